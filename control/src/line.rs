//! How messages travel between the service and its jailed processes: one JSON object per line
//! over a Unix stream socket pair, with descriptors passed alongside (`SCM_RIGHTS`).
//!
//! Lines are bounded ([`MAX_LINE`]) on both sides: a VM or network process is as hostile as its
//! guest once the guest may have taken it over, so the service reads it like guest data.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use serde::{Deserialize, Serialize};

/// The longest line either side accepts.
pub const MAX_LINE: usize = 64 * 1024;
/// `recvmsg`'s flags: descriptors that arrive close-on-exec (where the system can do it at once).
#[cfg(target_os = "linux")]
const RECV_FLAGS: libc::c_int = libc::MSG_CMSG_CLOEXEC;
#[cfg(not(target_os = "linux"))]
const RECV_FLAGS: libc::c_int = 0;
/// The most descriptors one message carries.
const MAX_FDS: usize = 4;
/// What a reader's buffer keeps of its size between lines: a peer that once sent a line near
/// the limit does not hold that much of the reader's memory for good.
const KEEP: usize = 64 * 1024;
/// The longest error text a line's parse gives (serde repeats an unknown field's name whole).
const MAX_ERROR: usize = 256;

/// `text`, cut to [`MAX_ERROR`] bytes at a character's boundary.
fn cut(text: &str) -> String {
    if text.len() <= MAX_ERROR {
        return text.to_string();
    }
    let mut end = MAX_ERROR;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// Writes one message as a line, with `fd` attached when given.
pub fn send<T: Serialize>(sock: &UnixStream, msg: &T, fd: Option<RawFd>) -> io::Result<()> {
    send_fds(sock, msg, fd.as_slice())
}

/// Writes one message as a line, with `fds` (at most four) attached. The line is overwritten once
/// sent: the network process's settings carry secrets.
pub fn send_fds<T: Serialize>(sock: &UnixStream, msg: &T, fds: &[RawFd]) -> io::Result<()> {
    let mut line = zeroize::Zeroizing::new(serde_json::to_vec(msg).map_err(io::Error::other)?);
    line.push(b'\n');
    if fds.is_empty() {
        return (&*sock).write_all(&line);
    }
    if fds.len() > MAX_FDS {
        return Err(io::Error::other(format!(
            "{} descriptors in one message, more than {MAX_FDS}",
            fds.len()
        )));
    }
    // The descriptors travel with the first byte; the rest follows as plain bytes.
    let n = crate::fds::send_with_fds(sock.as_raw_fd(), &line, fds)?;
    (&*sock).write_all(&line[n..])
}

/// Reads lines (and the descriptors that come with them) from a control socket.
pub struct Reader {
    sock: RawFd,
    buf: Vec<u8>,
    /// How much of `buf` is known to hold no line feed.
    searched: usize,
    limit: usize,
    /// How long one line may take in all, however it trickles in (`None`: no bound).
    within: Option<std::time::Duration>,
    fds: std::collections::VecDeque<OwnedFd>,
}

impl Reader {
    /// Reads from `sock` (which the caller keeps open), lines of at most [`MAX_LINE`] bytes.
    pub fn new(sock: &UnixStream) -> Reader {
        Reader::with_limit(sock, MAX_LINE)
    }

    /// Reads from `sock`, lines of at most `limit` bytes (a network process's report is larger
    /// than a VM process's messages).
    pub fn with_limit(sock: &UnixStream, limit: usize) -> Reader {
        Reader {
            sock: sock.as_raw_fd(),
            buf: Vec::new(),
            searched: 0,
            limit,
            within: None,
            fds: Default::default(),
        }
    }

    /// Changes the longest line read from now on (a reply to a small request may be held to a
    /// smaller bound than the reader's largest).
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// Changes the bound on the time each line takes ([`Reader::within`]).
    pub fn set_within(&mut self, bound: std::time::Duration) {
        self.within = Some(bound);
    }

    /// Bounds the time each line takes in all (the socket's receive timeout is set to what is
    /// left before each read): a peer that sends a byte at a time cannot hold a read for longer.
    pub fn within(mut self, bound: std::time::Duration) -> Reader {
        self.within = Some(bound);
        self
    }

    /// Takes the bound on each line's time off again, the socket's receive timeout with it: a
    /// reader that waited a bounded time for an answer goes on to wait for whatever comes,
    /// whenever (a VM process's events after its adoption).
    pub fn unbounded(mut self) -> io::Result<Reader> {
        self.within = None;
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        };
        // SAFETY: setsockopt with a timeval that lives across the call; zero is no timeout.
        let r = unsafe {
            libc::setsockopt(
                self.sock,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const tv).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if r == 0 {
            Ok(self)
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// The next line, parsed; `None` at end of file. A line longer than the limit or one that
    /// does not parse is an error. Each byte is searched for the line's end once.
    pub fn read<T: for<'de> Deserialize<'de>>(&mut self) -> io::Result<Option<T>> {
        let deadline = self.within.map(|w| std::time::Instant::now() + w);
        loop {
            if let Some(i) = self.buf[self.searched..].iter().position(|&b| b == b'\n') {
                let i = self.searched + i;
                let parsed = serde_json::from_slice(&self.buf[..i])
                    .map(Some)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, cut(&e.to_string())));
                // The line may have carried secrets (the network process's settings): overwritten
                // before it goes, and a buffer a long line grew is given back.
                zeroize::Zeroize::zeroize(&mut self.buf[..=i]);
                self.buf.drain(..=i);
                self.buf.shrink_to(KEEP);
                self.searched = 0;
                return parsed;
            }
            self.searched = self.buf.len();
            if self.buf.len() > self.limit {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("a control line longer than {} bytes", self.limit),
                ));
            }
            if let Some(d) = deadline {
                let left = d.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "a control line took longer than its bound",
                    ));
                }
                set_receive_timeout(self.sock, left)?;
            }
            let mut chunk = [0u8; 64 * 1024];
            let n = match self.recv(&mut chunk) {
                // The receive timeout set above ran out (the clock it counts by may end it a
                // little before `deadline` does): the line took longer than its bound.
                Err(e) if deadline.is_some() && e.kind() == io::ErrorKind::WouldBlock => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "a control line took longer than its bound",
                    ));
                }
                r => r?,
            };
            if n == 0 {
                return Ok(None);
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// A descriptor that came on the socket, oldest first.
    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fds.pop_front()
    }

    fn recv(&mut self, chunk: &mut [u8]) -> io::Result<usize> {
        // SAFETY: recvmsg into our buffers; each descriptor the kernel wrote into the control
        // buffer is new and taken into an OwnedFd exactly once.
        unsafe {
            let mut iov = libc::iovec {
                iov_base: chunk.as_mut_ptr().cast(),
                iov_len: chunk.len(),
            };
            let space = libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) as usize;
            let mut control = vec![0u8; space];
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &raw mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            let n = loop {
                let n = libc::recvmsg(self.sock, &raw mut msg, RECV_FLAGS);
                if n >= 0 {
                    break n as usize;
                }
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            };
            let mut cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                    let len = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    for i in 0..len / std::mem::size_of::<RawFd>() {
                        let fd = std::ptr::read_unaligned(data.add(i));
                        let owned = OwnedFd::from_raw_fd(fd);
                        // macOS has no MSG_CMSG_CLOEXEC: the flag is set right after.
                        #[cfg(not(target_os = "linux"))]
                        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
                        // More than a message may carry: closed, never kept.
                        if self.fds.len() < MAX_FDS {
                            self.fds.push_back(owned);
                        }
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&raw const msg, cmsg);
            }
            Ok(n)
        }
    }
}

/// `SO_RCVTIMEO` of `sock` (at least a millisecond: zero would mean no bound).
fn set_receive_timeout(sock: RawFd, left: std::time::Duration) -> io::Result<()> {
    let left = left.max(std::time::Duration::from_millis(1));
    let tv = libc::timeval {
        tv_sec: left.as_secs() as _,
        tv_usec: left.subsec_micros() as _,
    };
    // SAFETY: setsockopt with a timeval that lives across the call.
    let r = unsafe {
        libc::setsockopt(
            sock,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const tv).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::{Event, Request};

    #[test]
    fn lines_and_a_descriptor_round_trip() {
        let (a, b) = UnixStream::pair().unwrap();
        let (x, _y) = UnixStream::pair().unwrap();
        send(&a, &Event::Started, None).unwrap();
        send(&a, &Event::Connected, Some(x.as_raw_fd())).unwrap();
        send(
            &a,
            &Request::Connect {
                port: 1024,
                timeout_ms: 5,
            },
            None,
        )
        .unwrap();
        let mut r = Reader::new(&b);
        assert!(matches!(r.read::<Event>().unwrap(), Some(Event::Started)));
        assert!(matches!(r.read::<Event>().unwrap(), Some(Event::Connected)));
        assert!(r.take_fd().is_some());
        assert!(matches!(
            r.read::<Request>().unwrap(),
            Some(Request::Connect {
                port: 1024,
                timeout_ms: 5
            })
        ));
        drop(a);
        assert!(r.read::<Event>().unwrap().is_none());
    }

    #[test]
    fn a_snapshot_request_carries_its_two_descriptors_in_order() {
        let (a, b) = UnixStream::pair().unwrap();
        let (p, q) = UnixStream::pair().unwrap();
        let (x, _y) = UnixStream::pair().unwrap();
        send_fds(
            &a,
            &Request::Snapshot {
                id: 7,
                resume: true,
            },
            &[p.as_raw_fd(), x.as_raw_fd()],
        )
        .unwrap();
        let mut r = Reader::new(&b);
        assert!(matches!(
            r.read::<Request>().unwrap(),
            Some(Request::Snapshot {
                id: 7,
                resume: true
            })
        ));
        let (first, _second) = (r.take_fd().unwrap(), r.take_fd().unwrap());
        assert!(r.take_fd().is_none());
        (&UnixStream::from(first)).write_all(b"!").unwrap();
        let mut got = [0u8; 1];
        std::io::Read::read_exact(&mut &q, &mut got).unwrap();
        assert_eq!(&got, b"!", "the first descriptor is the first sent");
        assert!(send_fds(&a, &Event::Started, &[p.as_raw_fd(); 5]).is_err());
    }

    #[test]
    fn an_endless_line_is_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        std::thread::spawn(move || {
            let junk = vec![b'x'; MAX_LINE * 2];
            let _ = (&a).write_all(&junk);
        });
        let mut r = Reader::new(&b);
        assert!(r.read::<Event>().is_err());
    }

    /// A line of megabytes (a network process's report) arrives whole through many reads, each
    /// byte searched once, and the next line after it; a reader's own limit holds.
    #[test]
    fn a_long_line_within_its_limit_is_read_and_one_past_it_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let big = "y".repeat(8 << 20);
        let writer = {
            let big = big.clone();
            std::thread::spawn(move || {
                send(&a, &big, None).unwrap();
                send(&a, &"after", None).unwrap();
                let _ = send(&a, &"z".repeat(1 << 20), None);
            })
        };
        let mut r = Reader::with_limit(&b, 9 << 20);
        let t = std::time::Instant::now();
        assert_eq!(r.read::<String>().unwrap().as_deref(), Some(big.as_str()));
        assert_eq!(r.read::<String>().unwrap().as_deref(), Some("after"));
        eprintln!("8 MiB line read in {:?}", t.elapsed());
        let mut small = Reader::with_limit(&b, 64 << 10);
        assert!(small.read::<String>().is_err(), "over the limit");
        drop(b); // the writer's last line, unread, fails
        writer.join().unwrap();
    }

    /// A line that trickles in a byte at a time, each well within a read's timeout, is still
    /// cut at the line's own bound.
    #[test]
    fn a_trickled_line_is_cut_at_its_bound() {
        let (a, b) = UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || {
            for _ in 0..40 {
                if (&a).write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        });
        let t = std::time::Instant::now();
        let mut r = Reader::new(&b).within(std::time::Duration::from_millis(500));
        let e = r.read::<String>().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(
            t.elapsed() < std::time::Duration::from_secs(1),
            "{:?}",
            t.elapsed()
        );
        drop(b);
        writer.join().unwrap();
    }
}
