//! The HTTP routes of `/v1` and `/metrics`, one router per resource, merged behind the token.

mod exec;
mod fork;
pub mod health;
mod observe;
mod pause;
pub(crate) mod ports;
mod pty;
pub mod sandboxes;
mod transfer;

pub use pty::MAX_MESSAGE as PTY_MAX_MESSAGE;

use axum::Router;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Request};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

use crate::error::ApiError;
use crate::state::AppState;

/// Every (method, path) the API serves; `docs/openapi.json` must list exactly these (tested
/// here, and the end-to-end tests request every documented route on the real binary). A
/// fleet's gateway serves the routes of one sandbox from this list, so a method a route does
/// not take is its `405`, as on a host.
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/v1/health"),
    ("PUT", "/v1/hosts/{name}/drain"),
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes/{id}"),
    ("DELETE", "/v1/sandboxes/{id}"),
    ("POST", "/v1/sandboxes/{id}/keepalive"),
    ("POST", "/v1/sandboxes/{id}/pause"),
    ("POST", "/v1/sandboxes/{id}/resume"),
    ("POST", "/v1/sandboxes/{id}/fork"),
    ("PUT", "/v1/sandboxes/{id}/archive"),
    ("GET", "/v1/sandboxes/{id}/archive"),
    ("PUT", "/v1/sandboxes/{id}/files"),
    ("GET", "/v1/sandboxes/{id}/files"),
    ("GET", "/v1/sandboxes/{id}/watch"),
    ("POST", "/v1/sandboxes/{id}/exec"),
    ("GET", "/v1/sandboxes/{id}/pty"),
    ("GET", "/v1/sandboxes/{id}/ports/{port}/{path}"),
    ("POST", "/v1/sandboxes/{id}/ports/{port}/{path}"),
    ("PUT", "/v1/sandboxes/{id}/ports/{port}/{path}"),
    ("PATCH", "/v1/sandboxes/{id}/ports/{port}/{path}"),
    ("DELETE", "/v1/sandboxes/{id}/ports/{port}/{path}"),
    ("POST", "/v1/sandboxes/{id}/ports/{port}/url"),
    ("GET", "/p/{link}/{path}"),
    ("POST", "/p/{link}/{path}"),
    ("PUT", "/p/{link}/{path}"),
    ("PATCH", "/p/{link}/{path}"),
    ("DELETE", "/p/{link}/{path}"),
    ("GET", "/v1/sandboxes/{id}/egress"),
    ("GET", "/v1/sandboxes/{id}/usage"),
    ("GET", "/metrics"),
];

/// The whole application.
pub fn app(state: AppState) -> Router {
    let max_body = state.config().max_body;
    Router::new()
        .merge(health::router())
        .merge(sandboxes::router())
        .merge(pause::router())
        .merge(fork::router())
        .merge(exec::router())
        .merge(pty::router())
        .merge(ports::router())
        .merge(transfer::router())
        .merge(observe::router())
        .fallback(ports::by_cookie)
        .layer(middleware::from_fn(json_405))
        .layer(DefaultBodyLimit::max(
            usize::try_from(max_body).unwrap_or(usize::MAX),
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            declared_length,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::auth::require_token,
        ))
        .with_state(state)
}

/// axum answers a known route asked with a method it does not take with a bare 405 (and adds
/// the `Allow` header outside this layer); this gives that answer the API's JSON error.
pub(crate) async fn json_405(req: Request, next: Next) -> Response {
    let method = req.method().to_string();
    let res = next.run(req).await;
    if res.status() != axum::http::StatusCode::METHOD_NOT_ALLOWED {
        return res;
    }
    ApiError::MethodNotAllowed(method).into_response()
}

/// Refuses a body whose declared length is over the limit before reading any of it.
async fn declared_length(
    axum::extract::State(state): axum::extract::State<AppState>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if declared_over(req.headers(), state.config().max_body) {
        return Err(too_large(&state));
    }
    Ok(next.run(req).await)
}

/// Whether a request declares a body longer than `max` bytes (`Content-Length`).
pub fn declared_over(headers: &axum::http::HeaderMap, max: u64) -> bool {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|n| n > max)
}

/// The 413 error for this host's limit.
pub fn too_large(state: &AppState) -> ApiError {
    ApiError::TooLarge {
        bytes: state.config().max_body,
        mb: state.config().max_body_mb,
    }
}

/// The sandbox id of a route's path. An id axum cannot take (not UTF-8 once percent-decoded,
/// like `%ff`) is this API's JSON 400 instead of axum's plain-text one.
pub struct SandboxId(pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for SandboxId {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<String>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(id)) => Ok(SandboxId(id)),
            Err(e) => Err(ApiError::BadRequest(format!(
                "the sandbox id in the path cannot be read: {}",
                e.body_text()
            ))),
        }
    }
}

/// A small JSON body already read, checked as [`ApiJson`] checks one (its type, then its
/// fields), for a fleet's gateway, which must refuse what a host refuses in the same words.
pub(crate) fn json_body<T: DeserializeOwned>(
    headers: &axum::http::HeaderMap,
    bytes: &[u8],
) -> Result<T, ApiError> {
    if !json_content_type(headers) {
        return Err(ApiError::BadRequest(
            "send the body as JSON with Content-Type: application/json".into(),
        ));
    }
    axum::Json::<T>::from_bytes(bytes)
        .map(|axum::Json(v)| v)
        .map_err(|e| ApiError::BadRequest(e.body_text()))
}

/// A JSON body whose rejections come back as this API's errors (400 naming the field, 413).
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T>
where
    AppState: axum::extract::FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let app = <AppState as axum::extract::FromRef<S>>::from_ref(state);
        if !json_content_type(req.headers()) {
            return Err(ApiError::BadRequest(
                "send the body as JSON with Content-Type: application/json".into(),
            ));
        }
        let bytes = match axum::body::Bytes::from_request(req, state).await {
            Ok(b) => b,
            Err(r) if r.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE => {
                return Err(too_large(&app));
            }
            Err(r) => return Err(ApiError::BadRequest(r.body_text())),
        };
        let parsed = axum::Json::<T>::from_bytes(&bytes);
        // A create's body holds the run's secrets: overwritten once read, when this is its only
        // reference (issue 32: the network process keeps them, the service does not).
        if let Ok(mut owned) = bytes.try_into_mut() {
            zeroize::Zeroize::zeroize(&mut owned[..]);
        }
        match parsed {
            Ok(axum::Json(v)) => Ok(ApiJson(v)),
            Err(JsonRejection::BytesRejection(r))
                if r.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE =>
            {
                Err(too_large(&app))
            }
            Err(JsonRejection::MissingJsonContentType(_)) => Err(ApiError::BadRequest(
                "send the body as JSON with Content-Type: application/json".into(),
            )),
            Err(e) => Err(ApiError::BadRequest(e.body_text())),
        }
    }
}

/// Whether a request says its body is JSON, as `axum::Json` decides it (`application/json`, or
/// any `application/*+json`).
fn json_content_type(headers: &axum::http::HeaderMap) -> bool {
    let Some(ct) = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence
        .strip_prefix("application/")
        .is_some_and(|sub| sub == "json" || sub.ends_with("+json"))
}

/// A response body fed through a bounded channel, so a slow client slows the producer (and, for
/// an exec, the guest process) instead of growing memory. An `Err` item aborts the response, so a
/// client never takes a stream cut by a failure for a complete one.
pub struct ChannelBody {
    rx: tokio::sync::mpsc::Receiver<Result<Vec<u8>, std::io::Error>>,
}

/// A body and the sender that feeds it, holding at most `depth` chunks.
pub fn channel_body(
    depth: usize,
) -> (
    tokio::sync::mpsc::Sender<Result<Vec<u8>, std::io::Error>>,
    ChannelBody,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(depth);
    (tx, ChannelBody { rx })
}

impl http_body::Body for ChannelBody {
    type Data = axum::body::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        self.rx
            .poll_recv(cx)
            .map(|o| o.map(|r| r.map(|b| http_body::Frame::data(b.into()))))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// `docs/openapi.json` documents exactly the routes the router serves (the end-to-end test
    /// also requests each of them on the real binary).
    #[test]
    fn openapi_lists_exactly_the_routes() {
        let doc: serde_json::Value =
            serde_json::from_str(include_str!("../../../docs/openapi.json")).unwrap();
        let mut documented = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                documented.insert((method.to_uppercase(), path.clone()));
            }
        }
        let served: BTreeSet<(String, String)> = super::ROUTES
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();
        assert_eq!(documented, served);
    }
}
