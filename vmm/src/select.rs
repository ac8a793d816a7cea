//! Picking the VMM backend from `SANDBOX_HOST_VMM` (and QEMU's accelerator from
//! `SANDBOX_HOST_QEMU_ACCEL`): `auto` takes the in-process KVM backend whenever it proves it can
//! boot a guest here, else QEMU; `kvm` and `qemu` force one.

use crate::arch::Arch;
use crate::backend::Backend;
use crate::config::{AccelSetting, VmmSetting};
use crate::image::ImageStore;
#[cfg(target_os = "linux")]
use crate::kvm::KvmBackend;
use crate::qemu::QemuBackend;

/// The backend to use, with a warning for the operator when it is a fallback.
pub struct Selected {
    /// The backend.
    pub backend: Box<dyn Backend>,
    /// Why it is not the best one, when it is not.
    pub warning: Option<String>,
}

/// Whether the KVM backend boots the stock image here (cached per host boot).
#[cfg(target_os = "linux")]
pub async fn kvm_usable(store: &ImageStore) -> Result<KvmBackend, String> {
    let kvm = KvmBackend::new()?;
    crate::probe::boots_cached(&kvm, "the KVM backend", "kvm-backend", &[], store).await?;
    Ok(kvm)
}

/// The KVM backend, when it boots the stock image here.
#[cfg(target_os = "linux")]
async fn kvm_backend(store: &ImageStore) -> Result<Box<dyn Backend>, String> {
    Ok(Box::new(kvm_usable(store).await?))
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

/// Resolves the backend settings. An error is a sentence for the operator.
pub async fn select(store: &ImageStore) -> Result<Selected, String> {
    let vmm = VmmSetting::from_env().map_err(|e| e.to_string())?;
    let accel = AccelSetting::from_env().map_err(|e| e.to_string())?;
    let arch = Arch::from_env().map_err(|e| e.to_string())?;
    let qemu = |kvm_why: Option<String>| async move {
        let qemu = QemuBackend::new(accel, store)
            .await
            .map_err(|e| e.to_string())?;
        let warning = fallback_warning(kvm_why.as_deref(), qemu.warning());
        Ok::<Selected, String>(Selected {
            backend: Box::new(qemu),
            warning,
        })
    };
    // The KVM backend runs x86_64 guests on x86_64 Linux hosts only; anywhere else QEMU is the
    // backend of the architecture, not a fallback, so it gets no warning of its own.
    if !(cfg!(target_os = "linux") && arch == Arch::X86_64 && arch.is_native()) {
        return match vmm {
            VmmSetting::Kvm => Err(format!(
                "SANDBOX_HOST_VMM=kvm but the KVM backend runs x86_64 guests on x86_64 Linux hosts, and \
                 the guest here is {arch} on this {} {} host. Set SANDBOX_HOST_VMM=auto (or qemu) to use QEMU",
                Arch::host(),
                std::env::consts::OS
            )),
            VmmSetting::Auto | VmmSetting::Qemu => qemu(None).await,
        };
    }
    match vmm {
        VmmSetting::Kvm => match kvm_backend(store).await {
            Ok(backend) => Ok(Selected {
                backend,
                warning: None,
            }),
            Err(why) => Err(format!(
                "SANDBOX_HOST_VMM=kvm but the KVM backend cannot run guests here: {why}. \
                 Set SANDBOX_HOST_VMM=auto (or qemu) to use QEMU instead"
            )),
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
