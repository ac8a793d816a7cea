//! Pseudo terminals, for an exec that asks for one (an interactive shell): the pair is opened
//! here, the child made the leader of a new session with the terminal as its controlling one,
//! and the terminal's output read until the session is done with it.
//!
//! Only what a terminal needs beyond pipes is here; the exec itself (spawn, stdin, timeout,
//! exit) is `exec.rs`'s.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sandbox_protocol::message::TermSize;

/// While the session runs, how long one wait for output lasts before the reader looks at its
/// stop flag again.
const POLL_MS: i32 = 200;
/// Once the session's leader has exited: output that does not come within this is not waited
/// for (what it wrote before exiting is already in the terminal's buffer; the kernel moves it
/// to the master side within microseconds, or milliseconds in a loaded guest).
const QUIET_MS: i32 = 100;
/// Once the session's leader has exited, the most time spent reading what is left: a job in
/// the background that keeps writing would otherwise never leave a quiet moment.
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(1);
/// A terminal whose host went away is hung up (SIGHUP); what of its session is still there
/// this long after is killed.
const HANG_UP_GRACE: Duration = Duration::from_secs(5);
/// Passes over `/proc` a session's kill makes at most: a process forked during one pass is
/// found by the next.
const KILL_PASSES: usize = 5;

/// Both ends of a new pseudo terminal.
pub struct Pty {
    /// The side the agent reads and writes.
    pub master: File,
    /// The side the process gets as stdin, stdout, stderr and controlling terminal.
    slave: OwnedFd,
}

impl Pty {
    /// A new terminal of `size` (from `/dev/ptmx`; both ends close on exec).
    pub fn open(size: TermSize) -> io::Result<Pty> {
        // SAFETY: posix_openpt takes flags only and returns a new descriptor or -1.
        let fd = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let master = unsafe { File::from_raw_fd(fd) };
        // SAFETY: `master` is an open pty master; unlockpt takes nothing else.
        if unsafe { libc::unlockpt(master.as_raw_fd()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut name = [0 as libc::c_char; 128];
        // SAFETY: `name` is writable for its full length, which is what is passed.
        let r = unsafe { libc::ptsname_r(master.as_raw_fd(), name.as_mut_ptr(), name.len()) };
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
        // SAFETY: ptsname_r wrote a NUL-terminated path into `name` on success.
        let fd = unsafe {
            libc::open(
                name.as_ptr(),
                libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let slave = unsafe { OwnedFd::from_raw_fd(fd) };
        set_size(&master, size)?;
        Ok(Pty { master, slave })
    }

    /// Makes `cmd` run on the terminal: its stdin, stdout and stderr, and, in a session of its
    /// own, its controlling terminal (so a shell has job control and Ctrl-C reaches the
    /// foreground job). Consumes the slave side: once `cmd` has spawned and is dropped, only
    /// the child holds it, and the master reads EOF (EIO) when the child's session is done.
    pub fn attach(self, cmd: &mut Command) -> io::Result<File> {
        cmd.stdin(Stdio::from(self.slave.try_clone()?))
            .stdout(Stdio::from(self.slave.try_clone()?))
            .stderr(Stdio::from(self.slave));
        // SAFETY: the closure only makes async-signal-safe system calls (setsid, ioctl) and
        // touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(io::Error::last_os_error());
                }
                // Stdin is the slave by now (std sets up the descriptors before this runs).
                if libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(self.master)
    }
}

/// Gives the terminal of `master` a new size; the kernel sends SIGWINCH to its foreground
/// process group when the size changes.
pub fn set_size(master: &File, size: TermSize) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: `ws` is a valid winsize for the duration of the call; TIOCSWINSZ only reads it.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ as _, &ws) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The terminal's output, as a reader that ends at the terminal's hang-up (EIO: every process
/// of the session has closed it) or, once `stop` is set (the session's leader has exited), as
/// soon as no more output comes within [`QUIET_MS`]. Without the second, a background job that
/// keeps the terminal open would keep the exec from ending, where a terminal session ends with
/// its shell (as ssh's does).
pub struct Output {
    master: File,
    stop: Arc<AtomicBool>,
    /// When the reader first saw `stop`.
    stopped_at: Option<Instant>,
}

impl Output {
    /// Reads `master` until the hang-up or until `stop` and a quiet moment.
    pub fn new(master: File, stop: Arc<AtomicBool>) -> Output {
        Output {
            master,
            stop,
            stopped_at: None,
        }
    }
}

impl Read for Output {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let stopping = self.stop.load(Ordering::SeqCst);
            if stopping {
                let at = *self.stopped_at.get_or_insert_with(Instant::now);
                if at.elapsed() >= DRAIN_AFTER_EXIT {
                    return Ok(0);
                }
            }
            let mut pfd = libc::pollfd {
                fd: self.master.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let wait = if stopping { QUIET_MS } else { POLL_MS };
            // SAFETY: `pfd` is one valid pollfd for the duration of the call.
            let r = unsafe { libc::poll(&mut pfd, 1, wait) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if r == 0 {
                if stopping {
                    return Ok(0);
                }
                continue;
            }
            match self.master.read(buf) {
                Ok(n) => return Ok(n),
                // The slave side is closed by every process that had it: the session is over.
                Err(e) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Sends `sig` to every process of session `sid` (a terminal's processes are in several groups:
/// the shell's and each job's). A process that started a session of its own (a daemon) is not
/// in it, as it is not in the group an exec without a terminal kills. The walk is over
/// `/proc`, bounded by the number of processes.
pub fn kill_session(sid: i32, sig: i32) {
    if sid <= 0 {
        return;
    }
    // The leader's group first: it does not depend on /proc.
    // SAFETY: killpg has no memory preconditions; a group gone is at worst ESRCH.
    unsafe { libc::killpg(sid, sig) };
    for _ in 0..KILL_PASSES {
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return;
        };
        let mut found = false;
        for ent in dir.flatten() {
            let Some(pid) = ent.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            if session_of(pid) == Some(sid) {
                found = true;
                // SAFETY: kill has no memory preconditions; a pid gone since is at worst ESRCH.
                unsafe { libc::kill(pid, sig) };
            }
        }
        // A signal that does not end a process (SIGHUP caught) finds it again: one pass.
        if !found || sig != libc::SIGKILL {
            return;
        }
    }
}

/// Hangs up a session whose host went away: SIGHUP now, as a terminal's hang-up sends, and
/// SIGKILL to what is left of it after [`HANG_UP_GRACE`] (a process may ignore SIGHUP, and a
/// terminal exec has no timeout to end it otherwise).
pub fn hang_up(sid: i32) {
    kill_session(sid, libc::SIGHUP);
    let _ = std::thread::Builder::new()
        .name("hang-up".into())
        .spawn(move || {
            std::thread::sleep(HANG_UP_GRACE);
            kill_session(sid, libc::SIGKILL);
        });
}

/// The session of `pid` while it runs (not of a zombie, which no signal reaches), from
/// `/proc/<pid>/stat` (its sixth field; the second, the command's name in parentheses, may
/// hold spaces and parentheses itself, so fields are counted from the last `)`).
fn session_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // state, ppid, pgrp, session
    if fields.next()? == "Z" {
        return None;
    }
    fields.nth(2)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_of_reads_this_process() {
        // SAFETY: getsid(0) has no preconditions.
        let sid = unsafe { libc::getsid(0) };
        assert_eq!(session_of(std::process::id() as i32), Some(sid));
    }

    #[test]
    fn a_size_of_zero_or_too_large_is_refused() {
        assert!(TermSize { rows: 24, cols: 80 }.check().is_ok());
        let e = TermSize { rows: 0, cols: 80 }.check().unwrap_err();
        assert!(e.contains("rows must be 1 to 4096, not 0"), "{e}");
        let e = TermSize {
            rows: 24,
            cols: 5000,
        }
        .check()
        .unwrap_err();
        assert!(e.contains("cols must be 1 to 4096, not 5000"), "{e}");
    }
}
