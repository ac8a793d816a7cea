//! The protocol between sandbox-host and the agent inside each guest.
//!
//! One byte stream per sandbox (a virtio-serial port on the QEMU backend, a vsock connection on
//! the KVM backend) carries frames of many concurrent streams: execs, archive and file transfers,
//! readiness and shutdown. Each frame names its stream, so a slow consumer on one stream never
//! stalls another; flow control is by credit per stream (see [`kind::Kind::Window`]).
//! `docs/protocol.md` is the normative description; this crate is its implementation.
#![forbid(unsafe_code)]

pub mod boot_marker;
pub mod frame;
pub mod kind;
pub mod message;

#[cfg(feature = "client")]
pub mod client;

pub use frame::{DecodeError, Decoder, Frame, HEADER_LEN, MAX_PAYLOAD};
pub use kind::Kind;

/// The protocol revision this crate speaks; the agent reports its own in `READY`.
pub const PROTOCOL_VERSION: u32 = 1;

/// Bytes a receiver lets a sender have in flight on one stream before it grants more.
pub const INITIAL_WINDOW: u32 = 1 << 20;

/// Largest chunk of stream data put in one frame.
pub const DATA_CHUNK: usize = 64 * 1024;

/// Name of the virtio-serial port the agent listens on (QEMU backend).
pub const SERIAL_PORT_NAME: &str = "sandbox.agent";

/// Name of the virtio-serial port that carries the boot marker where there is no I/O port to
/// write it to (QEMU's `virt` machine on aarch64).
pub const MARKER_PORT_NAME: &str = "sandbox.marker";

/// Vsock port the agent listens on (KVM backend).
pub const VSOCK_PORT: u32 = 1024;
