//! The streams open on the channel: each worker's view of its own ([`StreamCtx`]), the reader's
//! view of all of them ([`Streams`]), and how a stream's processes are ended.
//!
//! A stream ends one of three ways: it finishes, the host cancels it ([`Entry::cancel`]: its
//! processes are killed), or the host goes away ([`Entry::abandon`]: its processes go on, since
//! the host service may be restarted under a running command, but nothing more of it is sent).

use std::collections::HashMap;
use std::fs::File;
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
    /// Frames of this stream; dropped once it is abandoned (see [`Outbox::for_stream`]).
    pub out: Outbox,
    /// Credit for what this stream sends to the host.
    pub credit: Arc<Credit>,
    /// Process group of an exec, once started (0 before).
    pub pgid: Arc<AtomicI32>,
    /// Set when the host cancelled the stream.
    pub cancelled: Arc<AtomicBool>,
    /// The terminal of an exec run on one, while it runs: resized through it, and its presence
    /// says that the exec's processes are a session (several groups), not one group.
    pub tty: Tty,
    /// Set when the host that opened the stream went away: its work goes on where it can (an
    /// exec runs to its end, its output read and dropped), and nothing of it is sent any more.
    pub abandoned: Arc<AtomicBool>,
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
        // Only its own entry: once abandoned, its id may already be a later stream's.
        self.streams.remove_own(self.id, &self.cancelled);
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
    pub(crate) abandoned: Arc<AtomicBool>,
    pub(crate) tty: Tty,
}

/// An exec's terminal, shared by the exec and the reader (for `Resize`).
pub type Tty = Arc<Mutex<TtySlot>>;

/// What the reader knows of an exec's terminal.
#[derive(Default)]
pub struct TtySlot {
    /// The master side, once the exec has opened it (and until it ends).
    pub master: Option<File>,
    /// A size that came before the terminal was open (a client's first resize follows its
    /// connection at once): the exec applies it as it opens the terminal.
    pub pending: Option<sandbox_protocol::message::TermSize>,
}

/// Whether an exec with this terminal slot runs on a terminal.
pub fn on_tty(tty: &Tty) -> bool {
    tty.lock()
        .unwrap_or_else(|e| e.into_inner())
        .master
        .is_some()
}

impl Entry {
    pub(crate) fn cancel(&mut self) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.credit.close();
        self.inbox = None;
        kill_job(
            self.pgid.load(Ordering::SeqCst),
            on_tty(&self.tty),
            libc::SIGKILL,
        );
    }

    /// The host that opened the stream went away. Unlike a cancel nothing is killed: an exec's
    /// stdin is closed (after what already arrived it reads EOF), its output is read and dropped
    /// and its exit goes unreported, and it runs to its end (or its timeout). A transfer ends as
    /// on a cancel, its upload or its credit cut off; nothing runs beside it to kill (an archive
    /// get writes its tar in this process, with the tar crate, not with a tar process).
    ///
    /// An exec on a terminal is hung up instead (SIGHUP to its session), as a terminal whose
    /// connection drops is: a shell waits for input no one will send, and would never end.
    pub(crate) fn abandon(&mut self) {
        // Before the credit closes: a sender that finds it closed must find the stream abandoned.
        self.abandoned.store(true, Ordering::SeqCst);
        self.credit.close();
        self.inbox = None;
        if on_tty(&self.tty) {
            crate::pty::hang_up(self.pgid.load(Ordering::SeqCst));
        }
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

    /// Removes stream `id` if its entry is the one with this `cancelled` flag: the stream's own,
    /// not a later one on the same id.
    pub(crate) fn remove_own(&self, id: u32, cancelled: &Arc<AtomicBool>) {
        let mut streams = self.lock();
        if streams
            .get(&id)
            .is_some_and(|e| Arc::ptr_eq(&e.cancelled, cancelled))
        {
            streams.remove(&id);
        }
    }

    /// The host went away: abandons every open stream (see [`Entry::abandon`]) and forgets it,
    /// so that its id is free at once for the next host, which numbers its streams from 1 again.
    pub(crate) fn abandon_all(&self) {
        for (_, mut e) in self.lock().drain() {
            e.abandon();
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

/// Sends `sig` to an exec's processes: its group, or its whole session when it runs on a
/// terminal (a shell's jobs are groups of their own).
pub fn kill_job(pgid: i32, session: bool, sig: i32) {
    if session {
        crate::pty::kill_session(pgid, sig);
    } else {
        kill_group(pgid, sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_protocol::Kind;

    /// Registers stream `id` as the server does (without an upload) and returns its context.
    fn open(streams: &Streams, out: &Outbox, id: u32) -> StreamCtx {
        let abandoned = Arc::new(AtomicBool::new(false));
        let entry = Entry {
            credit: Arc::new(Credit::new(16)),
            inbox: None,
            allowance: Arc::new(AtomicU64::new(0)),
            pgid: Arc::new(AtomicI32::new(0)),
            cancelled: Arc::new(AtomicBool::new(false)),
            abandoned: abandoned.clone(),
            tty: Tty::default(),
        };
        let ctx = StreamCtx {
            id,
            out: out.for_stream(abandoned.clone()),
            credit: entry.credit.clone(),
            pgid: entry.pgid.clone(),
            cancelled: entry.cancelled.clone(),
            tty: entry.tty.clone(),
            abandoned,
            upload: None,
            streams: streams.clone(),
        };
        streams.lock().insert(id, entry);
        ctx
    }

    #[test]
    fn an_abandoned_stream_leaves_a_later_one_on_its_id_alone() {
        let out = Outbox::start(std::io::sink());
        let streams = Streams::default();
        let old = open(&streams, &out, 1);
        streams.abandon_all();
        assert!(streams.lock().is_empty(), "abandoned ids are free at once");
        assert!(old.abandoned.load(Ordering::SeqCst));
        assert_eq!(old.credit.take(1), None);

        let new = open(&streams, &out, 1);
        assert!(!old.out.send(Kind::Stdout, 1, b"late".to_vec()));
        drop(old);
        assert!(
            streams
                .lock()
                .get(&1)
                .is_some_and(|e| Arc::ptr_eq(&e.cancelled, &new.cancelled)),
            "the old stream's end removed the new one's entry"
        );
        assert!(new.out.send(Kind::Stdout, 1, b"mine".to_vec()));
        assert_eq!(new.credit.take(1), Some(1));
        drop(new);
        assert!(streams.lock().is_empty());
    }
}
