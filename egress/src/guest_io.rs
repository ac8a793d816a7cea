//! A guest connection as a byte stream (`AsyncRead + AsyncWrite`) over the stack loop's chunk
//! channels, so TLS and HTTP libraries can run on it. Bytes already read to decide the
//! connection (the ClientHello) are replayed first.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{Notify, mpsc};

use crate::memory::CHUNK;

type Reserve = Pin<
    Box<dyn Future<Output = Result<mpsc::OwnedPermit<Vec<u8>>, mpsc::error::SendError<()>>> + Send>,
>;

/// The stream.
pub(crate) struct GuestStream {
    prefix: Vec<u8>,
    prefix_at: usize,
    chunk: Vec<u8>,
    chunk_at: usize,
    from_guest: mpsc::Receiver<Vec<u8>>,
    to_guest: Option<mpsc::Sender<Vec<u8>>>,
    reserving: Option<Reserve>,
    wake: Arc<Notify>,
}

impl GuestStream {
    pub(crate) fn new(
        prefix: Vec<u8>,
        from_guest: mpsc::Receiver<Vec<u8>>,
        to_guest: mpsc::Sender<Vec<u8>>,
        wake: Arc<Notify>,
    ) -> Self {
        GuestStream {
            prefix,
            prefix_at: 0,
            chunk: Vec::new(),
            chunk_at: 0,
            from_guest,
            to_guest: Some(to_guest),
            reserving: None,
            wake,
        }
    }
}

impl AsyncRead for GuestStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.prefix_at < this.prefix.len() {
            let n = buf.remaining().min(this.prefix.len() - this.prefix_at);
            buf.put_slice(&this.prefix[this.prefix_at..this.prefix_at + n]);
            this.prefix_at += n;
            return Poll::Ready(Ok(()));
        }
        if this.chunk_at >= this.chunk.len() {
            match ready!(this.from_guest.poll_recv(cx)) {
                Some(c) => {
                    this.chunk = c;
                    this.chunk_at = 0;
                    this.wake.notify_one(); // room for more
                }
                None => return Poll::Ready(Ok(())), // the guest closed its side
            }
        }
        let n = buf.remaining().min(this.chunk.len() - this.chunk_at);
        buf.put_slice(&this.chunk[this.chunk_at..this.chunk_at + n]);
        this.chunk_at += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for GuestStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let Some(tx) = &this.to_guest else {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        };
        let fut = this
            .reserving
            .get_or_insert_with(|| Box::pin(tx.clone().reserve_owned()));
        let permit = ready!(fut.as_mut().poll(cx));
        this.reserving = None;
        match permit {
            Ok(permit) => {
                let n = data.len().min(CHUNK);
                permit.send(data[..n].to_vec());
                this.wake.notify_one();
                Poll::Ready(Ok(n))
            }
            Err(_) => Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.reserving = None;
        self.to_guest = None; // FIN once the loop has written what is queued
        self.wake.notify_one();
        Poll::Ready(Ok(()))
    }
}
