//! Raw virtio-blk disks on the selected backend (QEMU here, KVM in the nested test host): a read-only disk reads back what the host wrote and
//! refuses writes; a writable disk's writes reach the host file.

use sandbox_e2e::{boot_stock_with_disks, pseudo_random, sh, sha256_hex};
use sandbox_vmm::Disk;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_disks_read_and_write() {
    let tmp = tempfile::tempdir().unwrap();
    let ro = tmp.path().join("base.img");
    let rw = tmp.path().join("scratch.img");
    let content = pseudo_random(8 << 20, 21);
    std::fs::write(&ro, &content).unwrap();
    std::fs::File::create(&rw)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let disks = vec![
        Disk {
            path: ro.clone(),
            read_only: true,
        },
        Disk {
            path: rw.clone(),
            read_only: false,
        },
    ];
    let Some(vm) = boot_stock_with_disks(512, 1, disks).await else {
        return;
    };
    let c = &vm.sandbox.client;

    // Disks are found by their virtio serial, as the guest's init does: the order of the
    // /dev/vdX names is the machine's (x86_64 microvm and KVM name them in order, aarch64 virt
    // in reverse).
    let (ro_dev, rw_dev) = (dev_of(c, "disk0").await, dev_of(c, "disk1").await);
    let out = sh(
        c,
        &format!("cat /sys/block/{ro_dev}/size /sys/block/{ro_dev}/ro /sys/block/{rw_dev}/ro"),
    )
    .await;
    assert_eq!(out.stdout_str(), "16384\n1\n0\n");
    let back = c
        .get_file(&format!("/dev/{ro_dev}"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(sha256_hex(&back), sha256_hex(&content));

    let out = sh(
        c,
        &format!("echo x | dd of=/dev/{ro_dev} conv=fsync 2>&1; echo rc=$?"),
    )
    .await;
    assert!(
        out.stdout_str().ends_with("rc=1\n"),
        "a write to the read-only disk succeeded: {}",
        out.stdout_str()
    );

    let out = sh(c, &format!("printf 'written by the guest' | dd of=/dev/{rw_dev} bs=512 seek=3 conv=fsync 2>/dev/null; sync; echo $?")).await;
    assert_eq!(out.stdout_str(), "0\n");
    vm.sandbox.stop().await;

    let disk = std::fs::read(&rw).unwrap();
    assert_eq!(&disk[1536..1536 + 20], b"written by the guest");

    // A new VM on the same disk (the sandbox rebooted) reads back what the first one wrote.
    let disks = vec![Disk {
        path: rw.clone(),
        read_only: false,
    }];
    let Some(vm) = boot_stock_with_disks(256, 1, disks).await else {
        return;
    };
    let out = sh(
        &vm.sandbox.client,
        "dd if=/dev/vda bs=512 skip=3 count=1 2>/dev/null | head -c 20",
    )
    .await;
    assert_eq!(out.stdout_str(), "written by the guest");
    vm.sandbox.stop().await;
    assert_eq!(
        std::fs::read(&ro).unwrap(),
        content,
        "the read-only disk changed"
    );
}

/// The block device (`vda`, ...) whose virtio serial is `serial`.
async fn dev_of(c: &sandbox_protocol::client::Client, serial: &str) -> String {
    let out = sh(
        c,
        &format!(
            "for d in /sys/block/vd*; do [ \"$(cat $d/serial)\" = {serial} ] && echo ${{d##*/}}; done"
        ),
    )
    .await;
    let dev = out.stdout_str().trim().to_string();
    assert!(
        dev.starts_with("vd"),
        "no disk with serial {serial}: {out:?}"
    );
    dev
}
