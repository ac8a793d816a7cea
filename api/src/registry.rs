//! The sandboxes of this host: creation, lookup, activity, disposal, and the sweep.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use sandbox_vmm::{Sandbox, VmExit};

use crate::egress::EgressSpec;
use crate::error::ApiError;

/// Per-sandbox counters.
#[derive(Debug, Default)]
pub struct Counters {
    /// Execs started.
    pub execs: AtomicU64,
    /// Bytes into the guest.
    pub bytes_in: AtomicU64,
    /// Bytes out of the guest.
    pub bytes_out: AtomicU64,
}

impl Counters {
    /// Execs, bytes in, bytes out.
    pub fn values(&self) -> [u64; 3] {
        [&self.execs, &self.bytes_in, &self.bytes_out].map(|c| c.load(Relaxed))
    }

    fn from_values([execs, bytes_in, bytes_out]: [u64; 3]) -> Counters {
        Counters {
            execs: AtomicU64::new(execs),
            bytes_in: AtomicU64::new(bytes_in),
            bytes_out: AtomicU64::new(bytes_out),
        }
    }
}

/// One sandbox: its VM and agent, what it was created with, and its activity.
pub struct SandboxEntry {
    /// Its id.
    pub id: String,
    /// The run it belongs to.
    pub run_id: String,
    /// The image it booted.
    pub image: String,
    /// Whether that is the stock image (a fallback, or asked for).
    pub stock_image: bool,
    /// Harness version comparison, when both sides have one.
    pub harness_version_match: Option<bool>,
    /// Disk limit of the run.
    pub disk_limit_mib: u64,
    /// Guest memory.
    pub memory_mib: u32,
    /// Guest vCPUs.
    pub vcpus: u8,
    /// Environment of every exec.
    pub env: BTreeMap<String, String>,
    /// Egress settings of the run.
    pub egress: EgressSpec,
    /// The sandbox's network process: its only way out, and its refusal counters.
    pub net: Option<Arc<crate::netproc::NetProcess>>,
    /// Creation time.
    pub created_at: SystemTime,
    /// End of the run's time limit.
    pub expires_at: SystemTime,
    /// The VM and its agent; another one after each resume.
    sandbox: std::sync::RwLock<Arc<Sandbox>>,
    /// Counters.
    pub counters: Counters,
    last_activity: Mutex<(Instant, SystemTime)>,
    /// Requests in flight (a long exec, a large upload): a busy sandbox is never idle.
    in_flight: AtomicU64,
    /// Its share of the host's budgets, given back when the entry goes (the memory part while
    /// it is paused).
    pub reservation: Mutex<crate::capacity::Reservation>,
    /// What pausing needs, where the backend can (KVM): the snapshot's files (written by the VM
    /// process, which got them at its start) and how to start the VM again.
    pub pausable: Option<Pausable>,
    /// What a fork of it needs: the image it runs on and its network device's address.
    pub fork_base: Option<ForkBase>,
    /// Set while paused; pauses and resumes of one sandbox take turns on its lock.
    pub paused: tokio::sync::Mutex<bool>,
    /// Mirrors `paused` for readers that must not wait (state, sweeps, routes); set as soon as
    /// a pause begins.
    paused_now: std::sync::atomic::AtomicBool,
    /// A pause or resume failed with the VM gone: the sandbox answers 410 until the sweep
    /// disposes of it.
    lost: std::sync::atomic::AtomicBool,
    /// Its record's turn (`adopt.rs`): the counters it last saved, and whether it was disposed
    /// of (no save writes it again).
    pub record: Mutex<RecordTurn>,
}

/// What the saves of one sandbox's record share.
#[derive(Debug, Default)]
pub struct RecordTurn {
    /// The counters last saved.
    pub saved: [u64; 3],
    /// The sandbox was disposed of: its record is gone for good.
    pub disposed: bool,
}

impl Pausable {
    /// The running VM's state directory.
    pub fn vm_dir(&self) -> std::path::PathBuf {
        self.vm_dir
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records the state directory of the VM a resume started.
    pub fn set_vm_dir(&self, dir: std::path::PathBuf) {
        *self.vm_dir.lock().unwrap_or_else(|e| e.into_inner()) = dir;
    }

    /// A state directory no VM of this sandbox has had: `<state dir>-r<n>`.
    pub fn next_vm_dir(&self) -> std::path::PathBuf {
        let n = self.resumes.fetch_add(1, Relaxed) + 1;
        let mut name = self.spec.state_dir.as_os_str().to_os_string();
        name.push(format!("-r{n}"));
        name.into()
    }
}

/// How a sandbox is paused and resumed (see `routes/pause.rs`).
pub struct Pausable {
    /// Its directory, `SANDBOX_HOST_STATE_DIR/<id>.paused/`: the snapshots, and the sandbox
    /// disk while it is paused.
    pub dir: std::path::PathBuf,
    /// Two sets of snapshot files, used in turn: a VM restored from one (its memory mapped
    /// from that file) writes its own snapshot to the other, never to the file it maps.
    pub files: [sandbox_vmm::SnapshotFiles; 2],
    /// Which set the running VM writes to.
    pub slot: std::sync::atomic::AtomicUsize,
    /// The running VM's state directory: each VM of a resume gets a new one.
    pub vm_dir: Mutex<std::path::PathBuf>,
    /// Counts resumes, for those directories' names.
    pub resumes: AtomicU64,
    /// The VM's spec at create, without its network (given again at resume).
    pub spec: sandbox_vmm::VmSpec,
    /// The network device's MAC address: each VM of the sandbox gets a new socket to its
    /// network process (`NetProcess::relink`), with the address the guest's driver read.
    pub mac: [u8; 6],
    /// The image's directory (canonical): a snapshot is restored only onto the files it was
    /// taken with, so the service's next run rebuilds the spec from this very directory.
    pub image_dir: std::path::PathBuf,
}

/// What a fork's children are started with besides the parent's snapshot: the very image the
/// parent's guest runs on (its kernel and disks, whatever the store holds under its name now),
/// and the MAC address its guest's driver read, which every child keeps.
#[derive(Clone)]
pub struct ForkBase {
    /// The image, at the directory the parent started from.
    pub image: sandbox_vmm::Image,
    /// The guest's MAC address.
    pub mac: [u8; 6],
}

/// Marks a sandbox busy for as long as it lives.
pub struct Busy(Arc<SandboxEntry>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
        self.0.touch();
    }
}

impl SandboxEntry {
    /// Records a request on the sandbox (for the idle sweep).
    pub fn touch(&self) {
        *self.last_activity.lock().unwrap_or_else(|e| e.into_inner()) =
            (Instant::now(), SystemTime::now());
    }

    /// Requests running in it now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Marks the sandbox busy until the guard is dropped (then counts as activity).
    pub fn busy(self: &Arc<Self>) -> Busy {
        self.in_flight
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Busy(self.clone())
    }

    /// When the last request came.
    pub fn last_activity(&self) -> (Instant, SystemTime) {
        *self.last_activity.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The VM and its agent now.
    pub fn sandbox(&self) -> Arc<Sandbox> {
        self.sandbox
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Puts the VM of a resume in place.
    pub fn replace_sandbox(&self, sandbox: Sandbox) {
        *self.sandbox.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(sandbox);
    }

    /// Whether the sandbox is paused (or being paused).
    pub fn is_paused(&self) -> bool {
        self.paused_now.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Records a pause or a resume (under `paused`'s lock).
    pub fn set_paused(&self, paused: bool) {
        self.paused_now
            .store(paused, std::sync::atomic::Ordering::SeqCst);
    }

    /// Marks the sandbox lost (a failed pause or resume left it without a VM).
    pub fn set_lost(&self) {
        self.lost.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// A pause or resume failed with its VM gone: the next sweep disposes of it.
    pub fn is_lost(&self) -> bool {
        self.lost.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// For a request that runs something in the guest: counts it as in flight first, then
    /// checks that the sandbox is alive and not paused (a pause marks itself first, then
    /// counts: one of the two sees the other).
    pub fn enter(self: &Arc<Self>) -> Result<Busy, ApiError> {
        let busy = self.busy();
        self.ensure_alive()?;
        Ok(busy)
    }

    /// How the VM ended, if it did so on its own.
    pub fn died(&self) -> Option<VmExit> {
        self.sandbox().vm.exit().filter(|e| !e.requested)
    }

    /// Fails with the VM's end (reason and last console lines) when it is gone, and when the
    /// sandbox is paused.
    pub fn ensure_alive(&self) -> Result<(), ApiError> {
        if self.is_lost() {
            return Err(ApiError::VmDied(format!(
                "sandbox `{}` was lost when it was paused, resumed or forked",
                self.id
            )));
        }
        if self.is_paused() {
            return Err(ApiError::Paused(self.id.clone()));
        }
        match self.died() {
            Some(exit) => Err(ApiError::VmDied(format!(
                "{}{}",
                exit.reason,
                sandbox_vmm::backend::console_suffix(&exit.console)
            ))),
            None => Ok(()),
        }
    }

    /// Turns an agent failure into the error a caller should see. When the channel closed because
    /// the VM died, the VM's own reason (and last console lines) is the answer.
    pub async fn explain(&self, e: sandbox_protocol::client::ClientError) -> ApiError {
        if matches!(e, sandbox_protocol::client::ClientError::Closed(_))
            && let Ok(exit) =
                tokio::time::timeout(Duration::from_secs(2), self.sandbox().vm.wait()).await
            && !exit.requested
        {
            return ApiError::VmDied(format!(
                "{}{}",
                exit.reason,
                sandbox_vmm::backend::console_suffix(&exit.console)
            ));
        }
        ApiError::from_client(e)
    }

    /// `Ok` as it is, or the failure explained (see [`SandboxEntry::explain`]).
    pub async fn check<T>(
        &self,
        r: Result<T, sandbox_protocol::client::ClientError>,
    ) -> Result<T, ApiError> {
        match r {
            Ok(v) => Ok(v),
            Err(e) => Err(self.explain(e).await),
        }
    }

    /// `ready`, `paused` or `dead`.
    pub fn state(&self) -> &'static str {
        if self.is_lost() {
            "dead"
        } else if self.is_paused() {
            "paused"
        } else if self.sandbox().vm.exit().is_some() {
            "dead"
        } else {
            "ready"
        }
    }
}

/// The live sandboxes.
#[derive(Default)]
pub struct Registry {
    map: Mutex<HashMap<String, Arc<SandboxEntry>>>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<SandboxEntry>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a sandbox.
    pub fn insert(&self, e: Arc<SandboxEntry>) {
        self.lock().insert(e.id.clone(), e);
    }

    /// Looks a sandbox up without touching it.
    pub fn peek(&self, id: &str) -> Option<Arc<SandboxEntry>> {
        self.lock().get(id).cloned()
    }

    /// Looks a sandbox up for a request: counts as activity, and fails if it is unknown.
    pub fn get(&self, id: &str) -> Result<Arc<SandboxEntry>, ApiError> {
        let e = self
            .peek(id)
            .ok_or_else(|| ApiError::NoSandbox(id.chars().take(80).collect()))?;
        e.touch();
        Ok(e)
    }

    /// Takes a sandbox out of the registry.
    pub fn take(&self, id: &str) -> Option<Arc<SandboxEntry>> {
        self.lock().remove(id)
    }

    /// Every sandbox.
    pub fn all(&self) -> Vec<Arc<SandboxEntry>> {
        let mut v: Vec<_> = self.lock().values().cloned().collect();
        v.sort_by_key(|e| e.created_at);
        v
    }
}

/// A run as its entry holds it: what the create asked for, checked and resolved.
pub struct Run {
    /// The sandbox's id.
    pub id: String,
    /// The platform's run id.
    pub run_id: String,
    /// The image's name as the run sees it.
    pub image: String,
    /// Whether it is the stock image (asked for, or a fallback).
    pub stock_image: bool,
    /// The run's harness version against the image's, when both have one.
    pub harness_version_match: Option<bool>,
    /// Its disk's size.
    pub disk_limit_mib: u64,
    /// Guest memory.
    pub memory_mib: u32,
    /// Guest vCPUs.
    pub vcpus: u8,
    /// Variables of every command.
    pub env: BTreeMap<String, String>,
    /// Its egress, secrets' values included until its network process has them.
    pub egress: EgressSpec,
    /// Its time limit.
    pub time_limit: Duration,
}

/// What a started sandbox has besides its run.
pub struct Running {
    /// Variables every command gets from its start (the secrets' placeholders, the CA's paths),
    /// besides the run's own.
    pub env: Vec<(String, String)>,
    /// Its network process.
    pub net: Option<Arc<crate::netproc::NetProcess>>,
    /// Its VM and agent.
    pub sandbox: Sandbox,
    /// Its share of the host's budgets.
    pub reservation: crate::capacity::Reservation,
    /// What pausing it needs, where the backend can.
    pub pausable: Option<Pausable>,
    /// What forking it needs.
    pub fork_base: Option<ForkBase>,
}

impl SandboxEntry {
    /// The entry of `run`'s sandbox, started as `running` says. The run's secrets' values are
    /// not kept (issue 32: the network process holds them; the service keeps what it shows,
    /// each secret's variable and hosts, and never needs a value again).
    pub fn new(run: Run, running: Running) -> SandboxEntry {
        Self::restored(run, running, SystemTime::now(), [0; 3], false)
    }

    /// The entry of a sandbox created at `created_at` with `counters` so far: one a previous run
    /// of the service left running and this one took on again (`adopt.rs`), or a new one.
    pub fn restored(
        run: Run,
        running: Running,
        created_at: SystemTime,
        counters: [u64; 3],
        paused: bool,
    ) -> SandboxEntry {
        let mut egress = run.egress;
        for s in &mut egress.secrets {
            zeroize::Zeroize::zeroize(&mut s.value);
        }
        SandboxEntry {
            id: run.id,
            run_id: run.run_id,
            image: run.image,
            stock_image: run.stock_image,
            harness_version_match: run.harness_version_match,
            disk_limit_mib: run.disk_limit_mib,
            memory_mib: run.memory_mib,
            vcpus: run.vcpus,
            env: run.env.into_iter().chain(running.env).collect(),
            egress,
            net: running.net,
            created_at,
            expires_at: created_at + run.time_limit,
            sandbox: std::sync::RwLock::new(Arc::new(running.sandbox)),
            counters: Counters::from_values(counters),
            last_activity: Mutex::new((Instant::now(), SystemTime::now())),
            in_flight: AtomicU64::new(0),
            reservation: Mutex::new(running.reservation),
            pausable: running.pausable,
            fork_base: running.fork_base,
            paused: tokio::sync::Mutex::new(paused),
            paused_now: std::sync::atomic::AtomicBool::new(paused),
            lost: std::sync::atomic::AtomicBool::new(false),
            record: Mutex::new(RecordTurn {
                saved: counters,
                disposed: false,
            }),
        }
    }
}

/// Logs the VM of a sandbox that stops on its own (the sweep disposes of it).
pub fn watch(watched: Arc<SandboxEntry>) {
    let sandbox = watched.sandbox();
    tokio::spawn(async move {
        let exit = sandbox.vm.wait().await;
        if !exit.requested {
            tracing::warn!(
                id = %watched.id,
                run_id = %watched.run_id,
                reason = %exit.reason,
                console = %exit.console.join(" | "),
                "The VM of a sandbox stopped on its own; the next sweep disposes of it"
            );
        }
    });
}

/// A new sandbox id: `sbx-` and 16 random hex digits, then `-` and the host's name if it has
/// one (`SANDBOX_HOST_NAME`, issue 33: a gateway reads the host from the id).
pub fn new_id(host: Option<&str>) -> String {
    let mut b = [0u8; 8];
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok();
    if !ok {
        let n = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        b = (n as u64 ^ u64::from(std::process::id()).rotate_left(32)).to_le_bytes();
    }
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    match host {
        Some(h) => format!("sbx-{hex}-{h}"),
        None => format!("sbx-{hex}"),
    }
}

/// The host's name an id ends with (`new_id`), if it is one this service makes.
pub fn host_of(id: &str) -> Option<Option<&str>> {
    let rest = id.strip_prefix("sbx-")?;
    let hex = rest.get(..16)?;
    if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    match &rest[16..] {
        "" => Some(None),
        tail => {
            let name = tail.strip_prefix('-')?;
            crate::config::valid_host_name(name).then_some(Some(name))
        }
    }
}

/// Adds `n` to a per-sandbox and the service-wide counter.
pub fn count(local: &AtomicU64, global: &AtomicU64, n: u64) {
    local.fetch_add(n, Relaxed);
    global.fetch_add(n, Relaxed);
}
