//! Templates (issue 15): sandboxes start from a snapshot instead of a boot, on the KVM backend
//! (its own snapshot) and on QEMU (its migration to a file, `sandbox_vmm::qemu`).
//!
//! For each shape in use (image build, memory, vCPUs, sandbox disk size) the service boots one
//! VM to agent-ready, before anything of a run exists in it (no network set-up, no CA, no
//! environment, an empty sandbox disk), pauses it, and keeps its snapshot: state, memory and
//! the sandbox disk as it was. Later sandboxes of that shape are restored from it: each maps the
//! memory copy-on-write, gets a copy of the disk, its own random state and clock (the agent's
//! `Identity`), then its run's network, CA and environment exactly as after a cold boot.
//!
//! The first sandbox of a shape boots cold and starts the template's build beside it; a new
//! image build is a new shape (the image store is read at every create). A template that fails
//! to restore is discarded with a log line and that create boots cold. Templates live under
//! the state directory and are made again after a restart: a snapshot holds the exact kernel,
//! agent and VMM state of the service that took it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sandbox_vmm::{Backend, Image, SnapshotFiles};

use crate::state::AppState;

/// The most templates kept; the least recently used goes first.
const MAX_TEMPLATES: usize = 8;
/// After a failed build, the same shape is not tried again for this long.
const RETRY_AFTER: Duration = Duration::from_secs(600);
/// A template's boot has the bound of a sandbox's.
const BUILD_BOOT_TIMEOUT: Duration = Duration::from_secs(180);

/// What makes two sandboxes restorable from one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Shape {
    /// The image's build directory: a new build of the image is a new shape.
    pub image_dir: PathBuf,
    /// Guest memory.
    pub memory_mib: u32,
    /// vCPUs.
    pub vcpus: u8,
    /// The sandbox disk's size, for images that have one.
    pub disk_mib: Option<u64>,
}

impl Shape {
    /// A short stable name for files and logs.
    fn name(&self) -> String {
        // FNV-1a, as for guest MACs: stable across runs, unlike std's hasher.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let text = format!(
            "{}|{}|{}|{:?}",
            self.image_dir.display(),
            self.memory_mib,
            self.vcpus,
            self.disk_mib
        );
        for b in text.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        format!("tpl-{h:016x}")
    }
}

/// A snapshot sandboxes of one shape are restored from.
#[derive(Debug)]
pub struct Template {
    /// Its files (the disk included where the image has one).
    pub files: SnapshotFiles,
    /// The MAC address the guest's network device has: every clone keeps it (each sandbox has
    /// a link of its own, so no two guests share a network).
    pub mac: [u8; 6],
    /// Its directory.
    dir: PathBuf,
}

impl Drop for Template {
    fn drop(&mut self) {
        // The last clone being restored holds its own reference: files go once nobody maps them.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

enum Slot {
    Building,
    Ready {
        template: Arc<Template>,
        used: Instant,
    },
    Failed {
        at: Instant,
    },
}

/// The service's templates.
pub struct Templates {
    dir: PathBuf,
    slots: Mutex<HashMap<Shape, Slot>>,
    /// Numbers builds: each has a directory of its own, so a template still held by a create
    /// never shares files with a newer build of its shape.
    builds: std::sync::atomic::AtomicU64,
}

impl Templates {
    /// Templates under `state_dir/templates`; whatever an earlier run left there is removed.
    pub fn new(state_dir: &std::path::Path) -> Templates {
        let dir = state_dir.join("templates");
        let _ = std::fs::remove_dir_all(&dir);
        Templates {
            dir,
            slots: Mutex::new(HashMap::new()),
            builds: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<Shape, Slot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ready template of `shape`, if there is one.
    pub fn get(&self, shape: &Shape) -> Option<Arc<Template>> {
        match self.slots().get_mut(shape) {
            Some(Slot::Ready { template, used }) => {
                *used = Instant::now();
                Some(template.clone())
            }
            _ => None,
        }
    }

    /// Forgets the template of `shape` (it failed to restore); its files go with the last
    /// reference.
    pub fn discard(&self, shape: &Shape, why: &str) {
        let mut slots = self.slots();
        if matches!(slots.get(shape), Some(Slot::Ready { .. })) {
            tracing::warn!(template = %shape.name(), why, "a template failed to restore; it is discarded and this sandbox boots cold");
            let old = slots.insert(shape.clone(), Slot::Failed { at: Instant::now() });
            // Its files go when the last holder lets go, outside the lock.
            drop(slots);
            drop(old);
        }
    }

    /// Starts building the template of `shape` in the background unless it exists, is being
    /// built, or failed recently.
    pub fn ensure(&self, state: &AppState, backend: Arc<dyn Backend>, image: Image, shape: Shape) {
        {
            let mut slots = self.slots();
            slots.retain(|_, s| !matches!(s, Slot::Failed { at } if at.elapsed() >= RETRY_AFTER));
            match slots.get(&shape) {
                Some(Slot::Building | Slot::Ready { .. } | Slot::Failed { .. }) => return,
                None => {}
            }
            // One build at a time: each is a VM booting beside the sandboxes. A shape that
            // finds another building boots cold and asks again at its next create.
            if slots.values().any(|s| matches!(s, Slot::Building)) {
                return;
            }
            slots.insert(shape.clone(), Slot::Building);
        }
        let state = state.clone();
        let n = self
            .builds
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = self.dir.join(format!("{}-{n}", shape.name()));
        tokio::spawn(async move {
            let t0 = Instant::now();
            let built = build(&state, backend.as_ref(), &image, &shape, dir).await;
            let Some(templates) = state.templates() else {
                return;
            };
            let mut slots = templates.slots();
            let mut dropped = Vec::new();
            match built {
                Ok(template) => {
                    tracing::info!(template = %shape.name(), image = %image.name, memory_mib = shape.memory_mib, vcpus = shape.vcpus, build_ms = t0.elapsed().as_millis() as u64, "Template ready: sandboxes of this shape are restored from it");
                    slots.insert(
                        shape,
                        Slot::Ready {
                            template: Arc::new(template),
                            used: Instant::now(),
                        },
                    );
                    dropped = evict(&mut slots);
                }
                Err(why) => {
                    tracing::warn!(template = %shape.name(), image = %image.name, why, "a template could not be built; sandboxes of this shape boot cold");
                    slots.insert(shape, Slot::Failed { at: Instant::now() });
                }
            }
            // Evicted templates' files go outside the lock.
            drop(slots);
            drop(dropped);
        });
    }

    /// How many templates are ready, for `/metrics`.
    pub fn ready(&self) -> usize {
        self.slots()
            .values()
            .filter(|s| matches!(s, Slot::Ready { .. }))
            .count()
    }
}

/// Takes the least recently used templates past [`MAX_TEMPLATES`] out; the caller drops them.
fn evict(slots: &mut HashMap<Shape, Slot>) -> Vec<Slot> {
    let mut out = Vec::new();
    loop {
        let ready: Vec<(&Shape, Instant)> = slots
            .iter()
            .filter_map(|(k, s)| match s {
                Slot::Ready { used, .. } => Some((k, *used)),
                _ => None,
            })
            .collect();
        if ready.len() <= MAX_TEMPLATES {
            return out;
        }
        let Some(oldest) = ready
            .iter()
            .min_by_key(|(_, u)| *u)
            .map(|(k, _)| (*k).clone())
        else {
            return out;
        };
        out.extend(slots.remove(&oldest));
    }
}

/// Boots the template VM, snapshots it paused, keeps its sandbox disk, and stops it.
async fn build(
    state: &AppState,
    backend: &dyn Backend,
    image: &Image,
    shape: &Shape,
    dir: PathBuf,
) -> Result<Template, String> {
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
    let files = SnapshotFiles {
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
    let egress = crate::egress::start(&name, &Default::default(), state.config(), None)
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
    Ok(Template { files, mac, dir })
}
