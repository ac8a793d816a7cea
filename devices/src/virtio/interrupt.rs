//! A virtio-mmio device's interrupt: the InterruptStatus bits the driver reads and acknowledges,
//! and the eventfd that KVM turns into an edge on the device's interrupt line (irqfd).

use std::sync::atomic::{AtomicU32, Ordering};

use vmm_sys_util::eventfd::EventFd;

/// InterruptStatus bit: a queue's used ring has new entries.
pub const INT_VRING: u32 = virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_VRING;
/// InterruptStatus bit: the configuration (or the device status) changed.
pub const INT_CONFIG: u32 = virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_CONFIG;

/// Shared by the transport (vCPU thread) and the device (device thread).
#[derive(Debug)]
pub struct Interrupt {
    status: AtomicU32,
    evt: EventFd,
}

impl Interrupt {
    /// An interrupt raised through `evt` (registered with KVM as an irqfd by the VMM).
    pub fn new(evt: EventFd) -> Interrupt {
        Interrupt {
            status: AtomicU32::new(0),
            evt,
        }
    }

    /// Tells the driver that used rings changed.
    pub fn signal_used(&self) {
        self.raise(INT_VRING);
    }

    /// Tells the driver that the config space or the device status changed.
    pub fn signal_config(&self) {
        self.raise(INT_CONFIG);
    }

    fn raise(&self, bit: u32) {
        self.status.fetch_or(bit, Ordering::SeqCst);
        // A full eventfd counter (2^64 - 2 pending) cannot happen: KVM drains it on every edge.
        let _ = self.evt.write(1);
    }

    /// The InterruptStatus register.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// InterruptACK: clears the bits the driver has handled.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Sets the pending bits a snapshot recorded (the line itself is in the irqchip's state).
    pub fn set_status(&self, bits: u32) {
        self.status.store(bits, Ordering::SeqCst);
    }

    /// Forgets pending bits (device reset).
    pub fn clear(&self) {
        self.status.store(0, Ordering::SeqCst);
    }

    /// The eventfd, to register with KVM.
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}
