//! The run's secrets: the guest sees only a random placeholder in each secret's environment
//! variable; the stack puts the real value in place of the placeholder only in the secret's
//! credential headers (`authorization` and `x-api-key` unless the run names others) of requests
//! bound for the secret's hosts, and refuses any request in which it can read a placeholder
//! anywhere else (another header, the target, a trailer, or a body to another host): that is a
//! leak, or an attempt to make a provider echo the key back.

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
        "secret `{0}`: the value must be printable ASCII with no line breaks (it goes into HTTP \
         headers), at least {MIN_VALUE_LEN} characters (shorter ones cannot be told apart from \
         ordinary text in responses) and at most {MAX_VALUE_LEN}"
    )]
    BadValue(String),
    /// A credential header name that cannot carry a key.
    #[error(
        "secret `{env}`: `{header}` cannot be one of its headers: {why}. Name the request headers \
         the provider reads the key from, such as authorization, x-api-key, api-key or x-goog-api-key"
    )]
    BadHeader {
        /// The secret's variable.
        env: String,
        /// The header as given (cut short).
        header: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// No randomness for placeholders.
    #[error("reading /dev/urandom for secret placeholders: {0}")]
    Random(std::io::Error),
}

/// Shortest secret value accepted.
pub const MIN_VALUE_LEN: usize = 16;
/// Longest secret value accepted (a header value; also bounds the response scanner's window).
pub const MAX_VALUE_LEN: usize = 4096;
/// The credential headers of a secret that names none: what Anthropic (`x-api-key`), OpenAI and
/// OpenRouter (`authorization: Bearer`) read.
pub const DEFAULT_HEADERS: [&str; 2] = ["authorization", "x-api-key"];
/// Most credential headers one secret may name.
pub const MAX_HEADERS: usize = 8;
/// Headers that never carry a key, besides the hop-by-hop ones: the proxy sets them itself.
const SET_BY_THE_PROXY: [&str; 4] = ["host", "content-length", "content-type", "accept-encoding"];
/// One secret.
pub struct Secret {
    /// The environment variable the guest sees the placeholder in.
    pub env: String,
    /// What the guest sees.
    pub placeholder: String,
    value: String,
    hosts: Vec<HostPattern>,
    /// The request headers (lower case) whose placeholder becomes the value.
    headers: Vec<String>,
}

impl fmt::Debug for Secret {
    // The value never appears in logs or debug output.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Secret")
            .field("env", &self.env)
            .field("placeholder", &self.placeholder)
            .field("hosts", &self.hosts)
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}

impl Secret {
    /// A secret with a fresh random placeholder, replaced in `headers` (lower or mixed case;
    /// `None` for [`DEFAULT_HEADERS`]) of requests to `hosts`.
    pub fn new(
        env: &str,
        value: &str,
        hosts: &[String],
        headers: Option<&[String]>,
    ) -> Result<Secret, SecretsError> {
        if !(MIN_VALUE_LEN..=MAX_VALUE_LEN).contains(&value.len())
            || !value.bytes().all(|b| (0x20..0x7f).contains(&b))
        {
            return Err(SecretsError::BadValue(env.to_string()));
        }
        let headers = match headers {
            None => DEFAULT_HEADERS.iter().map(|h| h.to_string()).collect(),
            Some(hs) => credential_headers(env, hs)?,
        };
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
            headers,
        })
    }

    /// Whether a placeholder in request header `name` (lower case, as `http` keeps names) of a
    /// request to one of the secret's hosts becomes the value.
    pub fn substitutes_in(&self, name: &str) -> bool {
        self.headers.iter().any(|h| h == name)
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

/// Checks the credential header names a run gave for a secret.
fn credential_headers(env: &str, given: &[String]) -> Result<Vec<String>, SecretsError> {
    let bad = |header: &str, why| SecretsError::BadHeader {
        env: env.to_string(),
        header: header.chars().take(64).collect(),
        why,
    };
    if given.is_empty() {
        return Err(bad(
            "",
            "the list is empty (leave `headers` out for the default)",
        ));
    }
    if given.len() > MAX_HEADERS {
        return Err(bad(&given[MAX_HEADERS], "a secret names at most 8 headers"));
    }
    let mut out: Vec<String> = Vec::new();
    for h in given {
        let name = h.trim().to_ascii_lowercase();
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        if name.is_empty() || name.len() > 64 || !name.bytes().all(token) {
            return Err(bad(h, "it is not an HTTP header name"));
        }
        if name.starts_with(':')
            || crate::intercept::HOP.contains(&name.as_str())
            || SET_BY_THE_PROXY.contains(&name.as_str())
        {
            return Err(bad(h, "the proxy sets or removes that header itself"));
        }
        if !out.contains(&name) {
            out.push(name);
        }
    }
    Ok(out)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
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
            "sk-ant-real-key-000",
            &["api.anthropic.com".to_string()],
            None,
        )
        .unwrap()
    }

    #[test]
    fn the_value_goes_only_into_its_credential_headers() {
        let s = secret();
        assert!(s.placeholder.starts_with("vantik-placeholder-") && s.placeholder.len() == 51);
        assert_ne!(s.placeholder, secret().placeholder, "random per sandbox");
        assert!(s.substitutes_in("x-api-key") && s.substitutes_in("authorization"));
        assert!(!s.substitutes_in("anthropic-beta") && !s.substitutes_in("cookie"));
        let named = Secret::new(
            "GEMINI_API_KEY",
            "AIza-real-value-000",
            &["generativelanguage.googleapis.com".into()],
            Some(&["X-Goog-Api-Key".into(), "x-goog-api-key".into()]),
        )
        .unwrap();
        assert!(named.substitutes_in("x-goog-api-key"));
        assert!(
            !named.substitutes_in("authorization"),
            "naming headers replaces the default"
        );
    }

    #[test]
    fn credential_header_names_are_checked() {
        let with = |hs: &[&str]| {
            let hs: Vec<String> = hs.iter().map(|h| h.to_string()).collect();
            Secret::new("K", "sk-0123456789abcdef", &["a.com".into()], Some(&hs))
        };
        for bad in [
            &[][..],
            &["host"],
            &["content-length"],
            &["bad header"],
            &[":path"],
            &[""],
        ] {
            let e = with(bad).unwrap_err().to_string();
            assert!(
                e.contains("secret `K`") && e.contains("authorization, x-api-key"),
                "{e}"
            );
        }
        assert!(with(&["a", "b", "c", "d", "e", "f", "g", "h", "i"]).is_err());
        assert!(with(&["api-key"]).is_ok());
    }

    #[test]
    fn values_and_hosts_are_checked_and_never_printed() {
        let new = |v: &str, h: &str| Secret::new("K", v, &[h.into()], None);
        assert!(new("sk-0123\r\n4567", "a.com").is_err());
        assert!(new("", "a.com").is_err());
        assert!(new("short", "a.com").is_err());
        assert!(new(&"k".repeat(MAX_VALUE_LEN + 1), "a.com").is_err());
        assert!(new("sk-0123456789abcdef", "10.0.0.1").is_err());
        assert!(!format!("{:?}", secret()).contains("sk-ant-real"));
    }
}
