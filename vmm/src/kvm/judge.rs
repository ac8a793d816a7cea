//! How a VM process ended, as the service records it: the kernel's word (the OOM killer, the
//! seccomp trap) over the service's own kill, over what the process reported, which a guest that
//! took it over writes.

use std::time::Duration;

use async_trait::async_trait;
use std::sync::Arc;

use super::control::{Control, told};
use crate::backend::VmExit;
use crate::supervised::{Classify, Ending};

/// How a VM process ended: [`judge`] over the kernel's word, the service's and the process's
/// own last report, read from its control socket once it is gone.
pub(super) struct ProcessEnd {
    pub(super) control: Arc<Control>,
    /// Resolves when the control reader has read all the process said.
    pub(super) reader_done: Option<tokio::sync::oneshot::Receiver<()>>,
}

#[async_trait]
impl Classify for ProcessEnd {
    async fn reaped(&mut self) {
        // The process is gone. Shut the socket down: a descriptor of its own end that it
        // passed back (SCM_RIGHTS) must not keep the reader, and what it queued, alive.
        let _ = self
            .control
            .writer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .shutdown(std::net::Shutdown::Both);
        // The reader reaches the end of what it said (bounded anyway).
        if let Some(done) = self.reader_done.take() {
            let _ = tokio::time::timeout(Duration::from_secs(2), done).await;
        }
    }

    fn classify(self: Box<Self>, mut e: Ending) -> VmExit {
        let reported = self
            .control
            .learned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .exit
            .take();
        e.console = e.console.into_iter().map(told).collect();
        judge(e, reported)
    }
}

/// Why a VM ended: the kernel's word first (the OOM killer, the seccomp trap's status or
/// signal), then the service's own kill, then another signal, and only then what the VM process
/// reported, whose `requested` counts only if the service asked. A report the kernel
/// contradicts is logged.
/// `reported` is what the VM process said of its end (its word, which a guest that took it over
/// writes).
fn judge(e: Ending, reported: Option<VmExit>) -> VmExit {
    let console = e.console;
    let from_kernel = |reason: String| {
        if let Some(r) = &reported {
            tracing::warn!(
                reported = %r.reason,
                reported_requested = r.requested,
                kernel = %reason,
                "a VM process reported an end the kernel contradicts: the kernel's is recorded"
            );
        }
        VmExit {
            reason,
            requested: false,
            console: console.clone(),
        }
    };
    if e.status.oom_kills > 0 {
        return from_kernel(format!(
            "out of memory: the VM's process used more than its limit of {} MiB (the guest's \
             memory and the VMM's allowance, SANDBOX_HOST_VMM_ALLOWANCE_MIB) and the kernel \
             killed it",
            e.memory_mib
        ));
    }
    let trapped = e.status.code() == Some(sandbox_control::vm::SIGSYS_EXIT)
        || e.status.signal() == Some(libc::SIGSYS);
    if trapped {
        return from_kernel(
            "a thread of the VM process made a system call outside its seccomp filter \
             (the console's last lines name the call): a bug of sandbox-vm, or a guest \
             that took over a VMM thread"
                .into(),
        );
    }
    // The service's own kill, once the kernel has no cause of its own to give (a process that
    // died of its filter or of memory just before the kill is recorded as what it died of).
    if let Some(reason) = e.killed {
        return VmExit {
            reason,
            requested: false,
            console,
        };
    }
    match e.status.signal() {
        Some(_) if e.requested => {
            return VmExit {
                reason: "stopped by the host".into(),
                requested: true,
                console,
            };
        }
        Some(sig) => return from_kernel(format!("the VM process was killed by signal {sig}")),
        None => {}
    }
    if let Some(mut r) = reported {
        r.requested &= e.requested;
        if r.console.is_empty() {
            r.console = console;
        }
        return r;
    }
    VmExit {
        reason: match e.status.code() {
            Some(code) => format!("the VM process exited with status {code}"),
            None => "the VM process ended".into(),
        },
        requested: e.requested,
        console,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(code: Option<i32>, signal: Option<i32>, oom_kills: u64) -> sandbox_jail::Exit {
        let status = match (code, signal) {
            (Some(c), _) => c << 8,
            (_, Some(s)) => s,
            _ => 0,
        };
        sandbox_jail::Exit {
            status,
            oom_kills,
            known: true,
        }
    }

    fn lie() -> Option<VmExit> {
        Some(VmExit {
            reason: "stopped by the host as it asked".into(),
            requested: true,
            console: vec!["a line".into()],
        })
    }

    fn ending(status: sandbox_jail::Exit, requested: bool) -> Ending {
        Ending {
            status,
            killed: None,
            requested,
            memory_mib: 576,
            console: vec![],
        }
    }

    /// [`super::judge`] of an ending the VM process reported as a requested stop (a lie unless
    /// the service asked), with `console`.
    fn judge(e: Ending, console: Vec<String>, _pid: u32) -> VmExit {
        super::judge(Ending { console, ..e }, lie())
    }

    #[test]
    fn the_kernels_word_wins_over_the_vms() {
        // The seccomp trap's status, its signal, the OOM killer and a signal all beat a report.
        for (status, says) in [
            (
                exit(Some(sandbox_control::vm::SIGSYS_EXIT), None, 0),
                "seccomp filter",
            ),
            (exit(None, Some(libc::SIGSYS), 0), "seccomp filter"),
            (exit(Some(0), None, 1), "out of memory"),
            (exit(None, Some(libc::SIGSEGV), 0), "killed by signal 11"),
        ] {
            let e = judge(ending(status, false), vec![], 1);
            assert!(e.reason.contains(says), "{status:?}: {}", e.reason);
            assert!(!e.requested, "{status:?}");
        }
        // Even when the service had asked for a stop: a trap is a trap.
        let e = judge(
            ending(exit(Some(sandbox_control::vm::SIGSYS_EXIT), None, 0), true),
            vec![],
            1,
        );
        assert!(e.reason.contains("seccomp") && !e.requested);
    }

    #[test]
    fn requested_only_when_the_service_asked() {
        let e = judge(ending(exit(Some(0), None, 0), false), vec![], 1);
        assert!(!e.requested, "the VM's word alone");
        assert_eq!(e.reason, "stopped by the host as it asked");
        let e = judge(ending(exit(Some(0), None, 0), true), vec![], 1);
        assert!(e.requested);
        let e = judge(
            Ending {
                killed: Some("the guest stopped answering".into()),
                ..ending(exit(None, Some(libc::SIGKILL), 0), true)
            },
            vec![],
            1,
        );
        assert_eq!(
            (e.reason.as_str(), e.requested),
            ("the guest stopped answering", false)
        );
        // Dead of its filter just before the service's kill: the filter is the cause.
        let e = judge(
            Ending {
                killed: Some("the guest stopped answering".into()),
                ..ending(exit(Some(sandbox_control::vm::SIGSYS_EXIT), None, 0), false)
            },
            vec![],
            1,
        );
        assert!(e.reason.contains("seccomp filter"), "{}", e.reason);
    }
}
