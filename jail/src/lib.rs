//! The jail of every VM process (issue 12).
//!
//! A guest that breaks out of its virtual devices lands in the process that emulates them, so
//! that process must hold nothing and reach nothing: each VM process (our own VMM, or QEMU) is
//! started here in new user, mount, pid, network, IPC, UTS and cgroup namespaces, as a uid and
//! gid of its own that no other VM shares, with an empty read-only root holding only what it was
//! given, no capabilities, `no_new_privs`, an empty environment, only the descriptors it was
//! handed, rlimits (no core dumps, open files, file size), a cgroup with memory, process and CPU
//! limits, and a seccomp filter. The parent-death signal ends it with the service.
//!
//! Like Firecracker's jailer, but without a privileged helper: the service may run as an
//! ordinary user, getting its VMs' ids from `/etc/subuid` through `newuidmap` (see [`ids`]).

//!
//! Elsewhere (macOS) none of this exists: `unconfined` starts the VM process with only its
//! descriptors, rlimits and an empty environment, and says at start-up that the jail is missing,
//! so `SANDBOX_HOST_JAIL=required` refuses VMs there.

pub mod adopt;
#[cfg(target_os = "linux")]
pub mod cgroup;
#[cfg(target_os = "linux")]
mod child;
#[cfg(target_os = "linux")]
pub mod filter;
#[cfg(target_os = "linux")]
pub mod ids;
#[cfg(target_os = "linux")]
mod jailer;
#[cfg(target_os = "linux")]
mod spawn;
mod spec;
// Compiled for the tests on Linux too: its spawning is macOS's only confinement, and no Mac runs
// the tests.
#[cfg(any(not(target_os = "linux"), test))]
pub mod unconfined;

pub use adopt::AdoptError;
#[cfg(target_os = "linux")]
pub use cgroup::{Cgroups, Leaf};
#[cfg(target_os = "linux")]
pub use ids::{IdMode, IdPool};
#[cfg(target_os = "linux")]
pub use jailer::Jailer;
#[cfg(target_os = "linux")]
pub use spawn::{Jailed, SpawnError};
pub use spec::{Bind, Command, Exit, Identity, Limits, Root};
#[cfg(not(target_os = "linux"))]
pub use unconfined::{Jailed, Jailer, SpawnError};

/// `SANDBOX_HOST_JAIL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Apply every part of the jail the host allows; say at start-up which part is missing.
    Auto,
    /// Refuse to start VMs unless the namespaces, ids and cgroups can all be applied.
    Required,
    /// No jail (the VM processes run as the service's user, without namespaces). For debugging.
    Off,
}

/// What the service configures.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How strict.
    pub mode: Mode,
    /// `SANDBOX_HOST_JAIL_IDS` (`START:COUNT`, a root service's range).
    pub ids: Option<String>,
    /// `SANDBOX_HOST_CGROUP`: the parent group, relative to the hierarchy's root.
    pub cgroup_parent: String,
    /// Names this service instance's groups, stable across restarts so a restart finds what a
    /// crash left.
    pub instance: String,
}

impl Settings {
    /// From the environment, with `instance` chosen by the caller.
    pub fn from_env(instance: &str) -> Result<Settings, String> {
        let mode = match std::env::var("SANDBOX_HOST_JAIL")
            .ok()
            .as_deref()
            .map(str::trim)
        {
            None | Some("") | Some("auto") => Mode::Auto,
            Some("required") => Mode::Required,
            Some("off") => Mode::Off,
            Some(other) => {
                return Err(format!(
                    "SANDBOX_HOST_JAIL={other:?} is not one of auto, required, off; fix it in .env \
                     or the environment and start the sandbox host again"
                ));
            }
        };
        Ok(Settings {
            mode,
            ids: std::env::var("SANDBOX_HOST_JAIL_IDS")
                .ok()
                .filter(|s| !s.trim().is_empty()),
            cgroup_parent: std::env::var("SANDBOX_HOST_CGROUP")
                .ok()
                .filter(|s| !s.trim().is_empty())
                .unwrap_or_else(|| "sandbox-host".into()),
            instance: instance.to_string(),
        })
    }
}

/// What the jail applies on this host, for `/v1/health` and the start-up line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// Namespaces, the empty root, no capabilities and the seccomp filter are applied.
    pub namespaces: bool,
    /// `per-vm` (an id pair per VM), `shared` (the service's own), or `none`.
    pub ids: &'static str,
    /// `v2`, `v1`, or `None` when no cgroup can be made.
    pub cgroup: Option<&'static str>,
    /// Each part that is missing, with why, in the operator's words.
    pub missing: Vec<String>,
    /// Limits of fairness between VMs the host's cgroups cannot apply (an I/O weight, one
    /// OOM kill for the group), in the operator's words: said at start-up, never a refusal.
    pub unenforced: Vec<String>,
    /// Set in `required` mode when a part is missing: VMs are refused with this.
    pub refusal: Option<String>,
}

static GLOBAL: std::sync::OnceLock<Jailer> = std::sync::OnceLock::new();

/// Installs the service's jailer (once, at start-up); later calls return the installed one.
pub fn install(settings: &Settings) -> &'static Jailer {
    GLOBAL.get_or_init(|| Jailer::new(settings))
}

/// The jailer of this process: the installed one, or one from the environment for this process
/// alone (tools and tests that start VMs without the service).
pub fn global() -> &'static Jailer {
    GLOBAL.get_or_init(|| {
        let instance = format!("pid-{}", std::process::id());
        let settings = Settings::from_env(&instance).unwrap_or(Settings {
            mode: Mode::Auto,
            ids: None,
            cgroup_parent: "sandbox-host".into(),
            instance,
        });
        Jailer::new(&settings)
    })
}
