//! The full guest image (issue 6), end to end: `rootfs/build-guest.py` builds it from a clean
//! layer cache into a fresh image store, a real VM boots it on the selected backend, the agent's
//! tools run, /workspace takes 1 GiB while the sandbox's host disk file grows by about that and
//! no more, a full disk gives the guest ENOSPC and the sandbox keeps answering, and a rebuild
//! never lets a reader see half an image.
//!
//! Slow (a Debian bootstrap and the npm installs: several minutes cold), so it runs where the
//! build can: as root on Linux with debootstrap and the network to Debian, PyPI and npm. CI runs
//! it. The downloads (Debian packages, wheels, npm tarballs) are shared with the operator's
//! cache so a CI run does not fetch them again; every layer is built afresh.

#[allow(dead_code)]
mod support;

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sandbox_vmm::{ImageStore, config};
use support::{TestVm, boot_image, sh, skip};

const IMAGE: &str = "vantik-guest:latest";

/// The tests here each take minutes of both cores (a build, a nested host): one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Runs the image build; returns how long it took.
fn build(config_file: &Path, store: &Path, cache: &Path) -> Duration {
    let downloads = config::cache_dir().join("guest");
    let t = Instant::now();
    let status = Command::new("python3")
        .arg(repo().join("rootfs/build-guest.py"))
        .arg("--config")
        .arg(config_file)
        .arg("--store")
        .arg(store)
        .arg("--cache")
        .arg(cache)
        .arg("--download-cache")
        .arg(&downloads)
        .status()
        .expect("python3 runs");
    assert!(status.success(), "the guest image build failed: {status}");
    t.elapsed()
}

/// Bytes the host file actually holds (it is sparse).
fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

async fn ok(vm: &TestVm, command: &str) -> String {
    let out = sh(&vm.sandbox.client, command).await;
    let status = out.status.as_ref().expect("exit status");
    assert_eq!(
        status.exit_code,
        Some(0),
        "`{command}` failed: {status:?}\nstdout: {}\nstderr: {}",
        out.stdout_str(),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout_str()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_image_builds_boots_and_grows_to_its_disk() {
    let _one_at_a_time = SERIAL.lock().await;
    // The owner of /proc/self is this process's effective user.
    if std::fs::metadata("/proc/self").unwrap().uid() != 0 {
        skip("building the guest image needs root (debootstrap, chroot, mounts)");
        return;
    }
    if which("debootstrap").is_none() {
        skip("debootstrap is missing; run `bash scripts/install-deps.sh`");
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("guest-image-test")
        .tempdir_in(config::cache_dir())
        .unwrap();
    let (store_dir, cache) = (tmp.path().join("images"), tmp.path().join("layers"));
    let cfg = repo().join("rootfs/guest/image.toml");
    let cold = build(&cfg, &store_dir, &cache);
    let store = ImageStore::new(&store_dir);
    let image = store
        .resolve(IMAGE)
        .expect("the build tagged vantik-guest:latest");
    let rootfs = image.rootfs.clone().expect("a disk image");
    println!(
        "figures: build from a clean layer cache {:.0} s; rootfs.ext4 {} MiB file, {} MiB allocated",
        cold.as_secs_f64(),
        std::fs::metadata(&rootfs).unwrap().len() >> 20,
        allocated(&rootfs) >> 20
    );
    let again = build(&cfg, &store_dir, &cache);
    println!(
        "figures: rebuild with nothing changed {:.1} s",
        again.as_secs_f64()
    );

    // Boot it with the product's default disk limit and run the agent's tools.
    let t = Instant::now();
    let Some(vm) = boot_image(&image, 4096, 2, 20480, vec![]).await else {
        return;
    };
    let boot = t.elapsed();
    let disk = vm.state_dir.join("sandbox-disk.ext4");
    let after_boot = allocated(&disk);
    println!(
        "figures: full image ready in {} ms; sandbox disk right after boot: {} KiB of {} MiB",
        boot.as_millis(),
        after_boot >> 10,
        std::fs::metadata(&disk).unwrap().len() >> 20
    );
    // The stock image on the same backend, for comparison.
    if let Ok(stock) = ImageStore::new(config::image_dir()).resolve("stock") {
        let t = Instant::now();
        if let Some(s) = boot_image(&stock, 4096, 2, 0, vec![]).await {
            println!(
                "figures: stock image ready in {} ms on the same backend",
                t.elapsed().as_millis()
            );
            s.sandbox.stop().await;
        }
    }
    let pi = image.harness_version.clone().expect("harness version");
    check_tools(&vm, &pi).await;
    let df = ok(&vm, "df -m /workspace | tail -n 1").await;
    let size_mib: u64 = df.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(
        size_mib > 19_000,
        "/workspace should grow to the 20 GiB disk: {df}"
    );

    // 1 GiB into /workspace: the host file grows by about that, and no more.
    let before = allocated(&disk);
    ok(
        &vm,
        "dd if=/dev/zero of=/workspace/big bs=1M count=1024 conv=fsync 2>/dev/null && sync",
    )
    .await;
    let grown = allocated(&disk) - before;
    println!(
        "figures: 1024 MiB written in the guest, host disk file grew {} MiB",
        grown >> 20
    );
    assert!(
        (1024 << 20..=(1024 + 96) << 20).contains(&grown),
        "the host file grew {grown} bytes for 1 GiB written"
    );
    vm.sandbox.stop().await;
    assert!(
        !vm.state_dir.exists(),
        "the sandbox disk is removed with the VM"
    );

    // A small disk fills up: ENOSPC in the guest, and the sandbox keeps answering.
    let Some(vm) = boot_image(&image, 1024, 1, 256, vec![]).await else {
        return;
    };
    let out = sh(
        &vm.sandbox.client,
        "dd if=/dev/zero of=/workspace/fill bs=1M count=1024 2>&1; echo rc=$?",
    )
    .await;
    let text = out.stdout_str();
    assert!(text.contains("No space left on device"), "{text}");
    assert!(!text.contains("rc=0"), "{text}");
    assert_eq!(ok(&vm, "echo still here").await, "still here\n");
    assert_eq!(
        ok(
            &vm,
            "rm /workspace/fill && echo again > /workspace/x && cat /workspace/x"
        )
        .await,
        "again\n"
    );
    let disk = vm.state_dir.join("sandbox-disk.ext4");
    assert!(allocated(&disk) <= 256 << 20);
    vm.sandbox.stop().await;

    rebuild_while_resolving(&cfg, &store_dir, &cache).await;
}

/// Every tool of the image runs and is the version `image.toml` pins.
async fn check_tools(vm: &TestVm, pi: &str) {
    for (command, expect) in [
        ("node -e 'console.log(6 * 7)'", "42".to_string()),
        ("npm --version", String::new()),
        ("python3 -c 'print(6 * 7)'", "42".into()),
        ("uv --version", "uv ".into()),
        ("rg --version", "ripgrep".into()),
        ("fd --version", "fd".into()),
        ("echo '{\"a\":[1,2]}' | jq -c .a", "[1,2]".into()),
        ("sg --version", "ast-grep".into()),
        ("tsc --version", "Version 5.9.3".into()),
        ("typescript-language-server --version", String::new()),
        ("pyright --version", "pyright 1.1.414".into()),
        // pi prints its version on stderr.
        ("pi --version 2>&1", pi.to_string()),
        ("cat /opt/vantik/pi-version", pi.to_string()),
        ("ssh -V 2>&1", "OpenSSH".into()),
        ("curl --version", "curl".into()),
        (
            "cd /workspace && mkdir repo && cd repo && git init -q && echo hi > a && git add a \
             && git commit -qm first && git log --oneline | wc -l",
            "1".into(),
        ),
    ] {
        let out = ok(vm, command).await;
        assert!(
            out.contains(&expect),
            "`{command}` printed {out:?}, expected {expect:?}"
        );
        println!("guest: {command} -> {}", out.lines().next().unwrap_or(""));
    }
}

/// The guest image of the guest architecture (`SANDBOX_HOST_ARCH`: the arm64 image, under
/// emulation, in bin/test's aarch64 run), as bin/test builds it into that architecture's image
/// store: it boots on the selected backend, is that architecture, and carries every tool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_image_of_the_guest_arch_has_every_tool() {
    let _one_at_a_time = SERIAL.lock().await;
    let arch = sandbox_vmm::arch::Arch::guest();
    let store = ImageStore::new(config::image_dir());
    let Ok(image) = store.resolve(IMAGE) else {
        let why = format!(
            "no {arch} vantik-guest:latest in the image store {}; build it with `sudo python3 rootfs/build-guest.py --arch {arch}`",
            store.dir().display()
        );
        let root = std::fs::metadata("/proc/self").unwrap().uid() == 0;
        assert!(
            !(root && std::env::var("SANDBOX_HOST_REQUIRE_E2E").as_deref() == Ok("1")),
            "{why} (bin/test builds it as root)"
        );
        skip(&why);
        return;
    };
    let t = Instant::now();
    let Some(vm) = boot_image(&image, 2048, 2, 4096, vec![]).await else {
        return;
    };
    println!(
        "figures: {arch} guest image ready in {} ms",
        t.elapsed().as_millis()
    );
    assert_eq!(ok(&vm, "uname -m").await.trim(), arch.as_str());
    let recorded = ok(&vm, "cat /opt/vantik/image.json").await;
    assert!(
        recorded.contains(&format!("\"arch\": \"{arch}\"")),
        "{recorded}"
    );
    let pi = image.harness_version.clone().expect("harness version");
    check_tools(&vm, &pi).await;
    vm.sandbox.stop().await;
    assert!(!vm.state_dir.exists());
}

/// A rebuild with a changed config, while readers resolve the tag and a sandbox boots: every
/// resolution is a whole image (manifest, kernel, initramfs, a rootfs whose size and ext4 magic
/// are right), and the sandbox that started during the build works.
async fn rebuild_while_resolving(cfg: &Path, store_dir: &Path, cache: &Path) {
    let changed = cache.join("image-changed.toml");
    let text = std::fs::read_to_string(cfg).unwrap().replace(
        "commands = [",
        "commands = [\n  \"echo rebuilt > /etc/vantik-rebuilt\",",
    );
    std::fs::write(&changed, text).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(AtomicUsize::new(0));
    let reader = {
        let (done, seen, store) = (done.clone(), seen.clone(), ImageStore::new(store_dir));
        std::thread::spawn(move || {
            let mut dirs = std::collections::BTreeSet::new();
            while !done.load(Ordering::SeqCst) {
                let img = store
                    .resolve(IMAGE)
                    .expect("the tag always resolves to a whole image");
                let rootfs = img.rootfs.clone().unwrap();
                let f = std::fs::File::open(&rootfs).expect("rootfs opens");
                let mut magic = [0u8; 2];
                f.read_exact_at(&mut magic, 1080)
                    .expect("superblock readable");
                assert_eq!(
                    magic,
                    [0x53, 0xef],
                    "{} is an ext4 file system",
                    rootfs.display()
                );
                assert!(img.kernel.is_file() && img.initrd.as_ref().unwrap().is_file());
                dirs.insert(img.dir);
                seen.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
            }
            dirs
        })
    };
    let builder = {
        let (changed, store_dir, cache) = (changed.clone(), store_dir.to_owned(), cache.to_owned());
        std::thread::spawn(move || build(&changed, &store_dir, &cache))
    };
    // One build per image and store at a time: a second one is refused and says why.
    std::thread::sleep(Duration::from_secs(3));
    let second = Command::new("python3")
        .arg(repo().join("rootfs/build-guest.py"))
        .arg("--config")
        .arg(&changed)
        .arg("--store")
        .arg(store_dir)
        .arg("--cache")
        .arg(cache)
        .output()
        .expect("python3 runs");
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "a concurrent build ran: {err}");
    assert!(err.contains("another build of vantik-guest"), "{err}");
    // A sandbox created while the build runs gets the old image or the new one, whole.
    let image = ImageStore::new(store_dir).resolve(IMAGE).unwrap();
    if let Some(vm) = boot_image(&image, 1024, 1, 1024, vec![]).await {
        let pi = image.harness_version.clone().unwrap();
        assert_eq!(ok(&vm, "cat /opt/vantik/pi-version").await.trim(), pi);
        vm.sandbox.stop().await;
    }
    let warm = builder.join().expect("build thread");
    // Let the readers see the swapped tag too.
    std::thread::sleep(Duration::from_millis(300));
    done.store(true, Ordering::SeqCst);
    let dirs = reader.join().expect("every resolution was a whole image");
    println!(
        "figures: warm rebuild (cached base, changed config) {:.0} s; {} resolutions during it saw {} image(s)",
        warm.as_secs_f64(),
        seen.load(Ordering::SeqCst),
        dirs.len()
    );
    assert!(seen.load(Ordering::SeqCst) > 10);
    let new = ImageStore::new(store_dir).resolve(IMAGE).unwrap();
    assert_ne!(new.dir, image.dir, "the changed config made a new build");
    assert!(new.dir.join("rootfs.ext4").is_file());
    assert_eq!(
        dirs.len(),
        2,
        "readers saw the old image, then the new one: {dirs:?}"
    );
    assert!(dirs.contains(&new.dir));
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// The guest image on the KVM backend: natively where /dev/kvm boots Linux, else inside the
/// nested test host with the operator's `vantik-guest:latest` copied in. Boots it, runs Node.js
/// and Python, and checks /workspace is on the sandbox disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_image_boots_on_the_kvm_backend() {
    let _one_at_a_time = SERIAL.lock().await;
    let store = ImageStore::new(config::image_dir());
    let Ok(image) = store.resolve(IMAGE) else {
        let why = "no vantik-guest:latest in the image store; build it with `sudo python3 rootfs/build-guest.py`";
        let root = std::fs::metadata("/proc/self").unwrap().uid() == 0;
        assert!(
            !(root && std::env::var("SANDBOX_HOST_REQUIRE_E2E").as_deref() == Ok("1")),
            "{why} (bin/test builds it as root)"
        );
        skip(why);
        return;
    };
    let nested = std::env::var("SANDBOX_HOST_IN_NESTED").as_deref() == Ok("1");
    if nested || sandbox_vmm::select::kvm_usable(&store).await.is_ok() {
        let backend = sandbox_vmm::kvm::KvmBackend::new().expect("/dev/kvm opens");
        let tmp = tempfile::tempdir_in("/tmp").unwrap();
        let spec = image.vm_spec("kvm-guest".into(), 1024, 2, 4096, tmp.path().join("vm"));
        let t = Instant::now();
        let sandbox = sandbox_vmm::boot(&backend, spec, Duration::from_secs(300))
            .await
            .expect("the guest image boots on the KVM backend");
        println!(
            "figures: guest image ready on the KVM backend in {} ms",
            t.elapsed().as_millis()
        );
        let out = sh(
            &sandbox.client,
            "node -e 'console.log(6*7)' && python3 -c 'print(6*7)' && df -m /workspace | tail -n 1",
        )
        .await;
        let text = out.stdout_str();
        assert!(
            text.starts_with("42\n42\n"),
            "{text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let size: u64 = text
            .lines()
            .nth(2)
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        assert!((3900..=4096).contains(&size), "{text}");
        sandbox.stop().await;
        return;
    }
    let me = std::env::current_exe().unwrap();
    let name = me.file_name().unwrap().to_string_lossy().into_owned();
    let args: [&std::ffi::OsStr; 6] = [
        "--mem".as_ref(),
        "8192".as_ref(),
        "--image".as_ref(),
        IMAGE.as_ref(),
        "--with".as_ref(),
        me.as_os_str(),
    ];
    let text = support::run_nested(
        &args,
        &format!(
            "SANDBOX_HOST_IN_NESTED=1 ./{name} --exact guest_image_boots_on_the_kvm_backend --nocapture"
        ),
        "nested run failed",
    );
    assert!(text.contains("test result: ok. 1 passed"), "{text}");
}
