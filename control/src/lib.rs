//! What crosses the boundaries between the sandbox host's service and the jailed processes of a
//! sandbox, in a small crate both sides use (issue 31):
//!
//! - [`vm`]: `sandbox-vm`'s control socket (the service starts it, configures it, asks it to
//!   pause and snapshot; it reports), the exit codes and bounds both sides agree on;
//! - [`net`]: the network process's channel (`sandbox-net`: the service starts it with the
//!   sandbox's egress settings and reads its counters, refusals and usage);
//! - [`line`]: how both travel, one bounded JSON line at a time with descriptors alongside;
//! - [`console`]: a VM's console as the service keeps it (bounded, the last lines read as
//!   untrusted text), from the pipe either VM process writes it to;
//! - [`files`]: the layout of a snapshot's files, which one side writes and the other sizes and
//!   checks; [`link`]: the Ethernet frames between a VM's network device and the egress stack,
//!   and `pump` (feature `pump`): those frames over the socket between two processes.
//!
//! So the service never links the code that touches guest memory or parses guest traffic, and
//! neither process links the service. Each protocol is versioned: a process of another version is
//! refused at its first message.

pub mod console;
pub mod fds;
pub mod files;
pub mod line;
pub mod link;
pub mod net;
#[cfg(feature = "pump")]
pub mod pump;
pub mod vm;
