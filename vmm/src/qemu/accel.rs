//! Choosing QEMU's accelerator. `auto` takes KVM only after proving that this host's `/dev/kvm`
//! boots our guest: on some nested hypervisors `/dev/kvm` opens fine but cannot run a Linux
//! kernel, and QEMU then hangs with an internal error instead of failing.

use std::path::Path;

use super::QemuBackend;
use super::args::{Accel, Arch};
use crate::config::AccelSetting;
use crate::image::ImageStore;
use crate::probe::ProbeError;

/// The accelerator picked, and a warning for the operator when it is not what they would want.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccelChoice {
    /// The accelerator.
    pub accel: Accel,
    /// Set when falling back to software emulation, with the reason.
    pub warning: Option<String>,
}

/// Resolves `SANDBOX_HOST_QEMU_ACCEL` for this host.
pub async fn resolve_accel(
    setting: AccelSetting,
    arch: Arch,
    program: &Path,
    store: &ImageStore,
) -> AccelChoice {
    let fixed = |accel| AccelChoice {
        accel,
        warning: None,
    };
    match setting {
        AccelSetting::Kvm => fixed(Accel::Kvm),
        AccelSetting::Hvf => fixed(Accel::Hvf),
        AccelSetting::Tcg => AccelChoice {
            accel: Accel::Tcg,
            warning: Some("SANDBOX_HOST_QEMU_ACCEL=tcg: QEMU emulates the processor, so runs work but are very slow".into()),
        },
        // An emulated architecture has no accelerator (QemuBackend::new refuses kvm and hvf).
        AccelSetting::Auto if !arch.is_native() => AccelChoice {
            accel: Accel::Tcg,
            warning: Some(format!(
                "SANDBOX_HOST_ARCH={arch} on this {} host: QEMU emulates the processor (tcg), so runs work but are very slow",
                Arch::host()
            )),
        },
        AccelSetting::Auto if cfg!(target_os = "macos") => fixed(Accel::Hvf),
        AccelSetting::Auto => match kvm_boots(arch, program, store).await {
            Ok(()) => fixed(Accel::Kvm),
            Err(why) => {
                // The container's own reason already says what to do.
                let container = crate::config::container_no_kvm();
                let fix = if matches!(why, ProbeError::NoDevice(s) if s == container) {
                    ""
                } else {
                    ". Run the sandbox host on a machine with hardware virtualisation to fix this"
                };
                AccelChoice {
                    accel: Accel::Tcg,
                    warning: Some(format!(
                        "{why}; QEMU emulates the processor (tcg), so runs work but are very slow{fix}"
                    )),
                }
            }
        },
    }
}

/// Whether QEMU with KVM boots the stock image here, remembered per host boot, QEMU binary and
/// image, so only the first start after a change pays for the probe.
async fn kvm_boots(arch: Arch, program: &Path, store: &ImageStore) -> Result<(), ProbeError> {
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        if e.kind() == std::io::ErrorKind::NotFound {
            return Err(ProbeError::NoDevice(crate::config::no_kvm_device()));
        }
        return Err(ProbeError::Device(e));
    }
    let backend = QemuBackend::with(arch, Accel::Kvm, program.to_path_buf());
    crate::probe::boots_cached(&backend, "QEMU with KVM", "qemu-kvm", &[program], store).await
}
