//! The memory one sandbox's egress may hold on the host, as one budget (issue 29, item 8).
//!
//! Every buffer the guest can fill is bounded by a constant, so each connection, upstream
//! connection and request has a worst case known when it starts. It takes that worst case from
//! the sandbox's [`Budget`] before it starts, and gives it back when it is gone; request bodies
//! the meter holds take what they hold. The budget is `SANDBOX_HOST_EGRESS_MEMORY_MIB`, and the
//! service's admission counts it with the guest's memory, so a guest that opens every connection
//! it may and fills every buffer costs the host at most that, and one sandbox cannot take memory
//! the others were promised. Beyond it a new connection is reset and a new request answered
//! `503`, both counted as `memory_limit`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Largest chunk a connection moves in one message, each way.
pub(crate) const CHUNK: usize = 16 * 1024;
/// Chunks a connection's channel holds: with [`CHUNK`], 64 KiB in flight each way.
pub(crate) const CHUNKS: usize = 4;

/// The default budget when the meter holds bodies of up to [`crate::intercept::interception::DEFAULT_BODY_MAX`]:
/// two such bodies at once (what the meter held before there was one budget) and 32 MiB for
/// connections, which is some 20 intercepted requests in flight at their worst case or 90
/// spliced connections; a run of npm or pip opens a few dozen at most.
pub const DEFAULT_MEMORY: usize = 2 * crate::intercept::interception::DEFAULT_BODY_MAX + (32 << 20);

/// A TLS session's buffers at most: rustls' received plaintext (16 KiB) and sendable plaintext
/// (64 KiB) limits, a record being read and one being written.
const TLS_SESSION: usize = 128 << 10;

/// The largest buffer hyper may grow to on one HTTP/1 connection, reading or writing
/// ([`crate::intercept`] sets it on both ends).
pub const HTTP1_BUFFER: usize = 64 << 10;

/// The HTTP/2 connection window the guest's side gets: request body bytes in flight from the guest,
/// all streams together.
pub const H2_CONNECTION_WINDOW: u32 = 256 << 10;

/// The HTTP/2 stream window the guest's side gets.
pub const H2_STREAM_WINDOW: u32 = 64 << 10;

/// What one HTTP/2 stream to the guest may hold of its response, sent and not yet acknowledged.
pub const H2_SEND_BUFFER: usize = 64 << 10;

/// The stack's side of one guest connection: its socket's two buffers (`socket_buffer` each) and
/// the bytes waiting for room in the socket (one chunk).
pub fn socket_cost(socket_buffer: usize) -> usize {
    2 * socket_buffer + CHUNK
}

/// A connection's task, whatever it becomes: its two channels, the first bytes read to decide
/// it (a request head or a ClientHello, at most 32 KiB) and a chunk each way being copied.
pub const TASK_COST: usize = 2 * CHUNKS * CHUNK + (32 << 10) + 2 * CHUNK;

/// What a connection adds when it is served as HTTP (intercepted or plain): the TLS session to
/// the guest, hyper's two buffers and the HTTP/2 connection window.
pub const HTTP_COST: usize = TLS_SESSION + 2 * HTTP1_BUFFER + H2_CONNECTION_WINDOW as usize;

/// One upstream connection of an HTTP connection: its TLS session and hyper's two buffers.
pub const UPSTREAM_COST: usize = TLS_SESSION + 2 * HTTP1_BUFFER;

/// One request in flight: its response's HTTP/2 send buffer, the bytes the echo scan holds back,
/// the meter's longest event line and JSON value, and a chunk in transit.
pub const REQUEST_COST: usize = H2_SEND_BUFFER
    + crate::echo::HOLD_BACK
    + crate::meter::sse::MAX_LINE
    + crate::meter::json_scan::MAX_VALUE
    + CHUNK;

/// The bytes one sandbox's egress may hold at once.
#[derive(Debug)]
pub struct Budget {
    used: AtomicUsize,
    max: usize,
}

impl Budget {
    /// A budget of `max` bytes.
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Budget {
            used: AtomicUsize::new(0),
            max,
        })
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// The budget's size.
    pub fn max(&self) -> usize {
        self.max
    }
}

/// A share of a [`Budget`], given back when dropped.
#[derive(Debug)]
pub struct Hold {
    budget: Arc<Budget>,
    n: usize,
}

impl Hold {
    /// The budget this is a share of.
    pub fn budget(&self) -> Arc<Budget> {
        self.budget.clone()
    }

    /// An empty share of `budget`.
    pub fn new(budget: &Arc<Budget>) -> Self {
        Hold {
            budget: budget.clone(),
            n: 0,
        }
    }

    /// A share of `n` bytes of `budget`, if it has that much left.
    pub fn take(budget: &Arc<Budget>, n: usize) -> Option<Self> {
        let mut h = Hold::new(budget);
        h.grow(n).then_some(h)
    }

    /// Takes `by` bytes more; false (and nothing taken) when the budget has not that much left.
    pub fn grow(&mut self, by: usize) -> bool {
        let b = &self.budget;
        let ok = b
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(by).filter(|&n| n <= b.max)
            })
            .is_ok();
        if ok {
            self.n += by;
        }
        ok
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.n, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_is_shared_and_given_back() {
        let b = Budget::new(100);
        let mut one = Hold::new(&b);
        let mut two = Hold::new(&b);
        assert!(one.grow(60));
        assert!(!two.grow(41), "past the budget");
        assert!(two.grow(40));
        assert!(!one.grow(1));
        assert!(!one.grow(usize::MAX), "no overflow");
        assert!(Hold::take(&b, 1).is_none());
        drop(one);
        assert_eq!(b.used(), 40);
        let three = Hold::take(&b, 60).expect("room again");
        assert_eq!(b.used(), 100);
        drop((two, three));
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn the_default_admits_the_connections_a_build_opens() {
        let spliced = socket_cost(64 << 10) + TASK_COST;
        let intercepted = spliced + HTTP_COST + UPSTREAM_COST + REQUEST_COST;
        let connections = DEFAULT_MEMORY - 2 * crate::intercept::interception::DEFAULT_BODY_MAX;
        assert!(connections / spliced >= 64, "{}", connections / spliced);
        assert!(
            connections / intercepted >= 16,
            "{}",
            connections / intercepted
        );
    }
}
