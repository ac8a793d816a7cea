//! Shared fixtures of the end-to-end tests: booting a real sandbox on the stock image, and
//! skipping (loudly) where that cannot be done.
#![allow(missing_docs)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use sandbox_protocol::client::{Client, ExecEvent};
use sandbox_protocol::message::{ExecRequest, ExitStatus};
use sandbox_vmm::config;
use sandbox_vmm::{ImageStore, Sandbox};

/// A booted sandbox and the temporary directory that holds its state.
pub struct TestVm {
    pub sandbox: Sandbox,
    pub state_dir: PathBuf,
    _tmp: tempfile::TempDir,
    _deadline: Deadline,
}

/// The last steps the tests of this process took, with the test (thread) that took each.
static STEPS: Mutex<Vec<(Instant, String, String)>> = Mutex::new(Vec::new());

/// Records what the current test is about to wait for, for the message of a [`Deadline`].
pub fn step(what: impl Into<String>) {
    let test = std::thread::current()
        .name()
        .unwrap_or("an unnamed thread")
        .to_string();
    let mut steps = STEPS.lock().unwrap_or_else(|e| e.into_inner());
    if steps.len() >= 64 {
        steps.remove(0);
    }
    steps.push((Instant::now(), test, what.into()));
}

/// How long a test may keep a VM: `SANDBOX_HOST_TEST_DEADLINE_S`, else 300 s, well under the
/// nested host's 20 minutes, so a hang fails that test with what it waited for.
pub fn deadline_limit() -> Duration {
    std::env::var("SANDBOX_HOST_TEST_DEADLINE_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(300), Duration::from_secs)
}

/// A test's own deadline: if it is still armed when the limit passes, the process prints what
/// the test was waiting for (its last steps) and what its VM was doing (console, vCPUs), and
/// exits with a failure instead of hanging. Dropping it disarms it.
pub struct Deadline {
    armed: Arc<AtomicBool>,
}

impl Deadline {
    /// Arms a deadline for the current test; `vm` is reported if it is still alive then.
    pub fn arm(limit: Duration, vm: Option<Weak<dyn sandbox_vmm::Vm>>) -> Deadline {
        let armed = Arc::new(AtomicBool::new(true));
        let test = std::thread::current()
            .name()
            .unwrap_or("an unnamed thread")
            .to_string();
        let flag = armed.clone();
        let vm = Mutex::new(vm);
        let started = Instant::now();
        std::thread::spawn(move || {
            while started.elapsed() < limit {
                std::thread::sleep(Duration::from_millis(200).min(limit));
                if !flag.load(Ordering::SeqCst) {
                    return;
                }
            }
            if !flag.load(Ordering::SeqCst) {
                return;
            }
            let steps: Vec<String> = STEPS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .filter(|(_, t, _)| *t == test)
                .map(|(at, _, what)| format!("  {:>7.1?} ago: {what}", at.elapsed()))
                .collect();
            let vm = vm
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .and_then(|w| w.upgrade());
            let vm_state = match vm {
                Some(vm) => {
                    // This thread has no runtime: one of its own, for the VMM's answer (bounded
                    // by the VM's side).
                    let vcpus = tokio::runtime::Builder::new_current_thread()
                        .enable_time()
                        .build()
                        .map(|rt| rt.block_on(vm.diagnostics()))
                        .unwrap_or_default();
                    format!(
                        "its VM: exit {:?}; {vcpus}\n  console:\n    {}",
                        vm.exit().map(|e| e.reason),
                        vm.console_tail(12).join("\n    ")
                    )
                }
                None => "no VM of it is alive".into(),
            };
            // Straight to the process's stderr: the test harness captures what this thread
            // prints with eprintln!, and the exit below would drop it unshown.
            let message = format!(
                "\nDEADLINE: test `{test}` gave up after {limit:?}; it was waiting for its last step:\n{}\n{vm_state}\n",
                steps.join("\n")
            );
            let _ = std::io::Write::write_all(&mut std::io::stderr(), message.as_bytes());
            std::process::exit(101);
        });
        Deadline { armed }
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        self.armed.store(false, Ordering::SeqCst);
    }
}

/// Awaits `fut` for at most [`deadline_limit`] less 30 s (so it fails as an ordinary test failure
/// before the test's deadline ends the process); on expiry panics naming `what`.
pub async fn bounded<F: std::future::Future>(what: &str, fut: F) -> F::Output {
    step(what);
    let limit = deadline_limit().saturating_sub(Duration::from_secs(30));
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("gave up after {limit:?} waiting for: {what}"),
    }
}

/// Says why a test cannot run here. Under `SANDBOX_HOST_REQUIRE_E2E=1` (CI) that is a failure:
/// CI must run every test that can run.
pub fn skip(why: &str) {
    if std::env::var("SANDBOX_HOST_REQUIRE_E2E").as_deref() == Ok("1") {
        panic!("test cannot run but SANDBOX_HOST_REQUIRE_E2E=1: {why}");
    }
    eprintln!("skipped: {why}");
}

/// Boots the stock image on the backend the environment selects (`SANDBOX_HOST_VMM`, `auto`
/// by default: KVM where it boots guests, else QEMU). `None` after printing "skipped" if QEMU or the image is missing.
pub async fn boot_stock(memory_mib: u32, vcpus: u8) -> Option<TestVm> {
    boot_stock_with_disks(memory_mib, vcpus, vec![]).await
}

/// Like [`boot_stock`], with raw disks attached (virtio serials `disk0`, `disk1`, ...).
pub async fn boot_stock_with_disks(
    memory_mib: u32,
    vcpus: u8,
    disks: Vec<sandbox_vmm::Disk>,
) -> Option<TestVm> {
    boot_image(&stock_image()?, memory_mib, vcpus, 0, disks).await
}

/// The stock image of the image store; `None` after printing "skipped" if it is missing.
fn stock_image() -> Option<sandbox_vmm::Image> {
    match ImageStore::new(config::image_dir()).resolve("stock") {
        Ok(i) => Some(i),
        Err(e) => {
            skip(&format!("{e}"));
            None
        }
    }
}

/// Boots `image` on the selected backend; a disk image gets a sandbox disk of `disk_mib`.
pub async fn boot_image(
    image: &sandbox_vmm::Image,
    memory_mib: u32,
    vcpus: u8,
    disk_mib: u64,
    disks: Vec<sandbox_vmm::Disk>,
) -> Option<TestVm> {
    boot_image_with_net(image, memory_mib, vcpus, disk_mib, disks, None).await
}

/// The stock image with a network device on `net`.
pub async fn boot_stock_with_net(
    memory_mib: u32,
    vcpus: u8,
    net: sandbox_vmm::NetAttachment,
) -> Option<TestVm> {
    boot_image_with_net(&stock_image()?, memory_mib, vcpus, 0, vec![], Some(net)).await
}

/// The stock image, its agent watched with `liveness` instead of the default.
pub async fn boot_stock_watched(
    memory_mib: u32,
    vcpus: u8,
    liveness: sandbox_vmm::Liveness,
) -> Option<TestVm> {
    boot_with(
        &stock_image()?,
        memory_mib,
        vcpus,
        0,
        vec![],
        None,
        Some(liveness),
    )
    .await
}

/// Like [`boot_image`], with a network device if `net` is given.
pub async fn boot_image_with_net(
    image: &sandbox_vmm::Image,
    memory_mib: u32,
    vcpus: u8,
    disk_mib: u64,
    disks: Vec<sandbox_vmm::Disk>,
    net: Option<sandbox_vmm::NetAttachment>,
) -> Option<TestVm> {
    boot_with(image, memory_mib, vcpus, disk_mib, disks, net, None).await
}

/// The backend the environment selects, or `None` after saying why there is none.
pub async fn backend() -> Option<Box<dyn sandbox_vmm::Backend>> {
    let store = ImageStore::new(config::image_dir());
    match sandbox_vmm::select::select(&store).await {
        Ok(b) => Some(b.backend),
        Err(e) => {
            skip(&e.to_string());
            None
        }
    }
}

/// The stock image, or `None` after saying why it is missing.
pub fn stock() -> Option<sandbox_vmm::Image> {
    stock_image()
}

async fn boot_with(
    image: &sandbox_vmm::Image,
    memory_mib: u32,
    vcpus: u8,
    disk_mib: u64,
    disks: Vec<sandbox_vmm::Disk>,
    net: Option<sandbox_vmm::NetAttachment>,
    liveness: Option<sandbox_vmm::Liveness>,
) -> Option<TestVm> {
    let backend = backend().await?;
    let tmp = tempfile::Builder::new()
        .prefix("sbx-e2e")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let state_dir = tmp.path().join("vm");
    let mut spec = image.vm_spec("e2e".into(), memory_mib, vcpus, disk_mib, state_dir.clone());
    spec.disks.extend(disks);
    spec.net = net;
    // The boot has its own bound (180 s): the deadline covers it too, with the VM unknown yet.
    let booting = Deadline::arm(deadline_limit(), None);
    step(format!(
        "booting image {} on {}",
        image.name,
        backend.name()
    ));
    let timeout = Duration::from_secs(180);
    let booted = match liveness {
        Some(l) => sandbox_vmm::boot_watched(backend.as_ref(), spec, timeout, l).await,
        None => sandbox_vmm::boot(backend.as_ref(), spec, timeout).await,
    };
    let sandbox = booted.unwrap_or_else(|e| panic!("image {} boots: {e}", image.name));
    let deadline = Deadline::arm(deadline_limit(), Some(Arc::downgrade(&sandbox.vm)));
    drop(booting);
    step(format!("using the VM of image {}", image.name));
    Some(TestVm {
        sandbox,
        state_dir,
        _tmp: tmp,
        _deadline: deadline,
    })
}

/// Everything an exec produced.
#[derive(Debug, Default)]
pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub status: Option<ExitStatus>,
}

impl Output {
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// Runs a shell command and collects its output.
pub async fn sh(client: &Client, command: &str) -> Output {
    run(
        client,
        ExecRequest {
            command: Some(command.into()),
            cwd: Some("/".into()),
            ..Default::default()
        },
    )
    .await
}

/// Runs a request without stdin and collects its output.
pub async fn run(client: &Client, req: ExecRequest) -> Output {
    let what = match (&req.command, &req.argv) {
        (Some(c), _) => format!("exec `{}`", c.chars().take(120).collect::<String>()),
        (None, Some(a)) => format!("exec {:?}", a.iter().take(6).collect::<Vec<_>>()),
        (None, None) => "exec".into(),
    };
    let exec = bounded(&format!("{what}: start"), client.exec(&req))
        .await
        .expect("exec starts");
    bounded(&format!("{what}: output and exit"), collect(exec.output)).await
}

/// Collects an exec's output until its exit.
pub async fn collect(mut output: sandbox_protocol::client::ExecOutput) -> Output {
    let mut out = Output::default();
    while let Some(ev) = output.next().await {
        match ev.expect("exec output") {
            ExecEvent::Stdout(b) => out.stdout.extend_from_slice(&b),
            ExecEvent::Stderr(b) => out.stderr.extend_from_slice(&b),
            ExecEvent::Exit(s) => out.status = Some(s),
        }
    }
    out
}

/// Runs `command` in the nested test host (`tests/nested/run.sh`) with `args` before the `--`
/// (`--with FILE`, `--image NAME`, …), prints its console, and returns it once it exited 0;
/// `what` names the run in the failure message.
///
/// A nested host that wedges (its emulated processor stops: its heartbeat ends, which no test of
/// ours can cause) is booted once more by `run.sh`, loudly, up to three boots; see
/// tests/nested/README.md, "Wedged".
pub fn run_nested(args: &[&std::ffi::OsStr], command: &str, what: &str) -> String {
    let (status, text, stderr) = nested(args, command);
    assert_eq!(status, Some(0), "{what}:\n{text}\n{stderr}");
    text
}

/// Runs `command` in the nested test host as [`run_nested`] does and returns its exit status,
/// the console of its last boot and `run.sh`'s own messages (with every boot's console), whatever
/// the status.
pub fn nested(args: &[&std::ffi::OsStr], command: &str) -> (Option<i32>, String, String) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    // The KVM backend runs each VM in `sandbox-vm`, which goes down with every test binary.
    let vm_binary = sandbox_vmm::kvm::process::vm_binary()
        .unwrap_or_else(|why| panic!("the nested host needs the VM program: {why}"));
    // run.sh boots a wedged nested host once more by itself (up to three boots).
    let out = std::process::Command::new("bash")
        .arg(root.join("tests/nested/run.sh"))
        .args(args)
        .arg("--with")
        .arg(&vm_binary)
        .arg("--")
        .arg(command)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    // run.sh's own lines (a wedge and the boot after it among them) show even when a later boot
    // passed; the consoles of earlier boots stay in `stderr` for a failure's message.
    for line in stderr.lines().filter(|l| l.starts_with("[nested ")) {
        eprintln!("{line}");
    }
    eprintln!("{text}");
    (out.status.code(), text, stderr)
}

/// The static hostile helper of `tests/guest/freeze.c` (see there), or `None` after saying why
/// it cannot be used.
pub fn freeze_binary() -> Option<&'static [u8]> {
    static NATIVE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/freeze"));
    static AARCH64: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/freeze-aarch64"));
    let arch = sandbox_vmm::arch::Arch::guest();
    let (freeze, install) = match (arch.is_native(), arch) {
        (true, _) => (NATIVE, "gcc and libc6-dev"),
        (false, sandbox_vmm::arch::Arch::Aarch64) => {
            (AARCH64, "gcc-aarch64-linux-gnu and libc6-dev-arm64-cross")
        }
        (false, other) => {
            skip(&format!(
                "no {other} build of tests/guest/freeze.c on this host"
            ));
            return None;
        }
    };
    if freeze.is_empty() {
        skip(&format!(
            "tests/guest/freeze.c was not built for {arch} (no C compiler with a static libc when the tests were built; install {install})"
        ));
        return None;
    }
    Some(freeze)
}

/// The static `tests/guest/getrandom.c` for this host's architecture (prints 64 bytes of
/// getrandom(2) as hex), or `None` after saying why it is missing.
pub fn getrandom_binary() -> Option<&'static [u8]> {
    static NATIVE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/getrandom"));
    if NATIVE.is_empty() {
        skip(
            "tests/guest/getrandom.c was not built (no C compiler with a static libc when the tests were built; install gcc and libc6-dev)",
        );
        return None;
    }
    Some(NATIVE)
}

/// Hex SHA-256.
pub fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Deterministic pseudo-random bytes (xorshift), so tests need no randomness source.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}
