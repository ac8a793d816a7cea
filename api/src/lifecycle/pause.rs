//! Pausing and resuming a sandbox (issue 15, on a backend that can pause: KVM): the guest
//! written to its snapshot files and its VM process ended, so its memory goes back to the host;
//! later a new VM restored from the snapshot with the same disk, network process and counters.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::error::ApiError;
use crate::registry::{self, SandboxEntry};
use crate::state::AppState;

use super::BOOT_TIMEOUT;

/// How a pause ended well.
pub enum PauseOutcome {
    /// It was paused already.
    AlreadyPaused,
    /// Paused now, in this long.
    Paused {
        /// From the request to the VM process's end.
        pause_ms: u64,
    },
}

/// How a resume ended well.
pub enum ResumeOutcome {
    /// It was not paused: it runs.
    Running,
    /// Resumed now, in this long.
    Resumed {
        /// From the request to the agent's answer in the new VM.
        resume_ms: u64,
    },
}

/// Why a sandbox without what pausing needs cannot be paused or resumed.
fn not_pausable() -> String {
    "this sandbox cannot be paused or resumed: pausing needs the KVM backend (QEMU cannot \
     restore a sandbox), and the image it was made from (a sandbox the sandbox host took on \
     again after a restart whose image left the store cannot be paused)"
        .into()
}

/// Pauses `entry`'s sandbox: its guest stopped where it is and written to its snapshot files,
/// its VM process ended (its memory goes back to the host), its disk, network process and
/// counters kept. Refused while a request runs in it (pausing would end it).
pub async fn pause(state: &AppState, entry: &Arc<SandboxEntry>) -> Result<PauseOutcome, ApiError> {
    let Some(p) = &entry.pausable else {
        return Err(ApiError::Conflict(not_pausable()));
    };
    let mut paused = entry.paused.lock().await;
    if *paused {
        return Ok(PauseOutcome::AlreadyPaused);
    }
    entry.ensure_alive()?;
    // The memory file can grow to the guest's memory: a pause that could fill the state
    // directory's file system (where the other sandboxes' disks grow) is refused instead.
    let need = u64::from(entry.memory_mib) + PAUSE_MARGIN_MIB;
    if let Some(free) = crate::capacity::statvfs_free_mib(&p.dir)
        && free < need
    {
        return Err(ApiError::NoCapacity(format!(
            "pausing sandbox `{}` writes up to {} MiB of its memory under {}, where {free} MiB \
             are free (it needs {need} MiB); free space there or delete sandboxes, then pause \
             again (it keeps running meanwhile)",
            entry.id,
            entry.memory_mib,
            p.dir.display()
        )));
    }
    // Marked paused before requests are counted: a request counts itself before it checks the
    // mark (`SandboxEntry::enter`), so either it sees the mark or this sees it.
    entry.set_paused(true);
    if entry.in_flight() > 0 {
        entry.set_paused(false);
        return Err(ApiError::Conflict(format!(
            "a request is running in sandbox `{}` (an exec or a transfer); pausing would end it. \
             Pause when it has finished",
            entry.id
        )));
    }
    let vm_dir = p.vm_dir();
    let vm_disk = vm_dir.join("sandbox-disk.ext4");
    if p.spec.scratch_disk_mib.is_some() && !vm_disk.exists() {
        entry.set_paused(false);
        return Err(ApiError::Internal(format!(
            "sandbox `{}` has lost its disk ({} is missing); it cannot be paused",
            entry.id,
            vm_disk.display()
        )));
    }
    let t0 = std::time::Instant::now();
    let sandbox = entry.sandbox();
    let done = match sandbox.snapshot(false).await {
        Ok(d) => d,
        Err(e) => {
            entry.set_paused(false);
            return Err(ApiError::Internal(format!(
                "sandbox `{}` could not be paused: {e}",
                entry.id
            )));
        }
    };
    // The guest is stopped: its disk leaves the VM's directory, which the stop removes.
    let slot = p.slot.load(Ordering::SeqCst);
    let disk = pause_disk(p);
    let moved = if vm_disk.exists() {
        std::fs::rename(&vm_disk, &disk)
    } else {
        Ok(())
    };
    sandbox.stop().await;
    if let Err(e) = moved {
        entry.set_paused(false);
        entry.set_lost();
        return Err(ApiError::VmDied(format!(
            "sandbox `{}` could not keep its disk while paused ({e}) and is lost",
            entry.id
        )));
    }
    let freed = entry
        .reservation
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .release_memory();
    *paused = true;
    // Its record says so from now on: the service's next run keeps it paused, resumable.
    let (dir, e) = (state.config().state_dir.clone(), entry.clone());
    let _ = tokio::task::spawn_blocking(move || {
        if let Err(err) = crate::adopt::save_as(&dir, &e, true) {
            tracing::warn!(id = %e.id, "a paused sandbox's record was not written, so a restart of the sandbox host would dispose of it: {err}");
        }
    })
    .await;
    tracing::info!(
        id = %entry.id,
        run_id = %entry.run_id,
        slot,
        memory_written_mib = done.memory_written >> 20,
        memory_freed_mib = freed,
        vcpus_stopped_ms = done.pause_us / 1000,
        snapshot_written_ms = done.write_us / 1000,
        pause_ms = t0.elapsed().as_millis() as u64,
        "Paused sandbox"
    );
    Ok(PauseOutcome::Paused {
        pause_ms: t0.elapsed().as_millis() as u64,
    })
}

/// Free space a pause leaves beyond its memory file, for the sandboxes that go on writing.
const PAUSE_MARGIN_MIB: u64 = 256;

/// Where a paused sandbox's disk waits.
fn pause_disk(p: &registry::Pausable) -> std::path::PathBuf {
    p.dir.join("sandbox-disk.ext4")
}

/// Resumes `entry`'s paused sandbox: a new VM restored from its snapshot, with its disk,
/// network process and counters; its clock set to the host's and its random generator
/// reseeded. A resume that fails loses the sandbox (its guest state and disk may no longer
/// agree): the error says so and the sweep disposes of it.
pub async fn resume(
    state: &AppState,
    entry: &Arc<SandboxEntry>,
) -> Result<ResumeOutcome, ApiError> {
    let Some(p) = &entry.pausable else {
        return Err(ApiError::Conflict(not_pausable()));
    };
    let Some(backend) = state.backend().cloned() else {
        return Err(ApiError::Unavailable(
            state
                .availability()
                .reason
                .clone()
                .unwrap_or_else(|| "no backend".into()),
        ));
    };
    let mut paused = entry.paused.lock().await;
    if !*paused {
        entry.ensure_alive()?;
        return Ok(ResumeOutcome::Running);
    }
    entry
        .reservation
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .reacquire_memory(u64::from(entry.memory_mib))
        .map_err(|why| {
            state.metrics().refused_for_capacity();
            ApiError::NoCapacity(why)
        })?;
    let t0 = std::time::Instant::now();
    let slot = p.slot.load(Ordering::SeqCst);
    let disk = pause_disk(p);
    let mut from = p.files[slot].clone();
    if disk.exists() {
        from.disk = Some(disk.clone());
        from.take_disk = true;
    }
    let mut spec = p.spec.clone();
    // The new VM process gets a socket pair of its own to the network process; the old one's
    // ended with it.
    if let Some(net) = &entry.net {
        let (vm, theirs) = std::os::unix::net::UnixStream::pair().map_err(|e| {
            ApiError::Internal(format!("a socket for the resumed VM's frames: {e}"))
        })?;
        net.relink_async(theirs.into())
            .await
            .map_err(|e| ApiError::Internal(format!("the sandbox's network process: {e}")))?;
        spec.net = Some(sandbox_vmm::NetAttachment {
            mac: p.mac,
            link: sandbox_vmm::NetLink::Socket(std::sync::Arc::new(vm.into())),
        });
    }
    spec.restore_from = Some(from);
    // The new VM maps the snapshot it comes from, so it writes its own to the other set.
    spec.snapshot_to = Some(p.files[1 - slot].clone());
    // A directory of its own: the old VM's, which its handle removes when dropped, is never
    // reused.
    spec.state_dir = p.next_vm_dir();
    let vm_dir = spec.state_dir.clone();
    let liveness = state.config().liveness();
    match sandbox_vmm::boot_watched(backend.as_ref(), spec, BOOT_TIMEOUT, liveness).await {
        Ok(sandbox) => {
            let _ = std::fs::remove_file(&disk);
            p.set_vm_dir(vm_dir);
            entry.replace_sandbox(sandbox);
            p.slot.store(1 - slot, Ordering::SeqCst);
            *paused = false;
            entry.set_paused(false);
            entry.touch();
            registry::watch(entry.clone());
            // Its record names the new VM's process from now on.
            let (dir, e) = (state.config().state_dir.clone(), entry.clone());
            let _ = tokio::task::spawn_blocking(move || {
                if let Err(err) = crate::adopt::save_as(&dir, &e, false) {
                    tracing::warn!(id = %e.id, "a sandbox's record was not written, so a restart of the sandbox host would dispose of it: {err}");
                }
            })
            .await;
            tracing::info!(id = %entry.id, run_id = %entry.run_id, resume_ms = t0.elapsed().as_millis() as u64, "Resumed sandbox");
            Ok(ResumeOutcome::Resumed {
                resume_ms: t0.elapsed().as_millis() as u64,
            })
        }
        Err(e) => {
            // Not paused any more, and with no VM: lost, disposed of by the next sweep.
            *paused = false;
            entry.set_paused(false);
            entry.set_lost();
            tracing::error!(id = %entry.id, run_id = %entry.run_id, error = %e, "a paused sandbox could not be resumed; it is lost");
            Err(ApiError::VmDied(format!(
                "sandbox `{}` could not be resumed and is lost: {e}",
                entry.id
            )))
        }
    }
}
