//! Taking descriptor chains from a queue and returning them, with every failure named.
//!
//! virtio-queue bounds a chain by the queue size (and an indirect table by its own length) and
//! checks each descriptor's range against guest memory when a `Reader`/`Writer` is made; what is
//! left for us is to turn its errors into ours and to never trust an index.

use thiserror::Error;
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT, Reader, Writer};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryMmap};

/// A chain the guest handed over.
pub type Chain<'a> = DescriptorChain<&'a GuestMemoryMmap>;

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

/// The next available chain of `queue`, if any. Errors (an avail index that moved more than
/// the queue size, rings outside memory) mean the driver is broken.
pub fn pop<'a>(
    index: usize,
    queue: &mut Queue,
    mem: &'a GuestMemoryMmap,
) -> Result<Option<Chain<'a>>, QueueError> {
    if !queue.ready() {
        return Ok(None);
    }
    let mut iter = queue.iter(mem).map_err(|e| QueueError::Ring {
        index,
        what: format!("{e:?}"),
    })?;
    let Some(chain) = iter.next() else {
        return Ok(None);
    };
    refuse_indirect(index, queue, mem, chain.head_index())?;
    Ok(Some(chain))
}

/// VIRTQ_DESC_F_INDIRECT: the descriptor points at a table of further descriptors.
const DESC_F_INDIRECT: u16 = 4;
/// VIRTQ_DESC_F_NEXT: the chain continues at `next`.
const DESC_F_NEXT: u16 = 2;

/// No device of ours offers VIRTIO_RING_F_INDIRECT_DESC, and virtio-queue follows indirect
/// tables whatever was negotiated: a guest could hand over chains of a queue's size of indirect
/// tables each and make a device thread walk them. A chain with an indirect descriptor is a
/// driver that broke the protocol. Walks the chain's direct descriptors (at most the queue size).
fn refuse_indirect(
    index: usize,
    queue: &Queue,
    mem: &GuestMemoryMmap,
    head: u16,
) -> Result<(), QueueError> {
    let table = GuestAddress(queue.desc_table());
    let size = queue.size();
    let mut at = head;
    for _ in 0..size {
        let flags: u16 = table
            .checked_add(u64::from(at) * 16 + 12)
            .and_then(|a| mem.read_obj(a).ok())
            .ok_or_else(|| QueueError::Ring {
                index,
                what: format!("descriptor {at} is outside guest memory"),
            })?;
        if flags & DESC_F_INDIRECT != 0 {
            return Err(QueueError::Ring {
                index,
                what: "an indirect descriptor, which the device never offered".into(),
            });
        }
        if flags & DESC_F_NEXT == 0 {
            return Ok(());
        }
        let next: u16 = table
            .checked_add(u64::from(at) * 16 + 14)
            .and_then(|a| mem.read_obj(a).ok())
            .unwrap_or(size);
        if next >= size {
            // virtio-queue reports a bad next itself when the chain is read.
            return Ok(());
        }
        at = next;
    }
    Ok(())
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

/// The readable part of a chain; `None` if a descriptor lies outside guest memory.
pub fn reader<'a>(mem: &'a GuestMemoryMmap, chain: Chain<'a>) -> Option<Reader<'a>> {
    chain.reader(mem).ok()
}

/// The writable part of a chain; `None` if a descriptor lies outside guest memory.
pub fn writer<'a>(mem: &'a GuestMemoryMmap, chain: Chain<'a>) -> Option<Writer<'a>> {
    chain.writer(mem).ok()
}
