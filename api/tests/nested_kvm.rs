//! The QEMU backend on real KVM: with `SANDBOX_HOST_QEMU_ACCEL=auto`, a host whose /dev/kvm boots
//! Linux gets KVM (and runs work on it); a host whose /dev/kvm cannot falls back to TCG. Natively
//! where KVM works; otherwise inside the nested test host (`tests/nested/run.sh`), where /dev/kvm
//! is real KVM on an emulated AMD SVM processor.

mod common;

use std::process::Command;

use common::{bin, stock_image_missing};

/// The accelerator a `run` selected, from its `backend selected` log line.
fn selected_accel(stderr: &str) -> Option<String> {
    let line = stderr.lines().find(|l| l.contains("backend selected"))?;
    let at = line.find("accel=")? + "accel=".len();
    Some(
        line[at..]
            .split_whitespace()
            .next()?
            .trim_matches('"')
            .to_string(),
    )
}

#[test]
fn auto_accel_uses_kvm_where_kvm_boots_linux() {
    if stock_image_missing() {
        return;
    }
    let native = bin()
        .env("SANDBOX_HOST_LOG", "info")
        .env("SANDBOX_HOST_QEMU_ACCEL", "auto")
        .args(["run", "--memory-mib", "256", "--vcpus", "1", "--", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&native.stderr);
    assert_eq!(native.status.code(), Some(0), "{stderr}");
    let accel = selected_accel(&stderr).expect("a `backend selected` line");
    if accel == "kvm" {
        eprintln!("native /dev/kvm boots Linux: the QEMU backend runs on KVM here");
        return;
    }
    assert_eq!(accel, "tcg", "{stderr}");
    assert!(
        stderr.contains("QEMU emulates the processor (tcg)"),
        "the fallback must be announced: {stderr}"
    );

    // This host's /dev/kvm cannot boot Linux: prove the KVM path one level down.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let out = Command::new("bash")
        .arg(root.join("tests/nested/run.sh"))
        .args(["--with", env!("CARGO_BIN_EXE_sandbox-host"), "--"])
        .arg(
            // Through a pipe, so the logs are plain text; pipefail keeps the run's status.
            "set -o pipefail; SANDBOX_HOST_LOG=info ./sandbox-host run --memory-mib 512 --vcpus 1 -- sh -c \
             'grep -c ^processor /proc/cpuinfo; echo nested-ok' 2>&1 | cat",
        )
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("NESTED-START kvm=yes"),
        "the nested host has no /dev/kvm: {text}"
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        selected_accel(&text).as_deref(),
        Some("kvm"),
        "auto did not pick KVM on a real KVM host: {text}"
    );
    assert!(text.contains("nested-ok"), "{text}");
}
