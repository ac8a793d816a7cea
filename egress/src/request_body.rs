//! Request bodies the meter reads before they go upstream (a streaming chat completion must ask
//! for its usage, and that is known only from the whole body): held up to a size, against a
//! per-sandbox budget, and replayed (trailers included), so a body that is not changed leaves with
//! exactly the bytes it came with.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// The bytes one sandbox's request bodies may hold at once while the meter reads them.
#[derive(Debug)]
pub struct Budget {
    used: AtomicUsize,
    max: usize,
}

impl Budget {
    /// A budget of `max` bytes.
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Budget {
            used: AtomicUsize::new(0),
            max,
        })
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

/// A share of a [`Budget`], given back when dropped.
#[derive(Debug)]
pub struct Hold {
    budget: Arc<Budget>,
    n: usize,
}

impl Hold {
    /// The budget this is a share of.
    pub fn budget(&self) -> Arc<Budget> {
        self.budget.clone()
    }

    /// An empty share of `budget`.
    pub fn new(budget: &Arc<Budget>) -> Self {
        Hold {
            budget: budget.clone(),
            n: 0,
        }
    }

    /// Takes `by` bytes more; false (and nothing taken) when the budget has not that much left.
    pub fn grow(&mut self, by: usize) -> bool {
        let b = &self.budget;
        let ok = b
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(by).filter(|&n| n <= b.max)
            })
            .is_ok();
        if ok {
            self.n += by;
        }
        ok
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.n, Ordering::AcqRel);
    }
}

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
                        data.extend_from_slice(&d);
                        return Ok((
                            Read::TooLarge(Replay::new(data, trailers, Some(body))),
                            hold,
                        ));
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
    trailers: Option<HeaderMap>,
    rest: Option<GuestBody>,
}

impl Replay {
    /// `data`, then `trailers`, then what `rest` still has.
    pub fn new(data: Vec<u8>, trailers: Option<HeaderMap>, rest: Option<GuestBody>) -> Self {
        Replay {
            data: Bytes::from(data),
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
            && self.trailers.is_none()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let held = self.data.len() as u64;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_is_shared_and_given_back() {
        let b = Budget::new(100);
        let mut one = Hold::new(&b);
        let mut two = Hold::new(&b);
        assert!(one.grow(60));
        assert!(!two.grow(41), "past the budget");
        assert!(two.grow(40));
        assert!(!one.grow(1));
        assert!(!one.grow(usize::MAX), "no overflow");
        drop(one);
        assert_eq!(b.used(), 40);
        assert!(two.grow(60));
        drop(two);
        assert_eq!(b.used(), 0);
    }
}
