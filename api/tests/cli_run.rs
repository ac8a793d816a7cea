//! `sandbox-host run` as an operator uses it: the real binary, a real VM on the stock image.

mod common;

use common::{bin, stock_image_missing};

#[test]
fn run_streams_output_and_passes_the_exit_code_on() {
    if stock_image_missing() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let out = bin()
        .env("SANDBOX_HOST_STATE_DIR", state.path())
        .args([
            "run",
            "--memory-mib",
            "512",
            "--vcpus",
            "1",
            "--env",
            "WHO=operator",
            "--",
            "sh",
            "-c",
        ])
        .arg("echo hello $WHO; echo oops >&2; exit 7")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello operator\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains("oops\n"));
    assert_eq!(
        out.status.code(),
        Some(7),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The VM is disposed of: nothing is left in the state directory.
    assert_eq!(std::fs::read_dir(state.path()).unwrap().count(), 0);
}

#[test]
fn run_passes_stdin_and_reports_timeouts() {
    if stock_image_missing() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let mut child = bin()
        .env("SANDBOX_HOST_STATE_DIR", state.path())
        .args([
            "run",
            "--memory-mib",
            "512",
            "--vcpus",
            "1",
            "-i",
            "--",
            "wc",
            "-c",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(&[b'x'; 123_456]).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "123456");
    assert_eq!(out.status.code(), Some(0));

    let out = bin()
        .env("SANDBOX_HOST_STATE_DIR", state.path())
        .args([
            "run",
            "--memory-mib",
            "512",
            "--vcpus",
            "1",
            "--timeout-ms",
            "500",
            "--",
            "sleep",
            "60",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(124));
    assert!(String::from_utf8_lossy(&out.stderr).contains("timed out"));
}

#[test]
fn missing_qemu_is_reported_in_the_guides_words() {
    let out = bin()
        .env("PATH", "/nonexistent")
        .args(["run", "--", "true"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125));
    assert!(
        err.contains("has no qemu-system-x86_64 on its PATH"),
        "{err}"
    );
    assert!(err.contains("Install QEMU"), "{err}");
}

#[test]
fn bad_settings_and_arguments_are_named() {
    let out = bin()
        .env("SANDBOX_HOST_QEMU_ACCEL", "warp")
        .args(["run", "--", "true"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125));
    assert!(
        err.contains("SANDBOX_HOST_QEMU_ACCEL") && err.contains("`warp`"),
        "{err}"
    );

    let out = bin()
        .args(["run", "--vcpus", "0", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--vcpus"));

    let out = bin()
        .args(["run", "--image", "../x", "--", "true"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a valid image name"));
}

#[test]
fn stale_run_directories_are_removed() {
    if stock_image_missing() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    // A pid that cannot be running (above pid_max) and one that is (this test).
    let dead = state.path().join("run-4194305-deadbeef");
    let alive = state
        .path()
        .join(format!("run-{}-cafe", std::process::id()));
    std::fs::create_dir_all(&dead).unwrap();
    std::fs::write(dead.join("agent.sock"), b"").unwrap();
    std::fs::create_dir_all(&alive).unwrap();
    let out = bin()
        .env("SANDBOX_HOST_STATE_DIR", state.path())
        .args(["run", "--memory-mib", "256", "--vcpus", "1", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!dead.exists(), "the dead run's directory is still there");
    assert!(alive.exists(), "a live run's directory was removed");
}

/// `run` on the aarch64 guest (`SANDBOX_HOST_ARCH=aarch64`): QEMU's `virt` machine, emulated on an
/// x86_64 host, native on an aarch64 one, from that architecture's image store.
#[test]
fn run_boots_the_aarch64_guest() {
    use sandbox_vmm::arch::Arch;
    let store = sandbox_vmm::config::image_dir_for(Arch::Aarch64);
    if !store.join("stock/manifest.json").is_file() {
        let why = format!(
            "no aarch64 stock image in {}; run `SANDBOX_HOST_ARCH=aarch64 bash rootfs/build-stock.sh`",
            store.display()
        );
        assert!(
            std::env::var("SANDBOX_HOST_REQUIRE_E2E").as_deref() != Ok("1"),
            "{why} (bin/test builds it)"
        );
        eprintln!("skipped: {why}");
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let out = bin()
        .env("SANDBOX_HOST_STATE_DIR", state.path())
        .env("SANDBOX_HOST_ARCH", "aarch64")
        .env("SANDBOX_HOST_LOG", "info")
        .args([
            "run",
            "--memory-mib",
            "512",
            "--vcpus",
            "1",
            "--",
            "uname",
            "-m",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "aarch64\n",
        "{stderr}"
    );
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("backend selected"), "{stderr}");
    assert_eq!(std::fs::read_dir(state.path()).unwrap().count(), 0);
}
