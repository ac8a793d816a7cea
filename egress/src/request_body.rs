//! Request bodies the meter reads before they go upstream (a streaming chat completion must ask
//! for its usage, and that is known only from the whole body): held up to a size, against a
//! sandbox's egress memory ([`crate::memory`]), and replayed (trailers included), so a body that is not changed leaves with
//! exactly the bytes it came with.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::HeaderMap;
use hyper::body::Incoming;

use crate::idle::Idle;

/// A request body as it comes from the guest: ended if it stalls (see [`Idle`]).
pub type GuestBody = Idle<Incoming>;
/// What reading one fails with (hyper's error, or [`crate::idle::Stalled`]).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

pub use crate::memory::{Budget, Hold};

/// What reading a body gave.
pub enum Read {
    /// The whole body: its data, and its trailers if it had any.
    Whole(Vec<u8>, Option<HeaderMap>),
    /// More than `max` bytes (or than the budget had left): what was read, and the rest unread.
    TooLarge(Replay),
}

/// Frames a held body is sent on in: small enough that scanning one for placeholders keeps the
/// runtime's thread briefly.
const SLICE: usize = 64 << 10;

/// Reads `body` whole if it is at most `max` bytes and `hold` can grow to hold it. Only the bytes
/// are kept (the frames they came in, however many, are not), and the buffer's whole capacity is
/// charged to `hold`, which comes back with the result.
pub async fn read(
    mut body: GuestBody,
    max: usize,
    mut hold: Hold,
) -> Result<(Read, Hold), BodyError> {
    let mut data: Vec<u8> = Vec::new();
    let mut trailers: Option<HeaderMap> = None;
    while let Some(frame) = body.frame().await {
        let frame = match frame?.into_data() {
            Ok(d) => {
                let need = data.len() + d.len();
                if need > data.capacity() {
                    let cap = need.max(data.capacity() * 2).min(max);
                    if need > max || !hold.grow(cap - data.capacity()) {
                        // The frame goes on as it came: copied onto what is held, it could
                        // double the buffer past what the budget counts.
                        let mut replay = Replay::new(data, trailers, Some(body));
                        replay.then = d;
                        return Ok((Read::TooLarge(replay), hold));
                    }
                    data.reserve_exact(cap - data.len());
                }
                data.extend_from_slice(&d);
                continue;
            }
            Err(f) => f,
        };
        if let Ok(t) = frame.into_trailers() {
            trailers.get_or_insert_with(HeaderMap::new).extend(t);
        }
    }
    Ok((Read::Whole(data, trailers), hold))
}

/// A request body sent on from memory (in frames of at most 64 KiB, then its trailers), then from
/// the guest where it was not all read.
pub struct Replay {
    data: Bytes,
    /// The frame that did not fit, sent after `data`.
    then: Bytes,
    trailers: Option<HeaderMap>,
    rest: Option<GuestBody>,
}

impl Replay {
    /// `data`, then `trailers`, then what `rest` still has.
    pub fn new(data: Vec<u8>, trailers: Option<HeaderMap>, rest: Option<GuestBody>) -> Self {
        Replay {
            data: Bytes::from(data),
            then: Bytes::new(),
            trailers,
            rest,
        }
    }

    /// A body that is all of `body`, unread.
    pub fn unread(body: GuestBody) -> Self {
        Replay::new(Vec::new(), None, Some(body))
    }
}

impl Body for Replay {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if !self.data.is_empty() {
            let n = self.data.len().min(SLICE);
            return Poll::Ready(Some(Ok(Frame::data(self.data.split_to(n)))));
        }
        if !self.then.is_empty() {
            let then = std::mem::take(&mut self.then);
            return Poll::Ready(Some(Ok(Frame::data(then))));
        }
        if let Some(t) = self.trailers.take() {
            return Poll::Ready(Some(Ok(Frame::trailers(t))));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_empty()
            && self.then.is_empty()
            && self.trailers.is_none()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let held = (self.data.len() + self.then.len()) as u64;
        match &self.rest {
            None => SizeHint::with_exact(held),
            Some(rest) => {
                let r = rest.size_hint();
                let mut h = SizeHint::new();
                h.set_lower(held + r.lower());
                if let Some(u) = r.upper() {
                    h.set_upper(held + u);
                }
                h
            }
        }
    }
}
