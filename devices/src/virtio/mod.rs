//! virtio devices for the KVM backend and the virtio-mmio transport they sit behind.
//!
//! A device implements [`VirtioDevice`]: what it offers (type, features, queues, config space)
//! and what it does when the driver kicks a queue or a host-side source it watches becomes
//! ready. The transport ([`mmio::MmioTransport`]) does everything the spec asks of the
//! register interface and hands the device its queues only once the driver has set them up
//! (DRIVER_OK). Every device runs on the VM's device thread (event-manager); vCPU threads only
//! touch registers.

pub mod block;
mod interrupt;
pub mod mmio;
pub mod net;
mod queue;
pub mod vsock;

use event_manager::{EventOps, EventSet};
use thiserror::Error;
use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;

pub use interrupt::Interrupt;
pub use queue::QueueError;

/// The device complies with virtio 1.x (modern only; we never offer legacy).
pub const VIRTIO_F_VERSION_1: u64 = 1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;

/// `data` values at or above this name a device's own event sources; below it, queue kicks.
pub const HOST_EVENT_BASE: u32 = 0x100;

/// Copies the bytes of a device's config space `cfg` at `offset` into `data`; bytes past its
/// end (or an offset beyond any) read as zero, whatever the guest asks for.
pub fn read_config_bytes(cfg: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(i))
            .and_then(|o| cfg.get(o).copied())
            .unwrap_or(0);
    }
}

/// What a device needs to work on its queues: guest memory, the queues, and its interrupt.
pub struct Queues<'a> {
    /// Guest memory (all of it; every address from the guest is checked against it).
    pub mem: &'a GuestMemoryMmap,
    /// The device's queues, in the device type's order.
    pub queues: &'a mut [Queue],
    /// Raises the device's interrupt.
    pub interrupt: &'a Interrupt,
    /// Queues whose work the device stopped at its per-wake-up budget (bit per queue): the
    /// transport kicks them again, so the event loop comes back to them after the VM's other
    /// devices had their turn.
    pub resume: u64,
}

impl Queues<'_> {
    /// Asks to be called again for queue `index` on the event loop's next round.
    pub fn resume_later(&mut self, index: usize) {
        if index < 64 {
            self.resume |= 1 << index;
        }
    }
}

/// Most descriptor chains a device takes from one queue per wake-up; more wait for the next round
/// of the event loop (the other devices of the VM go first).
pub const CHAINS_PER_WAKE: usize = 64;
/// Most bytes a block device moves per wake-up, likewise.
pub const BYTES_PER_WAKE: u64 = 4 << 20;

/// A device's failure. The transport marks the device broken (DEVICE_NEEDS_RESET): the guest
/// loses that device, the host and the other devices carry on.
#[derive(Debug, Error)]
pub enum DeviceError {
    /// A queue could not be used.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// The driver did something the device cannot go on from.
    #[error("the driver broke the device protocol: {0}")]
    Protocol(String),
    /// A host resource failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
}

/// One virtio device type, as the transport sees it.
pub trait VirtioDevice: Send {
    /// The virtio device id (2 = block, 1 = net, 19 = vsock).
    fn device_type(&self) -> u32;
    /// The feature bits offered (must include [`VIRTIO_F_VERSION_1`]).
    fn features(&self) -> u64;
    /// The largest size of each queue, one entry per queue.
    fn queue_max_sizes(&self) -> &[u16];
    /// Reads the device-specific config space at `offset`; bytes past its end read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes the config space (no device of ours has writable config: ignored by default).
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// Registers the host-side event sources the device watches from the start (data values
    /// from [`HOST_EVENT_BASE`] on).
    fn init(&mut self, _ops: &mut EventOps) {}
    /// The driver finished setting up (DRIVER_OK) with `features` acknowledged.
    fn activate(&mut self, _features: u64, _q: &mut Queues) -> Result<(), DeviceError> {
        Ok(())
    }
    /// The driver made buffers available on queue `index`.
    fn queue_notify(
        &mut self,
        index: usize,
        q: &mut Queues,
        ops: &mut EventOps,
    ) -> Result<(), DeviceError>;
    /// A host-side source the device registered is ready. `q` is `None` while the driver has
    /// not activated the device (or after a reset): the device must not touch guest memory.
    fn host_event(
        &mut self,
        _data: u32,
        _events: EventSet,
        _q: Option<&mut Queues>,
        _ops: &mut EventOps,
    ) -> Result<(), DeviceError> {
        Ok(())
    }
    /// The device was brought back from a snapshot, after [`activate`](Self::activate): its
    /// host-side state (connections, pending packets) is gone, the guest's is as it was.
    fn restored(&mut self, _q: &mut Queues) -> Result<(), DeviceError> {
        Ok(())
    }
    /// The driver reset the device: forget everything about the guest's side.
    fn reset(&mut self) {}
}

/// The guest-driver harness of the unit tests and the fuzz targets.
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
#[allow(missing_docs)]
pub mod testing;
