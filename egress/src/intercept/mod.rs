//! TLS interception of the secret and meter hosts: the guest's TLS ends here, with a certificate
//! for the connection's name signed by the sandbox's own CA (which the guest trusts, and which can
//! sign for these names only); each request is checked, gets the real key in place of its
//! placeholder in the secret's credential headers when it goes to the secret's hosts (a placeholder
//! anywhere else is refused), and goes on over verified TLS (system roots, plus
//! `SANDBOX_HOST_EGRESS_CA_FILE`) to the same name. Responses stream back while the meter reads
//! their usage and the echo scan masks any secret value in them (`echo`).
//!
//! HTTP/2 and HTTP/1.1 toward the guest (by its ALPN); HTTP/1.1 upstream, on up to
//! [`UPSTREAM_CONNECTIONS`] connections per guest connection, each made with the same
//! connect-time checks as any other.
//!
//! Here: the connection's TLS and HTTP serving. A request's steps are in `handle`, the
//! placeholders' rules in `credentials`, the upstream connections in `pool`, the scanned and
//! metered bodies in `bodies`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::header::{self, HeaderName, HeaderValue};
use hyper::{Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::sync::Mutex;

use crate::context::Context;
use crate::guest_io::GuestStream;
use crate::memory;
use crate::refusal::Reason;
use crate::stats::Stats;
use pool::Sender;

pub use rustls::ClientConfig;

mod bodies;
mod connect;
mod credentials;
mod handle;
pub(crate) mod interception;
mod pool;

/// Upstream connections one guest connection may use at once (HTTP/2 streams from the guest
/// share them; more requests wait for one to be free).
pub const UPSTREAM_CONNECTIONS: usize = 8;
/// Upstream connections of one sandbox's proxied and intercepted requests at once.
pub const SANDBOX_UPSTREAM_CONNECTIONS: usize = 64;
/// Concurrent HTTP/2 streams a guest may open on one intercepted connection.
pub const MAX_GUEST_STREAMS: u32 = 32;
/// How long the guest's and the upstream's TLS handshakes may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often an HTTP/2 guest is pinged, and how long it has to answer.
const H2_PING_INTERVAL: Duration = Duration::from_secs(30);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

pub use interception::{
    DEFAULT_BODY_MAX, InterceptError, Interception, MeterPolicy, upstream_client,
};

/// One intercepted connection of the guest to `name:port`, whose first bytes (the ClientHello)
/// are in `guest` still.
pub(crate) async fn run(
    guest: GuestStream,
    first: tokio::net::TcpStream,
    name: String,
    port: u16,
    cx: Arc<Context>,
    icp: Arc<Interception>,
) -> Result<(), InterceptError> {
    let leaf = icp
        .ca
        .leaf(&name)
        .map_err(|e| InterceptError::Certificate(name.clone(), e))?;
    let mut server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(
        vec![CertificateDer::from(leaf.cert_der)],
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf.key_der)),
    )?;
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
    let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(guest))
        .await
        .map_err(|_| InterceptError::Handshake("guest", "timed out".into()))?
        .map_err(|e| InterceptError::Handshake("guest", e.to_string()))?;
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    Stats::add(&cx.stats.intercepted, 1);

    let proxy = Arc::new(Proxy {
        name,
        port,
        cx,
        icp: Some(icp),
        tls: true,
        pool: Arc::new(Mutex::new(Vec::new())),
        returned: Arc::new(tokio::sync::Notify::new()),
        slots: Arc::new(tokio::sync::Semaphore::new(UPSTREAM_CONNECTIONS)),
        first: std::sync::Mutex::new(Some(first)),
    });
    serve(proxy, TokioIo::new(tls), h2).await
}

/// One plain-HTTP/1 connection of the guest to `name:port` (its first request head, already
/// checked, is in `guest` still): every request is checked like an intercepted one, and goes on
/// in plain HTTP. No key is ever substituted into cleartext.
pub(crate) async fn run_plain(
    guest: GuestStream,
    first: tokio::net::TcpStream,
    name: String,
    port: u16,
    cx: Arc<Context>,
) -> Result<(), InterceptError> {
    let icp = cx.interception.clone();
    let proxy = Arc::new(Proxy {
        name,
        port,
        cx,
        icp,
        tls: false,
        pool: Arc::new(Mutex::new(Vec::new())),
        returned: Arc::new(tokio::sync::Notify::new()),
        slots: Arc::new(tokio::sync::Semaphore::new(UPSTREAM_CONNECTIONS)),
        first: std::sync::Mutex::new(Some(first)),
    });
    serve(proxy, TokioIo::new(guest), false).await
}

async fn serve<I>(proxy: Arc<Proxy>, io: TokioIo<I>, h2: bool) -> Result<(), InterceptError>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let header_timeout = proxy.cx.header_timeout;
    let service = hyper::service::service_fn(move |req| {
        let proxy = proxy.clone();
        async move { Ok::<_, Infallible>(proxy.handle(req).await) }
    });
    if h2 {
        // Pings find a guest that went away; a stream's body that stalls is cut by `Idle`.
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(Some(H2_PING_INTERVAL))
            .keep_alive_timeout(H2_PING_TIMEOUT)
            .max_concurrent_streams(MAX_GUEST_STREAMS)
            // Bounds of what the guest's side may hold (crate::memory's HTTP_COST and
            // REQUEST_COST count them).
            .initial_connection_window_size(memory::H2_CONNECTION_WINDOW)
            .initial_stream_window_size(memory::H2_STREAM_WINDOW)
            .max_send_buf_size(memory::H2_SEND_BUFFER)
            .serve_connection(io, service)
            .await?;
    } else {
        // A client may close its sending side once its request is out (`nc`, shutdown(SHUT_WR)):
        // the answer still goes back. A request head must come whole within its time (no
        // slowloris); hyper then closes the connection.
        hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .max_buf_size(memory::HTTP1_BUFFER)
            .half_close(true)
            .serve_connection(io, service)
            .await?;
    }
    Ok(())
}

use bodies::ProxyBody;

struct Proxy {
    name: String,
    port: u16,
    cx: Arc<Context>,
    /// The sandbox's interception (its secrets), if it has one.
    icp: Option<Arc<Interception>>,
    /// Whether upstream is TLS (intercepted) or plain HTTP.
    tls: bool,
    /// Free upstream connections: a sender is put back once its response has been read to the
    /// end, by the task that waits for that.
    pool: Arc<Mutex<Vec<Sender>>>,
    /// Signalled when a sender goes back to the pool.
    returned: Arc<tokio::sync::Notify>,
    /// This guest connection's share of upstream connections.
    slots: Arc<tokio::sync::Semaphore>,
    /// The connection made (and checked) before the guest's handshake was answered.
    first: std::sync::Mutex<Option<tokio::net::TcpStream>>,
}

fn refuse(reason: Reason) -> Response<ProxyBody> {
    let body = format!("sandbox egress refused this request: {}\n", reason.as_str());
    let mut r = Response::new(
        http_body_util::Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = match reason {
        Reason::MemoryLimit => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::FORBIDDEN,
    };
    r.headers_mut().insert(
        HeaderName::from_static("x-sandbox-egress-refused"),
        HeaderValue::from_static(reason.as_str()),
    );
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

fn bad_gateway(why: &str) -> Response<ProxyBody> {
    let mut r = Response::new(
        http_body_util::Full::new(Bytes::from(format!("sandbox egress: {why}\n")))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = StatusCode::BAD_GATEWAY;
    r
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::bodies::Pending;
    use super::credentials::{Shape, credential_shape};
    use crate::meter::record::Meter;
    use crate::meter::request::Unmetered;
    use crate::stats::Stats;

    /// Issue 29, item 5: an Anthropic stream the guest cuts before `message_delta` is recorded
    /// as cut before its usage, with the host's marked lower bound, not as a complete call of
    /// one output token.
    #[test]
    fn a_stream_cut_before_its_usage_is_unmetered_with_a_lower_bound() {
        let stats = Arc::new(Stats::default());
        let mut meter = Meter::for_content_type("text/event-stream").unwrap();
        meter.feed(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_c\",\"model\":\"claude\",\"usage\":{\"input_tokens\":900,\"output_tokens\":1}}}\n\n");
        for _ in 0..12 {
            meter.feed(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"more \"}}\n\n");
        }
        drop(Pending {
            stats: stats.clone(),
            host: "api.anthropic.com".into(),
            status: 200,
            missing: Some(Unmetered::NoUsage),
            meter: Some(meter),
            quiet: false,
            done: false,
        });
        let u = stats.usage();
        let c = &u.calls[0];
        let usage = c.usage.as_ref().unwrap();
        assert_eq!(
            (
                c.complete,
                c.unmetered,
                usage.input_tokens,
                usage.output_tokens,
                usage.estimated
            ),
            (false, Some(Unmetered::CutBeforeUsage), 900, 12, true)
        );
        assert_eq!(u.totals.unmetered_calls(), 1);
    }

    #[test]
    fn a_call_is_recorded_once_whatever_ends_it() {
        let stats = Arc::new(Stats::default());
        let pending = |status, missing, quiet| Pending {
            stats: stats.clone(),
            host: "api.test".into(),
            status,
            missing,
            meter: None,
            quiet,
            done: false,
        };
        // Dropped before any answer (the guest went away, the provider hung up).
        drop(pending(0, None, false));
        // Dropped before any answer, with a reason known from the request.
        drop(pending(0, Some(Unmetered::BodyTooLarge), false));
        // Answered 200, its body cut before usage; finished twice, recorded once.
        let mut p = pending(200, Some(Unmetered::NoUsage), false);
        p.finish(false);
        drop(p);
        // An error status is not unmetered; a quiet call without usage is not recorded.
        drop(pending(429, Some(Unmetered::NoUsage), false));
        drop(pending(200, Some(Unmetered::NoUsage), true));
        let u = stats.usage();
        let got: Vec<(u16, Option<Unmetered>)> =
            u.calls.iter().map(|c| (c.status, c.unmetered)).collect();
        assert_eq!(
            got,
            [
                (0, Some(Unmetered::Abandoned)),
                (0, Some(Unmetered::BodyTooLarge)),
                (200, Some(Unmetered::CutBeforeUsage)),
                (429, None),
            ]
        );
        assert_eq!(u.totals.unmetered_calls(), 3);
    }

    /// HTTP lower-cases header names: a value reflected into one is found in any letter case
    /// (issue 29's second review: it passed lower-cased, its letters' case all it lost).
    #[test]
    fn a_value_in_a_header_name_is_found_in_any_case() {
        use crate::echo::EchoForms;
        use hyper::header::{HeaderMap, HeaderName, HeaderValue};
        let key = "Sk-Ant-Api03-ZX9QW0ER1TY2UI3OP";
        let forms = EchoForms::new([key]).unwrap().unwrap();
        let mut h = HeaderMap::new();
        let name = HeaderName::from_bytes(format!("x-echo-{key}").as_bytes()).unwrap();
        h.insert(name, HeaderValue::from_static("1"));
        h.insert("x-other", HeaderValue::from_static("2"));
        assert_eq!(super::bodies::mask_headers(&forms, &mut h), 1);
        let names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["x-other"]);
    }

    #[test]
    fn only_credential_shapes_get_the_key() {
        let p = b"vantik-placeholder-0123";
        for (ok, shape) in [
            (&b"vantik-placeholder-0123"[..], Shape::Header),
            (b"Bearer vantik-placeholder-0123", Shape::Header),
            (b"x-access-token:vantik-placeholder-0123", Shape::BasicPair),
            (b":vantik-placeholder-0123", Shape::BasicPair),
        ] {
            assert!(
                credential_shape(ok, p, shape),
                "{}",
                String::from_utf8_lossy(ok)
            );
        }
        for (bad, shape) in [
            (&b"AAAAvantik-placeholder-0123"[..], Shape::Header),
            (b"vantik-placeholder-0123AAAA", Shape::Header),
            (b"Bearer  vantik-placeholder-0123", Shape::Header),
            (b"a b vantik-placeholder-0123", Shape::Header),
            (
                b"Averyveryverylongschemeword vantik-placeholder-0123",
                Shape::Header,
            ),
            (b"u:v:vantik-placeholder-0123", Shape::BasicPair),
            // `user:` outside Basic: a guest-chosen prefix the provider may quote.
            (b"Bearer abc:vantik-placeholder-0123", Shape::Header),
            (b"junk:vantik-placeholder-0123", Shape::Header),
            (b"x-access-token:vantik-placeholder-0123", Shape::Header),
            // Inside Basic only the pair: not a scheme word, not the placeholder alone.
            (b"vantik-placeholder-0123", Shape::BasicPair),
            (b"Bearer vantik-placeholder-0123", Shape::BasicPair),
        ] {
            assert!(
                !credential_shape(bad, p, shape),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
