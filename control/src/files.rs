//! A snapshot's two files as both sides handle them: the service creates and sizes the memory
//! file and writes the state file from what the VM process sends; the VM process writes guest
//! memory into the one and reads both back at a restore.

use std::fs::File;
use std::os::unix::fs::FileExt;

/// The largest state file read back (a machine of 254 vCPUs needs about 8 MiB).
pub const MAX_STATE_BYTES: u64 = 16 << 20;

/// A snapshot file that could not be written or sized.
#[derive(Debug, thiserror::Error)]
#[error("{context}: {source}")]
pub struct FileError {
    /// What was being done.
    pub context: &'static str,
    /// The failure.
    #[source]
    pub source: std::io::Error,
}

fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> FileError {
    move |source| FileError { context, source }
}

/// Replaces `file`'s content with a state's `bytes` and syncs it (the service's side: a VM
/// process hands its state over a pipe).
pub fn write_state_file(bytes: &[u8], file: &File) -> Result<(), FileError> {
    file.set_len(0).map_err(io("truncating the state file"))?;
    file.write_all_at(bytes, 0)
        .map_err(io("writing the state file"))?;
    file.sync_data().map_err(io("syncing the state file"))
}

/// The memory file's length for a machine of `mem_bytes`: every RAM region back to back, so
/// the guest's memory size (the regions around the MMIO hole add up to it).
pub fn memory_file_len(mem_bytes: u64) -> u64 {
    mem_bytes
}

/// Empties `file` and sizes it for a machine of `mem_bytes`, all holes: done by whoever hands
/// the file over (the VM process never changes its size).
pub fn size_memory_file(file: &File, mem_bytes: u64) -> Result<(), FileError> {
    file.set_len(0).map_err(io("truncating the memory file"))?;
    file.set_len(memory_file_len(mem_bytes))
        .map_err(io("sizing the memory file"))
}
