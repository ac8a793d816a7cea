//! The KVM backend as a [`Backend`]: each VM a jailed `sandbox-vm` process of its own
//! ([`super::process`]), its agent channel a vsock connection the process opens to the agent's
//! port and passes back.

use async_trait::async_trait;
use thiserror::Error;

use super::guest::{AGENT_PORT, GUEST_CID, kernel_cmdline};
use crate::backend::{Backend, MissingProgram, StartedVm, VmError, VmSpec, validate_spec};
use crate::probe::ProbeError;

/// Why the KVM backend cannot be used on this host; each says what to do about it.
#[derive(Debug, Error)]
pub enum KvmUnusable {
    /// There is no `/dev/kvm` (the sentence says how to get one, for this host or container).
    #[error("{0}")]
    NoDevice(&'static str),
    /// `/dev/kvm` exists but this user may not open it (the sentence says how to allow it).
    #[error("{0}")]
    NoAccess(&'static str),
    /// `/dev/kvm` could not be opened for another reason.
    #[error("/dev/kvm cannot be opened: {0}")]
    Open(#[source] kvm_ioctls::Error),
    /// The host's KVM lacks a capability the machine uses.
    #[error("the host's KVM lacks {0}")]
    Lacks(&'static str),
    /// The VM program is not where the service looks for it.
    #[error(transparent)]
    NoVmProgram(#[from] MissingProgram),
    /// The stock image did not boot on it.
    #[error(transparent)]
    DoesNotBoot(#[from] ProbeError),
}

/// The KVM backend.
#[derive(Debug, Clone, Default)]
pub struct KvmBackend {
    /// Each VM in this process instead of a jailed `sandbox-vm` of its own: only for the
    /// benchmark that measures what the process and the jail cost.
    #[cfg(feature = "in-process")]
    in_process: bool,
}

impl KvmBackend {
    /// Checks that /dev/kvm can be opened and has what the machine uses. This does not prove
    /// the host's KVM can run Linux; [`probe`] does.
    pub fn new() -> Result<KvmBackend, KvmUnusable> {
        check_kvm()?;
        super::process::vm_binary()?;
        Ok(KvmBackend::default())
    }

    /// The same backend running each VM's threads in this process (no jail): the reference the
    /// benchmarks measure the VM process against.
    #[cfg(feature = "in-process")]
    pub fn in_process() -> Result<KvmBackend, KvmUnusable> {
        check_kvm()?;
        Ok(KvmBackend { in_process: true })
    }
}

/// Why this user may not open /dev/kvm, and the fix that applies here: a device left to root
/// alone needs a group first (Debian's udev rule makes it `root:kvm`, 0660).
fn kvm_access_hint() -> &'static str {
    use std::os::unix::fs::MetadataExt;
    let group_only_root = std::fs::metadata("/dev/kvm")
        .map(|m| m.gid() == 0 && m.mode() & 0o060 == 0)
        .unwrap_or(false);
    if group_only_root {
        "/dev/kvm exists but only root may open it: give it to the kvm group (chgrp kvm /dev/kvm; \
         chmod 0660 /dev/kvm, or the udev rule KERNEL==\"kvm\", GROUP=\"kvm\", MODE=\"0660\") and add \
         this user to that group"
    } else {
        "/dev/kvm exists but this user may not open it (add the user to the kvm group)"
    }
}

/// Checks that /dev/kvm can be opened and has what the machine uses.
fn check_kvm() -> Result<(), KvmUnusable> {
    {
        let kvm = kvm_ioctls::Kvm::new().map_err(|e| match e.errno() {
            libc::ENOENT => KvmUnusable::NoDevice(crate::config::no_kvm_device()),
            libc::EACCES | libc::EPERM => KvmUnusable::NoAccess(kvm_access_hint()),
            _ => KvmUnusable::Open(e),
        })?;
        for (cap, name) in [
            (kvm_ioctls::Cap::Irqchip, "an in-kernel irqchip"),
            (kvm_ioctls::Cap::Irqfd, "irqfd"),
            (kvm_ioctls::Cap::Ioeventfd, "ioeventfd"),
            (kvm_ioctls::Cap::Pit2, "an in-kernel PIT"),
        ] {
            if !kvm.check_extension(cap) {
                return Err(KvmUnusable::Lacks(name));
            }
        }
        Ok(())
    }
}

#[async_trait]
impl Backend for KvmBackend {
    fn can_pause(&self) -> bool {
        true
    }

    fn can_outlive(&self) -> bool {
        // `sandbox-vm` can; the benchmarks' machine in this process cannot.
        #[cfg(feature = "in-process")]
        if self.in_process {
            return false;
        }
        true
    }

    fn name(&self) -> &'static str {
        "kvm"
    }

    fn accel(&self) -> String {
        "kvm".into()
    }

    async fn start(&self, spec: VmSpec) -> Result<StartedVm, VmError> {
        validate_spec(&spec)?;
        let spec = crate::backend::prepare(&spec)?;
        #[cfg(feature = "in-process")]
        let result = if self.in_process {
            super::in_process::start(&spec).await
        } else {
            super::process::start(&spec, kernel_cmdline(&spec), AGENT_PORT, GUEST_CID).await
        };
        #[cfg(not(feature = "in-process"))]
        let result =
            super::process::start(&spec, kernel_cmdline(&spec), AGENT_PORT, GUEST_CID).await;
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&spec.state_dir);
        }
        result
    }
}
