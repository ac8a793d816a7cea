//! What every connection of one sandbox shares: who dials its upstreams, what it intercepts,
//! its counters, its timeouts, its pace, its memory.

use std::sync::Arc;
use std::time::Duration;

use crate::policy::HostPattern;
use crate::stats::Stats;
use crate::upstream;

/// What every connection of one sandbox shares.
pub(crate) struct Context {
    /// Who makes the upstream connections.
    pub(crate) dial: Arc<dyn upstream::Dial>,
    pub(crate) intercept: Vec<HostPattern>,
    pub(crate) stats: Arc<Stats>,
    pub(crate) sniff_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    pub(crate) header_timeout: Duration,
    pub(crate) body_idle_timeout: Duration,
    /// Paces the sandbox's new upstream connections.
    pub(crate) connects: crate::pace::Bucket,
    /// The sandbox's share of the service's log.
    pub(crate) log: crate::pace::LogLimit,
    /// The sandbox's TLS interception, when it has secret or meter hosts.
    pub(crate) interception: Option<Arc<crate::intercept::interception::Interception>>,
    /// Upstream connections the sandbox's proxied and intercepted requests may hold at once
    /// ([`crate::intercept::SANDBOX_UPSTREAM_CONNECTIONS`]); more requests wait their turn.
    pub(crate) upstream: Arc<tokio::sync::Semaphore>,
    /// The sandbox's egress memory ([`crate::memory`]).
    pub(crate) memory: Arc<crate::memory::Budget>,
}
