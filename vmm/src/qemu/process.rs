//! One QEMU process: spawning it, collecting its console, noticing its end, stopping it and
//! removing everything it had on disk.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

use crate::backend::{Channel, StartedVm, Vm, VmError, VmExit, VmSpec};
use crate::supervised::{Classify, Ending, Spawn, Supervised, pipe};

/// The longest a stop waits for QEMU to be reaped after SIGKILL.
const REAP_TIMEOUT: Duration = Duration::from_secs(10);

/// A QEMU process and what belongs to it.
pub struct QemuVm {
    /// The jailed QEMU process (signals go through its pidfd, never to a recycled pid).
    process: Supervised,
    /// From spawning QEMU to the guest's boot marker, once it came.
    marker: Arc<std::sync::OnceLock<Duration>>,
    /// A VM that may be snapshotted: its monitor (taken by the one snapshot it may have), what
    /// its snapshot is of, and where its state file goes.
    snapshot: Option<SnapshotTarget>,
}

/// What [`Vm::snapshot`] of a QEMU VM needs.
struct SnapshotTarget {
    monitor: tokio::sync::Mutex<Option<std::os::unix::net::UnixStream>>,
    header: super::snapshot::Header,
    state: PathBuf,
    memory: PathBuf,
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

/// Spawns QEMU in its jail, with every socket and disk as an inherited descriptor.
pub async fn spawn(
    program: &Path,
    arch: super::Arch,
    accel: super::Accel,
    spec: &VmSpec,
) -> Result<StartedVm, VmError> {
    use std::os::fd::OwnedFd;
    let jailer = sandbox_jail::global();
    let (agent_host, agent_vm) = socket_pair("agent")?;
    // The boot marker: an I/O port on x86_64, a virtio-serial port on aarch64 (see args).
    let marker = Some(socket_pair("boot marker")?);
    // The network: a socket whose other end the sandbox's network process holds, handed over
    // as it is; or a link in this process, which a pump here serves.
    let net = match &spec.net {
        Some(n) => Some(match &n.link {
            sandbox_control::link::NetLink::Socket(fd) => (
                None,
                fd.try_clone()
                    .map_err(|e| VmError::io("the network socket", e))?,
            ),
            sandbox_control::link::NetLink::Frames(link) => {
                let (host, vm) = socket_pair("network")?;
                (Some((host, link.clone())), vm)
            }
        }),
        None => None,
    };
    let (out_r, out_w) = pipe("QEMU output")?;
    let (err_r, err_w) = pipe("QEMU error")?;
    let null = std::fs::File::open("/dev/null").map_err(|e| VmError::io("opening /dev/null", e))?;

    let mut fds: Vec<OwnedFd> = vec![null.into(), out_w, err_w, agent_vm];
    let agent_fd = 3;
    // QEMU's ends move into its descriptors: the host keeps no copy, so QEMU's end closing
    // (it died) is an end of file here.
    let mut marker_fd = None;
    let marker = marker.map(|(host, vm)| {
        fds.push(vm);
        marker_fd = Some(fds.len() as i32 - 1);
        host
    });
    let mut net_fd = None;
    let net = net.and_then(|(pumped, vm)| {
        fds.push(vm);
        net_fd = Some(fds.len() as i32 - 1);
        pumped
    });
    // A VM that may be snapshotted gets its monitor (its snapshot's memory file comes over it
    // with the snapshot, by `add-fd`: until then QEMU holds no file it could write one to); a
    // VM restored from one gets that file to read.
    let mut qmp_fd = None;
    let mut monitor = None;
    if spec.snapshot_to.is_some() {
        let (host, vm) = socket_pair("monitor")?;
        fds.push(vm);
        qmp_fd = Some(fds.len() as i32 - 1);
        monitor = Some(host);
    }
    let mut restore_fd = None;
    if let Some(from) = &spec.restore_from {
        let f = std::fs::File::open(&from.memory)
            .map_err(|e| VmError::io(format!("opening {}", from.memory.display()), e))?;
        fds.push(f.into());
        restore_fd = Some(fds.len() as i32 - 1);
    }
    // KVM's device, opened here: QEMU gets no device node and no group of the service's.
    let mut kvm_fd = None;
    if accel == super::Accel::Kvm {
        let kvm = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .map_err(|e| VmError::io("opening /dev/kvm", e))?;
        fds.push(kvm.into());
        kvm_fd = Some(fds.len() as i32 - 1);
    }
    let mut disk_fds = vec![];
    // The largest file QEMU may write: its disks, and a snapshot (the guest's memory, a header
    // per page, and the devices' state).
    let mut fsize = if spec.snapshot_to.is_some() {
        (u64::from(spec.memory_mib) << 20) + (u64::from(spec.memory_mib) << 10) * 3 + (64 << 20)
    } else {
        0
    };
    for d in &spec.disks {
        let open = |write: bool| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(write)
                .open(&d.path)
                .map_err(|e| VmError::io(format!("opening the disk {}", d.path.display()), e))
        };
        // QEMU opens a writable disk read-only first, then read-write: its fd set holds both.
        let mut set = vec![];
        if !d.read_only {
            let f = open(true)?;
            fsize = fsize.max(f.metadata().map(|m| m.len()).unwrap_or(0));
            fds.push(f.into());
            set.push(fds.len() as i32 - 1);
        }
        fds.push(open(false)?.into());
        set.push(fds.len() as i32 - 1);
        disk_fds.push(set);
    }

    let jailed_paths = jailer.namespaces();
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
        agent_fd,
        marker_fd,
        net_fd,
        disk_fds,
        qmp_fd,
        restore_fd,
        kvm_fd,
    };
    let args = super::args::qemu_args(arch, accel, spec, &wiring);

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
        .map_err(|e| VmError::InvalidSpec(e.to_string()))?
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
    let cmd = sandbox_jail::Command {
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
    };
    let started = std::time::Instant::now();
    let process = Supervised::spawn(
        Spawn {
            name: "QEMU",
            cmd,
            outputs: vec![(out_r, ""), (err_r, "qemu: ")],
            state_dir: Some(spec.state_dir.clone()),
            reap_within: REAP_TIMEOUT,
        },
        Box::new(QemuEnd),
    )
    .await?;
    let exit_rx = process.exit_watch();

    let marker_time = Arc::new(std::sync::OnceLock::new());
    if let Some(host) = marker {
        let s = tokio::net::UnixStream::from_std(host)
            .map_err(|e| VmError::io("watching the boot marker socket", e))?;
        tokio::spawn(time_marker(
            s,
            started,
            marker_time.clone(),
            exit_rx.clone(),
        ));
    }
    if let Some((host, link)) = net {
        let s = tokio::net::UnixStream::from_std(host)
            .map_err(|e| VmError::io("connecting the network socket", e))?;
        tokio::spawn(crate::netpump::run(s, link, exit_rx.clone()));
    }
    let snapshot = match (monitor, &spec.snapshot_to) {
        (Some(m), Some(to)) => Some(SnapshotTarget {
            monitor: tokio::sync::Mutex::new(Some(m)),
            header: super::snapshot::Header::of(arch, accel, spec),
            state: to.state.clone(),
            memory: to.memory.clone(),
        }),
        _ => None,
    };
    if spec.restore_from.is_some() {
        // The restored agent waits in a read on its port, as it did when the snapshot was
        // taken, and does not know the host is new: a ping on the control stream makes it
        // announce itself there (its `Ready` is what the boot waits for). The socket is empty
        // and its buffer far larger than one header, so this never blocks.
        use std::io::Write;
        let ping = sandbox_protocol::Frame::new(sandbox_protocol::Kind::Ping, 0, Vec::new());
        (&agent_host)
            .write_all(&ping.encode())
            .map_err(|e| VmError::io("greeting the restored agent", e))?;
    }
    let vm = QemuVm {
        snapshot,
        process,
        marker: marker_time,
    };
    let stream = tokio::net::UnixStream::from_std(agent_host)
        .map_err(|e| VmError::io("connecting the agent socket", e))?;
    let (read, write) = stream.into_split();
    Ok(StartedVm {
        vm: Box::new(vm),
        channel: Channel {
            read: Box::new(read),
            write: Box::new(write),
        },
    })
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
                Some(std::process::ExitStatus::from_raw(e.status.status)),
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

    async fn snapshot(&self, resume: bool) -> Result<crate::backend::SnapshotDone, VmError> {
        let Some(target) = &self.snapshot else {
            return Err(VmError::Unsupported(
                "this VM was started without a snapshot file, so it cannot be snapshotted".into(),
            ));
        };
        // One snapshot per VM: its memory file is written once, from its start.
        let Some(monitor) = target.monitor.lock().await.take() else {
            return Err(VmError::Snapshot(
                "this VM has been snapshotted already; a QEMU VM is snapshotted once".into(),
            ));
        };
        let monitor = tokio::net::UnixStream::from_std(monitor)
            .map_err(|e| VmError::io("connecting QEMU's monitor", e))?;
        let taking = async {
            let mut qmp = super::qmp::Qmp::connect(monitor, Duration::from_secs(10))
                .await
                .map_err(|e| VmError::Snapshot(format!("QEMU's monitor: {e}")))?;
            // The memory file, handed over now: QEMU's migration writes it as `/dev/fdset/N`.
            let memory = std::fs::OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(&target.memory)
                .map_err(|e| VmError::io(format!("opening {}", target.memory.display()), e))?;
            {
                use std::os::fd::AsRawFd;
                qmp.execute_with_fd(
                    "add-fd",
                    serde_json::json!({ "fdset-id": super::args::SNAPSHOT_FDSET }),
                    memory.as_raw_fd(),
                    Duration::from_secs(10),
                )
                .await
                .map_err(|e| VmError::Snapshot(format!("handing QEMU its snapshot file: {e}")))?;
            }
            drop(memory);
            super::snapshot::take(&mut qmp, &target.header, &target.state, resume).await
        };
        tokio::select! {
            r = taking => r,
            exit = self.wait() => Err(VmError::Snapshot(format!(
                "the VM ended while its snapshot was taken: {}",
                exit.reason
            ))),
        }
    }
}
