//! Egress from inside a real guest (issue 5), through the real binary: the guest resolves an
//! allowed name through the stack's DNS and fetches from a server on this machine's loopback
//! (reached through `SANDBOX_HOST_EGRESS_RESOLVE`), and every way around the allowlist is
//! refused, counted by reason, and shown in `/egress` and `/metrics`. No traffic leaves the
//! machine: names outside the overrides are refused inside the stack before any lookup.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{start, stock_image_missing};
use serde_json::{Value, json};
use std::process::{Command, Stdio};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A plain HTTP/1.1 server on loopback that answers every request with `body` and records the
/// request heads it saw.
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
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
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
    let h = start(&[("SANDBOX_HOST_EGRESS_RESOLVE", &resolve)]);
    let id = h
        .create(json!({"egress": {"allow": ["allowed.test", "private.test", "metadata.test", "mapped.test"]}}))
        .await;

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
        assert!(
            started.elapsed() < Duration::from_secs(4),
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
    assert!(other_seen.lock().unwrap().is_empty());
    assert_eq!(
        seen.lock().unwrap().len(),
        1,
        "only the allowed request arrived"
    );
    eprintln!("{} refusals answered in {:?}", cases.len(), t.elapsed());

    let v = egress(&h, &id).await;
    let by = &v["by_reason"];
    assert!(by["name_not_allowed"].as_u64() >= Some(2), "{v}");
    assert!(by["ip_literal"].as_u64() >= Some(3), "{v}");
    assert_eq!(by["internal_address"], 3, "{v}");
    assert!(by["dns_bypass"].as_u64() >= Some(2), "{v}");
    assert!(by["udp"].as_u64() >= Some(1), "{v}");
    assert_eq!(by["http_connect"], 1, "{v}");
    assert_eq!(by["sni_host_mismatch"], 1, "{v}");
    assert_eq!(by["protocol"], 1, "{v}");
    let events = v["events"].as_array().unwrap();
    assert!(
        events
            .iter()
            .any(|e| e["reason"] == "internal_address"
                && e["target"] == format!("private.test:{port}")),
        "{v}"
    );
    assert_eq!(v["connections"]["http"], 1, "{v}");
    assert_eq!(v["connections"]["open"], 0, "{v}");
    assert!(v["bytes"]["to_guest"].as_u64() > Some(20), "{v}");
    // The sandbox's summary carries the same counters.
    let (_, show) = h.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(show["egress"]["refused"], v["refused"], "{show}");

    let (_, m) = h.req("GET", "/metrics", vec![], &[]).await;
    let m = text(&m);
    assert!(
        m.contains("sandbox_host_egress_refusals_total{reason=\"internal_address\"} 3"),
        "{m}"
    );
    // The totals stay after the sandbox goes.
    let (s, _) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, 204);
    let (_, m) = h.req("GET", "/metrics", vec![], &[]).await;
    assert!(
        text(&m).contains("sandbox_host_egress_refusals_total{reason=\"internal_address\"} 3"),
        "{}",
        text(&m)
    );
}

/// A TLS server on loopback (`openssl s_server`) with a certificate for `name` from a CA made for
/// the test; returns the server process, its port and the CA's PEM.
fn tls_server(dir: &std::path::Path, name: &str) -> (std::process::Child, u16, String) {
    let run = |args: &[&str]| {
        let st = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("openssl runs");
        assert!(st.success(), "openssl {args:?}");
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=egress test CA",
    ]);
    run(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        "srv.key",
        "-out",
        "srv.csr",
        "-subj",
        &format!("/CN={name}"),
    ]);
    std::fs::write(dir.join("ext.cnf"), format!("subjectAltName=DNS:{name}\n")).unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "srv.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
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
    let store = sandbox_vmm::config::image_dir();
    if sandbox_vmm::ImageStore::new(&store)
        .resolve("vantik-guest:latest")
        .is_err()
    {
        let why = "no vantik-guest:latest in the image store; build it with `sudo python3 rootfs/build-guest.py`";
        let root = std::fs::metadata("/proc/self")
            .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
            .unwrap_or(false);
        assert!(
            !(root && std::env::var("SANDBOX_HOST_REQUIRE_E2E").as_deref() == Ok("1")),
            "{why}"
        );
        eprintln!("skipped: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (mut tls, tls_port, ca) = tls_server(dir.path(), "tls.test");
    let (port, seen) = http_server("hello from allowed.test\n").await;
    let resolve = format!("allowed.test:{port}:127.0.0.1,tls.test:{tls_port}:127.0.0.1");
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
    let v = egress(&h, &id).await;
    assert_eq!(v["by_reason"]["sni_host_mismatch"], 1, "{v}");
    assert_eq!(v["connections"]["spliced"], 1, "{v}");
    let _ = tls.kill();
    let _ = tls.wait();
}
