//! sandbox-agent: the process inside each sandbox guest that serves the host's requests.
//!
//! It runs as PID 1 of the stock image (after `/init` has mounted the filesystems) or is started
//! by the full image's init. It opens its channel to the host (a virtio-serial port or a vsock
//! port, chosen by `sandbox.channel=` on the kernel command line or `--channel`), announces itself
//! with `READY` and then serves frames until the host asks it to shut down.
//!
//! The binary (`main.rs`) is a thin wrapper over this library; the library exists so the fuzz
//! targets (fuzz/) can drive the frame server and the archive import directly. Only what the
//! binary needs is public, and with the `fuzzing` feature also [`unpack`].

mod archive;
mod boot_marker;
mod channel;
mod credit;
mod exec;
mod files;
mod identity;
mod outbox;
mod ports;
mod pty;
mod reaper;
mod server;
mod streams;
mod transfer;
mod watch;

#[cfg(feature = "fuzzing")]
pub use archive::unpack;
pub use boot_marker::mark as mark_boot;
pub use channel::{ChannelSpec, Conn, open as open_channel};
pub use reaper::Reaper;
pub use server::serve;

/// Agent version reported in `READY`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
