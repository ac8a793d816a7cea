//! `GET /v1/sandboxes/{id}/pty`: a terminal in the guest over a WebSocket (issue 35), framed as
//! Kubernetes' exec streams are, so that clients written for those (xterm.js bridges, k8s
//! tooling) need little change: every message is binary, its first byte the channel.
//!
//! | channel | way | bytes |
//! |---|---|---|
//! | 0 | client → host | typed input (stdin of the terminal) |
//! | 1 | host → client | the terminal's output |
//! | 3 | host → client | the end, JSON: how the process ended, or why the session failed |
//! | 4 | client → host | a new size, JSON `{"Width": cols, "Height": rows}` |
//!
//! The process runs on a real pseudo terminal in the guest (the agent's `pty.rs`): the session
//! ends when its first process exits, and closing the WebSocket ends the session (its processes
//! are killed, as a terminal's are when it is closed).

use std::time::Duration;

use axum::Router;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::extract::{Query, State};
use axum::response::Response;
use axum::routing::get;
use futures_util::{SinkExt, StreamExt};
use sandbox_protocol::client::{ClientError, Exec, ExecEvent};
use sandbox_protocol::message::{ExecRequest, ExitStatus, TermSize, code};
use serde::Deserialize;
use serde_json::json;

use super::SandboxId;
use crate::error::ApiError;
use crate::registry::{SandboxEntry, count};
use crate::state::{AppState, Ending};

/// The largest message a client may send: typed input comes a few bytes at a time, and a paste
/// of this much is passed on whole; more is refused (the connection closes with 1009).
pub const MAX_MESSAGE: usize = 256 * 1024;

/// The longest `command`: far beyond a command line, well within a request to the agent.
pub const MAX_COMMAND: usize = 64 * 1024;

/// The subprotocols of Kubernetes' exec streams; the first a client offers is taken (the
/// framing is the same either way), and a client that offers none gets the same framing.
const SUBPROTOCOLS: [&str; 2] = ["v4.channel.k8s.io", "channel.k8s.io"];

/// What runs when the query names no command: the image's bash as a login shell, else its sh.
const LOGIN_SHELL: &str = "if [ -x /bin/bash ]; then exec /bin/bash -l; fi; exec /bin/sh -l";

pub fn router() -> Router<AppState> {
    Router::new().route("/v1/sandboxes/{id}/pty", get(pty))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PtyQuery {
    /// A shell string; a login shell when absent.
    #[serde(default)]
    command: Option<String>,
    /// Working directory; `/workspace` when absent.
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default = "rows")]
    rows: u16,
    #[serde(default = "cols")]
    cols: u16,
}

fn rows() -> u16 {
    24
}

fn cols() -> u16 {
    80
}

async fn pty(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
    q: Result<Query<PtyQuery>, axum::extract::rejection::QueryRejection>,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    // An unknown or dead sandbox is the answer before anything about the request.
    let entry = state.registry().get(&id)?;
    let q = q
        .map(|Query(q)| q)
        .map_err(|e| ApiError::BadRequest(e.body_text()))?;
    if let Some(c) = &q.command
        && c.len() > MAX_COMMAND
    {
        return Err(ApiError::BadRequest(format!(
            "command is {} bytes; at most {MAX_COMMAND} (put a longer script in a file)",
            c.len()
        )));
    }
    let size = TermSize {
        rows: q.rows,
        cols: q.cols,
    };
    size.check().map_err(ApiError::BadRequest)?;
    if let Some(cwd) = &q.cwd
        && !cwd.starts_with('/')
    {
        return Err(ApiError::BadRequest(format!(
            "cwd `{}` is not an absolute path",
            cwd.chars().take(200).collect::<String>()
        )));
    }
    let ws = ws.map_err(|e| {
        ApiError::BadRequest(format!(
            "this route is a WebSocket ({}): send GET with `Connection: Upgrade`, \
             `Upgrade: websocket`, `Sec-WebSocket-Version: 13` and a `Sec-WebSocket-Key`",
            e.body_text()
        ))
    })?;
    let _entered = entry.enter()?;
    let req = ExecRequest {
        argv: None,
        command: Some(q.command.unwrap_or_else(|| LOGIN_SHELL.into())),
        env: entry.env.clone(),
        cwd: q.cwd,
        stdin: true,
        timeout_ms: None,
        pty: Some(size),
    };
    let exec = match entry.sandbox().client.exec(&req).await {
        Ok(e) => e,
        Err(e) => return Err(entry.explain(e).await),
    };
    count(&entry.counters.execs, &state.metrics().execs, 1);
    let busy = entry.busy();
    Ok(ws
        .protocols(SUBPROTOCOLS)
        .max_message_size(MAX_MESSAGE)
        .max_frame_size(MAX_MESSAGE)
        .on_upgrade(move |socket| async move {
            let _busy = busy;
            session(socket, exec, &entry, &state).await;
        }))
}

/// How a session ended, for its last message.
enum End {
    /// The process exited.
    Exited(ExitStatus),
    /// The client closed the WebSocket (or it broke): nothing more is sent.
    ClientGone,
    /// The session failed: the status says why, then the WebSocket closes with this code.
    Failed(ApiError, u16),
}

/// Relays one terminal session until its process exits or the client goes; input and output
/// each on their own, so a process that does not read its input never stops its output from
/// reaching the client (and the other way round).
async fn session(socket: WebSocket, exec: Exec, entry: &SandboxEntry, state: &AppState) {
    let (mut to_client, mut from_client) = socket.split();
    let Exec { stdin, mut output } = exec;
    let Some(mut stdin) = stdin else {
        return;
    };
    let control = output.control();
    let input = async {
        // A message read while the guest was still taking input (below).
        let mut held: Option<Message> = None;
        loop {
            let msg = match held.take() {
                Some(m) => Ok(m),
                None => match from_client.next().await {
                    Some(m) => m,
                    None => return End::ClientGone,
                },
            };
            let bytes = match msg {
                Ok(Message::Binary(b)) => b,
                Ok(Message::Close(_)) | Err(_) => return End::ClientGone,
                Ok(Message::Ping(_) | Message::Pong(_)) => continue,
                Ok(Message::Text(_)) => {
                    return End::Failed(
                        ApiError::BadRequest(
                            "a text message: send binary messages whose first byte is the \
                             channel (0 input, 4 size)"
                                .into(),
                        ),
                        close_code::UNSUPPORTED,
                    );
                }
            };
            let Some((&channel, data)) = bytes.split_first() else {
                continue;
            };
            let sent = match channel {
                0 => {
                    count(
                        &entry.counters.bytes_in,
                        &state.metrics().bytes_in,
                        data.len() as u64,
                    );
                    // The guest may not be reading (a program that ignores its input): while
                    // it takes this, the client is still read, so that its close is seen; one
                    // more message waits here, and the client waits for the rest.
                    let write = stdin.write(data);
                    tokio::pin!(write);
                    loop {
                        tokio::select! {
                            r = &mut write => break r,
                            m = from_client.next(), if held.is_none() => match m {
                                Some(Ok(Message::Close(_)) | Err(_)) | None => {
                                    return End::ClientGone;
                                }
                                Some(Ok(m)) => held = Some(m),
                            },
                        }
                    }
                }
                4 => match resize(data) {
                    Ok(Some(size)) => control.resize(size).await,
                    // A browser's terminal sends 0 x 0 while its tab is hidden: not a size.
                    Ok(None) => Ok(()),
                    Err(e) => return End::Failed(e, close_code::POLICY),
                },
                c => {
                    return End::Failed(
                        ApiError::BadRequest(format!(
                            "channel {c} is not one a client sends: 0 is input, 4 a new size"
                        )),
                        close_code::POLICY,
                    );
                }
            };
            if let Err(e) = sent {
                return failed(entry, e).await;
            }
        }
    };
    let relay_output = async {
        loop {
            let bytes = match output.next().await {
                Some(Ok(ExecEvent::Stdout(b) | ExecEvent::Stderr(b))) => b,
                Some(Ok(ExecEvent::Exit(s))) => return End::Exited(s),
                Some(Err(e)) => return failed(entry, e).await,
                None => {
                    return End::Failed(
                        ApiError::Internal("the terminal's output ended without an exit".into()),
                        close_code::ERROR,
                    );
                }
            };
            count(
                &entry.counters.bytes_out,
                &state.metrics().bytes_out,
                bytes.len() as u64,
            );
            let mut msg = Vec::with_capacity(bytes.len() + 1);
            msg.push(1);
            msg.extend_from_slice(&bytes);
            if to_client.send(Message::Binary(msg.into())).await.is_err() {
                return End::ClientGone;
            }
        }
    };
    let mut ending = state.ending_watch();
    let handed_over = async {
        let _ = ending.wait_for(|e| *e == Ending::HandedOver).await;
        End::Failed(
            ApiError::Restarting(
                "the sandbox host is handing over to its next run (an upgrade): the terminal \
                 is closed; open a new one once the host is back"
                    .into(),
            ),
            close_code::AGAIN,
        )
    };
    let end = tokio::select! {
        end = input => end,
        end = relay_output => end,
        end = handed_over => end,
    };
    let (status, close) = match end {
        End::ClientGone => return,
        End::Exited(s) => (exit_status(&s), close_code::NORMAL),
        End::Failed(err, code) => {
            let (_, api_code) = err.status_and_code();
            let status = json!({"status": "Failure", "error": err.to_string(), "code": api_code});
            (status, code)
        }
    };
    let mut msg = vec![3];
    msg.extend_from_slice(status.to_string().as_bytes());
    let _ = to_client.send(Message::Binary(msg.into())).await;
    let _ = to_client
        .send(Message::Close(Some(CloseFrame {
            code: close,
            reason: "".into(),
        })))
        .await;
    // The client has a moment to answer the close; the connection goes either way.
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while let Some(Ok(_)) = from_client.next().await {}
    })
    .await;
}

/// A failure of the channel to the guest, as the API says it.
async fn failed(entry: &SandboxEntry, e: ClientError) -> End {
    if let ClientError::Agent(m) = &e {
        // An agent from before terminals refuses the request's field.
        if m.code == code::BAD_REQUEST && m.message.contains("unknown field `pty`") {
            return End::Failed(
                ApiError::Conflict(
                    "this sandbox's guest agent has no terminals: its image was built by an \
                     older sandbox host; rebuild the image, then make a new sandbox"
                        .into(),
                ),
                close_code::ERROR,
            );
        }
        // The command could not start (a cwd that is not a directory, no such program).
        if m.code == code::BAD_REQUEST || m.code == code::SPAWN_FAILED {
            return End::Failed(ApiError::BadRequest(m.message.clone()), close_code::POLICY);
        }
    }
    End::Failed(entry.explain(e).await, close_code::ERROR)
}

/// The status message of a process that exited: Kubernetes' `status` word, and the exit as
/// `POST /exec`'s last line gives it.
fn exit_status(s: &ExitStatus) -> serde_json::Value {
    let ok = s.exit_code == Some(0);
    json!({
        "status": if ok { "Success" } else { "Failure" },
        "exit_code": s.exit_code,
        "signal": s.signal,
        "timed_out": s.timed_out,
        "duration_ms": s.duration_ms,
    })
}

/// A resize message's size: Kubernetes' `{"Width": cols, "Height": rows}`; `None` for 0 x 0,
/// which a hidden browser terminal sends and which is no size to give a terminal.
fn resize(data: &[u8]) -> Result<Option<TermSize>, ApiError> {
    #[derive(Deserialize)]
    struct Resize {
        #[serde(rename = "Width")]
        width: u16,
        #[serde(rename = "Height")]
        height: u16,
    }
    let r: Resize = serde_json::from_slice(data).map_err(|e| {
        ApiError::BadRequest(format!(
            "a size message (channel 4) is JSON {{\"Width\": columns, \"Height\": rows}}: {e}"
        ))
    })?;
    if r.width == 0 && r.height == 0 {
        return Ok(None);
    }
    let size = TermSize {
        rows: r.height,
        cols: r.width,
    };
    size.check().map_err(ApiError::BadRequest)?;
    Ok(Some(size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_message_is_read_and_checked() {
        assert_eq!(
            resize(br#"{"Width": 120, "Height": 40}"#).unwrap(),
            Some(TermSize {
                rows: 40,
                cols: 120
            })
        );
        assert_eq!(resize(br#"{"Width": 0, "Height": 0}"#).unwrap(), None);
        for (bad, why) in [
            (
                &br#"{"Width": 0, "Height": 40}"#[..],
                "cols must be 1 to 4096, not 0",
            ),
            (br#"{"Width": 80}"#, "missing field `Height`"),
            (br#"{"Width": 70000, "Height": 4}"#, "Width"),
            (b"80x24", "is JSON"),
        ] {
            let e = resize(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn the_status_says_success_only_for_exit_0() {
        let mut s = ExitStatus {
            exit_code: Some(0),
            signal: None,
            timed_out: false,
            duration_ms: 5,
        };
        assert_eq!(exit_status(&s)["status"], "Success");
        s.exit_code = Some(3);
        assert_eq!(exit_status(&s)["status"], "Failure");
        assert_eq!(exit_status(&s)["exit_code"], 3);
    }
}
