//! The API against its own contract: schemathesis (scripts/schemathesis.sh, pinned, from PyPI)
//! sends generated requests, valid and invalid, to the real binary and checks every response
//! against docs/openapi.json: no 5xx, only documented status codes, content types, headers and
//! bodies, valid input accepted and invalid input refused. Settings: api/tests/contract/.
//!
//! Bounded: a fixed seed and 10 examples per operation, one worker, and a wall-clock limit on the
//! child. Creating a sandbox boots a VM, so the host's memory budget holds the sandbox that every
//! operation on one sandbox goes to (256 MiB) and one more of 128 MiB: any other create is
//! refused with 503 no_capacity, which the hooks check is the only 503 create gives.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{TOKEN, start, stock_image_missing};
use serde_json::{Value, json};

/// The longest the whole schemathesis run may take (it takes well under a minute here).
const RUN_LIMIT: Duration = Duration::from_secs(15 * 60);
/// Installing schemathesis and its dependencies the first time (about 30 s here).
const INSTALL_LIMIT: Duration = Duration::from_secs(10 * 60);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Runs `cmd` (its own process group) with its output in `out`, killing the group after `limit`.
/// Returns the exit code, or `None` when it was killed.
fn run_bounded(mut cmd: Command, out: &Path, limit: Duration) -> Option<i32> {
    use std::os::unix::process::CommandExt;
    let file = std::fs::File::create(out).unwrap();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .process_group(0)
        .spawn()
        .unwrap();
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st.code().unwrap_or(-1));
        }
        if t.elapsed() > limit {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn read(path: &Path) -> String {
    let mut s = String::new();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_string(&mut s))
        .unwrap();
    s
}

/// Installs schemathesis if needed; `false` (with "skipped: why") when it cannot be installed and
/// the e2e tests are not required.
fn schemathesis_installed(dir: &Path) -> bool {
    let out = dir.join("install.txt");
    let mut cmd = Command::new("bash");
    cmd.arg(root().join("scripts/schemathesis.sh"))
        .arg("--version")
        .current_dir(dir);
    let code = run_bounded(cmd, &out, INSTALL_LIMIT);
    let said = read(&out);
    match code {
        Some(0) => true,
        Some(3) | None => {
            // The script's own last line says why; pip's messages above it say more.
            let reason = said
                .lines()
                .rev()
                .find_map(|l| l.strip_prefix("[schemathesis.sh] cannot install "))
                .unwrap_or("");
            let why = format!(
                "schemathesis could not be installed by scripts/schemathesis.sh{}: {reason}\n{}",
                if code.is_none() { " in time" } else { "" },
                said.trim()
            );
            assert!(
                std::env::var("SANDBOX_HOST_REQUIRE_E2E").as_deref() != Ok("1"),
                "{why}"
            );
            eprintln!("skipped: {why}");
            false
        }
        Some(c) => panic!("scripts/schemathesis.sh --version exited {c}: {said}"),
    }
}

/// The value of a counter in Prometheus text.
fn counter(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{metrics}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_matches_the_document() {
    if stock_image_missing() {
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("sbx-contract")
        .tempdir_in("/tmp")
        .unwrap();
    if !schemathesis_installed(dir.path()) {
        return;
    }
    let mut h = start(&[
        // The sandbox below and one more of 128 MiB (each with its 96 MiB of egress memory and
        // its network process's 32 MiB); other creates get 503 no_capacity.
        ("SANDBOX_HOST_MEMORY_LIMIT_MIB", "640"),
        // A generated sandbox (time limits from 1 ms) is gone within a second or two of its end.
        ("SANDBOX_HOST_GRACE_MS", "1000"),
        ("SANDBOX_HOST_SWEEP_MS", "1000"),
        ("SANDBOX_HOST_MAX_BODY_MB", "2"),
    ]);
    let id = h
        .create(json!({"run_id": "contract", "memory_mib": 256, "vcpus": 1}))
        .await;

    let doc: Value = serde_json::from_str(include_str!("../../docs/openapi.json")).unwrap();
    let operations: usize = doc["paths"]
        .as_object()
        .unwrap()
        .values()
        .map(|item| item.as_object().unwrap().len())
        .sum();
    let contract = root().join("api/tests/contract");
    let out = dir.path().join("schemathesis.txt");
    let mut cmd = Command::new("bash");
    cmd.arg(root().join("scripts/schemathesis.sh"))
        .arg("--config-file")
        .arg(contract.join("schemathesis.toml"))
        .arg("run")
        .arg(root().join("docs/openapi.json"))
        .args(["--url", &h.url(""), "--checks", "all", "--no-color"])
        // Its own directory: hypothesis keeps files in .hypothesis where it runs.
        .current_dir(dir.path())
        .env("SANDBOX_HOST_TOKEN", TOKEN)
        .env("SANDBOX_HOST_CONTRACT_ID", &id)
        .env("SCHEMATHESIS_HOOKS", contract.join("hooks.py"))
        .env("COLUMNS", "120");
    let t = Instant::now();
    let code = run_bounded(cmd, &out, RUN_LIMIT);
    let secs = t.elapsed().as_secs();
    let report = read(&out);
    assert!(
        code.is_some(),
        "schemathesis did not finish within {RUN_LIMIT:?}; its output so far:\n{report}"
    );
    assert_eq!(
        code,
        Some(0),
        "schemathesis found responses that do not match docs/openapi.json:\n{report}"
    );
    // It ran every documented operation and reached the guest, not only the front door.
    assert!(
        report.contains(&format!("Tested: {operations}\n")),
        "not every one of the {operations} documented operations was tested:\n{report}"
    );
    let (s, m) = h.req("GET", "/metrics", vec![], &[]).await;
    assert_eq!(s, 200);
    let m = String::from_utf8_lossy(&m);
    assert!(
        counter(&m, "sandbox_host_execs_total") > 0
            && counter(&m, "sandbox_host_bytes_in_total") > 0,
        "no generated exec or upload reached the guest:\n{report}"
    );
    let cases = report
        .lines()
        .find_map(|l| {
            l.trim()
                .split_once(" generated,")
                .map(|(n, _)| n.to_string())
        })
        .unwrap_or_else(|| "?".into());
    // The sandbox above is one of the boots; the others are generated creates.
    let boots = counter(&m, "sandbox_host_boots_total");
    eprintln!(
        "contract: {operations} operations, {cases} test cases, 0 failures, {secs} s \
         (schemathesis), {boots} VMs booted"
    );
    // Its phases and summary, for the log.
    for l in report
        .lines()
        .filter(|l| !l.trim().is_empty())
        .skip_while(|l| !l.contains("Examples (in"))
    {
        eprintln!("  {l}");
    }

    // Every sandbox, the generated ones too, goes with the service.
    h.signal("TERM");
    assert_eq!(h.wait_exit(Duration::from_secs(120)), Some(0));
    assert!(common::qemu_pids_under(&h.state).is_empty());
    assert!(
        common::state_entries(&h.state).is_empty(),
        "{:?}",
        common::state_entries(&h.state)
    );
}
