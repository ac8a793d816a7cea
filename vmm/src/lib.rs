//! The VMM layer of sandbox-host: a lifecycle-level trait over virtual machine backends, the
//! QEMU backend, the image store, and booting a sandbox (VM + agent channel) on any backend.
//!
//! The API and the `run` command only see [`Backend`] and [`Vm`]; the QEMU backend spawns
//! `qemu-system-*`, the KVM backend runs our VMM in a `sandbox-vm` process; both in the jail of `sandbox-jail`. Both hand back the same
//! agent channel, so everything above the trait works on either.

pub mod adopt;
pub mod arch;
pub mod backend;
pub mod config;
pub mod error;
pub mod exit;
pub mod host;
pub mod image;
#[cfg(target_os = "linux")]
pub mod kvm;
mod netpump;
pub mod probe;
pub mod qemu;
mod qmp;
pub mod sandbox;
pub mod scratch;
pub mod select;
pub mod setting;
pub mod supervised;

pub use backend::{
    Backend, Channel, Disk, SnapshotDone, SnapshotFiles, StartedVm, Vm, VmError, VmExit, VmSpec,
};
pub use image::{Image, ImageError, ImageStore};
pub use qmp::QmpError;
pub use sandbox::{BootError, Liveness, Sandbox, boot, boot_watched};
pub use sandbox_control::link::{FrameLink, NetAttachment, NetLink};
