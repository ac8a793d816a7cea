//! Sandbox lifecycle: create, list, get, delete, keepalive.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use sandbox_vmm::image::STOCK;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{ApiJson, SandboxId, integral, present};
use crate::error::ApiError;
use crate::registry::{self, EgressSpec, SandboxEntry};
use crate::state::AppState;
use crate::time::rfc3339;

/// The image a create request gets when it names none.
pub const DEFAULT_IMAGE: &str = "vantik-guest:latest";

/// Disk limit of a run with the review cycle, and without (MiB), from the operator guide.
const DISK_LIMIT_REVIEW_MIB: u64 = 30_720;
const DISK_LIMIT_MIB: u64 = 20_480;

/// Longest a sandbox may take to boot before the create fails (TCG boots take seconds).
pub(super) const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// The longest the guest's network set-up may take, host side.
const NET_SETUP_TIMEOUT: Duration = Duration::from_secs(30);

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
    if r.run_id.trim().is_empty() || r.run_id.chars().count() > 200 {
        return Err(bad("run_id must be 1 to 200 characters"));
    }
    if r.time_limit_ms == 0 || r.time_limit_ms > 7 * 24 * 3600 * 1000 {
        return Err(bad(
            "time_limit_ms must be between 1 and 604800000 (7 days)",
        ));
    }
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
    for k in r.env.keys().chain(r.egress.secrets.iter().map(|s| &s.env)) {
        if !valid_env_name(k) {
            return Err(bad(format!(
                "`{k}` is not a valid environment variable name"
            )));
        }
    }
    if r.env.values().any(|v| v.contains('\0')) {
        return Err(bad("env values cannot contain NUL"));
    }
    for h in r
        .egress
        .allow
        .iter()
        .chain(&r.egress.meter)
        .chain(r.egress.secrets.iter().flat_map(|s| &s.hosts))
    {
        if !valid_host_pattern(h) {
            return Err(bad(format!(
                "`{h}` in egress is not a host name or a `*.domain` wildcard (optionally with `:port`)"
            )));
        }
    }
    if let Some(s) = r
        .egress
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
    let Some(backend) = state.backend().cloned() else {
        let reason = state
            .availability()
            .reason
            .clone()
            .unwrap_or_else(|| "no backend".into());
        return Err(ApiError::Unavailable(reason));
    };
    let wanted = req
        .image
        .clone()
        .unwrap_or_else(|| DEFAULT_IMAGE.to_string());
    // Looked up now, so a newly built image applies to this sandbox without a restart.
    let (image, stock_image) = match state.store().resolve(&wanted) {
        Ok(img) => {
            let stock = wanted == STOCK;
            (img, stock)
        }
        Err(sandbox_vmm::ImageError::Missing { .. }) => {
            let img = state
                .store()
                .resolve(STOCK)
                .map_err(|e| ApiError::Unavailable(e.to_string()))?;
            tracing::warn!(wanted = %wanted, "image not in the image store; using the stock image (/workspace in memory)");
            (img, true)
        }
        Err(e) => return Err(bad(e.to_string())),
    };
    let harness_version_match = match (&req.harness_version, &image.harness_version) {
        (Some(want), Some(have)) => Some(want == have),
        _ => None,
    };
    let id = registry::new_id();
    let disk_limit_mib = if req.review {
        DISK_LIMIT_REVIEW_MIB
    } else {
        DISK_LIMIT_MIB
    };
    let spec = image.vm_spec(
        id.clone(),
        req.memory_mib,
        req.vcpus,
        disk_limit_mib,
        state.config().state_dir.join(&id),
    );
    // Admission: the sandbox's share of the host's budgets, held until it is gone.
    let reservation = state
        .capacity()
        .reserve(
            u64::from(req.memory_mib),
            state.config().egress_memory_mib + crate::netproc::ALLOWANCE_MIB,
            spec.scratch_disk_mib.unwrap_or(0),
        )
        .map_err(|why| {
            state.metrics().refused_for_capacity();
            ApiError::NoCapacity(why)
        })?;
    // A sandbox of a shape that has a template is restored from it; a
    // template that fails is discarded and the sandbox boots cold (templates.rs).
    let shape = crate::templates::Shape {
        image_dir: image.dir.clone(),
        memory_mib: req.memory_mib,
        vcpus: req.vcpus,
        disk_mib: spec.scratch_disk_mib,
    };
    // On the KVM backend every sandbox can be paused: its VM gets, at start, the two files its
    // snapshot goes to (created empty here; the VM process opens nothing itself).
    let pause_dir = state.config().state_dir.join(format!("{id}.paused"));
    let mut spec = spec;
    let pausable_files = if backend.name() == "kvm" {
        match snapshot_files(&pause_dir)
            .and_then(|a| Ok([a, snapshot_files(&pause_dir.join("b"))?]))
        {
            Ok(f) => Some(f),
            Err(e) => {
                return Err(ApiError::Internal(format!(
                    "creating the sandbox's snapshot files in {}: {e}",
                    pause_dir.display()
                )));
            }
        }
    } else {
        None
    };
    spec.snapshot_to = pausable_files.as_ref().map(|f| f[0].clone());
    let base_spec = spec.clone();
    let template = state.templates().and_then(|t| t.get(&shape));
    let from_template = template.is_some();
    let booted = match template {
        Some(t) => {
            match start_vm(&state, backend.as_ref(), &id, &req, spec.clone(), Some(&t)).await {
                Err(e @ ApiError::BadRequest(_)) => return Err(e),
                Err(e) => {
                    if let Some(templates) = state.templates() {
                        templates.discard(&shape, &e.to_string());
                    }
                    start_vm(&state, backend.as_ref(), &id, &req, spec, None)
                        .await
                        .map(|b| (b, false))
                }
                Ok(b) => Ok((b, true)),
            }
        }
        None => start_vm(&state, backend.as_ref(), &id, &req, spec, None)
            .await
            .map(|b| (b, false)),
    };
    let ((sandbox, started), restored) = match booted {
        Ok(b) => b,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&pause_dir);
            return Err(e);
        }
    };
    let pausable = pausable_files.map(|files| registry::Pausable {
        dir: pause_dir.clone(),
        files,
        slot: std::sync::atomic::AtomicUsize::new(0),
        vm_dir: std::sync::Mutex::new(base_spec.state_dir.clone()),
        resumes: std::sync::atomic::AtomicU64::new(0),
        spec: base_spec,
        mac: started.mac,
    });
    if !from_template && let Some(templates) = state.templates() {
        // The first sandbox of its shape: the next ones are restored.
        templates.ensure(&state, backend.clone(), image.clone(), shape);
    }
    state.metrics().started(restored);
    state.metrics().boot(sandbox.boot_time);
    let image_name = if stock_image {
        STOCK.to_string()
    } else {
        wanted
    };
    let entry = registry::new_entry(
        &state,
        id,
        req.run_id,
        image_name,
        stock_image,
        harness_version_match,
        disk_limit_mib,
        req.memory_mib,
        req.vcpus,
        // The secrets' placeholders (and the CA's paths) for every command.
        req.env.into_iter().chain(started.env).collect(),
        without_values(req.egress),
        Some(started.egress),
        Duration::from_millis(req.time_limit_ms),
        sandbox,
        reservation,
        pausable,
    );
    tracing::info!(
        id = %entry.id,
        run_id = %entry.run_id,
        image = %entry.image,
        stock_image = entry.stock_image,
        boot_ms = entry.sandbox().boot_time.as_millis() as u64,
        started_from = if restored { "template" } else { "boot" },
        "Created sandbox"
    );
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "id": entry.id,
            "run_id": entry.run_id,
            "image": entry.image,
            "stock_image": entry.stock_image,
            "harness_version_match": entry.harness_version_match,
            "disk_limit_mib": entry.disk_limit_mib,
            "expires_at": rfc3339(entry.expires_at),
            "boot_ms": entry.sandbox().boot_time.as_millis() as u64,
            "started_from": if restored { "template" } else { "boot" },
        })),
    ))
}

/// The egress stack and what the create's boot needs of it, once the guest is configured.
struct Started {
    egress: std::sync::Arc<crate::netproc::NetProcess>,
    env: Vec<(String, String)>,
    /// The guest's MAC address, for a resume.
    mac: [u8; 6],
}

/// Two empty files for a sandbox's snapshot, in a directory of their own.
fn snapshot_files(dir: &std::path::Path) -> std::io::Result<sandbox_vmm::SnapshotFiles> {
    std::fs::create_dir_all(dir)?;
    let files = sandbox_vmm::SnapshotFiles {
        state: dir.join("snapshot.state"),
        memory: dir.join("snapshot.mem"),
        disk: None,
        take_disk: false,
    };
    for p in [&files.state, &files.memory] {
        std::fs::File::create(p)?;
    }
    Ok(files)
}

/// Starts the sandbox's egress, then its VM (restored from `template` or booted), then gives
/// the guest its network and CA. On failure nothing of it is left.
async fn start_vm(
    state: &AppState,
    backend: &dyn sandbox_vmm::Backend,
    id: &str,
    req: &CreateRequest,
    mut spec: sandbox_vmm::VmSpec,
    template: Option<&crate::templates::Template>,
) -> Result<(sandbox_vmm::Sandbox, Started), ApiError> {
    // The egress stack starts first: the VM's network device is its other end. A clone keeps
    // the template's MAC address, which its guest's driver read at the template's boot.
    let started = crate::egress::start(id, &req.egress, state.config(), template.map(|t| t.mac))
        .await
        .map_err(|e| match e {
            crate::netproc::NetProcessError::Bad(m) => bad(m),
            crate::netproc::NetProcessError::Internal(m) => {
                ApiError::Internal(format!("the sandbox's egress could not start: {m}"))
            }
        })?;
    let mac = started.attachment.mac;
    spec.net = Some(started.attachment);
    spec.restore_from = template.map(|t| t.files.clone());
    let liveness = state.config().liveness();
    let sandbox = match sandbox_vmm::boot_watched(backend, spec, BOOT_TIMEOUT, liveness).await {
        Ok(s) => s,
        Err(e) => {
            state.metrics().boot_failed();
            tracing::error!(run_id = %req.run_id, error = %e, restored = template.is_some(), "a sandbox did not start");
            return Err(ApiError::Internal(format!(
                "the microVM did not start: {e}"
            )));
        }
    };
    // The guest's own timeout for the script is 10 s; the host's bound covers a guest that
    // never answers at all.
    // Either failure carries the guest's last console lines: a guest that closed its channel
    // has usually said why there.
    let console = || {
        sandbox_vmm::backend::console_suffix(&sandbox_vmm::sandbox::diagnostic_lines(
            sandbox.vm.as_ref(),
        ))
    };
    let configured = match tokio::time::timeout(
        NET_SETUP_TIMEOUT,
        crate::egress::configure_guest(&sandbox.client, mac, started.ca_pem.as_deref()),
    )
    .await
    {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("{e}{}", console())),
        Err(_) => Err(format!(
            "the guest did not finish its network set-up within {NET_SETUP_TIMEOUT:?}{}",
            console()
        )),
    };
    if let Err(e) = configured {
        sandbox.stop().await;
        state.metrics().boot_failed();
        tracing::error!(run_id = %req.run_id, error = %e, "a sandbox's network could not be set up");
        return Err(ApiError::Internal(format!(
            "the microVM started but its network could not be set up: {e}"
        )));
    }
    Ok((
        sandbox,
        Started {
            egress: started.net,
            env: started.env,
            mac,
        },
    ))
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
    registry::delete(&state, &id).await?;
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

/// The run's egress as the registry keeps it: the secrets' values go (issue 32: the network
/// process holds them; the service keeps what it shows, each secret's variable and hosts, and
/// never needs a value again).
fn without_values(mut spec: crate::registry::EgressSpec) -> crate::registry::EgressSpec {
    for s in &mut spec.secrets {
        zeroize::Zeroize::zeroize(&mut s.value);
    }
    spec
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
