//! Reaping children as PID 1.
//!
//! As init, the agent inherits every orphan in the guest, so it must `waitpid(-1)`; a per-child
//! `wait` would race with that. One thread reaps everything and hands each status to whoever
//! spawned that pid; statuses of orphans are dropped.

use std::collections::HashMap;
use std::io;
use std::process::{Child, Command};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Exited(i32),
    Signaled(i32),
}

/// The one reaper of the process: a thread in `waitpid(-1)` that hands each child's status to
/// whoever spawned it through [`Reaper::spawn`]. Cloning it is cheap.
#[derive(Clone)]
pub struct Reaper {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    spawned: Condvar,
}

#[derive(Default)]
struct State {
    waiters: HashMap<i32, SyncSender<Status>>,
    /// Spawns so far, so the reaper can tell whether one happened since it last found no child.
    spawns: u64,
}

impl Reaper {
    /// Starts the reaper thread; once per process, since it reaps every child.
    pub fn start() -> Reaper {
        let inner = Arc::new(Inner {
            state: Mutex::new(State::default()),
            spawned: Condvar::new(),
        });
        let r = Reaper { inner };
        let r2 = r.clone();
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || r2.run())
            .expect("spawning the reaper thread at start-up");
        r
    }

    /// Spawns `cmd` and returns the child with a receiver for its status. The pid is registered
    /// before the reaper can see it exit, because the reaper needs the same lock to dispatch.
    pub(crate) fn spawn(&self, cmd: &mut Command) -> io::Result<(Child, Receiver<Status>)> {
        let mut state = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        let child = cmd.spawn()?;
        let (tx, rx) = sync_channel(1);
        state.waiters.insert(child.id() as i32, tx);
        state.spawns += 1;
        self.inner.spawned.notify_all();
        Ok((child, rx))
    }

    fn run(&self) {
        loop {
            let seen = self
                .inner
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .spawns;
            let mut raw = 0;
            // SAFETY: `raw` is a valid out-pointer for the duration of the call.
            let pid = unsafe { libc::waitpid(-1, &mut raw, 0) };
            if pid > 0 {
                let status = if libc::WIFSIGNALED(raw) {
                    Status::Signaled(libc::WTERMSIG(raw))
                } else {
                    Status::Exited(libc::WEXITSTATUS(raw))
                };
                let mut state = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(tx) = state.waiters.remove(&pid) {
                    let _ = tx.send(status);
                }
                continue;
            }
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) => {}
                // No children: sleep until a spawn (or a second passes, for adopted orphans).
                _ => {
                    let state = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
                    if state.spawns == seen {
                        let _ = self
                            .inner
                            .spawned
                            .wait_timeout(state, Duration::from_secs(1));
                    }
                }
            }
        }
    }
}
