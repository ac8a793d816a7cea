//! `sandbox-host shell ID [-- COMMAND...]`: a terminal in a sandbox of a running host (or of a
//! fleet's gateway), over the API's WebSocket (`GET /v1/sandboxes/{id}/pty`). The local
//! terminal is put in raw mode so that every key (Ctrl-C, arrows, Tab) reaches the guest, its
//! size follows the local window's, and the command's exit code is this command's.

use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;

use futures_util::{SinkExt, StreamExt};
use hyper::{Method, StatusCode};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::client::generate_key;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};

use crate::client::{Target, error_text, fail};

/// The size used when standard output is not a terminal.
const DEFAULT_SIZE: (u16, u16) = (24, 80);

/// Runs the shell (or `argv`, quoted for the guest's sh) and returns its exit code: the
/// command's, 128 plus a signal's number, or 1 when the session failed.
pub async fn shell(id: String, argv: Vec<String>) -> ExitCode {
    let t = match Target::from_env() {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    let (rows, cols) = window_size().unwrap_or(DEFAULT_SIZE);
    let mut query = format!("rows={rows}&cols={cols}");
    if !argv.is_empty() {
        let line: Vec<String> = argv.iter().map(|a| sh_quote(a)).collect();
        query.push_str("&command=");
        query.push_str(&percent_encode(&line.join(" ")));
    }
    let key = generate_key();
    let headers = [
        ("connection", "Upgrade"),
        ("upgrade", "websocket"),
        ("sec-websocket-version", "13"),
        ("sec-websocket-key", key.as_str()),
        ("sec-websocket-protocol", "v4.channel.k8s.io"),
    ];
    let path = format!("/v1/sandboxes/{}/pty?{query}", percent_encode(&id));
    let mut res = match t.request_with(Method::GET, &path, &headers, None).await {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    if res.status() != StatusCode::SWITCHING_PROTOCOLS {
        let status = res.status();
        let bytes = http_body_util::BodyExt::collect(http_body_util::Limited::new(
            res.into_body(),
            64 << 10,
        ))
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if status == StatusCode::UNAUTHORIZED {
            return fail(
                "The sandbox host refused the token: set the same SANDBOX_HOST_TOKEN for both",
            );
        }
        return fail(error_text(&v));
    }
    let accept = res
        .headers()
        .get("sec-websocket-accept")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if accept != derive_accept_key(key.as_bytes()) {
        return fail(
            "the sandbox host's WebSocket answer is not for this request (a proxy between?)",
        );
    }
    let upgraded = match hyper::upgrade::on(&mut res).await {
        Ok(u) => u,
        Err(e) => return fail(format!("the terminal's connection did not switch: {e}")),
    };
    let mut config = WebSocketConfig::default();
    config.max_message_size = Some(crate::routes::PTY_MAX_MESSAGE);
    let ws = WebSocketStream::from_raw_socket(
        hyper_util::rt::TokioIo::new(upgraded),
        Role::Client,
        Some(config),
    )
    .await;
    let raw = RawMode::enter();
    let ended = relay(ws).await;
    drop(raw);
    if std::io::stdout().is_terminal() {
        // Modes the guest may have left on (the alternate screen, a hidden cursor, mouse
        // reporting, bracketed paste, colours): off, so the local shell reads as before.
        let mut stdout = std::io::stdout().lock();
        let _ = stdout.write_all(RESET);
        let _ = stdout.flush();
    }
    match ended {
        Ok(code) => code,
        Err(e) => fail(e),
    }
}

/// What a terminal is reset with once the guest's session is over.
const RESET: &[u8] = b"\x1b[?1049l\x1b[?25h\x1b[?1000l\x1b[?1002l\x1b[?1006l\x1b[?2004l\x1b[0m";

/// Local input and window changes to the guest, the guest's output to the local terminal,
/// until the status message (channel 3) or the end of the connection.
async fn relay<S>(ws: WebSocketStream<S>) -> Result<ExitCode, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut to_host, mut from_host) = ws.split();
    // Standard input on a thread of its own: a blocking read that the process's exit ends,
    // which a task of the runtime's blocking pool would keep the runtime waiting for.
    let (input_tx, mut input) = mpsc::channel::<Vec<u8>>(4);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 16 * 1024];
        let mut stdin = std::io::stdin().lock();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let mut msg = Vec::with_capacity(n + 1);
                    msg.push(0);
                    msg.extend_from_slice(&buf[..n]);
                    if input_tx.blocking_send(msg).is_err() {
                        return;
                    }
                }
            }
        }
    });
    let mut winch =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change()).ok();
    let mut input_open = true;
    loop {
        tokio::select! {
            msg = from_host.next() => {
                let bytes = match msg {
                    Some(Ok(Message::Binary(b))) => b,
                    Some(Ok(Message::Close(_))) | None => {
                        return Err("the terminal closed without saying how its command ended".into());
                    }
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => return Err(format!("the terminal's connection broke: {e}")),
                };
                match bytes.split_first() {
                    Some((1, out)) => {
                        let mut stdout = std::io::stdout().lock();
                        let _ = stdout.write_all(out);
                        let _ = stdout.flush();
                    }
                    Some((3, status)) => return exit_code(status),
                    _ => {}
                }
            }
            msg = input.recv(), if input_open => match msg {
                Some(m) => {
                    if to_host.send(Message::Binary(m.into())).await.is_err() {
                        return Err("the terminal's connection broke".into());
                    }
                }
                // Local input ended (a pipe): the session goes on until the command exits.
                None => input_open = false,
            },
            Some(()) = async { match winch.as_mut() { Some(w) => w.recv().await, None => None } } => {
                if let Some((rows, cols)) = window_size() {
                    let mut m = vec![4];
                    m.extend_from_slice(
                        serde_json::json!({"Width": cols, "Height": rows}).to_string().as_bytes(),
                    );
                    let _ = to_host.send(Message::Binary(m.into())).await;
                }
            }
        }
    }
}

/// The exit code a status message gives: the command's own, 128 plus its signal's number,
/// 124 for a timeout (as `sandbox-host exec`), 1 with the error printed for a failed session.
fn exit_code(status: &[u8]) -> Result<ExitCode, String> {
    let v: Value = serde_json::from_slice(status).unwrap_or(Value::Null);
    if v.get("error").is_some() {
        return Err(error_text(&v));
    }
    if v["timed_out"] == Value::Bool(true) {
        return Ok(ExitCode::from(124));
    }
    if let Some(c) = v["exit_code"].as_i64() {
        return Ok(ExitCode::from(c.clamp(0, 255) as u8));
    }
    Ok(ExitCode::from(
        (128 + v["signal"].as_i64().unwrap_or(0)).clamp(0, 255) as u8,
    ))
}

/// The local terminal's size (rows, columns), from standard output; `None` when it is not a
/// terminal.
fn window_size() -> Option<(u16, u16)> {
    let ws = rustix::termios::tcgetwinsize(std::io::stdout()).ok()?;
    (ws.ws_row > 0 && ws.ws_col > 0).then_some((ws.ws_row, ws.ws_col))
}

/// The local terminal in raw mode while it lives (no echo, no line editing, no signals from
/// keys: the guest's terminal does all of that); restored when dropped.
struct RawMode;

/// The settings to restore, for whichever thread of the runtime ends the session.
static SAVED: std::sync::Mutex<Option<rustix::termios::Termios>> = std::sync::Mutex::new(None);

impl RawMode {
    fn enter() -> RawMode {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return RawMode;
        }
        let Ok(saved) = rustix::termios::tcgetattr(&stdin) else {
            return RawMode;
        };
        let mut raw = saved.clone();
        raw.make_raw();
        if rustix::termios::tcsetattr(&stdin, rustix::termios::OptionalActions::Now, &raw).is_ok() {
            *SAVED.lock().unwrap_or_else(|e| e.into_inner()) = Some(saved);
        }
        RawMode
    }

    /// Restores the terminal.
    fn restore_now() {
        let saved = SAVED.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(saved) = saved {
            let _ = rustix::termios::tcsetattr(
                std::io::stdin(),
                rustix::termios::OptionalActions::Now,
                &saved,
            );
        }
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        RawMode::restore_now();
    }
}

/// `s` quoted for a POSIX shell: as it is when it is plain, else in single quotes.
fn sh_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// `s` as a URL's query value or path segment: every byte but the unreserved ones as `%XX`.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_quoted_for_the_guest_shell() {
        assert_eq!(sh_quote("ls"), "ls");
        assert_eq!(sh_quote("-la"), "-la");
        assert_eq!(sh_quote("a b"), "'a b'");
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
        assert_eq!(sh_quote(""), "''");
        assert_eq!(sh_quote("$(reboot)"), "'$(reboot)'");
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(
            percent_encode("stty size; exit 3"),
            "stty%20size%3B%20exit%203"
        );
        assert_eq!(percent_encode("a&b=c#d"), "a%26b%3Dc%23d");
    }

    #[test]
    fn the_exit_code_follows_the_status() {
        let code = |s: &str| format!("{:?}", exit_code(s.as_bytes()).unwrap());
        assert_eq!(
            code(r#"{"status":"Failure","exit_code":3,"signal":null}"#),
            format!("{:?}", ExitCode::from(3))
        );
        assert_eq!(
            code(r#"{"status":"Failure","exit_code":null,"signal":2}"#),
            format!("{:?}", ExitCode::from(130))
        );
        assert_eq!(
            code(r#"{"status":"Success","exit_code":0}"#),
            format!("{:?}", ExitCode::SUCCESS)
        );
    }
}
