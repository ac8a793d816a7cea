//! Frames between a stream socket and a [`FrameLink`]: each Ethernet frame as a 4-byte
//! big-endian length and the frame, the framing of QEMU's `-netdev stream` that `sandbox-vm`
//! speaks too. The network process runs it on the socket the VM process shares with it (and,
//! until each sandbox has one, the service does).
//!
//! Frame lengths come from the guest (through its VM process): a frame longer than the link
//! carries is read into a fixed buffer and dropped; a length beyond any Ethernet frame ends the
//! pump.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::UnixStream;
use tokio::sync::Notify;

use crate::link::FrameLink;

/// Longest frame the other side may hand over (a 64 KiB IP packet with its Ethernet header and
/// tag).
pub const MAX_STREAM_FRAME: usize = 65_535 + 18;
/// Longest frame the link carries (1500 bytes of MTU, header, VLAN tag).
pub const MAX_FRAME: usize = 1518;

/// Moves frames between `stream` and `link` until the socket ends (end of file: `Ok`) or fails.
pub async fn run(stream: UnixStream, link: Arc<dyn FrameLink>) -> std::io::Result<()> {
    let (r, w) = stream.into_split();
    // Frames are small: read them from a buffer, not two system calls each.
    let mut r = BufReader::with_capacity(64 * 1024, r);
    let ready = Arc::new(Notify::new());
    let waker = ready.clone();
    link.set_waker(Box::new(move || waker.notify_one()));

    let from_guest = async {
        let mut buf = vec![0u8; MAX_STREAM_FRAME];
        loop {
            let len = r.read_u32().await? as usize;
            if len > MAX_STREAM_FRAME {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("the VM process sent a {len}-byte frame"),
                ));
            }
            r.read_exact(&mut buf[..len]).await?;
            if len <= MAX_FRAME {
                link.send(&buf[..len]); // a full link drops it (counted there)
            }
        }
        #[allow(unreachable_code)]
        Ok::<(), std::io::Error>(())
    };
    let to_guest = async {
        let mut w = BufWriter::with_capacity(64 * 1024, w);
        let mut buf = vec![0u8; MAX_FRAME];
        loop {
            let notified = ready.notified();
            let mut wrote = false;
            while let Some(n) = link.recv(&mut buf) {
                let n = n.min(MAX_FRAME);
                w.write_u32(n as u32).await?;
                w.write_all(&buf[..n]).await?;
                wrote = true;
            }
            if wrote {
                w.flush().await?;
            }
            notified.await;
        }
        #[allow(unreachable_code)]
        Ok::<(), std::io::Error>(())
    };
    let r = tokio::select! {
        r = from_guest => r,
        r = to_guest => r,
    };
    match r {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(()),
        r => r,
    }
}
