//! A sandbox's network: its egress stack (the only way out of the guest), the VM's network device
//! on top of it, the guest's address set-up through the agent, and the egress read-outs.

use std::sync::Arc;

use sandbox_egress::link::GuestEnd;
use sandbox_egress::policy::{Allowlist, HostPattern};
use sandbox_egress::refusal::Reason;
use sandbox_egress::resolve::ResolveOverrides;
use sandbox_egress::stats::Stats;
use sandbox_egress::{Egress, EgressConfig};
use sandbox_protocol::client::{Client, ExecEvent};
use sandbox_protocol::message::ExecRequest;
use sandbox_vmm::{FrameLink, NetAttachment};
use serde_json::{Value, json};

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

/// Starts the egress stack of sandbox `id` with the run's settings; returns it and the network
/// device to give the VM. The patterns were validated with the create request.
pub fn start(
    id: &str,
    spec: &EgressSpec,
    overrides: Arc<ResolveOverrides>,
) -> Result<(Egress, NetAttachment), String> {
    let secret_hosts = spec.secrets.iter().flat_map(|s| &s.hosts);
    let allow = Allowlist::parse(
        spec.allow
            .iter()
            .chain(&spec.meter)
            .chain(secret_hosts.clone())
            .map(String::as_str),
    )
    .map_err(|e| e.to_string())?;
    let intercept = spec
        .meter
        .iter()
        .chain(secret_hosts)
        .map(|h| HostPattern::parse(h))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let mac = sandbox_egress::net::guest_mac(id);
    let mut config = EgressConfig::new(mac, allow);
    config.intercept = intercept;
    config.overrides = overrides;
    let (egress, guest) = Egress::start(config);
    let link = Arc::new(EgressLink(guest));
    Ok((egress, NetAttachment { mac, link }))
}

/// Gives the guest its clock, address, route and resolver through the agent (as root), with
/// [`sandbox_egress::net::guest_setup_script`].
pub async fn configure_guest(client: &Client, mac: [u8; 6]) -> Result<(), String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let script = sandbox_egress::net::guest_setup_script(mac, now);
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
