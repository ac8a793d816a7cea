//! Tells the VMM that userspace is up, which it records as the guest's boot time. On x86_64: one
//! byte to the boot-marker I/O port (0x440), decoded by the KVM backend's marker device and by
//! QEMU's isa-debugcon. On aarch64 there are no I/O ports: the same byte goes to the
//! virtio-serial port `sandbox.marker` when QEMU offers one. Where neither exists the marker is
//! lost, which is harmless.

#[cfg(target_arch = "x86_64")]
use sandbox_protocol::boot_marker::PORT;
use sandbox_protocol::boot_marker::VALUE;

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

/// Writes the marker once to the marker port, if the VMM gave the guest one. A port's name
/// arrives through virtio-serial's control queue and may show in sysfs just after init starts,
/// so it is looked for briefly (up to 500 ms, in 5 ms steps; on QEMU's `virt` it is there).
#[cfg(not(target_arch = "x86_64"))]
pub fn mark() {
    use std::io::Write;
    let mut dev = None;
    for _ in 0..100 {
        if let Ok(Some(d)) = crate::channel::find_serial_port(sandbox_protocol::MARKER_PORT_NAME) {
            dev = Some(d);
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let Some(dev) = dev else {
        return;
    };
    if let Ok(mut f) = std::fs::OpenOptions::new().write(true).open(dev) {
        let _ = f.write_all(&[VALUE]);
    }
}
