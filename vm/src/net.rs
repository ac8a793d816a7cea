//! The KVM backend's virtio-net backend: frames go to the VM's [`FrameLink`], and an eventfd
//! the link's waker writes tells the device thread (epoll) that frames for the guest wait.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use sandbox_devices::virtio::net::NetBackend;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use sandbox_control::link::FrameLink;

/// A [`NetBackend`] over a [`FrameLink`].
pub struct LinkBackend {
    link: Arc<dyn FrameLink>,
    ready: Arc<EventFd>,
}

impl LinkBackend {
    /// A backend for `link`; installs the link's waker.
    pub fn new(link: Arc<dyn FrameLink>) -> std::io::Result<Self> {
        let ready = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        let waker = ready.clone();
        link.set_waker(Box::new(move || {
            // The counter saturating is harmless: readable is all that matters.
            let _ = waker.write(1);
        }));
        Ok(LinkBackend { link, ready })
    }
}

impl NetBackend for LinkBackend {
    fn send(&mut self, frame: &[u8]) {
        self.link.send(frame);
    }

    fn recv(&mut self, buf: &mut [u8]) -> Option<usize> {
        self.link.recv(buf)
    }

    fn ready_fd(&self) -> Option<RawFd> {
        Some(self.ready.as_raw_fd())
    }

    fn clear_ready(&mut self) {
        let _ = self.ready.read();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Loop {
        frames: Mutex<VecDeque<Vec<u8>>>,
        waker: Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
    }

    impl FrameLink for Loop {
        fn send(&self, frame: &[u8]) -> bool {
            let mut q = self.frames.lock().unwrap();
            let was_empty = q.is_empty();
            q.push_back(frame.to_vec());
            drop(q);
            if was_empty && let Some(w) = &*self.waker.lock().unwrap() {
                w();
            }
            true
        }
        fn recv(&self, buf: &mut [u8]) -> Option<usize> {
            let f = self.frames.lock().unwrap().pop_front()?;
            buf[..f.len()].copy_from_slice(&f);
            Some(f.len())
        }
        fn set_waker(&self, wake: Box<dyn Fn() + Send + Sync>) {
            *self.waker.lock().unwrap() = Some(wake);
        }
    }

    fn readable(fd: RawFd) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    #[test]
    fn the_eventfd_signals_waiting_frames_and_clears() {
        let link = Arc::new(Loop::default());
        let mut b = LinkBackend::new(link.clone()).unwrap();
        let fd = b.ready_fd().unwrap();
        assert!(!readable(fd));
        // A looped-back frame: the waker fires, the fd turns readable.
        b.send(b"frame one");
        assert!(readable(fd));
        b.clear_ready();
        assert!(!readable(fd));
        let mut buf = [0u8; 64];
        assert_eq!(b.recv(&mut buf), Some(9));
        assert_eq!(&buf[..9], b"frame one");
        assert_eq!(b.recv(&mut buf), None);
    }
}
