//! The KVM backend: a VMM on kvm-ioctls and the rust-vmm crates that boots the same kernel and
//! images as the QEMU backend, with its devices (virtio-mmio: vsock for the agent channel, block,
//! net). Each VM runs in a process of its own (`sandbox-vm`, [`child`]) that the service starts
//! in a jail ([`process`]); the machine itself ([`machine`]) can also run in the caller's
//! process, which the benchmarks compare against.

pub mod backend;
pub mod boot;
pub mod child;
pub mod control;
pub mod cpu;
pub mod layout;
pub mod machine;
pub mod mptable;
pub mod net;
pub mod process;
pub mod seal;
pub mod serial;
mod stream_link;

pub use backend::KvmBackend;
pub use machine::{
    ConsoleSink, DiskConfig, FileRef, Machine, MachineConfig, MachineError, MachineExit,
};
