//! The VM process's side of the guest's network: a [`FrameLink`] over the stream socket the
//! service gave it, with frames as a 4-byte big-endian length and the frame (the framing of
//! QEMU's `-netdev stream`, so the service pumps both backends alike).
//!
//! The device thread never blocks on the service: frames to the service go through a bounded
//! queue to a writer thread (a full queue drops the frame; TCP resends), frames from the service
//! through a bounded queue filled by a reader thread.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};

use sandbox_control::link::FrameLink;

/// Longest frame either way (1500 bytes of MTU, the Ethernet header and a VLAN tag).
const MAX_FRAME: usize = 1518;
/// Frames waiting in each direction.
const QUEUE: usize = 256;

type Waker = Box<dyn Fn() + Send + Sync>;

struct Inner {
    to_guest: Mutex<VecDeque<Vec<u8>>>,
    to_host: Mutex<VecDeque<Vec<u8>>>,
    to_host_ready: Condvar,
    waker: Mutex<Option<Waker>>,
}

/// A link whose other end is the service's network pump.
pub struct StreamLink {
    inner: Arc<Inner>,
}

impl StreamLink {
    /// Starts the reader and writer threads on `sock`; they end when the socket does.
    pub fn new(sock: UnixStream) -> std::io::Result<StreamLink> {
        let inner = Arc::new(Inner {
            to_guest: Mutex::new(VecDeque::new()),
            to_host: Mutex::new(VecDeque::new()),
            to_host_ready: Condvar::new(),
            waker: Mutex::new(None),
        });
        // Each thread says when it has its filter; the link is handed over only then, so the
        // machine's vCPUs never run beside an unfiltered thread of ours.
        let (sealed_tx, sealed) = std::sync::mpsc::sync_channel::<()>(2);
        let mut reader = sock.try_clone()?;
        let r = inner.clone();
        let sealed_in = sealed_tx.clone();
        std::thread::Builder::new()
            .name("vm-net-in".into())
            .spawn(move || {
                crate::seal::enter_or_abort(crate::seal::ThreadKind::Device);
                let _ = sealed_in.send(());
                drop(sealed_in);
                let mut len = [0u8; 4];
                let mut buf = vec![0u8; 65_535 + 18];
                loop {
                    if reader.read_exact(&mut len).is_err() {
                        return;
                    }
                    let n = u32::from_be_bytes(len) as usize;
                    if n > buf.len() || reader.read_exact(&mut buf[..n]).is_err() {
                        return;
                    }
                    if n > MAX_FRAME {
                        continue;
                    }
                    let was_empty = {
                        let mut q = r.to_guest.lock().unwrap_or_else(|e| e.into_inner());
                        if q.len() >= QUEUE {
                            continue;
                        }
                        q.push_back(buf[..n].to_vec());
                        q.len() == 1
                    };
                    if was_empty
                        && let Some(w) = r.waker.lock().unwrap_or_else(|e| e.into_inner()).as_ref()
                    {
                        w();
                    }
                }
            })?;
        let mut writer = sock;
        let w = inner.clone();
        std::thread::Builder::new()
            .name("vm-net-out".into())
            .spawn(move || {
                crate::seal::enter_or_abort(crate::seal::ThreadKind::Device);
                let _ = sealed_tx.send(());
                drop(sealed_tx);
                loop {
                    let frame = {
                        let mut q = w.to_host.lock().unwrap_or_else(|e| e.into_inner());
                        loop {
                            if let Some(f) = q.pop_front() {
                                break f;
                            }
                            q = w.to_host_ready.wait(q).unwrap_or_else(|e| e.into_inner());
                        }
                    };
                    let mut msg = Vec::with_capacity(4 + frame.len());
                    msg.extend_from_slice(&(frame.len() as u32).to_be_bytes());
                    msg.extend_from_slice(&frame);
                    if writer.write_all(&msg).is_err() {
                        return;
                    }
                }
            })?;
        for _ in 0..2 {
            sealed
                .recv()
                .map_err(|_| std::io::Error::other("a network link thread ended unsealed"))?;
        }
        Ok(StreamLink { inner })
    }
}

impl FrameLink for StreamLink {
    fn send(&self, frame: &[u8]) -> bool {
        if frame.len() > MAX_FRAME {
            return false;
        }
        let mut q = self.inner.to_host.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= QUEUE {
            return false;
        }
        q.push_back(frame.to_vec());
        self.inner.to_host_ready.notify_one();
        true
    }

    fn recv(&self, buf: &mut [u8]) -> Option<usize> {
        let f = self
            .inner
            .to_guest
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()?;
        let n = f.len().min(buf.len());
        buf[..n].copy_from_slice(&f[..n]);
        Some(n)
    }

    fn set_waker(&self, wake: Box<dyn Fn() + Send + Sync>) {
        *self.inner.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(wake);
    }
}
