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
}

/// The steps, for the parent's error message.
pub(crate) const STEPS: &[&str] = &[
    "waiting for the service",
    "asking for SIGKILL on the service's death",
    "making the mounts private",
    "mounting the jail's root",
    "making a directory in the jail",
    "making a file in the jail",
    "making a link in the jail",
    "bind-mounting into the jail",
    "remounting a bind mount read-only",
    "mounting /proc",
    "pivoting into the jail's root",
    "detaching the host's mounts",
    "making the jail's root read-only",
    "setting the groups",
    "switching to the jail's gid",
    "switching to the jail's uid",
    "checking that the service lives",
    "arranging the descriptors",
    "setting the resource limits",
    "locking the security bits",
    "dropping the capability bounding set",
    "clearing the ambient capabilities",
    "dropping the capabilities",
    "setting no_new_privs",
    "installing the seccomp filter",
    "executing the program",
    "resetting the signals",
    "limiting the namespaces the jail may make",
];

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
    #[allow(unused_assignments)]
    let mut step = 0usize;
    macro_rules! check {
        ($s:expr, $e:expr) => {{
            step = $s;
            if $e {
                fail(plan.err_write, step);
            }
        }};
    }
    // SAFETY: (the whole block) raw system calls on descriptors and NUL-terminated strings the
    // parent prepared; no allocation, no locks, no unwinding.
    unsafe {
        for fd in plan.parent_ends {
            libc::close(fd);
        }
        // 0: the parent places us in our cgroup and writes our id maps, then sends one byte.
        let mut b = 0u8;
        loop {
            let n = libc::read(plan.sync_read, (&raw mut b).cast(), 1);
            if n == 1 {
                break;
            }
            if n < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            }
            libc::_exit(126);
        }
        check!(
            1,
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as c_ulong, 0, 0, 0) != 0
        );
        check!(26, !reset_signals());

        // Mounts happen in two halves around the switch to the jail's ids. Path lookups on the
        // host need the service's own ids (the state directory is not open to the jail's uid);
        // creating files in the new tmpfs needs ids mapped in the namespace. So: take each bind
        // source as a detached mount and enter the new root as the service, then switch.
        let none = std::ptr::null::<c_char>();
        let mut trees = [-1 as RawFd; MAX_BINDS];
        if let Some(staging) = &plan.staging {
            check!(7, plan.binds.len() > MAX_BINDS);
            check!(
                2,
                libc::mount(
                    none,
                    c"/".as_ptr(),
                    none,
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null()
                ) != 0
            );
            for (i, bind) in plan.binds.iter().enumerate() {
                trees[i] = libc::syscall(
                    libc::SYS_open_tree,
                    libc::AT_FDCWD,
                    bind.src.as_ptr(),
                    OPEN_TREE_CLONE | libc::O_CLOEXEC as u32,
                ) as RawFd;
                check!(7, trees[i] < 0);
            }
            for f in &plan.ns_limits {
                let fd = libc::open(f.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                check!(27, fd < 0);
                let w = libc::write(fd, c"0".as_ptr().cast(), 1);
                libc::close(fd);
                check!(27, w != 1);
            }
            check!(
                3,
                libc::mount(
                    c"tmpfs".as_ptr(),
                    staging.as_ptr(),
                    c"tmpfs".as_ptr(),
                    libc::MS_NOSUID | libc::MS_NODEV,
                    c"mode=0755,uid=0,gid=0,size=1m,nr_inodes=1024"
                        .as_ptr()
                        .cast(),
                ) != 0
            );
            // Into the new tmpfs (the walk crosses the mount just made); all further paths are
            // relative to it.
            check!(10, libc::chdir(staging.as_ptr()) != 0);
        }

        if plan.namespaces {
            if let Some(groups) = &plan.set_groups {
                check!(
                    13,
                    libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0
                );
            }
            // Raw system calls: the C library's wrappers broadcast credential changes to every
            // thread it knows of, and in this copy of a multi-threaded process those threads do
            // not exist (it would wait for them forever).
            check!(14, libc::syscall(libc::SYS_setresgid, 0, 0, 0) != 0);
            check!(15, libc::syscall(libc::SYS_setresuid, 0, 0, 0) != 0);
        }

        if plan.staging.is_some() {
            for d in &plan.mkdirs {
                check!(
                    4,
                    libc::mkdir(d.as_ptr(), 0o755) != 0
                        && *libc::__errno_location() != libc::EEXIST
                );
            }
            for f in &plan.mkfiles {
                let fd = libc::open(
                    f.as_ptr(),
                    libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                    0o600,
                );
                check!(5, fd < 0);
                libc::close(fd);
            }
            for (target, link) in &plan.symlinks {
                check!(6, libc::symlink(target.as_ptr(), link.as_ptr()) != 0);
            }
            for (i, bind) in plan.binds.iter().enumerate() {
                check!(
                    7,
                    libc::syscall(
                        libc::SYS_move_mount,
                        trees[i],
                        c"".as_ptr(),
                        libc::AT_FDCWD,
                        bind.dst.as_ptr(),
                        MOVE_MOUNT_F_EMPTY_PATH,
                    ) != 0
                );
                libc::close(trees[i]);
                check!(
                    8,
                    libc::mount(
                        none,
                        bind.dst.as_ptr(),
                        none,
                        libc::MS_REMOUNT | libc::MS_BIND | bind.remount_flags,
                        std::ptr::null()
                    ) != 0
                );
            }
            if let Some(p) = &plan.proc_dir {
                check!(
                    9,
                    libc::mount(
                        c"proc".as_ptr(),
                        p.as_ptr(),
                        c"proc".as_ptr(),
                        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                        c"subset=pid".as_ptr().cast(),
                    ) != 0
                );
            }
            if libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) == 0 {
                check!(11, libc::umount2(c".".as_ptr(), libc::MNT_DETACH) != 0);
            } else {
                // The host's root is the initramfs (rootfs), which cannot be pivoted away from:
                // move the new root over it and chroot, as switch_root does. The host's mounts
                // stay beneath, unreachable without the capabilities dropped below.
                check!(10, *libc::__errno_location() != libc::EINVAL);
                check!(
                    10,
                    libc::mount(
                        c".".as_ptr(),
                        c"/".as_ptr(),
                        none,
                        libc::MS_MOVE,
                        std::ptr::null()
                    ) != 0
                );
                check!(10, libc::chroot(c".".as_ptr()) != 0);
            }
            check!(10, libc::chdir(c"/".as_ptr()) != 0);
            check!(
                12,
                libc::mount(
                    none,
                    c"/".as_ptr(),
                    none,
                    libc::MS_REMOUNT
                        | libc::MS_BIND
                        | libc::MS_RDONLY
                        | libc::MS_NOSUID
                        | libc::MS_NODEV,
                    std::ptr::null()
                ) != 0
            );
        }

        // Changing credentials cleared the parent-death signal: set it again, then make sure the
        // parent did not die before it was set (its end of the sync pipe would be closed).
        check!(
            1,
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as c_ulong, 0, 0, 0) != 0
        );
        let mut pfd = libc::pollfd {
            fd: plan.sync_read,
            events: libc::POLLIN,
            revents: 0,
        };
        check!(16, libc::poll(&raw mut pfd, 1, 0) != 0);

        // Descriptors: park every source above the targets, then put each in its place.
        let n = plan.fds.len() as c_int;
        let mut parked = [0 as RawFd; 32];
        check!(17, plan.fds.len() > parked.len());
        for (i, &fd) in plan.fds.iter().enumerate() {
            parked[i] = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, n + 2);
            check!(17, parked[i] < 0);
        }
        let exe = match plan.exe {
            Some(e) => {
                let p = libc::fcntl(e, libc::F_DUPFD_CLOEXEC, n + 2);
                check!(17, p < 0);
                Some(p)
            }
            None => None,
        };
        let err = libc::fcntl(plan.err_write, libc::F_DUPFD_CLOEXEC, n + 2);
        check!(17, err < 0);
        for (i, &p) in parked.iter().enumerate().take(plan.fds.len()) {
            check!(17, libc::dup2(p, i as c_int) < 0);
        }
        // The error pipe at n + 1 and the program at n, both closed by exec; nothing else.
        if err != n + 1 {
            check!(17, libc::dup3(err, n + 1, libc::O_CLOEXEC) < 0);
        }
        let err = n + 1;
        let exe_fd = match exe {
            Some(e) if e != n => {
                let r = libc::dup3(e, n, libc::O_CLOEXEC);
                if r < 0 {
                    fail(err, 17);
                }
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
        if exe_fd.is_none() {
            libc::close(n);
        }

        macro_rules! check_err {
            ($s:expr, $e:expr) => {{
                if $e {
                    fail(err, $s);
                }
            }};
        }
        for &(res, value) in &plan.rlimits {
            let lim = libc::rlimit {
                rlim_cur: value,
                rlim_max: value,
            };
            check_err!(18, libc::setrlimit(res as _, &raw const lim) != 0);
        }
        if plan.namespaces {
            check_err!(
                19,
                libc::prctl(libc::PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0) != 0
            );
            for cap in 0..=plan.cap_last {
                check_err!(
                    20,
                    libc::prctl(libc::PR_CAPBSET_DROP, cap as c_ulong, 0, 0, 0) != 0
                );
            }
        }
        check_err!(
            21,
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL as c_ulong,
                0,
                0,
                0
            ) != 0
        );
        let mut hdr = CapHeader {
            version: CAP_V3,
            pid: 0,
        };
        let data = [CapData {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        }; 2];
        check_err!(
            22,
            libc::syscall(libc::SYS_capset, &raw mut hdr, data.as_ptr()) != 0
        );
        check_err!(
            23,
            libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as c_ulong, 0, 0, 0) != 0
        );
        for f in &plan.filters {
            let prog = libc::sock_fprog {
                len: f.len() as u16,
                filter: f.as_ptr() as *mut libc::sock_filter,
            };
            check_err!(
                24,
                libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER as c_ulong,
                    &raw const prog as c_ulong,
                    0,
                    0
                ) != 0
            );
        }
        let _ = step;
        match exe_fd {
            Some(fd) => {
                libc::syscall(
                    libc::SYS_execveat,
                    fd,
                    c"".as_ptr(),
                    plan.argv_ptrs.as_ptr(),
                    plan.envp_ptrs.as_ptr(),
                    libc::AT_EMPTY_PATH,
                );
                fail(err, 25)
            }
            None => libc::_exit(0),
        }
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
fn fail(err_fd: RawFd, step: usize) -> ! {
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
