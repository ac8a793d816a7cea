//! The aarch64 guest under emulation against the x86_64 guest, interleaved in one run on this
//! host's QEMU with TCG: what `SANDBOX_HOST_ARCH=aarch64` costs here (the figure says what the
//! tests of the aarch64 guest cost, not what a Mac with HVF gets, which runs it natively).
//!
//! Rows per architecture: start VM -> agent ready (the stock image, 4096 MiB, 2 vCPUs), the boot
//! marker (the agent's first act as PID 1), and an exec of `true` round trip. The x86_64 guest's
//! boot is the reference. `BENCH_RUNS` sets the number of runs (default 10).

use std::time::{Duration, Instant};

use sandbox_benches::{header, row, stats};
use sandbox_protocol::client::ExecEvent;
use sandbox_protocol::message::ExecRequest;
use sandbox_vmm::arch::Arch;
use sandbox_vmm::qemu::{QemuBackend, args::Accel};
use sandbox_vmm::{ImageStore, VmSpec, config};

struct Guest {
    arch: Arch,
    backend: QemuBackend,
    image: sandbox_vmm::Image,
    ready: Vec<Duration>,
    marker: Vec<Duration>,
    exec: Vec<Duration>,
}

fn spec_for(image: &sandbox_vmm::Image, name: &str) -> VmSpec {
    image.vm_spec(
        name.into(),
        4096,
        2,
        0,
        config::state_dir().join(format!("{name}-{}", std::process::id())),
    )
}

fn main() {
    let runs = sandbox_benches::runs(10);
    let mut guests = vec![];
    for arch in [Arch::X86_64, Arch::Aarch64] {
        let store = ImageStore::with_arch(config::image_dir_for(arch), arch);
        let Ok(image) = store.resolve("stock") else {
            println!(
                "skipped: no {arch} stock image in {}; run `SANDBOX_HOST_ARCH={arch} bash rootfs/build-stock.sh`",
                store.dir().display()
            );
            return;
        };
        let Ok(program) = sandbox_vmm::qemu::find_qemu(arch) else {
            println!("skipped: no {}", arch.qemu_program());
            return;
        };
        guests.push(Guest {
            arch,
            backend: QemuBackend::with(arch, Accel::Tcg, program),
            image,
            ready: vec![],
            marker: vec![],
            exec: vec![],
        });
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let req = ExecRequest {
        argv: Some(vec!["true".into()]),
        cwd: Some("/".into()),
        ..Default::default()
    };
    for i in 0..runs {
        for g in &mut guests {
            let spec = spec_for(&g.image, &format!("bench-{}-{i}", g.arch));
            rt.block_on(async {
                let sb = sandbox_vmm::boot(&g.backend, spec, Duration::from_secs(120))
                    .await
                    .expect("boot");
                g.ready.push(sb.boot_time);
                g.marker.extend(sb.vm.boot_marker());
                for _ in 0..2 {
                    let t = Instant::now();
                    let mut e = sb.client.exec(&req).await.expect("exec");
                    while let Some(ev) = e.output.next().await {
                        if let Ok(ExecEvent::Exit(_)) = ev {
                            break;
                        }
                    }
                    g.exec.push(t.elapsed());
                }
                sb.stop().await;
            });
        }
    }
    println!(
        "\nQEMU with TCG on this {} host, stock image, 4096 MiB, 2 vCPUs, interleaved\n",
        Arch::host()
    );
    header();
    let reference = stats(&guests[0].ready).0;
    for g in &guests {
        let name = match g.arch {
            Arch::X86_64 => "x86_64 (-M microvm)",
            Arch::Aarch64 => "aarch64 (-M virt)",
        };
        row(
            &format!("{name}: start VM -> agent ready"),
            &g.ready,
            Some(reference),
        );
        row(
            &format!("{name}: start VM -> boot marker"),
            &g.marker,
            Some(reference),
        );
        row(&format!("{name}: exec `true` round trip"), &g.exec, None);
    }
}
