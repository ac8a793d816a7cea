//! The VM process's control socket: the service starts `sandbox-vm`, configures it, asks it to
//! pause and snapshot, and connects through it to the guest's agent; the process reports. The
//! protocol is versioned ([`VERSION`]): a VM process of another version is refused at its first
//! message.
//!
//! A VM process that may outlive the service (issue 32) also gets a socket it listens on
//! ([`VmConfig::adopt_fd`]). When its control socket ends without a stop (the service crashed or
//! handed over) its machine runs on, and it waits there for the service's next run: a new
//! connection's first line is [`Request::Adopt`], answered [`Event::Adopted`] with the version and
//! the [`VmConfig::token`] it was started with; that connection is its control socket from then
//! on. Anything else first closes that connection.

use std::os::fd::RawFd;

use serde::{Deserialize, Serialize};

pub use crate::line::{MAX_LINE, Reader, send, send_fds};

/// The control protocol's version: a `sandbox-vm` built from another tree is not spoken to.
pub const VERSION: u32 = 2;

/// The longest token of adoption ([`VmConfig::token`]).
pub const MAX_TOKEN: usize = 64;

/// Exit code of a VM process that made a system call outside its seccomp filter (its `SIGSYS`
/// handler's `_exit`): the service reads it as the kernel's word on why the VM ended.
pub const SIGSYS_EXIT: i32 = 159;

/// How long a VM process's machine may take to stop its threads; the service waits a little more
/// than this before it kills the process.
pub const STOP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What a snapshot cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SnapshotDone {
    /// Guest memory bytes written (the rest of the file is holes).
    pub memory_written: u64,
    /// Microseconds until every vCPU and the device thread had stopped.
    pub pause_us: u64,
    /// Microseconds to write the state and memory.
    pub write_us: u64,
}

/// What the VM process is to build. Every file is a descriptor number it inherited.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmConfig {
    /// The protocol's version ([`VERSION`]) the service speaks; a VM process of another
    /// refuses to start (a `sandbox-vm` left from another build beside a new service).
    #[serde(default)]
    pub version: u32,
    /// `/dev/kvm`.
    pub kvm_fd: RawFd,
    /// The kernel.
    pub kernel_fd: RawFd,
    /// The initramfs.
    pub initrd_fd: Option<RawFd>,
    /// The kernel command line (complete).
    pub cmdline: String,
    /// Guest memory.
    pub memory_mib: u32,
    /// vCPUs.
    pub vcpus: u8,
    /// Disks in order.
    pub disks: Vec<DiskFd>,
    /// The guest's vsock context id.
    pub vsock_cid: u64,
    /// The network: frames on a stream socket as a 4-byte big-endian length and the frame.
    pub net: Option<NetFd>,
    /// Start from this snapshot instead of booting the kernel. (Where a snapshot is written
    /// comes only with each [`Request::Snapshot`]: until then the process holds no file it
    /// could write one to.)
    pub restore: Option<SnapshotFds>,
    /// A socket it listens on for the service's next run, for a VM that may outlive the service
    /// (see the module's doc); `None`: the end of its control socket stops the machine.
    #[serde(default)]
    pub adopt_fd: Option<RawFd>,
    /// The token it answers an adoption with (at most [`MAX_TOKEN`] bytes).
    #[serde(default)]
    pub token: String,
}

/// A snapshot's two files, to restore from (the state read, the memory mapped privately).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct SnapshotFds {
    /// The state file.
    pub state_fd: RawFd,
    /// The memory file.
    pub memory_fd: RawFd,
}

/// One disk.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DiskFd {
    /// Its descriptor (read-write unless `read_only`).
    pub fd: RawFd,
    /// Whether the guest may write it.
    pub read_only: bool,
}

/// The network device.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NetFd {
    /// The frames' socket.
    pub fd: RawFd,
    /// The guest's MAC address.
    pub mac: [u8; 6],
}

/// From the service to the VM process.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Request {
    /// Build and start the machine (the first message, once).
    Start(VmConfig),
    /// Connect to a vsock port of the guest, retrying while nothing listens, for at most
    /// `timeout_ms`; the answer is [`Event::Connected`] with the descriptor, or
    /// [`Event::ConnectFailed`].
    Connect {
        /// The port.
        port: u32,
        /// The bound.
        timeout_ms: u64,
    },
    /// Stop the machine; the process ends after [`Event::Exit`].
    Stop,
    /// End the machine as failed for `reason`.
    Fail {
        /// Why the host gave up on it.
        reason: String,
    },
    /// Answer with [`Event::Diagnostics`].
    Diagnostics,
    /// Pause the guest and write its snapshot; run on after if `resume`. Two descriptors come
    /// with it: a pipe the state goes into (the service bounds it and writes the file), and the
    /// memory file, which the service created at the guest's size (it is written through a
    /// mapping, so the process's file size limit stays at its disks'). The answer is
    /// [`Event::Snapshot`].
    Snapshot {
        /// Named in the answer, so a late answer to an earlier request is never taken for it.
        id: u64,
        /// Let the guest run again once written.
        resume: bool,
    },
    /// Let a guest that a snapshot left paused (`resume` false) run again: a fork's parent,
    /// held while its disk was copied. Nothing is answered; a guest that runs already is left
    /// as it is.
    Resume,
    /// The first line of the service's next run on the socket of [`VmConfig::adopt_fd`]; the
    /// answer is [`Event::Adopted`].
    Adopt,
}

/// From the VM process to the service.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// The machine is built and its vCPUs run.
    Started,
    /// The machine could not be built.
    Error(String),
    /// The guest wrote its boot marker.
    Marker,
    /// Connected; the agent channel's descriptor came with this message.
    Connected,
    /// Not connected, with why.
    ConnectFailed(String),
    /// vCPU activity, for an error message.
    Diagnostics(String),
    /// A snapshot was written, or why not.
    Snapshot {
        /// The request's.
        id: u64,
        /// What it cost, or why not.
        result: Result<SnapshotDone, String>,
    },
    /// The answer to [`Request::Adopt`]: this connection is the control socket now.
    Adopted {
        /// The protocol's version the process speaks.
        version: u32,
        /// The [`VmConfig::token`] it was started with.
        token: String,
    },
    /// The machine ended.
    Exit {
        /// For a person.
        reason: String,
        /// The host asked for it.
        requested: bool,
        /// The last console lines.
        console: Vec<String>,
    },
}
