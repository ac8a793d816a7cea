//! Bearer-token check and Host-header check, run before every route.

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::state::AppState;

/// Compares two secrets in time independent of where they differ and of their lengths: both
/// are hashed first, and the digests compared without an early exit.
pub fn token_matches(given: &[u8], expected_digest: &[u8; 32]) -> bool {
    let d = Sha256::digest(given);
    let mut diff = 0u8;
    for (a, b) in d.iter().zip(expected_digest.iter()) {
        diff |= a ^ b;
    }
    std::hint::black_box(diff) == 0
}

/// Whether a Host header names a loopback address (DNS-rebinding protection on a loopback bind).
pub fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(h, p)| {
            if p.chars().all(|c| c.is_ascii_digit()) {
                h
            } else {
                host
            }
        })
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Middleware: Host check (on a loopback bind) then bearer token.
pub async fn require_token(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if is_signed_link(req.uri().path())
        || (crate::port_link::cookie_may_route(req.uri().path())
            && crate::port_link::from_cookie(req.headers()).is_some())
    {
        // A signed link to a guest's port carries its own proof (routes/ports.rs); the Host
        // check still holds.
        check_host(state.config().bind.is_loopback(), &req)?;
    } else {
        check(
            state.config().bind.is_loopback(),
            state.token_digest(),
            &req,
        )?;
    }
    Ok(next.run(req).await)
}

/// Whether `path` is a signed link to a guest's port (`/p/<link>…`), which a browser opens
/// without the token.
pub fn is_signed_link(path: &str) -> bool {
    path.starts_with("/p/") || path == "/p"
}

/// On a loopback bind, the Host header must name loopback (a web page elsewhere cannot reach a
/// loopback service through a name that resolves to it: DNS rebinding).
pub fn check_host(loopback_bind: bool, req: &Request) -> Result<(), ApiError> {
    if loopback_bind {
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        if !host.is_empty() && !is_loopback_host(host) {
            return Err(ApiError::ForeignHost(host.chars().take(100).collect()));
        }
    }
    Ok(())
}

/// The checks of [`require_token`], for any service that serves this API (the host, a fleet's
/// gateway): on a loopback bind the Host header must name loopback, then the bearer token must
/// be the one whose digest is `expected_digest`.
pub fn check(
    loopback_bind: bool,
    expected_digest: &[u8; 32],
    req: &Request,
) -> Result<(), ApiError> {
    check_host(loopback_bind, req)?;
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .unwrap_or(b"");
    if !token_matches(given, expected_digest) {
        return Err(ApiError::Unauthorized);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_by_digest() {
        let d: [u8; 32] = Sha256::digest(b"a-long-enough-token-123456").into();
        assert!(token_matches(b"a-long-enough-token-123456", &d));
        assert!(!token_matches(b"a-long-enough-token-123457", &d));
        assert!(!token_matches(b"", &d));
    }

    #[test]
    fn loopback_hosts() {
        for ok in [
            "127.0.0.1",
            "127.0.0.1:3004",
            "localhost:3004",
            "LOCALHOST",
            "[::1]:3004",
            "[::1]",
        ] {
            assert!(is_loopback_host(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:3004",
            "10.0.0.1:3004",
            "localhost.evil.example",
            "[fe80::1]:80",
        ] {
            assert!(!is_loopback_host(bad), "{bad}");
        }
    }
}
