//! Start-up of the real binary: the token rules, `.env` against the environment, the first log
//! lines (availability), and a host that cannot start microVMs.

mod common;

use std::time::Duration;

use common::{TOKEN, bin, free_port, start, stock_image_missing};

fn first_json_line(stderr: &[u8]) -> serde_json::Value {
    let text = String::from_utf8_lossy(stderr);
    serde_json::from_str(text.lines().next().unwrap_or(""))
        .unwrap_or_else(|_| panic!("not a JSON line: {text}"))
}

#[test]
fn refuses_to_start_without_a_token_or_with_a_short_one() {
    let out = bin().arg("serve").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let line = first_json_line(&out.stderr);
    assert_eq!(line["level"], "ERROR");
    let msg = line["message"].as_str().unwrap();
    assert!(
        msg.contains("SANDBOX_HOST_TOKEN is not set") && msg.contains("openssl rand -hex 32"),
        "{msg}"
    );

    let out = bin()
        .arg("serve")
        .env("SANDBOX_HOST_TOKEN", "only-twenty-characte")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let msg = first_json_line(&out.stderr)["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("SANDBOX_HOST_TOKEN has 20 characters; it needs at least 24"),
        "{msg}"
    );

    let out = bin()
        .arg("serve")
        .env("SANDBOX_HOST_TOKEN", TOKEN)
        .env("SANDBOX_HOST_IDLE_MS", "soon")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        first_json_line(&out.stderr)["message"]
            .as_str()
            .unwrap()
            .contains("SANDBOX_HOST_IDLE_MS is `soon`")
    );
}

#[tokio::test]
async fn dotenv_applies_and_the_environment_wins() {
    if stock_image_missing() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (file_port, env_port) = (free_port(), free_port());
    let dotenv = dir.path().join(".env");
    std::fs::write(&dotenv, format!("SANDBOX_HOST_TOKEN={TOKEN}\nSANDBOX_HOST_PORT={file_port}\nSANDBOX_HOST_MAX_BODY_MB=7\n")).unwrap();
    common::give_to_service(&dir.path().join("state"));
    let mut child = common::service()
        .arg("serve")
        .env("SANDBOX_HOST_DOTENV", &dotenv)
        .env("SANDBOX_HOST_PORT", env_port.to_string())
        .env("SANDBOX_HOST_STATE_DIR", dir.path().join("state"))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut stderr, &mut first).unwrap();
    let line: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert_eq!(
        line["message"],
        format!("Listening on 127.0.0.1:{env_port}"),
        "{first}"
    );
    // The token came from the file and the body limit too: a declared 8 MB body is refused
    // with the file's 7 MB limit, on the environment's port.
    let head = format!(
        "POST /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        8 << 20
    );
    let resp = common::raw_http(env_port, &head, vec![]);
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
    assert!(resp.contains("larger than 7340032 bytes"), "{resp}");
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test]
async fn first_lines_say_where_it_listens_and_whether_it_can_start_microvms() {
    if stock_image_missing() {
        return;
    }
    let h = start(&[]);
    let first = h.logs.lock().unwrap()[0].clone();
    let line: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert_eq!(
        line["message"],
        format!("Listening on 127.0.0.1:{}", h.port)
    );
    assert_eq!(line["available"], true, "{first}");
    assert_eq!(line["backend"], "qemu");
    assert_eq!(
        line["arch"],
        sandbox_vmm::arch::Arch::host().as_str(),
        "{first}"
    );
    // No full guest image in the store: the warning says what that means.
    let warn = h.wait_log("is not in the image store", Duration::from_secs(5));
    assert_eq!(warn["level"], "WARN");
    assert!(
        warn["message"]
            .as_str()
            .unwrap()
            .contains("/workspace is a tmpfs")
    );
    let (s, v) = h.json("GET", "/v1/health", None).await;
    assert_eq!(s, 200);
    assert_eq!(v["available"], true);
    assert_eq!(v["arch"], line["arch"]);
    // The jail, in the start-up line and in health alike; CI's host applies all of it.
    let jail: serde_json::Value = serde_json::from_str(line["jail"].as_str().unwrap_or("null"))
        .unwrap_or(serde_json::Value::Null);
    assert_eq!(jail, v["jail"], "{first}");
    if std::env::var_os("SANDBOX_HOST_REQUIRE_E2E").is_some() {
        assert_eq!(v["jail"]["namespaces"], true, "{v}");
        assert_eq!(v["jail"]["ids"], "per-vm", "{v}");
        assert!(!v["jail"]["cgroup"].is_null(), "{v}");
        assert_eq!(v["jail"]["missing"], serde_json::json!([]), "{v}");
    }
    assert_eq!(
        v["image"],
        serde_json::json!({"name": "stock", "stock": true})
    );
    // The documented setup: the process that parses every request runs as the user
    // sandbox-host, and so says nothing of root.
    let logs = h.logs.lock().unwrap().join("\n");
    if common::service_user().is_some() {
        let status = std::fs::read_to_string(format!("/proc/{}/status", h.child.id())).unwrap();
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .unwrap()
            .split_whitespace()
            .map(str::to_string)
            .collect::<Vec<_>>();
        let id = std::process::Command::new("id")
            .args(["-u", common::SERVICE_USER])
            .output()
            .unwrap();
        let want = String::from_utf8_lossy(&id.stdout).trim().to_string();
        assert_eq!(
            uid,
            vec![want.clone(); 4],
            "real, effective, saved and fs uid"
        );
        assert!(!logs.contains("runs as root"), "{logs}");
        // A session of its own without a terminal (no TIOCSTI into whoever started it), and an
        // environment of its own settings only.
        let pid = h.child.id();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
        assert_eq!(fields[3], pid.to_string(), "session id: {stat}");
        assert_eq!(fields[4], "0", "controlling terminal: {stat}");
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        for var in environ.split(|b| *b == 0).filter(|v| !v.is_empty()) {
            let name = String::from_utf8_lossy(var.split(|b| *b == b'=').next().unwrap());
            assert!(
                name.starts_with("SANDBOX_HOST_")
                    || [
                        "PATH",
                        "LANG",
                        "LC_ALL",
                        "TZ",
                        "RUST_LOG",
                        "RUST_BACKTRACE",
                        "HOME"
                    ]
                    .contains(&name.as_ref()),
                "the service inherited {name}"
            );
        }
    } else if std::env::var_os("SANDBOX_HOST_REQUIRE_E2E").is_some() {
        assert!(
            !logs.contains("runs as root"),
            "CI runs the service as an ordinary user: {logs}"
        );
    }
}

#[tokio::test]
async fn without_qemu_it_starts_unavailable_and_refuses_creates() {
    let h = start(&[("PATH", "/nonexistent")]);
    let line: serde_json::Value = serde_json::from_str(&h.logs.lock().unwrap()[0]).unwrap();
    assert_eq!(line["available"], false);
    let reason = line["reason"].as_str().unwrap();
    assert!(
        reason.contains("no qemu-system-x86_64 on its PATH"),
        "{reason}"
    );
    let (s, v) = h.json("GET", "/v1/health", None).await;
    assert_eq!((s, v["available"].clone()), (200, serde_json::json!(false)));
    let (s, v) = h
        .json(
            "POST",
            "/v1/sandboxes",
            Some(serde_json::json!({"run_id": "r", "time_limit_ms": 1000, "review": false})),
        )
        .await;
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["code"], "unavailable");
    assert!(v["error"].as_str().unwrap().contains("qemu-system-x86_64"));
}

/// `SANDBOX_HOST_ARCH` for a guest this host does not run natively: the start-up line names the
/// architecture and the emulation; a store without that architecture's stock image says how to
/// build it; a hardware accelerator asked for it is refused by name, not left to fail at a boot.
#[tokio::test]
async fn a_foreign_guest_architecture_is_named_and_its_missing_pieces_said() {
    use sandbox_vmm::arch::Arch;
    let foreign = match Arch::host() {
        Arch::X86_64 => Arch::Aarch64,
        Arch::Aarch64 => Arch::X86_64,
    };
    if sandbox_vmm::qemu::which(foreign.qemu_program()).is_none() {
        let why = format!(
            "no {} (bin/test installs it: scripts/install-deps.sh --aarch64)",
            foreign.qemu_program()
        );
        assert!(
            std::env::var("SANDBOX_HOST_REQUIRE_E2E").as_deref() != Ok("1")
                || foreign == Arch::X86_64,
            "{why}"
        );
        eprintln!("skipped: {why}");
        return;
    }
    let empty = tempfile::tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(
        empty.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let store = empty.path().to_str().unwrap();
    let h = start(&[
        ("SANDBOX_HOST_ARCH", foreign.as_str()),
        ("SANDBOX_HOST_IMAGE_DIR", store),
    ]);
    let first = h.logs.lock().unwrap()[0].clone();
    let line: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert_eq!(line["arch"], foreign.as_str(), "{first}");
    assert_eq!(line["backend"], "qemu", "{first}");
    assert_eq!(line["accel"], "tcg", "{first}");
    assert_eq!(line["available"], false, "{first}");
    let reason = line["reason"].as_str().unwrap();
    let hint = match foreign {
        Arch::Aarch64 => "SANDBOX_HOST_ARCH=aarch64 bash rootfs/build-stock.sh",
        Arch::X86_64 => "x86_64 images are built on an x86_64 host",
    };
    assert!(reason.contains(hint), "{reason}");
    let warning = line["warning"].as_str().unwrap_or("");
    assert!(warning.contains("QEMU emulates the processor"), "{first}");
    let (_, v) = h.json("GET", "/v1/health", None).await;
    assert_eq!(v["arch"], foreign.as_str());
    drop(h);

    let h = start(&[
        ("SANDBOX_HOST_ARCH", foreign.as_str()),
        ("SANDBOX_HOST_QEMU_ACCEL", "kvm"),
    ]);
    let line: serde_json::Value = serde_json::from_str(&h.logs.lock().unwrap()[0]).unwrap();
    assert_eq!(line["available"], false);
    let reason = line["reason"].as_str().unwrap();
    assert!(
        reason.contains("runs only under emulation") && reason.contains("SANDBOX_HOST_QEMU_ACCEL"),
        "{reason}"
    );

    let h = start(&[("SANDBOX_HOST_ARCH", "riscv64")]);
    let line: serde_json::Value = serde_json::from_str(&h.logs.lock().unwrap()[0]).unwrap();
    assert_eq!(line["available"], false);
    assert!(
        line["reason"]
            .as_str()
            .unwrap()
            .contains("SANDBOX_HOST_ARCH must be one of auto, x86_64, aarch64"),
        "{line}"
    );
}

#[test]
fn a_second_host_on_the_same_state_directory_is_refused() {
    let h = start(&[("PATH", "/nonexistent")]);
    let out = bin()
        .arg("serve")
        .env("SANDBOX_HOST_TOKEN", TOKEN)
        .env("SANDBOX_HOST_PORT", free_port().to_string())
        .env("SANDBOX_HOST_STATE_DIR", &h.state)
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("another sandbox host uses SANDBOX_HOST_STATE_DIR")
    );
}

/// The hand-over to the service's user refuses what would let that user (or anyone but root)
/// change what root later runs or trusts: a runtime directory that is not root's alone, and
/// image files others could write.
#[test]
fn the_hand_over_refuses_a_foreign_runtime_directory_and_writable_images() {
    if common::service_user().is_none() {
        eprintln!("skipped: the hand-over to the user sandbox-host runs only as root");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let script = root.join("scripts/service-user.sh");
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let run = |rt: &std::path::Path, store: &std::path::Path| {
        std::process::Command::new("bash")
            .arg(&script)
            .args(["--cgroup", "sandbox-host-tests"])
            .arg(rt)
            .arg(env!("CARGO_BIN_EXE_sandbox-host"))
            .env("SANDBOX_HOST_IMAGE_DIR", store)
            .output()
            .unwrap()
    };
    // A directory the user made.
    let foreign = tmp.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    let st = std::process::Command::new("chown")
        .args([common::SERVICE_USER, foreign.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(st.success());
    let store = tmp.path().join("store");
    std::fs::create_dir_all(store.join("img")).unwrap();
    std::fs::write(store.join("img/manifest.json"), "{}").unwrap();
    std::fs::set_permissions(
        store.join("img/manifest.json"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let out = run(&foreign, &store);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("is not a directory of root's that only root can write"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!foreign.join("bin").exists(), "nothing was made in it");
    // A world-writable image file.
    let rt = tmp.path().join("rt");
    std::fs::set_permissions(
        store.join("img/manifest.json"),
        std::fs::Permissions::from_mode(0o666),
    )
    .unwrap();
    let out = run(&rt, &store);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("img/manifest.json") && err.contains("others could change"),
        "{err}"
    );
    assert!(!rt.join("images").exists(), "the store was not handed over");
    // The same store, fixed, is handed over.
    std::fs::set_permissions(
        store.join("img/manifest.json"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let out = run(&rt, &store);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(rt.join("images/img/manifest.json").is_file());
}

/// A state directory in memory (tmpfs) is named at start-up: what the VMs write there, their
/// disks and the snapshots of pauses, is memory counted against each VM's limit. One on a disk
/// is not.
#[test]
fn a_state_directory_in_memory_is_named_at_start_up() {
    let shm = std::path::Path::new("/dev/shm");
    if !sandbox_vmm::host::in_memory(shm) {
        eprintln!("skipped: /dev/shm is not a tmpfs here");
        return;
    }
    let tmp = tempfile::tempdir_in(shm).unwrap();
    let h = common::start_in(&tmp.path().join("state"), &[("PATH", "/nonexistent")]);
    let warn = h.wait_log(
        "The state directory is in memory (tmpfs)",
        Duration::from_secs(5),
    );
    assert_eq!(warn["level"], "WARN", "{warn}");
    assert!(
        warn["message"]
            .as_str()
            .unwrap_or_default()
            .contains("Put SANDBOX_HOST_STATE_DIR on a disk"),
        "{warn}"
    );
    drop(h);
    if sandbox_vmm::host::in_memory(std::path::Path::new("/tmp")) {
        return;
    }
    let h = start(&[("PATH", "/nonexistent")]);
    h.wait_log("Budgets", Duration::from_secs(5));
    let logs = h.logs.lock().unwrap().clone();
    assert!(
        !logs.iter().any(|l| l.contains("in memory (tmpfs)")),
        "{logs:?}"
    );
}
