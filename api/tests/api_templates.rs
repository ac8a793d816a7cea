//! Templates through the service (issue 15). On the KVM backend the first sandbox of a shape
//! boots and its template is built beside it; the next ones are restored from it and work as a
//! booted sandbox does: exec, files, the network (an allowed name reached, a refused address
//! counted), each with its own random bytes and the host's clock. A template whose memory file
//! is damaged is discarded and the create boots cold. On QEMU the same holds with QEMU's
//! migration to a file as the snapshot (pause stays the KVM backend's). The guest
//! image's clones (when this machine has the image) run Python, call a fake provider through
//! interception, and take an archive and disk writes.
//!
//! The two KVM parts (the stock image's templates, and the guest image's clones) run where this
//! machine's /dev/kvm boots Linux, else each inside a nested test host of its own
//! (`tests/nested/run.sh`), this binary and the service's two programs taken along: each nested
//! host has one emulated processor, so the two side by side use both of this machine's, and
//! each boots about a dozen guests, half of what wedges one (tests/nested/README.md, "Wedged").

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{start, stock_image_missing};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A plain HTTP server on loopback answering every request with `body`.
async fn http_server(body: &'static str) -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = s.read(&mut buf).await;
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    port
}

/// On QEMU a template is QEMU's migration to a file: the first sandbox of a shape boots, the
/// next are restored from it, each a machine of its own with a working network and files; a
/// damaged template is discarded and that create boots; with templates off, every one boots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_qemu_sandboxes_are_restored_from_their_shapes_template() {
    if stock_image_missing() || std::env::var("SANDBOX_HOST_IN_NESTED").as_deref() == Ok("1") {
        return;
    }
    let port = http_server("hello from the host").await;
    let resolve = format!("allowed.test:{port}:127.0.0.1");
    let h = start(&[
        ("SANDBOX_HOST_VMM", "qemu"),
        ("SANDBOX_HOST_TEMPLATES", "on"),
        ("SANDBOX_HOST_EGRESS_RESOLVE", resolve.as_str()),
    ]);
    let create = || async {
        let body = json!({"run_id": "r", "time_limit_ms": 600000, "review": false, "memory_mib": 256, "vcpus": 1,
            "egress": {"allow": ["allowed.test"]}});
        let (s, v) = h.json("POST", "/v1/sandboxes", Some(body)).await;
        assert_eq!(s, 201, "{v}");
        v
    };
    let first = create().await;
    assert_eq!(first["started_from"], "boot", "{first}");
    let boot_ms = first["boot_ms"].as_u64().unwrap_or(0);
    h.wait_log("Template ready", Duration::from_secs(300));
    let mut seen = std::collections::BTreeSet::new();
    let mut restore_ms = vec![];
    for i in 0..3 {
        let v = create().await;
        assert_eq!(v["started_from"], "template", "clone {i}: {v}");
        restore_ms.push(v["boot_ms"].as_u64().unwrap_or(0));
        let id = v["id"].as_str().unwrap().to_string();
        its_own_machine(&h, &id, i, false, &mut seen).await;
        let (out, err, last) = h
            .exec(
                &id,
                &format!(
                    "printf 'GET / HTTP/1.1\\r\\nHost: allowed.test\\r\\nConnection: close\\r\\n\\r\\n' | nc -w 5 allowed.test {port}; \
                     echo {i} > /workspace/f; cat /workspace/f"
                ),
            )
            .await;
        assert_eq!(last["exit_code"], 0, "{}", String::from_utf8_lossy(&err));
        let out = String::from_utf8_lossy(&out);
        assert!(
            out.contains("hello from the host") && out.ends_with(&format!("{i}\n")),
            "{out}"
        );
        let (s, _) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
        assert!(s == 200 || s == 204, "{s}");
    }
    eprintln!(
        "QEMU: boot_ms of the first sandbox {boot_ms}, of three restored from its template {restore_ms:?}"
    );
    let (_, metrics) = h.req("GET", "/metrics", vec![], &[]).await;
    let metrics = String::from_utf8_lossy(&metrics).to_string();
    assert!(
        metrics.contains("sandbox_host_template_restores_total 3"),
        "{metrics}"
    );
    assert!(
        metrics.contains("sandbox_host_templates_ready 1"),
        "{metrics}"
    );

    // A damaged template: the create boots cold, says so, and the template is gone.
    let tpl = std::fs::read_dir(h.state.join("templates"))
        .unwrap()
        .flatten()
        .next()
        .expect("a template directory")
        .path();
    let mem = tpl.join("snapshot.mem");
    let len = std::fs::metadata(&mem).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&mem)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let v = create().await;
    assert_eq!(v["started_from"], "boot", "{v}");
    h.wait_log("a template failed to restore", Duration::from_secs(5));
    let (out, _, _) = h.exec(v["id"].as_str().unwrap(), "echo cold").await;
    assert_eq!(out, b"cold\n");
    drop(h);

    let h = start(&[
        ("SANDBOX_HOST_VMM", "qemu"),
        ("SANDBOX_HOST_TEMPLATES", "off"),
    ]);
    for _ in 0..2 {
        let (s, v) = h
            .json(
                "POST",
                "/v1/sandboxes",
                Some(
                    json!({"run_id": "r", "time_limit_ms": 600000, "review": false, "memory_mib": 256, "vcpus": 1}),
                ),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        assert_eq!(v["started_from"], "boot", "{v}");
    }
    let (_, metrics) = h.req("GET", "/metrics", vec![], &[]).await;
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(
        metrics.contains("sandbox_host_templates_ready 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("sandbox_host_template_restores_total 0"),
        "{metrics}"
    );
}

/// On the KVM backend: the first sandbox of a shape boots, the next ones are restored from its
/// template and work as booted ones do, a damaged template is discarded, pause and resume keep
/// a sandbox's processes (`templates_on_kvm`).
#[test]
fn on_kvm_sandboxes_are_restored_from_their_shapes_template() {
    on_kvm(
        "on_kvm_sandboxes_are_restored_from_their_shapes_template",
        false,
        templates_on_kvm,
    );
}

/// On the KVM backend, the guest image's clones (`guest_image_on_kvm`).
#[test]
fn on_kvm_the_guest_image_is_restored_from_its_template() {
    if std::env::var("SANDBOX_HOST_IN_NESTED").as_deref() != Ok("1")
        && common::guest_image_missing()
    {
        return;
    }
    on_kvm(
        "on_kvm_the_guest_image_is_restored_from_its_template",
        true,
        guest_image_on_kvm,
    );
}

/// Runs `part` where the KVM backend runs: here, or one level down in a nested test host of
/// its own (this binary and the service's two programs taken along), which then runs this
/// test (`name`) alone. Each KVM part has its nested host: one emulated processor each, so the
/// two use both of this machine's, and each boots half the guests (a nested host wedges after
/// about twenty: tests/nested/README.md, "Wedged").
fn on_kvm<F: std::future::Future<Output = ()>>(name: &str, guest_image: bool, part: fn() -> F) {
    if stock_image_missing() {
        return;
    }
    if std::env::var("SANDBOX_HOST_IN_NESTED").as_deref() == Ok("1") {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(part());
        return;
    }
    let store = sandbox_vmm::ImageStore::new(sandbox_vmm::config::image_dir());
    let rt = tokio::runtime::Runtime::new().unwrap();
    if rt.block_on(sandbox_vmm::select::kvm_usable(&store)).is_ok() {
        rt.block_on(part());
        return;
    }
    // One level down: this binary, the service and its VM and network programs, at the paths the service's
    // tests expect them (the binary's own path is compiled into this test). The nested host has
    // no user sandbox-host: the service runs as root there, so CI's demand for that user
    // (SANDBOX_HOST_REQUIRE_E2E, passed down with the other settings) is dropped for this run.
    let me = std::env::current_exe().unwrap();
    let service = std::path::Path::new(env!("CARGO_BIN_EXE_sandbox-host"));
    let vm = service.with_file_name("sandbox-vm");
    let net = service.with_file_name("sandbox-net");
    let dir = service.parent().unwrap().display().to_string();
    // The fake provider's CA and certificate, made here (the nested host has no openssl).
    let certs = tempfile::tempdir().unwrap();
    common::make_certs(certs.path(), &["api.provider.test"]);
    // The guest image (a gigabyte) goes along for the part that uses it: the nested host then
    // needs more memory to hold it.
    let mut extra: Vec<&str> = vec![];
    if guest_image {
        extra.extend(["--mem", "8192", "--image", "vantik-guest:latest"]);
    }
    let cmd = format!(
        "mkdir -p {dir} && ln -sf /work/sandbox-host {dir}/sandbox-host && ln -sf /work/sandbox-vm {dir}/sandbox-vm && ln -sf /work/sandbox-net {dir}/sandbox-net && \
         unset SANDBOX_HOST_REQUIRE_E2E; export SANDBOX_HOST_IN_NESTED=1 SANDBOX_HOST_TEST_GUEST_IMAGE={}; \
         timeout 1500 ./{} --test-threads 1 --nocapture --exact {name} 2>&1",
        u8::from(guest_image),
        me.file_name().unwrap().to_string_lossy()
    );
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let out = std::process::Command::new("bash")
        .arg(root.join("tests/nested/run.sh"))
        .args(["--timeout", "1800"])
        .args(&extra)
        .arg("--with")
        .arg(certs.path().join("ca.pem"))
        .arg("--with")
        .arg(certs.path().join("srv.pem"))
        .arg("--with")
        .arg(certs.path().join("srv.key"))
        .arg("--with")
        .arg(&me)
        .arg("--with")
        .arg(service)
        .arg("--with")
        .arg(&vm)
        .arg("--with")
        .arg(&net)
        .arg("--")
        .arg(cmd)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(0) && text.contains("test result: ok. 1 passed"),
        "{name} failed in the nested host:\n{text}\n{stderr}"
    );
    eprintln!("{text}");
}

/// Checks that clone `i` is a machine of its own: 64 bytes of its `/dev/urandom` (and, with
/// `python`, of Python's `os.urandom`), each new to `seen`, and its clock within a second of the
/// host's.
async fn its_own_machine(
    h: &common::Host,
    id: &str,
    i: usize,
    python: bool,
    seen: &mut std::collections::BTreeSet<String>,
) {
    let python_read = if python {
        "python3 -c 'import os; print(os.urandom(64).hex())'; "
    } else {
        ""
    };
    let before = std::time::SystemTime::now();
    let (out, err, last) = h
        .exec(
            id,
            &format!(
                "head -c 64 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; {python_read}date +%s"
            ),
        )
        .await;
    let after = std::time::SystemTime::now();
    assert_eq!(last["exit_code"], 0, "{}", String::from_utf8_lossy(&err));
    let text = String::from_utf8_lossy(&out).to_string();
    let lines: Vec<&str> = text.lines().collect();
    let reads = if python { 2 } else { 1 };
    assert_eq!(lines.len(), reads + 1, "{text}");
    for random in &lines[..reads] {
        assert_eq!(random.len(), 128, "{text}");
        assert!(
            seen.insert(random.to_string()),
            "clone {i} read bytes another read gave: {text}"
        );
    }
    let guest: u64 = lines[reads].parse().unwrap_or(0);
    let secs =
        |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    assert!(
        secs(before) - 1 <= guest && guest <= secs(after) + 1,
        "clone {i}: the guest's clock says {guest}, the host's {} to {}",
        secs(before),
        secs(after)
    );
}

/// Everything the KVM part checks, on a host where the KVM backend runs.
async fn templates_on_kvm() {
    let port = http_server("hello from the host").await;
    let resolve = format!("allowed.test:{port}:127.0.0.1");
    // The nested host has no system roots, which interception needs: the outer run made a
    // CA for it (the fake provider's, used by `guest_image_on_kvm`; none is reached here).
    let ca = std::path::Path::new("/work/ca.pem");
    let ca_env = ca.to_string_lossy().into_owned();
    let mut env = vec![
        ("SANDBOX_HOST_VMM", "kvm"),
        ("SANDBOX_HOST_TEMPLATES", "on"),
        ("SANDBOX_HOST_EGRESS_RESOLVE", resolve.as_str()),
        // The disk image's 20 GiB sandbox disks are sparse; the nested host's /tmp is memory.
        ("SANDBOX_HOST_DISK_OVERCOMMIT", "100"),
    ];
    if std::env::var("SANDBOX_HOST_IN_NESTED").as_deref() == Ok("1") && ca.exists() {
        env.push(("SANDBOX_HOST_EGRESS_CA_FILE", ca_env.as_str()));
    }
    let h = start(&env);
    let create = || async {
        let mut body = json!({"run_id": "run-t", "time_limit_ms": 600000, "review": false, "memory_mib": 256, "vcpus": 1});
        body["egress"] = json!({"allow": ["allowed.test"]});
        let (s, v) = h.json("POST", "/v1/sandboxes", Some(body)).await;
        assert_eq!(s, 201, "{v}");
        v
    };
    let first = create().await;
    assert_eq!(first["started_from"], "boot", "{first}");
    h.wait_log("Template ready", Duration::from_secs(600));

    let mut seen = std::collections::BTreeSet::new();
    let mut boot_ms = vec![];
    for i in 0..10 {
        let v = create().await;
        assert_eq!(v["started_from"], "template", "clone {i}: {v}");
        boot_ms.push(v["boot_ms"].as_u64().unwrap_or(0));
        let id = v["id"].as_str().unwrap().to_string();
        its_own_machine(&h, &id, i, false, &mut seen).await;
        if i == 0 {
            // The network as on a booted sandbox: the allowed name answers, an address that
            // is not allowed is refused and counted.
            let (out, err, last) = h
                .exec(
                    &id,
                    &format!(
                        "printf 'GET /hello HTTP/1.1\\r\\nHost: allowed.test\\r\\nConnection: close\\r\\n\\r\\n' | nc -w 5 allowed.test {port}"
                    ),
                )
                .await;
            assert_eq!(last["exit_code"], 0, "{}", String::from_utf8_lossy(&err));
            assert!(
                String::from_utf8_lossy(&out).contains("hello from the host"),
                "{}",
                String::from_utf8_lossy(&out)
            );
            let (_, _, last) = h.exec(&id, "nc -w 3 198.51.100.7 80 </dev/null").await;
            assert_ne!(last["exit_code"], 0);
            let (s, egress) = h
                .json("GET", &format!("/v1/sandboxes/{id}/egress"), None)
                .await;
            assert_eq!(s, 200, "{egress}");
            assert!(
                egress["refused"].as_u64().unwrap_or(0) > 0,
                "the refusal is counted: {egress}"
            );
            // Files in and out through the API.
            let (s, body) = h
                .req(
                    "PUT",
                    &format!("/v1/sandboxes/{id}/files?path=/tmp/in.txt"),
                    b"from the API".to_vec(),
                    &[],
                )
                .await;
            assert!(s == 200 || s == 201 || s == 204, "{s}: {body:?}");
            let (out, _, _) = h.exec(&id, "cat /tmp/in.txt").await;
            assert_eq!(out, b"from the API");
        }
        let (s, _) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
        assert!(s == 200 || s == 204, "{s}");
    }
    eprintln!("boot_ms of ten sandboxes restored from the template: {boot_ms:?}");
    // A run with a provider key, restored: its placeholder and its sandbox's own CA are set up
    // as after a boot (the template has neither), and the key is nowhere in the guest.
    let key = "sk-ant-api03-REALKEY-0123456789abcdef";
    let (s, v) = h
        .json(
            "POST",
            "/v1/sandboxes",
            Some(
                json!({"run_id": "run-t", "time_limit_ms": 600000, "review": false,
                "memory_mib": 256, "vcpus": 1,
                "egress": {"allow": ["allowed.test"], "secrets": [
                    {"env": "ANTHROPIC_API_KEY", "value": key, "hosts": ["api.provider.test"]}]}}),
            ),
        )
        .await;
    assert_eq!(
        (s, v["started_from"].as_str()),
        (201, Some("template")),
        "{v}"
    );
    let id = v["id"].as_str().unwrap().to_string();
    let (out, _, last) = h
        .exec(
            &id,
            "echo $ANTHROPIC_API_KEY; head -1 /etc/ssl/certs/sandbox-egress-ca.pem; grep -rl REALKEY / --exclude-dir=proc --exclude-dir=sys 2>/dev/null | head -1; true",
        )
        .await;
    assert_eq!(last["exit_code"], 0);
    let text = String::from_utf8_lossy(&out).to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines
            .first()
            .is_some_and(|l| l.starts_with("vantik-placeholder-")),
        "{text}"
    );
    assert_eq!(
        lines.get(1).copied(),
        Some("-----BEGIN CERTIFICATE-----"),
        "{text}"
    );
    assert_eq!(lines.len(), 2, "the key is in the guest: {text}");
    let (s, _) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert!(s == 200 || s == 204);
    let (_, metrics) = h.req("GET", "/metrics", vec![], &[]).await;
    let metrics = String::from_utf8_lossy(&metrics).to_string();
    assert!(
        metrics.contains("sandbox_host_template_restores_total 11"),
        "{metrics}"
    );
    assert!(
        metrics.contains("sandbox_host_templates_ready 1"),
        "{metrics}"
    );

    // Pause and resume: a running process, a file, and the counters survive; the VM's memory
    // goes back to the host meanwhile.
    let v = create().await;
    let id = v["id"].as_str().unwrap().to_string();
    let (_, err, last) = h
        .exec(
            &id,
            "sleep 100000 >/dev/null 2>&1 & echo kept > /workspace/kept; nc -w 3 198.51.100.9 80 </dev/null; true",
        )
        .await;
    assert_eq!(last["exit_code"], 0, "{}", String::from_utf8_lossy(&err));
    let (_, egress_before) = h
        .json("GET", &format!("/v1/sandboxes/{id}/egress"), None)
        .await;
    let (_, usage_before) = h
        .json("GET", &format!("/v1/sandboxes/{id}/usage"), None)
        .await;
    let (_, health) = h.json("GET", "/v1/health", None).await;
    let committed = |h: &serde_json::Value| h["capacity"]["memory_mib"]["committed"].as_u64();
    let before = committed(&health).unwrap();
    let vm_rss_kib = || {
        // The VM processes of this sandbox (`sandbox-vm` with its state directory's id in its
        // jail: its cgroup is named after the sandbox), and their resident memory.
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| {
                let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
                let cgroup = std::fs::read_to_string(e.path().join("cgroup")).ok()?;
                (comm.trim() == "sandbox-vm" && cgroup.contains(&id)).then_some(())?;
                let status = std::fs::read_to_string(e.path().join("status")).ok()?;
                status
                    .lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .collect::<Vec<u64>>()
    };
    let running = vm_rss_kib();
    assert_eq!(running.len(), 1, "one VM process for the sandbox");
    let (s, v) = h
        .json("POST", &format!("/v1/sandboxes/{id}/pause"), None)
        .await;
    assert_eq!((s, v["state"].as_str()), (200, Some("paused")), "{v}");
    eprintln!("pause: {v}");
    assert!(
        vm_rss_kib().is_empty(),
        "the paused sandbox's VM process is gone"
    );
    eprintln!(
        "the pause released the VM process's {} KiB of resident memory",
        running[0]
    );
    let (_, health) = h.json("GET", "/v1/health", None).await;
    assert_eq!(
        committed(&health),
        Some(before - 256),
        "its memory no longer counts: {health}"
    );
    let (s, v) = h
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"command": "true"})),
        )
        .await;
    assert_eq!((s, v["code"].as_str()), (409, Some("paused")), "{v}");
    let (s, v) = h.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!((s, v["state"].as_str()), (200, Some("paused")), "{v}");
    let (s, v) = h
        .json("POST", &format!("/v1/sandboxes/{id}/resume"), None)
        .await;
    assert_eq!((s, v["state"].as_str()), (200, Some("ready")), "{v}");
    eprintln!("resume: {v}");
    let (out, err, last) = h
        .exec(
            &id,
            "cat /workspace/kept; pidof sleep >/dev/null && echo running; date +%s; ps",
        )
        .await;
    assert_eq!(last["exit_code"], 0, "{}", String::from_utf8_lossy(&err));
    let text = String::from_utf8_lossy(&out).to_string();
    assert!(text.starts_with("kept\nrunning\n"), "{text}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let guest: u64 = text
        .lines()
        .nth(2)
        .and_then(|l| l.parse().ok())
        .unwrap_or(0);
    assert!(
        guest + 2 >= now && guest <= now + 1,
        "the resumed clock: {guest} vs {now}"
    );
    let (_, egress_after) = h
        .json("GET", &format!("/v1/sandboxes/{id}/egress"), None)
        .await;
    let (_, usage_after) = h
        .json("GET", &format!("/v1/sandboxes/{id}/usage"), None)
        .await;
    assert_eq!(
        egress_after["refused"], egress_before["refused"],
        "{egress_after}"
    );
    assert!(
        egress_before["refused"].as_u64().unwrap_or(0) > 0,
        "{egress_before}"
    );
    assert_eq!(usage_after, usage_before);
    // The network still works after the resume.
    let (out, _, _) = h
        .exec(
            &id,
            &format!(
                "printf 'GET / HTTP/1.1\\r\\nHost: allowed.test\\r\\nConnection: close\\r\\n\\r\\n' | nc -w 5 allowed.test {port}"
            ),
        )
        .await;
    assert!(String::from_utf8_lossy(&out).contains("hello from the host"));
    // Twice more: each pause writes the set of files the running VM does not map.
    for round in 0..2 {
        let (s, v) = h
            .json("POST", &format!("/v1/sandboxes/{id}/pause"), None)
            .await;
        assert_eq!(s, 200, "round {round}: {v}");
        let (s, v) = h
            .json("POST", &format!("/v1/sandboxes/{id}/resume"), None)
            .await;
        assert_eq!(s, 200, "round {round}: {v}");
        let (out, _, _) = h.exec(&id, "cat /workspace/kept").await;
        assert_eq!(out, b"kept\n", "round {round}");
    }
    let (s, _) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert!(s == 200 || s == 204);
    assert!(
        !h.state.join(format!("{id}.paused")).exists(),
        "its snapshot files are removed"
    );

    // A damaged template: the create boots cold, says so, and the template is gone.
    let templates = h.state.join("templates");
    let tpl = std::fs::read_dir(&templates)
        .unwrap()
        .flatten()
        .next()
        .expect("a template directory")
        .path();
    let mem = tpl.join("snapshot.mem");
    let len = std::fs::metadata(&mem).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&mem)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let v = create().await;
    assert_eq!(v["started_from"], "boot", "{v}");
    h.wait_log("a template failed to restore", Duration::from_secs(5));
    let (_, metrics) = h.req("GET", "/metrics", vec![], &[]).await;
    assert!(
        String::from_utf8_lossy(&metrics).contains("sandbox_host_templates_ready 0"),
        "the damaged template is discarded"
    );
    let id = v["id"].as_str().unwrap();
    let (out, _, _) = h.exec(id, "echo cold").await;
    assert_eq!(out, b"cold\n");

    // Pause and resume a sandbox with a disk, twice: its files, on the disk and only in the
    // page cache, come back each time, read back from the disk itself too.
    let store = common::stock_only_store(&h.state);
    install_small_disk_image(&store);
    let (s, v) = h
        .json(
            "POST",
            "/v1/sandboxes",
            Some(
                json!({"run_id": "run-d", "time_limit_ms": 600000, "review": false,
                "memory_mib": 256, "vcpus": 1, "image": "small"}),
            ),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["image"], "small", "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let (_, err, last) = h
        .exec(
            &id,
            "echo on-disk > /workspace/synced; sync; echo cached > /workspace/cached; df -k /run/sandbox/upper | tail -1",
        )
        .await;
    assert_eq!(last["exit_code"], 0, "{}", String::from_utf8_lossy(&err));
    for round in 0..2 {
        let (s, v) = h
            .json("POST", &format!("/v1/sandboxes/{id}/pause"), None)
            .await;
        assert_eq!(s, 200, "round {round}: {v}");
        let (s, v) = h
            .json("POST", &format!("/v1/sandboxes/{id}/resume"), None)
            .await;
        assert_eq!(s, 200, "round {round}: {v}");
        let (out, err, _) = h
            .exec(
                &id,
                &format!(
                    "cat /workspace/synced /workspace/cached; echo {round} > /workspace/round{round}; sync; \
                     echo 3 > /proc/sys/vm/drop_caches; cat /workspace/synced /workspace/cached /workspace/round{round}"
                ),
            )
            .await;
        assert_eq!(
            String::from_utf8_lossy(&out),
            format!("on-disk\ncached\non-disk\ncached\n{round}\n"),
            "round {round}: {}",
            String::from_utf8_lossy(&err)
        );
    }
    let (s, _) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert!(s == 200 || s == 204);
    // A fork of a running sandbox, on this backend's snapshots with shared pages.
    forks_of_a_running_sandbox(&h, port).await;
}

/// What a clone of the guest image's template says to an Anthropic call, with its usage.
const PROVIDER_JSON: &str = r#"{"id":"msg_clone","type":"message","role":"assistant","model":"claude-test","content":[{"type":"text","text":"from the provider"}],"stop_reason":"end_turn","usage":{"input_tokens":1200,"output_tokens":85}}"#;

/// A fake model provider on loopback: TLS with `srv.pem`/`srv.key` from `dir`, one HTTP/1.1
/// request per connection, answered with `PROVIDER_JSON`; each request's head is kept.
async fn fake_provider(dir: &std::path::Path) -> (u16, Arc<Mutex<Vec<String>>>) {
    let acceptor = common::tls_acceptor(dir);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let (acceptor, log) = (acceptor.clone(), log.clone());
            tokio::spawn(async move {
                let Ok(mut s) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = Vec::new();
                let end = loop {
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                    let mut b = [0u8; 4096];
                    match s.read(&mut b).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&b[..n]),
                    }
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
                while buf.len() < end + len {
                    let mut b = [0u8; 4096];
                    match s.read(&mut b).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&b[..n]),
                    }
                }
                log.lock().unwrap().push(head);
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{PROVIDER_JSON}",
                    PROVIDER_JSON.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    (port, seen)
}

/// The guest image restored from its template: ten clones read different bytes from
/// `/dev/urandom` and from Python's `os.urandom`, with the host's clock; and a clone's provider
/// call goes through interception as a booted sandbox's does (curl, then Python, trusting the
/// clone's own CA): the provider gets the key, the guest its placeholder and the answer, the
/// usage is metered, and the key is nowhere in the guest. An archive goes in and comes out,
/// and 8 MiB written to the clone's disk read back the same from the disk.
async fn guest_image_on_kvm() {
    let nested = std::env::var("SANDBOX_HOST_IN_NESTED").as_deref() == Ok("1");
    if nested {
        if std::env::var("SANDBOX_HOST_TEST_GUEST_IMAGE").as_deref() != Ok("1") {
            eprintln!("skipped: the outer run had no guest image to bring into the nested host");
            return;
        }
    } else if common::guest_image_missing() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = if nested {
        std::path::PathBuf::from("/work")
    } else {
        common::make_certs(tmp.path(), &["api.provider.test"]);
        tmp.path().to_path_buf()
    };
    let (port, seen) = fake_provider(&dir).await;
    let resolve = format!("api.provider.test:{port}:127.0.0.1");
    let ca = dir.join("ca.pem").to_string_lossy().into_owned();
    let store = common::image_store().to_string_lossy().into_owned();
    let mut env = vec![
        ("SANDBOX_HOST_VMM", "kvm"),
        ("SANDBOX_HOST_TEMPLATES", "on"),
        ("SANDBOX_HOST_EGRESS_RESOLVE", resolve.as_str()),
        ("SANDBOX_HOST_EGRESS_CA_FILE", ca.as_str()),
        ("SANDBOX_HOST_IMAGE_DIR", store.as_str()),
        ("SANDBOX_HOST_DISK_OVERCOMMIT", "100"),
    ];
    let state_in_memory = sandbox_vmm::host::in_memory(std::path::Path::new("/tmp"));
    if state_in_memory {
        // The state directory is a tmpfs (the nested host's /tmp): what a clone reads of its
        // template's memory file allocates file pages charged to it, and its disk is memory
        // too, so it needs room beyond the default 64 MiB (the service warns about this).
        env.push(("SANDBOX_HOST_VMM_ALLOWANCE_MIB", "512"));
    }
    let h = start(&env);
    if state_in_memory {
        h.wait_log(
            "The state directory is in memory (tmpfs)",
            Duration::from_secs(5),
        );
    }
    let key = "sk-ant-api03-REALKEY-0123456789abcdef";
    let create = || async {
        let (s, v) = h
            .json(
                "POST",
                "/v1/sandboxes",
                Some(json!({"run_id": "run-g", "time_limit_ms": 600000, "review": false,
                    "memory_mib": 256, "vcpus": 1, "image": "vantik-guest:latest",
                    "egress": {"secrets": [
                        {"env": "ANTHROPIC_API_KEY", "value": key, "hosts": ["api.provider.test"]}]}})),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        v
    };
    let first = create().await;
    assert_eq!(first["started_from"], "boot", "{first}");
    h.wait_log("Template ready", Duration::from_secs(900));
    let mut seen_bytes = std::collections::BTreeSet::new();
    let mut boot_ms = vec![];
    // Every clone restores: the device-thread trap once seen here (glibc's lazy open of
    // /proc/sys/vm/overcommit_memory under the filter) is fixed in sandbox-vm, not tolerated.
    for i in 0..10 {
        let v = create().await;
        assert_eq!(v["started_from"], "template", "clone {i}: {v}");
        boot_ms.push(v["boot_ms"].as_u64().unwrap_or(0));
        let id = v["id"].as_str().unwrap().to_string();
        its_own_machine(&h, &id, i, true, &mut seen_bytes).await;
        if i == 0 {
            let calls = [
                format!(
                    "curl -sS --max-time 60 -H \"x-api-key: $ANTHROPIC_API_KEY\" -H 'content-type: application/json' \
                     -d '{{\"model\":\"m\"}}' https://api.provider.test:{port}/v1/messages"
                ),
                format!(
                    "python3 -c \"import os,sys,urllib.request as u; r=u.Request('https://api.provider.test:{port}/v1/messages', \
                     data=b'{{}}', headers={{'x-api-key': os.environ['ANTHROPIC_API_KEY']}}); \
                     sys.stdout.write(u.urlopen(r, timeout=60).read().decode())\""
                ),
            ];
            for call in &calls {
                let (out, err, last) = h.exec(&id, call).await;
                assert_eq!(
                    (
                        last["exit_code"].as_i64(),
                        String::from_utf8_lossy(&out).as_ref()
                    ),
                    (Some(0), PROVIDER_JSON),
                    "{call}: {}",
                    String::from_utf8_lossy(&err)
                );
            }
            let heads = seen.lock().unwrap().clone();
            assert_eq!(heads.len(), 2, "{heads:?}");
            for head in &heads {
                assert!(
                    head.to_ascii_lowercase()
                        .contains(&format!("x-api-key: {key}").to_ascii_lowercase()),
                    "the provider got the key: {head}"
                );
            }
            let mut u = json!(null);
            for _ in 0..40 {
                let (s, v) = h
                    .json("GET", &format!("/v1/sandboxes/{id}/usage"), None)
                    .await;
                assert_eq!(s, 200, "{v}");
                u = v;
                if u["totals"]["calls"] == 2 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            assert_eq!(
                (&u["totals"]["calls"], &u["totals"]["output_tokens"]),
                (&json!(2), &json!(170)),
                "both calls metered: {u}"
            );
            let (out, _, last) = h
                .exec(
                    &id,
                    // Where a key could land (the image's own gigabyte is read-only and the
                    // same in every sandbox): configuration, run state, homes, the
                    // workspace, temporary files, and every process's environment.
                    "echo $ANTHROPIC_API_KEY; grep -rls REALKEY /etc /run /root /home /workspace /tmp /var/tmp /proc/[0-9]*/environ | head -1; true",
                )
                .await;
            assert_eq!(last["exit_code"], 0);
            let text = String::from_utf8_lossy(&out).to_string();
            assert!(text.starts_with("vantik-placeholder-"), "{text}");
            assert_eq!(text.lines().count(), 1, "the key is in the guest: {text}");

            // An archive in and out, and disk writes read back from the disk, as on a booted
            // sandbox of the image.
            let mut tarball = tar::Builder::new(Vec::new());
            for (name, body, mode) in [
                ("a/hello.txt", &b"hello\n"[..], 0o644),
                ("a/run.sh", &b"#!/bin/sh\necho ran\n"[..], 0o755),
            ] {
                let mut head = tar::Header::new_gnu();
                head.set_size(body.len() as u64);
                head.set_mode(mode);
                head.set_cksum();
                tarball.append_data(&mut head, name, body).unwrap();
            }
            let (s, b) = h
                .req(
                    "PUT",
                    &format!("/v1/sandboxes/{id}/archive?path=/workspace/proj"),
                    tarball.into_inner().unwrap(),
                    &[("content-type", "application/x-tar")],
                )
                .await;
            assert_eq!(s, 204, "{}", String::from_utf8_lossy(&b));
            let (out, err, last) = h
                .exec(
                    &id,
                    "cd /workspace/proj && ./a/run.sh && cat a/hello.txt && \
                     head -c 8388608 /dev/urandom > big && sha256sum big > big.sum && sync && \
                     echo 3 > /proc/sys/vm/drop_caches && sha256sum -c big.sum",
                )
                .await;
            assert_eq!(
                (
                    last["exit_code"].as_i64(),
                    String::from_utf8_lossy(&out).as_ref()
                ),
                (Some(0), "ran\nhello\nbig: OK\n"),
                "{}",
                String::from_utf8_lossy(&err)
            );
            let (s, back) = h
                .req(
                    "GET",
                    &format!("/v1/sandboxes/{id}/archive?path=/workspace/proj"),
                    vec![],
                    &[],
                )
                .await;
            assert_eq!(s, 200);
            let names: Vec<String> = tar::Archive::new(&back[..])
                .entries()
                .unwrap()
                .map(|e| e.unwrap().path().unwrap().to_string_lossy().into_owned())
                .collect();
            assert!(
                ["a/hello.txt", "a/run.sh", "big"]
                    .iter()
                    .all(|want| names.iter().any(|n| n.ends_with(want))),
                "{names:?}"
            );
        }
        let (s, _) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
        assert!(s == 200 || s == 204, "{s}");
    }
    eprintln!("boot_ms of ten guest-image sandboxes restored from the template: {boot_ms:?}");
}

/// A small disk image in `store` named `small`: the stock image's kernel and initramfs, and its
/// initramfs's files as the read-only ext4 root (the same /init boots it as an overlay with a
/// sandbox disk, as it boots the guest image).
fn install_small_disk_image(store: &std::path::Path) {
    let stock = std::fs::canonicalize(store.join("stock")).expect("the stock image");
    let dir = store.join("small");
    if dir.join("manifest.json").exists() {
        return;
    }
    let tree = store.join("small-tree");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::create_dir_all(&tree).unwrap();
    for f in ["vmlinux", "initramfs.cpio"] {
        std::fs::copy(stock.join(f), dir.join(f)).unwrap();
    }
    let ok = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "cd '{}' && cpio -id < '{}' 2>/dev/null; mkfs.ext4 -q -F -d '{}' '{}' 64M",
            tree.display(),
            stock.join("initramfs.cpio").display(),
            tree.display(),
            dir.join("rootfs.ext4").display()
        ))
        .env("PATH", "/usr/sbin:/sbin:/usr/bin:/bin")
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "the small disk image is made (cpio, mkfs.ext4 -d)");
    std::fs::write(
        dir.join("manifest.json"),
        r#"{"name": "small", "arch": "x86_64", "kind": "disk", "kernel": "vmlinux", "initrd": "initramfs.cpio", "rootfs": "rootfs.ext4", "agent_version": "0.1.0"}"#,
    )
    .unwrap();
}

/// A fork of a running sandbox (issue 35) on the backend `h` runs, on the small disk image: a
/// parent with a process running, a file on its disk and one only in its page cache, and a
/// secret, forked into two children on runs of their own. Each child has the process and both
/// files, is a machine of its own (its own random bytes, the host's clock), reaches the network
/// through its own network process with its own placeholder and CA, and what it writes stays
/// its own; the parent runs on. Bad forks are refused with the reason.
async fn forks_of_a_running_sandbox(h: &common::Host, port: u16) {
    let store = common::stock_only_store(&h.state);
    install_small_disk_image(&store);
    let run = |run_id: &str, key: &str| {
        json!({"run_id": run_id, "time_limit_ms": 600000,
            "egress": {"allow": ["allowed.test"], "secrets": [
                {"env": "PROVIDER_KEY", "value": key, "hosts": ["api.provider.test"]}]}})
    };
    let mut body = run("run-parent", "sk-parent-0123456789");
    body["review"] = json!(false);
    body["memory_mib"] = json!(256);
    body["vcpus"] = json!(1);
    body["image"] = json!("small");
    let (s, v) = h.json("POST", "/v1/sandboxes", Some(body)).await;
    assert_eq!(s, 201, "{v}");
    let parent = v["id"].as_str().unwrap().to_string();
    let (out, err, last) = h
        .exec(
            &parent,
            "sleep 100000 >/dev/null 2>&1 & echo $! > /workspace/pid; echo on-disk > /workspace/synced; \
             sync; echo cached > /workspace/cached; echo $PROVIDER_KEY; sha256sum /etc/ssl/certs/sandbox-egress-ca.pem",
        )
        .await;
    assert_eq!(last["exit_code"], 0, "{}", String::from_utf8_lossy(&err));
    let parent_says = String::from_utf8_lossy(&out).to_string();

    // Refusals, each with its reason, and the parent untouched by them.
    for (body, want) in [
        (
            json!({"count": 0, "children": []}),
            "count must be between 1 and 16",
        ),
        (
            json!({"count": 17, "children": []}),
            "count must be between 1 and 16",
        ),
        (
            json!({"count": 2, "children": [run("a", "sk-valid-0123456789")]}),
            "one entry per child",
        ),
        (
            json!({"count": 1, "children": [{"run_id": "a", "time_limit_ms": 1000, "memory_mib": 512}]}),
            "unknown field `memory_mib`",
        ),
        (
            json!({"count": 1, "children": [{"run_id": "", "time_limit_ms": 1000}]}),
            "children[0]: run_id must be 1 to 200 characters",
        ),
        (
            json!({"count": 1, "children": [run("a", "short")]}),
            "children[0]: secret `PROVIDER_KEY`: the value must be printable ASCII",
        ),
    ] {
        let (s, v) = h
            .json("POST", &format!("/v1/sandboxes/{parent}/fork"), Some(body))
            .await;
        assert_eq!(s, 400, "{v}");
        assert!(
            v["error"].as_str().unwrap_or("").contains(want),
            "{want}: {v}"
        );
    }
    let (s, v) = h
        .json(
            "POST",
            "/v1/sandboxes/sbx-0123456789abcdef/fork",
            Some(json!({"count": 1, "children": [run("a", "sk-valid-0123456789")]})),
        )
        .await;
    assert_eq!(s, 404, "{v}");

    // Forked while an exec streams its output in the parent: the exec goes on in the parent to
    // its end, and the children's agents, which still hold its stream, answer their new host.
    let ticking = h.exec(
        &parent,
        "for i in $(seq 1 40); do echo tick $i; sleep 0.1; done",
    );
    let forking = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        h.json(
            "POST",
            &format!("/v1/sandboxes/{parent}/fork"),
            Some(json!({"count": 2, "children": [
                run("run-child-a", "sk-child-a-0123456789"),
                run("run-child-b", "sk-child-b-0123456789")]})),
        )
        .await
    };
    let ((out, _, last), (s, v)) = tokio::join!(ticking, forking);
    assert_eq!(s, 201, "{v}");
    assert_eq!(last["exit_code"], 0, "{last}");
    let ticks = String::from_utf8_lossy(&out).to_string();
    assert!(
        ticks.starts_with("tick 1\n") && ticks.ends_with("tick 40\n"),
        "{ticks}"
    );
    assert_eq!(ticks.lines().count(), 40, "{ticks}");
    eprintln!("fork: {v}");
    let children: Vec<String> = v["children"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert_eq!(c["started_from"], "fork", "{c}");
            assert_eq!(c["image"], "small", "{c}");
            c["id"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(children.len(), 2, "{v}");
    assert_eq!(v["children"][1]["run_id"], "run-child-b", "{v}");
    assert!(v["held_ms"].as_u64().is_some(), "{v}");

    let mut seen = std::collections::BTreeSet::new();
    let mut says = vec![parent_says.clone()];
    for (i, id) in std::iter::once(&parent).chain(&children).enumerate() {
        // The process, both files (read back from the disk itself too), and the network.
        let (out, err, last) = h
            .exec(
                id,
                &format!(
                    "kill -0 $(cat /workspace/pid) && echo running; echo 3 > /proc/sys/vm/drop_caches; \
                     cat /workspace/synced /workspace/cached; \
                     printf 'GET / HTTP/1.1\\r\\nHost: allowed.test\\r\\nConnection: close\\r\\n\\r\\n' | nc -w 5 allowed.test {port} | tail -1; echo; \
                     echo $PROVIDER_KEY; sha256sum /etc/ssl/certs/sandbox-egress-ca.pem; echo {i} > /workspace/mine"
                ),
            )
            .await;
        assert_eq!(
            last["exit_code"],
            0,
            "{i}: {}",
            String::from_utf8_lossy(&err)
        );
        let text = String::from_utf8_lossy(&out).to_string();
        assert!(
            text.starts_with("running\non-disk\ncached\nhello from the host\n"),
            "{i}: {text}"
        );
        if i > 0 {
            says.push(text.lines().skip(4).collect::<Vec<_>>().join("\n") + "\n");
        }
        its_own_machine(h, id, i, false, &mut seen).await;
    }
    // Placeholders and CAs: each sandbox its own (its network process made them).
    let mut keys = std::collections::BTreeSet::new();
    let mut cas = std::collections::BTreeSet::new();
    for s in &says {
        let lines: Vec<&str> = s.lines().collect();
        assert!(lines[0].starts_with("vantik-placeholder-"), "{s}");
        keys.insert(lines[0].to_string());
        cas.insert(lines[1].to_string());
    }
    assert_eq!((keys.len(), cas.len()), (3, 3), "{says:?}");
    // What each wrote after the fork is its own.
    for (i, id) in std::iter::once(&parent).chain(&children).enumerate() {
        let (out, _, _) = h.exec(id, "cat /workspace/mine").await;
        assert_eq!(out, format!("{i}\n").into_bytes(), "{id}");
        let (s, v) = h.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["state"], "ready", "{v}");
    }
    let (_, v) = h
        .json("GET", &format!("/v1/sandboxes/{}", children[0]), None)
        .await;
    assert_eq!(v["run_id"], "run-child-a", "{v}");
    assert_eq!(
        v["egress_settings"]["secrets"][0]["env"], "PROVIDER_KEY",
        "{v}"
    );
    // A child forks too.
    let (s, v) = h
        .json(
            "POST",
            &format!("/v1/sandboxes/{}/fork", children[0]),
            Some(json!({"count": 1, "children": [run("run-grandchild", "sk-grandchild-0123456789")]})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let grandchild = v["children"][0]["id"].as_str().unwrap().to_string();
    let (out, _, _) = h
        .exec(&grandchild, "cat /workspace/mine /workspace/cached")
        .await;
    assert_eq!(out, b"1\ncached\n");
    for id in std::iter::once(&parent)
        .chain(&children)
        .chain([&grandchild])
    {
        let (s, _) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
        assert!(s == 200 || s == 204, "{s}");
    }
    let left: Vec<_> = std::fs::read_dir(&h.state)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".fork-"))
        .collect();
    assert!(
        left.is_empty(),
        "the forks' snapshots are removed: {left:?}"
    );
}

/// On QEMU a running sandbox forks through QEMU's migration to a file
/// (`forks_of_a_running_sandbox`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_qemu_a_running_sandbox_forks() {
    if stock_image_missing() || std::env::var("SANDBOX_HOST_IN_NESTED").as_deref() == Ok("1") {
        return;
    }
    let port = http_server("hello from the host").await;
    let resolve = format!("allowed.test:{port}:127.0.0.1");
    let h = start(&[
        ("SANDBOX_HOST_VMM", "qemu"),
        ("SANDBOX_HOST_TEMPLATES", "off"),
        ("SANDBOX_HOST_EGRESS_RESOLVE", resolve.as_str()),
        // Four 20 GiB sandbox disks at once, sparse.
        ("SANDBOX_HOST_DISK_OVERCOMMIT", "100"),
    ]);
    forks_of_a_running_sandbox(&h, port).await;
}
