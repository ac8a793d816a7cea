//! A guest's ports through the API (issue 35), on the guest image: a `python3 -m http.server`
//! and a Node WebSocket echo started in the guest, reached with the token and through a signed
//! link without it, and refused once the link has expired or was tampered with.

mod common;

use common::{TOKEN, guest_image_missing, start, stock_image_missing};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

/// A WebSocket echo on the loopback in Node's own modules: its first message says what the
/// handshake it got carried (`Host`, `Origin`, whether any `Authorization`), then it echoes
/// each text message of up to 125 bytes.
const ECHO: &str = r#"
const http = require('http'), crypto = require('crypto');
const s = http.createServer((req, res) => { res.end('plain ' + req.url); });
s.on('upgrade', (req, sock) => {
  const key = crypto.createHash('sha1').update(req.headers['sec-websocket-key'] + '258EAFA5-E914-47DA-95CA-C5AB0DC85B11').digest('base64');
  sock.write('HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: ' + key + '\r\n\r\n');
  const text = (t) => { const b = Buffer.from(t); sock.write(Buffer.concat([Buffer.from([0x81, b.length]), b])); };
  text(`host=${req.headers.host} origin=${req.headers.origin} auth=${req.headers.authorization || 'none'} url=${req.url}`);
  sock.on('data', (f) => {
    const op = f[0] & 0x0f, len = f[1] & 0x7f, mask = f.subarray(2, 6), body = Buffer.from(f.subarray(6, 6 + len));
    for (let i = 0; i < body.length; i++) body[i] ^= mask[i % 4];
    if (op === 8) { sock.end(Buffer.from([0x88, 0])); return; }
    text('echo:' + body.toString());
  });
});
s.listen(8080, '127.0.0.1', () => console.log('listening'));
"#;

async fn get(url: &str, token: bool) -> (u16, Vec<u8>) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<hyper::body::Bytes>>();
    let mut req = hyper::Request::get(url);
    if token {
        req = req.header("authorization", format!("Bearer {TOKEN}"));
    }
    let res = client
        .request(req.body(Default::default()).unwrap())
        .await
        .unwrap();
    let status = res.status().as_u16();
    use http_body_util::BodyExt;
    let body = res.into_body().collect().await.unwrap().to_bytes().to_vec();
    (status, body)
}

/// A GET without the token, with `headers`, its answer as it came.
async fn get_with(url: &str, headers: &[(&str, &str)]) -> hyper::Response<hyper::body::Incoming> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<hyper::body::Bytes>>();
    let mut req = hyper::Request::get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    client
        .request(req.body(Default::default()).unwrap())
        .await
        .unwrap()
}

/// Opens a WebSocket at `url` (with the token when asked) and returns its first message and the
/// echo of `say`.
async fn echo(url: &str, token: bool, say: &str) -> (String, String) {
    let mut req = url
        .replacen("http://", "ws://", 1)
        .into_client_request()
        .unwrap();
    if token {
        req.headers_mut()
            .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    }
    req.headers_mut()
        .insert("origin", "https://review.example.com".parse().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(req).await.unwrap();
    let first = ws
        .next()
        .await
        .unwrap()
        .unwrap()
        .into_text()
        .unwrap()
        .to_string();
    ws.send(Message::text(say)).await.unwrap();
    let back = ws
        .next()
        .await
        .unwrap()
        .unwrap()
        .into_text()
        .unwrap()
        .to_string();
    let _ = ws.close(None).await;
    (first, back)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guests_servers_are_reached_with_the_token_and_through_a_signed_link() {
    if stock_image_missing() || guest_image_missing() {
        return;
    }
    let store = common::image_store();
    let h = start(&[("SANDBOX_HOST_IMAGE_DIR", store.to_str().unwrap())]);
    let (s, created) = h
        .json(
            "POST",
            "/v1/sandboxes",
            Some(
                json!({"run_id": "ports", "time_limit_ms": 600000, "review": true, "memory_mib": 1024, "vcpus": 1}),
            ),
        )
        .await;
    assert_eq!(s, 201, "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let put = common::request(
        "PUT",
        &h.url(&format!("/v1/sandboxes/{id}/files?path=/workspace/echo.js")),
        ECHO.as_bytes().to_vec(),
        &[("content-type", "application/octet-stream")],
    )
    .await;
    assert_eq!(put.0, 204, "{put:?}");
    let (_, _, end) = h
        .exec(
            &id,
            "mkdir -p /workspace/site && echo 'hello from the guest' > /workspace/site/index.html \
             && (setsid python3 -m http.server 8000 --bind 127.0.0.1 --directory /workspace/site \
                 > /tmp/http.log 2>&1 &) \
             && (setsid node /workspace/echo.js > /tmp/echo.log 2>&1 &) \
             && for i in $(seq 1 150); do \
                  curl -sf -o /dev/null http://127.0.0.1:8000/ && curl -sf -o /dev/null http://127.0.0.1:8080/ && exit 0; \
                  sleep 0.2; done; cat /tmp/http.log /tmp/echo.log; exit 1",
        )
        .await;
    assert_eq!(end["exit_code"], 0, "the servers did not start: {end}");

    // With the token.
    let (s, body) = get(
        &h.url(&format!("/v1/sandboxes/{id}/ports/8000/index.html")),
        true,
    )
    .await;
    assert_eq!(
        (s, String::from_utf8_lossy(&body).as_ref()),
        (200, "hello from the guest\n")
    );
    let (s, body) = get(
        &h.url(&format!("/v1/sandboxes/{id}/ports/8080/some/path?q=1")),
        true,
    )
    .await;
    assert_eq!(
        (s, String::from_utf8_lossy(&body).as_ref()),
        (200, "plain /some/path?q=1")
    );
    let (first, back) = echo(
        &h.url(&format!("/v1/sandboxes/{id}/ports/8080/hmr")),
        true,
        "ping-42",
    )
    .await;
    assert_eq!(
        first, "host=localhost:8080 origin=http://localhost:8080 auth=none url=/hmr",
        "the guest sees its own Host and Origin, and never the token"
    );
    assert_eq!(back, "echo:ping-42");
    // Without the token: refused, as every route.
    let (s, _) = get(
        &h.url(&format!("/v1/sandboxes/{id}/ports/8000/index.html")),
        false,
    )
    .await;
    assert_eq!(s, 401);
    // Nothing on the port.
    let (s, body) = get(&h.url(&format!("/v1/sandboxes/{id}/ports/8001/")), true).await;
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((s, v["code"].as_str()), (502, Some("port_closed")), "{v}");
    assert!(v["error"].as_str().unwrap().contains("port 8001"), "{v}");

    // A signed link: no token, the same server, WebSocket included.
    let (s, link) = h
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/ports/8080/url"),
            Some(json!({"ttl_s": 600})),
        )
        .await;
    assert_eq!(s, 200, "{link}");
    let url = link["url"].as_str().unwrap().to_string();
    assert!(
        url.starts_with("http://127.0.0.1:") && url.ends_with('/'),
        "{url}"
    );
    let (s, body) = get(&format!("{url}app.js"), false).await;
    assert_eq!(
        (s, String::from_utf8_lossy(&body).as_ref()),
        (200, "plain /app.js")
    );
    let (first, back) = echo(&format!("{url}hmr"), false, "over-a-link").await;
    assert!(
        first.starts_with("host=localhost:8080 origin=http://localhost:8080 auth=none"),
        "{first}"
    );
    assert_eq!(back, "echo:over-a-link");
    // The link's cookie takes the page's root paths (a dev server's `/@vite/client`, its hot
    // reload at `/`) to the same port, and nothing of the API.
    let res = get_with(&format!("{url}index"), &[]).await;
    let cookie = res
        .headers()
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap().to_string())
        .find(|c| c.starts_with("sandbox_port_link="))
        .expect("the link's answer sets its cookie");
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("Path=/"),
        "{cookie}"
    );
    let pair = cookie.split(';').next().unwrap().to_string();
    let base = h.url("");
    let res = get_with(
        &format!("{base}/@vite/client?x=1"),
        &[("cookie", &format!("a=b; {pair}"))],
    )
    .await;
    assert_eq!(res.status(), 200);
    assert_eq!(
        res.headers()["vary"],
        "Cookie",
        "no cache gives it without the cookie"
    );
    assert_eq!(res.headers()["cache-control"], "private, no-store");
    use http_body_util::BodyExt;
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(String::from_utf8_lossy(&body), "plain /@vite/client?x=1");
    let res = get_with(&format!("{base}/v1/sandboxes"), &[("cookie", &pair)]).await;
    assert_eq!(res.status(), 401, "the API still needs the token");
    let mut req = base
        .replacen("http://", "ws://", 1)
        .into_client_request()
        .unwrap();
    req.headers_mut().insert("cookie", pair.parse().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(req).await.unwrap();
    let first = ws
        .next()
        .await
        .unwrap()
        .unwrap()
        .into_text()
        .unwrap()
        .to_string();
    assert!(first.ends_with("auth=none url=/"), "{first}");
    let _ = ws.close(None).await;

    // No service worker through a link: it would see every later page of the origin.
    let res = get_with(&format!("{url}sw.js"), &[("service-worker", "script")]).await;
    assert_eq!(res.status(), 403);

    // Another port is not reached with it; a tampered link is refused.
    let forged = url.replacen("/p/", "/p/x", 1);
    let (s, body) = get(&forged, false).await;
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((s, v["code"].as_str()), (403, Some("link_refused")), "{v}");

    // A link that expired.
    let (s, link) = h
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/ports/8000/url"),
            Some(json!({"ttl_s": 1})),
        )
        .await;
    assert_eq!(s, 200, "{link}");
    let short = link["url"].as_str().unwrap().to_string();
    let (s, _) = get(&format!("{short}index.html"), false).await;
    assert_eq!(s, 200);
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    let (s, body) = get(&format!("{short}index.html"), false).await;
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((s, v["code"].as_str()), (403, Some("link_refused")), "{v}");
    assert!(v["error"].as_str().unwrap().contains("expired"), "{v}");
    for (body, why) in [
        (json!({"ttl_s": 0}), "ttl_s must be 1 to 604800"),
        (json!({"ttl_s": 604801}), "ttl_s must be 1 to 604800"),
        (json!({"ttl": 5}), "unknown field"),
    ] {
        let (s, v) = h
            .json(
                "POST",
                &format!("/v1/sandboxes/{id}/ports/8000/url"),
                Some(body),
            )
            .await;
        assert_eq!(s, 400, "{v}");
        assert!(v["error"].as_str().unwrap().contains(why), "{v}");
    }

    // The sandbox gone, its links go with it.
    let (s, _) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert!(s == 200 || s == 204);
    let (s, _) = get(&format!("{url}app.js"), false).await;
    assert_eq!(s, 404);
}
