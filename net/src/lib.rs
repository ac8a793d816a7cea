//! A sandbox's network, as the network process runs it (issue 32): its egress stack started from
//! the channel's [`NetConfig`](sandbox_control::net::NetConfig) ([`start`]), and what it has done
//! as the channel's [`Report`](sandbox_control::net::Report) ([`report`]).
//!
//! The service builds the settings from the create request and its own configuration and never
//! needs the stack's types: what it reads back is the report, typed and bounded.

#![forbid(unsafe_code)]

pub mod report;
#[cfg(target_os = "linux")]
pub mod seal;
pub mod start;

pub use report::report;
pub use start::{Running, StartError, start, upstream_client};
