//! A service that restarts without losing runs (issue 32), on the real binary with real guests:
//! `kill -9` of the service, and its hand-over (SIGUSR2), leave each sandbox running (its VM,
//! its network process, its open connections, the commands in it) for the next service on the
//! same state directory, which takes it on again with its run, counters and refusals; a paused
//! sandbox (KVM) is kept paused and resumes; and a sandbox whose VM died while no service was
//! there leaves nothing behind.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{instance_pids, qemu_pids_under, start_in, state_entries, stock_image_missing};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// An HTTP server on loopback (the egress carries HTTP and TLS, nothing else): `GET /stream`
/// is answered with a chunked body that never ends, a line `tick` every 300 ms (a connection that
/// stays open across a restart); any other request with `again`.
async fn http_server() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut b = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut b).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&b[..n]),
                    }
                }
                if !head.starts_with(b"GET /stream ") {
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\nconnection: close\r\n\r\nagain\n")
                        .await;
                    return;
                }
                let ok = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
                if s.write_all(ok).await.is_err() {
                    return;
                }
                while s.write_all(b"5\r\ntick\n\r\n").await.is_ok() {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            });
        }
    });
    port
}

async fn sandbox(h: &common::Host, id: &str) -> Value {
    let (s, v) = h.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, 200, "{v}");
    v
}

async fn refusals(h: &common::Host, id: &str) -> u64 {
    let (s, v) = h
        .json("GET", &format!("/v1/sandboxes/{id}/egress"), None)
        .await;
    assert_eq!(s, 200, "{v}");
    v["by_reason"]["name_not_allowed"].as_u64().unwrap_or(0)
}

/// Runs `command` in the guest and returns its stdout, checking that it exited with 0.
async fn run(h: &common::Host, id: &str, command: &str) -> String {
    let (out, err, last) = h.exec(id, command).await;
    assert_eq!(
        last["exit_code"],
        0,
        "`{command}`: {last} {}",
        String::from_utf8_lossy(&err)
    );
    String::from_utf8_lossy(&out).into_owned()
}

/// Starts an exec of `command` and reads its stream until it ends or is cut (the service went
/// away): what came before either.
async fn open_exec(url: &str, command: &str) -> Vec<u8> {
    use http_body_util::{BodyExt, Full};
    use hyper::body::Bytes;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let req = hyper::Request::builder()
        .method("POST")
        .uri(url)
        .header("authorization", format!("Bearer {}", common::TOKEN))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            json!({ "command": command }).to_string(),
        )))
        .unwrap();
    let mut body = client.request(req).await.unwrap().into_body();
    let mut got = Vec::new();
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(d) = frame.data_ref() {
            got.extend_from_slice(d);
        }
    }
    got
}

/// The whole lines of an NDJSON body that may have been cut.
fn whole_lines(body: &[u8]) -> Vec<Value> {
    let end = body.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    body[..end]
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect()
}

/// The lines the guest's long-lived connection has carried so far.
async fn echoed(h: &common::Host, id: &str) -> usize {
    let (out, _, _) = h.exec(id, "grep -c tick /workspace/echoed").await;
    String::from_utf8_lossy(&out).trim().parse().unwrap_or(0)
}

async fn wait_for(what: &str, within: Duration, mut ok: impl AsyncFnMut() -> bool) {
    let t = Instant::now();
    while !ok().await {
        assert!(t.elapsed() < within, "{what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// What a restart must keep, made in a sandbox of `h`: a file, a background process, a
/// connection to an allowed host that stays open, a refusal, and an exec stream left open.
/// Returns the exec's task, which ends when the service goes.
async fn make_a_run(h: &common::Host, id: &str, port: u16) -> tokio::task::JoinHandle<Vec<u8>> {
    run(h, id, "echo kept > /workspace/file").await;
    run(
        h,
        id,
        "setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $! > /workspace/bg.pid",
    )
    .await;
    run(
        h,
        id,
        &format!(
            "setsid sh -c '(printf \"GET /stream HTTP/1.1\\r\\nHost: echo.test:{port}\\r\\n\\r\\n\"; sleep 100000) | nc echo.test {port} > /workspace/echoed' </dev/null >/dev/null 2>&1 &"
        ),
    )
    .await;
    let id2 = id.to_string();
    // A refused name, counted by the network process.
    let (_, _, last) = h.exec(id, "nc -w 3 other.test 80 </dev/null").await;
    assert_ne!(last["exit_code"], 0, "{last}");
    assert!(refusals(h, id).await >= 1);
    let url = h.url(&format!("/v1/sandboxes/{id2}/exec"));
    let open =
        tokio::spawn(async move { open_exec(&url, "sleep 4; echo done > /workspace/after").await });
    wait_for(
        "the connection's first lines",
        Duration::from_secs(30),
        async || echoed(h, id).await >= 2,
    )
    .await;
    open
}

/// What the next service must show of the run `make_a_run` made.
async fn check_the_run_is_kept(
    h: &common::Host,
    id: &str,
    port: u16,
    before: &Value,
    refused: u64,
) {
    let now = sandbox(h, id).await;
    for k in ["id", "run_id", "created_at", "expires_at", "image"] {
        assert_eq!(now[k], before[k], "{k}: {now} against {before}");
    }
    assert!(now["execs"].as_u64() >= before["execs"].as_u64(), "{now}");
    let (s, list) = h.json("GET", "/v1/sandboxes", None).await;
    assert_eq!(s, 200);
    assert!(
        list["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["id"] == id),
        "{list}"
    );
    assert_eq!(run(h, id, "cat /workspace/file").await, "kept\n");
    run(h, id, "kill -0 $(cat /workspace/bg.pid)").await;
    // The command whose stream was open when the service went ran on to its end.
    wait_for(
        "the open command's end",
        Duration::from_secs(20),
        async || h.exec(id, "cat /workspace/after").await.2["exit_code"] == 0,
    )
    .await;
    // The connection made before the restart still carries lines, and a new one works.
    let n = echoed(h, id).await;
    wait_for(
        "more lines on the old connection",
        Duration::from_secs(20),
        async || echoed(h, id).await > n,
    )
    .await;
    let once = run(
        h,
        id,
        &format!(
            "printf 'GET /once HTTP/1.1\\r\\nHost: echo.test:{port}\\r\\nConnection: close\\r\\n\\r\\n' | nc -w 5 echo.test {port}"
        ),
    )
    .await;
    assert!(once.ends_with("\r\n\r\nagain\n"), "{once:?}");
    assert!(refusals(h, id).await >= refused, "refusals kept");
}

/// Deletes the sandbox and checks nothing of it is left.
async fn delete_and_check_nothing_left(h: &common::Host, id: &str, state: &Path) {
    let (s, v) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, 204, "{v}");
    assert!(qemu_pids_under(state).is_empty());
    wait_for("the processes' end", Duration::from_secs(10), async || {
        instance_pids(state).is_empty()
    })
    .await;
    assert!(
        state_entries(state).is_empty(),
        "{:?}",
        state_entries(state)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_of_the_service_keeps_every_run() {
    if stock_image_missing() {
        return;
    }
    let port = http_server().await;
    let resolve = format!("echo.test:{port}:127.0.0.1");
    let env = [("SANDBOX_HOST_EGRESS_RESOLVE", resolve.as_str())];
    let tmp = tempfile::Builder::new()
        .prefix("sbx-restart")
        .tempdir_in("/tmp")
        .unwrap();
    let state = tmp.path().join("state");
    let mut h = start_in(&state, &env);
    let id = h
        .create(json!({"run_id": "run-kept", "egress": {"allow": ["echo.test"]}}))
        .await;
    let open = make_a_run(&h, &id, port).await;
    let before = sandbox(&h, &id).await;
    let refused = refusals(&h, &id).await;
    // The record keeps up with the counters within a second (`RECORD_EVERY`).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    h.signal("KILL");
    h.wait_exit(Duration::from_secs(10));
    // The open exec's client saw its stream cut, with no exit line: not a failed command.
    let cut = whole_lines(&open.await.unwrap());
    assert!(cut.iter().all(|l| l.get("exit_code").is_none()), "{cut:?}");
    assert_eq!(
        qemu_pids_under(&state).len(),
        1,
        "the VM outlived the service"
    );
    let h2 = start_in(&state, &env);
    let line = h2.wait_log("taken on again, or disposed of", Duration::from_secs(30));
    assert_eq!(
        (line["adopted"].as_u64(), line["disposed"].as_u64()),
        (Some(1), Some(0)),
        "{line}"
    );
    check_the_run_is_kept(&h2, &id, port, &before, refused).await;
    delete_and_check_nothing_left(&h2, &id, &state).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_keeps_every_run() {
    if stock_image_missing() {
        return;
    }
    let port = http_server().await;
    let resolve = format!("echo.test:{port}:127.0.0.1");
    let env = [("SANDBOX_HOST_EGRESS_RESOLVE", resolve.as_str())];
    let tmp = tempfile::Builder::new()
        .prefix("sbx-handover")
        .tempdir_in("/tmp")
        .unwrap();
    let state = tmp.path().join("state");
    let mut h = start_in(&state, &env);
    let id = h
        .create(json!({"run_id": "run-handed", "egress": {"allow": ["echo.test"]}}))
        .await;
    let open = make_a_run(&h, &id, port).await;
    let before = sandbox(&h, &id).await;
    let refused = refusals(&h, &id).await;
    h.signal("USR2");
    assert_eq!(
        h.wait_exit(Duration::from_secs(30)),
        Some(75),
        "the hand-over's status"
    );
    let line = h.wait_log("Handed over", Duration::from_secs(1));
    assert_eq!(
        (line["kept"].as_u64(), line["disposed"].as_u64()),
        (Some(1), Some(0)),
        "{line}"
    );
    // The open exec's client was told, in a line of its own, that the host is handing over.
    let cut = whole_lines(&open.await.unwrap());
    assert!(cut.iter().all(|l| l.get("exit_code").is_none()), "{cut:?}");
    assert_eq!(
        cut.last().map(|l| l["code"].clone()),
        Some(json!("host_restarting")),
        "{cut:?}"
    );
    let h2 = start_in(&state, &env);
    h2.wait_log("taken on again, or disposed of", Duration::from_secs(30));
    check_the_run_is_kept(&h2, &id, port, &before, refused).await;
    delete_and_check_nothing_left(&h2, &id, &state).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_whose_vm_died_while_the_service_was_down_leaves_nothing() {
    if stock_image_missing() {
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("sbx-restart")
        .tempdir_in("/tmp")
        .unwrap();
    let state = tmp.path().join("state");
    let mut h = start_in(&state, &[]);
    let id = h.create(json!({})).await;
    h.signal("KILL");
    h.wait_exit(Duration::from_secs(10));
    let qemu = qemu_pids_under(&state);
    assert_eq!(qemu.len(), 1);
    assert!(
        instance_pids(&state).len() >= 2,
        "the VM and its network process"
    );
    // SAFETY: kill has no memory arguments.
    unsafe { libc::kill(qemu[0] as i32, libc::SIGKILL) };
    wait_for("QEMU's end", Duration::from_secs(10), async || {
        qemu_pids_under(&state).is_empty()
    })
    .await;
    let h2 = start_in(&state, &[]);
    let line = h2.wait_log("could not be taken on again", Duration::from_secs(30));
    assert_eq!(line["id"], id.as_str(), "{line}");
    wait_for(
        "the network process's end",
        Duration::from_secs(10),
        async || instance_pids(&state).is_empty(),
    )
    .await;
    let (s, v) = h2.json("GET", "/v1/sandboxes", None).await;
    assert_eq!((s, v["sandboxes"].as_array().map(Vec::len)), (200, Some(0)));
    assert!(
        state_entries(&state).is_empty(),
        "{:?}",
        state_entries(&state)
    );
    // Its cgroups too, where this host makes them.
    let health = h2.json("GET", "/v1/health", None).await.1;
    if !health["jail"]["cgroup"].is_null() {
        let groups = std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
            .any(|c| {
                let inst = c.path().join("sandbox-host");
                std::fs::read_dir(inst)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .any(|i| {
                        std::fs::read_dir(i.path())
                            .into_iter()
                            .flatten()
                            .flatten()
                            .any(|g| g.file_name().to_string_lossy().contains(&id))
                    })
            });
        assert!(!groups, "a cgroup of {id} is left");
    }
}

/// Pauses or resumes `id`, and says the state it answered with.
async fn pause_or_resume(h: &common::Host, id: &str, what: &str) -> String {
    let (s, v) = h
        .json("POST", &format!("/v1/sandboxes/{id}/{what}"), None)
        .await;
    assert_eq!(s, 200, "{what}: {v}");
    v["state"].as_str().unwrap_or_default().to_string()
}

/// A paused sandbox survives a crash and a hand-over of the service paused, and resumes with its
/// files and processes; a sandbox taken on again (running) can be paused and resumed, from the
/// snapshot set its first service left it on. Only a backend that pauses (KVM): where this
/// machine's /dev/kvm cannot boot Linux, `nested_kvm.rs` runs this test in the nested test host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sandbox_stays_paused_across_restarts_and_resumes() {
    if stock_image_missing() {
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("sbx-paused")
        .tempdir_in("/tmp")
        .unwrap();
    let state = tmp.path().join("state");
    let mut h = start_in(&state, &[]);
    let (_, health) = h.json("GET", "/v1/health", None).await;
    if health["backend"] != "kvm" {
        assert!(
            std::env::var("SANDBOX_HOST_IN_NESTED").as_deref() != Ok("1"),
            "the nested host runs the KVM backend: {health}"
        );
        eprintln!(
            "skipped: pausing needs the KVM backend, and this host runs {} (nested_kvm runs \
             this test in the nested test host)",
            health["backend"]
        );
        return;
    }
    let id = h.create(json!({"run_id": "run-paused"})).await;
    run(&h, &id, "echo kept > /workspace/file").await;
    run(
        &h,
        &id,
        "setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $! > /workspace/bg.pid",
    )
    .await;
    let before = sandbox(&h, &id).await;
    assert_eq!(pause_or_resume(&h, &id, "pause").await, "paused");

    // A crash while it is paused: the next service has it, paused.
    h.signal("KILL");
    h.wait_exit(Duration::from_secs(10));
    let mut h2 = start_in(&state, &[]);
    let line = h2.wait_log("taken on again, or disposed of", Duration::from_secs(60));
    if line["adopted"] != 1 {
        let why = h2.wait_log("could not be taken on again", Duration::from_secs(1));
        panic!("the paused sandbox was not taken on again: {why}");
    }
    let now = sandbox(&h2, &id).await;
    assert_eq!(now["state"], "paused", "{now}");
    for k in ["run_id", "created_at", "expires_at", "image"] {
        assert_eq!(now[k], before[k], "{k}: {now} against {before}");
    }
    assert_eq!(pause_or_resume(&h2, &id, "resume").await, "ready");
    assert_eq!(run(&h2, &id, "cat /workspace/file").await, "kept\n");
    run(&h2, &id, "kill -0 $(cat /workspace/bg.pid)").await;

    // Paused again by the service that took it on (the other snapshot set), then handed over.
    run(&h2, &id, "echo again >> /workspace/file").await;
    assert_eq!(pause_or_resume(&h2, &id, "pause").await, "paused");
    h2.signal("USR2");
    assert_eq!(h2.wait_exit(Duration::from_secs(30)), Some(75));
    let line = h2.wait_log("Handed over", Duration::from_secs(1));
    assert_eq!(
        (line["kept"].as_u64(), line["disposed"].as_u64()),
        (Some(1), Some(0)),
        "{line}"
    );
    let mut h3 = start_in(&state, &[]);
    h3.wait_log("taken on again, or disposed of", Duration::from_secs(60));
    assert_eq!(sandbox(&h3, &id).await["state"], "paused");
    assert_eq!(pause_or_resume(&h3, &id, "resume").await, "ready");
    assert_eq!(run(&h3, &id, "cat /workspace/file").await, "kept\nagain\n");
    run(&h3, &id, "kill -0 $(cat /workspace/bg.pid)").await;

    // A crash while it runs: the next service takes its VM on, and can pause and resume it.
    run(&h3, &id, "echo third >> /workspace/file").await;
    h3.signal("KILL");
    h3.wait_exit(Duration::from_secs(10));
    let h4 = start_in(&state, &[]);
    h4.wait_log("taken on again, or disposed of", Duration::from_secs(60));
    assert_eq!(sandbox(&h4, &id).await["state"], "ready");
    assert_eq!(pause_or_resume(&h4, &id, "pause").await, "paused");
    assert_eq!(pause_or_resume(&h4, &id, "resume").await, "ready");
    assert_eq!(
        run(&h4, &id, "cat /workspace/file").await,
        "kept\nagain\nthird\n"
    );
    run(&h4, &id, "kill -0 $(cat /workspace/bg.pid)").await;
    delete_and_check_nothing_left(&h4, &id, &state).await;
}
