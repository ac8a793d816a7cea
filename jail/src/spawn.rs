//! The parent's side of starting a jailed process: prepare the plan, `clone3` into new
//! namespaces, place the child in its cgroup and write its id maps, let it go, and learn whether
//! its `execve` succeeded.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use thiserror::Error;

use crate::cgroup::{CgroupError, Leaf};
use crate::child::{BindPlan, Plan, Step};
use crate::ids::{IdError, IdLease, IdMode};
use crate::spec::{Command, Exit, Root};

/// Why a jailed process could not be started.
#[derive(Debug, Error)]
pub enum SpawnError {
    /// No id pair was free.
    #[error(transparent)]
    Ids(#[from] IdError),
    /// The VM's cgroup could not be made or joined.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// Preparing the jail failed on the host.
    #[error("preparing the jail: {what}: {source}")]
    Prepare {
        /// What was being done.
        what: String,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// The id maps could not be written.
    #[error("writing the jail's id maps: {0}")]
    Maps(String),
    /// A step in the new process failed.
    #[error("the jail could not be applied ({step}): {source}")]
    Child {
        /// The step, in words.
        step: &'static str,
        /// Its errno.
        #[source]
        source: std::io::Error,
    },
    /// The spec is unusable.
    #[error("invalid jail: {0}")]
    Invalid(String),
}

fn prep(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SpawnError {
    let what = what.into();
    move |source| SpawnError::Prepare { what, source }
}

/// A running jailed process.
pub struct Jailed {
    pid: u32,
    pidfd: OwnedFd,
    lease: Option<IdLease>,
    leaf: Option<Leaf>,
    /// The write end of the sync pipe: the child's lifeline until it is in its program (none
    /// for an adopted process).
    lifeline: Option<OwnedFd>,
    /// Whether it is this process's child (else adopted after a restart: its end is seen on
    /// its pidfd, and its status went to whoever reaped it).
    child: bool,
    /// Whether it runs under its lease's ids (in namespaces of its own), not the service's.
    mapped: bool,
    /// Its start time, read once while it is known to be this process (after its start, or
    /// as recorded when adopted): never read again by a pid that may have been reused.
    start_time: OnceLock<u64>,
    exit: OnceLock<Exit>,
    async_fd: OnceLock<tokio::io::unix::AsyncFd<OwnedFd>>,
}

impl std::fmt::Debug for Jailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jailed")
            .field("pid", &self.pid)
            .field("uid", &self.uid())
            .finish()
    }
}

impl Jailed {
    /// Its pid on the host.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its uid on the host.
    pub fn uid(&self) -> Option<u32> {
        self.lease.as_ref().map(|l| l.uid)
    }

    /// Its cgroup, if it has one.
    pub fn cgroup(&self) -> Option<&Leaf> {
        self.leaf.as_ref()
    }

    /// What finds this same process again after a restart of the service; `None` once it has
    /// ended, or when its start time could not be read.
    pub fn identity(&self) -> Option<crate::Identity> {
        if self.exit.get().is_some() {
            return None;
        }
        Some(crate::Identity {
            pid: self.pid,
            start_time: *self.start_time.get()?,
            uid: self.lease.as_ref().filter(|_| self.mapped).map(|l| l.uid),
            cgroup: self
                .leaf
                .as_ref()
                .map(|l| l.dirs().to_vec())
                .unwrap_or_default(),
        })
    }

    /// An adopted process: found again by [`crate::Jailer::adopt`].
    pub(crate) fn adopted(
        identity: &crate::Identity,
        pidfd: OwnedFd,
        lease: Option<IdLease>,
        leaf: Option<Leaf>,
    ) -> Jailed {
        Jailed {
            pid: identity.pid,
            pidfd,
            start_time: OnceLock::from(identity.start_time),
            mapped: lease.is_some(),
            lease,
            leaf,
            lifeline: None,
            child: false,
            exit: OnceLock::new(),
            async_fd: OnceLock::new(),
        }
    }

    /// Sends `sig` through the pidfd (never to a recycled pid).
    pub fn signal(&self, sig: i32) {
        if self.exit.get().is_some() {
            return;
        }
        // SAFETY: pidfd_send_signal on our own pidfd with no siginfo.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                sig,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
    }

    /// The exit, if the process has ended (and reaps it).
    pub fn try_wait(&self) -> Option<Exit> {
        if let Some(e) = self.exit.get() {
            return Some(*e);
        }
        if !self.child {
            return crate::adopt::ended(&self.pidfd, 0).then(|| self.finish(0, false));
        }
        let status = waitid(&self.pidfd, libc::WNOHANG)?;
        Some(self.finish(status, true))
    }

    /// Waits for the end of the process (needs a tokio runtime).
    pub async fn wait(&self) -> Exit {
        loop {
            if let Some(e) = self.try_wait() {
                return e;
            }
            let afd = match self.async_fd.get() {
                Some(a) => a,
                None => {
                    let registered = self.pidfd.try_clone().ok().and_then(|fd| {
                        // SAFETY: the AsyncFd owns this duplicate, which stays open and the
                        // same for its whole life.
                        unsafe {
                            tokio::io::unix::AsyncFd::register_with_interest(
                                fd,
                                tokio::io::Interest::READABLE,
                            )
                        }
                        .ok()
                    });
                    match registered {
                        Some(a) => {
                            let _ = self.async_fd.set(a);
                            self.async_fd.get().expect("just set")
                        }
                        None => {
                            // No reactor for it: poll slowly rather than never.
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        }
                    }
                }
            };
            if let Ok(mut g) = afd.readable().await {
                g.clear_ready();
            }
        }
    }

    fn finish(&self, status: i32, known: bool) -> Exit {
        let oom_kills = self.leaf.as_ref().map_or(0, Leaf::oom_kills);
        if let Some(leaf) = &self.leaf {
            leaf.remove();
        }
        let e = Exit {
            status,
            oom_kills,
            known,
        };
        let _ = self.exit.set(e);
        *self.exit.get().unwrap_or(&e)
    }
}

impl Drop for Jailed {
    fn drop(&mut self) {
        if self.exit.get().is_some() {
            return;
        }
        self.signal(libc::SIGKILL);
        // Reap it and free its ids and cgroup once it is gone, off the caller's thread.
        let pidfd = match self.pidfd.try_clone() {
            Ok(p) => p,
            Err(_) => return,
        };
        let lease = self.lease.take();
        let leaf = self.leaf.take();
        let child = self.child;
        std::thread::spawn(move || {
            if child {
                let _ = waitid(&pidfd, 0);
            } else {
                // Not ours to reap: its end shows on the pidfd. SIGKILL was sent; a process
                // stuck in the kernel gets a bound.
                crate::adopt::ended(&pidfd, 10_000);
            }
            if let Some(l) = leaf {
                l.remove();
            }
            drop(lease);
        });
    }
}

fn waitid(pidfd: &OwnedFd, flags: i32) -> Option<i32> {
    // SAFETY: waitid into a zeroed siginfo we own.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let r = libc::waitid(
            libc::P_PIDFD,
            pidfd.as_raw_fd() as libc::id_t,
            &raw mut info,
            libc::WEXITED | flags,
        );
        if r != 0 || info.si_pid() == 0 {
            return None;
        }
        let status = info.si_status();
        Some(match info.si_code {
            libc::CLD_EXITED => (status & 0xff) << 8,
            libc::CLD_DUMPED => (status & 0x7f) | 0x80,
            _ => status & 0x7f,
        })
    }
}

/// How the jail is applied: the mode of the ids and the host's cgroups.
pub(crate) struct Host<'a> {
    pub namespaces: bool,
    pub ids: &'a IdMode,
    pub cgroups: Option<&'a crate::cgroup::Cgroups>,
    pub filters: &'a [seccompiler::BpfProgram],
    pub usr_links: &'a [(PathBuf, PathBuf)],
    pub system_dirs: &'a [PathBuf],
}

fn cstr(p: impl AsRef<std::ffi::OsStr>) -> Result<CString, SpawnError> {
    CString::new(p.as_ref().as_bytes())
        .map_err(|_| SpawnError::Invalid(format!("{:?} contains a NUL byte", p.as_ref())))
}

/// `inside` (absolute, plain) as a path relative to the jail's root.
fn under(inside: &Path) -> Result<PathBuf, SpawnError> {
    let rel = inside
        .strip_prefix("/")
        .map_err(|_| SpawnError::Invalid(format!("{} is not absolute", inside.display())))?;
    if rel
        .components()
        .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(SpawnError::Invalid(format!(
            "{} is not a plain path",
            inside.display()
        )));
    }
    Ok(rel.to_path_buf())
}

/// The flags of the mount holding `p`, in the form a bind remount must repeat.
fn mount_flags(p: &Path) -> Result<libc::c_ulong, SpawnError> {
    let c = cstr(p)?;
    // SAFETY: statvfs into a zeroed struct we own, with a valid path.
    let st = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &raw mut st) != 0 {
            return Err(prep(format!("reading the mount of {}", p.display()))(
                std::io::Error::last_os_error(),
            ));
        }
        st
    };
    let mut f = 0;
    for (st_flag, ms_flag) in [
        (libc::ST_NOSUID, libc::MS_NOSUID),
        (libc::ST_NODEV, libc::MS_NODEV),
        (libc::ST_NOEXEC, libc::MS_NOEXEC),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
        (libc::ST_RDONLY, libc::MS_RDONLY),
    ] {
        if st.f_flag & st_flag != 0 {
            f |= ms_flag;
        }
    }
    Ok(f)
}

fn plan_root(root: &Root, host: &Host<'_>, plan: &mut Plan) -> Result<(), SpawnError> {
    let staging = &root.staging;
    let empty = std::fs::read_dir(staging)
        .map_err(prep(format!("reading {}", staging.display())))?
        .next()
        .is_none();
    if !empty {
        return Err(SpawnError::Invalid(format!(
            "{} is not empty",
            staging.display()
        )));
    }
    plan.staging = Some(cstr(staging)?);
    let mut dirs: Vec<PathBuf> = vec![];
    let need_dir = |p: &Path, dirs: &mut Vec<PathBuf>| {
        for a in p.ancestors().collect::<Vec<_>>().into_iter().rev() {
            if !a.as_os_str().is_empty() && !dirs.iter().any(|d| d == a) {
                dirs.push(a.to_path_buf());
            }
        }
    };
    let mut binds: Vec<(PathBuf, PathBuf, bool, bool)> = vec![];
    if root.system {
        binds.push(("/usr".into(), "/usr".into(), false, false));
        for (link, target) in host.usr_links {
            plan.symlinks.push((cstr(target)?, cstr(under(link)?)?));
        }
        for d in host.system_dirs {
            binds.push((d.clone(), d.clone(), false, false));
        }
        for d in ["/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"] {
            binds.push((d.into(), d.into(), true, true));
        }
    }
    for d in &root.devices {
        binds.push((d.clone(), d.clone(), true, true));
    }
    for b in &root.binds {
        binds.push((b.src.clone(), b.dst.clone(), b.writable, false));
    }
    if binds.len() > crate::child::MAX_BINDS {
        return Err(SpawnError::Invalid(format!(
            "{} bind mounts (at most {})",
            binds.len(),
            crate::child::MAX_BINDS
        )));
    }
    let mut files = vec![];
    for (src, dst, writable, _dev) in &binds {
        let meta = std::fs::metadata(src).map_err(prep(format!("reading {}", src.display())))?;
        let target = under(dst)?;
        if let Some(parent) = target.parent() {
            need_dir(parent, &mut dirs);
        }
        if meta.is_dir() {
            need_dir(&target, &mut dirs);
        } else {
            files.push(cstr(&target)?);
        }
        let mut flags = mount_flags(src)?;
        if !writable {
            flags |= libc::MS_RDONLY;
        }
        // Set-uid programs never elevate anything in here.
        flags |= libc::MS_NOSUID;
        plan.binds.push(BindPlan {
            src: cstr(src)?,
            dst: cstr(&target)?,
            remount_flags: flags,
        });
    }
    if root.proc {
        let p = PathBuf::from("proc");
        need_dir(&p, &mut dirs);
        plan.proc_dir = Some(cstr(&p)?);
    }
    plan.ns_limits = std::fs::read_dir("/proc/sys/user")
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    let n = e.file_name();
                    let n = n.to_string_lossy();
                    n.starts_with("max_") && n.ends_with("_namespaces")
                })
                .filter_map(|e| cstr(e.path()).ok())
                .collect()
        })
        .unwrap_or_default();
    plan.mkdirs = dirs.iter().map(cstr).collect::<Result<_, _>>()?;
    plan.mkfiles = files;
    Ok(())
}

/// Clone flags: every namespace but the time namespace.
const NAMESPACES: u64 = (libc::CLONE_NEWUSER
    | libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWCGROUP) as u64;

#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

fn pipe() -> Result<(OwnedFd, OwnedFd), SpawnError> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into our array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(prep("making a pipe")(std::io::Error::last_os_error()));
    }
    // SAFETY: both descriptors are new and ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn cap_last() -> libc::c_int {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// Starts `cmd` in a jail. Must run on a thread that outlives the process (the parent-death
/// signal follows the thread that cloned).
pub(crate) fn spawn(cmd: Command, lease: IdLease, host: &Host<'_>) -> Result<Jailed, SpawnError> {
    if cmd.fds.len() > 32 {
        return Err(SpawnError::Invalid("more than 32 descriptors".into()));
    }
    let (sync_read, sync_write) = pipe()?;
    let (err_read, err_write) = pipe()?;
    let exe = open_program(&cmd)?;
    // Everything the child reads is made here (it may not allocate): the strings `argv_ptrs`
    // points into live until the clone has returned.
    let argv = argv(&cmd)?;
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut plan = new_plan(&cmd, host, argv_ptrs);
    plan.exe = exe.as_ref().map(AsRawFd::as_raw_fd);
    plan.sync_read = sync_read.as_raw_fd();
    plan.err_write = err_write.as_raw_fd();
    plan.parent_ends = [sync_write.as_raw_fd(), err_read.as_raw_fd()];
    if let Some(root) = &cmd.root {
        plan_root(root, host, &mut plan)?;
    }
    let leaf = match host.cgroups {
        Some(c) => Some(c.create(&cmd.name, &cmd.limits)?),
        None => None,
    };
    let (pid, pidfd) = match clone_into_jail(&plan, host.namespaces, cmd.host_network) {
        Ok(child) => child,
        Err(e) => {
            if let Some(l) = leaf {
                l.remove();
            }
            return Err(e);
        }
    };
    drop(sync_read);
    drop(err_write);
    let jailed = Jailed {
        pid,
        pidfd,
        lease: Some(lease),
        leaf,
        lifeline: Some(sync_write),
        child: true,
        mapped: host.namespaces,
        start_time: OnceLock::new(),
        exit: OnceLock::new(),
        async_fd: OnceLock::new(),
    };
    // From here on, dropping `jailed` kills and reaps the child.
    if let Some(l) = &jailed.leaf {
        l.add(pid)?;
    }
    if host.namespaces {
        let lease = jailed.lease.as_ref().expect("set above");
        write_maps(pid, lease, &cmd.keep_groups, host.ids)?;
    }
    let jailed = release(jailed, &err_read)?;
    drop(exe);
    // Our child, not yet reaped: its pid is its own while we read.
    if let Ok(t) = crate::adopt::start_time(pid) {
        let _ = jailed.start_time.set(t);
    }
    Ok(jailed)
}

/// The program, opened here as `O_PATH` for the child's `execveat`: the jail's empty root has
/// no path to it.
fn open_program(cmd: &Command) -> Result<Option<OwnedFd>, SpawnError> {
    let Some(p) = &cmd.program else {
        return Ok(None);
    };
    let c = cstr(p)?;
    // SAFETY: open with a valid path; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(prep(format!("opening {}", p.display()))(
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: a new descriptor we own.
    Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The program's arguments, its file name first.
fn argv(cmd: &Command) -> Result<Vec<CString>, SpawnError> {
    match &cmd.program {
        Some(p) => Ok(
            std::iter::once(cstr(p.file_name().unwrap_or(p.as_os_str()))?)
                .chain(cmd.args.iter().map(cstr).collect::<Result<Vec<_>, _>>()?)
                .collect(),
        ),
        None => Ok(vec![]),
    }
}

/// What the child does, except its root and the descriptors of its start (set by the caller).
fn new_plan(cmd: &Command, host: &Host<'_>, argv_ptrs: Vec<*const libc::c_char>) -> Plan {
    let keep_groups = !cmd.keep_groups.is_empty();
    let mut rlimits = vec![
        (libc::RLIMIT_CORE as libc::c_int, 0),
        (libc::RLIMIT_NOFILE as libc::c_int, cmd.nofile),
        (libc::RLIMIT_NPROC as libc::c_int, cmd.limits.pids),
    ];
    if let Some(size) = cmd.fsize {
        rlimits.push((libc::RLIMIT_FSIZE as libc::c_int, size));
    }
    Plan {
        staging: None,
        mkdirs: vec![],
        mkfiles: vec![],
        symlinks: vec![],
        binds: vec![],
        proc_dir: None,
        ns_limits: vec![],
        namespaces: host.namespaces,
        set_groups: match host.ids {
            IdMode::Root => Some((1..=cmd.keep_groups.len() as u32).collect()),
            IdMode::Subordinate { .. } if !keep_groups => Some(vec![]),
            // newgidmap cannot map the service's own groups, and a shared map forbids setgroups:
            // the inherited groups stay (the operator guide asks for no group but `kvm`).
            _ => None,
        },
        rlimits,
        fds: cmd.fds.iter().map(AsRawFd::as_raw_fd).collect(),
        exe: None,
        argv_ptrs,
        envp_ptrs: vec![std::ptr::null()],
        filters: if cmd.seccomp {
            host.filters.to_vec()
        } else {
            vec![]
        },
        cap_last: cap_last(),
        sync_read: -1,
        err_write: -1,
        parent_ends: [-1, -1],
        death_signal: !cmd.outlive,
    }
}

/// `clone3` into new namespaces (all of them, but the network's when the process keeps the
/// host's); the child runs `plan` and waits on its sync pipe. The child's pid and pidfd.
fn clone_into_jail(
    plan: &Plan,
    namespaces: bool,
    host_network: bool,
) -> Result<(u32, OwnedFd), SpawnError> {
    let mut pidfd: RawFd = -1;
    let args = CloneArgs {
        flags: match (namespaces, host_network) {
            (false, _) => 0,
            (true, false) => NAMESPACES,
            (true, true) => NAMESPACES & !(libc::CLONE_NEWNET as u64),
        } | libc::CLONE_PIDFD as u64,
        pidfd: (&raw mut pidfd) as u64,
        exit_signal: libc::SIGCHLD as u64,
        ..Default::default()
    };
    // SAFETY: clone3 without CLONE_VM: the child runs on a copy of this stack, like fork, and
    // only runs `child::run`, which makes system calls and ends in exec or _exit.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &raw const args,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if pid == 0 {
        // SAFETY: we are the child of the clone above.
        unsafe { crate::child::run(plan) }
    }
    if pid < 0 {
        return Err(prep(
            "starting the jailed process (clone3 with new namespaces)",
        )(std::io::Error::last_os_error()));
    }
    // SAFETY: CLONE_PIDFD wrote a new descriptor we own.
    Ok((pid as u32, unsafe { OwnedFd::from_raw_fd(pidfd) }))
}

/// Lets the child go on (one byte on its sync pipe) and learns whether its `execve`
/// succeeded: the error pipe closes on exec (or _exit), and 8 bytes on it mean a step failed.
fn release(jailed: Jailed, err_read: &OwnedFd) -> Result<Jailed, SpawnError> {
    let lifeline = jailed.lifeline.as_ref().map_or(-1, AsRawFd::as_raw_fd);
    // SAFETY: a one-byte write to our pipe.
    if unsafe { libc::write(lifeline, [1u8].as_ptr().cast(), 1) } != 1 {
        return Err(prep("releasing the jailed process")(
            std::io::Error::last_os_error(),
        ));
    }
    let mut msg = [0u8; 8];
    let n = read_bounded(err_read, &mut msg, Duration::from_secs(10))
        .map_err(prep("waiting for the jailed process to start"))?;
    if n == 8 {
        let step = u32::from_ne_bytes(msg[..4].try_into().expect("4 bytes"));
        let errno = i32::from_ne_bytes(msg[4..].try_into().expect("4 bytes"));
        // Reap it now, so its ids and cgroup are free when we return.
        let _ = waitid(&jailed.pidfd, 0);
        let _ = jailed.finish(0, true);
        return Err(SpawnError::Child {
            step: Step::from_number(step).map_or("an unknown step", Step::describe),
            source: std::io::Error::from_raw_os_error(errno),
        });
    }
    Ok(jailed)
}

/// Reads until `buf` is full, end of file, or `timeout` (an error).
fn read_bounded(fd: &OwnedFd, buf: &mut [u8], timeout: Duration) -> std::io::Result<usize> {
    let deadline = std::time::Instant::now() + timeout;
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {timeout:?}"),
            ));
        }
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one pollfd we own.
        let r = unsafe { libc::poll(&raw mut p, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            continue;
        }
        // SAFETY: read into the unfilled part of our buffer.
        let n = unsafe {
            libc::read(
                fd.as_raw_fd(),
                buf[got..].as_mut_ptr().cast(),
                buf.len() - got,
            )
        };
        match n {
            0 => break,
            n if n < 0 => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            n => got += n as usize,
        }
    }
    Ok(got)
}

/// Maps the child's uid 0 and gid 0 to the lease's ids (and, as root, inside gids 1.. to the
/// groups it keeps).
fn write_maps(
    pid: u32,
    lease: &IdLease,
    keep_groups: &[u32],
    mode: &IdMode,
) -> Result<(), SpawnError> {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    match mode {
        IdMode::Root => {
            std::fs::write(proc.join("uid_map"), format!("0 {} 1\n", lease.uid))
                .map_err(|e| SpawnError::Maps(format!("uid_map: {e}")))?;
            let mut gid_map = format!("0 {} 1\n", lease.gid);
            for (i, g) in keep_groups.iter().enumerate() {
                gid_map.push_str(&format!("{} {g} 1\n", i + 1));
            }
            std::fs::write(proc.join("gid_map"), gid_map)
                .map_err(|e| SpawnError::Maps(format!("gid_map: {e}")))?;
        }
        IdMode::Subordinate {
            newuidmap,
            newgidmap,
        } => {
            for (prog, id) in [(newuidmap, lease.uid), (newgidmap, lease.gid)] {
                let out = std::process::Command::new(prog)
                    .args([pid.to_string(), "0".into(), id.to_string(), "1".into()])
                    .stdin(std::process::Stdio::null())
                    .output()
                    .map_err(|e| SpawnError::Maps(format!("running {}: {e}", prog.display())))?;
                if !out.status.success() {
                    return Err(SpawnError::Maps(format!(
                        "{} failed ({}): {}",
                        prog.display(),
                        out.status,
                        String::from_utf8_lossy(&out.stderr).trim()
                    )));
                }
            }
        }
        IdMode::Shared => {
            std::fs::write(proc.join("setgroups"), "deny")
                .map_err(|e| SpawnError::Maps(format!("setgroups: {e}")))?;
            std::fs::write(proc.join("uid_map"), format!("0 {} 1\n", lease.uid))
                .map_err(|e| SpawnError::Maps(format!("uid_map: {e}")))?;
            std::fs::write(proc.join("gid_map"), format!("0 {} 1\n", lease.gid))
                .map_err(|e| SpawnError::Maps(format!("gid_map: {e}")))?;
        }
    }
    Ok(())
}
