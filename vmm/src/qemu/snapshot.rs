//! Snapshots on the QEMU backend: QEMU's own migration, to a file and back.
//!
//! A VM that may be snapshotted starts with its monitor on a socket of ours and its snapshot's
//! memory file as an inherited descriptor. The snapshot is a migration of the running guest
//! into that file (`file:/dev/fdset/N`): QEMU copies memory while the guest runs, stops it for
//! the last pages and the devices' state, and leaves it stopped. A VM restored from the file
//! (`-incoming`) loads that state and runs on from the instant it stopped, in a fraction of a
//! boot under emulation. The state file beside it says what machine the memory file is of, so
//! a snapshot of another shape, architecture or accelerator is refused before QEMU reads it.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::args::{Accel, Arch, SNAPSHOT_FDSET};
use crate::backend::{SnapshotDone, VmError, VmSnapshotError, VmSpec};
use crate::qmp::Qmp;

/// The longest a snapshot may take: under emulation the guest's memory is copied at a few
/// hundred MB a second, and the host may be loaded.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(120);
/// The bound on each monitor command.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the migration's progress is read.
const POLL: Duration = Duration::from_millis(20);
/// What the state file says its memory file is.
const FORMAT: &str = "sandbox-host qemu migration v1";

/// The state file of a QEMU snapshot: what machine its memory file (QEMU's migration stream)
/// was taken of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    format: String,
    arch: String,
    accel: String,
    memory_mib: u32,
    vcpus: u8,
}

impl Header {
    /// The header of a snapshot of `spec`'s VM.
    pub fn of(arch: Arch, accel: Accel, spec: &VmSpec) -> Header {
        Header {
            format: FORMAT.into(),
            arch: arch.to_string(),
            accel: accel.as_str().into(),
            memory_mib: spec.memory_mib,
            vcpus: spec.vcpus,
        }
    }

    /// Checks that the snapshot whose state file is `path` is one of this machine.
    pub fn check(&self, path: &Path) -> Result<(), VmError> {
        let text = std::fs::read(path).map_err(|source| VmSnapshotError::File {
            what: "reading",
            path: path.to_path_buf(),
            source,
        })?;
        let theirs: Header =
            serde_json::from_slice(&text).map_err(|source| VmSnapshotError::NotQemu {
                path: path.to_path_buf(),
                source,
            })?;
        if &theirs != self {
            return Err(VmSnapshotError::OtherMachine {
                theirs: format!("{}, {}", theirs.machine(), theirs.format),
                ours: self.machine(),
            }
            .into());
        }
        Ok(())
    }

    /// The machine, as a person reads it.
    fn machine(&self) -> String {
        format!(
            "{} {} with {} MiB and {} vCPUs",
            self.arch, self.accel, self.memory_mib, self.vcpus
        )
    }
}

/// Lets a guest that a migration left stopped run again (QEMU takes its disks back first: a
/// completed migration handed them to the destination).
pub async fn cont(qmp: &mut Qmp) -> Result<(), VmError> {
    qmp.execute("cont", serde_json::Value::Null, COMMAND_TIMEOUT)
        .await
        .map_err(VmSnapshotError::Command)?;
    Ok(())
}

/// Migrates the running guest into the memory file (set [`SNAPSHOT_FDSET`]), writes the
/// state file, and lets the guest run on if `resume`.
pub async fn take(
    qmp: &mut Qmp,
    header: &Header,
    state: &Path,
    resume: bool,
) -> Result<SnapshotDone, VmError> {
    let fail = VmSnapshotError::Command;
    let t0 = Instant::now();
    qmp.execute(
        "migrate",
        json!({ "uri": format!("file:/dev/fdset/{SNAPSHOT_FDSET}") }),
        COMMAND_TIMEOUT,
    )
    .await
    .map_err(fail)?;
    let info = loop {
        let info = qmp
            .execute("query-migrate", serde_json::Value::Null, COMMAND_TIMEOUT)
            .await
            .map_err(fail)?;
        match info.get("status").and_then(|s| s.as_str()) {
            Some("completed") => break info,
            Some(s @ ("failed" | "cancelled")) => {
                let why = info
                    .get("error-desc")
                    .and_then(|d| d.as_str())
                    .unwrap_or("no reason given");
                return Err(VmSnapshotError::Migration {
                    status: s.to_string(),
                    why: why.chars().take(300).collect(),
                }
                .into());
            }
            _ => {}
        }
        if t0.elapsed() > SNAPSHOT_TIMEOUT {
            return Err(VmSnapshotError::MigrationTimeout(SNAPSHOT_TIMEOUT).into());
        }
        tokio::time::sleep(POLL).await;
    };
    let write_us = t0.elapsed().as_micros() as u64;
    let text = serde_json::to_vec(header).map_err(VmSnapshotError::Encode)?;
    std::fs::write(state, text)
        .map_err(|e| VmError::io(format!("writing {}", state.display()), e))?;
    if resume {
        cont(qmp).await?;
    }
    let number = |k: &str| {
        info.get("ram")
            .and_then(|r| r.get(k))
            .and_then(|v| v.as_u64())
    };
    Ok(SnapshotDone {
        memory_written: number("transferred").unwrap_or(0),
        pause_us: info
            .get("downtime")
            .and_then(|v| v.as_u64())
            .unwrap_or(0)
            .saturating_mul(1000),
        write_us,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_of_another_machine_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let spec = VmSpec {
            id: "t".into(),
            memory_mib: 256,
            vcpus: 1,
            kernel: "/k".into(),
            initrd: None,
            disks: vec![],
            scratch_disk_mib: None,
            cmdline: vec![],
            state_dir: "/s".into(),
            net: None,
            start_timeout: None,
            snapshot_to: None,
            restore_from: None,
            outlive: false,
        };
        let ours = Header::of(Arch::X86_64, Accel::Tcg, &spec);
        let p = dir.path().join("state");
        std::fs::write(&p, serde_json::to_vec(&ours).unwrap()).unwrap();
        ours.check(&p).unwrap();
        let mut other = spec.clone();
        other.memory_mib = 512;
        let e = Header::of(Arch::X86_64, Accel::Tcg, &other)
            .check(&p)
            .unwrap_err();
        assert!(e.to_string().contains("another machine"), "{e}");
        assert!(
            Header::of(Arch::X86_64, Accel::Kvm, &spec)
                .check(&p)
                .is_err()
        );
        std::fs::write(&p, b"{\"vcpus\":[]}").unwrap();
        assert!(
            ours.check(&p)
                .unwrap_err()
                .to_string()
                .contains("not a snapshot")
        );
    }
}
