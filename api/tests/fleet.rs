//! A fleet as Kubernetes runs one (issue 33), on this machine: three sandbox hosts, each in a
//! network namespace of its own with its own address (as pods are), found by two gateway
//! replicas through a DNS name whose A records are the hosts (a headless Service), served by a
//! resolver of this test that the gateways use as their only one (each runs in a mount
//! namespace whose /etc/resolv.conf names it). Sandboxes spread over the hosts; either gateway
//! serves every sandbox, and one killed leaves the other serving; a host taken out of the DNS
//! name leaves the gateways' hosts; and a gigabyte streams through a gateway whose memory stays
//! flat. Needs root (namespaces, port 53); CI runs as root.

mod common;

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Host, start_gateway_wrapped, start_in_wrapped, stock_image_missing};

/// The name the gateways resolve, and the resolver's address.
const NAME: &str = "hosts.fleet.test";
/// Its SRV name: a record per host (the gateway's other way of finding hosts).
const SRV_NAME: &str = "_api._tcp.hosts.fleet.test";
const RESOLVER: &str = "127.0.0.53";

fn sh(args: &[&str]) {
    let st = Command::new(args[0]).args(&args[1..]).status().unwrap();
    assert!(st.success(), "{args:?}");
}

/// Three network namespaces joined to this one by veth pairs: host `i` at 10.77.i.2, this side
/// 10.77.i.1. Removed when dropped.
struct Namespaces(Vec<String>);

impl Namespaces {
    fn make(n: usize) -> Namespaces {
        let tag = std::process::id() % 100_000;
        let mut names = vec![];
        for i in 0..n {
            let ns = format!("sbxf{tag}-{i}");
            let (a, b) = (format!("vf{tag}{i}a"), format!("vf{tag}{i}b"));
            let _ = Command::new("ip").args(["netns", "del", &ns]).status();
            sh(&["ip", "netns", "add", &ns]);
            names.push(ns.clone());
            sh(&["ip", "link", "add", &a, "type", "veth", "peer", "name", &b]);
            sh(&["ip", "link", "set", &b, "netns", &ns]);
            sh(&["ip", "addr", "add", &format!("10.77.{i}.1/24"), "dev", &a]);
            sh(&["ip", "link", "set", &a, "up"]);
            sh(&[
                "ip",
                "netns",
                "exec",
                &ns,
                "ip",
                "addr",
                "add",
                &format!("10.77.{i}.2/24"),
                "dev",
                &b,
            ]);
            sh(&["ip", "netns", "exec", &ns, "ip", "link", "set", &b, "up"]);
            sh(&["ip", "netns", "exec", &ns, "ip", "link", "set", "lo", "up"]);
        }
        Namespaces(names)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.0 {
            // Deleting the namespace deletes its end of the veth pair, and with it the other.
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// A DNS server for one name on RESOLVER:53, answering its A records (`addrs`, changed as the
/// test goes), its SRV records and their targets' A records, and NXDOMAIN for anything else.
fn resolver(addrs: Arc<Mutex<Vec<Ipv4Addr>>>) {
    let sock = std::net::UdpSocket::bind((RESOLVER, 53)).expect("port 53 of 127.0.0.53 (root)");
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        while let Ok((n, peer)) = sock.recv_from(&mut buf) {
            let q = &buf[..n];
            if n < 12 {
                continue;
            }
            // The question: labels, then type and class.
            let mut i = 12;
            let mut labels = vec![];
            while i < n && q[i] != 0 {
                let l = q[i] as usize;
                if i + 1 + l > n {
                    break;
                }
                labels.push(String::from_utf8_lossy(&q[i + 1..i + 1 + l]).to_lowercase());
                i += 1 + l;
            }
            if i + 5 > n {
                continue;
            }
            let qtype = u16::from_be_bytes([q[i + 1], q[i + 2]]);
            let question = &q[12..i + 5];
            let asked = labels.join(".");
            let now = addrs.lock().unwrap().clone();
            // NAME: the hosts' addresses (A); SRV_NAME: a record per host, `h<i>.NAME` port
            // 3004 (SRV); `h<i>.NAME`: that host's address (A).
            let target = |i: usize| format!("h{i}.{NAME}");
            let mut records: Vec<(u16, Vec<u8>)> = vec![];
            let known = if asked == NAME {
                if qtype == 1 {
                    records.extend(now.iter().map(|a| (1, a.octets().to_vec())));
                }
                true
            } else if asked == SRV_NAME {
                if qtype == 33 {
                    for i in 0..now.len() {
                        let mut rdata = vec![0, 0, 0, 10, 0x0b, 0xbc]; // priority, weight, 3004
                        for l in target(i).split('.') {
                            rdata.push(l.len() as u8);
                            rdata.extend_from_slice(l.as_bytes());
                        }
                        rdata.push(0);
                        records.push((33, rdata));
                    }
                }
                true
            } else if let Some(i) = (0..now.len()).find(|i| target(*i) == asked) {
                if qtype == 1 {
                    records.push((1, now[i].octets().to_vec()));
                }
                true
            } else {
                false
            };
            let mut r = Vec::with_capacity(512);
            r.extend_from_slice(&q[0..2]); // id
            let rcode = if known { 0 } else { 3 };
            r.extend_from_slice(&[0x84 | (q[2] & 0x01), 0x80 | rcode]);
            r.extend_from_slice(&1u16.to_be_bytes());
            r.extend_from_slice(&(records.len() as u16).to_be_bytes());
            r.extend_from_slice(&[0, 0, 0, 0]);
            r.extend_from_slice(question);
            for (t, rdata) in records {
                r.extend_from_slice(&[0xc0, 0x0c]);
                r.extend_from_slice(&t.to_be_bytes());
                r.extend_from_slice(&[0, 1, 0, 0, 0, 1]);
                r.extend_from_slice(&(rdata.len() as u16).to_be_bytes());
                r.extend_from_slice(&rdata);
            }
            let _ = sock.send_to(&r, peer);
        }
    });
}

async fn hosts_up(gw: &Host, want: usize, within: Duration) {
    let t = Instant::now();
    loop {
        let (_, h) = gw.json("GET", "/v1/health", None).await;
        let up = h["hosts"]
            .as_array()
            .map(|a| a.iter().filter(|r| r["takes_sandboxes"] == true).count())
            .unwrap_or(0);
        let total = h["hosts"].as_array().map(Vec::len).unwrap_or(0);
        if up == want && total == want {
            return;
        }
        assert!(t.elapsed() < within, "{want} hosts within {within:?}: {h}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_in_namespaces_behind_two_gateways_found_by_dns() {
    if stock_image_missing() {
        return;
    }
    if !nix_root() {
        assert!(
            std::env::var("SANDBOX_HOST_REQUIRE_E2E").as_deref() != Ok("1"),
            "the fleet test needs root (network namespaces, port 53); CI runs as root"
        );
        eprintln!("skipped: the fleet test needs root (network namespaces, port 53)");
        return;
    }
    let nets = Namespaces::make(3);
    let addrs: Vec<Ipv4Addr> = (0..3).map(|i| Ipv4Addr::new(10, 77, i, 2)).collect();
    let served = Arc::new(Mutex::new(addrs.clone()));
    resolver(served.clone());
    let tmp = tempfile::Builder::new()
        .prefix("sbx-fleet")
        .tempdir_in("/tmp")
        .unwrap();
    let mut hosts = vec![];
    for (i, ns) in nets.0.iter().enumerate() {
        let name = format!("h{i}");
        let bind = addrs[i].to_string();
        let env = [
            ("SANDBOX_HOST_NAME", name.as_str()),
            ("SANDBOX_HOST_BIND", bind.as_str()),
            ("SANDBOX_HOST_PORT", "3004"),
            ("SANDBOX_HOST_MEMORY_LIMIT_MIB", "640"),
        ];
        let state = tmp.path().join(format!("state-{i}"));
        hosts.push(start_in_wrapped(&state, &env, &["ip", "netns", "exec", ns]));
    }
    // The gateways' only resolver is this test's (a mount namespace of their own each).
    let conf = tmp.path().join("resolv.conf");
    std::fs::write(
        &conf,
        format!("nameserver {RESOLVER}\noptions timeout:1 attempts:1\n"),
    )
    .unwrap();
    common::let_service_pass(tmp.path());
    let conf = conf.to_string_lossy().into_owned();
    let wrapper = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "/bin/sh",
        "-c",
        "mount --bind \"$0\" /etc/resolv.conf && exec \"$@\"",
        conf.as_str(),
    ];
    let dns = format!("http://{NAME}:3004");
    let env = [
        ("SANDBOX_HOST_GATEWAY_DNS", dns.as_str()),
        ("SANDBOX_HOST_GATEWAY_POLL_MS", "300"),
    ];
    let mut gw1 = start_gateway_wrapped(&env, &wrapper);
    let gw2 = start_gateway_wrapped(&env, &wrapper);
    // A third finds them by their SRV records (each a name and a port).
    let srv = format!("http://{SRV_NAME}");
    let gw3 = start_gateway_wrapped(
        &[
            ("SANDBOX_HOST_GATEWAY_DNS", srv.as_str()),
            ("SANDBOX_HOST_GATEWAY_POLL_MS", "300"),
        ],
        &wrapper,
    );
    hosts_up(&gw1, 3, Duration::from_secs(30)).await;
    hosts_up(&gw2, 3, Duration::from_secs(30)).await;
    hosts_up(&gw3, 3, Duration::from_secs(30)).await;
    let (_, health) = gw3.json("GET", "/v1/health", None).await;
    let urls: BTreeSet<&str> = health["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|h| h["url"].as_str())
        .collect();
    assert_eq!(
        urls,
        (0..3)
            .map(|i| format!("http://h{i}.{NAME}:3004/"))
            .collect::<BTreeSet<_>>()
            .iter()
            .map(String::as_str)
            .collect(),
        "{health}"
    );

    // Sandboxes spread over the hosts (one's room each).
    let mut ids = vec![];
    for i in 0..3 {
        let (s, v) = gw1
            .json(
                "POST",
                "/v1/sandboxes",
                Some(common::small_run(&format!("run-{i}"))),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        ids.push(v["id"].as_str().unwrap().to_string());
    }
    let placed: BTreeSet<String> = ids
        .iter()
        .map(|i| i.rsplit_once('-').unwrap().1.to_string())
        .collect();
    assert_eq!(placed.len(), 3, "{ids:?}");

    // The other replica serves every sandbox; with the first one killed, it still does.
    gw1.signal("KILL");
    gw1.wait_exit(Duration::from_secs(10));
    for id in &ids {
        let (out, _, last) = gw2.exec(id, "echo served").await;
        assert_eq!(last["exit_code"], 0, "{last}");
        assert_eq!(String::from_utf8_lossy(&out), "served\n");
    }
    let (_, list) = gw2.json("GET", "/v1/sandboxes", None).await;
    assert_eq!(
        list["sandboxes"].as_array().map(Vec::len),
        Some(3),
        "{list}"
    );

    // 1 GiB through the gateway: streamed, the gateway's memory flat. (A file: the stock image's
    // /workspace is memory, so the gigabyte is a sparse file, which an archive carries in 2 KiB,
    // GNU sparse; read as a file it is the whole gigabyte of zeros.)
    let id = &ids[0];
    let (_, _, last) = gw2
        .exec(
            id,
            "mkdir -p /workspace/big && truncate -s 1073741824 /workspace/big/zeros",
        )
        .await;
    assert_eq!(last["exit_code"], 0, "{last}");
    let rss = common::PeakRss::watch(common::service_pid(&gw2));
    let got = stream_len(&gw2.url(&format!(
        "/v1/sandboxes/{id}/files?path=/workspace/big/zeros"
    )))
    .await;
    let (before, peak) = rss.stop();
    eprintln!(
        "1 GiB through the gateway: {got} bytes; gateway RSS {before} KiB before, {peak} KiB at most"
    );
    assert_eq!(got, 1 << 30);
    assert!(
        peak < before + 64 * 1024,
        "the gateway held the stream: {before} KiB -> {peak} KiB"
    );

    // Through the SRV gateway too, a sandbox is served by the host its id names.
    let (out, _, last) = gw3.exec(&ids[1], "echo by-srv").await;
    assert_eq!(last["exit_code"], 0, "{last}");
    assert_eq!(String::from_utf8_lossy(&out), "by-srv\n");

    // A host taken out of the DNS name (and of its SRV records) leaves the gateways' hosts.
    served.lock().unwrap().pop();
    hosts_up(&gw2, 2, Duration::from_secs(30)).await;
    hosts_up(&gw3, 2, Duration::from_secs(30)).await;
    drop(hosts);
}

/// Reads a GET's whole body as it streams, counting it.
async fn stream_len(url: &str) -> u64 {
    use http_body_util::BodyExt;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<hyper::body::Bytes>>();
    let req = hyper::Request::get(url)
        .header("authorization", format!("Bearer {}", common::TOKEN))
        .body(Default::default())
        .unwrap();
    let res = client.request(req).await.unwrap();
    assert_eq!(res.status(), 200);
    let mut body = res.into_body();
    let mut n = 0u64;
    while let Some(f) = body.frame().await {
        if let Ok(d) = f.unwrap().into_data() {
            n += d.len() as u64;
        }
    }
    n
}

fn nix_root() -> bool {
    // SAFETY: geteuid has no arguments.
    unsafe { libc::geteuid() == 0 }
}
