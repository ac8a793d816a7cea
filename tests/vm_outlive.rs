//! A VM that outlives its service (issue 32), on the backend the environment selects: QEMU
//! here, the KVM backend's `sandbox-vm` in the nested host (`kvm_backend.rs` runs this binary
//! there). A first "service" (this binary again, as a child process) boots the stock image with
//! `outlive`, leaves a file and a background process in the guest, writes the VM's record and
//! exits without stopping it; this process takes the VM on again from the record
//! (`sandbox_vmm::adopt`), finds both, and stops it, after which nothing of it is left. A binary
//! of its own: the two processes' jails share one instance and one range of ids, which no other
//! test may use meanwhile.

use std::path::Path;
use std::time::Duration;

use sandbox_e2e::{backend, sh, skip, stock};
use sandbox_vmm::adopt::VmRecord;

/// Set in the child: where it writes the VM's id and record.
const CHILD: &str = "SANDBOX_E2E_OUTLIVE_RECORD";
/// The jail instance both processes use (the parent's own).
const INSTANCE: &str = "SANDBOX_E2E_OUTLIVE_INSTANCE";

fn jail(instance: &str) {
    let settings = sandbox_jail::Settings::from_env(instance).expect("the jail's settings");
    sandbox_jail::install(&settings);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_that_outlives_its_service_is_taken_on_again() {
    if let Ok(record) = std::env::var(CHILD) {
        first_service(Path::new(&record)).await;
        return;
    }
    let instance = format!("pid-{}", std::process::id());
    jail(&instance);
    let (Some(backend), Some(_)) = (backend().await, stock()) else {
        return;
    };
    if !backend.can_outlive() {
        skip(&format!(
            "the {} backend's VMs cannot outlive their service",
            backend.name()
        ));
        return;
    }
    if sandbox_jail::global().status().cgroup.is_none() {
        skip("no cgroups here: the service keeps no VM past its end without them");
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("sbx-outlive")
        .tempdir_in("/tmp")
        .unwrap();
    let record = tmp.path().join("record.json");
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_vm_that_outlives_its_service_is_taken_on_again",
            "--nocapture",
        ])
        .env(CHILD, &record)
        .env(INSTANCE, &instance)
        .status()
        .unwrap();
    assert!(child.success(), "the first service: {child}");
    let (id, rec): (String, VmRecord) =
        serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    assert!(
        Path::new(&format!("/proc/{}", rec.pid)).exists(),
        "the VM's process outlived its service"
    );
    let liveness = sandbox_vmm::Liveness::from_env().unwrap();
    let sandbox = sandbox_vmm::adopt::adopt(&id, &rec, liveness, None)
        .await
        .expect("taken on again");
    let out = sh(
        &sandbox.client,
        "cat /workspace/kept && kill -0 $(cat /workspace/bg.pid) && echo running",
    )
    .await;
    assert_eq!(out.stdout_str(), "kept\nrunning\n", "{out:?}");
    // A second adoption of the same process is refused: its ids are this process's now.
    let again = sandbox_vmm::adopt::adopt(&id, &rec, liveness, None).await;
    assert!(again.is_err(), "adopted twice");
    let exit = sandbox.stop().await;
    assert!(exit.requested, "{exit:?}");
    assert!(!rec.state_dir.exists(), "its directory is removed");
    let t = std::time::Instant::now();
    while sandbox_jail::adopt::start_time(rec.pid).ok() == Some(rec.start_time) {
        assert!(t.elapsed() < Duration::from_secs(10), "its process ended");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The child: boots a VM that may outlive it, leaves its traces, records it, and exits without
/// stopping it (no destructor runs).
async fn first_service(record: &Path) {
    jail(&std::env::var(INSTANCE).expect("the instance"));
    let backend = backend().await.expect("a backend");
    let image = stock().expect("the stock image");
    let id = format!("outlive-{}", std::process::id());
    let dir = record.parent().expect("a directory").join(&id);
    let mut spec = image.vm_spec(id.clone(), 256, 1, 0, dir);
    spec.outlive = true;
    let sandbox = sandbox_vmm::boot(backend.as_ref(), spec, Duration::from_secs(300))
        .await
        .expect("the VM boots");
    let out = sh(
        &sandbox.client,
        "echo kept > /workspace/kept && (setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $! > /workspace/bg.pid)",
    )
    .await;
    assert_eq!(
        out.status.as_ref().and_then(|s| s.exit_code),
        Some(0),
        "{out:?}"
    );
    let rec = sandbox.vm.record().expect("an outliving VM has a record");
    std::fs::write(record, serde_json::to_vec(&(id, rec)).unwrap()).unwrap();
    std::process::exit(0);
}
