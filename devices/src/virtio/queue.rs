//! Taking descriptor chains from a queue and returning them, with every failure named.
//!
//! virtio-queue bounds a chain by the queue size (and an indirect table by its own length) and
//! checks each descriptor's range against guest memory when a `Reader`/`Writer` is made; what is
//! left for us is to turn its errors into ours and to never trust an index.

use thiserror::Error;
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT, Reader, Writer};
use vm_memory::GuestMemoryMmap;

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
    Ok(iter.next())
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
