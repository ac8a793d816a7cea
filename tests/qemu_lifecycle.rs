//! Stopping a VM: in the middle of an exec, nothing is left behind (no QEMU process, no socket,
//! no file), and the exec's caller learns that the channel closed.

use std::time::Duration;

use sandbox_e2e::boot_stock;
use sandbox_protocol::client::ExecEvent;
use sandbox_protocol::message::ExecRequest;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_during_exec_leaves_nothing() {
    let Some(vm) = boot_stock(512, 1).await else {
        return;
    };
    let c = &vm.sandbox.client;
    // QEMU is a process of its own; the KVM backend is threads of this one.
    let pid = vm.sandbox.vm.pid();
    if let Some(pid) = pid {
        assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    }
    // The KVM backend's threads, by name.
    let vm_threads = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
            .filter(|n| n.starts_with("vcpu") || n.starts_with("vm-"))
            .count()
    };
    if pid.is_none() {
        assert!(vm_threads() >= 3, "vCPU, device and supervisor threads");
    }
    assert!(vm.state_dir.exists());

    let mut exec = c
        .exec(&ExecRequest {
            command: Some("while true; do echo tick; done".into()),
            cwd: Some("/".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    // Wait until it is really running.
    match exec.output.next().await {
        Some(Ok(ExecEvent::Stdout(_))) => {}
        other => panic!("expected output, got {other:?}"),
    }

    let exit = vm.sandbox.stop().await;
    assert!(exit.requested, "{exit:?}");

    // The exec ends with an error, not a hang.
    let rest = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match exec.output.next().await {
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Some(e),
                None => return None,
            }
        }
    })
    .await
    .expect("the exec ends when the VM stops");
    assert!(rest.is_some_and(|e| e.to_string().contains("closed")));

    if let Some(pid) = pid {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "QEMU process {pid} is still there"
        );
    } else {
        assert_eq!(vm_threads(), 0, "the VM's threads are still there");
    }
    assert!(
        !vm.state_dir.exists(),
        "the VM's state directory (socket) is still there"
    );
    let parent = vm.state_dir.parent().unwrap();
    assert_eq!(
        std::fs::read_dir(parent).unwrap().count(),
        0,
        "files left beside the VM's state"
    );
    assert!(c.closed_reason().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_shutdown_ends_the_vm() {
    let Some(vm) = boot_stock(512, 1).await else {
        return;
    };
    vm.sandbox.client.shutdown().await.unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(60), vm.sandbox.vm.wait())
        .await
        .expect("the VM ends after shutdown");
    assert!(!exit.requested);
    assert!(
        exit.reason
            .starts_with("the guest powered off or restarted"),
        "{}",
        exit.reason
    );
    vm.sandbox.stop().await;
    assert!(!vm.state_dir.exists());
}
