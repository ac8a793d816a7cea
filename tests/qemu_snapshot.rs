//! Snapshots on the QEMU backend (issue 36): a booted VM migrated to a file, then VMs started
//! from that file, two at once, each running on from where the guest was, each with its own
//! memory and random state and the host's clock; the file unchanged by them; and snapshots that
//! are damaged or of another machine refused with the reason, leaving nothing behind. The
//! service's templates on QEMU are these (api/tests/api_templates.rs tests them through the
//! API); this binary also runs on the aarch64 guest.

use std::path::Path;
use std::time::{Duration, Instant};

use sandbox_e2e::{bounded, sh};
use sandbox_vmm::{SnapshotFiles, VmSpec};

const BOOT_LIMIT: Duration = Duration::from_secs(180);

fn spec(image: &sandbox_vmm::Image, dir: &Path, name: &str) -> VmSpec {
    image.vm_spec(name.into(), 256, 1, 0, dir.join(name))
}

/// The QEMU backend, or `None` where another is selected (the KVM backend has kvm_snapshot).
async fn qemu_backend() -> Option<Box<dyn sandbox_vmm::Backend>> {
    let backend = sandbox_e2e::backend().await?;
    if backend.name() != "qemu" {
        eprintln!(
            "skipped: QEMU's snapshots need the QEMU backend; this one is {}",
            backend.name()
        );
        return None;
    }
    Some(backend)
}

fn restore_spec(
    image: &sandbox_vmm::Image,
    dir: &Path,
    name: &str,
    state: &Path,
    memory: &Path,
) -> VmSpec {
    let mut s = spec(image, dir, name);
    s.restore_from = Some(SnapshotFiles {
        state: state.to_path_buf(),
        memory: memory.to_path_buf(),
        disk: None,
        take_disk: false,
    });
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restored_vms_run_on_from_the_snapshot_and_damaged_ones_are_refused() {
    let Some(backend) = qemu_backend().await else {
        return;
    };
    let Some(image) = sandbox_e2e::stock() else {
        return;
    };
    let tmp = tempfile::tempdir_in("/tmp").expect("tempdir");
    let files = SnapshotFiles {
        state: tmp.path().join("snap.state"),
        memory: tmp.path().join("snap.mem"),
        disk: None,
        take_disk: false,
    };
    for p in [&files.state, &files.memory] {
        std::fs::File::create(p).expect("creating a snapshot file");
    }
    let mut original = spec(&image, tmp.path(), "original");
    original.snapshot_to = Some(files.clone());
    let t = Instant::now();
    let vm = bounded(
        "booting the original",
        sandbox_vmm::boot(backend.as_ref(), original, BOOT_LIMIT),
    )
    .await
    .expect("the original boots");
    let booted = t.elapsed();
    let out = sh(
        &vm.client,
        "echo before > /tmp/mark; cat /proc/sys/kernel/random/boot_id",
    )
    .await;
    assert_eq!(out.status.and_then(|s| s.exit_code), Some(0), "{out:?}");
    let boot_id = out.stdout_str();
    // QEMU holds no descriptor of the snapshot's files before the snapshot is taken (issue 30):
    // the memory file comes over its monitor with the request.
    if let Some(pid) = vm.vm.pid()
        && let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd"))
    {
        let held: Vec<_> = fds
            .flatten()
            .filter_map(|f| std::fs::read_link(f.path()).ok())
            .collect();
        assert!(
            !held.iter().any(|t| t == &files.memory || t == &files.state),
            "QEMU holds a snapshot file before any snapshot: {held:?}"
        );
        assert!(!held.is_empty(), "the listing sees QEMU's descriptors");
    } else {
        eprintln!("(QEMU's descriptors cannot be listed here: not checked)");
    }
    let done = bounded("the snapshot", vm.snapshot(false))
        .await
        .expect("the snapshot");
    assert!(done.memory_written > 0, "{done:?}");
    eprintln!(
        "snapshot of a 256 MiB guest: {} MiB written in {} ms, the guest stopped for {} us",
        done.memory_written >> 20,
        done.write_us / 1000,
        done.pause_us
    );
    // A guest its snapshot left stopped takes no other (the file it wrote is left as it is).
    let again = vm.snapshot(false).await.expect_err("a second snapshot");
    assert!(again.to_string().contains("stands stopped"), "{again}");
    bounded("stopping the original", vm.vm.stop(Duration::ZERO)).await;
    let memory_digest = sandbox_e2e::sha256_hex(&std::fs::read(&files.memory).unwrap());

    // Two VMs from the same file at once, each a machine of its own.
    let mut clones = Vec::new();
    for name in ["clone-a", "clone-b"] {
        let s = restore_spec(&image, tmp.path(), name, &files.state, &files.memory);
        let t = Instant::now();
        let c = bounded(
            &format!("restoring {name}"),
            sandbox_vmm::boot(backend.as_ref(), s, BOOT_LIMIT),
        )
        .await
        .unwrap_or_else(|e| panic!("{name} is restored: {e}"));
        eprintln!(
            "{name}: restored to agent ready in {:?}; the original booted in {booted:?}",
            t.elapsed()
        );
        clones.push(c);
    }
    let mut seen = std::collections::BTreeSet::new();
    for c in &clones {
        let before = std::time::SystemTime::now();
        let out = sh(
            &c.client,
            "cat /tmp/mark /proc/sys/kernel/random/boot_id; head -c 64 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; date +%s",
        )
        .await;
        let after = std::time::SystemTime::now();
        assert_eq!(out.status.and_then(|s| s.exit_code), Some(0), "{out:?}");
        let text = out.stdout_str();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert_eq!(
            format!("{}\n{}\n", lines[0], lines[1]),
            format!("before\n{boot_id}"),
            "the guest's files and boot are those of the snapshot"
        );
        assert!(
            lines[2].len() == 128 && seen.insert(lines[2].to_string()),
            "each clone has random bytes of its own: {text}"
        );
        let guest: u64 = lines[3].parse().unwrap_or(0);
        let secs =
            |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        assert!(
            secs(before).saturating_sub(1) <= guest && guest <= secs(after) + 1,
            "the clone's clock says {guest}, the host's {}..{}",
            secs(before),
            secs(after)
        );
    }
    let out = sh(&clones[0].client, "echo a > /tmp/mark").await;
    assert_eq!(out.status.and_then(|s| s.exit_code), Some(0), "{out:?}");
    assert_eq!(
        sh(&clones[1].client, "cat /tmp/mark").await.stdout_str(),
        "before\n"
    );
    for c in &clones {
        bounded("stopping a clone", c.vm.stop(Duration::ZERO)).await;
    }
    assert_eq!(
        sandbox_e2e::sha256_hex(&std::fs::read(&files.memory).unwrap()),
        memory_digest,
        "no clone wrote the snapshot"
    );

    // Refused: a snapshot of another machine (by its state file, before QEMU reads anything),
    // a state file that is not one, and a truncated memory file (QEMU's own check).
    let expect_refused = |s: VmSpec, want: &'static str| {
        let backend = &backend;
        let dir = s.state_dir.clone();
        async move {
            let name = s.id.clone();
            let e = match sandbox_vmm::boot(backend.as_ref(), s, BOOT_LIMIT).await {
                Ok(_) => panic!("{name}: a bad snapshot was restored"),
                Err(e) => e.to_string(),
            };
            assert!(e.contains(want), "{name}: {e}");
            assert!(!dir.exists(), "{name}: its state directory is removed");
        }
    };
    let mut bigger = restore_spec(&image, tmp.path(), "bigger", &files.state, &files.memory);
    bigger.memory_mib = 512;
    expect_refused(bigger, "another machine").await;
    let bad_state = tmp.path().join("bad.state");
    std::fs::write(&bad_state, b"{\"format\": 1}").unwrap();
    expect_refused(
        restore_spec(
            &image,
            tmp.path(),
            "garbage-state",
            &bad_state,
            &files.memory,
        ),
        "not a snapshot",
    )
    .await;
    let short = tmp.path().join("short.mem");
    let bytes = std::fs::read(&files.memory).unwrap();
    std::fs::write(&short, &bytes[..bytes.len() / 2]).unwrap();
    expect_refused(
        restore_spec(&image, tmp.path(), "short-memory", &files.state, &short),
        "load of migration failed",
    )
    .await;
    for name in ["original", "clone-a", "clone-b"] {
        assert!(!tmp.path().join(name).exists(), "{name}'s state is removed");
    }
}
