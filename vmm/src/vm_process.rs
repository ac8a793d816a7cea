//! What the service does alike for every VM process, QEMU's or `sandbox-vm`: the pipes its
//! console comes through, reading that console into the bounded log, removing the VM's files,
//! and the exit of a VM that ended without saying why.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::{Arc, Mutex};

use sandbox_devices::ConsoleLog;
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::backend::VmError;

/// A pipe (read end, write end), both close-on-exec; `what` names it in the error.
pub(crate) fn pipe(what: &str) -> Result<(OwnedFd, OwnedFd), VmError> {
    let (r, w) = std::io::pipe().map_err(|e| VmError::io(format!("making the {what} pipe"), e))?;
    Ok((r.into(), w.into()))
}

/// Reads a VM process's output into its console log until the pipe closes, starting each line
/// with `prefix`. The log is bounded; what the process writes is not trusted to be text.
pub(crate) async fn pump_console(
    mut r: impl AsyncRead + Unpin,
    console: Arc<Mutex<ConsoleLog>>,
    prefix: &'static str,
) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut line_start = true;
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let mut log = console.lock().unwrap_or_else(|e| e.into_inner());
                for piece in buf[..n].split_inclusive(|&b| b == b'\n') {
                    if line_start {
                        log.write(prefix.as_bytes());
                    }
                    log.write(piece);
                    line_start = piece.ends_with(b"\n");
                }
            }
        }
    }
}

/// Removes a VM's state directory; a failure other than "already gone" is logged.
pub(crate) fn remove_state_dir(dir: &Path) {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            tracing::warn!(dir = %dir.display(), error = %e, "could not remove the VM's state directory");
        }
        _ => {}
    }
}

/// The exit of a VM whose end was not recorded (its watcher is gone).
#[cfg(target_os = "linux")]
pub(crate) fn unknown_exit() -> crate::backend::VmExit {
    crate::backend::VmExit {
        reason: "the VM ended without a recorded reason".into(),
        requested: false,
        console: Vec::new(),
    }
}
