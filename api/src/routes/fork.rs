//! Forking a running sandbox (issue 35): `POST /v1/sandboxes/{id}/fork` gives `count` new
//! sandboxes with its memory, processes, files and disk, each on a run of its own.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{ApiJson, SandboxId};
use crate::egress::EgressSpec;
use crate::error::ApiError;
use crate::json::integral;
use crate::lifecycle;
use crate::state::AppState;

pub fn router() -> Router<AppState> {
    Router::new().route("/v1/sandboxes/{id}/fork", post(fork))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkRequest {
    #[serde(deserialize_with = "integral")]
    count: u64,
    children: Vec<ChildRequest>,
}

/// A child's run: the fields of a create that belong to a run. Its machine (memory, vCPUs,
/// image, disk) is its parent's, so a create's other fields are refused.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChildRequest {
    run_id: String,
    #[serde(deserialize_with = "integral")]
    time_limit_ms: u64,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    egress: EgressSpec,
}

/// `POST /v1/sandboxes/{id}/fork`: the parent held while its memory and disk are copied, then
/// let go on; one child per entry of `children`, all or none.
async fn fork(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
    body: Result<ApiJson<ForkRequest>, ApiError>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    // An unknown sandbox is the answer before anything about the body, as on every route.
    let parent = state.registry().get(&id)?;
    let ApiJson(req) = body?;
    let max = lifecycle::MAX_CHILDREN as u64;
    if req.count == 0 || req.count > max {
        return Err(ApiError::BadRequest(format!(
            "count must be between 1 and {max}, not {}",
            req.count
        )));
    }
    if req.children.len() as u64 != req.count {
        return Err(ApiError::BadRequest(format!(
            "children must have one entry per child: count is {} and children has {}",
            req.count,
            req.children.len()
        )));
    }
    for (i, c) in req.children.iter().enumerate() {
        super::sandboxes::validate_run(&c.run_id, c.time_limit_ms, &c.env, &c.egress)
            .and_then(|()| crate::egress::check_secrets(&c.egress).map_err(ApiError::BadRequest))
            .map_err(|e| match e {
                ApiError::BadRequest(m) => ApiError::BadRequest(format!("children[{i}]: {m}")),
                e => e,
            })?;
    }
    let children = req
        .children
        .into_iter()
        .map(|c| lifecycle::Child {
            run_id: c.run_id,
            time_limit: Duration::from_millis(c.time_limit_ms),
            env: c.env,
            egress: c.egress,
        })
        .collect();
    // On a task of its own: a client that goes away mid-fork does not leave the parent held
    // or children half made.
    let st = state.clone();
    let forked = tokio::spawn(async move { lifecycle::fork(&st, &parent, children).await })
        .await
        .map_err(|e| ApiError::Internal(format!("the fork's task failed: {e}")))??;
    let children: Vec<Value> = forked
        .children
        .iter()
        .map(|c| super::sandboxes::created(&state, c, "fork"))
        .collect();
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "id": id,
            "held_ms": forked.held_ms,
            "fork_ms": forked.fork_ms,
            "children": children,
        })),
    ))
}
