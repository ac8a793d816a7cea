//! The control channel between the service and a VM process: one JSON object per line over a
//! Unix stream socket pair, and the agent channel's descriptor passed back with `SCM_RIGHTS`.
//!
//! Lines are bounded ([`MAX_LINE`]) on both sides: the VM process is as hostile as its guest
//! once the guest may have taken it over, so the service reads it like guest data.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use serde::{Deserialize, Serialize};

/// The longest line either side accepts.
pub const MAX_LINE: usize = 64 * 1024;
/// The most descriptors one message carries.
const MAX_FDS: usize = 4;

/// What the VM process is to build. Every file is a descriptor number it inherited.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmConfig {
    /// The protocol's version ([`crate::VERSION`]) the service speaks; a VM process of another
    /// refuses to start (a `sandbox-vm` left from another build beside a new service).
    #[serde(default)]
    pub version: u32,
    /// `/dev/kvm`.
    pub kvm_fd: RawFd,
    /// The kernel.
    pub kernel_fd: RawFd,
    /// The initramfs.
    pub initrd_fd: Option<RawFd>,
    /// The kernel command line (complete).
    pub cmdline: String,
    /// Guest memory.
    pub memory_mib: u32,
    /// vCPUs.
    pub vcpus: u8,
    /// Disks in order.
    pub disks: Vec<DiskFd>,
    /// The guest's vsock context id.
    pub vsock_cid: u64,
    /// The network: frames on a stream socket as a 4-byte big-endian length and the frame.
    pub net: Option<NetFd>,
    /// Start from this snapshot instead of booting the kernel. (Where a snapshot is written
    /// comes only with each [`Request::Snapshot`]: until then the process holds no file it
    /// could write one to.)
    pub restore: Option<SnapshotFds>,
}

/// A snapshot's two files, to restore from (the state read, the memory mapped privately).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct SnapshotFds {
    /// The state file.
    pub state_fd: RawFd,
    /// The memory file.
    pub memory_fd: RawFd,
}

/// One disk.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DiskFd {
    /// Its descriptor (read-write unless `read_only`).
    pub fd: RawFd,
    /// Whether the guest may write it.
    pub read_only: bool,
}

/// The network device.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NetFd {
    /// The frames' socket.
    pub fd: RawFd,
    /// The guest's MAC address.
    pub mac: [u8; 6],
}

/// From the service to the VM process.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Request {
    /// Build and start the machine (the first message, once).
    Start(VmConfig),
    /// Connect to a vsock port of the guest, retrying while nothing listens, for at most
    /// `timeout_ms`; the answer is [`Event::Connected`] with the descriptor, or
    /// [`Event::ConnectFailed`].
    Connect {
        /// The port.
        port: u32,
        /// The bound.
        timeout_ms: u64,
    },
    /// Stop the machine; the process ends after [`Event::Exit`].
    Stop,
    /// End the machine as failed for `reason`.
    Fail {
        /// Why the host gave up on it.
        reason: String,
    },
    /// Answer with [`Event::Diagnostics`].
    Diagnostics,
    /// Pause the guest and write its snapshot; run on after if `resume`. Two descriptors come
    /// with it: a pipe the state goes into (the service bounds it and writes the file), and the
    /// memory file, which the service created at the guest's size (it is written through a
    /// mapping, so the process's file size limit stays at its disks'). The answer is
    /// [`Event::Snapshot`].
    Snapshot {
        /// Named in the answer, so a late answer to an earlier request is never taken for it.
        id: u64,
        /// Let the guest run again once written.
        resume: bool,
    },
}

/// From the VM process to the service.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// The machine is built and its vCPUs run.
    Started,
    /// The machine could not be built.
    Error(String),
    /// The guest wrote its boot marker.
    Marker,
    /// Connected; the agent channel's descriptor came with this message.
    Connected,
    /// Not connected, with why.
    ConnectFailed(String),
    /// vCPU activity, for an error message.
    Diagnostics(String),
    /// A snapshot was written, or why not.
    Snapshot {
        /// The request's.
        id: u64,
        /// What it cost, or why not.
        result: Result<crate::SnapshotDone, String>,
    },
    /// The machine ended.
    Exit {
        /// For a person.
        reason: String,
        /// The host asked for it.
        requested: bool,
        /// The last console lines.
        console: Vec<String>,
    },
}

/// Writes one message as a line, with `fd` attached when given.
pub fn send<T: Serialize>(sock: &UnixStream, msg: &T, fd: Option<RawFd>) -> io::Result<()> {
    send_fds(sock, msg, fd.as_slice())
}

/// Writes one message as a line, with `fds` (at most four) attached.
pub fn send_fds<T: Serialize>(sock: &UnixStream, msg: &T, fds: &[RawFd]) -> io::Result<()> {
    let mut line = serde_json::to_vec(msg).map_err(io::Error::other)?;
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
    let n = crate::send_with_fds(sock.as_raw_fd(), &line, fds)?;
    (&*sock).write_all(&line[n..])
}

/// Reads lines (and the descriptors that come with them) from a control socket.
pub struct Reader {
    sock: RawFd,
    buf: Vec<u8>,
    fds: std::collections::VecDeque<OwnedFd>,
}

impl Reader {
    /// Reads from `sock` (which the caller keeps open).
    pub fn new(sock: &UnixStream) -> Reader {
        Reader {
            sock: sock.as_raw_fd(),
            buf: Vec::new(),
            fds: Default::default(),
        }
    }

    /// The next line, parsed; `None` at end of file. A line longer than [`MAX_LINE`] or one
    /// that does not parse is an error.
    pub fn read<T: for<'de> Deserialize<'de>>(&mut self) -> io::Result<Option<T>> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return serde_json::from_slice(&line[..i])
                    .map(Some)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e));
            }
            if self.buf.len() > MAX_LINE {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("a control line longer than {MAX_LINE} bytes"),
                ));
            }
            let mut chunk = [0u8; 4096];
            let n = self.recv(&mut chunk)?;
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
                let n = libc::recvmsg(self.sock, &raw mut msg, libc::MSG_CMSG_CLOEXEC);
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
