//! The QEMU Machine Protocol, as far as a snapshot needs it: one command at a time on a
//! socket QEMU inherited, answers read line by line.
//!
//! QEMU runs guest code; a guest that took it over writes whatever it likes here. So every
//! line has a bound, every answer a deadline, and nothing QEMU says is more than a status to
//! compare or a number to report.

use std::time::Duration;

use serde_json::Value;
use thiserror::Error;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// The longest line QEMU may send (its answers here are a few hundred bytes).
const MAX_LINE: usize = 64 * 1024;
/// The most bytes of other lines (events) read while waiting for one answer: a long-lived VM's
/// monitor gathers the events its guest causes between two snapshots (a fork's parent's, for
/// hours), and they are read, and dropped, before the next answer.
const MAX_EVENT_BYTES: usize = 16 << 20;

/// Why a QMP exchange failed.
#[derive(Debug, Error)]
pub enum QmpError {
    /// The socket failed or closed (QEMU ended).
    #[error("QEMU's monitor socket: {0}")]
    Io(#[from] std::io::Error),
    /// QEMU did not answer in time.
    #[error("QEMU's monitor did not answer {0} within {1:?}")]
    Timeout(String, Duration),
    /// QEMU sent something that is not its protocol.
    #[error("QEMU's monitor sent {0}")]
    Protocol(String),
    /// QEMU refused the command.
    #[error("QEMU refused {command}: {desc}")]
    Refused {
        /// The command.
        command: String,
        /// QEMU's own description.
        desc: String,
    },
}

/// A QMP session in command mode.
pub struct Qmp {
    stream: BufReader<UnixStream>,
    /// Bytes of lines read so far.
    read: usize,
}

impl Qmp {
    /// Reads QEMU's greeting and enters command mode.
    pub async fn connect(stream: UnixStream, within: Duration) -> Result<Qmp, QmpError> {
        let mut qmp = Qmp {
            stream: BufReader::new(stream),
            read: 0,
        };
        let greeting = tokio::time::timeout(within, qmp.line())
            .await
            .map_err(|_| QmpError::Timeout("its greeting".into(), within))??;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!(
                "a first line that is not its greeting: {}",
                short(&greeting)
            )));
        }
        qmp.execute("qmp_capabilities", Value::Null, within).await?;
        Ok(qmp)
    }

    /// Runs `command` and returns its `return` value; events in between are skipped.
    pub async fn execute(
        &mut self,
        command: &str,
        arguments: Value,
        within: Duration,
    ) -> Result<Value, QmpError> {
        self.exchange(command, arguments, None, within).await
    }

    /// [`Qmp::execute`] with `fd` passed alongside (`SCM_RIGHTS`), as `add-fd` takes its
    /// descriptor: how a snapshot's file reaches QEMU only when the snapshot is taken.
    pub async fn execute_with_fd(
        &mut self,
        command: &str,
        arguments: Value,
        fd: std::os::fd::RawFd,
        within: Duration,
    ) -> Result<Value, QmpError> {
        self.exchange(command, arguments, Some(fd), within).await
    }

    async fn exchange(
        &mut self,
        command: &str,
        arguments: Value,
        fd: Option<std::os::fd::RawFd>,
        within: Duration,
    ) -> Result<Value, QmpError> {
        let mut msg = serde_json::json!({ "execute": command });
        if !arguments.is_null() {
            msg["arguments"] = arguments;
        }
        let mut bytes = serde_json::to_vec(&msg).map_err(|e| QmpError::Protocol(e.to_string()))?;
        bytes.push(b'\n');
        let exchange = async {
            let mut sent = 0;
            if let Some(fd) = fd {
                use std::os::fd::AsRawFd;
                let sock = self.stream.get_ref();
                sent = loop {
                    sock.writable().await?;
                    match sock.try_io(tokio::io::Interest::WRITABLE, || {
                        sandbox_control::fds::send_with_fds(sock.as_raw_fd(), &bytes, &[fd])
                    }) {
                        Ok(n) => break n,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                        Err(e) => return Err(e.into()),
                    }
                };
            }
            self.stream.get_mut().write_all(&bytes[sent..]).await?;
            let start = self.read;
            while self.read - start <= MAX_EVENT_BYTES {
                let v = self.line().await?;
                if let Some(r) = v.get("return") {
                    return Ok(r.clone());
                }
                if let Some(e) = v.get("error") {
                    return Err(QmpError::Refused {
                        command: command.into(),
                        desc: e
                            .get("desc")
                            .and_then(Value::as_str)
                            .unwrap_or("no description")
                            .chars()
                            .take(300)
                            .collect(),
                    });
                }
                // An event ({"event": ...}): not the answer.
            }
            Err(QmpError::Protocol(format!(
                "more than {MAX_EVENT_BYTES} bytes without answering {command}"
            )))
        };
        tokio::time::timeout(within, exchange)
            .await
            .map_err(|_| QmpError::Timeout(command.into(), within))?
    }

    /// One JSON line, at most [`MAX_LINE`] bytes.
    async fn line(&mut self) -> Result<Value, QmpError> {
        let mut line = Vec::new();
        loop {
            let buf = self.stream.fill_buf().await?;
            if buf.is_empty() {
                return Err(QmpError::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "closed",
                )));
            }
            let (take, done) = match buf.iter().position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (buf.len(), false),
            };
            if line.len() + take > MAX_LINE {
                return Err(QmpError::Protocol(format!(
                    "a line longer than {MAX_LINE} bytes"
                )));
            }
            line.extend_from_slice(&buf[..take]);
            self.stream.consume(take);
            self.read = self.read.saturating_add(take);
            if done {
                return serde_json::from_slice(&line)
                    .map_err(|e| QmpError::Protocol(format!("a line that is not JSON ({e})")));
            }
        }
    }
}

/// A value cut short for an error message.
fn short(v: &Value) -> String {
    v.to_string().chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair() -> (Qmp, BufReader<UnixStream>) {
        let (a, b) = UnixStream::pair().unwrap();
        let mut qemu = BufReader::new(b);
        let connect = tokio::spawn(Qmp::connect(a, Duration::from_secs(5)));
        qemu.get_mut()
            .write_all(b"{\"QMP\": {\"version\": {}}}\n")
            .await
            .unwrap();
        let mut l = String::new();
        qemu.read_line(&mut l).await.unwrap();
        assert!(l.contains("qmp_capabilities"), "{l}");
        qemu.get_mut()
            .write_all(b"{\"return\": {}}\n")
            .await
            .unwrap();
        (connect.await.unwrap().unwrap(), qemu)
    }

    #[tokio::test]
    async fn skips_events_and_reads_the_answer() {
        let (mut qmp, mut qemu) = pair().await;
        let answer = tokio::spawn(async move {
            let mut l = String::new();
            qemu.read_line(&mut l).await.unwrap();
            assert!(l.contains("query-status"), "{l}");
            qemu.get_mut()
                .write_all(b"{\"event\": \"STOP\"}\n{\"return\": {\"status\": \"running\"}}\n")
                .await
                .unwrap();
            qemu
        });
        let r = qmp
            .execute("query-status", Value::Null, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(r["status"], "running");
        answer.await.unwrap();
    }

    #[tokio::test]
    async fn a_refusal_an_endless_line_and_silence_are_errors() {
        let (mut qmp, mut qemu) = pair().await;
        qemu.get_mut()
            .write_all(b"{\"error\": {\"class\": \"GenericError\", \"desc\": \"no\"}}\n")
            .await
            .unwrap();
        let e = qmp
            .execute("cont", Value::Null, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(
            matches!(e, QmpError::Refused { ref desc, .. } if desc == "no"),
            "{e}"
        );

        let e = qmp
            .execute("cont", Value::Null, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(e, QmpError::Timeout(..)), "{e}");

        let flood = vec![b'x'; MAX_LINE + 10];
        let writer = tokio::spawn(async move {
            let _ = qemu.get_mut().write_all(&flood).await;
            qemu
        });
        let e = qmp
            .execute("cont", Value::Null, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(matches!(e, QmpError::Protocol(_)), "{e}");
        drop(writer.await);
    }
}
