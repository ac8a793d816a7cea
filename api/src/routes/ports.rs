//! A guest's TCP ports through the API (issue 35): any request to
//! `/v1/sandboxes/{id}/ports/{port}/{path…}` (with the token) or to `/p/{link}/{path…}` (a
//! signed link, without it) is sent to `127.0.0.1:<port>` in the guest over the agent's
//! channel, never through the guest's network or egress, and its answer streamed back;
//! WebSocket upgrades are joined end to end (a dev server's hot reload).
//!
//! Each request is one connection to the guest's port, spoken by hyper's HTTP/1 client over
//! an in-memory pipe whose other end is the agent's stream: the guest's server is as strict or
//! as lax as it likes, the host parses its answer with the same code as any HTTP answer.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, on};
use serde::Deserialize;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::ApiError;
use crate::port_link::{self, Grant};
use crate::registry::SandboxEntry;
use crate::state::AppState;

/// Bytes the in-memory pipe between hyper and the agent's stream holds each way.
const PIPE: usize = 64 * 1024;
/// How long the guest's server has to answer a request's head.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(300);

/// The methods passed on to a guest's server: HTTP's own but `TRACE` (which would echo the
/// request, its cookies included, to a page) and `CONNECT`; another is `405`.
pub(crate) fn methods() -> MethodFilter {
    MethodFilter::GET
        .or(MethodFilter::HEAD)
        .or(MethodFilter::POST)
        .or(MethodFilter::PUT)
        .or(MethodFilter::PATCH)
        .or(MethodFilter::DELETE)
        .or(MethodFilter::OPTIONS)
}

pub fn router() -> Router<AppState> {
    Router::new()
        .route(
            "/v1/sandboxes/{id}/ports/{port}/url",
            on(methods(), url_or_path),
        )
        .route(
            "/v1/sandboxes/{id}/ports/{port}",
            on(methods(), with_token_root),
        )
        .route(
            "/v1/sandboxes/{id}/ports/{port}/",
            on(methods(), with_token_root),
        )
        .route(
            "/v1/sandboxes/{id}/ports/{port}/{*path}",
            on(methods(), with_token),
        )
        .route("/p/{link}", on(methods(), signed_root))
        .route("/p/{link}/", on(methods(), signed_index))
        .route("/p/{link}/{*path}", on(methods(), signed))
}

/// The port of a path, or why it is not one.
fn port_of(s: &str) -> Result<u16, ApiError> {
    match s.parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(ApiError::BadRequest(format!(
            "`{}` is not a TCP port (1 to 65535)",
            s.chars().take(20).collect::<String>()
        ))),
    }
}

/// Segments of the API's path before the guest's: `/v1/sandboxes/{id}/ports/{port}/`.
const TOKEN_PREFIX: usize = 5;
/// And before a link's: `/p/{link}/`.
const LINK_PREFIX: usize = 2;

/// The path and query the guest's server gets: what follows the first `skip` segments of the
/// request's path (the port's, or the link's), as the client sent it: still percent-encoded,
/// so `%2F` and `%3F` reach the guest's server as the client wrote them.
fn guest_target(req: &Request, skip: usize) -> String {
    let rest = req
        .uri()
        .path()
        .splitn(skip + 2, '/')
        .nth(skip + 1)
        .unwrap_or("");
    let mut t = format!("/{rest}");
    if let Some(q) = req.uri().query() {
        t.push('?');
        t.push_str(q);
    }
    t
}

/// A route's path parameters, or the API's 400 for ones axum cannot read (not UTF-8).
fn params<T>(p: Result<Path<T>, PathRejection>) -> Result<T, ApiError> {
    p.map(|Path(t)| t)
        .map_err(|e| ApiError::BadRequest(format!("the path cannot be read: {}", e.body_text())))
}

async fn with_token_root(
    State(state): State<AppState>,
    p: Result<Path<(String, String)>, PathRejection>,
    req: Request,
) -> Result<Response, ApiError> {
    let (id, port) = params(p)?;
    let entry = state.registry().get(&id)?;
    let target = guest_target(&req, TOKEN_PREFIX);
    to_port(entry, port_of(&port)?, target, req).await
}

async fn with_token(
    State(state): State<AppState>,
    p: Result<Path<(String, String, String)>, PathRejection>,
    req: Request,
) -> Result<Response, ApiError> {
    let (id, port, _) = params(p)?;
    let entry = state.registry().get(&id)?;
    let target = guest_target(&req, TOKEN_PREFIX);
    to_port(entry, port_of(&port)?, target, req).await
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct UrlBody {
    /// Seconds the link lives.
    #[serde(default, deserialize_with = "crate::json::integral_present")]
    ttl_s: Option<u64>,
}

/// `POST …/ports/{port}/url` makes a signed link; any other method is the guest's `/url`.
async fn url_or_path(
    State(state): State<AppState>,
    p: Result<Path<(String, String)>, PathRejection>,
    req: Request,
) -> Result<Response, ApiError> {
    let (id, port) = params(p)?;
    let entry = state.registry().get(&id)?;
    let port = port_of(&port)?;
    if req.method() != axum::http::Method::POST {
        let target = guest_target(&req, TOKEN_PREFIX);
        return to_port(entry, port, target, req).await;
    }
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, 64 << 10)
        .await
        .map_err(|e| ApiError::BadRequest(format!("the body: {e}")))?;
    let body: UrlBody = if bytes.is_empty() {
        UrlBody::default()
    } else {
        super::json_body(&parts.headers, &bytes)?
    };
    let ttl = body.ttl_s.unwrap_or(port_link::DEFAULT_TTL_S);
    if !(1..=port_link::MAX_TTL_S).contains(&ttl) {
        return Err(ApiError::BadRequest(format!(
            "ttl_s must be 1 to {}, not {ttl}",
            port_link::MAX_TTL_S
        )));
    }
    let expires = now() + ttl;
    let link = port_link::sign(
        &port_link::key(state.token_digest()),
        &Grant {
            id: entry.id.clone(),
            port,
            expires,
        },
    );
    let path = format!("/p/{link}/");
    Ok(axum::Json(json!({
        "url": format!("{}{path}", origin(&parts.headers, serving_tls())),
        "path": path,
        "expires_at": crate::time::rfc3339(UNIX_EPOCH + Duration::from_secs(expires)),
    }))
    .into_response())
}

/// The origin a link is made for: the one the caller reached (through a fleet's gateway, the
/// gateway's, which it says in `X-Forwarded-Host` and `X-Forwarded-Proto`).
fn origin<'a>(headers: &'a HeaderMap, tls: bool) -> String {
    let get = |h: &str| {
        headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty() && !v.contains(['/', ' ', '\\', '@']))
    };
    // A host and an optional port, nothing else: what a link's URL may start with.
    let authority = |v: &'a str| {
        let a = v.parse::<axum::http::uri::Authority>().ok()?;
        let rebuilt = match a.port_u16() {
            Some(p) => format!("{}:{p}", a.host()),
            None => a.host().to_string(),
        };
        (rebuilt == v).then_some(v)
    };
    let host = get("x-forwarded-host")
        .and_then(authority)
        .or_else(|| get(header::HOST.as_str()).and_then(authority))
        .unwrap_or("localhost");
    let scheme = match get("x-forwarded-proto") {
        Some("https") => "https",
        Some(_) => "http",
        None if tls => "https",
        None => "http",
    };
    format!("{scheme}://{host}")
}

/// Whether this service serves https (`SANDBOX_HOST_TLS_CERT`, which it refuses to start
/// without when it is set but unusable).
fn serving_tls() -> bool {
    std::env::var_os(crate::tls::CERT_VAR).is_some_and(|v| !v.is_empty())
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `/p/<link>` without its slash: the page's relative links would lose the link; the same
/// path with it.
async fn signed_root(p: Result<Path<String>, PathRejection>) -> Response {
    let Ok(link) = params(p) else {
        return ApiError::LinkRefused(port_link::LinkError::Malformed.to_string()).into_response();
    };
    (
        axum::http::StatusCode::PERMANENT_REDIRECT,
        [(header::LOCATION, format!("/p/{link}/"))],
    )
        .into_response()
}

async fn signed(
    State(state): State<AppState>,
    p: Result<Path<(String, String)>, PathRejection>,
    req: Request,
) -> Result<Response, ApiError> {
    let (link, _) = params(p)?;
    let target = guest_target(&req, LINK_PREFIX);
    through_link(&state, &link, target, req, true).await
}

async fn signed_index(
    State(state): State<AppState>,
    p: Result<Path<String>, PathRejection>,
    req: Request,
) -> Result<Response, ApiError> {
    let link = params(p)?;
    let target = guest_target(&req, LINK_PREFIX);
    through_link(&state, &link, target, req, true).await
}

/// A path of no route: with a signed link's cookie (a guest's page loading `/src/main.ts` from
/// the root), the link's port; otherwise not found.
pub async fn by_cookie(State(state): State<AppState>, req: Request) -> Result<Response, ApiError> {
    let link = port_link::from_cookie(req.headers())
        .filter(|_| port_link::cookie_may_route(req.uri().path()));
    let Some(link) = link else {
        return Err(ApiError::NotFound("no such route; see docs/api.md".into()));
    };
    if !PASSED_ON.contains(req.method()) {
        return Err(ApiError::MethodNotAllowed(req.method().to_string()));
    }
    let target = req
        .uri()
        .path_and_query()
        .map_or("/".to_string(), |p| p.as_str().to_string());
    let mut res = through_link(&state, &link, target, req, false).await?;
    // The answer depends on the cookie: no cache may give it for the same path without it.
    let h = res.headers_mut();
    h.insert(header::VARY, HeaderValue::from_static("Cookie"));
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("private, no-store"),
    );
    Ok(res)
}

/// The methods of [`methods`], as a list.
const PASSED_ON: [axum::http::Method; 7] = [
    axum::http::Method::GET,
    axum::http::Method::HEAD,
    axum::http::Method::POST,
    axum::http::Method::PUT,
    axum::http::Method::PATCH,
    axum::http::Method::DELETE,
    axum::http::Method::OPTIONS,
];

/// `req` to the port `link` grants, once the link is checked; the link's cookie set on the
/// answer when `set_cookie` (the link's own path), so that the page's root paths follow it.
async fn through_link(
    state: &AppState,
    link: &str,
    target: String,
    req: Request,
    set_cookie: bool,
) -> Result<Response, ApiError> {
    let now = now();
    let grant = port_link::verify(&port_link::key(state.token_digest()), link, now)
        .map_err(|e| ApiError::LinkRefused(e.to_string()))?;
    let entry = state.registry().get(&grant.id)?;
    let mut res = to_port(entry, grant.port, target, req).await?;
    if set_cookie && res.status() != axum::http::StatusCode::SWITCHING_PROTOCOLS {
        let secure = if serving_tls() { "; Secure" } else { "" };
        let cookie = format!(
            "{}={link}; Path=/; Max-Age={}; HttpOnly; SameSite=Lax{secure}",
            port_link::COOKIE,
            grant.expires.saturating_sub(now)
        );
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            res.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    Ok(res)
}

/// The request the guest's server gets: as the caller sent it, to `target`, for
/// `localhost:<port>` (`Host`, and `Origin` when there is one, so that a dev server that checks
/// them, as Vite does, takes the request as its own), without the caller's credentials.
fn for_guest(req: Request, target: &str, port: u16, upgrade: bool) -> Result<Request, ApiError> {
    let (parts, body) = req.into_parts();
    let mut out = Request::builder()
        .method(parts.method)
        .uri(target)
        .body(body)
        .map_err(|e| ApiError::BadRequest(format!("the request cannot be passed on: {e}")))?;
    let h = out.headers_mut();
    // The end-to-end headers, less the caller's credentials (the host's token must never reach
    // a guest) and the `Referer`, which would hold a signed link.
    crate::gateway::proxy::pass_on(&parts.headers, h);
    h.remove(header::REFERER);
    // The link's cookie is the host's, not the guest server's (it would learn its own link).
    let cookies: Vec<String> = h
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|kv| {
            !kv.is_empty() && kv.split_once('=').map_or(*kv, |(k, _)| k) != port_link::COOKIE
        })
        .map(str::to_string)
        .collect();
    h.remove(header::COOKIE);
    if !cookies.is_empty()
        && let Ok(v) = HeaderValue::from_str(&cookies.join("; "))
    {
        h.insert(header::COOKIE, v);
    }
    let local = format!("localhost:{port}");
    h.insert(
        header::HOST,
        HeaderValue::from_str(&local).map_err(|e| ApiError::Internal(e.to_string()))?,
    );
    if h.contains_key(header::ORIGIN) {
        h.insert(
            header::ORIGIN,
            HeaderValue::from_str(&format!("http://{local}"))
                .map_err(|e| ApiError::Internal(e.to_string()))?,
        );
    }
    if upgrade {
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    }
    Ok(out)
}

/// Sends `req` to the guest's `port` as `target` and streams the answer back.
async fn to_port(
    entry: Arc<SandboxEntry>,
    port: u16,
    target: String,
    mut req: Request,
) -> Result<Response, ApiError> {
    let _entered = entry.enter()?;
    // A service worker registered from a guest's page would outlive its link and see every
    // later page of the API's origin (other sandboxes' links among them).
    if req.headers().contains_key("service-worker") {
        return Err(ApiError::LinkRefused(
            "a service worker cannot be registered through the sandbox host: a guest's pages \
             share its origin with every other sandbox's"
                .into(),
        ));
    }
    let upgrade = crate::gateway::proxy::wants_upgrade(req.headers());
    let client_side = upgrade.then(|| hyper::upgrade::on(&mut req));
    let req = for_guest(req, &target, port, upgrade)?;
    let (mut writer, mut download) = match entry.sandbox().client.port(port).await {
        Ok(c) => c,
        Err(e) => return Err(entry.explain(e).await),
    };
    let busy = entry.busy();
    let (hyper_side, relay_side) = tokio::io::duplex(PIPE);
    let (mut from_hyper, mut to_hyper) = tokio::io::split(relay_side);
    // The guest's bytes to hyper; its first failure (nothing listens) kept for the answer.
    let (failed_tx, mut failed_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let _busy = busy;
        while let Some(chunk) = download.next_chunk().await {
            match chunk {
                Ok(b) => {
                    if to_hyper.write_all(&b).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = failed_tx.send(e);
                    break;
                }
            }
        }
        let _ = to_hyper.shutdown().await;
    });
    // Hyper's bytes to the guest; its end a half-close the guest's server sees.
    tokio::spawn(async move {
        let mut buf = vec![0u8; sandbox_protocol::DATA_CHUNK];
        loop {
            match from_hyper.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if writer.write(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
        let _ = writer.close().await;
    });
    let io = hyper_util::rt::TokioIo::new(hyper_side);
    let (mut sender, conn) = hyper::client::conn::http1::handshake::<_, Body>(io)
        .await
        .map_err(|e| ApiError::Internal(format!("a connection to the guest's port: {e}")))?;
    tokio::spawn(conn.with_upgrades());
    let answered = tokio::time::timeout(ANSWER_TIMEOUT, sender.send_request(req)).await;
    let mut res = match answered {
        Ok(Ok(res)) => res,
        Ok(Err(e)) => {
            // Sent before the pipe closed, so there by the time hyper saw the end (waiting for
            // it could wait for a guest that sends nothing more).
            return Err(match failed_rx.try_recv() {
                Ok(sandbox_protocol::client::ClientError::Agent(m))
                    if m.code == sandbox_protocol::message::code::REFUSED =>
                {
                    ApiError::PortClosed(format!(
                        "{}: start the server in the sandbox first, listening on 127.0.0.1 or \
                         0.0.0.0",
                        m.message
                    ))
                }
                Ok(other) => entry.explain(other).await,
                Err(_) => ApiError::PortClosed(format!(
                    "the server on port {port} in the sandbox did not answer the request as \
                     HTTP/1.1 ({e})"
                )),
            });
        }
        Err(_) => {
            return Err(ApiError::PortClosed(format!(
                "the server on port {port} in the sandbox did not answer within {} s",
                ANSWER_TIMEOUT.as_secs()
            )));
        }
    };
    let switched = res.status() == axum::http::StatusCode::SWITCHING_PROTOCOLS;
    if switched && client_side.is_none() {
        return Err(ApiError::PortClosed(format!(
            "the server on port {port} in the sandbox switched protocols (101) on a request that \
             did not ask to"
        )));
    }
    let guest_side = switched.then(|| hyper::upgrade::on(&mut res));
    let (parts, incoming) = res.into_parts();
    let mut back = Response::builder()
        .status(parts.status)
        .body(Body::new(incoming))
        .map_err(|e| ApiError::Internal(format!("the guest's answer: {e}")))?;
    crate::gateway::proxy::pass_on(&parts.headers, back.headers_mut());
    unsafe_for_the_origin(back.headers_mut());
    if let (Some(client_side), Some(guest_side)) = (client_side, guest_side) {
        back.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        back.headers_mut()
            .insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        tokio::spawn(crate::gateway::proxy::join(client_side, guest_side));
    }
    Ok(back)
}

/// What a guest's answer may not set on the API's origin, which every signed link shares: a
/// service worker's reach beyond its path, the clearing of the origin's storage, and the link's
/// own cookie (which would send the browser's next requests to another port).
fn unsafe_for_the_origin(h: &mut HeaderMap) {
    h.remove("service-worker-allowed");
    h.remove("clear-site-data");
    let kept: Vec<HeaderValue> = h
        .get_all(header::SET_COOKIE)
        .iter()
        .filter(|v| {
            !v.to_str().is_ok_and(|c| {
                c.trim_start()
                    .to_ascii_lowercase()
                    .starts_with(&format!("{}=", port_link::COOKIE))
            })
        })
        .cloned()
        .collect();
    h.remove(header::SET_COOKIE);
    for v in kept {
        h.append(header::SET_COOKIE, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guest_never_gets_the_token_and_its_host_is_its_own() {
        let req = Request::builder()
            .method("POST")
            .uri("/v1/sandboxes/sbx-1/ports/5173/src/main.ts?t=1")
            .header("authorization", "Bearer the-host-token")
            .header("host", "sandboxes.example.com")
            .header("origin", "https://sandboxes.example.com")
            .header("referer", "https://sandboxes.example.com/p/secret-link/")
            .header("connection", "x-hop")
            .header("x-hop", "1")
            .header("accept", "text/html")
            .header("cookie", "theme=dark; sandbox_port_link=the-link; lang=en")
            .body(Body::empty())
            .unwrap();
        let out = for_guest(req, "/src/main.ts?t=1", 5173, false).unwrap();
        assert_eq!(out.uri(), "/src/main.ts?t=1");
        let h = out.headers();
        assert!(h.get("authorization").is_none());
        assert!(h.get("referer").is_none());
        assert!(h.get("x-hop").is_none());
        assert_eq!(h["host"], "localhost:5173");
        assert_eq!(h["origin"], "http://localhost:5173");
        assert_eq!(h["accept"], "text/html");
        assert_eq!(h["cookie"], "theme=dark; lang=en");
    }

    #[test]
    fn a_guest_answer_cannot_reach_past_its_link() {
        let mut h = HeaderMap::new();
        h.insert("service-worker-allowed", HeaderValue::from_static("/"));
        h.insert("clear-site-data", HeaderValue::from_static("\"*\""));
        h.append(
            header::SET_COOKIE,
            HeaderValue::from_static("session=1; Path=/"),
        );
        h.append(
            header::SET_COOKIE,
            HeaderValue::from_static("Sandbox_Port_Link=other; Path=/"),
        );
        unsafe_for_the_origin(&mut h);
        assert!(h.get("service-worker-allowed").is_none());
        assert!(h.get("clear-site-data").is_none());
        let cookies: Vec<_> = h.get_all(header::SET_COOKIE).iter().collect();
        assert_eq!(cookies, ["session=1; Path=/"]);
    }

    #[test]
    fn ports_and_origins_are_read_strictly() {
        assert_eq!(port_of("5173").unwrap(), 5173);
        for bad in ["0", "65536", "-1", "http", ""] {
            assert!(port_of(bad).is_err(), "{bad}");
        }
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:3004"));
        assert_eq!(origin(&h, false), "http://127.0.0.1:3004");
        assert_eq!(origin(&h, true), "https://127.0.0.1:3004");
        h.insert(
            "x-forwarded-host",
            HeaderValue::from_static("gw.example.com"),
        );
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        assert_eq!(origin(&h, false), "https://gw.example.com");
        h.insert("x-forwarded-host", HeaderValue::from_static("evil.com/x"));
        assert_eq!(origin(&h, false), "https://127.0.0.1:3004");
        for bad in ["evil.com?x", "evil.com#x", "a:b:c", "evil.com:port"] {
            h.insert("x-forwarded-host", HeaderValue::from_static(bad));
            assert_eq!(origin(&h, false), "https://127.0.0.1:3004", "{bad}");
        }
        h.insert("x-forwarded-host", HeaderValue::from_static("[::1]:8443"));
        assert_eq!(origin(&h, false), "https://[::1]:8443");
    }

    #[test]
    fn the_guest_gets_the_path_as_the_client_wrote_it() {
        let target = |uri: &str, skip: usize| {
            let req = axum::http::Request::builder()
                .uri(uri)
                .body(axum::body::Body::empty())
                .unwrap();
            guest_target(&req, skip)
        };
        for (uri, skip, want) in [
            (
                "/v1/sandboxes/sbx-1/ports/8080/a%2Fb%3Fc?x=1",
                TOKEN_PREFIX,
                "/a%2Fb%3Fc?x=1",
            ),
            ("/v1/sandboxes/sbx-1/ports/8080/", TOKEN_PREFIX, "/"),
            ("/v1/sandboxes/sbx-1/ports/8080", TOKEN_PREFIX, "/"),
            ("/v1/sandboxes/sbx-1/ports/8080/url", TOKEN_PREFIX, "/url"),
            (
                "/v1/sandboxes/sbx-1/ports/8080/src/../x",
                TOKEN_PREFIX,
                "/src/../x",
            ),
            ("/p/LINK/src/main.ts?t=1", LINK_PREFIX, "/src/main.ts?t=1"),
            ("/p/LINK/%2e%2e/x", LINK_PREFIX, "/%2e%2e/x"),
            ("/p/LINK/", LINK_PREFIX, "/"),
        ] {
            assert_eq!(target(uri, skip), want, "{uri}");
        }
    }
}
