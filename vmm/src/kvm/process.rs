//! The service's side of a VM process: start `sandbox-vm` in its jail with every file as a
//! descriptor, hand it the machine's configuration, get the agent channel back over the control
//! socket, and turn its end (an exit it reported, a signal, the OOM killer) into a [`VmExit`].

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::watch;

use super::control::{Control, read_events, told};
use super::judge::ProcessEnd;
use crate::backend::{
    MissingProgram, SpecError, StartedVm, Vm, VmError, VmExit, VmSnapshotError, VmSpec,
    VmStartError,
};
use crate::supervised::{Kind, Spawn, Supervised, pipe};
use sandbox_control::link::NetLink;
use sandbox_control::vm::{self as control, DiskFd, NetFd, Request, SnapshotFds, VmConfig};

/// Memory the VM process itself may use beyond the guest's, in its cgroup: its threads'
/// stacks, the device queues' buffers (a few MiB), the binary's pages.
pub const VMM_ALLOWANCE_MIB: u64 = 64;
/// How long the VM process gets to build its machine.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest a stop waits for the process to end before SIGKILL, and then to be reaped.
const STOP_TIMEOUT: Duration = sandbox_control::vm::STOP_TIMEOUT;
/// The longest a snapshot may take: the vCPUs stop within the machine's own bound, and writing
/// the touched part of guest memory takes seconds at most on a real disk (minutes only on an
/// emulated host under load).
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(300);

/// How long after its answer a VM process may take to close a snapshot's state pipe.
const STATE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a VM process taken on again may take to answer its adoption, and then to connect
/// to its agent.
const ADOPT_TIMEOUT: Duration = Duration::from_secs(5);

/// The socket a VM process that may outlive the service listens on for the service's next run,
/// in its state directory.
pub const CONTROL_SOCKET: &str = "control.sock";

/// Where `sandbox-vm` is: `SANDBOX_HOST_VM_BINARY`, else beside this program (or one directory
/// up, for cargo's test binaries in `deps/`).
pub fn vm_binary() -> Result<PathBuf, MissingProgram> {
    if let Some(p) = std::env::var_os("SANDBOX_HOST_VM_BINARY").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(MissingProgram::OwnPath)?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    [dir.join("sandbox-vm"), dir.join("../sandbox-vm")]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or(MissingProgram::VmProgram(exe))
}

/// Starts `sandbox-vm` for `spec` (already prepared) and returns it with its agent channel.
pub async fn start(
    spec: &VmSpec,
    cmdline: String,
    agent_port: u32,
    vsock_cid: u64,
) -> Result<StartedVm, VmError> {
    let program = vm_binary()?;
    start_program(program, spec, cmdline, agent_port, vsock_cid).await
}

/// [`start`] with the VM program named: the tests run stand-ins that misbehave.
async fn start_program(
    program: PathBuf,
    spec: &VmSpec,
    cmdline: String,
    agent_port: u32,
    vsock_cid: u64,
) -> Result<StartedVm, VmError> {
    let t0 = Instant::now();
    let (d, mut config) = descriptors(spec)?;
    config.cmdline = cmdline;
    config.vsock_cid = vsock_cid;
    let cmd = jail_command(&program, spec, d.fds, d.fsize)?;
    let limit_mib = cmd.limits.memory_bytes >> 20;
    let spawned = Instant::now();
    let writer = d
        .control
        .try_clone()
        .map_err(|e| VmError::io("the control socket", e))?;
    let control = Arc::new(Control::new(t0, writer));
    let (reader_done_tx, reader_done_rx) = tokio::sync::oneshot::channel::<()>();
    let process = Supervised::spawn(
        Spawn {
            kind: Kind {
                name: "the VM process",
                state_dir: Some(spec.state_dir.clone()),
                reap_within: STOP_TIMEOUT,
                line: told,
            },
            cmd,
            outputs: vec![(d.console, ""), (d.log, "sandbox-vm: ")],
        },
        Box::new(ProcessEnd {
            control: control.clone(),
            reader_done: Some(reader_done_rx),
        }),
    )
    .await?;
    {
        let control = control.clone();
        let ctl_host = d.control;
        std::thread::Builder::new()
            .name("vm-control-reader".into())
            .spawn(move || {
                read_events(&ctl_host, &control, spawned);
                let _ = reader_done_tx.send(());
            })
            .map_err(|e| VmError::io("starting the control reader", e))?;
    }
    let exit_rx = process.exit_watch();
    if let Some((host, link)) = d.pumped {
        host.set_nonblocking(true)
            .map_err(|e| VmError::io("the network socket", e))?;
        let s = tokio::net::UnixStream::from_std(host)
            .map_err(|e| VmError::io("the network socket", e))?;
        tokio::spawn(crate::netpump::run(s, link, exit_rx.clone()));
    }
    let vm = ProcessVm {
        process,
        control: control.clone(),
        exit: exit_rx.clone(),
        snapshots: std::sync::atomic::AtomicU64::new(0),
        snapshot_to: spec.snapshot_to.clone(),
        memory_mib: spec.memory_mib,
        adoptable: d.token.map(|t| Adoptable {
            token: t,
            state_dir: spec.state_dir.clone(),
            limit_mib,
        }),
    };
    vm.build_machine(config).await?;
    // The caller's bound, as on QEMU: a nested host under load needs more than the default.
    let within = spec.start_timeout.unwrap_or(Duration::from_secs(60));
    let stream = vm.connect_agent(agent_port, within).await?;
    let stream = UnixStream::from(stream);
    stream
        .set_nonblocking(true)
        .map_err(|e| VmError::io("the agent channel", e))?;
    let stream = tokio::net::UnixStream::from_std(stream)
        .map_err(|e| VmError::io("the agent channel", e))?;
    Ok(StartedVm::over_socket(Box::new(vm), stream))
}

/// The VM process of sandbox `id` that a previous run of the service started with `outlive`
/// (`record` says which), taken on again: adopted (its pid, start time, uid and cgroup), its
/// control socket connected anew on [`CONTROL_SOCKET`] and answering with its token and this
/// service's protocol version, and its agent connected anew (the old channel's host end closed
/// with the old service). The VM and its agent's channel, or why not; a process that was
/// adopted is killed on failure.
pub(crate) async fn adopt(
    id: &str,
    record: &crate::adopt::VmRecord,
    snapshot_to: Option<crate::adopt::SnapshotTo>,
) -> Result<(Box<dyn Vm>, tokio::net::UnixStream), crate::adopt::AdoptVmError> {
    use crate::adopt::AdoptVmError;
    let token = record
        .token
        .clone()
        .ok_or_else(|| AdoptVmError::Control("no token of adoption is recorded".into()))?;
    let identity = sandbox_jail::Identity {
        pid: record.pid,
        start_time: record.start_time,
        uid: record.uid,
        cgroup: record.cgroup.clone(),
    };
    let t0 = Instant::now();
    let path = record.state_dir.join(CONTROL_SOCKET);
    let connected = tokio::task::spawn_blocking(move || adopt_control(&path, &token))
        .await
        .map_err(|e| AdoptVmError::Control(e.to_string()))?;
    let (sock, reader) = connected.map_err(AdoptVmError::Control)?;
    let writer = sock
        .try_clone()
        .map_err(|e| AdoptVmError::Control(format!("the control socket: {e}")))?;
    let control = Arc::new(Control::new(t0, writer));
    let (reader_done_tx, reader_done_rx) = tokio::sync::oneshot::channel::<()>();
    let process = Supervised::adopt(
        Kind {
            name: "the VM process",
            state_dir: Some(record.state_dir.clone()),
            reap_within: STOP_TIMEOUT,
            line: told,
        },
        identity,
        id.to_string(),
        record.memory_mib,
        Box::new(ProcessEnd {
            control: control.clone(),
            reader_done: Some(reader_done_rx),
        }),
    )
    .await?;
    {
        let control = control.clone();
        std::thread::Builder::new()
            .name("vm-control-reader".into())
            .spawn(move || {
                super::control::read_events_from(reader, &control, t0);
                drop(sock);
                let _ = reader_done_tx.send(());
            })
            .map_err(|e| AdoptVmError::Control(format!("starting the control reader: {e}")))?;
    }
    let vm = ProcessVm {
        exit: process.exit_watch(),
        process,
        control,
        snapshots: std::sync::atomic::AtomicU64::new(0),
        memory_mib: snapshot_to.as_ref().map_or(0, |s| s.memory_mib),
        snapshot_to: snapshot_to.map(|s| s.files),
        adoptable: Some(Adoptable {
            token: record.token.clone().unwrap_or_default(),
            state_dir: record.state_dir.clone(),
            limit_mib: record.memory_mib,
        }),
    };
    let stream = match vm.connect_agent(super::AGENT_PORT, ADOPT_TIMEOUT).await {
        Ok(s) => s,
        Err(e) => return Err(AdoptVmError::Agent(e.to_string())),
    };
    let stream = UnixStream::from(stream);
    let stream = stream
        .set_nonblocking(true)
        .and_then(|()| tokio::net::UnixStream::from_std(stream))
        .map_err(|e| AdoptVmError::Agent(format!("its channel: {e}")))?;
    Ok((Box::new(vm), stream))
}

/// Connects to the control socket of a VM process that outlived the service and asks it to be
/// adopted: it must answer with this service's protocol version and `token`, within
/// [`ADOPT_TIMEOUT`].
fn adopt_control(path: &Path, token: &str) -> Result<(UnixStream, control::Reader), String> {
    let sock =
        UnixStream::connect(path).map_err(|e| format!("connecting to {}: {e}", path.display()))?;
    control::send(&sock, &Request::Adopt, None).map_err(|e| format!("asking it: {e}"))?;
    let mut reader = control::Reader::new(&sock).within(ADOPT_TIMEOUT);
    let answer = reader.read::<control::Event>();
    if reader.take_fd().is_some() {
        return Err("it sent a descriptor".into());
    }
    match answer {
        Ok(Some(control::Event::Adopted { version, .. })) if version != control::VERSION => {
            Err(format!(
                "it speaks control protocol {version}, this sandbox host {} (an upgrade that \
                 changed the protocol cannot take it on)",
                control::VERSION
            ))
        }
        Ok(Some(control::Event::Adopted { token: t, .. }))
            if crate::adopt::same_token(&t, token) =>
        {
            reader
                .unbounded()
                .map(|r| (sock, r))
                .map_err(|e| format!("the control socket: {e}"))
        }
        Ok(Some(control::Event::Adopted { .. })) => Err("it answered with another token".into()),
        Ok(Some(_)) => Err("it answered an adoption with something else".into()),
        Ok(None) => Err("it closed the connection".into()),
        Err(e) => Err(format!("its answer: {e}")),
    }
}

/// The host's end of a VM's network socket and the in-process link a pump serves over it.
type Pumped = (UnixStream, Arc<dyn sandbox_control::link::FrameLink>);

/// What the VM process inherits, and the host's ends.
struct Descriptors {
    /// 0: `/dev/null`, 1: the console pipe, 2: its log, 3: the control socket, 4: KVM, then
    /// its kernel, initramfs, disks, network and snapshot as [`VmConfig`] numbers them.
    fds: Vec<OwnedFd>,
    /// Its largest writable disk: the largest file it may write.
    fsize: u64,
    /// The host's end of the control socket.
    control: UnixStream,
    /// The read ends of its console and log.
    console: OwnedFd,
    log: OwnedFd,
    /// The frames of an in-process link, which a pump here serves.
    pumped: Option<Pumped>,
    /// The token of adoption of a VM process that may outlive the service.
    token: Option<String>,
}

/// Every file the VM process gets, as a descriptor (it opens nothing itself), and the machine's
/// configuration that names them; its command line and vsock id are the caller's to set.
fn descriptors(spec: &VmSpec) -> Result<(Descriptors, VmConfig), VmError> {
    let kvm = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map_err(|e| VmError::io("opening /dev/kvm", e))?;
    let (control, ctl_vm) =
        UnixStream::pair().map_err(|e| VmError::io("making the control socket", e))?;
    let (console, console_w) = pipe("console")?;
    let (log, log_w) = pipe("VM log")?;
    let null = std::fs::File::open("/dev/null").map_err(|e| VmError::io("opening /dev/null", e))?;
    let mut fds = Inherited(vec![
        null.into(),
        console_w,
        log_w,
        ctl_vm.into(),
        kvm.into(),
    ]);
    let kernel_fd = fds.push(open_file(&spec.kernel, false)?);
    let initrd_fd = match &spec.initrd {
        Some(i) => Some(fds.push(open_file(i, false)?)),
        None => None,
    };
    let mut disks = vec![];
    let mut fsize = 0u64;
    for d in &spec.disks {
        let f = open_file(&d.path, !d.read_only)?;
        if !d.read_only {
            fsize = fsize.max(std::fs::metadata(&d.path).map(|m| m.len()).unwrap_or(0));
        }
        disks.push(DiskFd {
            fd: fds.push(f),
            read_only: d.read_only,
        });
    }
    let (net, pumped) = match &spec.net {
        Some(n) => {
            let (vm, pumped) = net_socket(n)?;
            let net = NetFd {
                fd: fds.push(vm),
                mac: n.mac,
            };
            (Some(net), pumped)
        }
        None => (None, None),
    };
    // A snapshot to restore from, read-only (the memory file is mapped privately, so a template
    // serves many VMs unchanged). Where a snapshot is written is handed over only with each
    // request for one: until then the process holds no file but its disks to write, and its
    // file size limit is its largest disk's.
    let restore = match &spec.restore_from {
        Some(f) => Some(SnapshotFds {
            state_fd: fds.push(open_file(&f.state, false)?),
            memory_fd: fds.push(open_file(&f.memory, false)?),
        }),
        None => None,
    };
    // A VM that may outlive the service listens for its next run in its state directory.
    let (adopt_fd, token) = if spec.outlive {
        let path = spec.state_dir.join(CONTROL_SOCKET);
        let listener = std::os::unix::net::UnixListener::bind(&path)
            .map_err(|e| VmError::io(format!("making the socket {}", path.display()), e))?;
        let token = crate::adopt::new_token()
            .map_err(|e| VmError::io("making the token of adoption", e))?;
        (Some(fds.push(listener.into())), Some(token))
    } else {
        (None, None)
    };
    let config = VmConfig {
        version: sandbox_control::vm::VERSION,
        adopt_fd,
        token: token.clone().unwrap_or_default(),
        restore,
        kvm_fd: 4,
        kernel_fd,
        initrd_fd,
        cmdline: String::new(),
        memory_mib: spec.memory_mib,
        vcpus: spec.vcpus,
        disks,
        vsock_cid: 0,
        net,
    };
    let d = Descriptors {
        fds: fds.0,
        fsize,
        control,
        console,
        log,
        pumped,
        token,
    };
    Ok((d, config))
}

/// The descriptors a VM process inherits, numbered in order.
struct Inherited(Vec<OwnedFd>);

impl Inherited {
    /// Adds one; its number in the VM process.
    fn push(&mut self, fd: OwnedFd) -> i32 {
        self.0.push(fd);
        self.0.len() as i32 - 1
    }
}

/// A file the VM process gets, opened here.
fn open_file(path: &Path, write: bool) -> Result<OwnedFd, VmError> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(path)
        .map(OwnedFd::from)
        .map_err(|e| VmError::io(format!("opening {}", path.display()), e))
}

/// The VM's end of its network: a socket whose other end the sandbox's network process holds,
/// handed over as it is; or a socket to a link in this process, which a pump here serves.
fn net_socket(
    net: &sandbox_control::link::NetAttachment,
) -> Result<(OwnedFd, Option<Pumped>), VmError> {
    match &net.link {
        NetLink::Socket(fd) => {
            let vm = fd
                .try_clone()
                .map_err(|e| VmError::io("the network socket", e))?;
            Ok((vm, None))
        }
        NetLink::Frames(link) => {
            let (host, vm) =
                UnixStream::pair().map_err(|e| VmError::io("making the network socket", e))?;
            Ok((vm.into(), Some((host, link.clone()))))
        }
    }
}

/// The jail the VM process runs in: an empty root, its memory (the guest's and its own
/// allowance), threads and processors bounded.
fn jail_command(
    program: &Path,
    spec: &VmSpec,
    fds: Vec<OwnedFd>,
    fsize: u64,
) -> Result<sandbox_jail::Command, VmError> {
    let staging = spec.state_dir.join("root");
    std::fs::create_dir(&staging)
        .map_err(|e| VmError::io(format!("creating {}", staging.display()), e))?;
    let allowance = crate::config::vmm_allowance_mib()
        .map_err(SpecError::Setting)?
        .unwrap_or(VMM_ALLOWANCE_MIB);
    let limits = sandbox_jail::Limits {
        memory_bytes: (u64::from(spec.memory_mib) + allowance) << 20,
        // Its threads: main, control, marker, supervisor, devices, the network's two, a vCPU
        // each; and room for the C library's.
        pids: 16 + u64::from(spec.vcpus),
        cpu_weight: 100 * u32::from(spec.vcpus),
        // Its vCPUs, and one more for the device, network and supervisor threads, so a guest
        // spinning every vCPU does not starve its own disk and network.
        cpus: u32::from(spec.vcpus) + 1,
    };
    Ok(sandbox_jail::Command {
        name: spec.id.clone(),
        program: Some(program.to_path_buf()),
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
        host_network: false,
        outlive: spec.outlive,
    })
}

impl ProcessVm {
    /// Hands the process its machine's configuration and waits until the machine runs.
    async fn build_machine(&self, config: VmConfig) -> Result<(), VmError> {
        if !self.control.ask(&Request::Start(config)) {
            self.stop(Duration::ZERO).await;
            return Err(VmStartError::ControlClosed.into());
        }
        match self
            .control
            .wait_for(START_TIMEOUT, &self.exit, |l| l.started.take())
            .await
        {
            Ok(Ok(())) => Ok(()),
            Ok(Err(why)) => {
                self.stop(Duration::ZERO).await;
                Err(VmStartError::Reported(why).into())
            }
            Err(Some(exit)) => Err(VmError::DiedEarly(exit)),
            Err(None) => {
                self.stop(Duration::ZERO).await;
                Err(VmStartError::BuildTimeout(START_TIMEOUT).into())
            }
        }
    }

    /// Asks the process to connect to the guest agent's port, and waits for the connection's
    /// descriptor for at most `within`.
    async fn connect_agent(&self, port: u32, within: Duration) -> Result<OwnedFd, VmError> {
        self.control.ask(&Request::Connect {
            port,
            timeout_ms: within.as_millis() as u64,
        });
        match self
            .control
            .wait_for(within + Duration::from_secs(5), &self.exit, |l| {
                l.connected.take()
            })
            .await
        {
            Ok(Ok(fd)) => Ok(fd),
            Ok(Err(why)) => {
                let console = self.console_tail(8);
                self.stop(Duration::ZERO).await;
                Err(VmStartError::AgentRefused {
                    within,
                    why,
                    console,
                }
                .into())
            }
            Err(Some(exit)) => Err(VmError::DiedEarly(exit)),
            Err(None) => {
                self.stop(Duration::ZERO).await;
                Err(VmStartError::ConnectTimeout(within).into())
            }
        }
    }
}

/// A snapshot's state as the VM process wrote it into its pipe: at most
/// [`sandbox_control::files::MAX_STATE_BYTES`], as a restore reads; more is refused.
async fn read_state(pipe: OwnedFd) -> Result<Vec<u8>, VmSnapshotError> {
    use tokio::io::AsyncReadExt;
    let max = sandbox_control::files::MAX_STATE_BYTES;
    let pipe = tokio::net::unix::pipe::Receiver::from_owned_fd(pipe)
        .map_err(VmSnapshotError::StateRead)?;
    let mut bytes = Vec::new();
    pipe.take(max + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(VmSnapshotError::StateRead)?;
    if bytes.len() as u64 > max {
        return Err(VmSnapshotError::StateTooLong(max));
    }
    Ok(bytes)
}

/// The memory file of a snapshot, sized here to the guest's memory: the VM process writes it
/// through a mapping and cannot grow it.
async fn prepare_memory_file(
    path: PathBuf,
    mem_bytes: u64,
) -> Result<std::fs::File, VmSnapshotError> {
    tokio::task::spawn_blocking(move || {
        let f = open_truncated(&path, true)?;
        sandbox_control::files::size_memory_file(&f, mem_bytes)?;
        Ok(f)
    })
    .await
    .map_err(|source| VmSnapshotError::Task {
        what: "preparing the memory file",
        source,
    })?
}

/// Writes a snapshot's state, as the VM process sent it, into its file (synced).
async fn write_state_file(path: PathBuf, bytes: Vec<u8>) -> Result<(), VmSnapshotError> {
    tokio::task::spawn_blocking(move || {
        let file = open_truncated(&path, false)?;
        sandbox_control::files::write_state_file(&bytes, &file)?;
        Ok(())
    })
    .await
    .map_err(|source| VmSnapshotError::Task {
        what: "writing the state",
        source,
    })?
}

/// A snapshot's file, opened to be written from its start (`read` too for the memory file,
/// which the VM process maps).
fn open_truncated(path: &Path, read: bool) -> Result<std::fs::File, VmSnapshotError> {
    std::fs::OpenOptions::new()
        .read(read)
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(|source| VmSnapshotError::File {
            what: "opening",
            path: path.to_path_buf(),
            source,
        })
}

/// A VM in a process of its own.
pub struct ProcessVm {
    process: Supervised,
    control: Arc<Control>,
    exit: watch::Receiver<Option<VmExit>>,
    /// Numbers snapshot requests.
    snapshots: std::sync::atomic::AtomicU64,
    /// Where a snapshot goes: opened, and handed over, only when one is asked for.
    snapshot_to: Option<crate::backend::SnapshotFiles>,
    memory_mib: u32,
    /// What the service's next run needs of a VM process that may outlive the service.
    adoptable: Option<Adoptable>,
}

/// What a VM process that may outlive the service is taken on again with.
struct Adoptable {
    token: String,
    state_dir: PathBuf,
    /// Its cgroup's memory limit.
    limit_mib: u64,
}

impl ProcessVm {
    /// The state of a snapshot the process has answered, read from its pipe: it was written
    /// before the answer, so a process that keeps the pipe open past that is given up on.
    async fn state_read(
        &self,
        mut state: tokio::task::JoinHandle<Result<Vec<u8>, VmSnapshotError>>,
    ) -> Result<Vec<u8>, VmSnapshotError> {
        match tokio::time::timeout(STATE_TIMEOUT, &mut state).await {
            Ok(read) => read.map_err(|source| VmSnapshotError::Task {
                what: "reading the state",
                source,
            })?,
            Err(_) => {
                state.abort();
                self.kill(format!(
                    "the VM process answered its snapshot but did not close the state's pipe \
                     within {STATE_TIMEOUT:?}"
                ))
                .await;
                Err(VmSnapshotError::PipeHeld(STATE_TIMEOUT))
            }
        }
    }

    /// Pauses the guest and writes its snapshot to `files`; the guest runs on after if
    /// `resume`, else stays paused until [`Vm::resume`] or its stop.
    async fn snapshot_into(
        &self,
        files: &crate::backend::SnapshotFiles,
        resume: bool,
    ) -> Result<crate::backend::SnapshotDone, VmError> {
        if let Some(e) = self.exit() {
            return Err(VmSnapshotError::Ended(e.reason).into());
        }
        let id = self
            .snapshots
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // The memory file, and a pipe for the state, which is read here, bounded.
        let memory =
            prepare_memory_file(files.memory.clone(), u64::from(self.memory_mib) << 20).await?;
        let (state_r, state_w) = pipe("snapshot state")?;
        let sent = {
            use std::os::fd::AsRawFd;
            let w = self
                .control
                .writer
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            control::send_fds(
                &w,
                &Request::Snapshot { id, resume },
                &[state_w.as_raw_fd(), memory.as_raw_fd()],
            )
            .is_ok()
        };
        // Ours closed: the pipe ends when the VM process closes its copy.
        drop((state_w, memory));
        if !sent {
            return Err(VmSnapshotError::ControlClosed.into());
        }
        // Read as it comes (a state larger than the pipe's buffer blocks the VM until it is),
        // on the runtime: aborted, the pipe closes, so no VM can pin a thread by holding it.
        let state = tokio::spawn(read_state(state_r));
        let answer = self
            .control
            .wait_for(SNAPSHOT_TIMEOUT, &self.exit, |l| match l.snapshot.take() {
                Some((i, r)) if i == id => Some(r),
                // A late answer to an earlier request that timed out: dropped.
                _ => None,
            })
            .await;
        match answer {
            Ok(Ok(done)) => {
                let bytes = self.state_read(state).await?;
                write_state_file(files.state.clone(), bytes).await?;
                Ok(done)
            }
            Ok(Err(why)) => {
                state.abort();
                Err(VmSnapshotError::Reported(why).into())
            }
            Err(Some(exit)) => {
                state.abort();
                Err(VmSnapshotError::EndedDuring(exit.reason).into())
            }
            Err(None) => {
                state.abort();
                // Paused or running, writing or not: nobody can say. It is ended.
                self.kill(format!(
                    "the VM process did not write its snapshot within {SNAPSHOT_TIMEOUT:?}"
                ))
                .await;
                Err(VmSnapshotError::Timeout(SNAPSHOT_TIMEOUT).into())
            }
        }
    }

    /// Once the process is gone: a memory file it was handed, and kept a descriptor of past
    /// its pause, cut back to the guest's size (a compromised process could write past its end,
    /// up to its file size limit).
    fn trim_snapshot(&self) {
        let (Some(files), true) = (
            &self.snapshot_to,
            self.snapshots.load(std::sync::atomic::Ordering::SeqCst) > 0,
        ) else {
            return;
        };
        let want = sandbox_control::files::memory_file_len(u64::from(self.memory_mib) << 20);
        let Ok(f) = std::fs::OpenOptions::new().write(true).open(&files.memory) else {
            return;
        };
        if f.metadata().is_ok_and(|m| m.len() > want) {
            tracing::warn!(
                file = %files.memory.display(),
                "a VM process wrote past its snapshot's memory file; cut back to the guest's size"
            );
            let _ = f.set_len(want);
        }
    }
}

#[async_trait]
impl Vm for ProcessVm {
    fn exit(&self) -> Option<VmExit> {
        self.process.exit()
    }

    async fn wait(&self) -> VmExit {
        self.process.wait().await
    }

    async fn stop(&self, _grace: Duration) -> VmExit {
        // As in-process: no grace is needed (disks are written through); the machine stops
        // its vCPUs at once and the process reports and ends.
        let control = &self.control;
        let exit = self
            .process
            .stop(STOP_TIMEOUT, |p| {
                if !control.ask(&Request::Stop) {
                    p.signal(libc::SIGKILL);
                }
            })
            .await;
        self.trim_snapshot();
        exit
    }

    async fn kill(&self, reason: String) -> VmExit {
        let exit = self.process.kill(reason).await;
        self.trim_snapshot();
        exit
    }

    fn console_tail(&self, n: usize) -> Vec<String> {
        self.process.console_tail(n).into_iter().map(told).collect()
    }

    async fn snapshot(&self, resume: bool) -> Result<crate::backend::SnapshotDone, VmError> {
        let Some(files) = &self.snapshot_to else {
            return Err(VmSnapshotError::NoFiles.into());
        };
        self.snapshot_into(files, resume).await
    }

    async fn snapshot_held(
        &self,
        to: &crate::backend::SnapshotFiles,
    ) -> Result<crate::backend::SnapshotDone, VmError> {
        self.snapshot_into(to, false).await
    }

    async fn resume(&self) -> Result<(), VmError> {
        if let Some(e) = self.exit() {
            return Err(VmSnapshotError::Ended(e.reason).into());
        }
        if !self.control.ask(&Request::Resume) {
            return Err(VmSnapshotError::ControlClosed.into());
        }
        Ok(())
    }
    async fn diagnostics(&self) -> String {
        // Asked of the process, answered within a moment or not at all (it may be the reason
        // the VM is being given up on).
        if self.exit().is_some() || !self.control.ask(&Request::Diagnostics) {
            return String::new();
        }
        self.control
            .wait_for(Duration::from_millis(500), &self.exit, |l| {
                l.diagnostics.take()
            })
            .await
            .unwrap_or_default()
    }

    fn pid(&self) -> Option<u32> {
        Some(self.process.pid())
    }

    fn record(&self) -> Option<crate::adopt::VmRecord> {
        let a = self.adoptable.as_ref()?;
        let identity = self.process.identity()?;
        Some(crate::adopt::VmRecord {
            backend: "kvm".into(),
            pid: identity.pid,
            start_time: identity.start_time,
            uid: identity.uid,
            cgroup: identity.cgroup,
            memory_mib: a.limit_mib,
            state_dir: a.state_dir.clone(),
            token: Some(a.token.clone()),
        })
    }

    fn boot_marker(&self) -> Option<Duration> {
        self.control.marker.get().copied()
    }

    fn vmm_start(&self) -> Option<Duration> {
        self.control.vmm_start.get().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    /// The stand-in of `examples/stand_in_vm.rs`, built by `cargo test` beside the tests, and
    /// whether this host lets the service open /dev/kvm (as it does for each VM).
    fn stand_in() -> Option<PathBuf> {
        if std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_err()
        {
            eprintln!("skipped: /dev/kvm cannot be opened here (the service opens it for each VM)");
            return None;
        }
        if let Some(why) = &sandbox_jail::global().status().refusal {
            eprintln!("skipped: this host refuses VM processes: {why}");
            return None;
        }
        let exe = std::env::current_exe().unwrap();
        let p = exe
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .join("examples/stand_in_vm");
        if !p.is_file() {
            // `cargo test` builds the examples; `cargo test --lib` does not.
            assert!(
                std::env::var_os("SANDBOX_HOST_REQUIRE_E2E").is_none(),
                "{} was not built: run the tests with `cargo test`",
                p.display()
            );
            eprintln!(
                "skipped: {} was not built (`cargo test` builds it)",
                p.display()
            );
            return None;
        }
        Some(p)
    }

    /// A VM spec in `dir` with a 64 MiB disk and snapshot files of a 256 MiB guest.
    fn spec(dir: &Path) -> VmSpec {
        let kernel = dir.join("kernel");
        std::fs::write(&kernel, b"not a kernel").unwrap();
        let disk = dir.join("disk.ext4");
        std::fs::File::create(&disk)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        let paused = dir.join("sbx.paused");
        std::fs::create_dir(&paused).unwrap();
        let files = crate::backend::SnapshotFiles {
            state: paused.join("snapshot.state"),
            memory: paused.join("snapshot.mem"),
            disk: None,
            take_disk: false,
        };
        for p in [&files.state, &files.memory] {
            std::fs::File::create(p).unwrap();
        }
        let state_dir = dir.join("vm");
        std::fs::create_dir(&state_dir).unwrap();
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        VmSpec {
            id: format!(
                "stand-in-{}-{}",
                std::process::id(),
                SEQ.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            ),
            memory_mib: 256,
            vcpus: 1,
            kernel,
            initrd: None,
            disks: vec![crate::backend::Disk {
                path: disk,
                read_only: false,
            }],
            scratch_disk_mib: None,
            cmdline: vec![],
            state_dir,
            net: None,
            start_timeout: Some(Duration::from_secs(20)),
            snapshot_to: Some(files),
            restore_from: None,
            outlive: false,
        }
    }

    #[tokio::test]
    async fn a_vm_process_that_reports_a_requested_stop_and_dies_of_its_filter_is_a_seccomp_kill() {
        let Some(program) = stand_in() else { return };
        let dir = tempfile::tempdir().unwrap();
        let e = match start_program(program, &spec(dir.path()), "lie".into(), 1024, 3).await {
            Err(VmError::DiedEarly(e)) => e,
            Err(other) => panic!("expected the VM to die early, got {other}"),
            Ok(_) => panic!("the stand-in never starts a machine"),
        };
        assert!(e.reason.contains("seccomp filter"), "{}", e.reason);
        assert!(!e.requested);
    }

    #[tokio::test]
    async fn a_vm_process_cannot_grow_its_disk() {
        // Its file size limit is its disk's, not its guest memory's (the snapshot's memory file
        // is written through a mapping the service sized).
        let Some(program) = stand_in() else { return };
        let dir = tempfile::tempdir().unwrap();
        let spec = spec(dir.path());
        let why = match start_program(program, &spec, "grow".into(), 1024, 3).await {
            Err(VmError::Start(VmStartError::Reported(why))) => why,
            Err(other) => panic!("expected the stand-in's report, got {other}"),
            Ok(_) => panic!("the stand-in never starts a machine"),
        };
        assert_eq!(
            why, "write: File too large (os error 27); truncate: File too large (os error 27)",
            "a 64 MiB disk grew"
        );
        let len = std::fs::metadata(&spec.disks[0].path).unwrap().len();
        assert_eq!(len, 64 << 20);
    }

    #[tokio::test]
    async fn a_vm_process_holds_no_snapshot_file_before_a_pause() {
        let Some(program) = stand_in() else { return };
        let dir = tempfile::tempdir().unwrap();
        let spec = spec(dir.path());
        let started = start_program(program, &spec, "hold".into(), 1024, 3)
            .await
            .unwrap_or_else(|e| panic!("the stand-in starts: {e}"));
        let pid = started.vm.pid().unwrap();
        let paused = dir.path().join("sbx.paused");
        let mut held = vec![];
        for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
            let fd = fd.unwrap();
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            held.push(target.display().to_string());
            assert!(
                !target.starts_with(&paused),
                "the VM process holds {} before any pause",
                target.display()
            );
        }
        assert!(
            held.iter().any(|t| t.ends_with("disk.ext4")),
            "the listing sees the VM's files: {held:?}"
        );
        let exit = started.vm.stop(Duration::ZERO).await;
        assert!(exit.requested, "{}", exit.reason);
    }
}
