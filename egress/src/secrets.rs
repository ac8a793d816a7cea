//! The run's secrets: the guest sees only a random placeholder in each secret's environment
//! variable; the stack puts the real value in place of the placeholder in request headers bound
//! for that secret's hosts, and refuses any request to another host in which it can read a
//! placeholder (a leak, or an attempt to send the key elsewhere).

use std::fmt;
use std::io::Read;

use thiserror::Error;

use crate::policy::{HostPattern, PolicyError, normalize};

/// Why secrets cannot be set up.
#[derive(Debug, Error)]
pub enum SecretsError {
    /// A host pattern of a secret is not valid.
    #[error("secret `{env}`: {source}")]
    Host {
        /// The secret's variable.
        env: String,
        /// What is wrong with the pattern.
        source: PolicyError,
    },
    /// The value would break a header line.
    #[error(
        "secret `{0}`: the value must be non-empty printable ASCII with no line breaks (it goes \
         into HTTP headers)"
    )]
    BadValue(String),
    /// No randomness for placeholders.
    #[error("reading /dev/urandom for secret placeholders: {0}")]
    Random(std::io::Error),
}

/// One secret.
pub struct Secret {
    /// The environment variable the guest sees the placeholder in.
    pub env: String,
    /// What the guest sees.
    pub placeholder: String,
    value: String,
    hosts: Vec<HostPattern>,
}

impl fmt::Debug for Secret {
    // The value never appears in logs or debug output.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Secret")
            .field("env", &self.env)
            .field("placeholder", &self.placeholder)
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

impl Secret {
    /// A secret with a fresh random placeholder.
    pub fn new(env: &str, value: &str, hosts: &[String]) -> Result<Secret, SecretsError> {
        if value.is_empty() || !value.bytes().all(|b| (0x20..0x7f).contains(&b)) {
            return Err(SecretsError::BadValue(env.to_string()));
        }
        let hosts = hosts
            .iter()
            .map(|h| HostPattern::parse(h))
            .collect::<Result<_, _>>()
            .map_err(|source| SecretsError::Host {
                env: env.to_string(),
                source,
            })?;
        let mut random = [0u8; 16];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut random))
            .map_err(SecretsError::Random)?;
        let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
        Ok(Secret {
            env: env.to_string(),
            // Recognisable in logs and by people, long enough never to occur by chance.
            placeholder: format!("vantik-placeholder-{hex}"),
            value: value.to_string(),
            hosts,
        })
    }

    /// The real value (only ever written into verified TLS to the secret's hosts).
    pub(crate) fn value(&self) -> &str {
        &self.value
    }

    /// Whether requests to `host` get the real value.
    pub fn applies_to(&self, host: &str) -> bool {
        normalize(host).is_some_and(|h| self.hosts.iter().any(|p| p.matches(&h)))
    }
}

/// What happened to a request head.
#[derive(Debug, PartialEq, Eq)]
pub enum Rewrite {
    /// Send this head (placeholders for this host replaced by values).
    Send(Vec<u8>),
    /// A placeholder of `env` is in a request to a host it does not belong to: refuse.
    Leak {
        /// The secret's variable.
        env: String,
    },
}

/// Rewrites an HTTP/1 request head bound for `host`: each secret's placeholder becomes its value
/// where the secret applies to `host`; any placeholder anywhere else in the head (request line
/// included) is a leak.
pub fn rewrite_head(head: &[u8], host: &str, secrets: &[Secret]) -> Rewrite {
    let mut out = head.to_vec();
    for s in secrets {
        let p = s.placeholder.as_bytes();
        if !contains(&out, p) {
            continue;
        }
        if !s.applies_to(host) {
            return Rewrite::Leak { env: s.env.clone() };
        }
        // Only in header values: a placeholder in the request line (a URL) is never replaced.
        let line_end = out
            .windows(2)
            .position(|w| w == b"\r\n")
            .unwrap_or(out.len());
        if contains(&out[..line_end], p) {
            return Rewrite::Leak { env: s.env.clone() };
        }
        let (line, headers) = out.split_at(line_end);
        let mut next = line.to_vec();
        next.extend(replace(headers, p, s.value.as_bytes()));
        out = next;
    }
    Rewrite::Send(out)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

fn replace(hay: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hay.len() + to.len());
    let mut i = 0;
    while i < hay.len() {
        if hay[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(hay[i]);
            i += 1;
        }
    }
    out
}

/// Finds placeholders in a request body that streams past in chunks of any size, keeping only
/// the last few bytes (a placeholder's length) between chunks.
#[derive(Debug)]
pub struct LeakScanner {
    needles: Vec<(String, Vec<u8>)>,
    tail: Vec<u8>,
    keep: usize,
}

impl LeakScanner {
    /// A scanner for the placeholders of `secrets` that do not apply to `host`.
    pub fn new(secrets: &[Secret], host: &str) -> Self {
        let needles: Vec<(String, Vec<u8>)> = secrets
            .iter()
            .filter(|s| !s.applies_to(host))
            .map(|s| (s.env.clone(), s.placeholder.as_bytes().to_vec()))
            .collect();
        let keep = needles.iter().map(|(_, n)| n.len()).max().unwrap_or(1) - 1;
        LeakScanner {
            needles,
            tail: Vec::new(),
            keep,
        }
    }

    /// Whether there is anything to look for.
    pub fn is_idle(&self) -> bool {
        self.needles.is_empty()
    }

    /// Looks at the next chunk; the secret whose placeholder it completes, if any.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<&str> {
        if self.needles.is_empty() {
            return None;
        }
        let mut window = std::mem::take(&mut self.tail);
        window.extend_from_slice(chunk);
        let found = self
            .needles
            .iter()
            .find(|(_, n)| contains(&window, n))
            .map(|(env, _)| env.as_str());
        let start = window.len().saturating_sub(self.keep);
        self.tail = window[start..].to_vec();
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaks_in_bodies_are_found_across_chunks() {
        let s = secret();
        let body = format!("{{\"prompt\":\"{}\"}}", s.placeholder).into_bytes();
        for chunk in [body.len(), 10, 1] {
            let mut scan = LeakScanner::new(std::slice::from_ref(&s), "evil.com");
            let hits: Vec<bool> = body.chunks(chunk).map(|c| scan.feed(c).is_some()).collect();
            assert_eq!(
                hits.iter().filter(|h| **h).count(),
                1,
                "found once, chunk {chunk}"
            );
            assert!(scan.tail.len() <= s.placeholder.len());
        }
        // To the secret's own host the body is not the scanner's business.
        assert!(LeakScanner::new(std::slice::from_ref(&s), "api.anthropic.com").is_idle());
        let mut clean = LeakScanner::new(&[s], "evil.com");
        assert!(clean.feed(b"vantik-placeholder-").is_none());
        assert!(clean.feed(b"00000000").is_none());
    }

    fn secret() -> Secret {
        Secret::new(
            "ANTHROPIC_API_KEY",
            "sk-ant-real",
            &["api.anthropic.com".to_string()],
        )
        .unwrap()
    }

    #[test]
    fn the_value_goes_only_to_its_hosts() {
        let s = secret();
        assert!(s.placeholder.starts_with("vantik-placeholder-") && s.placeholder.len() == 51);
        assert_ne!(s.placeholder, secret().placeholder, "random per sandbox");
        let head = format!(
            "POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.com\r\nx-api-key: {}\r\n\r\n",
            s.placeholder
        );
        let Rewrite::Send(out) = rewrite_head(head.as_bytes(), "API.anthropic.com", &[s]) else {
            panic!("refused")
        };
        let out = String::from_utf8(out).unwrap();
        assert!(out.contains("x-api-key: sk-ant-real\r\n"), "{out}");
        assert!(!out.contains("vantik-placeholder-"));
    }

    #[test]
    fn placeholders_elsewhere_are_leaks() {
        let s = secret();
        let other = format!(
            "GET / HTTP/1.1\r\nHost: evil.com\r\nx: {}\r\n\r\n",
            s.placeholder
        );
        assert_eq!(
            rewrite_head(other.as_bytes(), "evil.com", std::slice::from_ref(&s)),
            Rewrite::Leak {
                env: "ANTHROPIC_API_KEY".into()
            }
        );
        let in_url = format!(
            "GET /?k={} HTTP/1.1\r\nHost: api.anthropic.com\r\n\r\n",
            s.placeholder
        );
        assert!(matches!(
            rewrite_head(
                in_url.as_bytes(),
                "api.anthropic.com",
                std::slice::from_ref(&s)
            ),
            Rewrite::Leak { .. }
        ));
        let clean = b"GET / HTTP/1.1\r\nHost: evil.com\r\n\r\n";
        assert_eq!(
            rewrite_head(clean, "evil.com", &[s]),
            Rewrite::Send(clean.to_vec())
        );
    }

    #[test]
    fn values_and_hosts_are_checked_and_never_printed() {
        assert!(Secret::new("K", "a\r\nb", &["a.com".into()]).is_err());
        assert!(Secret::new("K", "", &["a.com".into()]).is_err());
        assert!(Secret::new("K", "v", &["10.0.0.1".into()]).is_err());
        assert!(!format!("{:?}", secret()).contains("sk-ant-real"));
    }
}
