//! Shared fixtures of the end-to-end tests: booting a real sandbox on the stock image, and
//! skipping (loudly) where that cannot be done.
#![allow(missing_docs)]

use std::path::PathBuf;
use std::time::Duration;

use sandbox_protocol::client::{Client, ExecEvent};
use sandbox_protocol::message::{ExecRequest, ExitStatus};
use sandbox_vmm::config;
use sandbox_vmm::{ImageStore, Sandbox};

/// A booted sandbox and the temporary directory that holds its state.
pub struct TestVm {
    pub sandbox: Sandbox,
    pub state_dir: PathBuf,
    _tmp: tempfile::TempDir,
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

/// Like [`boot_image`], with a network device if `net` is given.
pub async fn boot_image_with_net(
    image: &sandbox_vmm::Image,
    memory_mib: u32,
    vcpus: u8,
    disk_mib: u64,
    disks: Vec<sandbox_vmm::Disk>,
    net: Option<sandbox_vmm::NetAttachment>,
) -> Option<TestVm> {
    let store = ImageStore::new(config::image_dir());
    let backend = match sandbox_vmm::select::select(&store).await {
        Ok(b) => b.backend,
        Err(e) => {
            skip(&e);
            return None;
        }
    };
    let tmp = tempfile::Builder::new()
        .prefix("sbx-e2e")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let state_dir = tmp.path().join("vm");
    let mut spec = image.vm_spec("e2e".into(), memory_mib, vcpus, disk_mib, state_dir.clone());
    spec.disks.extend(disks);
    spec.net = net;
    let sandbox = sandbox_vmm::boot(backend.as_ref(), spec, Duration::from_secs(180))
        .await
        .unwrap_or_else(|e| panic!("image {} boots: {e}", image.name));
    Some(TestVm {
        sandbox,
        state_dir,
        _tmp: tmp,
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
    let exec = client.exec(&req).await.expect("exec starts");
    collect(exec.output).await
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
pub fn run_nested(args: &[&std::ffi::OsStr], command: &str, what: &str) -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let out = std::process::Command::new("bash")
        .arg(root.join("tests/nested/run.sh"))
        .args(args)
        .arg("--")
        .arg(command)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{text}");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{what}:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
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
