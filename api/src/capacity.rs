//! Host-wide budgets and admission: a create that would overcommit the host is refused with `503`
//! and the reason, instead of taking every sandbox down with it (the OOM killer, a full disk, a
//! process out of file descriptors).
//!
//! - **Memory**: the guest memory of every sandbox (running or starting) and the memory its
//!   egress may hold on the host (`SANDBOX_HOST_EGRESS_MEMORY_MIB`, `sandbox_egress::memory`,
//!   and the network process's own [`crate::netproc::ALLOWANCE_MIB`]: its cgroup's bound) count
//!   against `SANDBOX_HOST_MEMORY_LIMIT_MIB` (default: this machine's memory less 2 GiB for
//!   the host). Both cost what is touched, never more than counted, so this is a promise the
//!   host can keep, not a forecast.
//! - **Disk**: a sandbox disk is sparse and grows up to its run's limit; a create needs free space
//!   under the state directory of at least its limit divided by `SANDBOX_HOST_DISK_OVERCOMMIT`
//!   (4), plus 1 GiB, and the limits of all sandboxes divided by the factor must fit in what is
//!   free plus what their disks already use.
//! - **File descriptors**: at start the service raises its soft `RLIMIT_NOFILE` to the hard limit;
//!   a create needs room for a sandbox's worst case ([`FDS_PER_SANDBOX`]) above what is open, with
//!   [`FD_RESERVE`] kept for the API and the files of new VMs.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

/// File descriptors one sandbox may need at most: 128 guest connections, their upstream sockets,
/// the VM's own (KVM fds, eventfds, disks; or QEMU's pipes and sockets) and the agent channel.
pub const FDS_PER_SANDBOX: u64 = 400;
/// File descriptors always kept free for the API and for starting VMs.
pub const FD_RESERVE: u64 = 512;
/// Free space always kept under the state directory.
const DISK_RESERVE_MIB: u64 = 1024;

/// The limits, from the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Guest memory all sandboxes together may have.
    pub memory_mib: u64,
    /// How many times the free disk the sandboxes' disk limits may add up to.
    pub disk_overcommit: u64,
}

impl Limits {
    /// The default memory limit: the machine's memory less 2 GiB (at least 1 GiB).
    pub fn default_memory_mib() -> u64 {
        let total_mib = sandbox_vmm::host::total_memory_mib().unwrap_or(4096);
        total_mib.saturating_sub(2048).max(1024)
    }
}

#[derive(Debug, Default)]
struct Committed {
    memory_mib: u64,
    disk_mib: u64,
    sandboxes: u64,
}

/// The host's budgets and what is committed against them.
#[derive(Debug)]
pub struct Capacity {
    limits: Limits,
    state_dir: PathBuf,
    committed: Mutex<Committed>,
}

/// A sandbox's share of the budgets, given back when it is dropped (the sandbox is gone, or its
/// create failed).
#[derive(Debug)]
pub struct Reservation {
    capacity: Arc<Capacity>,
    /// The guest's memory (given back while the sandbox is paused).
    memory_mib: u64,
    /// Its egress memory (held while paused: the egress stack and its connections stay).
    egress_mib: u64,
    disk_mib: u64,
}

impl Reservation {
    /// What it holds: guest memory, egress memory, disk (MiB), as [`Capacity::reserve`] takes
    /// them (a restart of the service reserves them again).
    pub fn shares(&self) -> [u64; 3] {
        [self.memory_mib, self.egress_mib, self.disk_mib]
    }

    /// Gives the memory part back (a paused sandbox holds only its disk); returns how much.
    pub fn release_memory(&mut self) -> u64 {
        let mut c = self.capacity.lock();
        c.memory_mib = c.memory_mib.saturating_sub(self.memory_mib);
        std::mem::take(&mut self.memory_mib)
    }

    /// Takes `memory_mib` again (a resume), refused as a create is when the host has no room.
    pub fn reacquire_memory(&mut self, memory_mib: u64) -> Result<(), String> {
        if self.memory_mib != 0 {
            return Ok(()); // still held (a resume that was interrupted and is asked again)
        }
        let mut c = self.capacity.lock();
        let limit = self.capacity.limits.memory_mib;
        if c.memory_mib + memory_mib > limit {
            return Err(format!(
                "the host has no room for {memory_mib} MiB more of guest memory: {} MiB of \
                 SANDBOX_HOST_MEMORY_LIMIT_MIB={limit} are committed to {} sandboxes. Retry the \
                 resume when a sandbox ends",
                c.memory_mib, c.sandboxes
            ));
        }
        c.memory_mib += memory_mib;
        self.memory_mib += memory_mib;
        Ok(())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut c = self.capacity.lock();
        c.memory_mib = c
            .memory_mib
            .saturating_sub(self.memory_mib + self.egress_mib);
        c.disk_mib = c.disk_mib.saturating_sub(self.disk_mib);
        c.sandboxes = c.sandboxes.saturating_sub(1);
    }
}

impl Capacity {
    /// Budgets for sandboxes whose files live under `state_dir`.
    pub fn new(limits: Limits, state_dir: PathBuf) -> Arc<Capacity> {
        Arc::new(Capacity {
            limits,
            state_dir,
            committed: Mutex::new(Committed::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Committed> {
        self.committed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a sandbox's share (its guest memory, its egress memory and its disk), or says which
    /// budget it would overrun and what to do.
    pub fn reserve(
        self: &Arc<Self>,
        memory_mib: u64,
        egress_mib: u64,
        disk_mib: u64,
    ) -> Result<Reservation, String> {
        let mut c = self.lock();
        if c.memory_mib + memory_mib + egress_mib > self.limits.memory_mib {
            return Err(format!(
                "the host has no room for {memory_mib} MiB more of guest memory and {egress_mib} \
                 MiB for its network (SANDBOX_HOST_EGRESS_MEMORY_MIB and its network process's \
                 own): {} MiB of \
                 SANDBOX_HOST_MEMORY_LIMIT_MIB={} are committed to {} sandboxes. Retry when a \
                 sandbox ends, ask for less memory_mib, or place the run on another host",
                c.memory_mib, self.limits.memory_mib, c.sandboxes
            ));
        }
        if disk_mib > 0 {
            let (free, used) = (self.free_disk_mib(), self.used_disk_mib());
            let factor = self.limits.disk_overcommit.max(1);
            let need = disk_mib.div_ceil(factor) + DISK_RESERVE_MIB;
            let all = (c.disk_mib + disk_mib).div_ceil(factor);
            if free < need || all > free.saturating_sub(DISK_RESERVE_MIB) + used {
                return Err(format!(
                    "the host has no room for another sandbox disk of {disk_mib} MiB: {free} MiB \
                     are free under {}, and the disks of {} sandboxes may grow to {} MiB \
                     (SANDBOX_HOST_DISK_OVERCOMMIT={factor}). Retry when a sandbox ends, or free \
                     space there",
                    self.state_dir.display(),
                    c.sandboxes,
                    c.disk_mib
                ));
            }
        }
        let (open, limit) = (open_fds(), fd_limit());
        if open + FDS_PER_SANDBOX + FD_RESERVE > limit {
            return Err(format!(
                "the host has no file descriptors for another sandbox: {open} of {limit} are open \
                 (each sandbox may need {FDS_PER_SANDBOX}). Raise the hard RLIMIT_NOFILE of the \
                 sandbox host (LimitNOFILE= in its systemd unit, ulimit -Hn), or retry when a \
                 sandbox ends"
            ));
        }
        c.memory_mib += memory_mib + egress_mib;
        c.disk_mib += disk_mib;
        c.sandboxes += 1;
        Ok(Reservation {
            capacity: self.clone(),
            memory_mib,
            egress_mib,
            disk_mib,
        })
    }

    /// Accounts for the share of a sandbox that already runs (taken on again after a restart of
    /// the service), without the admission's checks: it is no new load, and refusing it would
    /// end a healthy run. Says so when the host is now committed beyond its memory limit (a
    /// smaller `SANDBOX_HOST_MEMORY_LIMIT_MIB` than before): creates wait until runs end.
    pub fn hold(self: &Arc<Self>, memory_mib: u64, egress_mib: u64, disk_mib: u64) -> Reservation {
        let mut c = self.lock();
        c.memory_mib += memory_mib + egress_mib;
        c.disk_mib += disk_mib;
        c.sandboxes += 1;
        if c.memory_mib > self.limits.memory_mib {
            tracing::warn!(
                committed_mib = c.memory_mib,
                limit_mib = self.limits.memory_mib,
                "The sandboxes taken on again commit more memory than SANDBOX_HOST_MEMORY_LIMIT_MIB: new sandboxes wait until enough runs end"
            );
        }
        Reservation {
            capacity: self.clone(),
            memory_mib,
            egress_mib,
            disk_mib,
        }
    }

    fn free_disk_mib(&self) -> u64 {
        statvfs_free_mib(&self.state_dir).unwrap_or(0)
    }

    /// What the live sandboxes' disks already take (their blocks, not their sizes).
    fn used_disk_mib(&self) -> u64 {
        let mut kib = 0u64;
        let Ok(dirs) = std::fs::read_dir(&self.state_dir) else {
            return 0;
        };
        for d in dirs.flatten() {
            let Ok(files) = std::fs::read_dir(d.path()) else {
                continue;
            };
            for f in files.flatten() {
                if let Ok(m) = f.metadata() {
                    use std::os::unix::fs::MetadataExt;
                    kib += m.blocks() / 2;
                }
            }
        }
        kib / 1024
    }

    /// What `GET /v1/health` and `/metrics` report: committed, limit, free.
    pub fn report(&self) -> Value {
        let c = self.lock();
        json!({
            "sandboxes": c.sandboxes,
            "memory_mib": {"committed": c.memory_mib, "limit": self.limits.memory_mib,
                           "free": self.limits.memory_mib.saturating_sub(c.memory_mib)},
            "disk_mib": {"committed": c.disk_mib, "overcommit": self.limits.disk_overcommit,
                         "free": self.free_disk_mib()},
            "fds": {"open": open_fds(), "limit": fd_limit(), "per_sandbox": FDS_PER_SANDBOX},
        })
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit; returns the new soft limit.
pub fn raise_fd_limit() -> u64 {
    sandbox_vmm::host::raise_fd_limit()
}

fn fd_limit() -> u64 {
    sandbox_vmm::host::fd_limit()
}

fn open_fds() -> u64 {
    sandbox_vmm::host::open_fds()
}

pub(crate) fn statvfs_free_mib(path: &std::path::Path) -> Option<u64> {
    sandbox_vmm::host::free_mib(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_admitted_up_to_the_limit_and_given_back() {
        let dir = tempfile::tempdir().unwrap();
        let cap = Capacity::new(
            Limits {
                memory_mib: 1000,
                disk_overcommit: 4,
            },
            dir.path().to_path_buf(),
        );
        let mut a = cap.reserve(500, 100, 0).unwrap();
        let e = cap.reserve(500, 100, 0).unwrap_err();
        assert!(
            e.contains("600 MiB of SANDBOX_HOST_MEMORY_LIMIT_MIB=1000"),
            "{e}"
        );
        assert!(e.contains("100 MiB for its network"), "{e}");
        // A pause gives the guest's memory back, not the egress stack's.
        assert_eq!(a.release_memory(), 500);
        assert_eq!(cap.report()["memory_mib"]["committed"], 100);
        a.reacquire_memory(500).unwrap();
        let b = cap.reserve(350, 50, 0).unwrap();
        assert_eq!(cap.report()["memory_mib"]["free"], 0);
        drop(a);
        let _c = cap.reserve(500, 100, 0).unwrap();
        drop(b);
        assert_eq!(cap.report()["sandboxes"], 1);
    }

    #[test]
    fn disks_need_free_space_by_the_overcommit_factor() {
        let dir = tempfile::tempdir().unwrap();
        let free = statvfs_free_mib(dir.path()).unwrap();
        let cap = Capacity::new(
            Limits {
                memory_mib: u64::MAX / 2,
                disk_overcommit: 1,
            },
            dir.path().to_path_buf(),
        );
        assert!(cap.reserve(1, 0, free / 4).is_ok());
        let e = cap.reserve(1, 0, free * 2).unwrap_err();
        assert!(e.contains("SANDBOX_HOST_DISK_OVERCOMMIT=1"), "{e}");
    }
}
