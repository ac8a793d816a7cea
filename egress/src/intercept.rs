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

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use thiserror::Error;
use tokio::sync::Mutex;

use crate::conn::Context;
use crate::echo::{EchoError, EchoForms, EchoScanner};
use crate::guest_io::GuestStream;
use crate::idle::Idle;
use crate::memory::{self, Hold};
use crate::meter::record::Meter;
use crate::meter::request::{self as meter_request, Api, Unmetered};
use crate::policy::{HostPattern, normalize};
use crate::refusal::Reason;
use crate::request_body::{self, BodyError, GuestBody, Read, Replay};
use crate::secrets::{LeakScanner, Secret};
use crate::sniff::http::split_authority;
use crate::stats::{Call, Stats};
use crate::tls::ca::{CaError, SandboxCa};

pub use rustls::ClientConfig;

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

/// Why an intercepted connection ended early.
#[derive(Debug, Error)]
pub enum InterceptError {
    /// No certificate for the name (not a secret or meter host).
    #[error("no certificate for {0}: {1}")]
    Certificate(String, CaError),
    /// TLS configuration.
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// A handshake failed or took too long.
    #[error("TLS handshake with the {0} failed: {1}")]
    Handshake(&'static str, String),
    /// The system's roots could not be read.
    #[error("reading the system's root certificates: {0}")]
    Roots(String),
    /// `SANDBOX_HOST_EGRESS_CA_FILE` holds no usable certificate.
    #[error("SANDBOX_HOST_EGRESS_CA_FILE: {0}")]
    ExtraRoots(String),
    /// HTTP on either side.
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    /// The sandbox's CA could not be made.
    #[error("the sandbox's CA: {0}")]
    Ca(#[from] CaError),
    /// The response scan for the sandbox's secrets could not be compiled.
    #[error(transparent)]
    Echo(#[from] EchoError),
}

/// What a sandbox intercepts with: its CA, its secrets, its meter hosts, and the upstream TLS
/// client configuration.
pub struct Interception {
    ca: SandboxCa,
    secrets: Vec<Secret>,
    /// Every form of every secret's value, looked for in every response.
    echo: Option<Arc<EchoForms>>,
    meter: Vec<HostPattern>,
    policy: MeterPolicy,
    client: Arc<rustls::ClientConfig>,
}

/// How strictly a sandbox's model calls are metered.
#[derive(Debug, Clone, Copy)]
pub struct MeterPolicy {
    /// Refuse, before it goes upstream, a POST to a meter or secret host whose usage the meter
    /// could not read (the run's `egress.meter_strict`).
    pub strict: bool,
    /// The largest request body held to ask for usage (`SANDBOX_HOST_METER_BODY_MAX_MIB`); what
    /// the sandbox holds of all of them at once counts against its egress memory.
    pub body_max: usize,
}

impl Default for MeterPolicy {
    fn default() -> Self {
        MeterPolicy {
            strict: false,
            body_max: DEFAULT_BODY_MAX,
        }
    }
}

/// The default largest request body the meter holds: Anthropic's own request size limit.
pub const DEFAULT_BODY_MAX: usize = 32 << 20;

impl Interception {
    /// The interception of sandbox `id`. `intercepted` are the names its CA may sign for (the
    /// secrets' hosts and the meter hosts).
    pub fn new(
        id: &str,
        intercepted: &[HostPattern],
        secrets: Vec<Secret>,
        meter: Vec<HostPattern>,
        policy: MeterPolicy,
        client: Arc<rustls::ClientConfig>,
    ) -> Result<Self, InterceptError> {
        Ok(Interception {
            ca: SandboxCa::new(id, intercepted)?,
            echo: EchoForms::new(secrets.iter().map(Secret::value))?,
            secrets,
            meter,
            policy,
            client,
        })
    }

    /// The CA certificate (PEM) the guest must trust.
    pub fn ca_pem(&self) -> &str {
        self.ca.cert_pem()
    }

    /// The secrets.
    pub(crate) fn secrets(&self) -> &[Secret] {
        &self.secrets
    }

    /// The guest's environment: each secret's variable with its placeholder.
    pub fn placeholders(&self) -> Vec<(String, String)> {
        self.secrets
            .iter()
            .map(|s| (s.env.clone(), s.placeholder.clone()))
            .collect()
    }
}

impl std::fmt::Debug for Interception {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interception")
            .field("secrets", &self.secrets)
            .field("meter", &self.meter)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// The upstream TLS client: the system's roots and the PEM certificates of `extra` (the
/// operator's `SANDBOX_HOST_EGRESS_CA_FILE`). HTTP/1.1 only.
pub fn upstream_client(extra: Option<&[u8]>) -> Result<Arc<rustls::ClientConfig>, InterceptError> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    let (added, _) = roots.add_parsable_certificates(native.certs);
    if let Some(pem) = extra {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<_, _>>()
            .map_err(|e| InterceptError::ExtraRoots(e.to_string()))?;
        if certs.is_empty() {
            return Err(InterceptError::ExtraRoots(
                "no PEM certificate in the file".into(),
            ));
        }
        for c in certs {
            roots
                .add(c)
                .map_err(|e| InterceptError::ExtraRoots(e.to_string()))?;
        }
    } else if added == 0 {
        return Err(InterceptError::Roots(format!(
            "none found ({:?})",
            native.errors
        )));
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

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

type ProxyBody = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// An upstream HTTP/1.1 connection. Its places in the two bounds (this guest connection's and
/// the sandbox's) belong to its connection task and are given back when the connection itself
/// ends, not when this handle is dropped: a request the guest abandons mid-response leaves the
/// connection busy, and it still counts.
struct Sender {
    send: hyper::client::conn::http1::SendRequest<ProxyBody>,
}

/// Places in the two bounds.
type Slots = (
    tokio::sync::OwnedSemaphorePermit,
    tokio::sync::OwnedSemaphorePermit,
    Hold,
);

impl Sender {
    fn is_ready(&self) -> bool {
        self.send.is_ready()
    }

    fn is_closed(&self) -> bool {
        self.send.is_closed()
    }
}

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

/// Headers that belong to one hop and never pass (nor carry a secret).
pub(crate) const HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "upgrade",
    "trailer",
];

impl Proxy {
    async fn handle(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        let target = format!("{}:{}", self.name, self.port);
        let stats = &self.cx.stats;
        if req.method() == hyper::Method::CONNECT {
            stats.refuse(Reason::HttpConnect, &target);
            return refuse(Reason::HttpConnect);
        }
        // The request's authority (HTTP/2) or Host (HTTP/1) must be the connection's name.
        let authority = req
            .uri()
            .authority()
            .map(|a| a.as_str().to_string())
            .or_else(|| {
                req.headers()
                    .get(header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .map(str::to_string)
            });
        let ok = authority
            .as_deref()
            .and_then(split_authority)
            .is_some_and(|(h, p)| {
                normalize(h).as_deref() == Some(self.name.as_str())
                    && p.is_none_or(|p| p == self.port)
            });
        if !ok || req.headers().get_all(header::HOST).iter().count() > 1 {
            stats.refuse(Reason::SniHostMismatch, &target);
            return refuse(Reason::SniHostMismatch);
        }
        if req.headers().contains_key(header::UPGRADE) {
            stats.refuse(Reason::Protocol, &target);
            return refuse(Reason::Protocol);
        }
        // The request's worst case, held until its response has gone (or it failed).
        let Some(memory) = Hold::take(&self.cx.memory, memory::REQUEST_COST) else {
            stats.refuse(Reason::MemoryLimit, &target);
            return refuse(Reason::MemoryLimit);
        };
        let (parts, body) = req.into_parts();
        let body = Idle::new(body, self.cx.body_idle_timeout, "the guest's request body");
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_string();
        // Placeholders: the real value in the secret's credential headers to its own hosts and
        // paths, a leak anywhere else (another header, so a provider cannot be made to echo the
        // key), refused on a path the secret is not for.
        // A placeholder in a header given more than once is a leak: an upstream that joins the
        // values (`junk, sk-...`) and quotes the result cut short would show where the guest
        // chose how much of the key (issue 29, review).
        let repeated = parts.headers.keys().any(|k| {
            let values = parts.headers.get_all(k);
            values.iter().nth(1).is_some()
                && values.iter().any(|v| {
                    self.secrets()
                        .iter()
                        .any(|s| contains(v.as_bytes(), s.placeholder.as_bytes()))
                })
        });
        if repeated {
            stats.refuse(Reason::PlaceholderLeak, &target);
            return refuse(Reason::PlaceholderLeak);
        }
        // The endpoint a key is judged for: its method, or none that a rule names when the
        // request asks the server to take it for another.
        let method = if METHOD_OVERRIDES
            .iter()
            .any(|h| parts.headers.contains_key(*h))
        {
            ""
        } else {
            parts.method.as_str()
        };
        let route = (method, path.as_str());
        let mut headers = HeaderMap::new();
        let secret_host = self.tls && self.secrets().iter().any(|s| s.applies_to(&self.name));
        for (k, v) in &parts.headers {
            if HOP.contains(&k.as_str()) || k == header::HOST {
                continue;
            }
            // A range of an echo could cut a key where the guest likes: whole bodies only.
            if secret_host && (k == header::RANGE || k == header::IF_RANGE) {
                continue;
            }
            let v = if k == header::AUTHORIZATION || k == header::PROXY_AUTHORIZATION {
                match self.substitute_basic(k.as_str(), v, route) {
                    Ok(v) => v,
                    Err(why) => {
                        stats.refuse(why, &target);
                        return refuse(why);
                    }
                }
            } else {
                v.clone()
            };
            match self.substitute(k.as_str(), &v, Shape::Header, route) {
                Ok(v) => {
                    headers.append(k.clone(), v);
                }
                Err(why) => {
                    if why == Reason::PathNotAllowed {
                        let shown: String = path
                            .split('?')
                            .next()
                            .unwrap_or("")
                            .chars()
                            .take(128)
                            .collect();
                        self.cx.log.log(|| {
                            tracing::info!(
                                "egress: {target}: a secret's key refused on {shown}: not among its paths"
                            )
                        });
                    }
                    stats.refuse(why, &target);
                    return refuse(why);
                }
            }
        }
        let leaks = if self.tls {
            LeakScanner::new(self.secrets(), &self.name)
        } else {
            LeakScanner::new(self.secrets(), "") // in cleartext every placeholder is a leak
        };
        // A target is never a credential: a placeholder there is a leak, to any host.
        let in_target = self.secrets().iter().any(|s| path.contains(&s.placeholder));
        if in_target {
            stats.refuse(Reason::PlaceholderLeak, &target);
            return refuse(Reason::PlaceholderLeak);
        }
        // A known model provider that is a secret's host is metered whether or not the run
        // named it in `meter` (issue 29, item 6).
        let meter_host = self.icp.as_ref().is_some_and(|i| {
            i.meter.iter().any(|p| p.matches(&self.name))
                || (crate::secrets::provider_paths(&self.name).is_some()
                    && i.secrets.iter().any(|s| s.applies_to(&self.name)))
        });
        let metered = meter_host
            || self
                .icp
                .as_ref()
                .is_some_and(|i| i.secrets.iter().any(|s| s.applies_to(&self.name)));
        // Every response of a sandbox with secrets is scanned for them (`respond`): none may come
        // compressed, where the scan cannot read it.
        let scanned = self.icp.as_ref().is_some_and(|i| i.echo.is_some());
        if metered || scanned {
            // Responses the meter and the scan can read.
            headers.insert(
                header::ACCEPT_ENCODING,
                HeaderValue::from_static("identity"),
            );
        }
        // A model call is any request to a meter or secret host that may do something (not
        // GET, HEAD or OPTIONS, which bill nothing: a GET of a stored response would count its
        // tokens twice; unless it asks the server to take it for another method). Token
        // counting bills nothing. On a host that is only a secret's, a request to no known
        // model API (a git push to a token's host) is recorded only if its answer reports
        // usage: it is neither unmeterable nor refused.
        let api = Api::of(&path);
        let overridden = METHOD_OVERRIDES.iter().any(|h| headers.contains_key(*h));
        let acts = overridden
            || !matches!(
                parts.method,
                hyper::Method::GET | hyper::Method::HEAD | hyper::Method::OPTIONS
            );
        let call = metered && acts && api != Some(Api::Count);
        let quiet = !meter_host && api.is_none();
        let (body, asked) = if call && !quiet {
            match self
                .ask_for_usage(api, overridden, &mut headers, body)
                .await
            {
                Ok(b) => b,
                Err(e) => return bad_gateway(&format!("reading the request to {target}: {e}")),
            }
        } else {
            (Replay::unread(body), Asked::default())
        };
        if let Some(why) = asked.unmetered
            && self.icp.as_ref().is_some_and(|i| i.policy.strict)
        {
            self.cx.log.log(|| {
                tracing::info!(
                    "egress: {target}{path}: refused under meter_strict: {}",
                    why.as_str()
                )
            });
            stats.refuse(Reason::Unmeterable, &target);
            return refuse(Reason::Unmeterable);
        }
        let default_port = if self.tls { 443 } else { 80 };
        let host = if self.port == default_port {
            self.name.clone()
        } else {
            target.clone()
        };
        headers.insert(
            header::HOST,
            HeaderValue::from_str(&host).unwrap_or(HeaderValue::from_static("invalid")),
        );
        let body = ScannedBody {
            inner: body,
            scanner: leaks,
            placeholders: self
                .secrets()
                .iter()
                .map(|s| s.placeholder.clone())
                .collect(),
            stats: self.cx.stats.clone(),
            target: target.clone(),
        }
        .boxed();
        let mut up = Request::new(body);
        *up.method_mut() = parts.method;
        *up.uri_mut() = path.parse().unwrap_or_else(|_| "/".parse().expect("valid"));
        *up.headers_mut() = headers;

        let mut sender = match self.sender().await {
            Ok(s) => s,
            Err(None) => {
                stats.refuse(Reason::MemoryLimit, &target);
                return refuse(Reason::MemoryLimit);
            }
            Err(Some(e)) => {
                self.cx.log.log(|| tracing::warn!("egress: {target}: {e}"));
                return bad_gateway(&e);
            }
        };
        // From here the provider may bill: the call is recorded even if the guest goes away (this
        // future dropped) or the connection fails before an answer.
        let mut pending = call.then(|| Pending {
            stats: self.cx.stats.clone(),
            host: self.name.clone(),
            status: 0,
            missing: asked.unmetered,
            meter: None,
            quiet,
            done: false,
        });
        let resp = match sender.send.send_request(up).await {
            Ok(r) => r,
            Err(e) => {
                // A leak found in the body aborts the request (the scanner counted it).
                if self
                    .cx
                    .stats
                    .refusals()
                    .events()
                    .0
                    .last()
                    .is_some_and(|ev| ev.reason == Reason::PlaceholderLeak && ev.target == target)
                    && e.to_string().contains("placeholder")
                {
                    // Cut before its body ended: not a call the provider runs.
                    if let Some(p) = pending.as_mut() {
                        p.done = true;
                    }
                    return refuse(Reason::PlaceholderLeak);
                }
                return bad_gateway(&format!("the request to {target} failed: {e}"));
            }
        };
        // The connection is free again once this response's body has been read to its end
        // (hyper's `ready`): the task that waits for that puts it back and wakes one waiter, so
        // a request waiting for a connection is woken by the release, never by a timer (issue
        // 29, item 7). A connection that closes instead (a body the guest abandoned) is dropped;
        // its places in the bounds come back with its connection task.
        let (pool, returned) = (self.pool.clone(), self.returned.clone());
        tokio::spawn(async move {
            let mut sender = sender;
            if sender.send.ready().await.is_ok() {
                pool.lock().await.push(sender);
                returned.notify_one();
            }
        });
        drop(asked.hold);
        let (mut parts, body) = resp.into_parts();
        // Read before the hop-by-hop headers go: `Transfer-Encoding: gzip, chunked` compresses
        // the body under hyper's de-chunking just as `Content-Encoding` does.
        let encoded = content_encoded(&parts.headers);
        for h in HOP {
            parts.headers.remove(h);
        }
        // The upstream's own reason phrase would be written back to an HTTP/1.1 guest as it is,
        // unscanned ("401 invalid key sk-..."): the guest gets the standard one.
        parts.extensions.remove::<hyper::ext::ReasonPhrase>();
        let echo = self.icp.as_ref().and_then(|i| i.echo.clone());
        // Asked for identity (every host is, in a sandbox with secrets), a host that compresses
        // anyway sends bytes the scan cannot read: they do not reach the guest (issue 29: on any
        // scanned host, a `Transfer-Encoding` other than chunked as a `Content-Encoding`).
        if let Some(p) = pending.as_mut() {
            p.status = parts.status.as_u16();
        }
        if echo.is_some() && encoded {
            self.cx.log.log(|| {
                tracing::warn!(
                    "egress: {target} answered with a compressed body although asked for identity"
                )
            });
            // It was billed all the same: `pending` records it as it goes.
            if let Some(p) = pending.as_mut() {
                p.missing.get_or_insert(Unmetered::EncodedResponse);
            }
            return bad_gateway(&format!(
                "{target} sent a compressed response although asked not to; it cannot be checked for secrets"
            ));
        }
        if let Some(forms) = &echo {
            let echoed = mask_headers(forms, &mut parts.headers);
            for _ in 0..echoed {
                stats.refuse(Reason::SecretEcho, &target);
            }
        }
        if let Some(p) = pending.as_mut() {
            p.meter = if encoded {
                None
            } else {
                parts
                    .headers
                    .get(header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(Meter::for_content_type)
            };
            // What to say if the response reports no usage.
            p.missing.get_or_insert(if encoded {
                Unmetered::EncodedResponse
            } else if p.meter.is_none() {
                Unmetered::UnknownResponse
            } else {
                Unmetered::NoUsage
            });
        }
        // The upstream's own pace counts, not the guest's: a body whose bytes the scan holds back
        // (no barrier yet) still arrives, and is not cut as idle.
        let body = MeteredBody {
            inner: Idle::new(body, self.cx.idle_timeout, "the upstream's response body"),
            call: pending,
            echo: echo.map(EchoScanner::new),
            trailers: None,
            target,
            stats: self.cx.stats.clone(),
            _memory: memory,
        }
        .boxed();
        Response::from_parts(parts, body)
    }

    fn secrets(&self) -> &[Secret] {
        self.icp.as_ref().map_or(&[], |i| i.secrets.as_slice())
    }

    /// Prepares a model call's request: its body read where the meter must see it, and
    /// `stream_options.include_usage` set where the provider would not report usage otherwise.
    async fn ask_for_usage(
        &self,
        api: Option<Api>,
        overridden: bool,
        headers: &mut HeaderMap,
        body: GuestBody,
    ) -> Result<(Replay, Asked), BodyError> {
        let unread = |body, why| {
            Ok((
                Replay::unread(body),
                Asked {
                    unmetered: why,
                    hold: None,
                },
            ))
        };
        let (Some(icp), Some(api), false) = (self.icp.as_ref(), api, overridden) else {
            return unread(body, Some(Unmetered::UnknownRequest));
        };
        if !api.reads_body() {
            return unread(body, None);
        }
        if content_encoded(headers) {
            return unread(body, Some(Unmetered::UnreadableBody));
        }
        let hold = Hold::new(&self.cx.memory);
        let (body, hold, unmetered) =
            match request_body::read(body, icp.policy.body_max, hold).await? {
                (Read::TooLarge(replay), hold) => (replay, hold, Some(Unmetered::BodyTooLarge)),
                (Read::Whole(data, trailers), hold) => {
                    let (data, hold, prepared) = prepare_off_loop(api, data, hold).await;
                    match prepared {
                        Ok(None) => (Replay::new(data, trailers, None), hold, None),
                        Ok(Some(new)) => {
                            // hyper gives the new length from the body, which it knows exactly.
                            headers.remove(header::CONTENT_LENGTH);
                            (Replay::new(new, trailers, None), hold, None)
                        }
                        Err(why) => (Replay::new(data, trailers, None), hold, Some(why)),
                    }
                }
            };
        Ok((
            body,
            Asked {
                unmetered,
                hold: Some(hold),
            },
        ))
    }

    /// The value of header `name` with each placeholder replaced by its secret's value, where
    /// the request goes over TLS to the secret's hosts and `name` is one of its credential
    /// headers; `Err(PlaceholderLeak)` for a placeholder anywhere else (another secret's host,
    /// another header, plain HTTP), `Err(PathNotAllowed)` where `path` is not the secret's.
    fn substitute(
        &self,
        name: &str,
        v: &HeaderValue,
        shape: Shape,
        (method, path): (&str, &str),
    ) -> Result<HeaderValue, Reason> {
        let leak = Reason::PlaceholderLeak;
        let bytes = v.as_bytes();
        let mut out: Option<Vec<u8>> = None;
        for s in self.secrets() {
            let p = s.placeholder.as_bytes();
            let cur = out.as_deref().unwrap_or(bytes);
            if !cur.windows(p.len()).any(|w| w == p) {
                continue;
            }
            if !self.tls
                || !s.applies_to(&self.name)
                || !s.substitutes_in(name)
                || !credential_shape(cur, p, shape)
            {
                return Err(leak);
            }
            if !s.allows(&self.name, method, path) {
                return Err(Reason::PathNotAllowed);
            }
            let text = String::from_utf8_lossy(cur).replace(&s.placeholder, s.value());
            out = Some(text.into_bytes());
        }
        match out {
            None => Ok(v.clone()),
            Some(b) => {
                let mut v = HeaderValue::from_bytes(&b).map_err(|_| leak)?;
                v.set_sensitive(true); // never indexed by HPACK
                Ok(v)
            }
        }
    }

    /// `Basic <base64(user:password)>` with placeholders inside (git and other tools send a token
    /// as the password): decoded, substituted by [`substitute`](Self::substitute)'s rules, and
    /// encoded again. Any other value is returned as it is.
    fn substitute_basic(
        &self,
        name: &str,
        v: &HeaderValue,
        route: (&str, &str),
    ) -> Result<HeaderValue, Reason> {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        let Some(encoded) = v.to_str().ok().and_then(|t| {
            t.strip_prefix("Basic ")
                .or_else(|| t.strip_prefix("basic "))
        }) else {
            return Ok(v.clone());
        };
        let Ok(decoded) = b64.decode(encoded.trim()) else {
            return Ok(v.clone());
        };
        let Ok(inner) = HeaderValue::from_bytes(&decoded) else {
            return Ok(v.clone());
        };
        let replaced = self.substitute(name, &inner, Shape::BasicPair, route)?;
        if replaced.as_bytes() == decoded.as_slice() {
            return Ok(v.clone());
        }
        let mut out = HeaderValue::from_str(&format!("Basic {}", b64.encode(replaced.as_bytes())))
            .map_err(|_| Reason::PlaceholderLeak)?;
        out.set_sensitive(true);
        Ok(out)
    }

    /// An upstream HTTP/1.1 sender that is free: a pooled one, or a new connection. Waits (never
    /// fails for lack of room) while this guest connection has all its [`UPSTREAM_CONNECTIONS`]
    /// busy, and for a place among the sandbox's [`SANDBOX_UPSTREAM_CONNECTIONS`].
    /// `Err(None)`: the sandbox's egress memory has no room for another connection.
    async fn sender(&self) -> Result<Sender, Option<String>> {
        loop {
            {
                let mut pool = self.pool.lock().await;
                pool.retain(|s| !s.is_closed());
                if let Some(i) = pool.iter().position(Sender::is_ready) {
                    return Ok(pool.swap_remove(i));
                }
            }
            // No free connection: a new one when both bounds have room, else wait for one to be
            // given back (its response read to the end) or to close (its places come back).
            let slot = tokio::select! {
                slot = self.slots.clone().acquire_owned() => slot.map_err(|e| Some(e.to_string()))?,
                _ = self.returned.notified() => continue,
            };
            let shared = tokio::select! {
                shared = self.cx.upstream.clone().acquire_owned() => shared.map_err(|e| Some(e.to_string()))?,
                _ = self.returned.notified() => continue,
            };
            // Its buffers' worst case too; a sandbox whose other connections hold its egress
            // memory does not wait for them (they may never end).
            let Some(memory) = Hold::take(&self.cx.memory, memory::UPSTREAM_COST) else {
                return Err(None);
            };
            let send = self.connect((slot, shared, memory)).await.map_err(Some)?;
            return Ok(Sender { send });
        }
    }

    async fn connect(
        &self,
        slots: Slots,
    ) -> Result<hyper::client::conn::http1::SendRequest<ProxyBody>, String> {
        let first = self.first.lock().unwrap_or_else(|e| e.into_inner()).take();
        let tcp = match first {
            Some(t) => t,
            None => {
                self.cx.connects.pace().await;
                self.cx
                    .dial
                    .dial(&self.name, self.port)
                    .await
                    .map_err(|e| e.to_string())?
                    .0
            }
        };
        let icp = match (&self.icp, self.tls) {
            (Some(icp), true) => icp,
            _ => return handshake(tcp, slots).await,
        };
        let server_name = ServerName::try_from(self.name.clone()).map_err(|e| e.to_string())?;
        let tls = tokio::time::timeout(
            HANDSHAKE_TIMEOUT,
            tokio_rustls::TlsConnector::from(icp.client.clone()).connect(server_name, tcp),
        )
        .await
        .map_err(|_| "the upstream TLS handshake timed out".to_string())?
        .map_err(|e| format!("upstream TLS: {e}"))?;
        handshake(tls, slots).await
    }
}

/// An HTTP/1.1 client connection over `io`, its connection task spawned.
async fn handshake<I>(
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

/// [`meter_request::prepare`], on a blocking thread for a body large enough to keep the
/// runtime's thread from every other connection for long (a 32 MiB body takes tens of ms).
/// The body and its share of the budget go along, so that a guest that goes away meanwhile does
/// not free the budget while the bytes are still held.
async fn prepare_off_loop(
    api: Api,
    data: Vec<u8>,
    hold: Hold,
) -> (Vec<u8>, Hold, Result<Option<Vec<u8>>, Unmetered>) {
    const INLINE: usize = 256 << 10;
    if data.len() <= INLINE {
        let r = meter_request::prepare(api, &data);
        return (data, hold, r);
    }
    let budget = hold.budget();
    tokio::task::spawn_blocking(move || {
        let r = meter_request::prepare(api, &data);
        (data, hold, r)
    })
    .await
    .unwrap_or_else(|_| {
        (
            Vec::new(),
            Hold::new(&budget),
            Err(Unmetered::UnreadableBody),
        )
    })
}

/// Headers that ask a server to take a request for another method than its own.
const METHOD_OVERRIDES: [&str; 3] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

/// Whether any `Content-Encoding` is other than identity, or any `Transfer-Encoding` other than
/// chunked (every header, every item of a list): a body the scan and the meter cannot read.
fn content_encoded(headers: &HeaderMap) -> bool {
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

/// What the meter did to a model call's request.
#[derive(Debug, Default)]
struct Asked {
    /// Why its usage cannot be read, known before it goes upstream.
    unmetered: Option<Unmetered>,
    /// Its body's share of the sandbox's budget, while it is held.
    hold: Option<Hold>,
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
struct ScannedBody {
    inner: Replay,
    scanner: LeakScanner,
    /// Every placeholder: none may be in a trailer, whatever the host.
    placeholders: Vec<String>,
    stats: Arc<Stats>,
    target: String,
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
struct MeteredBody {
    /// The upstream's body, cut if the upstream sends nothing for the idle timeout.
    inner: Idle<Incoming>,
    /// The model call this answers, read by its meter as it passes.
    call: Option<Pending>,
    /// Masks secret values on their way to the guest (intercepted hosts with secrets).
    echo: Option<EchoScanner>,
    /// Trailers that wait until the bytes the echo scan held back have gone.
    trailers: Option<HeaderMap>,
    target: String,
    stats: Arc<Stats>,
    /// The request's share of the sandbox's egress memory ([`memory::REQUEST_COST`]).
    _memory: Hold,
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
struct Pending {
    stats: Arc<Stats>,
    host: String,
    /// The response's status; 0 while there is none.
    status: u16,
    /// Why its usage would be missing, once known.
    missing: Option<Unmetered>,
    meter: Option<Meter>,
    /// Recorded only if it reports usage (a request to no known API on a secret's host).
    quiet: bool,
    done: bool,
}

impl Pending {
    fn finish(&mut self, complete: bool) {
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
                            let (out, n) = echo.feed(&data);
                            this.echoed(n);
                            this.meter(&out);
                            if out.is_empty() {
                                continue; // all held back: wait for more
                            }
                            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
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
        self.trailers.is_none()
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
fn mask_headers(forms: &EchoForms, headers: &mut HeaderMap) -> usize {
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

/// Where a placeholder is being substituted: a header value as sent, or the `user:password`
/// pair decoded from `Authorization: Basic`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Header,
    BasicPair,
}

/// Whether a value holding `placeholder` has the shape of a credential: in a header, the
/// placeholder alone or after one short scheme word (`Bearer <placeholder>`); inside Basic, the
/// password of a short user name (`user:<placeholder>`), and only there (issue 29, item 3).
/// Padding around it would let a guest choose where a provider that quotes a truncated header
/// cuts the key.
fn credential_shape(value: &[u8], placeholder: &[u8], shape: Shape) -> bool {
    let Some(before) = value.strip_suffix(placeholder) else {
        return false;
    };
    match shape {
        Shape::BasicPair => before
            .strip_suffix(b":")
            .is_some_and(|user| user.len() <= 64 && !user.contains(&b':')),
        Shape::Header => {
            if before.is_empty() {
                return true;
            }
            let word = before.strip_suffix(b" ").unwrap_or(b"");
            !word.is_empty() && word.len() <= 16 && word.iter().all(u8::is_ascii_alphanumeric)
        }
    }
}

/// Whether `needle` occurs in `hay`.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::{Arc, Meter, Pending, Shape, Stats, Unmetered, credential_shape};

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
        assert_eq!(super::mask_headers(&forms, &mut h), 1);
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
