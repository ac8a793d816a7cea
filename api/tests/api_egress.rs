//! Egress from inside a real guest (issue 5), through the real binary: the guest resolves an
//! allowed name through the stack's DNS and fetches from a server on this machine's loopback
//! (reached through `SANDBOX_HOST_EGRESS_RESOLVE`), and every way around the allowlist is
//! refused, counted by reason, and shown in `/egress` and `/metrics`. No traffic leaves the
//! machine: names outside the overrides are refused inside the stack before any lookup.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{guest_image_missing, start, stock_image_missing};
use serde_json::{Value, json};
use std::process::{Command, Stdio};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A plain HTTP/1.1 server on loopback that answers every request with `body` (or, for
/// `REDIRECT <url>`, a redirect there) and records the request heads it saw.
async fn http_server(body: &'static str) -> (u16, Arc<Mutex<Vec<String>>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let log = log.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut b = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut b).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&b[..n]),
                    }
                }
                log.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&head).into_owned());
                let answer = match body.strip_prefix("REDIRECT ") {
                    Some(to) => format!(
                        "HTTP/1.1 302 Found\r\nlocation: {to}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    ),
                    None => format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    ),
                };
                let _ = s.write_all(answer.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    (port, seen)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

async fn egress(h: &common::Host, id: &str) -> Value {
    let (s, v) = h
        .json("GET", &format!("/v1/sandboxes/{id}/egress"), None)
        .await;
    assert_eq!(s, 200, "{v}");
    v
}

/// `printf <request> | nc <host> <port>` in the guest: busybox's nc is the stock image's HTTP
/// client (its static wget crashes in name lookup).
fn nc_get(host: &str, port: u16, host_header: &str) -> String {
    format!(
        "printf 'GET /hello HTTP/1.1\\r\\nHost: {host_header}\\r\\nConnection: close\\r\\n\\r\\n' | nc -w 5 {host} {port}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_reaches_allowed_names_and_nothing_else() {
    if stock_image_missing() {
        return;
    }
    let (port, seen) = http_server("hello from allowed.test\n").await;
    let (other_port, other_seen) = http_server("you should not see this\n").await;
    let resolve = format!(
        "allowed.test:{port}:127.0.0.1,other.test:{other_port}:127.0.0.1,private.test:{port}:10.0.0.5,metadata.test:80:169.254.169.254,mapped.test:80:[::ffff:169.254.169.254]"
    );
    // The rest of the internal ranges of `references.md`, each a name the guest may use (loopback
    // is the one range an override may name, for tests; without one it is refused like these, as
    // `upstream`'s unit tests show with a resolver that answers loopback).
    let internal = [
        ("cgnat.test", "100.64.1.1"),
        ("linklocal.test", "169.254.1.1"),
        ("alibaba.test", "100.100.100.200"),
        ("azure.test", "168.63.129.16"),
        ("ecs.test", "169.254.170.2"),
        ("awsv6.test", "[fd00:ec2::254]"),
        ("nat64.test", "[64:ff9b::a9fe:a9fe]"),
        ("sixtofour.test", "[2002:a9fe:a9fe::1]"),
        ("ula.test", "[fc00::1]"),
    ];
    let resolve = internal
        .iter()
        .fold(resolve, |r, (n, a)| format!("{r},{n}:80:{a}"));
    let h = start(&[("SANDBOX_HOST_EGRESS_RESOLVE", &resolve)]);
    let mut allow = vec![
        "allowed.test",
        "private.test",
        "metadata.test",
        "mapped.test",
    ];
    allow.extend(internal.iter().map(|(n, _)| *n));
    let id = h.create(json!({"egress": {"allow": allow}})).await;

    // DNS: an allowed name gets an address of the stack's pool, any other name NXDOMAIN.
    let (out, err, last) = h.exec(&id, "nslookup allowed.test").await;
    assert_eq!(last["exit_code"], 0, "{} {}", text(&out), text(&err));
    assert!(text(&out).contains("198.18."), "{}", text(&out));
    let (out, _, last) = h.exec(&id, "nslookup other.test").await;
    assert_ne!(last["exit_code"], 0, "{}", text(&out));

    // Plain HTTP to the allowed name, through the stack, byte for byte.
    let (out, err, last) = h
        .exec(
            &id,
            &nc_get("allowed.test", port, &format!("allowed.test:{port}")),
        )
        .await;
    assert_eq!(last["exit_code"], 0, "{last} {}", text(&err));
    assert!(
        text(&out).ends_with("\r\n\r\nhello from allowed.test\n"),
        "{}",
        text(&out)
    );
    let heads = seen.lock().unwrap().clone();
    assert_eq!(heads.len(), 1);
    assert!(
        heads[0].starts_with("GET /hello HTTP/1.1\r\n"),
        "{}",
        heads[0]
    );
    // Every request of a connection is checked, not only the first: a second request on the same
    // connection naming another host is refused.
    let (out, _, _) = h
        .exec(
            &id,
            &format!("printf 'GET /a HTTP/1.1\\r\\nHost: allowed.test:{port}\\r\\n\\r\\nGET /b HTTP/1.1\\r\\nHost: other.test\\r\\n\\r\\n' | nc -w 5 allowed.test {port}"),
        )
        .await;
    let out = text(&out);
    assert!(out.contains("hello from allowed.test"), "{out}");
    assert!(
        out.contains("x-sandbox-egress-refused: sni_host_mismatch"),
        "{out}"
    );
    assert_eq!(seen.lock().unwrap().len(), 2);

    // Refused, each failing fast: a name outside the allowlist, IP literals (the slirp-style
    // host alias, a public address, the gateway itself), names that resolve into a private range
    // or to cloud metadata (also as an IPv4-mapped IPv6 address), a foreign DNS server, UDP,
    // CONNECT, a Host that is not the connection's name, and a protocol that is not HTTP or TLS.
    let t = Instant::now();
    let cases = [
        (nc_get("other.test", other_port, "other.test"), "name"),
        (nc_get("10.0.2.2", port, "allowed.test"), "literal"),
        (nc_get("1.1.1.1", 80, "allowed.test"), "literal"),
        ("nc -w 3 10.233.0.1 3004 </dev/null".to_string(), "gateway"),
        (nc_get("private.test", port, "private.test"), "private"),
        (nc_get("metadata.test", 80, "metadata.test"), "metadata"),
        (nc_get("mapped.test", 80, "mapped.test"), "mapped"),
        ("nslookup allowed.test 8.8.8.8".to_string(), "dns"),
        (
            "traceroute -n -m 2 -w 1 198.18.0.1; nc -w 3 8.8.8.8 853 </dev/null".to_string(),
            "udp+dot",
        ),
        (
            format!(
                "printf 'CONNECT evil.test:443 HTTP/1.1\\r\\nHost: evil.test:443\\r\\n\\r\\n' | nc -w 5 allowed.test {port}"
            ),
            "connect",
        ),
        (nc_get("allowed.test", port, "other.test"), "host"),
        (
            "nc -w 3 10.233.0.1 53 </dev/null".to_string(),
            "dns over tcp",
        ),
        (
            format!("echo SSH-2.0-OpenSSH_9.9 | nc -w 5 allowed.test {port}"),
            "protocol",
        ),
    ];
    for (cmd, why) in &cases {
        let started = Instant::now();
        let (out, err, last) = h.exec(&id, cmd).await;
        let out = text(&out);
        assert!(
            !out.contains("should not see") && !out.contains("hello from"),
            "{why}: {cmd} got through: {out}"
        );
        if !why.starts_with("udp") && !out.contains("403 Forbidden") {
            assert_ne!(last["exit_code"], 0, "{why}: {cmd}: {out} {}", text(&err));
        }
        // Refused, not dropped: a dropped probe waits out the tool's own timeout. busybox's
        // nslookup retries after the port-unreachable it gets, which took 5 s in a loaded CI run,
        // so its proof is the refusal it reports, under a bound that a drop (two 5 s tries and
        // more) does not meet.
        let limit = if *why == "dns" {
            assert!(
                text(&err).contains("Connection refused"),
                "{why}: {cmd} was not refused: {}",
                text(&err)
            );
            Duration::from_secs(9)
        } else {
            Duration::from_secs(4)
        };
        assert!(
            started.elapsed() < limit,
            "{why}: {cmd} took {:?} to fail: {}",
            started.elapsed(),
            text(&err)
        );
        if matches!(*why, "connect" | "host" | "protocol") {
            assert!(
                out.starts_with("HTTP/1.1 403 Forbidden\r\n"),
                "{why}: {out}"
            );
        }
    }
    for (name, addr) in internal {
        let started = Instant::now();
        let (out, _, last) = h.exec(&id, &nc_get(name, 80, name)).await;
        assert_ne!(last["exit_code"], 0, "{name} ({addr}): {}", text(&out));
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{name} took {:?}",
            started.elapsed()
        );
    }
    assert!(other_seen.lock().unwrap().is_empty());
    assert_eq!(
        seen.lock().unwrap().len(),
        2,
        "only the allowed requests arrived"
    );
    eprintln!("{} refusals answered in {:?}", cases.len(), t.elapsed());

    let v = egress(&h, &id).await;
    let by = &v["by_reason"];
    assert!(by["name_not_allowed"].as_u64() >= Some(2), "{v}");
    assert!(by["ip_literal"].as_u64() >= Some(3), "{v}");
    assert_eq!(by["internal_address"], 3 + internal.len(), "{v}");
    assert!(by["dns_bypass"].as_u64() >= Some(3), "{v}");
    assert!(by["udp"].as_u64() >= Some(1), "{v}");
    assert_eq!(by["http_connect"], 1, "{v}");
    assert_eq!(by["sni_host_mismatch"], 2, "{v}");
    assert_eq!(by["protocol"], 1, "{v}");
    let events = v["events"].as_array().unwrap();
    assert!(
        events
            .iter()
            .any(|e| e["reason"] == "internal_address"
                && e["target"] == format!("private.test:{port}")),
        "{v}"
    );
    assert_eq!(v["connections"]["http"], 2, "{v}");
    assert_eq!(v["connections"]["open"], 0, "{v}");
    assert!(v["bytes"]["to_guest"].as_u64() > Some(20), "{v}");
    // The sandbox's summary carries the same counters.
    let (_, show) = h.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(show["egress"]["refused"], v["refused"], "{show}");

    let (_, m) = h.req("GET", "/metrics", vec![], &[]).await;
    let m = text(&m);
    assert!(
        m.contains(&format!(
            "sandbox_host_egress_refusals_total{{reason=\"internal_address\"}} {}",
            3 + internal.len()
        )),
        "{m}"
    );
    // The totals stay after the sandbox goes.
    let (s, _) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, 204);
    let (_, m) = h.req("GET", "/metrics", vec![], &[]).await;
    assert!(
        text(&m).contains(&format!(
            "sandbox_host_egress_refusals_total{{reason=\"internal_address\"}} {}",
            3 + internal.len()
        )),
        "{}",
        text(&m)
    );
}

/// A TLS server on loopback (`openssl s_server -www`) for `name`; its process, port and CA PEM.
fn tls_server(dir: &std::path::Path, name: &str) -> (std::process::Child, u16, String) {
    common::make_certs(dir, &[name]);
    let port = common::free_port();
    let child = Command::new("openssl")
        .args([
            "s_server",
            "-quiet",
            "-www",
            "-accept",
            &format!("127.0.0.1:{port}"),
            "-cert",
            "srv.pem",
            "-key",
            "srv.key",
        ])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("openssl s_server starts");
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "s_server did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (
        child,
        port,
        std::fs::read_to_string(dir.join("ca.pem")).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guest_images_clients_go_through_the_stack() {
    if stock_image_missing() {
        return;
    }
    if guest_image_missing() {
        return;
    }
    let store = common::image_store();
    let dir = tempfile::tempdir().unwrap();
    let (mut tls, tls_port, ca) = tls_server(dir.path(), "tls.test");
    let (port, seen) = http_server("hello from allowed.test\n").await;
    let (redirect_port, _) = http_server("REDIRECT http://evil.test/").await;
    let resolve = format!(
        "allowed.test:{port}:127.0.0.1,allowed.test:{redirect_port}:127.0.0.1,tls.test:{tls_port}:127.0.0.1"
    );
    let h = start(&[
        ("SANDBOX_HOST_EGRESS_RESOLVE", &resolve),
        ("SANDBOX_HOST_IMAGE_DIR", store.to_str().unwrap()),
    ]);
    let id = h
        .create(json!({"image": "vantik-guest:latest", "egress": {"allow": ["allowed.test", "tls.test"]}}))
        .await;
    let (s, _) = h
        .req(
            "PUT",
            &format!("/v1/sandboxes/{id}/files?path=/tmp/test-ca.pem"),
            ca.into_bytes(),
            &[],
        )
        .await;
    assert!(s == 200 || s == 204, "upload: {s}");

    let url = format!("http://allowed.test:{port}/hello");
    for (client, cmd) in [
        ("curl", format!("curl -sS -m 10 {url}")),
        (
            "python",
            format!(
                "python3 -c \"import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('{url}', timeout=10).read().decode())\""
            ),
        ),
        (
            "node",
            format!(
                "node -e \"fetch('{url}').then(r => r.text()).then(t => process.stdout.write(t))\""
            ),
        ),
    ] {
        let (out, err, last) = h.exec(&id, &cmd).await;
        assert_eq!(
            last["exit_code"],
            0,
            "{client}: {} {}",
            text(&out),
            text(&err)
        );
        assert_eq!(text(&out), "hello from allowed.test\n", "{client}");
    }
    assert_eq!(seen.lock().unwrap().len(), 3);

    // HTTPS, spliced: the guest verifies the real server's certificate end to end.
    let (out, err, last) = h
        .exec(
            &id,
            &format!("curl -sS -i -m 10 --cacert /tmp/test-ca.pem https://tls.test:{tls_port}/ | head -c 200"),
        )
        .await;
    assert_eq!(last["exit_code"], 0, "{} {}", text(&out), text(&err));
    assert!(
        text(&out).contains("HTTP/1.0 200 ok"),
        "{} {}",
        text(&out),
        text(&err)
    );
    // The same server under another allowed name (SNI differs from the pinned name), and a
    // name outside the allowlist: refused before any byte reaches it.
    let (out, err, last) = h
        .exec(
            &id,
            &format!("curl -sS -m 10 -k --connect-to allowed.test:{tls_port}:tls.test:{tls_port} https://allowed.test:{tls_port}/; curl -sS -m 10 -k https://dns.google/dns-query"),
        )
        .await;
    assert_ne!(last["exit_code"], 0, "{} {}", text(&out), text(&err));
    let err = text(&err);
    assert!(
        err.contains("curl: (35)") || err.contains("curl: (56)"),
        "{err}"
    );
    assert!(err.contains("curl: (6)"), "{err}");
    // An allowed name's TLS sent to another address (the guest's own resolution), and a redirect
    // to a name outside the allowlist: both refused.
    let (out, err, _) = h
        .exec(
            &id,
            &format!("curl -sS -m 5 -k --resolve tls.test:{tls_port}:203.0.113.7 https://tls.test:{tls_port}/; curl -sS -L -m 5 http://allowed.test:{redirect_port}/"),
        )
        .await;
    let err = text(&err);
    assert!(err.contains("curl: (7)"), "{} {err}", text(&out));
    assert!(
        err.contains("curl: (6)") && err.contains("evil.test"),
        "{err}"
    );
    let v = egress(&h, &id).await;
    assert_eq!(v["by_reason"]["sni_host_mismatch"], 1, "{v}");
    assert_eq!(v["by_reason"]["ip_literal"], 1, "{v}");
    assert!(
        v["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["reason"] == "name_not_allowed" && e["target"] == "evil.test"),
        "{v}"
    );
    assert_eq!(v["connections"]["spliced"], 1, "{v}");
    let _ = tls.kill();
    let _ = tls.wait();
}

const ANTHROPIC_JSON: &str = r#"{"id":"msg_01json","type":"message","role":"assistant","model":"claude-test-1","content":[{"type":"text","text":"usage: {\"input_tokens\": 999999} is not mine"}],"stop_reason":"end_turn","usage":{"input_tokens":1200,"cache_creation_input_tokens":300,"cache_read_input_tokens":4000,"output_tokens":85}}"#;

const ANTHROPIC_SSE: &[&str] = &[
    "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_02sse\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-test-2\",\"content\":[],\"usage\":{\"input_tokens\":2100,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":512,\"output_tokens\":1}}}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hel",
    "lo\"}}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":null},\"usage\":{\"output_tokens\":40}}\n\n",
    "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":77}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
];

const OPENAI_SSE: &[&str] = &[
    "data: {\"id\":\"chatcmpl-3\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-test\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n",
    "data: {\"id\":\"chatcmpl-3\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-test\",\"choices\":[],\"usage\":{\"prompt_tokens\":310,\"completion_tokens\":12,\"total_tokens\":322,\"prompt_tokens_details\":{\"cached_tokens\":100}}}\n\n",
    "data: [DONE]\n\n",
];

/// OpenAI's Responses API, streaming: usage in `response.completed`, whatever was asked.
const RESPONSES_SSE: &[&str] = &[
    "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_5\",\"object\":\"response\",\"model\":\"gpt-test\",\"usage\":null}}\n\n",
    "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n",
    "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_5\",\"object\":\"response\",\"model\":\"gpt-test\",\"usage\":{\"input_tokens\":70,\"input_tokens_details\":{\"cached_tokens\":20},\"output_tokens\":5,\"total_tokens\":75}}}\n\n",
];

/// OpenAI's answer to a chat completion that does not stream: usage always.
const OPENAI_JSON: &str = r#"{"id":"chatcmpl-7","object":"chat.completion","model":"gpt-test","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}"#;

/// A call whose usage comes later, elsewhere (a batch): no usage in its answer.
const BATCH_JSON: &str = r#"{"id":"batch_6","object":"batch","status":"validating"}"#;

/// Gemini's `generateContent` answer: usage in `usageMetadata`, thoughts billed as output.
const GEMINI_JSON: &str = r#"{"candidates":[{"content":{"parts":[{"text":"ok"}],"role":"model"},"finishReason":"STOP","index":0}],"usageMetadata":{"promptTokenCount":64,"candidatesTokenCount":5,"thoughtsTokenCount":20,"cachedContentTokenCount":32,"totalTokenCount":89},"modelVersion":"gemini-test-1","responseId":"resp-gemini-5"}"#;
const OPENROUTER_JSON: &str = r#"{"id":"gen-4","object":"chat.completion","model":"router/model","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}],"usage":{"prompt_tokens":50,"completion_tokens":7,"total_tokens":57,"cost":0.00123}}"#;

/// What the fake provider received: the request head and body.
type Seen = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// A fake model provider on loopback (HTTPS, HTTP/1.1, keep-alive): Anthropic JSON or SSE on
/// `/v1/messages` (SSE when the body asks for a stream), OpenAI SSE on `/v1/chat/completions`
/// (JSON when the body does not ask for a stream; the stream's usage chunk only when the body
/// asks for it, as OpenAI does), Responses API SSE on
/// `/v1/responses`, a batch on `/v1/batches`, OpenRouter JSON with a billed cost on
/// `/api/v1/chat/completions`, Gemini JSON on `…:generateContent`; anything under `/hang/`
/// after 5 s. Streams are sent in pieces.
/// TLS with the certificate `make_certs` put in `dir` (`common::tls_acceptor`).
async fn fake_provider(dir: &std::path::Path) -> (u16, Seen) {
    let acceptor = common::tls_acceptor(dir);
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let seen: Seen = Arc::default();
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let (acceptor, log) = (acceptor.clone(), log.clone());
            tokio::spawn(async move {
                let Ok(mut s) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = Vec::new();
                loop {
                    let Some(end) = read_head(&mut s, &mut buf).await else {
                        return;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    let len: usize = head
                        .lines()
                        .find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            k.eq_ignore_ascii_case("content-length")
                                .then(|| v.trim().parse().ok())?
                        })
                        .unwrap_or(0);
                    buf.drain(..end);
                    while buf.len() < len {
                        let mut b = [0u8; 4096];
                        match s.read(&mut b).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&b[..n]),
                        }
                    }
                    let body: Vec<u8> = buf.drain(..len).collect();
                    let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
                    let stream = String::from_utf8_lossy(&body).contains("\"stream\":true");
                    let v = serde_json::from_slice::<Value>(&body).unwrap_or_default();
                    log.lock().unwrap().push((head, body));
                    let (ctype, pieces): (&str, Vec<&str>) = if path.starts_with("/v1/messages") {
                        if stream {
                            ("text/event-stream", ANTHROPIC_SSE.to_vec())
                        } else {
                            ("application/json", vec![ANTHROPIC_JSON])
                        }
                    } else if path.starts_with("/v1/chat/completions") {
                        let mut pieces = OPENAI_SSE.to_vec();
                        if v["stream_options"]["include_usage"] != true {
                            pieces.remove(1);
                        }
                        if v["stream"] == true {
                            ("text/event-stream", pieces)
                        } else {
                            ("application/json", vec![OPENAI_JSON])
                        }
                    } else if path.starts_with("/v1/responses") {
                        ("text/event-stream", RESPONSES_SSE.to_vec())
                    } else if path.starts_with("/v1/batches") {
                        ("application/json", vec![BATCH_JSON])
                    } else if path.ends_with(":generateContent") {
                        ("application/json", vec![GEMINI_JSON])
                    } else {
                        ("application/json", vec![OPENROUTER_JSON])
                    };
                    let h = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: {ctype}\r\ntransfer-encoding: chunked\r\n\r\n"
                    );
                    if s.write_all(h.as_bytes()).await.is_err() {
                        return;
                    }
                    if path.starts_with("/hang/") {
                        // A provider still thinking before it answers at all.
                        tokio::time::sleep(Duration::from_secs(5)).await;
                    }

                    let pause = if path.starts_with("/v1/messages/slow") {
                        Duration::from_secs(2) // between events: a model thinking
                    } else {
                        Duration::from_millis(30)
                    };
                    for p in pieces {
                        let chunk = format!("{:x}\r\n{p}\r\n", p.len());
                        if s.write_all(chunk.as_bytes()).await.is_err() {
                            return;
                        }
                        let _ = s.flush().await;
                        tokio::time::sleep(pause).await;
                    }
                    if s.write_all(b"0\r\n\r\n").await.is_err() {
                        return;
                    }
                    let _ = s.flush().await;
                }
            });
        }
    });
    (port, seen)
}

/// Reads until a request head is complete in `buf`; its length with the blank line.
async fn read_head(s: &mut (impl AsyncReadExt + Unpin), buf: &mut Vec<u8>) -> Option<usize> {
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(i + 4);
        }
        let mut b = [0u8; 4096];
        match s.read(&mut b).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&b[..n]),
        }
    }
}

fn sha256(data: &[u8]) -> String {
    let out = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(data)?;
            c.wait_with_output()
        })
        .unwrap();
    String::from_utf8_lossy(&out.stdout)[..64].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_keys_are_injected_and_usage_is_metered() {
    if stock_image_missing() || guest_image_missing() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    common::make_certs(
        dir.path(),
        &[
            "api.provider.test",
            "openai.provider.test",
            "router.provider.test",
            "gemini.provider.test",
        ],
    );
    let (port, seen) = fake_provider(dir.path()).await;
    let (http_port, http_seen) = http_server("plain\n").await;
    let resolve = format!(
        "api.provider.test:{port}:127.0.0.1,openai.provider.test:{port}:127.0.0.1,router.provider.test:{port}:127.0.0.1,gemini.provider.test:{port}:127.0.0.1,allowed.test:{http_port}:127.0.0.1"
    );
    let ca = dir.path().join("ca.pem");
    let store = common::image_store();
    let h = start(&[
        ("SANDBOX_HOST_EGRESS_RESOLVE", &resolve),
        ("SANDBOX_HOST_EGRESS_CA_FILE", ca.to_str().unwrap()),
        ("SANDBOX_HOST_IMAGE_DIR", store.to_str().unwrap()),
    ]);
    let (anthropic_key, openai_key, router_key) = (
        "sk-ant-api03-REALKEY-0123456789abcdef",
        "sk-proj-REALKEY-fedcba9876543210",
        "sk-or-v1-REALKEY-0011223344556677",
    );
    let gemini_key = "AIzaREALKEY-gemini-0123456789abcdef";
    let id = h
        .create(json!({
            "image": "vantik-guest:latest",
            "egress": {
                "allow": ["allowed.test"],
                "meter": ["router.provider.test"],
                "secrets": [
                    {"env": "ANTHROPIC_API_KEY", "value": anthropic_key, "hosts": ["api.provider.test"]},
                    {"env": "OPENAI_API_KEY", "value": openai_key, "hosts": ["openai.provider.test"]},
                    {"env": "OPENROUTER_API_KEY", "value": router_key, "hosts": ["router.provider.test"]},
                    {"env": "GEMINI_API_KEY", "value": gemini_key, "hosts": ["gemini.provider.test"],
                     "headers": ["x-goog-api-key"]}
                ]
            }
        }))
        .await;

    // The guest sees placeholders, never a key.
    let (out, _, _) = h
        .exec(&id, "echo $ANTHROPIC_API_KEY; echo $NODE_EXTRA_CA_CERTS")
        .await;
    let out = text(&out);
    assert!(!out.contains("REALKEY"), "{out}");
    assert!(out.starts_with("vantik-placeholder-"), "{out}");
    assert!(
        out.contains("/etc/ssl/certs/sandbox-egress-ca.pem"),
        "{out}"
    );

    let base = format!("https://api.provider.test:{port}");
    let cases: Vec<(&str, String, String)> = vec![
        (
            "anthropic json, HTTP/1.1",
            format!(
                "curl -sS --http1.1 -H \"x-api-key: $ANTHROPIC_API_KEY\" -H 'content-type: application/json' -d '{{\"model\":\"m\"}}' {base}/v1/messages"
            ),
            ANTHROPIC_JSON.to_string(),
        ),
        (
            "anthropic sse, HTTP/2",
            format!(
                "curl -sS --http2 -H \"x-api-key: $ANTHROPIC_API_KEY\" -d '{{\"stream\":true}}' {base}/v1/messages"
            ),
            ANTHROPIC_SSE.concat(),
        ),
        (
            "openai sse",
            format!(
                "curl -sS -H \"authorization: Bearer $OPENAI_API_KEY\" -d '{{\"stream\":true}}' https://openai.provider.test:{port}/v1/chat/completions"
            ),
            OPENAI_SSE.concat(),
        ),
        (
            "openrouter json with cost",
            format!(
                "curl -sS -H \"authorization: Bearer $OPENROUTER_API_KEY\" -d '{{}}' https://router.provider.test:{port}/api/v1/chat/completions"
            ),
            OPENROUTER_JSON.to_string(),
        ),
        (
            "gemini json (its native API)",
            format!(
                "curl -sS -H \"x-goog-api-key: $GEMINI_API_KEY\" -d '{{}}' https://gemini.provider.test:{port}/v1beta/models/gemini-test-1:generateContent"
            ),
            GEMINI_JSON.to_string(),
        ),
        (
            "node fetch",
            format!(
                "node -e \"fetch('{base}/v1/messages',{{method:'POST',headers:{{'x-api-key':process.env.ANTHROPIC_API_KEY}},body:'{{}}'}}).then(r=>r.text()).then(t=>process.stdout.write(t))\""
            ),
            ANTHROPIC_JSON.to_string(),
        ),
        (
            "python urllib",
            format!(
                "python3 -c \"import os,sys,urllib.request as u; r=u.Request('{base}/v1/messages', data=b'{{}}', headers={{'x-api-key': os.environ['ANTHROPIC_API_KEY']}}); sys.stdout.write(u.urlopen(r, timeout=20).read().decode())\""
            ),
            ANTHROPIC_JSON.to_string(),
        ),
    ];
    for (what, cmd, want) in &cases {
        let (out, err, last) = h.exec(&id, &format!("{cmd} | sha256sum")).await;
        assert_eq!(last["exit_code"], 0, "{what}: {}", text(&err));
        assert_eq!(
            text(&out).split_whitespace().next(),
            Some(sha256(want.as_bytes()).as_str()),
            "{what}: the guest got other bytes than the provider sent; stderr: {}",
            text(&err)
        );
    }
    // A key sent as a Basic password (git over HTTPS does this) is replaced inside the encoding.
    let (out, err, last) = h
        .exec(
            &id,
            &format!("curl -sS -u \"x-access-token:$OPENROUTER_API_KEY\" -d '{{}}' https://router.provider.test:{port}/api/v1/chat/completions | sha256sum"),
        )
        .await;
    assert_eq!(last["exit_code"], 0, "{}", text(&err));
    assert_eq!(
        text(&out).split_whitespace().next(),
        Some(sha256(OPENROUTER_JSON.as_bytes()).as_str())
    );
    let basic = {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(format!("x-access-token:{router_key}"))
    };
    let last_head = seen.lock().unwrap().last().unwrap().0.clone();
    assert!(
        last_head.contains(&format!("authorization: Basic {basic}"))
            || last_head.contains(&format!("Authorization: Basic {basic}")),
        "{last_head}"
    );

    // Streams stream: each event reaches the guest as the provider sends it, not at the end.
    let (out, err, _) = h
        .exec(
            &id,
            &format!("curl -sSN -H \"x-api-key: $ANTHROPIC_API_KEY\" -d '{{\"stream\":true}}' {base}/v1/messages/slow | while IFS= read -r l; do case \"$l\" in event:*) date +%s%N;; esac; done"),
        )
        .await;
    let stamps: Vec<u128> = text(&out)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert_eq!(stamps.len(), 5, "{} {}", text(&out), text(&err));
    let spread = stamps[stamps.len() - 1] - stamps[0];
    assert!(
        spread >= 4_000_000_000,
        "the events arrived within {spread} ns of each other: buffered, not streamed"
    );
    let cases_len = cases.len() + 2; // with the Basic call and the slow stream

    // The provider got the real keys, never a placeholder.
    let got = seen.lock().unwrap().clone();
    assert_eq!(got.len(), cases_len);
    for (head, _) in &got {
        assert!(!head.contains("vantik-placeholder"), "{head}");
        let lower = head.to_ascii_lowercase();
        assert!(
            lower.contains(&format!(
                "x-api-key: {}",
                anthropic_key.to_ascii_lowercase()
            )) || lower.contains(&format!(
                "authorization: bearer {}",
                openai_key.to_ascii_lowercase()
            )) || lower.contains(&format!(
                "authorization: bearer {}",
                router_key.to_ascii_lowercase()
            )) || lower.contains(&format!(
                "x-goog-api-key: {}",
                gemini_key.to_ascii_lowercase()
            )) || head.contains(&basic),
            "{head}"
        );
    }

    // Inside interception the Host must still be the connection's name (domain fronting).
    let (out, _, _) = h
        .exec(
            &id,
            &format!("curl -sS -i -H 'Host: other.provider.test' {base}/v1/messages"),
        )
        .await;
    assert!(
        text(&out).contains("x-sandbox-egress-refused: sni_host_mismatch"),
        "{}",
        text(&out)
    );
    // Leaks: a placeholder sent to another secret's host, or over plain HTTP, is refused before
    // anything reaches the server.
    let (out, _, _) = h
        .exec(&id, &format!("curl -sS -i -H \"x-api-key: $ANTHROPIC_API_KEY\" https://openai.provider.test:{port}/v1/chat/completions; curl -sS -i -H \"x-api-key: $ANTHROPIC_API_KEY\" http://allowed.test:{http_port}/"))
        .await;
    let out = text(&out);
    assert_eq!(
        out.matches("x-sandbox-egress-refused: placeholder_leak")
            .count(),
        2,
        "{out}"
    );
    assert_eq!(seen.lock().unwrap().len(), cases_len);
    assert!(http_seen.lock().unwrap().is_empty());
    // No process in the guest holds a real key.
    let (out, _, _) = h
        .exec(&id, "grep -l REALKEY /proc/*/environ 2>/dev/null | wc -l")
        .await;
    assert_eq!(text(&out).trim(), "0");

    // The meter read every response as it passed.
    let (s, u) = h
        .json("GET", &format!("/v1/sandboxes/{id}/usage"), None)
        .await;
    assert_eq!(s, 200, "{u}");
    let calls = u["calls"].as_array().unwrap();
    assert_eq!(calls.len(), cases_len, "{u}");
    let by_id = |rid: &str| {
        calls
            .iter()
            .find(|c| c["response_id"] == rid)
            .unwrap_or_else(|| panic!("no call {rid}: {u}"))
            .clone()
    };
    let a = by_id("msg_01json");
    assert_eq!(
        (
            &a["model"],
            &a["input_tokens"],
            &a["output_tokens"],
            &a["cache_read_tokens"],
            &a["cache_write_tokens"],
            &a["provider"]
        ),
        (
            &json!("claude-test-1"),
            &json!(1200),
            &json!(85),
            &json!(4000),
            &json!(300),
            &json!("anthropic")
        ),
        "{a}"
    );
    let b = by_id("msg_02sse");
    assert_eq!(
        (
            &b["input_tokens"],
            &b["output_tokens"],
            &b["cache_read_tokens"],
            &b["complete"]
        ),
        (&json!(2100), &json!(77), &json!(512), &json!(true)),
        "{b}"
    );
    let c = by_id("chatcmpl-3");
    assert_eq!(
        (
            &c["input_tokens"],
            &c["output_tokens"],
            &c["cache_read_tokens"],
            &c["billed_cost_usd"]
        ),
        (&json!(310), &json!(12), &json!(100), &Value::Null),
        "{c}"
    );
    let d = by_id("gen-4");
    assert_eq!(
        (
            &d["input_tokens"],
            &d["output_tokens"],
            &d["billed_cost_usd"],
            &d["provider"]
        ),
        (&json!(50), &json!(7), &json!(0.00123), &json!("openrouter")),
        "{d}"
    );
    let g = by_id("resp-gemini-5");
    assert_eq!(
        (
            &g["model"],
            &g["input_tokens"],
            &g["output_tokens"],
            &g["cache_read_tokens"],
            &g["provider"],
            &g["unmetered"]
        ),
        (
            &json!("gemini-test-1"),
            &json!(64),
            &json!(25),
            &json!(32),
            &json!("google"),
            &Value::Null
        ),
        "{g}"
    );
    assert_eq!(u["totals"]["calls"], cases_len);
    // Two OpenRouter calls (Bearer and Basic), each billed 0.00123.
    let billed = u["totals"]["billed_cost_usd"].as_f64().unwrap();
    assert!((billed - 0.00246).abs() < 1e-12, "{u}");
    let v = egress(&h, &id).await;
    assert_eq!(v["by_reason"]["placeholder_leak"], 2, "{v}");
    assert_eq!(v["by_reason"]["sni_host_mismatch"], 1, "{v}");
    assert_eq!(v["connections"]["intercepted"], cases_len + 2, "{v}");
}

/// A provider that gives back what it got, in every way a real one might (HTTPS, HTTP/1.1,
/// keep-alive, chunked): `/headers` echoes the request headers as JSON (like httpbin) and the
/// credential in a response header; `/error` is Anthropic's 400 quoting the `x-api-key` value;
/// `/split` sends the credential raw, JSON-escaped and base64-encoded, cut across chunks one
/// byte at a time; `/forms` sends it in the forms programs write it in besides those
/// (`echo_forms`), in chunks of 7 bytes; `/te-gzip` answers with `Transfer-Encoding: gzip,
/// chunked`; `/v1/messages` is a model call that puts the key in its `id` and `model`; `/big`
/// streams 10 MiB of bytes that hold no key.
async fn echo_provider(dir: &std::path::Path) -> (u16, Seen) {
    let acceptor = common::tls_acceptor(dir);
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let seen: Seen = Arc::default();
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let (acceptor, log) = (acceptor.clone(), log.clone());
            tokio::spawn(async move {
                let Ok(mut s) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = Vec::new();
                while let Some(end) = read_head(&mut s, &mut buf).await {
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    buf.drain(..end);
                    log.lock().unwrap().push((head.clone(), vec![]));
                    let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
                    let header = |name: &str| {
                        head.lines()
                            .find_map(|l| {
                                let (k, v) = l.split_once(':')?;
                                k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
                            })
                            .unwrap_or_default()
                    };
                    // A request body (the model call's) is read, so the connection can be used
                    // again.
                    let length: usize = header("content-length").parse().unwrap_or(0);
                    while buf.len() < length {
                        let mut b = [0u8; 4096];
                        match s.read(&mut b).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&b[..n]),
                        }
                    }
                    buf.drain(..length);
                    let key = header("x-api-key");
                    let key = if key.is_empty() {
                        header("authorization")
                            .trim_start_matches("Bearer ")
                            .to_string()
                    } else {
                        key
                    };
                    let (status, pieces): (&str, Vec<Vec<u8>>) = match path.as_str() {
                        "/headers" | "/v1/models" => {
                            let map: serde_json::Map<String, Value> = head
                                .lines()
                                .skip(1)
                                .filter_map(|l| l.split_once(':'))
                                .map(|(k, v)| (k.to_string(), json!(v.trim())))
                                .collect();
                            let body = json!({ "headers": map }).to_string();
                            ("200 OK", vec![body.into_bytes()])
                        }
                        "/reason" => ("401 Unauthorized", vec![b"{}".to_vec()]),
                        "/error" => {
                            let body = json!({"type": "error", "error": {"type": "invalid_request_error",
                                "message": format!("Unexpected value(s) `{key}` for the `anthropic-beta` header")}})
                            .to_string();
                            ("400 Bad Request", vec![body.into_bytes()])
                        }
                        "/split" => {
                            use base64::Engine;
                            let b64 = base64::engine::general_purpose::STANDARD;
                            let text = format!(
                                "raw {key} json {} b64 {} end\n",
                                serde_json::to_string(&key).unwrap(),
                                b64.encode(format!("user:{key}"))
                            );
                            (
                                "200 OK",
                                text.into_bytes().chunks(1).map(<[u8]>::to_vec).collect(),
                            )
                        }
                        "/forms" => {
                            let (text, mime) = echo_forms(&key);
                            let mut body = text
                                .iter()
                                .map(|(name, form)| format!("{name} {form} "))
                                .collect::<String>();
                            body.push_str(&format!("end\r\n\r\n{mime}\r\nend\n"));
                            (
                                "200 OK",
                                body.into_bytes().chunks(7).map(<[u8]>::to_vec).collect(),
                            )
                        }
                        "/te-gzip" => ("200 OK", vec![b"not really gzip".to_vec()]),
                        p if p.starts_with("/reflect?q=") => (
                            "200 OK",
                            vec![
                                b"{\"note\":\"what you asked for, and 2 s later the end\",\n\"q\":\""
                                    .to_vec(),
                                p.as_bytes()["/reflect?q=".len()..].to_vec(),
                                b"\"}\n".to_vec(),
                            ],
                        ),
                        "/v1/messages" => {
                            let body = json!({"id": key, "type": "message", "role": "assistant",
                                "model": key, "content": [], "stop_reason": "end_turn",
                                "usage": {"input_tokens": 3, "output_tokens": 5}})
                            .to_string();
                            ("200 OK", vec![body.into_bytes()])
                        }
                        _ => {
                            let mut x = 0x2545_f491_4f6c_dd1d_u64;
                            let chunks = (0..160)
                                .map(|_| {
                                    (0..8192)
                                        .flat_map(|_| {
                                            x ^= x << 13;
                                            x ^= x >> 7;
                                            x ^= x << 17;
                                            x.to_le_bytes()
                                        })
                                        .collect()
                                })
                                .collect();
                            ("200 OK", chunks)
                        }
                    };
                    // `/gzip`: compressed although asked for identity (bytes the scan cannot read).
                    let encoding = if path == "/gzip" {
                        "content-encoding: gzip\r\n"
                    } else {
                        ""
                    };
                    // `/reason`: the key in the status line's reason phrase.
                    let status = if path == "/reason" {
                        format!("401 invalid key {key}")
                    } else {
                        status.to_string()
                    };
                    let coding = if path == "/te-gzip" {
                        "gzip, chunked"
                    } else {
                        "chunked"
                    };
                    let h = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nx-echo-key: {key}\r\n{encoding}transfer-encoding: {coding}\r\n\r\n"
                    );
                    if s.write_all(h.as_bytes()).await.is_err() {
                        return;
                    }
                    let pause_before = path.starts_with("/reflect").then(|| pieces.len() - 1);
                    for (i, p) in pieces.into_iter().enumerate() {
                        if pause_before == Some(i) {
                            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                        }
                        let mut chunk = format!("{:x}\r\n", p.len()).into_bytes();
                        chunk.extend(p);
                        chunk.extend(b"\r\n");
                        if s.write_all(&chunk).await.is_err() {
                            return;
                        }
                        let _ = s.flush().await;
                    }
                    if s.write_all(b"0\r\n\r\n").await.is_err() {
                        return;
                    }
                    let _ = s.flush().await;
                }
            });
        }
    });
    (port, seen)
}

/// `key` as programs write it besides raw, JSON and plain base64 (issue 29, item 2): named
/// text forms, and a MIME part's base64 of a text that holds it (76 columns, CRLF).
fn echo_forms(key: &str) -> (Vec<(&'static str, String)>, String) {
    use base64::Engine;
    let url = |keep: &[u8]| -> String {
        key.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || keep.contains(&b) {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect()
    };
    let text = vec![
        // Python's urllib.parse.quote: `/` kept.
        ("quote", url(b"/")),
        // JavaScript's encodeURI.
        ("uri", url(b";,/?:@&=+$!*'()#")),
        // JSON's \u escapes, every other character, the hex in capitals.
        (
            "unicode",
            key.bytes()
                .enumerate()
                .map(|(i, b)| {
                    if i % 2 == 0 {
                        format!("\\u{b:04X}")
                    } else {
                        (b as char).to_string()
                    }
                })
                .collect(),
        ),
    ];
    let b64 = base64::engine::general_purpose::STANDARD.encode(format!(
        "{}{key} and more text after it",
        "The lead of a file: ".repeat(3)
    ));
    let mime: Vec<&str> = b64
        .as_bytes()
        .chunks(76)
        .map(|c| std::str::from_utf8(c).unwrap())
        .collect();
    (text, mime.join("\r\n"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_echoes_never_gives_the_key_to_the_guest() {
    if stock_image_missing() || guest_image_missing() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    common::make_certs(
        dir.path(),
        &[
            "api.provider.test",
            "gemini.provider.test",
            "api.openai.com",
        ],
    );
    let (port, seen) = echo_provider(dir.path()).await;
    let resolve = format!(
        "api.provider.test:{port}:127.0.0.1,gemini.provider.test:{port}:127.0.0.1,api.openai.com:{port}:127.0.0.1"
    );
    let ca = dir.path().join("ca.pem");
    let store = common::image_store();
    let h = start(&[
        ("SANDBOX_HOST_EGRESS_RESOLVE", &resolve),
        ("SANDBOX_HOST_EGRESS_CA_FILE", ca.to_str().unwrap()),
        ("SANDBOX_HOST_IMAGE_DIR", store.to_str().unwrap()),
    ]);
    let key = "sk-ant-api03-REALKEY-9/8+7\"6_5";
    let gemini = "AIzaREALKEY-gemini-0123456789";
    let openai = "sk-proj-REALKEY-openai-0123456789";
    let id = h
        .create(json!({
            "image": "vantik-guest:latest",
            "egress": {"secrets": [
                {"env": "ANTHROPIC_API_KEY", "value": key, "hosts": ["api.provider.test"]},
                {"env": "GEMINI_API_KEY", "value": gemini, "hosts": ["gemini.provider.test"],
                 "headers": ["x-goog-api-key"], "paths": ["/headers"]},
                {"env": "OPENAI_API_KEY", "value": openai, "hosts": ["api.openai.com"]}
            ]}
        }))
        .await;
    let base = format!("https://api.provider.test:{port}");
    // Whatever the guest does, neither its output nor the headers it sees hold a key (or its
    // encodings). `curl -i` prints the response headers too.
    let forms = |k: &str| {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        vec![
            k.to_string(),
            serde_json::to_string(k)
                .unwrap()
                .trim_matches('"')
                .to_string(),
            b64.encode(format!("user:{k}"))[8..40].to_string(),
            "REALKEY".to_string(),
        ]
    };
    let run = |cmd: String| {
        let h = &h;
        let id = id.clone();
        async move {
            let (out, err, last) = h.exec(&id, &cmd).await;
            let all = format!("{}{}", text(&out), text(&err));
            for f in forms(key)
                .into_iter()
                .chain(forms(gemini))
                .chain(forms(openai))
            {
                assert!(
                    !all.contains(&f),
                    "`{f}` reached the guest through `{cmd}`: {all}"
                );
            }
            (text(&out), last)
        }
    };
    // Credential headers: the provider gets the key and echoes it; the guest sees it masked.
    let (out, _) = run(format!(
        "curl -sS -i --http1.1 -H \"x-api-key: $ANTHROPIC_API_KEY\" {base}/headers"
    ))
    .await;
    assert!(out.contains("x-echo-key: ****"), "{out}");
    assert!(
        out.contains("\"headers\""),
        "the rest of the echo arrives: {out}"
    );
    let (out, _) = run(format!(
        "curl -sS -i --http2 -H \"authorization: Bearer $ANTHROPIC_API_KEY\" {base}/headers"
    ))
    .await;
    assert!(out.contains("Bearer ****"), "{out}");
    let (out, _) = run(format!(
        "curl -sS -H \"x-api-key: $ANTHROPIC_API_KEY\" {base}/error"
    ))
    .await;
    assert!(out.contains("Unexpected value(s) `****"), "{out}");
    let (out, _) = run(format!(
        "curl -sS --http2 -H \"x-api-key: $ANTHROPIC_API_KEY\" {base}/split"
    ))
    .await;
    assert!(
        out.starts_with("raw ****") && out.ends_with(" end\n"),
        "{out}"
    );
    // The key in the upstream's reason phrase: an HTTP/1.1 guest gets the standard phrase.
    let (out, _) = run(format!(
        "curl -sS -i --http1.1 -H \"x-api-key: $ANTHROPIC_API_KEY\" {base}/reason"
    ))
    .await;
    assert!(out.starts_with("HTTP/1.1 401 Unauthorized"), "{out}");
    // A compressed answer although identity was asked for: refused, not passed unread.
    let (out, _) = run(format!(
        "curl -sS -i -H \"x-api-key: $ANTHROPIC_API_KEY\" {base}/gzip"
    ))
    .await;
    assert!(
        out.starts_with("HTTP/1.1 502") || out.starts_with("HTTP/2 502"),
        "{out}"
    );
    // The key in the forms a program would write it in: each masked whole, the MIME part's
    // base64 all but the characters it shares with the text around it.
    let (out, _) = run(format!(
        "curl -sS --http1.1 -H \"x-api-key: $ANTHROPIC_API_KEY\" {base}/forms"
    ))
    .await;
    let (forms_sent, mime) = echo_forms(key);
    for (name, form) in &forms_sent {
        assert!(
            out.contains(&format!("{name} {} ", "*".repeat(form.len()))),
            "{name}: {out}"
        );
    }
    let part = out
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .replace("\r\n", "");
    assert_eq!(
        part.len(),
        mime.replace("\r\n", "").len() + "end\n".len(),
        "{out}"
    );
    assert!(
        part.contains(&"*".repeat(key.len() * 4 / 3 - 4)),
        "the wrapped base64 is masked: {out}"
    );
    // `Transfer-Encoding: gzip, chunked` is as unreadable as a Content-Encoding: refused.
    let (out, _) = run(format!(
        "curl -sS -i -H \"x-api-key: $ANTHROPIC_API_KEY\" {base}/te-gzip"
    ))
    .await;
    assert!(
        out.starts_with("HTTP/1.1 502") || out.starts_with("HTTP/2 502"),
        "{out}"
    );
    assert!(!out.contains("not really gzip"), "{out}");
    // A model call whose answer carries the key as its id and model: the meter reads it masked.
    let (out, _) = run(format!(
        "curl -sS -H \"x-api-key: $ANTHROPIC_API_KEY\" -H 'content-type: application/json' \
         -d '{{\"model\":\"m\",\"max_tokens\":1,\"messages\":[]}}' {base}/v1/messages"
    ))
    .await;
    assert!(out.contains("\"model\":\"****"), "{out}");
    let (s, u) = h
        .json("GET", &format!("/v1/sandboxes/{id}/usage"), None)
        .await;
    assert_eq!(s, 200, "{u}");
    let usage = u.to_string();
    assert!(
        usage.contains("\"output_tokens\":5"),
        "the call was metered: {u}"
    );
    for f in forms(key) {
        assert!(!usage.contains(&f), "`{f}` reached /usage: {u}");
    }
    // The oracle of issue 29: the provider reflects a guess of the key's next character and
    // waits 2 s before its last chunk. A right guess and a wrong one reach the guest framed
    // alike and at the same moments, raw HTTP/1.1 chunks read off TLS and HTTP/2 DATA frames
    // alike: split where the 2 s pause falls, what came before it and after it is the same.
    let reader = format!(
        "cat > /tmp/reflect.mjs <<'EOF'\n{}\nEOF\n",
        r#"import tls from 'node:tls';
import http2 from 'node:http2';
const [mode, q] = process.argv.slice(2);
const host = 'api.provider.test', port = Number(process.env.PORT);
const key = process.env.ANTHROPIC_API_KEY, got = [], t0 = Date.now();
const seen = d => got.push([Date.now() - t0, d.toString('latin1')]);
const done = () => { console.log(JSON.stringify(got)); process.exit(0); };
if (mode === 'h1') {
  const s = tls.connect({ host, port, servername: host }, () => s.write(
    `GET /reflect?q=${q} HTTP/1.1\r\nhost: ${host}\r\nx-api-key: ${key}\r\nconnection: close\r\n\r\n`));
  s.on('data', seen);
  s.on('close', done);
} else {
  const c = http2.connect(`https://${host}:${port}`);
  const r = c.request({ ':path': `/reflect?q=${q}`, 'x-api-key': key });
  r.on('data', seen);
  r.on('end', () => { c.close(); done(); });
}"#
    );
    let arrivals = |mode: &'static str, q: String| {
        let (run, reader) = (&run, &reader);
        async move {
            let (out, _) = run(format!(
                "{reader}PORT={port} node /tmp/reflect.mjs {mode} {q}"
            ))
            .await;
            let got: Vec<(u64, String)> = serde_json::from_str(out.trim())
                .unwrap_or_else(|e| panic!("{mode} {q}: {e}: {out}"));
            // What came before the longest pause, and after it; the framing of each.
            let gap = (1..got.len())
                .max_by_key(|&i| got[i].0.saturating_sub(got[i - 1].0))
                .unwrap_or(got.len());
            let part = |p: &[(u64, String)]| {
                let data: String = p.iter().map(|(_, d)| d.as_str()).collect();
                // The response's Date header is the one byte-for-byte difference allowed.
                data.lines()
                    .filter(|l| !l.to_ascii_lowercase().starts_with("date:"))
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            (part(&got[..gap]), part(&got[gap..]), got.len())
        }
    };
    for mode in ["h1", "h2"] {
        let guess = &key[..16];
        let right = format!("{guess}{}", &key[16..17]);
        let wrong = format!("{guess}X");
        assert_ne!(right, wrong);
        let (r, w) = (
            arrivals(mode, right.clone()).await,
            arrivals(mode, wrong.clone()).await,
        );
        assert!(
            r.1.contains("\"}"),
            "{mode}: the end came after the pause: {r:?}"
        );
        assert_eq!(
            (r.0.replace(&right, &wrong), r.1.replace(&right, &wrong)),
            (w.0.clone(), w.1.clone()),
            "{mode}: a right guess ({r:?}) and a wrong one ({w:?}) differ"
        );
    }
    // A credential header the run named for a provider that reads another one.
    let (out, _) = run(format!(
        "curl -sS -H \"x-goog-api-key: $GEMINI_API_KEY\" https://gemini.provider.test:{port}/headers"
    ))
    .await;
    assert!(out.contains("\"headers\""), "{out}");
    // Issue 29, item 6: a key goes only to the paths its secret is for. The run's own `paths`
    // (gemini's: /headers); a known provider's inference endpoints (api.openai.com: no minting
    // of credentials, no files).
    for cmd in [
        format!(
            "-H \"x-goog-api-key: $GEMINI_API_KEY\" https://gemini.provider.test:{port}/upload"
        ),
        format!(
            "-X POST -H \"authorization: Bearer $OPENAI_API_KEY\" https://api.openai.com:{port}/v1/realtime/client_secrets"
        ),
        format!(
            "-H \"authorization: Bearer $OPENAI_API_KEY\" https://api.openai.com:{port}/v1/models/../files"
        ),
        // An endpoint's path with another method: the project's stored completions listed.
        format!(
            "-H \"authorization: Bearer $OPENAI_API_KEY\" https://api.openai.com:{port}/v1/chat/completions"
        ),
        // Or a POST the server is asked to take for a DELETE.
        format!(
            "-X POST -H 'x-http-method-override: DELETE' -H \"authorization: Bearer $OPENAI_API_KEY\" https://api.openai.com:{port}/v1/chat/completions/chatcmpl-1"
        ),
    ] {
        let (out, _) = run(format!("curl -sS -i --path-as-is {cmd}")).await;
        assert!(
            out.contains("x-sandbox-egress-refused: path_not_allowed"),
            "{cmd}: {out}"
        );
    }
    let (out, _) = run(format!(
        "curl -sS -H \"authorization: Bearer $OPENAI_API_KEY\" https://api.openai.com:{port}/v1/models"
    ))
    .await;
    assert!(
        out.contains("\"headers\"") && out.contains("Bearer ****"),
        "{out}"
    );
    let provider_got: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|(h, _)| h.clone())
        .collect();
    assert_eq!(provider_got.len(), 15, "{provider_got:?}");
    assert!(
        provider_got[..13].iter().all(|h| h.contains(key)),
        "{provider_got:?}"
    );
    assert!(provider_got[13].contains(&format!("x-goog-api-key: {gemini}")));
    assert!(provider_got[14].starts_with("GET /v1/models ") && provider_got[14].contains(openai));

    // A placeholder anywhere but a credential header is refused before the provider sees it.
    for (what, cmd) in [
        (
            "another header",
            format!("-H \"anthropic-beta: $ANTHROPIC_API_KEY\" {base}/error"),
        ),
        (
            "a custom header",
            format!("-H \"x-custom: x$ANTHROPIC_API_KEY\" {base}/headers"),
        ),
        (
            "padding in a credential header",
            format!("-H \"x-api-key: AAAAAAAA$ANTHROPIC_API_KEY\" {base}/headers"),
        ),
        (
            "the target",
            format!("\"{base}/headers?k=$ANTHROPIC_API_KEY\""),
        ),
        (
            "the credential header given twice",
            format!(
                "-H \"x-api-key: AAAAAAAA\" -H \"x-api-key: $ANTHROPIC_API_KEY\" {base}/headers"
            ),
        ),
        (
            "a default header of another secret",
            format!(
                "-H \"x-api-key: $GEMINI_API_KEY\" https://gemini.provider.test:{port}/headers"
            ),
        ),
    ] {
        let (out, _) = run(format!("curl -sS -i {cmd}")).await;
        assert!(
            out.contains("x-sandbox-egress-refused: placeholder_leak"),
            "{what}: {out}"
        );
    }
    assert_eq!(
        seen.lock().unwrap().len(),
        15,
        "nothing refused reached the provider"
    );

    // A long response with no key passes byte for byte, still streamed.
    let (out, last) = run(format!(
        "curl -sS -H \"x-api-key: $ANTHROPIC_API_KEY\" {base}/big | sha256sum"
    ))
    .await;
    assert_eq!(last["exit_code"], 0, "{last}");
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    let big: Vec<u8> = (0..160 * 8192)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    assert_eq!(big.len(), 10 << 20);
    assert_eq!(out.split_whitespace().next(), Some(sha256(&big).as_str()));

    let v = egress(&h, &id).await;
    assert_eq!(v["by_reason"]["placeholder_leak"], 6, "{v}");
    assert_eq!(v["by_reason"]["path_not_allowed"], 5, "{v}");
    // /headers twice (value and echoed header), the error, the split (three forms), gemini.
    assert!(v["by_reason"]["secret_echo"].as_u64().unwrap() >= 8, "{v}");
    let (_, m) = h.req("GET", "/metrics", vec![], &[]).await;
    assert!(String::from_utf8_lossy(&m).contains("reason=\"secret_echo\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intercepting_all_hosts_closes_domain_fronting() {
    if stock_image_missing() || guest_image_missing() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    common::make_certs(dir.path(), &["cdn.test"]);
    let (port, seen) = echo_provider(dir.path()).await;
    let ca = dir.path().join("ca.pem");
    let store = common::image_store();
    let h = start(&[
        (
            "SANDBOX_HOST_EGRESS_RESOLVE",
            &format!("cdn.test:{port}:127.0.0.1"),
        ),
        ("SANDBOX_HOST_EGRESS_CA_FILE", ca.to_str().unwrap()),
        ("SANDBOX_HOST_IMAGE_DIR", store.to_str().unwrap()),
    ]);
    let id = h
        .create(json!({"image": "vantik-guest:latest", "egress": {"allow": ["cdn.test"], "intercept": "all"}}))
        .await;
    // An allowed name works, through the sandbox's CA, byte for byte.
    let (out, err, last) = h
        .exec(&id, &format!("curl -sS https://cdn.test:{port}/headers"))
        .await;
    assert_eq!(last["exit_code"], 0, "{}", text(&err));
    assert!(text(&out).contains("\"headers\""), "{}", text(&out));
    // Fronting: the allowed name in the SNI, another site in the Host. Refused, counted.
    let (out, _, _) = h
        .exec(
            &id,
            &format!("curl -sS -i -H 'Host: hidden.example' https://cdn.test:{port}/headers; curl -sS -i --http2 -H 'Host: hidden.example' https://cdn.test:{port}/headers"),
        )
        .await;
    assert_eq!(
        text(&out)
            .matches("x-sandbox-egress-refused: sni_host_mismatch")
            .count(),
        2,
        "{}",
        text(&out)
    );
    assert_eq!(
        seen.lock().unwrap().len(),
        1,
        "the fronted requests never left"
    );
    // Another port of the allowed name is refused before any connection.
    let (_, _, last) = h
        .exec(&id, "curl -sS --max-time 10 https://cdn.test:8443/")
        .await;
    assert_ne!(last["exit_code"], 0);
    let v = egress(&h, &id).await;
    assert_eq!(v["by_reason"]["sni_host_mismatch"], 2, "{v}");
    assert_eq!(v["by_reason"]["port_not_allowed"], 1, "{v}");
    let (_, shown) = h.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(shown["egress_settings"]["intercept"], "all", "{shown}");
}

/// A provider that takes requests and never answers, reading their bodies forever; it counts the
/// connections it has open now and the most it ever had.
async fn holding_provider(
    dir: &std::path::Path,
) -> (
    u16,
    Arc<std::sync::atomic::AtomicUsize>,
    Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let acceptor = common::tls_acceptor(dir);
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let (open, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (o, m) = (open.clone(), most.clone());
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let (acceptor, o, m) = (acceptor.clone(), o.clone(), m.clone());
            tokio::spawn(async move {
                let now = o.fetch_add(1, Ordering::SeqCst) + 1;
                m.fetch_max(now, Ordering::SeqCst);
                if let Ok(mut s) = acceptor.accept(tcp).await {
                    let mut b = vec![0u8; 4096];
                    while matches!(s.read(&mut b).await, Ok(n) if n > 0) {}
                }
                o.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    (port, open, most)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_guest_connection_cannot_open_unbounded_upstream_connections() {
    if stock_image_missing() || guest_image_missing() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    common::make_certs(dir.path(), &["api.provider.test", "other.provider.test"]);
    let (port, open, most) = holding_provider(dir.path()).await;
    let (other_port, other_seen) = echo_provider(dir.path()).await;
    let ca = dir.path().join("ca.pem");
    let store = common::image_store();
    let h = start(&[
        (
            "SANDBOX_HOST_EGRESS_RESOLVE",
            &format!(
                "api.provider.test:{port}:127.0.0.1,other.provider.test:{other_port}:127.0.0.1"
            ),
        ),
        ("SANDBOX_HOST_EGRESS_CA_FILE", ca.to_str().unwrap()),
        ("SANDBOX_HOST_IMAGE_DIR", store.to_str().unwrap()),
    ]);
    let id = h
        .create(json!({"image": "vantik-guest:latest", "egress": {
            "meter": ["other.provider.test"],
            "secrets": [{"env": "ANTHROPIC_API_KEY", "value": "sk-ant-REALKEY-0123456789", "hosts": ["api.provider.test"]}]}}))
        .await;
    // 200 HTTP/2 requests on one connection, each with a body that never ends.
    let script = format!(
        "const h=require('http2');const c=h.connect('https://api.provider.test:{port}');c.on('error',()=>{{}});\
         for(let i=0;i<200;i++){{const s=c.request({{':method':'POST',':path':'/v1/messages','x-api-key':process.env.ANTHROPIC_API_KEY}});s.on('error',()=>{{}});s.write('x');}}\
         setInterval(()=>{{}},1000);"
    );
    let (_, err, last) = h
        .exec(
            &id,
            &format!("cat > /tmp/flood.js <<'EOF'\n{script}\nEOF\n(node /tmp/flood.js >/dev/null 2>&1 &) ; sleep 8; echo started"),
        )
        .await;
    assert_eq!(last["exit_code"], 0, "{}", text(&err));
    // Node under TCG, beside the other tests' guests, may take longer than those 8 s to start.
    let t = Instant::now();
    while open.load(std::sync::atomic::Ordering::SeqCst) == 0
        && t.elapsed() < Duration::from_secs(90)
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let during = open.load(std::sync::atomic::Ordering::SeqCst);
    eprintln!(
        "200 endless HTTP/2 requests: {during} upstream connections open, at most {}",
        most.load(std::sync::atomic::Ordering::SeqCst)
    );
    assert!(during > 0, "the flood reached the provider");
    assert!(
        most.load(std::sync::atomic::Ordering::SeqCst) <= 8,
        "more upstream connections than the bound"
    );
    // The sandbox's other connections still work meanwhile.
    let (out, err, last) = h
        .exec(
            &id,
            &format!("curl -sS --max-time 30 https://other.provider.test:{other_port}/headers"),
        )
        .await;
    assert_eq!(last["exit_code"], 0, "{}", text(&err));
    assert!(text(&out).contains("\"headers\""));
    assert_eq!(other_seen.lock().unwrap().len(), 1);
}

/// Issue 18: a guest cannot make model calls that escape the meter. Streaming chat completions
/// from curl, Python (reading the stream as the OpenAI SDK does) and Node (the OpenAI SDK itself,
/// from the Pi harness's packages) that do not ask for usage get it asked for, and their clients
/// read the extra usage chunk without error; what the meter cannot read is recorded and counted,
/// and refused under `meter_strict`; what needed nothing reaches the provider byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_meter_cannot_be_evaded() {
    if stock_image_missing() || guest_image_missing() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    common::make_certs(dir.path(), &["openai.provider.test", "api.provider.test"]);
    let (port, seen) = fake_provider(dir.path()).await;
    let resolve =
        format!("openai.provider.test:{port}:127.0.0.1,api.provider.test:{port}:127.0.0.1");
    let ca = dir.path().join("ca.pem");
    let store = common::image_store();
    let h = start(&[
        ("SANDBOX_HOST_EGRESS_RESOLVE", &resolve),
        ("SANDBOX_HOST_EGRESS_CA_FILE", ca.to_str().unwrap()),
        ("SANDBOX_HOST_IMAGE_DIR", store.to_str().unwrap()),
        // Small, so that an oversized body is quick to send from a guest under TCG.
        ("SANDBOX_HOST_METER_BODY_MAX_MIB", "1"),
    ]);
    let sandbox = |strict: bool| {
        json!({"image": "vantik-guest:latest", "egress": {"meter_strict": strict,
            "meter": ["openai.provider.test", "api.provider.test"], "secrets": [
            {"env": "OPENAI_API_KEY", "value": "sk-proj-REALKEY-fedcba9876543210", "hosts": ["openai.provider.test"]},
            {"env": "ANTHROPIC_API_KEY", "value": "sk-ant-api03-REALKEY-0123456789", "hosts": ["api.provider.test"]}]}})
    };
    let id = h.create(sandbox(false)).await;
    let base = format!("https://openai.provider.test:{port}/v1");
    let stream_req =
        r#"{"model":"gpt-test","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let auth = "-H \"authorization: Bearer $OPENAI_API_KEY\" -H 'content-type: application/json'";

    // Three clients stream without asking for usage.
    let (out, err, last) = h
        .exec(
            &id,
            &format!("curl -sS -N {auth} -d '{stream_req}' {base}/chat/completions"),
        )
        .await;
    assert_eq!(last["exit_code"], 0, "curl: {}", text(&err));
    assert_eq!(
        text(&out),
        OPENAI_SSE.concat(),
        "curl got the provider's stream, usage chunk included"
    );
    // A Python script with its indentation: one line per element (a `\` line continuation
    // would strip the leading spaces).
    let python = [
        "python3 - <<'EOF'",
        "import json, os, urllib.request as u",
        &format!("r = u.Request('{base}/chat/completions', data=b'{stream_req}', headers={{'authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], 'content-type': 'application/json'}})"),
        "text, usage = '', None",
        "for line in u.urlopen(r, timeout=60):",
        "    line = line.decode().rstrip('\\n')",
        "    if not line.startswith('data: '):",
        "        continue",
        "    if line[6:].startswith('[DONE]'):",
        "        break",
        "    chunk = json.loads(line[6:])",
        "    for c in chunk['choices']:",
        "        text += c['delta'].get('content') or ''",
        "    if chunk.get('usage'):",
        "        usage = chunk['usage']['completion_tokens']",
        "print(text, usage)",
        "EOF",
    ]
    .join("\n");
    let (out, err, last) = h.exec(&id, &python).await;
    assert_eq!(last["exit_code"], 0, "python: {}", text(&err));
    assert_eq!(text(&out).trim(), "Hi 12", "python: {}", text(&err));
    let node = format!(
        "cat > /tmp/sdk.mjs <<'EOF'\n\
import {{ createRequire }} from 'node:module';\n\
import {{ execSync }} from 'node:child_process';\n\
const pkg = execSync(\"find \\\"$(npm root -g)\\\" -path '*/node_modules/openai/package.json' | head -n 1\").toString().trim();\n\
if (!pkg) {{ console.error('the OpenAI SDK is not in the image'); process.exit(3); }}\n\
const sdk = createRequire(pkg)('openai');\n\
const OpenAI = sdk.OpenAI ?? sdk.default ?? sdk;\n\
const client = new OpenAI({{ apiKey: process.env.OPENAI_API_KEY, baseURL: '{base}', maxRetries: 0 }});\n\
const stream = await client.chat.completions.create({{ model: 'gpt-test', messages: [{{ role: 'user', content: 'hi' }}], stream: true }});\n\
let text = '', usage = null;\n\
for await (const c of stream) {{ text += c.choices[0]?.delta?.content ?? ''; if (c.usage) usage = c.usage.completion_tokens; }}\n\
console.log(text, usage);\n\
EOF\n\
node /tmp/sdk.mjs"
    );
    let (out, err, last) = h.exec(&id, &node).await;
    assert_eq!(last["exit_code"], 0, "node: {}", text(&err));
    assert_eq!(text(&out).trim(), "Hi 12", "node: {}", text(&err));
    // The provider was asked for usage each time; nothing else in the bodies changed.
    {
        let got = seen.lock().unwrap();
        assert_eq!(got.len(), 3);
        let want: Value = serde_json::from_str(stream_req).unwrap();
        for (i, (_, body)) in got.iter().enumerate() {
            let mut v: Value = serde_json::from_slice(body).unwrap();
            assert_eq!(
                v["stream_options"],
                json!({"include_usage": true}),
                "call {i}"
            );
            v.as_object_mut().unwrap().remove("stream_options");
            if i == 0 {
                assert_eq!(v, want, "curl's body, but for stream_options");
            }
        }
    }

    // What needed nothing is sent byte for byte: Anthropic's streams, a non-streaming
    // completion, a Responses API stream (its usage always comes).
    let unchanged = [
        (
            format!("https://api.provider.test:{port}/v1/messages"),
            r#"{"model":"m", "stream": true,"messages":[]}"#,
            "-H \"x-api-key: $ANTHROPIC_API_KEY\"",
        ),
        (
            format!("{base}/chat/completions"),
            r#"{ "model":"m","messages":[] }"#,
            auth,
        ),
        (
            format!("{base}/responses"),
            r#"{"model":"gpt-test","stream":true,"input":"hi"}"#,
            auth,
        ),
    ];
    for (url, body, hdr) in &unchanged {
        let (_, err, last) = h
            .exec(
                &id,
                &format!("curl -sS -o /dev/null {hdr} -d '{body}' {url}"),
            )
            .await;
        assert_eq!(last["exit_code"], 0, "{url}: {}", text(&err));
        let got = seen.lock().unwrap().last().unwrap().1.clone();
        assert_eq!(text(&got), *body, "{url}: the body changed on its way");
    }

    // What the meter cannot read: recorded, counted, and let through.
    let big = "python3 -c 'import json; print(json.dumps({\"model\":\"m\",\"stream\":True,\"messages\":[{\"role\":\"user\",\"content\":\"x\"*1200000}]}))' > /tmp/big.json";
    let (_, err, last) = h.exec(&id, big).await;
    assert_eq!(last["exit_code"], 0, "{}", text(&err));
    let unmeterable = [
        (
            "unreadable_body",
            format!("-d '{{\"stream\":true,\"stream_options\":\"yes\"}}' {base}/chat/completions"),
        ),
        (
            "unknown_request",
            format!("-d '{{\"input_file_id\":\"f\"}}' {base}/batches"),
        ),
        (
            "body_too_large",
            format!("-d @/tmp/big.json {base}/chat/completions"),
        ),
    ];
    let before = seen.lock().unwrap().len();
    for (why, args) in &unmeterable {
        let (_, err, last) = h
            .exec(&id, &format!("curl -sS -o /dev/null {auth} {args}"))
            .await;
        assert_eq!(last["exit_code"], 0, "{why}: {}", text(&err));
    }
    assert_eq!(
        seen.lock().unwrap().len(),
        before + 3,
        "all three went upstream"
    );
    let big_sent = seen.lock().unwrap().last().unwrap().1.len();
    assert!(
        big_sent > 1 << 20,
        "the oversized body went whole: {big_sent}"
    );
    // A guest that gives up before the provider answers still leaves the call on record.
    let (_, _, last) = h
        .exec(
            &id,
            &format!("curl -sS --http2 --max-time 2 {auth} -d '{{}}' https://openai.provider.test:{port}/hang/v1/chat/completions"),
        )
        .await;
    assert_ne!(last["exit_code"], 0, "curl gave up");

    let mut u = Value::Null;
    for _ in 0..30 {
        let (s, v) = h
            .json("GET", &format!("/v1/sandboxes/{id}/usage"), None)
            .await;
        assert_eq!(s, 200, "{v}");
        u = v;
        if u["calls"].as_array().is_some_and(|c| c.len() == 10) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let calls = u["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 10, "{u}");
    for c in &calls[..3] {
        assert_eq!(
            (
                &c["response_id"],
                &c["input_tokens"],
                &c["output_tokens"],
                &c["cache_read_tokens"],
                &c["unmetered"]
            ),
            (
                &json!("chatcmpl-3"),
                &json!(310),
                &json!(12),
                &json!(100),
                &Value::Null
            ),
            "{c}"
        );
    }
    let responses = &calls[5];
    assert_eq!(
        (
            &responses["response_id"],
            &responses["provider"],
            &responses["input_tokens"],
            &responses["output_tokens"],
            &responses["cache_read_tokens"]
        ),
        (
            &json!("resp_5"),
            &json!("openai"),
            &json!(70),
            &json!(5),
            &json!(20)
        ),
        "{responses}"
    );
    for (c, (why, _)) in calls[6..9].iter().zip(&unmeterable) {
        assert_eq!(c["unmetered"], *why, "{c}");
        assert_eq!(c["usage_missing"], true, "{c}");
    }
    // The given-up call: abandoned, or, where the provider's answer came before the guest's
    // going away was noticed, cut before its usage went by.
    let gave_up = (&calls[9]["unmetered"], &calls[9]["status"]);
    assert!(
        gave_up == (&json!("abandoned"), &json!(0))
            || gave_up == (&json!("cut_before_usage"), &json!(200)),
        "{u}"
    );
    assert_eq!(u["totals"]["unmetered_calls"], 4, "{u}");
    let by = &u["totals"]["unmetered_by_reason"];
    assert_eq!(
        (
            &by["unreadable_body"],
            &by["unknown_request"],
            &by["body_too_large"]
        ),
        (&json!(1), &json!(1), &json!(1)),
        "{u}"
    );
    // The three streams, Anthropic's answer (JSON: the fake reads `"stream":true` without a
    // space), the JSON completion, the Responses stream, and the lower bounds of the two
    // unmetered streams that passed a content delta each (`output_tokens_estimated`).
    assert_eq!(u["totals"]["output_tokens"], 3 * 12 + 85 + 2 + 5 + 2, "{u}");

    // Under meter_strict the same calls are refused before they go upstream, and counted.
    let strict = h.create(sandbox(true)).await;
    let (_, err, last) = h.exec(&strict, big).await;
    assert_eq!(last["exit_code"], 0, "{}", text(&err));
    let before = seen.lock().unwrap().len();
    for (why, args) in &unmeterable {
        let (out, _, _) = h.exec(&strict, &format!("curl -sS -i {auth} {args}")).await;
        let out = text(&out);
        assert!(
            out.lines()
                .next()
                .is_some_and(|l| l.starts_with("HTTP/") && l.contains(" 403")),
            "{why}: {out}"
        );
        assert!(
            out.contains("x-sandbox-egress-refused: unmeterable"),
            "{why}: {out}"
        );
    }
    assert_eq!(seen.lock().unwrap().len(), before, "nothing went upstream");
    // A call the meter can read still goes, with usage asked for.
    let (out, err, last) = h
        .exec(
            &strict,
            &format!("curl -sS -N {auth} -d '{stream_req}' {base}/chat/completions"),
        )
        .await;
    assert_eq!(last["exit_code"], 0, "{}", text(&err));
    assert_eq!(text(&out), OPENAI_SSE.concat());
    let v = egress(&h, &strict).await;
    assert_eq!(v["by_reason"]["unmeterable"], 3, "{v}");
    let (_, u) = h
        .json("GET", &format!("/v1/sandboxes/{strict}/usage"), None)
        .await;
    assert_eq!(
        (
            &u["totals"]["calls"],
            &u["totals"]["unmetered_calls"],
            &u["totals"]["output_tokens"]
        ),
        (&json!(1), &json!(0), &json!(12)),
        "{u}"
    );

    let (_, m) = h.req("GET", "/metrics", vec![], &[]).await;
    let metrics = text(&m);
    for line in [
        "sandbox_host_unmetered_calls_total{reason=\"body_too_large\"} 1",
        "sandbox_host_unmetered_calls_total{reason=\"no_usage\"} 0",
        "sandbox_host_egress_refusals_total{reason=\"unmeterable\"} 3",
    ] {
        assert!(metrics.contains(line), "missing {line}:\n{metrics}");
    }
}

/// How many times `needle` is in the memory of process `pid` (every readable mapping, read
/// through `/proc/<pid>/mem` as root reads it), and in which mappings.
fn occurrences_in_memory(pid: u32, needle: &[u8]) -> (usize, Vec<String>) {
    use std::io::{Read, Seek, SeekFrom};
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let Ok(mut mem) = std::fs::File::open(format!("/proc/{pid}/mem")) else {
        return (0, vec![]);
    };
    let (mut n, mut where_) = (0, vec![]);
    for line in maps.lines() {
        let mut parts = line.split_whitespace();
        let (Some(range), Some(perms)) = (parts.next(), parts.next()) else {
            continue;
        };
        let name = parts.nth(3).unwrap_or("[anon]").to_string();
        if !perms.starts_with('r') || name == "[vvar]" || name == "[vsyscall]" {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (a, b) = (
            u64::from_str_radix(a, 16).unwrap(),
            u64::from_str_radix(b, 16).unwrap(),
        );
        let mut buf = vec![0u8; (b - a) as usize];
        if mem.seek(SeekFrom::Start(a)).is_err() || mem.read_exact(&mut buf).is_err() {
            continue;
        }
        let here = buf.windows(needle.len()).filter(|w| *w == needle).count();
        if here > 0 {
            n += here;
            where_.push(format!("{here} in {name} {range}"));
        }
    }
    (n, where_)
}

/// The processes of sandbox `id` named `comm` (found by their cgroup, which is named after the
/// sandbox), with their `/proc` directories.
fn processes_of(id: &str, comm: &str) -> Vec<std::path::PathBuf> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            std::fs::read_to_string(p.join("comm")).is_ok_and(|c| c.trim() == comm)
                && std::fs::read_to_string(p.join("cgroup")).is_ok_and(|c| c.contains(id))
        })
        .collect()
}

/// A line of `/proc/<pid>/status`.
fn status(p: &std::path::Path, key: &str) -> String {
    std::fs::read_to_string(p.join("status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{key}:"))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_default()
}

/// A namespace of a process, as the link names it.
fn ns(p: &std::path::Path, which: &str) -> String {
    std::fs::read_link(p.join("ns").join(which))
        .map(|l| l.display().to_string())
        .unwrap_or_default()
}

/// Issue 32: each sandbox's network runs in a process of its own, jailed: a uid of its own (not
/// the service's, not its VM's), no capabilities, its seccomp filter, new namespaces but the
/// host's network (it connects upstream), a cgroup of its own named after the sandbox; it carries
/// the guest's traffic, and it ends with its sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sandbox_has_a_jailed_network_process_of_its_own() {
    if stock_image_missing() {
        return;
    }
    let (port, _seen) = http_server("hello from allowed.test\n").await;
    let resolve = format!("allowed.test:{port}:127.0.0.1");
    let h = start(&[("SANDBOX_HOST_EGRESS_RESOLVE", &resolve)]);
    // A key of this run alone, so that any copy found is this one.
    let key = format!(
        "sk-ant-api03-MEMCHECK{:016x}{:08x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
        std::process::id()
    );
    let id = h
        .create(json!({"egress": {
            "allow": ["allowed.test"],
            "secrets": [{"env": "ANTHROPIC_API_KEY", "value": key, "hosts": ["api.provider.test"]}]
        }}))
        .await;
    let (out, err, last) = h
        .exec(&id, &nc_get("allowed.test", port, "allowed.test"))
        .await;
    assert_eq!(last["exit_code"], 0, "{} {}", text(&out), text(&err));
    assert!(
        text(&out).contains("hello from allowed.test"),
        "{}",
        text(&out)
    );

    let nets = processes_of(&id, "sandbox-net");
    assert_eq!(nets.len(), 1, "one network process for the sandbox");
    let net = &nets[0];
    let service = std::path::PathBuf::from(format!("/proc/{}", h.child.id()));
    let uid = |p: &std::path::Path| status(p, "Uid");
    assert_ne!(uid(net), uid(&service), "not the service's uid");
    assert_ne!(uid(net).split_whitespace().next(), Some("0"), "not root");
    for vm in processes_of(&id, "sandbox-vm")
        .iter()
        .chain(&processes_of(&id, "qemu-system-x86"))
    {
        assert_ne!(uid(net), uid(vm), "not its VM's uid");
    }
    assert_eq!(status(net, "Seccomp"), "2", "a seccomp filter");
    assert_eq!(status(net, "NoNewPrivs"), "1");
    assert_eq!(status(net, "CapEff"), "0000000000000000", "no capabilities");
    for which in ["net", "mnt", "pid", "user", "ipc", "uts"] {
        assert_ne!(
            ns(net, which),
            ns(&service, which),
            "a {which} namespace of its own"
        );
    }
    // Its network namespace has no interface but its own loopback: the guest's connection above
    // went out through the service's dialer, and a process its guest took over reaches nothing.
    match std::fs::read_to_string(net.join("net/dev")) {
        Ok(dev) => {
            let ifaces: Vec<&str> = dev
                .lines()
                .skip(2)
                .filter_map(|l| l.split(':').next())
                .map(str::trim)
                .collect();
            assert_eq!(ifaces, ["lo"], "{dev}");
        }
        Err(e) => eprintln!("skipped the interface check: /proc/<pid>/net/dev: {e}"),
    }
    let cgroup = std::fs::read_to_string(net.join("cgroup")).unwrap();
    assert!(cgroup.contains(&format!("{id}-net")), "{cgroup}");
    // The service holds no end of the guest's frames: no socket of the service is one the VM or
    // the network process holds (a descriptor of the same socket shows the same inode).
    let sockets = |p: &std::path::Path| -> std::collections::BTreeSet<String> {
        std::fs::read_dir(p.join("fd"))
            .map(|d| {
                d.flatten()
                    .filter_map(|e| std::fs::read_link(e.path()).ok())
                    .map(|l| l.to_string_lossy().into_owned())
                    .filter(|l| l.starts_with("socket:"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let theirs: std::collections::BTreeSet<String> = processes_of(&id, "sandbox-vm")
        .iter()
        .chain(&processes_of(&id, "qemu-system-x86"))
        .chain(std::iter::once(net))
        .flat_map(|p| sockets(p))
        .collect();
    assert!(!theirs.is_empty(), "the processes' sockets are readable");
    let shared: Vec<_> = sockets(&service).intersection(&theirs).cloned().collect();
    assert!(
        shared.is_empty(),
        "the service holds their sockets: {shared:?}"
    );

    // The key lives in the network process; what a read of the service's memory finds of it
    // after the create (issue 32, item 3). The registry's copy, the settings sent and the
    // request's body are overwritten; what may remain is the HTTP connection's read buffer,
    // which the server library keeps (found once in four runs, in an anonymous mapping).
    let net_pid: u32 = net.file_name().unwrap().to_string_lossy().parse().unwrap();
    let (in_net, _) = occurrences_in_memory(net_pid, key.as_bytes());
    assert!(in_net >= 1, "the network process holds the key");
    let (in_service, where_) = occurrences_in_memory(h.child.id(), key.as_bytes());
    eprintln!("the key in the service's memory after the create: {in_service} ({where_:?})");
    assert!(
        in_service <= 1,
        "the service keeps copies of the key: {in_service} ({where_:?})"
    );

    let (s, _) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, 204);
    let gone = (0..100).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(100));
        !net.exists()
    });
    assert!(gone, "the network process ends with its sandbox");
}

/// A server that answers every request with an endless body (64 MiB at most), for a guest that
/// never reads it.
async fn flood_server() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut b = [0u8; 1024];
                let _ = s.read(&mut b).await;
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 67108864\r\n\r\n")
                    .await;
                let chunk = vec![b'x'; 1 << 20];
                for _ in 0..64 {
                    if s.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// Issue 32: a guest that floods its network process (128 connections whose responses it never
/// reads) fills that process's buffers, up to its own egress memory, and nothing of the service's:
/// the service's resident memory stays where it was, and another sandbox's execs still answer
/// (their latency printed beside a quiet run's; machines are too noisy to assert a time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_floods_its_network_process_weighs_on_no_one_else() {
    if stock_image_missing() {
        return;
    }
    let port = flood_server().await;
    let resolve = format!("flood.test:{port}:127.0.0.1");
    let h = start(&[("SANDBOX_HOST_EGRESS_RESOLVE", &resolve)]);
    let (flooder, quiet) = tokio::join!(
        h.create(json!({"egress": {"allow": ["flood.test"]}})),
        h.create(json!({}))
    );
    let service = std::path::PathBuf::from(format!("/proc/{}", h.child.id()));
    let rss_kib = |p: &std::path::Path| -> u64 {
        status(p, "VmRSS")
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let exec_ms = |n: usize| {
        let (h, quiet) = (&h, &quiet);
        async move {
            let mut v = Vec::new();
            for _ in 0..n {
                let t = std::time::Instant::now();
                let (_, _, last) = h.exec(quiet, "true").await;
                assert_eq!(last["exit_code"], 0, "{last}");
                v.push(t.elapsed().as_secs_f64() * 1e3);
            }
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        }
    };
    let quiet_ms = exec_ms(7).await;
    let service_before = rss_kib(&service);

    // 128 connections, each sending a request and never reading its answer: the pipe after nc
    // is never read, so nc stops reading and the guest's receive windows close.
    let flood = format!(
        "i=0; while [ $i -lt 128 ]; do \
         ( (printf 'GET / HTTP/1.1\\r\\nHost: flood.test\\r\\n\\r\\n'; sleep 300) \
         | nc flood.test {port} | sleep 300 ) >/dev/null 2>&1 & i=$((i+1)); done; echo started"
    );
    let (out, err, last) = h.exec(&flooder, &flood).await;
    assert_eq!(last["exit_code"], 0, "{} {}", text(&out), text(&err));
    // Let the buffers fill.
    tokio::time::sleep(std::time::Duration::from_secs(8)).await;
    let (s, egress) = h
        .json("GET", &format!("/v1/sandboxes/{flooder}/egress"), None)
        .await;
    assert_eq!(s, 200, "{egress}");
    let open = egress["connections"]["open"].as_u64().unwrap_or(0);
    let held = egress["memory"]["held_bytes"].as_u64().unwrap_or(0);
    let limit = egress["memory"]["limit_bytes"].as_u64().unwrap_or(0);
    // Each costs its worst case (an HTTP connection with its upstream and a request in flight,
    // about 1.5 MiB): the egress memory takes some sixty, and the rest are reset (memory_limit).
    assert!(open >= 32, "the flood holds connections open: {egress}");
    assert!(held <= limit, "{egress}");

    let flood_ms = exec_ms(7).await;
    let service_during = rss_kib(&service);
    let nets = processes_of(&flooder, "sandbox-net");
    assert_eq!(nets.len(), 1, "the flooder's network process still runs");
    let net_kib = rss_kib(&nets[0]);
    eprintln!(
        "flood: {open} connections open, egress memory held {:.1} of {:.1} MiB; the flooder's \
         network process {:.1} MiB resident; the service {:.1} MiB before, {:.1} MiB during; the \
         other sandbox's exec median {quiet_ms:.1} ms quiet, {flood_ms:.1} ms during",
        held as f64 / 1048576.0,
        limit as f64 / 1048576.0,
        net_kib as f64 / 1024.0,
        service_before as f64 / 1024.0,
        service_during as f64 / 1024.0,
    );
    // The process's memory is bounded by its cgroup (its egress memory and its allowance), and
    // the guest's data never reaches the service.
    assert!(
        net_kib * 1024 <= limit + (32 << 20),
        "the network process holds {net_kib} KiB"
    );
    assert!(
        service_during < service_before + 16 * 1024,
        "the service grew from {service_before} KiB to {service_during} KiB during the flood"
    );
    for id in [&flooder, &quiet] {
        let (s, _) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, 204);
    }
}
