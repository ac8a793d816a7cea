//! The streams open on the channel: each worker's view of its own ([`StreamCtx`]), the reader's
//! view of all of them ([`Streams`]), and how a stream's processes are ended.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use crate::credit::Credit;
use crate::outbox::Outbox;
use crate::transfer::Upload;

/// Streams that may be open at once; more get a `busy` error.
pub(crate) const MAX_STREAMS: usize = 128;

/// What a worker thread needs to serve its stream.
pub struct StreamCtx {
    pub id: u32,
    pub out: Outbox,
    /// Credit for what this stream sends to the host.
    pub credit: Arc<Credit>,
    /// Process group of an exec, once started (0 before).
    pub pgid: Arc<AtomicI32>,
    /// Set when the host cancelled the stream or went away.
    pub cancelled: Arc<AtomicBool>,
    pub(crate) upload: Option<Upload>,
    pub(crate) streams: Streams,
}

impl StreamCtx {
    /// The stream's upload (stdin or put data); taken once.
    pub fn take_upload(&mut self) -> Option<Upload> {
        self.upload.take()
    }

    /// Sends an error that ends the stream.
    pub fn fail(&self, code: &str, message: impl Into<String>) {
        self.out.error(self.id, code, message);
    }
}

impl Drop for StreamCtx {
    fn drop(&mut self) {
        self.credit.close();
        self.streams.remove(self.id);
    }
}

/// The reader thread's view of one stream.
pub(crate) struct Entry {
    pub(crate) credit: Arc<Credit>,
    /// Upload bytes go here; `None` once the host closed its side.
    pub(crate) inbox: Option<Sender<Vec<u8>>>,
    /// Upload bytes the host may still send before the agent grants more.
    pub(crate) allowance: Arc<AtomicU64>,
    pub(crate) pgid: Arc<AtomicI32>,
    pub(crate) cancelled: Arc<AtomicBool>,
}

impl Entry {
    pub(crate) fn cancel(&mut self) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.credit.close();
        self.inbox = None;
        kill_group(self.pgid.load(Ordering::SeqCst), libc::SIGKILL);
    }
}

#[derive(Clone, Default)]
pub(crate) struct Streams(Arc<Mutex<HashMap<u32, Entry>>>);

impl Streams {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Entry>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn remove(&self, id: u32) {
        self.lock().remove(&id);
    }

    pub(crate) fn cancel_all(&self) {
        for (_, e) in self.lock().iter_mut() {
            e.cancel();
        }
    }
}

/// Sends `sig` to process group `pgid` (a no-op for 0).
pub fn kill_group(pgid: i32, sig: i32) {
    if pgid > 0 {
        // SAFETY: killpg has no memory preconditions; a stale pgid at worst yields ESRCH.
        unsafe { libc::killpg(pgid, sig) };
    }
}
