//! The in-process KVM backend (issue 3), being built: today it boots the guest kernel on one
//! vCPU with a serial console and reports how the guest ended. It is not yet a [`Backend`]
//! (no virtio devices, so no agent channel), so backend selection does not offer it.
//!
//! [`Backend`]: crate::Backend

pub mod boot;
pub mod cpu;
pub mod layout;
pub mod machine;
pub mod serial;

pub use machine::{MachineConfig, MachineError, MachineExit, run};
