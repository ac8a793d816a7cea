//! Bodies that may not stall: a request body from the guest, or a response body from an upstream,
//! that sends nothing for its time is ended with an error, so a guest cannot hold a connection
//! and the upstream connection behind it by sending a byte now and then, or never (issue 29,
//! item 8: no slowloris).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};
use thiserror::Error;
use tokio::time::{Instant, Sleep};

/// The body sent nothing for too long.
#[derive(Debug, Error)]
#[error("{what} sent nothing for {} s", after.as_secs_f64())]
pub struct Stalled {
    what: &'static str,
    after: Duration,
}

/// `inner`, ended with [`Stalled`] once it has kept its reader waiting `after` for a frame. Only
/// the reader's waiting counts: while the reader does not ask (the other side's backpressure),
/// the body is not idle.
pub struct Idle<B> {
    inner: B,
    sleep: Pin<Box<Sleep>>,
    after: Duration,
    what: &'static str,
    /// Whether the reader is waiting for a frame (the clock runs).
    waiting: bool,
}

impl<B> Idle<B> {
    /// `what` names the body in the error ("the guest's request body").
    pub fn new(inner: B, after: Duration, what: &'static str) -> Self {
        Idle {
            inner,
            sleep: Box::pin(tokio::time::sleep(after)),
            after,
            what,
            waiting: false,
        }
    }
}

impl<B> Body for Idle<B>
where
    B: Body + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = B::Data;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        if !std::mem::replace(&mut this.waiting, true) {
            let deadline = Instant::now() + this.after;
            this.sleep.as_mut().reset(deadline);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(f) => {
                this.waiting = false;
                Poll::Ready(f.map(|r| r.map_err(Into::into)))
            }
            Poll::Pending => match this.sleep.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(Stalled {
                    what: this.what,
                    after: this.after,
                })))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// One frame, then nothing, ever.
    struct OneThenSilence(bool);

    impl Body for OneThenSilence {
        type Data = bytes::Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<bytes::Bytes>, std::io::Error>>> {
            if std::mem::replace(&mut self.0, true) {
                Poll::Pending
            } else {
                Poll::Ready(Some(Ok(Frame::data(bytes::Bytes::from_static(b"a")))))
            }
        }
    }

    /// A body that sends one frame, then nothing: ended after its time, not held for ever.
    #[tokio::test]
    async fn a_stalled_body_ends_with_an_error() {
        let after = Duration::from_millis(300);
        let mut b = Idle::new(OneThenSilence(false), after, "the guest's request body");
        let first = b.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), "a");
        let started = Instant::now();
        let e = b.frame().await.unwrap().unwrap_err();
        assert_eq!(
            e.to_string(),
            "the guest's request body sent nothing for 0.3 s"
        );
        assert!(started.elapsed() >= after);
    }
}
