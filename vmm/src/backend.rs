//! The VMM trait: what the rest of sandbox-host needs from a virtual machine backend.
//!
//! It is deliberately lifecycle-level (start, talk, wait, stop), as Kata's runtime is over its
//! hypervisors: QEMU and our KVM VMM (`sandbox-vm`) are processes of their own that speak
//! different control protocols, so a finer trait (vCPUs, devices) would fit only one of them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use tokio::io::{AsyncRead, AsyncWrite};

/// What to boot. Built by the caller from a sandbox's spec and its image.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// Short unique name, used in file names and logs.
    pub id: String,
    /// Guest memory.
    pub memory_mib: u32,
    /// Guest vCPUs.
    pub vcpus: u8,
    /// Uncompressed kernel (`vmlinux` with a PVH note on x86_64).
    pub kernel: PathBuf,
    /// Initramfs, if the image has one.
    pub initrd: Option<PathBuf>,
    /// Disks in order; the guest sees disk `i` with the virtio serial `disk<i>`.
    pub disks: Vec<Disk>,
    /// A fresh writable ext4 disk of this many MiB, made by the backend in the state directory
    /// (removed with it) and attached after `disks`: the sandbox's own disk of a disk image.
    pub scratch_disk_mib: Option<u64>,
    /// Extra kernel command-line words, after the backend's own.
    pub cmdline: Vec<String>,
    /// A directory that belongs to this VM alone; the backend puts its sockets there and
    /// removes it on stop.
    pub state_dir: PathBuf,
    /// The network device, if the guest gets one (egress); without it the guest has no network.
    pub net: Option<sandbox_control::link::NetAttachment>,
    /// The longest `Backend::start` may take to hand back a connected agent channel (`None`:
    /// the backend's own bound). `boot` sets it to its ready timeout, so a guest that never
    /// listens fails within that bound with its console lines.
    pub start_timeout: Option<Duration>,
    /// Where [`Vm::snapshot`] writes, if the VM may be snapshotted. The files are created by
    /// the caller and given to the VM at start: a jailed VM has no path. On QEMU the memory
    /// file holds QEMU's migration stream, and a VM is snapshotted at most once.
    pub snapshot_to: Option<SnapshotFiles>,
    /// Start from this snapshot instead of booting. The spec must be the
    /// one the snapshot was taken with, and its disks in the state they had then.
    pub restore_from: Option<SnapshotFiles>,
    /// Whether the VM's process may outlive the service, to be taken on again by its next run
    /// ([`crate::adopt`]): its channels are then sockets it listens on in its state directory,
    /// which the next run connects to, and it gets no parent-death signal.
    pub outlive: bool,
}

/// A snapshot's two files: the machine's state and its memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotFiles {
    /// vCPUs, devices and in-kernel state (JSON).
    pub state: PathBuf,
    /// Guest memory, raw, with holes where the guest wrote nothing.
    pub memory: PathBuf,
    /// The sandbox disk as it was when the snapshot was taken (the guest's page cache and
    /// file system state refer to it): a VM restored from the snapshot gets a copy of it as its
    /// sandbox disk instead of a fresh one. Written by the snapshot's taker, not the backend.
    pub disk: Option<PathBuf>,
    /// The restore takes `disk` itself (a hard link into the VM's directory) instead of a copy:
    /// a paused sandbox's own disk, which moves with it; a failed restore leaves it in place.
    pub take_disk: bool,
}

pub use sandbox_control::vm::SnapshotDone;

/// A raw disk image. Never probed for a format: the guest may have written anything into it.
#[derive(Debug, Clone)]
pub struct Disk {
    /// File on the host.
    pub path: PathBuf,
    /// Whether the guest may write to it.
    pub read_only: bool,
}

/// The agent channel of a started VM, as a read half and a write half.
pub struct Channel {
    /// Bytes from the guest agent.
    pub read: Box<dyn AsyncRead + Unpin + Send>,
    /// Bytes to the guest agent.
    pub write: Box<dyn AsyncWrite + Unpin + Send>,
}

/// A VM that a backend started, with its agent channel.
pub struct StartedVm {
    /// Control of the VM.
    pub vm: Box<dyn Vm>,
    /// The byte stream to the agent.
    pub channel: Channel,
}

impl StartedVm {
    /// A started VM whose agent channel is one socket, split into its two halves.
    pub fn over_socket(vm: Box<dyn Vm>, stream: tokio::net::UnixStream) -> StartedVm {
        let (read, write) = stream.into_split();
        StartedVm {
            vm,
            channel: Channel {
                read: Box::new(read),
                write: Box::new(write),
            },
        }
    }
}

pub use crate::error::{
    MissingProgram, SpecError, Unsupported, VmError, VmSnapshotError, VmStartError,
};
pub use crate::exit::{VmExit, console_suffix};

/// A virtual machine backend.
#[async_trait]
pub trait Backend: Send + Sync {
    /// `qemu` or `kvm`, as the API reports it.
    fn name(&self) -> &'static str;
    /// The accelerator in use (`kvm`, `hvf`, `tcg`).
    fn accel(&self) -> String;
    /// Whether a VM can be paused into a snapshot and started again from it, any number of
    /// times (the KVM backend; a QEMU VM is snapshotted at most once, for templates).
    fn can_pause(&self) -> bool {
        false
    }
    /// Whether a VM started with [`VmSpec::outlive`] can be taken on again by the next run of
    /// the service ([`crate::adopt`]): QEMU's. A backend that cannot gets no `outlive` VMs:
    /// they die with the service, as before.
    fn can_outlive(&self) -> bool {
        false
    }
    /// Starts a VM and returns it once its agent channel is connected (not yet ready).
    async fn start(&self, spec: VmSpec) -> Result<StartedVm, VmError>;
}

/// A running (or ended) VM.
#[async_trait]
pub trait Vm: Send + Sync {
    /// How it ended, if it has.
    fn exit(&self) -> Option<VmExit>;
    /// Resolves when it ends.
    async fn wait(&self) -> VmExit;
    /// Ends it: asks the VMM to quit, forces it after `grace`, and removes every file of the VM.
    /// Returns once nothing of it is left. Calling it on an ended VM only cleans up.
    async fn stop(&self, grace: Duration) -> VmExit;
    /// Ends it as failed for `reason` (the host gave up on it, for instance because the guest
    /// stopped answering): like `stop` with no grace, but the exit is not `requested` and its
    /// reason is `reason`, so whoever waits on the VM learns why. Bounded like `stop`.
    async fn kill(&self, reason: String) -> VmExit;
    /// The last `n` console lines.
    fn console_tail(&self, n: usize) -> Vec<String>;
    /// What the VMM knows of a VM that stopped answering (vCPU activity), for error messages.
    /// Asked of a VM process, it is awaited (bounded), never waited for on a runtime's thread.
    async fn diagnostics(&self) -> String {
        String::new()
    }
    /// The host process of the VM, if it is a separate one (QEMU).
    fn pid(&self) -> Option<u32>;
    /// What takes this VM on again after a restart of the service ([`crate::adopt`]), for a VM
    /// started with [`VmSpec::outlive`] on a backend that can (QEMU) and still running.
    fn record(&self) -> Option<crate::adopt::VmRecord> {
        None
    }
    /// Pauses the guest and writes its snapshot to the spec's `snapshot_to` files; the guest
    /// runs on afterwards if `resume`, else stays paused until stopped.
    async fn snapshot(&self, resume: bool) -> Result<SnapshotDone, VmError> {
        let _ = resume;
        Err(Unsupported::Snapshots.into())
    }
    /// Pauses the guest and writes its snapshot to `to` (a fork's files, not the spec's), and
    /// leaves it paused until [`Vm::resume`]: what must agree with the memory (the sandbox
    /// disk) is copied meanwhile. Every call is answered by a `resume`, whatever the result.
    async fn snapshot_held(&self, to: &SnapshotFiles) -> Result<SnapshotDone, VmError> {
        let _ = to;
        Err(Unsupported::Snapshots.into())
    }
    /// Lets a guest that [`Vm::snapshot_held`] left paused run again.
    async fn resume(&self) -> Result<(), VmError> {
        Err(Unsupported::Snapshots.into())
    }
    /// From the backend's `start` to the guest's first instruction (the machine built and its
    /// vCPUs running): the VMM's own start-up cost, where the backend knows it (not QEMU).
    fn vmm_start(&self) -> Option<Duration> {
        None
    }
    /// From the VM's start to the guest's boot marker (userspace up), where the backend
    /// records it: our marker device on KVM, QEMU's isa-debugcon on x86_64, a virtio-serial
    /// port on aarch64.
    fn boot_marker(&self) -> Option<Duration> {
        None
    }
}

/// Makes the VM's state directory and its scratch disk, and returns the spec with that disk
/// in `disks`. On failure nothing is left behind.
pub(crate) fn prepare(spec: &VmSpec) -> Result<VmSpec, VmError> {
    make_state_dir(&spec.state_dir)?;
    let mut spec = spec.clone();
    if let Some(mib) = spec.scratch_disk_mib.take() {
        let path = spec.state_dir.join("sandbox-disk.ext4");
        let saved = spec
            .restore_from
            .as_ref()
            .and_then(|r| r.disk.clone().map(|d| (d, r.take_disk)));
        let made = match saved {
            Some((saved, true)) => std::fs::hard_link(&saved, &path).map_err(|source| {
                crate::scratch::ScratchError::Create {
                    path: path.clone(),
                    source,
                }
            }),
            Some((saved, false)) => crate::scratch::copy_sparse(&saved, &path).map(|_| ()),
            None => crate::scratch::create(&path, mib),
        };
        if let Err(e) = made {
            let _ = std::fs::remove_dir_all(&spec.state_dir);
            return Err(match e {
                crate::scratch::ScratchError::Size(_) => SpecError::DiskSize(e).into(),
                e => VmStartError::Disk(e).into(),
            });
        }
        // The guest's init finds its writable layer by this serial.
        spec.cmdline
            .push(format!("sandbox.upper=disk{}", spec.disks.len()));
        spec.disks.push(Disk {
            path,
            read_only: false,
        });
    }
    Ok(spec)
}

/// Checks what every backend needs of a spec: vCPUs, memory, and files that exist.
pub(crate) fn validate_spec(spec: &VmSpec) -> Result<(), VmError> {
    if spec.vcpus == 0 || spec.vcpus > 64 {
        return Err(SpecError::Vcpus(spec.vcpus).into());
    }
    if spec.memory_mib < 128 {
        return Err(SpecError::Memory(spec.memory_mib).into());
    }
    for p in std::iter::once(&spec.kernel)
        .chain(spec.initrd.iter())
        .chain(spec.disks.iter().map(|d| &d.path))
    {
        if !p.is_file() {
            return Err(SpecError::Missing(p.clone()).into());
        }
    }
    Ok(())
}

/// Makes a VM's state directory, its own (mode 0700); one that exists already is refused, so
/// two VMs never share one.
pub(crate) fn make_state_dir(dir: &Path) -> Result<(), VmError> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.exists() {
        return Err(SpecError::StateDirExists(dir.to_path_buf()).into());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| VmError::io(format!("creating {}", dir.display()), e))
}
