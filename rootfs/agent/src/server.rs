//! The frame loop: reads the channel, answers control frames, and hands each stream to a
//! worker thread. The reader never blocks on a worker, so one stalled stream stalls no other.

use std::fs::File;
use std::io::{self, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::mpsc::channel;
use std::time::Duration;

use sandbox_protocol::message::{self, Ready, code};
use sandbox_protocol::{Decoder, Frame, INITIAL_WINDOW, Kind, PROTOCOL_VERSION};
use serde::de::DeserializeOwned;

use crate::channel::{ChannelSpec, Conn};
use crate::credit::Credit;
use crate::outbox::Outbox;
use crate::reaper::Reaper;
use crate::streams::{Entry, MAX_STREAMS, StreamCtx, Streams, kill_group};
use crate::transfer::Upload;
use crate::{archive, exec, files};

/// Serves one connection until the host goes away. On a serial port the device stays open and
/// EOF means "host disconnected for now", so this only returns for vsock.
pub fn serve(conn: Conn, spec: &ChannelSpec, reaper: &Reaper) {
    let out = Outbox::start(conn.writer);
    let mut server = Server {
        out,
        streams: Streams::default(),
        reaper: reaper.clone(),
        spec: spec.clone(),
    };
    server.send_ready(0);
    server.read_loop(conn.reader);
    server.streams.cancel_all();
}

struct Server {
    out: Outbox,
    streams: Streams,
    reaper: Reaper,
    spec: ChannelSpec,
}

impl Server {
    fn read_loop(&mut self, mut reader: File) {
        let mut dec = Decoder::new();
        let mut buf = vec![0u8; 64 * 1024];
        let mut connected = true;
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) if self.spec.is_serial() => {
                    if connected {
                        // The host closed its end: whatever it was doing is abandoned.
                        self.streams.cancel_all();
                        dec = Decoder::new();
                        connected = false;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                Ok(0) => return,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    eprintln!("sandbox-agent: reading the channel failed: {e}");
                    return;
                }
            };
            connected = true;
            dec.push(&buf[..n]);
            while let Some(r) = dec.next_frame() {
                match r {
                    Ok(f) => self.handle(f),
                    Err(e) => {
                        self.out.error(e.stream(), code::BAD_FRAME, e.to_string());
                    }
                }
            }
        }
    }

    fn handle(&mut self, f: Frame) {
        let Some(kind) = Kind::from_u8(f.kind) else {
            self.out.error(
                f.stream,
                code::UNKNOWN_KIND,
                format!("unknown frame kind 0x{:02x}", f.kind),
            );
            return;
        };
        match kind {
            Kind::Ping => self.send_ready(f.stream),
            Kind::Exec | Kind::ArchivePut | Kind::ArchiveGet | Kind::FilePut | Kind::FileGet => {
                self.open_stream(kind, f)
            }
            Kind::Identity => crate::identity::handle(&self.out, f.stream, &f.payload),
            Kind::Stdin | Kind::Data => self.deliver(kind, f),
            Kind::Window => self.grant(f),
            Kind::Signal => self.signal(f),
            Kind::Cancel | Kind::Error => {
                if let Some(e) = self.streams.lock().get_mut(&f.stream) {
                    e.cancel();
                }
            }
            Kind::Shutdown => shutdown(&self.out, f.stream),
            Kind::Ready | Kind::Stdout | Kind::Stderr | Kind::Exit | Kind::Output | Kind::Done => {
                self.out.error(
                    f.stream,
                    code::UNKNOWN_KIND,
                    format!("frame kind {kind:?} is sent by the agent, not to it"),
                );
            }
        }
    }

    fn send_ready(&self, stream: u32) {
        let ready = Ready {
            version: crate::VERSION.to_owned(),
            protocol: PROTOCOL_VERSION,
            channel: self.spec.to_string(),
            uptime_ms: uptime_ms(),
        };
        self.out.send_json(Kind::Ready, stream, &ready);
    }

    fn open_stream(&mut self, kind: Kind, f: Frame) {
        let id = f.stream;
        let mut streams = self.streams.lock();
        if id == 0 {
            self.out.error(
                0,
                code::BAD_STREAM,
                "stream 0 is the control stream; open requests on a new id",
            );
            return;
        }
        if streams.contains_key(&id) {
            self.out
                .error(id, code::BAD_STREAM, format!("stream {id} is already open"));
            return;
        }
        if streams.len() >= MAX_STREAMS {
            self.out.error(
                id,
                code::BUSY,
                format!("{MAX_STREAMS} streams are already open; retry later"),
            );
            return;
        }
        let takes_upload = matches!(kind, Kind::ArchivePut | Kind::FilePut);
        let (inbox, upload_rx) = if takes_upload || kind == Kind::Exec {
            let (tx, rx) = channel::<Vec<u8>>();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let allowance = Arc::new(AtomicU64::new(INITIAL_WINDOW.into()));
        let entry = Entry {
            credit: Arc::new(Credit::new(INITIAL_WINDOW)),
            inbox,
            allowance: allowance.clone(),
            pgid: Arc::new(AtomicI32::new(0)),
            cancelled: Arc::new(AtomicBool::new(false)),
        };
        let ctx = StreamCtx {
            id,
            out: self.out.clone(),
            credit: entry.credit.clone(),
            pgid: entry.pgid.clone(),
            cancelled: entry.cancelled.clone(),
            upload: upload_rx.map(|rx| Upload::new(rx, self.out.clone(), id, allowance)),
            streams: self.streams.clone(),
        };
        streams.insert(id, entry);
        drop(streams);

        let reaper = self.reaper.clone();
        let payload = f.payload;
        let spawned = std::thread::Builder::new()
            .name(format!("stream-{id}"))
            .spawn(move || match kind {
                Kind::Exec => with_request(ctx, &payload, |ctx, req| exec::run(ctx, req, &reaper)),
                Kind::ArchivePut => with_request(ctx, &payload, archive::put),
                Kind::ArchiveGet => with_request(ctx, &payload, archive::get),
                Kind::FilePut => with_request(ctx, &payload, files::put),
                Kind::FileGet => with_request(ctx, &payload, files::get),
                _ => unreachable!("open_stream is only called for request kinds"),
            });
        if let Err(e) = spawned {
            self.streams.remove(id);
            self.out
                .error(id, code::BUSY, format!("cannot start a worker thread: {e}"));
        }
    }

    fn deliver(&mut self, kind: Kind, f: Frame) {
        let mut streams = self.streams.lock();
        let Some(entry) = streams.get_mut(&f.stream) else {
            // A stream that already ended (for instance after an error): late data is dropped.
            return;
        };
        let Some(inbox) = &entry.inbox else {
            let what = if kind == Kind::Stdin {
                "stdin"
            } else {
                "the upload"
            };
            self.out.error(
                f.stream,
                code::BAD_STREAM,
                format!("{what} of stream {} is already closed", f.stream),
            );
            return;
        };
        let len = f.payload.len() as u64;
        let fits = entry
            .allowance
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |a| a.checked_sub(len))
            .is_ok();
        if !fits {
            self.out.error(
                f.stream,
                code::WINDOW_EXCEEDED,
                "more data sent than the window granted",
            );
            entry.cancel();
            return;
        }
        let eof = f.payload.is_empty();
        let _ = inbox.send(f.payload);
        if eof {
            entry.inbox = None;
        }
    }

    fn grant(&mut self, f: Frame) {
        match message::parse_window(&f.payload) {
            Some(n) => {
                if let Some(e) = self.streams.lock().get(&f.stream) {
                    e.credit.grant(n);
                }
            }
            None => {
                self.out.error(
                    f.stream,
                    code::BAD_REQUEST,
                    "a window payload is exactly 4 bytes",
                );
            }
        }
    }

    fn signal(&mut self, f: Frame) {
        let req: message::SignalRequest = match parse(&f.payload) {
            Ok(r) => r,
            Err(e) => {
                self.out.error(f.stream, code::BAD_REQUEST, e);
                return;
            }
        };
        if !(1..=64).contains(&req.signal) {
            self.out.error(
                f.stream,
                code::BAD_REQUEST,
                format!("signal {} is not 1..=64", req.signal),
            );
            return;
        }
        match self.streams.lock().get(&f.stream) {
            Some(e) => kill_group(e.pgid.load(Ordering::SeqCst), req.signal),
            None => {
                self.out.error(
                    f.stream,
                    code::BAD_STREAM,
                    format!("no exec on stream {}", f.stream),
                );
            }
        }
    }
}

fn parse<T: DeserializeOwned>(payload: &[u8]) -> Result<T, String> {
    serde_json::from_slice(payload).map_err(|e| format!("bad request payload: {e}"))
}

fn with_request<T: DeserializeOwned>(ctx: StreamCtx, payload: &[u8], f: impl FnOnce(StreamCtx, T)) {
    match parse(payload) {
        Ok(req) => f(ctx, req),
        Err(e) => ctx.fail(code::BAD_REQUEST, e),
    }
}

fn uptime_ms() -> u64 {
    std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0, |s| (s * 1000.0) as u64)
}

/// Syncs and restarts the guest, which the VMM treats as power-off (`reboot=t`, and QEMU runs
/// with `-no-reboot`). Outside a VM (the agent is not PID 1) it only exits.
fn shutdown(out: &Outbox, stream: u32) {
    out.send_json(Kind::Done, stream, &message::Done::default());
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    if std::process::id() == 1 {
        // SAFETY: reboot with a valid command; as PID 1 in a guest this ends the VM.
        unsafe { libc::reboot(libc::RB_AUTOBOOT) };
    }
    std::process::exit(0);
}
