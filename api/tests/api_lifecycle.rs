//! Lifecycle on the real binary: idle and time-limit disposal, keepalive, a VM that dies, a guest
//! that stops answering, SIGTERM disposing of everything. A restart is `api_restart.rs`.

mod common;

use std::time::{Duration, Instant};

use common::{qemu_pids_under, start, state_entries, stock_image_missing};
use serde_json::json;

async fn wait_gone(h: &common::Host, id: &str, within: Duration) {
    let t = Instant::now();
    loop {
        let (s, _) = h
            .json("GET", &format!("/v1/sandboxes/{id}?peek"), None)
            .await;
        if s == 404 {
            return;
        }
        assert!(
            t.elapsed() < within,
            "sandbox {id} was not disposed of within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_time_limit_disposal_and_keepalive() {
    if stock_image_missing() {
        return;
    }
    // The idle limit is longer than a boot under emulation, so creating the others cannot idle
    // out the first.
    let h = start(&[
        ("SANDBOX_HOST_IDLE_MS", "6000"),
        ("SANDBOX_HOST_GRACE_MS", "500"),
        ("SANDBOX_HOST_SWEEP_MS", "200"),
    ]);
    let (idle, kept, limited) = tokio::join!(
        h.create(json!({"run_id": "idle"})),
        h.create(json!({"run_id": "kept"})),
        h.create(json!({"run_id": "limited", "time_limit_ms": 1000})),
    );

    // `kept` gets a keepalive every 500 ms for 9 s; `idle` gets nothing; `limited` runs out of
    // its time limit.
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(9) {
        let (s, _) = h
            .req(
                "POST",
                &format!("/v1/sandboxes/{kept}/keepalive"),
                vec![],
                &[],
            )
            .await;
        assert_eq!(s, 204);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    wait_gone(&h, &idle, Duration::from_secs(10)).await;
    wait_gone(&h, &limited, Duration::from_secs(10)).await;
    let (s, v) = h.json("GET", &format!("/v1/sandboxes/{kept}"), None).await;
    assert_eq!((s, v["state"].as_str()), (200, Some("ready")), "{v}");

    // A long exec is activity: the sandbox is not idle while it runs.
    let (out, _, last) = h.exec(&kept, "sleep 3; echo finished").await;
    assert_eq!(
        (out.as_slice(), last["exit_code"].as_i64()),
        (&b"finished\n"[..], Some(0))
    );

    let (_, m) = h.req("GET", "/metrics", vec![], &[]).await;
    let m = String::from_utf8_lossy(&m);
    assert!(
        m.contains("sandbox_host_disposals_total{reason=\"idle\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("sandbox_host_disposals_total{reason=\"time_limit\"} 1"),
        "{m}"
    );
    let log = h.wait_log("\"reason\":\"idle\"", Duration::from_secs(1));
    assert_eq!(log["message"], "Disposed of sandbox");
    assert_eq!(log["run_id"], "idle");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_vm_answers_with_its_reason_and_is_swept() {
    if stock_image_missing() {
        return;
    }
    let h = start(&[("SANDBOX_HOST_SWEEP_MS", "1000")]);
    let id = h.create(json!({})).await;
    let pids = qemu_pids_under(&h.state);
    assert_eq!(pids.len(), 1);
    std::process::Command::new("kill")
        .args(["-KILL", &pids[0].to_string()])
        .status()
        .unwrap();
    // Before the sweep: every route says why.
    let t = Instant::now();
    let v = loop {
        let (s, v) = h
            .json(
                "POST",
                &format!("/v1/sandboxes/{id}/exec"),
                Some(json!({"command": "true"})),
            )
            .await;
        if s == 410 {
            break v;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "{s} {v}");
    };
    assert_eq!(v["code"], "vm_died");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("QEMU was killed by signal 9"),
        "{v}"
    );
    wait_gone(&h, &id, Duration::from_secs(10)).await;
    // Its files go right after it leaves the list (the disposal's last step), within a bound.
    let t = Instant::now();
    while !state_entries(&h.state).is_empty() && t.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        state_entries(&h.state).is_empty(),
        "{:?}",
        state_entries(&h.state)
    );
}

/// Puts the freezer into a sandbox and freezes its agent (see tests/guest/freeze.c).
async fn freeze_agent(h: &common::Host, id: &str, freeze: &[u8]) {
    let (s, b) = h
        .req(
            "PUT",
            &format!("/v1/sandboxes/{id}/files?path=/freeze"),
            freeze.to_vec(),
            &[],
        )
        .await;
    assert_eq!(s, 204, "{}", String::from_utf8_lossy(&b));
    let (out, err, last) = h
        .exec(id, "chmod 755 /freeze && /freeze stop-agent && echo frozen")
        .await;
    assert_eq!(out, b"frozen\n", "{} {last}", String::from_utf8_lossy(&err));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_stops_answering_is_killed_swept_and_deleted_quickly() {
    if stock_image_missing() {
        return;
    }
    let Some(freeze) = sandbox_e2e::freeze_binary() else {
        return;
    };
    let h = start(&[
        ("SANDBOX_HOST_UNRESPONSIVE_MS", "4000"),
        ("SANDBOX_HOST_SWEEP_MS", "1000"),
    ]);
    let (swept, deleted) = tokio::join!(
        h.create(json!({"run_id": "frozen-swept"})),
        h.create(json!({"run_id": "frozen-deleted"})),
    );

    // DELETE of a frozen guest: the agent cannot help, the host stops the VM by itself.
    freeze_agent(&h, &deleted, freeze).await;
    let t = Instant::now();
    let (s, _) = h
        .req("DELETE", &format!("/v1/sandboxes/{deleted}"), vec![], &[])
        .await;
    eprintln!("DELETE of a frozen sandbox: {s} after {:.1?}", t.elapsed());
    assert_eq!(s, 204);

    // An exec without a timeout on a guest that freezes ends with the reason, not a hang.
    freeze_agent(&h, &swept, freeze).await;
    let t = Instant::now();
    let (out, _, last) = h.exec(&swept, "sleep 1; echo never").await;
    eprintln!(
        "exec on a frozen sandbox ended after {:.1?}: {last}",
        t.elapsed()
    );
    assert!(out.is_empty());
    assert_eq!(last["code"], "vm_died", "{last}");
    assert!(
        last["error"]
            .as_str()
            .unwrap()
            .contains("the guest stopped answering"),
        "{last}"
    );
    let (s, v) = h
        .json("GET", &format!("/v1/sandboxes/{swept}?peek"), None)
        .await;
    assert!(s == 404 || v["state"] == "dead", "{s} {v}");
    wait_gone(&h, &swept, Duration::from_secs(10)).await;
    let (_, m) = h.req("GET", "/metrics", vec![], &[]).await;
    let m = String::from_utf8_lossy(&m);
    assert!(
        m.contains("sandbox_host_disposals_total{reason=\"vm_died\"} 1"),
        "{m}"
    );
    assert!(state_entries(&h.state).is_empty());
    assert!(qemu_pids_under(&h.state).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_disposes_of_every_sandbox() {
    if stock_image_missing() {
        return;
    }
    let mut h = start(&[]);
    for _ in 0..2 {
        h.create(json!({})).await;
    }
    assert_eq!(qemu_pids_under(&h.state).len(), 2);
    h.signal("TERM");
    assert_eq!(h.wait_exit(Duration::from_secs(60)), Some(0));
    assert!(qemu_pids_under(&h.state).is_empty());
    assert!(
        state_entries(&h.state).is_empty(),
        "{:?}",
        state_entries(&h.state)
    );
    let logs = h.logs.lock().unwrap().join("\n");
    assert!(logs.contains("\"disposed\":2"), "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_beyond_the_memory_limit_get_503_until_one_ends() {
    if stock_image_missing() {
        return;
    }
    // Two sandboxes of 256 MiB, each with its 96 MiB of egress memory and its network process's
    // 32 MiB, fit; a third does not.
    let h = start(&[("SANDBOX_HOST_MEMORY_LIMIT_MIB", "800")]);
    let (a, _b) = tokio::join!(h.create(json!({})), h.create(json!({})));
    let (s, v) = h
        .json(
            "POST",
            "/v1/sandboxes",
            Some(json!({"run_id": "third", "time_limit_ms": 60000, "review": false, "memory_mib": 256, "vcpus": 1})),
        )
        .await;
    assert_eq!((s, v["code"].as_str()), (503, Some("no_capacity")), "{v}");
    let why = v["error"].as_str().unwrap();
    assert!(
        why.contains("768 MiB of SANDBOX_HOST_MEMORY_LIMIT_MIB=800")
            && why.contains("128 MiB for its network")
            && why.contains("Retry"),
        "{why}"
    );
    let (_, health) = h.json("GET", "/v1/health", None).await;
    assert_eq!(
        health["capacity"]["memory_mib"]["committed"], 768,
        "{health}"
    );
    assert_eq!(health["capacity"]["memory_mib"]["limit"], 800, "{health}");
    assert!(health["capacity"]["fds"]["limit"].as_u64().unwrap() >= 1024);
    let (_, m) = h.req("GET", "/metrics", vec![], &[]).await;
    let m = String::from_utf8_lossy(&m);
    assert!(m.contains("sandbox_host_capacity_refusals_total 1"), "{m}");
    assert!(
        m.contains("sandbox_host_memory_mib{kind=\"committed\"} 768"),
        "{m}"
    );
    // Deleting one lets the next in.
    let (s, _) = h
        .req("DELETE", &format!("/v1/sandboxes/{a}"), vec![], &[])
        .await;
    assert_eq!(s, 204);
    h.create(json!({"run_id": "third"})).await;
    let (_, health) = h.json("GET", "/v1/health", None).await;
    assert_eq!(
        health["capacity"]["memory_mib"]["committed"], 768,
        "{health}"
    );
}

/// A guest that pushes its VM process past its cgroup's memory limit: that sandbox alone dies,
/// with the reason, while another keeps answering execs during and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_past_its_memory_limit_dies_alone() {
    if stock_image_missing() {
        return;
    }
    // No allowance: the limit is the guest's own memory, which QEMU's own pages plus the guest's
    // reach long before the guest runs out (QEMU under TCG holds some 200 MiB of its own).
    let h = start(&[("SANDBOX_HOST_VMM_ALLOWANCE_MIB", "0")]);
    // The jail is the host's own (a gateway's health has no jail).
    let (_, health) = h.service_json("GET", "/v1/health").await;
    if health["jail"]["cgroup"].is_null() {
        assert!(
            std::env::var_os("SANDBOX_HOST_REQUIRE_E2E").is_none(),
            "no cgroup on this host: {health}"
        );
        eprintln!("skipped: no cgroup on this host ({health})");
        return;
    }
    let survivor = h.create(json!({"memory_mib": 512})).await;
    let victim = h.create(json!({"memory_mib": 512})).await;
    // tmpfs pages stay in guest memory: each one written is a page of the VM process.
    let fill_path = format!("/v1/sandboxes/{victim}/exec");
    let fill = h.json(
        "POST",
        &fill_path,
        Some(json!({"command": "mkdir -p /mnt/fill && mount -t tmpfs -o size=2g fill /mnt/fill && dd if=/dev/zero of=/mnt/fill/f bs=1M count=480"})),
    );
    // The survivor answers while the victim fills and dies.
    let watch = async {
        let t = Instant::now();
        let mut answered = 0;
        loop {
            let (out, _, end) = h.exec(&survivor, "echo alive").await;
            assert_eq!(
                (out.as_slice(), end["exit_code"].as_i64()),
                (&b"alive\n"[..], Some(0))
            );
            answered += 1;
            let (s, v) = h
                .json("GET", &format!("/v1/sandboxes/{victim}"), None)
                .await;
            if s == 410 || v["state"] == "dead" {
                return (answered, v);
            }
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "the victim never died: {v}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let (_, (answered, reason)) = tokio::join!(fill, watch);
    let (s, v) = h
        .json(
            "POST",
            &format!("/v1/sandboxes/{victim}/exec"),
            Some(json!({"command": "true"})),
        )
        .await;
    assert_eq!(
        (s, v["code"].as_str()),
        (410, Some("vm_died")),
        "{v} {reason}"
    );
    assert!(
        v["error"].as_str().unwrap().contains("out of memory"),
        "the reason must say out of memory: {v}"
    );
    // After: still answering.
    let (out, _, _) = h.exec(&survivor, "echo still").await;
    assert_eq!(out, b"still\n");
    assert!(answered >= 1);
}
