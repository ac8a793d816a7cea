//! Device models of sandbox-host.
//!
//! The console log is shared by both backends: the bounded record of what a guest printed, kept
//! so a VM that dies can say why. The virtio devices (block, vsock, net) and their virtio-mmio
//! transport belong to the KVM backend, which runs them in-process on its device thread.
#![forbid(unsafe_code)]

pub mod boot_marker;
pub mod console_log;
#[cfg(target_os = "linux")]
pub mod virtio;

pub use boot_marker::BootMarker;
pub use console_log::ConsoleLog;
