//! Archives and files in and out of a guest, streamed both ways: an upload goes to the agent as
//! it arrives (never held whole in memory), a download goes to the client as the agent sends it.

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::put;
use http_body_util::BodyExt;
use sandbox_protocol::client::{ClientError, Download, Upload};
use sandbox_protocol::message::code;
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
        .route("/v1/sandboxes/{id}/watch", axum::routing::get(watch))
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WatchQuery {
    #[serde(default = "workspace")]
    path: String,
    #[serde(default)]
    recursive: bool,
    /// Ends the stream after this long.
    #[serde(default)]
    timeout_ms: Option<u64>,
}

fn workspace() -> String {
    "/workspace".into()
}

/// Longest path the guest's kernel takes (PATH_MAX less its NUL), and longest name in it.
const PATH_MAX_BYTES: usize = 4095;
const NAME_MAX_BYTES: usize = 255;

fn absolute(path: &str) -> Result<&str, ApiError> {
    let shown = || path.chars().take(200).collect::<String>();
    if !path.starts_with('/') || path.contains('\0') {
        return Err(ApiError::BadRequest(format!(
            "path `{}` is not an absolute path",
            shown()
        )));
    }
    // Checked here: the guest would fail it as an I/O error (ENAMETOOLONG), a 500.
    if path.len() > PATH_MAX_BYTES || path.split('/').any(|n| n.len() > NAME_MAX_BYTES) {
        return Err(ApiError::BadRequest(format!(
            "path `{}…` is too long: a path has at most {PATH_MAX_BYTES} bytes and each name in it \
             at most {NAME_MAX_BYTES} (UTF-8)",
            shown()
        )));
    }
    Ok(path)
}

/// A failure of the agent on these routes, explained. The agent reports what the guest's kernel
/// refused for the path (a directory where a file was asked for or the other way round, a
/// read-only or kernel file system, no permission, a name that grows too long inside an archive)
/// as `io`. That depends on what is in the guest now, not on the request alone, and is not a
/// failure of the host: 409 `path_refused`, with the agent's message, which names the path and the
/// kernel's reason. A VM that died is still 410.
async fn explain(entry: &SandboxEntry, e: ClientError) -> ApiError {
    match e {
        ClientError::Agent(m) if m.code == code::IO => ApiError::PathRefused(format!(
            "the guest refused the path: {}; check what is at that path in the sandbox",
            m.message
        )),
        e => entry.explain(e).await,
    }
}

/// `Ok` as it is, or the failure [`explain`]ed.
async fn checked<T>(entry: &SandboxEntry, r: Result<T, ClientError>) -> Result<T, ApiError> {
    match r {
        Ok(v) => Ok(v),
        Err(e) => Err(explain(entry, e).await),
    }
}

/// The first name of `path` taken as written, `.` and `..` resolved (`None` for `/`).
fn first_name(path: &str) -> Option<&str> {
    let mut names: Vec<&str> = vec![];
    for n in path.split('/') {
        match n {
            "" | "." => {}
            ".." => {
                names.pop();
            }
            n => names.push(n),
        }
    }
    names.first().copied()
}

/// A directory that can be read as a tar stream: not `/` and nothing in /proc or /sys (the path
/// taken as written, `.` and `..` resolved). Those are the kernel's file systems: their files do
/// not hold what their sizes say, and entries vanish while they are read, so the stream broke
/// midway after its 200 (or, in /proc, never ended).
fn archivable(path: &str) -> Result<&str, ApiError> {
    if matches!(first_name(path), None | Some("proc") | Some("sys")) {
        return Err(ApiError::BadRequest(format!(
            "`{}` is or holds /proc or /sys, the kernel's file systems, which cannot be read as \
             an archive (their files change while they are read); archive a directory below /, \
             such as /workspace",
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
    let _entered = entry.enter()?;
    let upload = checked(
        &entry,
        entry
            .sandbox()
            .client
            .archive_upload(absolute(&q.path)?)
            .await,
    )
    .await?;
    stream_in(&state, &entry, upload, req.into_body(), Empty::Refused).await
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
    let _entered = entry.enter()?;
    let upload = checked(
        &entry,
        entry
            .sandbox()
            .client
            .file_upload(absolute(&q.path)?, mode)
            .await,
    )
    .await?;
    stream_in(&state, &entry, upload, req.into_body(), Empty::Allowed).await
}

/// Whether an upload may have no bytes: a file may be empty, an archive may not (no bytes are
/// not a tar stream: the body was left out).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Empty {
    Allowed,
    Refused,
}

/// Copies a request body into an upload, counting against the body limit as it goes (for bodies
/// without a declared length, which the middleware could not refuse up front).
async fn stream_in(
    state: &AppState,
    entry: &std::sync::Arc<SandboxEntry>,
    mut upload: Upload,
    mut body: Body,
    empty: Empty,
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
        checked(entry, upload.write(&data).await).await?;
        count(
            &entry.counters.bytes_in,
            &state.metrics().bytes_in,
            data.len() as u64,
        );
    }
    if total == 0 && empty == Empty::Refused {
        // Dropping the upload cancels it in the guest: nothing was extracted.
        return Err(ApiError::BadRequest(
            "the request body is empty: send the archive as a tar or tar.gz stream \
             (Content-Type: application/x-tar or application/gzip)"
                .into(),
        ));
    }
    checked(entry, upload.finish().await).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn get_archive(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
    q: Result<Query<ArchiveQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let entry = state.registry().get(&id)?;
    let _entered = entry.enter()?;
    let path = archivable(absolute(&q.path)?)?;
    let dl = checked(&entry, entry.sandbox().client.get_archive(path).await).await?;
    stream_out(state, entry, dl, "application/x-tar").await
}

async fn get_file(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
    q: Result<Query<FileQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let entry = state.registry().get(&id)?;
    let _entered = entry.enter()?;
    let dl = entry
        .check(entry.sandbox().client.get_file(absolute(&q.path)?).await)
        .await?;
    stream_out(state, entry, dl, "application/octet-stream").await
}

/// `GET /v1/sandboxes/{id}/watch`: the file events of a guest's directory as NDJSON, from the
/// agent's inotify (issue 35), for as long as the client reads or until `timeout_ms`; the first
/// line says the watch is set. The stream keeps the sandbox from being idle, as a running
/// command does.
async fn watch(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
    q: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let deadline = match q.timeout_ms {
        None => None,
        Some(ms @ 1..=86_400_000) => {
            Some(tokio::time::Instant::now() + std::time::Duration::from_millis(ms))
        }
        Some(ms) => {
            return Err(ApiError::BadRequest(format!(
                "timeout_ms must be between 1 and 86400000, not {ms}"
            )));
        }
    };
    let path = watchable(absolute(&q.path)?)?;
    let entry = state.registry().get(&id)?;
    let _entered = entry.enter()?;
    let mut dl = entry
        .check(entry.sandbox().client.watch(path, q.recursive).await)
        .await?;
    // The first line (`ready`) before the answer: a path that cannot be watched is its error.
    let first = match dl.next_chunk().await {
        Some(Ok(b)) => b,
        Some(Err(e)) => return Err(explain(&entry, e).await),
        None => return Err(ApiError::Internal("the watch ended before it began".into())),
    };
    let (tx, body) = channel_body(4);
    let busy = entry.busy();
    tokio::spawn(async move {
        let _busy = busy;
        let mut next = Some(first);
        while let Some(chunk) = next.take() {
            if tx.send(Ok(chunk.to_vec())).await.is_err() {
                return;
            }
            let more = match deadline {
                Some(d) => match tokio::time::timeout_at(d, dl.next_chunk()).await {
                    Ok(more) => more,
                    Err(_) => {
                        let end = b"{\"event\":\"end\",\"reason\":\"timeout\"}\n".to_vec();
                        let _ = tx.send(Ok(end)).await;
                        return;
                    }
                },
                None => dl.next_chunk().await,
            };
            match more {
                Some(Ok(b)) => next = Some(b),
                Some(Err(e)) => {
                    tracing::warn!(id = %entry.id, error = %e, "a watch of a guest failed midway");
                    let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
                    return;
                }
                None => return,
            }
        }
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::new(body),
    )
        .into_response())
}

/// A directory that can be watched: nothing in /proc, /sys or /dev (the path taken as written,
/// `.` and `..` resolved), whose files the kernel makes and changes without telling inotify.
fn watchable(path: &str) -> Result<&str, ApiError> {
    if matches!(first_name(path), Some("proc") | Some("sys") | Some("dev")) {
        return Err(ApiError::BadRequest(format!(
            "`{}` is in /proc, /sys or /dev, the kernel's file systems, whose changes inotify \
             does not see; watch a directory such as /workspace",
            path.chars().take(200).collect::<String>()
        )));
    }
    Ok(path)
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
        Some(Err(e)) => return Err(explain(&entry, e).await),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by schemathesis: a path of 4096 bytes, or one with a name over 255 bytes, went to
    /// the guest, whose ENAMETOOLONG came back as 500 internal.
    /// Found by schemathesis: GET archive of `/` answered 200, then the stream broke when the
    /// agent reached a process that had gone from /proc.
    #[test]
    fn root_proc_and_sys_are_not_archived() {
        for bad in [
            "/",
            "//",
            "/.",
            "/proc",
            "/proc/1",
            "/sys/",
            "/workspace/../proc",
            "/a/../..",
        ] {
            assert!(archivable(bad).is_err(), "{bad}");
        }
        for ok in [
            "/workspace",
            "/dev",
            "/etc/../workspace",
            "/procfs",
            "/a/proc",
        ] {
            assert_eq!(archivable(ok).unwrap(), ok);
        }
    }

    #[test]
    fn paths_too_long_for_the_guest_are_bad_requests() {
        let name = "n".repeat(255);
        assert!(absolute(&format!("/{name}")).is_ok());
        let long = format!("/{}", [name.as_str(); 16].join("/"));
        assert_eq!(long.len(), 4096);
        assert!(absolute(&long[..4095]).is_ok());
        for bad in [
            long.clone(),
            format!("/{name}n"),
            format!("/a/{}/b", "é".repeat(128)),
        ] {
            let e = absolute(&bad).unwrap_err();
            assert!(
                matches!(&e, ApiError::BadRequest(m) if m.contains("too long")),
                "{e}"
            );
        }
        assert!(absolute("relative").is_err() && absolute("/a\0b").is_err());
    }
}
