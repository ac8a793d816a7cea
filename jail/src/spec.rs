//! What to run in a jail and how it ended: plain data, the same on every system, so that the
//! backends describe their VM process once. Linux applies all of it (`spawn`); macOS, which has
//! no namespaces, cgroups or seccomp, applies the descriptors, the environment and the rlimits
//! (`unconfined`) and says the rest is missing.

use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

/// The limits of one VM's group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Memory the whole VM process may use: guest memory plus the VMM's own allowance.
    pub memory_bytes: u64,
    /// Processes and threads.
    pub pids: u64,
    /// CPU weight on v2's scale (1 to 10000, 100 is a default process); v1's shares are
    /// derived from it. The I/O weight is the same share of the disks.
    pub cpu_weight: u32,
    /// The most processors' worth of time the group gets (`cpu.max`, v1's CFS quota): a VM's
    /// vCPUs. 0 leaves it unbounded.
    pub cpus: u32,
}

/// A file or directory of the host made visible in the jail.
#[derive(Debug, Clone)]
pub struct Bind {
    /// On the host.
    pub src: PathBuf,
    /// In the jail (absolute).
    pub dst: PathBuf,
    /// Whether the jailed process may write to it.
    pub writable: bool,
}

/// The jail's root file system: an empty, read-only tmpfs with only what is listed.
#[derive(Debug, Clone, Default)]
pub struct Root {
    /// An empty directory of the host the root is built on (the VM's state directory holds one).
    pub staging: PathBuf,
    /// `/usr` read-only and the top-level links into it (`/lib`, `/bin`, ...), for a dynamically
    /// linked program; `/dev/null`, `/dev/zero`, `/dev/random`, `/dev/urandom`.
    pub system: bool,
    /// Further files and directories.
    pub binds: Vec<Bind>,
    /// Device nodes, at the same path (`/dev/kvm`).
    pub devices: Vec<PathBuf>,
    /// A `/proc` of the jail's own pid namespace (process directories only).
    pub proc: bool,
}

/// What to run in a jail.
#[derive(Debug)]
pub struct Command {
    /// Names the cgroup (`vm-<name>`): unique among live VMs of this service.
    pub name: String,
    /// The program on the host; `None` runs nothing (the jail is built, then the process ends
    /// with status 0: a probe).
    pub program: Option<PathBuf>,
    /// Its arguments (argv[0] is the program's file name).
    pub args: Vec<OsString>,
    /// Descriptors that become 0, 1, 2, ... in the jailed process (at most 32); nothing else is
    /// inherited.
    pub fds: Vec<OwnedFd>,
    /// The root file system; `None` keeps the host's mounts (only for a probe or tests).
    pub root: Option<Root>,
    /// cgroup limits (not enforced on macOS, which has no cgroups).
    pub limits: Limits,
    /// `RLIMIT_NOFILE`.
    pub nofile: u64,
    /// `RLIMIT_FSIZE`: the largest file the process may write (its biggest disk).
    pub fsize: Option<u64>,
    /// Host groups the process keeps (the group of `/dev/kvm` for QEMU with KVM).
    pub keep_groups: Vec<u32>,
    /// Whether to install the filter of [`crate::filter`].
    pub seccomp: bool,
    /// Whether the process stays in the host's network namespace (the network process, which
    /// connects to upstreams); every other jailed process gets an empty one of its own.
    pub host_network: bool,
    /// Whether the process may outlive the service: no parent-death signal, so a service that
    /// crashes or hands over leaves it running for the next one to find again
    /// ([`crate::Jailer::adopt`]). A process nobody will look for (a probe, a template's build,
    /// `sandbox-host run`'s) dies with its service.
    pub outlive: bool,
}

/// How a jailed process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// The wait status (`WIFEXITED` and friends apply).
    pub status: i32,
    /// Kills by the OOM killer in the process's cgroup: non-zero means it ran out of memory
    /// (always 0 on macOS).
    pub oom_kills: u64,
    /// Whether `status` is the kernel's word. A process adopted after a restart of the service
    /// is not its child: its status went to whoever reaped it, and only its end is known.
    pub known: bool,
}

impl Exit {
    /// The exit code, if it exited (and its status is known).
    pub fn code(&self) -> Option<i32> {
        (self.known && libc::WIFEXITED(self.status)).then(|| libc::WEXITSTATUS(self.status))
    }

    /// The signal that ended it, if one did (and its status is known).
    pub fn signal(&self) -> Option<i32> {
        (self.known && libc::WIFSIGNALED(self.status)).then(|| libc::WTERMSIG(self.status))
    }
}

/// What the service records of a jailed process it started, to find that same process again
/// after a restart: its pid with its start time (a pid alone may have been given to another
/// process since), its uid, and its cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Its pid on the host.
    pub pid: u32,
    /// When it started, in clock ticks since the host booted (`/proc/<pid>/stat`, field 22).
    pub start_time: u64,
    /// Its uid on the host (`None`: it shares the service's).
    pub uid: Option<u32>,
    /// The directories of its cgroup (none without cgroups).
    pub cgroup: Vec<std::path::PathBuf>,
}
