//! A fleet behind a gateway (issue 33), with real hosts and guests: three sandbox hosts of one
//! sandbox's room each, named, and `sandbox-host gateway` in front of them. A create lands on a
//! host with room (three creates, one on each), the fourth is refused with the hosts' reasons;
//! exec, files and the list go through the gateway to the host an id names; a host killed
//! mid-run gives its sandboxes' callers the clear 503 while the others serve, and a create goes
//! where there is room.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{start, start_gateway, stock_image_missing};
use serde_json::json;

/// The host an id names (`sbx-<hex>-<host>`).
fn host_of(id: &str) -> &str {
    id.rsplit_once('-').map(|(_, h)| h).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_places_routes_and_outlives_a_lost_host() {
    if stock_image_missing() {
        return;
    }
    // Room for one 256 MiB sandbox each (with its egress and network process's shares).
    let host = |name: &str| {
        start(&[
            ("SANDBOX_HOST_NAME", name),
            ("SANDBOX_HOST_MEMORY_LIMIT_MIB", "640"),
        ])
    };
    let (a, mut b, c) = (host("a"), host("b"), host("c"));
    let hosts = format!("a={},b={},c={}", a.url(""), b.url(""), c.url(""));
    let gw = start_gateway(&[
        ("SANDBOX_HOST_GATEWAY_HOSTS", hosts.as_str()),
        ("SANDBOX_HOST_GATEWAY_POLL_MS", "300"),
    ]);
    let (s, health) = gw.json("GET", "/v1/health", None).await;
    assert_eq!(s, 200, "{health}");
    assert_eq!(health["available"], true, "{health}");
    assert_eq!(
        health["hosts"].as_array().map(Vec::len),
        Some(3),
        "{health}"
    );
    assert!(
        health["hosts"]
            .as_array()
            .unwrap()
            .iter()
            .all(|h| h["up"] == true),
        "{health}"
    );
    // The token rules are the hosts': none, no answer.
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<hyper::body::Bytes>>();
    let res = client
        .request(
            hyper::Request::get(gw.url("/v1/sandboxes"))
                .body(Default::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), 401);
    // A create's body is read (bounded) to place it: one far larger than a create is refused.
    let big = format!("{{\"run_id\": \"{}\"}}", "x".repeat(2 << 20));
    let (s, answer) = gw
        .req(
            "POST",
            "/v1/sandboxes",
            big.into_bytes(),
            &[("content-type", "application/json")],
        )
        .await;
    let v: serde_json::Value = serde_json::from_slice(&answer).unwrap_or_default();
    assert_eq!(
        (s, v["code"].as_str()),
        (413, Some("body_too_large")),
        "{v}"
    );

    // Three creates: one on each host (each has room for one), each answer naming its host.
    let mut ids = vec![];
    for i in 0..3 {
        let (s, v) = gw
            .json(
                "POST",
                "/v1/sandboxes",
                Some(common::small_run(&format!("run-{i}"))),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        let id = v["id"].as_str().unwrap().to_string();
        assert_eq!(v["host"].as_str(), Some(host_of(&id)), "{v}");
        ids.push(id);
    }
    let placed: BTreeSet<&str> = ids.iter().map(|i| host_of(i)).collect();
    assert_eq!(placed, BTreeSet::from(["a", "b", "c"]), "{ids:?}");
    // A fourth: no host has room, and the answer says so.
    let (s, v) = gw
        .json("POST", "/v1/sandboxes", Some(common::small_run("run-4")))
        .await;
    assert_eq!((s, v["code"].as_str()), (503, Some("no_capacity")), "{v}");

    // Through the gateway to the host each id names: exec, a file both ways, the list.
    for id in &ids {
        let (out, _, last) = gw.exec(id, "echo hello from $(hostname)").await;
        assert_eq!(last["exit_code"], 0, "{last}");
        assert!(String::from_utf8_lossy(&out).starts_with("hello"));
    }
    let id = &ids[0];
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let (s, _) = gw
        .req(
            "PUT",
            &format!("/v1/sandboxes/{id}/files?path=/workspace/f"),
            data.clone(),
            &[],
        )
        .await;
    assert_eq!(s, 204);
    let (s, back) = gw
        .req(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path=/workspace/f"),
            vec![],
            &[],
        )
        .await;
    assert_eq!((s, back.len()), (200, data.len()));
    assert!(back == data);
    let (s, list) = gw.json("GET", "/v1/sandboxes", None).await;
    assert_eq!(s, 200);
    let listed: BTreeSet<String> = list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(listed, ids.iter().cloned().collect(), "{list}");

    // Host b is lost mid-run: its sandbox's callers get the clear 503, nothing hangs, the
    // others serve, and the list names what did not answer.
    let on_b = ids.iter().find(|i| host_of(i) == "b").unwrap().clone();
    b.signal("KILL");
    b.wait_exit(Duration::from_secs(10));
    let t = std::time::Instant::now();
    let (s, v) = gw.json("GET", &format!("/v1/sandboxes/{on_b}"), None).await;
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert_eq!(
        (s, v["code"].as_str()),
        (503, Some("host_unavailable")),
        "{v}"
    );
    assert!(
        v["error"].as_str().unwrap().starts_with(&format!(
            "The sandbox host b that holds {on_b} did not answer"
        )),
        "{v}"
    );
    let (_, list) = gw.json("GET", "/v1/sandboxes", None).await;
    assert_eq!(
        list["sandboxes"].as_array().map(Vec::len),
        Some(2),
        "{list}"
    );
    assert_eq!(list["unreachable"][0]["host"], "b", "{list}");
    for id in ids.iter().filter(|i| **i != on_b) {
        let (s, v) = gw.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, 200, "{v}");
    }

    // Room again on a, but a drains: no host takes a create. Then a takes it again.
    let on_a = ids.iter().find(|i| host_of(i) == "a").unwrap().clone();
    let (s, _) = gw
        .json("DELETE", &format!("/v1/sandboxes/{on_a}"), None)
        .await;
    assert_eq!(s, 204);
    let (s, v) = gw
        .json("PUT", "/v1/hosts/a/drain", Some(json!({"draining": true})))
        .await;
    assert_eq!((s, &v), (200, &json!({"name": "a", "draining": true})));
    let (_, health) = gw.json("GET", "/v1/health", None).await;
    let row_a = health["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["name"] == "a")
        .cloned()
        .unwrap();
    assert_eq!(
        (
            row_a["draining"].as_bool(),
            row_a["takes_sandboxes"].as_bool()
        ),
        (Some(true), Some(false)),
        "{row_a}"
    );
    let (s, v) = gw
        .json(
            "POST",
            "/v1/sandboxes",
            Some(common::small_run("run-drained")),
        )
        .await;
    assert_eq!((s, v["code"].as_str()), (503, Some("no_capacity")), "{v}");
    let (s, v) = gw
        .json("PUT", "/v1/hosts/zz/drain", Some(json!({"draining": true})))
        .await;
    assert_eq!((s, v["code"].as_str()), (404, Some("not_found")), "{v}");
    let (s, _) = gw
        .json("PUT", "/v1/hosts/a/drain", Some(json!({"draining": false})))
        .await;
    assert_eq!(s, 200);
    tokio::time::sleep(Duration::from_millis(700)).await; // a poll sees the room
    let (s, v) = gw
        .json("POST", "/v1/sandboxes", Some(common::small_run("run-5")))
        .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["host"], "a", "{v}");

    // Ids of no sandbox: a gone one on a live host, one of no host of the fleet, one of no form.
    for (id, code) in [
        (on_a.as_str(), "no_sandbox"),
        ("sbx-0123456789abcdef-zz", "no_sandbox"),
        ("sbx-nothing", "no_sandbox"),
    ] {
        let (s, v) = gw.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!((s, v["code"].as_str()), (404, Some(code)), "{id}: {v}");
    }
    let (_, m) = gw.req("GET", "/metrics", vec![], &[]).await;
    let m = String::from_utf8_lossy(&m);
    assert!(
        m.contains("sandbox_gateway_placements_total{host=\"a\"} 2"),
        "{m}"
    );
    assert!(m.contains("sandbox_gateway_host_up{host=\"b\"} 0"), "{m}");
    drop((a, c));
}

/// Placement by architecture: an x86_64 host and an aarch64 host (its guests under emulation)
/// behind one gateway. A run asking for aarch64 lands on the aarch64 host and its guest says so;
/// one asking for x86_64 on the other; a host asked directly for guests it does not run refuses
/// as a full host does, in words; an architecture no host runs now is refused with each host's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_places_a_run_on_a_host_of_the_architecture_it_asks_for() {
    if stock_image_missing() {
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("sbx-arch")
        .tempdir_in("/tmp")
        .unwrap();
    let arm_state = tmp.path().join("arm");
    let Some(arm_store) = common::aarch64_store(&arm_state) else {
        return;
    };
    let x86 = start(&[("SANDBOX_HOST_NAME", "x")]);
    let arm = common::start_in(
        &arm_state,
        &[
            ("SANDBOX_HOST_NAME", "arm"),
            ("SANDBOX_HOST_ARCH", "aarch64"),
            ("SANDBOX_HOST_VMM", "qemu"),
            ("SANDBOX_HOST_IMAGE_DIR", arm_store.to_str().unwrap()),
        ],
    );
    let hosts = format!("x={},arm={}", x86.url(""), arm.url(""));
    let gw = start_gateway(&[
        ("SANDBOX_HOST_GATEWAY_HOSTS", hosts.as_str()),
        ("SANDBOX_HOST_GATEWAY_POLL_MS", "300"),
    ]);
    let (_, health) = gw.json("GET", "/v1/health", None).await;
    let arches: BTreeSet<(String, String)> = health["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h["name"].as_str().unwrap_or_default().to_string(),
                h["arch"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    assert_eq!(
        arches,
        [("arm", "aarch64"), ("x", "x86_64")]
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .into(),
        "{health}"
    );

    let run = |arch: &str| {
        let mut r = common::small_run("run-arch");
        r["arch"] = json!(arch);
        r
    };
    for (arch, host, machine) in [("aarch64", "arm", "aarch64"), ("x86_64", "x", "x86_64")] {
        for _ in 0..2 {
            let (s, v) = gw.json("POST", "/v1/sandboxes", Some(run(arch))).await;
            assert_eq!(s, 201, "{v}");
            assert_eq!(v["host"], host, "{arch}: {v}");
            let id = v["id"].as_str().unwrap().to_string();
            let (out, _, last) = gw.exec(&id, "uname -m").await;
            assert_eq!(last["exit_code"], 0, "{last}");
            assert_eq!(String::from_utf8_lossy(&out).trim(), machine);
            let (s, _) = gw
                .req("DELETE", &format!("/v1/sandboxes/{id}"), vec![], &[])
                .await;
            assert_eq!(s, 204);
        }
    }

    // Asked directly, a host refuses a run for guests it does not run, as a full host does.
    let (s, v) = x86
        .json("POST", "/v1/sandboxes", Some(run("aarch64")))
        .await;
    assert_eq!((s, v["code"].as_str()), (503, Some("no_capacity")), "{v}");
    let why = v["error"].as_str().unwrap();
    assert!(
        why.contains("this host runs x86_64 guests and the run asks for aarch64"),
        "{why}"
    );
    // No such architecture: the host's own words, from the gateway too.
    for at in [&gw, &x86] {
        let (s, v) = at.json("POST", "/v1/sandboxes", Some(run("riscv64"))).await;
        assert_eq!((s, v["code"].as_str()), (400, Some("bad_request")), "{v}");
        assert!(
            v["error"]
                .as_str()
                .unwrap()
                .contains("arch must be x86_64 or aarch64, not `riscv64`"),
            "{v}"
        );
    }
    // The aarch64 host draining: a run for aarch64 has no host, and the refusal says each one's.
    let (s, _) = gw
        .json(
            "PUT",
            "/v1/hosts/arm/drain",
            Some(json!({"draining": true})),
        )
        .await;
    assert_eq!(s, 200);
    let (s, v) = gw.json("POST", "/v1/sandboxes", Some(run("aarch64"))).await;
    assert_eq!((s, v["code"].as_str()), (503, Some("no_capacity")), "{v}");
    let why = v["error"].as_str().unwrap();
    assert!(
        why.contains("takes a sandbox of aarch64 guests now")
            && why.contains("x: it runs x86_64 guests")
            && why.contains("arm: it is draining"),
        "{why}"
    );
}

/// TLS between a gateway and its hosts: a host serving https only (`SANDBOX_HOST_TLS_CERT`,
/// `SANDBOX_HOST_TLS_KEY`), a gateway reaching it at its address with the certificate checked
/// against the name it is issued for (`SANDBOX_HOST_TLS_NAME`) and an authority of
/// `SANDBOX_HOST_CA_FILE`: a sandbox made, used and deleted through it. A gateway trusting
/// another authority, or expecting another name, never sends it a request (the host is down,
/// with the certificate's reason); a client that opens connections and never finishes its
/// handshake holds nothing up; the operator commands reach an https host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_reaches_its_hosts_over_tls() {
    use std::os::unix::fs::PermissionsExt;
    if stock_image_missing() {
        return;
    }
    let certs = tempfile::Builder::new()
        .prefix("sbx-tls")
        .tempdir_in("/tmp")
        .unwrap();
    let (ours, other) = (certs.path().join("ours"), certs.path().join("other"));
    for d in [&ours, &other] {
        std::fs::create_dir(d).unwrap();
    }
    common::let_service_pass(certs.path());
    common::make_certs(&ours, &["hosts.test", "localhost"]);
    common::make_certs(&other, &["hosts.test"]);
    // The service's user reads the key (an operator gives it the file; here, the world may).
    std::fs::set_permissions(ours.join("srv.key"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let path = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let (cert, key) = (path(&ours.join("srv.pem")), path(&ours.join("srv.key")));
    // Bodies up to 2 GB: the gigabyte's archive below.
    let host = start(&[
        ("SANDBOX_HOST_NAME", "t1"),
        ("SANDBOX_HOST_TLS_CERT", cert.as_str()),
        ("SANDBOX_HOST_TLS_KEY", key.as_str()),
        ("SANDBOX_HOST_MAX_BODY_MB", "2000"),
    ]);
    // Connections from another address that never finish their handshake, held open all
    // along: eight hold a slot each, the host closes the ones past them at once.
    let mut idle = vec![];
    for _ in 0..12 {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        idle.push(
            sock.connect(format!("127.0.0.1:{}", host.port).parse().unwrap())
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut closed = 0;
    for c in &idle {
        let mut b = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(200), c.peek(&mut b)).await {
            closed += 1;
        }
    }
    assert_eq!(
        closed, 4,
        "the connections past eight from one address are closed at once"
    );
    // Plain http to it gets no HTTP answer.
    let plain = common::raw_http(
        host.port,
        "GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        vec![],
    );
    assert!(!plain.starts_with("HTTP/1.1 200"), "{plain}");

    let hosts = format!("t1=https://127.0.0.1:{}", host.port);
    let gateway = |ca: &std::path::Path, name: &str| {
        start_gateway(&[
            ("SANDBOX_HOST_GATEWAY_HOSTS", hosts.as_str()),
            ("SANDBOX_HOST_GATEWAY_POLL_MS", "300"),
            ("SANDBOX_HOST_TLS_NAME", name),
            ("SANDBOX_HOST_CA_FILE", ca.to_str().unwrap()),
            ("SANDBOX_HOST_MAX_BODY_MB", "2000"),
        ])
    };
    let gw = gateway(&ours.join("ca.pem"), "hosts.test");
    let (_, health) = gw.json("GET", "/v1/health", None).await;
    assert_eq!(health["hosts"][0]["up"], true, "{health}");
    let (s, v) = gw
        .json("POST", "/v1/sandboxes", Some(common::small_run("run-tls")))
        .await;
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let (out, _, last) = gw.exec(&id, "echo over-tls").await;
    assert_eq!(
        (String::from_utf8_lossy(&out).trim(), &last["exit_code"]),
        ("over-tls", &json!(0))
    );
    let data: Vec<u8> = (0..8u32 << 20).map(|i| (i * 7 + i / 4099) as u8).collect();
    let (s, _) = gw
        .req(
            "PUT",
            &format!("/v1/sandboxes/{id}/files?path=/workspace/blob"),
            data.clone(),
            &[("content-type", "application/octet-stream")],
        )
        .await;
    assert_eq!(s, 204);
    let (s, back) = gw
        .req(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path=/workspace/blob"),
            vec![],
            &[],
        )
        .await;
    assert_eq!(s, 200);
    assert!(back == data, "8 MiB back over TLS differ");

    // A gigabyte's archive into a guest through the gateway, over TLS both ways: the client sends
    // as fast as it can, the guest takes it at its pace (emulated: tens of MB/s), and the gateway
    // holds none of the difference (its resident memory sampled throughout).
    let (s, v) = gw
        .json(
            "POST",
            "/v1/sandboxes",
            Some(
                json!({"run_id": "run-gigabyte", "time_limit_ms": 600000, "review": false,
                        "memory_mib": 1536, "vcpus": 1}),
            ),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let big = v["id"].as_str().unwrap().to_string();
    let rss = common::PeakRss::watch(common::service_pid(&gw));
    let t = std::time::Instant::now();
    let (s, body) = put_streamed(
        &gw.url(&format!("/v1/sandboxes/{big}/archive?path=/workspace/big")),
        GigabyteTar::new(),
    )
    .await;
    let secs = t.elapsed().as_secs_f64();
    let (before, peak) = rss.stop();
    assert_eq!(s, 204, "{body}");
    eprintln!(
        "a 1 GiB archive through the gateway over TLS in {secs:.1} s ({:.0} MiB/s); gateway RSS \
         {before} KiB before, {peak} KiB at most",
        1024.0 / secs
    );
    assert!(
        peak < before + 64 * 1024,
        "the gateway held the stream: {before} KiB -> {peak} KiB"
    );
    let (out, _, last) = gw
        .exec(
            &big,
            "stat -c %s /workspace/big/gigabyte; tail -c 1048576 /workspace/big/gigabyte | sha256sum",
        )
        .await;
    assert_eq!(last["exit_code"], 0, "{last}");
    let out = String::from_utf8_lossy(&out).to_string();
    let chunk_sum = {
        use sha2::Digest;
        let d = sha2::Sha256::digest(GigabyteTar::chunk(1023));
        d.iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    assert!(
        out.starts_with("1073741824\n") && out.contains(&chunk_sum),
        "{out} (want the last MiB's sum {chunk_sum})"
    );
    let (s, _) = gw
        .req("DELETE", &format!("/v1/sandboxes/{big}"), vec![], &[])
        .await;
    assert_eq!(s, 204);

    // Another authority, or another name: no request reaches the host.
    for (ca, name, why) in [
        (
            other.join("ca.pem"),
            "hosts.test",
            "invalid peer certificate",
        ),
        (
            ours.join("ca.pem"),
            "elsewhere.test",
            "certificate not valid for name",
        ),
    ] {
        let bad = gateway(&ca, name);
        let (_, health) = bad.json("GET", "/v1/health", None).await;
        let row = &health["hosts"][0];
        assert_eq!(row["up"], false, "{health}");
        assert!(
            row["reason"].as_str().unwrap_or_default().contains(why),
            "{health}"
        );
        let (s, v) = bad.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(
            (s, v["code"].as_str()),
            (503, Some("host_unavailable")),
            "{v}"
        );
    }

    // The operator commands over https: by the name the certificate has, or at an address with
    // that name given (as the Helm chart's probe does); another name is refused.
    for (url, name, ok) in [
        ("localhost", "", true),
        ("127.0.0.1", "hosts.test", true),
        ("127.0.0.1", "", false),
    ] {
        let out = common::bin()
            .arg("health")
            .env("SANDBOX_HOST_URL", format!("https://{url}:{}", host.port))
            .env("SANDBOX_HOST_TLS_NAME", name)
            .env("SANDBOX_HOST_CA_FILE", ours.join("ca.pem"))
            .env("SANDBOX_HOST_TOKEN", common::TOKEN)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.success(), ok, "{url} {name}: {said} {err}");
        if ok {
            assert!(said.contains("\"available\""), "{said}");
        } else {
            assert!(err.contains("SANDBOX_HOST_CA_FILE and the name"), "{err}");
        }
    }
    let (s, _) = gw
        .req("DELETE", &format!("/v1/sandboxes/{id}"), vec![], &[])
        .await;
    assert_eq!(s, 204);
    drop(idle);
}

/// A tar stream of one file of 1 GiB (`gigabyte`), made as it is read: 1024 chunks of 1 MiB,
/// each its own bytes.
struct GigabyteTar {
    next: u32,
    done: bool,
}

impl GigabyteTar {
    const CHUNKS: u32 = 1024;

    fn new() -> GigabyteTar {
        GigabyteTar {
            next: 0,
            done: false,
        }
    }

    fn chunk(i: u32) -> Vec<u8> {
        (0..1u32 << 20)
            .map(|j| (j.wrapping_mul(31) ^ i.wrapping_mul(131)) as u8)
            .collect()
    }
}

impl http_body::Body for GigabyteTar {
    type Data = hyper::body::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let data = if self.done {
            return std::task::Poll::Ready(None);
        } else if self.next == 0 {
            let mut h = tar::Header::new_gnu();
            h.set_path("gigabyte").unwrap();
            h.set_size(u64::from(Self::CHUNKS) << 20);
            h.set_mode(0o644);
            h.set_entry_type(tar::EntryType::Regular);
            h.set_cksum();
            let mut first = h.as_bytes().to_vec();
            first.extend(Self::chunk(0));
            first
        } else if self.next < Self::CHUNKS {
            Self::chunk(self.next)
        } else {
            self.done = true;
            vec![0u8; 1024]
        };
        self.next += 1;
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(data.into()))))
    }
}

/// A PUT of `body` (streamed, no length) with the test token; the status and the answer.
async fn put_streamed(url: &str, body: GigabyteTar) -> (u16, String) {
    use http_body_util::BodyExt;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<GigabyteTar>();
    let req = hyper::Request::put(url)
        .header("authorization", format!("Bearer {}", common::TOKEN))
        .header("content-type", "application/x-tar")
        .body(body)
        .unwrap();
    let res = client.request(req).await.unwrap();
    let status = res.status().as_u16();
    let body = res
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    (status, String::from_utf8_lossy(&body).into_owned())
}
