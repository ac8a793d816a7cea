//! The guest's architecture. It is the host's unless `SANDBOX_HOST_ARCH` names another one, which
//! QEMU then emulates (TCG): how an x86_64 machine runs the aarch64 guest that Apple silicon and
//! aarch64 Linux hosts run natively, to test it.

use crate::setting::SettingError;

/// Guest architecture, which picks the QEMU binary and machine, the kernel and the image store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// `qemu-system-x86_64 -M microvm`, or the KVM backend.
    X86_64,
    /// `qemu-system-aarch64 -M virt`.
    Aarch64,
}

impl Arch {
    /// The architecture of this host.
    pub fn host() -> Arch {
        if cfg!(target_arch = "aarch64") {
            Arch::Aarch64
        } else {
            Arch::X86_64
        }
    }

    /// `SANDBOX_HOST_ARCH`: `auto` (or unset) is the host's; `x86_64` or `aarch64` (`arm64`) pick
    /// one, emulated when it is not the host's.
    pub fn parse(value: &str) -> Result<Arch, SettingError> {
        match value.trim() {
            "" | "auto" => Ok(Arch::host()),
            "x86_64" | "amd64" => Ok(Arch::X86_64),
            "aarch64" | "arm64" => Ok(Arch::Aarch64),
            other => Err(SettingError {
                var: "SANDBOX_HOST_ARCH",
                value: other.into(),
                allowed: "one of auto, x86_64, aarch64",
            }),
        }
    }

    /// Reads `SANDBOX_HOST_ARCH`.
    pub fn from_env() -> Result<Arch, SettingError> {
        Arch::parse(&std::env::var("SANDBOX_HOST_ARCH").unwrap_or_default())
    }

    /// The guest's architecture for a caller that cannot report an error: a bad value reads as
    /// the host's (the service refuses to start on it before anything calls this).
    pub fn guest() -> Arch {
        Arch::from_env().unwrap_or_else(|_| Arch::host())
    }

    /// Whether this host runs it without emulation.
    pub fn is_native(self) -> bool {
        self == Arch::host()
    }

    /// Its name, as `uname -m` in the guest prints it.
    pub fn as_str(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64",
            Arch::Aarch64 => "aarch64",
        }
    }

    /// The QEMU system emulator for it.
    pub fn qemu_program(self) -> &'static str {
        match self {
            Arch::X86_64 => "qemu-system-x86_64",
            Arch::Aarch64 => "qemu-system-aarch64",
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_and_refuses_others() {
        assert_eq!(Arch::parse(""), Ok(Arch::host()));
        assert_eq!(Arch::parse("auto"), Ok(Arch::host()));
        assert_eq!(Arch::parse("arm64"), Ok(Arch::Aarch64));
        assert_eq!(Arch::parse("x86_64"), Ok(Arch::X86_64));
        let e = Arch::parse("riscv64").unwrap_err().to_string();
        assert!(
            e.contains("SANDBOX_HOST_ARCH") && e.contains("`riscv64`"),
            "{e}"
        );
    }
}
