//! Byte streams of a stream: uploads from the host (stdin, put data) as `Read`, downloads to
//! the host (get data) as `Write`, both under the stream's window.

use std::io::{self, Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Receiver;

use sandbox_protocol::message::window_payload;
use sandbox_protocol::{DATA_CHUNK, Kind};

use crate::credit::Credit;
use crate::outbox::Outbox;

/// Upload bytes as they arrive. Each chunk taken from the inbox is granted back to the host at
/// once, so at most one window plus one chunk is ever buffered.
pub struct Upload {
    rx: Receiver<Vec<u8>>,
    out: Outbox,
    stream: u32,
    allowance: Arc<AtomicU64>,
    buf: Vec<u8>,
    pos: usize,
    done: bool,
}

impl Upload {
    pub fn new(rx: Receiver<Vec<u8>>, out: Outbox, stream: u32, allowance: Arc<AtomicU64>) -> Self {
        Upload {
            rx,
            out,
            stream,
            allowance,
            buf: Vec::new(),
            pos: 0,
            done: false,
        }
    }

    /// Reads and discards the rest of the upload, so the host is never left waiting for window.
    pub fn drain(&mut self) -> io::Result<u64> {
        io::copy(self, &mut io::sink())
    }
}

impl Read for Upload {
    fn read(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.buf.len() {
            if self.done {
                return Ok(0);
            }
            match self.rx.recv() {
                Ok(chunk) if chunk.is_empty() => self.done = true,
                Ok(chunk) => {
                    let n = chunk.len() as u32;
                    self.allowance.fetch_add(n.into(), Ordering::SeqCst);
                    self.out.send(Kind::Window, self.stream, window_payload(n));
                    self.buf = chunk;
                    self.pos = 0;
                }
                Err(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        "the host cancelled the upload",
                    ));
                }
            }
        }
        let n = dst.len().min(self.buf.len() - self.pos);
        dst[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Download bytes to the host as `kind` frames, in chunks, waiting for window as needed.
pub struct Download {
    out: Outbox,
    stream: u32,
    kind: Kind,
    credit: Arc<Credit>,
    buf: Vec<u8>,
    pub bytes: u64,
}

impl Download {
    pub fn new(out: Outbox, stream: u32, kind: Kind, credit: Arc<Credit>) -> Self {
        Download {
            out,
            stream,
            kind,
            credit,
            buf: Vec::with_capacity(DATA_CHUNK),
            bytes: 0,
        }
    }

    /// Sends `data` now, splitting it as the window allows.
    pub fn send_now(&mut self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let n = self.credit.take(data.len()).ok_or_else(|| {
                io::Error::new(io::ErrorKind::BrokenPipe, "the host cancelled the stream")
            })?;
            if !self.out.send(self.kind, self.stream, data[..n].to_vec()) {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "the channel to the host is closed",
                ));
            }
            self.bytes += n as u64;
            data = &data[n..];
        }
        Ok(())
    }

    /// Flushes and sends the empty frame that ends the download.
    pub fn finish(mut self) -> io::Result<u64> {
        self.flush()?;
        self.out.send(self.kind, self.stream, Vec::new());
        Ok(self.bytes)
    }
}

impl Write for Download {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let room = DATA_CHUNK - self.buf.len();
        let n = room.min(data.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == DATA_CHUNK {
            self.flush()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        let buf = std::mem::take(&mut self.buf);
        let r = self.send_now(&buf);
        self.buf = buf;
        self.buf.clear();
        r
    }
}
