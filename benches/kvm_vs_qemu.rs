//! The KVM backend against QEMU on KVM (`-M microvm`), interleaved in one run, same kernel, same
//! stock image, same guest size (4096 MiB, 2 vCPUs), same host.
//!
//! Rows per backend: start → guest userspace (the boot marker; the KVM backend only, QEMU does
//! not decode the marker port), start → agent ready, exec of `true` round trip, and the host
//! memory a running idle sandbox costs (QEMU: the process's RSS; KVM backend: this process's RSS
//! growth), guest memory the guest touched included in both.
//!
//! Where this machine's /dev/kvm cannot run Linux, the bench runs itself inside the nested test
//! host (`tests/nested/run.sh`), where /dev/kvm is real KVM on an emulated processor: the figures
//! then compare the two VMMs under the same (slow, emulated) conditions, not real-KVM speed.
//! `BENCH_RUNS` sets the number of runs (default 10).

use std::path::Path;
use std::time::{Duration, Instant};

use sandbox_benches::{header, row, stats};
use sandbox_protocol::client::ExecEvent;
use sandbox_protocol::message::ExecRequest;
use sandbox_vmm::kvm::KvmBackend;
use sandbox_vmm::qemu::{QemuBackend, args};
use sandbox_vmm::{Backend, ImageStore, VmSpec, config};

fn spec_for(image: &sandbox_vmm::Image, name: &str) -> VmSpec {
    VmSpec {
        id: name.into(),
        memory_mib: 4096,
        vcpus: 2,
        kernel: image.kernel.clone(),
        initrd: image.initrd.clone(),
        disks: vec![],
        cmdline: vec![],
        state_dir: config::state_dir().join(format!("{name}-{}", std::process::id())),
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[derive(Default)]
struct Figures {
    marker: Vec<Duration>,
    ready: Vec<Duration>,
    exec: Vec<Duration>,
    rss_kib: Vec<u64>,
}

async fn measure(
    backend: &dyn Backend,
    image: &sandbox_vmm::Image,
    name: &str,
    execs: usize,
    f: &mut Figures,
) {
    let rss0 = rss_kib(std::process::id());
    let sb = sandbox_vmm::boot(backend, spec_for(image, name), Duration::from_secs(300))
        .await
        .expect("boot");
    f.ready.push(sb.boot_time);
    if let Some(m) = sb.vm.boot_marker() {
        f.marker.push(m);
    }
    let req = ExecRequest {
        argv: Some(vec!["true".into()]),
        cwd: Some("/".into()),
        ..Default::default()
    };
    for _ in 0..execs {
        let t = Instant::now();
        let mut e = sb.client.exec(&req).await.expect("exec");
        while let Some(ev) = e.output.next().await {
            if let Ok(ExecEvent::Exit(_)) = ev {
                break;
            }
        }
        f.exec.push(t.elapsed());
    }
    let rss = match sb.vm.pid() {
        Some(pid) => rss_kib(pid),
        None => rss_kib(std::process::id()).saturating_sub(rss0),
    };
    f.rss_kib.push(rss);
    sb.stop().await;
}

fn in_nested() -> bool {
    std::env::var("SANDBOX_HOST_IN_NESTED").as_deref() == Ok("1")
}

fn main() {
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let store = ImageStore::new(config::image_dir());
    let Ok(image) = store.resolve("stock") else {
        println!("skipped: no stock image; run `bash rootfs/build-stock.sh`");
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let kvm_ok = rt.block_on(sandbox_vmm::select::kvm_usable(&store));
    if let Err(why) = &kvm_ok {
        if in_nested() {
            println!("skipped: the KVM backend cannot run in the nested host: {why}");
            return;
        }
        println!(
            "this machine's KVM cannot run Linux ({why}); running the bench in the nested test host"
        );
        let me = std::env::current_exe().expect("exe");
        let name = me.file_name().unwrap().to_string_lossy().into_owned();
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let st = std::process::Command::new("bash")
            .arg(root.join("tests/nested/run.sh"))
            .args(["--with", me.to_str().unwrap(), "--"])
            .arg(format!(
                "SANDBOX_HOST_IN_NESTED=1 BENCH_RUNS={runs} ./{name} --bench"
            ))
            .status()
            .expect("nested run");
        std::process::exit(st.code().unwrap_or(1));
    }
    let kvm = KvmBackend::new().expect("KVM backend");
    let program = sandbox_vmm::qemu::find_qemu(args::Arch::host()).expect("QEMU");
    let qemu = QemuBackend::with(args::Arch::host(), args::Accel::Kvm, program);

    let (mut k, mut q) = (Figures::default(), Figures::default());
    for i in 0..runs {
        let execs = if i == 0 { runs * 2 } else { 0 };
        rt.block_on(measure(&qemu, &image, &format!("q{i}"), execs, &mut q));
        rt.block_on(measure(&kvm, &image, &format!("k{i}"), execs, &mut k));
    }

    let env = if in_nested() {
        "nested test host (QEMU/TCG, emulated AMD SVM) — relative figures only"
    } else {
        "native KVM"
    };
    println!("\nKVM backend vs QEMU -M microvm on KVM, stock image, 4096 MiB, 2 vCPUs, {env}\n");
    header();
    let reference = stats(&q.ready).0;
    row(
        "QEMU: start -> agent ready (reference)",
        &q.ready,
        Some(reference),
    );
    row(
        "KVM backend: start -> agent ready",
        &k.ready,
        Some(reference),
    );
    row(
        "KVM backend: start -> guest userspace (boot marker)",
        &k.marker,
        Some(reference),
    );
    row("QEMU: exec `true` round trip", &q.exec, None);
    row("KVM backend: exec `true` round trip", &k.exec, None);
    let med = |v: &mut Vec<u64>| {
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    };
    println!(
        "\nhost memory of a running idle sandbox (median RSS, guest pages touched included): QEMU process {} KiB, KVM backend {} KiB",
        med(&mut q.rss_kib),
        med(&mut k.rss_kib)
    );
}
