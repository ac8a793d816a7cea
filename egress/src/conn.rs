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
/// becomes HTTP.
pub(crate) async fn run(
    mut io: Io,
    name: String,
    port: u16,
    cx: Arc<Context>,
    mut memory: crate::memory::Hold,
) {
    let target = format!("{name}:{port}");
    cx.connects.pace().await;
    let upstream = match cx.dial.dial(&name, port).await {
        Ok((s, _)) => s,
        Err(e) => {
            match &e {
                UpstreamError::Internal { .. } => cx.stats.refuse(Reason::InternalAddress, &target),
                _ => Stats::add(&cx.stats.upstream_failures, 1),
            }
            cx.log.log(|| tracing::warn!("egress: {e}"));
            io.control(Ctl::ABORT);
            return;
        }
    };
    io.control(Ctl::ACCEPT);
    tracing::trace!(%target, "egress: upstream connected");

    let mut decider = Decider::new(&name, port, cx.intercept.clone());
    let decision = loop {
        let chunk = match tokio::time::timeout(cx.sniff_timeout, io.recv()).await {
            Ok(Some(c)) => c,
            // Closed before saying anything: nothing to refuse.
            Ok(None) => return,
            Err(_) => break Decision::Refuse(Reason::Protocol),
        };
        tracing::trace!(len = chunk.len(), "egress: task got bytes");
        match decider.feed(&chunk) {
            Decision::NeedMore => continue,
            d => break d,
        }
    };
    match decision {
        Decision::Splice => Stats::add(&cx.stats.spliced, 1),
        Decision::Http => {
            // A placeholder in a plain-HTTP request head is a leak wherever it goes: no key is
            // ever written into cleartext.
            let leak = cx.interception.as_ref().is_some_and(|icp| {
                let head = decider.received();
                icp.secrets().iter().any(|s| {
                    head.windows(s.placeholder.len())
                        .any(|w| w == s.placeholder.as_bytes())
                })
            });
            if leak {
                cx.stats.refuse(Reason::PlaceholderLeak, &target);
                refuse_http(&io, Reason::PlaceholderLeak).await;
                return;
            }
            if !memory.grow(crate::memory::HTTP_COST) {
                cx.stats.refuse(Reason::MemoryLimit, &target);
                refuse_http(&io, Reason::MemoryLimit).await;
                return;
            }
            Stats::add(&cx.stats.http, 1)
        }
        Decision::Intercept => {
            let Some(icp) = cx.interception.clone() else {
                // Only names the interception covers are decided so; never pass them unread.
                cx.stats.refuse(Reason::Protocol, &target);
                io.control(Ctl::ABORT);
                return;
            };
            if !memory.grow(crate::memory::HTTP_COST) {
                // Before the guest's handshake: nothing readable can be said, a reset it is.
                cx.stats.refuse(Reason::MemoryLimit, &target);
                io.control(Ctl::ABORT);
                return;
            }
            io.control(Ctl::RUNNING);
            let (guest, end) = io.into_stream(decider.received().to_vec());
            if let Err(e) =
                crate::intercept::run(guest, upstream, name, port, cx.clone(), icp).await
            {
                cx.log.log(|| tracing::info!("egress: {target}: {e}"));
                end.abort();
            }
            return;
        }
        Decision::Refuse(reason) => {
            cx.stats.refuse(reason, &target);
            if decider
                .received()
                .first()
                .is_some_and(u8::is_ascii_uppercase)
            {
                // An HTTP client gets a readable answer instead of a bare reset.
                refuse_http(&io, reason).await;
            } else {
                io.control(Ctl::ABORT);
            }
            return;
        }
        Decision::NeedMore => return,
    }
    io.control(Ctl::RUNNING);
    let first = decider.received().to_vec();
    if decision == Decision::Http {
        // Every request of the connection is checked, not only the first.
        let (guest, end) = io.into_stream(first);
        if let Err(e) = crate::intercept::run_plain(guest, upstream, name, port, cx.clone()).await {
            tracing::debug!("egress: {target}: {e}");
            end.abort();
        }
        return;
    }
    let Io {
        from_guest,
        to_guest,
        ctl,
        wake,
    } = io;
    if let Err(e) = splice(from_guest, to_guest, &wake, upstream, first, &cx).await {
        tracing::debug!("egress: {target}: {e}");
        ctl.set(Ctl::ABORT);
        wake.notify_one();
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
