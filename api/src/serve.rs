//! `sandbox-host serve`: start-up checks, the listener, the sweep, and disposal on SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use sandbox_vmm::ImageStore;
use sandbox_vmm::image::STOCK;

use crate::config::{self, Config};
use crate::state::{AppState, Availability};
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

/// The service: reads the configuration, starts the backend and the API, and runs until a
/// signal stops it (shutting every sandbox down first).
pub async fn serve() -> ExitCode {
    let dotenv = config::load_dotenv();
    init_json_logs();
    if let Err(e) = &dotenv {
        tracing::error!("{e}");
        return ExitCode::from(1);
    }
    let cfg = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::from(1);
        }
    };
    let _lock = match claim_state_dir(&cfg.state_dir) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::from(1);
        }
    };
    // The jail comes first: every VM process (the probes' too) is started through it.
    let jail_settings = match sandbox_jail::Settings::from_env(&jail_instance(&cfg.state_dir)) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::from(1);
        }
    };
    let jail = sandbox_jail::install(&jail_settings);
    let stale = jail.remove_stale();
    if stale > 0 {
        tracing::info!(
            groups = stale,
            "Removed the cgroups of VMs a previous run left"
        );
    }
    let store = ImageStore::new(cfg.image_dir.clone());
    let (mut availability, backend) = availability(&store).await;
    let status = jail.status();
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
    let addr = SocketAddr::new(cfg.bind, cfg.port);
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(
                "cannot listen on {addr}: {e}. Stop what uses the port, or set SANDBOX_HOST_PORT / SANDBOX_HOST_BIND"
            );
            return ExitCode::from(1);
        }
    };
    let local = listener.local_addr().unwrap_or(addr);
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

    let fds = crate::capacity::raise_fd_limit();
    tracing::info!(
        fd_limit = fds,
        memory_limit_mib = cfg.limits.memory_mib,
        disk_overcommit = cfg.limits.disk_overcommit,
        "Budgets: guest memory up to SANDBOX_HOST_MEMORY_LIMIT_MIB, sandbox disks up to SANDBOX_HOST_DISK_OVERCOMMIT times the free space, file descriptors up to RLIMIT_NOFILE"
    );
    let state = AppState::new(cfg, availability, backend);
    tokio::spawn(lifecycle::sweep_forever(state.clone()));
    let app = routes::app(state.clone());
    let shutdown_state = state.clone();
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let sig = shutdown_signal().await;
            tracing::info!(signal = sig, "Stopping: disposing of every sandbox");
            match tokio::time::timeout(SHUTDOWN_TIMEOUT, lifecycle::dispose_all(&shutdown_state)).await {
                Ok(n) => tracing::info!(disposed = n, "Disposed of every sandbox"),
                Err(_) => tracing::error!("disposing of the sandboxes took longer than {SHUTDOWN_TIMEOUT:?}; exiting anyway"),
            }
        })
        .await;
    if let Err(e) = served {
        tracing::error!("the HTTP server failed: {e}");
        return ExitCode::from(1);
    }
    tracing::info!("Stopped");
    ExitCode::SUCCESS
}

async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers the process still ends on the default action; never resolve.
        std::future::pending::<()>().await;
        return "none";
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// Names this instance's cgroups after its state directory: stable across restarts (so a
/// restart finds what a crash left) and distinct between instances on one host.
fn jail_instance(state_dir: &Path) -> String {
    use sha2::Digest;
    let canonical = state_dir
        .canonicalize()
        .unwrap_or_else(|_| state_dir.to_path_buf());
    let digest = sha2::Sha256::digest(canonical.as_os_str().as_encoded_bytes());
    format!(
        "i-{}",
        digest[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    )
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

/// Takes the state directory for this process (one sandbox host per directory) and removes what
/// a crashed earlier process left there. Directories of `sandbox-host run`s still running stay.
fn claim_state_dir(dir: &Path) -> Result<std::fs::File, String> {
    std::fs::create_dir_all(dir).map_err(|e| {
        format!(
            "cannot create SANDBOX_HOST_STATE_DIR {}: {e}",
            dir.display()
        )
    })?;
    let lock_path = dir.join(".lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| format!("cannot open {}: {e}", lock_path.display()))?;
    lock.try_lock().map_err(|_| {
        format!(
            "another sandbox host uses SANDBOX_HOST_STATE_DIR {}; stop it, or give this one another directory",
            dir.display()
        )
    })?;
    let mut removed = 0;
    for e in std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == ".lock" || live_run(&name) {
            continue;
        }
        let p = e.path();
        let gone = if p.is_dir() {
            std::fs::remove_dir_all(&p)
        } else {
            std::fs::remove_file(&p)
        };
        if gone.is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        tracing::info!(removed, dir = %dir.display(), "Removed what an earlier sandbox host left in the state directory");
    }
    Ok(lock)
}

/// `run-<pid>-…` of a `sandbox-host run` that is still running.
fn live_run(name: &str) -> bool {
    name.strip_prefix("run-")
        .and_then(|r| r.split('-').next())
        .and_then(|p| p.parse::<u32>().ok())
        .is_some_and(sandbox_vmm::host::process_alive)
}
