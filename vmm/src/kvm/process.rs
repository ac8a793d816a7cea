//! The service's side of a VM process: start `sandbox-vm` in its jail with every file as a
//! descriptor, hand it the machine's configuration, get the agent channel back over the control
//! socket, and turn its end (an exit it reported, a signal, the OOM killer) into a [`VmExit`].

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sandbox_devices::ConsoleLog;
use tokio::sync::watch;

use super::control::{self, DiskFd, Event, NetFd, Request, SnapshotFds, VmConfig};
use crate::backend::{Channel, StartedVm, Vm, VmError, VmExit, VmSpec};
use crate::vm_process::{pipe, pump_console, remove_state_dir, unknown_exit};

/// Memory the VM process itself may use beyond the guest's, in its cgroup: its threads'
/// stacks, the device queues' buffers (a few MiB), the binary's pages.
pub const VMM_ALLOWANCE_MIB: u64 = 64;
/// How long the VM process gets to build its machine.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest a stop waits for the process to end before SIGKILL, and then to be reaped.
const STOP_TIMEOUT: Duration = super::machine::STOP_TIMEOUT;
/// Console lines kept in a `VmExit`.
const EXIT_CONSOLE_LINES: usize = 20;
/// The longest a snapshot may take: the vCPUs stop within the machine's own bound, and writing
/// the touched part of guest memory takes seconds at most on a real disk (minutes only on an
/// emulated host under load).
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(300);

/// Where `sandbox-vm` is: `SANDBOX_HOST_VM_BINARY`, else beside this program (or one directory
/// up, for cargo's test binaries in `deps/`).
pub fn vm_binary() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("SANDBOX_HOST_VM_BINARY").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    [dir.join("sandbox-vm"), dir.join("../sandbox-vm")]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "the VM program sandbox-vm is not beside {} (build it with `cargo build -p sandbox-vmm --bins`, \
                 or set SANDBOX_HOST_VM_BINARY)",
                exe.display()
            )
        })
}

/// What the control reader learned.
#[derive(Default)]
struct Learned {
    started: Option<Result<(), String>>,
    connected: Option<Result<OwnedFd, String>>,
    diagnostics: Option<String>,
    snapshot: Option<(u64, Result<crate::backend::SnapshotDone, String>)>,
    exit: Option<VmExit>,
}

struct Control {
    /// When `start` began, and how long until the machine ran its first instruction.
    t0: Instant,
    vmm_start: OnceLock<Duration>,
    learned: Mutex<Learned>,
    changed: tokio::sync::Notify,
    changed_sync: std::sync::Condvar,
    marker: OnceLock<Duration>,
    writer: Mutex<UnixStream>,
}

impl Control {
    fn ask(&self, r: &Request) -> bool {
        let w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        control::send(&w, r, None).is_ok()
    }

    fn update(&self, f: impl FnOnce(&mut Learned)) {
        f(&mut self.learned.lock().unwrap_or_else(|e| e.into_inner()));
        self.changed.notify_waiters();
        self.changed_sync.notify_all();
    }

    /// Waits until `f` finds something, the process ends, or `within` passes.
    async fn wait_for<T>(
        &self,
        within: Duration,
        exit: &watch::Receiver<Option<VmExit>>,
        mut f: impl FnMut(&mut Learned) -> Option<T>,
    ) -> Result<T, Option<VmExit>> {
        let deadline = tokio::time::Instant::now() + within;
        let mut exit = exit.clone();
        loop {
            let notified = self.changed.notified();
            if let Some(t) = f(&mut self.learned.lock().unwrap_or_else(|e| e.into_inner())) {
                return Ok(t);
            }
            if let Some(e) = exit.borrow().clone() {
                return Err(Some(e));
            }
            tokio::select! {
                _ = notified => {}
                _ = exit.changed() => {}
                _ = tokio::time::sleep_until(deadline) => return Err(None),
            }
        }
    }
}

/// Starts `sandbox-vm` for `spec` (already prepared) and returns it with its agent channel.
pub async fn start(
    spec: &VmSpec,
    cmdline: String,
    agent_port: u32,
    vsock_cid: u64,
) -> Result<StartedVm, VmError> {
    let t0 = Instant::now();
    let program = vm_binary().map_err(VmError::MissingProgram)?;
    let kvm = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map_err(|e| VmError::io("opening /dev/kvm", e))?;
    let (ctl_host, ctl_vm) =
        UnixStream::pair().map_err(|e| VmError::io("making the control socket", e))?;
    let (console_r, console_w) = pipe("console")?;
    let (log_r, log_w) = pipe("VM log")?;
    let null = std::fs::File::open("/dev/null").map_err(|e| VmError::io("opening /dev/null", e))?;
    let mut fds: Vec<OwnedFd> = vec![null.into(), console_w, log_w, ctl_vm.into(), kvm.into()];
    let mut push = |f: OwnedFd| {
        fds.push(f);
        fds.len() as i32 - 1
    };
    let open = |p: &Path, write: bool| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(p)
            .map(OwnedFd::from)
            .map_err(|e| VmError::io(format!("opening {}", p.display()), e))
    };
    let kernel_fd = push(open(&spec.kernel, false)?);
    let initrd_fd = match &spec.initrd {
        Some(i) => Some(push(open(i, false)?)),
        None => None,
    };
    let mut disks = vec![];
    let mut fsize = 0u64;
    for d in &spec.disks {
        let f = open(&d.path, !d.read_only)?;
        if !d.read_only {
            fsize = fsize.max(std::fs::metadata(&d.path).map(|m| m.len()).unwrap_or(0));
        }
        disks.push(DiskFd {
            fd: push(f),
            read_only: d.read_only,
        });
    }
    let net = match &spec.net {
        Some(n) => {
            let (host, vm) =
                UnixStream::pair().map_err(|e| VmError::io("making the network socket", e))?;
            let fd = push(vm.into());
            Some((host, n.link.clone(), NetFd { fd, mac: n.mac }))
        }
        None => None,
    };
    // A snapshot's files: those to restore from read-only (the memory file is mapped privately,
    // so a template serves many VMs unchanged), those to write read-write.
    let mut snapshot_fds = |files: &Option<crate::backend::SnapshotFiles>, write: bool| {
        files
            .as_ref()
            .map(|f| -> Result<SnapshotFds, VmError> {
                Ok(SnapshotFds {
                    state_fd: push(open(&f.state, write)?),
                    memory_fd: push(open(&f.memory, write)?),
                })
            })
            .transpose()
    };
    let restore = snapshot_fds(&spec.restore_from, false)?;
    let snapshot_to = snapshot_fds(&spec.snapshot_to, true)?;
    if spec.snapshot_to.is_some() {
        // The memory file is as large as guest memory: the VM's file size limit must allow it.
        fsize = fsize.max(super::snapshot::memory_file_len(
            u64::from(spec.memory_mib) << 20,
        ));
    }
    let config = VmConfig {
        restore,
        snapshot_to,
        kvm_fd: 4,
        kernel_fd,
        initrd_fd,
        cmdline,
        memory_mib: spec.memory_mib,
        vcpus: spec.vcpus,
        disks,
        vsock_cid,
        net: net.as_ref().map(|(_, _, n)| n.clone()),
    };

    let staging = spec.state_dir.join("root");
    std::fs::create_dir(&staging)
        .map_err(|e| VmError::io(format!("creating {}", staging.display()), e))?;
    let allowance = crate::config::vmm_allowance_mib()
        .map_err(|e| VmError::InvalidSpec(e.to_string()))?
        .unwrap_or(VMM_ALLOWANCE_MIB);
    let limits = sandbox_jail::Limits {
        memory_bytes: (u64::from(spec.memory_mib) + allowance) << 20,
        // Its threads: main, control, marker, supervisor, devices, the network's two, a vCPU
        // each; and room for the C library's.
        pids: 16 + u64::from(spec.vcpus),
        cpu_weight: 100 * u32::from(spec.vcpus),
    };
    let cmd = sandbox_jail::Command {
        name: spec.id.clone(),
        program: Some(program.clone()),
        args: vec![],
        fds,
        root: Some(sandbox_jail::Root {
            staging,
            system: true,
            ..Default::default()
        }),
        limits,
        nofile: 128,
        fsize: Some(fsize.max(1 << 20)),
        keep_groups: vec![],
        seccomp: true,
    };
    let spawned = Instant::now();
    let jailer = sandbox_jail::global();
    let jailed = tokio::task::spawn_blocking(move || jailer.spawn(cmd))
        .await
        .map_err(|e| VmError::Start(format!("the jail's spawner failed: {e}")))?
        .map_err(|e| {
            VmError::Start(format!("cannot run {} in its jail: {e}", program.display()))
        })?;
    let jailed = Arc::new(jailed);

    let console = Arc::new(Mutex::new(ConsoleLog::default()));
    for (fd, prefix) in [(console_r, ""), (log_r, "sandbox-vm: ")] {
        if let Ok(r) = tokio::net::unix::pipe::Receiver::from_owned_fd(fd) {
            tokio::spawn(pump_console(r, console.clone(), prefix));
        }
    }
    let writer = ctl_host
        .try_clone()
        .map_err(|e| VmError::io("the control socket", e))?;
    let control = Arc::new(Control {
        t0,
        vmm_start: OnceLock::new(),
        learned: Mutex::new(Learned::default()),
        changed: tokio::sync::Notify::new(),
        changed_sync: std::sync::Condvar::new(),
        marker: OnceLock::new(),
        writer: Mutex::new(writer),
    });
    let (reader_done_tx, reader_done_rx) = tokio::sync::oneshot::channel::<()>();
    {
        let control = control.clone();
        std::thread::Builder::new()
            .name("vm-control-reader".into())
            .spawn(move || {
                read_events(&ctl_host, &control, spawned);
                let _ = reader_done_tx.send(());
            })
            .map_err(|e| VmError::io("starting the control reader", e))?;
    }
    let (exit_tx, exit_rx) = watch::channel(None);
    let exit_tx = Arc::new(exit_tx);
    let kill_reason = Arc::new(Mutex::new(None));
    let stop_requested = Arc::new(std::sync::atomic::AtomicBool::new(false));
    tokio::spawn(wait_exit(
        jailed.clone(),
        limits,
        control.clone(),
        console.clone(),
        exit_tx.clone(),
        kill_reason.clone(),
        stop_requested.clone(),
        reader_done_rx,
    ));
    if let Some((host, link, _)) = net {
        host.set_nonblocking(true)
            .map_err(|e| VmError::io("the network socket", e))?;
        let s = tokio::net::UnixStream::from_std(host)
            .map_err(|e| VmError::io("the network socket", e))?;
        tokio::spawn(crate::qemu::netpump::run(s, link, exit_rx.clone()));
    }
    let vm = ProcessVm {
        jailed,
        control: control.clone(),
        console,
        exit: exit_rx.clone(),
        exit_tx,
        kill_reason,
        stop_requested,
        state_dir: spec.state_dir.clone(),
        snapshots: std::sync::atomic::AtomicU64::new(0),
    };

    if !control.ask(&Request::Start(config)) {
        vm.stop(Duration::ZERO).await;
        return Err(VmError::Start(
            "the VM process closed its control socket".into(),
        ));
    }
    match control
        .wait_for(START_TIMEOUT, &exit_rx, |l| l.started.take())
        .await
    {
        Ok(Ok(())) => {}
        Ok(Err(why)) => {
            vm.stop(Duration::ZERO).await;
            return Err(VmError::Start(why));
        }
        Err(Some(exit)) => return Err(VmError::DiedEarly(exit)),
        Err(None) => {
            vm.stop(Duration::ZERO).await;
            return Err(VmError::Start(format!(
                "the VM process did not build its machine within {START_TIMEOUT:?}"
            )));
        }
    }
    // The caller's bound, as on QEMU: a nested host under load needs more than the default.
    let within = spec.start_timeout.unwrap_or(Duration::from_secs(60));
    control.ask(&Request::Connect {
        port: agent_port,
        timeout_ms: within.as_millis() as u64,
    });
    let stream = match control
        .wait_for(within + Duration::from_secs(5), &exit_rx, |l| {
            l.connected.take()
        })
        .await
    {
        Ok(Ok(fd)) => fd,
        Ok(Err(why)) => {
            let console = vm.console_tail(8);
            vm.stop(Duration::ZERO).await;
            return Err(VmError::Start(format!(
                "the guest agent did not accept the host's connection within {within:?}: {why}{}",
                crate::backend::console_suffix(&console)
            )));
        }
        Err(Some(exit)) => return Err(VmError::DiedEarly(exit)),
        Err(None) => {
            vm.stop(Duration::ZERO).await;
            return Err(VmError::Start(format!(
                "the VM process did not answer a connection request within {within:?}"
            )));
        }
    };
    let stream = UnixStream::from(stream);
    stream
        .set_nonblocking(true)
        .map_err(|e| VmError::io("the agent channel", e))?;
    let stream = tokio::net::UnixStream::from_std(stream)
        .map_err(|e| VmError::io("the agent channel", e))?;
    let (read, write) = stream.into_split();
    Ok(StartedVm {
        vm: Box::new(vm),
        channel: Channel {
            read: Box::new(read),
            write: Box::new(write),
        },
    })
}

/// The control reader: the VM process's events, until it closes the socket. What it says is
/// bounded and parsed like guest data; a malformed line ends the reading (the VM is then judged
/// by how its process ends).
fn read_events(sock: &UnixStream, control: &Control, spawned: Instant) {
    let mut reader = control::Reader::new(sock);
    loop {
        let event = match reader.read::<Event>() {
            Ok(Some(e)) => e,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("a VM process sent a bad control message: {e}");
                return;
            }
        };
        match event {
            Event::Started => {
                let _ = control.vmm_start.set(control.t0.elapsed());
                control.update(|l| l.started = Some(Ok(())))
            }
            Event::Error(why) => control.update(|l| l.started = Some(Err(why))),
            Event::Marker => {
                let _ = control.marker.set(spawned.elapsed());
            }
            Event::Connected => {
                let fd = reader.take_fd();
                control.update(|l| {
                    l.connected =
                        Some(fd.ok_or_else(|| "no descriptor came with the connection".to_string()))
                });
            }
            Event::ConnectFailed(why) => control.update(|l| l.connected = Some(Err(why))),
            Event::Diagnostics(d) => control.update(|l| l.diagnostics = Some(d)),
            Event::Snapshot { id, result } => control.update(|l| l.snapshot = Some((id, result))),
            Event::Exit {
                reason,
                requested,
                console,
            } => control.update(|l| {
                l.exit = Some(VmExit {
                    reason,
                    requested,
                    console: console.into_iter().take(EXIT_CONSOLE_LINES).collect(),
                })
            }),
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn wait_exit(
    jailed: Arc<sandbox_jail::Jailed>,
    limits: sandbox_jail::Limits,
    control: Arc<Control>,
    console: Arc<Mutex<ConsoleLog>>,
    tx: Arc<watch::Sender<Option<VmExit>>>,
    kill_reason: Arc<Mutex<Option<String>>>,
    stop_requested: Arc<std::sync::atomic::AtomicBool>,
    reader_done: tokio::sync::oneshot::Receiver<()>,
) {
    let status = jailed.wait().await;
    // The process is gone: the reader reaches the end of what it said (bounded anyway).
    let _ = tokio::time::timeout(Duration::from_secs(2), reader_done).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let lines = console
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .tail(EXIT_CONSOLE_LINES);
    let reported = control
        .learned
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .exit
        .take();
    let killed = kill_reason
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let requested = stop_requested.load(std::sync::atomic::Ordering::SeqCst);
    let exit = if let Some(reason) = killed {
        VmExit {
            reason,
            requested: false,
            console: lines,
        }
    } else if status.oom_kills > 0 {
        VmExit {
            reason: format!(
                "out of memory: the VM's process used more than its limit of {} MiB (the guest's \
                 memory and the VMM's allowance, SANDBOX_HOST_VMM_ALLOWANCE_MIB) and the kernel \
                 killed it",
                limits.memory_bytes >> 20
            ),
            requested: false,
            console: lines,
        }
    } else if let Some(mut e) = reported {
        if e.console.is_empty() {
            e.console = lines;
        }
        e
    } else {
        VmExit {
            reason: match (status.signal(), status.code()) {
                (Some(_), _) if requested => "stopped by the host".into(),
                (Some(sig), _) => format!("the VM process was killed by signal {sig}"),
                (None, Some(super::seal::SIGSYS_EXIT)) => {
                    "a thread of the VM process made a system call outside its seccomp filter \
                     (the console's last lines name the call): a bug of sandbox-vm, or a guest \
                     that took over a VMM thread"
                        .into()
                }
                (None, Some(code)) => format!("the VM process exited with status {code}"),
                _ => "the VM process ended".into(),
            },
            requested,
            console: lines,
        }
    };
    tx.send_replace(Some(exit));
}

/// A VM in a process of its own.
pub struct ProcessVm {
    jailed: Arc<sandbox_jail::Jailed>,
    control: Arc<Control>,
    console: Arc<Mutex<ConsoleLog>>,
    exit: watch::Receiver<Option<VmExit>>,
    exit_tx: Arc<watch::Sender<Option<VmExit>>>,
    kill_reason: Arc<Mutex<Option<String>>>,
    stop_requested: Arc<std::sync::atomic::AtomicBool>,
    state_dir: PathBuf,
    /// Numbers snapshot requests.
    snapshots: std::sync::atomic::AtomicU64,
}

impl ProcessVm {
    /// Waits for the process's end for at most `within`; SIGKILL and a bounded reap after that.
    async fn ended(&self, within: Duration) -> VmExit {
        if let Ok(e) = tokio::time::timeout(within, self.wait()).await {
            return e;
        }
        self.jailed.signal(libc::SIGKILL);
        match tokio::time::timeout(STOP_TIMEOUT, self.wait()).await {
            Ok(e) => e,
            Err(_) => {
                let exit = VmExit {
                    reason: format!(
                        "the VM process (pid {}) did not end within {STOP_TIMEOUT:?} of SIGKILL; it is left behind",
                        self.jailed.pid()
                    ),
                    requested: false,
                    console: self.console_tail(EXIT_CONSOLE_LINES),
                };
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
}

#[async_trait]
impl Vm for ProcessVm {
    fn exit(&self) -> Option<VmExit> {
        self.exit.borrow().clone()
    }

    async fn wait(&self) -> VmExit {
        let mut rx = self.exit.clone();
        match rx.wait_for(Option::is_some).await {
            Ok(e) => e.clone().unwrap_or_else(unknown_exit),
            Err(_) => unknown_exit(),
        }
    }

    async fn stop(&self, _grace: Duration) -> VmExit {
        // As in-process: no grace is needed (disks are written through); the machine stops
        // its vCPUs at once and the process reports and ends.
        if self.exit().is_none() {
            self.stop_requested
                .store(true, std::sync::atomic::Ordering::SeqCst);
            if !self.control.ask(&Request::Stop) {
                self.jailed.signal(libc::SIGKILL);
            }
        }
        let exit = self.ended(STOP_TIMEOUT).await;
        remove_state_dir(&self.state_dir);
        exit
    }

    async fn kill(&self, reason: String) -> VmExit {
        if self.exit().is_none() {
            *self.kill_reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
            self.jailed.signal(libc::SIGKILL);
        }
        let exit = self.ended(Duration::ZERO).await;
        remove_state_dir(&self.state_dir);
        exit
    }

    fn console_tail(&self, n: usize) -> Vec<String> {
        self.console
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .tail(n)
    }

    async fn snapshot(&self, resume: bool) -> Result<crate::backend::SnapshotDone, VmError> {
        if let Some(e) = self.exit() {
            return Err(VmError::Snapshot(format!("the VM has ended: {}", e.reason)));
        }
        let id = self
            .snapshots
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if !self.control.ask(&Request::Snapshot { id, resume }) {
            return Err(VmError::Snapshot(
                "the VM process closed its control socket".into(),
            ));
        }
        let answer = self
            .control
            .wait_for(SNAPSHOT_TIMEOUT, &self.exit, |l| match l.snapshot.take() {
                Some((i, r)) if i == id => Some(r),
                // A late answer to an earlier request that timed out: dropped.
                _ => None,
            })
            .await;
        match answer {
            Ok(Ok(done)) => Ok(done),
            Ok(Err(why)) => Err(VmError::Snapshot(why)),
            Err(Some(exit)) => Err(VmError::Snapshot(format!(
                "the VM ended while its snapshot was taken: {}",
                exit.reason
            ))),
            Err(None) => {
                // Paused or running, writing or not: nobody can say. It is ended.
                let why = format!(
                    "the VM process did not write its snapshot within {SNAPSHOT_TIMEOUT:?}"
                );
                self.kill(why.clone()).await;
                Err(VmError::Snapshot(format!("{why}; the VM was stopped")))
            }
        }
    }

    fn diagnostics(&self) -> String {
        // Asked of the process, answered within a moment or not at all (it may be the reason
        // the VM is being given up on).
        if self.exit().is_some() || !self.control.ask(&Request::Diagnostics) {
            return String::new();
        }
        let deadline = Instant::now() + Duration::from_millis(500);
        let mut learned = self
            .control
            .learned
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(d) = learned.diagnostics.take() {
                return d;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return String::new();
            }
            learned = self
                .control
                .changed_sync
                .wait_timeout(learned, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    fn pid(&self) -> Option<u32> {
        Some(self.jailed.pid())
    }

    fn boot_marker(&self) -> Option<Duration> {
        self.control.marker.get().copied()
    }

    fn vmm_start(&self) -> Option<Duration> {
        self.control.vmm_start.get().copied()
    }
}

impl Drop for ProcessVm {
    fn drop(&mut self) {
        if self.exit().is_none() {
            self.jailed.signal(libc::SIGKILL);
        }
        remove_state_dir(&self.state_dir);
    }
}
