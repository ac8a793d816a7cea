//! `sandbox-host serve`: start-up checks, the listener, the sweep, and disposal on SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use sandbox_vmm::ImageStore;
use sandbox_vmm::image::STOCK;

use crate::config::{self, Config, ConfigError};
use crate::state::{AppState, Availability};
use crate::state_dir::{self, StateDirError};
use crate::{lifecycle, routes};
use sandbox_vmm::select as backend_select;

/// How long disposal at shutdown may take before the process exits anyway.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

/// Logs JSON lines, one object per event, fields at the top level.
pub fn init_json_logs() {
    tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_span_list(false)
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SANDBOX_HOST_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
}

/// Why the service did not start, or stopped without being asked; logged as one line.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// `.env` or a setting has a value it does not accept.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The state directory cannot be this process's.
    #[error(transparent)]
    StateDir(#[from] StateDirError),
    /// The jail's settings are wrong (the sentence names the setting).
    #[error("{0}")]
    Jail(String),
    /// The API's address cannot be listened on.
    #[error(
        "cannot listen on {addr}: {source}. Stop what uses the port, or set SANDBOX_HOST_PORT / SANDBOX_HOST_BIND"
    )]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP server ended with an error.
    #[error("the HTTP server failed: {0}")]
    Http(#[source] std::io::Error),
    /// `SANDBOX_HOST_TLS_CERT` or `SANDBOX_HOST_TLS_KEY` cannot be used.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
}

/// The service: reads the configuration, starts the backend and the API, and runs until a
/// signal stops it (shutting every sandbox down first).
pub async fn serve() -> ExitCode {
    let dotenv = config::load_dotenv();
    init_json_logs();
    let served = match dotenv {
        Ok(_) => run().await,
        Err(e) => Err(e.into()),
    };
    match served {
        Ok(()) => {
            tracing::info!("Stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::from(1)
        }
    }
}

/// Start-up in its order (the configuration, the state directory, the jail, the backend, the
/// listener), then the API until a signal.
async fn run() -> Result<(), ServiceError> {
    let cfg = Config::from_env()?;
    let tls = crate::tls::server_from_env()?;
    let _lock = state_dir::claim(&cfg.state_dir)?;
    // The jail comes first: every VM process (the probes' too) is started through it.
    let jail_settings = sandbox_jail::Settings::from_env(&state_dir::jail_instance(&cfg.state_dir))
        .map_err(ServiceError::Jail)?;
    let jail = sandbox_jail::install(&jail_settings);
    // From here on a signal is the service's to handle: one during the start-up (which may take
    // sandboxes on again) is answered once it serves, never with the default action's abrupt end.
    let signals = Signals::install();
    let store = ImageStore::new(cfg.image_dir.clone());
    let (mut availability, backend) = availability(&store).await;
    add_jail_status(&mut availability, jail.status());
    let addr = SocketAddr::new(cfg.bind, cfg.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServiceError::Listen { addr, source })?;
    let local = listener.local_addr().unwrap_or(addr);
    log_start(local, &availability);
    warn_about_host(&cfg, &store);
    let fds = crate::capacity::raise_fd_limit();
    tracing::info!(
        fd_limit = fds,
        memory_limit_mib = cfg.limits.memory_mib,
        disk_overcommit = cfg.limits.disk_overcommit,
        "Budgets: guest memory up to SANDBOX_HOST_MEMORY_LIMIT_MIB, sandbox disks up to SANDBOX_HOST_DISK_OVERCOMMIT times the free space, file descriptors up to RLIMIT_NOFILE"
    );
    let state = AppState::new(cfg, availability, backend);
    // The sandboxes an earlier run left running are taken on again before the API serves;
    // then what that run left of the others goes (their cgroups killing what is in them).
    let kept = crate::adopt::adopt_all(&state).await;
    let stale = jail.remove_stale(&kept.cgroups);
    if stale > 0 {
        tracing::info!(
            groups = stale,
            "Removed the cgroups of VMs a previous run left"
        );
    }
    state_dir::remove_leftovers(&state.config().state_dir, &kept.files)?;
    tokio::spawn(lifecycle::sweep_forever(state.clone()));
    lifecycle::save_forever(state.clone());
    let app = routes::app(state.clone());
    crate::tls::serve(listener, tls, app, dispose_on_signal(state, signals))
        .await
        .map_err(ServiceError::Http)
}

/// Resolves on SIGTERM or SIGINT once every sandbox is disposed of (or the time for it is up).
/// On SIGUSR2 it hands over instead ([`hand_over`]) and never resolves.
async fn dispose_on_signal(state: AppState, signals: Signals) {
    let sig = signals.recv().await;
    if sig == "SIGUSR2" {
        hand_over(&state).await;
    }
    state.begin_ending(crate::state::Ending::Disposing);
    tracing::info!(signal = sig, "Stopping: disposing of every sandbox");
    match tokio::time::timeout(SHUTDOWN_TIMEOUT, lifecycle::dispose_all(&state)).await {
        Ok(n) => tracing::info!(disposed = n, "Disposed of every sandbox"),
        Err(_) => tracing::error!(
            "disposing of the sandboxes took longer than {SHUTDOWN_TIMEOUT:?}; exiting anyway"
        ),
    }
    // What outlived the disposal (a create that finished meanwhile, a disposal that ran out of
    // time) would outlive the service too: every process left in this instance's cgroups ends.
    let left = sandbox_jail::global().remove_stale(&[]);
    if left > 0 {
        tracing::warn!(
            groups = left,
            "Killed what was left of sandboxes after the disposal"
        );
    }
}

/// What the jail cannot apply: a refusal makes the host unavailable, a gap is a warning.
fn add_jail_status(availability: &mut Availability, status: &sandbox_jail::Status) {
    let mut jail_warnings = vec![];
    if let Some(refusal) = &status.refusal {
        availability.available = false;
        availability.reason = Some(refusal.clone());
    } else if !status.missing.is_empty() {
        jail_warnings.push(format!(
            "the VM jail is incomplete: {}",
            status.missing.join("; ")
        ));
    }
    if !status.unenforced.is_empty() {
        jail_warnings.push(format!(
            "the VMs' cgroups cannot apply: {}",
            status.unenforced.join("; ")
        ));
    }
    if !jail_warnings.is_empty() {
        let jail_warning = jail_warnings.join("; ");
        availability.warning = Some(match availability.warning.take() {
            Some(w) => format!("{w}; {jail_warning}"),
            None => jail_warning,
        });
    }
}

/// The start-up line an operator reads first: where the API listens, and whether VMs can start.
fn log_start(local: SocketAddr, availability: &Availability) {
    tracing::info!(
        available = availability.available,
        reason = availability.reason.as_deref(),
        backend = %availability.backend,
        accel = %availability.accel,
        arch = %availability.arch,
        warning = availability.warning.as_deref(),
        jail = %crate::routes::health::jail_report(),
        "Listening on {}:{}",
        local.ip(),
        local.port()
    );
    if let Some(w) = &availability.warning {
        tracing::warn!("{w}");
    }
}

/// Warnings about how the host is set up: root, a state directory in memory, no guest image.
fn warn_about_host(cfg: &Config, store: &ImageStore) {
    // /proc/self belongs to the effective uid.
    let root = std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false);
    if root {
        tracing::warn!(
            "The sandbox host runs as root: the process that parses every HTTP request and holds every key \
             should run as an ordinary user (with access to /dev/kvm and subordinate ids for the jail); see \
             \"The jail\" in the operator guide"
        );
    }
    if sandbox_vmm::host::in_memory(&cfg.state_dir) {
        tracing::warn!(
            state_dir = %cfg.state_dir.display(),
            "The state directory is in memory (tmpfs): sandbox disks, the snapshots of paused sandboxes and \
             what a sandbox restored from a template reads of its snapshot are memory there, counted against \
             each VM's memory limit, so a VM that writes much to its disk, is paused with much of its memory \
             in use, or was restored and touches much of its memory, can be stopped by that limit. Put \
             SANDBOX_HOST_STATE_DIR on a disk"
        );
    }
    if store.resolve(lifecycle::DEFAULT_IMAGE).is_err() {
        tracing::warn!(
            image = lifecycle::DEFAULT_IMAGE,
            store = %store.dir().display(),
            "The guest image {} is not in the image store, so sandboxes use the stock image: each run keeps \
             its checkout in memory (/workspace is a tmpfs of three quarters of the guest's memory). Build \
             the guest image to give runs a disk",
            lifecycle::DEFAULT_IMAGE
        );
    }
}

/// How long a hand-over waits for a sandbox's pause or resume under way to end.
const PAUSE_TURN: Duration = Duration::from_secs(20);

/// The status a hand-over exits with: systemd restarts the unit on it (`RestartForceExitStatus`
/// in deploy/systemd/sandbox-host.service), with whatever binary is installed by then.
pub const HANDOVER_EXIT: i32 = 75;

/// The upgrade path (SIGUSR2): every sandbox whose processes can outlive the service has its
/// record written and is left running for the next run to take on again; the others (a backend
/// that cannot hand over) are disposed of. Then the process exits at once with
/// [`HANDOVER_EXIT`]: open requests end with their connections (an exec's stream with a
/// `host_restarting` line, its command running on), creates are refused meanwhile, and nothing
/// of the sandboxes is dropped or stopped.
async fn hand_over(state: &AppState) -> ! {
    // Creates are refused from now on, and the open exec streams say that the host is going.
    state.begin_ending(crate::state::Ending::HandingOver);
    let dir = state.config().state_dir.clone();
    let (mut kept, mut disposals) = (0, vec![]);
    let all = state.registry().all();
    // The kept sandboxes' pause locks, held to the exit: a pause asked before the hand-over
    // began cannot change a sandbox after its record was written.
    let mut held = vec![];
    for e in &all {
        // A pause or resume under way ends first (both are bounded), so the record says which
        // the sandbox is; one that does not end in time is not kept.
        let turn = tokio::time::timeout(PAUSE_TURN, e.paused.lock()).await.ok();
        let saved = match &turn {
            Some(paused) => {
                let paused = **paused && !e.is_lost();
                let (d, entry) = (dir.clone(), e.clone());
                crate::adopt::can_keep(e, paused)
                    && tokio::task::spawn_blocking(move || {
                        crate::adopt::save_as(&d, &entry, paused).is_ok()
                    })
                    .await
                    .unwrap_or(false)
            }
            None => false,
        };
        if saved {
            kept += 1;
            held.extend(turn);
        } else {
            drop(turn);
            if let Some(entry) = state.registry().take(&e.id) {
                let st = state.clone();
                disposals.push(tokio::spawn(async move {
                    lifecycle::dispose(&st, entry, crate::metrics::Disposal::Shutdown).await
                }));
            }
        }
    }
    // The exec streams of the kept sandboxes are told; those of the others end with their VM.
    state.begin_ending(crate::state::Ending::HandedOver);
    let disposed = disposals.len();
    let _ = tokio::time::timeout(SHUTDOWN_TIMEOUT, async {
        for d in disposals {
            let _ = d.await;
        }
    })
    .await;
    tracing::info!(
        kept,
        disposed,
        "Handed over: the sandboxes are left running for the next sandbox host on this state directory, which takes them on again"
    );
    // A moment for the exec streams' last lines to reach their clients.
    tokio::time::sleep(Duration::from_millis(300)).await;
    std::process::exit(HANDOVER_EXIT);
}

/// The signals that end the service, listened for from the start-up on.
struct Signals(
    Option<(
        tokio::signal::unix::Signal,
        tokio::signal::unix::Signal,
        tokio::signal::unix::Signal,
    )>,
);

impl Signals {
    fn install() -> Signals {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::user_defined2()),
        ) {
            (Ok(term), Ok(int), Ok(usr2)) => Signals(Some((term, int, usr2))),
            _ => Signals(None),
        }
    }

    /// The next one's name.
    async fn recv(self) -> &'static str {
        let Some((mut term, mut int, mut usr2)) = self.0 else {
            // Without signal handlers the process still ends on the default action; never resolve.
            std::future::pending::<()>().await;
            return "none";
        };
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
            _ = usr2.recv() => "SIGUSR2",
        }
    }
}

/// Can this host start a microVM? The backend must be usable and the stock image present.
async fn availability(store: &ImageStore) -> (Availability, Option<Arc<dyn sandbox_vmm::Backend>>) {
    let arch = sandbox_vmm::arch::Arch::guest().to_string();
    match backend_select::select(store).await {
        Ok(sel) => {
            let (backend, accel) = (sel.backend.name().to_string(), sel.backend.accel());
            match store.resolve(STOCK) {
                Ok(_) => (
                    Availability {
                        available: true,
                        reason: None,
                        backend,
                        accel,
                        arch: arch.clone(),
                        warning: sel.warning,
                    },
                    Some(Arc::from(sel.backend)),
                ),
                Err(e) => (
                    Availability {
                        available: false,
                        reason: Some(e.to_string()),
                        backend,
                        accel,
                        arch: arch.clone(),
                        warning: sel.warning,
                    },
                    None,
                ),
            }
        }
        Err(reason) => (
            Availability {
                available: false,
                reason: Some(reason.to_string()),
                backend: "qemu".into(),
                accel: "none".into(),
                arch,
                warning: None,
            },
            None,
        ),
    }
}
