//! JSON payloads of control frames. Unknown fields are refused so that a typo on either side is
//! an error, not a silently ignored option.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Payload of `Exec`: exactly one of `argv` and `command`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// Program and arguments, run without a shell; `PATH` is searched for the program.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// A shell string, run as `/bin/sh -c <command>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// Variables added to (or replacing those of) the agent's base environment.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Working directory; `/workspace` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Whether the host will send stdin; otherwise stdin is `/dev/null`.
    #[serde(default)]
    pub stdin: bool,
    /// Kill the whole process group after this many milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Run it on a pseudo terminal of this size instead of pipes: it is the controlling
    /// terminal of a new session (job control, `stty size`, SIGWINCH on `Resize`), stdin and
    /// the output both go through it (all output comes as `Stdout`), and `stdin` must be set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<TermSize>,
}

/// A terminal's size, in character cells: the payload of `Resize` and an exec's `pty`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TermSize {
    /// Lines.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

impl TermSize {
    /// The largest side either way: far beyond any screen, small enough that a program sizing
    /// a buffer by the terminal's cells (rows × cols) stays within memory.
    pub const MAX: u16 = 4096;

    /// Why this size cannot be a terminal's, if it cannot (a side of 0, or over [`Self::MAX`]).
    pub fn check(&self) -> Result<(), String> {
        for (what, n) in [("rows", self.rows), ("cols", self.cols)] {
            if n == 0 || n > Self::MAX {
                return Err(format!(
                    "a terminal's {what} must be 1 to {}, not {n}",
                    Self::MAX
                ));
            }
        }
        Ok(())
    }
}

/// Payload of `Watch`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchRequest {
    /// The directory watched (absolute).
    pub path: String,
    /// Its subdirectories too, and each one made later.
    #[serde(default)]
    pub recursive: bool,
}

/// Payload of `PortOpen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortRequest {
    /// The TCP port on the guest's loopback (127.0.0.1).
    pub port: u16,
}

/// Payload of `Exit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExitStatus {
    /// Exit code when the process exited by itself.
    pub exit_code: Option<i32>,
    /// Signal number when a signal ended it.
    pub signal: Option<i32>,
    /// Whether the agent killed it because its timeout passed.
    pub timed_out: bool,
    /// Wall time from spawn to exit.
    pub duration_ms: u64,
}

/// Payload of `Identity`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// Random bytes from the host, hex-encoded: mixed into the guest kernel's pool (and
    /// credited) before its generator is reseeded from it. At most [`Identity::MAX_ENTROPY`].
    pub entropy_hex: String,
    /// The host's wall clock, nanoseconds since the Unix epoch: the guest's realtime clock is
    /// set to it (a restored guest's clock stands where the snapshot left it).
    pub unix_ns: u64,
}

impl Identity {
    /// The most entropy bytes a request carries (the kernel's pool is 256 bits; more adds
    /// nothing).
    pub const MAX_ENTROPY: usize = 256;
}

/// Payload of `Signal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// Signal number, sent to the process group.
    pub signal: i32,
}

/// Payload of `ArchivePut`, `ArchiveGet` and `FileGet`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathRequest {
    /// Absolute path in the guest.
    pub path: String,
}

/// Payload of `FilePut`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePut {
    /// Absolute path in the guest; missing parent directories are created.
    pub path: String,
    /// Permission bits; 0644 when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
}

/// Payload of `Done`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Done {
    /// Archive entries (or 1 for a file) written.
    pub entries: u64,
    /// Bytes of file content written.
    pub bytes: u64,
}

/// Payload of `Ready`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ready {
    /// Version of the agent binary.
    pub version: String,
    /// Protocol revision it speaks.
    pub protocol: u32,
    /// Transport it is serving on, e.g. `serial:sandbox.agent` or `vsock:1024`.
    pub channel: String,
    /// Seconds since the guest kernel started, so boot time can be read from inside.
    pub uptime_ms: u64,
}

/// Payload of `Error`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorMessage {
    /// Machine-readable reason, one of the codes in `docs/protocol.md`.
    pub code: String,
    /// What happened, for a person.
    pub message: String,
}

impl ErrorMessage {
    /// An error with a code and a message.
    pub fn new(code: &str, message: impl Into<String>) -> Self {
        ErrorMessage {
            code: code.to_owned(),
            message: message.into(),
        }
    }
}

/// Error codes the agent sends. The host maps them to API errors.
pub mod code {
    /// Bytes that did not form a valid frame.
    pub const BAD_FRAME: &str = "bad_frame";
    /// A frame kind the receiver does not know or does not accept in this direction.
    pub const UNKNOWN_KIND: &str = "unknown_kind";
    /// A JSON payload that does not parse or has unknown fields.
    pub const BAD_REQUEST: &str = "bad_request";
    /// A stream id already in use, or a frame for a stream in the wrong state.
    pub const BAD_STREAM: &str = "bad_stream";
    /// More bytes sent than the window granted.
    pub const WINDOW_EXCEEDED: &str = "window_exceeded";
    /// A path that does not exist.
    pub const NOT_FOUND: &str = "not_found";
    /// An archive entry that would escape the target or is of a refused type.
    pub const UNSAFE_ARCHIVE: &str = "unsafe_archive";
    /// Not enough space or inodes on the target filesystem.
    pub const NO_SPACE: &str = "no_space";
    /// A program that could not be started.
    pub const SPAWN_FAILED: &str = "spawn_failed";
    /// Any other I/O failure.
    pub const IO: &str = "io";
    /// Too many streams open at once.
    pub const BUSY: &str = "busy";
    /// Nothing accepts connections on the guest's port asked for.
    pub const REFUSED: &str = "refused";
}

/// Encodes a window grant.
pub fn window_payload(bytes: u32) -> Vec<u8> {
    bytes.to_le_bytes().to_vec()
}

/// Decodes a window grant; `None` if the payload is not exactly four bytes.
pub fn parse_window(payload: &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(payload.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_request_refuses_unknown_fields() {
        let err =
            serde_json::from_str::<ExecRequest>(r#"{"argv":["true"],"cmd":"x"}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `cmd`"), "{err}");
    }

    #[test]
    fn window_payload_round_trip() {
        assert_eq!(parse_window(&window_payload(12345)), Some(12345));
        assert_eq!(parse_window(b"abc"), None);
    }
}
