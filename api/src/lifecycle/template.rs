//! A template's VM (issue 15): started like a sandbox's, on a network process that allows
//! nothing, booted, snapshotted paused with its sandbox disk kept, and stopped; what
//! `templates.rs` keeps for the sandboxes of its shape.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbox_vmm::{Backend, Image};

use crate::state::AppState;

/// A template's boot has the bound of a sandbox's, and more: it boots beside them.
const BUILD_BOOT_TIMEOUT: Duration = Duration::from_secs(180);

/// Builds the template of `shape` in the background, unless it exists, is being built, or
/// failed recently (`Templates::start_build`).
pub(super) fn ensure(
    state: &AppState,
    backend: Arc<dyn Backend>,
    image: Image,
    shape: crate::templates::Shape,
) {
    let Some(dir) = state.templates().and_then(|t| t.start_build(&shape)) else {
        return;
    };
    let state = state.clone();
    tokio::spawn(async move {
        let t0 = Instant::now();
        let built = build(&state, backend.as_ref(), &image, &shape, dir).await;
        if let Some(templates) = state.templates() {
            templates.finish_build(shape, &image.name, t0, built);
        }
    });
}

/// Boots a template's VM, snapshots it paused, keeps its sandbox disk, and stops it.
async fn build(
    state: &AppState,
    backend: &dyn Backend,
    image: &Image,
    shape: &crate::templates::Shape,
    dir: std::path::PathBuf,
) -> Result<crate::templates::Template, String> {
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let fail = |why: String| {
        let _ = std::fs::remove_dir_all(&dir);
        why
    };
    // It holds memory and a VM like a sandbox while it boots. Its egress allows nothing, so no
    // connection of its guest is ever admitted: no egress memory to count, only its network
    // process's own.
    let reservation = state
        .capacity()
        .reserve(
            u64::from(shape.memory_mib),
            crate::netproc::ALLOWANCE_MIB,
            shape.disk_mib.unwrap_or(0),
        )
        .map_err(|why| fail(format!("no room for the template's VM: {why}")))?;
    let files = sandbox_vmm::SnapshotFiles {
        state: dir.join("snapshot.state"),
        memory: dir.join("snapshot.mem"),
        disk: shape.disk_mib.map(|_| dir.join("sandbox-disk.ext4")),
        take_disk: false,
    };
    for p in [&files.state, &files.memory] {
        std::fs::File::create(p).map_err(|e| fail(format!("creating {}: {e}", p.display())))?;
    }
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut spec = image.vm_spec(
        name.clone(),
        shape.memory_mib,
        shape.vcpus,
        shape.disk_mib.unwrap_or(0),
        dir.join("vm"),
    );
    spec.snapshot_to = Some(files.clone());
    // A network device as every sandbox has, on an egress that allows nothing: the template's
    // guest never reaches anything, and a clone's device gets its run's egress.
    let egress = crate::egress::start(&name, &Default::default(), state.config(), None, false)
        .await
        .map_err(|e| fail(format!("the template's egress: {e}")))?;
    let mac = egress.attachment.mac;
    spec.net = Some(egress.attachment);
    let sandbox =
        sandbox_vmm::boot_watched(backend, spec, BUILD_BOOT_TIMEOUT, state.config().liveness())
            .await
            .map_err(|e| fail(format!("the template's VM did not boot: {e}")))?;
    let snapshot = sandbox.snapshot(false).await;
    // Paused: the guest does not touch its disk while it is copied.
    let disk = match (&snapshot, &files.disk) {
        (Ok(_), Some(to)) => {
            let (from, to) = (dir.join("vm").join("sandbox-disk.ext4"), to.clone());
            tokio::task::spawn_blocking(move || {
                sandbox_vmm::scratch::copy_sparse(&from, &to).map_err(|e| e.to_string())
            })
            .await
            .unwrap_or_else(|e| Err(format!("the copy's task failed: {e}")))
        }
        _ => Ok(0),
    };
    sandbox.stop().await;
    drop(egress.net);
    drop(reservation);
    let done = snapshot.map_err(|e| fail(format!("the template's snapshot: {e}")))?;
    disk.map_err(|e| fail(format!("keeping the template's disk: {e}")))?;
    tracing::debug!(
        template = %name,
        memory_written = done.memory_written,
        pause_us = done.pause_us,
        write_us = done.write_us,
        "template snapshot written"
    );
    Ok(crate::templates::Template { files, mac, dir })
}
