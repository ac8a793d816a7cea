#![cfg(target_os = "linux")]
//! `sandbox-vm`: the VM process of the KVM backend. A VMM on kvm-ioctls and the rust-vmm crates
//! that boots the same kernel and images as the QEMU backend, with its devices (virtio-mmio:
//! vsock for the agent channel, block, net). Each VM runs in a process of its own, which the
//! service starts in a jail and drives over its control socket ([`child`];
//! `sandbox_control` holds the messages). This crate is all the code that touches guest
//! memory; the service links it only for the benchmarks' in-process machine.

pub mod boot;
pub mod cpu;
mod gate;
pub mod layout;
pub mod machine;
pub mod mptable;
pub mod net;
pub mod program;
pub mod saved;
pub mod seal;
pub mod serial;
pub mod snapshot;
pub mod state_check;
mod stream_link;

/// The pause before connection attempt `n` (from 0) to a guest port nothing listens on yet:
/// 2 ms doubling to 20 ms. The agent listens a few milliseconds after userspace starts on real
/// KVM, but seconds later on an emulated host, where a fixed 5 ms retry cost each VM 200
/// wake-ups a second of the guest's own processor time.
pub fn connect_pause(n: u32) -> std::time::Duration {
    std::time::Duration::from_millis((2u64 << n.min(4)).min(20))
}

pub use machine::{
    ConsoleSink, DiskConfig, FileRef, Machine, MachineConfig, MachineError, MachineExit, Restore,
};
