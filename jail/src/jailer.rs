//! The service's jailer on Linux: what this host allows, proved at start-up, and the thread that
//! starts every jailed process.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, mpsc};

use crate::cgroup::Cgroups;
use crate::ids::{IdMode, IdPool};
use crate::spawn::{self, Jailed, SpawnError};
use crate::spec::{Command, Limits, Root};
use crate::{Mode, Settings, Status, filter};

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

/// Whether this service runs as root (its VMs would too, without the jail's namespaces).
fn root_service() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Why VMs are refused, if they are: in `required` mode any missing part; in `auto` mode a
/// service running as root that cannot apply the namespaces (its VMs would run as root, with
/// the host's mounts and network): never quietly. An ordinary user's service in `auto` mode
/// runs its VMs with the warning.
fn refusal(
    mode: Mode,
    root: bool,
    namespaces: bool,
    shared_ids: bool,
    missing: &[String],
) -> Option<String> {
    match mode {
        Mode::Required if !missing.is_empty() => Some(format!(
            "SANDBOX_HOST_JAIL=required, but {}",
            missing.join("; ")
        )),
        Mode::Auto if root && (!namespaces || shared_ids) => Some(format!(
            "the sandbox host runs as root and its VMs would too, without the jail's namespaces \
             or ids of their own ({}): run it as the user sandbox-host (bin/up does when \
             started as root), or set SANDBOX_HOST_JAIL=off to run them unjailed anyway \
             (debugging only)",
            missing.join("; ")
        )),
        _ => None,
    }
}

/// The ids VMs get: a pair each where the host gives this user subordinate ids, else shared
/// (said in `missing`).
fn id_pool(settings: &Settings, missing: &mut Vec<String>) -> IdPool {
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
    pool
}

/// This instance's cgroups, where they can be had (what they lack said in `missing`); groups
/// of instances that are gone are removed.
fn cgroups(settings: &Settings, missing: &mut Vec<String>) -> Option<Cgroups> {
    if settings.mode == Mode::Off {
        return None;
    }
    match Cgroups::discover(&settings.cgroup_parent, &settings.instance) {
        Ok((c, m)) => {
            c.remove_dead_instances();
            missing.extend(m.into_iter().map(|m| format!("cgroup controller {m}")));
            Some(c)
        }
        Err(e) => {
            missing.push(format!(
                "no cgroup per VM ({e}): a guest's memory, processes and CPU are limited \
                 only by its VM size; see \"The jail\" in the operator guide"
            ));
            None
        }
    }
}

/// The thread every jailed process is cloned from; its jobs come over the channel returned.
fn start_spawner() -> mpsc::Sender<Job> {
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
    tx
}

impl Jailer {
    /// Works out what this host allows and proves it by jailing a process that does nothing.
    pub fn new(settings: &Settings) -> Jailer {
        let mut missing = vec![];
        let pool = id_pool(settings, &mut missing);
        let cgroups = cgroups(settings, &mut missing);
        let filters = match filter::programs() {
            Ok(f) => f,
            Err(e) => {
                missing.push(format!("no seccomp filter ({e})"));
                vec![]
            }
        };
        let (usr_links, system_dirs) = system_layout();
        let tx = start_spawner();
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
                unenforced: vec![],
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
            refusal: refusal(
                settings.mode,
                root_service(),
                jailer.namespaces,
                matches!(jailer.ids.mode(), IdMode::Shared),
                &missing,
            ),
            missing,
            unenforced: jailer
                .cgroups
                .as_ref()
                .map(|c| c.unenforced().to_vec())
                .unwrap_or_default(),
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
                    cpus: 1,
                },
                nofile: 64,
                fsize: Some(0),
                keep_groups: vec![],
                seccomp: true,
                host_network: false,
                outlive: false,
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

    /// Removes what a previous run of this instance left (cgroups of VMs that outlived it),
    /// except the groups in `keep` (of the processes this run adopted).
    pub fn remove_stale(&self, keep: &[PathBuf]) -> usize {
        self.cgroups.as_ref().map_or(0, |c| c.remove_stale(keep))
    }

    /// Takes on the process `identity` records, which a previous run of this service started
    /// with [`Command::outlive`] and named `name`: once it is shown to be that process (see
    /// [`crate::adopt`]), its ids and its cgroup are this run's again and it is watched through
    /// its pidfd. What this jailer gives every process it starts must be recorded: a uid of the
    /// jail's where it maps ids, a cgroup named after `name` where it makes cgroups; a record
    /// without them names a process this jailer did not start. An adopted process is not this
    /// process's child: its status is not known when it ends ([`crate::Exit::known`]).
    pub fn adopt(
        &self,
        identity: &crate::Identity,
        name: &str,
    ) -> Result<Jailed, crate::AdoptError> {
        let pid = identity.pid;
        let refuse = |why: &str| crate::AdoptError::Ids {
            pid,
            why: why.to_string(),
        };
        let maps_ids = self.namespaces && *self.ids.mode() != IdMode::Shared;
        match (identity.uid, maps_ids) {
            (None, true) => {
                return Err(refuse(
                    "no uid is recorded, and every jailed process has one",
                ));
            }
            (Some(_), false) => return Err(refuse("a uid is recorded, and this jail maps none")),
            _ => {}
        }
        let cgroup = match (&self.cgroups, identity.cgroup.first()) {
            (Some(c), Some(first)) => Some((c, first.clone())),
            (Some(_), None) => {
                return Err(crate::AdoptError::Cgroup {
                    pid,
                    dir: PathBuf::new(),
                    why: "none is recorded, and every jailed process has one".into(),
                });
            }
            (None, Some(first)) => {
                return Err(crate::AdoptError::Cgroup {
                    pid,
                    dir: first.clone(),
                    why: "this host makes no cgroups now".into(),
                });
            }
            (None, None) => None,
        };
        let pidfd = crate::adopt::open(identity)?;
        let lease = match identity.uid {
            Some(uid) => Some(
                self.ids
                    .adopt(uid)
                    .map_err(|why| crate::AdoptError::Ids { pid, why })?,
            ),
            None => None,
        };
        let leaf = match cgroup {
            Some((c, first)) => Some(c.adopt(&identity.cgroup, pid, name).map_err(|why| {
                crate::AdoptError::Cgroup {
                    pid,
                    dir: first,
                    why,
                }
            })?),
            None => None,
        };
        Ok(Jailed::adopted(identity, pidfd, lease, leaf))
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

#[cfg(test)]
mod refusal_tests {
    use super::*;

    #[test]
    fn auto_refuses_a_root_service_without_namespaces_and_only_that() {
        let missing = vec!["the jail cannot be applied here (mount: EPERM)".to_string()];
        let why = refusal(Mode::Auto, true, false, false, &missing).expect("refused");
        assert!(
            why.contains("runs as root") && why.contains("EPERM"),
            "{why}"
        );
        assert_eq!(
            refusal(Mode::Auto, false, false, true, &missing),
            None,
            "a laptop's warning"
        );
        assert_eq!(
            refusal(Mode::Auto, true, true, false, &missing),
            None,
            "only a cgroup missing"
        );
        assert!(refusal(Mode::Required, false, true, false, &missing).is_some());
        assert_eq!(refusal(Mode::Required, true, true, false, &[]), None);
        assert_eq!(refusal(Mode::Off, true, false, true, &missing), None);
        // Root with one shared id pair (a bad SANDBOX_HOST_JAIL_IDS): every VM would be root.
        let bad_ids = vec!["SANDBOX_HOST_JAIL_IDS=x is not START:COUNT".to_string()];
        assert!(refusal(Mode::Auto, true, true, true, &bad_ids).is_some());
    }
}
