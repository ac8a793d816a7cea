//! What a machine is built from: its files (a path, or a descriptor its jail was handed), its
//! disks, its console's copy, and the snapshot a restore starts from.

use std::path::PathBuf;
use std::sync::Arc;

use crate::snapshot;

/// A file the machine reads or writes: a path it opens, or a file opened for it. A jailed VM
/// process gets every file as a descriptor: its jail has no path to any of them.
#[derive(Debug, Clone)]
pub enum FileRef {
    /// Opened by the machine.
    Path(PathBuf),
    /// Already open (read-write where the machine writes it); named for messages.
    Open(Arc<std::fs::File>, String),
}

impl FileRef {
    /// The file, opened for writing too when `write`.
    pub fn open(&self, write: bool) -> std::io::Result<std::fs::File> {
        match self {
            FileRef::Path(p) => std::fs::OpenOptions::new().read(true).write(write).open(p),
            FileRef::Open(f, _) => f.try_clone(),
        }
    }
}

impl std::fmt::Display for FileRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FileRef::Path(p) => write!(f, "{}", p.display()),
            FileRef::Open(_, name) => f.write_str(name),
        }
    }
}

impl From<PathBuf> for FileRef {
    fn from(p: PathBuf) -> Self {
        FileRef::Path(p)
    }
}

/// Where the guest's console bytes go besides the machine's own log (the VM process passes them
/// to the service).
#[derive(Clone)]
pub struct ConsoleSink(pub Arc<ConsoleFn>);

/// What a [`ConsoleSink`] calls with each piece of console output.
pub type ConsoleFn = dyn Fn(&[u8]) + Send + Sync;

impl std::fmt::Debug for ConsoleSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConsoleSink")
    }
}

/// A disk for the machine.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// Raw image.
    pub file: FileRef,
    /// Whether the guest may write it.
    pub read_only: bool,
}

/// What to boot.
#[derive(Debug, Clone)]
pub struct MachineConfig {
    /// `/dev/kvm`, opened by the caller; `None` opens it here.
    pub kvm: Option<Arc<std::fs::File>>,
    /// Uncompressed kernel with a PVH note.
    pub kernel: FileRef,
    /// Initramfs.
    pub initrd: Option<FileRef>,
    /// A copy of the guest's console output.
    pub console: Option<ConsoleSink>,
    /// Kernel command line; the machine appends a `virtio_mmio.device=` entry per device.
    pub cmdline: String,
    /// Guest memory.
    pub memory_mib: u32,
    /// vCPUs (1 to 254).
    pub vcpus: u8,
    /// Disks, as /dev/vda, /dev/vdb, ... in this order.
    pub disks: Vec<DiskConfig>,
    /// The guest's vsock context id (3 or more).
    pub vsock_cid: u64,
    /// A network device and the link behind it, if the guest has a network.
    pub net: Option<sandbox_control::link::NetAttachment>,
    /// Restore this snapshot instead of booting the kernel (which is then not read). The
    /// machine must be the one it was taken of: memory, vCPUs and devices.
    pub restore: Option<Restore>,
}

/// A snapshot to start from: its state, read and checked, and its memory file.
#[derive(Clone)]
pub struct Restore {
    /// Read with [`snapshot::MachineState::read_from`].
    pub state: Arc<snapshot::MachineState>,
    /// Mapped privately: the guest's writes never reach it.
    pub memory: FileRef,
}

impl std::fmt::Debug for Restore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Restore({} vCPUs, memory {})",
            self.state.vcpus.len(),
            self.memory
        )
    }
}
