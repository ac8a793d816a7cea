//! VM processes where the jail does not exist (macOS): no namespaces, per-VM ids, cgroups or
//! seccomp, so the process runs as the service's user. What can still be applied is: only the
//! descriptors it was handed, an empty environment, and rlimits (no core dumps, open files, file
//! size). The start-up line and `/v1/health` say the jail is missing, and
//! `SANDBOX_HOST_JAIL=required` refuses VMs, as on a Linux host that cannot apply it.
//!
//! The types mirror the Linux jail's, so the QEMU backend starts its process the same way on both.

use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use thiserror::Error;

use crate::{Mode, Settings, Status};

/// The most descriptors a process is handed (as the Linux jail).
const MAX_FDS: usize = 32;

/// Why a VM process could not be started.
#[derive(Debug, Error)]
pub enum SpawnError {
    /// Starting the program failed.
    #[error("starting {program}: {source}")]
    Start {
        /// The program.
        program: String,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// The spec is unusable, or the jail is required and missing.
    #[error("invalid jail: {0}")]
    Invalid(String),
}

/// Limits a Linux cgroup would apply; kept so callers describe them alike. Not enforced here
/// beyond what the VM's own size bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Memory the whole VM process may use.
    pub memory_bytes: u64,
    /// Processes and threads.
    pub pids: u64,
    /// CPU weight (1 to 10000).
    pub cpu_weight: u32,
}

/// A file of the host the process would see in a Linux jail; here it keeps its host path.
#[derive(Debug, Clone)]
pub struct Bind {
    /// On the host.
    pub src: PathBuf,
    /// In the jail.
    pub dst: PathBuf,
    /// Whether the process may write to it.
    pub writable: bool,
}

/// The Linux jail's root file system; ignored here (there is no mount namespace).
#[derive(Debug, Clone, Default)]
pub struct Root {
    /// An empty directory of the host.
    pub staging: PathBuf,
    /// `/usr` and the system's devices.
    pub system: bool,
    /// Further files and directories.
    pub binds: Vec<Bind>,
    /// Device nodes.
    pub devices: Vec<PathBuf>,
    /// A `/proc` of its own.
    pub proc: bool,
}

/// What to run.
#[derive(Debug)]
pub struct Command {
    /// Names the VM in errors.
    pub name: String,
    /// The program; `None` runs nothing.
    pub program: Option<PathBuf>,
    /// Its arguments, after the program's name.
    pub args: Vec<OsString>,
    /// Descriptors that become 0, 1, 2, ... in the process (at most 32); nothing else is
    /// inherited.
    pub fds: Vec<OwnedFd>,
    /// Ignored here (no mount namespace): paths are the host's.
    pub root: Option<Root>,
    /// Not enforced here (no cgroups).
    pub limits: Limits,
    /// `RLIMIT_NOFILE`.
    pub nofile: u64,
    /// `RLIMIT_FSIZE`: the largest file the process may write.
    pub fsize: Option<u64>,
    /// Host groups the process keeps: it runs as the service's user with all of its groups.
    pub keep_groups: Vec<u32>,
    /// Ignored here (no seccomp).
    pub seccomp: bool,
}

/// How the process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// The wait status.
    pub status: i32,
    /// Always 0: without a cgroup there is no count of memory kills.
    pub oom_kills: u64,
}

impl Exit {
    /// The exit code, if it exited.
    pub fn code(&self) -> Option<i32> {
        libc::WIFEXITED(self.status).then(|| libc::WEXITSTATUS(self.status))
    }

    /// The signal that ended it, if one did.
    pub fn signal(&self) -> Option<i32> {
        libc::WIFSIGNALED(self.status).then(|| libc::WTERMSIG(self.status))
    }
}

/// A running VM process.
pub struct Jailed {
    pid: u32,
    /// Reaping and signalling hold this lock, so a signal never reaches a reaped (and perhaps
    /// recycled) pid.
    child: Mutex<Option<std::process::Child>>,
    exit: OnceLock<Exit>,
}

impl std::fmt::Debug for Jailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jailed").field("pid", &self.pid).finish()
    }
}

impl Jailed {
    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its uid: the service's own, so none of its own.
    pub fn uid(&self) -> Option<u32> {
        None
    }

    /// Sends `sig`, unless the process was already reaped.
    pub fn signal(&self, sig: i32) {
        let child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        if child.is_some() && self.exit.get().is_none() {
            // SAFETY: kill on a child of ours that has not been reaped, so its pid is still its own.
            unsafe { libc::kill(self.pid as libc::pid_t, sig) };
        }
    }

    /// The exit, if the process has ended (and reaps it).
    pub fn try_wait(&self) -> Option<Exit> {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = self.exit.get() {
            return Some(*e);
        }
        let status = child.as_mut()?.try_wait().ok()??;
        let e = Exit {
            status: status.into_raw(),
            oom_kills: 0,
        };
        let _ = self.exit.set(e);
        *child = None;
        Some(e)
    }

    /// Waits for the end of the process. Polls: macOS has no pidfd for the reactor to watch.
    pub async fn wait(&self) -> Exit {
        loop {
            if let Some(e) = self.try_wait() {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Jailed {
    fn drop(&mut self) {
        let child = self
            .child
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(mut c) = child {
            let _ = c.kill();
            // Reap it off the caller's thread.
            std::thread::spawn(move || {
                let _ = c.wait();
            });
        }
    }
}

/// Starts VM processes for this service.
#[derive(Debug)]
pub struct Jailer {
    status: Status,
}

impl Jailer {
    /// Says what is missing: everything the Linux jail applies.
    pub fn new(settings: &Settings) -> Jailer {
        let missing = vec![match settings.mode {
            Mode::Off => "SANDBOX_HOST_JAIL=off: VM processes run as the sandbox host's own user, \
                          without namespaces, seccomp or cgroups"
                .to_string(),
            _ => format!(
                "{} has no namespaces, per-VM ids, cgroups or seccomp for the jail: QEMU runs as \
                 the sandbox host's own user, with only its descriptors, an empty environment and \
                 rlimits; see \"On macOS\" in the operator guide",
                std::env::consts::OS
            ),
        }];
        Jailer {
            status: Status {
                namespaces: false,
                ids: "none",
                cgroup: None,
                refusal: (settings.mode == Mode::Required)
                    .then(|| format!("SANDBOX_HOST_JAIL=required, but {}", missing.join("; "))),
                missing,
            },
        }
    }

    /// What is applied, and what is missing.
    pub fn status(&self) -> &Status {
        &self.status
    }

    /// Always false: paths given to the process are the host's.
    pub fn namespaces(&self) -> bool {
        false
    }

    /// Nothing outlives a run here (no cgroups).
    pub fn remove_stale(&self) -> usize {
        0
    }

    /// Starts `cmd` with only its descriptors, an empty environment and its rlimits.
    pub fn spawn(&self, cmd: Command) -> Result<Jailed, SpawnError> {
        if let Some(r) = &self.status.refusal {
            return Err(SpawnError::Invalid(r.clone()));
        }
        if cmd.fds.len() > MAX_FDS {
            return Err(SpawnError::Invalid(format!(
                "{} descriptors for {}; at most {MAX_FDS}",
                cmd.fds.len(),
                cmd.name
            )));
        }
        let program = cmd
            .program
            .unwrap_or_else(|| PathBuf::from("/usr/bin/true"));
        let sources: Vec<RawFd> = cmd.fds.iter().map(AsRawFd::as_raw_fd).collect();
        let mut moved = [0 as RawFd; MAX_FDS];
        let (nofile, fsize) = (cmd.nofile, cmd.fsize);
        let mut c = std::process::Command::new(&program);
        c.args(&cmd.args).env_clear();
        // SAFETY: the closure runs in the child between fork and exec and calls only
        // async-signal-safe functions (fcntl, dup2, close, setrlimit) on memory allocated
        // before the fork.
        unsafe {
            c.pre_exec(move || {
                let n = sources.len() as RawFd;
                // First above every target, then down into place: a source may sit on another's
                // target.
                for (i, &fd) in sources.iter().enumerate() {
                    let d = libc::fcntl(fd, libc::F_DUPFD, n.max(3));
                    if d < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    moved[i] = d;
                }
                for (i, &d) in moved[..sources.len()].iter().enumerate() {
                    if libc::dup2(d, i as RawFd) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                // Nothing else is inherited.
                let mut lim = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                let top = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
                    lim.rlim_cur.min(65536) as RawFd
                } else {
                    4096
                };
                for fd in n..top {
                    libc::close(fd);
                }
                let set = |res, v: u64| {
                    let l = libc::rlimit {
                        rlim_cur: v as libc::rlim_t,
                        rlim_max: v as libc::rlim_t,
                    };
                    libc::setrlimit(res, &l)
                };
                set(libc::RLIMIT_CORE, 0);
                set(libc::RLIMIT_NOFILE, nofile);
                if let Some(f) = fsize {
                    set(libc::RLIMIT_FSIZE, f);
                }
                Ok(())
            });
        }
        let child = c.spawn().map_err(|source| SpawnError::Start {
            program: program.display().to_string(),
            source,
        })?;
        // The child has its copies; the parent's close here.
        drop(cmd.fds);
        Ok(Jailed {
            pid: child.id(),
            child: Mutex::new(Some(child)),
            exit: OnceLock::new(),
        })
    }
}
