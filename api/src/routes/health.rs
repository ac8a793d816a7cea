//! `GET /v1/health`: can this host start a microVM, on what, with which image.

use axum::extract::State;
use axum::routing::{get, put};
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::state::AppState;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/hosts/{name}/drain", put(drain))
}

/// The body of a drain (a gateway checks it too, before it picks the host).
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DrainRequest {
    draining: bool,
}

/// `PUT /v1/hosts/{name}/drain`: a draining host takes no new sandboxes (a create gets `503
/// no_capacity` saying so, which a fleet's gateway passes on to another host) and its sandboxes
/// run to their end. `{name}` is this host's `SANDBOX_HOST_NAME`; a gateway sends the request to
/// the host it names. Not kept across a restart of the service.
async fn drain(
    State(state): State<AppState>,
    axum::extract::Path(name): axum::extract::Path<String>,
    crate::routes::ApiJson(req): crate::routes::ApiJson<DrainRequest>,
) -> Result<Json<Value>, ApiError> {
    let own = state.config().name.as_deref().unwrap_or("");
    if name != own {
        return Err(ApiError::NotFound(format!(
            "no host `{}` here: this sandbox host is {}",
            name.chars().take(64).collect::<String>(),
            if own.is_empty() {
                "unnamed (SANDBOX_HOST_NAME is not set)".to_string()
            } else {
                format!("`{own}`")
            }
        )));
    }
    state.set_draining(req.draining);
    tracing::info!(draining = req.draining, "Draining changed");
    Ok(Json(json!({"name": own, "draining": req.draining})))
}

/// The image a create request gets by default, and whether it is the stock fallback.
pub fn default_image(state: &AppState) -> (String, bool) {
    match state.store().resolve(crate::lifecycle::DEFAULT_IMAGE) {
        Ok(_) => (crate::lifecycle::DEFAULT_IMAGE.to_string(), false),
        Err(_) => (sandbox_vmm::image::STOCK.to_string(), true),
    }
}

async fn health(State(state): State<AppState>) -> Json<Value> {
    let a = state.availability();
    let (image, stock) = default_image(&state);
    Json(json!({
        "available": a.available,
        "reason": a.reason,
        "backend": a.backend,
        "accel": a.accel,
        "arch": a.arch,
        "warning": a.warning,
        "version": env!("CARGO_PKG_VERSION"),
        "image": { "name": image, "stock": stock },
        // A fleet's gateway places a create by these (issue 33).
        "name": state.config().name,
        "draining": state.draining(),
        "images": state.store().names(),
        "sandboxes": state.registry().all().len(),
        "capacity": state.capacity().report(),
        "jail": jail_report(),
        "uptime_ms": state.started().elapsed().as_millis() as u64,
    }))
}

/// The jail's status for `/v1/health` (see `docs/openapi.json`).
pub fn jail_report() -> Value {
    let s = sandbox_jail::global().status();
    json!({
        "namespaces": s.namespaces,
        "ids": s.ids,
        "cgroup": s.cgroup,
        "missing": s.missing,
        "unenforced": s.unenforced,
    })
}
