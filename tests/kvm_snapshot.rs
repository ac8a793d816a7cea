//! Snapshots on the KVM backend (issue 15): a booted VM paused and written to files, then VMs
//! restored from those files, two at once, each running on from where the snapshot left the
//! guest, each with memory of its own (copy on write: the snapshot's file never changes); and
//! damaged snapshots refused with the reason, leaving nothing behind.
//!
//! Needs the KVM backend: where this machine's /dev/kvm cannot boot Linux, `kvm_backend` runs
//! this binary inside the nested test host.

use std::path::Path;
use std::time::{Duration, Instant};

use sandbox_e2e::{bounded, sh};
use sandbox_vmm::{SnapshotFiles, VmSpec};

const BOOT_LIMIT: Duration = Duration::from_secs(180);

/// Two empty files for a snapshot in `dir`.
fn snapshot_files(dir: &Path) -> SnapshotFiles {
    let files = SnapshotFiles {
        state: dir.join("snap.state"),
        memory: dir.join("snap.mem"),
        disk: None,
        take_disk: false,
    };
    for p in [&files.state, &files.memory] {
        std::fs::File::create(p).expect("creating a snapshot file");
    }
    files
}

fn spec(image: &sandbox_vmm::Image, dir: &Path, name: &str) -> VmSpec {
    image.vm_spec(name.into(), 256, 1, 0, dir.join(name))
}

/// The VM the others are restored from: booted with its snapshot files in `dir`.
async fn boot_original(
    backend: &dyn sandbox_vmm::Backend,
    image: &sandbox_vmm::Image,
    dir: &Path,
) -> (sandbox_vmm::Sandbox, SnapshotFiles) {
    let files = snapshot_files(dir);
    let mut original = spec(image, dir, "original");
    original.snapshot_to = Some(files.clone());
    let vm = bounded(
        "booting the original",
        sandbox_vmm::boot(backend, original, BOOT_LIMIT),
    )
    .await
    .expect("the original boots");
    (vm, files)
}

/// The KVM backend, or `None` where it is not the one selected. Not a skip: `kvm_backend` runs
/// this binary in the nested test host, where it must pass.
async fn kvm_backend() -> Option<Box<dyn sandbox_vmm::Backend>> {
    let backend = sandbox_e2e::backend().await?;
    if backend.name() != "kvm" {
        eprintln!(
            "snapshots need the KVM backend: this test runs through kvm_backend in the nested host"
        );
        return None;
    }
    Some(backend)
}

fn digest(p: &Path) -> String {
    sandbox_e2e::sha256_hex(&std::fs::read(p).expect("reading a snapshot file"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restored_vms_run_on_from_the_snapshot_each_with_its_own_memory() {
    let Some(backend) = kvm_backend().await else {
        return;
    };
    let Some(image) = sandbox_e2e::stock() else {
        return;
    };
    let tmp = tempfile::tempdir_in("/tmp").expect("tempdir");
    // The original: booted, given something to remember, snapshotted and stopped.
    let (vm, files) = boot_original(backend.as_ref(), &image, tmp.path()).await;
    let out = sh(
        &vm.client,
        "echo before > /tmp/mark; cat /proc/sys/kernel/random/boot_id",
    )
    .await;
    assert_eq!(out.status.and_then(|s| s.exit_code), Some(0), "{out:?}");
    let boot_id = out.stdout_str();
    // A snapshot that lets the guest run on: it does.
    let done = vm
        .vm
        .snapshot(true)
        .await
        .expect("a snapshot while running");
    assert!(done.memory_written > 0);
    assert_eq!(sh(&vm.client, "echo still").await.stdout_str(), "still\n");
    // The one that is restored: the guest stays paused until stopped.
    let done = vm.snapshot(false).await.expect("the snapshot");
    eprintln!(
        "snapshot of a 256 MiB guest: {} MiB written, paused in {} us, written in {} ms",
        done.memory_written >> 20,
        done.pause_us,
        done.write_us / 1000
    );
    bounded("stopping the original", vm.vm.stop(Duration::ZERO)).await;
    let memory_digest = digest(&files.memory);

    // Two VMs restored from the same files at once.
    let mut clones = Vec::new();
    for name in ["clone-a", "clone-b"] {
        let mut s = spec(&image, tmp.path(), name);
        s.restore_from = Some(files.clone());
        let t = Instant::now();
        let sandbox = bounded(
            &format!("restoring {name}"),
            sandbox_vmm::boot(backend.as_ref(), s, BOOT_LIMIT),
        )
        .await
        .unwrap_or_else(|e| panic!("{name} is restored: {e}"));
        eprintln!(
            "{name}: restored to agent ready in {:?} (the service's view: {:?})",
            t.elapsed(),
            sandbox.boot_time
        );
        clones.push(sandbox);
    }
    for c in &clones {
        let out = sh(&c.client, "cat /tmp/mark /proc/sys/kernel/random/boot_id").await;
        assert_eq!(out.status.and_then(|s| s.exit_code), Some(0), "{out:?}");
        assert_eq!(
            out.stdout_str(),
            format!("before\n{boot_id}"),
            "the guest's files and boot are those of the snapshot"
        );
    }
    // Copy on write: what one clone writes, the other does not see, and the file keeps.
    let out = sh(
        &clones[0].client,
        "echo a > /tmp/mark; head -c 8388608 /dev/zero > /tmp/fill",
    )
    .await;
    assert_eq!(out.status.and_then(|s| s.exit_code), Some(0), "{out:?}");
    assert_eq!(
        sh(&clones[1].client, "cat /tmp/mark").await.stdout_str(),
        "before\n"
    );
    assert_eq!(
        sh(&clones[0].client, "cat /tmp/mark").await.stdout_str(),
        "a\n"
    );
    for c in &clones {
        bounded("stopping a clone", c.vm.stop(Duration::ZERO)).await;
    }

    // Ten clones, one after another: each has random bytes of its own (from /dev/urandom and
    // from getrandom(2), which Python's os.urandom calls) and the host's time.
    let getrandom = sandbox_e2e::getrandom_binary().expect("tests/guest/getrandom.c is built");
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..10 {
        let mut s = spec(&image, tmp.path(), &format!("clone-{i}"));
        s.restore_from = Some(files.clone());
        let c = bounded(
            "restoring a clone",
            sandbox_vmm::boot(backend.as_ref(), s, BOOT_LIMIT),
        )
        .await
        .unwrap_or_else(|e| panic!("clone {i} is restored: {e}"));
        c.client
            .put_file("/tmp/getrandom", Some(0o755), getrandom)
            .await
            .expect("the getrandom helper is put");
        let before = std::time::SystemTime::now();
        let out = sh(
            &c.client,
            "head -c 64 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; /tmp/getrandom; date +%s",
        )
        .await;
        let after = std::time::SystemTime::now();
        let text = out.stdout_str();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{out:?}");
        for random in &lines[..2] {
            assert_eq!(random.len(), 128, "{out:?}");
            assert!(
                seen.insert(random.to_string()),
                "clone {i} read random bytes another clone read: {out:?}"
            );
        }
        let guest_s: u64 = lines[2].parse().unwrap_or(0);
        let secs =
            |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        assert!(
            secs(before).saturating_sub(1) <= guest_s && guest_s <= secs(after) + 1,
            "clone {i}'s clock says {guest_s}, the host's {}..{}",
            secs(before),
            secs(after)
        );
        bounded("stopping a clone", c.vm.stop(Duration::ZERO)).await;
    }
    assert_eq!(seen.len(), 20);
    assert_eq!(
        digest(&files.memory),
        memory_digest,
        "no clone wrote the snapshot"
    );
    for name in ["clone-a", "clone-b", "original", "clone-9"] {
        assert!(!tmp.path().join(name).exists(), "{name}'s state is removed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_snapshots_are_refused_with_the_reason_and_leave_nothing() {
    let Some(backend) = kvm_backend().await else {
        return;
    };
    let Some(image) = sandbox_e2e::stock() else {
        return;
    };
    let tmp = tempfile::tempdir_in("/tmp").expect("tempdir");
    let (vm, files) = boot_original(backend.as_ref(), &image, tmp.path()).await;
    vm.snapshot(false).await.expect("the snapshot");
    bounded("stopping the original", vm.vm.stop(Duration::ZERO)).await;

    // Damaged copies of the snapshot's files, the good ones kept for the last restore.
    let good_state = std::fs::read(&files.state).unwrap();
    let memory_len = std::fs::metadata(&files.memory).unwrap().len();
    let short_memory = tmp.path().join("short.mem");
    {
        let mut src = std::fs::File::open(&files.memory).unwrap();
        let dst = std::fs::File::create(&short_memory).unwrap();
        std::io::copy(
            &mut std::io::Read::take(&mut src, memory_len / 2),
            &mut &dst,
        )
        .unwrap();
    }
    let bad_state = tmp.path().join("bad.state");
    let restore = |name: &'static str, state: &Path, memory: &Path| {
        let mut s = spec(&image, tmp.path(), name);
        s.restore_from = Some(SnapshotFiles {
            state: state.to_path_buf(),
            memory: memory.to_path_buf(),
            disk: None,
            take_disk: false,
        });
        s
    };
    let expect_refused = |s: VmSpec, want: &'static str| {
        let backend = &backend;
        let dir = s.state_dir.clone();
        async move {
            let name = s.id.clone();
            let e = match sandbox_vmm::boot(backend.as_ref(), s, BOOT_LIMIT).await {
                Ok(_) => panic!("{name}: a damaged snapshot was restored"),
                Err(e) => e.to_string(),
            };
            assert!(e.contains(want), "{name}: {e}");
            assert!(!dir.exists(), "{name}: its state directory is removed");
        }
    };

    // A truncated memory file (it would fault the VM at the first page past its end).
    expect_refused(
        restore("short-memory", &files.state, &short_memory),
        "the memory file has",
    )
    .await;
    // A truncated state file, and one that is not a snapshot's.
    std::fs::write(&bad_state, &good_state[..good_state.len() / 2]).unwrap();
    expect_refused(
        restore("short-state", &bad_state, &files.memory),
        "unreadable",
    )
    .await;
    std::fs::write(&bad_state, b"{\"format\": 1}").unwrap();
    expect_refused(
        restore("garbage-state", &bad_state, &files.memory),
        "unreadable",
    )
    .await;
    // A snapshot of another machine: more memory.
    let mut bigger = restore("bigger", &files.state, &files.memory);
    bigger.memory_mib = 512;
    expect_refused(bigger, "256 MiB of memory, the machine has 512").await;
    // Back to the good files: restores.
    let vm = bounded(
        "restoring the intact snapshot",
        sandbox_vmm::boot(
            backend.as_ref(),
            restore("intact", &files.state, &files.memory),
            BOOT_LIMIT,
        ),
    )
    .await
    .expect("the intact snapshot restores");
    assert_eq!(sh(&vm.client, "echo ok").await.stdout_str(), "ok\n");
    bounded("stopping", vm.vm.stop(Duration::ZERO)).await;
}

/// A disk image made here from the stock image: its initramfs's files as a read-only ext4 root
/// (the same /init then boots it as it boots the guest image: an overlay with a sandbox disk).
fn small_disk_image(stock: &sandbox_vmm::Image, dir: &Path) -> Option<sandbox_vmm::Image> {
    let tree = dir.join("tree");
    std::fs::create_dir_all(&tree).ok()?;
    let initrd = stock.initrd.as_ref()?;
    let unpacked = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "cd '{}' && cpio -id < '{}' 2>/dev/null",
            tree.display(),
            initrd.display()
        ))
        .status()
        .ok()?
        .success();
    let rootfs = dir.join("rootfs.ext4");
    let mkfs = ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"]
        .into_iter()
        .find(|p| Path::new(p).exists())?;
    let made = std::process::Command::new(mkfs)
        .args(["-q", "-F", "-d"])
        .arg(&tree)
        .arg(&rootfs)
        .arg("64M")
        .status()
        .ok()?
        .success();
    (unpacked && made).then(|| sandbox_vmm::Image {
        name: "small-disk".into(),
        dir: dir.to_path_buf(),
        kernel: stock.kernel.clone(),
        initrd: stock.initrd.clone(),
        rootfs: Some(rootfs),
        kind: "disk".into(),
        agent_version: None,
        harness_version: None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_with_a_sandbox_disk_gives_each_clone_its_own_copy() {
    let Some(backend) = kvm_backend().await else {
        return;
    };
    let Some(stock) = sandbox_e2e::stock() else {
        return;
    };
    let tmp = tempfile::tempdir_in("/tmp").expect("tempdir");
    let Some(image) = small_disk_image(&stock, tmp.path()) else {
        panic!("the small disk image could not be made (cpio and mkfs.ext4 -d)");
    };
    let mut files = snapshot_files(tmp.path());
    files.disk = Some(tmp.path().join("snap.disk"));
    let mut original = image.vm_spec("original".into(), 256, 1, 128, tmp.path().join("original"));
    original.snapshot_to = Some(files.clone());
    let vm = bounded(
        "booting the disk image",
        sandbox_vmm::boot(backend.as_ref(), original, BOOT_LIMIT),
    )
    .await
    .expect("the disk image boots");
    // Written before the snapshot: partly on the disk, partly in the page cache the snapshot
    // keeps. Both must agree in every clone.
    eprintln!("disk image booted; writing");
    let probe = sh(&vm.client, "mount; df -k").await;
    eprintln!("{}", probe.stdout_str());
    let out = sh(
        &vm.client,
        "echo before > /workspace/mark; head -c 3000000 /dev/zero | tr '\\0' x > /workspace/big; sync; echo unsynced > /workspace/cached; df -k /run/sandbox/upper | tail -1",
    )
    .await;
    assert_eq!(
        out.status.and_then(|s| s.exit_code),
        Some(0),
        "{out:?} {:?}",
        vm.vm.console_tail(20)
    );
    eprintln!("written: {}", out.stdout_str());
    vm.snapshot(false).await.expect("the snapshot");
    // Paused: its disk is copied as the templates do it.
    sandbox_vmm::scratch::copy_sparse(
        &tmp.path().join("original").join("sandbox-disk.ext4"),
        files.disk.as_ref().unwrap(),
    )
    .expect("the disk is copied");
    bounded("stopping the original", vm.vm.stop(Duration::ZERO)).await;
    let disk_digest = digest(files.disk.as_ref().unwrap());

    let mut clones = Vec::new();
    for name in ["disk-a", "disk-b"] {
        let mut s = image.vm_spec(name.into(), 256, 1, 128, tmp.path().join(name));
        s.restore_from = Some(files.clone());
        clones.push(
            bounded(
                "restoring a clone with a disk",
                sandbox_vmm::boot(backend.as_ref(), s, BOOT_LIMIT),
            )
            .await
            .unwrap_or_else(|e| panic!("{name} is restored: {e}")),
        );
    }
    let read_all = "cat /workspace/mark /workspace/cached; wc -c < /workspace/big";
    for c in &clones {
        let out = sh(&c.client, read_all).await;
        assert_eq!(out.stdout_str(), "before\nunsynced\n3000000\n", "{out:?}");
    }
    // One clone writes and syncs; the other does not see it, and the saved disk is unchanged.
    let out = sh(
        &clones[0].client,
        "echo a > /workspace/mark; head -c 5000000 /dev/zero > /workspace/more; sync; echo 3 > /proc/sys/vm/drop_caches; cat /workspace/mark /workspace/cached; wc -c < /workspace/more",
    )
    .await;
    assert_eq!(out.stdout_str(), "a\nunsynced\n5000000\n", "{out:?}");
    // Read back from the disk itself, not the page cache: the clone's copy is a sound ext4.
    let out = sh(
        &clones[1].client,
        "echo 3 > /proc/sys/vm/drop_caches; cat /workspace/mark; ls /workspace/more 2>&1; wc -c < /workspace/big",
    )
    .await;
    let text = out.stdout_str() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.starts_with("before\n"), "{text}");
    assert!(text.contains("No such file"), "{text}");
    assert!(text.contains("3000000"), "{text}");
    for c in &clones {
        bounded("stopping a clone", c.vm.stop(Duration::ZERO)).await;
    }
    assert_eq!(
        digest(files.disk.as_ref().unwrap()),
        disk_digest,
        "no clone wrote the saved disk"
    );
}
