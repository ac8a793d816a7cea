//! The in-process KVM backend: a VMM on kvm-ioctls and the rust-vmm crates that boots the same
//! kernel and images as the QEMU backend, with its devices (virtio-mmio: vsock for the agent
//! channel, block, net) running on threads of this process.

pub mod backend;
pub mod boot;
pub mod cpu;
pub mod layout;
pub mod machine;
pub mod mptable;
pub mod net;
pub mod serial;

pub use backend::KvmBackend;
pub use machine::{DiskConfig, Machine, MachineConfig, MachineError, MachineExit};
