//! One QEMU process: spawning it, collecting its console, noticing its end, stopping it and
//! removing everything it had on disk.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

use sandbox_control::link::{FrameLink, NetLink};

use crate::backend::{
    SpecError, StartedVm, Unsupported, Vm, VmError, VmExit, VmSnapshotError, VmSpec,
};
use crate::supervised::{Classify, Ending, Kind, Spawn, Supervised, pipe};

/// The longest a stop waits for QEMU to be reaped after SIGKILL.
const REAP_TIMEOUT: Duration = Duration::from_secs(10);

/// A QEMU process and what belongs to it.
pub struct QemuVm {
    /// The jailed QEMU process (signals go through its pidfd, never to a recycled pid).
    process: Supervised,
    /// From spawning QEMU to the guest's boot marker, once it came.
    marker: Arc<std::sync::OnceLock<Duration>>,
    /// Its monitor, what its snapshots are of, and where the spec's snapshot goes: every VM
    /// started here may be snapshotted (a pause's files, or a fork's).
    snapshot: Option<SnapshotTarget>,
    /// Where its agent's socket listens, for a VM that may outlive the service.
    agent_path: Option<PathBuf>,
    /// Its cgroup's memory limit, for the record.
    memory_mib: u64,
}

/// The name of the socket a VM that may outlive the service listens on for its agent's
/// channel, in its state directory: the next run of the service connects to it.
pub const AGENT_SOCKET: &str = "agent.sock";

/// What [`Vm::snapshot`] of a QEMU VM needs.
struct SnapshotTarget {
    monitor: tokio::sync::Mutex<Monitor>,
    header: super::snapshot::Header,
    /// The spec's `snapshot_to`: where [`Vm::snapshot`] writes.
    to: Option<crate::backend::SnapshotFiles>,
}

/// QEMU's monitor: its socket until the first snapshot, then the session on it, kept for the
/// next one and for the `cont` of a held guest.
enum Monitor {
    Socket(std::os::unix::net::UnixStream),
    Open(crate::qmp::Qmp),
    /// A command on it failed: what it answers from now on cannot be trusted to belong to
    /// the next question.
    Broken,
}

/// Memory QEMU itself may use beyond the guest's, in its cgroup: TCG keeps a translation cache
/// (bounded by `tb-size`, see [`super::args`]) and QEMU its device and I/O buffers.
pub const QEMU_ALLOWANCE_TCG_MIB: u64 = 512;
/// The same with a hardware accelerator (no translation cache).
pub const QEMU_ALLOWANCE_MIB: u64 = 256;

/// A connected pair of stream sockets: the host's end and QEMU's.
fn socket_pair(
    what: &str,
) -> Result<(std::os::unix::net::UnixStream, std::os::fd::OwnedFd), VmError> {
    let (host, vm) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| VmError::io(format!("making the {what} socket"), e))?;
    host.set_nonblocking(true)
        .map_err(|e| VmError::io(format!("making the {what} socket"), e))?;
    Ok((host, vm.into()))
}

/// A socket QEMU listens on at `path` (its chardev's `server=on`), and the host's end,
/// connected before QEMU runs (QEMU accepts it from the backlog): the next run of the service
/// connects to the same path. The state directory is the service's alone (mode 0700), so no
/// other user can.
fn listening_socket(
    path: &Path,
    what: &str,
) -> Result<(std::os::unix::net::UnixStream, OwnedFd), VmError> {
    let err = |e| VmError::io(format!("making the {what} socket {}", path.display()), e);
    let listener = std::os::unix::net::UnixListener::bind(path).map_err(err)?;
    let host = std::os::unix::net::UnixStream::connect(path).map_err(err)?;
    host.set_nonblocking(true).map_err(err)?;
    Ok((host, listener.into()))
}

/// What QEMU inherits, in order (0, 1, 2, the agent's socket, then the rest as they are
/// pushed), and where each of its devices finds its own.
struct Descriptors {
    fds: Vec<OwnedFd>,
    marker_fd: Option<i32>,
    net_fd: Option<i32>,
    qmp_fd: Option<i32>,
    restore_fd: Option<i32>,
    kvm_fd: Option<i32>,
    disk_fds: Vec<Vec<i32>>,
    /// The largest file QEMU may write: its disks, and a snapshot.
    fsize: u64,
}

impl Descriptors {
    /// Gives QEMU `fd`; returns its number there.
    fn push(&mut self, fd: OwnedFd) -> i32 {
        self.fds.push(fd);
        self.fds.len() as i32 - 1
    }
}

/// The host's ends of QEMU's sockets and pipes. QEMU's ends move into its descriptors: the host
/// keeps no copy, so QEMU's end closing (it died) is an end of file here.
struct HostEnds {
    agent: std::os::unix::net::UnixStream,
    marker: std::os::unix::net::UnixStream,
    /// The frames of an in-process link, which a pump here serves.
    pumped: Option<(std::os::unix::net::UnixStream, Arc<dyn FrameLink>)>,
    monitor: Option<std::os::unix::net::UnixStream>,
    out: OwnedFd,
    err: OwnedFd,
}

/// Spawns QEMU in its jail, with every socket and disk as an inherited descriptor.
pub async fn spawn(
    program: &Path,
    arch: super::Arch,
    accel: super::Accel,
    spec: &VmSpec,
) -> Result<StartedVm, VmError> {
    let (d, ends) = descriptors(spec, accel)?;
    let jailed_paths = sandbox_jail::global().namespaces();
    let (kernel, initrd) = if jailed_paths {
        (
            PathBuf::from("/vm/kernel"),
            spec.initrd.as_ref().map(|_| PathBuf::from("/vm/initrd")),
        )
    } else {
        (spec.kernel.clone(), spec.initrd.clone())
    };
    let wiring = super::args::Wiring {
        kernel,
        initrd,
        agent_fd: 3,
        agent_listens: spec.outlive,
        marker_fd: d.marker_fd,
        net_fd: d.net_fd,
        disk_fds: d.disk_fds,
        qmp_fd: d.qmp_fd,
        restore_fd: d.restore_fd,
        kvm_fd: d.kvm_fd,
    };
    let args = super::args::qemu_args(arch, accel, spec, &wiring);
    let cmd = jail_command(program, arch, accel, spec, args, d.fds, d.fsize)?;
    let started = std::time::Instant::now();
    let agent_path = spec.outlive.then(|| spec.state_dir.join(AGENT_SOCKET));
    let memory_mib = cmd.limits.memory_bytes >> 20;
    let process = Supervised::spawn(
        Spawn {
            kind: Kind {
                name: "QEMU",
                state_dir: Some(spec.state_dir.clone()),
                reap_within: REAP_TIMEOUT,
                line: std::convert::identity,
            },
            cmd,
            outputs: vec![(ends.out, ""), (ends.err, "qemu: ")],
        },
        Box::new(QemuEnd),
    )
    .await?;
    let exit_rx = process.exit_watch();
    let marker_time = Arc::new(std::sync::OnceLock::new());
    let s = tokio::net::UnixStream::from_std(ends.marker)
        .map_err(|e| VmError::io("watching the boot marker socket", e))?;
    tokio::spawn(time_marker(
        s,
        started,
        marker_time.clone(),
        exit_rx.clone(),
    ));
    if let Some((host, link)) = ends.pumped {
        let s = tokio::net::UnixStream::from_std(host)
            .map_err(|e| VmError::io("connecting the network socket", e))?;
        tokio::spawn(crate::netpump::run(s, link, exit_rx.clone()));
    }
    let snapshot = ends.monitor.map(|m| SnapshotTarget {
        monitor: tokio::sync::Mutex::new(Monitor::Socket(m)),
        header: super::snapshot::Header::of(arch, accel, spec),
        to: spec.snapshot_to.clone(),
    });
    if spec.restore_from.is_some() {
        greet_restored(&ends.agent)?;
    }
    let vm = QemuVm {
        snapshot,
        process,
        marker: marker_time,
        agent_path,
        memory_mib,
    };
    let stream = tokio::net::UnixStream::from_std(ends.agent)
        .map_err(|e| VmError::io("connecting the agent socket", e))?;
    Ok(StartedVm::over_socket(Box::new(vm), stream))
}

/// QEMU's descriptors for `spec`: standard input from `/dev/null`, its output and errors into
/// pipes, its agent's and boot marker's sockets, its network, its monitor and snapshot file
/// where it may be snapshotted or is restored, KVM's device, and its disks.
fn descriptors(spec: &VmSpec, accel: super::Accel) -> Result<(Descriptors, HostEnds), VmError> {
    let (agent, agent_vm) = if spec.outlive {
        listening_socket(&spec.state_dir.join(AGENT_SOCKET), "agent")?
    } else {
        socket_pair("agent")?
    };
    let (out, out_w) = pipe("QEMU output")?;
    let (err, err_w) = pipe("QEMU error")?;
    let null = std::fs::File::open("/dev/null").map_err(|e| VmError::io("opening /dev/null", e))?;
    let mut d = Descriptors {
        fds: vec![null.into(), out_w, err_w, agent_vm],
        marker_fd: None,
        net_fd: None,
        qmp_fd: None,
        restore_fd: None,
        kvm_fd: None,
        disk_fds: vec![],
        // A snapshot (every VM may have one: a pause's or a fork's): the guest's memory, a
        // header per page, and the devices' state.
        fsize: (u64::from(spec.memory_mib) << 20)
            + (u64::from(spec.memory_mib) << 10) * 3
            + (64 << 20),
    };
    // The boot marker: an I/O port on x86_64, a virtio-serial port on aarch64 (see args).
    let (marker, marker_vm) = socket_pair("boot marker")?;
    d.marker_fd = Some(d.push(marker_vm));
    // The network: a socket whose other end the sandbox's network process holds, handed over
    // as it is; or a link in this process, which a pump here serves.
    let mut pumped = None;
    if let Some(n) = &spec.net {
        let vm = match &n.link {
            NetLink::Socket(fd) => fd
                .try_clone()
                .map_err(|e| VmError::io("the network socket", e))?,
            NetLink::Frames(link) => {
                let (host, vm) = socket_pair("network")?;
                pumped = Some((host, link.clone()));
                vm
            }
        };
        d.net_fd = Some(d.push(vm));
    }
    // Every VM gets its monitor, so that any can be snapshotted (a pause, a fork): a snapshot's
    // memory file comes over it with the snapshot, by `add-fd`, so until then QEMU holds no
    // file it could write one to. A VM restored from one gets that file to read.
    let (host, vm) = socket_pair("monitor")?;
    d.qmp_fd = Some(d.push(vm));
    let monitor = Some(host);
    if let Some(from) = &spec.restore_from {
        let f = std::fs::File::open(&from.memory)
            .map_err(|e| VmError::io(format!("opening {}", from.memory.display()), e))?;
        d.restore_fd = Some(d.push(f.into()));
    }
    // KVM's device, opened here: QEMU gets no device node and no group of the service's.
    if accel == super::Accel::Kvm {
        let kvm = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .map_err(|e| VmError::io("opening /dev/kvm", e))?;
        d.kvm_fd = Some(d.push(kvm.into()));
    }
    push_disks(&mut d, spec)?;
    let ends = HostEnds {
        agent,
        marker,
        pumped,
        monitor,
        out,
        err,
    };
    Ok((d, ends))
}

/// Each disk, twice if writable: QEMU opens a writable disk read-only first, then read-write,
/// and its fd set holds both.
fn push_disks(d: &mut Descriptors, spec: &VmSpec) -> Result<(), VmError> {
    for disk in &spec.disks {
        let open = |write: bool| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(write)
                .open(&disk.path)
                .map_err(|e| VmError::io(format!("opening the disk {}", disk.path.display()), e))
        };
        let mut set = vec![];
        if !disk.read_only {
            let f = open(true)?;
            d.fsize = d.fsize.max(f.metadata().map(|m| m.len()).unwrap_or(0));
            set.push(d.push(f.into()));
        }
        set.push(d.push(open(false)?.into()));
        d.disk_fds.push(set);
    }
    Ok(())
}

/// The jail QEMU runs in: a root with its kernel and initramfs alone, its memory (the guest's
/// and its own allowance), threads and processors bounded, none of the service's groups.
fn jail_command(
    program: &Path,
    arch: super::Arch,
    accel: super::Accel,
    spec: &VmSpec,
    args: Vec<std::ffi::OsString>,
    fds: Vec<OwnedFd>,
    fsize: u64,
) -> Result<sandbox_jail::Command, VmError> {
    let staging = spec.state_dir.join("root");
    std::fs::create_dir(&staging)
        .map_err(|e| VmError::io(format!("creating {}", staging.display()), e))?;
    let mut binds = vec![sandbox_jail::Bind {
        src: spec.kernel.clone(),
        dst: "/vm/kernel".into(),
        writable: false,
    }];
    if let Some(i) = &spec.initrd {
        binds.push(sandbox_jail::Bind {
            src: i.clone(),
            dst: "/vm/initrd".into(),
            writable: false,
        });
    }
    // None of the service's groups: not `kvm` (KVM comes as a descriptor), not the group that
    // reads its settings. Except for QEMU with KVM on aarch64, which opens `/dev/kvm` by path
    // besides (a scratch vCPU to learn the host's CPU and GIC): the node and its group stay.
    let (devices, keep_groups) = if accel == super::Accel::Kvm && arch == super::Arch::Aarch64 {
        (
            vec![PathBuf::from("/dev/kvm")],
            kvm_group().into_iter().collect(),
        )
    } else {
        (vec![], vec![])
    };
    let allowance = crate::config::vmm_allowance_mib()
        .map_err(SpecError::Setting)?
        .unwrap_or(if accel == super::Accel::Tcg {
            QEMU_ALLOWANCE_TCG_MIB
        } else {
            QEMU_ALLOWANCE_MIB
        });
    let limits = sandbox_jail::Limits {
        memory_bytes: (u64::from(spec.memory_mib) + allowance) << 20,
        // QEMU's threads: the main loop, RCU, one per vCPU, and its block I/O pool (up to 64).
        pids: 128 + u64::from(spec.vcpus),
        cpu_weight: 100 * u32::from(spec.vcpus),
        // Its vCPUs, and one more for the main loop and I/O threads that emulate its devices.
        cpus: u32::from(spec.vcpus) + 1,
    };
    Ok(sandbox_jail::Command {
        name: spec.id.clone(),
        program: Some(program.to_path_buf()),
        args,
        fds,
        root: Some(sandbox_jail::Root {
            staging,
            system: true,
            binds,
            devices,
            proc: false,
        }),
        limits,
        nofile: 1024,
        fsize: Some(fsize.max(1 << 20)),
        keep_groups,
        seccomp: true,
        host_network: false,
        outlive: spec.outlive,
    })
}

/// The restored agent waits in a read on its port, as it did when the snapshot was taken, and
/// does not know the host is new: a ping on the control stream makes it announce itself there
/// (its `Ready` is what the boot waits for). The socket is empty and its buffer far larger than
/// one header, so this never blocks.
fn greet_restored(agent: &std::os::unix::net::UnixStream) -> Result<(), VmError> {
    use std::io::Write;
    let ping = sandbox_protocol::Frame::new(sandbox_protocol::Kind::Ping, 0, Vec::new());
    (&*agent)
        .write_all(&ping.encode())
        .map_err(|e| VmError::io("greeting the restored agent", e))
}

/// The group that owns `/dev/kvm`, when it is not root's.
fn kvm_group() -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let gid = std::fs::metadata("/dev/kvm").ok()?.gid();
    (gid != 0).then_some(gid)
}

/// Records when the guest's boot marker arrives on the marker socket; ends with the VM.
async fn time_marker(
    mut s: tokio::net::UnixStream,
    started: std::time::Instant,
    marker: Arc<std::sync::OnceLock<Duration>>,
    mut exit: watch::Receiver<Option<VmExit>>,
) {
    let timed = async {
        let mut b = [0u8; 1];
        if s.read(&mut b).await.ok()? == 1 && b[0] == sandbox_protocol::boot_marker::VALUE {
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
}

/// The QEMU process of a VM a previous run of the service started with `outlive` (`record`
/// says which), taken on again: watched, stopped and cleaned up as one this run started. It
/// has no boot marker to report, no console, and no snapshot (QEMU VMs are snapshotted only
/// for templates, which never outlive their service).
pub(crate) async fn adopt(
    id: &str,
    record: &crate::adopt::VmRecord,
) -> Result<Box<dyn Vm>, sandbox_jail::AdoptError> {
    let identity = sandbox_jail::Identity {
        pid: record.pid,
        start_time: record.start_time,
        uid: record.uid,
        cgroup: record.cgroup.clone(),
    };
    let process = Supervised::adopt(
        Kind {
            name: "QEMU",
            state_dir: Some(record.state_dir.clone()),
            reap_within: REAP_TIMEOUT,
            line: std::convert::identity,
        },
        identity,
        id.to_string(),
        record.memory_mib,
        Box::new(QemuEnd),
    )
    .await?;
    Ok(Box::new(QemuVm {
        process,
        marker: Arc::default(),
        snapshot: None,
        agent_path: Some(record.state_dir.join(AGENT_SOCKET)),
        memory_mib: record.memory_mib,
    }))
}

/// How QEMU ended: the service's own kill, the OOM killer, then its status and console.
struct QemuEnd;

impl Classify for QemuEnd {
    fn classify(self: Box<Self>, e: Ending) -> VmExit {
        let requested = e.killed.is_none() && e.requested;
        let reason = e.killed.unwrap_or_else(|| {
            if e.status.oom_kills > 0 && !requested {
                return format!(
                    "out of memory: the VM's process used more than its limit of {} MiB (the \
                     guest's memory and QEMU's own allowance, SANDBOX_HOST_VMM_ALLOWANCE_MIB) and \
                     the kernel killed it",
                    e.memory_mib
                );
            }
            use std::os::unix::process::ExitStatusExt;
            classify(
                e.status
                    .known
                    .then(|| std::process::ExitStatus::from_raw(e.status.status)),
                requested,
                &e.console,
            )
        });
        VmExit {
            reason,
            requested,
            console: e.console,
        }
    }
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
        self.process.exit()
    }

    async fn wait(&self) -> VmExit {
        self.process.wait().await
    }

    async fn stop(&self, grace: Duration) -> VmExit {
        self.process.stop(grace, |p| p.signal(libc::SIGTERM)).await
    }

    async fn kill(&self, reason: String) -> VmExit {
        self.process.kill(reason).await
    }

    fn console_tail(&self, n: usize) -> Vec<String> {
        self.process.console_tail(n)
    }

    fn pid(&self) -> Option<u32> {
        Some(self.process.pid())
    }

    fn record(&self) -> Option<crate::adopt::VmRecord> {
        let path = self.agent_path.as_ref()?;
        let identity = self.process.identity()?;
        Some(crate::adopt::VmRecord {
            backend: "qemu".into(),
            pid: identity.pid,
            start_time: identity.start_time,
            uid: identity.uid,
            cgroup: identity.cgroup,
            memory_mib: self.memory_mib,
            state_dir: path.parent()?.to_path_buf(),
            token: None,
        })
    }

    async fn snapshot(&self, resume: bool) -> Result<crate::backend::SnapshotDone, VmError> {
        let Some(to) = self.snapshot.as_ref().and_then(|t| t.to.clone()) else {
            return Err(Unsupported::NoSnapshotFile.into());
        };
        self.snapshot_into(&to, resume).await
    }

    async fn snapshot_held(
        &self,
        to: &crate::backend::SnapshotFiles,
    ) -> Result<crate::backend::SnapshotDone, VmError> {
        self.snapshot_into(to, false).await
    }

    async fn resume(&self) -> Result<(), VmError> {
        let Some(target) = &self.snapshot else {
            return Err(Unsupported::NoSnapshotFile.into());
        };
        let mut monitor = target.monitor.lock().await;
        let Monitor::Open(qmp) = &mut *monitor else {
            return Err(VmSnapshotError::MonitorLost.into());
        };
        let going = async {
            super::snapshot::cont(qmp).await?;
            remove_fdset(qmp).await
        };
        let r = tokio::select! {
            r = going => r,
            exit = self.wait() => Err(VmSnapshotError::EndedDuring(exit.reason).into()),
        };
        if r.as_ref().is_err_and(breaks_monitor) {
            *monitor = Monitor::Broken;
        }
        r
    }
}

impl QemuVm {
    /// Migrates the guest into `to` (QEMU's migration to a file, over the monitor, with the
    /// memory file handed over by `add-fd` into a set of its own), writes the state file, and
    /// lets the guest run on if `resume`.
    async fn snapshot_into(
        &self,
        to: &crate::backend::SnapshotFiles,
        resume: bool,
    ) -> Result<crate::backend::SnapshotDone, VmError> {
        let Some(target) = &self.snapshot else {
            return Err(Unsupported::NoSnapshotFile.into());
        };
        let mut monitor = target.monitor.lock().await;
        if let Monitor::Socket(_) = &*monitor {
            let Monitor::Socket(socket) = std::mem::replace(&mut *monitor, Monitor::Broken) else {
                unreachable!("matched above");
            };
            let socket = tokio::net::UnixStream::from_std(socket)
                .map_err(|e| VmError::io("connecting QEMU's monitor", e))?;
            let qmp = crate::qmp::Qmp::connect(socket, Duration::from_secs(10))
                .await
                .map_err(VmSnapshotError::Monitor)?;
            *monitor = Monitor::Open(qmp);
        }
        let Monitor::Open(qmp) = &mut *monitor else {
            return Err(VmSnapshotError::MonitorLost.into());
        };
        let fdset = super::args::SNAPSHOT_FDSET;
        let taking = async {
            // The memory file, handed over now: QEMU's migration writes it as `/dev/fdset/N`.
            let memory = std::fs::OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(&to.memory)
                .map_err(|e| VmError::io(format!("opening {}", to.memory.display()), e))?;
            {
                use std::os::fd::AsRawFd;
                qmp.execute_with_fd(
                    "add-fd",
                    serde_json::json!({ "fdset-id": fdset }),
                    memory.as_raw_fd(),
                    Duration::from_secs(10),
                )
                .await
                .map_err(VmSnapshotError::HandOver)?;
            }
            drop(memory);
            let taken = super::snapshot::take(qmp, &target.header, &to.state, resume).await;
            // A guest left running (a failed migration resumes it too) lets go of the file
            // now; a held one at its resume (QEMU closes a set's descriptors only while the
            // guest runs).
            if resume || taken.is_err() {
                remove_fdset(qmp).await?;
            }
            taken
        };
        let r = tokio::select! {
            r = taking => r,
            exit = self.wait() => Err(VmSnapshotError::EndedDuring(exit.reason).into()),
        };
        if r.as_ref().is_err_and(breaks_monitor) {
            *monitor = Monitor::Broken;
        }
        r
    }
}

/// Empties the snapshots' fd set: the next snapshot's file is alone in it.
async fn remove_fdset(qmp: &mut crate::qmp::Qmp) -> Result<(), VmError> {
    match qmp
        .execute(
            "remove-fd",
            serde_json::json!({ "fdset-id": super::args::SNAPSHOT_FDSET }),
            Duration::from_secs(10),
        )
        .await
    {
        // Empty already (a migration that failed before QEMU took the file).
        Ok(_) | Err(crate::qmp::QmpError::Refused { .. }) => Ok(()),
        Err(e) => Err(VmSnapshotError::Command(e).into()),
    }
}

/// Whether `e` leaves the monitor's session unusable: its socket failed, a command went
/// unanswered (a late answer would be taken for the next one's), or QEMU broke the protocol.
/// QEMU's refusals and a failed migration leave it as it was.
fn breaks_monitor(e: &VmError) -> bool {
    use crate::qmp::QmpError;
    match e {
        VmError::Snapshot(
            VmSnapshotError::Monitor(q)
            | VmSnapshotError::HandOver(q)
            | VmSnapshotError::Command(q),
        ) => !matches!(q, QmpError::Refused { .. }),
        VmError::Snapshot(VmSnapshotError::MigrationTimeout(_)) => true,
        _ => false,
    }
}
