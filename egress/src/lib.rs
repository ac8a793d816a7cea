//! Egress of sandbox-host (issue 5): every byte a guest sends out goes through this crate.
//!
//! This first part holds the decisions that need no network: which names a run may reach
//! ([`policy`]), which addresses nothing may reach ([`addr`]), the operator's test overrides for
//! name resolution ([`resolve`]) and the fixed addressing of the guest's link ([`net`]). The
//! userspace stack that applies them to the guest's frames builds on these.
#![forbid(unsafe_code)]

pub mod addr;
mod conn;
mod context;
pub mod decide;
pub mod dns;
pub mod echo;
pub mod gate;
mod guest_io;
pub mod host_addrs;
pub mod idle;
pub mod intercept;
pub mod link;
pub mod memory;
pub mod meter;
pub mod net;
mod pace;
mod phy;
pub mod policy;
pub mod refusal;
pub mod request_body;
pub mod resolve;
pub mod secrets;
pub mod sim;
pub mod sniff;
pub mod stack;
pub mod stats;
pub mod tls;
pub mod upstream;

pub use stack::{Egress, EgressConfig, Limits};
