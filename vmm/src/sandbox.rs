//! Booting a sandbox: a VM from any backend plus its connected, ready agent client, and the
//! watchdog that ends a sandbox whose guest stops answering.
//!
//! Every wait on a guest is bounded: boot by the ready timeout, and everything after it (an exec
//! without a timeout, a transfer, any request) by the watchdog, which pings the agent and, when
//! a ping goes unanswered for [`Liveness::timeout`], kills the VM with a reason that names the
//! step and the last console lines. The channel is then closed, and every waiter gets that
//! reason. The watchdog proves that the agent answers, not that each request progresses: a
//! request whose work the guest itself blocks (its own process stopped, say) ends with the run's
//! time limit, which the service enforces.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbox_protocol::client::{Client, ClientError};
use sandbox_protocol::message::Ready;
use thiserror::Error;

use crate::backend::{Backend, Vm, VmError, VmExit, VmSpec, console_suffix};

/// Why a sandbox did not come up.
#[derive(Debug, Error)]
pub enum BootError {
    /// The backend could not start the VM.
    #[error("VM {vm}: {source}")]
    Vm {
        /// The VM's id.
        vm: String,
        /// What the backend said.
        #[source]
        source: VmError,
    },
    /// The VM started but its agent never said it was ready.
    #[error("VM {vm}: the guest agent was not ready within {timeout:?}{}", console_suffix(.console))]
    NotReady {
        /// The VM's id.
        vm: String,
        /// How long it waited.
        timeout: Duration,
        /// The last console lines.
        console: Vec<String>,
    },
    /// A restored guest could not be made a machine of its own (its random generator reseeded,
    /// its clock set): it is not used, since it would share secrets-to-be with its siblings.
    #[error("VM {vm}: the restored guest could not be given its own identity: {why}")]
    Identity {
        /// The VM's id.
        vm: String,
        /// Why.
        why: String,
    },
    /// The agent channel closed during boot.
    #[error("VM {vm}: the guest agent channel closed during boot: {why}{}", console_suffix(.console))]
    ChannelClosed {
        /// The VM's id.
        vm: String,
        /// Why it closed.
        why: String,
        /// The last console lines.
        console: Vec<String>,
    },
}

/// How the host decides that a guest stopped answering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    /// Pause between two pings of the agent.
    pub interval: Duration,
    /// How long a ping may go unanswered before the VM is killed as unresponsive.
    pub timeout: Duration,
}

impl Liveness {
    /// Pings every 5 s; `SANDBOX_HOST_UNRESPONSIVE_MS` (60000) without an answer ends the VM.
    pub fn from_env() -> Result<Liveness, crate::config::SettingError> {
        Ok(Liveness {
            interval: Duration::from_secs(5),
            timeout: crate::config::unresponsive()?,
        })
    }
}

/// A booted sandbox.
pub struct Sandbox {
    /// The VM.
    pub vm: Arc<dyn Vm>,
    /// The agent.
    pub client: Client,
    /// What the agent said when it came up.
    pub ready: Ready,
    /// From asking the backend to start to the agent's `Ready`.
    pub boot_time: Duration,
    watchdog: tokio::task::AbortHandle,
    /// Counts the snapshots' holds of the guest and their ends (odd while one holds it): the
    /// watchdog does not count that time, nor a ping that a hold overlapped.
    snapshotting: Arc<std::sync::atomic::AtomicU64>,
}

impl Sandbox {
    /// Pauses the guest and writes its snapshot ([`Vm::snapshot`]); the watchdog does not count
    /// the time the guest is held. A guest left paused (`resume` false) is never pinged again:
    /// it waits for its stop.
    pub async fn snapshot(&self, resume: bool) -> Result<crate::SnapshotDone, VmError> {
        use std::sync::atomic::Ordering;
        self.not_stopped()?;
        self.snapshotting.fetch_add(1, Ordering::SeqCst);
        let r = self.vm.snapshot(resume).await;
        if resume || r.is_err() {
            self.snapshotting.fetch_add(1, Ordering::SeqCst);
        } else {
            self.watchdog.abort();
        }
        r
    }

    /// Pauses the guest and writes its snapshot to `to`, leaving it paused for
    /// [`Sandbox::resume`] ([`Vm::snapshot_held`]): a fork's copy. The watchdog does not count
    /// the time the guest is held.
    pub async fn snapshot_held(
        &self,
        to: &crate::SnapshotFiles,
    ) -> Result<crate::SnapshotDone, VmError> {
        use std::sync::atomic::Ordering;
        self.not_stopped()?;
        self.snapshotting.fetch_add(1, Ordering::SeqCst);
        self.vm.snapshot_held(to).await
    }

    /// Refuses a snapshot of a guest an earlier one left stopped, before any file is touched
    /// (the next would empty the memory file the last one wrote).
    fn not_stopped(&self) -> Result<(), VmError> {
        if self.snapshotting.load(std::sync::atomic::Ordering::SeqCst) % 2 == 1 {
            return Err(crate::error::VmSnapshotError::Stopped.into());
        }
        Ok(())
    }

    /// Lets a guest held by [`Sandbox::snapshot_held`] run again, and the watchdog count again.
    pub async fn resume(&self) -> Result<(), VmError> {
        use std::sync::atomic::Ordering;
        let r = self.vm.resume().await;
        self.snapshotting.fetch_add(1, Ordering::SeqCst);
        r
    }

    /// A sandbox of `vm` whose agent is ready, watched from now on as `liveness` says.
    pub(crate) fn watched(
        id: String,
        vm: Arc<dyn Vm>,
        client: Client,
        ready: Ready,
        boot_time: Duration,
        liveness: Liveness,
    ) -> Sandbox {
        let snapshotting = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let watchdog = tokio::spawn(watch(
            id,
            vm.clone(),
            client.clone(),
            liveness,
            snapshotting.clone(),
        ));
        Sandbox {
            vm,
            client,
            ready,
            boot_time,
            watchdog: watchdog.abort_handle(),
            snapshotting,
        }
    }

    /// A sandbox with no VM: what a paused sandbox holds when the service takes it on again
    /// after a restart (its VM ended at the pause; a resume starts the next). Its VM has ended
    /// as asked, with `reason`, and its agent channel is closed with it, so a request that
    /// reaches it gets that reason, as it would from any VM that ended.
    pub fn ended(reason: String) -> Sandbox {
        let (ours, theirs) = tokio::io::duplex(64);
        drop(theirs);
        let (read, write) = tokio::io::split(ours);
        let client = Client::new(read, write);
        client.close(reason.clone());
        Sandbox {
            vm: Arc::new(EndedVm(VmExit {
                reason,
                requested: true,
                console: vec![],
            })),
            client,
            ready: Ready {
                version: String::new(),
                protocol: 0,
                channel: String::new(),
                uptime_ms: 0,
            },
            boot_time: Duration::ZERO,
            watchdog: tokio::spawn(async {}).abort_handle(),
            snapshotting: Arc::new(std::sync::atomic::AtomicU64::new(1)),
        }
    }

    /// Stops the VM and removes its files.
    pub async fn stop(&self) -> VmExit {
        // A stop is not a failure: the watchdog must not see the closing channel and kill.
        self.watchdog.abort();
        let exit = self.vm.stop(Duration::from_secs(2)).await;
        // Every waiter learns it now, even if the VM's transport outlived the stop.
        self.client
            .close(format!("the VM was stopped: {}", exit.reason));
        exit
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        self.watchdog.abort();
    }
}

/// Starts a VM and waits until its agent is ready, watched as `SANDBOX_HOST_UNRESPONSIVE_MS`
/// says (the default if the variable is invalid: the service checks it at start). On failure
/// nothing of the VM is left.
pub async fn boot(
    backend: &dyn Backend,
    spec: VmSpec,
    timeout: Duration,
) -> Result<Sandbox, BootError> {
    let liveness = Liveness::from_env().unwrap_or(Liveness {
        interval: Duration::from_secs(5),
        timeout: crate::config::UNRESPONSIVE_DEFAULT,
    });
    boot_watched(backend, spec, timeout, liveness).await
}

/// [`boot`] with an explicit watchdog setting.
pub async fn boot_watched(
    backend: &dyn Backend,
    spec: VmSpec,
    timeout: Duration,
    liveness: Liveness,
) -> Result<Sandbox, BootError> {
    let t0 = Instant::now();
    let id = spec.id.clone();
    // Starting counts against the same bound as becoming ready; the backend applies it itself,
    // so a failure still carries the console.
    let mut spec = spec;
    spec.start_timeout = Some(timeout);
    let restored = spec.restore_from.is_some();
    let started = backend.start(spec).await.map_err(|source| BootError::Vm {
        vm: id.clone(),
        source,
    })?;
    let remaining = timeout.saturating_sub(t0.elapsed());
    let vm: Arc<dyn Vm> = Arc::from(started.vm);
    let (client, joined) = if restored {
        join_restored(started.channel, remaining).await
    } else {
        (
            Client::new(started.channel.read, started.channel.write),
            Ok(()),
        )
    };
    let result = tokio::select! {
        r = async {
            joined?;
            client.wait_ready(remaining).await
        } => r,
        exit = vm.wait() => {
            let e = BootError::Vm {
                vm: id,
                source: VmError::DiedEarly(exit),
            };
            vm.stop(Duration::ZERO).await;
            return Err(e);
        }
    };
    match result {
        Ok(ready) => {
            if restored
                && let Err(why) = set_identity(&client, timeout.saturating_sub(t0.elapsed())).await
            {
                vm.stop(Duration::ZERO).await;
                return Err(BootError::Identity { vm: id, why });
            }
            Ok(Sandbox::watched(
                id,
                vm,
                client,
                ready,
                t0.elapsed(),
                liveness,
            ))
        }
        Err(e) => {
            // The channel usually closes because the VM is ending: let its console finish first.
            let _ = tokio::time::timeout(Duration::from_secs(1), vm.wait()).await;
            let console = diagnostic_lines(vm.as_ref());
            vm.stop(Duration::ZERO).await;
            Err(match e {
                ClientError::Timeout(_) => BootError::NotReady {
                    vm: id,
                    timeout,
                    console,
                },
                other => BootError::ChannelClosed {
                    vm: id,
                    why: other.to_string(),
                    console,
                },
            })
        }
    }
}

/// The client of a restored guest's channel. The guest's agent may still hold the streams of
/// the host its snapshot was taken under (a fork's parent, with an exec under way), and on
/// QEMU the channel may begin with the tail of a frame it was sending then: what comes before
/// the agent's first `Ready` is skipped (its answer to the backend's greeting on QEMU, or the
/// one it sends a new vsock connection on KVM), a second ping's `Ready` is what the client
/// waits for, and its streams are numbered from far above the old host's.
async fn join_restored(
    channel: crate::backend::Channel,
    within: Duration,
) -> (Client, Result<(), ClientError>) {
    let (mut read, mut write) = (channel.read, channel.write);
    let ping = sandbox_protocol::Frame::new(sandbox_protocol::Kind::Ping, 0, Vec::new()).encode();
    let joined = async {
        let rest = tokio::time::timeout(within, crate::adopt::skip_to_ready(&mut read))
            .await
            .map_err(|_| ClientError::Timeout(within))?
            .map_err(|e| ClientError::Closed(e.to_string()))?;
        tokio::io::AsyncWriteExt::write_all(&mut write, &ping)
            .await
            .map_err(|e| ClientError::Closed(format!("greeting the restored agent: {e}")))?;
        Ok::<_, ClientError>(rest)
    }
    .await;
    match joined {
        Ok(rest) => {
            let read = tokio::io::AsyncReadExt::chain(std::io::Cursor::new(rest), read);
            (
                Client::numbered_from(Box::new(read), write, crate::adopt::first_stream()),
                Ok(()),
            )
        }
        Err(e) => (Client::new(read, write), Err(e)),
    }
}

/// Gives a guest restored from a snapshot its own random state and the host's time, before
/// anything else runs in it: every guest restored from the same snapshot starts with the same
/// kernel random generator, and the clock the snapshot was taken at.
async fn set_identity(client: &Client, within: Duration) -> Result<(), String> {
    let mut entropy = [0u8; 64];
    getrandom(&mut entropy).map_err(|e| format!("the host's random bytes: {e}"))?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| format!("the host's clock: {e}"))?;
    match tokio::time::timeout(within, client.set_identity(&entropy, now.as_nanos() as u64)).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("the guest agent did not answer within {within:?}")),
    }
}

/// Fills `buf` from the host kernel's generator (the same device on Linux and macOS).
fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

/// Pings the agent until the VM ends; kills the VM when a ping goes unanswered for
/// `liveness.timeout` or the channel closes while the VM runs on.
async fn watch(
    id: String,
    vm: Arc<dyn Vm>,
    client: Client,
    liveness: Liveness,
    snapshotting: Arc<std::sync::atomic::AtomicU64>,
) {
    use std::sync::atomic::Ordering;
    let reason = loop {
        tokio::select! {
            _ = vm.wait() => return,
            _ = tokio::time::sleep(liveness.interval) => {}
        }
        let holds = snapshotting.load(Ordering::SeqCst);
        if holds % 2 == 1 {
            continue;
        }
        let pinged = tokio::select! {
            _ = vm.wait() => return,
            r = tokio::time::timeout(liveness.timeout, client.ping()) => r,
        };
        // A snapshot that began (or came and went) while the ping waited held the guest: not
        // its fault.
        if snapshotting.load(Ordering::SeqCst) != holds {
            continue;
        }
        match pinged {
            // An agent that answers anything is alive.
            Ok(Ok(_) | Err(ClientError::Agent(_) | ClientError::Unexpected(_))) => {}
            Ok(Err(ClientError::Timeout(_))) => {}
            Ok(Err(ClientError::Closed(why))) => {
                // Usually the VM is ending (a reboot, a crash): give it a moment to say so.
                if tokio::time::timeout(Duration::from_secs(2), vm.wait())
                    .await
                    .is_ok()
                {
                    return;
                }
                break format!("the guest agent's channel closed while the VM ran on ({why})");
            }
            Err(_) => {
                let vcpus = vm.diagnostics().await;
                break format!(
                    "the guest stopped answering: its agent did not reply to a ping within {:?}{}",
                    liveness.timeout,
                    if vcpus.is_empty() {
                        String::new()
                    } else {
                        format!(" ({vcpus})")
                    }
                );
            }
        }
    };
    // The exit carries the console lines; the reason stays one line.
    tracing::warn!(
        vm = %id,
        reason = %reason,
        console = %diagnostic_lines(vm.as_ref()).join(" | "),
        "Killing an unresponsive VM"
    );
    let exit = vm.kill(reason).await;
    client.close(exit.reason);
}

/// The console lines that explain a failed boot: the first kernel panic, BUG, oops, warning, fault,
/// stall or OOM lines of the recent console (they scroll away behind a call trace), then the last.
pub fn diagnostic_lines(vm: &dyn Vm) -> Vec<String> {
    const MARKERS: [&str; 11] = [
        "Kernel panic",
        "BUG:",
        "Oops",
        "Out of memory",
        "general protection fault",
        "WARNING:",
        "RIP:",
        "Unable to handle",
        "invalid opcode",
        "segfault",
        "stall",
    ];
    let recent = vm.console_tail(400);
    let mut lines: Vec<String> = recent
        .iter()
        .filter(|l| MARKERS.iter().any(|m| l.contains(m)))
        .take(4)
        .cloned()
        .collect();
    lines.extend(recent.iter().rev().take(8).rev().cloned());
    lines
}

/// The VM of [`Sandbox::ended`]: it ended before this service knew it, and has nothing left.
struct EndedVm(VmExit);

#[async_trait::async_trait]
impl Vm for EndedVm {
    fn exit(&self) -> Option<VmExit> {
        Some(self.0.clone())
    }
    async fn wait(&self) -> VmExit {
        self.0.clone()
    }
    async fn stop(&self, _grace: Duration) -> VmExit {
        self.0.clone()
    }
    async fn kill(&self, _reason: String) -> VmExit {
        self.0.clone()
    }
    fn console_tail(&self, _n: usize) -> Vec<String> {
        vec![]
    }
    fn pid(&self) -> Option<u32> {
        None
    }
}
