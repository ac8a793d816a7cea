//! Why a backend could not start, snapshot or restore a VM, typed by what went wrong, so a
//! caller tells a request it must not repeat (a bad spec) from a host that failed (a jail, a
//! VM process that ended) without reading a sentence, and an operator still reads one.
//!
//! Text that another process wrote (a VM process's own report, QEMU's reason, console lines)
//! is carried as it came: it is data, bounded by whoever read it, not an error of ours.

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

use crate::exit::{VmExit, console_suffix};
use crate::setting::SettingError;

/// Why a VM could not be started, snapshotted or restored.
#[derive(Debug, Error)]
pub enum VmError {
    /// A program the backend needs is not installed.
    #[error("{0}")]
    MissingProgram(#[from] MissingProgram),
    /// The spec cannot be booted as given.
    #[error("invalid VM spec: {0}")]
    InvalidSpec(#[from] SpecError),
    /// The VMM could not be started.
    #[error("starting the VM failed: {0}")]
    Start(#[from] VmStartError),
    /// The backend cannot do this (snapshots on QEMU without a snapshot file).
    #[error("{0}")]
    Unsupported(#[from] Unsupported),
    /// A snapshot could not be taken or restored.
    #[error("{0}")]
    Snapshot(#[from] VmSnapshotError),
    /// The VM ended before its agent channel was up.
    #[error("the VM stopped while starting: {}{}", .0.reason, console_suffix(&.0.console))]
    DiedEarly(VmExit),
    /// Host I/O around the VM failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
}

impl VmError {
    /// An I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        VmError::Io {
            context: context.into(),
            source,
        }
    }
}

/// A program the backend runs that is not there; each says how to get it.
#[derive(Debug, Error)]
pub enum MissingProgram {
    /// QEMU's system emulator or `qemu-img` is not on the PATH.
    #[error(
        "the sandbox host has no {program} on its PATH. Install QEMU on the machine of the sandbox host \
         (Debian: apt-get install {package} qemu-utils; macOS: brew install qemu), \
         then stop the sandbox host and start it again"
    )]
    Qemu {
        /// The program looked for.
        program: &'static str,
        /// Debian's package of the system emulator.
        package: &'static str,
    },
    /// This program's own path is unknown, so `sandbox-vm` beside it cannot be found.
    #[error("cannot find this program: {0}")]
    OwnPath(#[source] std::io::Error),
    /// `sandbox-vm` is not beside this program.
    #[error(
        "the VM program sandbox-vm is not beside {} (build it with `cargo build -p sandbox-vm --bins`, \
         or set SANDBOX_HOST_VM_BINARY)",
        .0.display()
    )]
    VmProgram(PathBuf),
}

/// A spec no backend boots as given: the caller's to fix, not worth a retry.
#[derive(Debug, Error)]
pub enum SpecError {
    /// Too few or too many vCPUs.
    #[error("vcpus must be 1 to 64, not {0}")]
    Vcpus(u8),
    /// Too little memory for our kernel.
    #[error("memory_mib must be at least 128, not {0}")]
    Memory(u32),
    /// The kernel, initramfs or a disk is not a file.
    #[error("{} does not exist", .0.display())]
    Missing(PathBuf),
    /// Two VMs never share a state directory.
    #[error("the VM state directory {} already exists", .0.display())]
    StateDirExists(PathBuf),
    /// QEMU's sockets in the state directory would not fit a Unix socket's path.
    #[error(
        "the state directory {} is too long for a Unix socket path ({len} > {max} bytes); \
         set SANDBOX_HOST_STATE_DIR to a shorter directory",
        .dir.display()
    )]
    StateDirTooLong {
        /// The state directory.
        dir: PathBuf,
        /// The longest socket path in it.
        len: usize,
        /// The most a Unix socket's path may hold.
        max: usize,
    },
    /// A setting the VM's jail or machine is built from has a value it does not accept.
    #[error(transparent)]
    Setting(#[from] SettingError),
    /// The sandbox disk's size is outside what one may be.
    #[error(transparent)]
    DiskSize(crate::scratch::ScratchError),
    /// A foreign architecture is emulated, and a hardware accelerator was asked for.
    #[error(
        "SANDBOX_HOST_ARCH={arch} on this {host} host runs only under emulation, but \
         SANDBOX_HOST_QEMU_ACCEL asks for a hardware accelerator; set SANDBOX_HOST_QEMU_ACCEL=auto \
         (or tcg), or leave SANDBOX_HOST_ARCH unset"
    )]
    ForeignArch {
        /// The guest's architecture.
        arch: crate::arch::Arch,
        /// The host's.
        host: crate::arch::Arch,
    },
}

/// Why a VM that was asked for did not start.
#[derive(Debug, Error)]
pub enum VmStartError {
    /// The blocking task that spawns jailed processes did not finish.
    #[error("the jail's spawner failed: {0}")]
    Spawner(#[source] tokio::task::JoinError),
    /// The jail refused to run the program.
    #[error("cannot run {} in its jail: {source}", .program.display())]
    Jail {
        /// The program.
        program: PathBuf,
        /// What the jail said.
        #[source]
        source: sandbox_jail::SpawnError,
    },
    /// The sandbox disk could not be made.
    #[error(transparent)]
    Disk(crate::scratch::ScratchError),
    /// The VM process closed its control socket before the machine ran.
    #[error("the VM process closed its control socket")]
    ControlClosed,
    /// The VM process could not build its machine, in its own words (bounded by `told`).
    #[error("{0}")]
    Reported(String),
    /// The VM process did not say its machine runs in time.
    #[error("the VM process did not build its machine within {0:?}")]
    BuildTimeout(Duration),
    /// The guest agent refused or ignored the host's connection until the deadline.
    #[error(
        "the guest agent did not accept the host's connection within {within:?}: {why}{}",
        console_suffix(.console)
    )]
    AgentRefused {
        /// How long the host tried.
        within: Duration,
        /// The last refusal (the VM's words, or the vsock device's).
        why: String,
        /// The last console lines.
        console: Vec<String>,
    },
    /// The VM process did not answer a connection request in time.
    #[error("the VM process did not answer a connection request within {0:?}")]
    ConnectTimeout(Duration),
    /// The blocking task that builds an in-process machine did not finish.
    #[error("the VM start task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// The in-process machine could not be built (the benchmarks' reference only).
    #[cfg(all(target_os = "linux", feature = "in-process"))]
    #[error(transparent)]
    Machine(#[from] sandbox_vm::machine::MachineError),
}

/// What a backend cannot do at all, or not for this VM.
#[derive(Debug, Error)]
pub enum Unsupported {
    /// The backend has no snapshots.
    #[error("this backend cannot snapshot a VM")]
    Snapshots,
    /// A QEMU VM gets its snapshot file at start, and this one got none.
    #[error("this VM was started without a snapshot file, so it cannot be snapshotted")]
    NoSnapshotFile,
}

/// Why a snapshot was not taken, or cannot be restored.
#[derive(Debug, Error)]
pub enum VmSnapshotError {
    /// The VM ended before the snapshot was asked for.
    #[error("the VM has ended: {0}")]
    Ended(String),
    /// The VM ended while the snapshot was being taken.
    #[error("the VM ended while its snapshot was taken: {0}")]
    EndedDuring(String),
    /// The VM was started without the files a snapshot is written to.
    #[error("this VM was started without snapshot files")]
    NoFiles,
    /// A snapshot left the guest stopped, and nothing let it run since.
    #[error(
        "this VM's guest stands stopped after its last snapshot: it is snapshotted again only \
         once it runs again"
    )]
    Stopped,
    /// A command on QEMU's monitor failed earlier, so it is not used again.
    #[error("QEMU's monitor failed in an earlier snapshot of this VM, so it takes no other")]
    MonitorLost,
    /// A blocking task around the snapshot's files did not finish.
    #[error("{what}: {source}")]
    Task {
        /// What the task did.
        what: &'static str,
        /// Why it did not finish.
        #[source]
        source: tokio::task::JoinError,
    },
    /// A snapshot's file could not be opened or read.
    #[error("{what} {}: {source}", .path.display())]
    File {
        /// `opening`, `reading`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// The memory file could not be sized, or the state file written.
    #[error(transparent)]
    Files(#[from] sandbox_control::files::FileError),
    /// The VM process closed its control socket.
    #[error("the VM process closed its control socket")]
    ControlClosed,
    /// The VM process's state could not be read from its pipe.
    #[error("reading the state from the VM process: {0}")]
    StateRead(#[source] std::io::Error),
    /// The VM process sent more state than a restore reads.
    #[error("the VM process sent a state longer than {0} bytes")]
    StateTooLong(u64),
    /// The VM process answered but kept the state's pipe open; it was stopped.
    #[error(
        "the VM process answered its snapshot but did not close the state's pipe within {0:?}; \
         the VM was stopped"
    )]
    PipeHeld(Duration),
    /// The VM process did not answer in time; it was stopped.
    #[error("the VM process did not write its snapshot within {0:?}; the VM was stopped")]
    Timeout(Duration),
    /// The VM process could not take the snapshot, in its own words.
    #[error("{0}")]
    Reported(String),
    /// QEMU's monitor did not come up.
    #[error("QEMU's monitor: {0}")]
    Monitor(#[source] crate::qmp::QmpError),
    /// QEMU did not take the memory file's descriptor.
    #[error("handing QEMU its snapshot file: {0}")]
    HandOver(#[source] crate::qmp::QmpError),
    /// A monitor command of the migration failed.
    #[error("the snapshot failed: {0}")]
    Command(#[source] crate::qmp::QmpError),
    /// QEMU's migration failed or was cancelled, with QEMU's reason (at most 300 characters).
    #[error("QEMU's migration to the snapshot file {status}: {why}")]
    Migration {
        /// `failed` or `cancelled`.
        status: String,
        /// QEMU's `error-desc`.
        why: String,
    },
    /// QEMU's migration did not complete in time.
    #[error("QEMU did not write the snapshot within {0:?}")]
    MigrationTimeout(Duration),
    /// A QEMU snapshot's state file could not be written or read as one.
    #[error("{} is not a snapshot of the QEMU backend ({source})", .path.display())]
    NotQemu {
        /// The state file.
        path: PathBuf,
        /// What the parser said.
        #[source]
        source: serde_json::Error,
    },
    /// The state file could not be encoded.
    #[error("{0}")]
    Encode(#[source] serde_json::Error),
    /// The snapshot is of a machine of another shape, architecture or accelerator.
    #[error("the snapshot is of another machine ({theirs}); this VM is {ours}")]
    OtherMachine {
        /// What the snapshot is of.
        theirs: String,
        /// What this VM is.
        ours: String,
    },
    /// An in-process machine's snapshot failed or cannot be restored (the benchmarks' only).
    #[cfg(all(target_os = "linux", feature = "in-process"))]
    #[error(transparent)]
    Machine(#[from] sandbox_vm::snapshot::SnapshotError),
    /// An in-process machine's state file could not be emptied or synced.
    #[error("{what} the state file: {source}")]
    StateFile {
        /// `emptying`, `syncing`.
        what: &'static str,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
}
