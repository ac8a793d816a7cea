//! The jailed process's side, between `clone3` and `execve`.
//!
//! It runs in a copy of a multi-threaded process, so it may only make system calls (and never
//! through a C library wrapper that coordinates threads, like `setresuid`'s): every
//! string, list and filter it needs is prepared by the parent in a [`Plan`] before the clone,
//! and nothing here allocates, locks or unwinds. A failed step is written to the error pipe as
//! (step, errno) and the child exits; the parent turns that into a sentence.

use std::ffi::CString;
use std::os::fd::RawFd;

use libc::{c_char, c_int, c_ulong};

/// One bind mount of the jail's root.
pub(crate) struct BindPlan {
    pub src: CString,
    /// Path relative to the jail's root.
    pub dst: CString,
    /// Flags for the read-only (or flag-keeping) remount: the source mount's own `nosuid`,
    /// `nodev`, `noexec` and atime flags are locked in a user namespace and must be repeated.
    pub remount_flags: c_ulong,
}

/// Everything the child does, prepared by the parent.
pub(crate) struct Plan {
    /// The jail's root is built on this (empty) directory; `None` keeps the host's mounts.
    pub staging: Option<CString>,
    /// Directories, files and links to make, relative to the jail's root.
    pub mkdirs: Vec<CString>,
    pub mkfiles: Vec<CString>,
    /// (target, link path).
    pub symlinks: Vec<(CString, CString)>,
    pub binds: Vec<BindPlan>,
    /// `/proc/sys/user/max_*_namespaces` of the new user namespace, set to 0: even without the
    /// seccomp filter the jailed process can make no namespace (a nested user namespace would
    /// give it capabilities over new mounts).
    pub ns_limits: Vec<CString>,
    /// Where to mount a `/proc` of the jail's own pid namespace (relative).
    pub proc_dir: Option<CString>,
    /// New namespaces: switch to uid/gid 0 of the namespace and drop the bounding set.
    pub namespaces: bool,
    /// `Some(list)`: set the supplementary groups (inside ids); `None`: keep the inherited ones.
    pub set_groups: Option<Vec<libc::gid_t>>,
    pub rlimits: Vec<(c_int, u64)>,
    /// Descriptors that become 0, 1, 2, ... in order.
    pub fds: Vec<RawFd>,
    /// The program, opened with `O_PATH`; `None` exits 0 once the jail is in place (a probe).
    pub exe: Option<RawFd>,
    pub argv_ptrs: Vec<*const c_char>,
    pub envp_ptrs: Vec<*const c_char>,
    /// seccomp programs, installed in order.
    pub filters: Vec<Vec<seccompiler::sock_filter>>,
    pub cap_last: c_int,
    /// The parent's go-ahead (one byte), then its lifeline: end of file means it died.
    pub sync_read: RawFd,
    /// (step, errno) on failure; closed by a successful exec.
    pub err_write: RawFd,
    /// The parent's ends of both pipes: closed first, so the lifeline can end.
    pub parent_ends: [RawFd; 2],
    /// Whether the process dies with the service (`PR_SET_PDEATHSIG`); not for one that
    /// outlives it ([`crate::Command::outlive`]).
    pub death_signal: bool,
}

/// The child's steps, in the order they first run; a failed one is reported by its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Step {
    WaitForService = 0,
    DeathSignal = 1,
    PrivateMounts = 2,
    MountRoot = 3,
    MakeDir = 4,
    MakeFile = 5,
    MakeLink = 6,
    BindMount = 7,
    RemountBind = 8,
    MountProc = 9,
    PivotRoot = 10,
    DetachHost = 11,
    ReadOnlyRoot = 12,
    SetGroups = 13,
    SetGid = 14,
    SetUid = 15,
    ServiceAlive = 16,
    ArrangeFds = 17,
    Rlimits = 18,
    SecureBits = 19,
    DropBoundingSet = 20,
    ClearAmbient = 21,
    DropCapabilities = 22,
    NoNewPrivs = 23,
    Seccomp = 24,
    Exec = 25,
    ResetSignals = 26,
    LimitNamespaces = 27,
}

impl Step {
    const ALL: [Step; 28] = [
        Step::WaitForService,
        Step::DeathSignal,
        Step::PrivateMounts,
        Step::MountRoot,
        Step::MakeDir,
        Step::MakeFile,
        Step::MakeLink,
        Step::BindMount,
        Step::RemountBind,
        Step::MountProc,
        Step::PivotRoot,
        Step::DetachHost,
        Step::ReadOnlyRoot,
        Step::SetGroups,
        Step::SetGid,
        Step::SetUid,
        Step::ServiceAlive,
        Step::ArrangeFds,
        Step::Rlimits,
        Step::SecureBits,
        Step::DropBoundingSet,
        Step::ClearAmbient,
        Step::DropCapabilities,
        Step::NoNewPrivs,
        Step::Seccomp,
        Step::Exec,
        Step::ResetSignals,
        Step::LimitNamespaces,
    ];

    /// The step a child reported, if it is one.
    pub(crate) fn from_number(n: u32) -> Option<Step> {
        Step::ALL.get(n as usize).copied()
    }

    /// The step in words, for the parent's error message.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Step::WaitForService => "waiting for the service",
            Step::DeathSignal => "asking for SIGKILL on the service's death",
            Step::PrivateMounts => "making the mounts private",
            Step::MountRoot => "mounting the jail's root",
            Step::MakeDir => "making a directory in the jail",
            Step::MakeFile => "making a file in the jail",
            Step::MakeLink => "making a link in the jail",
            Step::BindMount => "bind-mounting into the jail",
            Step::RemountBind => "remounting a bind mount read-only",
            Step::MountProc => "mounting /proc",
            Step::PivotRoot => "pivoting into the jail's root",
            Step::DetachHost => "detaching the host's mounts",
            Step::ReadOnlyRoot => "making the jail's root read-only",
            Step::SetGroups => "setting the groups",
            Step::SetGid => "switching to the jail's gid",
            Step::SetUid => "switching to the jail's uid",
            Step::ServiceAlive => "checking that the service lives",
            Step::ArrangeFds => "arranging the descriptors",
            Step::Rlimits => "setting the resource limits",
            Step::SecureBits => "locking the security bits",
            Step::DropBoundingSet => "dropping the capability bounding set",
            Step::ClearAmbient => "clearing the ambient capabilities",
            Step::DropCapabilities => "dropping the capabilities",
            Step::NoNewPrivs => "setting no_new_privs",
            Step::Seccomp => "installing the seccomp filter",
            Step::Exec => "executing the program",
            Step::ResetSignals => "resetting the signals",
            Step::LimitNamespaces => "limiting the namespaces the jail may make",
        }
    }
}

/// `Err(step)` when `failed`: each system call's check, with errno left as the call set it.
fn check(step: Step, failed: bool) -> Result<(), Step> {
    if failed { Err(step) } else { Ok(()) }
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Most bind mounts one jail takes.
pub(crate) const MAX_BINDS: usize = 64;
const OPEN_TREE_CLONE: u32 = 1;
const MOVE_MOUNT_F_EMPTY_PATH: u32 = 0x4;

/// `_LINUX_CAPABILITY_VERSION_3`.
const CAP_V3: u32 = 0x2008_0522;
/// NOROOT, NO_SETUID_FIXUP, NO_CAP_AMBIENT_RAISE and the locks of all four bits but KEEP_CAPS:
/// uid 0 in the jail never regains capabilities, by exec or otherwise.
const SECUREBITS: c_ulong = 0b1110_1111;

/// Runs the plan; never returns.
///
/// # Safety
/// Must be called only in the child of a `clone3` (or fork) of this process, with `plan`'s
/// descriptors and pointers valid there; it ends the process.
pub(crate) unsafe fn run(plan: &Plan) -> ! {
    // SAFETY: (every step) raw system calls on descriptors and NUL-terminated strings the
    // parent prepared; no allocation, no locks, no unwinding.
    unsafe {
        for fd in plan.parent_ends {
            libc::close(fd);
        }
        wait_for_service(plan);
        let mut trees = [-1 as RawFd; MAX_BINDS];
        let in_jail = arm_death_signal(plan)
            .and_then(|()| check(Step::ResetSignals, !reset_signals()))
            .and_then(|()| take_bind_sources(plan, &mut trees))
            .and_then(|()| become_root(plan))
            .and_then(|()| build_root(plan, &trees))
            .and_then(|()| arm_death_signal(plan))
            .and_then(|()| service_alive(plan));
        if let Err(step) = in_jail {
            fail(plan.err_write, step);
        }
        let (err, exe) = match arrange_fds(plan) {
            Ok(placed) => placed,
            Err((err, step)) => fail(err, step),
        };
        if let Err(step) = drop_privileges(plan) {
            fail(err, step);
        }
        match exe {
            Some(fd) => {
                libc::syscall(
                    libc::SYS_execveat,
                    fd,
                    c"".as_ptr(),
                    plan.argv_ptrs.as_ptr(),
                    plan.envp_ptrs.as_ptr(),
                    libc::AT_EMPTY_PATH,
                );
                fail(err, Step::Exec)
            }
            None => libc::_exit(0),
        }
    }
}

/// The parent places the child in its cgroup and writes its id maps, then sends one byte; an
/// end of file (the parent died) ends the child.
unsafe fn wait_for_service(plan: &Plan) {
    // SAFETY: a read of one byte into a local.
    unsafe {
        let mut b = 0u8;
        loop {
            let n = libc::read(plan.sync_read, (&raw mut b).cast(), 1);
            if n == 1 {
                return;
            }
            if n < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            }
            libc::_exit(126);
        }
    }
}

/// SIGKILL when the service dies, unless the process is to outlive it. Changing credentials
/// clears it: it is set again after.
unsafe fn arm_death_signal(plan: &Plan) -> Result<(), Step> {
    if !plan.death_signal {
        return Ok(());
    }
    // SAFETY: prctl with integer arguments.
    let r = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as c_ulong, 0, 0, 0) };
    check(Step::DeathSignal, r != 0)
}

/// Mounts happen in two halves around the switch to the jail's ids. Path lookups on the host
/// need the service's own ids (the state directory is not open to the jail's uid); creating
/// files in the new tmpfs needs ids mapped in the namespace. So: take each bind source as a
/// detached mount, limit the namespaces the jail may make, mount the new root's tmpfs and enter
/// it as the service; the rest is [`build_root`], once the ids are switched.
unsafe fn take_bind_sources(plan: &Plan, trees: &mut [RawFd; MAX_BINDS]) -> Result<(), Step> {
    let Some(staging) = &plan.staging else {
        return Ok(());
    };
    let none = std::ptr::null::<c_char>();
    // SAFETY: mount, open_tree, open, write and chdir with the parent's NUL-terminated strings.
    unsafe {
        check(Step::BindMount, plan.binds.len() > MAX_BINDS)?;
        check(
            Step::PrivateMounts,
            libc::mount(
                none,
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0,
        )?;
        for (i, bind) in plan.binds.iter().enumerate() {
            trees[i] = libc::syscall(
                libc::SYS_open_tree,
                libc::AT_FDCWD,
                bind.src.as_ptr(),
                OPEN_TREE_CLONE | libc::O_CLOEXEC as u32,
            ) as RawFd;
            check(Step::BindMount, trees[i] < 0)?;
        }
        for f in &plan.ns_limits {
            let fd = libc::open(f.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            check(Step::LimitNamespaces, fd < 0)?;
            let w = libc::write(fd, c"0".as_ptr().cast(), 1);
            libc::close(fd);
            check(Step::LimitNamespaces, w != 1)?;
        }
        check(
            Step::MountRoot,
            libc::mount(
                c"tmpfs".as_ptr(),
                staging.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                c"mode=0755,uid=0,gid=0,size=1m,nr_inodes=1024"
                    .as_ptr()
                    .cast(),
            ) != 0,
        )?;
        // Into the new tmpfs (the walk crosses the mount just made); all further paths are
        // relative to it.
        check(Step::PivotRoot, libc::chdir(staging.as_ptr()) != 0)
    }
}

/// In new namespaces, uid and gid 0 of the namespace (the jail's ids on the host), with the
/// planned supplementary groups.
unsafe fn become_root(plan: &Plan) -> Result<(), Step> {
    if !plan.namespaces {
        return Ok(());
    }
    // SAFETY: raw credential system calls with integer arguments and the parent's group list.
    // Raw: the C library's wrappers broadcast credential changes to every thread it knows of,
    // and in this copy of a multi-threaded process those threads do not exist (it would wait for
    // them forever).
    unsafe {
        if let Some(groups) = &plan.set_groups {
            check(
                Step::SetGroups,
                libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0,
            )?;
        }
        check(
            Step::SetGid,
            libc::syscall(libc::SYS_setresgid, 0, 0, 0) != 0,
        )?;
        check(
            Step::SetUid,
            libc::syscall(libc::SYS_setresuid, 0, 0, 0) != 0,
        )
    }
}

/// The jail's root: its directories, files and links, the bind mounts (remounted with their
/// flags), `/proc`, then the pivot into it and the host's mounts detached, read-only.
unsafe fn build_root(plan: &Plan, trees: &[RawFd; MAX_BINDS]) -> Result<(), Step> {
    if plan.staging.is_none() {
        return Ok(());
    }
    // SAFETY: each step makes file system calls on paths relative to the new root, with the
    // parent's strings and the detached trees taken before.
    unsafe {
        make_entries(plan)?;
        mount_binds(plan, trees)?;
        mount_proc(plan)?;
        pivot()
    }
}

/// The root's directories, empty files (bind targets) and links.
unsafe fn make_entries(plan: &Plan) -> Result<(), Step> {
    // SAFETY: mkdir, open, close and symlink on the parent's strings.
    unsafe {
        for d in &plan.mkdirs {
            check(
                Step::MakeDir,
                libc::mkdir(d.as_ptr(), 0o755) != 0 && *libc::__errno_location() != libc::EEXIST,
            )?;
        }
        for f in &plan.mkfiles {
            let fd = libc::open(
                f.as_ptr(),
                libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                0o600,
            );
            check(Step::MakeFile, fd < 0)?;
            libc::close(fd);
        }
        for (target, link) in &plan.symlinks {
            check(
                Step::MakeLink,
                libc::symlink(target.as_ptr(), link.as_ptr()) != 0,
            )?;
        }
    }
    Ok(())
}

/// Each detached tree moved onto its target, then remounted with its bind's flags.
unsafe fn mount_binds(plan: &Plan, trees: &[RawFd; MAX_BINDS]) -> Result<(), Step> {
    let none = std::ptr::null::<c_char>();
    // SAFETY: move_mount of trees the parent detached for us, mount on the parent's strings.
    unsafe {
        for (i, bind) in plan.binds.iter().enumerate() {
            check(
                Step::BindMount,
                libc::syscall(
                    libc::SYS_move_mount,
                    trees[i],
                    c"".as_ptr(),
                    libc::AT_FDCWD,
                    bind.dst.as_ptr(),
                    MOVE_MOUNT_F_EMPTY_PATH,
                ) != 0,
            )?;
            libc::close(trees[i]);
            check(
                Step::RemountBind,
                libc::mount(
                    none,
                    bind.dst.as_ptr(),
                    none,
                    libc::MS_REMOUNT | libc::MS_BIND | bind.remount_flags,
                    std::ptr::null(),
                ) != 0,
            )?;
        }
    }
    Ok(())
}

/// `/proc` of the process's own pid namespace, if the plan has one: no set-uid, devices or
/// programs, and only the processes (`subset=pid`).
unsafe fn mount_proc(plan: &Plan) -> Result<(), Step> {
    let Some(p) = &plan.proc_dir else {
        return Ok(());
    };
    // SAFETY: mount with static strings and the parent's path.
    unsafe {
        check(
            Step::MountProc,
            libc::mount(
                c"proc".as_ptr(),
                p.as_ptr(),
                c"proc".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                c"subset=pid".as_ptr().cast(),
            ) != 0,
        )
    }
}

/// Into the new root (the current directory), the host's mounts detached, the root read-only.
unsafe fn pivot() -> Result<(), Step> {
    let none = std::ptr::null::<c_char>();
    // SAFETY: pivot_root, umount2, mount, chroot and chdir with static strings.
    unsafe {
        if libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) == 0 {
            check(
                Step::DetachHost,
                libc::umount2(c".".as_ptr(), libc::MNT_DETACH) != 0,
            )?;
        } else {
            // The host's root is the initramfs (rootfs), which cannot be pivoted away from:
            // move the new root over it and chroot, as switch_root does. The host's mounts
            // stay beneath, unreachable without the capabilities dropped below.
            check(Step::PivotRoot, *libc::__errno_location() != libc::EINVAL)?;
            check(
                Step::PivotRoot,
                libc::mount(
                    c".".as_ptr(),
                    c"/".as_ptr(),
                    none,
                    libc::MS_MOVE,
                    std::ptr::null(),
                ) != 0,
            )?;
            check(Step::PivotRoot, libc::chroot(c".".as_ptr()) != 0)?;
        }
        check(Step::PivotRoot, libc::chdir(c"/".as_ptr()) != 0)?;
        check(
            Step::ReadOnlyRoot,
            libc::mount(
                none,
                c"/".as_ptr(),
                none,
                libc::MS_REMOUNT
                    | libc::MS_BIND
                    | libc::MS_RDONLY
                    | libc::MS_NOSUID
                    | libc::MS_NODEV,
                std::ptr::null(),
            ) != 0,
        )
    }
}

/// The parent did not die before the death signal was set again (its end of the sync pipe
/// would be closed, the pipe readable).
unsafe fn service_alive(plan: &Plan) -> Result<(), Step> {
    let mut pfd = libc::pollfd {
        fd: plan.sync_read,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll on one local pollfd, without waiting.
    check(
        Step::ServiceAlive,
        unsafe { libc::poll(&raw mut pfd, 1, 0) } != 0,
    )
}

/// The planned descriptors become 0, 1, 2, ... in order; the error pipe goes to n + 1 and the
/// program to n, both closed by exec; nothing else stays open. Returns where the error pipe and
/// the program are, or the error pipe to report a failure on with its step.
unsafe fn arrange_fds(plan: &Plan) -> Result<(RawFd, Option<RawFd>), (RawFd, Step)> {
    let fail_at = |err| move |step| (err, step);
    // SAFETY: fcntl, dup2, dup3, close and close_range on descriptors this process holds.
    unsafe {
        // Park every source above the targets, then put each in its place.
        let n = plan.fds.len() as c_int;
        let mut parked = [0 as RawFd; 32];
        let early = fail_at(plan.err_write);
        check(Step::ArrangeFds, plan.fds.len() > parked.len()).map_err(early)?;
        for (i, &fd) in plan.fds.iter().enumerate() {
            parked[i] = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, n + 2);
            check(Step::ArrangeFds, parked[i] < 0).map_err(early)?;
        }
        let exe = match plan.exe {
            Some(e) => {
                let p = libc::fcntl(e, libc::F_DUPFD_CLOEXEC, n + 2);
                check(Step::ArrangeFds, p < 0).map_err(early)?;
                Some(p)
            }
            None => None,
        };
        let err = libc::fcntl(plan.err_write, libc::F_DUPFD_CLOEXEC, n + 2);
        check(Step::ArrangeFds, err < 0).map_err(early)?;
        for (i, &p) in parked.iter().enumerate().take(plan.fds.len()) {
            check(Step::ArrangeFds, libc::dup2(p, i as c_int) < 0).map_err(early)?;
        }
        if err != n + 1 {
            check(
                Step::ArrangeFds,
                libc::dup3(err, n + 1, libc::O_CLOEXEC) < 0,
            )
            .map_err(early)?;
        }
        let err = n + 1;
        let exe = match exe {
            Some(e) if e != n => {
                check(Step::ArrangeFds, libc::dup3(e, n, libc::O_CLOEXEC) < 0)
                    .map_err(fail_at(err))?;
                Some(n)
            }
            other => other,
        };
        if libc::syscall(libc::SYS_close_range, (n + 2) as u32, u32::MAX, 0) != 0 {
            // Kernels before 5.9: close one by one up to the descriptor limit.
            for fd in (n + 2)..65_536 {
                libc::close(fd);
            }
        }
        if exe.is_none() {
            libc::close(n);
        }
        Ok((err, exe))
    }
}

/// The resource limits, then every privilege gone: the security bits locked and the bounding
/// set dropped (in new namespaces), no ambient, permitted or effective capabilities,
/// no_new_privs, and the seccomp filters.
unsafe fn drop_privileges(plan: &Plan) -> Result<(), Step> {
    // SAFETY: setrlimit, prctl and capset with local values and the parent's filters.
    unsafe {
        for &(res, value) in &plan.rlimits {
            let lim = libc::rlimit {
                rlim_cur: value,
                rlim_max: value,
            };
            check(
                Step::Rlimits,
                libc::setrlimit(res as _, &raw const lim) != 0,
            )?;
        }
        if plan.namespaces {
            check(
                Step::SecureBits,
                libc::prctl(libc::PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0) != 0,
            )?;
            for cap in 0..=plan.cap_last {
                check(
                    Step::DropBoundingSet,
                    libc::prctl(libc::PR_CAPBSET_DROP, cap as c_ulong, 0, 0, 0) != 0,
                )?;
            }
        }
        check(
            Step::ClearAmbient,
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL as c_ulong,
                0,
                0,
                0,
            ) != 0,
        )?;
        let mut hdr = CapHeader {
            version: CAP_V3,
            pid: 0,
        };
        let data = [CapData {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        }; 2];
        check(
            Step::DropCapabilities,
            libc::syscall(libc::SYS_capset, &raw mut hdr, data.as_ptr()) != 0,
        )?;
        check(
            Step::NoNewPrivs,
            libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as c_ulong, 0, 0, 0) != 0,
        )?;
        for f in &plan.filters {
            let prog = libc::sock_fprog {
                len: f.len() as u16,
                filter: f.as_ptr() as *mut libc::sock_filter,
            };
            check(
                Step::Seccomp,
                libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER as c_ulong,
                    &raw const prog as c_ulong,
                    0,
                    0,
                ) != 0,
            )?;
        }
        Ok(())
    }
}

/// Default dispositions and an empty mask: what a freshly executed program expects (Rust
/// ignores SIGPIPE; the runtime's threads may block signals).
unsafe fn reset_signals() -> bool {
    // SAFETY: sigset and sigaction calls on local values.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&raw mut set);
        if libc::pthread_sigmask(libc::SIG_SETMASK, &raw const set, std::ptr::null_mut()) != 0 {
            return false;
        }
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        true
    }
}

/// Reports (step, errno) and exits.
fn fail(err_fd: RawFd, step: Step) -> ! {
    // SAFETY: errno read, a write of a local buffer, and _exit.
    unsafe {
        let errno = *libc::__errno_location();
        let mut msg = [0u8; 8];
        msg[..4].copy_from_slice(&(step as u32).to_ne_bytes());
        msg[4..].copy_from_slice(&errno.to_ne_bytes());
        libc::write(err_fd, msg.as_ptr().cast(), msg.len());
        libc::_exit(127)
    }
}

#[cfg(test)]
mod tests {
    use super::Step;

    /// The number a child writes is the step the parent names: every step's number finds it.
    #[test]
    fn each_step_is_found_by_its_number() {
        for (i, s) in Step::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i, "{s:?} out of place in Step::ALL");
            assert_eq!(Step::from_number(i as u32), Some(*s));
        }
        assert_eq!(Step::from_number(Step::ALL.len() as u32), None);
        assert_eq!(
            Step::from_number(7).map(Step::describe),
            Some("bind-mounting into the jail")
        );
    }
}
