//! The service's configuration: the environment, then `.env` at the repository root, the
//! environment winning, as the operator guide describes.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

/// Shortest token accepted.
pub const MIN_TOKEN_LEN: usize = 24;

/// A setting that cannot be used. Each message names the variable and what to do.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    /// No token.
    #[error(
        "SANDBOX_HOST_TOKEN is not set. The sandbox host does not start without it. Make one with: \
         echo \"SANDBOX_HOST_TOKEN=$(openssl rand -hex 32)\" >> .env"
    )]
    NoToken,
    /// A token that is too short.
    #[error(
        "SANDBOX_HOST_TOKEN has {0} characters; it needs at least 24. Make one with: \
         echo \"SANDBOX_HOST_TOKEN=$(openssl rand -hex 32)\" >> .env"
    )]
    ShortToken(usize),
    /// A value that does not parse.
    #[error("{var} is `{value}`, which is not {expected}; fix it in the environment or in .env")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it should be.
        expected: &'static str,
    },
    /// A resolution override that does not parse.
    #[error(
        "SANDBOX_HOST_EGRESS_RESOLVE is `{value}`: {why}. It takes comma-separated name:port:address \
         entries, like curl's --resolve (IPv6 addresses in brackets); fix it in the environment or in .env"
    )]
    EgressResolve {
        /// The value.
        value: String,
        /// What is wrong with it.
        why: String,
    },
    /// The extra upstream roots cannot be used.
    #[error(
        "SANDBOX_HOST_EGRESS_CA_FILE is {path}, which cannot be used: {why}. It must be a PEM file of \
         CA certificates; fix it in the environment or in .env"
    )]
    EgressCaFile {
        /// The file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// The `.env` file exists but cannot be read.
    #[error("cannot read {path}: {why}")]
    DotEnv {
        /// The file.
        path: PathBuf,
        /// Why.
        why: String,
    },
}

/// Whether `name` can name a host in a fleet (`SANDBOX_HOST_NAME`): it ends every id of the
/// host's sandboxes, so it is short and plain (a sandbox's socket paths, which hold its id, must
/// stay under 108 bytes; and no `.`, which the cgroups' names use as a separator).
pub fn valid_host_name(name: &str) -> bool {
    (1..=40).contains(&name.len())
        && !name.starts_with('-')
        && !name.ends_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Everything `serve` needs, validated.
#[derive(Clone)]
pub struct Config {
    /// The shared secret (never printed).
    pub token: String,
    /// Address to listen on.
    pub bind: IpAddr,
    /// Port to listen on.
    pub port: u16,
    /// A sandbox with no request for this long is disposed of.
    pub idle: Duration,
    /// Time after a run's time limit before its sandbox is disposed of.
    pub grace: Duration,
    /// Largest request body, in bytes.
    pub max_body: u64,
    /// `SANDBOX_HOST_MAX_BODY_MB` as given, for messages.
    pub max_body_mb: u64,
    /// How often the sweep runs (15 s; shorter only for tests).
    pub sweep: Duration,
    /// `SANDBOX_HOST_MEMORY_LIMIT_MIB` and `SANDBOX_HOST_DISK_OVERCOMMIT`: what sandboxes may
    /// commit of this host.
    pub limits: crate::capacity::Limits,
    /// `SANDBOX_HOST_UNRESPONSIVE_MS`: a guest whose agent leaves a ping unanswered this long
    /// is killed as unresponsive (and then swept).
    pub unresponsive: Duration,
    /// The image store.
    pub image_dir: PathBuf,
    /// Where sandboxes keep their files.
    pub state_dir: PathBuf,
    /// `SANDBOX_HOST_EGRESS_RESOLVE`: names the egress resolves to fixed addresses (tests).
    pub egress_resolve: std::sync::Arc<sandbox_egress::resolve::ResolveOverrides>,
    /// `SANDBOX_HOST_EGRESS_CA_FILE`: extra PEM roots for upstream TLS of intercepted hosts.
    pub egress_ca_file: Option<PathBuf>,
    /// That bundle as read at start: each sandbox's network is given the text, never the path
    /// (a network process opens no file).
    pub egress_ca_pem: Option<String>,
    /// `SANDBOX_HOST_METER_BODY_MAX_MIB` in bytes: the largest model request body the meter
    /// holds to ask for usage (what a sandbox holds at once counts against its egress memory).
    pub meter_body_max: usize,
    /// `SANDBOX_HOST_EGRESS_MEMORY_MIB`: what one sandbox's egress may hold on the host
    /// (`sandbox_egress::memory`), counted with its guest's memory at admission.
    pub egress_memory_mib: u64,
    /// `SANDBOX_HOST_TEMPLATES` (`on` by default, `off`): sandboxes are restored from a
    /// template of their shape instead of booting (issue 15; on QEMU too, issue 36).
    pub templates: bool,
    /// `SANDBOX_HOST_NAME`: this host's name in a fleet (issue 33). Its sandboxes' ids end with
    /// it, so a gateway finds the host of a sandbox from the id alone; `/v1/health` says it.
    pub name: Option<String>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("token", &"<redacted>")
            .field("bind", &self.bind)
            .field("port", &self.port)
            .field("idle", &self.idle)
            .field("grace", &self.grace)
            .field("max_body", &self.max_body)
            .field("sweep", &self.sweep)
            .field("unresponsive", &self.unresponsive)
            .field("limits", &self.limits)
            .field("image_dir", &self.image_dir)
            .field("state_dir", &self.state_dir)
            .field("egress_resolve", &self.egress_resolve)
            .field("egress_ca_file", &self.egress_ca_file)
            .field(
                "egress_ca_pem",
                &self.egress_ca_pem.as_ref().map(String::len),
            )
            .field("meter_body_max", &self.meter_body_max)
            .field("egress_memory_mib", &self.egress_memory_mib)
            .field("templates", &self.templates)
            .field("name", &self.name)
            .finish()
    }
}

/// Where `.env` is read from: `SANDBOX_HOST_DOTENV` if set, else the repository root this binary
/// was built from, else the current directory.
pub fn dotenv_path() -> PathBuf {
    if let Some(p) = std::env::var_os("SANDBOX_HOST_DOTENV") {
        return p.into();
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(|p| p.join(".env"));
    match repo {
        Some(p) if p.exists() => p,
        _ => PathBuf::from(".env"),
    }
}

/// Loads `.env` into the process environment without overriding what is already set.
pub fn load_dotenv() -> Result<Option<PathBuf>, ConfigError> {
    let path = dotenv_path();
    if !path.exists() {
        return Ok(None);
    }
    // dotenvy::from_path never overrides variables that are already set.
    dotenvy::from_path(&path).map_err(|e| ConfigError::DotEnv {
        path: path.clone(),
        why: e.to_string(),
    })?;
    Ok(Some(path))
}

impl Config {
    /// The watchdog of every sandbox: a ping every 5 s (or half the bound, if shorter).
    pub fn liveness(&self) -> sandbox_vmm::Liveness {
        sandbox_vmm::Liveness {
            interval: (self.unresponsive / 2).min(Duration::from_secs(5)),
            timeout: self.unresponsive,
        }
    }

    /// Reads the configuration from the process environment (after [`load_dotenv`]).
    pub fn from_env() -> Result<Config, ConfigError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the configuration through `get`, so tests need not touch the process environment.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let token = get("SANDBOX_HOST_TOKEN").ok_or(ConfigError::NoToken)?;
        let token = token.trim().to_string();
        if token.chars().count() < MIN_TOKEN_LEN {
            return Err(ConfigError::ShortToken(token.chars().count()));
        }
        let bind = parse(
            &get,
            "SANDBOX_HOST_BIND",
            "127.0.0.1".parse().expect("valid address"),
            "an IP address",
        )?;
        let port = parse(&get, "SANDBOX_HOST_PORT", 3004u16, "a port number")?;
        let idle_ms: u64 = parse(
            &get,
            "SANDBOX_HOST_IDLE_MS",
            300_000,
            "a number of milliseconds",
        )?;
        let grace_ms: u64 = parse(
            &get,
            "SANDBOX_HOST_GRACE_MS",
            120_000,
            "a number of milliseconds",
        )?;
        let max_body_mb: u64 = parse(&get, "SANDBOX_HOST_MAX_BODY_MB", 512, "a number of MB")?;
        if max_body_mb == 0 || max_body_mb > 1 << 20 {
            return Err(ConfigError::Invalid {
                var: "SANDBOX_HOST_MAX_BODY_MB",
                value: max_body_mb.to_string(),
                expected: "between 1 and 1048576",
            });
        }
        let sweep_ms: u64 = parse(
            &get,
            "SANDBOX_HOST_SWEEP_MS",
            15_000,
            "a number of milliseconds",
        )?;
        let sweep_ms = sweep_ms.max(50);
        let unresponsive_ms: u64 = parse(
            &get,
            "SANDBOX_HOST_UNRESPONSIVE_MS",
            60_000,
            "a number of milliseconds",
        )?;
        let memory_limit_mib: u64 = parse(
            &get,
            "SANDBOX_HOST_MEMORY_LIMIT_MIB",
            crate::capacity::Limits::default_memory_mib(),
            "a number of MiB",
        )?;
        let disk_overcommit: u64 = parse(
            &get,
            "SANDBOX_HOST_DISK_OVERCOMMIT",
            4,
            "a whole number from 1 to 100",
        )?;
        if !(1..=100).contains(&disk_overcommit) {
            return Err(ConfigError::Invalid {
                var: "SANDBOX_HOST_DISK_OVERCOMMIT",
                value: disk_overcommit.to_string(),
                expected: "a whole number from 1 to 100",
            });
        }
        if unresponsive_ms < 2000 {
            return Err(ConfigError::Invalid {
                var: "SANDBOX_HOST_UNRESPONSIVE_MS",
                value: unresponsive_ms.to_string(),
                expected: "at least 2000 (a busy guest needs time to answer)",
            });
        }
        let probe_s: u64 = parse(
            &get,
            "SANDBOX_HOST_PROBE_TIMEOUT_S",
            20,
            "a whole number of seconds from 1 to 600",
        )?;
        if !(1..=600).contains(&probe_s) {
            return Err(ConfigError::Invalid {
                var: "SANDBOX_HOST_PROBE_TIMEOUT_S",
                value: probe_s.to_string(),
                expected: "a whole number of seconds from 1 to 600",
            });
        }
        let _: u64 = parse(
            &get,
            "SANDBOX_HOST_VMM_ALLOWANCE_MIB",
            0,
            "a whole number of MiB from 0 to 1048576",
        )?;
        let meter_body_max_mib: usize = parse(
            &get,
            "SANDBOX_HOST_METER_BODY_MAX_MIB",
            sandbox_egress::intercept::DEFAULT_BODY_MAX >> 20,
            "a whole number of MiB from 1 to 1024",
        )?;
        if !(1..=1024).contains(&meter_body_max_mib) {
            return Err(ConfigError::Invalid {
                var: "SANDBOX_HOST_METER_BODY_MAX_MIB",
                value: meter_body_max_mib.to_string(),
                expected: "a whole number of MiB from 1 to 1024",
            });
        }
        // By default two of the largest bodies and 32 MiB for connections (sandbox_egress::memory).
        let egress_memory_mib: u64 = parse(
            &get,
            "SANDBOX_HOST_EGRESS_MEMORY_MIB",
            2 * meter_body_max_mib as u64 + 32,
            "a whole number of MiB",
        )?;
        if egress_memory_mib < meter_body_max_mib as u64 + 16 || egress_memory_mib > 65_536 {
            return Err(ConfigError::Invalid {
                var: "SANDBOX_HOST_EGRESS_MEMORY_MIB",
                value: egress_memory_mib.to_string(),
                expected: "a whole number of MiB from SANDBOX_HOST_METER_BODY_MAX_MIB + 16 (a body \
                           the meter holds must fit beside the connections) to 65536",
            });
        }
        let name = match get("SANDBOX_HOST_NAME").map(|v| v.trim().to_string()) {
            None => None,
            Some(n) if valid_host_name(&n) => Some(n),
            Some(n) => {
                return Err(ConfigError::Invalid {
                    var: "SANDBOX_HOST_NAME",
                    value: n,
                    expected: "a name of 1 to 40 lowercase letters, digits and inner `-` (a \
                               node's name, say; the container's entrypoint makes one of \
                               SANDBOX_HOST_NODE_NAME)",
                });
            }
        };
        let templates = match get("SANDBOX_HOST_TEMPLATES").as_deref().map(str::trim) {
            None | Some("on") => true,
            Some("off") => false,
            Some(other) => {
                return Err(ConfigError::Invalid {
                    var: "SANDBOX_HOST_TEMPLATES",
                    value: other.to_string(),
                    expected: "`on` or `off`",
                });
            }
        };
        let egress_resolve = match get("SANDBOX_HOST_EGRESS_RESOLVE") {
            None => Default::default(),
            Some(v) => sandbox_egress::resolve::ResolveOverrides::parse(&v).map_err(|e| {
                ConfigError::EgressResolve {
                    value: v.clone(),
                    why: e.to_string(),
                }
            })?,
        };
        let (egress_ca_file, egress_ca_pem) = match get("SANDBOX_HOST_EGRESS_CA_FILE") {
            None => (None, None),
            Some(v) => {
                let path = PathBuf::from(v.trim());
                let why = |why: String| ConfigError::EgressCaFile {
                    path: path.clone(),
                    why,
                };
                let pem = std::fs::read(&path).map_err(|e| why(e.to_string()))?;
                let pem = String::from_utf8(pem)
                    .map_err(|_| why("it is not PEM text (not UTF-8)".into()))?;
                sandbox_net::upstream_client(Some(&pem)).map_err(|e| why(e.to_string()))?;
                (Some(path), Some(pem))
            }
        };
        Ok(Config {
            token,
            bind,
            port,
            idle: Duration::from_millis(idle_ms),
            grace: Duration::from_millis(grace_ms),
            max_body: max_body_mb * 1024 * 1024,
            max_body_mb,
            sweep: Duration::from_millis(sweep_ms),
            unresponsive: Duration::from_millis(unresponsive_ms),
            limits: crate::capacity::Limits {
                memory_mib: memory_limit_mib,
                disk_overcommit,
            },
            image_dir: sandbox_vmm::config::image_dir(),
            state_dir: sandbox_vmm::config::state_dir(),
            egress_resolve: std::sync::Arc::new(egress_resolve),
            templates,
            name,
            egress_ca_file,
            egress_ca_pem,
            meter_body_max: meter_body_max_mib << 20,
            egress_memory_mib,
        })
    }
}

fn parse<T: std::str::FromStr>(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
    default: T,
    expected: &'static str,
) -> Result<T, ConfigError> {
    match get(var) {
        None => Ok(default),
        Some(v) => v.trim().parse().map_err(|_| ConfigError::Invalid {
            var,
            value: v,
            expected,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn a_host_name_is_short_and_plain_and_ends_its_ids() {
        let t = "x".repeat(24);
        let c = cfg(&[
            ("SANDBOX_HOST_TOKEN", t.as_str()),
            ("SANDBOX_HOST_NAME", "node-7"),
        ])
        .unwrap();
        assert_eq!(c.name.as_deref(), Some("node-7"));
        let id = crate::registry::new_id(c.name.as_deref());
        assert_eq!(crate::registry::host_of(&id), Some(Some("node-7")));
        assert_eq!(
            crate::registry::host_of(&crate::registry::new_id(None)),
            Some(None)
        );
        for bad in ["Node", "-a", "a-", "a_b", "a.b", &"a".repeat(41)] {
            let e = cfg(&[
                ("SANDBOX_HOST_TOKEN", t.as_str()),
                ("SANDBOX_HOST_NAME", bad),
            ])
            .unwrap_err()
            .to_string();
            assert!(e.contains("SANDBOX_HOST_NAME"), "{bad}: {e}");
        }
        for bad in [
            "sbx-0123456789abcdef-",
            "sbx-0123456789abcdefx",
            "sbx-0123",
            "x-0123456789abcdef",
        ] {
            assert_eq!(crate::registry::host_of(bad), None, "{bad}");
        }
    }

    #[test]
    fn token_is_required_and_long() {
        assert_eq!(cfg(&[]).unwrap_err(), ConfigError::NoToken);
        assert_eq!(
            cfg(&[("SANDBOX_HOST_TOKEN", "short")]).unwrap_err(),
            ConfigError::ShortToken(5)
        );
        assert!(cfg(&[("SANDBOX_HOST_TOKEN", "x".repeat(24).as_str())]).is_ok());
        assert!(
            ConfigError::NoToken
                .to_string()
                .contains("openssl rand -hex 32")
        );
    }

    #[test]
    fn defaults_and_bad_values() {
        let c = cfg(&[("SANDBOX_HOST_TOKEN", "t".repeat(30).as_str())]).unwrap();
        assert_eq!((c.bind.to_string().as_str(), c.port), ("127.0.0.1", 3004));
        assert_eq!(
            (c.idle.as_millis(), c.grace.as_millis(), c.max_body_mb),
            (300_000, 120_000, 512)
        );
        assert_eq!(c.sweep.as_millis(), 15_000);
        assert_eq!(c.unresponsive.as_millis(), 60_000);
        let e = cfg(&[
            ("SANDBOX_HOST_TOKEN", "t".repeat(30).as_str()),
            ("SANDBOX_HOST_UNRESPONSIVE_MS", "10"),
        ])
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("SANDBOX_HOST_UNRESPONSIVE_MS is `10`"),
            "{e}"
        );
        let e = cfg(&[
            ("SANDBOX_HOST_TOKEN", "t".repeat(30).as_str()),
            ("SANDBOX_HOST_PORT", "http"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("SANDBOX_HOST_PORT is `http`"), "{e}");
        assert!(!format!("{c:?}").contains("tttt"));
        assert_eq!(c.meter_body_max, 32 << 20);
        assert_eq!(c.egress_memory_mib, 96);
        for (var, value) in [
            ("SANDBOX_HOST_METER_BODY_MAX_MIB", "0"),
            ("SANDBOX_HOST_METER_BODY_MAX_MIB", "4096"),
            ("SANDBOX_HOST_PROBE_TIMEOUT_S", "0"),
            ("SANDBOX_HOST_PROBE_TIMEOUT_S", "a minute"),
        ] {
            let e = cfg(&[
                ("SANDBOX_HOST_TOKEN", "t".repeat(30).as_str()),
                (var, value),
            ])
            .unwrap_err();
            assert!(
                e.to_string().contains(&format!("{var} is `{value}`")),
                "{e}"
            );
        }
    }
}
