//! How a sandbox comes to run, whatever asked for it: a [`Plan`] checked against the image
//! store, its share of the host's budgets, its network process, its VM (restored from a
//! template of its shape, or booted) on that network with the guest's network set up, and its
//! registry entry built from the plan. The create handler only turns JSON into a plan and the
//! entry into JSON.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use sandbox_vmm::image::STOCK;
use sandbox_vmm::{Backend, Image, VmSpec};

use crate::egress::EgressSpec;
use crate::error::ApiError;
use crate::metrics::Disposal;
use crate::registry::{self, SandboxEntry};
use crate::state::AppState;

mod fork;
mod pause;
mod template;

pub use fork::{Child, MAX_CHILDREN, fork};
pub use pause::{PauseOutcome, ResumeOutcome, pause, resume};

/// The image a run gets when it names none.
pub const DEFAULT_IMAGE: &str = "vantik-guest:latest";

/// Disk limit of a run with the review cycle, and without (MiB), from the operator guide.
const DISK_LIMIT_REVIEW_MIB: u64 = 30_720;
const DISK_LIMIT_MIB: u64 = 20_480;

/// Longest a sandbox may take to boot before the create fails (TCG boots take seconds).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// The longest the guest's network set-up may take, host side.
const NET_SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// What a run asked for, checked by the API (lengths, names, patterns).
pub struct Asked {
    /// The platform's run id.
    pub run_id: String,
    /// Its time limit.
    pub time_limit: Duration,
    /// The review cycle's larger disk.
    pub review: bool,
    /// Guest memory.
    pub memory_mib: u32,
    /// Guest vCPUs.
    pub vcpus: u8,
    /// The image by name; [`DEFAULT_IMAGE`] if none.
    pub image: Option<String>,
    /// Variables of every command.
    pub env: BTreeMap<String, String>,
    /// The harness version the run expects, if it says.
    pub harness_version: Option<String>,
    /// Its egress, secrets' values included until its network process has them.
    pub egress: EgressSpec,
}

/// A sandbox to be: the run as its registry entry will hold it, and the image it boots.
pub struct Plan {
    /// The run, checked and resolved.
    pub run: registry::Run,
    /// The image it boots (the stock one when the one asked for is not in the store).
    pub image: Image,
}

impl Plan {
    /// The plan of `asked`: its image looked up now, so a newly built image applies without a
    /// restart; an image missing from the store falls back to the stock one, as the operator
    /// guide says, with a warning in the log.
    pub fn new(state: &AppState, asked: Asked) -> Result<Plan, ApiError> {
        let wanted = asked.image.unwrap_or_else(|| DEFAULT_IMAGE.to_string());
        let (image, stock_image) = match state.store().resolve(&wanted) {
            Ok(img) => {
                let stock = wanted == STOCK;
                (img, stock)
            }
            Err(sandbox_vmm::ImageError::Missing { .. }) => {
                let img = state
                    .store()
                    .resolve(STOCK)
                    .map_err(|e| ApiError::Unavailable(e.to_string()))?;
                tracing::warn!(wanted = %wanted, "image not in the image store; using the stock image (/workspace in memory)");
                (img, true)
            }
            Err(e) => return Err(ApiError::BadRequest(e.to_string())),
        };
        let harness_version_match = match (&asked.harness_version, &image.harness_version) {
            (Some(want), Some(have)) => Some(want == have),
            _ => None,
        };
        Ok(Plan {
            run: registry::Run {
                id: registry::new_id(state.config().name.as_deref()),
                run_id: asked.run_id,
                image: if stock_image {
                    STOCK.to_string()
                } else {
                    wanted
                },
                stock_image,
                harness_version_match,
                disk_limit_mib: if asked.review {
                    DISK_LIMIT_REVIEW_MIB
                } else {
                    DISK_LIMIT_MIB
                },
                memory_mib: asked.memory_mib,
                vcpus: asked.vcpus,
                env: asked.env,
                egress: asked.egress,
                time_limit: asked.time_limit,
            },
            image,
        })
    }

    /// Its VM's spec, in its own state directory.
    fn vm_spec(&self, state: &AppState) -> VmSpec {
        let run = &self.run;
        self.image.vm_spec(
            run.id.clone(),
            run.memory_mib,
            run.vcpus,
            run.disk_limit_mib,
            state.config().state_dir.join(&run.id),
        )
    }

    /// The template shape its VM matches.
    fn shape(&self, spec: &VmSpec) -> crate::templates::Shape {
        crate::templates::Shape {
            image_dir: self.image.dir.clone(),
            memory_mib: self.run.memory_mib,
            vcpus: self.run.vcpus,
            disk_mib: spec.scratch_disk_mib,
        }
    }
}

/// The host's backend, or why no sandbox can start here (checked before anything of a request
/// is: a host that cannot start one says so first).
pub fn backend(state: &AppState) -> Result<Arc<dyn Backend>, ApiError> {
    state.backend().cloned().ok_or_else(|| {
        ApiError::Unavailable(
            state
                .availability()
                .reason
                .clone()
                .unwrap_or_else(|| "no backend".into()),
        )
    })
}

/// A sandbox that runs, and how it came to.
pub struct Created {
    /// Its registry entry.
    pub entry: Arc<SandboxEntry>,
    /// Restored from a template rather than booted.
    pub restored: bool,
}

/// Where a new sandbox's VM comes from.
enum Origin<'a> {
    /// Its shape's template, or a boot.
    Shape,
    /// A snapshot of a running sandbox, for which room was made already.
    Fork {
        snapshot: &'a crate::templates::Template,
        reservation: crate::capacity::Reservation,
    },
}

/// Makes the sandbox `plan` describes, on the host's backend: admitted, started (from a
/// template of its shape when there is one; a template that fails is discarded and the sandbox
/// boots cold), registered and watched. On failure nothing of it is left.
pub async fn create(
    state: &AppState,
    backend: Arc<dyn Backend>,
    plan: Plan,
) -> Result<Created, ApiError> {
    create_from(state, backend, plan, Origin::Shape).await
}

/// Whether the service takes new sandboxes now: not while it stops, hands over or drains.
fn taking_new(state: &AppState) -> Result<(), ApiError> {
    match state.ending() {
        crate::state::Ending::Serving => {}
        crate::state::Ending::Disposing => {
            return Err(ApiError::Restarting(
                "the sandbox host is stopping: it disposes of every sandbox; create the sandbox \
                 on another host, or here once it has started again"
                    .into(),
            ));
        }
        crate::state::Ending::HandingOver | crate::state::Ending::HandedOver => {
            return Err(ApiError::Restarting(
                "the sandbox host is handing over to its next run (an upgrade): retry in a few \
                 seconds"
                    .into(),
            ));
        }
    }
    if state.draining() {
        return Err(ApiError::NoCapacity(
            "this sandbox host is draining: it takes no new sandboxes, and its sandboxes run to \
             their end. Create the sandbox on another host (a fleet's gateway does), or end the \
             drain (PUT /v1/hosts/{name}/drain with {\"draining\": false})"
                .into(),
        ));
    }
    Ok(())
}

/// [`create`], of a VM from `origin`.
async fn create_from(
    state: &AppState,
    backend: Arc<dyn Backend>,
    plan: Plan,
    origin: Origin<'_>,
) -> Result<Created, ApiError> {
    taking_new(state)?;
    let mut spec = plan.vm_spec(state);
    // A sandbox outlives a crash or a hand-over of the service where its backend lets the next
    // run take it on again (`adopt.rs`), and where the jail makes cgroups: what the next run does
    // not take on (a crash before its record, a record refused) ends with its cgroup, which
    // nothing else would end.
    spec.outlive = backend.can_outlive() && sandbox_jail::global().status().cgroup.is_some();
    // Admission: the sandbox's share of the host's budgets, held until it is gone (a fork's
    // children were admitted before their parent was held).
    let (reservation, fork) = match origin {
        Origin::Shape => (admit(state, &plan.run, &spec)?, None),
        Origin::Fork {
            snapshot,
            reservation,
        } => (reservation, Some(snapshot)),
    };
    let shape = plan.shape(&spec);
    // Where the backend can pause a VM, every sandbox's VM gets at start the two files its
    // snapshot goes to (created empty here; the VM process opens nothing itself).
    let pause_dir = state
        .config()
        .state_dir
        .join(format!("{}.paused", plan.run.id));
    let pausable_files = if backend.can_pause() {
        let files = snapshot_files(&pause_dir)
            .and_then(|a| Ok([a, snapshot_files(&pause_dir.join("b"))?]))
            .map_err(|e| {
                ApiError::Internal(format!(
                    "creating the sandbox's snapshot files in {}: {e}",
                    pause_dir.display()
                ))
            })?;
        Some(files)
    } else {
        None
    };
    spec.snapshot_to = pausable_files.as_ref().map(|f| f[0].clone());
    let base_spec = spec.clone();
    let booted = match fork {
        None => start_from_template_or_boot(state, backend.as_ref(), &plan, spec, &shape).await,
        Some(snapshot) => start(state, backend.as_ref(), &plan, spec, Some(snapshot))
            .await
            .map(|b| (b, true, true)),
    };
    let ((sandbox, started), restored, had_template) = match booted {
        Ok(b) => b,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&pause_dir);
            return Err(e);
        }
    };
    let pausable = pausable_files.map(|files| registry::Pausable {
        dir: pause_dir.clone(),
        files,
        slot: std::sync::atomic::AtomicUsize::new(0),
        vm_dir: std::sync::Mutex::new(base_spec.state_dir.clone()),
        resumes: std::sync::atomic::AtomicU64::new(0),
        spec: base_spec,
        mac: started.mac,
        image_dir: plan.image.dir.clone(),
    });
    if !had_template {
        // The first sandbox of its shape: the next ones are restored.
        template::ensure(state, backend.clone(), plan.image.clone(), shape);
    }
    state.metrics().started(restored && fork.is_none());
    state.metrics().boot(sandbox.boot_time);
    let entry = register(
        state,
        plan.run,
        registry::Running {
            // The secrets' placeholders (and the CA's paths) for every command.
            env: started.env,
            net: Some(started.egress),
            sandbox,
            reservation,
            pausable,
            fork_base: Some(registry::ForkBase {
                image: plan.image.clone(),
                mac: started.mac,
            }),
        },
    );
    // A create that was under way when the service began to dispose of every sandbox: that
    // disposal did not see it, so it goes now (it would outlive the service otherwise).
    if state.ending() == crate::state::Ending::Disposing
        && let Some(entry) = state.registry().take(&entry.id)
    {
        dispose(state, entry, Disposal::Shutdown).await;
        return Err(ApiError::Restarting(
            "the sandbox host is stopping: it disposes of every sandbox; create the sandbox on \
             another host, or here once it has started again"
                .into(),
        ));
    }
    // Its record, before the create is answered (a crash after the answer keeps the sandbox),
    // off the runtime's threads (it is synced to disk).
    let (dir, e) = (state.config().state_dir.clone(), entry.clone());
    let _ = tokio::task::spawn_blocking(move || crate::adopt::save_or_log(&dir, &e)).await;
    Ok(Created { entry, restored })
}

/// The share of the host's budgets a sandbox of `run` with `spec` holds until it is gone.
fn admit(
    state: &AppState,
    run: &registry::Run,
    spec: &VmSpec,
) -> Result<crate::capacity::Reservation, ApiError> {
    state
        .capacity()
        .reserve(
            u64::from(run.memory_mib),
            state.config().egress_memory_mib + crate::netproc::ALLOWANCE_MIB,
            spec.scratch_disk_mib.unwrap_or(0),
        )
        .map_err(|why| {
            state.metrics().refused_for_capacity();
            ApiError::NoCapacity(why)
        })
}

/// The VM of `plan` started from its shape's template, if there is one and it works, else
/// booted; with whether it was restored, and whether its shape had a template.
async fn start_from_template_or_boot(
    state: &AppState,
    backend: &dyn Backend,
    plan: &Plan,
    spec: VmSpec,
    shape: &crate::templates::Shape,
) -> Result<((sandbox_vmm::Sandbox, Started), bool, bool), ApiError> {
    let Some(t) = state.templates().and_then(|t| t.get(shape)) else {
        return start(state, backend, plan, spec, None)
            .await
            .map(|b| (b, false, false));
    };
    match start(state, backend, plan, spec.clone(), Some(&t)).await {
        Ok(b) => Ok((b, true, true)),
        Err(e @ ApiError::BadRequest(_)) => Err(e),
        Err(e) => {
            if let Some(templates) = state.templates() {
                templates.discard(shape, &e.to_string());
            }
            start(state, backend, plan, spec, None)
                .await
                .map(|b| (b, false, true))
        }
    }
}

/// The network process and what the guest got of it, once the guest is configured.
struct Started {
    egress: Arc<crate::netproc::NetProcess>,
    env: Vec<(String, String)>,
    /// The guest's MAC address, for a resume.
    mac: [u8; 6],
}

/// Two empty files for a sandbox's snapshot, in a directory of their own.
fn snapshot_files(dir: &std::path::Path) -> std::io::Result<sandbox_vmm::SnapshotFiles> {
    std::fs::create_dir_all(dir)?;
    let files = snapshot_paths(dir);
    for p in [&files.state, &files.memory] {
        std::fs::File::create(p)?;
    }
    Ok(files)
}

/// Where a snapshot set under `dir` is (`snapshot.state`, `snapshot.mem`).
pub(crate) fn snapshot_paths(dir: &std::path::Path) -> sandbox_vmm::SnapshotFiles {
    sandbox_vmm::SnapshotFiles {
        state: dir.join("snapshot.state"),
        memory: dir.join("snapshot.mem"),
        disk: None,
        take_disk: false,
    }
}

/// Starts the sandbox's network process, then its VM (restored from `template` or booted),
/// then gives the guest its network and CA. On failure nothing of it is left.
async fn start(
    state: &AppState,
    backend: &dyn Backend,
    plan: &Plan,
    mut spec: VmSpec,
    template: Option<&crate::templates::Template>,
) -> Result<(sandbox_vmm::Sandbox, Started), ApiError> {
    // The network process starts first: the VM's network device is its other end. A clone
    // keeps the template's MAC address, which its guest's driver read at the template's boot.
    let started = crate::egress::start(
        &plan.run.id,
        &plan.run.egress,
        state.config(),
        template.map(|t| t.mac),
        spec.outlive,
    )
    .await
    .map_err(|e| match e {
        crate::netproc::NetProcessError::Bad(m) => ApiError::BadRequest(m),
        crate::netproc::NetProcessError::Internal(m) => {
            ApiError::Internal(format!("the sandbox's egress could not start: {m}"))
        }
    })?;
    let mac = started.attachment.mac;
    spec.net = Some(started.attachment);
    spec.restore_from = template.map(|t| t.files.clone());
    let liveness = state.config().liveness();
    let sandbox = match sandbox_vmm::boot_watched(backend, spec, BOOT_TIMEOUT, liveness).await {
        Ok(s) => s,
        Err(e) => {
            state.metrics().boot_failed();
            tracing::error!(run_id = %plan.run.run_id, error = %e, restored = template.is_some(), "a sandbox did not start");
            return Err(ApiError::Internal(format!(
                "the microVM did not start: {e}"
            )));
        }
    };
    // The guest's own timeout for the script is 10 s; the host's bound covers a guest that
    // never answers at all.
    // Either failure carries the guest's last console lines: a guest that closed its channel
    // has usually said why there.
    let console = || {
        sandbox_vmm::backend::console_suffix(&sandbox_vmm::sandbox::diagnostic_lines(
            sandbox.vm.as_ref(),
        ))
    };
    let configured = match tokio::time::timeout(
        NET_SETUP_TIMEOUT,
        crate::egress::configure_guest(
            &sandbox.client,
            mac,
            started.ca_pem.as_deref(),
            template.is_none(),
        ),
    )
    .await
    {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("{e}{}", console())),
        Err(_) => Err(format!(
            "the guest did not finish its network set-up within {NET_SETUP_TIMEOUT:?}{}",
            console()
        )),
    };
    if let Err(e) = configured {
        sandbox.stop().await;
        state.metrics().boot_failed();
        tracing::error!(run_id = %plan.run.run_id, error = %e, "a sandbox's network could not be set up");
        return Err(ApiError::Internal(format!(
            "the microVM started but its network could not be set up: {e}"
        )));
    }
    Ok((
        sandbox,
        Started {
            egress: started.net,
            env: started.env,
            mac,
        },
    ))
}

/// Registers the entry of `run`'s sandbox and watches its VM.
fn register(state: &AppState, run: registry::Run, running: registry::Running) -> Arc<SandboxEntry> {
    let entry = Arc::new(SandboxEntry::new(run, running));
    state.registry().insert(entry.clone());
    registry::watch(entry.clone());
    entry
}

/// Stops a sandbox's VM, removes its files, logs and counts the disposal.
pub async fn dispose(state: &AppState, entry: Arc<SandboxEntry>, why: Disposal) {
    // A pause or resume under way finishes first (each is bounded).
    let _turn = entry.paused.lock().await;
    // The record first: a crash from here on leaves nothing that a restart would take on. Off
    // the runtime's threads: a save of it in progress holds its turn across a sync to disk.
    let (dir, e) = (state.config().state_dir.clone(), entry.clone());
    let _ = tokio::task::spawn_blocking(move || crate::adopt::forget(&dir, &e)).await;
    let exit = entry.sandbox().stop().await;
    if let Some(p) = &entry.pausable {
        let _ = std::fs::remove_dir_all(&p.dir);
    }
    state.metrics().disposed(why);
    if let Some(net) = &entry.net {
        let report = crate::egress::report(net).await;
        net.end();
        state.metrics().retire_egress(
            &crate::egress::refusal_counts(&report),
            &crate::egress::unmetered_counts(&report),
        );
    }
    tracing::info!(
        id = %entry.id,
        run_id = %entry.run_id,
        reason = why.as_str(),
        vm_exit = %exit.reason,
        "Disposed of sandbox"
    );
}

/// Disposes of a sandbox by id (DELETE).
pub async fn delete(state: &AppState, id: &str) -> Result<(), ApiError> {
    let entry = state
        .registry()
        .take(id)
        .ok_or_else(|| ApiError::NoSandbox(id.chars().take(80).collect()))?;
    dispose(state, entry, Disposal::Deleted).await;
    Ok(())
}

/// One pass of the sweep: dead VMs, idle sandboxes, expired runs.
pub async fn sweep(state: &AppState) {
    let now_i = Instant::now();
    let now_w = SystemTime::now();
    let cfg = state.config();
    for e in state.registry().all() {
        // A paused sandbox has no VM: only its run's time limit applies (a pause is the
        // platform keeping it for later, so it is never idle).
        let paused = e.is_paused();
        let why = if e.is_lost() || (!paused && e.sandbox().vm.exit().is_some()) {
            Some(Disposal::VmDied)
        } else if now_w > e.expires_at + cfg.grace {
            Some(Disposal::TimeLimit)
        } else if !paused
            && e.in_flight() == 0
            && now_i.duration_since(e.last_activity().0) > cfg.idle
        {
            Some(Disposal::Idle)
        } else {
            None
        };
        if let Some(why) = why
            && let Some(entry) = state.registry().take(&e.id)
        {
            if entry.paused.try_lock().is_ok() {
                dispose(state, entry, why).await;
            } else {
                // A pause or resume holds it (bounded, but by minutes for a guest that never
                // answers): it is disposed of when that ends, and the others are not kept
                // waiting behind it.
                let state = state.clone();
                tokio::spawn(async move { dispose(&state, entry, why).await });
            }
        }
    }
}

/// Runs the sweep every `SANDBOX_HOST_SWEEP_MS` (15 s) until the process ends.
pub async fn sweep_forever(state: AppState) {
    let mut tick = tokio::time::interval(state.config().sweep);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        sweep(&state).await;
    }
}

/// Every second, writes the records of the sandboxes whose counters moved, so that a crash of
/// the service loses at most a second of them; on a thread of its own (each write is synced to
/// disk), so a slow disk holds up neither the runtime nor the sweep.
pub fn save_forever(state: AppState) {
    std::thread::Builder::new()
        .name("records".into())
        .spawn(move || {
            loop {
                std::thread::sleep(RECORD_EVERY);
                for e in state.registry().all() {
                    crate::adopt::save_if_moved(&state.config().state_dir, &e);
                }
            }
        })
        .map(drop)
        .unwrap_or_else(|e| tracing::error!("the records' thread did not start: {e}"));
}

/// How often the records keep up with the sandboxes' counters.
const RECORD_EVERY: Duration = Duration::from_secs(1);

/// Disposes of every sandbox (SIGINT/SIGTERM), all at once.
pub async fn dispose_all(state: &AppState) -> usize {
    let entries: Vec<_> = state
        .registry()
        .all()
        .into_iter()
        .filter_map(|e| state.registry().take(&e.id))
        .collect();
    let n = entries.len();
    let tasks: Vec<_> = entries
        .into_iter()
        .map(|e| {
            let st = state.clone();
            tokio::spawn(async move { dispose(&st, e, Disposal::Shutdown).await })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    n
}
