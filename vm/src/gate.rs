//! The start gate of a machine: its vCPUs wait at it, sealed, until every other thread of the
//! VM process has its own filter, so no guest instruction runs while any thread of the process
//! is unfiltered (issue 30). A thread that cannot seal shuts it, and the vCPUs end without
//! entering the guest.

use std::sync::{Condvar, Mutex};

/// Opens when each of its parties has passed; shut for good when the machine ends first.
pub(crate) struct Gate {
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    /// Parties that have not passed yet.
    waiting_for: u32,
    shut: bool,
}

impl Gate {
    /// A gate that opens once `parties` have passed.
    pub(crate) fn new(parties: u32) -> Gate {
        Gate {
            state: Mutex::new(State {
                waiting_for: parties,
                shut: false,
            }),
            changed: Condvar::new(),
        }
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.state.lock().unwrap_or_else(|e| e.into_inner()));
        self.changed.notify_all();
    }

    /// One party is ready (its thread sealed).
    pub(crate) fn pass(&self) {
        self.update(|s| s.waiting_for = s.waiting_for.saturating_sub(1));
    }

    /// The machine ends before (or after) the gate opened: waiting vCPUs return.
    pub(crate) fn shut(&self) {
        self.update(|s| s.shut = true);
    }

    /// Waits until the gate opens (true) or is shut (false).
    pub(crate) fn wait(&self) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if s.shut {
                return false;
            }
            if s.waiting_for == 0 {
                return true;
            }
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn opens_only_when_every_party_passed() {
        let gate = Arc::new(Gate::new(2));
        let waiter = {
            let g = gate.clone();
            std::thread::spawn(move || g.wait())
        };
        gate.pass();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished(), "opened with a party still unsealed");
        gate.pass();
        assert!(waiter.join().unwrap());
    }

    #[test]
    fn a_shut_gate_never_lets_a_vcpu_in() {
        let gate = Arc::new(Gate::new(1));
        let waiter = {
            let g = gate.clone();
            std::thread::spawn(move || g.wait())
        };
        gate.shut();
        assert!(!waiter.join().unwrap());
        gate.pass();
        assert!(!gate.wait(), "shut is for good");
    }
}
