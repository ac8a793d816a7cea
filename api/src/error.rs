//! The one error type of the HTTP API: each variant is a status, a code and a message for a
//! person, rendered as `{"error": "...", "code": "..."}`.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use sandbox_protocol::client::ClientError;
use thiserror::Error;

/// Why a request failed.
#[derive(Debug, Error)]
pub enum ApiError {
    /// Admitting the sandbox would overcommit the host (memory, disk, file descriptors).
    #[error("{0}")]
    NoCapacity(String),
    /// Missing or wrong bearer token.
    #[error("missing or wrong bearer token: send Authorization: Bearer <SANDBOX_HOST_TOKEN>")]
    Unauthorized,
    /// A Host header that is not this loopback listener's.
    #[error(
        "the Host header `{0}` is not this sandbox host's loopback address; requests from other origins are refused"
    )]
    ForeignHost(String),
    /// No such sandbox.
    #[error("no sandbox with id `{0}`")]
    NoSandbox(String),
    /// A route that exists, with a method it does not take (axum adds the `Allow` header).
    #[error(
        "{0} is not allowed on this route; the Allow header lists the methods it takes (see docs/api.md)"
    )]
    MethodNotAllowed(String),
    /// Bad input, with what is wrong.
    #[error("{0}")]
    BadRequest(String),
    /// A body over `SANDBOX_HOST_MAX_BODY_MB`.
    #[error(
        "the request body is larger than {bytes} bytes (SANDBOX_HOST_MAX_BODY_MB={mb}); increase \
         SANDBOX_HOST_MAX_BODY_MB for the sandbox host"
    )]
    TooLarge {
        /// The limit in bytes.
        bytes: u64,
        /// The setting.
        mb: u64,
    },
    /// A path in the guest that does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The guest's kernel refused a path as the guest's files are now (a directory where a file
    /// was asked for, a file where a directory was, a read-only or kernel file system).
    #[error("{0}")]
    PathRefused(String),
    /// The sandbox's VM is gone.
    #[error("the sandbox's VM stopped: {0}")]
    VmDied(String),
    /// The sandbox is paused: resume it before using it.
    #[error("sandbox `{0}` is paused; resume it first (POST /v1/sandboxes/{0}/resume)")]
    Paused(String),
    /// The sandbox cannot be paused or resumed now, with why.
    #[error("{0}")]
    Conflict(String),
    /// The host cannot start microVMs.
    #[error("the sandbox host cannot start a microVM: {0}")]
    Unavailable(String),
    /// The service is stopping or handing over to its next run.
    #[error("{0}")]
    Restarting(String),
    /// The guest's disk or memory is full.
    #[error("{0}")]
    NoSpace(String),
    /// The guest or the VM failed in a way the caller cannot fix.
    #[error("{0}")]
    Internal(String),
    /// A create body larger than a fleet's gateway reads to place it (issue 33).
    #[error(
        "the create's body is larger than {0} bytes, which a fleet's gateway reads to place it; a \
         create needs far less (its variables and egress settings)"
    )]
    CreateTooLarge(usize),
    /// A fleet's gateway could not reach the sandbox host a request needs (issue 33).
    #[error("{0}")]
    HostDown(String),
    /// Nothing in the guest accepts connections on the port a request is for (issue 35).
    #[error("{0}")]
    PortClosed(String),
    /// A signed link to a guest's port that is malformed, forged or expired (issue 35).
    #[error("{0}")]
    LinkRefused(String),
}

impl ApiError {
    /// HTTP status and machine-readable code.
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
            ApiError::ForeignHost(_) => (StatusCode::FORBIDDEN, "foreign_host"),
            ApiError::NoSandbox(_) => (StatusCode::NOT_FOUND, "no_sandbox"),
            ApiError::MethodNotAllowed(_) => (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
            ApiError::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            ApiError::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::PathRefused(_) => (StatusCode::CONFLICT, "path_refused"),
            ApiError::VmDied(_) => (StatusCode::GONE, "vm_died"),
            ApiError::Paused(_) => (StatusCode::CONFLICT, "paused"),
            ApiError::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            ApiError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            ApiError::Restarting(_) => (StatusCode::SERVICE_UNAVAILABLE, "host_restarting"),
            ApiError::NoCapacity(_) => (StatusCode::SERVICE_UNAVAILABLE, "no_capacity"),
            ApiError::NoSpace(_) => (StatusCode::INSUFFICIENT_STORAGE, "no_space"),
            ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            ApiError::HostDown(_) => (StatusCode::SERVICE_UNAVAILABLE, "host_unavailable"),
            ApiError::PortClosed(_) => (StatusCode::BAD_GATEWAY, "port_closed"),
            ApiError::LinkRefused(_) => (StatusCode::FORBIDDEN, "link_refused"),
            ApiError::CreateTooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
        }
    }

    /// Maps an agent or channel failure to the error a caller should see.
    pub fn from_client(e: ClientError) -> ApiError {
        match &e {
            ClientError::Agent(m) => match m.code.as_str() {
                "not_found" => ApiError::NotFound(m.message.clone()),
                "bad_request" | "unsafe_archive" | "spawn_failed" | "bad_stream" => {
                    ApiError::BadRequest(m.message.clone())
                }
                "no_space" => ApiError::NoSpace(m.message.clone()),
                // An agent older than the host (an image or template built before a request
                // kind such as file events existed).
                "unknown_kind" => ApiError::Conflict(format!(
                    "this sandbox's guest agent does not know the request ({}): its image was \
                     built by an older sandbox host; rebuild the image, then make a new sandbox",
                    m.message
                )),
                _ => ApiError::Internal(format!("the guest agent failed: {}", m.message)),
            },
            ClientError::Closed(why) => {
                ApiError::VmDied(format!("the agent channel closed: {why}"))
            }
            _ => ApiError::Internal(e.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        (
            status,
            Json(serde_json::json!({ "error": self.to_string(), "code": code })),
        )
            .into_response()
    }
}
