//! VM processes where the jail does not exist (macOS): no namespaces, per-VM ids, cgroups or
//! seccomp, so the process runs as the service's user. What can still be applied is: only the
//! descriptors it was handed, an empty environment, rlimits (no core dumps, open files, file
//! size), and a session of its own (no terminal's signals). The start-up line and `/v1/health`
//! say the jail is missing, and `SANDBOX_HOST_JAIL=required` refuses VMs, as on a Linux host that
//! cannot apply it.
//!
//! macOS has no parent-death signal: a VM process outlives a service that is killed outright
//! (SIGKILL, a crash); a service that stops normally stops its VMs first. The operator guide says
//! how to find them.
//!
//! The types mirror the Linux jail's, so the QEMU backend starts its process the same way on both.
//! A fork and exec of our own rather than `std::process::Command`, whose exec-error pipe could sit
//! on a descriptor number the process is to receive.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use thiserror::Error;

use crate::spec::{Command, Exit};
use crate::{Mode, Settings, Status};

/// The most descriptors a process is handed (as the Linux jail).
const MAX_FDS: usize = 32;

/// Why a VM process could not be started.
#[derive(Debug, Error)]
pub enum SpawnError {
    /// Preparing or forking failed in the service.
    #[error("starting {program}: {what}: {source}")]
    Start {
        /// The program.
        program: String,
        /// What was being done.
        what: &'static str,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// A step in the new process failed before its program ran.
    #[error("starting {program}: {step}: {source}")]
    Child {
        /// The program.
        program: String,
        /// The step, in words.
        step: &'static str,
        /// Its errno.
        #[source]
        source: std::io::Error,
    },
    /// The spec is unusable, or the jail is required and missing.
    #[error("invalid jail: {0}")]
    Invalid(String),
}

/// The child's steps, reported by number through the error pipe.
const STEPS: [&str; 4] = [
    "moving its descriptors into place",
    "setting its rlimits",
    "starting a session",
    "executing the program",
];

/// In a forked child: writes the failed step and errno to the report pipe and exits. Reading
/// errno and writing to a pipe are async-signal-safe; nothing is allocated.
fn report_and_exit(w: RawFd, step: i32) -> ! {
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    let mut msg = [0u8; 8];
    msg[..4].copy_from_slice(&step.to_ne_bytes());
    msg[4..].copy_from_slice(&errno.to_ne_bytes());
    // SAFETY: a write of our own buffer to our own descriptor, then _exit.
    unsafe {
        libc::write(w, msg.as_ptr().cast(), msg.len());
        libc::_exit(127)
    }
}

/// A running VM process.
pub struct Jailed {
    pid: libc::pid_t,
    /// Held while reaping and while signalling, so a signal never reaches a reaped (and perhaps
    /// recycled) pid.
    reap: Mutex<()>,
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
        self.pid as u32
    }

    /// Its uid: the service's own, so none of its own.
    pub fn uid(&self) -> Option<u32> {
        None
    }

    /// Nothing finds it again: a restart of the service disposes of it.
    pub fn identity(&self) -> Option<crate::Identity> {
        None
    }

    /// Sends `sig`, unless the process was already reaped.
    pub fn signal(&self, sig: i32) {
        let _held = self.reap.lock().unwrap_or_else(|e| e.into_inner());
        if self.exit.get().is_none() {
            // SAFETY: kill on a child of ours that has not been reaped, so the pid is its own.
            unsafe { libc::kill(self.pid, sig) };
        }
    }

    /// The exit, if the process has ended (and reaps it).
    pub fn try_wait(&self) -> Option<Exit> {
        let _held = self.reap.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = self.exit.get() {
            return Some(*e);
        }
        let mut status = 0;
        // SAFETY: waitpid on our own child, writing into a local.
        let r = unsafe { libc::waitpid(self.pid, &raw mut status, libc::WNOHANG) };
        let status = match r {
            0 => return None,
            r if r == self.pid => status,
            _ => match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) => return None,
                // Reaped by somebody else (SIGCHLD ignored): it is gone, its status unknown.
                _ => 255 << 8,
            },
        };
        let e = Exit {
            status,
            oom_kills: 0,
            known: true,
        };
        let _ = self.exit.set(e);
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
        if self.exit.get().is_some() {
            return;
        }
        let pid = self.pid;
        // SAFETY: not reaped yet (we hold the only handle), so the pid is still our child's.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        // Reap it off the caller's thread.
        std::thread::spawn(move || {
            let mut status = 0;
            // SAFETY: waitpid on our own child.
            unsafe { libc::waitpid(pid, &raw mut status, 0) };
        });
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
                unenforced: vec![],
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
    pub fn remove_stale(&self, _keep: &[std::path::PathBuf]) -> usize {
        0
    }

    /// Processes cannot be found again here: a restart of the service disposes of them.
    pub fn adopt(
        &self,
        _identity: &crate::Identity,
        _name: &str,
    ) -> Result<Jailed, crate::AdoptError> {
        Err(crate::AdoptError::Unsupported)
    }

    /// Starts `cmd` with only its descriptors, an empty environment, its rlimits and a session
    /// of its own. Blocks until the program runs (or says why it could not).
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
            .clone()
            .unwrap_or_else(|| PathBuf::from("/usr/bin/true"));
        let shown = program.display().to_string();
        let start = |what: &'static str| {
            let program = shown.clone();
            move |source| SpawnError::Start {
                program,
                what,
                source,
            }
        };
        let exec = Exec::prepare(&cmd, &program)?;
        // The child reports a failed step here; above every target, close-on-exec, so a
        // successful exec closes it and the parent reads end-of-file.
        let (report_r, report_w) = std::io::pipe().map_err(start("making its report pipe"))?;
        let n = exec.sources.len() as RawFd;
        // SAFETY: F_DUPFD_CLOEXEC duplicates a descriptor we own into a new one.
        let w = unsafe { libc::fcntl(report_w.as_raw_fd(), libc::F_DUPFD_CLOEXEC, n.max(3)) };
        if w < 0 {
            return Err(start("placing its report pipe")(
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: a new descriptor of ours alone.
        let report_w_high = unsafe { OwnedFd::from_raw_fd(w) };
        drop(report_w);

        // SAFETY: fork; the child below calls only async-signal-safe functions on memory made
        // before the fork, and ends in execve or _exit.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(start("forking")(std::io::Error::last_os_error()));
        }
        if pid == 0 {
            // SAFETY: the child of a fork (see `Exec::run`).
            unsafe { exec.run(w) }
        }
        drop(report_w_high);
        // The parent's copies of the descriptors: the child has its own now.
        drop(cmd.fds);
        let jailed = Jailed {
            pid,
            reap: Mutex::new(()),
            exit: OnceLock::new(),
        };
        let Some((step, errno)) = read_report(report_r) else {
            return Ok(jailed);
        };
        // The child has _exited: reap it before saying why.
        let _ = jailed.try_wait();
        Err(SpawnError::Child {
            program: shown,
            step: STEPS
                .get(step as usize)
                .copied()
                .unwrap_or("an unknown step"),
            source: std::io::Error::from_raw_os_error(errno),
        })
    }
}

/// Everything the child of the fork touches, made before it: between fork and exec it may not
/// allocate.
struct Exec {
    path: CString,
    /// The strings `argv` points into.
    _words: Vec<CString>,
    argv: Vec<*const libc::c_char>,
    envp: [*const libc::c_char; 1],
    /// The descriptors it gets, in order: source `i` becomes descriptor `i`.
    sources: Vec<RawFd>,
    core: libc::rlimit,
    nofile: libc::rlimit,
    fsize: Option<libc::rlimit>,
    /// Descriptors below this are made close-on-exec (all the parent may have open).
    top: RawFd,
    no_signals: libc::sigset_t,
}

impl Exec {
    fn prepare(cmd: &Command, program: &std::path::Path) -> Result<Exec, SpawnError> {
        let bad = |_| SpawnError::Invalid(format!("a NUL byte in the command of {}", cmd.name));
        let path = CString::new(program.as_os_str().as_bytes()).map_err(bad)?;
        let mut words = vec![path.clone()];
        for a in &cmd.args {
            words.push(CString::new(a.as_bytes()).map_err(bad)?);
        }
        let mut argv: Vec<*const libc::c_char> = words.iter().map(|w| w.as_ptr()).collect();
        argv.push(std::ptr::null());
        let limit = |v: u64| libc::rlimit {
            rlim_cur: v as libc::rlim_t,
            rlim_max: v as libc::rlim_t,
        };
        let mut top = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes only the struct passed.
        let top = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut top) } == 0 {
            top.rlim_cur.min(65536) as RawFd
        } else {
            4096
        };
        // SAFETY: an all-zero sigset is valid storage; sigemptyset initialises it.
        let mut no_signals: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe { libc::sigemptyset(&raw mut no_signals) };
        Ok(Exec {
            path,
            _words: words,
            argv,
            envp: [std::ptr::null()],
            sources: cmd.fds.iter().map(AsRawFd::as_raw_fd).collect(),
            core: limit(0),
            nofile: limit(cmd.nofile),
            fsize: cmd.fsize.map(limit),
            top,
            no_signals,
        })
    }

    /// The child's steps: its descriptors into place, the others closed at exec, its rlimits,
    /// a session of its own, default signals; then the program. A failed step is reported on
    /// `w` by its number in [`STEPS`].
    ///
    /// # Safety
    /// Only in the child of a fork: it calls only async-signal-safe functions, on memory made
    /// before the fork, and ends in `execve` or `_exit`.
    unsafe fn run(&self, w: RawFd) -> ! {
        let fail = |step: i32| report_and_exit(w, step);
        let n = self.sources.len() as RawFd;
        let mut moved = [0 as RawFd; MAX_FDS];
        // SAFETY: the child of a fork; each call below is async-signal-safe, on memory of our
        // own.
        unsafe {
            // First above every target, then down into place: a source may sit on another's
            // target.
            for (i, &fd) in self.sources.iter().enumerate() {
                let d = libc::fcntl(fd, libc::F_DUPFD, n.max(3));
                if d < 0 {
                    fail(0);
                }
                moved[i] = d;
            }
            for (i, &d) in moved[..self.sources.len()].iter().enumerate() {
                if libc::dup2(d, i as RawFd) < 0 {
                    fail(0);
                }
            }
            // Nothing else reaches the program: every other descriptor closes at exec.
            for fd in n..self.top {
                libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            }
            if libc::setrlimit(libc::RLIMIT_CORE, &self.core) != 0
                || libc::setrlimit(libc::RLIMIT_NOFILE, &self.nofile) != 0
                || self
                    .fsize
                    .is_some_and(|l| libc::setrlimit(libc::RLIMIT_FSIZE, &l) != 0)
            {
                fail(1);
            }
            // No terminal's signals (a Ctrl-C meant for the service); the service stops it.
            if libc::setsid() < 0 {
                fail(2);
            }
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            libc::sigprocmask(
                libc::SIG_SETMASK,
                &raw const self.no_signals,
                std::ptr::null_mut(),
            );
            libc::execve(self.path.as_ptr(), self.argv.as_ptr(), self.envp.as_ptr());
        }
        fail(3)
    }
}

/// What the child reported on its report pipe before it ended: the step that failed and its
/// errno; `None` when the pipe closed empty (its exec succeeded).
fn read_report(mut r: std::io::PipeReader) -> Option<(i32, i32)> {
    let mut report = [0u8; 8];
    let mut got = 0;
    while got < report.len() {
        match std::io::Read::read(&mut r, &mut report[got..]) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    if got == 0 {
        return None;
    }
    let step = i32::from_ne_bytes(report[..4].try_into().unwrap_or_default());
    let errno = i32::from_ne_bytes(report[4..].try_into().unwrap_or_default());
    Some((step, errno))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::OwnedFd;

    fn settings(mode: Mode) -> Settings {
        Settings {
            mode,
            ids: None,
            cgroup_parent: "unused".into(),
            instance: "test".into(),
        }
    }

    /// A command for these tests: `program` with `args` and `fds`, the rest as a VM's.
    fn command(program: &str, args: Vec<std::ffi::OsString>, fds: Vec<OwnedFd>) -> Command {
        Command {
            name: "t".into(),
            program: Some(program.into()),
            args,
            fds,
            root: None,
            limits: crate::Limits {
                memory_bytes: 1 << 30,
                pids: 16,
                cpu_weight: 100,
                cpus: 1,
            },
            nofile: 64,
            fsize: None,
            keep_groups: vec![],
            seccomp: true,
            host_network: false,
            outlive: false,
        }
    }

    #[tokio::test]
    async fn the_process_gets_only_its_descriptors_no_environment_and_its_rlimits() {
        let jailer = Jailer::new(&settings(Mode::Auto));
        assert!(!jailer.namespaces());
        assert!(jailer.status().missing[0].contains("no namespaces"));
        // A descriptor of the parent's that is not close-on-exec must not reach the child.
        let leak = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: dup of a descriptor we own; the copy is owned below.
        let leaked = unsafe { libc::dup(leak.as_raw_fd()) };
        assert!(leaked > 3);
        // SAFETY: the new descriptor is ours alone.
        let _leaked_owner = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(leaked) };
        let (stdin_r, stdin_w) = std::io::pipe().unwrap();
        let (mut out_r, out_w) = std::io::pipe().unwrap();
        let err_w = out_w.try_clone().unwrap();
        let extra = std::fs::File::open("/dev/zero").unwrap();
        let script = format!(
            "echo home=${{HOME-unset}}; [ -e /dev/fd/3 ] && echo fd3; [ -e /dev/fd/{leaked} ] && echo leaked; \
             echo nofile=$(ulimit -n) core=$(ulimit -c); read x; echo never"
        );
        let j = jailer
            .spawn(Command {
                nofile: 77,
                fsize: Some(1 << 20),
                ..command(
                    "/bin/sh",
                    vec!["-c".into(), script.into()],
                    vec![stdin_r.into(), out_w.into(), err_w.into(), extra.into()],
                )
            })
            .unwrap();
        assert!(j.try_wait().is_none(), "it waits on its stdin");
        // Its output, up to the blocking read: the parent's copies of the write ends are gone.
        let mut out = String::new();
        let mut buf = [0u8; 256];
        while !out.contains("core=") {
            let n = out_r.read(&mut buf).unwrap();
            assert!(n > 0, "{out}");
            out.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        assert_eq!(out, "home=unset\nfd3\nnofile=77 core=0\n");
        j.signal(libc::SIGTERM);
        let e = tokio::time::timeout(Duration::from_secs(10), j.wait())
            .await
            .expect("the process ends on SIGTERM");
        assert_eq!(e.signal(), Some(libc::SIGTERM));
        assert_eq!(j.try_wait(), Some(e));
        // After the reap, a signal goes nowhere (the pid may be another process's now).
        j.signal(libc::SIGKILL);
        drop(stdin_w);
    }

    #[test]
    fn required_refuses_and_says_why() {
        let jailer = Jailer::new(&settings(Mode::Required));
        let e = jailer
            .spawn(Command {
                nofile: 64,
                fsize: None,
                ..command("/bin/true", vec![], vec![])
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("SANDBOX_HOST_JAIL=required, but"), "{e}");
        let off = Jailer::new(&settings(Mode::Off));
        assert!(off.status().missing[0].contains("SANDBOX_HOST_JAIL=off"));
    }

    #[test]
    fn descriptors_land_on_their_numbers_even_when_sources_sit_on_targets() {
        let jailer = Jailer::new(&settings(Mode::Auto));
        // Pipes opened first take the lowest free numbers, so the write ends likely sit on
        // 3, 4, 5...: handed over in reverse, sources and targets cross.
        let pipes: Vec<_> = (0..6).map(|_| std::io::pipe().unwrap()).collect();
        let (readers, writers): (Vec<_>, Vec<_>) = pipes.into_iter().unzip();
        let mut fds: Vec<OwnedFd> = writers.into_iter().map(OwnedFd::from).collect();
        fds.reverse();
        let j = jailer
            .spawn(Command {
                nofile: 64,
                fsize: None,
                ..command(
                    "/bin/sh",
                    vec![
                        "-c".into(),
                        "for i in 0 1 2 3 4 5; do echo $i >&$i; done".into(),
                    ],
                    fds,
                )
            })
            .unwrap();
        for (k, mut r) in readers.into_iter().enumerate() {
            let mut got = String::new();
            r.read_to_string(&mut got).unwrap();
            // Writer k went to target 5 - k.
            assert_eq!(got, format!("{}\n", 5 - k), "pipe {k}");
        }
        for _ in 0..500 {
            if let Some(e) = j.try_wait() {
                assert_eq!(e.code(), Some(0));
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("the shell did not end");
    }

    #[test]
    fn a_program_that_cannot_run_is_an_error_at_spawn_not_a_dead_vm() {
        let jailer = Jailer::new(&settings(Mode::Auto));
        let (_r, w) = std::io::pipe().unwrap();
        let e = jailer
            .spawn(Command {
                nofile: 64,
                fsize: None,
                ..command("/nonexistent/qemu-system-aarch64", vec![], vec![w.into()])
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("executing the program") && e.contains("No such file"),
            "{e}"
        );
    }
}
