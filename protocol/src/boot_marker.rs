//! The boot marker: one byte the guest's init writes once, as its first act as PID 1, so that
//! a VM's boot time is measured from inside the guest rather than guessed from its console. On
//! x86_64 it goes to an I/O port, which the KVM backend's marker device and QEMU's
//! `isa-debugcon` read; on aarch64 to the virtio-serial port `sandbox.marker`. Only the first
//! write of [`VALUE`] counts: a guest cannot move the mark.

/// The I/O port (unused by anything else on our machines).
pub const PORT: u16 = 0x0440;
/// The value the guest writes.
pub const VALUE: u8 = 0x7b;
