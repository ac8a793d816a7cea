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

#![cfg(target_os = "linux")]

pub mod cgroup;
mod child;
pub mod filter;
pub mod ids;
mod spawn;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, mpsc};

pub use cgroup::{Cgroups, Leaf, Limits};
pub use ids::{IdMode, IdPool};
pub use spawn::{Bind, Command, Exit, Jailed, Root, SpawnError};

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
    /// Set in `required` mode when a part is missing: VMs are refused with this.
    pub refusal: Option<String>,
}

type Job = Box<dyn FnOnce() + Send>;

/// Starts jailed processes for this service.
pub struct Jailer {
    namespaces: bool,
    ids: Arc<IdPool>,
    cgroups: Option<Cgroups>,
    filters: Vec<seccompiler::BpfProgram>,
    usr_links: Vec<(PathBuf, PathBuf)>,
    system_dirs: Vec<PathBuf>,
    status: Status,
    spawner: Mutex<mpsc::Sender<Job>>,
}

impl std::fmt::Debug for Jailer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jailer")
            .field("status", &self.status)
            .finish()
    }
}

impl Jailer {
    /// Works out what this host allows and proves it by jailing a process that does nothing.
    pub fn new(settings: &Settings) -> Jailer {
        let mut missing = vec![];
        let (pool, id_warning) = match IdPool::for_this_process(settings.ids.as_deref()) {
            Ok(p) => p,
            Err(e) => {
                missing.push(e.to_string());
                // SAFETY: getuid/getgid cannot fail.
                let (u, g) = unsafe { (libc::getuid(), libc::getgid()) };
                (IdPool::new(IdMode::Shared, u, g, 1), None)
            }
        };
        missing.extend(id_warning);
        let (cgroups, cg_missing) = if settings.mode == Mode::Off {
            (None, vec![])
        } else {
            match Cgroups::discover(&settings.cgroup_parent, &settings.instance) {
                Ok((c, m)) => {
                    c.remove_dead_instances();
                    (
                        Some(c),
                        m.into_iter()
                            .map(|m| format!("cgroup controller {m}"))
                            .collect(),
                    )
                }
                Err(e) => (
                    None,
                    vec![format!(
                        "no cgroup per VM ({e}): a guest's memory, processes and CPU are limited \
                         only by its VM size; see \"The jail\" in the operator guide"
                    )],
                ),
            }
        };
        missing.extend(cg_missing);
        let filters = match filter::programs() {
            Ok(f) => f,
            Err(e) => {
                missing.push(format!("no seccomp filter ({e})"));
                vec![]
            }
        };
        let (usr_links, system_dirs) = system_layout();
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("jail-spawner".into())
            .spawn(move || {
                // This thread is the parent of every jailed process and lives as long as the
                // service: their parent-death signal fires when the process ends, not earlier.
                while let Ok(job) = rx.recv() {
                    job();
                }
            })
            .expect("starting the jail's spawner thread");
        let mut jailer = Jailer {
            namespaces: settings.mode != Mode::Off,
            ids: Arc::new(pool),
            cgroups,
            filters,
            usr_links,
            system_dirs,
            status: Status {
                namespaces: false,
                ids: "none",
                cgroup: None,
                missing: vec![],
                refusal: None,
            },
            spawner: Mutex::new(tx),
        };
        if settings.mode == Mode::Off {
            missing.push(
                "SANDBOX_HOST_JAIL=off: VM processes run as the sandbox host's own user, without \
                 namespaces, seccomp or cgroups"
                    .into(),
            );
        } else if let Err(e) = jailer.probe() {
            missing.push(format!(
                "the jail cannot be applied here ({e}): VM processes run without namespaces, \
                 their own ids or seccomp; see \"The jail\" in the operator guide"
            ));
            jailer.namespaces = false;
        }
        jailer.status = Status {
            namespaces: jailer.namespaces,
            ids: match (jailer.namespaces, jailer.ids.mode()) {
                (false, _) => "none",
                (true, IdMode::Shared) => "shared",
                (true, _) => "per-vm",
            },
            cgroup: jailer.cgroups.as_ref().map(Cgroups::version),
            refusal: (settings.mode == Mode::Required && !missing.is_empty())
                .then(|| format!("SANDBOX_HOST_JAIL=required, but {}", missing.join("; "))),
            missing,
        };
        jailer
    }

    fn probe(&self) -> Result<(), String> {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("sandbox-jail-probe-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let r = self
            .spawn_now(Command {
                name: format!("probe-{}", std::process::id()),
                program: None,
                args: vec![],
                fds: vec![],
                root: Some(Root {
                    staging: dir.clone(),
                    system: true,
                    ..Root::default()
                }),
                limits: Limits {
                    memory_bytes: 64 << 20,
                    pids: 8,
                    cpu_weight: 100,
                },
                nofile: 64,
                fsize: Some(0),
                keep_groups: vec![],
                seccomp: true,
            })
            .map_err(|e| e.to_string())
            .and_then(|j| {
                // Ends at once; bounded anyway.
                for _ in 0..500 {
                    if let Some(e) = j.try_wait() {
                        return match e.code() {
                            Some(0) => Ok(()),
                            _ => Err(format!(
                                "the probe process ended with status {:#x}",
                                e.status
                            )),
                        };
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err("the probe process did not end within 5 s".into())
            });
        let _ = std::fs::remove_dir_all(&dir);
        r
    }

    /// What is applied, and what is missing.
    pub fn status(&self) -> &Status {
        &self.status
    }

    /// Whether jailed processes get their own mount namespace (so paths given to them must be
    /// their paths in the jail, see [`Root`]).
    pub fn namespaces(&self) -> bool {
        self.namespaces
    }

    /// Removes what a previous run of this instance left (cgroups of VMs that outlived it).
    pub fn remove_stale(&self) -> usize {
        self.cgroups.as_ref().map_or(0, Cgroups::remove_stale)
    }

    /// Starts `cmd` jailed (blocking for the few milliseconds it takes: call it from a blocking
    /// context). Without namespaces (`SANDBOX_HOST_JAIL=off`, or a host that cannot), `cmd.root`
    /// is ignored and the program runs as the service's user with its descriptors, rlimits,
    /// cgroup and `no_new_privs`.
    pub fn spawn(&self, cmd: Command) -> Result<Jailed, SpawnError> {
        if let Some(r) = &self.status.refusal {
            return Err(SpawnError::Invalid(r.clone()));
        }
        self.spawn_now(cmd)
    }

    fn spawn_now(&self, mut cmd: Command) -> Result<Jailed, SpawnError> {
        let lease = self.ids.lease()?;
        if !self.namespaces {
            cmd.root = None;
        }
        let namespaces = self.namespaces;
        let ids = self.ids.mode().clone();
        let cgroups = self.cgroups.clone();
        let filters = self.filters.clone();
        let usr_links = self.usr_links.clone();
        let system_dirs = self.system_dirs.clone();
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move || {
            let host = spawn::Host {
                namespaces,
                ids: &ids,
                cgroups: cgroups.as_ref(),
                filters: &filters,
                usr_links: &usr_links,
                system_dirs: &system_dirs,
            };
            let _ = tx.send(spawn::spawn(cmd, lease, &host));
        });
        self.spawner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(job)
            .map_err(|_| SpawnError::Invalid("the jail's spawner thread is gone".into()))?;
        rx.recv()
            .map_err(|_| SpawnError::Invalid("the jail's spawner thread is gone".into()))?
    }
}

/// The top-level entries that lead into `/usr` (`/lib -> usr/lib` on a merged-/usr system) and
/// the ones that are directories of their own (an older layout), for a dynamically linked
/// program's loader and libraries.
fn system_layout() -> (Vec<(PathBuf, PathBuf)>, Vec<PathBuf>) {
    let mut links = vec![];
    let mut dirs = vec![];
    for name in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"] {
        let p = PathBuf::from("/").join(name);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                if let Ok(t) = std::fs::read_link(&p) {
                    links.push((p, t));
                }
            }
            Ok(m) if m.is_dir() => dirs.push(p),
            _ => {}
        }
    }
    (links, dirs)
}

static GLOBAL: OnceLock<Jailer> = OnceLock::new();

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
