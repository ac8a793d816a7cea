//! 20 sandboxes created, used and deleted concurrently, round after round: every request
//! answered, and nothing left behind (QEMU processes, file descriptors, files, memory back near
//! its start). Two rounds boot every guest (templates off: 40 concurrent cold boots on two
//! cores); ten more restore them from the shape's template, as a service does by default
//! (issue 36: the same load on the create, exec, file and delete paths, at a twelfth of the
//! processor time).

mod common;

use std::time::{Duration, Instant};

use common::{qemu_pids_under, start, state_entries, stock_image_missing};
use serde_json::json;

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Waits until `f` holds (descriptors of closed connections go away asynchronously).
fn settle(mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    f()
}

/// One after the other: two services side by side would be forty TCG guests on two cores.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_sandboxes_at_once_booted_then_from_a_template_nothing_leaks() {
    if stock_image_missing() {
        return;
    }
    rounds(&[("SANDBOX_HOST_TEMPLATES", "off")], 2, "boot").await;
    let template_rounds: usize = std::env::var("SANDBOX_HOST_LOAD_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    rounds(
        &[("SANDBOX_HOST_TEMPLATES", "on")],
        template_rounds,
        "template",
    )
    .await;
}

/// `rounds` rounds of 20 concurrent sandboxes on a service started with `env`, each created
/// from `started_from` (the first of a template service boots, and its template is awaited).
async fn rounds(env: &[(&str, &str)], rounds: usize, started_from: &str) {
    let h = std::sync::Arc::new(start(env));
    let pid = h.child.id();
    // A first sandbox warms up what is allocated once (runtime threads, the HTTP server, and
    // on a template service the template).
    let warm = h.create(json!({"memory_mib": 256})).await;
    h.exec(&warm, "true").await;
    if started_from == "template" {
        h.wait_log("Template ready", Duration::from_secs(300));
    }
    assert_eq!(
        h.req("DELETE", &format!("/v1/sandboxes/{warm}"), vec![], &[])
            .await
            .0,
        204
    );
    std::thread::sleep(Duration::from_millis(500));
    let (fds0, rss0) = (fd_count(pid), rss_kib(pid));

    // Twenty TCG guests on two cores is a tenfold overcommit of an emulated machine. Guest kernels
    // used to panic in early boot here ("IO-APIC + timer doesn't work!", 9 of 620 boots) until
    // the QEMU backend passed `no_timer_check` (0 of 200 since). Should a guest still crash, the
    // host must answer that create with a clear error and leak nothing; every other request must
    // succeed.
    let failed_boots = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    for round in 0..rounds {
        let mut tasks = Vec::new();
        for i in 0..20 {
            let h = h.clone();
            let failed_boots = failed_boots.clone();
            let started_from = started_from.to_string();
            tasks.push(tokio::spawn(async move {
                let body = json!({"run_id": format!("load-{round}-{i}"), "time_limit_ms": 600000, "review": false, "memory_mib": 256, "vcpus": 1});
                let (s, v) = h.json("POST", "/v1/sandboxes", Some(body)).await;
                if s == 500 && v["error"].as_str().is_some_and(|e| e.starts_with("the microVM did not start")) {
                    eprintln!("round {round}: a guest failed to boot: {v}");
                    failed_boots.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    return;
                }
                assert_eq!(s, 201, "{v}");
                assert_eq!(v["started_from"], started_from, "{v}");
                let id = v["id"].as_str().unwrap().to_string();
                let (out, _, last) = h.exec(&id, &format!("echo {round}-{i}")).await;
                assert_eq!(String::from_utf8_lossy(&out), format!("{round}-{i}\n"));
                assert_eq!(last["exit_code"], 0);
                let (s, _) = h.req("PUT", &format!("/v1/sandboxes/{id}/files?path=/workspace/f"), vec![1u8; 10_000], &[]).await;
                assert_eq!(s, 204);
                let (s, b) = h.req("GET", &format!("/v1/sandboxes/{id}/files?path=/workspace/f"), vec![], &[]).await;
                assert_eq!((s, b.len()), (200, 10_000));
                let (s, _) = h.req("DELETE", &format!("/v1/sandboxes/{id}"), vec![], &[]).await;
                assert_eq!(s, 204);
            }));
        }
        for t in tasks {
            t.await.expect("every request of the round is answered");
        }
        let (s, v) = h.json("GET", "/v1/sandboxes", None).await;
        assert_eq!(
            (s, v["sandboxes"].as_array().map(Vec::len)),
            (200, Some(0)),
            "round {round}"
        );
        eprintln!(
            "round {round}: done at {:.1} s, fds {}, rss {} KiB",
            started.elapsed().as_secs_f64(),
            fd_count(pid),
            rss_kib(pid)
        );
    }
    let failed = failed_boots.load(std::sync::atomic::Ordering::SeqCst);
    eprintln!("{failed} of {} boots failed", rounds * 20);
    assert!(
        failed * 50 <= rounds * 20,
        "{failed} of {} boots failed (more than 2%)",
        rounds * 20
    );

    assert!(qemu_pids_under(&h.state).is_empty(), "QEMU processes left");
    assert!(
        state_entries(&h.state).is_empty(),
        "files left: {:?}",
        state_entries(&h.state)
    );
    // The templates directory holds the one template of the one shape, nothing of a sandbox.
    let templates: Vec<_> = std::fs::read_dir(h.state.join("templates"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert_eq!(
        templates.len(),
        usize::from(started_from == "template"),
        "{templates:?}"
    );
    assert!(
        settle(|| fd_count(pid) <= fds0),
        "descriptors: {} at the start, {} now",
        fds0,
        fd_count(pid)
    );
    let rss1 = rss_kib(pid);
    // Allocators keep some freed memory; 200 sandboxes' worth of leaks would be far above this.
    assert!(
        rss1 <= rss0 + 16 * 1024,
        "RSS grew from {rss0} KiB to {rss1} KiB"
    );
    let (_, m) = h.req("GET", "/metrics", vec![], &[]).await;
    let m = String::from_utf8_lossy(&m);
    let booted = rounds * 20 + 1 - failed;
    assert!(
        m.contains(&format!("sandbox_host_boots_total {booted}")),
        "{m}"
    );
    let restored = if started_from == "template" {
        rounds * 20 - failed
    } else {
        0
    };
    assert!(
        m.contains(&format!("sandbox_host_template_restores_total {restored}")),
        "{m}"
    );
    assert!(
        m.contains(&format!("sandbox_host_boot_failures_total {failed}")),
        "{m}"
    );
    assert!(
        m.contains(&format!(
            "sandbox_host_disposals_total{{reason=\"deleted\"}} {booted}"
        )),
        "{m}"
    );
}
