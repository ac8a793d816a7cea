//! Pausing and resuming a sandbox (issue 15, KVM backend): the guest written to its snapshot
//! files and its VM process ended, so its memory goes back to the host; later a new VM restored
//! from the snapshot with the same disk, egress stack and counters.

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};

use super::SandboxId;
use crate::error::ApiError;
use crate::lifecycle;
use crate::state::AppState;

/// A pause or resume starts only while the service serves: one that began after a hand-over
/// saved the sandbox's record would leave a record of a VM that is gone.
fn serving(state: &AppState) -> Result<(), ApiError> {
    match state.ending() {
        crate::state::Ending::Serving => Ok(()),
        _ => Err(ApiError::Restarting(
            "the sandbox host is stopping or handing over to its next run: pause or resume the \
             sandbox once it has started again"
                .into(),
        )),
    }
}

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/pause", post(pause))
        .route("/v1/sandboxes/{id}/resume", post(resume))
}

/// `POST /v1/sandboxes/{id}/pause`: the guest is stopped where it is and written to its
/// snapshot files, its VM process ends (its memory goes back to the host), and its disk, egress
/// stack and counters stay. Refused while a request runs in it (pausing would end it).
async fn pause(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
) -> Result<Json<Value>, ApiError> {
    let entry = state.registry().get(&id)?;
    serving(&state)?;
    // On a task of its own: a client that goes away mid-pause does not leave it half done.
    let st = state.clone();
    let outcome =
        tokio::spawn(async move { lifecycle::pause(&st, &entry).await.map(|o| (entry, o)) })
            .await
            .map_err(|e| ApiError::Internal(format!("the pause's task failed: {e}")))?;
    let (entry, outcome) = outcome?;
    Ok(Json(match outcome {
        lifecycle::PauseOutcome::AlreadyPaused => json!({"id": entry.id, "state": "paused"}),
        lifecycle::PauseOutcome::Paused { pause_ms } => {
            json!({"id": entry.id, "state": "paused", "pause_ms": pause_ms})
        }
    }))
}

/// `POST /v1/sandboxes/{id}/resume`: a new VM restored from the pause's snapshot, with the
/// sandbox's disk, egress stack and counters; its clock set to the host's and its random
/// generator reseeded. A resume that fails loses the sandbox (its guest state and disk may no
/// longer agree): the answer says so and the sweep disposes of it.
async fn resume(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
) -> Result<Json<Value>, ApiError> {
    let entry = state.registry().get(&id)?;
    serving(&state)?;
    let outcome =
        tokio::spawn(async move { lifecycle::resume(&state, &entry).await.map(|o| (entry, o)) })
            .await
            .map_err(|e| ApiError::Internal(format!("the resume's task failed: {e}")))?;
    let (entry, outcome) = outcome?;
    Ok(Json(match outcome {
        lifecycle::ResumeOutcome::Running => json!({"id": entry.id, "state": "ready"}),
        lifecycle::ResumeOutcome::Resumed { resume_ms } => {
            json!({"id": entry.id, "state": "ready", "resume_ms": resume_ms})
        }
    }))
}
