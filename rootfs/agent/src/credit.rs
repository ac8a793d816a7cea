//! Send credit for one stream: how many bytes the host still lets the agent send.

use std::sync::{Condvar, Mutex};

/// The stream is over: no credit will come.
#[derive(Debug, PartialEq, Eq)]
pub struct Closed;

/// Credit granted by the host's `Window` frames, spent by the stream's senders.
pub struct Credit {
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    avail: u64,
    closed: bool,
}

impl Credit {
    /// Credit starting at `initial` bytes.
    pub fn new(initial: u32) -> Self {
        Credit {
            state: Mutex::new(State {
                avail: initial.into(),
                closed: false,
            }),
            cv: Condvar::new(),
        }
    }

    /// Adds a grant. Grants are capped so a hostile host cannot overflow the counter.
    pub fn grant(&self, n: u32) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.avail = s.avail.saturating_add(n.into()).min(1 << 40);
        self.cv.notify_all();
    }

    /// Wakes every waiter for good: the stream is over.
    pub fn close(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.closed = true;
        self.cv.notify_all();
    }

    /// Takes up to `want` bytes of the credit there is now, without waiting (0 when there is
    /// none); `Err` once closed. For a sender that has other work while the host reads slowly
    /// (a watch reads the kernel's events meanwhile).
    pub fn try_take(&self, want: usize) -> Result<usize, Closed> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.closed {
            return Err(Closed);
        }
        let n = (want as u64).min(s.avail);
        s.avail -= n;
        Ok(n as usize)
    }

    /// Waits for credit and takes up to `want` bytes of it; `None` once closed.
    pub fn take(&self, want: usize) -> Option<usize> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if s.closed {
                return None;
            }
            if s.avail > 0 {
                let n = (want as u64).min(s.avail);
                s.avail -= n;
                return Some(n as usize);
            }
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn take_waits_for_grant_and_close_releases() {
        let c = Arc::new(Credit::new(3));
        assert_eq!(c.take(10), Some(3));
        let c2 = c.clone();
        let t = std::thread::spawn(move || c2.take(5));
        std::thread::sleep(std::time::Duration::from_millis(20));
        c.grant(4);
        assert_eq!(t.join().unwrap(), Some(4));
        let c3 = c.clone();
        let t = std::thread::spawn(move || c3.take(5));
        c.close();
        assert_eq!(t.join().unwrap(), None);
        assert_eq!(c.try_take(1), Err(Closed));
        let c = Credit::new(2);
        assert_eq!((c.try_take(5), c.try_take(5)), (Ok(2), Ok(0)));
    }
}
