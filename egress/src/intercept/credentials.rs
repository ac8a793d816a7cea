//! The secrets' placeholders in a request's headers: replaced by the real value only in the
//! secret's credential headers, in the shape of a credential, over TLS to the secret's hosts and
//! paths; anywhere else a leak.

use hyper::header::HeaderValue;

use super::Proxy;
use crate::refusal::Reason;
use crate::secrets::Secret;

impl Proxy {
    pub(super) fn secrets(&self) -> &[Secret] {
        self.icp.as_ref().map_or(&[], |i| i.secrets.as_slice())
    }
    /// The value of header `name` with each placeholder replaced by its secret's value, where
    /// the request goes over TLS to the secret's hosts and `name` is one of its credential
    /// headers; `Err(PlaceholderLeak)` for a placeholder anywhere else (another secret's host,
    /// another header, plain HTTP), `Err(PathNotAllowed)` where `path` is not the secret's.
    pub(super) fn substitute(
        &self,
        name: &str,
        v: &HeaderValue,
        shape: Shape,
        (method, path): (&str, &str),
    ) -> Result<HeaderValue, Reason> {
        let leak = Reason::PlaceholderLeak;
        let bytes = v.as_bytes();
        let mut out: Option<Vec<u8>> = None;
        for s in self.secrets() {
            let p = s.placeholder.as_bytes();
            let cur = out.as_deref().unwrap_or(bytes);
            if !cur.windows(p.len()).any(|w| w == p) {
                continue;
            }
            if !self.tls
                || !s.applies_to(&self.name)
                || !s.substitutes_in(name)
                || !credential_shape(cur, p, shape)
            {
                return Err(leak);
            }
            if !s.allows(&self.name, method, path) {
                return Err(Reason::PathNotAllowed);
            }
            let text = String::from_utf8_lossy(cur).replace(&s.placeholder, s.value());
            out = Some(text.into_bytes());
        }
        match out {
            None => Ok(v.clone()),
            Some(b) => {
                let mut v = HeaderValue::from_bytes(&b).map_err(|_| leak)?;
                v.set_sensitive(true); // never indexed by HPACK
                Ok(v)
            }
        }
    }

    /// `Basic <base64(user:password)>` with placeholders inside (git and other tools send a token
    /// as the password): decoded, substituted by [`substitute`](Self::substitute)'s rules, and
    /// encoded again. Any other value is returned as it is.
    pub(super) fn substitute_basic(
        &self,
        name: &str,
        v: &HeaderValue,
        route: (&str, &str),
    ) -> Result<HeaderValue, Reason> {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        let Some(encoded) = v.to_str().ok().and_then(|t| {
            t.strip_prefix("Basic ")
                .or_else(|| t.strip_prefix("basic "))
        }) else {
            return Ok(v.clone());
        };
        let Ok(decoded) = b64.decode(encoded.trim()) else {
            return Ok(v.clone());
        };
        let Ok(inner) = HeaderValue::from_bytes(&decoded) else {
            return Ok(v.clone());
        };
        let replaced = self.substitute(name, &inner, Shape::BasicPair, route)?;
        if replaced.as_bytes() == decoded.as_slice() {
            return Ok(v.clone());
        }
        let mut out = HeaderValue::from_str(&format!("Basic {}", b64.encode(replaced.as_bytes())))
            .map_err(|_| Reason::PlaceholderLeak)?;
        out.set_sensitive(true);
        Ok(out)
    }
}

/// Where a placeholder is being substituted: a header value as sent, or the `user:password`
/// pair decoded from `Authorization: Basic`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
    Header,
    BasicPair,
}

/// Whether a value holding `placeholder` has the shape of a credential: in a header, the
/// placeholder alone or after one short scheme word (`Bearer <placeholder>`); inside Basic, the
/// password of a short user name (`user:<placeholder>`), and only there (issue 29, item 3).
/// Padding around it would let a guest choose where a provider that quotes a truncated header
/// cuts the key.
pub(super) fn credential_shape(value: &[u8], placeholder: &[u8], shape: Shape) -> bool {
    let Some(before) = value.strip_suffix(placeholder) else {
        return false;
    };
    match shape {
        Shape::BasicPair => before
            .strip_suffix(b":")
            .is_some_and(|user| user.len() <= 64 && !user.contains(&b':')),
        Shape::Header => {
            if before.is_empty() {
                return true;
            }
            let word = before.strip_suffix(b" ").unwrap_or(b"");
            !word.is_empty() && word.len() <= 16 && word.iter().all(u8::is_ascii_alphanumeric)
        }
    }
}

/// Whether `needle` occurs in `hay`.
pub(super) fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}
