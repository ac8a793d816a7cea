//! virtio-blk on a raw host file (virtio 1.2, section 5.2).
//!
//! The file is never probed for a format: the guest may have written anything into it. Every
//! request is checked against the disk's size before any host I/O; requests run synchronously on
//! the device thread through a bounded bounce buffer, so a guest asking for a huge transfer
//! costs time, not host memory.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};

use event_manager::EventOps;

use super::queue::{Chain, Reader, Writer, add_used, pop, reader, writer};
use super::{
    BYTES_PER_WAKE, CHAINS_PER_WAKE, DeviceError, Queues, VIRTIO_F_VERSION_1, VirtioDevice,
};

/// virtio device id of block devices.
pub const DEVICE_TYPE: u32 = 2;
const SECTOR: u64 = 512;
const QUEUE_SIZES: [u16; 1] = [256];
/// Bounce buffer size: the most host memory one request holds at a time.
const CHUNK: usize = 128 * 1024;
/// The most data buffers one request may have (`seg_max`, offered), and the largest of them
/// (`size_max`): a driver that keeps to them never asks for more than [`MAX_REQUEST`].
const SEG_MAX: u32 = 64;
const SIZE_MAX: u32 = 64 * 1024;
/// The most bytes one request moves, whatever its descriptors say: one wake-up's budget. A
/// chain of aliased buffers asking for more fails alone, before any host I/O, so no request
/// costs more device-thread time than a wake-up may spend.
pub const MAX_REQUEST: u64 = BYTES_PER_WAKE;
const _: () = assert!(SEG_MAX as u64 * SIZE_MAX as u64 <= MAX_REQUEST);
/// A request's header (16 bytes) and status byte, beside its data.
const HEADER_AND_STATUS: u64 = 17;

/// A block device.
pub struct Block {
    file: File,
    read_only: bool,
    capacity_sectors: u64,
    id: [u8; VIRTIO_BLK_ID_BYTES as usize],
    buf: Vec<u8>,
    /// Requests answered with an error because they were malformed or out of range.
    pub bad_requests: u64,
}

impl Block {
    /// Opens `path` (read-only if `read_only`) as a disk called `id` (at most 20 bytes used).
    pub fn open(path: &Path, read_only: bool, id: &str) -> std::io::Result<Block> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)?;
        Block::from_file(file, read_only, id)
    }

    /// A disk on a file the caller opened (read-write unless `read_only`): a jailed VM process
    /// gets its disks as descriptors, with no path to open.
    pub fn from_file(file: std::fs::File, read_only: bool, id: &str) -> std::io::Result<Block> {
        let len = file.metadata()?.len();
        let mut idb = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        for (d, s) in idb.iter_mut().zip(id.bytes()) {
            *d = s;
        }
        Ok(Block {
            file,
            read_only,
            capacity_sectors: len / SECTOR,
            id: idb,
            buf: Vec::new(),
            bad_requests: 0,
        })
    }

    fn execute(&mut self, q: &mut Queues, chain: &Chain) -> (u8, u32) {
        let Some(mut r) = reader(q.mem, chain) else {
            return (VIRTIO_BLK_S_IOERR as u8, 0);
        };
        let Some(mut w) = writer(q.mem, chain) else {
            return (VIRTIO_BLK_S_IOERR as u8, 0);
        };
        let mut hdr = [0u8; 16];
        if r.read_exact(&mut hdr).is_err() || w.available_bytes() == 0 {
            return (VIRTIO_BLK_S_IOERR as u8, 0);
        }
        // The status byte is the last writable byte; the data (for reads) comes before it.
        let data_len = w.available_bytes() - 1;
        let Some(mut status_w) = w.split_at(data_len) else {
            return (VIRTIO_BLK_S_IOERR as u8, 0);
        };
        let kind = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
        let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap_or([0; 8]));
        // Larger than the offer allows (aliased buffers included): refused before any host I/O.
        let too_large = chain.total_len() > MAX_REQUEST + HEADER_AND_STATUS;
        let (status, written) = match kind {
            _ if too_large => (VIRTIO_BLK_S_IOERR, 0),
            VIRTIO_BLK_T_IN => self.read(sector, &mut w),
            VIRTIO_BLK_T_OUT => self.write(sector, &mut r),
            VIRTIO_BLK_T_FLUSH => {
                if self.read_only || self.file.sync_data().is_ok() {
                    (VIRTIO_BLK_S_OK, 0)
                } else {
                    (VIRTIO_BLK_S_IOERR, 0)
                }
            }
            VIRTIO_BLK_T_GET_ID => {
                let n = self.id.len().min(data_len);
                match w.write_all(&self.id[..n]) {
                    Ok(()) => (VIRTIO_BLK_S_OK, n as u32),
                    Err(_) => (VIRTIO_BLK_S_IOERR, 0),
                }
            }
            _ => (VIRTIO_BLK_S_UNSUPP, 0),
        };
        if status != VIRTIO_BLK_S_OK {
            self.bad_requests += 1;
        }
        let _ = status_w.write_all(&[status as u8]);
        (status as u8, written + 1)
    }

    /// The byte range of `len` bytes at `sector`, if it is whole sectors inside the disk.
    fn range(&self, sector: u64, len: usize) -> Option<u64> {
        let len = len as u64;
        if !len.is_multiple_of(SECTOR) {
            return None;
        }
        let end = sector.checked_add(len / SECTOR)?;
        (end <= self.capacity_sectors).then(|| sector * SECTOR)
    }

    fn read(&mut self, sector: u64, w: &mut Writer<'_>) -> (u32, u32) {
        let total = w.available_bytes();
        let Some(mut off) = self.range(sector, total) else {
            return (VIRTIO_BLK_S_IOERR, 0);
        };
        let mut done = 0usize;
        while done < total {
            let n = (total - done).min(CHUNK);
            self.buf.resize(n, 0);
            if self.file.read_exact_at(&mut self.buf[..n], off).is_err()
                || w.write_all(&self.buf[..n]).is_err()
            {
                return (VIRTIO_BLK_S_IOERR, done as u32);
            }
            done += n;
            off += n as u64;
        }
        (VIRTIO_BLK_S_OK, done as u32)
    }

    fn write(&mut self, sector: u64, r: &mut Reader<'_>) -> (u32, u32) {
        if self.read_only {
            return (VIRTIO_BLK_S_IOERR, 0);
        }
        let total = r.available_bytes();
        let Some(mut off) = self.range(sector, total) else {
            return (VIRTIO_BLK_S_IOERR, 0);
        };
        let mut done = 0usize;
        while done < total {
            let n = (total - done).min(CHUNK);
            self.buf.resize(n, 0);
            if r.read_exact(&mut self.buf[..n]).is_err()
                || self.file.write_all_at(&self.buf[..n], off).is_err()
            {
                return (VIRTIO_BLK_S_IOERR, 0);
            }
            done += n;
            off += n as u64;
        }
        (VIRTIO_BLK_S_OK, 0)
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn features(&self) -> u64 {
        let mut f = VIRTIO_F_VERSION_1
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_SIZE_MAX);
        if self.read_only {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        f
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // `capacity` (le64), `size_max` and `seg_max` (le32 each); the rest reads as zero.
        let mut cfg = [0u8; 16];
        cfg[..8].copy_from_slice(&self.capacity_sectors.to_le_bytes());
        cfg[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        cfg[12..].copy_from_slice(&SEG_MAX.to_le_bytes());
        super::read_config_bytes(&cfg, offset, data);
    }

    fn queue_notify(
        &mut self,
        index: usize,
        q: &mut Queues,
        _ops: &mut EventOps,
    ) -> Result<(), DeviceError> {
        let mut used = false;
        // Bounded per wake-up, in requests and in bytes: a guest that keeps the ring full gets
        // the rest on the event loop's next round, after the VM's other devices.
        let mut bytes = 0u64;
        for taken in 0.. {
            if taken == CHAINS_PER_WAKE || bytes >= BYTES_PER_WAKE {
                q.resume_later(index);
                break;
            }
            let Some(chain) = pop(index, &mut q.queues[index], q.mem)? else {
                break;
            };
            let head = chain.head_index();
            // What the request moves, either way: its buffers' lengths (a request past
            // MAX_REQUEST moves nothing, and counts as the most one may move).
            bytes += chain.total_len().min(MAX_REQUEST);
            let (_, len) = self.execute(q, &chain);
            add_used(index, &mut q.queues[index], q.mem, head, len)?;
            used = true;
        }
        if used {
            q.interrupt.signal_used();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::testing::Driver;

    const HDR: u64 = 0x20_0000;
    const BUF: u64 = 0x30_0000;
    const STATUS: u64 = 0x40_0000;

    fn disk(read_only: bool) -> (tempfile::NamedTempFile, Driver<Block>) {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(64 * 1024).unwrap();
        let mut d = Driver::new(Block::open(f.path(), read_only, "disk-id-0").unwrap());
        d.setup(Block::open(f.path(), read_only, "x").unwrap().features());
        (f, d)
    }

    fn header(d: &Driver<Block>, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        d.put(HDR, &h);
        d.put(STATUS, &[0xff]);
    }

    fn status(d: &Driver<Block>) -> u8 {
        d.get(STATUS, 1)[0]
    }

    #[test]
    fn indirect_chains_are_refused_without_being_walked() {
        let (_f, mut d) = disk(false);
        // One table of 256 chained descriptors, and every head of the ring pointing at it: what
        // cost 2.15 s of device-thread time per kick when indirect tables were followed.
        let table = 0x50_0000u64;
        for i in 0..256u64 {
            let mut desc = [0u8; 16];
            desc[0..8].copy_from_slice(&BUF.to_le_bytes());
            desc[8..12].copy_from_slice(&512u32.to_le_bytes());
            let flags: u16 = if i < 255 { 2 | 1 } else { 1 }; // NEXT | WRITE
            desc[12..14].copy_from_slice(&flags.to_le_bytes());
            desc[14..16].copy_from_slice(&((i + 1) as u16).to_le_bytes());
            d.put(table + 16 * i, &desc);
        }
        for head in 0..256u16 {
            d.put_desc(0, head, table, 256 * 16, 4, 0); // INDIRECT
            d.publish(0, head);
        }
        let t = std::time::Instant::now();
        d.kick(0);
        let took = t.elapsed();
        eprintln!("256 indirect chains in one kick: {took:?} of device-thread time");
        let failure = d.t.lock().unwrap().failure().map(str::to_owned);
        assert!(
            failure
                .as_deref()
                .is_some_and(|f| f.contains("indirect descriptor")),
            "{failure:?}"
        );
        assert!(d.used(0).is_empty(), "nothing was executed");
    }

    #[test]
    fn a_request_past_a_wakeups_budget_fails_before_any_io() {
        // 16 aliased 4 MiB buffers ask for 64 MiB in one request of a 64 MiB disk: refused
        // before a byte moves. One buffer of the whole budget is served.
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(64 << 20).unwrap();
        let mut d = Driver::new(Block::open(f.path(), false, "big").unwrap());
        let features = d.t.lock().unwrap().device().features();
        d.setup(features);
        const BIG: u64 = 0x80_0000;
        d.put(BIG, &[0xaa; 64]);
        header(&d, VIRTIO_BLK_T_IN, 0);
        let mut bufs = vec![(HDR, 16, false)];
        bufs.extend((0..16).map(|_| (BIG, 4 << 20, true)));
        bufs.push((STATUS, 1, true));
        d.add_chain(0, &bufs);
        d.kick(0);
        assert_eq!(status(&d), VIRTIO_BLK_S_IOERR as u8);
        assert_eq!(d.used(0)[0].1, 1, "the status byte alone");
        assert_eq!(d.get(BIG, 64), [0xaa; 64], "the disk was not read");
        assert_eq!(d.t.lock().unwrap().device().bad_requests, 1);
        header(&d, VIRTIO_BLK_T_IN, 0);
        d.add_chain(
            0,
            &[(HDR, 16, false), (BIG, 4 << 20, true), (STATUS, 1, true)],
        );
        d.kick(0);
        assert_eq!(status(&d), 0);
        assert_eq!(d.get(BIG, 64), [0u8; 64]);
    }

    #[test]
    fn the_offer_bounds_a_drivers_requests_to_the_budget() {
        let (_f, d) = disk(false);
        let features = d.t.lock().unwrap().device().features();
        assert_ne!(features & (1 << VIRTIO_BLK_F_SEG_MAX), 0);
        assert_ne!(features & (1 << VIRTIO_BLK_F_SIZE_MAX), 0);
        let cfg = |off: u32| d.read(virtio_bindings::virtio_mmio::VIRTIO_MMIO_CONFIG + off);
        let (size_max, seg_max) = (cfg(8), cfg(12));
        assert_eq!(cfg(0), 128, "capacity in sectors");
        assert!(u64::from(size_max) * u64::from(seg_max) <= MAX_REQUEST);
        assert!((2..=256 - 2).contains(&seg_max), "{seg_max}");
        // Not below a page of any guest (64 KiB pages on some aarch64 kernels).
        assert!(size_max >= 64 * 1024, "{size_max}");
    }

    #[test]
    fn a_full_ring_is_served_over_several_rounds() {
        let (_f, mut d) = disk(false);
        // Every descriptor of a 256-entry ring used: 85 three-descriptor requests, more than one
        // wake-up's budget of 64. All are done, over more than one round of the event loop.
        for _ in 0..85 {
            header(&d, VIRTIO_BLK_T_IN, 0);
            d.add_chain(0, &[(HDR, 16, false), (BUF, 512, true), (STATUS, 1, true)]);
        }
        d.kick(0);
        assert_eq!(d.used(0).len(), 85);
    }

    #[test]
    fn write_flush_read_back_and_id() {
        let (f, mut d) = disk(false);
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        d.put(BUF, &data);
        header(&d, VIRTIO_BLK_T_OUT, 3);
        d.add_chain(
            0,
            &[(HDR, 16, false), (BUF, 4096, false), (STATUS, 1, true)],
        );
        d.kick(0);
        assert_eq!(d.used(0).len(), 1);
        assert_eq!(status(&d), 0);
        let on_disk = std::fs::read(f.path()).unwrap();
        assert_eq!(&on_disk[3 * 512..3 * 512 + 4096], &data[..]);

        header(&d, VIRTIO_BLK_T_FLUSH, 0);
        d.add_chain(0, &[(HDR, 16, false), (STATUS, 1, true)]);
        d.kick(0);
        assert_eq!(status(&d), 0);
        assert_eq!(d.used(0), vec![(3, 1)]);

        d.put(BUF, &[0u8; 4096]);
        header(&d, VIRTIO_BLK_T_IN, 3);
        d.add_chain(0, &[(HDR, 16, false), (BUF, 4096, true), (STATUS, 1, true)]);
        d.kick(0);
        assert_eq!(d.used(0)[0].1, 4097);
        assert_eq!(d.get(BUF, 4096), data);

        header(&d, VIRTIO_BLK_T_GET_ID, 0);
        d.add_chain(0, &[(HDR, 16, false), (BUF, 20, true), (STATUS, 1, true)]);
        d.kick(0);
        assert_eq!(status(&d), 0);
        assert_eq!(&d.get(BUF, 9), b"disk-id-0");
    }

    #[test]
    fn out_of_range_unaligned_and_unknown_requests_fail_alone() {
        let (_f, mut d) = disk(false);
        for (kind, sector, len) in [
            (VIRTIO_BLK_T_IN, 127, 1024u32),  // runs past the end (128 sectors)
            (VIRTIO_BLK_T_IN, u64::MAX, 512), // overflows
            (VIRTIO_BLK_T_OUT, 0, 100),       // not whole sectors
            (99, 0, 512),                     // unknown type
        ] {
            header(&d, kind, sector);
            let w = kind == VIRTIO_BLK_T_IN;
            d.add_chain(0, &[(HDR, 16, false), (BUF, len, w), (STATUS, 1, true)]);
            d.kick(0);
            assert_ne!(status(&d), 0, "kind {kind} sector {sector} len {len}");
        }
        assert_eq!(d.used(0).len(), 4);
        assert!(d.t.lock().unwrap().is_active());
        assert_eq!(d.t.lock().unwrap().device().bad_requests, 4);
    }

    #[test]
    fn read_only_disks_refuse_writes() {
        let (f, mut d) = disk(true);
        d.put(BUF, &[1u8; 512]);
        header(&d, VIRTIO_BLK_T_OUT, 0);
        d.add_chain(0, &[(HDR, 16, false), (BUF, 512, false), (STATUS, 1, true)]);
        d.kick(0);
        assert_eq!(status(&d), VIRTIO_BLK_S_IOERR as u8);
        assert!(std::fs::read(f.path()).unwrap().iter().all(|&b| b == 0));
    }

    #[test]
    fn descriptor_loops_and_wild_addresses_end_in_an_error_not_a_hang() {
        let (_f, mut d) = disk(false);
        header(&d, VIRTIO_BLK_T_IN, 0);
        // A chain whose second descriptor points back at the first, forever.
        d.put_desc(0, 10, HDR, 16, 1, 11);
        d.put_desc(0, 11, BUF, 512, 1 | 2, 10);
        d.publish(0, 10);
        d.kick(0);
        assert_eq!(d.used(0).len(), 1);
        // A data buffer far outside guest memory.
        header(&d, VIRTIO_BLK_T_IN, 0);
        d.put_desc(0, 20, HDR, 16, 1, 21);
        d.put_desc(0, 21, 0xffff_ffff_0000, 512, 1 | 2, 22);
        d.put_desc(0, 22, STATUS, 1, 2, 0);
        d.publish(0, 20);
        d.kick(0);
        assert_eq!(d.used(0), vec![(20, 0)]);
        // The device kept serving well-formed requests.
        header(&d, VIRTIO_BLK_T_FLUSH, 0);
        d.put_desc(0, 30, HDR, 16, 1, 31);
        d.put_desc(0, 31, STATUS, 1, 2, 0);
        d.publish(0, 30);
        d.kick(0);
        assert_eq!(status(&d), 0);
        // A head index past the table cannot even be returned: the device needs a reset, and
        // says so, rather than stalling or touching anything.
        d.publish(0, 4000);
        d.kick(0);
        let t = d.t.lock().unwrap();
        assert!(!t.is_active());
        assert_ne!(t.status() & 0x40, 0, "DEVICE_NEEDS_RESET");
        assert!(
            t.failure().unwrap().contains("queue 0"),
            "{:?}",
            t.failure()
        );
        assert_ne!(d.irq.status() & 2, 0, "config interrupt");
    }
}
