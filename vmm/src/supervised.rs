//! A jailed process the service watches over: QEMU, `sandbox-vm`, and a sandbox's `sandbox-net`.
//!
//! What the three share lives here once: the spawn into the jail, the console read from its
//! pipes into a bounded log, the watch on its end, the stop that asks and then kills within a
//! bound, the reap that never waits without end, the removal of its state directory, and the
//! kill of a process whose owner was dropped without stopping it. Each kind keeps its own
//! handshake and its own reading of how it ended (a [`Classify`]): QEMU's exit status and
//! console, `sandbox-vm`'s report checked against the kernel's word.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sandbox_control::console::ConsoleLog;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::watch;

use crate::backend::{VmError, VmExit, VmStartError};

/// Console lines kept in an exit.
pub const EXIT_CONSOLE_LINES: usize = 20;

/// What is known of a supervised process once it has been reaped: what its kind's
/// [`Classify`] turns into one line for a person.
#[derive(Debug, Clone)]
pub struct Ending {
    /// The kernel's word: how the process ended, and the OOM kills in its cgroup.
    pub status: sandbox_jail::Exit,
    /// Why the service killed it, if it did.
    pub killed: Option<String>,
    /// The service asked it to stop.
    pub requested: bool,
    /// Its cgroup's memory limit, for the out-of-memory message.
    pub memory_mib: u64,
    /// The last lines of its console.
    pub console: Vec<String>,
}

/// How one kind of process reads its own end.
#[async_trait]
pub trait Classify: Send + 'static {
    /// Runs once the process has been reaped, before its console's last lines are taken: the
    /// place to drain what it said last (a control socket's final report).
    async fn reaped(&mut self) {}
    /// The exit, from what is known.
    fn classify(self: Box<Self>, ending: Ending) -> VmExit;
}

/// How a supervised process is started.
pub struct Spawn {
    /// What it is.
    pub kind: Kind,
    /// The jail's command.
    pub cmd: sandbox_jail::Command,
    /// The read ends of the pipes its output comes through, each with the prefix its lines get
    /// in the console log.
    pub outputs: Vec<(OwnedFd, &'static str)>,
}

/// What a supervised process is, besides its jail: how it is named, where its files are, how
/// long its reap may take, how its console lines are read.
pub struct Kind {
    /// Names it in messages ("QEMU", "the VM process").
    pub name: &'static str,
    /// Its directory, removed when it is stopped, killed or dropped.
    pub state_dir: Option<PathBuf>,
    /// The longest a reap waits after SIGKILL before the process is declared left behind.
    pub reap_within: Duration,
    /// What each console line becomes before anyone reads it (a bound and printable text for
    /// a process a guest may have taken over); [`std::convert::identity`] keeps it.
    pub line: fn(String) -> String,
}

/// A running (or ended) supervised process.
pub struct Supervised {
    name: &'static str,
    jailed: Arc<sandbox_jail::Jailed>,
    console: Arc<Mutex<ConsoleLog>>,
    exit: watch::Receiver<Option<VmExit>>,
    /// The waiter task sets the exit; a reap that cannot end the process sets it too.
    exit_tx: Arc<watch::Sender<Option<VmExit>>>,
    stop_requested: Arc<AtomicBool>,
    /// Set by [`Supervised::kill`]: the reason the host gave up on it, reported as its exit.
    kill_reason: Arc<Mutex<Option<String>>>,
    state_dir: Option<PathBuf>,
    reap_within: Duration,
    line: fn(String) -> String,
}

impl Supervised {
    /// Spawns the process in its jail (off the runtime's threads), starts reading its outputs
    /// and watching for its end, which `classify` reads.
    pub async fn spawn(s: Spawn, classify: Box<dyn Classify>) -> Result<Self, VmError> {
        let Spawn { kind, cmd, outputs } = s;
        let name = kind.name;
        let program = cmd.program.clone().unwrap_or_default();
        let limits = cmd.limits;
        let jailer = sandbox_jail::global();
        let jailed = tokio::task::spawn_blocking(move || jailer.spawn(cmd))
            .await
            .map_err(VmStartError::Spawner)?
            .map_err(|source| VmStartError::Jail { program, source })?;
        let console = Arc::new(Mutex::new(ConsoleLog::default()));
        for (fd, prefix) in outputs {
            match tokio::net::unix::pipe::Receiver::from_owned_fd(fd) {
                Ok(r) => {
                    tokio::spawn(pump_console(r, console.clone(), prefix));
                }
                Err(e) => tracing::warn!("cannot read the output of {name}: {e}"),
            }
        }
        Ok(Self::watched(
            jailed,
            kind,
            console,
            limits.memory_bytes >> 20,
            classify,
        ))
    }

    /// Takes on the process `identity` records, which a previous run of the service started
    /// and left running (issue 32) under the jail's name `jail_name` (its command's `name`):
    /// shown to be that same process, it is watched, stopped and cleaned up as one this run
    /// started. Its console is not read (its pipes ended with the service that read them); its
    /// status at its end is not known (`Exit::known`).
    pub async fn adopt(
        kind: Kind,
        identity: sandbox_jail::Identity,
        jail_name: String,
        memory_mib: u64,
        classify: Box<dyn Classify>,
    ) -> Result<Self, sandbox_jail::AdoptError> {
        let jailer = sandbox_jail::global();
        let pid = identity.pid;
        let jailed = tokio::task::spawn_blocking(move || jailer.adopt(&identity, &jail_name))
            .await
            .map_err(|e| sandbox_jail::AdoptError::Host {
                pid,
                what: "adopting it",
                source: std::io::Error::other(e.to_string()),
            })??;
        Ok(Self::watched(
            jailed,
            kind,
            Arc::default(),
            memory_mib,
            classify,
        ))
    }

    fn watched(
        jailed: sandbox_jail::Jailed,
        kind: Kind,
        console: Arc<Mutex<ConsoleLog>>,
        memory_mib: u64,
        classify: Box<dyn Classify>,
    ) -> Self {
        let (exit_tx, exit) = watch::channel(None);
        let me = Supervised {
            name: kind.name,
            jailed: Arc::new(jailed),
            console,
            exit,
            exit_tx: Arc::new(exit_tx),
            stop_requested: Arc::default(),
            kill_reason: Arc::default(),
            state_dir: kind.state_dir,
            reap_within: kind.reap_within,
            line: kind.line,
        };
        tokio::spawn(watch_end(
            me.jailed.clone(),
            memory_mib,
            me.console.clone(),
            me.exit_tx.clone(),
            me.stop_requested.clone(),
            me.kill_reason.clone(),
            classify,
        ));
        me
    }

    /// What finds this process again after a restart of the service (`None` once it ended).
    pub fn identity(&self) -> Option<sandbox_jail::Identity> {
        self.jailed.identity()
    }

    /// Its pid on the host.
    pub fn pid(&self) -> u32 {
        self.jailed.pid()
    }

    /// Sends `sig` through its pidfd (never to a recycled pid).
    pub fn signal(&self, sig: i32) {
        self.jailed.signal(sig);
    }

    /// How it ended, if it has.
    pub fn exit(&self) -> Option<VmExit> {
        self.exit.borrow().clone()
    }

    /// A receiver of its end, for tasks that end with it.
    pub fn exit_watch(&self) -> watch::Receiver<Option<VmExit>> {
        self.exit.clone()
    }

    /// Resolves when it ends.
    pub async fn wait(&self) -> VmExit {
        let mut rx = self.exit.clone();
        match rx.wait_for(Option::is_some).await {
            Ok(e) => e.clone().unwrap_or_else(unknown_exit),
            // The waiter task is gone without a result: only at the runtime's shutdown.
            Err(_) => unknown_exit(),
        }
    }

    /// Ends it as the host asked: `ask` is the kind's polite request (a signal, a control
    /// message), then after `within` SIGKILL and a bounded reap; its directory is removed.
    pub async fn stop(&self, within: Duration, ask: impl FnOnce(&Self)) -> VmExit {
        if self.exit().is_none() {
            self.stop_requested.store(true, Ordering::SeqCst);
            ask(self);
        }
        let exit = self.ended(within).await;
        self.remove_state_dir();
        exit
    }

    /// Ends it as failed for `reason` (the host gave up on it): SIGKILL, a bounded reap, its
    /// directory removed. Its exit says `reason`, unless the kernel has a cause of its own.
    pub async fn kill(&self, reason: String) -> VmExit {
        if self.exit().is_none() {
            *self.kill_reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
            self.signal(libc::SIGKILL);
        }
        let exit = self.ended(Duration::ZERO).await;
        self.remove_state_dir();
        exit
    }

    /// Waits for its end for at most `within`; then SIGKILL, and a reap bounded by the
    /// spawn's `reap_within`, past which an exit says it is left behind: a process in
    /// uninterruptible sleep is never waited for without bound.
    async fn ended(&self, within: Duration) -> VmExit {
        if let Ok(e) = tokio::time::timeout(within, self.wait()).await {
            return e;
        }
        self.signal(libc::SIGKILL);
        if let Ok(e) = tokio::time::timeout(self.reap_within, self.wait()).await {
            return e;
        }
        tracing::error!(
            pid = self.pid(),
            "{} did not end within {:?} of SIGKILL",
            self.name,
            self.reap_within
        );
        let exit = VmExit {
            reason: format!(
                "{} (pid {}) did not end within {:?} of SIGKILL; it is left behind",
                self.name,
                self.pid(),
                self.reap_within
            ),
            requested: false,
            console: self.console_tail(EXIT_CONSOLE_LINES),
        };
        // Waiters learn it now; the waiter task replaces it if the process is reaped later.
        self.exit_tx.send_if_modified(|e| {
            if e.is_some() {
                return false;
            }
            *e = Some(exit.clone());
            true
        });
        exit
    }

    /// The last `n` lines of its console, each as the spawn's `line` makes it.
    pub fn console_tail(&self, n: usize) -> Vec<String> {
        self.console
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .tail(n)
            .into_iter()
            .map(self.line)
            .collect()
    }

    /// Ends it as the host asked, without waiting: SIGKILL, and its end counts as requested.
    pub fn end(&self) {
        if self.exit().is_none() {
            self.stop_requested.store(true, Ordering::SeqCst);
            self.signal(libc::SIGKILL);
        }
    }

    fn remove_state_dir(&self) {
        if let Some(dir) = &self.state_dir {
            remove_state_dir(dir);
        }
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        // Dropped without a stop (an error path, a panic): killed now, its files removed now;
        // the waiter task reaps it.
        if self.exit().is_none() {
            self.stop_requested.store(true, Ordering::SeqCst);
            self.signal(libc::SIGKILL);
        }
        self.remove_state_dir();
    }
}

/// The waiter: the process's end, read by its kind's classifier, into the exit watch.
async fn watch_end(
    jailed: Arc<sandbox_jail::Jailed>,
    memory_mib: u64,
    console: Arc<Mutex<ConsoleLog>>,
    tx: Arc<watch::Sender<Option<VmExit>>>,
    stop_requested: Arc<AtomicBool>,
    kill_reason: Arc<Mutex<Option<String>>>,
    mut classify: Box<dyn Classify>,
) {
    let status = jailed.wait().await;
    classify.reaped().await;
    // A moment for the console pumps to take its last words.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let console = console
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .tail(EXIT_CONSOLE_LINES);
    let killed = kill_reason
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let exit = classify.classify(Ending {
        status,
        killed,
        requested: stop_requested.load(Ordering::SeqCst),
        memory_mib,
        console,
    });
    tx.send_replace(Some(exit));
}

/// A pipe (read end, write end), both close-on-exec; `what` names it in the error.
pub fn pipe(what: &str) -> Result<(OwnedFd, OwnedFd), VmError> {
    let (r, w) = std::io::pipe().map_err(|e| VmError::io(format!("making the {what} pipe"), e))?;
    Ok((r.into(), w.into()))
}

/// Reads a process's output into its console log until the pipe closes, starting each line
/// with `prefix`. The log is bounded; what the process writes is not trusted to be text.
async fn pump_console(
    mut r: impl AsyncRead + Unpin,
    console: Arc<Mutex<ConsoleLog>>,
    prefix: &'static str,
) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut line_start = true;
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let mut log = console.lock().unwrap_or_else(|e| e.into_inner());
                for piece in buf[..n].split_inclusive(|&b| b == b'\n') {
                    if line_start {
                        log.write(prefix.as_bytes());
                    }
                    log.write(piece);
                    line_start = piece.ends_with(b"\n");
                }
            }
        }
    }
}

/// Removes a VM's state directory; a failure other than "already gone" is logged.
pub(crate) fn remove_state_dir(dir: &Path) {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            tracing::warn!(dir = %dir.display(), error = %e, "could not remove the VM's state directory");
        }
        _ => {}
    }
}

/// The exit of a VM whose end was not recorded (its watcher is gone).
pub(crate) fn unknown_exit() -> VmExit {
    VmExit {
        reason: "the VM ended without a recorded reason".into(),
        requested: false,
        console: Vec::new(),
    }
}
