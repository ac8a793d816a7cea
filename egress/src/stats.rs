//! What one sandbox's egress has done, shared between its stack, its connections and the API.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::refusal::{Reason, Refusals};

/// Counters of one sandbox's egress. Monotonic except `open`.
#[derive(Debug, Default)]
pub struct Stats {
    refusals: Arc<Mutex<Refusals>>,
    /// Connections open now.
    pub open: AtomicU64,
    /// Connections the guest opened to an allowed name.
    pub connections: AtomicU64,
    /// TLS connections copied through without decryption.
    pub spliced: AtomicU64,
    /// TLS connections terminated with the sandbox CA.
    pub intercepted: AtomicU64,
    /// Plain HTTP connections.
    pub http: AtomicU64,
    /// Bytes from the guest written upstream.
    pub to_upstream: AtomicU64,
    /// Bytes from upstream given to the guest.
    pub to_guest: AtomicU64,
    /// Connections that failed upstream without a policy reason (resolve or connect errors).
    pub upstream_failures: AtomicU64,
}

impl Stats {
    /// The refusal log the gate writes too.
    pub fn refusal_log(&self) -> Arc<Mutex<Refusals>> {
        self.refusals.clone()
    }

    /// The refusals so far.
    pub fn refusals(&self) -> MutexGuard<'_, Refusals> {
        self.refusals.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a refusal.
    pub fn refuse(&self, reason: Reason, target: &str) {
        self.refusals().record(reason, target);
    }

    /// Adds to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}
