//! Device models of sandbox-host.
//!
//! The virtio-mmio transport and the virtio-blk, virtio-vsock and virtio-net devices of the KVM
//! backend land here (issue 3). What is here already is shared by both backends: the console log,
//! the bounded record of what a guest printed, kept so a VM that dies can say why.
#![forbid(unsafe_code)]

pub mod console_log;

pub use console_log::ConsoleLog;
