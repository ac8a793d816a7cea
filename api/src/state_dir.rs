//! The state directory as one service's own: its lock, what a crashed earlier service left in
//! it, and the name its cgroups take from it.

use std::path::{Path, PathBuf};

use thiserror::Error;

/// Why the state directory cannot be this process's; each says what to do.
#[derive(Debug, Error)]
pub enum StateDirError {
    /// It cannot be created.
    #[error("cannot create SANDBOX_HOST_STATE_DIR {}: {source}", .dir.display())]
    Create {
        /// The directory.
        dir: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// Its lock file cannot be opened.
    #[error("cannot open {}: {source}", .path.display())]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// Another sandbox host holds it.
    #[error(
        "another sandbox host uses SANDBOX_HOST_STATE_DIR {}; stop it, or give this one another directory",
        .0.display()
    )]
    Taken(PathBuf),
    /// It cannot be listed.
    #[error("cannot read {}: {source}", .dir.display())]
    Read {
        /// The directory.
        dir: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
}

/// Names this instance's cgroups after its state directory: stable across restarts (so a
/// restart finds what a crash left) and distinct between instances on one host.
pub fn jail_instance(state_dir: &Path) -> String {
    use sha2::Digest;
    let canonical = state_dir
        .canonicalize()
        .unwrap_or_else(|_| state_dir.to_path_buf());
    let digest = sha2::Sha256::digest(canonical.as_os_str().as_encoded_bytes());
    format!(
        "i-{}",
        digest[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    )
}

/// Takes the state directory for this process (one sandbox host per directory). The lock is held
/// as long as the file returned is open.
pub fn claim(dir: &Path) -> Result<std::fs::File, StateDirError> {
    std::fs::create_dir_all(dir).map_err(|source| StateDirError::Create {
        dir: dir.to_path_buf(),
        source,
    })?;
    let lock_path = dir.join(".lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|source| StateDirError::Lock {
            path: lock_path.clone(),
            source,
        })?;
    lock.try_lock()
        .map_err(|_| StateDirError::Taken(dir.to_path_buf()))?;
    // Only this service's user may reach what is in it: the sockets of the processes that
    // outlive it among them (whoever connects to those is the service).
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    Ok(lock)
}

/// Removes what an earlier process left in the state directory, except `keep` (the names of
/// what belongs to the sandboxes this one took on again) and the directories of
/// `sandbox-host run`s still running.
pub fn remove_leftovers(dir: &Path, keep: &[String]) -> Result<(), StateDirError> {
    let entries = std::fs::read_dir(dir).map_err(|source| StateDirError::Read {
        dir: dir.to_path_buf(),
        source,
    })?;
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == ".lock" || live_run(&name) || keep.contains(&name) {
            continue;
        }
        let p = e.path();
        let gone = if p.is_dir() {
            std::fs::remove_dir_all(&p)
        } else {
            std::fs::remove_file(&p)
        };
        if gone.is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        tracing::info!(removed, dir = %dir.display(), "Removed what an earlier sandbox host left in the state directory");
    }
    Ok(())
}

/// `run-<pid>-…` of a `sandbox-host run` that is still running.
fn live_run(name: &str) -> bool {
    name.strip_prefix("run-")
        .and_then(|r| r.split('-').next())
        .and_then(|p| p.parse::<u32>().ok())
        .is_some_and(sandbox_vmm::host::process_alive)
}
