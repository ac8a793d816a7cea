//! Egress of sandbox-host (issue 5): every byte a guest sends out goes through this crate.
//!
//! This first part holds the decisions that need no network: which names a run may reach
//! ([`policy`]), which addresses nothing may reach ([`addr`]), the operator's test overrides for
//! name resolution ([`resolve`]) and the fixed addressing of the guest's link ([`net`]). The
//! userspace stack that applies them to the guest's frames builds on these.
#![forbid(unsafe_code)]

pub mod addr;
pub mod decide;
pub mod dns;
pub mod gate;
pub mod link;
pub mod meter;
pub mod net;
pub mod policy;
pub mod refusal;
pub mod resolve;
pub mod secrets;
pub mod sniff;
pub mod tls;
pub mod upstream;
