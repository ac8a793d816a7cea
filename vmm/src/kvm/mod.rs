//! The KVM backend's service side: each VM a `sandbox-vm` process (the `sandbox-vm` crate), which
//! the service starts in a jail and drives over its control socket ([`process`], `control`; its end read by `judge`). With the
//! `in-process` feature the machine can also run in the caller's process ([`in_process`]),
//! which the benchmarks compare against.

pub mod backend;
mod control;
pub mod guest;
#[cfg(feature = "in-process")]
mod in_process;
mod judge;
pub mod process;

pub use backend::{KvmBackend, KvmUnusable};
pub use guest::AGENT_PORT;
