//! What crosses the boundary between the sandbox host's service and a VM process: the messages
//! of `sandbox-vm`'s control socket (the service starts it, configures it, asks it to pause and
//! snapshot; it reports), the descriptors passed with them, the exit codes and bounds both sides
//! agree on, the layout of a snapshot's files, which one side writes and the other sizes and
//! checks, and the link of Ethernet frames between a VM's network device and the egress stack. A small crate of its own so that the service never links the code that touches guest
//! memory, and the VM process never links the service (issue 31).
//!
//! The protocol is versioned ([`VERSION`]): a VM process of another version is refused at its
//! first message.

mod fds;
pub mod files;
pub mod link;

#[cfg(target_os = "linux")]
mod control;

#[cfg(target_os = "linux")]
pub use control::*;
pub use fds::send_with_fds;

/// The control protocol's version: a `sandbox-vm` built from another tree is not spoken to.
pub const VERSION: u32 = 1;

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
