//! The wire between a guest's network device and its stack: two bounded queues of Ethernet
//! frames. The backend's end is synchronous (the KVM device thread, QEMU's socket pump); the
//! stack's end is async. A guest that sends faster than the stack takes frames loses frames (and
//! they are counted), never the host's memory.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// Largest frame carried: 1500 bytes of payload, the Ethernet header and a VLAN tag.
pub const MAX_FRAME: usize = 1518;
/// Frames a queue holds at most, each way.
pub const QUEUE_FRAMES: usize = 1024;

type Waker = Box<dyn Fn() + Send + Sync>;

#[derive(Default)]
struct Inner {
    to_stack: Mutex<VecDeque<Vec<u8>>>,
    to_guest: Mutex<VecDeque<Vec<u8>>>,
    stack_wake: Notify,
    guest_wake: Mutex<Option<Waker>>,
    dropped_to_stack: AtomicU64,
    dropped_to_guest: AtomicU64,
    oversized: AtomicU64,
}

/// A new link: the guest's end for the backend, the stack's end for the stack.
pub fn link() -> (GuestEnd, StackEnd) {
    let inner = Arc::new(Inner::default());
    (
        GuestEnd {
            inner: inner.clone(),
        },
        StackEnd { inner },
    )
}

fn push(q: &Mutex<VecDeque<Vec<u8>>>, frame: &[u8], dropped: &AtomicU64) -> Option<bool> {
    let mut q = q.lock().unwrap_or_else(|e| e.into_inner());
    if q.len() >= QUEUE_FRAMES {
        dropped.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    let was_empty = q.is_empty();
    q.push_back(frame.to_vec());
    Some(was_empty)
}

/// The backend's end.
#[derive(Clone)]
pub struct GuestEnd {
    inner: Arc<Inner>,
}

impl GuestEnd {
    /// A frame from the guest; `false` if it was dropped (queue full or oversized).
    pub fn send(&self, frame: &[u8]) -> bool {
        if frame.len() > MAX_FRAME {
            self.inner.oversized.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        match push(&self.inner.to_stack, frame, &self.inner.dropped_to_stack) {
            Some(_) => {
                self.inner.stack_wake.notify_one();
                true
            }
            None => false,
        }
    }

    /// The next frame for the guest, copied into `buf` (at least [`MAX_FRAME`] bytes).
    pub fn recv(&self, buf: &mut [u8]) -> Option<usize> {
        let frame = self
            .inner
            .to_guest
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()?;
        let n = frame.len().min(buf.len());
        buf[..n].copy_from_slice(&frame[..n]);
        Some(n)
    }

    /// Called (from the stack's thread) whenever the queue to the guest turns non-empty, so the
    /// backend can wake its device; an eventfd write, typically.
    pub fn set_waker(&self, wake: impl Fn() + Send + Sync + 'static) {
        *self
            .inner
            .guest_wake
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Box::new(wake));
    }
}

/// The stack's end.
#[derive(Clone)]
pub struct StackEnd {
    inner: Arc<Inner>,
}

impl StackEnd {
    /// The next frame from the guest, waiting for one.
    pub async fn recv(&self) -> Vec<u8> {
        loop {
            let notified = self.inner.stack_wake.notified();
            if let Some(f) = self.try_recv() {
                return f;
            }
            notified.await;
        }
    }

    /// The next frame from the guest, if one is waiting.
    pub fn try_recv(&self) -> Option<Vec<u8>> {
        self.inner
            .to_stack
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
    }

    /// A frame for the guest; `false` if the guest's queue was full and it was dropped.
    pub fn send(&self, frame: &[u8]) -> bool {
        match push(&self.inner.to_guest, frame, &self.inner.dropped_to_guest) {
            Some(was_empty) => {
                if was_empty
                    && let Some(w) = &*self
                        .inner
                        .guest_wake
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                {
                    w();
                }
                true
            }
            None => false,
        }
    }

    /// Frames dropped: from the guest (queue full or oversized), and to the guest.
    pub fn dropped(&self) -> (u64, u64) {
        (
            self.inner.dropped_to_stack.load(Ordering::Relaxed)
                + self.inner.oversized.load(Ordering::Relaxed),
            self.inner.dropped_to_guest.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[tokio::test]
    async fn frames_flow_both_ways_in_order_and_wake_the_other_side() {
        let (guest, stack) = link();
        let wakes = Arc::new(AtomicUsize::new(0));
        let w = wakes.clone();
        guest.set_waker(move || {
            w.fetch_add(1, Ordering::SeqCst);
        });
        let reader = tokio::spawn({
            let stack = stack.clone();
            async move { (stack.recv().await, stack.recv().await) }
        });
        tokio::task::yield_now().await;
        assert!(guest.send(b"one"));
        assert!(guest.send(b"two"));
        assert_eq!(reader.await.unwrap(), (b"one".to_vec(), b"two".to_vec()));

        assert!(stack.send(b"a") && stack.send(b"b"));
        assert_eq!(
            wakes.load(Ordering::SeqCst),
            1,
            "woken when the queue turned non-empty"
        );
        let mut buf = [0u8; MAX_FRAME];
        assert_eq!(guest.recv(&mut buf), Some(1));
        assert_eq!(&buf[..1], b"a");
        assert_eq!(guest.recv(&mut buf), Some(1));
        assert_eq!(guest.recv(&mut buf), None);
        assert!(stack.send(b"c"));
        assert_eq!(wakes.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn queues_are_bounded_and_drops_counted() {
        let (guest, stack) = link();
        for _ in 0..QUEUE_FRAMES {
            assert!(guest.send(&[0u8; 60]));
        }
        assert!(!guest.send(&[0u8; 60]));
        assert!(!guest.send(&[0u8; MAX_FRAME + 1]));
        for _ in 0..QUEUE_FRAMES + 5 {
            stack.send(&[1u8; 60]);
        }
        assert_eq!(stack.dropped(), (2, 5));
        assert!(stack.try_recv().is_some());
    }
}
