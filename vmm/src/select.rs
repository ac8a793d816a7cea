//! Picking the VMM backend from `SANDBOX_HOST_VMM` (and QEMU's accelerator from
//! `SANDBOX_HOST_QEMU_ACCEL`): `auto` takes the KVM backend (a jailed `sandbox-vm` per VM) whenever it proves it can
//! boot a guest here, else QEMU; `kvm` and `qemu` force one.

use thiserror::Error;

use crate::arch::Arch;
use crate::backend::{Backend, VmError};
use crate::config::{AccelSetting, SettingError, VmmSetting};
use crate::image::ImageStore;
#[cfg(target_os = "linux")]
use crate::kvm::{KvmBackend, KvmUnusable};
use crate::qemu::QemuBackend;

/// Why no backend could be selected; each is a sentence for the operator with its fix.
#[derive(Debug, Error)]
pub enum SelectError {
    /// A setting has a value it does not accept.
    #[error(transparent)]
    Setting(#[from] SettingError),
    /// `SANDBOX_HOST_VMM=kvm` on a host or for a guest the KVM backend does not run.
    #[error(
        "SANDBOX_HOST_VMM=kvm but the KVM backend runs x86_64 guests on x86_64 Linux hosts, and \
         the guest here is {guest} on this {host} {os} host. Set SANDBOX_HOST_VMM=auto (or qemu) \
         to use QEMU"
    )]
    KvmElsewhere {
        /// The guest's architecture.
        guest: Arch,
        /// The host's.
        host: Arch,
        /// The host's operating system.
        os: &'static str,
    },
    /// `SANDBOX_HOST_VMM=kvm` and the KVM backend cannot run guests here.
    #[error(
        "SANDBOX_HOST_VMM=kvm but the KVM backend cannot run guests here: {0}. Set \
         SANDBOX_HOST_VMM=auto (or qemu) to use QEMU instead"
    )]
    KvmForced(String),
    /// QEMU, the backend of last resort, cannot be used either.
    #[error(transparent)]
    Qemu(#[from] VmError),
}

/// The backend to use, with a warning for the operator when it is a fallback.
pub struct Selected {
    /// The backend.
    pub backend: Box<dyn Backend>,
    /// Why it is not the best one, when it is not.
    pub warning: Option<String>,
}

/// Whether the KVM backend boots the stock image here (cached per host boot).
#[cfg(target_os = "linux")]
pub async fn kvm_usable(store: &ImageStore) -> Result<KvmBackend, KvmUnusable> {
    let kvm = KvmBackend::new()?;
    crate::probe::boots_cached(&kvm, "the KVM backend", "kvm-backend", &[], store)
        .await
        .map_err(KvmUnusable::DoesNotBoot)?;
    Ok(kvm)
}

/// The KVM backend, when it boots the stock image here.
#[cfg(target_os = "linux")]
async fn kvm_backend(store: &ImageStore) -> Result<Box<dyn Backend>, String> {
    Ok(Box::new(
        kvm_usable(store).await.map_err(|e| e.to_string())?,
    ))
}

/// The KVM backend is Linux's; `select` never asks for it elsewhere.
#[cfg(not(target_os = "linux"))]
async fn kvm_backend(_: &ImageStore) -> Result<Box<dyn Backend>, String> {
    Err("the KVM backend runs on Linux only".into())
}

/// The operator's warning when VMs run on QEMU: why the KVM backend is not used, and QEMU's own
/// warning. Said once when both have the same cause (no /dev/kvm gives both the same sentence).
fn fallback_warning(kvm_why: Option<&str>, qemu: Option<&str>) -> Option<String> {
    match (kvm_why, qemu) {
        (Some(k), Some(q)) if q.starts_with(k) => Some(format!(
            "the KVM backend cannot be used, so VMs run on QEMU; {q}"
        )),
        (Some(k), Some(q)) => Some(format!(
            "the KVM backend cannot be used ({k}), so VMs run on QEMU; {q}"
        )),
        (Some(k), None) => Some(format!(
            "the KVM backend cannot be used ({k}), so VMs run on QEMU"
        )),
        (None, q) => q.map(str::to_owned),
    }
}

/// Resolves the backend settings.
pub async fn select(store: &ImageStore) -> Result<Selected, SelectError> {
    let vmm = VmmSetting::from_env()?;
    let accel = AccelSetting::from_env()?;
    let arch = Arch::from_env()?;
    let qemu = |kvm_why: Option<String>| async move {
        let qemu = QemuBackend::new(accel, store).await?;
        let warning = fallback_warning(kvm_why.as_deref(), qemu.warning());
        Ok::<Selected, SelectError>(Selected {
            backend: Box::new(qemu),
            warning,
        })
    };
    // The KVM backend runs x86_64 guests on x86_64 Linux hosts only; anywhere else QEMU is the
    // backend of the architecture, not a fallback, so it gets no warning of its own.
    if !(cfg!(target_os = "linux") && arch == Arch::X86_64 && arch.is_native()) {
        return match vmm {
            VmmSetting::Kvm => Err(SelectError::KvmElsewhere {
                guest: arch,
                host: Arch::host(),
                os: std::env::consts::OS,
            }),
            VmmSetting::Auto | VmmSetting::Qemu => qemu(None).await,
        };
    }
    match vmm {
        VmmSetting::Kvm => match kvm_backend(store).await {
            Ok(backend) => Ok(Selected {
                backend,
                warning: None,
            }),
            Err(why) => Err(SelectError::KvmForced(why)),
        },
        VmmSetting::Qemu => qemu(None).await,
        VmmSetting::Auto => match kvm_backend(store).await {
            Ok(backend) => Ok(Selected {
                backend,
                warning: None,
            }),
            Err(why) => qemu(Some(why)).await,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::fallback_warning;

    #[test]
    fn a_cause_both_backends_share_is_said_once() {
        let why = "No /dev/kvm in this container: map the device into it";
        let q = format!("{why}; QEMU emulates the processor (tcg), so runs work but are very slow");
        let w = fallback_warning(Some(why), Some(&q)).unwrap();
        assert_eq!(w.matches("No /dev/kvm").count(), 1, "{w}");
        assert!(w.starts_with("the KVM backend cannot be used, so VMs run on QEMU; No /dev/kvm"));
    }

    #[test]
    fn different_causes_are_both_said() {
        let w = fallback_warning(
            Some("KVM internal error"),
            Some("no usable /dev/kvm (EACCES)"),
        )
        .unwrap();
        assert!(
            w.contains("(KVM internal error)") && w.ends_with("no usable /dev/kvm (EACCES)"),
            "{w}"
        );
        assert_eq!(fallback_warning(None, None), None);
        assert_eq!(
            fallback_warning(Some("x"), None).unwrap(),
            "the KVM backend cannot be used (x), so VMs run on QEMU"
        );
    }
}
