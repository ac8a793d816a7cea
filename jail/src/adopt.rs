//! Finding a jailed process again after a restart of the service (issue 32): the process a
//! crashed or upgraded service left running is taken on by the next one only if it is provably
//! the same process (its pid, its start time, its uid, its cgroup), through a pidfd, so no
//! signal ever goes to a pid the kernel has since given to another process.

#[cfg(target_os = "linux")]
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;

use thiserror::Error;

/// Why a recorded process cannot be adopted; each says what is wrong with it.
#[derive(Debug, Error)]
pub enum AdoptError {
    /// No process has that pid any more.
    #[error("process {0} has ended")]
    Gone(u32),
    /// A process has the pid, but another one: it started at another time.
    #[error("process {pid} is not the one recorded (it started at tick {now}, not {recorded})")]
    Restarted {
        /// The pid.
        pid: u32,
        /// The recorded start time.
        recorded: u64,
        /// The start time of the process with that pid now.
        now: u64,
    },
    /// The process runs under another uid than the one recorded.
    #[error("process {pid} runs as uid {now}, not the recorded {recorded}")]
    OtherUid {
        /// The pid.
        pid: u32,
        /// The recorded uid.
        recorded: u32,
        /// Its uid now.
        now: u32,
    },
    /// Its recorded uid is not one of this service's jail ids, or another live process has it.
    #[error("process {pid}: {why}")]
    Ids {
        /// The pid.
        pid: u32,
        /// Why.
        why: String,
    },
    /// Its recorded cgroup is not one of this service's, or the process is not in it.
    #[error("process {pid}: its cgroup {}: {why}", .dir.display())]
    Cgroup {
        /// The pid.
        pid: u32,
        /// The directory.
        dir: PathBuf,
        /// Why.
        why: String,
    },
    /// The host could not be asked (no `/proc`, no pidfd).
    #[error("process {pid}: {what}: {source}")]
    Host {
        /// The pid.
        pid: u32,
        /// What was being done.
        what: &'static str,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// This system cannot adopt processes (macOS).
    #[error("re-adopting a VM's process after a restart needs Linux")]
    Unsupported,
}

#[cfg(target_os = "linux")]
/// The start time of process `pid`, in clock ticks since boot (field 22 of `/proc/<pid>/stat`,
/// read after the name in parentheses, which may hold spaces and parentheses of its own).
pub fn start_time(pid: u32) -> std::io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_start_time(&stat).ok_or_else(|| std::io::Error::other("an unreadable /proc/<pid>/stat"))
}

#[cfg(target_os = "linux")]
fn parse_start_time(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is the first after the name: field 22 is the 20th.
    after_name.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(target_os = "linux")]
/// The real uid of process `pid` (`/proc/<pid>/status`).
fn uid_of(pid: u32) -> std::io::Result<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|u| u.parse().ok())
        .ok_or_else(|| std::io::Error::other("no Uid line in /proc/<pid>/status"))
}

#[cfg(target_os = "linux")]
/// A pidfd of process `pid`.
fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open with integer arguments; a non-negative result is a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the descriptor is new and ours.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(target_os = "linux")]
/// Whether the process of `pidfd` has ended, waiting at most `timeout_ms` (0: not at all). A
/// pidfd becomes readable when its process ends, whoever its parent is.
pub(crate) fn ended(pidfd: &OwnedFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(timeout_ms as u64);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        // SAFETY: poll on one pollfd we own.
        let r = unsafe { libc::poll(&raw mut p, 1, left.as_millis() as i32) };
        if r > 0 {
            return p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
        }
        if r == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return false;
        }
    }
}

#[cfg(target_os = "linux")]
/// A pidfd of the process `identity` records, once it is shown to be that process: the pidfd
/// is opened first and the start time read after, so a match means the pidfd's process is the
/// recorded one (the recorded one started before the pidfd was opened; a process that took its
/// pid after it ended would have started later).
pub(crate) fn open(identity: &crate::Identity) -> Result<OwnedFd, AdoptError> {
    let pid = identity.pid;
    let pidfd = pidfd_open(pid).map_err(|e| match e.raw_os_error() {
        Some(libc::ESRCH) => AdoptError::Gone(pid),
        _ => AdoptError::Host {
            pid,
            what: "opening its pidfd",
            source: e,
        },
    })?;
    let now = start_time(pid).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => AdoptError::Gone(pid),
        _ => AdoptError::Host {
            pid,
            what: "reading its start time",
            source: e,
        },
    })?;
    if now != identity.start_time {
        return Err(AdoptError::Restarted {
            pid,
            recorded: identity.start_time,
            now,
        });
    }
    if let Some(recorded) = identity.uid {
        let now = uid_of(pid).map_err(|source| AdoptError::Host {
            pid,
            what: "reading its uid",
            source,
        })?;
        if now != recorded {
            return Err(AdoptError::OtherUid { pid, recorded, now });
        }
    }
    if ended(&pidfd, 0) {
        return Err(AdoptError::Gone(pid));
    }
    Ok(pidfd)
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn the_start_time_is_read_after_a_name_with_spaces_and_parentheses() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 \
                    10 18446744073709551615";
        assert_eq!(parse_start_time(stat), Some(987_654));
        assert_eq!(parse_start_time("42 (x) S 1 2"), None);
        assert_eq!(parse_start_time("no parenthesis"), None);
    }

    #[test]
    fn this_process_is_found_and_a_wrong_start_time_is_refused() {
        let pid = std::process::id();
        let start_time = start_time(pid).unwrap();
        let me = crate::Identity {
            pid,
            start_time,
            uid: None,
            cgroup: vec![],
        };
        let fd = open(&me).unwrap();
        assert!(!ended(&fd, 0));
        let other = crate::Identity {
            start_time: start_time + 1,
            ..me.clone()
        };
        assert!(matches!(open(&other), Err(AdoptError::Restarted { .. })));
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        let wrong_uid = crate::Identity {
            uid: Some(uid.wrapping_add(1)),
            ..me
        };
        assert!(matches!(open(&wrong_uid), Err(AdoptError::OtherUid { .. })));
    }

    #[test]
    fn an_ended_process_is_gone() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start_time = start_time(pid).unwrap();
        let fd = pidfd_open(pid).unwrap();
        child.wait().unwrap();
        assert!(ended(&fd, 1000));
        let gone = crate::Identity {
            pid,
            start_time,
            uid: None,
            cgroup: vec![],
        };
        assert!(matches!(open(&gone), Err(AdoptError::Gone(_))));
    }
}
