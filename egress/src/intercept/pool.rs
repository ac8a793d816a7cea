//! The upstream connections of one guest connection: a pool of HTTP/1.1 senders, each made
//! with the same connect-time checks as any other connection of the sandbox, within two bounds
//! (this guest connection's and the sandbox's) and the sandbox's egress memory.

use hyper_util::rt::TokioIo;

use super::bodies::ProxyBody;
use crate::memory::{self, Hold};

/// An upstream HTTP/1.1 connection. Its places in the two bounds (this guest connection's and
/// the sandbox's) belong to its connection task and are given back when the connection itself
/// ends, not when this handle is dropped: a request the guest abandons mid-response leaves the
/// connection busy, and it still counts.
pub(super) struct Sender {
    pub(super) send: hyper::client::conn::http1::SendRequest<ProxyBody>,
}

/// Places in the two bounds.
pub(super) type Slots = (
    tokio::sync::OwnedSemaphorePermit,
    tokio::sync::OwnedSemaphorePermit,
    Hold,
);

impl Sender {
    pub(super) fn is_ready(&self) -> bool {
        self.send.is_ready()
    }

    pub(super) fn is_closed(&self) -> bool {
        self.send.is_closed()
    }
}

/// An HTTP/1.1 client connection over `io`, its connection task spawned.
pub(super) async fn handshake<I>(
    io: I,
    slots: Slots,
) -> Result<hyper::client::conn::http1::SendRequest<ProxyBody>, String>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::Builder::new()
        .max_buf_size(memory::HTTP1_BUFFER)
        .handshake(TokioIo::new(io))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = conn.await;
        drop(slots); // the connection is gone: its places are free
    });
    Ok(sender)
}
