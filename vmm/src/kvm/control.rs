//! The VM process's control socket, service side: what the reader learned from the process's
//! events (parsed like guest data, every string bounded and made printable before it is kept),
//! and the requests the service sends.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::backend::VmExit;
use crate::supervised::EXIT_CONSOLE_LINES;
use sandbox_control::vm::{self as control, Event, Request};

/// What the control reader learned.
#[derive(Default)]
pub(super) struct Learned {
    pub(super) started: Option<Result<(), String>>,
    pub(super) connected: Option<Result<OwnedFd, String>>,
    pub(super) diagnostics: Option<String>,
    pub(super) snapshot: Option<(u64, Result<crate::backend::SnapshotDone, String>)>,
    pub(super) exit: Option<VmExit>,
}

pub(super) struct Control {
    /// When `start` began, and how long until the machine ran its first instruction.
    pub(super) t0: Instant,
    pub(super) vmm_start: OnceLock<Duration>,
    pub(super) learned: Mutex<Learned>,
    pub(super) changed: tokio::sync::Notify,
    pub(super) marker: OnceLock<Duration>,
    pub(super) writer: Mutex<UnixStream>,
}

impl Control {
    /// The control of a VM process whose requests go to `writer`, started (or taken on) at `t0`.
    pub(super) fn new(t0: Instant, writer: UnixStream) -> Control {
        Control {
            t0,
            vmm_start: OnceLock::new(),
            learned: Mutex::new(Learned::default()),
            changed: tokio::sync::Notify::new(),
            marker: OnceLock::new(),
            writer: Mutex::new(writer),
        }
    }

    pub(super) fn ask(&self, r: &Request) -> bool {
        let w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        control::send(&w, r, None).is_ok()
    }

    pub(super) fn update(&self, f: impl FnOnce(&mut Learned)) {
        f(&mut self.learned.lock().unwrap_or_else(|e| e.into_inner()));
        self.changed.notify_waiters();
    }

    /// Waits until `f` finds something, the process ends, or `within` passes.
    pub(super) async fn wait_for<T>(
        &self,
        within: Duration,
        exit: &watch::Receiver<Option<VmExit>>,
        mut f: impl FnMut(&mut Learned) -> Option<T>,
    ) -> Result<T, Option<VmExit>> {
        let deadline = tokio::time::Instant::now() + within;
        let mut exit = exit.clone();
        loop {
            let notified = self.changed.notified();
            if let Some(t) = f(&mut self.learned.lock().unwrap_or_else(|e| e.into_inner())) {
                return Ok(t);
            }
            if let Some(e) = exit.borrow().clone() {
                return Err(Some(e));
            }
            tokio::select! {
                _ = notified => {}
                _ = exit.changed() => {}
                _ = tokio::time::sleep_until(deadline) => return Err(None),
            }
        }
    }
}

/// The control reader: the VM process's events, until it closes the socket. What it says is
/// bounded and parsed like guest data; a malformed line ends the reading (the VM is then judged
/// by how its process ends).
pub(super) fn read_events(sock: &UnixStream, control: &Control, spawned: Instant) {
    read_events_from(control::Reader::new(sock), control, spawned)
}

/// [`read_events`] from a reader already made (an adopted process's, which read its answer).
pub(super) fn read_events_from(mut reader: control::Reader, control: &Control, spawned: Instant) {
    loop {
        let event = match reader.read::<Event>() {
            Ok(Some(e)) => e,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(
                    "a VM process sent a bad control message: {}",
                    told(e.to_string())
                );
                return;
            }
        };
        match event {
            Event::Started => {
                let _ = control.vmm_start.set(control.t0.elapsed());
                control.update(|l| l.started = Some(Ok(())))
            }
            Event::Error(why) => control.update(|l| l.started = Some(Err(told(why)))),
            Event::Marker => {
                let _ = control.marker.set(spawned.elapsed());
            }
            Event::Connected => {
                let fd = reader.take_fd();
                control.update(|l| {
                    l.connected =
                        Some(fd.ok_or_else(|| "no descriptor came with the connection".to_string()))
                });
            }
            Event::ConnectFailed(why) => control.update(|l| l.connected = Some(Err(told(why)))),
            Event::Diagnostics(d) => {
                control.update(|l| l.diagnostics = Some(told_within(d, DIAGNOSTICS_CHARS)))
            }
            Event::Snapshot { id, result } => {
                control.update(|l| l.snapshot = Some((id, result.map_err(told))))
            }
            // Only ever the answer to an adoption, which its adopter reads.
            Event::Adopted { .. } => {
                tracing::warn!("a VM process sent an adoption's answer unasked");
                return;
            }
            Event::Exit {
                reason,
                requested,
                console,
            } => control.update(|l| {
                l.exit = Some(VmExit {
                    reason: told(reason),
                    requested,
                    console: console
                        .into_iter()
                        .take(EXIT_CONSOLE_LINES)
                        .map(told)
                        .collect(),
                })
            }),
        }
    }
}

/// A string the VM process sent, made fit for a log line and an API answer: at most
/// [`TOLD_CHARS`] characters, control characters (escape sequences, line breaks) and the
/// invisible ones that reorder or hide text (bidirectional overrides, zero-width) replaced.
pub(super) fn told(s: String) -> String {
    told_within(s, TOLD_CHARS)
}

fn told_within(s: String, max: usize) -> String {
    let hidden = |c: char| {
        c.is_control()
            || matches!(c, '\u{00ad}' | '\u{061c}' | '\u{200b}'..='\u{200f}'
                | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}')
    };
    if s.len() <= max && !s.chars().any(hidden) {
        return s;
    }
    let mut out: String = s
        .chars()
        .take(max)
        .map(|c| if hidden(c) { '\u{fffd}' } else { c })
        .collect();
    if s.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}

/// The most characters of one string the VM process sends that the service keeps.
const TOLD_CHARS: usize = 1024;
/// Diagnostics name every vCPU (about 60 characters each): room for 254.
const DIAGNOSTICS_CHARS: usize = 16 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_vm_process_says_is_bounded_and_printable() {
        let s = told("reason\x1b[2J\nforged log line\r".into());
        assert_eq!(s, "reason\u{fffd}[2J\u{fffd}forged log line\u{fffd}");
        let s = told("ok \u{202e}gnp.exe".into());
        assert_eq!(s, "ok \u{fffd}gnp.exe", "a bidirectional override");
        let s = told("é".repeat(10_000));
        assert_eq!(s.chars().count(), TOLD_CHARS + 1);
        assert!(s.ends_with('…'));
        assert_eq!(told("plain".into()), "plain");
    }
}
