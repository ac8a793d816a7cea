//! Exec in a real VM on the QEMU backend: output, exit codes, stdin, a 100 MB stream, timeouts
//! that kill the whole process group, and concurrent execs.

use sandbox_e2e::{boot_stock, collect, pseudo_random, run, sh, sha256_hex};
use sandbox_protocol::client::ExecEvent;
use sandbox_protocol::message::ExecRequest;
use sha2::Digest;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_behaves() {
    let Some(vm) = boot_stock(1024, 2).await else {
        return;
    };
    let c = &vm.sandbox.client;
    // Both backends time the guest's boot marker (the agent's first act as PID 1), which comes
    // before the agent is ready.
    let marker = vm
        .sandbox
        .vm
        .boot_marker()
        .expect("the boot marker was timed");
    assert!(
        marker <= vm.sandbox.boot_time,
        "{marker:?} > {:?}",
        vm.sandbox.boot_time
    );

    // The guest is of the architecture asked for (SANDBOX_HOST_ARCH runs this very test on the
    // aarch64 guest under emulation).
    let out = sh(c, "uname -m").await;
    assert_eq!(
        out.stdout_str().trim(),
        sandbox_vmm::arch::Arch::guest().as_str(),
        "{out:?}"
    );

    // No nested virtualisation on any backend (docs/threat-model.md, "CPUID"): the CPU shows
    // neither VMX nor SVM, and the x86_64 guest kernel, which has KVM built in (it is also the
    // nested test host's kernel), finds no hardware to run it on, so there is no /dev/kvm.
    let out = sh(
        c,
        "grep -c -w -E 'vmx|svm' /proc/cpuinfo; \
         if [ -e /dev/kvm ]; then echo kvm-device; else echo no-kvm-device; fi; \
         if [ -d /sys/module/kvm ]; then echo kvm-built-in; fi",
    )
    .await;
    let text = out.stdout_str();
    assert!(text.starts_with("0\nno-kvm-device\n"), "{text}");
    if sandbox_vmm::arch::Arch::guest() == sandbox_vmm::arch::Arch::X86_64 {
        assert!(
            text.contains("kvm-built-in"),
            "the x86_64 guest kernel has KVM: {text}"
        );
    }

    // echo, through argv (no shell)
    let out = run(
        c,
        ExecRequest {
            argv: Some(vec!["echo".into(), "hello".into(), "world".into()]),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(out.stdout, b"hello world\n");
    assert_eq!(out.status.unwrap().exit_code, Some(0));

    // a non-zero exit code and stderr, apart from stdout
    let out = sh(c, "echo out; echo err >&2; exit 42").await;
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    let st = out.status.unwrap();
    assert_eq!(
        (st.exit_code, st.signal, st.timed_out),
        (Some(42), None, false)
    );

    // a signal ends a process
    let out = sh(c, "kill -9 $$").await;
    assert_eq!(out.status.unwrap().signal, Some(9));

    // env and cwd
    let mut req = ExecRequest {
        command: Some("echo $GREETING; pwd".into()),
        cwd: Some("/tmp".into()),
        ..Default::default()
    };
    req.env.insert("GREETING".into(), "bonjour".into());
    assert_eq!(run(c, req).await.stdout, b"bonjour\n/tmp\n");

    // a missing program and a missing cwd are errors that name them
    let err = c
        .exec(&ExecRequest {
            argv: Some(vec!["/no/such/program".into()]),
            cwd: Some("/".into()),
            ..Default::default()
        })
        .await
        .unwrap()
        .output
        .next()
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.agent_code(), Some("spawn_failed"), "{err}");
    assert!(err.to_string().contains("/no/such/program"), "{err}");
    let err = c
        .exec(&ExecRequest {
            command: Some("true".into()),
            cwd: Some("/nope".into()),
            ..Default::default()
        })
        .await
        .unwrap()
        .output
        .next()
        .await
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("/nope"), "{err}");

    // stdin: 5 MB in, the same 5 MB back, while output is being read
    let input = pseudo_random(5 << 20, 7);
    let exec = c
        .exec(&ExecRequest {
            argv: Some(vec!["cat".into()]),
            stdin: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut stdin = exec.stdin.unwrap();
    let feed = input.clone();
    let writer = tokio::spawn(async move {
        for chunk in feed.chunks(100_000) {
            stdin.write(chunk).await.unwrap();
        }
        stdin.close().await.unwrap();
    });
    let out = collect(exec.output).await;
    writer.await.unwrap();
    assert_eq!(out.stdout.len(), input.len());
    assert_eq!(sha256_hex(&out.stdout), sha256_hex(&input));

    // 100 MB of stdout, byte-exact: a 1 MiB file written through the file route, printed 100 times
    let block = pseudo_random(1 << 20, 99);
    c.put_file("/tmp/block", None, &block[..]).await.unwrap();
    let mut exec = c
        .exec(&ExecRequest {
            command: Some("for i in $(seq 100); do cat /tmp/block; done".into()),
            cwd: Some("/".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut hasher = sha2::Sha256::new();
    let mut total = 0usize;
    let mut status = None;
    while let Some(ev) = exec.output.next().await {
        match ev.unwrap() {
            ExecEvent::Stdout(b) => {
                total += b.len();
                hasher.update(&b);
            }
            ExecEvent::Stderr(b) => panic!("unexpected stderr: {}", String::from_utf8_lossy(&b)),
            ExecEvent::Exit(s) => status = Some(s),
        }
    }
    let mut expected = sha2::Sha256::new();
    for _ in 0..100 {
        expected.update(&block);
    }
    assert_eq!(total, 100 << 20);
    assert_eq!(hasher.finalize(), expected.finalize());
    assert_eq!(status.unwrap().exit_code, Some(0));

    // a timeout kills the command and every process it started
    let out = run(
        c,
        ExecRequest {
            command: Some("sleep 1000 & sleep 1000 & echo started; wait".into()),
            cwd: Some("/".into()),
            timeout_ms: Some(1500),
            ..Default::default()
        },
    )
    .await;
    let st = out.status.unwrap();
    assert!(st.timed_out, "{st:?}");
    assert_eq!(st.signal, Some(9), "{st:?}");
    assert_eq!(out.stdout, b"started\n");
    let left = sh(c, "ps -o pid,comm | grep -c '[s]leep'; true").await;
    assert_eq!(
        left.stdout_str().trim(),
        "0",
        "sleep processes survived the timeout"
    );

    // 8 concurrent execs, each with 2 MB of its own output
    let mut tasks = Vec::new();
    for i in 0..8u8 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let cmd = format!(
                "head -c 2000000 /dev/zero | tr '\\0' '{}'; echo done {i} >&2",
                (b'a' + i) as char
            );
            (i, sh(&c, &cmd).await)
        }));
    }
    for t in tasks {
        let (i, out) = t.await.unwrap();
        assert_eq!(out.stdout.len(), 2_000_000, "exec {i}");
        assert!(
            out.stdout.iter().all(|&b| b == b'a' + i),
            "exec {i} got another exec's bytes"
        );
        assert_eq!(out.stderr, format!("done {i}\n").into_bytes());
        assert_eq!(out.status.unwrap().exit_code, Some(0));
    }

    // a file read back, a missing file
    let back = c
        .get_file("/tmp/block")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(back, block);
    let err = c
        .get_file("/tmp/missing")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap_err();
    assert_eq!(err.agent_code(), Some("not_found"));

    vm.sandbox.stop().await;
}
