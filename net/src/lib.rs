//! A sandbox's network, as the network process runs it (issue 32): its egress stack started from
//! the channel's [`NetConfig`](sandbox_control::net::NetConfig) ([`start`]), and what it has done
//! as the channel's [`Report`](sandbox_control::net::Report) ([`report`]); and its upstream
//! connections, which the service makes for it ([`dial`]): the process has no network of its own.
//! A service that went away and came back takes the running process over ([`adopt`]).
//!
//! The service builds the settings from the create request and its own configuration and never
//! needs the stack's types: what it reads back is the report, typed and bounded.

#![forbid(unsafe_code)]

pub mod adopt;
pub mod dial;
pub mod report;
#[cfg(target_os = "linux")]
pub mod seal;
pub mod start;

pub use report::report;

use sandbox_control::link::FrameLink;
use sandbox_egress::link::GuestEnd;

/// The stack's link as a VM's frames see it: what the pump (and an in-process VM) moves frames
/// through. One adapter for every place that joins the two crates, which do not depend on each
/// other.
pub struct GuestLink(pub GuestEnd);

impl FrameLink for GuestLink {
    fn send(&self, frame: &[u8]) -> bool {
        self.0.send(frame)
    }
    fn recv(&self, buf: &mut [u8]) -> Option<usize> {
        self.0.recv(buf)
    }
    fn set_waker(&self, wake: Box<dyn Fn() + Send + Sync>) {
        self.0.set_waker(wake);
    }
}
pub use start::{Running, StartError, secrets, start, upstream_client};
