//! Warm starts (issue 15): time to a ready sandbox by three ways, interleaved run by run on the
//! same host, stock image, same guest (512 MiB, 1 vCPU):
//!
//! - QEMU `-M microvm` on KVM, booting (the reference);
//! - our KVM backend, booting;
//! - our KVM backend, restored from a snapshot of a VM booted to agent-ready (the way the
//!   service's templates start sandboxes), its identity (random state, clock) set included.
//!
//! "Ready" is from asking the backend to start to the agent's `Ready` (plus, for the restore,
//! the `Identity` round trip): what a create waits for before the run's network set-up.
//! Then density: the host memory (PSS, from each VM process's smaps_rollup) of ten idle
//! sandboxes restored from one snapshot against ten booted.
//!
//! And QEMU's own snapshot (issue 15, item 5): the same QEMU command line as the QEMU backend's
//! (its agent and marker sockets replaced by a null device and a file, and a QMP socket added)
//! boots to the guest's boot marker, is migrated to a file (`migrate file:`), and new QEMUs
//! start from that file (`-incoming file:`) until QMP says the guest runs: QEMU's restore
//! against its own boot, in the same run.
//!
//! Where this machine's /dev/kvm cannot run Linux, the bench runs itself inside the nested test
//! host (`tests/nested/run.sh`), where /dev/kvm is real KVM on an emulated processor: the figures
//! then compare the three ways under the same (slow, emulated) conditions. `BENCH_RUNS` sets
//! the number of runs (default 10).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sandbox_benches::{header, in_nested, pss_kib, ready, row, run_nested, stats};
use sandbox_vmm::kvm::KvmBackend;
use sandbox_vmm::qemu::{QemuBackend, args};
use sandbox_vmm::{Backend, ImageStore, SnapshotFiles, VmSpec, config};

const MEMORY_MIB: u32 = 512;

fn spec_for(image: &sandbox_vmm::Image, name: &str) -> VmSpec {
    image.vm_spec(
        name.into(),
        MEMORY_MIB,
        1,
        0,
        config::state_dir().join(format!("{name}-{}", std::process::id())),
    )
}

/// One QEMU started outside the backend, with a QMP socket.
struct Qemu {
    child: std::process::Child,
    qmp: BufReader<UnixStream>,
}

impl Qemu {
    /// Starts `program` with the QEMU backend's arguments for `spec`, a null agent channel, the
    /// boot marker into `marker`, and QMP; `incoming` loads a migration file first.
    fn start(
        program: &Path,
        spec: &VmSpec,
        dir: &Path,
        marker: &Path,
        incoming: Option<&Path>,
    ) -> Option<Qemu> {
        let wiring = args::Wiring {
            kernel: spec.kernel.clone(),
            initrd: spec.initrd.clone(),
            agent_fd: 3,
            agent_listens: false,
            marker_fd: Some(4),
            net_fd: None,
            disk_fds: vec![],
            qmp_fd: None,
            kvm_fd: None,
            restore_fd: None,
        };
        let mut a: Vec<String> =
            args::qemu_args(args::Arch::X86_64, args::Accel::Kvm, spec, &wiring)
                .into_iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect();
        for s in a.iter_mut() {
            if s == "socket,id=agent,fd=3" {
                *s = "null,id=agent".into();
            } else if s == "socket,id=marker,fd=4" {
                *s = format!("file,id=marker,path={}", marker.display());
            }
        }
        let sock = dir.join("qmp.sock");
        let _ = std::fs::remove_file(&sock);
        a.extend([
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", sock.display()),
        ]);
        if let Some(f) = incoming {
            a.extend(["-incoming".into(), format!("file:{}", f.display())]);
        }
        let child = std::process::Command::new(program)
            .args(&a)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok()?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let stream = loop {
            if let Ok(s) = UnixStream::connect(&sock) {
                break s;
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let mut q = Qemu {
            child,
            qmp: BufReader::new(stream),
        };
        q.line()?; // the greeting
        q.call(r#"{"execute": "qmp_capabilities"}"#)?;
        Some(q)
    }

    fn line(&mut self) -> Option<String> {
        let mut l = String::new();
        match self.qmp.read_line(&mut l) {
            Ok(n) if n > 0 => Some(l),
            _ => None,
        }
    }

    /// Sends a command and returns its answer (events skipped).
    fn call(&mut self, cmd: &str) -> Option<String> {
        self.qmp.get_mut().write_all(cmd.as_bytes()).ok()?;
        self.qmp.get_mut().write_all(b"\n").ok()?;
        loop {
            let l = self.line()?;
            if !l.contains("\"event\"") {
                return Some(l);
            }
        }
    }

    /// Polls `cmd` until its answer contains `want`, for at most `within`.
    fn until(&mut self, cmd: &str, want: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            match self.call(cmd) {
                Some(a) if a.contains(want) => return true,
                Some(a) if a.contains("\"failed\"") => return false,
                Some(_) => std::thread::sleep(Duration::from_millis(1)),
                None => return false,
            }
        }
        false
    }
}

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until the guest wrote its boot marker into `marker`.
fn wait_marker(marker: &Path, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if std::fs::metadata(marker)
            .map(|m| m.len() > 0)
            .unwrap_or(false)
        {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

/// QEMU booting to the boot marker, and QEMU restored from its migration file to running,
/// `runs` times each, interleaved; and the migration file's size.
fn qemu_migration(
    program: &Path,
    spec: &VmSpec,
    runs: usize,
) -> (Vec<Duration>, Vec<Duration>, u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file: PathBuf = dir.path().join("vm.migration");
    let (mut boots, mut restores) = (vec![], vec![]);
    // The file every restore loads: a guest in userspace, migrated.
    {
        let marker = dir.path().join("marker0");
        let Some(mut q) = Qemu::start(program, spec, dir.path(), &marker, None) else {
            println!("QEMU did not start for its migration");
            return (boots, restores, 0);
        };
        if !wait_marker(&marker, Duration::from_secs(120)) {
            println!("QEMU's guest did not reach userspace for its migration");
            return (boots, restores, 0);
        }
        q.call(&format!(
            r#"{{"execute": "migrate", "arguments": {{"uri": "file:{}"}}}}"#,
            file.display()
        ));
        if !q.until(
            r#"{"execute": "query-migrate"}"#,
            "\"completed\"",
            Duration::from_secs(120),
        ) {
            println!("QEMU's migration to a file did not complete");
            return (boots, restores, 0);
        }
    }
    let size = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
    for i in 0..runs {
        let marker = dir.path().join(format!("marker-b{i}"));
        let t = Instant::now();
        if let Some(q) = Qemu::start(program, spec, dir.path(), &marker, None)
            && wait_marker(&marker, Duration::from_secs(120))
        {
            boots.push(t.elapsed());
            drop(q);
        }
        let marker = dir.path().join(format!("marker-r{i}"));
        let t = Instant::now();
        if let Some(mut q) = Qemu::start(program, spec, dir.path(), &marker, Some(&file))
            && q.until(
                r#"{"execute": "query-status"}"#,
                "\"running\"",
                Duration::from_secs(120),
            )
        {
            restores.push(t.elapsed());
        }
    }
    (boots, restores, size)
}

fn main() {
    let runs = sandbox_benches::runs(10);
    let store = ImageStore::new(config::image_dir());
    let Ok(image) = store.resolve("stock") else {
        println!("skipped: no stock image; run `bash rootfs/build-stock.sh`");
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    if let Err(why) = rt.block_on(sandbox_vmm::select::kvm_usable(&store)) {
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
    let program = sandbox_vmm::qemu::find_qemu(args::Arch::host()).expect("QEMU");
    let qemu = QemuBackend::with(args::Arch::host(), args::Accel::Kvm, program);

    // The snapshot every restore starts from: a VM booted to agent-ready, paused, written.
    let dir = tempfile::tempdir().expect("tempdir");
    let files = SnapshotFiles {
        state: dir.path().join("snap.state"),
        memory: dir.path().join("snap.mem"),
        disk: None,
        take_disk: false,
    };
    for p in [&files.state, &files.memory] {
        std::fs::File::create(p).expect("snapshot file");
    }
    let mut template = spec_for(&image, "template");
    template.snapshot_to = Some(files.clone());
    let (snapshot_ms, written) = rt.block_on(async {
        let sb = ready(&kvm, template).await.expect("the template boots");
        let done = sb.snapshot(false).await.expect("the snapshot");
        sb.stop().await;
        (
            (done.pause_us + done.write_us) as f64 / 1000.0,
            done.memory_written,
        )
    });
    let restore_spec = |name: &str| {
        let mut s = spec_for(&image, name);
        s.restore_from = Some(files.clone());
        s
    };

    let (mut q, mut k, mut r) = (vec![], vec![], vec![]);
    let mut failures = 0;
    for i in 0..runs {
        rt.block_on(async {
            for (backend, spec, out) in [
                (
                    &qemu as &dyn Backend,
                    spec_for(&image, &format!("q{i}")),
                    &mut q,
                ),
                (&kvm, spec_for(&image, &format!("k{i}")), &mut k),
                (&kvm, restore_spec(&format!("r{i}")), &mut r),
            ] {
                match ready(backend, spec).await {
                    Some(sb) => {
                        out.push(sb.boot_time);
                        sb.stop().await;
                    }
                    None => failures += 1,
                }
            }
        });
    }

    // Density: ten idle sandboxes at once, restored, then ten booted.
    let density = |restored: bool| {
        rt.block_on(async {
            let mut vms = vec![];
            for i in 0..10 {
                let spec = if restored {
                    restore_spec(&format!("dr{i}"))
                } else {
                    spec_for(&image, &format!("dc{i}"))
                };
                if let Some(sb) = ready(&kvm, spec).await {
                    vms.push(sb);
                }
            }
            // Let the guests settle (the kernel's deferred work after boot).
            tokio::time::sleep(Duration::from_secs(3)).await;
            let pss: u64 = vms.iter().filter_map(|sb| sb.vm.pid()).map(pss_kib).sum();
            let n = vms.len();
            for sb in vms {
                sb.stop().await;
            }
            (pss, n)
        })
    };
    let (pss_restored, n_restored) = density(true);
    let (pss_cold, n_cold) = density(false);
    let qemu_program = sandbox_vmm::qemu::find_qemu(args::Arch::host()).expect("QEMU");
    let (qemu_boots, qemu_restores, migration_size) =
        qemu_migration(&qemu_program, &spec_for(&image, "qm"), runs);

    let env = if in_nested() {
        "nested test host (QEMU/TCG, emulated AMD SVM): relative figures only"
    } else {
        "native KVM"
    };
    println!(
        "\nTime to a ready sandbox, stock image, {MEMORY_MIB} MiB, 1 vCPU, {env}; {failures} failed starts\n"
    );
    header();
    let reference = stats(&q).0;
    row(
        "QEMU -M microvm: boot -> agent ready (reference)",
        &q,
        Some(reference),
    );
    row("our VMM: boot -> agent ready", &k, Some(reference));
    row(
        "our VMM: restore from a snapshot -> ready, identity set",
        &r,
        Some(reference),
    );
    println!(
        "\nrestore / QEMU boot = {:.3} (the goal: at most 0.333); restore / our boot = {:.3}",
        stats(&r).0 / reference,
        stats(&r).0 / stats(&k).0
    );
    println!(
        "the snapshot: {} MiB of {MEMORY_MIB} MiB written (the rest holes), paused and written in {snapshot_ms:.1} ms",
        written >> 20
    );
    println!("\nQEMU's own snapshot (migration to a file), same QEMU, same guest:\n");
    header();
    let qemu_boot_ref = stats(&qemu_boots).0;
    row(
        "QEMU: boot -> guest userspace (boot marker, reference)",
        &qemu_boots,
        Some(qemu_boot_ref),
    );
    row(
        "QEMU: -incoming file: -> guest running again",
        &qemu_restores,
        Some(qemu_boot_ref),
    );
    println!(
        "QEMU restore / QEMU boot to userspace = {:.3}; QEMU restore / our restore to ready = {:.2}; migration file {} MiB",
        stats(&qemu_restores).0 / qemu_boot_ref,
        stats(&qemu_restores).0 / stats(&r).0,
        migration_size >> 20
    );
    println!(
        "\nDensity, ten idle sandboxes at once (sum of the VM processes' PSS):\n\
         | restored from one snapshot | {:>8} KiB | {n_restored} VMs | {:>7} KiB each |\n\
         | booted                     | {:>8} KiB | {n_cold} VMs | {:>7} KiB each |\n\
         restored / booted = {:.2}",
        pss_restored,
        pss_restored / n_restored.max(1) as u64,
        pss_cold,
        pss_cold / n_cold.max(1) as u64,
        pss_restored as f64 / pss_cold.max(1) as f64
    );
}
