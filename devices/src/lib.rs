//! Device models of sandbox-host's KVM backend, which the VM process (`sandbox-vm`) runs: the
//! boot marker, and the virtio devices (block, vsock, net) with their virtio-mmio transport. The
//! service links none of them: what it reads of a VM (its console, the boot marker's byte) is
//! in `sandbox-control` and `sandbox-protocol`.
#![forbid(unsafe_code)]

pub mod boot_marker;
#[cfg(target_os = "linux")]
pub mod virtio;

pub use boot_marker::BootMarker;
