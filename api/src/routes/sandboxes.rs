//! Sandbox lifecycle: create, list, get, delete, keepalive.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{ApiJson, SandboxId};
use crate::egress::EgressSpec;
use crate::error::ApiError;
use crate::json::{integral, present};
use crate::lifecycle;
use crate::registry::SandboxEntry;
use crate::state::AppState;
use crate::time::rfc3339;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes", post(create).get(list))
        .route("/v1/sandboxes/{id}", get(show).delete(delete))
        .route("/v1/sandboxes/{id}/keepalive", post(keepalive))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRequest {
    run_id: String,
    #[serde(deserialize_with = "integral")]
    time_limit_ms: u64,
    review: bool,
    #[serde(default = "default_memory", deserialize_with = "integral")]
    memory_mib: u32,
    #[serde(default = "default_vcpus", deserialize_with = "integral")]
    vcpus: u8,
    #[serde(default, deserialize_with = "present")]
    image: Option<String>,
    /// The guests' architecture the run needs (`x86_64`, `aarch64`): a host of another refuses
    /// it as it refuses one it has no room for, so a fleet's gateway places it elsewhere.
    #[serde(default, deserialize_with = "present")]
    arch: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default, deserialize_with = "present")]
    harness_version: Option<String>,
    #[serde(default)]
    egress: EgressSpec,
}

fn default_memory() -> u32 {
    4096
}

fn default_vcpus() -> u8 {
    2
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::BadRequest(msg.into())
}

fn validate(r: &CreateRequest) -> Result<(), ApiError> {
    validate_run(&r.run_id, r.time_limit_ms, &r.env, &r.egress)?;
    if !(128..=65_536).contains(&r.memory_mib) {
        return Err(bad(format!(
            "memory_mib must be between 128 and 65536, not {}",
            r.memory_mib
        )));
    }
    if !(1..=32).contains(&r.vcpus) {
        return Err(bad(format!(
            "vcpus must be between 1 and 32, not {}",
            r.vcpus
        )));
    }
    if let Some(e) = r.arch.as_deref().and_then(unknown_arch) {
        return Err(e);
    }
    Ok(())
}

/// The checks of a run's own fields, a create's or a fork's child's.
pub(super) fn validate_run(
    run_id: &str,
    time_limit_ms: u64,
    env: &BTreeMap<String, String>,
    egress: &EgressSpec,
) -> Result<(), ApiError> {
    if run_id.trim().is_empty() || run_id.chars().count() > 200 {
        return Err(bad("run_id must be 1 to 200 characters"));
    }
    if time_limit_ms == 0 || time_limit_ms > 7 * 24 * 3600 * 1000 {
        return Err(bad(
            "time_limit_ms must be between 1 and 604800000 (7 days)",
        ));
    }
    for k in env.keys().chain(egress.secrets.iter().map(|s| &s.env)) {
        if !valid_env_name(k) {
            return Err(bad(format!(
                "`{k}` is not a valid environment variable name"
            )));
        }
    }
    if env.values().any(|v| v.contains('\0')) {
        return Err(bad("env values cannot contain NUL"));
    }
    for h in egress
        .allow
        .iter()
        .chain(&egress.meter)
        .chain(egress.secrets.iter().flat_map(|s| &s.hosts))
    {
        if !valid_host_pattern(h) {
            return Err(bad(format!(
                "`{h}` in egress is not a host name or a `*.domain` wildcard (optionally with `:port`)"
            )));
        }
    }
    if let Some(s) = egress
        .secrets
        .iter()
        .find(|s| s.hosts.is_empty() || s.value.is_empty())
    {
        return Err(bad(format!(
            "egress secret `{}` needs a value and at least one host",
            s.env
        )));
    }
    Ok(())
}

/// The architectures a create may ask for, as `/v1/health` names them.
pub const ARCHES: [&str; 2] = ["x86_64", "aarch64"];

/// The error of an `arch` no host runs (a gateway checks it before placing, with these words).
pub fn unknown_arch(a: &str) -> Option<ApiError> {
    (!ARCHES.contains(&a)).then(|| {
        bad(format!(
            "arch must be x86_64 or aarch64, not `{}`",
            a.chars().take(40).collect::<String>()
        ))
    })
}

/// A run asking for guests of another architecture than this host's gets what a full host
/// answers (`503 no_capacity`): another host may take it, and a gateway sends it on.
fn check_arch(state: &AppState, asked: Option<&str>) -> Result<(), ApiError> {
    let own = &state.availability().arch;
    match asked {
        Some(a) if a != own => Err(ApiError::NoCapacity(format!(
            "this host runs {own} guests and the run asks for {a}: send it to a host of that \
             architecture (a fleet's gateway places it on one)"
        ))),
        _ => Ok(()),
    }
}

fn valid_env_name(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 256
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `example.com`, `api.example.com`, or `*.example.com`, each with an optional `:port`; no IP
/// literals or schemes. The
/// egress stack's own parser, so what the API accepts is exactly what egress enforces.
fn valid_host_pattern(h: &str) -> bool {
    sandbox_egress::policy::HostPattern::parse(h).is_ok()
}

async fn create(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<CreateRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    validate(&req)?;
    check_arch(&state, req.arch.as_deref())?;
    let backend = lifecycle::backend(&state)?;
    let plan = lifecycle::Plan::new(
        &state,
        lifecycle::Asked {
            run_id: req.run_id,
            time_limit: Duration::from_millis(req.time_limit_ms),
            review: req.review,
            memory_mib: req.memory_mib,
            vcpus: req.vcpus,
            image: req.image,
            env: req.env,
            harness_version: req.harness_version,
            egress: req.egress,
        },
    )?;
    let lifecycle::Created { entry, restored } = lifecycle::create(&state, backend, plan).await?;
    let started_from = if restored { "template" } else { "boot" };
    Ok((
        StatusCode::CREATED,
        Json(created(&state, &entry, started_from)),
    ))
}

/// A new sandbox as a create (or a fork, for each child) answers it; logged.
pub(super) fn created(state: &AppState, entry: &SandboxEntry, started_from: &str) -> Value {
    let boot_ms = entry.sandbox().boot_time.as_millis() as u64;
    tracing::info!(
        id = %entry.id,
        run_id = %entry.run_id,
        image = %entry.image,
        stock_image = entry.stock_image,
        boot_ms,
        started_from,
        "Created sandbox"
    );
    json!({
        "id": entry.id,
        "run_id": entry.run_id,
        "image": entry.image,
        "stock_image": entry.stock_image,
        "harness_version_match": entry.harness_version_match,
        "disk_limit_mib": entry.disk_limit_mib,
        "expires_at": rfc3339(entry.expires_at),
        "boot_ms": boot_ms,
        "started_from": started_from,
        "host": state.config().name,
    })
}

/// The summary of a sandbox shown by list and get.
fn summary(e: &SandboxEntry) -> Value {
    // A paused sandbox's VM was stopped on purpose: no reason to show.
    let dead = e.sandbox().vm.exit().filter(|_| !e.is_paused());
    json!({
        "id": e.id,
        "run_id": e.run_id,
        "state": e.state(),
        "reason": dead.map(|x| format!("{}{}", x.reason, sandbox_vmm::backend::console_suffix(&x.console))),
        "image": e.image,
        "stock_image": e.stock_image,
        "memory_mib": e.memory_mib,
        "vcpus": e.vcpus,
        "disk_limit_mib": e.disk_limit_mib,
        "created_at": rfc3339(e.created_at),
        "last_activity_at": rfc3339(e.last_activity().1),
        "expires_at": rfc3339(e.expires_at),
        "boot_ms": e.sandbox().boot_time.as_millis() as u64,
        "execs": e.counters.execs.load(Relaxed),
        "bytes_in": e.counters.bytes_in.load(Relaxed),
        "bytes_out": e.counters.bytes_out.load(Relaxed),
        "egress_settings": {
            "allow": e.egress.allow,
            "meter": e.egress.meter,
            "secrets": e.egress.secrets.iter().map(|s| json!({
                "env": s.env,
                "hosts": s.hosts,
                "headers": s.headers.clone().unwrap_or_else(|| {
                    sandbox_egress::secrets::DEFAULT_HEADERS.iter().map(|h| h.to_string()).collect()
                }),
                // null: the default (a known provider's inference endpoints, elsewhere any).
                "paths": s.paths,
                "wildcard": s.wildcard,
            })).collect::<Vec<_>>(),
            "intercept": if e.egress.intercept.is_some() { "all" } else { "secret_and_meter_hosts" },
            "meter_strict": e.egress.meter_strict,
        },
    })
}

async fn list(State(state): State<AppState>) -> Json<Value> {
    let all: Vec<Value> = state.registry().all().iter().map(|e| summary(e)).collect();
    Json(json!({ "sandboxes": all }))
}

async fn show(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
) -> Result<Json<Value>, ApiError> {
    let e = state.registry().get(&id)?;
    let mut v = summary(&e);
    v["egress"] = super::observe::egress_json(&e).await;
    v["usage"] = super::observe::usage_json(&e).await["totals"].clone();
    Ok(Json(v))
}

async fn delete(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
) -> Result<StatusCode, ApiError> {
    lifecycle::delete(&state, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn keepalive(
    State(state): State<AppState>,
    SandboxId(id): SandboxId,
) -> Result<StatusCode, ApiError> {
    let e = state.registry().get(&id)?;
    e.ensure_alive()?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_patterns() {
        for ok in [
            "api.anthropic.com",
            "*.npmjs.org",
            "registry.npmjs.org",
            "a-b.example.io",
            "registry.example.com:8443",
        ] {
            assert!(valid_host_pattern(ok), "{ok}");
        }
        for bad in [
            "",
            "localhost",
            "1.2.3.4",
            "*.",
            "a..b",
            "-a.com",
            "https://x.com",
            "x.com:0",
            "x.com:99999",
            "*.*.com",
            "[::1]",
            "10.0.0.1",
        ] {
            assert!(!valid_host_pattern(bad), "{bad}");
        }
    }

    fn create_request(body: Value) -> Result<CreateRequest, String> {
        serde_json::from_value(body).map_err(|e| e.to_string())
    }

    /// Found by schemathesis: `"time_limit_ms": 452.0` is the integer 452 (JSON Schema's
    /// `integer`), and was refused as a float.
    #[test]
    fn integers_written_as_floats_are_accepted() {
        let r = create_request(
            json!({"run_id": "r", "time_limit_ms": 452.0, "review": false,
            "memory_mib": 256.0, "vcpus": 1e0}),
        )
        .unwrap();
        assert_eq!((r.time_limit_ms, r.memory_mib, r.vcpus), (452, 256, 1));
        for bad in [
            json!(452.5),
            json!(-1),
            json!(-1.0),
            json!(1e30),
            json!("452"),
        ] {
            let e = create_request(json!({"run_id": "r", "time_limit_ms": bad, "review": false}))
                .unwrap_err();
            assert!(e.contains("invalid"), "{bad}: {e}");
        }
        let e = create_request(json!({"run_id": "r", "time_limit_ms": 1, "review": false,
            "vcpus": 256.0}))
        .unwrap_err();
        assert!(e.contains("256"), "{e}");
    }

    /// `null` for an optional field is refused like any other wrong type, in the egress settings
    /// too (the exec body's null was found by schemathesis; these are the same rule).
    #[test]
    fn null_is_refused_for_optional_fields() {
        let base = json!({"run_id": "r", "time_limit_ms": 1, "review": false});
        for (field, value) in [
            ("image", json!(null)),
            ("harness_version", json!(null)),
            ("memory_mib", json!(null)),
            ("egress", json!({"intercept": null})),
            (
                "egress",
                json!({"secrets": [{"env": "K", "value": "v", "hosts": ["a.com"], "headers": null}]}),
            ),
        ] {
            let mut body = base.clone();
            body[field] = value;
            let e = create_request(body).unwrap_err();
            assert!(e.contains("invalid type: null"), "{field}: {e}");
        }
        let r = create_request(base).unwrap();
        assert!(r.image.is_none() && r.harness_version.is_none());
    }

    /// Found writing the document's patterns: run_id's 200 was counted in bytes, while the
    /// message and the document (maxLength) count characters.
    #[test]
    fn run_id_is_measured_in_characters() {
        let r = |id: String| {
            create_request(json!({"run_id": id, "time_limit_ms": 1, "review": false})).unwrap()
        };
        assert!(validate(&r("é".repeat(200))).is_ok());
        assert!(validate(&r("é".repeat(201))).is_err());
        assert!(validate(&r(" \t".into())).is_err());
    }

    #[test]
    fn env_names() {
        assert!(valid_env_name("ANTHROPIC_API_KEY"));
        assert!(!valid_env_name("1X") && !valid_env_name("A=B") && !valid_env_name(""));
    }
}
