//! A bounded record of a guest's console output.
//!
//! The guest controls what it prints and how much, so the log keeps only the last
//! [`ConsoleLog::capacity`] bytes, never grows beyond that, and splits lines itself (a guest that
//! never prints a newline still cannot make it allocate more).

use std::collections::VecDeque;

/// Default number of bytes kept: enough for a kernel panic trace.
pub const DEFAULT_CAPACITY: usize = 64 * 1024;

/// Ring buffer of console bytes.
#[derive(Debug, Clone)]
pub struct ConsoleLog {
    buf: VecDeque<u8>,
    cap: usize,
    total: u64,
}

impl Default for ConsoleLog {
    fn default() -> Self {
        Self::with_capacity(DEFAULT_CAPACITY)
    }
}

impl ConsoleLog {
    /// A log keeping the last `cap` bytes (at least 1).
    pub fn with_capacity(cap: usize) -> Self {
        let cap = cap.max(1);
        ConsoleLog {
            buf: VecDeque::with_capacity(cap.min(DEFAULT_CAPACITY)),
            cap,
            total: 0,
        }
    }

    /// How many bytes it keeps at most.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Bytes ever written, kept or not.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Appends console output, dropping the oldest bytes beyond capacity.
    pub fn write(&mut self, bytes: &[u8]) {
        self.total += bytes.len() as u64;
        let bytes = &bytes[bytes.len().saturating_sub(self.cap)..];
        let overflow = (self.buf.len() + bytes.len()).saturating_sub(self.cap);
        self.buf.drain(..overflow);
        self.buf.extend(bytes);
    }

    /// The last `n` lines (lossy UTF-8, control characters other than tab removed, carriage
    /// returns dropped), oldest first. A partial first line cut by the ring is left out.
    pub fn tail(&self, n: usize) -> Vec<String> {
        let (a, b) = self.buf.as_slices();
        let text: Vec<u8> = a.iter().chain(b).copied().filter(|&c| c != b'\r').collect();
        let text = String::from_utf8_lossy(&text);
        let mut lines: Vec<&str> = text.split('\n').collect();
        if self.total > self.buf.len() as u64 && lines.len() > 1 {
            lines.remove(0);
        }
        if lines.last() == Some(&"") {
            lines.pop();
        }
        let start = lines.len().saturating_sub(n);
        lines[start..]
            .iter()
            .map(|l| {
                l.chars()
                    .filter(|c| !c.is_control() || *c == '\t')
                    .collect()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_last_lines() {
        let mut log = ConsoleLog::with_capacity(1024);
        log.write(b"one\r\ntwo\nthree\n");
        assert_eq!(log.tail(2), vec!["two", "three"]);
        assert_eq!(log.tail(10), vec!["one", "two", "three"]);
    }

    #[test]
    fn bounded_and_drops_cut_line() {
        let mut log = ConsoleLog::with_capacity(20);
        for i in 0..1000 {
            log.write(format!("line {i}\n").as_bytes());
            assert!(log.buf.len() <= 20);
        }
        assert_eq!(log.tail(5), vec!["line 998", "line 999"]);
        assert_eq!(
            log.total_bytes(),
            (0..1000)
                .map(|i| format!("line {i}\n").len() as u64)
                .sum::<u64>()
        );
    }

    #[test]
    fn one_huge_write_without_newline() {
        let mut log = ConsoleLog::with_capacity(8);
        log.write(&vec![b'x'; 1 << 20]);
        assert_eq!(log.buf.len(), 8);
        assert_eq!(log.tail(1), vec!["xxxxxxxx"]);
    }

    #[test]
    fn strips_control_characters() {
        let mut log = ConsoleLog::default();
        log.write(b"\x1b[1mbold\x1b[0m\tok\n");
        assert_eq!(log.tail(1), vec!["[1mbold[0m\tok"]);
    }
}
