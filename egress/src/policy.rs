//! The run's allowlist: exact host names and `*.domain` wildcards, and how a name the guest asks
//! for is compared with them.

use thiserror::Error;

/// Why a host pattern is not accepted.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PolicyError {
    /// Not a DNS name of at least two labels (or `*.` and one), or it is an address.
    #[error(
        "`{0}` is not a host name pattern: use a name like `api.example.com` or a wildcard like \
         `*.example.com` (no IP addresses, ports, schemes or paths)"
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

impl HostPattern {
    /// Parses `name` or `*.domain`, case-insensitively, one trailing dot allowed.
    pub fn parse(s: &str) -> Result<HostPattern, PolicyError> {
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

/// The names a run may reach.
#[derive(Debug, Clone, Default)]
pub struct Allowlist {
    patterns: Vec<HostPattern>,
}

impl Allowlist {
    /// An allowlist of these patterns.
    pub fn parse<'a>(patterns: impl IntoIterator<Item = &'a str>) -> Result<Self, PolicyError> {
        Ok(Allowlist {
            patterns: patterns
                .into_iter()
                .map(HostPattern::parse)
                .collect::<Result<_, _>>()?,
        })
    }

    /// Whether the guest may reach `name` (as the guest wrote it: DNS query, SNI or Host).
    pub fn allows(&self, name: &str) -> bool {
        normalize(name).is_some_and(|n| self.patterns.iter().any(|p| p.matches(&n)))
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
            "a.com:443",
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
        // Internationalised names arrive as A-labels; those are ordinary labels.
        assert!(HostPattern::parse("xn--bcher-kva.example").is_ok());
        assert_eq!(normalize("Ex.COM."), Some("ex.com".into()));
    }
}
