//! The end-to-end suite on the KVM backend. Where this machine's /dev/kvm boots Linux, `auto`
//! already runs every e2e test on the KVM backend. Where it cannot (these development machines),
//! this test runs the e2e binaries inside the nested test host (`tests/nested/run.sh`), where
//! /dev/kvm is real KVM, with `SANDBOX_HOST_VMM=kvm`, and fails if any of them fails.
//!
//! Also here: four VMs at once, each exec'd and stopped, with no thread or fd of theirs left.

use std::path::PathBuf;

use sandbox_e2e::{boot_stock, sh};

/// The e2e test binaries run through the nested host (cargo's names, without the hash).
const SUITE: [&str; 9] = [
    "qemu_exec",
    "qemu_egress",
    "qemu_archive",
    "qemu_disk",
    "qemu_lifecycle",
    "qemu_protocol_abuse",
    "kvm_snapshot",
    "kvm_backend",
    "vm_outlive",
];

/// The names of this process's threads, but the runtime's pool threads.
fn own_threads() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
                .map(|n| n.trim().to_string())
                .filter(|n| n != "tokio-rt-worker")
                .collect()
        })
        .unwrap_or_default()
}

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

/// The two tests here count this process's fds and threads, or start a nested host whose pipes
/// are fds of this process: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
// The guard only keeps the other (synchronous) test out; nothing else takes it.
#[allow(clippy::await_holding_lock)]
async fn four_vms_at_once() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // `SANDBOX_HOST_STRESS_ROUNDS` repeats it (issue 17: the hunt for a hang of this test).
    let rounds: usize = std::env::var("SANDBOX_HOST_STRESS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    for round in 1..=rounds {
        let started = std::time::Instant::now();
        if !four_vms_round(round).await {
            return;
        }
        eprintln!(
            "four_vms_at_once: round {round} of {rounds} passed in {:.1?}",
            started.elapsed()
        );
    }
}

/// Boots four VMs at once, runs a command in each, stops them and checks that none of their
/// threads or fds is left. False if the test cannot run here (skipped).
async fn four_vms_round(round: usize) -> bool {
    // The jail's spawner thread lives as long as the process: start it before counting.
    sandbox_jail::global();
    let (threads0, fds0) = (own_threads().len(), count("/proc/self/fd"));
    let boots = (0..4).map(|_| boot_stock(256, 1));
    let vms: Vec<_> = futures_join_all(boots).await;
    if vms.iter().any(Option::is_none) {
        return false;
    }
    let vms: Vec<_> = vms.into_iter().flatten().collect();
    for (i, vm) in vms.iter().enumerate() {
        let out = sh(&vm.sandbox.client, &format!("echo vm{i}")).await;
        assert_eq!(out.stdout_str(), format!("vm{i}\n"), "round {round}");
    }
    for (i, vm) in vms.iter().enumerate() {
        sandbox_e2e::bounded(
            &format!("round {round}: stopping VM {i}"),
            vm.sandbox.stop(),
        )
        .await;
    }
    drop(vms);
    // Give the runtime a moment to drop the channel tasks of the stopped VMs.
    for _ in 0..50 {
        if count("/proc/self/fd") <= fds0 && own_threads().len() <= threads0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let fds: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .map(|p| p.display().to_string())
                .collect()
        })
        .unwrap_or_default();
    assert!(fds.len() <= fds0, "round {round}: fds left behind: {fds:?}");
    // The runtime's pool threads (`tokio-rt-worker`, which linger idle for a while after the
    // blocking calls of four starts at once) are not the VMs'; every other thread must be gone
    // (the VMs' control readers here, and their vCPU, device and supervisor threads where a VM
    // runs in this process).
    let names = own_threads();
    assert!(
        names.len() <= threads0,
        "round {round}: threads left behind: {} > {threads0}: {names:?}",
        names.len(),
    );
    true
}

async fn futures_join_all<F>(fs: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = fs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("boot task"));
    }
    out
}

/// The longest one test binary may run in the nested host.
const BINARY_LIMIT_S: u64 = 600;

/// The newest built test binary called `name-<hash>` next to this one.
fn sibling(name: &str) -> Option<PathBuf> {
    let me = std::env::current_exe().ok()?;
    let dir = me.parent()?;
    std::fs::read_dir(dir)
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

#[test]
fn e2e_suite_on_the_kvm_backend() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if std::env::var("SANDBOX_HOST_IN_NESTED").as_deref() == Ok("1") {
        return; // this is the suite's own run inside the nested host
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = sandbox_vmm::ImageStore::new(sandbox_vmm::config::image_dir());
    if store.resolve("stock").is_err() {
        sandbox_e2e::skip("no stock image; run `bash rootfs/build-stock.sh`");
        return;
    }
    match rt.block_on(sandbox_vmm::select::kvm_usable(&store)) {
        Ok(_) => {
            eprintln!(
                "this machine's KVM boots guests: `auto` runs every e2e test on the KVM backend"
            );
            return;
        }
        Err(why) => eprintln!("the KVM backend cannot run here ({why}); going one level down"),
    }
    let mut bins = Vec::new();
    for name in SUITE {
        match sibling(name) {
            Some(p) => bins.push(p),
            None => {
                sandbox_e2e::skip(&format!(
                    "the test binary {name} is not built; run `cargo test -p sandbox-e2e`"
                ));
                return;
            }
        }
    }
    // Each binary in a nested host of its own, two at a time (one emulated processor each).
    // One nested host boot runs at most about twenty KVM guests: around the 21st to 25th, the
    // emulated machine wedges (tests/nested/README.md, "Wedged"), and the whole suite boots more
    // than that. Every binary runs whatever the others did, under its own bound (its tests have
    // their own deadlines inside it), so one failure names itself and the rest still report.
    // What every nested host needs, built once before two of them start at the same time.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    for script in [
        &["guest-kernel/build.sh", "x86_64"][..],
        &["rootfs/build-stock.sh"],
    ] {
        let ok = std::process::Command::new("bash")
            .args(script)
            .current_dir(root)
            .stdout(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "bash {script:?} failed");
    }
    // Four guests at once (this binary's own test) load a nested host's one emulated processor
    // the most: beside a second nested host they once stayed stuck in boot past their 180 s
    // bound (1 run in 3). That binary runs after the others, with the machine to itself.
    let (alone, paired): (Vec<PathBuf>, Vec<PathBuf>) = bins.iter().cloned().partition(|b| {
        b.file_name()
            .is_some_and(|f| f.to_string_lossy().starts_with("kvm_backend-"))
    });
    let queue = std::sync::Mutex::new(paired);
    let results = std::sync::Mutex::new(Vec::new());
    let run = |b: &PathBuf| {
        let f = b.file_name().unwrap().to_string_lossy().into_owned();
        let cmd = format!(
            "export SANDBOX_HOST_IN_NESTED=1 SANDBOX_HOST_VMM=kvm; timeout {BINARY_LIMIT_S} ./{f} --test-threads 1 2>&1"
        );
        let limit = (BINARY_LIMIT_S + 120).to_string();
        let args: Vec<&std::ffi::OsStr> = vec![
            "--timeout".as_ref(),
            limit.as_ref(),
            "--with".as_ref(),
            b.as_os_str(),
        ];
        let (status, text, stderr) = sandbox_e2e::nested(&args, &cmd);
        results.lock().unwrap_or_else(|e| e.into_inner()).push((
            f,
            status,
            format!("{text}\n{stderr}"),
        ));
    };
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                loop {
                    let Some(b) = queue.lock().unwrap_or_else(|e| e.into_inner()).pop() else {
                        return;
                    };
                    run(&b);
                }
            });
        }
    });
    for b in &alone {
        run(b);
    }
    let results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    let failed: Vec<String> = results
        .iter()
        .filter(|(_, status, text)| {
            *status != Some(0) || !text.contains("test result: ok.") || text.contains("skipped:")
        })
        .map(|(f, status, text)| {
            format!("== {f}: status {status:?} (124: killed after {BINARY_LIMIT_S} s)\n{text}")
        })
        .collect();
    assert_eq!(results.len(), SUITE.len());
    let text = failed.join("\n");
    assert!(
        failed.is_empty(),
        "the e2e suite failed on the KVM backend (or a test skipped there):\n{text}"
    );
}
