//! A test driver: guest memory, a transport set up through its registers the way Linux's
//! virtio-mmio driver does it, hand-built descriptor chains, and a real event loop.

use std::sync::{Arc, Mutex};

use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use virtio_bindings::virtio_mmio as reg;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::mmio::{MmioDevice, MmioTransport, RestoreError};
use super::{Interrupt, VirtioDevice};

pub const MEM_SIZE: usize = 16 << 20;

pub type Manager = EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>;

pub struct Driver<D: VirtioDevice + 'static> {
    pub mem: GuestMemoryMmap,
    pub t: Arc<Mutex<MmioTransport<D>>>,
    pub em: Manager,
    pub irq: Arc<Interrupt>,
    sizes: Vec<u16>,
    next_desc: Vec<u16>,
    avail_idx: Vec<u16>,
    used_seen: Vec<u16>,
}

pub fn queue_base(i: usize) -> u64 {
    0x1_0000 * (i as u64 + 1)
}

impl<D: VirtioDevice + 'static> Driver<D> {
    pub fn new(device: D) -> Self {
        Self::with_memory(device, MEM_SIZE)
    }

    /// A driver with `size` bytes of guest memory (the fuzz targets compare all of it).
    pub fn with_memory(device: D, size: usize) -> Self {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size)]).unwrap();
        let irq = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
        let sizes = device.queue_max_sizes().to_vec();
        let t = Arc::new(Mutex::new(
            MmioTransport::new(device, mem.clone(), irq.clone()).unwrap(),
        ));
        let mut em = Manager::new().unwrap();
        em.add_subscriber(t.clone());
        let n = sizes.len();
        Driver {
            mem,
            t,
            em,
            irq,
            sizes,
            next_desc: vec![0; n],
            avail_idx: vec![0; n],
            used_seen: vec![0; n],
        }
    }

    /// A second transport with `device` over the same guest memory, restored from this one's
    /// saved state: what a machine restored from a snapshot has. The driver's ring bookkeeping
    /// carries over, as the guest's does.
    pub fn restored(&self, device: D) -> Result<Driver<D>, RestoreError> {
        let state = self.t.lock().unwrap().save_state();
        let irq = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
        let mut t = MmioTransport::new(device, self.mem.clone(), irq.clone()).unwrap();
        t.restore_state(&state)?;
        let t = Arc::new(Mutex::new(t));
        let mut em = Manager::new().unwrap();
        em.add_subscriber(t.clone());
        Ok(Driver {
            mem: self.mem.clone(),
            t,
            em,
            irq,
            sizes: self.sizes.clone(),
            next_desc: self.next_desc.clone(),
            avail_idx: self.avail_idx.clone(),
            used_seen: self.used_seen.clone(),
        })
    }

    pub fn read(&self, off: u32) -> u32 {
        let mut b = [0u8; 4];
        self.t.lock().unwrap().mmio_read(u64::from(off), &mut b);
        u32::from_le_bytes(b)
    }

    pub fn write(&self, off: u32, v: u32) {
        self.t
            .lock()
            .unwrap()
            .mmio_write(u64::from(off), &v.to_le_bytes());
    }

    /// Negotiates `features` and sets up every queue at its full size, then DRIVER_OK.
    pub fn setup(&mut self, features: u64) {
        self.write(reg::VIRTIO_MMIO_STATUS, 1);
        self.write(reg::VIRTIO_MMIO_STATUS, 3);
        self.write(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
        self.write(reg::VIRTIO_MMIO_DRIVER_FEATURES, features as u32);
        self.write(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        self.write(reg::VIRTIO_MMIO_DRIVER_FEATURES, (features >> 32) as u32);
        self.write(reg::VIRTIO_MMIO_STATUS, 11);
        assert_eq!(
            self.read(reg::VIRTIO_MMIO_STATUS),
            11,
            "FEATURES_OK refused"
        );
        for i in 0..self.sizes.len() {
            self.setup_queue(i, self.sizes[i]);
        }
        self.write(reg::VIRTIO_MMIO_STATUS, 15);
    }

    pub fn setup_queue(&self, i: usize, size: u16) {
        let base = queue_base(i);
        self.write(reg::VIRTIO_MMIO_QUEUE_SEL, i as u32);
        self.write(reg::VIRTIO_MMIO_QUEUE_NUM, u32::from(size));
        self.write(reg::VIRTIO_MMIO_QUEUE_DESC_LOW, base as u32);
        self.write(reg::VIRTIO_MMIO_QUEUE_DESC_HIGH, 0);
        self.write(reg::VIRTIO_MMIO_QUEUE_AVAIL_LOW, (base + 0x1000) as u32);
        self.write(reg::VIRTIO_MMIO_QUEUE_AVAIL_HIGH, 0);
        self.write(reg::VIRTIO_MMIO_QUEUE_USED_LOW, (base + 0x2000) as u32);
        self.write(reg::VIRTIO_MMIO_QUEUE_USED_HIGH, 0);
        self.write(reg::VIRTIO_MMIO_QUEUE_READY, 1);
    }

    /// Writes a raw descriptor.
    pub fn put_desc(&self, q: usize, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = GuestAddress(queue_base(q) + 16 * u64::from(index));
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        self.mem.write_slice(&d, at).unwrap();
    }

    /// Publishes `head` on the avail ring.
    pub fn publish(&mut self, q: usize, head: u16) {
        let avail = queue_base(q) + 0x1000;
        let idx = self.avail_idx[q];
        let slot = u64::from(idx % self.sizes[q]);
        self.mem
            .write_obj(head, GuestAddress(avail + 4 + 2 * slot))
            .unwrap();
        self.avail_idx[q] = idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx[q], GuestAddress(avail + 2))
            .unwrap();
    }

    /// The descriptor index the next chain of queue `q` will start at.
    pub fn next_head(&self, q: usize) -> u16 {
        self.next_desc[q]
    }

    /// Adds a chain of (address, length, device-writable) buffers and publishes it.
    pub fn add_chain(&mut self, q: usize, bufs: &[(u64, u32, bool)]) -> u16 {
        let size = self.sizes[q];
        let head = self.next_desc[q];
        for (i, &(addr, len, w)) in bufs.iter().enumerate() {
            let idx = (head + i as u16) % size;
            let last = i + 1 == bufs.len();
            let flags = if last { 0 } else { 1 } | if w { 2 } else { 0 };
            self.put_desc(q, idx, addr, len, flags, (idx + 1) % size);
        }
        self.next_desc[q] = (head + bufs.len() as u16) % size;
        self.publish(q, head);
        head
    }

    /// Kicks queue `q` and runs the event loop until it is idle.
    pub fn kick(&mut self, q: usize) {
        self.write(reg::VIRTIO_MMIO_QUEUE_NOTIFY, q as u32);
        self.run();
    }

    /// Resets the device (status 0), as a driver does, and forgets this driver's ring state.
    pub fn reset(&mut self) {
        self.write(reg::VIRTIO_MMIO_STATUS, 0);
        self.next_desc.fill(0);
        self.avail_idx.fill(0);
        self.used_seen.fill(0);
        self.run();
    }

    pub fn run(&mut self) {
        while self.em.run_with_timeout(20).unwrap() > 0 {}
    }

    /// Used entries (id, len) since the last call.
    pub fn used(&mut self, q: usize) -> Vec<(u32, u32)> {
        let used = queue_base(q) + 0x2000;
        let idx: u16 = self.mem.read_obj(GuestAddress(used + 2)).unwrap();
        let mut out = Vec::new();
        while self.used_seen[q] != idx {
            let slot = u64::from(self.used_seen[q] % self.sizes[q]);
            let id: u32 = self
                .mem
                .read_obj(GuestAddress(used + 4 + 8 * slot))
                .unwrap();
            let len: u32 = self
                .mem
                .read_obj(GuestAddress(used + 8 + 8 * slot))
                .unwrap();
            out.push((id, len));
            self.used_seen[q] = self.used_seen[q].wrapping_add(1);
        }
        out
    }

    pub fn put(&self, addr: u64, bytes: &[u8]) {
        self.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
    }

    pub fn get(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }
}
