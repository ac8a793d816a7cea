//! A sandbox's egress, built from the channel's settings.

use std::sync::Arc;

use sandbox_control::net::NetConfig;
use sandbox_egress::intercept::{ClientConfig, Interception, MeterPolicy};
use sandbox_egress::link::GuestEnd;
use sandbox_egress::policy::{Allowlist, HostPattern};
use sandbox_egress::resolve::ResolveOverrides;
use sandbox_egress::secrets::Secret;
use sandbox_egress::upstream::Dial;
use sandbox_egress::{Egress, EgressConfig};

/// Why a sandbox's egress did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The request's settings cannot be used (a bad pattern, a secret that cannot go into a
    /// header): the create request is refused.
    #[error("{0}")]
    Bad(String),
    /// The host's side failed.
    #[error("{0}")]
    Internal(String),
    /// The settings come from a service of another version.
    #[error(
        "the network channel's version {got} is not this sandbox-net's {want}: the service and \
         sandbox-net come from different builds (install both from one, or point \
         SANDBOX_HOST_NET_BINARY at the one built with this service)"
    )]
    Version {
        /// The service's.
        got: u32,
        /// This program's.
        want: u32,
    },
}

/// A started egress and what the guest needs to use it.
pub struct Running {
    /// The stack.
    pub egress: Egress,
    /// The VM's end of the stack's link.
    pub guest: GuestEnd,
    /// The sandbox CA's certificate, when it intercepts anything (the guest must trust it).
    pub ca_pem: Option<String>,
    /// Variables every command of the sandbox gets: each secret's placeholder, and where the CA
    /// is for tools that keep their own trust stores.
    pub env: Vec<(String, String)>,
}

/// The secrets of a sandbox's settings, each checked by the egress stack's parser: what the
/// network process runs with, and what the service checks a request against before it does
/// anything for it.
pub fn secrets(
    cfg: &[sandbox_control::net::SecretConfig],
) -> Result<Vec<Secret>, sandbox_egress::secrets::SecretsError> {
    cfg.iter()
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
        .collect()
}

/// The TLS client of intercepted connections to their upstreams, trusting `ca_pem` (the
/// operator's bundle) or the system's roots. Loading the roots takes tens of milliseconds: a
/// process that starts many sandboxes makes it once.
pub fn upstream_client(ca_pem: Option<&str>) -> Result<Arc<ClientConfig>, StartError> {
    sandbox_egress::intercept::upstream_client(ca_pem.map(str::as_bytes))
        .map_err(|e| StartError::Internal(e.to_string()))
}

/// The names the sandbox `cfg` describes may reach: its allowlist, its meter's and its secrets'
/// hosts.
pub fn allowlist(cfg: &NetConfig) -> Result<Allowlist, StartError> {
    Allowlist::parse(
        cfg.allow
            .iter()
            .chain(&cfg.meter)
            .chain(cfg.secrets.iter().flat_map(|s| &s.hosts))
            .map(String::as_str),
    )
    .map_err(|e| StartError::Bad(e.to_string()))
}

fn overrides(cfg: &NetConfig) -> Result<Arc<ResolveOverrides>, StartError> {
    Ok(Arc::new(
        ResolveOverrides::parse(&cfg.resolve).map_err(|e| StartError::Bad(e.to_string()))?,
    ))
}

/// What the service may connect to for the sandbox `cfg` describes
/// ([`crate::dial::serve`]): the same allowlist and routed ports its stack follows.
pub fn dial_rules(cfg: &NetConfig) -> Result<crate::dial::Rules, StartError> {
    let overrides = overrides(cfg)?;
    Ok(crate::dial::Rules {
        allow: allowlist(cfg)?.with_routed_ports(overrides.routes()),
        overrides,
    })
}

/// Starts the egress `cfg` describes (on the current Tokio runtime), its upstream connections
/// made by `dial`, its intercepted connections going upstream through the client `client` makes
/// (asked for only when something is intercepted: a sandbox that only splices needs no roots).
pub fn start(
    cfg: &NetConfig,
    dial: Arc<dyn Dial>,
    client: impl FnOnce() -> Result<Arc<ClientConfig>, StartError>,
) -> Result<Running, StartError> {
    if cfg.version != sandbox_control::net::VERSION {
        return Err(StartError::Version {
            got: cfg.version,
            want: sandbox_control::net::VERSION,
        });
    }
    let bad = |e: &dyn std::fmt::Display| StartError::Bad(e.to_string());
    let secret_hosts = cfg.secrets.iter().flat_map(|s| &s.hosts);
    let allow = allowlist(cfg)?;
    let parse = |hs: &mut dyn Iterator<Item = &String>| {
        hs.map(|h| HostPattern::parse(h))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(&e))
    };
    let meter = parse(&mut cfg.meter.iter())?;
    let mut intercept = parse(&mut cfg.meter.iter().chain(secret_hosts))?;
    if cfg.intercept_all {
        // Every allowed TLS name is read, so each request's Host is checked against it.
        intercept.extend(parse(&mut cfg.allow.iter())?);
    }
    let mut egress = EgressConfig::new(cfg.mac, allow);
    egress.overrides = overrides(cfg)?;
    egress.dial = Some(dial);
    egress.limits.memory = usize::try_from(cfg.memory_bytes).unwrap_or(usize::MAX);
    let (mut ca_pem, mut env) = (None, Vec::new());
    if !intercept.is_empty() {
        let secrets = secrets(&cfg.secrets).map_err(|e| bad(&e))?;
        let policy = MeterPolicy {
            strict: cfg.meter_strict,
            body_max: usize::try_from(cfg.meter_body_max).unwrap_or(usize::MAX),
        };
        let icp = Interception::new(&cfg.sandbox, &intercept, secrets, meter, policy, client()?)
            .map_err(|e| StartError::Internal(e.to_string()))?;
        ca_pem = Some(icp.ca_pem().to_string());
        env = icp.placeholders();
        env.extend(
            sandbox_egress::net::guest_ca_env()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string())),
        );
        egress.interception = Some(Arc::new(icp));
    }
    egress.intercept = intercept;
    let (egress, guest) = Egress::start(egress);
    Ok(Running {
        egress,
        guest,
        ca_pem,
        env,
    })
}
