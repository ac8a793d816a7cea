//! The gateway's routes: the API of `routes/`, each answered by the fleet's hosts.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use sha2::Digest;

use super::config::GatewayConfig;
use super::fleet::{Fleet, Host};
use super::place;
use super::proxy;
use crate::error::ApiError;

/// The gateway's state, shared by every handler.
#[derive(Clone)]
pub struct Gateway(Arc<Inner>);

struct Inner {
    config: GatewayConfig,
    token_digest: [u8; 32],
    fleet: Arc<Fleet>,
    rng: Mutex<place::Rng>,
    /// Sandboxes made, by host.
    placements: Mutex<BTreeMap<String, u64>>,
    /// Creates a host refused or did not take, sent on to the next.
    failovers: AtomicU64,
}

impl Gateway {
    /// The gateway of `fleet`.
    pub fn new(config: GatewayConfig, fleet: Arc<Fleet>) -> Gateway {
        Gateway(Arc::new(Inner {
            token_digest: sha2::Sha256::digest(config.token.as_bytes()).into(),
            config,
            fleet,
            rng: Mutex::new(place::Rng::new()),
            placements: Mutex::default(),
            failovers: AtomicU64::new(0),
        }))
    }
}

/// The whole application.
pub fn app(gw: Gateway) -> Router {
    let mut router = Router::new()
        .route("/v1/health", get(health))
        .route("/v1/hosts/{name}/drain", axum::routing::put(drain))
        .route("/v1/sandboxes", post(create).get(list))
        .route("/metrics", get(metrics));
    // A sandbox's routes, each with the methods a host takes on it (its own table): another
    // method is the host's `405` with its `Allow`, not a trip to the host.
    let mut by_path: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (method, path) in crate::routes::ROUTES {
        // A guest's ports take any method and path (below).
        if path.starts_with("/v1/sandboxes/{id}") && !path.contains("/ports/") {
            by_path.entry(path).or_default().push(method);
        }
    }
    for (path, methods) in by_path {
        let mut on = axum::routing::MethodRouter::new();
        for m in methods {
            let filter = match m {
                "GET" => axum::routing::MethodFilter::GET,
                "POST" => axum::routing::MethodFilter::POST,
                "PUT" => axum::routing::MethodFilter::PUT,
                "DELETE" => axum::routing::MethodFilter::DELETE,
                _ => continue,
            };
            on = on.on(filter, by_id);
        }
        router = router.route(path, on);
    }
    for path in [
        "/v1/sandboxes/{id}/ports/{port}",
        "/v1/sandboxes/{id}/ports/{port}/",
        "/v1/sandboxes/{id}/ports/{port}/{*path}",
    ] {
        router = router.route(
            path,
            axum::routing::on(crate::routes::ports::methods(), by_port),
        );
    }
    router
        .route(
            "/p/{link}",
            axum::routing::on(crate::routes::ports::methods(), by_link),
        )
        .route(
            "/p/{link}/",
            axum::routing::on(crate::routes::ports::methods(), by_link),
        )
        .route(
            "/p/{link}/{*path}",
            axum::routing::on(crate::routes::ports::methods(), by_link),
        )
        .fallback(by_cookie)
        .layer(middleware::from_fn(crate::routes::json_405))
        .layer(middleware::from_fn_with_state(gw.clone(), declared_length))
        .layer(middleware::from_fn_with_state(gw.clone(), require_token))
        .with_state(gw)
}

async fn require_token(
    State(gw): State<Gateway>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if crate::auth::is_signed_link(req.uri().path())
        || (crate::port_link::cookie_may_route(req.uri().path())
            && crate::port_link::from_cookie(req.headers()).is_some())
    {
        // Its host checks the link's signature; the gateway only reads where it goes.
        crate::auth::check_host(gw.0.config.bind.is_loopback(), &req)?;
    } else {
        crate::auth::check(gw.0.config.bind.is_loopback(), &gw.0.token_digest, &req)?;
    }
    Ok(next.run(req).await)
}

/// A request to a guest's port, to the host the id names.
async fn by_port(
    State(gw): State<Gateway>,
    axum::extract::Path(params): axum::extract::Path<Vec<(String, String)>>,
    req: Request,
) -> Response {
    let id = params
        .iter()
        .find(|(k, _)| k == "id")
        .map_or(String::new(), |(_, v)| v.clone());
    route(&gw, &id, req).await
}

/// A path of no route: a guest's page under a signed link (its cookie) goes to the link's host;
/// anything else is not found.
async fn by_cookie(State(gw): State<Gateway>, req: Request) -> Response {
    let link = crate::port_link::from_cookie(req.headers())
        .filter(|_| crate::port_link::cookie_may_route(req.uri().path()));
    match link.map(|l| crate::port_link::read_unchecked(&l)) {
        Some(Ok(grant)) => route_as(&gw, &grant.id, req, false).await,
        Some(Err(e)) => ApiError::LinkRefused(e.to_string()).into_response(),
        None => ApiError::NotFound("no such route; see docs/api.md".into()).into_response(),
    }
}

/// A signed link to a guest's port, sent to the host of the sandbox it names (unchecked here:
/// the host that made it checks it).
async fn by_link(
    State(gw): State<Gateway>,
    axum::extract::Path(params): axum::extract::Path<Vec<(String, String)>>,
    req: Request,
) -> Response {
    let link = params
        .iter()
        .find(|(k, _)| k == "link")
        .map_or("", |(_, v)| v.as_str());
    match crate::port_link::read_unchecked(link) {
        Ok(grant) => route_as(&gw, &grant.id, req, false).await,
        Err(e) => ApiError::LinkRefused(e.to_string()).into_response(),
    }
}

fn too_large(gw: &Gateway) -> ApiError {
    ApiError::TooLarge {
        bytes: gw.0.config.max_body,
        mb: gw.0.config.max_body_mb,
    }
}

/// A body whose declared length is over the limit is refused before any of it is read, as a
/// host refuses it; a body without a declared length is bounded by the host it streams to.
async fn declared_length(
    State(gw): State<Gateway>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if crate::routes::declared_over(req.headers(), gw.0.config.max_body) {
        return Err(too_large(&gw));
    }
    Ok(next.run(req).await)
}

/// The error of a sandbox whose host did not answer, in the words of the contract.
fn host_down(name: &str, id: &str, why: &str) -> ApiError {
    ApiError::HostDown(format!(
        "The sandbox host {name} that holds {id} did not answer ({why}); retry later, or make a \
         new sandbox"
    ))
}

async fn by_id(
    State(gw): State<Gateway>,
    crate::routes::SandboxId(id): crate::routes::SandboxId,
    req: Request,
) -> Response {
    route(&gw, &id, req).await
}

/// Sends a request about sandbox `id` to the host its id names.
async fn route(gw: &Gateway, id: &str, req: Request) -> Response {
    route_as(gw, id, req, true).await
}

/// [`route`], with the host token only when `authenticated` (a signed link's request goes to
/// its host without it, and its failures say nothing of the fleet).
async fn route_as(gw: &Gateway, id: &str, req: Request, authenticated: bool) -> Response {
    let Some(Some(name)) = crate::registry::host_of(id) else {
        return ApiError::NoSandbox(id.chars().take(100).collect()).into_response();
    };
    let Some(host) = gw.0.fleet.by_name(name) else {
        return ApiError::NoSandbox(id.to_string()).into_response();
    };
    let token = authenticated.then(|| gw.0.fleet.host_token());
    match proxy::forward_as(gw.0.fleet.client(), &host.url, token, req).await {
        Ok(res) => res,
        Err(e) => {
            if e.before_sending {
                host.failed(e.why.clone());
            }
            if authenticated {
                host_down(name, id, &e.why).into_response()
            } else {
                ApiError::HostDown(
                    "the sandbox host that holds this link's sandbox did not answer; retry later"
                        .into(),
                )
                .into_response()
            }
        }
    }
}

/// `PUT /v1/hosts/{name}/drain`: to the host named, which then takes no new sandboxes (the next
/// poll sees it; the gateway stops placing on it at once).
async fn drain(State(gw): State<Gateway>, Path(name): Path<String>, req: Request) -> Response {
    // The body as a host checks it, before the host is looked for (a host's order).
    let (parts, body) = req.into_parts();
    let bytes = match http_body_util::Limited::new(body, 64 << 10).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => return ApiError::BadRequest(format!("the body: {e}")).into_response(),
    };
    if let Err(e) =
        crate::routes::json_body::<crate::routes::health::DrainRequest>(&parts.headers, &bytes)
    {
        return e.into_response();
    }
    let req = Request::from_parts(parts, Body::from(bytes));
    let Some(host) = gw.0.fleet.by_name(&name) else {
        return ApiError::NotFound(format!(
            "no host `{}` in this fleet (GET /v1/health lists its hosts)",
            name.chars().take(64).collect::<String>()
        ))
        .into_response();
    };
    match proxy::forward(gw.0.fleet.client(), &host.url, gw.0.fleet.host_token(), req).await {
        Ok(res) if res.status().is_success() => {
            // The host's answer says what it is now; a draining host gets no create from here
            // on, whatever a poll under way saw before.
            let (parts, body) = res.into_parts();
            let body = http_body_util::Limited::new(body, 64 << 10)
                .collect()
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            let said: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            if said["draining"] == true {
                host.draining();
            }
            gw.0.fleet.poll_now().await;
            Response::from_parts(parts, Body::from(body))
        }
        Ok(res) => res,
        Err(e) => ApiError::HostDown(format!(
            "The sandbox host {name} did not answer ({}); retry later",
            e.why
        ))
        .into_response(),
    }
}

/// How much a create body may be when the gateway reads it to place it (a create's JSON is
/// small; the host applies its own limit to it again).
const CREATE_MAX: usize = 1 << 20;

/// `POST /v1/sandboxes`: placed on a host that takes it (`place.rs`), sent on to the next when a
/// host refuses it for room (`503 no_capacity`), is restarting, cannot start VMs, or cannot be
/// reached. The host's answer comes back as it is, naming the host (`host`).
async fn create(State(gw): State<Gateway>, req: Request) -> Result<Response, ApiError> {
    let (parts, mut body) = req.into_parts();
    // Read up to CREATE_MAX; past it, the rest is read and dropped (within the body limit) so the
    // answer reaches a client still sending, rather than a reset.
    let (mut kept, mut seen) = (Vec::new(), 0u64);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ApiError::BadRequest(format!("the create's body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            seen += data.len() as u64;
            if seen > gw.0.config.max_body {
                return Err(too_large(&gw));
            }
            if kept.len() + data.len() <= CREATE_MAX {
                kept.extend_from_slice(&data);
            }
        }
    }
    if seen as usize > CREATE_MAX {
        return Err(ApiError::CreateTooLarge(CREATE_MAX));
    }
    let bytes = axum::body::Bytes::from(kept);
    // The host checks the request; the gateway reads only what places it.
    let asked: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let image = asked["image"].as_str().map(str::to_string);
    let memory = asked["memory_mib"].as_u64().unwrap_or(4096);
    let arch = asked["arch"].as_str();
    if let Some(e) = arch.and_then(crate::routes::sandboxes::unknown_arch) {
        return Err(e);
    }
    let hosts: Vec<(Arc<Host>, super::fleet::Seen)> =
        gw.0.fleet
            .all()
            .into_iter()
            .map(|h| {
                let s = h.seen();
                (h, s)
            })
            .filter(|(_, s)| s.takes_sandboxes && arch.is_none_or(|a| s.arch == a))
            .collect();
    if hosts.is_empty() {
        return Err(ApiError::NoCapacity(no_host_reason(&gw, arch)));
    }
    // Hosts with the image first; where none has it, any (a host makes it from its stock image,
    // as a lone host does, and says so).
    let with_image: Vec<(Arc<Host>, super::fleet::Seen)> = match &image {
        Some(i) => hosts
            .iter()
            .filter(|(_, s)| s.images.iter().any(|n| n == i))
            .cloned()
            .collect(),
        None => hosts.clone(),
    };
    let pool = if with_image.is_empty() {
        hosts
    } else {
        with_image
    };
    let free: Vec<u64> = pool.iter().map(|(_, s)| s.free_memory_mib).collect();
    let order = {
        let mut rng = gw.0.rng.lock().unwrap_or_else(|e| e.into_inner());
        place::order(&free, memory, &mut rng)
    };
    let mut last: Option<Response> = None;
    for i in order {
        let (host, seen) = &pool[i];
        let name = seen.name.clone().unwrap_or_default();
        let mut out = Request::builder()
            .method(parts.method.clone())
            .uri(parts.uri.clone())
            .body(Body::from(bytes.clone()))
            .map_err(|e| ApiError::Internal(format!("the create could not be passed on: {e}")))?;
        *out.headers_mut() = parts.headers.clone();
        match proxy::forward(gw.0.fleet.client(), &host.url, gw.0.fleet.host_token(), out).await {
            Ok(res) if res.status() == StatusCode::SERVICE_UNAVAILABLE => {
                // Read (bounded) to pass on the last refusal if every host refuses.
                let (p, b) = res.into_parts();
                let body = http_body_util::Limited::new(b, 64 << 10)
                    .collect()
                    .await
                    .map(|c| c.to_bytes())
                    .unwrap_or_default();
                tracing::info!(host = %name, "A host refused a create; trying the next");
                gw.0.failovers.fetch_add(1, Relaxed);
                last = Some(Response::from_parts(p, Body::from(body)));
            }
            Ok(res) => {
                if res.status() == StatusCode::CREATED {
                    host.placed(memory);
                    *gw.0
                        .placements
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(name)
                        .or_default() += 1;
                }
                return Ok(res);
            }
            Err(e) if e.before_sending => {
                tracing::warn!(host = %name, "A host did not answer a create; trying the next: {}", e.why);
                host.failed(e.why);
                gw.0.failovers.fetch_add(1, Relaxed);
            }
            Err(e) => {
                // The create reached the host: it may have made the sandbox. Not sent again.
                host.failed(e.why.clone());
                return Err(ApiError::HostDown(format!(
                    "The sandbox host {name} stopped answering during the create ({}); the sandbox \
                     may exist there: list the sandboxes to see, then retry",
                    e.why
                )));
            }
        }
    }
    Ok(last.unwrap_or_else(|| ApiError::NoCapacity(no_host_reason(&gw, arch)).into_response()))
}

/// Why no host takes a create (of guests of `arch`, when it names one), host by host.
fn no_host_reason(gw: &Gateway, arch: Option<&str>) -> String {
    let why: Vec<String> =
        gw.0.fleet
            .all()
            .iter()
            .map(|h| {
                let s = h.seen();
                let why = match (s.reason, arch) {
                    (Some(r), _) => r,
                    (None, Some(a)) if s.arch != a => format!("it runs {} guests", s.arch),
                    (None, _) => "no room".into(),
                };
                format!("{}: {why}", s.name.unwrap_or_else(|| h.url.to_string()))
            })
            .collect();
    let of = arch.map(|a| format!(" of {a} guests")).unwrap_or_default();
    format!(
        "no sandbox host of this fleet takes a sandbox{of} now ({}); retry when a run ends, or add hosts",
        if why.is_empty() {
            "no host found".into()
        } else {
            why.join("; ")
        }
    )
}

/// `GET /v1/sandboxes`: every host's list, merged; the hosts that did not answer are named.
async fn list(State(gw): State<Gateway>, req: Request) -> Response {
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let mut asks = tokio::task::JoinSet::new();
    for h in gw.0.fleet.all() {
        let Some(name) = h.name() else { continue };
        let (client, token, query) = (
            gw.0.fleet.client().clone(),
            gw.0.fleet.host_token().to_string(),
            query.clone(),
        );
        asks.spawn(async move {
            let req = Request::get(format!("/v1/sandboxes{query}"))
                .body(Body::empty())
                .expect("a plain request");
            let got = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                let res = proxy::forward(&client, &h.url, &token, req)
                    .await
                    .map_err(|e| e.why)?;
                let ok = res.status().is_success();
                let body = http_body_util::Limited::new(res.into_body(), 64 << 20)
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                let v: Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
                if !ok {
                    return Err(v["error"].as_str().unwrap_or("an error").to_string());
                }
                Ok(v)
            })
            .await
            .unwrap_or_else(|_| Err("no answer within 5 s".into()));
            (name, got)
        });
    }
    let mut sandboxes = vec![];
    let mut unreachable = vec![];
    while let Some(Ok((name, got))) = asks.join_next().await {
        match got {
            Ok(v) => sandboxes.extend(v["sandboxes"].as_array().cloned().unwrap_or_default()),
            Err(why) => unreachable.push(json!({"host": name, "error": why})),
        }
    }
    sandboxes.sort_by(|a, b| a["created_at"].as_str().cmp(&b["created_at"].as_str()));
    axum::Json(json!({"sandboxes": sandboxes, "unreachable": unreachable})).into_response()
}

/// `GET /v1/health`: available when any host takes sandboxes; the capacity summed, a row per host.
/// Each host is asked again first (one poll shared by the health requests that come during it),
/// so what it says is the hosts' own figures of now, not the gateway's estimate since the last
/// poll.
async fn health(State(gw): State<Gateway>) -> Response {
    gw.0.fleet.poll_now().await;
    let mut rows = vec![];
    let mut sandboxes = 0u64;
    let mut capacities = vec![];
    let mut available = false;
    for h in gw.0.fleet.all() {
        let s = h.seen();
        if s.up {
            sandboxes += s.health["sandboxes"].as_u64().unwrap_or(0);
            capacities.push(s.health["capacity"].clone());
        }
        available |= s.takes_sandboxes;
        rows.push(json!({
            "name": s.name,
            "url": h.url.to_string(),
            "up": s.up,
            "takes_sandboxes": s.takes_sandboxes,
            "draining": s.health["draining"].as_bool().unwrap_or(false),
            "reason": s.reason,
            "sandboxes": s.sandboxes,
            "arch": s.arch,
            "images": s.images,
            "capacity": s.health["capacity"],
            "backend": s.health["backend"],
            "version": s.health["version"],
        }));
    }
    let reason = (!available).then(|| no_host_reason(&gw, None));
    // What the API says of one host (its backend, accelerator, guests' architecture, default
    // image) is said of one that takes sandboxes, else of any that answered.
    let seen: Vec<_> = gw.0.fleet.all().iter().map(|h| h.seen()).collect();
    let one = seen
        .iter()
        .find(|s| s.takes_sandboxes)
        .or_else(|| seen.iter().find(|s| s.up))
        .map(|s| s.health.clone())
        .unwrap_or(Value::Null);
    axum::Json(json!({
        "role": "gateway",
        "available": available,
        "reason": reason,
        "backend": one["backend"].as_str().unwrap_or("qemu"),
        "accel": one["accel"].as_str().unwrap_or("none"),
        "arch": one["arch"].as_str().unwrap_or(std::env::consts::ARCH),
        "image": if one["image"].is_object() { one["image"].clone() } else { json!({}) },
        "version": env!("CARGO_PKG_VERSION"),
        "sandboxes": sandboxes,
        "capacity": summed(&capacities),
        "hosts": rows,
    }))
    .into_response()
}

/// The hosts' capacities as one host's: amounts (sandboxes, committed, free, limits, open
/// descriptors) summed, settings (`overcommit`, `per_sandbox`) as the first host has them.
fn summed(capacities: &[Value]) -> Value {
    const AMOUNTS: [(&str, &[&str]); 3] = [
        ("memory_mib", &["committed", "limit", "free"]),
        ("disk_mib", &["committed", "free"]),
        ("fds", &["open", "limit"]),
    ];
    const SETTINGS: [(&str, &str); 2] = [("disk_mib", "overcommit"), ("fds", "per_sandbox")];
    let total = |f: &dyn Fn(&Value) -> &Value| -> u64 {
        capacities
            .iter()
            .map(|c| f(c).as_u64().unwrap_or(0))
            .fold(0, u64::saturating_add)
    };
    let mut out = json!({"sandboxes": total(&|c| &c["sandboxes"])});
    for (group, fields) in AMOUNTS {
        for field in fields {
            out[group][*field] = json!(total(&|c| &c[group][*field]));
        }
    }
    for (group, field) in SETTINGS {
        if let Some(v) = capacities.first().and_then(|c| c[group][field].as_u64()) {
            out[group][field] = json!(v);
        }
    }
    out
}

/// `GET /metrics`: the gateway's own counters (each host is scraped on its own).
async fn metrics(State(gw): State<Gateway>) -> Response {
    let mut out = String::new();
    out.push_str("# HELP sandbox_gateway_placements_total Sandboxes made through this gateway, by host.\n# TYPE sandbox_gateway_placements_total counter\n");
    for (host, n) in
        gw.0.placements
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
    {
        out.push_str(&format!(
            "sandbox_gateway_placements_total{{host=\"{host}\"}} {n}\n"
        ));
    }
    out.push_str(&format!(
        "# HELP sandbox_gateway_failovers_total Creates a host refused or did not answer, sent on to the next.\n# TYPE sandbox_gateway_failovers_total counter\nsandbox_gateway_failovers_total {}\n",
        gw.0.failovers.load(Relaxed)
    ));
    out.push_str("# HELP sandbox_gateway_host_up Whether the host answered the last poll.\n# TYPE sandbox_gateway_host_up gauge\n");
    for h in gw.0.fleet.all() {
        let s = h.seen();
        let name = s.name.unwrap_or_else(|| h.url.to_string());
        out.push_str(&format!(
            "sandbox_gateway_host_up{{host=\"{name}\"}} {}\n",
            u8::from(s.up)
        ));
    }
    out.push_str(&format!(
        "# HELP sandbox_gateway_polls_total Health polls of the fleet.\n# TYPE sandbox_gateway_polls_total counter\nsandbox_gateway_polls_total {}\n",
        gw.0.fleet.polls.load(Relaxed)
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}
