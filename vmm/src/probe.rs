//! Proving that a backend boots a guest here: boot the stock image, wait for its agent, run
//! `true`. Some hosts offer a `/dev/kvm` that opens fine but cannot run a Linux kernel (nested
//! hypervisors that emulate kernel code and fail); only a real boot tells. The result is
//! remembered per host boot, backend and image, so only the first start after a change pays.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use thiserror::Error;

use crate::backend::{Backend, VmError, VmExit, VmSpec, VmStartError, console_suffix};
use crate::image::{ImageError, ImageStore, STOCK};
use sandbox_protocol::client::{Client, ClientError, ExecEvent};

/// Why a backend is taken not to boot a guest here; `what` names the backend as the operator
/// knows it ("the KVM backend", "QEMU with KVM").
#[derive(Debug, Error)]
pub enum ProbeError {
    /// The stock image, which the probe boots, is not there.
    #[error("{what} could not be checked: {source}")]
    Image {
        /// The backend.
        what: &'static str,
        /// Why the image is missing.
        #[source]
        source: ImageError,
    },
    /// The host's KVM cannot run a Linux kernel (a nested hypervisor that emulates it).
    #[error("/dev/kvm cannot run a Linux guest here (KVM internal error: emulation failure)")]
    Emulation,
    /// `/dev/kvm` is missing (the sentence says how to get one).
    #[error("{0}")]
    NoDevice(&'static str),
    /// `/dev/kvm` cannot be opened.
    #[error("no usable /dev/kvm ({0})")]
    Device(#[source] std::io::Error),
    /// The backend refused to start the probe's VM.
    #[error("{what} did not start a guest ({source})")]
    Start {
        /// The backend.
        what: &'static str,
        /// What it said.
        #[source]
        source: VmError,
    },
    /// The backend did not hand back a VM in time.
    #[error("{what} did not boot a guest within {limit:?} (SANDBOX_HOST_PROBE_TIMEOUT_S)")]
    StartTimeout {
        /// The backend.
        what: &'static str,
        /// The bound.
        limit: Duration,
    },
    /// The guest's agent was not ready in time.
    #[error("a {what} guest did not boot within {limit:?} (SANDBOX_HOST_PROBE_TIMEOUT_S)")]
    BootTimeout {
        /// The backend.
        what: &'static str,
        /// The bound.
        limit: Duration,
    },
    /// The guest ended before its agent was ready.
    #[error("{what} could not boot a guest: {}{}", .exit.reason, console_suffix(&.exit.console))]
    Stopped {
        /// The backend.
        what: &'static str,
        /// How it ended.
        exit: VmExit,
    },
    /// The agent channel failed while the VM ran on.
    #[error("the {what} probe guest lost its channel ({source})")]
    LostChannel {
        /// The backend.
        what: &'static str,
        /// How the channel failed.
        #[source]
        source: ClientError,
    },
    /// `true` ran and failed.
    #[error("`true` failed in the {what} probe guest: {status}")]
    TrueFailed {
        /// The backend.
        what: &'static str,
        /// Its status, as the agent gave it.
        status: String,
    },
    /// `true` could not be run.
    #[error("exec in the {what} probe guest failed: {source}")]
    Exec {
        /// The backend.
        what: &'static str,
        /// What the agent channel said.
        #[source]
        source: ClientError,
    },
    /// `true`'s output ended without its status.
    #[error("exec in the {what} probe guest ended without a status")]
    NoStatus {
        /// The backend.
        what: &'static str,
    },
    /// `true` did not finish in time.
    #[error("`true` did not finish within {limit:?} in the {what} probe guest")]
    TrueTimeout {
        /// The backend.
        what: &'static str,
        /// The bound.
        limit: Duration,
    },
    /// What an earlier probe on this host boot found (its sentence, from the record).
    #[error("{0}")]
    Remembered(String),
}

impl ProbeError {
    /// Whether a loaded host, rather than a backend that cannot work, may be the cause: a
    /// deadline passed. Such a result is not remembered; the next start tries again.
    fn may_pass(&self) -> bool {
        match self {
            ProbeError::StartTimeout { .. }
            | ProbeError::BootTimeout { .. }
            | ProbeError::TrueTimeout { .. } => true,
            ProbeError::Start {
                source: VmError::Start(e),
                ..
            } => match e {
                VmStartError::AgentRefused { .. }
                | VmStartError::BuildTimeout(_)
                | VmStartError::ConnectTimeout(_) => true,
                // The jailed process did not say it had started in time (a loaded host).
                VmStartError::Jail { source, .. } => timed_out(source),
                _ => false,
            },
            _ => false,
        }
    }
}

/// Whether `e`, or an error it was caused by, is an I/O deadline that passed.
fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// How long a probe boot may take by default; a real KVM host needs well under a second, QEMU
/// under TCG a few seconds.
const DEFAULT_PROBE_TIMEOUT_S: u64 = 20;

/// `SANDBOX_HOST_PROBE_TIMEOUT_S` (1 to 600, checked with the service's configuration): an
/// emulated host (KVM nested under TCG, as in `tests/nested/`) boots a guest in about 10 s
/// when idle and slower under load.
pub fn probe_timeout() -> Duration {
    let s = std::env::var("SANDBOX_HOST_PROBE_TIMEOUT_S")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| (1..=600).contains(s))
        .unwrap_or(DEFAULT_PROBE_TIMEOUT_S);
    Duration::from_secs(s)
}

/// Held while a probe runs (see [`boots_cached`]).
static PROBING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
/// Numbers the probes of this process, so no two share a state directory.
static PROBE_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[derive(Debug, Serialize, Deserialize)]
struct ProbeRecord {
    key: u64,
    ok: bool,
    reason: String,
}

/// Whether `backend` boots the stock image, cached in `<cache>/probe/<name>.json`, keyed by
/// the host's boot id, `extra` files (e.g. the QEMU binary), the image and our own binary.
pub async fn boots_cached(
    backend: &dyn Backend,
    what: &'static str,
    name: &str,
    extra: &[&Path],
    store: &ImageStore,
) -> Result<(), ProbeError> {
    let image = store
        .resolve(STOCK)
        .map_err(|source| ProbeError::Image { what, source })?;
    let exe = std::env::current_exe().ok();
    let mut keyed: Vec<&Path> = extra.to_vec();
    keyed.push(&image.kernel);
    if let Some(i) = image.initrd.as_deref() {
        keyed.push(i);
    }
    if let Some(e) = exe.as_deref() {
        keyed.push(e);
    }
    let key = probe_key(&keyed);
    // One probe at a time in this process: callers that come while one runs (four sandboxes
    // created at once on a fresh host) wait for its record instead of racing it.
    let _one_at_a_time = PROBING.lock().await;
    let record_path = crate::config::cache_dir().join(format!("probe/{name}.json"));
    let cached = std::fs::read(&record_path)
        .ok()
        .and_then(|b| serde_json::from_slice::<ProbeRecord>(&b).ok());
    if let Some(r) = cached.filter(|r| r.key == key) {
        return if r.ok {
            Ok(())
        } else {
            Err(ProbeError::Remembered(r.reason))
        };
    }
    let result = probe(backend, what, &image.kernel, image.initrd.clone()).await;
    // A timeout may be a loaded host rather than a backend that cannot work: the next start
    // tries again instead of living with it until the host reboots.
    if result.as_ref().is_err_and(ProbeError::may_pass) {
        return result;
    }
    let record = ProbeRecord {
        key,
        ok: result.is_ok(),
        reason: result
            .as_ref()
            .err()
            .map(ToString::to_string)
            .unwrap_or_default(),
    };
    if let Some(dir) = record_path.parent() {
        let _ = std::fs::create_dir_all(dir);
        // Written aside and renamed: another process (a second test binary, `sandbox-host run`)
        // reading the record meanwhile sees the old one or this one, never half of one.
        let tmp = record_path.with_extension(format!("json.{}", std::process::id()));
        if std::fs::write(&tmp, serde_json::to_vec(&record).unwrap_or_default()).is_ok()
            && std::fs::rename(&tmp, &record_path).is_err()
        {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    result
}

fn emulation_failed(lines: &[String]) -> bool {
    lines
        .iter()
        .any(|l| l.contains("KVM internal error") || l.contains("emulation failure"))
}

/// Boots the stock image once on `backend` and runs `true` in it.
pub async fn probe(
    backend: &dyn Backend,
    what: &'static str,
    kernel: &Path,
    initrd: Option<PathBuf>,
) -> Result<(), ProbeError> {
    let seq = PROBE_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let state_dir = crate::config::state_dir().join(format!(
        "probe-{}-{}-{seq}",
        backend.name(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&state_dir);
    let limit = probe_timeout();
    let spec = VmSpec {
        id: "probe".into(),
        memory_mib: 256,
        vcpus: 1,
        kernel: kernel.to_path_buf(),
        initrd,
        disks: vec![],
        scratch_disk_mib: None,
        cmdline: vec![],
        state_dir,
        net: None,
        start_timeout: Some(limit),
        snapshot_to: None,
        restore_from: None,
        outlive: false,
    };
    let started = Instant::now();
    let vm = match tokio::time::timeout(limit, backend.start(spec)).await {
        Ok(Ok(vm)) => vm,
        Ok(Err(source)) => {
            return Err(if source.to_string().contains("KVM internal error") {
                ProbeError::Emulation
            } else {
                ProbeError::Start { what, source }
            });
        }
        Err(_) => return Err(ProbeError::StartTimeout { what, limit }),
    };
    let client = Client::new(vm.channel.read, vm.channel.write);
    let vm = vm.vm;
    let outcome = loop {
        tokio::select! {
            r = client.wait_ready(Duration::from_millis(200)) => match r {
                Ok(_) => break Ok(()),
                Err(ClientError::Timeout(_)) => {}
                Err(source) => match tokio::time::timeout(Duration::from_secs(1), vm.wait()).await {
                    Ok(exit) => break Err(ProbeError::Stopped { what, exit }),
                    Err(_) => break Err(ProbeError::LostChannel { what, source }),
                },
            },
            exit = vm.wait() => break Err(ProbeError::Stopped { what, exit }),
        }
        if emulation_failed(&vm.console_tail(50)) {
            break Err(ProbeError::Emulation);
        }
        if started.elapsed() > limit {
            break Err(ProbeError::BootTimeout { what, limit });
        }
    };
    let outcome = match outcome {
        Ok(()) => tokio::time::timeout(limit, run_true(&client, what))
            .await
            .unwrap_or(Err(ProbeError::TrueTimeout { what, limit })),
        Err(e) => Err(e),
    };
    // Whatever went wrong, an emulation failure in the console is the real reason.
    let outcome = outcome.map_err(|why| {
        if emulation_failed(&vm.console_tail(50)) {
            ProbeError::Emulation
        } else {
            why
        }
    });
    vm.stop(Duration::from_millis(500)).await;
    outcome
}

async fn run_true(client: &Client, what: &'static str) -> Result<(), ProbeError> {
    let req = sandbox_protocol::message::ExecRequest {
        argv: Some(vec!["true".into()]),
        cwd: Some("/".into()),
        ..Default::default()
    };
    match client.exec(&req).await {
        Ok(mut e) => loop {
            match e.output.next().await {
                Some(Ok(ExecEvent::Exit(s))) if s.exit_code == Some(0) => break Ok(()),
                Some(Ok(ExecEvent::Exit(s))) => {
                    break Err(ProbeError::TrueFailed {
                        what,
                        status: format!("{s:?}"),
                    });
                }
                Some(Ok(_)) => {}
                Some(Err(source)) => break Err(ProbeError::Exec { what, source }),
                None => break Err(ProbeError::NoStatus { what }),
            }
        },
        Err(source) => Err(ProbeError::Exec { what, source }),
    }
}

fn probe_key(paths: &[&Path]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap_or_default()
        .hash(&mut h);
    for p in paths {
        p.hash(&mut h);
        if let Ok(m) = std::fs::metadata(p) {
            m.len().hash(&mut h);
            m.modified().ok().hash(&mut h);
        }
    }
    h.finish()
}

// The jail's errors are Linux's here (the macOS jail has its own).
#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn jail_failure(kind: std::io::ErrorKind) -> ProbeError {
        ProbeError::Start {
            what: "the KVM backend",
            source: VmError::Start(VmStartError::Jail {
                program: "sandbox-vm".into(),
                source: sandbox_jail::SpawnError::Prepare {
                    what: "waiting for the jailed process to start".into(),
                    source: std::io::Error::new(kind, "no answer within 10s"),
                },
            }),
        }
    }

    /// A deadline that passed is a loaded host, not a backend that cannot work: not
    /// remembered, so the next start tries again; the jail's own start-up bound too (issue 31's
    /// review: the typed check first missed it, where the old text check had " within ").
    #[test]
    fn a_deadline_that_passed_is_not_remembered() {
        assert!(jail_failure(std::io::ErrorKind::TimedOut).may_pass());
        assert!(!jail_failure(std::io::ErrorKind::PermissionDenied).may_pass());
        assert!(
            ProbeError::BootTimeout {
                what: "the KVM backend",
                limit: Duration::from_secs(20)
            }
            .may_pass()
        );
        assert!(!ProbeError::Emulation.may_pass());
    }
}
