//! The gateway's settings: the API's own (token, bind, port, body limit) and where its hosts are.

use std::net::IpAddr;
use std::time::Duration;

use hyper::Uri;
use thiserror::Error;

use crate::config::{ConfigError, MIN_TOKEN_LEN, valid_host_name};

/// A gateway setting that cannot be used; each message names the variable and what to do.
#[derive(Debug, Error)]
pub enum GatewayConfigError {
    /// One of the settings the gateway shares with a host.
    #[error(transparent)]
    Shared(#[from] ConfigError),
    /// Neither way of finding hosts is set, or both are.
    #[error(
        "set one of SANDBOX_HOST_GATEWAY_HOSTS (name=url,name=url,...) or SANDBOX_HOST_GATEWAY_DNS \
         (http://a-dns-name:port, whose A/AAAA records are the hosts): the gateway needs its hosts"
    )]
    NoHosts,
    /// An entry of the static list that does not parse.
    #[error(
        "SANDBOX_HOST_GATEWAY_HOSTS has `{entry}`: {why}. Each entry is name=http://address:port, the \
         name being the host's SANDBOX_HOST_NAME"
    )]
    BadHost {
        /// The entry.
        entry: String,
        /// What is wrong.
        why: String,
    },
    /// The DNS setting does not parse.
    #[error(
        "SANDBOX_HOST_GATEWAY_DNS is `{0}`: it takes http://a-dns-name:port (its A/AAAA records \
         are the hosts) or http://_service._tcp.a-dns-name (its SRV records are), or the same \
         with https"
    )]
    BadDns(String),
    /// SRV discovery over https that would trust any public certificate.
    #[error(
        "SANDBOX_HOST_GATEWAY_DNS names SRV records over https: set SANDBOX_HOST_CA_FILE (the \
         authority of the hosts' certificates) or SANDBOX_HOST_TLS_NAME (the name they are issued \
         for), since the hosts' names come from DNS answers and the gateway sends them its token"
    )]
    SrvTrust,
    /// The name hosts' certificates are checked against is not a DNS name or address.
    #[error(
        "SANDBOX_HOST_TLS_NAME is `{0}`: it takes the DNS name (or address) the hosts' \
         certificates are issued for"
    )]
    BadTlsName(String),
}

/// Where the hosts are.
#[derive(Debug, Clone)]
pub enum Hosts {
    /// Named hosts at fixed URLs.
    Static(Vec<(String, Uri)>),
    /// A DNS name (a headless Kubernetes Service) whose addresses are the hosts, all on one port;
    /// or, for a name that starts with `_` (`_api._tcp.<service>`), whose SRV records name each
    /// host and its port. Each host's name is what its `/v1/health` says.
    Dns {
        /// `http` or `https`.
        scheme: String,
        /// The name looked up.
        name: String,
        /// The hosts' port (none for SRV: each record has its own).
        port: u16,
        /// The name's SRV records are the hosts.
        srv: bool,
    },
}

/// Everything `gateway` needs, validated.
#[derive(Clone)]
pub struct GatewayConfig {
    /// The token clients send (`SANDBOX_HOST_TOKEN`).
    pub token: String,
    /// The token sent to hosts (`SANDBOX_HOST_GATEWAY_HOST_TOKEN`, else `token`).
    pub host_token: String,
    /// Address and port to listen on.
    pub bind: IpAddr,
    /// Port.
    pub port: u16,
    /// Largest request body, in bytes (refused by its declared length, as a host does).
    pub max_body: u64,
    /// `SANDBOX_HOST_MAX_BODY_MB` as given.
    pub max_body_mb: u64,
    /// The hosts.
    pub hosts: Hosts,
    /// How often each host's `/v1/health` is asked (`SANDBOX_HOST_GATEWAY_POLL_MS`, 2000).
    pub poll: Duration,
    /// The name every host's certificate is checked against over https
    /// (`SANDBOX_HOST_TLS_NAME`; else, for hosts found by DNS, that DNS name: one
    /// certificate of the headless Service's name serves every host; else each URL's host).
    pub tls_name: Option<String>,
}

impl GatewayConfig {
    /// Whether any host is reached over https (then the gateway needs authorities to trust).
    pub fn uses_https(&self) -> bool {
        match &self.hosts {
            Hosts::Static(list) => list.iter().any(|(_, u)| u.scheme_str() == Some("https")),
            Hosts::Dns { scheme, .. } => scheme == "https",
        }
    }
}

impl std::fmt::Debug for GatewayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayConfig")
            .field("token", &"<redacted>")
            .field("host_token", &"<redacted>")
            .field("bind", &self.bind)
            .field("port", &self.port)
            .field("max_body", &self.max_body)
            .field("hosts", &self.hosts)
            .field("poll", &self.poll)
            .finish()
    }
}

fn invalid(var: &'static str, value: String, expected: &'static str) -> ConfigError {
    ConfigError::Invalid {
        var,
        value,
        expected,
    }
}

fn read_token(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<String>, ConfigError> {
    let Some(t) = get(var).map(|t| t.trim().to_string()) else {
        return Ok(None);
    };
    if t.chars().count() < MIN_TOKEN_LEN {
        return Err(if var == "SANDBOX_HOST_TOKEN" {
            ConfigError::ShortToken(t.chars().count())
        } else {
            invalid(
                var,
                "<redacted>".into(),
                "a token of at least 24 characters",
            )
        });
    }
    Ok(Some(t))
}

/// An `http` or `https` URL with a host and a port, and nothing after them.
fn base_url(s: &str) -> Result<Uri, String> {
    let uri: Uri = s.parse().map_err(|e| format!("not a URL ({e})"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err("the URL must start with http:// or https://".into());
    }
    if uri.host().is_none() || uri.port_u16().is_none() {
        return Err("the URL needs an address and a port".into());
    }
    if uri
        .path_and_query()
        .is_some_and(|p| p.as_str() != "/" && !p.as_str().is_empty())
    {
        return Err("the URL takes no path".into());
    }
    Ok(uri)
}

impl GatewayConfig {
    /// Reads the configuration from the process environment (after `.env`).
    pub fn from_env() -> Result<GatewayConfig, GatewayConfigError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the configuration through `get`.
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<GatewayConfig, GatewayConfigError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let token = read_token(&get, "SANDBOX_HOST_TOKEN")?.ok_or(ConfigError::NoToken)?;
        let host_token =
            read_token(&get, "SANDBOX_HOST_GATEWAY_HOST_TOKEN")?.unwrap_or(token.clone());
        let num = |var: &'static str, default: u64, expected: &'static str| {
            get(var).map_or(Ok(default), |v| {
                v.trim()
                    .parse::<u64>()
                    .map_err(|_| invalid(var, v.clone(), expected))
            })
        };
        let bind = match get("SANDBOX_HOST_BIND") {
            None => IpAddr::from([127, 0, 0, 1]),
            Some(v) => v
                .trim()
                .parse()
                .map_err(|_| invalid("SANDBOX_HOST_BIND", v.clone(), "an IP address"))?,
        };
        let port = num("SANDBOX_HOST_PORT", 3004, "a port number")?;
        let port = u16::try_from(port)
            .map_err(|_| invalid("SANDBOX_HOST_PORT", port.to_string(), "a port number"))?;
        let max_body_mb = num("SANDBOX_HOST_MAX_BODY_MB", 512, "a number of MB")?;
        if max_body_mb == 0 || max_body_mb > 1 << 20 {
            return Err(invalid(
                "SANDBOX_HOST_MAX_BODY_MB",
                max_body_mb.to_string(),
                "between 1 and 1048576",
            )
            .into());
        }
        let poll_ms = num(
            "SANDBOX_HOST_GATEWAY_POLL_MS",
            2000,
            "a number of milliseconds",
        )?;
        if !(100..=60_000).contains(&poll_ms) {
            return Err(invalid(
                "SANDBOX_HOST_GATEWAY_POLL_MS",
                poll_ms.to_string(),
                "between 100 and 60000",
            )
            .into());
        }
        let hosts = match (
            get("SANDBOX_HOST_GATEWAY_HOSTS"),
            get("SANDBOX_HOST_GATEWAY_DNS"),
        ) {
            (Some(list), None) => Hosts::Static(static_hosts(&list)?),
            (None, Some(dns)) => dns_hosts(&dns)?,
            _ => return Err(GatewayConfigError::NoHosts),
        };
        let tls_name = match (get(crate::tls::NAME_VAR), &hosts) {
            (Some(n), _) => {
                let n = n.trim().to_string();
                rustls::pki_types::ServerName::try_from(n.as_str())
                    .map_err(|_| GatewayConfigError::BadTlsName(n.clone()))?;
                Some(n)
            }
            (
                None,
                Hosts::Dns {
                    name, srv: false, ..
                },
            ) => Some(name.clone()),
            // SRV targets have names of their own, which their certificates carry.
            (None, Hosts::Dns { srv: true, .. }) => None,
            (None, Hosts::Static(_)) => None,
        };
        // Hosts whose names come from DNS answers, over https checked only against the system's
        // authorities, would be any name's holder of a public certificate: the gateway's token
        // goes to them. An authority of the operator's, or a name of the operator's, is needed.
        if matches!(&hosts, Hosts::Dns { scheme, srv: true, .. } if scheme == "https")
            && get(crate::tls::CA_VAR).is_none()
            && tls_name.is_none()
        {
            return Err(GatewayConfigError::SrvTrust);
        }
        Ok(GatewayConfig {
            token,
            host_token,
            bind,
            port,
            max_body: max_body_mb * 1024 * 1024,
            max_body_mb,
            hosts,
            poll: Duration::from_millis(poll_ms),
            tls_name,
        })
    }
}

fn static_hosts(list: &str) -> Result<Vec<(String, Uri)>, GatewayConfigError> {
    let mut hosts: Vec<(String, Uri)> = vec![];
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let bad = |why: String| GatewayConfigError::BadHost {
            entry: entry.chars().take(200).collect(),
            why,
        };
        let (name, url) = entry
            .split_once('=')
            .ok_or_else(|| bad("it has no `=`".into()))?;
        let name = name.trim();
        if !valid_host_name(name) {
            return Err(bad(format!(
                "`{name}` is not a host name (1 to 40 lowercase letters, digits and inner `-`)"
            )));
        }
        if hosts.iter().any(|(n, _)| n == name) {
            return Err(bad(format!("`{name}` is named twice")));
        }
        hosts.push((name.to_string(), base_url(url.trim()).map_err(bad)?));
    }
    if hosts.is_empty() {
        return Err(GatewayConfigError::NoHosts);
    }
    Ok(hosts)
}

fn dns_hosts(v: &str) -> Result<Hosts, GatewayConfigError> {
    let bad = || GatewayConfigError::BadDns(v.to_string());
    let srv = v
        .trim()
        .split_once("://")
        .is_some_and(|(_, rest)| rest.starts_with('_'));
    let uri = if srv {
        // No port: each SRV record has its own.
        let uri: Uri = v.trim().parse().map_err(|_| bad())?;
        if !matches!(uri.scheme_str(), Some("http" | "https"))
            || uri.port().is_some()
            || uri.path_and_query().is_some_and(|p| p.as_str() != "/")
        {
            return Err(bad());
        }
        uri
    } else {
        base_url(v.trim()).map_err(|_| bad())?
    };
    Ok(Hosts::Dns {
        scheme: uri.scheme_str().unwrap_or("http").into(),
        name: uri.host().unwrap_or_default().to_string(),
        port: uri.port_u16().unwrap_or(0),
        srv,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&str, &str)]) -> Result<GatewayConfig, GatewayConfigError> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        GatewayConfig::from_lookup(move |k| {
            pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        })
    }

    const TOKEN: (&str, &str) = ("SANDBOX_HOST_TOKEN", "a-token-of-enough-length-123");

    #[test]
    fn hosts_are_named_urls_or_a_dns_name() {
        let c = cfg(&[
            TOKEN,
            (
                "SANDBOX_HOST_GATEWAY_HOSTS",
                "a=http://10.0.0.1:3004, b=http://h2:3004",
            ),
        ])
        .unwrap();
        let Hosts::Static(h) = c.hosts else { panic!() };
        assert_eq!(h.len(), 2);
        assert_eq!(c.host_token, TOKEN.1);
        let c = cfg(&[
            TOKEN,
            ("SANDBOX_HOST_GATEWAY_DNS", "http://hosts.ns.svc:3004"),
        ])
        .unwrap();
        assert!(
            matches!(c.hosts, Hosts::Dns { ref name, port: 3004, .. } if name == "hosts.ns.svc")
        );
        assert!(!c.uses_https());
        // Over https, hosts found by DNS are checked against that name, unless one is given.
        let c = cfg(&[
            TOKEN,
            ("SANDBOX_HOST_GATEWAY_DNS", "https://hosts.ns.svc:3004"),
        ])
        .unwrap();
        assert!(c.uses_https());
        assert_eq!(c.tls_name.as_deref(), Some("hosts.ns.svc"));
        // SRV: no port (each record has its own), and each target checked by its own name.
        let e = cfg(&[
            TOKEN,
            ("SANDBOX_HOST_GATEWAY_DNS", "https://_api._tcp.hosts.ns.svc"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("set SANDBOX_HOST_CA_FILE"), "{e}");
        let c = cfg(&[
            TOKEN,
            ("SANDBOX_HOST_GATEWAY_DNS", "https://_api._tcp.hosts.ns.svc"),
            ("SANDBOX_HOST_CA_FILE", "/etc/sandbox-host/ca.pem"),
        ])
        .unwrap();
        assert!(
            matches!(c.hosts, Hosts::Dns { ref name, srv: true, .. } if name == "_api._tcp.hosts.ns.svc")
        );
        assert_eq!(c.tls_name, None);
        for bad in [
            "http://_api._tcp.hosts:3004",
            "ftp://_api._tcp.h",
            "http://_a._tcp.h/x",
        ] {
            let e = cfg(&[TOKEN, ("SANDBOX_HOST_GATEWAY_DNS", bad)])
                .unwrap_err()
                .to_string();
            assert!(e.contains("SRV records"), "{bad}: {e}");
        }
        let c = cfg(&[
            TOKEN,
            ("SANDBOX_HOST_GATEWAY_HOSTS", "a=https://10.0.0.1:3004"),
            ("SANDBOX_HOST_TLS_NAME", "hosts.example"),
        ])
        .unwrap();
        assert_eq!(c.tls_name.as_deref(), Some("hosts.example"));
        let e = cfg(&[
            TOKEN,
            ("SANDBOX_HOST_GATEWAY_HOSTS", "a=https://10.0.0.1:3004"),
            ("SANDBOX_HOST_TLS_NAME", "not a name"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("SANDBOX_HOST_TLS_NAME is `not a name`"), "{e}");
    }

    #[test]
    fn bad_host_settings_say_what_is_wrong() {
        for (list, why) in [
            ("a=http://h:1,a=http://h:2", "named twice"),
            ("A=http://h:1", "not a host name"),
            ("a", "no `=`"),
            ("a=ftp://h:1", "http:// or https://"),
            ("a=http://h", "a port"),
            ("a=http://h:1/v1", "no path"),
        ] {
            let e = cfg(&[TOKEN, ("SANDBOX_HOST_GATEWAY_HOSTS", list)])
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{list}: {e}");
        }
        let e = cfg(&[TOKEN]).unwrap_err().to_string();
        assert!(e.contains("needs its hosts"), "{e}");
        let e = cfg(&[
            TOKEN,
            ("SANDBOX_HOST_GATEWAY_HOSTS", "a=http://h:1"),
            ("SANDBOX_HOST_GATEWAY_HOST_TOKEN", "short"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("SANDBOX_HOST_GATEWAY_HOST_TOKEN") && !e.contains("short"),
            "{e}"
        );
    }
}
