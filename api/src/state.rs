//! The shared state of the service: configuration, availability, the backend, the image store,
//! the sandbox registry and the counters. Cloned into every handler (a few `Arc`s).

use std::sync::Arc;
use std::time::Instant;

use sandbox_vmm::{Backend, ImageStore};
use sha2::{Digest, Sha256};

use crate::config::Config;
use crate::metrics::Metrics;
use crate::registry::Registry;

/// Whether this host can start microVMs, and on what.
#[derive(Debug, Clone)]
pub struct Availability {
    /// True when a microVM can be started.
    pub available: bool,
    /// Why not, when not.
    pub reason: Option<String>,
    /// `qemu` or `kvm`.
    pub backend: String,
    /// The accelerator.
    pub accel: String,
    /// The guests' architecture (`x86_64`, `aarch64`): the host's, or `SANDBOX_HOST_ARCH`.
    pub arch: String,
    /// A slow fallback the operator should know about.
    pub warning: Option<String>,
}

/// Whether the service serves, or how it is ending (a signal came).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// It serves.
    Serving,
    /// SIGINT or SIGTERM: it disposes of every sandbox, then exits.
    Disposing,
    /// SIGUSR2: it hands its sandboxes over to its next run, then exits.
    HandingOver,
    /// The hand-over decided: the sandboxes still in the registry are kept for the next run,
    /// the others are being disposed of.
    HandedOver,
}

/// State shared by every handler.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    config: Config,
    token_digest: [u8; 32],
    availability: Availability,
    backend: Option<Arc<dyn Backend>>,
    store: ImageStore,
    registry: Registry,
    metrics: Metrics,
    capacity: Arc<crate::capacity::Capacity>,
    templates: Option<crate::templates::Templates>,
    started: Instant,
    ending: tokio::sync::watch::Sender<Ending>,
    /// Draining (issue 33): no new sandboxes; those it has run to their end.
    draining: std::sync::atomic::AtomicBool,
}

impl AppState {
    /// Assembles the state.
    pub fn new(
        config: Config,
        availability: Availability,
        backend: Option<Arc<dyn Backend>>,
    ) -> Self {
        let token_digest = Sha256::digest(config.token.as_bytes()).into();
        let store = ImageStore::new(config.image_dir.clone());
        let capacity = crate::capacity::Capacity::new(config.limits, config.state_dir.clone());
        // Both backends restore snapshots: the KVM backend its own, QEMU its migration to a file.
        let templates = (backend.is_some() && config.templates)
            .then(|| crate::templates::Templates::new(&config.state_dir));
        AppState {
            inner: Arc::new(Inner {
                registry: Registry::default(),
                config,
                token_digest,
                availability,
                backend,
                store,
                metrics: Metrics::default(),
                capacity,
                templates,
                started: Instant::now(),
                ending: tokio::sync::watch::Sender::new(Ending::Serving),
                draining: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// SHA-256 of the token.
    pub fn token_digest(&self) -> &[u8; 32] {
        &self.inner.token_digest
    }

    /// Availability as computed at start.
    pub fn availability(&self) -> &Availability {
        &self.inner.availability
    }

    /// The backend, when available.
    pub fn backend(&self) -> Option<&Arc<dyn Backend>> {
        self.inner.backend.as_ref()
    }

    /// The image store.
    pub fn store(&self) -> &ImageStore {
        &self.inner.store
    }

    /// The sandboxes.
    pub fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    /// The counters.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The host's budgets.
    pub fn capacity(&self) -> &Arc<crate::capacity::Capacity> {
        &self.inner.capacity
    }

    /// The templates sandboxes are restored from, where the backend has them.
    pub fn templates(&self) -> Option<&crate::templates::Templates> {
        self.inner.templates.as_ref()
    }

    /// When the service started.
    pub fn started(&self) -> Instant {
        self.inner.started
    }

    /// Records that the service is ending, and how: creates are refused from now on, and at a
    /// hand-over the open exec streams say so.
    pub fn begin_ending(&self, how: Ending) {
        self.inner.ending.send_replace(how);
    }

    /// Whether the service serves, or how it is ending.
    pub fn ending(&self) -> Ending {
        *self.inner.ending.borrow()
    }

    /// Whether the host is draining: it takes no new sandboxes.
    pub fn draining(&self) -> bool {
        self.inner
            .draining
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Starts or ends draining.
    pub fn set_draining(&self, on: bool) {
        self.inner
            .draining
            .store(on, std::sync::atomic::Ordering::SeqCst);
    }

    /// A receiver of how the service ends, for the streams that answer it.
    pub fn ending_watch(&self) -> tokio::sync::watch::Receiver<Ending> {
        self.inner.ending.subscribe()
    }
}
