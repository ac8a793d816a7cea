//! Requests passed on to a host: the method, the path and query, the headers a host reads, and
//! the body, streamed both ways (an exec's NDJSON, an archive of any size): nothing is buffered
//! here, so a slow reader on either side slows the other (hyper's flow control end to end).

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, Response, header};
use hyper::Uri;
use hyper_util::client::legacy::connect::HttpConnector;

/// The client the gateway reaches hosts with: keep-alive connections, a bounded connect.
pub type Client = hyper_util::client::legacy::Client<HttpConnector, Body>;

/// How long a host has to accept a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The client of [`Client`]'s kind.
pub fn client() -> Client {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    http.set_nodelay(true);
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(http)
}

/// Headers that belong to one connection, never passed on (RFC 9110, 7.6.1), and the ones the
/// gateway sets itself.
const DROPPED: [header::HeaderName; 9] = [
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::HOST,
    header::AUTHORIZATION,
];

fn pass_on(from: &HeaderMap, to: &mut HeaderMap) {
    for (k, v) in from {
        if !DROPPED.contains(k) && k.as_str() != "keep-alive" {
            to.append(k.clone(), v.clone());
        }
    }
}

/// Why a request did not reach its host, or its answer did not come.
#[derive(Debug, thiserror::Error)]
#[error("{why}")]
pub struct Unreachable {
    /// Nothing of the request reached the host (no connection): safe to send elsewhere.
    pub before_sending: bool,
    /// What happened.
    pub why: String,
}

fn local(why: String) -> Unreachable {
    Unreachable {
        before_sending: true,
        why,
    }
}

/// Sends `req` (its path and query as they came) to the host at `base`, with the host token,
/// and gives back the host's answer as it streams.
pub async fn forward(
    client: &Client,
    base: &Uri,
    token: &str,
    req: Request<Body>,
) -> Result<Response<Body>, Unreachable> {
    let (parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let uri: Uri = format!(
        "{}://{}{path}",
        base.scheme_str().unwrap_or("http"),
        base.authority().map_or("", |a| a.as_str())
    )
    .parse()
    .map_err(|e| local(format!("a request to it could not be made ({e})")))?;
    let mut out = Request::builder()
        .method(parts.method)
        .uri(uri)
        .body(body)
        .map_err(|e| local(format!("a request to it could not be made ({e})")))?;
    pass_on(&parts.headers, out.headers_mut());
    let bearer = HeaderValue::from_str(&format!("Bearer {token}"))
        .map_err(|_| local("the host token is not a header value".into()))?;
    out.headers_mut().insert(header::AUTHORIZATION, bearer);
    let res = client.request(out).await.map_err(|e| Unreachable {
        before_sending: e.is_connect(),
        why: match std::error::Error::source(&e) {
            Some(cause) => format!("{e}: {cause}"),
            None => e.to_string(),
        },
    })?;
    let (parts, incoming) = res.into_parts();
    let mut back = Response::builder()
        .status(parts.status)
        .body(Body::new(incoming))
        .map_err(|e| local(format!("its answer could not be passed on ({e})")))?;
    pass_on(&parts.headers, back.headers_mut());
    Ok(back)
}
