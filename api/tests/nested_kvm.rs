//! Backend selection on real KVM. With `SANDBOX_HOST_VMM=qemu` and `SANDBOX_HOST_QEMU_ACCEL=auto`,
//! a host whose /dev/kvm boots Linux gets QEMU on KVM; a host whose /dev/kvm cannot falls back to
//! TCG. With `SANDBOX_HOST_VMM=auto` (the default) a host whose /dev/kvm boots Linux gets the
//! KVM backend, else QEMU, and says why. Natively where KVM works; otherwise inside the
//! nested test host (`tests/nested/run.sh`), where /dev/kvm is real KVM on an emulated AMD SVM
//! processor.

mod common;

use std::process::Command;

use common::{bin, stock_image_missing};

/// The accelerator a `run` selected, from its `backend selected` log line.
fn selected_accel(stderr: &str) -> Option<String> {
    selected(stderr, "accel")
}

/// A field of the `backend selected` log line.
fn selected(stderr: &str, field: &str) -> Option<String> {
    let line = stderr.lines().find(|l| l.contains("backend selected"))?;
    let key = format!("{field}=");
    let at = line.find(&key)? + key.len();
    Some(
        line[at..]
            .split_whitespace()
            .next()?
            .trim_matches('"')
            .to_string(),
    )
}

/// One nested host at a time: each keeps a processor busy, and a second beside it slows both.
static ONE_NESTED_HOST: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn auto_accel_uses_kvm_where_kvm_boots_linux() {
    let _one = ONE_NESTED_HOST.lock().unwrap_or_else(|e| e.into_inner());
    if stock_image_missing() {
        return;
    }
    let native = bin()
        .env("SANDBOX_HOST_LOG", "info")
        .env("SANDBOX_HOST_VMM", "qemu")
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

    // With the default SANDBOX_HOST_VMM=auto, the KVM backend's failed proof is announced too.
    let auto = bin()
        .env("SANDBOX_HOST_LOG", "info")
        .env_remove("SANDBOX_HOST_VMM")
        .args(["run", "--memory-mib", "256", "--vcpus", "1", "--", "true"])
        .output()
        .unwrap();
    let auto_err = String::from_utf8_lossy(&auto.stderr);
    assert_eq!(auto.status.code(), Some(0), "{auto_err}");
    assert_eq!(
        selected(&auto_err, "backend").as_deref(),
        Some("qemu"),
        "{auto_err}"
    );
    // Its reason in parentheses, or, where QEMU's own warning gives the same cause (this
    // host's /dev/kvm fails both probes alike), once, in QEMU's sentence that follows.
    assert!(
        auto_err.contains("the KVM backend cannot be used (")
            || auto_err.contains(
                "the KVM backend cannot be used, so VMs run on QEMU; /dev/kvm cannot run a Linux guest here ("
            ),
        "the fallback from the KVM backend must be announced with its reason: {auto_err}"
    );

    // This host's /dev/kvm cannot boot Linux: prove the KVM path one level down.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let out = Command::new("bash")
        .arg(root.join("tests/nested/run.sh"))
        .args(["--with", env!("CARGO_BIN_EXE_sandbox-host")])
        // The KVM backend's VM process and the sandbox's network process, built beside the
        // service by `cargo build --workspace`.
        .args([
            "--with".as_ref(),
            std::path::Path::new(env!("CARGO_BIN_EXE_sandbox-host"))
                .with_file_name("sandbox-vm")
                .as_os_str(),
            "--with".as_ref(),
            std::path::Path::new(env!("CARGO_BIN_EXE_sandbox-host"))
                .with_file_name("sandbox-net")
                .as_os_str(),
            "--".as_ref(),
        ])
        .arg(
            // Through a pipe, so the logs are plain text; pipefail keeps the run's status. First
            // QEMU on KVM, then the default (auto), which must pick the KVM backend.
            "set -o pipefail; SANDBOX_HOST_VMM=qemu SANDBOX_HOST_LOG=info ./sandbox-host run --memory-mib 512 --vcpus 1 -- sh -c \
             'grep -c ^processor /proc/cpuinfo; echo nested-ok' 2>&1 | cat && echo ==auto && \
             SANDBOX_HOST_LOG=info ./sandbox-host run --memory-mib 512 --vcpus 2 -- sh -c \
             'grep -c ^processor /proc/cpuinfo; echo nested-kvm-ok' 2>&1 | cat",
        )
        .output()
        .unwrap();
    let text = nested_ran(&out);
    let (qemu, auto) = text.split_once("==auto").expect("both runs happened");
    assert_eq!(
        selected_accel(qemu).as_deref(),
        Some("kvm"),
        "auto accel did not pick KVM on a real KVM host: {text}"
    );
    assert_eq!(selected(qemu, "backend").as_deref(), Some("qemu"), "{text}");
    assert!(qemu.contains("nested-ok"), "{text}");
    assert_eq!(
        selected(auto, "backend").as_deref(),
        Some("kvm"),
        "SANDBOX_HOST_VMM=auto did not pick the KVM backend on a real KVM host: {text}"
    );
    // The nested host's console ends lines with CR LF.
    let auto = auto.replace('\r', "");
    assert!(
        auto.contains("2\nnested-kvm-ok"),
        "two vCPUs in the guest: {text}"
    );
}

/// What the nested host printed, once it is shown to have had /dev/kvm and run the command to
/// a status of 0.
fn nested_ran(out: &std::process::Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
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
    text
}

/// The newest test binary `name` beside this one (cargo's `<name>-<hash>`).
fn sibling(name: &str) -> Option<std::path::PathBuf> {
    let me = std::env::current_exe().ok()?;
    std::fs::read_dir(me.parent()?)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let f = p.file_name().and_then(|f| f.to_str()).unwrap_or("");
            f.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(|hash| !hash.contains('.') && hash.len() == 16)
        })
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
}

/// A paused sandbox across a crash and a hand-over of the service (`api_restart.rs`), which
/// only the KVM backend can pause: where this machine's /dev/kvm boots Linux that test runs on
/// it natively; here it runs in the nested test host, the service and its processes with it.
#[test]
fn a_paused_sandbox_is_kept_across_restarts_on_the_kvm_backend() {
    let _one = ONE_NESTED_HOST.lock().unwrap_or_else(|e| e.into_inner());
    if stock_image_missing() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = sandbox_vmm::ImageStore::new(sandbox_vmm::config::image_dir());
    if rt.block_on(sandbox_vmm::select::kvm_usable(&store)).is_ok() {
        eprintln!("this machine's KVM boots guests: api_restart runs the test natively");
        return;
    }
    let test = sibling("api_restart").expect("the api_restart test binary, built beside this one");
    let service = std::path::Path::new(env!("CARGO_BIN_EXE_sandbox-host"));
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let name = test.file_name().unwrap().to_string_lossy().into_owned();
    let out = Command::new("bash")
        .arg(root.join("tests/nested/run.sh"))
        .args(["--timeout", "900"])
        .arg("--with")
        .arg(&test)
        .arg("--with")
        .arg(service)
        .arg("--with")
        .arg(service.with_file_name("sandbox-vm"))
        .arg("--with")
        .arg(service.with_file_name("sandbox-net"))
        .arg("--")
        .arg(format!(
            // As root: the nested host has no service user (its one user is root), and the test
            // fails rather than skip when the KVM backend is not the one it gets.
            "export SANDBOX_HOST_IN_NESTED=1 SANDBOX_HOST_VMM=kvm SANDBOX_HOST_BIN=/work/sandbox-host; \
             unset SANDBOX_HOST_REQUIRE_E2E; \
             timeout 600 ./{name} --exact \
             a_paused_sandbox_stays_paused_across_restarts_and_resumes --nocapture 2>&1"
        ))
        .output()
        .unwrap();
    let text = nested_ran(&out);
    // Nothing skipped but the service user, which the nested host does not have.
    let skipped = text
        .lines()
        .filter(|l| l.contains("skipped:") && !l.contains("as an ordinary user"))
        .count();
    assert!(
        text.contains("test result: ok. 1 passed") && skipped == 0,
        "{text}"
    );
    eprintln!("{text}");
}
