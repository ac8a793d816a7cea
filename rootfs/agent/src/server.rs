//! The frame loop: reads the channel, answers control frames, and hands each stream to a
//! worker thread. The reader never blocks on a worker, so one stalled stream stalls no other.
//!
//! When the host goes away (EOF) its streams are abandoned, not cancelled: the host service may
//! be restarted while a command runs, and the command goes on (see [`Entry::abandon`]).

use std::io::{self, Read, Write};
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
use crate::streams::{Entry, MAX_STREAMS, StreamCtx, Streams, Tty, kill_group};
use crate::transfer::Upload;
use crate::{archive, exec, files, ports, watch};

/// Serves one connection until the host goes away. On a serial port the device stays open and
/// EOF means "host disconnected for now", so this only returns for vsock. Streams still open
/// when it returns are abandoned and run on; the connection is closed at once all the same.
pub fn serve(conn: Conn, spec: &ChannelSpec, reaper: &Reaper) {
    serve_io(conn.reader, conn.writer, spec, reaper);
}

/// [`serve`] over any reader and writer (the tests' seam).
pub(crate) fn serve_io(
    reader: impl Read,
    writer: impl Write + Send + 'static,
    spec: &ChannelSpec,
    reaper: &Reaper,
) {
    let out = Outbox::start(writer);
    let mut server = Server {
        out,
        streams: Streams::default(),
        reaper: reaper.clone(),
        spec: spec.clone(),
    };
    server.send_ready(0);
    server.read_loop(reader);
    server.abandon_streams();
    // Abandoned streams keep handles of the outbox; its writer must not keep the channel open.
    server.out.close();
}

struct Server {
    out: Outbox,
    streams: Streams,
    reaper: Reaper,
    spec: ChannelSpec,
}

impl Server {
    fn read_loop(&mut self, mut reader: impl Read) {
        let mut dec = Decoder::new();
        let mut buf = vec![0u8; 64 * 1024];
        let mut connected = true;
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) if self.spec.is_serial() => {
                    if connected {
                        // The host closed its end: whatever it was doing is abandoned.
                        self.abandon_streams();
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
            Kind::Exec
            | Kind::ArchivePut
            | Kind::ArchiveGet
            | Kind::FilePut
            | Kind::FileGet
            | Kind::Watch
            | Kind::PortOpen => self.open_stream(kind, f),
            Kind::Identity => crate::identity::handle(&self.out, f.stream, &f.payload),
            Kind::Stdin | Kind::Data => self.deliver(kind, f),
            Kind::Window => self.grant(f),
            Kind::Signal => self.signal(f),
            Kind::Resize => self.resize(f),
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

    /// The host went away: its streams are abandoned (see [`Entry::abandon`]), their ids free,
    /// their frames still queued dropped and their senders waiting for room released.
    fn abandon_streams(&self) {
        self.streams.abandon_all();
        self.out.purge();
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
        let takes_upload = matches!(kind, Kind::ArchivePut | Kind::FilePut | Kind::PortOpen);
        let (inbox, upload_rx) = if takes_upload || kind == Kind::Exec {
            let (tx, rx) = channel::<Vec<u8>>();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let allowance = Arc::new(AtomicU64::new(INITIAL_WINDOW.into()));
        let abandoned = Arc::new(AtomicBool::new(false));
        let out = self.out.for_stream(abandoned.clone());
        let failed = out.clone();
        let entry = Entry {
            credit: Arc::new(Credit::new(INITIAL_WINDOW)),
            inbox,
            allowance: allowance.clone(),
            pgid: Arc::new(AtomicI32::new(0)),
            cancelled: Arc::new(AtomicBool::new(false)),
            abandoned: abandoned.clone(),
            tty: Tty::default(),
        };
        let ctx = StreamCtx {
            id,
            out: out.clone(),
            credit: entry.credit.clone(),
            pgid: entry.pgid.clone(),
            cancelled: entry.cancelled.clone(),
            tty: entry.tty.clone(),
            abandoned,
            upload: upload_rx.map(|rx| Upload::new(rx, out, id, allowance)),
            streams: self.streams.clone(),
        };
        streams.insert(id, entry);
        drop(streams);

        let reaper = self.reaper.clone();
        let payload = f.payload;
        let spawned = std::thread::Builder::new()
            .name(format!("stream-{id}"))
            .spawn(move || {
                let served =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match kind {
                        Kind::Exec => {
                            with_request(ctx, &payload, |ctx, req| exec::run(ctx, req, &reaper))
                        }
                        Kind::ArchivePut => with_request(ctx, &payload, archive::put),
                        Kind::ArchiveGet => with_request(ctx, &payload, archive::get),
                        Kind::FilePut => with_request(ctx, &payload, files::put),
                        Kind::FileGet => with_request(ctx, &payload, files::get),
                        Kind::Watch => with_request(ctx, &payload, watch::run),
                        Kind::PortOpen => with_request(ctx, &payload, ports::relay),
                        _ => unreachable!("open_stream is only called for request kinds"),
                    }));
                // A worker that panicked still ends its stream: the host is never left waiting.
                if served.is_err() {
                    failed.error(
                        id,
                        code::IO,
                        "the agent's worker for this request failed (a bug in the agent); retry",
                    );
                }
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

    /// A new size for the terminal of the exec on stream `f.stream`.
    fn resize(&mut self, f: Frame) {
        let size = match parse::<message::TermSize>(&f.payload).and_then(|s| s.check().map(|()| s))
        {
            Ok(s) => s,
            Err(e) => {
                self.out.error(f.stream, code::BAD_REQUEST, e);
                return;
            }
        };
        let streams = self.streams.lock();
        let tty = streams.get(&f.stream).map(|e| e.tty.clone());
        drop(streams);
        let Some(tty) = tty else {
            self.out.error(
                f.stream,
                code::BAD_STREAM,
                format!("no exec on stream {}", f.stream),
            );
            return;
        };
        let mut slot = tty.lock().unwrap_or_else(|e| e.into_inner());
        match slot.master.as_ref() {
            Some(master) => {
                if let Err(e) = crate::pty::set_size(master, size) {
                    self.out.error(
                        f.stream,
                        code::IO,
                        format!("cannot resize the terminal: {e}"),
                    );
                }
            }
            // Before the terminal is open: applied when it is. After the exec's end, or on an
            // exec without a terminal, it is never used.
            None => slot.pending = Some(size),
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

#[cfg(test)]
mod tests {
    //! The server over real channels (a socket pair as vsock, a FIFO as a serial port) running
    //! real processes: what a command does when its host goes away, and what a later host sees.

    use super::*;
    use std::ffi::CString;
    use std::fs::{File, OpenOptions};
    use std::net::Shutdown;
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::net::UnixStream;
    use std::path::Path;
    use std::sync::atomic::AtomicUsize;
    use std::sync::mpsc::{Receiver, RecvTimeoutError};
    use std::thread::JoinHandle;
    use std::time::Instant;

    use sandbox_protocol::message::{ExecRequest, ExitStatus};

    /// How long anything awaited in these tests may take.
    const PATIENCE: Duration = Duration::from_secs(2);

    /// The test binary's one reaper: it reaps every child of the process.
    fn reaper() -> &'static Reaper {
        crate::reaper::for_tests()
    }

    fn frame(kind: Kind, stream: u32, payload: impl Into<Vec<u8>>) -> Vec<u8> {
        Frame::new(kind, stream, payload.into()).encode()
    }

    /// An `Exec` of the shell line `command` in `cwd`, with `FILE` naming `file`.
    fn exec(stream: u32, command: &str, cwd: &Path, file: &Path, stdin: bool) -> Vec<u8> {
        let req = ExecRequest {
            command: Some(command.into()),
            env: [("FILE".to_owned(), file.display().to_string())].into(),
            cwd: Some(cwd.display().to_string()),
            stdin,
            ..Default::default()
        };
        frame(Kind::Exec, stream, serde_json::to_vec(&req).unwrap())
    }

    fn is(f: &Frame, kind: Kind, stream: u32) -> bool {
        Kind::from_u8(f.kind) == Some(kind) && f.stream == stream
    }

    fn exit_status(f: &Frame) -> ExitStatus {
        serde_json::from_slice(&f.payload).unwrap()
    }

    /// Waits for `path` to exist.
    fn wait_for(path: &Path) {
        let until = Instant::now() + PATIENCE;
        while !path.exists() {
            assert!(Instant::now() < until, "{} never appeared", path.display());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The frames the agent sends, as the host reads them.
    struct Frames {
        rx: Receiver<Frame>,
        /// Every frame taken so far.
        seen: Vec<Frame>,
    }

    impl Frames {
        /// Reads the agent's frames from `r` on a thread of its own, to the agent's EOF.
        fn read(mut r: impl Read + Send + 'static) -> Frames {
            let (tx, rx) = channel();
            std::thread::spawn(move || {
                let mut dec = Decoder::new();
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n @ 1..) = r.read(&mut buf) {
                    dec.push(&buf[..n]);
                    while let Some(f) = dec.next_frame() {
                        if tx.send(f.expect("the agent's frames decode")).is_err() {
                            return;
                        }
                    }
                }
            });
            Frames {
                rx,
                seen: Vec::new(),
            }
        }

        /// The next frame `want` accepts, the frames before it kept in `seen`.
        fn until(&mut self, what: &str, want: impl Fn(&Frame) -> bool) -> Frame {
            let until = Instant::now() + PATIENCE;
            loop {
                let left = until.saturating_duration_since(Instant::now());
                let f = self.rx.recv_timeout(left).unwrap_or_else(|e| {
                    panic!("no {what} from the agent ({e}); saw {}", self.summary(0))
                });
                self.seen.push(f.clone());
                if want(&f) {
                    return f;
                }
            }
        }

        /// Every frame to the agent's EOF, which must come within [`PATIENCE`].
        fn rest(&mut self) {
            let until = Instant::now() + PATIENCE;
            loop {
                let left = until.saturating_duration_since(Instant::now());
                match self.rx.recv_timeout(left) {
                    Ok(f) => self.seen.push(f),
                    Err(RecvTimeoutError::Disconnected) => return,
                    Err(RecvTimeoutError::Timeout) => panic!("the agent kept the channel open"),
                }
            }
        }

        /// Kinds and streams of the frames seen from `from` on, for messages.
        fn summary(&self, from: usize) -> String {
            let shown: Vec<String> = self.seen[from..]
                .iter()
                .map(|f| format!("{:?}@{}", Kind::from_u8(f.kind), f.stream))
                .collect();
            shown.join(" ")
        }
    }

    /// A host connected over a socket pair, as over vsock: `serve` returns once the host shuts
    /// its side down. The host's end is returned unread.
    fn vsock() -> (UnixStream, JoinHandle<()>) {
        let (host, agent) = UnixStream::pair().unwrap();
        let writer = File::from(OwnedFd::from(agent.try_clone().unwrap()));
        let conn = Conn {
            reader: File::from(OwnedFd::from(agent)),
            writer,
        };
        let server = std::thread::spawn(move || serve(conn, &ChannelSpec::Vsock(1024), reaper()));
        (host, server)
    }

    #[test]
    fn an_abandoned_exec_runs_on_unreported() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("x");
        let (mut host, server) = vsock();
        let mut frames = Frames::read(host.try_clone().unwrap());
        let cmd = r#"echo started; sleep 0.5; echo x > "$FILE"; echo late"#;
        host.write_all(&exec(1, cmd, dir.path(), &file, false))
            .unwrap();
        frames.until("output", |f| is(f, Kind::Stdout, 1));
        let abandoned_at = frames.seen.len();

        host.shutdown(Shutdown::Write).unwrap();
        server.join().unwrap();
        frames.rest();
        assert!(
            !file.exists(),
            "the agent closes the channel while the exec still runs"
        );
        assert!(
            frames.seen[abandoned_at..].iter().all(|f| f.stream != 1),
            "frames of the abandoned exec: {}",
            frames.summary(abandoned_at)
        );
        wait_for(&file);
    }

    #[test]
    fn an_abandoned_exec_output_is_drained() {
        let dir = tempfile::tempdir().unwrap();
        let (one, two) = (dir.path().join("1"), dir.path().join("2"));
        let (mut host, server) = vsock();
        // Stream 1 outgrows its window (none granted beyond the first); stream 2 has all the
        // window it wants but the host reads nothing, so the outbox fills and its sends wait.
        // The file is written only if all the output was written (no EPIPE, no SIGPIPE).
        let big =
            r#"head -c 3000000 /dev/zero && head -c 300000 /dev/zero >&2 && echo x > "$FILE""#;
        host.write_all(&exec(1, big, dir.path(), &one, false))
            .unwrap();
        host.write_all(&exec(
            2,
            &big.replace("3000000", "9000000"),
            dir.path(),
            &two,
            false,
        ))
        .unwrap();
        host.write_all(&frame(Kind::Window, 2, message::window_payload(u32::MAX)))
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !one.exists() && !two.exists(),
            "both execs wait for their output to be taken"
        );

        host.shutdown(Shutdown::Write).unwrap();
        server.join().unwrap();
        wait_for(&one);
        wait_for(&two);
        // Only now does the host read: what it gets is no concern of the abandoned execs.
        Frames::read(host).rest();
    }

    /// The agent's end of a FIFO, standing for a serial port: EOF while no host has it open,
    /// data again once one does. Counts the EOFs it returned; fails once told to stop, which
    /// ends `serve`.
    struct Port {
        fifo: File,
        eofs: Arc<AtomicUsize>,
        stop: Arc<AtomicBool>,
    }

    impl Read for Port {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.stop.load(Ordering::SeqCst) {
                return Err(io::Error::other("the test is over"));
            }
            let n = self.fifo.read(buf)?;
            if n == 0 {
                self.eofs.fetch_add(1, Ordering::SeqCst);
            }
            Ok(n)
        }
    }

    #[test]
    fn a_later_stream_on_an_abandoned_id_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("port");
        let c = CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // Opening for reading would wait for a writer unless non-blocking; reads block again
        // once it is open, as on the serial port.
        let fifo = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .unwrap();
        // SAFETY: fcntl on a descriptor we own.
        let rc = unsafe { libc::fcntl(fifo.as_raw_fd(), libc::F_SETFL, 0) };
        assert_eq!(rc, 0);
        let eofs = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let port = Port {
            fifo,
            eofs: eofs.clone(),
            stop: stop.clone(),
        };
        let (host_reads, agent_writes) = UnixStream::pair().unwrap();
        let mut frames = Frames::read(host_reads);
        let spec = ChannelSpec::Serial("test".into());
        let server = std::thread::spawn(move || serve_io(port, agent_writes, &spec, reaper()));
        let connect = || OpenOptions::new().write(true).open(&path).unwrap();

        // The first host starts an exec that will outlive it, then goes away.
        let old = dir.path().join("old");
        let mut host = connect();
        let cmd = r#"echo started; sleep 0.3; echo late; echo late >&2; echo x > "$FILE"; exit 7"#;
        host.write_all(&exec(1, cmd, dir.path(), &old, false))
            .unwrap();
        frames.until("output", |f| is(f, Kind::Stdout, 1));
        let eofs_before = eofs.load(Ordering::SeqCst);
        drop(host);
        let until = Instant::now() + PATIENCE;
        while eofs.load(Ordering::SeqCst) == eofs_before {
            assert!(Instant::now() < until, "the agent never saw the host go");
            std::thread::sleep(Duration::from_millis(5));
        }
        let abandoned_at = frames.seen.len();

        // The next host numbers its streams from 1 again; its stream 1 waits for stdin until
        // the old stream 1 has ended, then must still be served.
        let mut host = connect();
        host.write_all(&frame(Kind::Ping, 0, [])).unwrap();
        frames.until("ready", |f| is(f, Kind::Ready, 0));
        let new = r#"read line; echo "got $line""#;
        host.write_all(&exec(1, new, dir.path(), &dir.path().join("unused"), true))
            .unwrap();
        wait_for(&old);
        // The old exec's end (its exit, its context dropped) follows its last write at once.
        std::thread::sleep(Duration::from_millis(200));
        host.write_all(&frame(Kind::Stdin, 1, *b"hello\n")).unwrap();
        host.write_all(&frame(Kind::Stdin, 1, [])).unwrap();
        let exit = frames.until("exit", |f| is(f, Kind::Exit, 1));
        assert_eq!(exit_status(&exit).exit_code, Some(0));

        let after = &frames.seen[abandoned_at..];
        let stdout: Vec<u8> = after
            .iter()
            .filter(|f| is(f, Kind::Stdout, 1))
            .flat_map(|f| f.payload.clone())
            .collect();
        assert_eq!(String::from_utf8_lossy(&stdout), "got hello\n");
        assert!(
            after
                .iter()
                .all(|f| !is(f, Kind::Stderr, 1) && !is(f, Kind::Error, 1)),
            "frames after the abandonment: {}",
            frames.summary(abandoned_at)
        );
        assert_eq!(after.iter().filter(|f| is(f, Kind::Exit, 1)).count(), 1);

        stop.store(true, Ordering::SeqCst);
        drop(host);
        server.join().unwrap();
        frames.rest();
    }

    #[test]
    fn cancel_kills_the_group() {
        let dir = tempfile::tempdir().unwrap();
        let (mut host, server) = vsock();
        let mut frames = Frames::read(host.try_clone().unwrap());
        let cmd = "sleep 30 & echo $!; wait";
        host.write_all(&exec(1, cmd, dir.path(), dir.path(), false))
            .unwrap();
        let out = frames.until("the pid", |f| is(f, Kind::Stdout, 1));
        let pid: i32 = String::from_utf8_lossy(&out.payload)
            .trim()
            .parse()
            .unwrap();

        host.write_all(&frame(Kind::Cancel, 1, [])).unwrap();
        let exit = frames.until("exit", |f| is(f, Kind::Exit, 1));
        assert_eq!(exit_status(&exit).signal, Some(libc::SIGKILL));
        // The background sleep of the group is killed too (gone, or a zombie left to its reaper).
        let until = Instant::now() + PATIENCE;
        while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, rest)| !rest.starts_with('Z'))
        }) {
            assert!(
                Instant::now() < until,
                "the group's sleep {pid} survived the cancel"
            );
            std::thread::sleep(Duration::from_millis(10));
        }

        host.shutdown(Shutdown::Write).unwrap();
        server.join().unwrap();
        frames.rest();
    }

    /// An exec on a terminal, with stdin, of the shell line `command` (`FILE` naming `file`).
    fn exec_on_tty(stream: u32, command: &str, cwd: &Path, file: &Path) -> Vec<u8> {
        let req = ExecRequest {
            command: Some(command.into()),
            env: [("FILE".to_owned(), file.display().to_string())].into(),
            cwd: Some(cwd.display().to_string()),
            stdin: true,
            pty: Some(message::TermSize { rows: 24, cols: 80 }),
            ..Default::default()
        };
        frame(Kind::Exec, stream, serde_json::to_vec(&req).unwrap())
    }

    /// A terminal's output read as it comes, until it holds `want`.
    fn tty_until(frames: &mut Frames, stream: u32, text: &mut String, want: &str) {
        while !text.contains(want) {
            let f = frames.until(want, |f| {
                is(f, Kind::Stdout, stream)
                    || is(f, Kind::Error, stream)
                    || is(f, Kind::Exit, stream)
            });
            assert!(
                is(&f, Kind::Stdout, stream),
                "{:?} before {want:?}; output so far: {text:?}",
                String::from_utf8_lossy(&f.payload)
            );
            text.push_str(&String::from_utf8_lossy(&f.payload));
        }
    }

    /// A real pseudo terminal: the process's controlling terminal (`tty`), of the size asked;
    /// a `Resize` changes the size and delivers SIGWINCH; what the host types is echoed and
    /// read, Ctrl-C interrupts the foreground process through the line discipline, and a job
    /// left in the background does not hold the exec open. A cancel kills the whole session
    /// (a job of its own group too).
    #[test]
    fn an_exec_on_a_terminal_is_a_session_with_a_size() {
        let dir = tempfile::tempdir().unwrap();
        let go = dir.path().join("go");
        let (mut host, server) = vsock();
        let mut frames = Frames::read(host.try_clone().unwrap());
        let cmd = r#"stty size; tty -s && echo tty-ok; trap 'echo winch $(stty size)' WINCH; echo ready; while [ ! -e "$FILE" ]; do sleep 0.05; done; read line; echo "got $line"; sleep 30 & exit 5"#;
        host.write_all(&exec_on_tty(1, cmd, dir.path(), &go))
            .unwrap();
        let mut text = String::new();
        tty_until(&mut frames, 1, &mut text, "ready");
        assert!(text.contains("24 80\r\n"), "{text:?}");
        assert!(text.contains("tty-ok"), "{text:?}");
        let size = serde_json::to_vec(&message::TermSize {
            rows: 40,
            cols: 120,
        })
        .unwrap();
        host.write_all(&frame(Kind::Resize, 1, size)).unwrap();
        tty_until(&mut frames, 1, &mut text, "winch 40 120");
        std::fs::write(&go, "").unwrap();
        host.write_all(&frame(Kind::Stdin, 1, *b"hello\n")).unwrap();
        tty_until(&mut frames, 1, &mut text, "got hello");
        let exit = frames.until("exit", |f| is(f, Kind::Exit, 1));
        assert_eq!(exit_status(&exit).exit_code, Some(5), "{text:?}");
        // The line discipline echoed what was typed, with the terminal's line ends.
        assert!(text.contains("hello\r\n"), "{text:?}");

        // Ctrl-C: SIGINT to the foreground group, from the terminal, not from the host.
        host.write_all(&exec_on_tty(2, "echo up; exec sleep 30", dir.path(), &go))
            .unwrap();
        let mut text = String::new();
        tty_until(&mut frames, 2, &mut text, "up");
        host.write_all(&frame(Kind::Stdin, 2, *b"\x03")).unwrap();
        let exit = frames.until("exit", |f| is(f, Kind::Exit, 2));
        assert_eq!(exit_status(&exit).signal, Some(libc::SIGINT));

        // A job in a group of its own (job control on), killed with the session on a cancel.
        let cmd = "set -m; sleep 30 & echo \"pid $!\"; wait";
        host.write_all(&exec_on_tty(3, cmd, dir.path(), &go))
            .unwrap();
        let mut text = String::new();
        tty_until(&mut frames, 3, &mut text, "\r\n");
        let pid: i32 = text
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no pid in {text:?}"));
        // SAFETY: getpgid and getsid have no memory preconditions.
        let (group, session) = unsafe { (libc::getpgid(pid), libc::getsid(pid)) };
        assert_eq!(group, pid, "the job has a group of its own");
        assert_ne!(session, group, "the job is in the shell's session");
        host.write_all(&frame(Kind::Cancel, 3, [])).unwrap();
        frames.until("exit", |f| is(f, Kind::Exit, 3));
        let until = Instant::now() + PATIENCE;
        while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, rest)| !rest.starts_with('Z'))
        }) {
            assert!(
                Instant::now() < until,
                "the session's job {pid} survived the cancel"
            );
            std::thread::sleep(Duration::from_millis(10));
        }

        // A size sent right behind the request, before the terminal is open, is its size; a
        // job left writing in the background does not hold the exec open past its leader.
        let cmd = r#"stty size; set -m; yes > /dev/tty & echo "job $!"; sleep 0.2; exit 0"#;
        host.write_all(&exec_on_tty(5, cmd, dir.path(), &go))
            .unwrap();
        let size = serde_json::to_vec(&message::TermSize { rows: 33, cols: 77 }).unwrap();
        host.write_all(&frame(Kind::Resize, 5, size)).unwrap();
        // A reader that keeps up (the job writes as fast as it can).
        host.write_all(&frame(Kind::Window, 5, message::window_payload(u32::MAX)))
            .unwrap();
        let mut text = String::new();
        tty_until(&mut frames, 5, &mut text, "job ");
        assert!(text.starts_with("33 77\r\n"), "{text:?}");
        let exit = frames.until("exit", |f| is(f, Kind::Exit, 5));
        assert_eq!(exit_status(&exit).exit_code, Some(0));
        let job: i32 = text
            .split("job ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no job pid in {text:?}"));
        // SAFETY: kill has no memory preconditions.
        unsafe { libc::kill(job, libc::SIGKILL) };

        // A size of 0 is refused, for an exec and for a resize.
        let req = ExecRequest {
            command: Some("true".into()),
            cwd: Some(dir.path().display().to_string()),
            stdin: true,
            pty: Some(message::TermSize { rows: 0, cols: 80 }),
            ..Default::default()
        };
        host.write_all(&frame(Kind::Exec, 4, serde_json::to_vec(&req).unwrap()))
            .unwrap();
        let err = frames.until("an error", |f| is(f, Kind::Error, 4));
        assert!(
            String::from_utf8_lossy(&err.payload).contains("rows must be 1 to 4096, not 0"),
            "{}",
            String::from_utf8_lossy(&err.payload)
        );

        host.shutdown(Shutdown::Write).unwrap();
        server.join().unwrap();
        frames.rest();
    }

    /// A guest's port over the channel: bytes to it and back from a real TCP connection on the
    /// loopback, the host's end of sending a half-close the server sees, the server's close the
    /// end of the stream; a port nothing listens on is refused in words.
    #[test]
    fn a_port_is_relayed_both_ways_and_a_closed_one_is_refused() {
        use std::net::TcpListener;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        // An upper-casing echo that answers once its peer is done sending, then closes.
        let server = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            c.read_to_end(&mut got).unwrap();
            c.write_all(&got.to_ascii_uppercase()).unwrap();
        });
        let (mut host, agent) = vsock();
        let mut frames = Frames::read(host.try_clone().unwrap());
        let req = serde_json::to_vec(&message::PortRequest { port }).unwrap();
        host.write_all(&frame(Kind::PortOpen, 1, req)).unwrap();
        host.write_all(&frame(Kind::Data, 1, *b"hello ")).unwrap();
        host.write_all(&frame(Kind::Data, 1, *b"port")).unwrap();
        host.write_all(&frame(Kind::Data, 1, [])).unwrap();
        let mut got = Vec::new();
        loop {
            let f = frames.until("output", |f| {
                is(f, Kind::Output, 1) || is(f, Kind::Error, 1)
            });
            assert!(
                is(&f, Kind::Output, 1),
                "{}",
                String::from_utf8_lossy(&f.payload)
            );
            if f.payload.is_empty() {
                break;
            }
            got.extend_from_slice(&f.payload);
        }
        assert_eq!(got, b"HELLO PORT");
        server.join().unwrap();

        // Nothing listens on it now.
        let req = serde_json::to_vec(&message::PortRequest { port }).unwrap();
        host.write_all(&frame(Kind::PortOpen, 2, req)).unwrap();
        let err = frames.until("an error", |f| is(f, Kind::Error, 2));
        let err: message::ErrorMessage = serde_json::from_slice(&err.payload).unwrap();
        assert_eq!(err.code, code::REFUSED);
        assert!(
            err.message.contains(&format!("port {port} in the guest")),
            "{}",
            err.message
        );

        host.shutdown(Shutdown::Write).unwrap();
        agent.join().unwrap();
        frames.rest();
    }

    /// The watch's output read as it comes, until a line holding `want` arrives.
    fn watch_until(frames: &mut Frames, text: &mut String, want: &str) {
        while !text.contains(want) {
            let f = frames.until(want, |f| is(f, Kind::Output, 1) || is(f, Kind::Error, 1));
            assert!(
                is(&f, Kind::Output, 1),
                "{}",
                String::from_utf8_lossy(&f.payload)
            );
            text.push_str(&String::from_utf8_lossy(&f.payload));
        }
    }

    /// A watch on a real directory (inotify): creates, a modify, a rename and a delete in a
    /// subdirectory made after it started; then, with the host granting no more window, more
    /// changes than its queue holds: they are dropped and counted, and once the host reads again
    /// an `overflow` line says how many.
    #[test]
    fn a_watch_reports_changes_and_says_what_it_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let (mut host, server) = vsock();
        let mut frames = Frames::read(host.try_clone().unwrap());
        let req = serde_json::json!({"path": root, "recursive": true}).to_string();
        host.write_all(&frame(Kind::Watch, 1, req)).unwrap();
        let mut text = String::new();
        watch_until(&mut frames, &mut text, "\"event\":\"ready\"");

        std::fs::create_dir(root.join("sub")).unwrap();
        let sub = root.join("sub").display().to_string();
        // Its watch is set once its create is sent (inotify's own race: what happens in a new
        // directory before its watch is added is found by the scan, as creates, and no more).
        watch_until(&mut frames, &mut text, &format!("\"path\":\"{sub}\""));
        std::fs::write(root.join("sub/x"), b"one").unwrap();
        std::fs::write(root.join("sub/x"), b"two").unwrap();
        std::fs::rename(root.join("sub/x"), root.join("sub/y")).unwrap();
        std::fs::remove_file(root.join("sub/y")).unwrap();
        watch_until(
            &mut frames,
            &mut text,
            &format!("\"event\":\"delete\",\"path\":\"{sub}/y\""),
        );
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let has = |want: serde_json::Value| {
            assert!(lines.contains(&want), "no {want} in {lines:?}");
        };
        has(serde_json::json!({"event": "create", "path": sub, "dir": true}));
        has(serde_json::json!({"event": "create", "path": format!("{sub}/x"), "dir": false}));
        has(
            serde_json::json!({"event": "rename", "from": format!("{sub}/x"),
                               "to": format!("{sub}/y"), "dir": false}),
        );

        // The host stops granting window: past the first window and the queue, changes drop.
        let many = root.join("many");
        std::fs::create_dir(&many).unwrap();
        // Its watch is set (and its first scan done) before anything is made in it.
        watch_until(
            &mut frames,
            &mut text,
            &format!("\"path\":\"{}\"", many.display()),
        );
        let n = 40_000;
        for i in 0..n {
            std::fs::write(
                many.join(format!("a-long-name-to-fill-the-window-sooner-{i:06}")),
                b"",
            )
            .unwrap();
        }
        std::thread::sleep(Duration::from_millis(500));
        host.write_all(&frame(Kind::Window, 1, message::window_payload(64 << 20)))
            .unwrap();
        watch_until(&mut frames, &mut text, "\"event\":\"overflow\"");
        let overflow: serde_json::Value = text
            .lines()
            .find(|l| l.contains("\"overflow\""))
            .map(|l| serde_json::from_str(l).unwrap())
            .unwrap();
        let dropped = overflow["dropped"].as_u64().unwrap();
        assert_eq!(overflow["reason"], "queue", "{overflow}");
        assert!(dropped > 0 && dropped < n, "{overflow}");
        // What was sent and what was dropped are every change (the creates; their writes of
        // nothing made no modify): what the queue held comes after the overflow line.
        while (text.matches("a-long-name-to-fill").count() as u64) + dropped < n {
            let f = frames.until("the queued events", |f| is(f, Kind::Output, 1));
            text.push_str(&String::from_utf8_lossy(&f.payload));
        }
        let sent = text.matches("a-long-name-to-fill").count() as u64;
        assert_eq!(sent + dropped, n, "{sent} sent, {dropped} dropped");

        host.write_all(&frame(Kind::Cancel, 1, Vec::new())).unwrap();
        host.shutdown(Shutdown::Write).unwrap();
        server.join().unwrap();
        frames.rest();
    }
}
