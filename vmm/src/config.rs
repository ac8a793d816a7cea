//! Settings the VMM layer reads from the environment, and where sandbox-host keeps its files.

use std::path::PathBuf;

pub use crate::setting::SettingError;

/// Root of what sandbox-host builds and keeps: `SANDBOX_HOST_CACHE`, else
/// `$XDG_CACHE_HOME/sandbox-host`, else `~/.cache/sandbox-host` (as `scripts/cache-dir.sh`).
pub fn cache_dir() -> PathBuf {
    if let Some(d) = non_empty_env("SANDBOX_HOST_CACHE") {
        return d.into();
    }
    if let Some(d) = non_empty_env("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("sandbox-host");
    }
    let home = non_empty_env("HOME").unwrap_or_else(|| "/tmp".into());
    PathBuf::from(home).join(".cache/sandbox-host")
}

/// The image store: `SANDBOX_HOST_IMAGE_DIR`, else `<cache>/images` for guests of the host's
/// architecture and `<cache>/images-<arch>` for emulated ones (`SANDBOX_HOST_ARCH`), so that an
/// x86_64 and an aarch64 stock image never replace each other (as `scripts/cache-dir.sh`).
pub fn image_dir() -> PathBuf {
    non_empty_env("SANDBOX_HOST_IMAGE_DIR")
        .map_or_else(|| image_dir_for(crate::arch::Arch::guest()), PathBuf::from)
}

/// The default image store of guests of `arch` (`SANDBOX_HOST_IMAGE_DIR` aside).
pub fn image_dir_for(arch: crate::arch::Arch) -> PathBuf {
    if arch.is_native() {
        cache_dir().join("images")
    } else {
        cache_dir().join(format!("images-{arch}"))
    }
}

/// Where running sandboxes keep their files: `SANDBOX_HOST_STATE_DIR`, else `<cache>/state`.
pub fn state_dir() -> PathBuf {
    non_empty_env("SANDBOX_HOST_STATE_DIR").map_or_else(|| cache_dir().join("state"), PathBuf::from)
}

/// `SANDBOX_HOST_UNRESPONSIVE_MS` when it is not set.
pub const UNRESPONSIVE_DEFAULT: std::time::Duration = std::time::Duration::from_secs(60);

/// Why there is no KVM, when `/dev/kvm` does not exist. The container image sets
/// `SANDBOX_HOST_CONTAINER=1`: there the device exists on the host but was not mapped in, which the
/// operator fixes in the compose file, not on the machine (the guide's fault table has both rows).
pub fn no_kvm_device() -> &'static str {
    if std::env::var_os("SANDBOX_HOST_CONTAINER").is_some_and(|v| v == "1") {
        container_no_kvm()
    } else {
        "there is no /dev/kvm on this machine (no KVM: load kvm_intel or kvm_amd, or run on a host \
         with hardware virtualisation)"
    }
}

/// Why there is no KVM in our container: a sentence that says what to do, so QEMU's fallback
/// warning adds no advice of its own to it.
pub fn container_no_kvm() -> &'static str {
    "No /dev/kvm in this container: map the device into it (the sandbox-host service of \
     docker-compose.yaml does, with devices: [/dev/kvm]), or run the sandbox host on a machine \
     with KVM"
}

/// `SANDBOX_HOST_UNRESPONSIVE_MS`: how long the guest agent may leave a ping unanswered before
/// its VM is killed as unresponsive (60000; at least 2000).
pub fn unresponsive() -> Result<std::time::Duration, SettingError> {
    let Some(v) = non_empty_env("SANDBOX_HOST_UNRESPONSIVE_MS") else {
        return Ok(UNRESPONSIVE_DEFAULT);
    };
    match v.trim().parse::<u64>() {
        Ok(ms) if ms >= 2000 => Ok(std::time::Duration::from_millis(ms)),
        _ => Err(SettingError {
            var: "SANDBOX_HOST_UNRESPONSIVE_MS",
            value: v,
            allowed: "a number of milliseconds, at least 2000",
        }),
    }
}

/// `SANDBOX_HOST_VMM_ALLOWANCE_MIB`: memory a VM process may use beyond its guest's memory, in
/// its cgroup. Unset: the backend's own figure (64 MiB for `sandbox-vm`; for QEMU 512 MiB under
/// TCG, 256 MiB with an accelerator).
pub fn vmm_allowance_mib() -> Result<Option<u64>, SettingError> {
    let Some(v) = non_empty_env("SANDBOX_HOST_VMM_ALLOWANCE_MIB") else {
        return Ok(None);
    };
    v.trim()
        .parse::<u64>()
        .ok()
        .filter(|&n| n <= 1 << 20)
        .map(Some)
        .ok_or(SettingError {
            var: "SANDBOX_HOST_VMM_ALLOWANCE_MIB",
            value: v,
            allowed: "a number of MiB from 0 to 1048576",
        })
}

fn non_empty_env(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|v| !v.is_empty())
}

/// `SANDBOX_HOST_QEMU_ACCEL`: the accelerator of the QEMU backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccelSetting {
    /// kvm when `/dev/kvm` can really boot a guest, hvf on macOS, else tcg with a warning.
    Auto,
    /// Hardware virtualisation on Linux.
    Kvm,
    /// Hardware virtualisation on macOS.
    Hvf,
    /// Software emulation: always works, slowly.
    Tcg,
}

impl AccelSetting {
    /// Parses the variable's value (empty means `auto`).
    pub fn parse(value: &str) -> Result<Self, SettingError> {
        match value.trim() {
            "" | "auto" => Ok(Self::Auto),
            "kvm" => Ok(Self::Kvm),
            "hvf" => Ok(Self::Hvf),
            "tcg" => Ok(Self::Tcg),
            other => Err(SettingError {
                var: "SANDBOX_HOST_QEMU_ACCEL",
                value: other.into(),
                allowed: "one of auto, kvm, hvf, tcg",
            }),
        }
    }

    /// Reads `SANDBOX_HOST_QEMU_ACCEL`.
    pub fn from_env() -> Result<Self, SettingError> {
        Self::parse(&std::env::var("SANDBOX_HOST_QEMU_ACCEL").unwrap_or_default())
    }
}

/// `SANDBOX_HOST_VMM`: which backend runs the VMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmmSetting {
    /// The KVM backend when it can boot a guest, else QEMU.
    Auto,
    /// The KVM backend only.
    Kvm,
    /// The QEMU backend only.
    Qemu,
}

impl VmmSetting {
    /// Parses the variable's value (empty means `auto`).
    pub fn parse(value: &str) -> Result<Self, SettingError> {
        match value.trim() {
            "" | "auto" => Ok(Self::Auto),
            "kvm" => Ok(Self::Kvm),
            "qemu" => Ok(Self::Qemu),
            other => Err(SettingError {
                var: "SANDBOX_HOST_VMM",
                value: other.into(),
                allowed: "one of auto, kvm, qemu",
            }),
        }
    }

    /// Reads `SANDBOX_HOST_VMM`.
    pub fn from_env() -> Result<Self, SettingError> {
        Self::parse(&std::env::var("SANDBOX_HOST_VMM").unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_settings_and_names_the_variable_on_error() {
        assert_eq!(AccelSetting::parse(""), Ok(AccelSetting::Auto));
        assert_eq!(AccelSetting::parse("tcg"), Ok(AccelSetting::Tcg));
        let e = AccelSetting::parse("fast").unwrap_err().to_string();
        assert!(
            e.contains("SANDBOX_HOST_QEMU_ACCEL") && e.contains("`fast`"),
            "{e}"
        );
        assert_eq!(VmmSetting::parse("qemu"), Ok(VmmSetting::Qemu));
        assert!(
            VmmSetting::parse("krun")
                .unwrap_err()
                .to_string()
                .contains("SANDBOX_HOST_VMM")
        );
    }
}
