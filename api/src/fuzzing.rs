//! The API's router in process, for the fuzz targets (feature `fuzzing`, never in the service's
//! build): the real routes, authentication, extractors and errors, on a host with no microVM
//! backend, so that every request is answered without booting anything and a request that gets
//! past validation ends in the documented 503 instead of a VM.

use std::path::Path;

use axum::Router;

use crate::config::Config;
use crate::state::{AppState, Availability};

/// The router of a host whose token is `token` and whose state and images live under `dir`.
pub fn router(token: &str, dir: &Path) -> Router {
    let mut cfg = Config::from_lookup(|k| (k == "SANDBOX_HOST_TOKEN").then(|| token.to_string()))
        .expect("the fuzzing configuration is valid");
    cfg.state_dir = dir.join("state");
    cfg.image_dir = dir.join("images");
    let availability = Availability {
        available: false,
        reason: Some("fuzzing: no microVM backend".into()),
        backend: "none".into(),
        accel: "none".into(),
        arch: sandbox_vmm::arch::Arch::host().to_string(),
        warning: None,
    };
    crate::routes::app(AppState::new(cfg, availability, None))
}
