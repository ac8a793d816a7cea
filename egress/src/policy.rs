//! The run's allowlist: exact host names and `*.domain` wildcards, each with an optional port, and
//! how a name the guest asks for is compared with them. An entry without a port allows 443 and
//! 80 only, so an allowed host cannot be port-scanned through the stack.

use thiserror::Error;

/// Why a host pattern is not accepted.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PolicyError {
    /// Not a DNS name of at least two labels (or `*.` and one), or it is an address.
    #[error(
        "`{0}` is not a host name pattern: use a name like `api.example.com` or a wildcard like \
         `*.example.com`, optionally with a port (`registry.example.com:8443`); no IP addresses, \
         schemes or paths"
    )]
    BadPattern(String),
}

/// One allowlist entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    /// This name only.
    Exact(String),
    /// Any name below this domain (not the domain itself): `*.example.com` holds
    /// `api.example.com` and `a.b.example.com`.
    Subdomains(String),
}

/// The ports an entry without a port allows.
pub const DEFAULT_PORTS: [u16; 2] = [443, 80];

impl HostPattern {
    /// Parses `name` or `*.domain`, case-insensitively, one trailing dot allowed, with an
    /// optional `:port`, which the pattern itself ignores (see [`HostPattern::parse_with_port`]).
    pub fn parse(s: &str) -> Result<HostPattern, PolicyError> {
        Self::parse_with_port(s).map(|(p, _)| p)
    }

    /// Parses an entry into its pattern and its port, if it names one (1-65535).
    pub fn parse_with_port(s: &str) -> Result<(HostPattern, Option<u16>), PolicyError> {
        let bad = || PolicyError::BadPattern(s.to_string());
        let (host, port) = match s.rsplit_once(':') {
            Some((h, p)) => {
                if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                match p.parse::<u16>() {
                    Ok(p) if p > 0 => (h, Some(p)),
                    _ => return Err(bad()),
                }
            }
            None => (s, None),
        };
        Ok((Self::parse_name(host).map_err(|_| bad())?, port))
    }

    fn parse_name(s: &str) -> Result<HostPattern, PolicyError> {
        let bad = || PolicyError::BadPattern(s.to_string());
        let (wild, rest) = match s.strip_prefix("*.") {
            Some(r) => (true, r),
            None => (false, s),
        };
        let name = normalize(rest).ok_or_else(bad)?;
        if !name.contains('.') {
            return Err(bad());
        }
        Ok(if wild {
            HostPattern::Subdomains(name)
        } else {
            HostPattern::Exact(name)
        })
    }

    /// Whether a normalized name matches.
    pub fn matches(&self, name: &str) -> bool {
        match self {
            HostPattern::Exact(n) => n == name,
            HostPattern::Subdomains(d) => name
                .strip_suffix(d.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        }
    }
}

/// The names a run may reach, and on which ports.
#[derive(Debug, Clone, Default)]
pub struct Allowlist {
    patterns: Vec<(HostPattern, Option<u16>)>,
}

impl Allowlist {
    /// An allowlist of these entries (`name`, `*.domain`, either with `:port`).
    pub fn parse<'a>(patterns: impl IntoIterator<Item = &'a str>) -> Result<Self, PolicyError> {
        Ok(Allowlist {
            patterns: patterns
                .into_iter()
                .map(HostPattern::parse_with_port)
                .collect::<Result<_, _>>()?,
        })
    }

    /// Whether the guest may reach `name` (as the guest wrote it: DNS query, SNI or Host) on
    /// some port.
    pub fn allows(&self, name: &str) -> bool {
        normalize(name).is_some_and(|n| self.patterns.iter().any(|(p, _)| p.matches(&n)))
    }

    /// This allowlist, plus each `name:port` the operator routes (`ResolveOverrides::routes`)
    /// whose name it allows: a port the operator routes for a name is a port it means the name
    /// to be reached on.
    pub fn with_routed_ports<'a>(
        mut self,
        routes: impl IntoIterator<Item = (&'a str, u16)>,
    ) -> Self {
        let extra: Vec<(HostPattern, Option<u16>)> = routes
            .into_iter()
            .filter(|(name, _)| self.allows(name))
            .map(|(name, port)| (HostPattern::Exact(name.to_string()), Some(port)))
            .collect();
        self.patterns.extend(extra);
        self
    }

    /// Whether the guest may open a connection to `port` of `name`: a port an entry for the
    /// name names, or 443 and 80 for an entry that names none.
    pub fn allows_port(&self, name: &str, port: u16) -> bool {
        normalize(name).is_some_and(|n| {
            self.patterns.iter().any(|(p, ports)| {
                p.matches(&n)
                    && match ports {
                        Some(only) => *only == port,
                        None => DEFAULT_PORTS.contains(&port),
                    }
            })
        })
    }
}

/// The canonical form of a host name: lowercase ASCII, no trailing dot; `None` if it is not a
/// DNS host name (labels of 1-63 letters, digits and inner hyphens, at most 253 bytes) or if it
/// looks like an IPv4 address (an all-digit last label), which DNS must never answer for.
pub fn normalize(name: &str) -> Option<String> {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() || name.len() > 253 {
        return None;
    }
    let ok = name.split('.').all(|l| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    });
    let last = name.rsplit('.').next().unwrap_or("");
    if !ok || last.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(name.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_and_wildcard_patterns() {
        let a = Allowlist::parse(["api.anthropic.com", "*.Example.COM."]).unwrap();
        assert!(a.allows("api.anthropic.com"));
        assert!(a.allows("API.Anthropic.com."));
        assert!(!a.allows("anthropic.com"));
        assert!(!a.allows("evil-api.anthropic.com"));
        assert!(!a.allows("api.anthropic.com.evil.net"));
        assert!(a.allows("www.example.com"));
        assert!(a.allows("a.b.example.com"));
        assert!(
            !a.allows("example.com"),
            "a wildcard does not hold its apex"
        );
        assert!(!a.allows("notexample.com"));
        assert!(!a.allows("xexample.com"));
        assert!(!Allowlist::default().allows("example.com"));
    }

    #[test]
    fn ports_are_443_and_80_unless_an_entry_names_one() {
        let a = Allowlist::parse(["api.x.com", "registry.x.com:8443", "*.y.com:22"]).unwrap();
        assert!(a.allows_port("api.x.com", 443) && a.allows_port("api.x.com", 80));
        assert!(!a.allows_port("api.x.com", 22) && !a.allows_port("api.x.com", 8443));
        assert!(a.allows_port("registry.x.com", 8443));
        assert!(
            !a.allows_port("registry.x.com", 443),
            "a named port replaces the default"
        );
        assert!(a.allows_port("git.y.com", 22) && !a.allows_port("git.y.com", 443));
        assert!(a.allows("registry.x.com") && !a.allows_port("other.com", 443));
        assert_eq!(
            HostPattern::parse_with_port("Registry.X.com:8443").unwrap(),
            (HostPattern::Exact("registry.x.com".into()), Some(8443))
        );
    }

    #[test]
    fn addresses_and_junk_are_not_names() {
        for bad in [
            "",
            ".",
            "127.0.0.1",
            "1.2.3.4.",
            "localhost",
            "*.com",
            "*",
            "a..b",
            "-a.com",
            "a-.com",
            "a_b.com",
            "a.com:",
            "a.com:0",
            "a.com:65536",
            "a.com:44x",
            "a.com:443:1",
            "http://a.com",
            "a.com/x",
            "::1",
            "[::1]",
            "ex ample.com",
            "*.*.a.com",
            "a.*.com",
        ] {
            assert!(HostPattern::parse(bad).is_err(), "{bad:?}");
            assert!(
                !Allowlist::parse(["*.a.com", "a.com"]).unwrap().allows(bad),
                "{bad:?}"
            );
        }
        let long = format!("{}.com", "a".repeat(64));
        assert!(HostPattern::parse(&long).is_err());
        let e = HostPattern::parse("10.0.0.1").unwrap_err().to_string();
        assert!(e.contains("no IP addresses"), "{e}");
        assert!(HostPattern::parse("10.0.0.1:443").is_err());
        // Internationalised names arrive as A-labels; those are ordinary labels.
        assert!(HostPattern::parse("xn--bcher-kva.example").is_ok());
        assert_eq!(normalize("Ex.COM."), Some("ex.com".into()));
    }
}
