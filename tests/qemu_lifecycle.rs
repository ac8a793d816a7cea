//! Stopping a VM: in the middle of an exec, nothing is left behind (no QEMU process, no socket,
//! no file), and the exec's caller learns that the channel closed. A guest that stops answering
//! (its agent frozen) or never becomes ready is stopped within its bound and reported with the
//! step and its last console lines.

use std::time::{Duration, Instant};

use sandbox_e2e::{boot_stock, boot_stock_watched, bounded, freeze_binary, sh};
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
    // Threads of a VM in this process, by name: a VM process's control reader, an in-process machine's vCPUs.
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

/// The watchdog of the tests below: a ping every second, 5 s without an answer kills the VM.
const QUICK: sandbox_vmm::Liveness = sandbox_vmm::Liveness {
    interval: Duration::from_secs(1),
    timeout: Duration::from_secs(5),
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_agent_is_killed_and_its_waiters_told_why() {
    let Some(freeze) = freeze_binary() else {
        return;
    };
    let Some(vm) = boot_stock_watched(512, 1, QUICK).await else {
        return;
    };
    let c = &vm.sandbox.client;
    bounded(
        "putting the freezer into the guest",
        c.put_file("/freeze", Some(0o755), freeze),
    )
    .await
    .unwrap();
    // A line on the guest's console, which the exit must carry.
    let out = sandbox_e2e::sh(
        c,
        "echo 'freezing the agent now' >/dev/console; /freeze stop-agent; echo started",
    )
    .await;
    assert_eq!(out.stdout_str(), "started\n", "{out:?}");
    let frozen_at = Instant::now();
    // An exec without a timeout, started as the agent freezes: it must end, not hang.
    let mut exec = bounded(
        "an exec after the freeze",
        c.exec(&ExecRequest {
            command: Some("sleep 2; echo too late".into()),
            cwd: Some("/".into()),
            ..Default::default()
        }),
    )
    .await
    .unwrap();
    let waited = bounded("the exec's end after the freeze", async {
        loop {
            match exec.output.next().await {
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Some(e),
                None => return None,
            }
        }
    })
    .await;
    let exit = bounded("the watchdog's kill", vm.sandbox.vm.wait()).await;
    let detected = frozen_at.elapsed();
    eprintln!(
        "frozen agent: VM ended {detected:.1?} after the freeze: {}",
        exit.reason
    );
    // A bound, not a speed: the freeze (1 s), a ping interval (1 s), the timeout (5 s), and room
    // for an emulated machine.
    assert!(detected < Duration::from_secs(40), "{detected:?}");
    assert!(
        exit.console
            .iter()
            .any(|l| l.contains("freezing the agent now")),
        "the exit carries the console: {:?}",
        exit.console
    );
    assert!(!exit.requested, "{exit:?}");
    assert!(
        exit.reason.contains("stopped answering")
            && exit.reason.contains("did not reply to a ping within 5s"),
        "{}",
        exit.reason
    );
    assert!(
        waited
            .as_ref()
            .is_some_and(|e| e.to_string().contains("closed")),
        "the exec ended with {waited:?}"
    );
    // Removing it (what DELETE and the sweep do) takes no longer than any other stop.
    let t = Instant::now();
    let stopped = bounded("stopping the killed VM", vm.sandbox.stop()).await;
    eprintln!("frozen agent: stop took {:.1?}", t.elapsed());
    assert_eq!(stopped.reason, exit.reason);
    assert!(!vm.state_dir.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_never_becomes_ready_is_stopped_and_reported() {
    let (Some(backend), Some(image)) = (sandbox_e2e::backend().await, sandbox_e2e::stock()) else {
        return;
    };
    let tmp = tempfile::tempdir_in("/tmp").unwrap();
    let state_dir = tmp.path().join("vm");
    let mut spec = image.vm_spec("never-ready".into(), 256, 1, 0, state_dir.clone());
    // Init is `cat` reading the console: the kernel runs, the agent never starts. loglevel=7
    // (after `quiet`) has the kernel say so on the console, which the error must carry. Under
    // TCG the kernel's clocksource watchdog finds the TSC skewed after init starts and says so in
    // five lines (seen in CI), pushing init's line out of the eight the error keeps: `tsc=unstable`
    // settles that before init, and RCU stall reports (a loaded host) are off for the same reason.
    // Only parameters the kernel knows: any other word would be an argument to `cat`.
    spec.cmdline.push("rdinit=/bin/cat".into());
    spec.cmdline.push("loglevel=7".into());
    spec.cmdline
        .extend(["tsc=unstable", "rcupdate.rcu_cpu_stall_suppress=1"].map(String::from));
    let limit = Duration::from_secs(20);
    let t = Instant::now();
    let booted = bounded(
        "a boot that never becomes ready",
        sandbox_vmm::boot_watched(backend.as_ref(), spec, limit, QUICK),
    )
    .await;
    let took = t.elapsed();
    assert!(took < limit + Duration::from_secs(20), "{took:?}");
    let Err(e) = booted else {
        panic!("a guest whose init is cat became ready");
    };
    let e = e.to_string();
    eprintln!("never ready: failed after {took:.1?}: {e}");
    assert!(e.contains("never-ready"), "the error names the VM: {e}");
    assert!(
        e.contains("not ready within 20s")
            || e.contains("did not accept the host's connection within 20s"),
        "{e}"
    );
    assert!(
        // The kernel's last words name init (`Run /bin/cat as init process`, then its argv).
        e.contains("Last console lines:") && e.contains("/bin/cat"),
        "the error carries the console: {e}"
    );
    assert!(!state_dir.exists(), "the VM's files are gone");
}

/// `kill -9` of one VM's process (QEMU, or `sandbox-vm` on the KVM backend): that VM is reported
/// dead with the signal, its caller's next exec fails instead of hanging, and another VM keeps
/// answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_one_vm_process_ends_that_vm_alone() {
    let (Some(a), Some(b)) = (boot_stock(256, 1).await, boot_stock(256, 1).await) else {
        return;
    };
    let pid = a
        .sandbox
        .vm
        .pid()
        .expect("every VM runs in a process of its own");
    assert_ne!(Some(pid), b.sandbox.vm.pid());
    assert_ne!(pid, std::process::id());
    let st = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let exit = bounded("the killed VM's end", a.sandbox.vm.wait()).await;
    assert!(!exit.requested, "{exit:?}");
    assert!(
        exit.reason.contains("killed by signal 9"),
        "the reason names the signal: {exit:?}"
    );
    let req = ExecRequest {
        command: Some("true".into()),
        cwd: Some("/".into()),
        ..Default::default()
    };
    let exited = bounded("an exec on the killed VM", async {
        match a.sandbox.client.exec(&req).await {
            Err(_) => false,
            Ok(mut e) => {
                while let Some(ev) = e.output.next().await {
                    match ev {
                        Ok(ExecEvent::Exit(_)) => return true,
                        Err(_) => return false,
                        Ok(_) => {}
                    }
                }
                false
            }
        }
    })
    .await;
    assert!(!exited, "an exec on a dead VM ran");
    let out = sh(&b.sandbox.client, "echo still-here").await;
    assert_eq!(out.stdout_str(), "still-here\n");
    a.sandbox.stop().await;
    b.sandbox.stop().await;
    assert!(!a.state_dir.exists() && !b.state_dir.exists());
}
