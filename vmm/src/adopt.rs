//! Taking on again a VM that a previous run of the service left running (issue 32): a crash,
//! `kill -9`, or a hand-over for an upgrade ends the service but not its VMs. What the next run
//! needs of one is its [`VmRecord`] (which process, where its agent listens); the process must
//! prove to be that one (`sandbox_jail::Jailer::adopt`), and its agent must answer, before it is
//! a [`Sandbox`] again.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use sandbox_protocol::client::Client;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::sandbox::{Liveness, Sandbox};

/// How long the agent of an adopted VM has to answer.
const AGENT_TIMEOUT: Duration = Duration::from_secs(10);
/// The most a channel may hold before the agent's `Ready` (what the old host left unread).
const MAX_SKIPPED: usize = 8 << 20;

/// What the service keeps of a running VM to take it on again after a restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmRecord {
    /// The backend that started it (`qemu`).
    pub backend: String,
    /// Its process's pid.
    pub pid: u32,
    /// Its process's start time (clock ticks since boot): with the pid, which process it is.
    pub start_time: u64,
    /// Its process's uid, when it has one of its own.
    pub uid: Option<u32>,
    /// Its cgroup's directories.
    pub cgroup: Vec<PathBuf>,
    /// Its cgroup's memory limit in MiB, for the message if it runs out.
    pub memory_mib: u64,
    /// Its state directory: its disk, and the socket it (QEMU's agent chardev, or
    /// `sandbox-vm`'s control) listens on.
    pub state_dir: PathBuf,
    /// The token `sandbox-vm` answers an adoption with (none for QEMU, which cannot).
    #[serde(default)]
    pub token: Option<String>,
}

/// Why a recorded VM cannot be taken on again.
#[derive(Debug, Error)]
pub enum AdoptVmError {
    /// Its backend's VMs cannot be taken on again.
    #[error("it was started by the {0} backend, whose VMs cannot be taken on again yet")]
    Backend(String),
    /// Its process is gone, or is not the one recorded.
    #[error(transparent)]
    Process(#[from] sandbox_jail::AdoptError),
    /// Its agent's socket does not connect.
    #[error("its agent's socket {}: {source}", .path.display())]
    Connect {
        /// The socket.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// Its agent did not say it is ready.
    #[error("its agent did not answer within {AGENT_TIMEOUT:?}: {0}")]
    Agent(String),
    /// Its VM process did not answer its adoption as the one started for it.
    #[error("its VM process: {0}")]
    Control(String),
}

/// Where a VM taken on again writes its snapshot (a pausable sandbox's, on the KVM backend): the
/// files its start was given, and its guest memory. The caller knows them from the sandbox's
/// id; a record names no path the VM may write.
#[derive(Debug, Clone)]
pub struct SnapshotTo {
    /// The snapshot set the VM writes to.
    pub files: crate::backend::SnapshotFiles,
    /// The guest's memory.
    pub memory_mib: u32,
}

/// The sandbox `record` describes, taken on again: its process adopted, its agent's channel
/// connected anew and answering, watched as one this run booted. The agent does not know the
/// host is new: a ping makes it announce itself (`Ready`), as a restored agent does. On
/// failure a process that was adopted is killed and its directory removed; one that was not
/// (gone, or not the recorded one) is left to the caller.
pub async fn adopt(
    id: &str,
    record: &VmRecord,
    liveness: Liveness,
    snapshot_to: Option<SnapshotTo>,
) -> Result<Sandbox, AdoptVmError> {
    let t0 = Instant::now();
    let path = record.state_dir.join(crate::qemu::process::AGENT_SOCKET);
    let (vm, stream): (std::sync::Arc<dyn crate::Vm>, _) = match record.backend.as_str() {
        "qemu" => {
            // A QEMU VM is snapshotted only for a template, never after its start.
            drop(snapshot_to);
            let vm = crate::qemu::process::adopt(id, record).await?;
            let stream = tokio::net::UnixStream::connect(&path)
                .await
                .map_err(|source| AdoptVmError::Connect {
                    path: path.clone(),
                    source,
                })?;
            (vm.into(), stream)
        }
        #[cfg(target_os = "linux")]
        "kvm" => {
            let (vm, stream) = crate::kvm::process::adopt(id, record, snapshot_to).await?;
            (vm.into(), stream)
        }
        other => return Err(AdoptVmError::Backend(other.chars().take(16).collect())),
    };
    let (mut read, mut write) = stream.into_split();
    let ping = sandbox_protocol::Frame::new(sandbox_protocol::Kind::Ping, 0, Vec::new()).encode();
    tokio::io::AsyncWriteExt::write_all(&mut write, &ping)
        .await
        .map_err(|source| AdoptVmError::Connect {
            path: path.clone(),
            source,
        })?;
    let rest = tokio::time::timeout(AGENT_TIMEOUT, skip_to_ready(&mut read))
        .await
        .map_err(|_| AdoptVmError::Agent("no Ready came".into()))??;
    // The client reads on from the frame's boundary after that `Ready` (what came after it in
    // the same read first); a second ping's `Ready` is its own.
    tokio::io::AsyncWriteExt::write_all(&mut write, &ping)
        .await
        .map_err(|source| AdoptVmError::Connect { path, source })?;
    let read = tokio::io::AsyncReadExt::chain(std::io::Cursor::new(rest), read);
    let client = Client::numbered_from(Box::new(read), Box::new(write), first_stream());
    let ready = client
        .wait_ready(AGENT_TIMEOUT)
        .await
        .map_err(|e| AdoptVmError::Agent(e.to_string()))?;
    Ok(Sandbox::watched(
        id.to_string(),
        vm,
        client,
        ready,
        t0.elapsed(),
        liveness,
    ))
}

/// A new token of adoption for a process that may outlive the service: 32 random bytes, in
/// hex. The process answers an adoption with it, which shows it is the one started with it.
pub fn new_token() -> std::io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Whether two tokens are equal, in a time that does not depend on where they differ.
pub fn same_token(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Where a host that takes an agent on again starts numbering its streams: at a random point
/// from 2^20 on, far from the ones an earlier host used (numbered from 1), which the agent may
/// still hold if it never saw that host go.
pub(crate) fn first_stream() -> u32 {
    use std::io::Read;
    let mut b = [0u8; 4];
    let _ = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    (1 << 20) + (u32::from_le_bytes(b) % (1 << 30))
}

/// Reads the channel up to and including the agent's `Ready` on stream 0, dropping what came
/// before it: a VM's channel may hold what its guest wrote while no host was there (QEMU keeps
/// a port's unsent bytes for the next connection), the tail of a frame among it. At most
/// [`MAX_SKIPPED`] bytes; the caller bounds the time. What came after the `Ready` in the same
/// read is returned, for the reader that goes on.
pub(crate) async fn skip_to_ready(
    read: &mut (impl tokio::io::AsyncRead + Unpin),
) -> Result<Vec<u8>, AdoptVmError> {
    use tokio::io::AsyncReadExt;
    let mut dec = sandbox_protocol::Decoder::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut skipped = 0usize;
    loop {
        let n = read
            .read(&mut buf)
            .await
            .map_err(|e| AdoptVmError::Agent(format!("reading its channel: {e}")))?;
        if n == 0 {
            return Err(AdoptVmError::Agent("its channel closed".into()));
        }
        skipped += n;
        if skipped > MAX_SKIPPED {
            return Err(AdoptVmError::Agent(format!(
                "more than {MAX_SKIPPED} bytes came before its Ready"
            )));
        }
        dec.push(&buf[..n]);
        while let Some(frame) = dec.next_frame() {
            if let Ok(f) = frame
                && f.kind == sandbox_protocol::Kind::Ready as u8
                && f.stream == 0
            {
                return Ok(dec.into_pending());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_protocol::{Frame, Kind};

    #[tokio::test]
    async fn what_the_old_host_left_is_skipped_up_to_the_ready() {
        let mut bytes = Frame::new(Kind::Stdout, 3, b"late output".to_vec()).encode();
        // The tail of a frame, cut anywhere, and a magic that leads nowhere.
        let cut = Frame::new(Kind::Stdout, 4, vec![b'x'; 300]).encode();
        bytes.extend_from_slice(&cut[7..]);
        bytes.extend_from_slice(b"SBX1garbage");
        bytes.extend_from_slice(&Frame::new(Kind::Ready, 0, b"{}".to_vec()).encode());
        let (mut host, mut guest) = tokio::io::duplex(1 << 20);
        // The start of what follows the `Ready` comes in the same read.
        let after = Frame::new(Kind::Ready, 0, b"{\"second\":1}".to_vec()).encode();
        bytes.extend_from_slice(&after[..9]);
        tokio::io::AsyncWriteExt::write_all(&mut guest, &bytes)
            .await
            .unwrap();
        let mut rest = skip_to_ready(&mut host).await.unwrap();
        assert_eq!(rest, after[..9], "kept for the reader that goes on");
        tokio::io::AsyncWriteExt::write_all(&mut guest, &after[9..])
            .await
            .unwrap();
        drop(guest);
        tokio::io::AsyncReadExt::read_to_end(&mut host, &mut rest)
            .await
            .unwrap();
        assert_eq!(rest, after);
    }

    #[tokio::test]
    async fn a_channel_that_closes_or_floods_before_its_ready_is_refused() {
        let (mut host, guest) = tokio::io::duplex(1024);
        drop(guest);
        assert!(matches!(
            skip_to_ready(&mut host).await,
            Err(AdoptVmError::Agent(_))
        ));
        let (mut host, mut guest) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            let junk = vec![b'j'; 1 << 16];
            while tokio::io::AsyncWriteExt::write_all(&mut guest, &junk)
                .await
                .is_ok()
            {}
        });
        let e = skip_to_ready(&mut host).await.unwrap_err().to_string();
        assert!(e.contains("more than"), "{e}");
    }
}
