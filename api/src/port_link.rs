//! Signed links to a guest's port (issue 35): what `POST /v1/sandboxes/{id}/ports/{port}/url`
//! hands out and `/p/{link}/…` takes without the bearer token, so a person's browser can open
//! the dev server an agent's run started.
//!
//! A link names one sandbox, one port and an expiry, and carries an HMAC-SHA256 of them under a
//! key derived from the host's token digest: any holder of the token could make one (it can do
//! more with the token), nobody else can, and the key survives restarts without being stored.
//! A link is `<payload>.<mac>`, both base64url: the payload is readable (a fleet's gateway reads
//! the sandbox id to route it), only its MAC is secret.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use ring::hmac;

/// The longest a link may live.
pub const MAX_TTL_S: u64 = 7 * 24 * 3600;
/// A link's life when the request names none.
pub const DEFAULT_TTL_S: u64 = 3600;
/// Bytes of the MAC a link carries (128 bits).
const MAC_LEN: usize = 16;
/// The longest link read: well over any real one (an id of a named host, a port, an expiry).
const MAX_LINK: usize = 512;

/// What a link grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The sandbox.
    pub id: String,
    /// Its guest's TCP port.
    pub port: u16,
    /// Unix seconds after which the link is refused.
    pub expires: u64,
}

/// Why a link is refused: said to whoever holds it, so nothing here depends on the key.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LinkError {
    /// Not of a link's form.
    #[error("this is not a link to a sandbox's port; ask for a new one")]
    Malformed,
    /// Its MAC is not this host's.
    #[error("this link to a sandbox's port was not made by this sandbox host; ask for a new one")]
    Forged,
    /// Past its expiry.
    #[error("this link to a sandbox's port expired at {0} (Unix time); ask for a new one")]
    Expired(u64),
}

/// The key links are signed with, from the token's digest (never the token itself).
pub fn key(token_digest: &[u8; 32]) -> hmac::Key {
    let derive = hmac::Key::new(hmac::HMAC_SHA256, b"sandbox-host port link v1");
    let tag = hmac::sign(&derive, token_digest);
    hmac::Key::new(hmac::HMAC_SHA256, tag.as_ref())
}

fn payload(g: &Grant) -> String {
    format!("{}:{}:{}", g.id, g.port, g.expires)
}

/// The link for `g`.
pub fn sign(key: &hmac::Key, g: &Grant) -> String {
    let p = payload(g);
    let tag = hmac::sign(key, p.as_bytes());
    format!(
        "{}.{}",
        B64.encode(p.as_bytes()),
        B64.encode(&tag.as_ref()[..MAC_LEN])
    )
}

/// The grant of `link`, read without checking its MAC: only to route it (a gateway), never to
/// serve it.
pub fn read_unchecked(link: &str) -> Result<Grant, LinkError> {
    if link.len() > MAX_LINK {
        return Err(LinkError::Malformed);
    }
    let (p, _) = link.split_once('.').ok_or(LinkError::Malformed)?;
    let p = B64.decode(p).map_err(|_| LinkError::Malformed)?;
    let p = String::from_utf8(p).map_err(|_| LinkError::Malformed)?;
    let mut parts = p.rsplitn(3, ':');
    let expires = parts.next().and_then(|e| e.parse().ok());
    let port = parts.next().and_then(|e| e.parse().ok());
    let id = parts.next();
    match (id, port, expires) {
        (Some(id), Some(port), Some(expires)) if !id.is_empty() && port > 0 => Ok(Grant {
            id: id.to_string(),
            port,
            expires,
        }),
        _ => Err(LinkError::Malformed),
    }
}

/// The grant of `link` if this host made it and it has not expired at `now` (Unix seconds).
pub fn verify(key: &hmac::Key, link: &str, now: u64) -> Result<Grant, LinkError> {
    let g = read_unchecked(link)?;
    let (_, mac) = link.split_once('.').ok_or(LinkError::Malformed)?;
    let mac = B64.decode(mac).map_err(|_| LinkError::Malformed)?;
    if mac.len() != MAC_LEN {
        return Err(LinkError::Malformed);
    }
    // The MAC of what was read back, compared in constant time.
    let tag = hmac::sign(key, payload(&g).as_bytes());
    if !constant_time_eq(&tag.as_ref()[..MAC_LEN], &mac) {
        return Err(LinkError::Forged);
    }
    if now > g.expires {
        return Err(LinkError::Expired(g.expires));
    }
    Ok(g)
}

/// The cookie a signed link's pages carry (set by the host on the link's first answer), so that
/// what they load from the root (`/@vite/client`, `/src/main.ts`, a hot reload's WebSocket at
/// `/`) reaches the same port: a dev server's pages work under a link without a base path.
pub const COOKIE: &str = "sandbox_port_link";

/// The link in a request's cookie, if it has one.
pub fn from_cookie(headers: &axum::http::HeaderMap) -> Option<String> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_string())
}

/// Whether a request to `path` is one a link's cookie may send to a guest's port: anything but
/// the API's own routes.
pub fn cookie_may_route(path: &str) -> bool {
    !(path.starts_with("/v1/") || path == "/v1" || path == "/metrics" || path.starts_with("/p/"))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_is_read_back_and_only_this_hosts_unexpired_ones_are_taken() {
        let k = key(&[7; 32]);
        let g = Grant {
            id: "sbx-0123456789abcdef-host-a".into(),
            port: 5173,
            expires: 1_000,
        };
        let link = sign(&k, &g);
        assert!(link.len() < 100, "{link}");
        assert_eq!(verify(&k, &link, 999), Ok(g.clone()));
        assert_eq!(verify(&k, &link, 1_000), Ok(g.clone()));
        assert_eq!(read_unchecked(&link), Ok(g.clone()));
        assert_eq!(verify(&k, &link, 1_001), Err(LinkError::Expired(1_000)));
        // Another host's key, another port, a longer life: each is refused.
        assert_eq!(verify(&key(&[8; 32]), &link, 0), Err(LinkError::Forged));
        let (_, mac) = link.split_once('.').unwrap();
        for other in [
            Grant {
                port: 5174,
                ..g.clone()
            },
            Grant {
                expires: 9_999,
                ..g.clone()
            },
            Grant {
                id: "sbx-0123456789abcdef-host-b".into(),
                ..g.clone()
            },
        ] {
            let forged = format!("{}.{mac}", B64.encode(payload(&other)));
            assert_eq!(verify(&k, &forged, 0), Err(LinkError::Forged), "{other:?}");
        }
        for bad in [
            "",
            ".",
            "x.y",
            "abc",
            &"a".repeat(600),
            &format!("{}.", B64.encode("a:1:2")),
        ] {
            assert!(verify(&k, bad, 0).is_err(), "{bad}");
        }
        assert_eq!(
            read_unchecked(&format!("{}.x", B64.encode("sbx-1:0:5"))),
            Err(LinkError::Malformed)
        );
    }
}
