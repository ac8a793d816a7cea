//! What the host process can have and see: its file-descriptor limit and count, the machine's
//! memory, the free space of a directory, whether a process lives, for the service's budgets and
//! clean-up (the `api` crate has no `unsafe`; these are its system calls). Linux and macOS alike.

use std::path::Path;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit; returns the soft limit after.
pub fn raise_fd_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            let want = r.rlim_cur;
            r.rlim_cur = r.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                // macOS refuses an unlimited hard limit for open files: its ceiling is
                // OPEN_MAX (10240) unless kern.maxfilesperproc is lower.
                r.rlim_cur = (10240 as libc::rlim_t).min(r.rlim_max).max(want);
                libc::setrlimit(libc::RLIMIT_NOFILE, &r);
            }
        }
    }
    fd_limit()
}

/// Descriptors this process has open (`/proc/self/fd` on Linux, `/dev/fd` on macOS).
pub fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd")
        .or_else(|_| std::fs::read_dir("/dev/fd"))
        .map_or(0, |d| d.count() as u64)
}

/// Whether a process with this pid exists (a zombie counts; so does one of another user's).
pub fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 checks only that the process exists and may be signalled.
    if unsafe { libc::kill(pid, 0) } == 0 {
        return true;
    }
    std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// The machine's memory in MiB, if it can be read.
pub fn total_memory_mib() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kib| kib / 1024)
        })
    }
    #[cfg(target_os = "macos")]
    {
        let mut bytes: u64 = 0;
        let mut len = std::mem::size_of::<u64>();
        // SAFETY: sysctlbyname writes at most `len` bytes into `bytes`; the name is NUL-terminated.
        let rc = unsafe {
            libc::sysctlbyname(
                c"hw.memsize".as_ptr(),
                (&raw mut bytes).cast(),
                &raw mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        (rc == 0 && len == std::mem::size_of::<u64>()).then_some(bytes >> 20)
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        None
    }
}

/// The soft `RLIMIT_NOFILE` (1024 if it cannot be read).
pub fn fd_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 {
        r.rlim_cur
    } else {
        1024
    }
}

/// MiB free for an unprivileged user on the filesystem of `path`.
pub fn free_mib(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero statvfs is a valid value of the plain C struct.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `s` a properly sized out-parameter.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return None;
    }
    Some(s.f_bavail as u64 * s.f_frsize as u64 / (1024 * 1024))
}

/// Whether `path` is on a file system held in memory (tmpfs, ramfs). What the VM processes
/// write there (sandbox disks, pause snapshots) is then memory charged to their own limits,
/// not disk. Linux only: elsewhere, and when it cannot be told, `false`.
pub fn in_memory(path: &Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        const TMPFS_MAGIC: i64 = 0x0102_1994;
        const RAMFS_MAGIC: i64 = 0x8584_58f6;
        let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
            return false;
        };
        // SAFETY: an all-zero statfs is a valid value of the plain C struct.
        let mut s: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a NUL-terminated path and `s` a properly sized out-parameter.
        if unsafe { libc::statfs(c.as_ptr(), &mut s) } != 0 {
            return false;
        }
        #[allow(clippy::unnecessary_cast)] // f_type's type differs between C libraries
        let kind = s.f_type as i64;
        kind == TMPFS_MAGIC || kind == RAMFS_MAGIC
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_memory_from_disk() {
        if Path::new("/dev/shm").is_dir() {
            assert!(in_memory(Path::new("/dev/shm")));
        }
        assert!(!in_memory(Path::new("/proc")));
        assert!(!in_memory(Path::new("/no/such/dir")));
    }

    #[test]
    fn sees_this_process_and_the_machine() {
        assert!(process_alive(std::process::id()));
        assert!(!process_alive(0));
        assert!(!process_alive(u32::MAX));
        assert!(open_fds() >= 3);
        assert!(total_memory_mib().is_some_and(|m| m > 256));
    }
}
