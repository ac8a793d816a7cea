//! The single writer of the channel: every thread hands it frames, one thread writes them, so
//! frames never interleave and a slow host stalls senders (bounded queue) instead of growing memory.

use std::io::Write;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use sandbox_protocol::message::ErrorMessage;
use sandbox_protocol::{Frame, Kind};

/// Frames waiting for the writer; beyond this, senders block.
const QUEUE: usize = 64;

/// A handle for sending frames to the host. Cloning it is cheap.
#[derive(Clone)]
pub struct Outbox {
    tx: SyncSender<Vec<u8>>,
}

impl Outbox {
    /// Starts the writer thread on `w`. It ends when every `Outbox` is dropped.
    pub fn start(mut w: impl Write + Send + 'static) -> Outbox {
        let (tx, rx): (SyncSender<Vec<u8>>, Receiver<Vec<u8>>) = sync_channel(QUEUE);
        std::thread::Builder::new()
            .name("outbox".into())
            .spawn(move || {
                for buf in rx {
                    if let Err(e) = w.write_all(&buf).and_then(|_| w.flush()) {
                        eprintln!("sandbox-agent: write to host failed: {e}; dropping frames");
                    }
                }
            })
            .expect("spawning the outbox thread at start-up");
        Outbox { tx }
    }

    /// Queues a frame; returns false if the writer is gone.
    pub fn send(&self, kind: Kind, stream: u32, payload: Vec<u8>) -> bool {
        self.tx
            .send(Frame::new(kind, stream, payload).encode())
            .is_ok()
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
}
