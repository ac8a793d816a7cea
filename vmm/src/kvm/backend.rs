//! The KVM backend as a [`Backend`]: each VM is a [`Machine`] in this process, its agent
//! channel a vsock connection the device opens to the agent's port.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::{oneshot, watch};

use super::machine::{DiskConfig, Machine, MachineConfig, MachineExit};
use crate::backend::{Backend, Channel, StartedVm, Vm, VmError, VmExit, VmSpec, validate_spec};
use crate::vm_process::{remove_state_dir, unknown_exit};
use sandbox_devices::virtio::vsock::ConnectError;

/// The vsock port the agent listens on.
pub const AGENT_PORT: u32 = 1024;
/// The guest's vsock context id (each VM has its own device, so every guest can be 3).
const GUEST_CID: u64 = 3;
/// How long a guest gets from start to listening on the agent port.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(60);
/// Console lines kept in a `VmExit`.
const EXIT_CONSOLE_LINES: usize = 20;

/// The KVM backend.
#[derive(Debug, Clone, Default)]
pub struct KvmBackend {
    /// Each VM in this process instead of a jailed `sandbox-vm` of its own: only for the
    /// benchmark that measures what the process and the jail cost.
    in_process: bool,
}

impl KvmBackend {
    /// Checks that /dev/kvm can be opened and has what the machine uses. This does not prove
    /// the host's KVM can run Linux; [`probe`] does.
    pub fn new() -> Result<KvmBackend, String> {
        check_kvm()?;
        super::process::vm_binary()?;
        Ok(KvmBackend { in_process: false })
    }

    /// The same backend running each VM's threads in this process (no jail): the reference the
    /// benchmarks measure the VM process against.
    pub fn in_process() -> Result<KvmBackend, String> {
        check_kvm()?;
        Ok(KvmBackend { in_process: true })
    }
}

/// Why this user may not open /dev/kvm, and the fix that applies here: a device left to root
/// alone needs a group first (Debian's udev rule makes it `root:kvm`, 0660).
fn kvm_access_hint() -> String {
    use std::os::unix::fs::MetadataExt;
    let group_only_root = std::fs::metadata("/dev/kvm")
        .map(|m| m.gid() == 0 && m.mode() & 0o060 == 0)
        .unwrap_or(false);
    if group_only_root {
        "/dev/kvm exists but only root may open it: give it to the kvm group (chgrp kvm /dev/kvm; \
         chmod 0660 /dev/kvm, or the udev rule KERNEL==\"kvm\", GROUP=\"kvm\", MODE=\"0660\") and add \
         this user to that group"
            .to_string()
    } else {
        "/dev/kvm exists but this user may not open it (add the user to the kvm group)".to_string()
    }
}

/// Checks that /dev/kvm can be opened and has what the machine uses.
fn check_kvm() -> Result<(), String> {
    {
        let kvm = kvm_ioctls::Kvm::new().map_err(|e| match e.errno() {
            libc::ENOENT => crate::config::no_kvm_device().to_string(),
            libc::EACCES | libc::EPERM => kvm_access_hint(),
            _ => format!("/dev/kvm cannot be opened: {e}"),
        })?;
        for (cap, name) in [
            (kvm_ioctls::Cap::Irqchip, "an in-kernel irqchip"),
            (kvm_ioctls::Cap::Irqfd, "irqfd"),
            (kvm_ioctls::Cap::Ioeventfd, "ioeventfd"),
            (kvm_ioctls::Cap::Pit2, "an in-kernel PIT"),
        ] {
            if !kvm.check_extension(cap) {
                return Err(format!("the host's KVM lacks {name}"));
            }
        }
        Ok(())
    }
}

/// The kernel command line of a KVM guest.
pub fn kernel_cmdline(spec: &VmSpec) -> String {
    let mut words = vec![
        "console=ttyS0".to_string(),
        "reboot=k".into(),
        "panic=-1".into(),
        "quiet".into(),
        "i8042.noaux".into(),
        "i8042.nomux".into(),
        "i8042.dumbkbd".into(),
        format!("sandbox.memory_mib={}", spec.memory_mib),
        format!("sandbox.channel=vsock:{AGENT_PORT}"),
    ];
    words.extend(spec.cmdline.iter().cloned());
    words.join(" ")
}

fn to_vm_exit(e: &MachineExit) -> VmExit {
    VmExit {
        reason: e.reason.clone(),
        requested: e.requested,
        console: e.console.clone(),
    }
}

#[async_trait]
impl Backend for KvmBackend {
    fn name(&self) -> &'static str {
        "kvm"
    }

    fn accel(&self) -> String {
        "kvm".into()
    }

    async fn start(&self, spec: VmSpec) -> Result<StartedVm, VmError> {
        validate_spec(&spec)?;
        let spec = crate::backend::prepare(&spec)?;
        let result = if self.in_process {
            start(&spec).await
        } else {
            super::process::start(&spec, kernel_cmdline(&spec), AGENT_PORT, GUEST_CID).await
        };
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&spec.state_dir);
        }
        result
    }
}

async fn start(spec: &VmSpec) -> Result<StartedVm, VmError> {
    let restore = match &spec.restore_from {
        Some(files) => {
            let state = std::fs::File::open(&files.state)
                .map_err(|e| VmError::io(format!("opening {}", files.state.display()), e))?;
            let expect = super::snapshot::Expect {
                memory_mib: spec.memory_mib,
                vcpus: spec.vcpus,
                devices: 1 + spec.disks.len() + usize::from(spec.net.is_some()),
            };
            let state = super::snapshot::MachineState::read_from(&state, &expect)
                .map_err(|e| VmError::Snapshot(e.to_string()))?;
            Some(super::machine::Restore {
                state: Arc::new(state),
                memory: files.memory.clone().into(),
            })
        }
        None => None,
    };
    let snapshot_to = match &spec.snapshot_to {
        Some(files) => {
            let open = |p: &std::path::Path| {
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(p)
                    .map_err(|e| VmError::io(format!("opening {}", p.display()), e))
            };
            Some((open(&files.state)?, open(&files.memory)?))
        }
        None => None,
    };
    let cfg = MachineConfig {
        kvm: None,
        kernel: spec.kernel.clone().into(),
        initrd: spec.initrd.clone().map(Into::into),
        console: None,
        cmdline: kernel_cmdline(spec),
        memory_mib: spec.memory_mib,
        vcpus: spec.vcpus,
        disks: spec
            .disks
            .iter()
            .map(|d| DiskConfig {
                file: d.path.clone().into(),
                read_only: d.read_only,
            })
            .collect(),
        vsock_cid: GUEST_CID,
        net: spec.net.clone(),
        restore,
    };
    let t0 = Instant::now();
    let (exit_tx, exit_rx) = watch::channel(None);
    let on_exit: super::machine::OnExit = Box::new(move |e| {
        let _ = exit_tx.send(Some(to_vm_exit(e)));
    });
    let machine = tokio::task::spawn_blocking(move || Machine::start(&cfg, Some(on_exit)))
        .await
        .map_err(|e| VmError::Start(format!("the VM start task failed: {e}")))?
        .map_err(|e| VmError::Start(e.to_string()))?;
    let vmm_start = t0.elapsed();
    let machine = Arc::new(machine);
    let vm = KvmVm {
        vmm_start,
        machine: machine.clone(),
        exit: exit_rx,
        state_dir: spec.state_dir.clone(),
        snapshot_to: snapshot_to.map(Arc::new),
        memory_mib: spec.memory_mib,
    };
    // The caller's bound, as on QEMU: a nested host under load needs more than the default.
    let within = spec.start_timeout.unwrap_or(CONNECT_TIMEOUT);
    match connect(&machine, &vm.exit, within).await {
        Ok(stream) => {
            let (read, write) = stream.into_split();
            Ok(StartedVm {
                vm: Box::new(vm),
                channel: Channel {
                    read: Box::new(read),
                    write: Box::new(write),
                },
            })
        }
        Err(e) => {
            vm.stop(Duration::ZERO).await;
            Err(e)
        }
    }
}

/// Connects to the agent's vsock port, retrying while nothing listens there yet.
async fn connect(
    machine: &Machine,
    exit: &watch::Receiver<Option<VmExit>>,
    within: Duration,
) -> Result<tokio::net::UnixStream, VmError> {
    let deadline = Instant::now() + within;
    let mut exit = exit.clone();
    // What the last finished attempt got, to say why the deadline passed.
    let mut last: Option<ConnectError> = None;
    let mut refusals = 0;
    loop {
        let (tx, rx) = oneshot::channel();
        machine.vsock().connect(
            AGENT_PORT,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        // The device answers when the guest does; a guest that never answers the request (its
        // vsock driver wedged) must not keep us here past the deadline.
        let result = tokio::select! {
            r = tokio::time::timeout_at(deadline.into(), rx) => match r {
                Ok(r) => r.unwrap_or(Err(ConnectError::Reset)),
                Err(_) => {
                    let why = match &last {
                        Some(e) => e.to_string(),
                        None => "the guest's vsock driver never came up, or its kernel never answered".into(),
                    };
                    return Err(VmError::Start(format!(
                        "the guest agent did not accept the host's connection within {within:?}: {why}{}",
                        crate::backend::console_suffix(&machine.console_tail(8))
                    )));
                }
            },
            e = exit.wait_for(|e| e.is_some()) => {
                let e = e.ok().and_then(|e| e.clone()).unwrap_or_else(unknown_exit);
                return Err(VmError::DiedEarly(e));
            }
        };
        match result {
            Ok(stream) => {
                stream
                    .set_nonblocking(true)
                    .map_err(|e| VmError::io("the agent channel", e))?;
                return tokio::net::UnixStream::from_std(stream)
                    .map_err(|e| VmError::io("the agent channel", e));
            }
            Err(e @ ConnectError::Refused(_)) if Instant::now() < deadline => {
                last = Some(e);
                tokio::time::sleep(super::connect_pause(refusals)).await;
                refusals += 1;
            }
            Err(e) => {
                return Err(VmError::Start(format!(
                    "the guest agent did not accept the host's connection within {within:?}: {e}{}",
                    crate::backend::console_suffix(&machine.console_tail(8))
                )));
            }
        }
    }
}

/// A VM of the KVM backend.
pub struct KvmVm {
    vmm_start: Duration,
    machine: Arc<Machine>,
    exit: watch::Receiver<Option<VmExit>>,
    state_dir: std::path::PathBuf,
    snapshot_to: Option<Arc<(std::fs::File, std::fs::File)>>,
    memory_mib: u32,
}

#[async_trait]
impl Vm for KvmVm {
    fn exit(&self) -> Option<VmExit> {
        self.exit.borrow().clone()
    }

    async fn wait(&self) -> VmExit {
        let mut rx = self.exit.clone();
        match rx.wait_for(|e| e.is_some()).await {
            Ok(e) => e.clone().unwrap_or_else(unknown_exit),
            Err(_) => self
                .machine
                .exit()
                .map(|e| to_vm_exit(&e))
                .unwrap_or_else(unknown_exit),
        }
    }

    async fn stop(&self, _grace: Duration) -> VmExit {
        // Nothing in the guest needs a grace period: disks are written through (the guest's
        // unflushed cache is lost, as on power loss), and no host process is left to reap.
        let m = self.machine.clone();
        let exit = tokio::task::spawn_blocking(move || m.stop())
            .await
            .map(|e| to_vm_exit(&e))
            .unwrap_or_else(|_| unknown_exit());
        remove_state_dir(&self.state_dir);
        exit
    }

    async fn kill(&self, reason: String) -> VmExit {
        let m = self.machine.clone();
        let exit = tokio::task::spawn_blocking(move || m.fail(reason))
            .await
            .map(|e| to_vm_exit(&e))
            .unwrap_or_else(|_| unknown_exit());
        remove_state_dir(&self.state_dir);
        exit
    }

    fn console_tail(&self, n: usize) -> Vec<String> {
        self.machine.console_tail(n.min(EXIT_CONSOLE_LINES.max(n)))
    }

    async fn snapshot(&self, resume: bool) -> Result<crate::backend::SnapshotDone, VmError> {
        let Some(files) = self.snapshot_to.clone() else {
            return Err(VmError::Snapshot(
                "this VM was started without snapshot files".into(),
            ));
        };
        let m = self.machine.clone();
        let memory_mib = self.memory_mib;
        tokio::task::spawn_blocking(move || -> Result<_, String> {
            let (state, memory) = (&files.0, &files.1);
            super::snapshot::size_memory_file(memory, u64::from(memory_mib) << 20)
                .map_err(|e| e.to_string())?;
            state
                .set_len(0)
                .and_then(|()| std::io::Seek::seek(&mut &*state, std::io::SeekFrom::Start(0)))
                .map_err(|e| format!("emptying the state file: {e}"))?;
            let done = m
                .pause_and_snapshot(&mut &*state, memory, resume)
                .map_err(|e| e.to_string())?;
            state
                .sync_data()
                .map_err(|e| format!("syncing the state file: {e}"))?;
            Ok(done)
        })
        .await
        .map_err(|e| VmError::Snapshot(format!("the snapshot task failed: {e}")))?
        .map_err(VmError::Snapshot)
    }

    async fn diagnostics(&self) -> String {
        self.machine.vcpu_report()
    }

    fn pid(&self) -> Option<u32> {
        None
    }

    fn boot_marker(&self) -> Option<Duration> {
        self.machine.boot_marker()
    }

    fn vmm_start(&self) -> Option<Duration> {
        Some(self.vmm_start)
    }
}

impl Drop for KvmVm {
    fn drop(&mut self) {
        remove_state_dir(&self.state_dir);
    }
}
