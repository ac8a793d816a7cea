//! Picking the VMM backend from `SANDBOX_HOST_VMM` (and QEMU's accelerator from
//! `SANDBOX_HOST_QEMU_ACCEL`): `auto` takes the in-process KVM backend whenever it proves it can
//! boot a guest here, else QEMU; `kvm` and `qemu` force one.

use crate::backend::Backend;
use crate::config::{AccelSetting, VmmSetting};
use crate::image::ImageStore;
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
pub async fn kvm_usable(store: &ImageStore) -> Result<KvmBackend, String> {
    let kvm = KvmBackend::new()?;
    crate::probe::boots_cached(&kvm, "the KVM backend", "kvm-backend", &[], store).await?;
    Ok(kvm)
}

/// Resolves the backend settings. An error is a sentence for the operator.
pub async fn select(store: &ImageStore) -> Result<Selected, String> {
    let vmm = VmmSetting::from_env().map_err(|e| e.to_string())?;
    let accel = AccelSetting::from_env().map_err(|e| e.to_string())?;
    let qemu = |kvm_why: Option<String>| async move {
        let qemu = QemuBackend::new(accel, store)
            .await
            .map_err(|e| e.to_string())?;
        let warning = match (kvm_why, qemu.warning()) {
            (Some(k), Some(q)) => Some(format!(
                "the KVM backend cannot be used ({k}), so VMs run on QEMU; {q}"
            )),
            (Some(k), None) => Some(format!(
                "the KVM backend cannot be used ({k}), so VMs run on QEMU"
            )),
            (None, q) => q.map(str::to_owned),
        };
        Ok::<Selected, String>(Selected {
            backend: Box::new(qemu),
            warning,
        })
    };
    match vmm {
        VmmSetting::Kvm => match kvm_usable(store).await {
            Ok(k) => Ok(Selected {
                backend: Box::new(k),
                warning: None,
            }),
            Err(why) => Err(format!(
                "SANDBOX_HOST_VMM=kvm but the KVM backend cannot run guests here: {why}. \
                 Set SANDBOX_HOST_VMM=auto (or qemu) to use QEMU instead"
            )),
        },
        VmmSetting::Qemu => qemu(None).await,
        VmmSetting::Auto => match kvm_usable(store).await {
            Ok(k) => Ok(Selected {
                backend: Box::new(k),
                warning: None,
            }),
            Err(why) => qemu(Some(why)).await,
        },
    }
}
