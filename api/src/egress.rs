//! A sandbox's network: its egress stack (the only way out of the guest), the VM's network device
//! on top of it, the guest's address set-up through the agent, and the egress read-outs.

use std::sync::Arc;

use sandbox_egress::intercept::{Interception, MeterPolicy};
use sandbox_egress::meter::Unmetered;

use crate::registry::InterceptMode;
use sandbox_egress::link::GuestEnd;
use sandbox_egress::policy::{Allowlist, HostPattern};
use sandbox_egress::refusal::Reason;
use sandbox_egress::secrets::Secret;
use sandbox_egress::stats::Stats;
use sandbox_egress::{Egress, EgressConfig};
use sandbox_protocol::client::{Client, ExecEvent};
use sandbox_protocol::message::ExecRequest;
use sandbox_vmm::{FrameLink, NetAttachment};
use serde_json::{Value, json};

use crate::config::Config;
use crate::registry::EgressSpec;
use crate::time::rfc3339;

/// The VM's end of the egress link.
struct EgressLink(GuestEnd);

impl FrameLink for EgressLink {
    fn send(&self, frame: &[u8]) -> bool {
        self.0.send(frame)
    }
    fn recv(&self, buf: &mut [u8]) -> Option<usize> {
        self.0.recv(buf)
    }
    fn set_waker(&self, wake: Box<dyn Fn() + Send + Sync>) {
        self.0.set_waker(wake);
    }
}

/// A started egress stack and what the guest needs to use it.
pub struct Started {
    /// The stack.
    pub egress: Egress,
    /// The VM's network device.
    pub attachment: NetAttachment,
    /// The sandbox CA's certificate, when it intercepts anything (the guest must trust it).
    pub ca_pem: Option<String>,
    /// Variables every command of the sandbox gets: each secret's placeholder, and where the CA
    /// is for tools that keep their own trust stores.
    pub env: Vec<(String, String)>,
}

/// The upstream TLS client, made once: loading the system's roots takes tens of milliseconds.
fn upstream_client(
    ca_file: Option<&std::path::Path>,
) -> Result<Arc<sandbox_egress::intercept::ClientConfig>, String> {
    static CLIENT: std::sync::OnceLock<
        Result<Arc<sandbox_egress::intercept::ClientConfig>, String>,
    > = std::sync::OnceLock::new();
    CLIENT
        .get_or_init(|| {
            let pem = match ca_file {
                Some(p) => Some(
                    std::fs::read(p)
                        .map_err(|e| format!("SANDBOX_HOST_EGRESS_CA_FILE {}: {e}", p.display()))?,
                ),
                None => None,
            };
            sandbox_egress::intercept::upstream_client(pem.as_deref()).map_err(|e| e.to_string())
        })
        .clone()
}

/// Starts the egress stack of sandbox `id` with the run's settings, for a guest whose network
/// device has `mac` (the id's own when `None`). The patterns were validated with the create
/// request; a secret value that cannot go into a header is refused here.
pub fn start(
    id: &str,
    spec: &EgressSpec,
    config: &Config,
    mac: Option<[u8; 6]>,
) -> Result<Started, StartError> {
    let secret_hosts = spec.secrets.iter().flat_map(|s| &s.hosts);
    let allow = Allowlist::parse(
        spec.allow
            .iter()
            .chain(&spec.meter)
            .chain(secret_hosts.clone())
            .map(String::as_str),
    )
    .map_err(|e| StartError::Bad(e.to_string()))?;
    let parse = |hs: &mut dyn Iterator<Item = &String>| {
        hs.map(|h| HostPattern::parse(h))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StartError::Bad(e.to_string()))
    };
    let meter = parse(&mut spec.meter.iter())?;
    let mut intercept = parse(&mut spec.meter.iter().chain(secret_hosts))?;
    if spec.intercept == Some(InterceptMode::All) {
        // Every allowed TLS name is read, so each request's Host is checked against it.
        intercept.extend(parse(&mut spec.allow.iter())?);
    }
    let mac = mac.unwrap_or_else(|| sandbox_egress::net::guest_mac(id));
    let mut cfg = EgressConfig::new(mac, allow);
    cfg.overrides = config.egress_resolve.clone();
    cfg.limits.memory = (config.egress_memory_mib as usize) << 20;
    let (mut ca_pem, mut env) = (None, Vec::new());
    if !intercept.is_empty() {
        let secrets = spec
            .secrets
            .iter()
            .map(|s| {
                Secret::scoped(
                    &s.env,
                    &s.value,
                    &s.hosts,
                    s.headers.as_deref(),
                    s.paths.as_deref(),
                    s.wildcard,
                )
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StartError::Bad(e.to_string()))?;
        let client =
            upstream_client(config.egress_ca_file.as_deref()).map_err(StartError::Internal)?;
        let policy = MeterPolicy {
            strict: spec.meter_strict,
            body_max: config.meter_body_max,
        };
        let icp = Interception::new(id, &intercept, secrets, meter, policy, client)
            .map_err(|e| StartError::Internal(e.to_string()))?;
        ca_pem = Some(icp.ca_pem().to_string());
        env = icp.placeholders();
        env.extend(
            sandbox_egress::net::guest_ca_env()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string())),
        );
        cfg.interception = Some(Arc::new(icp));
    }
    cfg.intercept = intercept;
    let (egress, guest) = Egress::start(cfg);
    let link = Arc::new(EgressLink(guest));
    Ok(Started {
        egress,
        attachment: NetAttachment { mac, link },
        ca_pem,
        env,
    })
}

/// Why a sandbox's egress could not start.
#[derive(Debug)]
pub enum StartError {
    /// The request's settings cannot be used.
    Bad(String),
    /// The host's side failed.
    Internal(String),
}

/// Gives the guest its clock, address, route and resolver through the agent (as root), with
/// [`sandbox_egress::net::guest_setup_script`].
pub async fn configure_guest(
    client: &Client,
    mac: [u8; 6],
    ca_pem: Option<&str>,
) -> Result<(), String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let script = sandbox_egress::net::guest_setup_script(mac, now, ca_pem);
    let req = ExecRequest {
        argv: Some(vec!["/bin/sh".into(), "-c".into(), script]),
        cwd: Some("/".into()),
        timeout_ms: Some(10_000),
        ..Default::default()
    };
    let mut exec = client
        .exec(&req)
        .await
        .map_err(|e| format!("setting up the guest's network: {e}"))?;
    let mut stderr = Vec::new();
    while let Some(ev) = exec.output.next().await {
        match ev.map_err(|e| format!("setting up the guest's network: {e}"))? {
            ExecEvent::Stderr(b) if stderr.len() < 4096 => stderr.extend_from_slice(&b),
            ExecEvent::Exit(s) if s.exit_code == Some(0) => return Ok(()),
            ExecEvent::Exit(s) => {
                return Err(format!(
                    "setting up the guest's network failed ({s:?}): {}",
                    String::from_utf8_lossy(&stderr).trim()
                ));
            }
            _ => {}
        }
    }
    Err("setting up the guest's network: the agent ended the command without a status".into())
}

/// `GET /v1/sandboxes/{id}/egress`: the refusals by reason, the most recent refused requests,
/// and what the stack carried.
pub fn egress_json(egress: &Egress) -> Value {
    let s = egress.stats();
    let r = s.refusals();
    let by_reason: serde_json::Map<String, Value> = Reason::ALL
        .iter()
        .filter(|x| r.count(**x) > 0)
        .map(|x| (x.as_str().to_string(), json!(r.count(*x))))
        .collect();
    let (events, dropped) = r.events();
    let events: Vec<Value> = events
        .map(|e| json!({ "at": rfc3339(e.at), "reason": e.reason.as_str(), "target": e.target }))
        .collect();
    let (from_guest, to_guest) = egress.frames_dropped();
    json!({
        "refused": r.total(),
        "by_reason": by_reason,
        "events": events,
        "events_dropped": dropped,
        "connections": {
            "open": Stats::get(&s.open),
            "total": Stats::get(&s.connections),
            "spliced": Stats::get(&s.spliced),
            "intercepted": Stats::get(&s.intercepted),
            "http": Stats::get(&s.http),
            "upstream_failures": Stats::get(&s.upstream_failures),
        },
        "bytes": { "to_upstream": Stats::get(&s.to_upstream), "to_guest": Stats::get(&s.to_guest) },
        "frames_dropped": { "from_guest": from_guest, "to_guest": to_guest },
        "memory": { "held_bytes": egress.memory().0, "limit_bytes": egress.memory().1 },
    })
}

/// Refusal counts of one sandbox by reason label, for `/metrics`.
pub fn refusal_counts(egress: &Egress) -> Vec<(&'static str, u64)> {
    let r = egress.stats().refusals();
    Reason::ALL
        .iter()
        .map(|x| (x.as_str(), r.count(*x)))
        .collect()
}

/// Unmetered model calls of one sandbox by reason label, for `/metrics`.
pub fn unmetered_counts(egress: &Egress) -> Vec<(&'static str, u64)> {
    let t = egress.stats().usage().totals;
    Unmetered::ALL
        .iter()
        .map(|x| (x.as_str(), t.unmetered(*x)))
        .collect()
}

/// `GET /v1/sandboxes/{id}/usage`: the metered calls and their totals.
pub fn usage_json(egress: &Egress) -> Value {
    let u = egress.stats().usage();
    let calls: Vec<Value> = u
        .calls
        .iter()
        .map(|c| {
            let r = c.usage.as_ref();
            json!({
                "at": rfc3339(c.at),
                "host": c.host,
                "status": c.status,
                "complete": c.complete,
                "usage_missing": r.is_none_or(|r| r.estimated),
                "output_tokens_estimated": r.is_some_and(|r| r.estimated),
                "unmetered": c.unmetered.map(Unmetered::as_str),
                "provider": r.map(|r| r.provider),
                "response_id": r.and_then(|r| r.response_id.clone()),
                "model": r.and_then(|r| r.model.clone()),
                "input_tokens": r.map_or(0, |r| r.input_tokens),
                "output_tokens": r.map_or(0, |r| r.output_tokens),
                "cache_read_tokens": r.map_or(0, |r| r.cache_read_tokens),
                "cache_write_tokens": r.map_or(0, |r| r.cache_write_tokens),
                "billed_cost_usd": r.and_then(|r| r.cost),
                "service_tier": r.and_then(|r| r.details.service_tier.clone()),
                "server_tool_use": r.map_or_else(serde_json::Map::new, |r| {
                    r.details
                        .server_tool_use
                        .iter()
                        .map(|(k, n)| (k.clone(), json!(n)))
                        .collect()
                }),
                "cache_write_5m_tokens": r.and_then(|r| r.details.cache_write_5m_tokens),
                "cache_write_1h_tokens": r.and_then(|r| r.details.cache_write_1h_tokens),
                "input_audio_tokens": r.and_then(|r| r.details.input_audio_tokens),
                "output_audio_tokens": r.and_then(|r| r.details.output_audio_tokens),
                "input_image_tokens": r.and_then(|r| r.details.input_image_tokens),
                "output_image_tokens": r.and_then(|r| r.details.output_image_tokens),
                "reasoning_tokens": r.and_then(|r| r.details.reasoning_tokens),
            })
        })
        .collect();
    let t = u.totals;
    json!({
        "calls": calls,
        "calls_dropped": u.dropped,
        "totals": {
            "calls": t.calls,
            "input_tokens": t.input_tokens,
            "output_tokens": t.output_tokens,
            "cache_read_tokens": t.cache_read_tokens,
            "cache_write_tokens": t.cache_write_tokens,
            "billed_cost_usd": t.billed_cost_usd,
            "unmetered_calls": t.unmetered_calls(),
            "unmetered_by_reason": Unmetered::ALL
                .iter()
                .filter(|x| t.unmetered(**x) > 0)
                .map(|x| (x.as_str().to_string(), json!(t.unmetered(*x))))
                .collect::<serde_json::Map<_, _>>(),
        }
    })
}
