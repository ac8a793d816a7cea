//! Picking the VMM backend from `SANDBOX_HOST_VMM` and `SANDBOX_HOST_QEMU_ACCEL`.

use sandbox_vmm::config::{AccelSetting, VmmSetting};
use sandbox_vmm::qemu::QemuBackend;
use sandbox_vmm::{Backend, ImageStore};

/// The backend to use, with a warning for the operator when it is a slow fallback.
pub struct Selected {
    pub backend: Box<dyn Backend>,
    pub warning: Option<String>,
}

/// Resolves the backend settings. An error is a sentence for the operator.
pub async fn select(store: &ImageStore) -> Result<Selected, String> {
    let vmm = VmmSetting::from_env().map_err(|e| e.to_string())?;
    let accel = AccelSetting::from_env().map_err(|e| e.to_string())?;
    match vmm {
        VmmSetting::Kvm => Err(
            "SANDBOX_HOST_VMM=kvm: this build has no in-process KVM backend yet; \
                                set SANDBOX_HOST_VMM=auto or qemu"
                .into(),
        ),
        VmmSetting::Auto | VmmSetting::Qemu => {
            let qemu = QemuBackend::new(accel, store)
                .await
                .map_err(|e| e.to_string())?;
            let warning = qemu.warning().map(str::to_owned);
            Ok(Selected {
                backend: Box::new(qemu),
                warning,
            })
        }
    }
}
