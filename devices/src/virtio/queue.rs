//! Taking descriptor chains from a queue and returning them, with every failure named.
//!
//! A chain is read from guest memory once, into a copy ([`Chain`]) that every later step uses:
//! the refusal of indirect descriptors, the byte budgets and the device's reads and writes all
//! see the same descriptors, whatever another vCPU writes into the table meanwhile (a guest that
//! flips `VIRTQ_DESC_F_INDIRECT` between a check and a use gets nothing from it). virtio-queue
//! still reads the avail ring (and bounds its index); the walk of the table is ours, bounded by
//! the queue's size, and each descriptor's range is checked against guest memory before any
//! byte moves.

use std::collections::VecDeque;
use std::io;

use thiserror::Error;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// Why a queue could not be used.
#[derive(Debug, Error)]
pub enum QueueError {
    /// The avail ring or a descriptor is outside guest memory, or the avail index is bogus.
    #[error("queue {index}: {what}")]
    Ring {
        /// Which queue.
        index: usize,
        /// What was wrong.
        what: String,
    },
}

/// VIRTQ_DESC_F_NEXT: the chain continues at `next`.
const DESC_F_NEXT: u16 = 1;
/// VIRTQ_DESC_F_WRITE: the device writes this buffer.
const DESC_F_WRITE: u16 = 2;
/// VIRTQ_DESC_F_INDIRECT: the descriptor points at a table of further descriptors.
const DESC_F_INDIRECT: u16 = 4;
/// Bytes of one descriptor in the table.
const DESC_LEN: u64 = 16;

/// One buffer of a chain, as it was when the chain was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Buffer {
    addr: u64,
    len: u32,
    write: bool,
}

/// A chain the guest handed over: its head, to return it by, and a copy of its descriptors.
#[derive(Debug, Clone)]
pub struct Chain {
    head: u16,
    buffers: Vec<Buffer>,
    /// False for a chain that loops or names a descriptor past the table: the request fails
    /// alone (the driver is wrong, not the device).
    whole: bool,
}

impl Chain {
    /// The head's index, for the used ring.
    pub fn head_index(&self) -> u16 {
        self.head
    }

    /// What the chain's buffers hold, both ways: the most a request can move.
    pub fn total_len(&self) -> u64 {
        self.buffers.iter().map(|b| u64::from(b.len)).sum()
    }

    fn part(&self, mem: &GuestMemoryMmap, write: bool) -> Option<Buffers> {
        if !self.whole {
            return None;
        }
        let mut ranges = VecDeque::new();
        let mut left = 0usize;
        for b in self
            .buffers
            .iter()
            .filter(|b| b.write == write && b.len > 0)
        {
            let len = b.len as usize;
            if !mem.check_range(GuestAddress(b.addr), len) {
                return None;
            }
            left = left.checked_add(len)?;
            ranges.push_back((b.addr, len));
        }
        Some(Buffers { ranges, left })
    }
}

/// Guest memory ranges, consumed from the front.
#[derive(Debug)]
struct Buffers {
    ranges: VecDeque<(u64, usize)>,
    left: usize,
}

impl Buffers {
    /// The next piece of at most `max` bytes, consumed.
    fn next(&mut self, max: usize) -> Option<(GuestAddress, usize)> {
        let (addr, len) = self.ranges.front_mut()?;
        let n = (*len).min(max);
        let at = GuestAddress(*addr);
        *addr += n as u64;
        *len -= n;
        if *len == 0 {
            self.ranges.pop_front();
        }
        self.left -= n;
        Some((at, n))
    }

    /// Splits off what lies past `offset`; `self` keeps the first `offset` bytes.
    fn split_at(&mut self, offset: usize) -> Option<Buffers> {
        if offset > self.left {
            return None;
        }
        let mut keep = VecDeque::new();
        let mut need = offset;
        while need > 0 {
            let (addr, len) = self.ranges.pop_front()?;
            let n = len.min(need);
            keep.push_back((addr, n));
            if n < len {
                self.ranges.push_front((addr + n as u64, len - n));
            }
            need -= n;
        }
        let rest = Buffers {
            ranges: std::mem::replace(&mut self.ranges, keep),
            left: self.left - offset,
        };
        self.left = offset;
        Some(rest)
    }
}

fn memory_error(e: vm_memory::GuestMemoryError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// The readable part of a chain.
#[derive(Debug)]
pub struct Reader<'a> {
    mem: &'a GuestMemoryMmap,
    buffers: Buffers,
}

impl Reader<'_> {
    /// Bytes left to read.
    pub fn available_bytes(&self) -> usize {
        self.buffers.left
    }
}

impl io::Read for Reader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.buffers.next(buf.len()) {
            Some((at, n)) => {
                self.mem
                    .read_slice(&mut buf[..n], at)
                    .map_err(memory_error)?;
                Ok(n)
            }
            None => Ok(0),
        }
    }
}

/// The writable part of a chain.
#[derive(Debug)]
pub struct Writer<'a> {
    mem: &'a GuestMemoryMmap,
    buffers: Buffers,
}

impl<'a> Writer<'a> {
    /// Room left to write.
    pub fn available_bytes(&self) -> usize {
        self.buffers.left
    }

    /// Splits off the room past `offset` as a writer of its own; this one keeps the first
    /// `offset` bytes. `None` if there is less room than `offset`.
    pub fn split_at(&mut self, offset: usize) -> Option<Writer<'a>> {
        Some(Writer {
            mem: self.mem,
            buffers: self.buffers.split_at(offset)?,
        })
    }
}

impl io::Write for Writer<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self.buffers.next(buf.len()) {
            Some((at, n)) => {
                self.mem.write_slice(&buf[..n], at).map_err(memory_error)?;
                Ok(n)
            }
            None => Ok(0),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The next available chain of `queue`, if any, copied out of guest memory. Errors (an avail
/// index that moved more than the queue size, rings or descriptors outside memory, a chain with
/// an indirect descriptor or longer than the queue) mean the driver is broken.
pub fn pop(
    index: usize,
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
) -> Result<Option<Chain>, QueueError> {
    if !queue.ready() {
        return Ok(None);
    }
    let head = {
        let mut iter = queue.iter(mem).map_err(|e| QueueError::Ring {
            index,
            what: format!("{e:?}"),
        })?;
        let Some(chain) = iter.next() else {
            return Ok(None);
        };
        chain.head_index()
    };
    let (buffers, whole) = walk(queue.desc_table(), queue.size(), mem, head)
        .map_err(|what| QueueError::Ring { index, what })?;
    Ok(Some(Chain {
        head,
        buffers,
        whole,
    }))
}

/// Reads the chain at `head` once: each descriptor in one read, at most `size` of them, and
/// says whether it ended where it should (not if it loops or runs past the table). No device of ours offers
/// VIRTIO_RING_F_INDIRECT_DESC: a chain with an indirect descriptor is a driver that broke the
/// protocol, and its table is never walked; that, and a table outside guest memory, are errors.
fn walk(
    table: u64,
    size: u16,
    mem: &GuestMemoryMmap,
    head: u16,
) -> Result<(Vec<Buffer>, bool), String> {
    let table = GuestAddress(table);
    let mut buffers = Vec::new();
    let mut at = head;
    loop {
        if at >= size {
            if buffers.is_empty() {
                return Err(format!("a head index {at} past the queue's {size}"));
            }
            return Ok((buffers, false));
        }
        if buffers.len() == usize::from(size) {
            return Ok((buffers, false));
        }
        let mut raw = [0u8; DESC_LEN as usize];
        table
            .checked_add(u64::from(at) * DESC_LEN)
            .and_then(|a| mem.read_slice(&mut raw, a).ok())
            .ok_or_else(|| format!("descriptor {at} is outside guest memory"))?;
        let field = |r: std::ops::Range<usize>| -> u64 {
            raw[r].iter().rev().fold(0, |v, b| (v << 8) | u64::from(*b))
        };
        let (addr, len, flags, next) = (
            field(0..8),
            field(8..12) as u32,
            field(12..14) as u16,
            field(14..16) as u16,
        );
        if flags & DESC_F_INDIRECT != 0 {
            return Err("an indirect descriptor, which the device never offered".into());
        }
        buffers.push(Buffer {
            addr,
            len,
            write: flags & DESC_F_WRITE != 0,
        });
        if flags & DESC_F_NEXT == 0 {
            return Ok((buffers, true));
        }
        at = next;
    }
}

/// Puts `head` back on the used ring with `len` bytes written.
pub fn add_used(
    index: usize,
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    head: u16,
    len: u32,
) -> Result<(), QueueError> {
    queue
        .add_used(mem, head, len)
        .map_err(|e| QueueError::Ring {
            index,
            what: format!("adding a used entry: {e:?}"),
        })
}

/// The readable part of a chain; `None` if a buffer lies outside guest memory.
pub fn reader<'a>(mem: &'a GuestMemoryMmap, chain: &Chain) -> Option<Reader<'a>> {
    Some(Reader {
        mem,
        buffers: chain.part(mem, false)?,
    })
}

/// The writable part of a chain; `None` if a buffer lies outside guest memory.
pub fn writer<'a>(mem: &'a GuestMemoryMmap, chain: &Chain) -> Option<Writer<'a>> {
    Some(Writer {
        mem,
        buffers: chain.part(mem, true)?,
    })
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    const SIZE: u16 = 16;
    const TABLE: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const DATA: u64 = 0x1_0000;
    const OUT: u64 = 0x2_0000;

    fn ring() -> (GuestMemoryMmap, Queue) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let mut q = Queue::new(SIZE).unwrap();
        q.set_size(SIZE);
        q.set_desc_table_address(Some(TABLE as u32), Some(0));
        q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
        q.set_used_ring_address(Some(USED as u32), Some(0));
        q.set_ready(true);
        (mem, q)
    }

    fn put_desc(mem: &GuestMemoryMmap, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        mem.write_slice(&d, GuestAddress(TABLE + 16 * u64::from(index)))
            .unwrap();
    }

    /// Publishes `head` as the `n`th entry of the avail ring.
    fn publish(mem: &GuestMemoryMmap, n: u16, head: u16) {
        let slot = u64::from(n % SIZE);
        mem.write_obj(head, GuestAddress(AVAIL + 4 + 2 * slot))
            .unwrap();
        mem.write_obj(n.wrapping_add(1), GuestAddress(AVAIL + 2))
            .unwrap();
    }

    #[test]
    fn the_device_uses_the_chain_as_it_was_taken() {
        let (mem, mut q) = ring();
        mem.write_slice(&[7u8; 64], GuestAddress(DATA)).unwrap();
        put_desc(&mem, 0, DATA, 64, DESC_F_NEXT, 1);
        put_desc(&mem, 1, OUT, 32, DESC_F_WRITE, 0);
        publish(&mem, 0, 0);
        let chain = pop(0, &mut q, &mem).unwrap().unwrap();
        // What another vCPU writes into the table after the chain was taken changes nothing.
        put_desc(&mem, 0, 0x8_0000, 4096, DESC_F_INDIRECT | DESC_F_NEXT, 1);
        put_desc(&mem, 1, 0x9_0000, 4096, DESC_F_WRITE, 0);
        let mut r = reader(&mem, &chain).unwrap();
        assert_eq!(r.available_bytes(), 64);
        let mut got = vec![];
        r.read_to_end(&mut got).unwrap();
        assert_eq!(got, [7u8; 64]);
        let mut w = writer(&mem, &chain).unwrap();
        assert_eq!(w.available_bytes(), 32);
        w.write_all(&[9u8; 32]).unwrap();
        assert!(w.write_all(&[1]).is_err(), "no room past the buffer");
        let mut out = [0u8; 33];
        mem.read_slice(&mut out, GuestAddress(OUT)).unwrap();
        assert_eq!(&out[..32], &[9u8; 32]);
        assert_eq!(out[32], 0);
        assert_eq!(chain.total_len(), 96);
    }

    #[test]
    fn an_indirect_descriptor_anywhere_in_the_chain_is_refused() {
        // Past a readable head too: the walk reads each descriptor's own flags.
        let (mem, mut q) = ring();
        put_desc(&mem, 0, DATA, 16, DESC_F_NEXT, 1);
        put_desc(&mem, 1, OUT, 16, DESC_F_WRITE | DESC_F_NEXT, 2);
        put_desc(&mem, 2, 0x4000, 16 * 16, DESC_F_INDIRECT, 0);
        publish(&mem, 0, 0);
        let e = pop(0, &mut q, &mem).unwrap_err().to_string();
        assert!(e.contains("indirect descriptor"), "{e}");
    }

    #[test]
    fn loops_and_bad_next_indices_fail_the_request_alone() {
        let (mem, mut q) = ring();
        put_desc(&mem, 0, DATA, 16, DESC_F_NEXT, 1);
        put_desc(&mem, 1, OUT, 16, DESC_F_WRITE | DESC_F_NEXT, 0);
        publish(&mem, 0, 0);
        let chain = pop(0, &mut q, &mem).unwrap().unwrap();
        assert_eq!(
            chain.buffers.len(),
            usize::from(SIZE),
            "walked at most the queue's size"
        );
        assert!(reader(&mem, &chain).is_none() && writer(&mem, &chain).is_none());
        put_desc(&mem, 2, DATA, 16, DESC_F_NEXT, SIZE + 3);
        publish(&mem, 1, 2);
        let chain = pop(0, &mut q, &mem).unwrap().unwrap();
        assert!(reader(&mem, &chain).is_none());
        // A buffer outside guest memory: the request fails, the ring carries on.
        put_desc(&mem, 3, u64::MAX - 8, 16, 0, 0);
        publish(&mem, 2, 3);
        let chain = pop(0, &mut q, &mem).unwrap().unwrap();
        assert!(reader(&mem, &chain).is_none());
    }

    #[test]
    fn a_racing_vcpu_never_gets_an_indirect_table_walked() {
        // One vCPU flips the second descriptor between direct and indirect as fast as it can
        // while the device takes the same chain over and over: each chain taken is either
        // refused whole or exactly the two direct buffers, never the table's contents.
        let (mem, mut q) = ring();
        for i in 0..SIZE {
            // The "table" an indirect descriptor would name: 16 buffers of 4 KiB.
            put_desc(&mem, i, 0x4_0000, 4096, DESC_F_NEXT, (i + 1) % SIZE);
        }
        put_desc(&mem, 0, DATA, 16, DESC_F_NEXT, 1);
        put_desc(&mem, 1, OUT, 16, DESC_F_WRITE, 0);
        let stop = Arc::new(AtomicBool::new(false));
        let flipper = {
            let (mem, stop) = (mem.clone(), stop.clone());
            std::thread::spawn(move || {
                let at = GuestAddress(TABLE + 16 + 12);
                let mut flips = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let flags = if flips.is_multiple_of(2) {
                        DESC_F_WRITE | DESC_F_INDIRECT
                    } else {
                        DESC_F_WRITE
                    };
                    mem.write_obj(flags, at).unwrap();
                    flips += 1;
                }
                flips
            })
        };
        let (mut refused, mut direct) = (0, 0);
        for n in 0..20_000u32 {
            publish(&mem, n as u16, 0);
            match pop(0, &mut q, &mem) {
                Err(e) => {
                    assert!(e.to_string().contains("indirect"), "{e}");
                    refused += 1;
                }
                Ok(Some(chain)) => {
                    assert_eq!(chain.total_len(), 32, "{chain:?}");
                    assert_eq!(reader(&mem, &chain).unwrap().available_bytes(), 16);
                    assert_eq!(writer(&mem, &chain).unwrap().available_bytes(), 16);
                    direct += 1;
                }
                Ok(None) => panic!("a published chain was not found"),
            }
            add_used(0, &mut q, &mem, 0, 0).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let flips = flipper.join().unwrap();
        eprintln!("{flips} flips: {refused} chains refused, {direct} taken direct");
        assert_eq!(refused + direct, 20_000);
    }

    #[test]
    fn a_writer_splits_at_a_byte_inside_a_buffer() {
        let (mem, mut q) = ring();
        put_desc(&mem, 0, OUT, 10, DESC_F_WRITE | DESC_F_NEXT, 1);
        put_desc(&mem, 1, OUT + 100, 10, DESC_F_WRITE, 0);
        publish(&mem, 0, 0);
        let chain = pop(0, &mut q, &mem).unwrap().unwrap();
        let mut w = writer(&mem, &chain).unwrap();
        assert!(w.split_at(21).is_none());
        let mut tail = w.split_at(15).unwrap();
        assert_eq!((w.available_bytes(), tail.available_bytes()), (15, 5));
        tail.write_all(b"TAIL!").unwrap();
        w.write_all(&[b'h'; 15]).unwrap();
        let mut out = [0u8; 10];
        mem.read_slice(&mut out, GuestAddress(OUT + 100)).unwrap();
        assert_eq!(&out, b"hhhhhTAIL!");
    }
}
