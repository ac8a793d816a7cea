//! The bodies on their way through the proxy: the request's, scanned for placeholders that do
//! not belong to its host; the response's, with secret values masked and its usage read by the
//! meter as it passes; and the model call they make, recorded exactly once.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::SystemTime;

use bytes::Bytes;
use http_body::{Body, Frame};
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use thiserror::Error;

use crate::echo::{EchoForms, EchoScanner};
use crate::idle::Idle;
use crate::memory::Hold;
use crate::meter::record::Meter;
use crate::meter::request::Unmetered;
use crate::refusal::Reason;
use crate::request_body::Replay;
use crate::secrets::LeakScanner;
use crate::stats::{Call, Stats};

/// What the proxy's bodies are, both ways: boxed, their errors too.
pub(super) type ProxyBody =
    http_body_util::combinators::BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// Whether any `Content-Encoding` is other than identity, or any `Transfer-Encoding` other than
/// chunked (every header, every item of a list): a body the scan and the meter cannot read.
pub(super) fn content_encoded(headers: &HeaderMap) -> bool {
    let coded = |name, plain: &[&[u8]]| {
        headers.get_all(name).iter().any(|v| {
            v.as_bytes().split(|&b| b == b',').any(|t| {
                let t = t.trim_ascii();
                !t.is_empty() && !plain.iter().any(|p| t.eq_ignore_ascii_case(p))
            })
        })
    };
    coded(header::CONTENT_ENCODING, &[b"identity"])
        || coded(header::TRANSFER_ENCODING, &[b"identity", b"chunked"])
}

/// Why a call with this status and usage is unmetered, given why its usage would be missing:
/// `None` when it reported usage, and for statuses providers do not bill. The host's own lower
/// bound of a stream cut before its usage is not the provider's word: still unmetered.
fn unmetered(
    status: u16,
    usage: Option<&crate::meter::UsageRecord>,
    why: Unmetered,
) -> Option<Unmetered> {
    (usage.is_none_or(|u| u.estimated) && (200..300).contains(&status)).then_some(why)
}

/// A request body on its way upstream, scanned for placeholders that do not belong to its host:
/// one found ends the body with an error, so the upstream request is aborted before the
/// placeholder's last byte leaves.
pub(super) struct ScannedBody {
    pub(super) inner: Replay,
    pub(super) scanner: LeakScanner,
    /// Every placeholder: none may be in a trailer, whatever the host.
    pub(super) placeholders: Vec<String>,
    pub(super) stats: Arc<Stats>,
    pub(super) target: String,
}

#[derive(Debug, Error)]
#[error("a secret's placeholder in the request body to {0}")]
struct Leak(String);

impl Body for ScannedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if this.scanner.feed(data).is_some() {
                        this.stats.refuse(Reason::PlaceholderLeak, &this.target);
                        return Poll::Ready(Some(Err(Box::new(Leak(this.target.clone())))));
                    }
                    Stats::add(&this.stats.to_upstream, data.len() as u64);
                }
                if let Some(trailers) = frame.trailers_ref() {
                    let leaked = trailers.iter().any(|(k, v)| {
                        this.placeholders.iter().any(|p| {
                            let p = p.as_bytes();
                            [k.as_str().as_bytes(), v.as_bytes()]
                                .iter()
                                .any(|b| b.windows(p.len()).any(|w| w == p))
                        })
                    });
                    if leaked {
                        this.stats.refuse(Reason::PlaceholderLeak, &this.target);
                        return Poll::Ready(Some(Err(Box::new(Leak(this.target.clone())))));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        Body::is_end_stream(&self.inner)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A response body on its way to the guest, unchanged and counted; on metered hosts read by the
/// meter as it passes, the call recorded when the body ends, or when it is dropped before (a cut
/// stream reports what it saw).
pub(super) struct MeteredBody {
    /// The upstream's body, cut if the upstream sends nothing for the idle timeout.
    pub(super) inner: Idle<Incoming>,
    /// The model call this answers, read by its meter as it passes.
    pub(super) call: Option<Pending>,
    /// Masks secret values on their way to the guest (intercepted hosts with secrets).
    pub(super) echo: Option<EchoScanner>,
    /// A chunk's own bytes, which wait while the bytes the echo scan held back before it go.
    pub(super) next: Option<Bytes>,
    /// Trailers that wait until the bytes the echo scan held back have gone.
    pub(super) trailers: Option<HeaderMap>,
    pub(super) target: String,
    pub(super) stats: Arc<Stats>,
    /// The request's share of the sandbox's egress memory ([`memory::REQUEST_COST`]).
    pub(super) _memory: Hold,
}

impl MeteredBody {
    fn finish(&mut self, complete: bool) {
        if let Some(c) = self.call.as_mut() {
            c.finish(complete);
        }
    }
}

/// A model call from the moment its request goes upstream: recorded exactly once, when its
/// response ends, or when it is dropped before (the guest went away, or the connection failed,
/// before the provider answered or while it did).
pub(super) struct Pending {
    pub(super) stats: Arc<Stats>,
    pub(super) host: String,
    /// The response's status; 0 while there is none.
    pub(super) status: u16,
    /// Why its usage would be missing, once known.
    pub(super) missing: Option<Unmetered>,
    pub(super) meter: Option<Meter>,
    /// Recorded only if it reports usage (a request to no known API on a secret's host).
    pub(super) quiet: bool,
    pub(super) done: bool,
}

impl Pending {
    pub(super) fn finish(&mut self, complete: bool) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let usage = self.meter.take().and_then(Meter::finish);
        if self.quiet && usage.is_none() {
            return;
        }
        let unmetered = if self.status == 0 {
            Some(self.missing.unwrap_or(Unmetered::Abandoned))
        } else {
            let missing = match self.missing.unwrap_or(Unmetered::NoUsage) {
                Unmetered::NoUsage if !complete => Unmetered::CutBeforeUsage,
                m => m,
            };
            unmetered(self.status, usage.as_ref(), missing)
        };
        self.stats.record_call(Call {
            at: SystemTime::now(),
            host: self.host.clone(),
            status: self.status,
            complete,
            unmetered,
            usage,
        });
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.finish(false);
    }
}

impl MeteredBody {
    /// The meter reads what the guest gets, masked: a key a provider echoed into `model` or
    /// `id` never reaches the usage a run reports (issue 29, item 4).
    fn meter(&mut self, data: &[u8]) {
        if let Some(m) = self.call.as_mut().and_then(|c| c.meter.as_mut()) {
            m.feed(data);
        }
    }

    fn echoed(&self, n: usize) {
        for _ in 0..n {
            self.stats.refuse(Reason::SecretEcho, &self.target);
        }
    }
}

impl Body for MeteredBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Some(d) = this.next.take() {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        if let Some(t) = this.trailers.take() {
            return Poll::Ready(Some(Ok(Frame::trailers(t))));
        }
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let frame = match frame.into_data() {
                        Ok(data) => {
                            Stats::add(&this.stats.to_guest, data.len() as u64);
                            let Some(echo) = this.echo.as_mut() else {
                                this.meter(&data);
                                return Poll::Ready(Some(Ok(Frame::data(data))));
                            };
                            let (out, n) = echo.feed_bytes(data);
                            this.echoed(n);
                            this.meter(&out.held);
                            this.meter(&out.chunk);
                            let first = match (out.held.is_empty(), out.chunk.is_empty()) {
                                (true, true) => continue, // all held back: wait for more
                                (true, false) => out.chunk,
                                (false, true) => out.held,
                                (false, false) => {
                                    this.next = Some(out.chunk);
                                    out.held
                                }
                            };
                            return Poll::Ready(Some(Ok(Frame::data(first))));
                        }
                        Err(frame) => frame,
                    };
                    let Ok(mut trailers) = frame.into_trailers() else {
                        continue; // a frame kind hyper may add later: not ours to pass
                    };
                    if let Some(forms) = this.echo.as_ref().map(|e| e.forms().clone()) {
                        let n = mask_headers(&forms, &mut trailers);
                        this.echoed(n);
                    }
                    let (held, n) = this
                        .echo
                        .as_mut()
                        .map(EchoScanner::finish)
                        .unwrap_or_default();
                    this.echoed(n);
                    this.meter(&held);
                    if held.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                    }
                    this.trailers = Some(trailers);
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(held)))));
                }
                Poll::Ready(Some(Err(e))) => {
                    this.finish(false);
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    let (held, n) = this
                        .echo
                        .as_mut()
                        .map(EchoScanner::finish)
                        .unwrap_or_default();
                    this.echoed(n);
                    this.meter(&held);
                    if !held.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from(held)))));
                    }
                    this.finish(true);
                    return Poll::Ready(None);
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.next.is_none()
            && self.trailers.is_none()
            && !self.echo.as_ref().is_some_and(EchoScanner::holding)
            && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        // Masking keeps every length: the upstream's hint stays exact.
        self.inner.size_hint()
    }
}

/// Masks secret values in header values (and drops a header whose name holds one, in any letter
/// case); returns how many there were.
pub(super) fn mask_headers(forms: &EchoForms, headers: &mut HeaderMap) -> usize {
    let mut found = 0;
    let names: Vec<HeaderName> = headers.keys().cloned().collect();
    for name in names {
        if forms.in_name(name.as_str().as_bytes()) {
            found += headers.get_all(&name).iter().count();
            headers.remove(&name);
            continue;
        }
        let values: Vec<HeaderValue> = headers.get_all(&name).iter().cloned().collect();
        let mut changed = false;
        let masked: Vec<HeaderValue> = values
            .into_iter()
            .map(|v| {
                let mut b = v.as_bytes().to_vec();
                let hits = forms.mask(&mut b);
                if hits == 0 {
                    return v;
                }
                found += hits;
                changed = true;
                // The mask is a visible ASCII byte: a valid header value still.
                HeaderValue::from_bytes(&b).unwrap_or(HeaderValue::from_static("*"))
            })
            .collect();
        if changed {
            headers.remove(&name);
            for v in masked {
                headers.append(name.clone(), v);
            }
        }
    }
    found
}
