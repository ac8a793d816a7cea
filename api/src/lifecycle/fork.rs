//! Forking a running sandbox (issue 35): its guest held while its memory and disk are copied,
//! then let go on; from that copy, children that each are a machine of their own (random state
//! reseeded, clock set, as a template's clones are) on a run of their own (network process,
//! secrets, CA, time limit), with the parent's processes, files and disk.

use std::sync::Arc;
use std::time::Instant;

use futures_util::future::join_all;

use crate::error::ApiError;
use crate::metrics::Disposal;
use crate::registry::{self, SandboxEntry};
use crate::state::AppState;

use super::{Created, Origin, Plan};

/// The most children one fork makes: each is a VM restored at once beside the parent.
pub const MAX_CHILDREN: usize = 16;

/// One child's run, as a create gives it (the machine is the parent's).
pub struct Child {
    /// The platform's run id.
    pub run_id: String,
    /// Its time limit, from the fork.
    pub time_limit: std::time::Duration,
    /// Variables of every command.
    pub env: std::collections::BTreeMap<String, String>,
    /// Its egress, secrets' values included until its network process has them.
    pub egress: crate::egress::EgressSpec,
}

/// A fork that worked.
pub struct Forked {
    /// The children, in the order they were asked for.
    pub children: Vec<Arc<SandboxEntry>>,
    /// How long the parent's guest was held: its memory written and its disk copied.
    pub held_ms: u64,
    /// From the request to the last child's ready agent.
    pub fork_ms: u64,
}

/// Free space a fork's snapshot leaves beyond the parent's memory, as a pause does.
const MARGIN_MIB: u64 = 256;

/// Forks `parent` into one child per `children`: all of them or none (a child that fails to
/// start takes the others with it; the parent runs on either way).
pub async fn fork(
    state: &AppState,
    parent: &Arc<SandboxEntry>,
    children: Vec<Child>,
) -> Result<Forked, ApiError> {
    let t0 = Instant::now();
    let backend = super::backend(state)?;
    super::taking_new(state)?;
    let Some(base) = parent.fork_base.clone() else {
        return Err(ApiError::Conflict(format!(
            "sandbox `{}` cannot be forked: this run of the sandbox host took it on after a \
             restart, and its VM's monitor stayed with the previous run (QEMU). Fork sandboxes \
             created since the restart",
            parent.id
        )));
    };
    if children.is_empty() || children.len() > MAX_CHILDREN {
        return Err(ApiError::BadRequest(format!(
            "a fork makes 1 to {MAX_CHILDREN} children, not {}",
            children.len()
        )));
    }
    // Each child's plan: the parent's machine and image, the child's run.
    let plans: Vec<Plan> = children
        .into_iter()
        .map(|c| Plan {
            run: registry::Run {
                id: registry::new_id(state.config().name.as_deref()),
                run_id: c.run_id,
                image: parent.image.clone(),
                stock_image: parent.stock_image,
                harness_version_match: parent.harness_version_match,
                disk_limit_mib: parent.disk_limit_mib,
                memory_mib: parent.memory_mib,
                vcpus: parent.vcpus,
                env: c.env,
                egress: c.egress,
                time_limit: c.time_limit,
            },
            image: base.image.clone(),
        })
        .collect();
    // Room for every child before the parent is held: a fork the host cannot take costs the
    // parent nothing.
    let mut reservations = Vec::with_capacity(plans.len());
    for plan in &plans {
        reservations.push(super::admit(state, &plan.run, &plan.vm_spec(state))?);
    }
    // The parent's turn: no pause, resume or disposal of it while it is held. A request on it
    // meanwhile: never idle while it forks.
    let turn = parent.paused.lock().await;
    if *turn {
        return Err(ApiError::Paused(parent.id.clone()));
    }
    let _busy = parent.enter()?;
    // A delete that had the turn first took it out of the registry.
    state.registry().get(&parent.id)?;
    let disk = parent_disk(state, parent);
    if plans[0].vm_spec(state).scratch_disk_mib.is_some() && disk.is_none() {
        return Err(ApiError::Internal(format!(
            "sandbox `{}` has lost its disk (its VM's sandbox-disk.ext4 is missing); it cannot be \
             forked",
            parent.id
        )));
    }
    let dir = state.config().state_dir.join(format!(
        "{}.fork-{}",
        parent.id,
        registry::new_id(None).trim_start_matches("sbx-")
    ));
    // Its memory (twice on a backend whose children map the copy: the copy of the copy), and
    // its disk's used space once for the copy and once per child.
    let copies = if backend.can_pause() { 2 } else { 1 };
    let disk_used_mib = disk.as_deref().map_or(0, allocated_mib);
    let need = u64::from(parent.memory_mib) * copies
        + disk_used_mib * (1 + plans.len() as u64)
        + MARGIN_MIB;
    if let Some(free) = crate::capacity::statvfs_free_mib(&state.config().state_dir)
        && free < need
    {
        return Err(ApiError::NoCapacity(format!(
            "forking sandbox `{}` writes up to {need} MiB under {} (its memory of {} MiB, and \
             its disk's {disk_used_mib} MiB for the copy and each child), where {free} MiB are \
             free; free space there or delete sandboxes, then fork again (it runs on meanwhile)",
            parent.id,
            state.config().state_dir.display(),
            parent.memory_mib,
        )));
    }
    let snapshot = crate::templates::Template {
        files: sandbox_vmm::SnapshotFiles {
            disk: disk.as_ref().map(|_| dir.join("sandbox-disk.ext4")),
            ..super::snapshot_paths(&dir)
        },
        mac: base.mac,
        dir: dir.clone(),
    };
    // Dropped (its directory removed) once every child has its own copy and maps or read it.
    let held_ms = hold_and_copy(parent, disk, &snapshot).await?;
    drop(turn);
    // The parent's VM process was handed the memory file (and may keep it, if its guest took
    // it over). Where children map the copy (KVM), they get one that process never had, so
    // nothing it writes later reaches them.
    if backend.can_pause() {
        let memory = snapshot.files.memory.clone();
        tokio::task::spawn_blocking(move || own_copy(&memory))
            .await
            .unwrap_or_else(|e| Err(format!("the copy's task failed: {e}")))
            .map_err(|e| {
                ApiError::Internal(format!(
                    "the memory of sandbox `{}` could not be copied for its fork (it runs on): \
                     {e}",
                    parent.id
                ))
            })?;
    }
    let snapshot = Arc::new(snapshot);
    let started = join_all(
        plans
            .into_iter()
            .zip(reservations)
            .map(|(plan, reservation)| {
                let (state, backend, snapshot) = (state.clone(), backend.clone(), snapshot.clone());
                // Tasks of their own: a client that goes away mid-fork does not leave VMs half made.
                tokio::spawn(async move {
                    super::create_from(
                        &state,
                        backend,
                        plan,
                        Origin::Fork {
                            snapshot: &snapshot,
                            reservation,
                        },
                    )
                    .await
                })
            }),
    )
    .await;
    // Where each child read it into its own memory (QEMU), its blocks go back now, even while
    // the parent's QEMU keeps it open. A file children map (KVM) is only unlinked: emptied,
    // their pages it still backs would be gone.
    if !backend.can_pause() {
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .open(&snapshot.files.memory)
            .and_then(|f| f.set_len(0));
    }
    drop(snapshot);
    let mut made = Vec::new();
    let mut failed = None;
    for s in started {
        match s {
            Ok(Ok(Created { entry, .. })) => made.push(entry),
            Ok(Err(e)) => failed = failed.or(Some(e)),
            Err(e) => {
                failed = failed.or(Some(ApiError::Internal(format!(
                    "a child's start failed: {e}"
                ))))
            }
        }
    }
    if let Some(e) = failed {
        for child in made {
            if let Some(entry) = state.registry().take(&child.id) {
                super::dispose(state, entry, Disposal::Deleted).await;
            }
        }
        tracing::error!(id = %parent.id, error = %e, "a fork failed; none of its children was kept");
        return Err(e);
    }
    let fork_ms = t0.elapsed().as_millis() as u64;
    tracing::info!(
        id = %parent.id,
        run_id = %parent.run_id,
        children = %made.iter().map(|c| c.id.as_str()).collect::<Vec<_>>().join(","),
        held_ms,
        fork_ms,
        "Forked sandbox"
    );
    Ok(Forked {
        children: made,
        held_ms,
        fork_ms,
    })
}

/// The space `path` takes on its file system, MiB.
fn allocated_mib(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or(0, |m| (m.blocks() * 512) >> 20)
}

/// Replaces the file at `path` with a copy of it (holes kept), and empties the file it was:
/// whoever still holds that one writes into nothing anyone reads.
fn own_copy(path: &std::path::Path) -> Result<(), String> {
    let mut name = path.as_os_str().to_owned();
    name.push(".own");
    let copy = std::path::PathBuf::from(name);
    let _ = std::fs::remove_file(&copy);
    sandbox_vmm::scratch::copy_sparse(path, &copy).map_err(|e| e.to_string())?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.set_len(0))
        .and_then(|()| std::fs::rename(&copy, path))
        .map_err(|e| format!("replacing {}: {e}", path.display()))
}

/// The parent's sandbox disk, where its image gives it one.
fn parent_disk(state: &AppState, parent: &SandboxEntry) -> Option<std::path::PathBuf> {
    let vm_dir = match &parent.pausable {
        Some(p) => p.vm_dir(),
        None => state.config().state_dir.join(&parent.id),
    };
    let disk = vm_dir.join("sandbox-disk.ext4");
    disk.exists().then_some(disk)
}

/// Holds the parent's guest while its snapshot is written into `snapshot`'s files and its disk
/// copied beside them, then lets it run on; how long it was held. A parent that cannot be let
/// go on is lost (answered 410 until the sweep disposes of it).
async fn hold_and_copy(
    parent: &Arc<SandboxEntry>,
    disk: Option<std::path::PathBuf>,
    snapshot: &crate::templates::Template,
) -> Result<u64, ApiError> {
    let dir = &snapshot.dir;
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::File::create(&snapshot.files.state).map(drop))
        .and_then(|()| std::fs::File::create(&snapshot.files.memory).map(drop))
        .map_err(|e| {
            ApiError::Internal(format!(
                "creating the fork's files in {}: {e}",
                dir.display()
            ))
        })?;
    let sandbox = parent.sandbox();
    let t0 = Instant::now();
    let held = sandbox.snapshot_held(&snapshot.files).await;
    // Held: the guest does not touch its disk while it is copied.
    let copied = match (&held, disk, &snapshot.files.disk) {
        (Ok(_), Some(from), Some(to)) => {
            let to = to.clone();
            tokio::task::spawn_blocking(move || {
                sandbox_vmm::scratch::copy_sparse(&from, &to).map_err(|e| e.to_string())
            })
            .await
            .unwrap_or_else(|e| Err(format!("the copy's task failed: {e}")))
        }
        _ => Ok(0),
    };
    let resumed = sandbox.resume().await;
    let held_ms = t0.elapsed().as_millis() as u64;
    if let Err(e) = resumed {
        parent.set_lost();
        let why = match &held {
            Ok(_) => e.to_string(),
            Err(first) => format!("{e}, after its copy failed: {first}"),
        };
        tracing::error!(id = %parent.id, error = %why, "a forked sandbox could not run on after its copy; it is lost");
        return Err(ApiError::VmDied(format!(
            "sandbox `{}` could not run on after its fork's copy and is lost: {why}",
            parent.id
        )));
    }
    let done = held.map_err(|e| {
        ApiError::Internal(format!(
            "sandbox `{}` could not be copied for its fork (it runs on): {e}",
            parent.id
        ))
    })?;
    let disk_bytes = copied.map_err(|e| {
        ApiError::Internal(format!(
            "the disk of sandbox `{}` could not be copied for its fork (it runs on): {e}",
            parent.id
        ))
    })?;
    tracing::debug!(
        id = %parent.id,
        memory_written = done.memory_written,
        disk_copied = disk_bytes,
        held_ms,
        "fork snapshot written"
    );
    Ok(held_ms)
}
