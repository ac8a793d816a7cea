//! Tells the VMM that userspace is up, which it records as the guest's boot time. On x86_64: one
//! byte to the boot-marker I/O port (0x440), decoded by the KVM backend's marker device and by
//! QEMU's isa-debugcon. On aarch64 there are no I/O ports: the same byte goes to the
//! virtio-serial port `sandbox.marker` when QEMU offers one. Where neither exists the marker is
//! lost, which is harmless.

/// The value the VMMs listen for (sandbox-devices' BootMarker).
const VALUE: u8 = 0x7b;
/// The port the KVM backend's boot marker listens on.
#[cfg(target_arch = "x86_64")]
const PORT: u16 = 0x0440;

/// Writes the marker once, if this process may touch I/O ports (it is PID 1, as root).
#[cfg(target_arch = "x86_64")]
pub fn mark() {
    // SAFETY: ioperm only changes this process's I/O permission bitmap.
    if unsafe { libc::ioperm(libc::c_ulong::from(PORT), 1, 1) } != 0 {
        return;
    }
    // SAFETY: the port was granted above; writing it has no effect on this process's memory.
    unsafe {
        std::arch::asm!("out dx, al", in("dx") PORT, in("al") VALUE, options(nomem, nostack, preserves_flags));
    }
    // SAFETY: as above; dropping the permission again.
    unsafe { libc::ioperm(libc::c_ulong::from(PORT), 1, 0) };
}

/// Writes the marker once to the marker port, if the VMM gave the guest one. Devices are probed
/// before the kernel starts init, so the port is there or will not come: no waiting.
#[cfg(not(target_arch = "x86_64"))]
pub fn mark() {
    use std::io::Write;
    let Ok(Some(dev)) = crate::channel::find_serial_port(sandbox_protocol::MARKER_PORT_NAME) else {
        return;
    };
    if let Ok(mut f) = std::fs::OpenOptions::new().write(true).open(dev) {
        let _ = f.write_all(&[VALUE]);
    }
}
