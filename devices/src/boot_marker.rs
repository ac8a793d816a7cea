//! The boot-time marker: an I/O port the guest's init writes once, when userspace starts, so
//! that boot time is measured from inside the guest rather than guessed from the console.
//!
//! The agent writes [`BootMarker::VALUE`] to [`BootMarker::PORT`] as its first act as PID 1.
//! Later writes (and other values) are ignored: a guest cannot move the mark.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// When the guest reached userspace, relative to the VM's start.
#[derive(Debug)]
pub struct BootMarker {
    start: Instant,
    at: OnceLock<Duration>,
}

impl BootMarker {
    /// The I/O port (unused by anything else on our machine).
    pub const PORT: u16 = sandbox_protocol::boot_marker::PORT;
    /// The value the guest writes.
    pub const VALUE: u8 = sandbox_protocol::boot_marker::VALUE;

    /// A marker counting from `start` (the moment the VMM began building the VM).
    pub fn new(start: Instant) -> BootMarker {
        BootMarker {
            start,
            at: OnceLock::new(),
        }
    }

    /// A guest write of `value`; only the first [`VALUE`](Self::VALUE) counts. True when this
    /// write set the mark, so whoever waits for it is woken once, however often a guest writes.
    pub fn write(&self, value: u8) -> bool {
        value == Self::VALUE && self.at.set(self.start.elapsed()).is_ok()
    }

    /// From VM start to the guest's mark, once it came.
    pub fn elapsed(&self) -> Option<Duration> {
        self.at.get().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_first_right_value_counts() {
        let m = BootMarker::new(Instant::now());
        assert!(!m.write(1));
        assert!(m.elapsed().is_none());
        assert!(m.write(BootMarker::VALUE));
        let first = m.elapsed().unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(!m.write(BootMarker::VALUE));
        assert_eq!(m.elapsed(), Some(first));
    }
}
