//! What one sandbox's egress has done, shared between its stack, its connections and the API.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use std::collections::VecDeque;
use std::time::SystemTime;

use crate::meter::record::UsageRecord;
use crate::meter::request::Unmetered;
use crate::refusal::{Reason, Refusals};

/// Metered calls kept per sandbox (the totals keep counting past it).
pub const CALLS: usize = 10_000;

/// One metered response.
#[derive(Debug, Clone)]
pub struct Call {
    /// When its body ended (or was cut).
    pub at: SystemTime,
    /// The host that answered.
    pub host: String,
    /// Its HTTP status.
    pub status: u16,
    /// Whether the body ended normally (false: cut before its end).
    pub complete: bool,
    /// The usage it reported; `None` when it reported none (an error body, or one of the
    /// `unmetered` cases).
    pub usage: Option<UsageRecord>,
    /// Why a successful call's usage could not be read; `None` when it was, and for errors
    /// (which providers do not bill).
    pub unmetered: Option<Unmetered>,
}

/// The metered calls of a sandbox.
#[derive(Debug, Default)]
pub struct UsageLog {
    /// The most recent calls, oldest first.
    pub calls: VecDeque<Call>,
    /// Calls let go from `calls`.
    pub dropped: u64,
    /// Sums over every call.
    pub totals: Totals,
}

/// Sums of usage.
#[derive(Debug, Default, Clone, Copy)]
pub struct Totals {
    /// Calls.
    pub calls: u64,
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Cache reads.
    pub cache_read_tokens: u64,
    /// Cache writes.
    pub cache_write_tokens: u64,
    /// Billed cost in USD, when any call reported one.
    pub billed_cost_usd: Option<f64>,
    /// Calls whose usage could not be read, by reason (in the order of [`Unmetered::ALL`]).
    pub unmetered: [u64; Unmetered::ALL.len()],
}

impl Totals {
    /// Calls whose usage could not be read.
    pub fn unmetered_calls(&self) -> u64 {
        self.unmetered.iter().sum()
    }

    /// Unmetered calls of one reason.
    pub fn unmetered(&self, why: Unmetered) -> u64 {
        self.unmetered[why as usize]
    }
}

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
    usage: Mutex<UsageLog>,
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

    /// The metered calls.
    pub fn usage(&self) -> MutexGuard<'_, UsageLog> {
        self.usage.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a metered call.
    pub fn record_call(&self, call: Call) {
        let mut u = self.usage();
        u.totals.calls += 1;
        if let Some(why) = call.unmetered {
            u.totals.unmetered[why as usize] += 1;
        }
        if let Some(r) = &call.usage {
            u.totals.input_tokens += r.input_tokens;
            u.totals.output_tokens += r.output_tokens;
            u.totals.cache_read_tokens += r.cache_read_tokens;
            u.totals.cache_write_tokens += r.cache_write_tokens;
            if let Some(c) = r.cost {
                *u.totals.billed_cost_usd.get_or_insert(0.0) += c;
            }
        }
        if u.calls.len() == CALLS {
            u.calls.pop_front();
            u.dropped += 1;
        }
        u.calls.push_back(call);
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
