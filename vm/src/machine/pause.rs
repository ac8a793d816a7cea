//! Pausing a running machine, reading its state and writing its snapshot, and resuming it.

use super::*;

impl Machine {
    /// Stops every vCPU and the device thread where they are, each vCPU's last exit completed
    /// and its state read; the guest does not run until [`Machine::resume`]. Bounded by
    /// [`STOP_TIMEOUT`]: a thread that does not park in time resumes the others and fails it.
    pub fn pause(&self) -> Result<Duration, snapshot::SnapshotError> {
        let t0 = Instant::now();
        let parts = self.parts()?;
        let n = parts.vcpu_threads.len();
        {
            let mut p = lock(&self.shared.pause);
            if self.shared.pausing.load(Ordering::SeqCst) {
                return Err(snapshot::SnapshotError::State(
                    "the machine is already paused".into(),
                ));
            }
            p.epoch += 1;
            p.stopped = vec![false; n];
            p.saved = (0..n).map(|_| None).collect();
            p.save = false;
            p.device_parked = false;
            self.shared.pausing.store(true, Ordering::SeqCst);
        }
        let _ = parts.device_kick.write(1);
        let deadline = t0 + STOP_TIMEOUT;
        let fail = |what: String| {
            self.resume();
            Err(snapshot::SnapshotError::State(what))
        };
        // First every thread out of the guest; then the vCPUs read their state.
        loop {
            {
                // Under the exit lock: no thread of the machine has been joined while it is
                // unset, so every pthread id is still valid to signal.
                let exit = lock(&self.shared.exit);
                if let Some(e) = exit.as_ref() {
                    let reason = e.reason.clone();
                    drop(exit);
                    return fail(format!("the machine ended: {reason}"));
                }
                let mut p = lock(&self.shared.pause);
                let stopped = p.device_parked && p.stopped.iter().all(|s| *s);
                if stopped && !p.save {
                    p.save = true;
                    self.shared.pause_cv.notify_all();
                }
                if p.save && p.saved.iter().all(Option::is_some) {
                    return Ok(t0.elapsed());
                }
                if !stopped {
                    for (i, t) in parts.vcpu_threads.iter().enumerate() {
                        if !p.stopped[i] {
                            kick(*t);
                        }
                    }
                }
            }
            if Instant::now() >= deadline {
                let report = self.shared.vcpu_report();
                return fail(format!(
                    "the machine's threads did not stop within {STOP_TIMEOUT:?} ({report})"
                ));
            }
            let p = lock(&self.shared.pause);
            let _ = self.shared.pause_cv.wait_timeout(p, KICK_FAST);
        }
    }

    /// Lets a paused machine run again; one that runs is left as it is.
    pub fn resume(&self) {
        let mut p = lock(&self.shared.pause);
        if !self.shared.pausing.load(Ordering::SeqCst) {
            return;
        }
        self.shared.pausing.store(false, Ordering::SeqCst);
        p.epoch += 1;
        p.stopped.clear();
        p.saved.clear();
        p.save = false;
        p.device_parked = false;
        self.shared.pause_cv.notify_all();
    }

    /// Writes the state of a paused machine to `state` (a pipe to the service, or a file the
    /// caller emptied) and its memory into `memory` (sized by the caller with
    /// [`snapshot::size_memory_file`]; never a file a machine is mapped from). The machine stays
    /// paused.
    pub fn snapshot(
        &self,
        state: &mut dyn std::io::Write,
        memory: &std::fs::File,
    ) -> Result<u64, snapshot::SnapshotError> {
        let parts = self.parts()?;
        let vcpus = {
            let mut p = lock(&self.shared.pause);
            if !self.shared.pausing.load(Ordering::SeqCst)
                || !p.device_parked
                || !p.save
                || p.saved.is_empty()
                || p.saved.iter().any(Option::is_none)
            {
                return Err(snapshot::SnapshotError::State(
                    "the machine must be paused for a snapshot".into(),
                ));
            }
            // Taken: one snapshot per pause (a second one of the same pause is refused above).
            let taken: Vec<_> = p.saved.iter_mut().map(Option::take).collect();
            taken
                .into_iter()
                .enumerate()
                .map(|(i, s)| match s {
                    Some(Ok(s)) => Ok(s),
                    Some(Err(e)) => Err(snapshot::SnapshotError::State(format!(
                        "reading vCPU {i}'s state: {e}"
                    ))),
                    None => Err(snapshot::SnapshotError::State(format!(
                        "vCPU {i} is not paused"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        let devices = parts
            .bus
            .iter()
            .map(|(_, d)| d.lock().unwrap_or_else(|e| e.into_inner()).save())
            .collect();
        let serial = snapshot::SerialSnapshot::of(
            &parts
                .console
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .state(),
        );
        let machine = snapshot::MachineState {
            format: snapshot::FORMAT,
            host: parts.host.clone(),
            memory_mib: parts.memory_mib,
            vcpus,
            vm: snapshot::save_vm(&parts.vm)?,
            serial,
            devices,
        };
        let bytes = machine.encode()?;
        let written = snapshot::write_memory(&parts.mem, memory)?;
        state
            .write_all(&bytes)
            .and_then(|()| state.flush())
            .map_err(|source| snapshot::SnapshotError::Io {
                context: "writing the state".into(),
                source,
            })?;
        Ok(written)
    }

    /// Pauses, writes the snapshot, and lets the guest run again if `resume` or if the
    /// snapshot failed (a failed pause has already resumed it).
    pub fn pause_and_snapshot(
        &self,
        state: &mut dyn std::io::Write,
        memory: &std::fs::File,
        resume: bool,
    ) -> Result<sandbox_control::vm::SnapshotDone, snapshot::SnapshotError> {
        let pause = self.pause()?;
        let t = Instant::now();
        let written = self.snapshot(state, memory);
        let write = t.elapsed();
        if resume || written.is_err() {
            self.resume();
        }
        Ok(sandbox_control::vm::SnapshotDone {
            memory_written: written?,
            pause_us: pause.as_micros() as u64,
            write_us: write.as_micros() as u64,
        })
    }

    fn parts(&self) -> Result<&Parts, snapshot::SnapshotError> {
        self.parts
            .as_ref()
            .ok_or_else(|| snapshot::SnapshotError::State("this machine cannot be paused".into()))
    }
}
