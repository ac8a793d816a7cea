//! Tells the VMM that userspace is up: one byte to the boot-marker I/O port (0x440), which the
//! KVM backend records as the guest's boot time. Elsewhere (QEMU, other architectures) the port
//! is not decoded and the write is lost, which is harmless.

/// The port and value the KVM backend's boot marker listens for (sandbox-devices' BootMarker).
#[cfg(target_arch = "x86_64")]
const PORT: u16 = 0x0440;
#[cfg(target_arch = "x86_64")]
const VALUE: u8 = 0x7b;

/// Writes the marker once, if this process may touch I/O ports (it is PID 1, as root).
pub fn mark() {
    #[cfg(target_arch = "x86_64")]
    {
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
}
