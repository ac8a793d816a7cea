//! A sandbox's network: its egress stack (the only way out of the guest), the VM's network device
//! on top of it, the guest's address set-up through the agent, and the egress read-outs.

use std::sync::Arc;

use sandbox_control::link::NetLink;
use sandbox_control::net::{NetConfig, Report, SecretConfig};
use sandbox_egress::meter::Unmetered;
use sandbox_egress::refusal::Reason;
use sandbox_protocol::client::{Client, ExecEvent};
use sandbox_protocol::message::ExecRequest;
use sandbox_vmm::NetAttachment;

use crate::netproc::{NetProcess, NetProcessError};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::config::Config;
use crate::time::rfc3339;

/// A secret of a run: the guest sees only a placeholder; the egress stack puts the value in
/// requests to `hosts` (issue 5). Never printed.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretSpec {
    /// Environment variable the guest's SDK reads.
    pub env: String,
    /// The real key.
    pub value: String,
    /// Hosts that may receive it.
    pub hosts: Vec<String>,
    /// Request headers the placeholder is replaced in (default `authorization`, `x-api-key`).
    #[serde(default, deserialize_with = "crate::json::present")]
    pub headers: Option<Vec<String>>,
    /// Path prefixes the key may be sent to (default: a known provider's inference endpoints
    /// on its host, any path on other hosts).
    #[serde(default, deserialize_with = "crate::json::present")]
    pub paths: Option<Vec<String>>,
    /// A `*.domain` host is meant: every name under it is the run's.
    #[serde(default)]
    pub wildcard: bool,
}

impl Drop for SecretSpec {
    /// The value is overwritten wherever a copy ends, a create that fails or is cancelled
    /// midway (its client went away) included.
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.value);
    }
}

impl std::fmt::Debug for SecretSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretSpec")
            .field("env", &self.env)
            .field("value", &"<redacted>")
            .field("hosts", &self.hosts)
            .field("headers", &self.headers)
            .field("paths", &self.paths)
            .field("wildcard", &self.wildcard)
            .finish()
    }
}

/// The egress settings of a run, stored for the egress stack (issue 5).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressSpec {
    /// Hosts the guest may reach: exact names and `*.domain` wildcards.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Secrets to substitute.
    #[serde(default)]
    pub secrets: Vec<SecretSpec>,
    /// Provider hosts whose responses are metered.
    #[serde(default)]
    pub meter: Vec<String>,
    /// `"all"`: every allowed TLS connection is intercepted, not only secret and meter hosts.
    #[serde(default, deserialize_with = "crate::json::present")]
    pub intercept: Option<InterceptMode>,
    /// Refuse a model call to a meter or secret host whose usage the meter could not read.
    #[serde(default)]
    pub meter_strict: bool,
}

/// Which TLS connections the egress reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InterceptMode {
    /// Every allowed name: the `Host` (or `:authority`) of each request is checked against the
    /// connection's name, which closes domain fronting through a shared CDN; the guest sees the
    /// sandbox's CA for every host.
    All,
}

/// A started network process and what the guest needs to use it.
pub struct Started {
    /// The sandbox's network process.
    pub net: Arc<NetProcess>,
    /// The VM's network device: its end of the process's frames.
    pub attachment: NetAttachment,
    /// The sandbox CA's certificate, when it intercepts anything (the guest must trust it).
    pub ca_pem: Option<String>,
    /// Variables every command of the sandbox gets: each secret's placeholder, and where the CA
    /// is for tools that keep their own trust stores.
    pub env: Vec<(String, String)>,
}

/// The network settings of sandbox `id`: the run's egress as the create request gave it, and the
/// host's configuration, for a guest whose network device has `mac`.
pub fn net_config(id: &str, spec: &EgressSpec, config: &Config, mac: [u8; 6]) -> NetConfig {
    NetConfig {
        version: sandbox_control::net::VERSION,
        sandbox: id.to_string(),
        mac,
        allow: spec.allow.clone(),
        meter: spec.meter.clone(),
        intercept_all: spec.intercept == Some(InterceptMode::All),
        meter_strict: spec.meter_strict,
        meter_body_max: config.meter_body_max as u64,
        secrets: secret_configs(spec),
        memory_bytes: config.egress_memory_mib << 20,
        resolve: config.egress_resolve.to_value(),
        upstream_ca_pem: config.egress_ca_pem.clone(),
        // TODO(adopt): the sandbox's token of adoption, made and kept by the service.
        token: String::new(),
    }
}

/// Checks `spec`'s secrets as its network process will (the egress stack's own parser), so a
/// request the process would refuse is refused before anything is done for it (a fork holds
/// its parent only for children that can start).
pub fn check_secrets(spec: &EgressSpec) -> Result<(), String> {
    let mut secrets = secret_configs(spec);
    let checked = sandbox_net::secrets(&secrets)
        .map(drop)
        .map_err(|e| e.to_string());
    for s in &mut secrets {
        zeroize::Zeroize::zeroize(&mut s.value);
    }
    checked
}

/// The run's secrets as its network process gets them.
fn secret_configs(spec: &EgressSpec) -> Vec<SecretConfig> {
    spec.secrets
        .iter()
        .map(|s| SecretConfig {
            env: s.env.clone(),
            value: s.value.clone(),
            hosts: s.hosts.clone(),
            headers: s.headers.clone(),
            paths: s.paths.clone(),
            wildcard: s.wildcard,
        })
        .collect()
}

/// Starts the network process of sandbox `id` with the run's settings, for a guest whose network
/// device has `mac` (the id's own when `None`); one that may `outlive` the service for a sandbox
/// its next run takes on again. The patterns were validated with the create
/// request; a secret value that cannot go into a header is refused here.
pub async fn start(
    id: &str,
    spec: &EgressSpec,
    config: &Config,
    mac: Option<[u8; 6]>,
    outlive: bool,
) -> Result<Started, NetProcessError> {
    let mac = mac.unwrap_or_else(|| sandbox_egress::net::guest_mac(id));
    let mut cfg = net_config(id, spec, config, mac);
    let started = NetProcess::start(id, &cfg, &config.state_dir, outlive).await;
    for s in &mut cfg.secrets {
        zeroize::Zeroize::zeroize(&mut s.value);
    }
    let started = started?;
    Ok(Started {
        net: started.process,
        attachment: NetAttachment {
            mac,
            link: NetLink::Socket(Arc::new(started.vm_socket)),
        },
        ca_pem: started.ca_pem,
        env: started.env,
    })
}

/// Gives the guest its address, route, resolver and CA through the agent (as root), with
/// [`sandbox_egress::net::guest_setup_script`]; and its clock, for a guest that booted (`set_clock`:
/// a restored one had its clock set to the nanosecond with its identity).
pub async fn configure_guest(
    client: &Client,
    mac: [u8; 6],
    ca_pem: Option<&str>,
    set_clock: bool,
) -> Result<(), String> {
    let now = set_clock.then(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    });
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

/// The report of a sandbox's network process now.
pub async fn report(net: &Arc<NetProcess>) -> Report {
    net.report_async().await
}

/// The counts of a sandbox's network process now (a report without its lists).
pub async fn counts(net: &Arc<NetProcess>) -> Report {
    net.counts_async().await
}

/// A report's count of `label` (0 when it lists none).
fn count(list: &[(String, u64)], label: &str) -> u64 {
    list.iter().find(|(l, _)| l == label).map_or(0, |(_, n)| *n)
}

/// A time of a report, as the API writes times.
fn at(ms: u64) -> String {
    rfc3339(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
}

/// `GET /v1/sandboxes/{id}/egress`: the refusals by reason, the most recent refused requests,
/// and what the stack carried.
pub fn egress_json(r: &Report) -> Value {
    let by_reason: serde_json::Map<String, Value> = Reason::ALL
        .iter()
        .map(|x| (x.as_str(), count(&r.refusals, x.as_str())))
        .filter(|(_, n)| *n > 0)
        .map(|(l, n)| (l.to_string(), json!(n)))
        .collect();
    let events: Vec<Value> = r
        .events
        .iter()
        .map(|e| json!({ "at": at(e.at_ms), "reason": e.reason, "target": e.target }))
        .collect();
    json!({
        "refused": r.refusals.iter().map(|(_, n)| n).fold(0u64, |a, n| a.saturating_add(*n)),
        "by_reason": by_reason,
        "events": events,
        "events_dropped": r.events_dropped,
        "connections": {
            "open": r.open,
            "total": r.connections,
            "spliced": r.spliced,
            "intercepted": r.intercepted,
            "http": r.http,
            "upstream_failures": r.upstream_failures,
        },
        "bytes": { "to_upstream": r.to_upstream, "to_guest": r.to_guest },
        "frames_dropped": {
            "from_guest": r.frames_dropped_from_guest,
            "to_guest": r.frames_dropped_to_guest,
        },
        "memory": { "held_bytes": r.memory_held, "limit_bytes": r.memory_limit },
    })
}

/// Refusal counts of one sandbox by reason label, for `/metrics`.
pub fn refusal_counts(r: &Report) -> Vec<(&'static str, u64)> {
    Reason::ALL
        .iter()
        .map(|x| (x.as_str(), count(&r.refusals, x.as_str())))
        .collect()
}

/// Unmetered model calls of one sandbox by reason label, for `/metrics`.
pub fn unmetered_counts(r: &Report) -> Vec<(&'static str, u64)> {
    Unmetered::ALL
        .iter()
        .map(|x| (x.as_str(), count(&r.usage.unmetered, x.as_str())))
        .collect()
}

/// `GET /v1/sandboxes/{id}/usage`: the metered calls and their totals.
pub fn usage_json(r: &Report) -> Value {
    let u = &r.usage;
    let calls: Vec<Value> = u
        .calls
        .iter()
        .map(|c| {
            let r = c.usage.as_ref();
            json!({
                "at": at(c.at_ms),
                "host": c.host,
                "status": c.status,
                "complete": c.complete,
                "usage_missing": r.is_none_or(|r| r.estimated),
                "output_tokens_estimated": r.is_some_and(|r| r.estimated),
                "unmetered": c.unmetered,
                "provider": r.map(|r| &r.provider),
                "response_id": r.and_then(|r| r.response_id.clone()),
                "model": r.and_then(|r| r.model.clone()),
                "input_tokens": r.map_or(0, |r| r.input_tokens),
                "output_tokens": r.map_or(0, |r| r.output_tokens),
                "cache_read_tokens": r.map_or(0, |r| r.cache_read_tokens),
                "cache_write_tokens": r.map_or(0, |r| r.cache_write_tokens),
                "billed_cost_usd": r.and_then(|r| r.cost),
                "service_tier": r.and_then(|r| r.service_tier.clone()),
                "server_tool_use": r.map_or_else(serde_json::Map::new, |r| {
                    r.server_tool_use
                        .iter()
                        .map(|(k, n)| (k.clone(), json!(n)))
                        .collect()
                }),
                "cache_write_5m_tokens": r.and_then(|r| r.cache_write_5m_tokens),
                "cache_write_1h_tokens": r.and_then(|r| r.cache_write_1h_tokens),
                "input_audio_tokens": r.and_then(|r| r.input_audio_tokens),
                "output_audio_tokens": r.and_then(|r| r.output_audio_tokens),
                "input_image_tokens": r.and_then(|r| r.input_image_tokens),
                "output_image_tokens": r.and_then(|r| r.output_image_tokens),
                "reasoning_tokens": r.and_then(|r| r.reasoning_tokens),
            })
        })
        .collect();
    let unmetered_calls = u
        .unmetered
        .iter()
        .fold(0u64, |a, (_, n)| a.saturating_add(*n));
    json!({
        "calls": calls,
        "calls_dropped": u.calls_dropped,
        "totals": {
            "calls": u.total_calls,
            "input_tokens": u.input_tokens,
            "output_tokens": u.output_tokens,
            "cache_read_tokens": u.cache_read_tokens,
            "cache_write_tokens": u.cache_write_tokens,
            "billed_cost_usd": u.billed_cost_usd,
            "unmetered_calls": unmetered_calls,
            "unmetered_by_reason": Unmetered::ALL
                .iter()
                .map(|x| (x.as_str(), count(&u.unmetered, x.as_str())))
                .filter(|(_, n)| *n > 0)
                .map(|(l, n)| (l.to_string(), json!(n)))
                .collect::<serde_json::Map<_, _>>(),
        }
    })
}
