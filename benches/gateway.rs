//! A fleet's gateway (issue 33): what passing through `sandbox-host gateway` costs, measured
//! against the same host asked directly, interleaved request by request on one sandbox: an exec
//! of `true` round trip (the goal: under 1 ms added), and the throughput of a 64 MiB archive read
//! (the goal: within 5 %). Both the host and the gateway are release builds of this workspace
//! (`cargo build --release -p sandbox-host`, or `SANDBOX_HOST_BIN`); the guest is the stock
//! image on the backend the host selects. `BENCH_RUNS` sets the runs (default 30 execs, a fifth
//! as many archives).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use sandbox_benches::{header, row, stats};
use serde_json::{Value, json};

const TOKEN: &str = "bench-token-0123456789abcdef-0123";

type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
>;

fn binary() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("SANDBOX_HOST_BIN") {
        return Some(p.into());
    }
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("sandbox-host");
    p.is_file().then_some(p)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `sandbox-host ARG` with `env`, and waits for its `Listening on` line.
fn start(bin: &std::path::Path, arg: &str, env: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(bin);
    cmd.arg(arg)
        .env("SANDBOX_HOST_TOKEN", TOKEN)
        .env("SANDBOX_HOST_DOTENV", "/nonexistent/.env")
        .env("SANDBOX_HOST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("the sandbox-host binary starts");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap_or_default();
        if line.contains("Listening on") {
            break;
        }
    }
    // The rest of its log is read and dropped, so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    child
}

async fn call(client: &Client, method: &str, url: &str, body: Option<Value>) -> (u16, Bytes) {
    let req = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .unwrap();
    let res = client.request(req).await.unwrap();
    let status = res.status().as_u16();
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    (status, bytes)
}

#[tokio::main]
async fn main() {
    let Some(bin) = binary() else {
        println!(
            "skipped: no release sandbox-host beside this bench; run `cargo build --release -p \
             sandbox-host` (or set SANDBOX_HOST_BIN)"
        );
        return;
    };
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let tmp = tempfile::tempdir().unwrap();
    let (host_port, gw_port) = (free_port(), free_port());
    let mut host = start(
        &bin,
        "serve",
        &[
            ("SANDBOX_HOST_NAME", "bench".into()),
            ("SANDBOX_HOST_PORT", host_port.to_string()),
            (
                "SANDBOX_HOST_STATE_DIR",
                tmp.path().join("state").display().to_string(),
            ),
            ("SANDBOX_HOST_TEMPLATES", "off".into()),
        ],
    );
    let mut gateway = start(
        &bin,
        "gateway",
        &[
            ("SANDBOX_HOST_PORT", gw_port.to_string()),
            (
                "SANDBOX_HOST_GATEWAY_HOSTS",
                format!("bench=http://127.0.0.1:{host_port}"),
            ),
        ],
    );
    let client: Client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let direct = format!("http://127.0.0.1:{host_port}");
    let through = format!("http://127.0.0.1:{gw_port}");
    let (s, b) = call(
        &client,
        "POST",
        &format!("{through}/v1/sandboxes"),
        Some(
            json!({"run_id": "bench", "time_limit_ms": 3_600_000, "review": false,
                    "memory_mib": 512, "vcpus": 1, "image": "stock"}),
        ),
    )
    .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let id = serde_json::from_slice::<Value>(&b).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let exec = |base: &str| format!("{base}/v1/sandboxes/{id}/exec");
    // Warm both paths (connections, the agent's first exec).
    for base in [&direct, &through] {
        call(
            &client,
            "POST",
            &exec(base),
            Some(json!({"argv": ["true"]})),
        )
        .await;
    }
    let (mut d, mut g) = (vec![], vec![]);
    for _ in 0..runs {
        for (base, out) in [(&direct, &mut d), (&through, &mut g)] {
            let t = Instant::now();
            let (s, _) = call(
                &client,
                "POST",
                &exec(base),
                Some(json!({"argv": ["true"]})),
            )
            .await;
            out.push(t.elapsed());
            assert_eq!(s, 200);
        }
    }
    // 64 MiB of data in the guest (not sparse: an archive would carry a sparse file in a header).
    let (s, _) = call(
        &client,
        "POST",
        &exec(&direct),
        Some(json!({"command": "mkdir -p /workspace/a && head -c 67108864 /dev/urandom > /workspace/a/f"})),
    )
    .await;
    assert_eq!(s, 200);
    let archive = |base: &str| format!("{base}/v1/sandboxes/{id}/archive?path=/workspace/a");
    let (mut ad, mut ag) = (vec![], vec![]);
    let mut size = 0;
    for _ in 0..(runs / 5).max(3) {
        for (base, out) in [(&direct, &mut ad), (&through, &mut ag)] {
            let t = Instant::now();
            let (s, body) = call(&client, "GET", &archive(base), None).await;
            out.push(t.elapsed());
            assert_eq!(s, 200);
            size = body.len();
        }
    }
    call(
        &client,
        "DELETE",
        &format!("{through}/v1/sandboxes/{id}"),
        None,
    )
    .await;
    let _ = gateway.kill();
    let _ = host.kill();
    let _ = (gateway.wait(), host.wait());

    println!("\nA sandbox asked directly and through a gateway, interleaved, same sandbox\n");
    header();
    let (dm, _) = stats(&d);
    row("exec `true` round trip, direct (reference)", &d, None);
    row("exec `true` round trip, through the gateway", &g, Some(dm));
    let (adm, _) = stats(&ad);
    row(
        &format!("archive of {} MiB, direct (reference)", size >> 20),
        &ad,
        None,
    );
    row(
        &format!("archive of {} MiB, through the gateway", size >> 20),
        &ag,
        Some(adm),
    );
    let (gm, _) = stats(&g);
    let (agm, _) = stats(&ag);
    let mbps = |ms: f64| size as f64 / (1 << 20) as f64 / (ms / 1000.0);
    println!(
        "\nadded by the gateway: exec {:.2} ms (median); archive throughput {:.0} MiB/s direct, {:.0} MiB/s through ({:+.1} %)",
        gm - dm,
        mbps(adm),
        mbps(agm),
        (mbps(agm) / mbps(adm) - 1.0) * 100.0
    );
}
