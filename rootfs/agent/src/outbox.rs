//! The single writer of the channel: every thread hands it frames, one thread writes them, so
//! frames never interleave and a slow host stalls senders (bounded queue) instead of growing memory.
//!
//! A stream's frames carry the stream's `abandoned` flag ([`Outbox::for_stream`]). Once the host
//! that opened the stream is gone they are dropped, whether still to be sent or already queued,
//! and a sender of theirs waiting for room gives up ([`Outbox::purge`]): on a serial port the
//! outbox outlives the host, and an abandoned stream must neither reach the next host (which
//! numbers its streams from 1 again) nor wait for it. A frame the writer is already writing when
//! the host goes away is the one exception: the channel takes it as it is.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use sandbox_protocol::message::ErrorMessage;
use sandbox_protocol::{Frame, Kind};

/// Frames waiting for the writer; beyond this, senders block.
const QUEUE: usize = 64;

/// A handle for sending frames to the host. Cloning it is cheap.
pub struct Outbox {
    shared: Arc<Shared>,
    /// The `abandoned` flag of the stream whose frames these are; `None` for control frames.
    gate: Option<Arc<AtomicBool>>,
}

struct Shared {
    queue: Mutex<Queue>,
    /// Signalled when a frame is queued or the writer should end.
    queued: Condvar,
    /// Signalled when room is made or a waiting sender may have been abandoned.
    room: Condvar,
}

struct Queue {
    frames: VecDeque<Queued>,
    /// Live `Outbox` handles: the writer ends with the last.
    handles: usize,
    /// Set by [`Outbox::close`]: nothing more is queued, the writer ends once the queue is empty.
    closed: bool,
}

struct Queued {
    bytes: Vec<u8>,
    gate: Option<Arc<AtomicBool>>,
}

impl Queued {
    fn abandoned(&self) -> bool {
        self.gate.as_ref().is_some_and(|g| g.load(Ordering::SeqCst))
    }
}

impl Outbox {
    /// Starts the writer thread on `w`. It ends when every `Outbox` is dropped, or once what is
    /// queued is written after [`Outbox::close`].
    pub fn start(mut w: impl Write + Send + 'static) -> Outbox {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                frames: VecDeque::with_capacity(QUEUE),
                handles: 1,
                closed: false,
            }),
            queued: Condvar::new(),
            room: Condvar::new(),
        });
        let writer = shared.clone();
        std::thread::Builder::new()
            .name("outbox".into())
            .spawn(move || {
                while let Some(frame) = writer.next() {
                    if frame.abandoned() {
                        continue;
                    }
                    if let Err(e) = w.write_all(&frame.bytes).and_then(|_| w.flush()) {
                        eprintln!("sandbox-agent: write to host failed: {e}; dropping frames");
                    }
                }
            })
            .expect("spawning the outbox thread at start-up");
        Outbox { shared, gate: None }
    }

    /// A handle whose frames belong to a stream and are dropped once `abandoned` is set.
    pub fn for_stream(&self, abandoned: Arc<AtomicBool>) -> Outbox {
        let mut out = self.clone();
        out.gate = Some(abandoned);
        out
    }

    /// Queues a frame; returns false if it was dropped (its stream is abandoned, or the outbox
    /// is closed).
    pub fn send(&self, kind: Kind, stream: u32, payload: Vec<u8>) -> bool {
        let bytes = Frame::new(kind, stream, payload).encode();
        let mut q = self.shared.lock();
        loop {
            if q.closed || self.abandoned() {
                return false;
            }
            if q.frames.len() < QUEUE {
                q.frames.push_back(Queued {
                    bytes,
                    gate: self.gate.clone(),
                });
                self.shared.queued.notify_one();
                return true;
            }
            q = self.shared.room.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Queues a JSON control frame.
    pub fn send_json(&self, kind: Kind, stream: u32, value: &impl serde::Serialize) -> bool {
        let payload = serde_json::to_vec(value).expect("protocol messages always serialise");
        self.send(kind, stream, payload)
    }

    /// Queues an `Error` frame with a code and message.
    pub fn error(&self, stream: u32, code: &str, message: impl Into<String>) -> bool {
        self.send_json(Kind::Error, stream, &ErrorMessage::new(code, message))
    }

    /// Drops the queued frames of streams abandoned since they were queued, and wakes the
    /// senders waiting for room, so that those of abandoned streams give up and the others
    /// find the room the dropped frames took.
    pub fn purge(&self) {
        let mut q = self.shared.lock();
        q.frames.retain(|f| !f.abandoned());
        self.shared.room.notify_all();
    }

    /// Ends the outbox for every handle: later frames are dropped, the writer writes what is
    /// queued and ends, closing its end of the channel even while abandoned streams still hold
    /// handles.
    pub fn close(&self) {
        let mut q = self.shared.lock();
        q.closed = true;
        self.shared.queued.notify_all();
        self.shared.room.notify_all();
    }

    fn abandoned(&self) -> bool {
        self.gate.as_ref().is_some_and(|g| g.load(Ordering::SeqCst))
    }
}

impl Clone for Outbox {
    fn clone(&self) -> Self {
        self.shared.lock().handles += 1;
        Outbox {
            shared: self.shared.clone(),
            gate: self.gate.clone(),
        }
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        let mut q = self.shared.lock();
        q.handles -= 1;
        if q.handles == 0 {
            self.shared.queued.notify_all();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next frame for the writer; `None` once it should end.
    fn next(&self) -> Option<Queued> {
        let mut q = self.lock();
        loop {
            if let Some(f) = q.frames.pop_front() {
                self.room.notify_all();
                return Some(f);
            }
            if q.closed || q.handles == 0 {
                return None;
            }
            q = self.queued.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_protocol::Decoder;
    use std::io::Read;

    /// Frames of an abandoned stream are dropped though already queued, and a sender of theirs
    /// waiting for room gives up; control frames still go out.
    #[test]
    fn abandoned_frames_are_dropped_and_their_senders_released() {
        let (mut host, agent) = std::io::pipe().unwrap();
        let out = Outbox::start(agent);
        // More than a pipe holds: the writer blocks in it until the host reads.
        out.send(Kind::Stdout, 1, vec![7; 100 * 1024]);
        let abandoned = Arc::new(AtomicBool::new(false));
        let stream = out.for_stream(abandoned.clone());
        let sender = std::thread::spawn(move || {
            let mut sent = 0;
            while stream.send(Kind::Stdout, 2, vec![2; 16]) {
                sent += 1;
            }
            sent
        });
        // The sender fills the queue and waits for room that never comes.
        while out.shared.lock().frames.len() < QUEUE {
            std::thread::yield_now();
        }
        abandoned.store(true, Ordering::SeqCst);
        out.purge();
        assert!(sender.join().unwrap() >= QUEUE - 1);
        // Their room is free at once, though the writer is still stuck in the first frame.
        assert!(out.shared.lock().frames.len() <= 1);
        out.send(Kind::Exit, 3, b"{}".to_vec());
        drop(out);

        let mut bytes = Vec::new();
        host.read_to_end(&mut bytes).unwrap();
        let mut dec = Decoder::new();
        dec.push(&bytes);
        let frames: Vec<(u32, usize)> = std::iter::from_fn(|| dec.next_frame())
            .map(|f| f.map(|f| (f.stream, f.payload.len())).unwrap())
            .collect();
        assert_eq!(frames, vec![(1, 100 * 1024), (3, 2)]);
    }
}
