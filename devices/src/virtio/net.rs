//! virtio-net (virtio 1.2, section 5.1): Ethernet frames between the guest and a
//! [`NetBackend`]. The egress stack (issue 5) is the real backend; until it is plugged in,
//! [`NullNet`] drops and counts every frame.

use std::io::{Read, Write};
use std::os::fd::RawFd;

use event_manager::{EventOps, EventSet, Events};
use virtio_bindings::virtio_net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_STATUS, VIRTIO_NET_S_LINK_UP};

use super::queue::{add_used, pop, reader, writer};
use super::{DeviceError, HOST_EVENT_BASE, Queues, VIRTIO_F_VERSION_1, VirtioDevice};

/// Most frames one queue moves per wake-up (one ring's worth); more wait for the next round.
const FRAMES_PER_WAKE: usize = 256;

/// virtio device id of network devices.
pub const DEVICE_TYPE: u32 = 1;
/// `virtio_net_hdr_v1` (with `num_buffers`, as VERSION_1 requires).
pub const NET_HDR_LEN: usize = 12;
/// Largest frame accepted from the guest: 1500 bytes of MTU, Ethernet header, VLAN tag.
pub const MAX_FRAME: usize = 1518;
const RX: usize = 0;
const TX: usize = 1;
const QUEUE_SIZES: [u16; 2] = [256, 256];
const BACKEND_DATA: u32 = HOST_EVENT_BASE;

/// Where the guest's frames go and where its incoming frames come from.
pub trait NetBackend: Send {
    /// A frame from the guest (header stripped, at most [`MAX_FRAME`] bytes).
    fn send(&mut self, frame: &[u8]);
    /// The next frame for the guest, copied into `buf`; `None` when there is none.
    fn recv(&mut self, buf: &mut [u8]) -> Option<usize>;
    /// An fd that becomes readable when `recv` may have a frame, if the backend has one.
    fn ready_fd(&self) -> Option<RawFd>;
    /// Makes [`ready_fd`](Self::ready_fd) unreadable again, before the device drains `recv`: a
    /// level-triggered fd left readable while the guest has no receive buffers would keep the
    /// device thread spinning.
    fn clear_ready(&mut self) {}
}

/// The backend used until egress exists: every frame is dropped and counted.
#[derive(Debug, Default)]
pub struct NullNet {
    /// Frames the guest sent.
    pub dropped: u64,
}

impl NetBackend for NullNet {
    fn send(&mut self, _frame: &[u8]) {
        self.dropped += 1;
    }
    fn recv(&mut self, _buf: &mut [u8]) -> Option<usize> {
        None
    }
    fn ready_fd(&self) -> Option<RawFd> {
        None
    }
}

/// Counters of the device.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NetStats {
    /// Frames passed to the backend.
    pub tx_frames: u64,
    /// Frames delivered to the guest.
    pub rx_frames: u64,
    /// Guest frames dropped: truncated header, oversized, outside guest memory.
    pub tx_malformed: u64,
}

/// A network device.
pub struct Net<B: NetBackend> {
    mac: [u8; 6],
    backend: B,
    frame: Vec<u8>,
    /// A frame from the backend that found no rx buffer yet.
    held: Option<Vec<u8>>,
    stats: NetStats,
}

impl<B: NetBackend> Net<B> {
    /// A device with address `mac` in front of `backend`.
    pub fn new(mac: [u8; 6], backend: B) -> Net<B> {
        Net {
            mac,
            backend,
            frame: Vec::with_capacity(MAX_FRAME),
            held: None,
            stats: NetStats::default(),
        }
    }

    /// The counters.
    pub fn stats(&self) -> NetStats {
        self.stats
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, mutably (tests and fuzz targets hand it frames for the guest).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    fn process_tx(&mut self, q: &mut Queues) -> Result<(), DeviceError> {
        let mut used = false;
        for taken in 0.. {
            if taken == FRAMES_PER_WAKE {
                q.resume_later(TX); // more later: the VM's other devices go first
                break;
            }
            let Some(chain) = pop(TX, &mut q.queues[TX], q.mem)? else {
                break;
            };
            let head = chain.head_index();
            match reader(q.mem, &chain) {
                Some(mut r)
                    if r.available_bytes() >= NET_HDR_LEN
                        && r.available_bytes() - NET_HDR_LEN <= MAX_FRAME =>
                {
                    let mut hdr = [0u8; NET_HDR_LEN];
                    let n = r.available_bytes() - NET_HDR_LEN;
                    self.frame.resize(n, 0);
                    if r.read_exact(&mut hdr).is_ok() && r.read_exact(&mut self.frame).is_ok() {
                        self.backend.send(&self.frame);
                        self.stats.tx_frames += 1;
                    } else {
                        self.stats.tx_malformed += 1;
                    }
                }
                _ => self.stats.tx_malformed += 1,
            }
            add_used(TX, &mut q.queues[TX], q.mem, head, 0)?;
            used = true;
        }
        if used {
            q.interrupt.signal_used();
        }
        Ok(())
    }

    fn process_rx(&mut self, q: &mut Queues) -> Result<(), DeviceError> {
        let mut used = false;
        for taken in 0.. {
            if taken == FRAMES_PER_WAKE {
                q.resume_later(RX);
                break;
            }
            let frame = match self.held.take() {
                Some(f) => f,
                None => {
                    let mut buf = vec![0u8; MAX_FRAME];
                    match self.backend.recv(&mut buf) {
                        Some(n) if n <= MAX_FRAME => {
                            buf.truncate(n);
                            buf
                        }
                        Some(_) => continue,
                        None => break,
                    }
                }
            };
            let Some(chain) = pop(RX, &mut q.queues[RX], q.mem)? else {
                self.held = Some(frame);
                break;
            };
            let head = chain.head_index();
            let mut len = 0u32;
            if let Some(mut w) = writer(q.mem, &chain)
                && w.available_bytes() >= NET_HDR_LEN + frame.len()
            {
                let mut hdr = [0u8; NET_HDR_LEN];
                hdr[10] = 1; // num_buffers
                if w.write_all(&hdr).is_ok() && w.write_all(&frame).is_ok() {
                    len = (NET_HDR_LEN + frame.len()) as u32;
                    self.stats.rx_frames += 1;
                }
            }
            add_used(RX, &mut q.queues[RX], q.mem, head, len)?;
            used = true;
        }
        if used {
            q.interrupt.signal_used();
        }
        Ok(())
    }
}

impl<B: NetBackend> VirtioDevice for Net<B> {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | (1 << VIRTIO_NET_F_MAC) | (1 << VIRTIO_NET_F_STATUS)
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // mac[6], status (le16).
        let mut cfg = [0u8; 8];
        cfg[..6].copy_from_slice(&self.mac);
        cfg[6..8].copy_from_slice(&(VIRTIO_NET_S_LINK_UP as u16).to_le_bytes());
        super::read_config_bytes(&cfg, offset, data);
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Some(fd) = self.backend.ready_fd() {
            let _ = ops.add(Events::with_data_raw(fd, BACKEND_DATA, EventSet::IN));
        }
    }

    fn queue_notify(
        &mut self,
        index: usize,
        q: &mut Queues,
        _ops: &mut EventOps,
    ) -> Result<(), DeviceError> {
        if index == TX {
            self.process_tx(q)?;
        }
        self.process_rx(q)
    }

    fn host_event(
        &mut self,
        _data: u32,
        _events: EventSet,
        q: Option<&mut Queues>,
        _ops: &mut EventOps,
    ) -> Result<(), DeviceError> {
        self.backend.clear_ready();
        match q {
            Some(q) => self.process_rx(q),
            None => Ok(()),
        }
    }

    fn reset(&mut self) {
        self.held = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::mmio::MmioDevice;
    use crate::virtio::testing::Driver;

    #[derive(Default)]
    struct Capture(Vec<Vec<u8>>);
    impl NetBackend for Capture {
        fn send(&mut self, frame: &[u8]) {
            self.0.push(frame.to_vec());
        }
        fn recv(&mut self, _buf: &mut [u8]) -> Option<usize> {
            None
        }
        fn ready_fd(&self) -> Option<RawFd> {
            None
        }
    }

    #[test]
    fn frames_reach_the_backend_and_bad_ones_are_counted() {
        let mut d = Driver::new(Net::new([2, 0, 0, 0, 0, 1], Capture::default()));
        d.setup(VIRTIO_F_VERSION_1 | (1 << VIRTIO_NET_F_MAC));
        let mut mac = [0u8; 6];
        d.t.lock().unwrap().mmio_read(0x100, &mut mac);
        assert_eq!(mac, [2, 0, 0, 0, 0, 1]);
        let frame: Vec<u8> = (0..60u8).collect();
        d.put(0x20_0000, &[0u8; NET_HDR_LEN]);
        d.put(0x20_1000, &frame);
        d.add_chain(
            TX,
            &[
                (0x20_0000, NET_HDR_LEN as u32, false),
                (0x20_1000, 60, false),
            ],
        );
        // Truncated header, oversized frame, address outside memory.
        d.add_chain(TX, &[(0x20_0000, 5, false)]);
        d.add_chain(
            TX,
            &[
                (0x20_0000, NET_HDR_LEN as u32, false),
                (0x20_1000, 9000, false),
            ],
        );
        d.add_chain(TX, &[(0xffff_0000_0000, 100, false)]);
        d.kick(TX);
        assert_eq!(d.used(TX).len(), 4);
        let t = d.t.lock().unwrap();
        assert_eq!(t.device().backend().0, vec![frame]);
        assert_eq!(t.device().stats().tx_frames, 1);
        assert_eq!(t.device().stats().tx_malformed, 3);
        assert!(t.is_active());
    }

    #[test]
    fn the_null_backend_counts_what_it_drops() {
        let mut n = NullNet::default();
        n.send(&[0; 60]);
        assert_eq!(n.dropped, 1);
        assert!(n.recv(&mut [0; 64]).is_none());
    }
}
