//! Choosing QEMU's accelerator. `auto` takes KVM only after proving that this host's `/dev/kvm`
//! boots our guest: on some nested hypervisors `/dev/kvm` opens fine but cannot run a Linux
//! kernel, and QEMU then hangs with an internal error instead of failing.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::QemuBackend;
use super::args::{Accel, Arch};
use crate::backend::{Backend, VmSpec};
use crate::config::AccelSetting;
use crate::image::{ImageStore, STOCK};

/// How long a KVM probe boot may take; a real KVM host needs well under a second.
const PROBE_TIMEOUT: Duration = Duration::from_secs(20);

/// The accelerator picked, and a warning for the operator when it is not what they would want.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccelChoice {
    /// The accelerator.
    pub accel: Accel,
    /// Set when falling back to software emulation, with the reason.
    pub warning: Option<String>,
}

/// Resolves `SANDBOX_HOST_QEMU_ACCEL` for this host.
pub async fn resolve_accel(
    setting: AccelSetting,
    arch: Arch,
    program: &Path,
    store: &ImageStore,
) -> AccelChoice {
    let fixed = |accel| AccelChoice {
        accel,
        warning: None,
    };
    match setting {
        AccelSetting::Kvm => fixed(Accel::Kvm),
        AccelSetting::Hvf => fixed(Accel::Hvf),
        AccelSetting::Tcg => AccelChoice {
            accel: Accel::Tcg,
            warning: Some("SANDBOX_HOST_QEMU_ACCEL=tcg: QEMU emulates the processor, so runs work but are very slow".into()),
        },
        AccelSetting::Auto if cfg!(target_os = "macos") => fixed(Accel::Hvf),
        AccelSetting::Auto => match kvm_boots(arch, program, store).await {
            Ok(()) => fixed(Accel::Kvm),
            Err(why) => AccelChoice {
                accel: Accel::Tcg,
                warning: Some(format!(
                    "{why}; QEMU emulates the processor (tcg), so runs work but are very slow. \
                     Run the sandbox host on a machine with hardware virtualisation to fix this"
                )),
            },
        },
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct ProbeRecord {
    key: u64,
    ok: bool,
    reason: String,
}

/// Whether QEMU with KVM boots the stock image here, remembered per host boot, QEMU binary and
/// image, so only the first start after a change pays for the probe.
async fn kvm_boots(arch: Arch, program: &Path, store: &ImageStore) -> Result<(), String> {
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        return Err(format!("no usable /dev/kvm ({e})"));
    }
    let image = store
        .resolve(STOCK)
        .map_err(|e| format!("/dev/kvm could not be checked: {e}"))?;
    let key = probe_key(program, &image.kernel, image.initrd.as_deref());
    let record_path = crate::config::cache_dir().join("probe/qemu-kvm.json");
    let cached = std::fs::read(&record_path)
        .ok()
        .and_then(|b| serde_json::from_slice::<ProbeRecord>(&b).ok());
    if let Some(r) = cached.filter(|r| r.key == key) {
        return if r.ok { Ok(()) } else { Err(r.reason) };
    }
    let result = probe(arch, program, &image.kernel, image.initrd.clone()).await;
    let record = ProbeRecord {
        key,
        ok: result.is_ok(),
        reason: result.clone().err().unwrap_or_default(),
    };
    if let Some(dir) = record_path.parent() {
        let _ = std::fs::create_dir_all(dir);
        let _ = std::fs::write(
            &record_path,
            serde_json::to_vec(&record).unwrap_or_default(),
        );
    }
    result
}

async fn probe(
    arch: Arch,
    program: &Path,
    kernel: &Path,
    initrd: Option<PathBuf>,
) -> Result<(), String> {
    let backend = QemuBackend::with(arch, Accel::Kvm, program.to_path_buf());
    let state_dir = crate::config::state_dir().join(format!("probe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state_dir);
    let spec = VmSpec {
        id: "kvm-probe".into(),
        memory_mib: 256,
        vcpus: 1,
        kernel: kernel.to_path_buf(),
        initrd,
        disks: vec![],
        cmdline: vec![],
        state_dir,
    };
    let started = Instant::now();
    let vm = backend
        .start(spec)
        .await
        .map_err(|e| format!("QEMU with KVM did not start ({e})"))?;
    let client = sandbox_protocol::client::Client::new(vm.channel.read, vm.channel.write);
    let vm = vm.vm;
    let outcome = loop {
        tokio::select! {
            r = client.wait_ready(Duration::from_millis(200)) => match r {
                Ok(_) => break Ok(()),
                Err(sandbox_protocol::client::ClientError::Timeout(_)) => {}
                Err(e) => match tokio::time::timeout(Duration::from_secs(1), vm.wait()).await {
                    Ok(exit) => break Err(stopped(&exit)),
                    Err(_) => break Err(format!("the KVM probe guest lost its channel ({e})")),
                },
            },
            exit = vm.wait() => break Err(stopped(&exit)),
        }
        if vm
            .console_tail(50)
            .iter()
            .any(|l| l.contains("KVM internal error") || l.contains("emulation failure"))
        {
            break Err(
                "/dev/kvm cannot run a Linux guest here (KVM internal error: emulation failure)"
                    .into(),
            );
        }
        if started.elapsed() > PROBE_TIMEOUT {
            break Err(format!("a KVM guest did not boot within {PROBE_TIMEOUT:?}"));
        }
    };
    let outcome = match outcome {
        Ok(()) => {
            let req = sandbox_protocol::message::ExecRequest {
                argv: Some(vec!["true".into()]),
                cwd: Some("/".into()),
                ..Default::default()
            };
            match client.exec(&req).await {
                Ok(mut e) => loop {
                    match e.output.next().await {
                        Some(Ok(sandbox_protocol::client::ExecEvent::Exit(s)))
                            if s.exit_code == Some(0) =>
                        {
                            break Ok(());
                        }
                        Some(Ok(sandbox_protocol::client::ExecEvent::Exit(s))) => {
                            break Err(format!("`true` failed in the KVM probe guest: {s:?}"));
                        }
                        Some(Ok(_)) => {}
                        Some(Err(e)) => {
                            break Err(format!("exec in the KVM probe guest failed: {e}"));
                        }
                        None => {
                            break Err("exec in the KVM probe guest ended without a status".into());
                        }
                    }
                },
                Err(e) => Err(format!("exec in the KVM probe guest failed: {e}")),
            }
        }
        Err(e) => Err(e),
    };
    // Whatever went wrong, an emulation failure in the console is the real reason.
    let outcome = outcome.map_err(|why| {
        if vm
            .console_tail(50)
            .iter()
            .any(|l| l.contains("KVM internal error") || l.contains("emulation failure"))
        {
            "/dev/kvm cannot run a Linux guest here (KVM internal error: emulation failure)"
                .to_string()
        } else {
            why
        }
    });
    vm.stop(Duration::from_millis(500)).await;
    outcome
}

fn stopped(exit: &crate::backend::VmExit) -> String {
    format!(
        "QEMU with KVM could not boot a guest: {}{}",
        exit.reason,
        crate::backend::console_suffix(&exit.console)
    )
}

fn probe_key(program: &Path, kernel: &Path, initrd: Option<&Path>) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap_or_default()
        .hash(&mut h);
    for p in [Some(program), Some(kernel), initrd].into_iter().flatten() {
        p.hash(&mut h);
        if let Ok(m) = std::fs::metadata(p) {
            m.len().hash(&mut h);
            m.modified().ok().hash(&mut h);
        }
    }
    h.finish()
}
