//! One guest connection, after the stack accepted its SYN: connect upstream (so a refused or
//! unreachable name is answered with a reset before the guest's handshake completes), read the
//! first bytes until [`Decider`] can decide, then copy both ways or refuse.
//!
//! The task talks to the stack loop through two bounded channels of byte chunks and one control
//! word; every send and receive wakes the loop, which moves bytes between the channels and the
//! guest's TCP socket.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Notify, mpsc};

use crate::decide::{Decider, Decision};
use crate::refusal::Reason;
use crate::stats::Stats;
use crate::upstream::UpstreamError;

use crate::memory::CHUNK;

/// What the task tells the stack loop about the guest's socket.
#[derive(Debug)]
pub(crate) struct Ctl(AtomicU8);

impl Default for Ctl {
    fn default() -> Self {
        Ctl(AtomicU8::new(Ctl::CONNECTING))
    }
}

impl Ctl {
    /// Upstream is not connected yet: the guest's SYN waits unanswered.
    pub(crate) const CONNECTING: u8 = 0;
    /// Upstream is connected: answer the SYN; the first bytes are being read.
    pub(crate) const ACCEPT: u8 = 1;
    /// Decided and copying.
    pub(crate) const RUNNING: u8 = 2;
    /// Reset the guest's connection.
    pub(crate) const ABORT: u8 = 3;

    pub(crate) fn get(&self) -> u8 {
        self.0.load(Ordering::Acquire)
    }

    fn set(&self, v: u8) {
        self.0.store(v, Ordering::Release);
    }
}

use crate::context::Context;

/// The task's ends of a connection.
pub(crate) struct Io {
    /// Bytes from the guest; `None` when the guest closed its side.
    pub(crate) from_guest: mpsc::Receiver<Vec<u8>>,
    /// Bytes for the guest; dropping it closes the guest's side (FIN).
    pub(crate) to_guest: mpsc::Sender<Vec<u8>>,
    pub(crate) ctl: Arc<Ctl>,
    /// Wakes the stack loop.
    pub(crate) wake: Arc<Notify>,
}

impl Io {
    fn control(&self, v: u8) {
        self.ctl.set(v);
        self.wake.notify_one();
    }

    async fn recv(&mut self) -> Option<Vec<u8>> {
        let chunk = self.from_guest.recv().await;
        self.wake.notify_one(); // room for more
        chunk
    }

    /// The connection as a byte stream (with `prefix`, the bytes already read, first) for a
    /// proxy, and the handle that resets it if the proxy fails.
    fn into_stream(self, prefix: Vec<u8>) -> (crate::guest_io::GuestStream, End) {
        let stream = crate::guest_io::GuestStream::new(
            prefix,
            self.from_guest,
            self.to_guest,
            self.wake.clone(),
        );
        (
            stream,
            End {
                ctl: self.ctl,
                wake: self.wake,
            },
        )
    }

    async fn send(&self, bytes: Vec<u8>) -> bool {
        let ok = self.to_guest.send(bytes).await.is_ok();
        self.wake.notify_one();
        ok
    }
}

/// Resets the guest's connection once its stream was handed to a proxy.
pub(crate) struct End {
    ctl: Arc<Ctl>,
    wake: Arc<Notify>,
}

impl End {
    fn abort(&self) {
        self.ctl.set(Ctl::ABORT);
        self.wake.notify_one();
    }
}

/// Runs one connection to `port` of the address handed out for `name`, to its end. `memory` is
/// its task's share of the sandbox's egress memory ([`crate::memory::TASK_COST`]), grown when it
/// becomes HTTP, and held until the connection ends.
pub(crate) async fn run(
    mut io: Io,
    name: String,
    port: u16,
    cx: Arc<Context>,
    mut memory: crate::memory::Hold,
) {
    let target = format!("{name}:{port}");
    let Some(upstream) = dial(&io, &name, port, &cx, &target).await else {
        return;
    };
    let mut decider = Decider::new(&name, port, cx.intercept.clone());
    let Some(decision) = decide(&mut io, &mut decider, &cx).await else {
        return;
    };
    let conn = Conn {
        io,
        upstream,
        first: decider.received().to_vec(),
        name,
        port,
        target,
        cx,
    };
    match decision {
        Decision::Splice => {
            Stats::add(&conn.cx.stats.spliced, 1);
            conn.splice().await;
        }
        Decision::Http => conn.http(&mut memory).await,
        Decision::Intercept => conn.intercept(&mut memory).await,
        Decision::Refuse(reason) => conn.refuse(reason).await,
        Decision::NeedMore => {}
    }
}

/// Connects to the upstream before the guest's handshake completes (the guest's SYN is
/// answered only once the upstream's is): a refused dial resets the guest's connection.
async fn dial(io: &Io, name: &str, port: u16, cx: &Context, target: &str) -> Option<TcpStream> {
    cx.connects.pace().await;
    match cx.dial.dial(name, port).await {
        Ok((s, _)) => {
            io.control(Ctl::ACCEPT);
            tracing::trace!(%target, "egress: upstream connected");
            Some(s)
        }
        Err(e) => {
            match &e {
                UpstreamError::Internal { .. } => cx.stats.refuse(Reason::InternalAddress, target),
                _ => Stats::add(&cx.stats.upstream_failures, 1),
            }
            cx.log.log(|| tracing::warn!("egress: {e}"));
            io.control(Ctl::ABORT);
            None
        }
    }
}

/// Reads the guest's first bytes until they say what the connection is (bounded in time);
/// `None` when it closed before saying anything.
async fn decide(io: &mut Io, decider: &mut Decider, cx: &Context) -> Option<Decision> {
    loop {
        let chunk = match tokio::time::timeout(cx.sniff_timeout, io.recv()).await {
            Ok(Some(c)) => c,
            // Closed before saying anything: nothing to refuse.
            Ok(None) => return None,
            Err(_) => return Some(Decision::Refuse(Reason::Protocol)),
        };
        tracing::trace!(len = chunk.len(), "egress: task got bytes");
        match decider.feed(&chunk) {
            Decision::NeedMore => continue,
            d => return Some(d),
        }
    }
}

/// A connection whose upstream is dialled and whose kind is decided.
struct Conn {
    io: Io,
    upstream: TcpStream,
    /// What the guest sent before the decision.
    first: Vec<u8>,
    name: String,
    port: u16,
    /// `name:port`, for the counters and the log.
    target: String,
    cx: Arc<Context>,
}

impl Conn {
    /// Plain HTTP: every request of the connection is checked, not only the first.
    async fn http(self, memory: &mut crate::memory::Hold) {
        let cx = self.cx.clone();
        // A placeholder in a plain-HTTP request head is a leak wherever it goes: no key is
        // ever written into cleartext.
        let leak = cx.interception.as_ref().is_some_and(|icp| {
            icp.secrets().iter().any(|s| {
                self.first
                    .windows(s.placeholder.len())
                    .any(|w| w == s.placeholder.as_bytes())
            })
        });
        if leak {
            cx.stats.refuse(Reason::PlaceholderLeak, &self.target);
            refuse_http(&self.io, Reason::PlaceholderLeak).await;
            return;
        }
        if !memory.grow(crate::memory::HTTP_COST) {
            cx.stats.refuse(Reason::MemoryLimit, &self.target);
            refuse_http(&self.io, Reason::MemoryLimit).await;
            return;
        }
        Stats::add(&cx.stats.http, 1);
        self.io.control(Ctl::RUNNING);
        let (guest, end) = self.io.into_stream(self.first);
        if let Err(e) =
            crate::intercept::run_plain(guest, self.upstream, self.name, self.port, cx).await
        {
            tracing::debug!("egress: {}: {e}", self.target);
            end.abort();
        }
    }

    /// TLS to a host the interception covers: terminated here, read, and sent on.
    async fn intercept(self, memory: &mut crate::memory::Hold) {
        let cx = self.cx.clone();
        let Some(icp) = cx.interception.clone() else {
            // Only names the interception covers are decided so; never pass them unread.
            cx.stats.refuse(Reason::Protocol, &self.target);
            self.io.control(Ctl::ABORT);
            return;
        };
        if !memory.grow(crate::memory::HTTP_COST) {
            // Before the guest's handshake: nothing readable can be said, a reset it is.
            cx.stats.refuse(Reason::MemoryLimit, &self.target);
            self.io.control(Ctl::ABORT);
            return;
        }
        self.io.control(Ctl::RUNNING);
        let (guest, end) = self.io.into_stream(self.first);
        if let Err(e) =
            crate::intercept::run(guest, self.upstream, self.name, self.port, cx.clone(), icp).await
        {
            cx.log
                .log(|| tracing::info!("egress: {}: {e}", self.target));
            end.abort();
        }
    }

    /// Refused: an HTTP client gets a readable answer instead of a bare reset.
    async fn refuse(self, reason: Reason) {
        self.cx.stats.refuse(reason, &self.target);
        if self.first.first().is_some_and(u8::is_ascii_uppercase) {
            refuse_http(&self.io, reason).await;
        } else {
            self.io.control(Ctl::ABORT);
        }
    }

    /// Anything else the policy allows: bytes copied both ways, unread.
    async fn splice(self) {
        self.io.control(Ctl::RUNNING);
        let Io {
            from_guest,
            to_guest,
            ctl,
            wake,
        } = self.io;
        if let Err(e) = splice(
            from_guest,
            to_guest,
            &wake,
            self.upstream,
            self.first,
            &self.cx,
        )
        .await
        {
            tracing::debug!("egress: {}: {e}", self.target);
            ctl.set(Ctl::ABORT);
            wake.notify_one();
        }
    }
}

/// Copies bytes both ways until both sides closed; an error on either side resets the guest.
async fn splice(
    mut from_guest: mpsc::Receiver<Vec<u8>>,
    to_guest: mpsc::Sender<Vec<u8>>,
    wake: &Notify,
    upstream: TcpStream,
    first: Vec<u8>,
    cx: &Context,
) -> std::io::Result<()> {
    let (mut up_r, mut up_w) = upstream.into_split();
    let idle = cx.idle_timeout;
    let stats = &cx.stats;
    let up = async {
        Stats::add(&stats.to_upstream, first.len() as u64);
        up_w.write_all(&first).await?;
        loop {
            let chunk = tokio::time::timeout(idle, from_guest.recv())
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?;
            wake.notify_one(); // room for more
            let Some(chunk) = chunk else { break };
            Stats::add(&stats.to_upstream, chunk.len() as u64);
            up_w.write_all(&chunk).await?;
        }
        up_w.shutdown().await
    };
    let down = async {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = tokio::time::timeout(idle, up_r.read(&mut buf))
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
            if n == 0 {
                break;
            }
            Stats::add(&stats.to_guest, n as u64);
            let sent = to_guest.send(buf[..n].to_vec()).await.is_ok();
            wake.notify_one();
            if !sent {
                return Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
            }
        }
        drop(to_guest); // FIN toward the guest once the loop has written what is queued
        wake.notify_one();
        Ok(())
    };
    let (a, b) = tokio::join!(up, down);
    a.and(b)
}

/// Answers a refused plain-HTTP request with a `403` that names the reason, then closes.
async fn refuse_http(io: &Io, reason: Reason) {
    let body = format!("sandbox egress refused this request: {}\n", reason.as_str());
    let answer = format!(
        "HTTP/1.1 {}\r\ncontent-type: text/plain\r\nx-sandbox-egress-refused: {}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        reason.status_line(),
        reason.as_str(),
        body.len()
    );
    io.control(Ctl::RUNNING);
    io.send(answer.into_bytes()).await;
}
