//! Requests passed on to a host: the method, the path and query, the headers a host reads, and
//! the body, streamed both ways (an exec's NDJSON, an archive of any size): nothing is buffered
//! here, so a slow reader on either side slows the other (hyper's flow control end to end).
//!
//! A request to switch protocols (a terminal's WebSocket) is passed on as one: when the host
//! agrees (101), the two connections are joined and their bytes copied both ways, unread, until
//! either side closes.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use hyper::Uri;
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;

use super::config::GatewayConfig;
use crate::tls::TlsError;

/// The client the gateway reaches hosts with: http or https by each host's URL, keep-alive
/// connections, a bounded connect.
pub type Client = hyper_util::client::legacy::Client<HttpsConnector<HttpConnector>, Body>;

/// How long a host has to accept a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The client of [`Client`]'s kind for `config`: over https, hosts' certificates are checked
/// against the authorities of `SANDBOX_HOST_CA_FILE` (else the system's), and against the name
/// of `tls_name` when there is one.
pub fn client(config: &GatewayConfig) -> Result<Client, TlsError> {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    http.set_nodelay(true);
    // A host that vanished under a joined connection (a terminal) is found.
    http.set_keepalive(Some(Duration::from_secs(60)));
    http.enforce_http(false);
    let tls = if config.uses_https() {
        crate::tls::client_config()?
    } else {
        crate::tls::no_authorities()?
    };
    let builder = HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    let builder = match &config.tls_name {
        Some(name) => {
            let name = rustls::pki_types::ServerName::try_from(name.clone())
                .map_err(|e| TlsError::Client(format!("`{name}`: {e}")))?;
            builder.with_server_name_resolver(FixedServerNameResolver::new(name))
        }
        None => builder,
    };
    let connector = builder.enable_http1().wrap_connector(http);
    Ok(
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector),
    )
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

/// The tokens of `Connection` (lower case): the headers it names, and `upgrade`.
fn connection_tokens(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .collect()
}

/// Copies the end-to-end headers of `from` into `to`: not the connection's own, those
/// `Connection` names, or the credentials and `Host`, which each hop sets itself.
pub(crate) fn pass_on(from: &HeaderMap, to: &mut HeaderMap) {
    // The headers `Connection` names are of this connection too (RFC 9110, 7.6.1).
    let named = connection_tokens(from);
    for (k, v) in from {
        if !DROPPED.contains(k)
            && k.as_str() != "keep-alive"
            && !named.iter().any(|n| n == k.as_str())
        {
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

/// An error and its causes, in one line: a TLS failure is the connection error's cause's cause
/// (`client error (Connect): invalid peer certificate: UnknownIssuer`).
pub fn causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    for _ in 0..8 {
        let Some(c) = next else { break };
        let said = c.to_string();
        if !out.contains(&said) {
            out.push_str(": ");
            out.push_str(&said);
        }
        next = c.source();
    }
    out
}

/// Sends `req` (its path and query as they came) to the host at `base`, with the host token,
/// and gives back the host's answer as it streams.
pub async fn forward(
    client: &Client,
    base: &Uri,
    token: &str,
    req: Request<Body>,
) -> Result<Response<Body>, Unreachable> {
    forward_as(client, base, Some(token), req).await
}

/// [`forward`], with the host token only when `token` is given: a signed link's request (to a
/// guest's port) goes without it, since the host does not need it there and the gateway has not
/// checked the link (a made-up one must not become a request that carries the token).
pub async fn forward_as(
    client: &Client,
    base: &Uri,
    token: Option<&str>,
    req: Request<Body>,
) -> Result<Response<Body>, Unreachable> {
    let mut req = req;
    let upgrade = wants_upgrade(req.headers()).then(|| hyper::upgrade::on(&mut req));
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
    if let Some(token) = token {
        let bearer = HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| local("the host token is not a header value".into()))?;
        out.headers_mut().insert(header::AUTHORIZATION, bearer);
    }
    // The address the client reached, for what a host says of it (a signed link's URL).
    if let Some(host) = parts.headers.get(header::HOST) {
        out.headers_mut().insert("x-forwarded-host", host.clone());
    }
    let scheme = if std::env::var_os(crate::tls::CERT_VAR).is_some_and(|v| !v.is_empty()) {
        "https"
    } else {
        "http"
    };
    out.headers_mut()
        .insert("x-forwarded-proto", HeaderValue::from_static(scheme));
    if upgrade.is_some() {
        out.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        out.headers_mut()
            .insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    }
    let mut res = client.request(out).await.map_err(|e| Unreachable {
        before_sending: e.is_connect(),
        why: causes(&e),
    })?;
    let switched = res.status() == StatusCode::SWITCHING_PROTOCOLS;
    let host_side = switched.then(|| hyper::upgrade::on(&mut res));
    let (parts, incoming) = res.into_parts();
    let mut back = Response::builder()
        .status(parts.status)
        .body(Body::new(incoming))
        .map_err(|e| local(format!("its answer could not be passed on ({e})")))?;
    pass_on(&parts.headers, back.headers_mut());
    if let (Some(client_side), Some(host_side)) = (upgrade, host_side) {
        back.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        back.headers_mut()
            .insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        tokio::spawn(join(client_side, host_side));
    }
    Ok(back)
}

/// Whether a request asks to switch to a WebSocket (`Connection: upgrade`, `Upgrade:
/// websocket`), the one protocol the API switches to; any other is passed on as a plain request
/// (which the host refuses).
pub(crate) fn wants_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("websocket"))
        && connection_tokens(headers).iter().any(|t| t == "upgrade")
}

/// Copies bytes both ways between a client's connection and its host's once both have switched
/// protocols. When either side is done, the other has [`JOIN_GRACE`] to finish (a WebSocket's
/// closing handshake), then both are dropped: a peer that never closes its side holds nothing.
pub(crate) async fn join(
    client_side: hyper::upgrade::OnUpgrade,
    host_side: hyper::upgrade::OnUpgrade,
) {
    let (client_side, host_side) = match tokio::try_join!(client_side, host_side) {
        Ok(both) => both,
        Err(e) => {
            tracing::info!(error = %e, "A switch of protocols did not complete");
            return;
        }
    };
    let (mut from_client, mut to_client) =
        tokio::io::split(hyper_util::rt::TokioIo::new(client_side));
    let (mut from_host, mut to_host) = tokio::io::split(hyper_util::rt::TokioIo::new(host_side));
    let up = async {
        let _ = tokio::io::copy(&mut from_client, &mut to_host).await;
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut to_host).await;
    };
    let down = async {
        let _ = tokio::io::copy(&mut from_host, &mut to_client).await;
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut to_client).await;
    };
    tokio::pin!(up, down);
    tokio::select! {
        () = &mut up => {
            let _ = tokio::time::timeout(JOIN_GRACE, down).await;
        }
        () = &mut down => {
            let _ = tokio::time::timeout(JOIN_GRACE, up).await;
        }
    }
}

/// How long one side of a joined connection may go on once the other is done.
const JOIN_GRACE: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_websocket_switch_is_passed_on_and_named_headers_stay() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(wants_upgrade(&h));
        h.insert(header::UPGRADE, HeaderValue::from_static("h2c"));
        assert!(!wants_upgrade(&h));
        h.remove(header::CONNECTION);
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(!wants_upgrade(&h));

        // A header the client names in Connection is of its connection: not passed on.
        let mut from = HeaderMap::new();
        from.insert(
            header::CONNECTION,
            HeaderValue::from_static("x-hop, Upgrade"),
        );
        from.insert("x-hop", HeaderValue::from_static("1"));
        from.insert("x-end", HeaderValue::from_static("2"));
        from.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer client"),
        );
        let mut to = HeaderMap::new();
        pass_on(&from, &mut to);
        assert_eq!(to.len(), 1, "{to:?}");
        assert_eq!(to["x-end"], "2");
    }
}
