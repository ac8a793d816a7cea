//! The QEMU backend: each VM is a `qemu-system-*` process (`-M microvm` on x86_64, `-M virt` on
//! aarch64) with the agent channel on a virtio-serial port connected to a Unix socket of ours.
//! It works everywhere QEMU does: with KVM, with HVF on macOS, and with TCG (slowly) elsewhere.

mod accel;
pub mod args;
pub(crate) mod process;
mod snapshot;

use std::path::PathBuf;

use async_trait::async_trait;

pub use accel::{AccelChoice, resolve_accel};
pub use args::{Accel, Arch};

use crate::backend::{Backend, MissingProgram, SpecError, StartedVm, VmError, VmSpec};
use crate::config::AccelSetting;
use crate::image::ImageStore;

/// Longest path a Unix socket address holds (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The QEMU backend, with its accelerator chosen.
#[derive(Debug, Clone)]
pub struct QemuBackend {
    arch: Arch,
    accel: Accel,
    program: PathBuf,
    warning: Option<String>,
}

impl QemuBackend {
    /// Finds QEMU for the guest architecture (`SANDBOX_HOST_ARCH`) and picks the accelerator
    /// for `setting` (probing KVM for `auto`). A foreign architecture is emulated: asking for a
    /// hardware accelerator for it is an error, not a VM that fails later.
    pub async fn new(setting: AccelSetting, store: &ImageStore) -> Result<QemuBackend, VmError> {
        let arch = Arch::from_env().map_err(SpecError::Setting)?;
        if !arch.is_native() && matches!(setting, AccelSetting::Kvm | AccelSetting::Hvf) {
            return Err(SpecError::ForeignArch {
                arch,
                host: Arch::host(),
            }
            .into());
        }
        let program = find_qemu(arch)?;
        let choice = resolve_accel(setting, arch, &program, store).await;
        Ok(QemuBackend {
            arch,
            accel: choice.accel,
            program,
            warning: choice.warning,
        })
    }

    /// A backend with a fixed accelerator and program, for tests and the KVM probe.
    pub fn with(arch: Arch, accel: Accel, program: PathBuf) -> QemuBackend {
        QemuBackend {
            arch,
            accel,
            program,
            warning: None,
        }
    }

    /// Why the accelerator is not the best one, when it is not (e.g. TCG fallback).
    pub fn warning(&self) -> Option<&str> {
        self.warning.as_deref()
    }

    /// The accelerator.
    pub fn accel_kind(&self) -> Accel {
        self.accel
    }

    /// The guest architecture.
    pub fn arch(&self) -> Arch {
        self.arch
    }
}

/// Finds `qemu-system-<arch>` and `qemu-img` on PATH, or says, in the operator guide's words,
/// that they are missing.
pub fn find_qemu(arch: Arch) -> Result<PathBuf, VmError> {
    let debian = match arch {
        Arch::X86_64 => "qemu-system-x86",
        Arch::Aarch64 => "qemu-system-arm",
    };
    let missing = |program: &'static str| {
        VmError::from(MissingProgram::Qemu {
            program,
            package: debian,
        })
    };
    let system = which(arch.qemu_program()).ok_or_else(|| missing(arch.qemu_program()))?;
    which("qemu-img").ok_or_else(|| missing("qemu-img"))?;
    Ok(system)
}

/// The first executable called `name` on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| {
            p.metadata()
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

#[async_trait]
impl Backend for QemuBackend {
    fn can_outlive(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        "qemu"
    }

    fn accel(&self) -> String {
        self.accel.as_str().to_string()
    }

    async fn start(&self, spec: VmSpec) -> Result<StartedVm, VmError> {
        validate(&spec)?;
        if let Some(from) = &spec.restore_from {
            snapshot::Header::of(self.arch, self.accel, &spec).check(&from.state)?;
        }
        let spec = crate::backend::prepare(&spec)?;
        let started = process::spawn(&self.program, self.arch, self.accel, &spec).await;
        if started.is_err() {
            let _ = std::fs::remove_dir_all(&spec.state_dir);
        }
        started
    }
}

fn validate(spec: &VmSpec) -> Result<(), VmError> {
    crate::backend::validate_spec(spec)?;
    let sock_len = spec.state_dir.join("agent.sock").as_os_str().len();
    if sock_len > MAX_SOCKET_PATH {
        return Err(SpecError::StateDirTooLong {
            dir: spec.state_dir.clone(),
            len: sock_len,
            max: MAX_SOCKET_PATH,
        }
        .into());
    }
    Ok(())
}
