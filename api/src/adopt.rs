//! A service that restarts without losing runs (issue 32). A sandbox whose processes may outlive
//! the service (its backend can take them on again: QEMU) has a record in the state directory,
//! `<id>.json`: its run, its activity counters, its share of the budgets, and which VM and
//! network processes are its own. The record is written atomically (a new file renamed over
//! the old) when the sandbox is registered, on each sweep whose counters moved, and at a
//! hand-over; it is removed with the sandbox.
//!
//! At start-up the service reads every record (the state directory is its alone, but a record is
//! read as hostile: bounded, strict, every path and id checked), and takes each sandbox on
//! again whose processes are alive and prove to be its own (pid and start time through a pidfd,
//! uid, cgroup, the network process's token, the agent answering). What cannot be taken on again
//! is disposed of, with a log line that names it and says why.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sandbox_vmm::adopt::VmRecord;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::egress::{EgressSpec, InterceptMode, SecretSpec};
use crate::netproc::NetRecord;
use crate::registry::{self, SandboxEntry};
use crate::state::AppState;

/// The records' format; a record of another is not taken on. Format 1 had no pause state
/// (the sandboxes it names are running ones, taken on as such).
const VERSION: u32 = 2;
/// The largest record read: a run's variables and egress settings come from a create request,
/// which the API's body limit bounds well below this.
const MAX_RECORD: u64 = 8 << 20;

/// Why a record cannot be written or a sandbox taken on again; each says what is wrong.
#[derive(Debug, Error)]
pub enum AdoptError {
    /// The record could not be read or written.
    #[error("its record {}: {source}", .path.display())]
    Io {
        /// The record's file.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// The record is not one this service wrote.
    #[error("its record {} is unusable: {why}", .path.display())]
    Record {
        /// The record's file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// Its VM could not be taken on again.
    #[error("its VM: {0}")]
    Vm(#[from] sandbox_vmm::adopt::AdoptVmError),
    /// Its network process could not be taken on again.
    #[error("its network process: {0}")]
    Net(String),
    /// The run's time limit passed while the service was away.
    #[error("its time limit passed while the sandbox host was down")]
    Expired,
    /// The record was written before the host last booted: its processes are gone.
    #[error("it was recorded before the host restarted")]
    Rebooted,
    /// Taking it on did not end within its bound.
    #[error("taking it on again took longer than {0:?}")]
    Slow(Duration),
    /// It is paused, and what resuming it needs is gone.
    #[error("it is paused and cannot be resumed: {0}")]
    Pause(String),
}

/// A sandbox as its record holds it.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SandboxRecord {
    version: u32,
    id: String,
    run_id: String,
    image: String,
    stock_image: bool,
    harness_version_match: Option<bool>,
    disk_limit_mib: u64,
    memory_mib: u32,
    vcpus: u8,
    /// Every variable of its commands: the run's and the network's (placeholders, the CA).
    env: BTreeMap<String, String>,
    egress: EgressRecord,
    /// Milliseconds since the epoch.
    created_at_ms: u64,
    expires_at_ms: u64,
    counters: [u64; 3],
    /// Its share of the budgets: guest memory, egress memory, disk (MiB).
    reservation: [u64; 3],
    /// The host's boot (`/proc/sys/kernel/random/boot_id`) the processes run in.
    boot_id: String,
    /// Its VM's process; none while the sandbox is paused (its VM ended at the pause).
    vm: Option<VmRecord>,
    net: NetRecord,
    /// What pausing and resuming it needs (a backend that can pause: KVM).
    #[serde(default)]
    pause: Option<PauseRecord>,
}

/// What rebuilds a sandbox's `registry::Pausable`: the snapshot files are found from its id
/// (`<id>.paused/`), the VM's spec from the image's directory and the run's shape.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseRecord {
    /// Paused: no VM runs, its guest is in the snapshot set `slot`.
    paused: bool,
    /// The snapshot set the running VM writes to, or the paused guest is in.
    slot: u8,
    /// Resumes so far (names the next VM's directory).
    resumes: u64,
    /// The network device's address, which the guest's driver read.
    mac: [u8; 6],
    /// The image's directory the VM was made from.
    image_dir: PathBuf,
}

/// A run's egress settings without the secrets' values, which only its network process holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct EgressRecord {
    allow: Vec<String>,
    meter: Vec<String>,
    intercept_all: bool,
    meter_strict: bool,
    secrets: Vec<SecretRecord>,
}

/// A secret without its value.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SecretRecord {
    env: String,
    hosts: Vec<String>,
    headers: Option<Vec<String>>,
    paths: Option<Vec<String>>,
    wildcard: bool,
}

impl From<&EgressSpec> for EgressRecord {
    fn from(e: &EgressSpec) -> Self {
        EgressRecord {
            allow: e.allow.clone(),
            meter: e.meter.clone(),
            intercept_all: e.intercept == Some(InterceptMode::All),
            meter_strict: e.meter_strict,
            secrets: e
                .secrets
                .iter()
                .map(|s| SecretRecord {
                    env: s.env.clone(),
                    hosts: s.hosts.clone(),
                    headers: s.headers.clone(),
                    paths: s.paths.clone(),
                    wildcard: s.wildcard,
                })
                .collect(),
        }
    }
}

impl From<EgressRecord> for EgressSpec {
    fn from(e: EgressRecord) -> Self {
        EgressSpec {
            allow: e.allow,
            meter: e.meter,
            intercept: e.intercept_all.then_some(InterceptMode::All),
            meter_strict: e.meter_strict,
            secrets: e
                .secrets
                .into_iter()
                .map(|s| SecretSpec {
                    env: s.env,
                    value: String::new(),
                    hosts: s.hosts,
                    headers: s.headers,
                    paths: s.paths,
                    wildcard: s.wildcard,
                })
                .collect(),
        }
    }
}

/// The record of sandbox `id`.
fn record_path(state_dir: &Path, id: &str) -> PathBuf {
    state_dir.join(format!("{id}.json"))
}

fn millis(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// This boot of the host, which a record names: processes of an earlier boot are gone.
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|b| b.trim().chars().take(64).collect())
        .unwrap_or_default()
}

/// Writes `entry`'s record, if its processes may outlive the service (else there is nothing to
/// take on again, and no record), unless it was disposed of. Saves of one entry take turns, and
/// a disposal removes the record under the same turn: a record is never written back after its
/// sandbox went. The new record is written beside the old (a file made anew, never one a link
/// leads from) and renamed over it, so a crash at any point leaves one whole record.
///
/// While a pause or a resume runs (it holds the sandbox's pause lock), nothing is written: each
/// saves the record itself as it ends ([`save_as`]).
pub fn save(state_dir: &Path, entry: &SandboxEntry) -> Result<(), AdoptError> {
    let Ok(paused) = entry.paused.try_lock() else {
        return Ok(());
    };
    save_as(state_dir, entry, *paused)
}

/// [`save`] by a holder of the sandbox's pause lock, which says whether it is paused.
pub fn save_as(state_dir: &Path, entry: &SandboxEntry, paused: bool) -> Result<(), AdoptError> {
    let mut turn = entry.record.lock().unwrap_or_else(|e| e.into_inner());
    if turn.disposed {
        return Ok(());
    }
    let counters = entry.counters.values();
    write(state_dir, entry, counters, paused)?;
    turn.saved = counters;
    Ok(())
}

/// Whether `entry`'s record can name everything its next run needs: a network process that
/// outlives the service, and a VM process that does, or a pause it can resume from.
pub fn can_keep(entry: &SandboxEntry, paused: bool) -> bool {
    entry.net.as_ref().and_then(|n| n.record()).is_some()
        && if paused {
            entry.pausable.is_some()
        } else {
            entry.sandbox().vm.record().is_some()
        }
}

fn write(
    state_dir: &Path,
    entry: &SandboxEntry,
    counters: [u64; 3],
    paused: bool,
) -> Result<(), AdoptError> {
    if !can_keep(entry, paused) {
        return Ok(());
    }
    let Some(net) = entry.net.as_ref().and_then(|n| n.record()) else {
        return Ok(());
    };
    let vm = if paused {
        None
    } else {
        entry.sandbox().vm.record()
    };
    let pause = entry.pausable.as_ref().map(|p| PauseRecord {
        paused,
        slot: p.slot.load(std::sync::atomic::Ordering::SeqCst) as u8,
        resumes: p.resumes.load(std::sync::atomic::Ordering::SeqCst),
        mac: p.mac,
        image_dir: p.image_dir.clone(),
    });
    let reservation = entry
        .reservation
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .shares();
    let record = SandboxRecord {
        version: VERSION,
        id: entry.id.clone(),
        run_id: entry.run_id.clone(),
        image: entry.image.clone(),
        stock_image: entry.stock_image,
        harness_version_match: entry.harness_version_match,
        disk_limit_mib: entry.disk_limit_mib,
        memory_mib: entry.memory_mib,
        vcpus: entry.vcpus,
        env: entry.env.clone(),
        egress: EgressRecord::from(&entry.egress),
        created_at_ms: millis(entry.created_at),
        expires_at_ms: millis(entry.expires_at),
        counters,
        reservation,
        boot_id: boot_id(),
        vm,
        net,
        pause,
    };
    let path = record_path(state_dir, &entry.id);
    let io = |source| AdoptError::Io {
        path: path.clone(),
        source,
    };
    let text = serde_json::to_vec(&record).map_err(|e| io(std::io::Error::other(e)))?;
    let tmp = state_dir.join(format!(".{}.json.new", entry.id));
    let _ = std::fs::remove_file(&tmp); // a crash's half-written one
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(&text)?;
        f.sync_data()?;
        std::fs::rename(&tmp, &path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(io)
}

/// Saves the record of `entry`, logging a failure: the sandbox runs on, but a crash of the
/// service before the next save would dispose of it.
pub fn save_or_log(state_dir: &Path, entry: &SandboxEntry) {
    if let Err(e) = save(state_dir, entry) {
        tracing::warn!(id = %entry.id, "a sandbox's record was not written, so a restart of the sandbox host would dispose of it: {e}");
    }
}

/// Saves `entry`'s record when its counters moved since it was last saved (every second).
pub fn save_if_moved(state_dir: &Path, entry: &SandboxEntry) {
    let moved = {
        let turn = entry.record.lock().unwrap_or_else(|e| e.into_inner());
        !turn.disposed && turn.saved != entry.counters.values()
    };
    if moved {
        save_or_log(state_dir, entry);
    }
}

/// Removes the record of `entry` as it is disposed of: no save after this writes it again.
pub fn forget(state_dir: &Path, entry: &SandboxEntry) {
    let mut turn = entry.record.lock().unwrap_or_else(|e| e.into_inner());
    turn.disposed = true;
    remove(state_dir, &entry.id);
}

/// Removes the record of sandbox `id`.
fn remove(state_dir: &Path, id: &str) {
    let _ = std::fs::remove_file(record_path(state_dir, id));
}

/// What the start-up's adoption kept: the state directory's entries and the cgroups that now
/// belong to adopted sandboxes, which the clean-up of what a crash left must spare.
#[derive(Debug, Default)]
pub struct Kept {
    /// Names in the state directory.
    pub files: Vec<String>,
    /// cgroup directories.
    pub cgroups: Vec<PathBuf>,
}

/// How many sandboxes are taken on again at once: each may wait for its processes' answers
/// (a few seconds at most), and a host with many sandboxes must not wait for them in turn.
const AT_ONCE: usize = 8;

/// The longest one sandbox's adoption may take.
const ONE_BOUND: Duration = Duration::from_secs(60);

/// Takes on again every sandbox the state directory has a record of, registering each; disposes
/// of the rest. Runs once at start-up, before the API serves.
pub async fn adopt_all(state: &AppState) -> Kept {
    let dir = state.config().state_dir.clone();
    let mut kept = Kept::default();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return kept;
    };
    let mut ids: Vec<String> = entries
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".json"))
                .filter(|n| !n.starts_with('.'))
                .map(str::to_string)
        })
        .collect();
    ids.sort();
    let slots = Arc::new(tokio::sync::Semaphore::new(AT_ONCE));
    let tasks: Vec<_> = ids
        .into_iter()
        .map(|id| {
            let (state, dir, slots) = (state.clone(), dir.clone(), slots.clone());
            tokio::spawn(async move {
                let _slot = slots.acquire_owned().await;
                // Each step has its own short bound; this one holds whatever a step missed,
                // so the start-up goes on. What was taken on by then is left to the clean-up
                // of the cgroups no sandbox keeps.
                let r = tokio::time::timeout(ONE_BOUND, adopt_one(&state, &dir, &id))
                    .await
                    .unwrap_or(Err(AdoptError::Slow(ONE_BOUND)));
                (id, r)
            })
        })
        .collect();
    let (mut adopted, mut disposed) = (0, 0);
    for t in tasks {
        let Ok((id, r)) = t.await else { continue };
        match r {
            Ok((entry, cgroups, files)) => {
                adopted += 1;
                kept.files.extend(files);
                kept.cgroups.extend(cgroups);
                tracing::info!(
                    id = %entry.id,
                    run_id = %entry.run_id,
                    "Took on again a sandbox an earlier sandbox host left running"
                );
            }
            Err(e) => {
                disposed += 1;
                let shown: String = id.chars().take(80).collect();
                tracing::warn!(
                    id = %shown,
                    "Disposed of a sandbox an earlier sandbox host left, because it could not be taken on again: {e}"
                );
                remove(&dir, &id);
                // One cut short at its very end may have been registered: it goes too.
                if let Some(entry) = state.registry().take(&id) {
                    crate::lifecycle::dispose(state, entry, crate::metrics::Disposal::Shutdown)
                        .await;
                }
            }
        }
    }
    if adopted + disposed > 0 {
        tracing::info!(
            adopted,
            disposed,
            "Sandboxes an earlier sandbox host left: taken on again, or disposed of"
        );
    }
    kept
}

/// Whether `id` is one this service makes (`registry::new_id`): a record's name is checked
/// before anything is built from it.
fn plain_id(id: &str) -> bool {
    registry::host_of(id).is_some()
}

/// The record of `id`, read within [`MAX_RECORD`] and checked.
fn read(dir: &Path, id: &str) -> Result<SandboxRecord, AdoptError> {
    let path = record_path(dir, id);
    let bad = |why: String| AdoptError::Record {
        path: path.clone(),
        why,
    };
    if !plain_id(id) {
        return Err(bad("not the name of a sandbox's record".into()));
    }
    // Never through a link, never waiting on a FIFO: only a regular file is read.
    let mut text = Vec::new();
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path)
        .and_then(|f| {
            if !f.metadata()?.is_file() {
                return Err(std::io::Error::other("not a regular file"));
            }
            f.take(MAX_RECORD + 1).read_to_end(&mut text)
        })
        .map_err(|source| AdoptError::Io {
            path: path.clone(),
            source,
        })?;
    if text.len() as u64 > MAX_RECORD {
        return Err(bad(format!("larger than {MAX_RECORD} bytes")));
    }
    let r: SandboxRecord = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    if !(1..=VERSION).contains(&r.version) {
        return Err(bad(format!(
            "format {} (this host reads {VERSION})",
            r.version
        )));
    }
    if r.id != id {
        return Err(bad(format!("it names another sandbox ({:.80})", r.id)));
    }
    let paused = r.pause.as_ref().is_some_and(|p| p.paused);
    match &r.vm {
        Some(vm) if vm_dir_name(dir, id, &vm.state_dir).is_none() => {
            return Err(bad("its VM's directory is not the sandbox's".into()));
        }
        Some(_) if paused => return Err(bad("it names a VM of a paused sandbox".into())),
        None if !paused => return Err(bad("it names no VM and no pause".into())),
        _ => {}
    }
    if r.pause.as_ref().is_some_and(|p| p.slot > 1) {
        return Err(bad("its snapshot set is neither 0 nor 1".into()));
    }
    Ok(r)
}

/// The name of a VM's directory of sandbox `id` under `dir`: `<id>`, or `<id>-r<n>` for the VM of
/// a resume (`registry::Pausable::next_vm_dir`); `None` for any other path.
fn vm_dir_name(dir: &Path, id: &str, vm_dir: &Path) -> Option<String> {
    if vm_dir.parent() != Some(dir) {
        return None;
    }
    let name = vm_dir.file_name()?.to_str()?;
    let plain = name == id
        || name
            .strip_prefix(id)
            .and_then(|r| r.strip_prefix("-r"))
            .is_some_and(|n| {
                !n.is_empty() && n.len() <= 19 && n.bytes().all(|b| b.is_ascii_digit())
            });
    plain.then(|| name.to_string())
}

/// What adopting one sandbox keeps: its entry, the cgroups its processes were found in, and
/// its names in the state directory.
type Adopted = (Arc<SandboxEntry>, Vec<PathBuf>, Vec<String>);

/// Takes sandbox `id` on again, or says why not (having disposed of what was adopted). A paused
/// sandbox has no VM to take on: its network process and its snapshot are, and a resume starts
/// its next VM as before the restart.
async fn adopt_one(state: &AppState, dir: &Path, id: &str) -> Result<Adopted, AdoptError> {
    let pause_dir = dir.join(format!("{id}.paused"));
    let r = match read(dir, id) {
        Ok(r) => r,
        Err(e) => {
            // Nothing in a record that is not this service's is trusted: its processes, if any,
            // are in this service's cgroups, which the clean-up after this empties.
            if plain_id(id) {
                let _ = std::fs::remove_dir_all(dir.join(id));
                let _ = std::fs::remove_dir_all(&pause_dir);
                let net = crate::netproc::socket_path(dir, id);
                if let Some(d) = net.parent() {
                    let _ = std::fs::remove_dir_all(d);
                }
            }
            return Err(e);
        }
    };
    let vm_state_dir = r.vm.as_ref().map(|v| v.state_dir.clone());
    let remove_files = || {
        if let Some(d) = &vm_state_dir {
            let _ = std::fs::remove_dir_all(d);
        }
        let _ = std::fs::remove_dir_all(&pause_dir);
    };
    if r.boot_id != boot_id() {
        remove_files();
        let _ = std::fs::remove_dir_all(dir.join(format!("net-{id}")));
        return Err(AdoptError::Rebooted);
    }
    let paused = r.vm.is_none();
    let created_at = SystemTime::UNIX_EPOCH + Duration::from_millis(r.created_at_ms);
    let expires_at = SystemTime::UNIX_EPOCH + Duration::from_millis(r.expires_at_ms);
    let egress: EgressSpec = r.egress.clone().into();
    // The dial rules need the settings, not the secrets' values.
    let cfg = crate::egress::net_config(id, &egress, state.config(), [0; 6]);
    let vm_dir = vm_state_dir
        .as_deref()
        .and_then(|d| vm_dir_name(dir, id, d));
    // What pausing needs: a paused sandbox without it cannot be resumed, and goes; a running one
    // runs on, and cannot be paused.
    let pausable = match &r.pause {
        Some(p) => match pausable(state, id, &r, p, vm_state_dir.clone()) {
            Ok(p) => Some(p),
            Err(why) if paused => {
                let _ = std::fs::remove_dir_all(dir.join(format!("net-{id}")));
                remove_files();
                return Err(AdoptError::Pause(why));
            }
            Err(why) => {
                tracing::warn!(id = %id, "A sandbox taken on again cannot be paused: {why}");
                None
            }
        },
        None => None,
    };
    // A running VM writes its snapshot to the set its start (or its resume) gave it.
    let snapshot_to = pausable.as_ref().map(|p| sandbox_vmm::adopt::SnapshotTo {
        files: p.files[p.slot.load(std::sync::atomic::Ordering::SeqCst)].clone(),
        memory_mib: r.memory_mib,
    });
    let liveness = state.config().liveness();
    let (net, vm) = tokio::join!(
        crate::netproc::NetProcess::adopt(id, &r.net, &cfg, dir),
        async {
            match &r.vm {
                Some(v) => sandbox_vmm::adopt::adopt(id, v, liveness, snapshot_to)
                    .await
                    .map(Some),
                None => Ok(None),
            }
        },
    );
    let (net, sandbox) = match (net, vm) {
        (Ok(net), Ok(sandbox)) => (net, sandbox),
        (net, vm) => {
            // What was taken on is disposed of; what was not is left to the cgroups' clean-up.
            if let Ok(n) = &net {
                n.end();
            }
            if let Ok(Some(s)) = &vm {
                s.stop().await;
            }
            remove_files();
            return Err(match (net, vm) {
                (Err(e), _) => AdoptError::Net(e),
                (_, Err(e)) => AdoptError::Vm(e),
                _ => unreachable!("one of the two failed"),
            });
        }
    };
    let dispose = |e: AdoptError| async {
        net.end();
        if let Some(s) = &sandbox {
            s.stop().await;
        }
        remove_files();
        e
    };
    if SystemTime::now() > expires_at + state.config().grace {
        return Err(dispose(AdoptError::Expired).await);
    }
    let [memory, egress_mib, disk] = r.reservation;
    let reservation = state.capacity().hold(memory, egress_mib, disk);
    let cgroups: Vec<PathBuf> =
        r.vm.iter()
            .flat_map(|v| v.cgroup.clone())
            .chain(r.net.cgroup.clone())
            .collect();
    let mut files = vec![format!("{id}.json"), format!("net-{id}")];
    files.extend(vm_dir);
    if pausable.is_some() {
        files.push(format!("{id}.paused"));
    }
    let run = registry::Run {
        id: id.to_string(),
        run_id: r.run_id,
        image: r.image,
        stock_image: r.stock_image,
        harness_version_match: r.harness_version_match,
        disk_limit_mib: r.disk_limit_mib,
        memory_mib: r.memory_mib,
        vcpus: r.vcpus,
        env: r.env,
        egress,
        time_limit: expires_at.duration_since(created_at).unwrap_or_default(),
    };
    let sandbox = sandbox.unwrap_or_else(|| {
        sandbox_vmm::Sandbox::ended(
            "the sandbox is paused: its VM ended at the pause, and a resume starts the next".into(),
        )
    });
    // A KVM sandbox's VM takes snapshots over its control socket, which this run holds now: it
    // can be forked. A QEMU VM's monitor stayed with the previous run.
    let fork_base = pausable.as_ref().and_then(|p| {
        let image = state.store().resolve_at(&run.image, &p.image_dir).ok()?;
        Some(registry::ForkBase { image, mac: p.mac })
    });
    let running = registry::Running {
        env: vec![],
        net: Some(net),
        sandbox,
        reservation,
        pausable,
        fork_base,
    };
    let entry = Arc::new(SandboxEntry::restored(
        run, running, created_at, r.counters, paused,
    ));
    state.registry().insert(entry.clone());
    if !paused {
        registry::watch(entry.clone());
    }
    let (d, e) = (dir.to_path_buf(), entry.clone());
    let _ = tokio::task::spawn_blocking(move || save_or_log(&d, &e)).await;
    Ok((entry, cgroups, files))
}

/// Rebuilds what pausing and resuming sandbox `id` needs, as its create made it: the snapshot
/// files under `<id>.paused/` (regular files, never links), the VM's spec from the very image
/// directory its snapshot was taken on (which must still be in the store), the snapshot set in
/// use, the resumes so far and the MAC address.
fn pausable(
    state: &AppState,
    id: &str,
    r: &SandboxRecord,
    p: &PauseRecord,
    vm_dir: Option<PathBuf>,
) -> Result<registry::Pausable, String> {
    let backend = state
        .backend()
        .filter(|b| b.can_pause())
        .ok_or("this sandbox host's backend cannot pause or resume a sandbox")?;
    let image = state
        .store()
        .resolve_at(&r.image, &p.image_dir)
        .map_err(|e| {
            format!("the image its snapshot was taken on is no longer in the store ({e})")
        })?;
    let config = state.config();
    let dir = config.state_dir.join(format!("{id}.paused"));
    let files = [
        crate::lifecycle::snapshot_paths(&dir),
        crate::lifecycle::snapshot_paths(&dir.join("b")),
    ];
    for f in files.iter().flat_map(|f| [&f.state, &f.memory]) {
        let regular = std::fs::symlink_metadata(f).is_ok_and(|m| m.file_type().is_file());
        if !regular {
            return Err(format!("its snapshot file {} is missing", f.display()));
        }
    }
    let slot = usize::from(p.slot);
    if p.paused && std::fs::metadata(&files[slot].state).map_or(0, |m| m.len()) == 0 {
        return Err(format!(
            "its snapshot {} is empty",
            files[slot].state.display()
        ));
    }
    let mut spec = image.vm_spec(
        id.to_string(),
        r.memory_mib,
        r.vcpus,
        r.disk_limit_mib,
        config.state_dir.join(id),
    );
    spec.outlive = backend.can_outlive() && sandbox_jail::global().status().cgroup.is_some();
    spec.snapshot_to = Some(files[0].clone());
    let vm_dir = vm_dir.unwrap_or_else(|| spec.state_dir.clone());
    Ok(registry::Pausable {
        dir,
        files,
        slot: std::sync::atomic::AtomicUsize::new(slot),
        vm_dir: std::sync::Mutex::new(vm_dir),
        resumes: std::sync::atomic::AtomicU64::new(p.resumes),
        spec,
        mac: p.mac,
        image_dir: p.image_dir.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ids_this_service_makes_are_read() {
        assert!(plain_id(&registry::new_id(None)));
        assert!(plain_id(&registry::new_id(Some("node-7"))));
        for bad in [
            "sbx-0123",
            "sbx-0123456789abcdeg",
            "../sbx-0123456789abcdef",
            "sbx-0123456789abcdef/..",
            "sbx-0123456789abcdef-",
            "sbx-0123456789abcdef-Node",
            "sbx-0123456789abcdef-a/../b",
            "sbx-0123456789abcdef-01234567890123456789012345678901234567890",
            "run-1-2",
            "",
        ] {
            assert!(!plain_id(bad), "{bad}");
        }
    }

    #[test]
    fn a_record_that_is_not_this_services_is_refused_with_why() {
        let dir = tempfile::tempdir().unwrap();
        let id = "sbx-0123456789abcdef";
        let path = record_path(dir.path(), id);
        let cases: [(&[u8], &str); 4] = [
            (b"{", "EOF"),
            (br#"{"version":1,"surprise":true}"#, "unknown field"),
            (&[b'x'; (MAX_RECORD + 1) as usize], "larger than"),
            (b"[]", "expected struct SandboxRecord"),
        ];
        for (text, why) in cases {
            std::fs::write(&path, text).unwrap();
            let e = read(dir.path(), id).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
        // Never through a link, never a FIFO (which would hold the start-up).
        std::fs::remove_file(&path).unwrap();
        std::fs::write(dir.path().join("elsewhere"), b"{}").unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &path).unwrap();
        assert!(matches!(read(dir.path(), id), Err(AdoptError::Io { .. })));
        std::fs::remove_file(&path).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(made.success());
        let e = read(dir.path(), id).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        assert!(matches!(
            read(dir.path(), "sbx-../../etc/passwd"),
            Err(AdoptError::Record { .. })
        ));
    }

    /// A record of format 2 whose VM and pause are `vm` and `pause` (JSON), the rest valid.
    fn record(id: &str, vm: serde_json::Value, pause: serde_json::Value) -> Vec<u8> {
        serde_json::json!({
            "version": 2, "id": id, "run_id": "r", "image": "stock", "stock_image": true,
            "harness_version_match": null, "disk_limit_mib": 1024, "memory_mib": 256, "vcpus": 1,
            "env": {}, "egress": {"allow": [], "meter": [], "intercept_all": false,
                                  "meter_strict": false, "secrets": []},
            "created_at_ms": 1, "expires_at_ms": 2, "counters": [0, 0, 0],
            "reservation": [256, 96, 1024], "boot_id": "b", "vm": vm,
            "net": {"pid": 2, "start_time": 3, "uid": null, "cgroup": [], "memory_mib": 32,
                    "token": "t"},
            "pause": pause,
        })
        .to_string()
        .into_bytes()
    }

    /// The checks of a record's VM and pause: a paused sandbox names no VM, a running one names
    /// its VM in the sandbox's own directory, and the snapshot set is 0 or 1.
    #[test]
    fn a_records_vm_and_pause_must_agree() {
        let dir = tempfile::tempdir().unwrap();
        let id = "sbx-0123456789abcdef-node-1";
        let vm = |name: &str| {
            serde_json::json!({"backend": "kvm", "pid": 1, "start_time": 1, "uid": null,
                               "cgroup": [], "memory_mib": 320,
                               "state_dir": dir.path().join(name), "token": "t"})
        };
        let pause = |paused: bool, slot: u8| {
            serde_json::json!({"paused": paused, "slot": slot, "resumes": 3,
                               "mac": [2, 0, 0, 0, 0, 1], "image_dir": "/images/stock"})
        };
        let null = serde_json::Value::Null;
        let cases = [
            // Valid: running (format 1's shape, and with its pause state), resumed, paused.
            (vm(id), null.clone(), None),
            (vm(id), pause(false, 1), None),
            (vm(&format!("{id}-r3")), pause(false, 0), None),
            (null.clone(), pause(true, 0), None),
            // Not: a paused sandbox that names a VM, a running one that names none, a third set,
            // a VM's directory elsewhere or of another name.
            (
                vm(id),
                pause(true, 0),
                Some("names a VM of a paused sandbox"),
            ),
            (null.clone(), null.clone(), Some("names no VM and no pause")),
            (
                null.clone(),
                pause(false, 0),
                Some("names no VM and no pause"),
            ),
            (vm(id), pause(false, 2), Some("neither 0 nor 1")),
            (
                vm("sbx-0123456789abcdef-node-2"),
                null.clone(),
                Some("not the sandbox's"),
            ),
            (
                vm(&format!("{id}-rx")),
                null.clone(),
                Some("not the sandbox's"),
            ),
            (
                serde_json::json!({"backend": "kvm", "pid": 1, "start_time": 1, "uid": null,
                                   "cgroup": [], "memory_mib": 1, "state_dir": "/tmp"}),
                null.clone(),
                Some("not the sandbox's"),
            ),
        ];
        for (vm, pause, want) in cases {
            let text = record(id, vm.clone(), pause.clone());
            std::fs::write(record_path(dir.path(), id), &text).unwrap();
            match (read(dir.path(), id), want) {
                (Ok(_), None) => {}
                (Err(e), Some(why)) => {
                    assert!(e.to_string().contains(why), "{vm} {pause}: {e}")
                }
                (got, want) => panic!("{vm} {pause}: {got:?}, want {want:?}"),
            }
        }
        // Format 3 is a later host's; another id is another sandbox's.
        let mut later: serde_json::Value =
            serde_json::from_slice(&record(id, vm(id), null.clone())).unwrap();
        later["version"] = 3.into();
        std::fs::write(record_path(dir.path(), id), later.to_string()).unwrap();
        let e = read(dir.path(), id).unwrap_err().to_string();
        assert!(e.contains("format 3 (this host reads 2)"), "{e}");
        later["version"] = 2.into();
        later["id"] = "sbx-fedcba9876543210".into();
        std::fs::write(record_path(dir.path(), id), later.to_string()).unwrap();
        let e = read(dir.path(), id).unwrap_err().to_string();
        assert!(e.contains("names another sandbox"), "{e}");
    }
}
