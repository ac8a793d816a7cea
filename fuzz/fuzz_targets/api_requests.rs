//! The HTTP API's router in process (sandbox-host's `fuzzing` feature: the real routes,
//! middleware, extractors and errors, on a host with no microVM backend): requests whose method,
//! route, sandbox id, query string, headers and body come from the input. Bodies and queries
//! start from the documented shapes (seeds) and are mutated from there.
//!
//! Invariants: no request gets a 500 or any 5xx but 503 `unavailable`; every answer other than a
//! success is the API's JSON error (`error` and `code`, both strings); a request without the
//! right token, or naming a foreign host, never succeeds; nothing panics.
#![no_main]

use std::sync::OnceLock;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use libfuzzer_sys::fuzz_target;
use sandbox_fuzz::Input;
use tower::ServiceExt;

const TOKEN: &str = "fuzz-token-0123456789abcdef0123456789";

fn app() -> &'static (tokio::runtime::Runtime, axum::Router, tempfile::TempDir) {
    static APP: OnceLock<(tokio::runtime::Runtime, axum::Router, tempfile::TempDir)> =
        OnceLock::new();
    APP.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let router = {
            let _in = rt.enter();
            sandbox_host::fuzzing::router(TOKEN, dir.path())
        };
        (rt, router, dir)
    })
}

/// Up to `max` input bytes as text (lossy: a request line or header must be valid anyway).
fn text(input: &mut Input, max: usize) -> String {
    let n = usize::from(input.byte().unwrap_or(0)) % (max + 1);
    String::from_utf8_lossy(input.bytes(n)).into_owned()
}

fuzz_target!(|data: &[u8]| {
    let (rt, router, _) = app();
    let mut input = Input(data);
    let method = match input.byte().unwrap_or(0) % 8 {
        0 => "GET",
        1 => "POST",
        2 => "PUT",
        3 => "DELETE",
        4 => "PATCH",
        5 => "HEAD",
        6 => "OPTIONS",
        _ => "TRACE",
    };
    let id = match input.byte().unwrap_or(0) % 4 {
        0 => "sbx_0123456789abcdef".to_string(),
        1 => "..".to_string(),
        _ => text(&mut input, 40),
    };
    let route = input.byte().unwrap_or(0);
    let path = match route % 14 {
        0 => "/v1/health".to_string(),
        1 => "/metrics".to_string(),
        2 | 3 => "/v1/sandboxes".to_string(),
        4 => format!("/v1/sandboxes/{id}"),
        5 => format!("/v1/sandboxes/{id}/keepalive"),
        6 => format!("/v1/sandboxes/{id}/archive"),
        7 => format!("/v1/sandboxes/{id}/files"),
        8 => format!("/v1/sandboxes/{id}/exec"),
        9 => format!("/v1/sandboxes/{id}/egress"),
        10 => format!("/v1/sandboxes/{id}/usage"),
        _ => text(&mut input, 80),
    };
    let query = if route & 0x80 != 0 {
        format!("?{}", text(&mut input, 120))
    } else {
        String::new()
    };
    let auth = input.byte().unwrap_or(0);
    let mut req = Request::builder().method(method).uri(format!("{path}{query}"));
    let authorised = match auth % 6 {
        0 | 1 | 2 => {
            req = req.header("authorization", format!("Bearer {TOKEN}"));
            true
        }
        3 => false,
        4 => {
            req = req.header("authorization", format!("bearer {TOKEN}"));
            false
        }
        _ => {
            req = req.header("authorization", format!("Bearer {}", text(&mut input, 60)));
            false
        }
    };
    let mut foreign = false;
    match (auth >> 3) % 4 {
        0 => req = req.header("host", "127.0.0.1:3004"),
        1 => {
            req = req.header("host", "evil.example");
            foreign = true;
        }
        _ => {}
    }
    match (auth >> 5) % 4 {
        0 | 1 => req = req.header("content-type", "application/json"),
        2 => req = req.header("content-type", text(&mut input, 40)),
        _ => {}
    }
    // The rest is the body.
    let body = input.0.to_vec();
    let Ok(req) = req.body(Body::from(body)) else {
        // Not a request at all (an invalid URI or header value): hyper refuses it before us.
        return;
    };
    let res = rt
        .block_on(router.clone().oneshot(req))
        .expect("the router is infallible");
    let status = res.status();
    let bytes = rt
        .block_on(axum::body::to_bytes(res.into_body(), 16 << 20))
        .expect("a body within 16 MiB");
    let what = || format!("{method} {path}{query} -> {status}: {}", String::from_utf8_lossy(&bytes));
    if !authorised || foreign {
        assert!(
            !status.is_success(),
            "{} succeeded without the token or from a foreign host",
            what()
        );
    }
    if status.is_success() {
        return;
    }
    if method == "HEAD" {
        assert!(status != StatusCode::INTERNAL_SERVER_ERROR, "{}", what());
        return;
    }
    let v: serde_json::Value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{}: not the API's JSON error ({e})", what()));
    assert!(
        v["error"].is_string() && v["code"].is_string(),
        "{}: not the API's JSON error",
        what()
    );
    if status.is_server_error() {
        assert!(
            status == StatusCode::SERVICE_UNAVAILABLE && v["code"] == "unavailable",
            "{}",
            what()
        );
    }
});
