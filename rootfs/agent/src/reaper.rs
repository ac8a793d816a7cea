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
    /// Spawns under way: a child that exits before its spawn has returned may be that spawn's
    /// (its exec failed: the standard library reaps it itself), so it is left alone until then.
    spawning: u32,
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

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Spawns `cmd` and returns the child with a receiver for its status. The reaper leaves
    /// every child that exits meanwhile alone until the pid is registered (or the spawn
    /// failed): a failed exec's child is reaped by the standard library's own `waitpid`, which
    /// would fail, and panic, had the reaper taken it first.
    pub(crate) fn spawn(&self, cmd: &mut Command) -> io::Result<(Child, Receiver<Status>)> {
        self.lock().spawning += 1;
        let spawned = cmd.spawn();
        let mut state = self.lock();
        state.spawning -= 1;
        state.spawns += 1;
        let r = spawned.map(|child| {
            let (tx, rx) = sync_channel(1);
            state.waiters.insert(child.id() as i32, tx);
            (child, rx)
        });
        self.inner.spawned.notify_all();
        r
    }

    fn run(&self) {
        loop {
            let seen = self.lock().spawns;
            // Which child exited, without reaping it yet.
            // SAFETY: siginfo_t is plain data; waitid fills it.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: `info` is a valid out-pointer for the duration of the call.
            let r =
                unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
            if r == 0 {
                // SAFETY: waitid succeeded with WEXITED, so the child fields of `info` are set.
                let pid = unsafe { info.si_pid() };
                self.reap(pid);
                continue;
            }
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) => {}
                // No children: sleep until a spawn (or a second passes, for adopted orphans).
                _ => {
                    let state = self.lock();
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

    /// Reaps `pid` (which has exited) once no spawn under way may own it, and hands its status
    /// to whoever spawned it; an orphan's is dropped.
    fn reap(&self, pid: i32) {
        let mut state = self.lock();
        while state.spawning > 0 && !state.waiters.contains_key(&pid) {
            state = self
                .inner
                .spawned
                .wait_timeout(state, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let mut raw = 0;
        // SAFETY: `raw` is a valid out-pointer for the duration of the call.
        let got = unsafe { libc::waitpid(pid, &mut raw, libc::WNOHANG) };
        // Not ours to reap any more (a failed spawn's child, reaped by its spawn): nothing to do.
        if got != pid {
            return;
        }
        let status = if libc::WIFSIGNALED(raw) {
            Status::Signaled(libc::WTERMSIG(raw))
        } else {
            Status::Exited(libc::WEXITSTATUS(raw))
        };
        if let Some(tx) = state.waiters.remove(&pid) {
            let _ = tx.send(status);
        }
    }
}

/// The test binary's one reaper: two would take each other's children.
#[cfg(test)]
pub(crate) fn for_tests() -> &'static Reaper {
    static REAPER: std::sync::OnceLock<Reaper> = std::sync::OnceLock::new();
    REAPER.get_or_init(Reaper::start)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reaper() -> &'static Reaper {
        for_tests()
    }

    /// A program that cannot be started, while another child runs (the reaper waiting on it,
    /// as with a dev server a run left in the background): each spawn fails with its error
    /// (before, the reaper could take the failed child from the standard library's own
    /// `waitpid`, whose assertion then panicked the spawning thread, and the exec never
    /// answered), and the running child's status still arrives.
    #[test]
    fn a_failed_spawn_beside_a_running_child_fails_cleanly() {
        let (_child, status) = reaper()
            .spawn(Command::new("sleep").arg("1"))
            .expect("sleep starts");
        for _ in 0..200 {
            // Found in PATH as the agent's execs are (a PATH of its own: the standard library
            // forks and execs itself then, and reaps a failed child with its own `waitpid`).
            let mut cmd = Command::new("no-such-program");
            cmd.env_clear().env("PATH", "/usr/bin:/bin");
            // Forces the standard library's own fork and exec (as a terminal's setsid does).
            // SAFETY: the closure makes no call at all.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, || Ok(()));
            }
            let e = reaper()
                .spawn(&mut cmd)
                .expect_err("a missing program does not start");
            assert_eq!(e.kind(), io::ErrorKind::NotFound);
        }
        assert_eq!(
            status.recv_timeout(Duration::from_secs(10)),
            Ok(Status::Exited(0))
        );
    }
}
