//! Fork of a running sandbox (issue 35) against a cold boot, run by run on the same host, stock
//! image, same guest (512 MiB, 1 vCPU), on both backends:
//!
//! - the parent: booted, then made to hold 64 MiB of data in its memory (a file in its
//!   in-memory root) with a process running;
//! - a fork: the parent held while its snapshot is written (`snapshot_held`), let run on
//!   (`resume`), and a child restored from the copy to a ready agent with its identity set
//!   (random state, clock): what `POST /v1/sandboxes/{id}/fork` does per child, without the
//!   network process;
//! - the reference: a cold boot to a ready agent, and a cold boot that then does the parent's
//!   work (the 64 MiB), which a fork's child has without doing it.
//!
//! Then memory: the host memory (PSS, from each VM process's smaps_rollup) of ten children of
//! one fork against ten booted sandboxes that each did the same work. Each of the six parts
//! (time, forked, booted; per backend) runs in a nested host of its own where one is needed.
//!
//! Where this machine's /dev/kvm cannot run Linux, the bench runs itself inside the nested test
//! host (`tests/nested/run.sh`), where the KVM backend and QEMU with KVM run: the figures then
//! compare the ways under the same (slow, emulated) conditions. `BENCH_RUNS` sets the number of
//! runs (default 3).

use std::time::{Duration, Instant};

use sandbox_benches::{header, in_nested, pss_kib, ready, row, stats};
use sandbox_protocol::client::ExecEvent;
use sandbox_protocol::message::ExecRequest;
use sandbox_vmm::kvm::KvmBackend;
use sandbox_vmm::qemu::{QemuBackend, args};
use sandbox_vmm::{Backend, ImageStore, SnapshotFiles, VmSpec, config};

const MEMORY_MIB: u32 = 512;
/// The parent's work: 64 MiB in its memory, and a process that runs on.
/// (One random MiB written 64 times: pages of data, not zeros, for little of the emulated
/// processor's time.)
const WORK: &str = "head -c 1048576 /dev/urandom > /tmp/r && for i in $(seq 64); do cat /tmp/r; done > /tmp/data && rm /tmp/r; (sleep 100000 >/dev/null 2>&1 &); true";

fn spec_for(image: &sandbox_vmm::Image, name: &str) -> VmSpec {
    image.vm_spec(
        name.into(),
        MEMORY_MIB,
        1,
        0,
        config::state_dir().join(format!("fork-{name}-{}", std::process::id())),
    )
}

/// Runs `cmd` in the guest to its end; whether it exited 0.
async fn run(sb: &sandbox_vmm::Sandbox, cmd: &str) -> bool {
    let req = ExecRequest {
        argv: Some(vec!["/bin/sh".into(), "-c".into(), cmd.into()]),
        timeout_ms: Some(300_000),
        ..Default::default()
    };
    let Ok(mut e) = sb.client.exec(&req).await else {
        return false;
    };
    while let Some(ev) = e.output.next().await {
        match ev {
            Ok(ExecEvent::Exit(s)) => return s.exit_code == Some(0),
            Err(_) => return false,
            Ok(_) => {}
        }
    }
    false
}

/// Fresh, empty snapshot files in `dir`.
fn files_in(dir: &std::path::Path) -> SnapshotFiles {
    std::fs::create_dir_all(dir).expect("fork dir");
    let f = SnapshotFiles {
        state: dir.join("snap.state"),
        memory: dir.join("snap.mem"),
        disk: None,
        take_disk: false,
    };
    for p in [&f.state, &f.memory] {
        std::fs::File::create(p).expect("snapshot file");
    }
    f
}

/// What a part measured.
#[derive(Default)]
struct Figures {
    held: Vec<Duration>,
    fork: Vec<Duration>,
    boot: Vec<Duration>,
    boot_work: Vec<Duration>,
    failures: usize,
}

/// A parent booted and made to do [`WORK`].
async fn parent(backend: &dyn Backend, image: &sandbox_vmm::Image) -> sandbox_vmm::Sandbox {
    let tag = backend.name();
    let parent = ready(backend, spec_for(image, &format!("{tag}-parent")))
        .await
        .expect("the parent boots");
    assert!(run(&parent, WORK).await, "the parent's work");
    progress(&format!("{tag}: the parent booted and did its work"));
    parent
}

/// A line now and then: the nested host's watchdog takes a long silence for a wedge.
fn progress(what: &str) {
    println!("  .. {what}");
}

/// Forks `parent` into `files`: held, written, let go on; how long it was held.
async fn fork_into(parent: &sandbox_vmm::Sandbox, files: &SnapshotFiles) -> Option<Duration> {
    let t0 = Instant::now();
    let held = parent.snapshot_held(files).await;
    parent.resume().await.expect("the parent runs on");
    match held {
        Ok(_) => Some(t0.elapsed()),
        Err(e) => {
            println!("fork failure: {e}");
            None
        }
    }
}

fn restore(image: &sandbox_vmm::Image, name: &str, files: &SnapshotFiles) -> VmSpec {
    let mut s = spec_for(image, name);
    s.restore_from = Some(files.clone());
    s
}

/// Run by run, a fork (parent held, child to a ready agent) and a cold boot (to ready, then to
/// the parent's work done).
async fn time(
    backend: &dyn Backend,
    image: &sandbox_vmm::Image,
    runs: usize,
    tmp: &std::path::Path,
) -> Figures {
    let mut f = Figures::default();
    let tag = backend.name();
    let parent = parent(backend, image).await;
    for i in 0..runs {
        let files = files_in(&tmp.join(format!("{tag}-fork{i}")));
        let t0 = Instant::now();
        let Some(held) = fork_into(&parent, &files).await else {
            f.failures += 1;
            continue;
        };
        match ready(backend, restore(image, &format!("{tag}-c{i}"), &files)).await {
            Some(child) => {
                f.fork.push(t0.elapsed());
                f.held.push(held);
                child.stop().await;
            }
            None => f.failures += 1,
        }
        progress(&format!(
            "{tag}: fork {i} in {:?} (held {held:?})",
            t0.elapsed()
        ));
        let _ = std::fs::remove_dir_all(tmp.join(format!("{tag}-fork{i}")));
        let t0 = Instant::now();
        match ready(backend, spec_for(image, &format!("{tag}-b{i}"))).await {
            Some(sb) => {
                f.boot.push(t0.elapsed());
                if run(&sb, WORK).await {
                    f.boot_work.push(t0.elapsed());
                }
                sb.stop().await;
            }
            None => f.failures += 1,
        }
        progress(&format!(
            "{tag}: boot {i} and its work in {:?}",
            t0.elapsed()
        ));
    }
    parent.stop().await;
    f
}

/// Ten children of one fork of a parent that did the work, or ten booted sandboxes that each
/// did it: the sum of their VM processes' PSS, and how many there were.
async fn memory(
    backend: &dyn Backend,
    image: &sandbox_vmm::Image,
    forked: bool,
    tmp: &std::path::Path,
) -> (u64, usize) {
    let tag = backend.name();
    let mut vms = vec![];
    if forked {
        let parent = parent(backend, image).await;
        let files = files_in(&tmp.join(format!("{tag}-forkm")));
        fork_into(&parent, &files).await.expect("the fork");
        parent.stop().await;
        use std::os::unix::fs::MetadataExt;
        let kib = std::fs::metadata(&files.memory).map_or(0, |m| m.blocks() / 2);
        println!(
            "the copy's memory file: {kib} KiB written (held once in the page cache for all \
             the children; on KVM their PSS below counts only the pages they touched)"
        );
        for i in 0..10 {
            if let Some(sb) = ready(backend, restore(image, &format!("{tag}-m{i}"), &files)).await {
                vms.push(sb);
            }
            progress(&format!("{tag}: child {i} of the fork"));
        }
    } else {
        for i in 0..10 {
            if let Some(sb) = ready(backend, spec_for(image, &format!("{tag}-n{i}"))).await
                && run(&sb, WORK).await
            {
                vms.push(sb);
            }
            progress(&format!("{tag}: booted sandbox {i} and its work"));
        }
    }
    // Let the guests settle (the kernel's deferred work after a start).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pss = vms.iter().filter_map(|sb| sb.vm.pid()).map(pss_kib).sum();
    let n = vms.len();
    for sb in vms {
        sb.stop().await;
    }
    (pss, n)
}

/// The parts, each in a nested host of its own where it needs one (about twenty guests wedge
/// one: tests/nested/README.md).
const PARTS: [&str; 6] = [
    "kvm-time",
    "kvm-forked",
    "kvm-booted",
    "qemu-time",
    "qemu-forked",
    "qemu-booted",
];

fn main() {
    let runs = sandbox_benches::runs(3);
    let store = ImageStore::new(config::image_dir());
    let Ok(image) = store.resolve("stock") else {
        println!("skipped: no stock image; run `bash rootfs/build-stock.sh`");
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let part = std::env::var("SANDBOX_HOST_BENCH_FORK_PART").ok();
    if let Err(why) = rt.block_on(sandbox_vmm::select::kvm_usable(&store)) {
        if in_nested() {
            println!("skipped: the KVM backend cannot run in the nested host: {why}");
            return;
        }
        println!(
            "this machine's KVM cannot run Linux ({why}); running the bench in the nested test host, one part per nested host"
        );
        let mut status = 0;
        let only: Vec<&str> = PARTS
            .into_iter()
            .filter(|p| part.as_deref().is_none_or(|only| only == *p))
            .collect();
        for p in only {
            status = status.max(sandbox_benches::run_nested_with(
                runs,
                &[("SANDBOX_HOST_BENCH_FORK_PART", p)],
            ));
        }
        std::process::exit(status);
    }
    let env = if in_nested() {
        "nested test host (QEMU/TCG, emulated AMD SVM): relative figures only"
    } else {
        "native KVM"
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let parts: Vec<&str> = match &part {
        Some(p) => vec![p.as_str()],
        None => PARTS.to_vec(),
    };
    for p in parts {
        let backend: Box<dyn Backend> = if p.starts_with("kvm") {
            Box::new(KvmBackend::new().expect("KVM backend"))
        } else {
            let program = sandbox_vmm::qemu::find_qemu(args::Arch::host()).expect("QEMU");
            Box::new(QemuBackend::with(
                args::Arch::host(),
                args::Accel::Kvm,
                program,
            ))
        };
        let label = if p.starts_with("kvm") {
            "our KVM backend (children map the copy copy-on-write)"
        } else {
            "QEMU with KVM (a migration to a file; each child reads it into its own memory)"
        };
        println!("\n[{p}] stock image, {MEMORY_MIB} MiB, 1 vCPU, {env}; {label}");
        if p.ends_with("time") {
            let f = rt.block_on(time(backend.as_ref(), &image, runs, tmp.path()));
            println!("{} failed starts\n", f.failures);
            header();
            let reference = stats(&f.boot).0;
            row(
                "cold boot -> agent ready (reference)",
                &f.boot,
                Some(reference),
            );
            row(
                "cold boot -> agent ready -> the parent's work done",
                &f.boot_work,
                Some(reference),
            );
            row(
                "fork: parent held, written, let go on",
                &f.held,
                Some(reference),
            );
            row(
                "fork: request -> child's agent ready, identity set",
                &f.fork,
                Some(reference),
            );
            println!(
                "fork / cold boot = {:.3}; fork / cold boot with the work = {:.3}",
                stats(&f.fork).0 / reference,
                stats(&f.fork).0 / stats(&f.boot_work).0
            );
        } else {
            let forked = p.ends_with("forked");
            let (pss, n) = rt.block_on(memory(backend.as_ref(), &image, forked, tmp.path()));
            println!(
                "| {} | {pss:>8} KiB | {n} VMs | {:>7} KiB each |",
                if forked {
                    "ten children of one fork"
                } else {
                    "ten booted, work redone "
                },
                pss / n.max(1) as u64
            );
        }
    }
}
