//! Booting a sandbox: a VM from any backend plus its connected, ready agent client.

use std::time::{Duration, Instant};

use sandbox_protocol::client::{Client, ClientError};
use sandbox_protocol::message::Ready;
use thiserror::Error;

use crate::backend::{Backend, Vm, VmError, VmExit, VmSpec, console_suffix};

/// Why a sandbox did not come up.
#[derive(Debug, Error)]
pub enum BootError {
    /// The backend could not start the VM.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// The VM started but its agent never said it was ready.
    #[error("the guest agent was not ready within {timeout:?}{}", console_suffix(.console))]
    NotReady {
        /// How long it waited.
        timeout: Duration,
        /// The last console lines.
        console: Vec<String>,
    },
    /// The agent channel closed during boot.
    #[error("the guest agent channel closed during boot: {why}{}", console_suffix(.console))]
    ChannelClosed {
        /// Why it closed.
        why: String,
        /// The last console lines.
        console: Vec<String>,
    },
}

/// A booted sandbox.
pub struct Sandbox {
    /// The VM.
    pub vm: Box<dyn Vm>,
    /// The agent.
    pub client: Client,
    /// What the agent said when it came up.
    pub ready: Ready,
    /// From asking the backend to start to the agent's `Ready`.
    pub boot_time: Duration,
}

impl Sandbox {
    /// Stops the VM and removes its files.
    pub async fn stop(&self) -> VmExit {
        self.vm.stop(Duration::from_secs(2)).await
    }
}

/// Starts a VM and waits until its agent is ready. On failure nothing of the VM is left.
pub async fn boot(
    backend: &dyn Backend,
    spec: VmSpec,
    timeout: Duration,
) -> Result<Sandbox, BootError> {
    let t0 = Instant::now();
    let started = backend.start(spec).await?;
    let vm = started.vm;
    let client = Client::new(started.channel.read, started.channel.write);
    let result = tokio::select! {
        r = client.wait_ready(timeout) => r,
        exit = vm.wait() => {
            let e = BootError::Vm(VmError::DiedEarly(exit));
            vm.stop(Duration::ZERO).await;
            return Err(e);
        }
    };
    match result {
        Ok(ready) => Ok(Sandbox {
            vm,
            client,
            ready,
            boot_time: t0.elapsed(),
        }),
        Err(e) => {
            // The channel usually closes because the VM is ending: let its console finish first.
            let _ = tokio::time::timeout(Duration::from_secs(1), vm.wait()).await;
            let console = diagnostic_lines(vm.as_ref());
            vm.stop(Duration::ZERO).await;
            Err(match e {
                ClientError::Timeout(_) => BootError::NotReady { timeout, console },
                other => BootError::ChannelClosed {
                    why: other.to_string(),
                    console,
                },
            })
        }
    }
}

/// The console lines that explain a failed boot: any kernel panic, BUG, oops or OOM line from the
/// recent console (these scroll away behind a call trace), then the last lines.
pub fn diagnostic_lines(vm: &dyn Vm) -> Vec<String> {
    const MARKERS: [&str; 5] = [
        "Kernel panic",
        "BUG:",
        "Oops",
        "Out of memory",
        "general protection fault",
    ];
    let recent = vm.console_tail(400);
    let mut lines: Vec<String> = recent
        .iter()
        .filter(|l| MARKERS.iter().any(|m| l.contains(m)))
        .take(3)
        .cloned()
        .collect();
    lines.extend(recent.iter().rev().take(8).rev().cloned());
    lines
}
