//! The KVM backend's VMs in the service's own process (no jail, no `sandbox-vm`): only for the
//! benchmark that measures what the VM process and its jail cost (`KvmBackend::in_process`,
//! built with the `in-process` feature). The service itself never links the machine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sandbox_devices::virtio::vsock::ConnectError;
use sandbox_vm::machine::{DiskConfig, Machine, MachineConfig, MachineExit};
use tokio::sync::{oneshot, watch};

use super::guest::{AGENT_PORT, GUEST_CID, kernel_cmdline};
use crate::backend::{StartedVm, Vm, VmError, VmExit, VmSnapshotError, VmSpec, VmStartError};
use crate::supervised::{EXIT_CONSOLE_LINES, remove_state_dir, unknown_exit};

/// How long a guest gets from start to listening on the agent port.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(60);

fn to_vm_exit(e: &MachineExit) -> VmExit {
    VmExit {
        reason: e.reason.clone(),
        requested: e.requested,
        console: e.console.clone(),
    }
}

/// Starts a VM in this process.
pub(super) async fn start(spec: &VmSpec) -> Result<StartedVm, VmError> {
    let restore = match &spec.restore_from {
        Some(files) => {
            let state = std::fs::File::open(&files.state)
                .map_err(|e| VmError::io(format!("opening {}", files.state.display()), e))?;
            let expect = sandbox_vm::snapshot::Expect {
                memory_mib: spec.memory_mib,
                vcpus: spec.vcpus,
                devices: 1 + spec.disks.len() + usize::from(spec.net.is_some()),
            };
            let state = sandbox_vm::snapshot::MachineState::read_from(&state, &expect)
                .map_err(VmSnapshotError::Machine)?;
            Some(sandbox_vm::machine::Restore {
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
    let on_exit: sandbox_vm::machine::OnExit = Box::new(move |e| {
        let _ = exit_tx.send(Some(to_vm_exit(e)));
    });
    let machine = tokio::task::spawn_blocking(move || Machine::start(&cfg, Some(on_exit)))
        .await
        .map_err(VmStartError::Task)?
        .map_err(VmStartError::Machine)?;
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
        Ok(stream) => Ok(StartedVm::over_socket(Box::new(vm), stream)),
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
                    return Err(VmStartError::AgentRefused {
                        within,
                        why,
                        console: machine.console_tail(8),
                    }
                    .into());
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
                tokio::time::sleep(sandbox_vm::connect_pause(refusals)).await;
                refusals += 1;
            }
            Err(e) => {
                return Err(VmStartError::AgentRefused {
                    within,
                    why: e.to_string(),
                    console: machine.console_tail(8),
                }
                .into());
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
            return Err(VmSnapshotError::NoFiles.into());
        };
        self.snapshot_into(files, resume).await
    }

    async fn snapshot_held(
        &self,
        to: &crate::backend::SnapshotFiles,
    ) -> Result<crate::backend::SnapshotDone, VmError> {
        let open = |p: &std::path::Path| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(p)
                .map_err(|source| VmSnapshotError::File {
                    what: "opening",
                    path: p.to_path_buf(),
                    source,
                })
        };
        let files = Arc::new((open(&to.state)?, open(&to.memory)?));
        self.snapshot_into(files, false).await
    }

    async fn resume(&self) -> Result<(), VmError> {
        self.machine.resume();
        Ok(())
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

impl KvmVm {
    /// Pauses, writes the snapshot into `files` (state, memory), and resumes if `resume`.
    async fn snapshot_into(
        &self,
        files: Arc<(std::fs::File, std::fs::File)>,
        resume: bool,
    ) -> Result<crate::backend::SnapshotDone, VmError> {
        let m = self.machine.clone();
        let memory_mib = self.memory_mib;
        let state_file = |what| move |source| VmSnapshotError::StateFile { what, source };
        tokio::task::spawn_blocking(move || -> Result<_, VmSnapshotError> {
            let (state, memory) = (&files.0, &files.1);
            sandbox_control::files::size_memory_file(memory, u64::from(memory_mib) << 20)?;
            state
                .set_len(0)
                .and_then(|()| std::io::Seek::seek(&mut &*state, std::io::SeekFrom::Start(0)))
                .map_err(state_file("emptying"))?;
            let done = m.pause_and_snapshot(&mut &*state, memory, resume)?;
            state.sync_data().map_err(state_file("syncing"))?;
            Ok(done)
        })
        .await
        .map_err(|source| VmSnapshotError::Task {
            what: "the snapshot task failed",
            source,
        })?
        .map_err(VmError::from)
    }
}
