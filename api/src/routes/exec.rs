//! `POST /v1/sandboxes/{id}/exec`: a command, its output streamed as NDJSON lines as it happens.

use std::collections::BTreeMap;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use sandbox_protocol::client::{ClientError, ExecEvent};
use sandbox_protocol::message::ExecRequest;
use serde::Deserialize;
use serde_json::json;

use super::{ApiJson, SandboxId, channel_body};
use crate::error::ApiError;
use crate::json::{integral_present, present};
use crate::registry::{SandboxEntry, count};
use crate::state::{AppState, Ending};

pub fn router() -> Router<AppState> {
    Router::new().route("/v1/sandboxes/{id}/exec", post(exec))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExecBody {
    #[serde(default, deserialize_with = "present")]
    argv: Option<Vec<String>>,
    #[serde(default, deserialize_with = "present")]
    command: Option<String>,
    #[serde(default, deserialize_with = "present")]
    cwd: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    /// Base64 of the bytes to send to stdin (then stdin is closed).
    #[serde(default, deserialize_with = "present")]
    stdin: Option<String>,
    #[serde(default, deserialize_with = "integral_present")]
    timeout_ms: Option<u64>,
}

/// One NDJSON line.
fn line(v: &serde_json::Value) -> Vec<u8> {
    let mut b = serde_json::to_vec(v).unwrap_or_default();
    b.push(b'\n');
    b
}

impl ExecBody {
    /// Refuses a body the agent would not run (what to run given twice or not at all, a
    /// relative `cwd`); the stdin it carries, decoded.
    fn check(&self) -> Result<Option<Vec<u8>>, ApiError> {
        match (&self.argv, &self.command) {
            (Some(_), Some(_)) => {
                return Err(ApiError::BadRequest(
                    "give either argv or command, not both".into(),
                ));
            }
            (None, None) => {
                return Err(ApiError::BadRequest(
                    "give argv (a list) or command (a shell string)".into(),
                ));
            }
            (Some(a), None) if a.is_empty() => {
                return Err(ApiError::BadRequest("argv is empty".into()));
            }
            _ => {}
        }
        if let Some(cwd) = &self.cwd
            && !cwd.starts_with('/')
        {
            return Err(ApiError::BadRequest(format!(
                "cwd `{cwd}` is not an absolute path"
            )));
        }
        match &self.stdin {
            Some(s) => B64
                .decode(s)
                .map(Some)
                .map_err(|e| ApiError::BadRequest(format!("stdin is not valid base64: {e}"))),
            None => Ok(None),
        }
    }
}

/// The NDJSON line of one event of the process (its output counted as it passes).
async fn event_line(
    ev: Result<ExecEvent, ClientError>,
    entry: &SandboxEntry,
    state: &AppState,
) -> Vec<u8> {
    let (stream, b) = match ev {
        Ok(ExecEvent::Stdout(b)) => ("stdout", b),
        Ok(ExecEvent::Stderr(b)) => ("stderr", b),
        Ok(ExecEvent::Exit(s)) => {
            return line(&json!({
                "exit_code": s.exit_code, "signal": s.signal, "timed_out": s.timed_out, "duration_ms": s.duration_ms
            }));
        }
        Err(e) => {
            let err = entry.explain(e).await;
            return line(&json!({ "error": err.to_string(), "code": err.status_and_code().1 }));
        }
    };
    count(
        &entry.counters.bytes_out,
        &state.metrics().bytes_out,
        b.len() as u64,
    );
    line(&json!({ stream: B64.encode(&b) }))
}

async fn exec(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
    body: Result<ApiJson<ExecBody>, ApiError>,
) -> Result<Response, ApiError> {
    // An unknown or dead sandbox is the answer before anything about the body.
    let entry = state.registry().get(&id)?;
    let _entered = entry.enter()?;
    let ApiJson(body) = body?;
    let stdin = body.check()?;
    let mut env = entry.env.clone();
    env.extend(body.env);
    let req = ExecRequest {
        argv: body.argv,
        command: body.command,
        env,
        cwd: body.cwd,
        stdin: stdin.is_some(),
        timeout_ms: body.timeout_ms,
        pty: None,
    };
    let exec = entry.check(entry.sandbox().client.exec(&req).await).await?;
    count(&entry.counters.execs, &state.metrics().execs, 1);

    let busy = entry.busy();
    let (tx, body) = channel_body(8);
    if let (Some(mut sink), Some(data)) = (exec.stdin, stdin) {
        count(
            &entry.counters.bytes_in,
            &state.metrics().bytes_in,
            data.len() as u64,
        );
        tokio::spawn(async move {
            if sink.write(&data).await.is_ok() {
                let _ = sink.close().await;
            }
        });
    }
    let mut output = exec.output;
    let mut ending = state.ending_watch();
    tokio::spawn(async move {
        let _busy = busy;
        loop {
            tokio::select! {
                ev = output.next() => {
                    let Some(ev) = ev else { return };
                    let l = event_line(ev, &entry, &state).await;
                    // A client that went away drops the receiver; dropping `output` then kills
                    // the process.
                    if tx.send(Ok(l)).await.is_err() {
                        return;
                    }
                }
                // Told once the hand-over has kept the sandbox (one it disposes of is gone from
                // the registry by then, and its stream ends with its VM).
                true = async {
                    ending.wait_for(|e| *e == Ending::HandedOver).await.is_ok()
                        && state.registry().get(&entry.id).is_ok()
                } => {
                    let err = ApiError::Restarting(
                        "the sandbox host is handing over to its next run (an upgrade): the \
                         command keeps running in the sandbox; read its results from the files \
                         it writes once the host is back"
                            .into(),
                    );
                    let (_, code) = err.status_and_code();
                    let _ = tx.send(Ok(line(&json!({ "error": err.to_string(), "code": code })))).await;
                    // `output` is held until the process exits: dropping it would cancel the
                    // command in the guest.
                    std::future::pending::<()>().await;
                }
            }
        }
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::new(body),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by schemathesis: `"timeout_ms": 751.0` is the integer 751 and was refused.
    #[test]
    fn timeout_written_as_a_float_is_accepted() {
        let b: ExecBody =
            serde_json::from_value(json!({"command": "true", "timeout_ms": 751.0})).unwrap();
        assert_eq!(b.timeout_ms, Some(751));
        let b: ExecBody = serde_json::from_value(json!({"command": "true"})).unwrap();
        assert_eq!(b.timeout_ms, None);
        assert!(
            serde_json::from_value::<ExecBody>(json!({"command": "true", "timeout_ms": 0.5}))
                .is_err()
        );
        // Found by schemathesis: 2^64 (18446744073709551616) was taken as u64::MAX.
        let max: ExecBody =
            serde_json::from_str(r#"{"command": "true", "timeout_ms": 18446744073709551615}"#)
                .unwrap();
        assert_eq!(max.timeout_ms, Some(u64::MAX));
        for over in ["18446744073709551616", "1.8446744073709552e19", "1e20"] {
            let body = format!(r#"{{"command": "true", "timeout_ms": {over}}}"#);
            assert!(serde_json::from_str::<ExecBody>(&body).is_err(), "{over}");
        }
    }

    /// Found by schemathesis: `"timeout_ms": null` (and null for argv, command, cwd, stdin) was
    /// taken for a missing field, where the document allows only the field's type.
    #[test]
    fn null_is_refused_for_optional_fields() {
        for body in [
            json!({"argv": null, "command": "true"}),
            json!({"command": null, "argv": ["true"]}),
            json!({"command": "true", "cwd": null}),
            json!({"command": "true", "stdin": null}),
            json!({"command": "true", "timeout_ms": null}),
        ] {
            let e = serde_json::from_value::<ExecBody>(body.clone()).unwrap_err();
            assert!(e.to_string().contains("invalid type: null"), "{body}: {e}");
        }
        let b: ExecBody = serde_json::from_value(json!({"argv": ["true"]})).unwrap();
        assert!(b.command.is_none() && b.cwd.is_none() && b.stdin.is_none());
    }
}
