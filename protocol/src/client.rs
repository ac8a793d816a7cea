//! The host side of the channel: a multiplexing client over any byte stream.
//!
//! One reader task decodes frames and routes them to their stream; one writer task owns the write
//! half. Everything the guest sends is checked: a malformed frame, a frame kind the agent may not
//! send, or data beyond the window the host granted closes the channel (the guest is either broken
//! or hostile, and the host never buffers more than it granted).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Semaphore, broadcast, mpsc, watch};

use crate::message::{
    Done, ErrorMessage, ExecRequest, ExitStatus, FilePut, PathRequest, Ready, SignalRequest,
    TermSize, parse_window, window_payload,
};
use crate::{DATA_CHUNK, Decoder, Frame, INITIAL_WINDOW, Kind};

/// Why a request over the channel failed.
#[derive(Debug, Error, Clone)]
pub enum ClientError {
    /// The channel is gone (VM stopped, agent died, or the guest broke the protocol).
    #[error("the agent channel is closed: {0}")]
    Closed(String),
    /// The agent answered the request with an error.
    #[error("{}", .0.message)]
    Agent(ErrorMessage),
    /// The agent did not answer in time.
    #[error("the agent did not answer within {0:?}")]
    Timeout(Duration),
    /// The agent answered with something the request did not expect.
    #[error("unexpected answer from the agent: {0}")]
    Unexpected(String),
}

impl ClientError {
    /// The agent's error code, if the agent refused the request.
    pub fn agent_code(&self) -> Option<&str> {
        match self {
            ClientError::Agent(m) => Some(&m.code),
            _ => None,
        }
    }
}

/// Something that arrived on a stream.
#[derive(Debug)]
enum Event {
    Data(Kind, Bytes),
    Exit(ExitStatus),
    Done(Done),
    Ready(Ready),
    Error(ErrorMessage),
    Closed(String),
}

struct StreamSlot {
    events: mpsc::UnboundedSender<Event>,
    /// Window for the host's uploads on this stream, granted by the agent.
    send_credit: Arc<Semaphore>,
    /// Bytes delivered to the consumer's queue that it has not yet taken (and so not re-granted).
    unacked: u64,
}

struct Shared {
    tx: mpsc::Sender<Vec<u8>>,
    streams: Mutex<HashMap<u32, StreamSlot>>,
    next_id: AtomicU32,
    closed: watch::Sender<Option<String>>,
    ready: watch::Sender<Option<Ready>>,
    stray_errors: broadcast::Sender<(u32, ErrorMessage)>,
}

/// Upper bound of upload credit the host keeps, whatever a guest grants.
const MAX_SEND_CREDIT: usize = 1 << 32;

/// A connection to one guest agent. Cheap to clone; all clones share the channel.
#[derive(Clone)]
pub struct Client {
    shared: Arc<Shared>,
}

impl Client {
    /// Starts the reader and writer tasks on the two halves of a byte stream.
    pub fn new<R, W>(read: R, write: W) -> Client
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        Client::numbered_from(read, write, 1)
    }

    /// [`Client::new`] whose streams are numbered from `first`: a host that takes an agent on
    /// again after another host (a restart of the service) numbers its streams apart from the
    /// ones the agent may still hold open for the old one, if it never saw the old one go (a
    /// reconnection faster than the guest read its channel).
    pub fn numbered_from<R, W>(read: R, write: W, first: u32) -> Client
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(64);
        let shared = Arc::new(Shared {
            tx,
            streams: Mutex::new(HashMap::new()),
            next_id: AtomicU32::new(first.max(1)),
            closed: watch::channel(None).0,
            ready: watch::channel(None).0,
            stray_errors: broadcast::channel(64).0,
        });
        tokio::spawn(write_loop(
            write,
            rx,
            Arc::downgrade(&shared),
            shared.closed.subscribe(),
        ));
        tokio::spawn(read_loop(read, shared.clone()));
        Client { shared }
    }

    /// Waits for the agent's first `Ready` (sent when it starts).
    pub async fn wait_ready(&self, timeout: Duration) -> Result<Ready, ClientError> {
        let mut ready = self.shared.ready.subscribe();
        let mut closed = self.shared.closed.subscribe();
        let wait = async {
            loop {
                if let Some(r) = ready.borrow_and_update().clone() {
                    return Ok(r);
                }
                if let Some(why) = closed.borrow_and_update().clone() {
                    return Err(ClientError::Closed(why));
                }
                tokio::select! {
                    _ = ready.changed() => {}
                    _ = closed.changed() => {}
                }
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| ClientError::Timeout(timeout))?
    }

    /// Closes the channel from the host's side: every open stream ends with `why` and nothing
    /// more is sent. For a VM the host gave up on, whose transport may not close by itself.
    pub fn close(&self, why: String) {
        close(&self.shared, why);
    }

    /// Why the channel closed, if it has.
    pub fn closed_reason(&self) -> Option<String> {
        self.shared.closed.borrow().clone()
    }

    /// Resolves when the channel closes, with the reason.
    pub async fn closed(&self) -> String {
        let mut rx = self.shared.closed.subscribe();
        loop {
            if let Some(why) = rx.borrow_and_update().clone() {
                return why;
            }
            if rx.changed().await.is_err() {
                return "the client was dropped".into();
            }
        }
    }

    /// Errors the agent sent on stream 0 or on streams the host does not have open (its answers
    /// to bad frames).
    pub fn subscribe_stray_errors(&self) -> broadcast::Receiver<(u32, ErrorMessage)> {
        self.shared.stray_errors.subscribe()
    }

    /// Asks the agent whether it is alive.
    pub async fn ping(&self) -> Result<Ready, ClientError> {
        let mut s = self.open(Kind::Ping, Vec::new()).await?;
        match s.next_event().await? {
            Event::Ready(r) => Ok(r),
            other => Err(unexpected(&other)),
        }
    }

    /// Starts a process.
    pub async fn exec(&self, req: &ExecRequest) -> Result<Exec, ClientError> {
        let stream = self.open(Kind::Exec, to_json(req)).await?;
        let stdin = req.stdin.then(|| Stdin {
            stream: stream.sender(),
            closed: false,
        });
        Ok(Exec {
            stdin,
            output: ExecOutput {
                stream,
                exited: false,
            },
        })
    }

    /// Unpacks a tar (or tar.gz) stream into a directory of the guest.
    pub async fn put_archive(
        &self,
        path: &str,
        body: impl AsyncRead + Unpin,
    ) -> Result<Done, ClientError> {
        self.archive_upload(path).await?.copy_from(body).await
    }

    /// Starts unpacking a tar (or tar.gz) stream into a directory; the caller writes the bytes.
    pub async fn archive_upload(&self, path: &str) -> Result<Upload, ClientError> {
        let s = self
            .open(
                Kind::ArchivePut,
                to_json(&PathRequest { path: path.into() }),
            )
            .await?;
        Ok(Upload::new(s))
    }

    /// Starts writing a file; the caller writes the bytes.
    pub async fn file_upload(&self, path: &str, mode: Option<u32>) -> Result<Upload, ClientError> {
        let s = self
            .open(
                Kind::FilePut,
                to_json(&FilePut {
                    path: path.into(),
                    mode,
                }),
            )
            .await?;
        Ok(Upload::new(s))
    }

    /// Streams a directory of the guest as a tar archive.
    pub async fn get_archive(&self, path: &str) -> Result<Download, ClientError> {
        let s = self
            .open(
                Kind::ArchiveGet,
                to_json(&PathRequest { path: path.into() }),
            )
            .await?;
        Ok(Download {
            stream: s,
            finished: false,
        })
    }

    /// Writes a file in the guest (atomically: a temporary file renamed into place).
    pub async fn put_file(
        &self,
        path: &str,
        mode: Option<u32>,
        body: impl AsyncRead + Unpin,
    ) -> Result<Done, ClientError> {
        self.file_upload(path, mode).await?.copy_from(body).await
    }

    /// Streams a file of the guest.
    pub async fn get_file(&self, path: &str) -> Result<Download, ClientError> {
        let s = self
            .open(Kind::FileGet, to_json(&PathRequest { path: path.into() }))
            .await?;
        Ok(Download {
            stream: s,
            finished: false,
        })
    }

    /// Streams the file events of a directory of the guest as NDJSON lines (its first line says
    /// the watch is set), until dropped.
    pub async fn watch(&self, path: &str, recursive: bool) -> Result<Download, ClientError> {
        let s = self
            .open(
                Kind::Watch,
                to_json(&crate::message::WatchRequest {
                    path: path.into(),
                    recursive,
                }),
            )
            .await?;
        Ok(Download {
            stream: s,
            finished: false,
        })
    }

    /// Opens a connection to a TCP port on the guest's loopback, relayed over the channel:
    /// what the caller writes reaches the port, what the port sends comes back as the
    /// download (which ends when the port closes its side; dropping it closes the connection).
    /// A port nothing listens on is the download's first result, an `Agent` error `refused`.
    pub async fn port(&self, port: u16) -> Result<(PortWriter, Download), ClientError> {
        let s = self
            .open(
                Kind::PortOpen,
                to_json(&crate::message::PortRequest { port }),
            )
            .await?;
        let writer = PortWriter {
            sender: s.sender(),
            closed: false,
        };
        Ok((
            writer,
            Download {
                stream: s,
                finished: false,
            },
        ))
    }

    /// Asks the agent to sync and power the guest off. Returns once the agent acknowledged it
    /// or the channel closed.
    pub async fn shutdown(&self) -> Result<(), ClientError> {
        let mut s = self.open(Kind::Shutdown, Vec::new()).await?;
        match s.next_event().await {
            Ok(Event::Done(_)) | Err(ClientError::Closed(_)) => Ok(()),
            Ok(other) => Err(unexpected(&other)),
            Err(e) => Err(e),
        }
    }

    /// Makes a guest restored from a shared snapshot a machine of its own: its random generator
    /// reseeded from `entropy`, its clock set to `unix_ns`. Returns once the agent did both.
    pub async fn set_identity(&self, entropy: &[u8], unix_ns: u64) -> Result<(), ClientError> {
        let req = crate::message::Identity {
            entropy_hex: entropy.iter().map(|b| format!("{b:02x}")).collect(),
            unix_ns,
        };
        let mut s = self.open(Kind::Identity, to_json(&req)).await?;
        match s.next_event().await {
            Ok(Event::Done(_)) => Ok(()),
            Ok(other) => Err(unexpected(&other)),
            Err(e) => Err(e),
        }
    }

    /// Writes bytes to the channel as they are, outside any stream. For testing how the agent
    /// copes with malformed input; never used by the host itself.
    pub async fn send_raw(&self, bytes: Vec<u8>) -> Result<(), ClientError> {
        self.shared
            .tx
            .send(bytes)
            .await
            .map_err(|_| self.closed_error())
    }

    /// Sends one frame on a stream the host has not opened through this client (tests).
    pub async fn send_frame(&self, frame: Frame) -> Result<(), ClientError> {
        self.send_raw(frame.encode()).await
    }

    fn closed_error(&self) -> ClientError {
        ClientError::Closed(
            self.closed_reason()
                .unwrap_or_else(|| "the channel writer stopped".into()),
        )
    }

    async fn open(&self, kind: Kind, payload: Vec<u8>) -> Result<Stream, ClientError> {
        if let Some(why) = self.closed_reason() {
            return Err(ClientError::Closed(why));
        }
        let id = loop {
            let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
            if id != 0 {
                break id;
            }
        };
        let (etx, erx) = mpsc::unbounded_channel();
        let send_credit = Arc::new(Semaphore::new(INITIAL_WINDOW as usize));
        lock(&self.shared.streams).insert(
            id,
            StreamSlot {
                events: etx,
                send_credit: send_credit.clone(),
                unacked: 0,
            },
        );
        let stream = Stream {
            shared: self.shared.clone(),
            id,
            events: erx,
            send_credit,
            done: false,
        };
        stream.send(kind, payload).await?;
        Ok(stream)
    }
}

/// Queues a frame from a synchronous context (a `Drop`): at once if the queue has room, else from
/// a task, so a full queue never loses a cancel.
fn send_soon(tx: &mpsc::Sender<Vec<u8>>, frame: Vec<u8>) {
    if let Err(mpsc::error::TrySendError::Full(frame)) = tx.try_send(frame)
        && let Ok(rt) = tokio::runtime::Handle::try_current()
    {
        let tx = tx.clone();
        rt.spawn(async move {
            let _ = tx.send(frame).await;
        });
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn to_json(v: &impl serde::Serialize) -> Vec<u8> {
    serde_json::to_vec(v).expect("protocol messages always serialise")
}

fn unexpected(e: &Event) -> ClientError {
    match e {
        Event::Error(m) => ClientError::Agent(m.clone()),
        Event::Closed(why) => ClientError::Closed(why.clone()),
        other => ClientError::Unexpected(format!("{other:?}").chars().take(200).collect()),
    }
}

/// One open stream: its events and the means to send on it.
struct Stream {
    shared: Arc<Shared>,
    id: u32,
    events: mpsc::UnboundedReceiver<Event>,
    send_credit: Arc<Semaphore>,
    done: bool,
}

impl Stream {
    fn sender(&self) -> StreamSender {
        StreamSender {
            shared: self.shared.clone(),
            id: self.id,
            send_credit: self.send_credit.clone(),
        }
    }

    async fn send(&self, kind: Kind, payload: Vec<u8>) -> Result<(), ClientError> {
        self.sender().send(kind, payload).await
    }

    /// The next event; data is re-granted to the agent as it is taken, so at most one window of
    /// it is ever queued.
    async fn next_event(&mut self) -> Result<Event, ClientError> {
        let ev = match self.events.recv().await {
            Some(ev) => ev,
            None => return Err(ClientError::Closed("the stream was dropped".into())),
        };
        match &ev {
            Event::Data(_, b) if !b.is_empty() => {
                let n = b.len() as u32;
                if let Some(slot) = lock(&self.shared.streams).get_mut(&self.id) {
                    slot.unacked = slot.unacked.saturating_sub(n.into());
                }
                let _ = self
                    .shared
                    .tx
                    .send(Frame::new(Kind::Window, self.id, window_payload(n)).encode())
                    .await;
            }
            Event::Data(..) => {}
            Event::Closed(why) => {
                self.done = true;
                return Err(ClientError::Closed(why.clone()));
            }
            _ => self.done = true,
        }
        Ok(ev)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        lock(&self.shared.streams).remove(&self.id);
        // A sender still waiting for window on this stream (an exec's stdin) gives up.
        self.send_credit.close();
        if !self.done {
            // The host gave up on the stream: the agent stops its work (kills an exec).
            send_soon(
                &self.shared.tx,
                Frame::new(Kind::Cancel, self.id, Vec::new()).encode(),
            );
        }
    }
}

/// The sending side of a stream, usable while another task reads its events.
struct StreamSender {
    shared: Arc<Shared>,
    id: u32,
    send_credit: Arc<Semaphore>,
}

impl StreamSender {
    async fn send(&self, kind: Kind, payload: Vec<u8>) -> Result<(), ClientError> {
        let closed = || {
            ClientError::Closed(
                self.shared
                    .closed
                    .borrow()
                    .clone()
                    .unwrap_or_else(|| "closed".into()),
            )
        };
        self.shared
            .tx
            .send(Frame::new(kind, self.id, payload).encode())
            .await
            .map_err(|_| closed())
    }

    /// Sends upload bytes as `kind` frames, waiting for window.
    async fn send_data(&self, kind: Kind, mut data: &[u8]) -> Result<(), ClientError> {
        while !data.is_empty() {
            let n = data.len().min(DATA_CHUNK);
            let permit = self
                .send_credit
                .acquire_many(n as u32)
                .await
                .map_err(|_| ClientError::Closed("the stream ended".into()))?;
            permit.forget();
            self.send(kind, data[..n].to_vec()).await?;
            data = &data[n..];
        }
        Ok(())
    }
}

/// An upload in progress (archive or file). The agent may refuse it at any point (an unsafe
/// entry, no space): `write` returns that refusal as soon as it arrives.
pub struct Upload {
    stream: Stream,
    sender: StreamSender,
    ended: Option<Result<Done, ClientError>>,
}

impl Upload {
    fn new(stream: Stream) -> Self {
        let sender = stream.sender();
        Upload {
            stream,
            sender,
            ended: None,
        }
    }

    /// Sends bytes, waiting for window; fails early if the agent has already refused the upload.
    pub async fn write(&mut self, data: &[u8]) -> Result<(), ClientError> {
        if let Some(r) = &self.ended {
            return Err(r
                .clone()
                .err()
                .unwrap_or_else(|| ClientError::Unexpected("the upload already ended".into())));
        }
        tokio::select! {
            biased;
            ev = self.stream.next_event() => {
                let r = finish_upload(ev);
                self.ended = Some(r.clone());
                Err(r.err().unwrap_or_else(|| ClientError::Unexpected("the agent ended the upload early".into())))
            }
            sent = self.sender.send_data(Kind::Data, data) => sent,
        }
    }

    /// Ends the upload and waits for the agent's result.
    pub async fn finish(mut self) -> Result<Done, ClientError> {
        if let Some(r) = self.ended.take() {
            return r;
        }
        self.sender.send(Kind::Data, Vec::new()).await?;
        finish_upload(self.stream.next_event().await)
    }

    /// Copies everything from `body`, then finishes.
    pub async fn copy_from(
        mut self,
        mut body: impl AsyncRead + Unpin,
    ) -> Result<Done, ClientError> {
        let mut buf = vec![0u8; DATA_CHUNK];
        loop {
            let n = body
                .read(&mut buf)
                .await
                .map_err(|e| ClientError::Unexpected(format!("reading the upload: {e}")))?;
            if n == 0 {
                return self.finish().await;
            }
            self.write(&buf[..n]).await?;
        }
    }
}

fn finish_upload(ev: Result<Event, ClientError>) -> Result<Done, ClientError> {
    match ev? {
        Event::Done(d) => Ok(d),
        other => Err(unexpected(&other)),
    }
}

/// The sending side of a connection to a guest's port ([`Client::port`]).
pub struct PortWriter {
    sender: StreamSender,
    closed: bool,
}

impl PortWriter {
    /// Sends bytes to the port, waiting for window (the port reading them).
    pub async fn write(&mut self, data: &[u8]) -> Result<(), ClientError> {
        self.sender.send_data(Kind::Data, data).await
    }

    /// Ends the sending side (the port reads EOF; what it sends still comes back).
    pub async fn close(mut self) -> Result<(), ClientError> {
        self.closed = true;
        self.sender.send(Kind::Data, Vec::new()).await
    }
}

/// A running process: its stdin (if requested) and its output.
pub struct Exec {
    /// Present when the request asked for stdin.
    pub stdin: Option<Stdin>,
    /// Output and exit status.
    pub output: ExecOutput,
}

/// The stdin of a running process.
pub struct Stdin {
    stream: StreamSender,
    closed: bool,
}

impl Stdin {
    /// Sends bytes, waiting while the agent's window is used up.
    pub async fn write(&mut self, data: &[u8]) -> Result<(), ClientError> {
        self.stream.send_data(Kind::Stdin, data).await
    }

    /// Closes stdin (the process reads EOF).
    pub async fn close(mut self) -> Result<(), ClientError> {
        self.closed = true;
        self.stream.send(Kind::Stdin, Vec::new()).await
    }
}

impl Drop for Stdin {
    fn drop(&mut self) {
        if !self.closed {
            send_soon(
                &self.stream.shared.tx,
                Frame::new(Kind::Stdin, self.stream.id, Vec::new()).encode(),
            );
        }
    }
}

/// One piece of a process's output, or its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    /// Bytes written to stdout.
    Stdout(Bytes),
    /// Bytes written to stderr.
    Stderr(Bytes),
    /// The process ended and all its output has been delivered.
    Exit(ExitStatus),
}

/// The output side of a running process. Dropping it before the exit kills the process group.
pub struct ExecOutput {
    stream: Stream,
    exited: bool,
}

impl ExecOutput {
    /// The next output chunk or the exit; `None` after the exit.
    pub async fn next(&mut self) -> Option<Result<ExecEvent, ClientError>> {
        if self.exited {
            return None;
        }
        let ev = match self.stream.next_event().await {
            Ok(ev) => ev,
            Err(e) => {
                self.exited = true;
                return Some(Err(e));
            }
        };
        Some(match ev {
            Event::Data(Kind::Stdout, b) => Ok(ExecEvent::Stdout(b)),
            Event::Data(Kind::Stderr, b) => Ok(ExecEvent::Stderr(b)),
            Event::Exit(s) => {
                self.exited = true;
                Ok(ExecEvent::Exit(s))
            }
            other => {
                self.exited = true;
                Err(unexpected(&other))
            }
        })
    }

    /// Sends a signal to the process group.
    pub async fn signal(&self, signal: i32) -> Result<(), ClientError> {
        self.control().signal(signal).await
    }

    /// A handle that signals the process or resizes its terminal while another task waits
    /// for its output.
    pub fn control(&self) -> ExecControl {
        ExecControl {
            stream: self.stream.sender(),
        }
    }
}

/// Signals and terminal sizes for a running process, apart from its output.
pub struct ExecControl {
    stream: StreamSender,
}

impl ExecControl {
    /// Sends a signal to the process group.
    pub async fn signal(&self, signal: i32) -> Result<(), ClientError> {
        self.stream
            .send(Kind::Signal, to_json(&SignalRequest { signal }))
            .await
    }

    /// Gives the terminal of a process started with a `pty` a new size.
    pub async fn resize(&self, size: TermSize) -> Result<(), ClientError> {
        self.stream.send(Kind::Resize, to_json(&size)).await
    }
}

/// A byte stream coming from the guest (an archive or a file).
pub struct Download {
    stream: Stream,
    finished: bool,
}

impl Download {
    /// The next chunk; `None` at the end. An error (for instance `not_found`) ends it.
    pub async fn next_chunk(&mut self) -> Option<Result<Bytes, ClientError>> {
        if self.finished {
            return None;
        }
        match self.stream.next_event().await {
            Ok(Event::Data(Kind::Output, b)) if b.is_empty() => {
                self.finished = true;
                None
            }
            Ok(Event::Data(Kind::Output, b)) => Some(Ok(b)),
            Ok(other) => {
                self.finished = true;
                Some(Err(unexpected(&other)))
            }
            Err(e) => {
                self.finished = true;
                Some(Err(e))
            }
        }
    }

    /// Collects the whole download (for small files and tests).
    pub async fn collect(mut self) -> Result<Vec<u8>, ClientError> {
        let mut out = Vec::new();
        while let Some(chunk) = self.next_chunk().await {
            out.extend_from_slice(&chunk?);
        }
        Ok(out)
    }
}

/// Owns the write half until the channel closes. It holds the shared state only weakly and
/// watches `closed`, so a closed channel never keeps its socket (or this task) alive.
async fn write_loop<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::Receiver<Vec<u8>>,
    shared: std::sync::Weak<Shared>,
    mut closed: watch::Receiver<Option<String>>,
) {
    let fail = |why: String| {
        if let Some(s) = shared.upgrade() {
            close(&s, why);
        }
    };
    loop {
        let buf = tokio::select! {
            b = rx.recv() => match b {
                Some(b) => b,
                None => return,
            },
            _ = closed.changed() => return,
        };
        if let Err(e) = w.write_all(&buf).await {
            fail(format!("writing to the guest failed: {e}"));
            return;
        }
        // Coalesce what is already queued before flushing.
        if rx.is_empty() && w.flush().await.is_err() {
            fail("flushing the channel failed".into());
            return;
        }
    }
}

async fn read_loop<R: AsyncRead + Unpin>(mut r: R, shared: Arc<Shared>) {
    let mut dec = Decoder::new();
    let mut buf = vec![0u8; 128 * 1024];
    let why = loop {
        let n = match r.read(&mut buf).await {
            Ok(0) => break "the guest closed the channel".to_string(),
            Ok(n) => n,
            Err(e) => break format!("reading from the guest failed: {e}"),
        };
        dec.push(&buf[..n]);
        let mut failure = None;
        while let Some(frame) = dec.next_frame() {
            let res = match frame {
                Ok(f) => route(&shared, f),
                Err(e) => Err(format!("the guest sent a malformed frame: {e}")),
            };
            if let Err(e) = res {
                failure = Some(e);
                break;
            }
        }
        if let Some(e) = failure {
            break e;
        }
    };
    close(&shared, why);
}

/// Delivers a frame from the guest to its stream. An error means the guest broke the protocol.
fn route(shared: &Shared, f: Frame) -> Result<(), String> {
    let kind = Kind::from_u8(f.kind)
        .ok_or_else(|| format!("the guest sent unknown frame kind 0x{:02x}", f.kind))?;
    let payload = Bytes::from(f.payload);
    let ev = match kind {
        Kind::Ready => Event::Ready(json(&payload)?),
        Kind::Stdout | Kind::Stderr | Kind::Output => Event::Data(kind, payload),
        Kind::Exit => Event::Exit(json(&payload)?),
        Kind::Done => Event::Done(json(&payload)?),
        Kind::Error => Event::Error(json(&payload)?),
        Kind::Window => {
            let n =
                parse_window(&payload).ok_or("the guest sent a window frame of the wrong size")?;
            if let Some(slot) = lock(&shared.streams).get(&f.stream) {
                let room = MAX_SEND_CREDIT.saturating_sub(slot.send_credit.available_permits());
                slot.send_credit.add_permits((n as usize).min(room));
            }
            return Ok(());
        }
        other => {
            return Err(format!(
                "the guest sent {other:?}, a frame only the host sends"
            ));
        }
    };
    if f.stream == 0 {
        match ev {
            Event::Ready(r) => {
                shared.ready.send_replace(Some(r));
            }
            Event::Error(m) => {
                let _ = shared.stray_errors.send((0, m));
            }
            other => return Err(format!("the guest sent {other:?} on the control stream")),
        }
        return Ok(());
    }
    let mut streams = lock(&shared.streams);
    let Some(slot) = streams.get_mut(&f.stream) else {
        // A stream the host already dropped (late output after a cancel), or the agent's answer
        // to a frame the host sent outside any stream.
        if let Event::Error(m) = ev {
            let _ = shared.stray_errors.send((f.stream, m));
        }
        return Ok(());
    };
    if let Event::Data(kind, b) = &ev {
        if b.is_empty() && *kind != Kind::Output {
            // Empty output means nothing and costs no window: queued, a flood of them would grow
            // without bound.
            return Ok(());
        }
        slot.unacked += b.len() as u64;
        if slot.unacked > INITIAL_WINDOW.into() {
            return Err(format!(
                "the guest sent more than the window on stream {}",
                f.stream
            ));
        }
    }
    // Every event but data ends its stream (so does the empty output that ends a download):
    // the slot goes, and what the agent sends on the stream after that is dropped above, so a
    // hostile agent cannot queue events for a reader that has stopped reading.
    let ends = match &ev {
        Event::Data(kind, b) => *kind == Kind::Output && b.is_empty(),
        _ => true,
    };
    let _ = slot.events.send(ev);
    if ends {
        // A writer waiting for window on the stream (stdin, an upload) gives up: no window
        // comes after the end, and a channel close would no longer find the slot to wake it.
        slot.send_credit.close();
        streams.remove(&f.stream);
    }
    Ok(())
}

fn json<T: serde::de::DeserializeOwned>(payload: &[u8]) -> Result<T, String> {
    serde_json::from_slice(payload)
        .map_err(|e| format!("the guest sent a bad control payload: {e}"))
}

fn close(shared: &Shared, why: String) {
    let first = shared.closed.send_if_modified(|c| {
        if c.is_none() {
            *c = Some(why.clone());
            true
        } else {
            false
        }
    });
    if first {
        tracing::debug!(reason = %why, "agent channel closed");
    }
    for (_, slot) in lock(&shared.streams).drain() {
        let _ = slot.events.send(Event::Closed(why.clone()));
        slot.send_credit.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{ExitStatus, Ready};
    use tokio::io::AsyncWriteExt;

    fn frame(kind: Kind, stream: u32, payload: &impl serde::Serialize) -> Vec<u8> {
        Frame::new(kind, stream, to_json(payload)).encode()
    }

    /// Returns once the host has routed everything the agent wrote before: frames are routed in
    /// order, so a READY written last arriving means the rest did.
    async fn routed(client: &Client, agent: &mut tokio::io::DuplexStream) {
        let ready = Ready {
            version: "t".into(),
            protocol: 1,
            channel: "t".into(),
            uptime_ms: 0,
        };
        agent
            .write_all(&frame(Kind::Ready, 0, &ready))
            .await
            .unwrap();
        client.wait_ready(Duration::from_secs(10)).await.unwrap();
    }

    /// Found while writing the protocol_client fuzz target: an agent that kept sending exits (or errors,
    /// or readies) on a stream the host was still holding had every one queued for a reader that
    /// takes only the first.
    #[tokio::test]
    async fn fuzz_protocol_client_events_after_the_end_of_a_stream_are_not_queued() {
        let (host, mut agent) = tokio::io::duplex(1 << 20);
        let (r, w) = tokio::io::split(host);
        let client = Client::new(r, w);
        let exec = client
            .exec(&ExecRequest {
                stdin: true,
                ..Default::default()
            })
            .await
            .unwrap();
        let exit = ExitStatus {
            exit_code: Some(0),
            signal: None,
            timed_out: false,
            duration_ms: 1,
        };
        let mut flood = Vec::new();
        for _ in 0..10_000 {
            flood.extend(frame(Kind::Exit, 1, &exit));
        }
        agent.write_all(&flood).await.unwrap();
        routed(&client, &mut agent).await;
        assert_eq!(
            exec.output.stream.events.len(),
            1,
            "only the first exit is kept"
        );
        // A writer waiting for window on the ended stream is woken, not left waiting.
        let mut stdin = exec.stdin.expect("stdin was asked for");
        let big = vec![0u8; INITIAL_WINDOW as usize + 1];
        let r = tokio::time::timeout(Duration::from_secs(10), stdin.write(&big)).await;
        assert!(matches!(r, Ok(Err(ClientError::Closed(_)))), "{r:?}");
        let mut out = exec.output;
        assert!(matches!(out.next().await, Some(Ok(ExecEvent::Exit(_)))));
        assert!(out.next().await.is_none());
    }

    /// Found in review of the fix above: empty stdout frames cost no window and were queued
    /// each, so a flood of them grew without bound while the reader was busy.
    #[tokio::test]
    async fn fuzz_protocol_client_empty_output_is_not_queued() {
        let (host, mut agent) = tokio::io::duplex(1 << 20);
        let (r, w) = tokio::io::split(host);
        let client = Client::new(r, w);
        let exec = client.exec(&ExecRequest::default()).await.unwrap();
        let mut flood = Vec::new();
        for _ in 0..10_000 {
            flood.extend(Frame::new(Kind::Stdout, 1, Vec::new()).encode());
        }
        flood.extend(Frame::new(Kind::Stdout, 1, b"x".to_vec()).encode());
        agent.write_all(&flood).await.unwrap();
        routed(&client, &mut agent).await;
        assert_eq!(
            exec.output.stream.events.len(),
            1,
            "only the byte is queued"
        );
    }
}
