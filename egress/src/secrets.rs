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
    /// A host with a port: the key would go to that name on every port the allowlist opens.
    #[error(
        "secret `{env}`: `{host}` names a port, but a secret's hosts are names: the key goes to \
         the name on whichever port the allowlist opens for it. Give the name alone (`{name}`), \
         and the port in `allow`"
    )]
    HostPort {
        /// The secret's variable.
        env: String,
        /// The entry as given.
        host: String,
        /// The entry without its port.
        name: String,
    },
    /// A wildcard host the run did not mark as meant.
    #[error(
        "secret `{env}`: `{host}` is a wildcard: anyone who can own a name under it (a tenant of \
         a shared cloud domain such as *.azure-api.net) would receive the key. Name the exact \
         host, or set `\"wildcard\": true` on the secret if every name under it is yours"
    )]
    Wildcard {
        /// The secret's variable.
        env: String,
        /// The pattern as given.
        host: String,
    },
    /// A path prefix that cannot be matched safely.
    #[error(
        "secret `{env}`: `{path}` in `paths`: {why}. Give path prefixes such as \
         /v1/messages or /v1/chat/completions (at most {MAX_PATHS}, each at most \
         {MAX_PATH_LEN} characters)"
    )]
    BadPath {
        /// The secret's variable.
        env: String,
        /// The prefix as given (cut short).
        path: String,
        /// What is wrong with it.
        why: &'static str,
    },
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
/// Most path prefixes one secret may name.
pub const MAX_PATHS: usize = 32;
/// The longest path prefix a secret may name.
pub const MAX_PATH_LEN: usize = 256;

/// The known model providers and their inference endpoints, each a method and a path: a secret
/// for one of these hosts that names no `paths` is good only for these (issue 29, item 6). A path
/// segment `*` is any one segment, `*:suffix` one that ends so (Gemini's `model:generateContent`);
/// nothing below a path is allowed unless listed. Not listed, so refused with the key: minting
/// credentials (`/v1/realtime/client_secrets`), admin and key management, organisation and
/// billing APIs, files and uploads (a round trip of guest data through the key's host),
/// fine-tuning, batches (unmetered spend, and every other run's results), stored completions and
/// responses read, changed or deleted (`GET /v1/chat/completions`, `GET /v1/responses/{id}`),
/// models deleted. A request that asks the server to take it for another method
/// (`X-HTTP-Method-Override`) matches none. These hosts are metered too, whether or not the run
/// names them in `meter`.
pub const KNOWN_PROVIDERS: &[(&str, &[&str])] = &[
    (
        "api.anthropic.com",
        &[
            "POST /v1/messages",
            "POST /v1/messages/count_tokens",
            "POST /v1/complete",
            "GET /v1/models",
            "GET /v1/models/*",
        ],
    ),
    (
        "api.openai.com",
        &[
            "POST /v1/chat/completions",
            "POST /v1/completions",
            "POST /v1/responses",
            "POST /v1/responses/input_tokens",
            "POST /v1/embeddings",
            "GET /v1/models",
            "GET /v1/models/*",
        ],
    ),
    (
        "openrouter.ai",
        &[
            "POST /api/v1/chat/completions",
            "POST /api/v1/completions",
            "POST /api/v1/responses",
            "POST /api/v1/messages",
            "POST /api/v1/embeddings",
            "GET /api/v1/models",
            "GET /api/v1/models/*",
        ],
    ),
    (
        "generativelanguage.googleapis.com",
        &[
            "POST /v1beta/models/*:generateContent",
            "POST /v1beta/models/*:streamGenerateContent",
            "POST /v1beta/models/*:countTokens",
            "POST /v1beta/models/*:embedContent",
            "POST /v1beta/models/*:batchEmbedContents",
            "GET /v1beta/models",
            "GET /v1beta/models/*",
            "POST /v1/models/*:generateContent",
            "POST /v1/models/*:streamGenerateContent",
            "POST /v1/models/*:countTokens",
            "POST /v1/models/*:embedContent",
            "GET /v1/models",
            "GET /v1/models/*",
            "POST /v1beta/openai/chat/completions",
            "POST /v1beta/openai/embeddings",
            "GET /v1beta/openai/models",
            "GET /v1beta/openai/models/*",
        ],
    ),
    (
        "api.mistral.ai",
        &[
            "POST /v1/chat/completions",
            "POST /v1/fim/completions",
            "POST /v1/embeddings",
            "GET /v1/models",
            "GET /v1/models/*",
        ],
    ),
    (
        "api.groq.com",
        &[
            "POST /openai/v1/chat/completions",
            "POST /openai/v1/completions",
            "POST /openai/v1/responses",
            "POST /openai/v1/embeddings",
            "GET /openai/v1/models",
            "GET /openai/v1/models/*",
        ],
    ),
    (
        "api.deepseek.com",
        &[
            "POST /chat/completions",
            "POST /completions",
            "GET /models",
            "POST /v1/chat/completions",
            "POST /v1/completions",
            "GET /v1/models",
            "POST /anthropic/v1/messages",
            "POST /anthropic/v1/messages/count_tokens",
        ],
    ),
    (
        "api.x.ai",
        &[
            "POST /v1/chat/completions",
            "POST /v1/completions",
            "POST /v1/responses",
            "POST /v1/messages",
            "POST /v1/embeddings",
            "GET /v1/models",
            "GET /v1/models/*",
        ],
    ),
];

/// The inference endpoints of `host` (normalized) when it is a known model provider.
pub fn provider_paths(host: &str) -> Option<&'static [&'static str]> {
    KNOWN_PROVIDERS
        .iter()
        .find(|(h, _)| *h == host)
        .map(|(_, p)| *p)
}

/// Whether a request for `method` and `path` (query and all) is what `rule` (`METHOD /path`, see
/// [`KNOWN_PROVIDERS`]) allows: the same method, and the path segment by segment.
fn endpoint(rule: &str, method: &str, path: &str) -> bool {
    let Some((want, pattern)) = rule.split_once(' ') else {
        return false;
    };
    let path = path.split(['?', '#']).next().unwrap_or("");
    if want != method {
        return false;
    }
    let (mut got, mut wanted) = (path.split('/'), pattern.split('/'));
    loop {
        match (got.next(), wanted.next()) {
            (None, None) => return true,
            (Some(g), Some("*")) if !g.is_empty() => {}
            (Some(g), Some(w)) if w.starts_with("*:") => {
                let suffix = &w[1..];
                if g.len() <= suffix.len() || !g.ends_with(suffix) {
                    return false;
                }
            }
            (Some(g), Some(w)) if g == w => {}
            _ => return false,
        }
    }
}

/// Whether `path` (the request target's path, query and all) names what it seems to: no dot
/// segments, no encoded dot, slash or backslash, no backslash, nothing an upstream could resolve to
/// another path than the prefix check saw.
fn plain_path(path: &str) -> bool {
    let path = path.split(['?', '#']).next().unwrap_or("");
    let lower = path.to_ascii_lowercase();
    // A dot segment is one before its parameters too (`..;` is `..` to Tomcat, Jetty and
    // Spring), and `%25` may be decoded twice on the way (`%252e` is `.` to such a server).
    path.starts_with('/')
        && !path.contains('\\')
        && !["%2e", "%2f", "%5c", "%00", "%25"]
            .iter()
            .any(|e| lower.contains(e))
        && !path.split('/').any(|seg| {
            let name = seg.split(';').next().unwrap_or("");
            name == "." || name == ".."
        })
}

/// Whether `path` is `prefix` or below it (a whole segment: `/v1/messages` holds
/// `/v1/messages/count_tokens` and `/v1/messages?beta=true`, not `/v1/messagesX`).
fn under(path: &str, prefix: &str) -> bool {
    let path = path.split(['?', '#']).next().unwrap_or("");
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
        None => false,
    }
}

/// Checks the path prefixes a run gave for a secret.
fn path_prefixes(env: &str, given: &[String]) -> Result<Vec<String>, SecretsError> {
    let bad = |path: &str, why| SecretsError::BadPath {
        env: env.to_string(),
        path: path.chars().take(64).collect(),
        why,
    };
    if given.is_empty() {
        return Err(bad(
            "",
            "the list is empty (leave `paths` out for the default)",
        ));
    }
    if given.len() > MAX_PATHS {
        return Err(bad(&given[MAX_PATHS], "too many prefixes"));
    }
    for p in given {
        if p.len() > MAX_PATH_LEN || !p.bytes().all(|b| (0x21..0x7f).contains(&b)) {
            return Err(bad(p, "it must be printable ASCII with no spaces"));
        }
        if p.contains(['?', '#']) || !plain_path(p) {
            return Err(bad(
                p,
                "it must start with `/` and hold no query, dot segment or encoded `.`, `/` or `\\`",
            ));
        }
    }
    Ok(given.to_vec())
}

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
    /// The path prefixes the value may be sent to; `None`: a known provider's inference
    /// endpoints on its host, anything on other hosts.
    paths: Option<Vec<String>>,
}

impl fmt::Debug for Secret {
    // The value never appears in logs or debug output.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Secret")
            .field("env", &self.env)
            .field("placeholder", &self.placeholder)
            .field("hosts", &self.hosts)
            .field("headers", &self.headers)
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}

impl Secret {
    /// A secret with a fresh random placeholder, replaced in `headers` (lower or mixed case;
    /// `None` for [`DEFAULT_HEADERS`]) of requests to `hosts` (no wildcard), with the default
    /// paths (see [`Secret::scoped`]).
    pub fn new(
        env: &str,
        value: &str,
        hosts: &[String],
        headers: Option<&[String]>,
    ) -> Result<Secret, SecretsError> {
        Self::scoped(env, value, hosts, headers, None, false)
    }

    /// A secret good only for requests whose path is under one of `paths` (`None`: a known
    /// provider's inference endpoints, [`KNOWN_PROVIDERS`], on its host; any path elsewhere).
    /// A wildcard among `hosts` is refused unless `wildcard`.
    pub fn scoped(
        env: &str,
        value: &str,
        hosts: &[String],
        headers: Option<&[String]>,
        paths: Option<&[String]>,
        wildcard: bool,
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
        let hosts: Vec<HostPattern> = hosts
            .iter()
            .map(|h| match HostPattern::parse_with_port(h) {
                Ok((p, None)) => Ok(p),
                Ok((_, Some(_))) => Err(SecretsError::HostPort {
                    env: env.to_string(),
                    host: h.chars().take(256).collect(),
                    name: h
                        .rsplit_once(':')
                        .map_or("", |(n, _)| n)
                        .chars()
                        .take(256)
                        .collect(),
                }),
                Err(source) => Err(SecretsError::Host {
                    env: env.to_string(),
                    source,
                }),
            })
            .collect::<Result<_, _>>()?;
        if !wildcard
            && let Some(HostPattern::Subdomains(d)) = hosts
                .iter()
                .find(|h| matches!(h, HostPattern::Subdomains(_)))
        {
            return Err(SecretsError::Wildcard {
                env: env.to_string(),
                host: format!("*.{d}"),
            });
        }
        let paths = paths.map(|p| path_prefixes(env, p)).transpose()?;
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
            paths,
        })
    }

    /// Whether the value may go in a `method` request (`""` for one that asks to be taken for
    /// another method) for `path` (path and query, as sent) to `host` (normalized): a plain path
    /// under one of the secret's prefixes, any method; without them, one of a known provider's
    /// endpoints ([`KNOWN_PROVIDERS`]), or anything on another host.
    pub fn allows(&self, host: &str, method: &str, path: &str) -> bool {
        if !plain_path(path) {
            return self.paths.is_none() && provider_paths(host).is_none();
        }
        match &self.paths {
            Some(p) => p.iter().any(|p| under(path, p)),
            None => match provider_paths(host) {
                Some(rules) => rules.iter().any(|r| endpoint(r, method, path)),
                None => true,
            },
        }
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
            || crate::sniff::http::HOP.contains(&name.as_str())
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

    /// Issue 29, item 6: a key is good only for what the run needs.
    #[test]
    fn a_known_providers_key_goes_only_to_its_inference_endpoints() {
        let s = secret();
        let host = "api.anthropic.com";
        for ok in [
            "/v1/messages",
            "/v1/messages?beta=true",
            "/v1/messages/count_tokens",
            "/v1/models",
        ] {
            let method = if ok.starts_with("/v1/models") {
                "GET"
            } else {
                "POST"
            };
            assert!(s.allows(host, method, ok), "{ok}");
        }
        for refused in [
            "/v1/organizations/api_keys",
            "/v1/files",
            "/v1/messagesX",
            "/v1/messages/../organizations/api_keys",
            "/v1/messages/%2e%2e/files",
            "/v1/messages%2F..%2Ffiles",
            "/v1/messages\\..\\files",
            "v1/messages",
            "",
        ] {
            assert!(!s.allows(host, "POST", refused), "{refused}");
        }
        // The method is the endpoint's, and nothing below it is allowed unless listed (the
        // hostile review: batches, stored completions and responses, deleted models).
        for (method, refused) in [
            ("GET", "/v1/messages"),
            ("POST", "/v1/messages/batches"),
            ("GET", "/v1/messages/batches"),
            ("GET", "/v1/messages/batches/msgbatch_1/results"),
            ("DELETE", "/v1/models/claude-x"),
            ("POST", "/v1/models"),
            ("", "/v1/messages"),
        ] {
            assert!(!s.allows(host, method, refused), "{method} {refused}");
        }
        let openai = Secret::new(
            "OPENAI_API_KEY",
            "sk-proj-0123456789",
            &["api.openai.com".into()],
            None,
        )
        .unwrap();
        let o = "api.openai.com";
        assert!(openai.allows(o, "POST", "/v1/chat/completions"));
        assert!(openai.allows(o, "POST", "/v1/responses/input_tokens"));
        assert!(openai.allows(o, "GET", "/v1/models/gpt-5"));
        for (method, refused) in [
            ("POST", "/v1/realtime/client_secrets"),
            ("POST", "/v1/organization/admin_api_keys"),
            ("GET", "/v1/chat/completions"),
            ("GET", "/v1/chat/completions/chatcmpl-1/messages"),
            ("DELETE", "/v1/chat/completions/chatcmpl-1"),
            ("GET", "/v1/responses/resp_1/input_items"),
            ("DELETE", "/v1/models/ft:gpt-4o:org:x"),
            ("GET", "/v1/models/a/b"),
        ] {
            assert!(!openai.allows(o, method, refused), "{method} {refused}");
        }
        let gemini = Secret::new(
            "GEMINI_API_KEY",
            "AIza0123456789abcdef",
            &["generativelanguage.googleapis.com".into()],
            None,
        )
        .unwrap();
        let g = "generativelanguage.googleapis.com";
        assert!(gemini.allows(g, "POST", "/v1beta/models/gemini-2.5-pro:generateContent"));
        assert!(gemini.allows(
            g,
            "POST",
            "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"
        ));
        assert!(!gemini.allows(g, "POST", "/v1beta/models/:generateContent"));
        assert!(!gemini.allows(g, "POST", "/v1beta/models/gemini-2.5-pro"));
        assert!(!gemini.allows(g, "POST", "/v1beta/files"));
        // Another host of no known provider: anything, unless the run names paths.
        let git = Secret::new(
            "GH_TOKEN",
            "ghp_0123456789abcdef",
            &["github.com".into()],
            None,
        )
        .unwrap();
        assert!(git.allows("github.com", "GET", "/owner/repo.git/git-upload-pack"));
        let scoped = Secret::scoped(
            "GH_TOKEN",
            "ghp_0123456789abcdef",
            &["github.com".into()],
            None,
            Some(&["/owner/repo.git/".into()]),
            false,
        )
        .unwrap();
        assert!(scoped.allows(
            "github.com",
            "GET",
            "/owner/repo.git/info/refs?service=git-upload-pack"
        ));
        assert!(!scoped.allows("github.com", "GET", "/owner/other.git/info/refs"));
        assert!(!scoped.allows(
            "github.com",
            "GET",
            "/owner/repo.git/../other.git/info/refs"
        ));
    }

    #[test]
    fn wildcards_and_paths_are_checked() {
        let with = |hosts: &[&str], paths: Option<&[&str]>, wildcard| {
            let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
            let paths: Option<Vec<String>> =
                paths.map(|p| p.iter().map(|x| x.to_string()).collect());
            Secret::scoped(
                "K",
                "sk-0123456789abcdef",
                &hosts,
                None,
                paths.as_deref(),
                wildcard,
            )
        };
        let e = with(&["*.azure-api.net"], None, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("wildcard") && e.contains("*.azure-api.net"),
            "{e}"
        );
        assert!(with(&["*.azure-api.net"], None, true).is_ok());
        for bad in [
            &[][..],
            &["v1/x"],
            &["/v1/x?y=1"],
            &["/a/../b"],
            &["/a%2fb"],
            &["/a b"],
        ] {
            let e = with(&["a.com"], Some(bad), false).unwrap_err().to_string();
            assert!(e.contains("secret `K`") && e.contains("paths"), "{e}");
        }
        let many: Vec<&str> = std::iter::repeat_n("/x", MAX_PATHS + 1).collect();
        assert!(with(&["a.com"], Some(&many), false).is_err());
        assert!(with(&["a.com"], Some(&["/v1/"]), false).is_ok());
        // Issue 29's second review: what a server resolves to another path than the prefix
        // check saw (`..;` is `..` to Tomcat, Jetty and Spring; `%252e` is `.` to a server that
        // decodes twice) is refused under a custom prefix and on a known provider.
        let custom = with(&["git.example.com"], Some(&["/repos/"]), false).unwrap();
        for bad in [
            "/repos/..;/admin",
            "/repos/.;/x",
            "/repos/%252e%252e/admin",
            "/repos/a%25/b",
        ] {
            assert!(!custom.allows("git.example.com", "GET", bad), "{bad}");
        }
        assert!(custom.allows("git.example.com", "GET", "/repos/a;b/c"));
        let anthropic = with(&["api.anthropic.com"], None, false).unwrap();
        for bad in ["/v1/models/..;", "/v1/models/%252e%252e"] {
            assert!(!anthropic.allows("api.anthropic.com", "GET", bad), "{bad}");
        }
        // A host with a port: refused, with the name to give instead.
        let e = with(&["api.example.com:8443"], None, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("names a port") && e.contains("`api.example.com`"),
            "{e}"
        );
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
