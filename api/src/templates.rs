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

use sandbox_vmm::SnapshotFiles;

/// The most templates kept; the least recently used goes first.
const MAX_TEMPLATES: usize = 8;
/// After a failed build, the same shape is not tried again for this long.
const RETRY_AFTER: Duration = Duration::from_secs(600);

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
    pub fn name(&self) -> String {
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
    pub dir: PathBuf,
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

    /// Claims the build of `shape`'s template unless it exists, is being built, or failed
    /// recently; returns the directory the build is to use. One build at a time: each is a VM
    /// booting beside the sandboxes, and a shape that finds another building boots cold and
    /// asks again at its next create.
    pub fn start_build(&self, shape: &Shape) -> Option<PathBuf> {
        let mut slots = self.slots();
        slots.retain(|_, s| !matches!(s, Slot::Failed { at } if at.elapsed() >= RETRY_AFTER));
        if slots.contains_key(shape) || slots.values().any(|s| matches!(s, Slot::Building)) {
            return None;
        }
        slots.insert(shape.clone(), Slot::Building);
        let n = self
            .builds
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(self.dir.join(format!("{}-{n}", shape.name())))
    }

    /// Records how the build of `shape`'s template (begun at `t0`, of image `image`) ended.
    pub fn finish_build(
        &self,
        shape: Shape,
        image: &str,
        t0: Instant,
        built: Result<Template, String>,
    ) {
        let mut slots = self.slots();
        let mut dropped = Vec::new();
        match built {
            Ok(template) => {
                tracing::info!(template = %shape.name(), image, memory_mib = shape.memory_mib, vcpus = shape.vcpus, build_ms = t0.elapsed().as_millis() as u64, "Template ready: sandboxes of this shape are restored from it");
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
                tracing::warn!(template = %shape.name(), image, why, "a template could not be built; sandboxes of this shape boot cold");
                slots.insert(shape, Slot::Failed { at: Instant::now() });
            }
        }
        // Evicted templates' files go outside the lock.
        drop(slots);
        drop(dropped);
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
