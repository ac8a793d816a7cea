//! Opening the byte stream to the host: a named virtio-serial port or a vsock listener.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// Where the agent talks to the host.
#[derive(Debug, Clone)]
pub enum ChannelSpec {
    /// A virtio-serial port with this name (QEMU backend).
    Serial(String),
    /// A vsock port on which the agent accepts the host's connection (KVM backend).
    Vsock(u32),
}

impl ChannelSpec {
    /// Whether this is a virtio-serial port (whose EOF means "host away for now").
    pub fn is_serial(&self) -> bool {
        matches!(self, ChannelSpec::Serial(_))
    }
}

impl fmt::Display for ChannelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChannelSpec::Serial(n) => write!(f, "serial:{n}"),
            ChannelSpec::Vsock(p) => write!(f, "vsock:{p}"),
        }
    }
}

impl FromStr for ChannelSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            Some(("serial", name)) if !name.is_empty() => Ok(ChannelSpec::Serial(name.to_owned())),
            Some(("vsock", port)) => port
                .parse()
                .map(ChannelSpec::Vsock)
                .map_err(|_| format!("bad vsock port `{port}` in channel `{s}`")),
            _ => Err(format!(
                "bad channel `{s}`: expected serial:<port name> or vsock:<port>"
            )),
        }
    }
}

/// An open connection: separate handles for reading and writing the same stream.
pub struct Conn {
    /// Frames from the host.
    pub reader: File,
    /// Frames to the host.
    pub writer: File,
}

/// Opens the channel, waiting up to 10 s for a serial port to appear (devices may still be
/// probing when the agent starts). For vsock, blocks until the host connects.
pub fn open(spec: &ChannelSpec) -> io::Result<Conn> {
    match spec {
        ChannelSpec::Serial(name) => {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Some(dev) = find_serial_port(name)? {
                    let f = OpenOptions::new().read(true).write(true).open(&dev)?;
                    return Ok(Conn {
                        writer: f.try_clone()?,
                        reader: f,
                    });
                }
                if Instant::now() > deadline {
                    return Err(io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("no virtio-serial port named `{name}` in /sys/class/virtio-ports"),
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        ChannelSpec::Vsock(port) => {
            let listener = vsock_listen(*port)?;
            let f = vsock_accept(&listener)?;
            Ok(Conn {
                writer: f.try_clone()?,
                reader: f,
            })
        }
    }
}

pub(crate) fn find_serial_port(name: &str) -> io::Result<Option<PathBuf>> {
    let dir = match std::fs::read_dir("/sys/class/virtio-ports") {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    for entry in dir {
        let entry = entry?;
        let port_name = std::fs::read_to_string(entry.path().join("name")).unwrap_or_default();
        if port_name.trim_end() == name {
            return Ok(Some(PathBuf::from("/dev").join(entry.file_name())));
        }
    }
    Ok(None)
}

fn vsock_listen(port: u32) -> io::Result<OwnedFd> {
    // SAFETY: socket() has no memory preconditions; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket we own exclusively.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_vm is plain data; all-zero is a valid starting value.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_port = port;
    addr.svm_cid = libc::VMADDR_CID_ANY;
    let len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
    // SAFETY: addr is a valid sockaddr_vm of `len` bytes that outlives the call.
    let rc = unsafe { libc::bind(fd, (&raw const addr).cast(), len) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a bound socket.
    if unsafe { libc::listen(fd, 1) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(owned)
}

fn vsock_accept(listener: &OwnedFd) -> io::Result<File> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: null address pointers are allowed by accept4; the fd is a listening socket.
        let fd = unsafe {
            libc::accept4(
                listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if fd >= 0 {
            // SAFETY: accept4 returned a new descriptor that nothing else owns.
            return Ok(unsafe { File::from_raw_fd(fd) });
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_channel_specs() {
        assert!(
            matches!("serial:sandbox.agent".parse(), Ok(ChannelSpec::Serial(n)) if n == "sandbox.agent")
        );
        assert!(matches!("vsock:1024".parse(), Ok(ChannelSpec::Vsock(1024))));
        assert!("vsock:x".parse::<ChannelSpec>().is_err());
        assert!("serial:".parse::<ChannelSpec>().is_err());
        assert!("tcp:1".parse::<ChannelSpec>().is_err());
    }
}
