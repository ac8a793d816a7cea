//! Read-outs: egress refusals and usage per sandbox (filled by the egress stack, issue 5), and
//! `/metrics`.

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Value, json};

use super::SandboxId;
use crate::error::ApiError;
use crate::registry::SandboxEntry;
use crate::state::AppState;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/egress", get(egress))
        .route("/v1/sandboxes/{id}/usage", get(usage))
        .route("/metrics", get(metrics))
}

/// Refusal counters of a sandbox and what its egress carried.
pub async fn egress_json(e: &SandboxEntry) -> Value {
    match &e.net {
        Some(net) => crate::egress::egress_json(&crate::egress::report(net).await),
        None => json!({ "refused": 0, "by_reason": {}, "events": [] }),
    }
}

/// Metered model calls of a sandbox.
pub async fn usage_json(e: &SandboxEntry) -> Value {
    if let Some(net) = &e.net {
        return crate::egress::usage_json(&crate::egress::report(net).await);
    }
    json!({
        "calls": [],
        "totals": {
            "calls": 0, "input_tokens": 0, "output_tokens": 0,
            "cache_read_tokens": 0, "cache_write_tokens": 0, "billed_cost_usd": null
        }
    })
}

async fn egress(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
) -> Result<Json<Value>, ApiError> {
    let e = state.registry().get(&id)?;
    Ok(Json(egress_json(&e).await))
}

async fn usage(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
) -> Result<Json<Value>, ApiError> {
    let e = state.registry().get(&id)?;
    Ok(Json(usage_json(&e).await))
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let all = state.registry().all();
    let dead = all.iter().filter(|e| e.state() == "dead").count() as u64;
    let states = [("ready", all.len() as u64 - dead), ("dead", dead)];
    let (mut live, mut live_unmetered): (Vec<(&'static str, u64)>, Vec<_>) = Default::default();
    // Every sandbox's counts at once: a network process that answers late (each is bounded, and
    // one that runs out is not asked again) delays the scrape by its own bound, not by the sum.
    let mut asked = tokio::task::JoinSet::new();
    for net in all.iter().filter_map(|e| e.net.clone()) {
        asked.spawn(async move { crate::egress::counts(&net).await });
    }
    while let Some(answer) = asked.join_next().await {
        if let Ok(report) = answer {
            live.extend(crate::egress::refusal_counts(&report));
            live_unmetered.extend(crate::egress::unmetered_counts(&report));
        }
    }
    let refusals = state.metrics().refusal_totals(&live);
    let unmetered = state.metrics().unmetered_totals(&live_unmetered);
    let mut text = state.metrics().render(&states, &refusals, &unmetered);
    text.push_str(&capacity_gauges(&state.capacity().report()));
    text.push_str(&format!(
        "# HELP sandbox_host_templates_ready Templates sandboxes are restored from (KVM backend).\n\
         # TYPE sandbox_host_templates_ready gauge\nsandbox_host_templates_ready {}\n",
        state.templates().map_or(0, |t| t.ready())
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

/// The host's budgets as gauges (what `GET /v1/health` reports under `capacity`).
fn capacity_gauges(c: &Value) -> String {
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    format!(
        "# HELP sandbox_host_memory_mib Memory committed to sandboxes (guest and egress memory), and its limit (SANDBOX_HOST_MEMORY_LIMIT_MIB).\n\
         # TYPE sandbox_host_memory_mib gauge\n\
         sandbox_host_memory_mib{{kind=\"committed\"}} {}\nsandbox_host_memory_mib{{kind=\"limit\"}} {}\n\
         # HELP sandbox_host_disk_mib Sandbox disk limits committed, and free space under the state directory.\n\
         # TYPE sandbox_host_disk_mib gauge\n\
         sandbox_host_disk_mib{{kind=\"committed\"}} {}\nsandbox_host_disk_mib{{kind=\"free\"}} {}\n\
         # HELP sandbox_host_fds File descriptors open in the sandbox host, and its limit.\n\
         # TYPE sandbox_host_fds gauge\n\
         sandbox_host_fds{{kind=\"open\"}} {}\nsandbox_host_fds{{kind=\"limit\"}} {}\n",
        n(&c["memory_mib"]["committed"]),
        n(&c["memory_mib"]["limit"]),
        n(&c["disk_mib"]["committed"]),
        n(&c["disk_mib"]["free"]),
        n(&c["fds"]["open"]),
        n(&c["fds"]["limit"]),
    )
}
