//! One QEMU process: spawning it, collecting its console, noticing its end, stopping it and
//! removing everything it had on disk.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sandbox_devices::ConsoleLog;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::UnixListener;
use tokio::process::{Child, Command};
use tokio::sync::watch;

use crate::backend::{Channel, StartedVm, Vm, VmError, VmExit, VmSpec};

/// How long QEMU gets to connect to the agent socket after it starts.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Console lines kept in a `VmExit`.
const EXIT_CONSOLE_LINES: usize = 20;
/// The longest a stop waits for QEMU to be reaped after SIGKILL.
const REAP_TIMEOUT: Duration = Duration::from_secs(10);

/// A QEMU process and what belongs to it.
pub struct QemuVm {
    pid: u32,
    /// A pidfd for the process, so signals can never reach a recycled pid.
    pidfd: Option<std::os::fd::OwnedFd>,
    console: Arc<Mutex<ConsoleLog>>,
    exit: watch::Receiver<Option<VmExit>>,
    /// The waiter task sets the exit; a stop that cannot reap QEMU sets it too.
    exit_tx: Arc<watch::Sender<Option<VmExit>>>,
    stop_requested: Arc<std::sync::atomic::AtomicBool>,
    /// Set by `kill`: the reason the host gave up on the VM, reported as its exit.
    kill_reason: Arc<Mutex<Option<String>>>,
    state_dir: PathBuf,
    /// From spawning QEMU to the guest's boot marker, once it came (x86_64).
    marker: Arc<std::sync::OnceLock<Duration>>,
}

/// Spawns QEMU with `args` and waits for it to connect to the agent socket.
pub async fn spawn(
    program: &Path,
    args: Vec<std::ffi::OsString>,
    spec: &VmSpec,
) -> Result<StartedVm, VmError> {
    let sock = spec.state_dir.join("agent.sock");
    let listener = UnixListener::bind(&sock)
        .map_err(|e| VmError::io(format!("listening on {}", sock.display()), e))?;

    // QEMU connects to the marker socket at start, like the agent's (x86_64 only).
    let marker_sock = super::args::marker_socket(&sock);
    let marker_listener = if args
        .iter()
        .any(|a| a.to_string_lossy().contains("isa-debugcon"))
    {
        Some(
            UnixListener::bind(&marker_sock)
                .map_err(|e| VmError::io(format!("listening on {}", marker_sock.display()), e))?,
        )
    } else {
        None
    };
    // QEMU connects to the network socket at start too, when the VM has a network.
    let net = match &spec.net {
        Some(n) => {
            let path = super::args::net_socket(&sock);
            let l = UnixListener::bind(&path)
                .map_err(|e| VmError::io(format!("listening on {}", path.display()), e))?;
            Some((l, path, n.link.clone()))
        }
        None => None,
    };
    let started = std::time::Instant::now();
    let mut cmd = Command::new(program);
    cmd.args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    // SAFETY: the closure runs in the child between fork and exec and only calls prctl, which is
    // async-signal-safe; it makes the kernel kill QEMU if sandbox-host dies, so no VM outlives it.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| VmError::Start(format!("cannot run {}: {e}", program.display())))?;
    let pid = child.id().unwrap_or(0);

    let console = Arc::new(Mutex::new(ConsoleLog::default()));
    if let Some(out) = child.stdout.take() {
        tokio::spawn(pump(out, console.clone(), ""));
    }
    if let Some(err) = child.stderr.take() {
        tokio::spawn(pump(err, console.clone(), "qemu: "));
    }

    let (exit_tx, exit_rx) = watch::channel(None);
    let exit_tx = Arc::new(exit_tx);
    let stop_requested = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let kill_reason = Arc::new(Mutex::new(None));
    tokio::spawn(wait_exit(
        child,
        console.clone(),
        exit_tx.clone(),
        stop_requested.clone(),
        kill_reason.clone(),
    ));

    let marker = Arc::new(std::sync::OnceLock::new());
    if let Some(l) = marker_listener {
        tokio::spawn(time_marker(
            l,
            marker_sock,
            started,
            marker.clone(),
            exit_rx.clone(),
        ));
    }
    if let Some((l, path, link)) = net {
        tokio::spawn(super::netpump::run(l, path, link, exit_rx.clone()));
    }
    let vm = QemuVm {
        pid,
        pidfd: pidfd_open(pid),
        console,
        exit: exit_rx,
        exit_tx,
        stop_requested,
        kill_reason,
        state_dir: spec.state_dir.clone(),
        marker,
    };
    let accepted = tokio::select! {
        r = tokio::time::timeout(CONNECT_TIMEOUT, listener.accept()) => r,
        exit = vm.wait() => return Err(VmError::DiedEarly(exit)),
    };
    // The socket file is not needed once QEMU is connected.
    let _ = std::fs::remove_file(&sock);
    let stream = match accepted {
        Ok(Ok((s, _))) => s,
        Ok(Err(e)) => {
            vm.stop(Duration::ZERO).await;
            return Err(VmError::io("accepting QEMU's agent connection", e));
        }
        Err(_) => {
            vm.stop(Duration::ZERO).await;
            return Err(VmError::Start(format!(
                "QEMU did not connect to the agent socket within {CONNECT_TIMEOUT:?}"
            )));
        }
    };
    let (read, write) = stream.into_split();
    Ok(StartedVm {
        vm: Box::new(vm),
        channel: Channel {
            read: Box::new(read),
            write: Box::new(write),
        },
    })
}

/// Records when the guest's boot marker arrives on the marker socket; ends with the VM.
async fn time_marker(
    listener: UnixListener,
    sock: PathBuf,
    started: std::time::Instant,
    marker: Arc<std::sync::OnceLock<Duration>>,
    mut exit: watch::Receiver<Option<VmExit>>,
) {
    let timed = async {
        let (mut s, _) = listener.accept().await.ok()?;
        let _ = std::fs::remove_file(&sock);
        let mut b = [0u8; 1];
        if s.read(&mut b).await.ok()? == 1 && b[0] == sandbox_devices::BootMarker::VALUE {
            let _ = marker.set(started.elapsed());
        }
        // Drain whatever else the guest writes, so QEMU never blocks on a full socket.
        let mut sink = [0u8; 256];
        while s.read(&mut sink).await.ok()? > 0 {}
        Some(())
    };
    tokio::select! {
        _ = timed => {}
        _ = exit.wait_for(Option::is_some) => {}
    }
    let _ = std::fs::remove_file(&sock);
}

async fn pump(
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

async fn wait_exit(
    mut child: Child,
    console: Arc<Mutex<ConsoleLog>>,
    tx: Arc<watch::Sender<Option<VmExit>>>,
    stop_requested: Arc<std::sync::atomic::AtomicBool>,
    kill_reason: Arc<Mutex<Option<String>>>,
) {
    let status = child.wait().await;
    // Give the console pumps a moment to take QEMU's last words.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let lines = console
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .tail(EXIT_CONSOLE_LINES);
    let killed = kill_reason
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let requested = killed.is_none() && stop_requested.load(std::sync::atomic::Ordering::SeqCst);
    let reason =
        killed.unwrap_or_else(|| classify(status.as_ref().ok().copied(), requested, &lines));
    tx.send_replace(Some(VmExit {
        reason,
        requested,
        console: lines,
    }));
}

/// One line saying why QEMU ended.
fn classify(
    status: Option<std::process::ExitStatus>,
    requested: bool,
    console: &[String],
) -> String {
    use std::os::unix::process::ExitStatusExt;
    if requested {
        return "stopped by the host".into();
    }
    if let Some(l) = console.iter().find(|l| l.contains("Kernel panic")) {
        return format!("the guest kernel panicked ({})", l.trim());
    }
    if console.iter().any(|l| l.contains("KVM internal error")) {
        return "KVM could not run the guest (KVM internal error)".into();
    }
    match status {
        Some(s) if s.code() == Some(0) => "the guest powered off or restarted".into(),
        Some(s) if s.signal().is_some() => {
            format!("QEMU was killed by signal {}", s.signal().unwrap_or(0))
        }
        Some(s) => format!("QEMU exited with status {}", s.code().unwrap_or(-1)),
        None => "QEMU's exit status could not be read".into(),
    }
}

#[async_trait]
impl Vm for QemuVm {
    fn boot_marker(&self) -> Option<Duration> {
        self.marker.get().copied()
    }

    fn exit(&self) -> Option<VmExit> {
        self.exit.borrow().clone()
    }

    async fn wait(&self) -> VmExit {
        let mut rx = self.exit.clone();
        loop {
            if let Some(e) = rx.borrow_and_update().clone() {
                return e;
            }
            if rx.changed().await.is_err() {
                // The waiter task is gone without a result; only possible at runtime shutdown.
                return VmExit {
                    reason: "the VM monitor task ended".into(),
                    requested: false,
                    console: vec![],
                };
            }
        }
    }

    async fn stop(&self, grace: Duration) -> VmExit {
        if self.exit().is_none() {
            self.stop_requested
                .store(true, std::sync::atomic::Ordering::SeqCst);
            self.signal(libc::SIGTERM);
            if tokio::time::timeout(grace, self.wait()).await.is_err() {
                self.signal(libc::SIGKILL);
            }
        }
        let exit = self.reaped().await;
        remove_state_dir(&self.state_dir);
        exit
    }

    async fn kill(&self, reason: String) -> VmExit {
        if self.exit().is_none() {
            *self.kill_reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
            self.signal(libc::SIGKILL);
        }
        let exit = self.reaped().await;
        remove_state_dir(&self.state_dir);
        exit
    }

    fn console_tail(&self, n: usize) -> Vec<String> {
        self.console
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .tail(n)
    }

    fn pid(&self) -> Option<u32> {
        Some(self.pid)
    }
}

impl Drop for QemuVm {
    fn drop(&mut self) {
        // Dropped without a stop (an error path, a panic): kill now, clean up now. The waiter task
        // reaps the process.
        if self.exit().is_none() {
            self.stop_requested
                .store(true, std::sync::atomic::Ordering::SeqCst);
            self.signal(libc::SIGKILL);
        }
        remove_state_dir(&self.state_dir);
    }
}

impl QemuVm {
    /// The exit once QEMU (sent SIGKILL) has been reaped, or after [`REAP_TIMEOUT`] an exit
    /// that says it could not be: a process in uninterruptible sleep is never waited for
    /// without bound.
    async fn reaped(&self) -> VmExit {
        if self.exit().is_none() {
            self.signal(libc::SIGKILL);
        }
        match tokio::time::timeout(REAP_TIMEOUT, self.wait()).await {
            Ok(exit) => exit,
            Err(_) => {
                tracing::error!(
                    pid = self.pid,
                    "QEMU did not end within {REAP_TIMEOUT:?} of SIGKILL"
                );
                let exit = VmExit {
                    reason: format!(
                        "QEMU (pid {}) did not end within {REAP_TIMEOUT:?} of SIGKILL; it is left behind",
                        self.pid
                    ),
                    requested: false,
                    console: self.console_tail(EXIT_CONSOLE_LINES),
                };
                // Waiters learn it now; the waiter task replaces it if QEMU is reaped later.
                self.exit_tx.send_if_modified(|e| {
                    if e.is_some() {
                        return false;
                    }
                    *e = Some(exit.clone());
                    true
                });
                exit
            }
        }
    }

    fn signal(&self, sig: i32) {
        use std::os::fd::AsRawFd;
        match &self.pidfd {
            Some(fd) => {
                // SAFETY: pidfd_send_signal with a valid pidfd we own and a null siginfo.
                unsafe {
                    libc::syscall(
                        libc::SYS_pidfd_send_signal,
                        fd.as_raw_fd(),
                        sig,
                        std::ptr::null::<libc::siginfo_t>(),
                        0,
                    )
                };
            }
            None if self.pid > 0 && self.exit().is_none() => {
                // SAFETY: kill has no memory preconditions; without a pidfd (kernel < 5.3) this
                // is the best available, checked against the exit just above.
                unsafe { libc::kill(self.pid as i32, sig) };
            }
            None => {}
        }
    }
}

fn pidfd_open(pid: u32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    if pid == 0 {
        return None;
    }
    // SAFETY: pidfd_open has no memory arguments; the result is checked.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the syscall returned a new descriptor that nothing else owns.
    Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

fn remove_state_dir(dir: &Path) {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            tracing::warn!(dir = %dir.display(), error = %e, "could not remove the VM's state directory");
        }
        _ => {}
    }
}
