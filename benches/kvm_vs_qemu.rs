//! The KVM backend against QEMU on KVM (`-M microvm`), interleaved in one run, same kernel, same
//! stock image, same guest size (4096 MiB, 2 vCPUs), same host. A third series runs the same
//! machine in this process, without the VM process and its jail: what the split and the jail
//! cost (issue 12), from the backend's start to the guest's first instruction and to agent
//! ready, and what the VM process itself holds in memory beyond guest RAM (from its smaps).
//!
//! Rows per backend: start → guest userspace (the boot marker: the agent's first write as PID 1
//! to I/O port 0x440, decoded by our device or by QEMU's isa-debugcon), start → agent ready, exec of `true` round trip, and the host
//! memory a running idle sandbox costs (QEMU: the process's RSS; KVM backend: this process's RSS
//! growth), guest memory the guest touched included in both.
//!
//! Where this machine's /dev/kvm cannot run Linux, the bench runs itself inside the nested test
//! host (`tests/nested/run.sh`), where /dev/kvm is real KVM on an emulated processor: the figures
//! then compare the two VMMs under the same (slow, emulated) conditions, not real-KVM speed.
//! `BENCH_RUNS` sets the number of runs (default 10).

use std::path::Path;
use std::time::{Duration, Instant};

use sandbox_benches::{header, in_nested, row, run_nested, stats};
use sandbox_protocol::client::ExecEvent;
use sandbox_protocol::message::ExecRequest;
use sandbox_vmm::kvm::KvmBackend;
use sandbox_vmm::qemu::{QemuBackend, args};
use sandbox_vmm::{Backend, ImageStore, VmSpec, config};

fn spec_for(image: &sandbox_vmm::Image, name: &str, disk: Option<&Path>) -> VmSpec {
    VmSpec {
        id: name.into(),
        memory_mib: 4096,
        vcpus: 2,
        kernel: image.kernel.clone(),
        initrd: image.initrd.clone(),
        disks: disk
            .map(|p| sandbox_vmm::Disk {
                path: p.to_path_buf(),
                read_only: true,
            })
            .into_iter()
            .collect(),
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

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The resident memory of a VM process that is not guest RAM: every mapping of its smaps but
/// the guest memory regions (anonymous mappings of 128 MiB or more; a guest has at least
/// 128 MiB and nothing else of a VMM is that large).
fn rss_without_guest_kib(pid: u32) -> Option<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let mut total = 0;
    let mut guest = false;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            // A mapping header: `start-end perms offset dev inode [path]`.
            let path = words.nth(4);
            guest = path.is_none() && b - a >= 128 << 20;
        } else if first == "Rss:" && !guest {
            total += words
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Some(total)
}

#[derive(Default)]
struct Figures {
    vmm_start: Vec<Duration>,
    rss_without_guest_kib: Vec<u64>,
    marker: Vec<Duration>,
    ready: Vec<Duration>,
    exec: Vec<Duration>,
    rss_kib: Vec<u64>,
    /// Sequential read of the disk in the guest, MB/s.
    disk_mbps: Vec<f64>,
    failures: usize,
}

/// The MB/s figure of a `dd` summary line: GNU ("..., 1.2 s, 456 MB/s") or busybox
/// ("..., 1.2 seconds, 456.7MB/s").
fn dd_rate(text: &str) -> Option<f64> {
    let line = text.lines().rev().find(|l| l.contains("copied"))?;
    let last = line.rsplit(',').next()?.trim().replace(' ', "");
    for (unit, scale) in [
        ("GB/s", 1000.0),
        ("MB/s", 1.0),
        ("kB/s", 0.001),
        ("B/s", 1e-6),
    ] {
        if let Some(v) = last.strip_suffix(unit) {
            return v.parse::<f64>().ok().map(|v| v * scale);
        }
    }
    None
}

async fn measure(
    backend: &dyn Backend,
    image: &sandbox_vmm::Image,
    name: &str,
    execs: usize,
    disk: Option<&Path>,
    f: &mut Figures,
) {
    let rss0 = rss_kib(std::process::id());
    let spec = spec_for(image, name, disk);
    let sb = match sandbox_vmm::boot(backend, spec, Duration::from_secs(300)).await {
        Ok(sb) => sb,
        Err(e) => {
            // Counted and shown, not hidden: in the nested test host a boot occasionally fails.
            println!("boot failure ({}): {e}", backend.name());
            f.failures += 1;
            return;
        }
    };
    f.ready.push(sb.boot_time);
    if let Some(v) = sb.vm.vmm_start() {
        f.vmm_start.push(v);
    }
    if let Some(kib) = sb.vm.pid().and_then(rss_without_guest_kib) {
        f.rss_without_guest_kib.push(kib);
    }
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
    if disk.is_some() {
        let req = ExecRequest {
            command: Some("dd if=/dev/vda of=/dev/null bs=1M 2>&1".into()),
            cwd: Some("/".into()),
            ..Default::default()
        };
        let t = Instant::now();
        let mut e = sb.client.exec(&req).await.expect("exec dd");
        let mut out = Vec::new();
        while let Some(ev) = e.output.next().await {
            match ev {
                Ok(ExecEvent::Stdout(b)) | Ok(ExecEvent::Stderr(b)) => out.extend_from_slice(&b),
                Ok(ExecEvent::Exit(_)) | Err(_) => break,
            }
        }
        // dd's own figure where it prints one (busybox may not); else the exec's wall time.
        let rate = dd_rate(&String::from_utf8_lossy(&out))
            .unwrap_or_else(|| (256u64 << 20) as f64 / 1e6 / t.elapsed().as_secs_f64());
        f.disk_mbps.push(rate);
    }
    let rss = match sb.vm.pid() {
        Some(pid) => rss_kib(pid),
        None => rss_kib(std::process::id()).saturating_sub(rss0),
    };
    f.rss_kib.push(rss);
    sb.stop().await;
}

fn main() {
    let runs = sandbox_benches::runs(10);
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
        run_nested(runs);
    }
    let kvm = KvmBackend::new().expect("KVM backend");
    let in_process = KvmBackend::in_process().expect("KVM backend, in this process");
    let program = sandbox_vmm::qemu::find_qemu(args::Arch::host()).expect("QEMU");
    let qemu = QemuBackend::with(args::Arch::host(), args::Accel::Kvm, program);

    // A 256 MiB disk of pseudo-random bytes, read sequentially in the first guest of each kind,
    // against reading the same (cached) file on the host.
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("disk.img");
    let mut data = vec![0u8; 256 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    std::fs::write(&disk, &data).expect("disk");
    drop(data);
    let host_read = || {
        let t = Instant::now();
        let n = std::fs::read(&disk).expect("read").len();
        n as f64 / 1e6 / t.elapsed().as_secs_f64()
    };
    host_read();
    let host_mbps = host_read();

    let (mut k, mut q, mut p) = (Figures::default(), Figures::default(), Figures::default());
    // Exec round trips and the disk read happen in the first guest of each kind that boots.
    let first = |f: &Figures| {
        if f.exec.is_empty() {
            (runs * 2, Some(disk.as_path()))
        } else {
            (0, None)
        }
    };
    for i in 0..runs {
        let (execs, d) = first(&q);
        rt.block_on(measure(&qemu, &image, &format!("q{i}"), execs, d, &mut q));
        let (execs, d) = first(&k);
        rt.block_on(measure(&kvm, &image, &format!("k{i}"), execs, d, &mut k));
        rt.block_on(measure(
            &in_process,
            &image,
            &format!("p{i}"),
            0,
            None,
            &mut p,
        ));
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
    let marker_ref = stats(&q.marker).0;
    row(
        "QEMU: start -> guest userspace (boot marker, reference)",
        &q.marker,
        Some(marker_ref),
    );
    row(
        "KVM backend: start -> guest userspace (boot marker)",
        &k.marker,
        Some(marker_ref),
    );
    let in_process_ref = stats(&p.ready).0;
    row(
        "KVM, VM in this process (no jail): start -> ready (ref)",
        &p.ready,
        Some(in_process_ref),
    );
    row(
        "KVM, jailed VM process: start -> agent ready",
        &k.ready,
        Some(in_process_ref),
    );
    let first_ref = stats(&p.vmm_start).0;
    row(
        "KVM, in this process: start -> first guest instruction",
        &p.vmm_start,
        Some(first_ref),
    );
    row(
        "KVM, jailed VM process: start -> first guest instruction",
        &k.vmm_start,
        Some(first_ref),
    );
    row("QEMU: exec `true` round trip", &q.exec, None);
    row("KVM backend: exec `true` round trip", &k.exec, None);
    let med = |v: &mut Vec<u64>| {
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    };
    println!(
        "\nboot failures: QEMU {} of {runs}, KVM backend {} of {runs}, KVM in this process {} of {runs}",
        q.failures, k.failures, p.failures
    );
    println!(
        "\nVM process memory beyond guest RAM (median smaps Rss without the guest's regions): \
         sandbox-vm {} KiB, QEMU {} KiB (Firecracker's published bar: 5 MiB)",
        med(&mut k.rss_without_guest_kib),
        med(&mut q.rss_without_guest_kib)
    );
    println!(
        "\nvirtio-blk sequential read of a 256 MiB raw disk (dd bs=1M in the guest): QEMU {:.0} MB/s, KVM backend {:.0} MB/s; the same file read on the host: {host_mbps:.0} MB/s",
        q.disk_mbps.first().copied().unwrap_or(0.0),
        k.disk_mbps.first().copied().unwrap_or(0.0),
    );
    println!(
        "\nhost memory of a running idle sandbox (median RSS, guest pages touched included): QEMU process {} KiB, KVM backend {} KiB",
        med(&mut q.rss_kib),
        med(&mut k.rss_kib)
    );
}
