//! Archives and files in and out of a guest, streamed both ways: an upload goes to the agent as
//! it arrives (never held whole in memory), a download goes to the client as the agent sends it.

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::put;
use http_body_util::BodyExt;
use sandbox_protocol::client::{Download, Upload};
use serde::Deserialize;

use super::{SandboxId, channel_body, too_large};
use crate::error::ApiError;
use crate::registry::{SandboxEntry, count};
use crate::state::AppState;

pub fn router() -> Router<AppState> {
    Router::new()
        .route(
            "/v1/sandboxes/{id}/archive",
            put(put_archive).get(get_archive),
        )
        .route("/v1/sandboxes/{id}/files", put(put_file).get(get_file))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ArchiveQuery {
    #[serde(default = "workspace")]
    path: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileQuery {
    path: String,
    /// Permission bits in octal, e.g. `755`.
    #[serde(default)]
    mode: Option<String>,
}

fn workspace() -> String {
    "/workspace".into()
}

fn absolute(path: &str) -> Result<&str, ApiError> {
    if !path.starts_with('/') || path.contains('\0') || path.len() > 4096 {
        return Err(ApiError::BadRequest(format!(
            "path `{}` is not an absolute path",
            path.chars().take(200).collect::<String>()
        )));
    }
    Ok(path)
}

fn query<T: serde::de::DeserializeOwned>(
    q: Result<Query<T>, axum::extract::rejection::QueryRejection>,
) -> Result<T, ApiError> {
    q.map(|Query(v)| v)
        .map_err(|e| ApiError::BadRequest(e.body_text()))
}

async fn put_archive(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
    q: Result<Query<ArchiveQuery>, axum::extract::rejection::QueryRejection>,
    req: Request,
) -> Result<StatusCode, ApiError> {
    let q = query(q)?;
    let entry = state.registry().get(&id)?;
    entry.ensure_alive()?;
    let upload = entry
        .check(
            entry
                .sandbox
                .client
                .archive_upload(absolute(&q.path)?)
                .await,
        )
        .await?;
    stream_in(&state, &entry, upload, req.into_body()).await
}

async fn put_file(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
    q: Result<Query<FileQuery>, axum::extract::rejection::QueryRejection>,
    req: Request,
) -> Result<StatusCode, ApiError> {
    let q = query(q)?;
    let mode = match &q.mode {
        Some(m) => Some(
            u32::from_str_radix(m, 8)
                .ok()
                .filter(|m| *m <= 0o7777)
                .ok_or_else(|| {
                    ApiError::BadRequest(format!(
                        "mode `{m}` is not octal permission bits like 644"
                    ))
                })?,
        ),
        None => None,
    };
    let entry = state.registry().get(&id)?;
    entry.ensure_alive()?;
    let upload = entry
        .check(
            entry
                .sandbox
                .client
                .file_upload(absolute(&q.path)?, mode)
                .await,
        )
        .await?;
    stream_in(&state, &entry, upload, req.into_body()).await
}

/// Copies a request body into an upload, counting against the body limit as it goes (for bodies
/// without a declared length, which the middleware could not refuse up front).
async fn stream_in(
    state: &AppState,
    entry: &std::sync::Arc<SandboxEntry>,
    mut upload: Upload,
    mut body: Body,
) -> Result<StatusCode, ApiError> {
    let _busy = entry.busy();
    let max = state.config().max_body;
    let mut total: u64 = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame
            .map_err(|e| ApiError::BadRequest(format!("reading the request body failed: {e}")))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len() as u64;
        if total > max {
            // Dropping the upload cancels it in the guest.
            return Err(too_large(state));
        }
        entry.check(upload.write(&data).await).await?;
        count(
            &entry.counters.bytes_in,
            &state.metrics().bytes_in,
            data.len() as u64,
        );
    }
    entry.check(upload.finish().await).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn get_archive(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
    q: Result<Query<ArchiveQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let entry = state.registry().get(&id)?;
    entry.ensure_alive()?;
    let dl = entry
        .check(entry.sandbox.client.get_archive(absolute(&q.path)?).await)
        .await?;
    stream_out(state, entry, dl, "application/x-tar").await
}

async fn get_file(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
    q: Result<Query<FileQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let entry = state.registry().get(&id)?;
    entry.ensure_alive()?;
    let dl = entry
        .check(entry.sandbox.client.get_file(absolute(&q.path)?).await)
        .await?;
    stream_out(state, entry, dl, "application/octet-stream").await
}

/// Waits for the first chunk (so a missing path is a 404, not a broken 200), then streams.
async fn stream_out(
    state: AppState,
    entry: std::sync::Arc<SandboxEntry>,
    mut dl: Download,
    content_type: &'static str,
) -> Result<Response, ApiError> {
    let first = match dl.next_chunk().await {
        Some(Ok(b)) => Some(b),
        Some(Err(e)) => return Err(entry.explain(e).await),
        None => None,
    };
    let (tx, body) = channel_body(4);
    let busy = entry.busy();
    tokio::spawn(async move {
        let _busy = busy;
        let mut next = first;
        loop {
            let Some(chunk) = next.take() else { break };
            count(
                &entry.counters.bytes_out,
                &state.metrics().bytes_out,
                chunk.len() as u64,
            );
            if tx.send(Ok(chunk.to_vec())).await.is_err() {
                return;
            }
            match dl.next_chunk().await {
                Some(Ok(b)) => next = Some(b),
                // A failure after the status was sent: abort the response, so the client sees
                // an error rather than a stream that merely ends early.
                Some(Err(e)) => {
                    tracing::warn!(id = %entry.id, error = %e, "a download from a guest failed midway");
                    let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
                    return;
                }
                None => break,
            }
        }
    });
    Ok(([(header::CONTENT_TYPE, content_type)], Body::new(body)).into_response())
}
