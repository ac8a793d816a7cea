//! Boot and exec figures of the QEMU backend, interleaved with a reference in the same run:
//! bare QEMU booting the same kernel and initramfs straight to a reboot (no agent, no channel).
//!
//! Rows: bare QEMU process start → exit (reference); `sandbox-host run -- true` start → exit;
//! `sandbox-host run -- echo` start → first stdout byte; in-process boot → agent ready; exec of
//! `true` round trip on a running sandbox. `BENCH_RUNS` sets the number of runs (default 10).

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sandbox_benches::{header, row, stats};
use sandbox_protocol::client::ExecEvent;
use sandbox_protocol::message::ExecRequest;
use sandbox_vmm::config::{self, AccelSetting};
use sandbox_vmm::qemu::{QemuBackend, args};
use sandbox_vmm::{ImageStore, VmSpec};

fn sandbox_host_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SANDBOX_HOST_BIN") {
        return Some(p.into());
    }
    // This bench runs from <target>/release/deps/; the binary is in <target>/{release,debug}/.
    let exe = std::env::current_exe().ok()?;
    let target = exe.parent()?.parent()?.parent()?;
    ["release", "debug"]
        .iter()
        .map(|p| target.join(p).join("sandbox-host"))
        .find(|p| p.is_file())
}

fn time_bare_qemu(
    program: &PathBuf,
    accel: args::Accel,
    kernel: &PathBuf,
    initrd: &PathBuf,
) -> Duration {
    let accel_args: &[&str] = match accel {
        args::Accel::Kvm => &[
            "-accel",
            "kvm",
            "-cpu",
            "host",
            "-M",
            "microvm,acpi=off,isa-serial=on,rtc=off,pit=off,pic=off",
        ],
        _ => &[
            "-accel",
            "tcg",
            "-cpu",
            "max",
            "-M",
            "microvm,acpi=off,isa-serial=on,rtc=off",
        ],
    };
    let t = Instant::now();
    let st = Command::new(program)
        .args(accel_args)
        .args([
            "-m",
            "4096",
            "-smp",
            "2",
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-serial",
            "stdio",
        ])
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initrd)
        .args([
            "-append",
            "console=ttyS0 reboot=t panic=-1 quiet rdinit=/bin/busybox -- reboot -f",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("qemu runs");
    assert!(st.success(), "bare QEMU failed: {st}");
    t.elapsed()
}

fn time_run(bin: &PathBuf, argv: &[&str], first_byte: bool) -> Duration {
    let t = Instant::now();
    let mut child = Command::new(bin)
        .arg("run")
        .arg("--")
        .args(argv)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("sandbox-host runs");
    let mut out = child.stdout.take().expect("stdout");
    let mut byte = [0u8; 1];
    let mut elapsed = None;
    if first_byte {
        assert_eq!(
            out.read(&mut byte).expect("read"),
            1,
            "no output from sandbox-host run"
        );
        elapsed = Some(t.elapsed());
    }
    let mut rest = Vec::new();
    let _ = out.read_to_end(&mut rest);
    assert!(child.wait().expect("wait").success());
    elapsed.unwrap_or_else(|| t.elapsed())
}

/// The VM every row boots: the stock image, 4096 MiB, 2 vCPUs (the defaults of a sandbox).
fn spec_for(kernel: &std::path::Path, initrd: &std::path::Path, name: &str) -> VmSpec {
    VmSpec {
        id: name.into(),
        memory_mib: 4096,
        vcpus: 2,
        kernel: kernel.to_path_buf(),
        initrd: Some(initrd.to_path_buf()),
        disks: vec![],
        scratch_disk_mib: None,
        cmdline: vec![],
        state_dir: config::state_dir().join(format!("{name}-{}", std::process::id())),
        net: None,
        start_timeout: None,
        snapshot_to: None,
        restore_from: None,
        outlive: false,
    }
}

fn main() {
    let runs = sandbox_benches::runs(10);
    let store = ImageStore::new(config::image_dir());
    let Ok(image) = store.resolve("stock") else {
        println!("skipped: no stock image; run `bash rootfs/build-stock.sh`");
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let backend = rt
        .block_on(QemuBackend::new(
            AccelSetting::from_env().expect("valid accel"),
            &store,
        ))
        .expect("QEMU is installed");
    let program = sandbox_vmm::qemu::find_qemu(args::Arch::host()).expect("QEMU");
    let initrd = image
        .initrd
        .clone()
        .expect("the stock image has an initramfs");
    let bin = sandbox_host_bin();

    let (mut bare, mut run_true, mut first_byte, mut ready) = (vec![], vec![], vec![], vec![]);
    for i in 0..runs {
        bare.push(time_bare_qemu(
            &program,
            backend.accel_kind(),
            &image.kernel,
            &initrd,
        ));
        if let Some(bin) = &bin {
            run_true.push(time_run(bin, &["true"], false));
            first_byte.push(time_run(bin, &["echo", "x"], true));
        }
        let spec = spec_for(&image.kernel, &initrd, &format!("bench-{i}"));
        rt.block_on(async {
            let sb = sandbox_vmm::boot(&backend, spec, Duration::from_secs(120))
                .await
                .expect("boot");
            ready.push(sb.boot_time);
            sb.stop().await;
        });
    }

    // Exec round trips on one running sandbox.
    let mut exec_rt = vec![];
    rt.block_on(async {
        let spec = spec_for(&image.kernel, &initrd, "bench-exec");
        let sb = sandbox_vmm::boot(&backend, spec, Duration::from_secs(120))
            .await
            .expect("boot");
        let req = ExecRequest {
            argv: Some(vec!["true".into()]),
            cwd: Some("/".into()),
            ..Default::default()
        };
        for _ in 0..runs * 2 {
            let t = Instant::now();
            let mut e = sb.client.exec(&req).await.expect("exec");
            while let Some(ev) = e.output.next().await {
                if let Ok(ExecEvent::Exit(_)) = ev {
                    break;
                }
            }
            exec_rt.push(t.elapsed());
        }
        sb.stop().await;
    });

    println!(
        "\nQEMU backend, accelerator {}, stock image, 4096 MiB, 2 vCPUs\n",
        backend.accel_kind().as_str()
    );
    header();
    let reference = stats(&bare).0;
    row(
        "bare QEMU: process start -> guest init -> exit (reference)",
        &bare,
        Some(reference),
    );
    if bin.is_some() {
        row(
            "sandbox-host run -- true: start -> exit",
            &run_true,
            Some(reference),
        );
        row(
            "sandbox-host run -- echo x: start -> first stdout byte",
            &first_byte,
            Some(reference),
        );
    } else {
        println!("skipped: sandbox-host binary not found (set SANDBOX_HOST_BIN or build it)");
    }
    row(
        "in-process: start VM -> agent ready",
        &ready,
        Some(reference),
    );
    row(
        "exec `true` round trip on a running sandbox",
        &exec_rt,
        None,
    );
}
