//! The network process's own filter, tried from inside a process that installed it: this test
//! binary runs itself as the payload (`SANDBOX_NET_SEAL_PAYLOAD`), seals, and tries what a guest
//! that took the process over would try next. A thread still starts and a pipe it holds still
//! carries bytes, and a listening socket it holds still accepts (`accept4`: the adoption
//! socket's); opening a file (to read or to write), opening a socket of any family, listening,
//! connecting and the old `accept` fail with EACCES; starting a program kills it.

#![cfg(target_os = "linux")]

use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;

const PAYLOAD: &str = "SANDBOX_NET_SEAL_PAYLOAD";

#[test]
fn payload() {
    if std::env::var_os(PAYLOAD).is_none() {
        return;
    }
    let dir = std::env::var(PAYLOAD).unwrap();
    // A socket made before the filter, as the service's connected sockets are.
    let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // Were `accept` let through, it answers at once rather than hang the test.
    listener.set_nonblocking(true).unwrap();
    // A listening socket made before the filter, as the adoption socket is (no connection
    // waits: an accept answers at once).
    let adoption = std::os::unix::net::UnixListener::bind(format!("{dir}/adopt.sock")).unwrap();
    adoption.set_nonblocking(true).unwrap();
    sandbox_net::seal::seal().expect("sealed");
    // What it still does.
    use std::io::{Read, Write};
    std::thread::spawn(move || a.write_all(b"ok").unwrap())
        .join()
        .expect("a thread starts");
    let mut two = [0u8; 2];
    b.read_exact(&mut two)
        .expect("a socket it holds still works");
    // std accepts with `accept4`: the filter lets it through to the socket, which has nothing.
    assert_eq!(
        adoption.accept().unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock,
        "accept4 on a socket it holds passes the filter"
    );
    // What it may no longer do.
    let eacces = |what: &str, e: std::io::Error| {
        assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{what}: {e}");
    };
    eacces(
        "a file cannot be made",
        std::fs::File::create(format!("{dir}/made")).unwrap_err(),
    );
    eacces(
        "a file cannot be read",
        std::fs::read_to_string("/proc/self/status").unwrap_err(),
    );
    eacces(
        "no IPv4 socket",
        std::net::UdpSocket::bind("127.0.0.1:0").unwrap_err(),
    );
    eacces(
        "no connection to the host's loopback",
        std::net::TcpStream::connect(("127.0.0.1", port)).unwrap_err(),
    );
    eacces(
        "no Unix socket",
        std::os::unix::net::UnixStream::pair().unwrap_err(),
    );
    // SAFETY: accept on a descriptor the test holds; a descriptor it returned would be leaked.
    let r = unsafe {
        libc::syscall(
            libc::SYS_accept,
            listener.as_raw_fd(),
            std::ptr::null_mut::<libc::sockaddr>(),
            std::ptr::null_mut::<libc::socklen_t>(),
        )
    };
    assert_eq!(
        (r, std::io::Error::last_os_error().raw_os_error()),
        (-1, Some(libc::EACCES)),
        "no accept (the old call)"
    );
    // SAFETY: plain socket calls; a descriptor, if any, is never used.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    assert_eq!(
        (fd, std::io::Error::last_os_error().raw_os_error()),
        (-1, Some(libc::EACCES)),
        "no packet socket"
    );
    println!("PAYLOAD-CHECKED");
    // The last: this kills the process.
    let _ = std::process::Command::new("/bin/true").status();
    println!("ESCAPED");
}

#[test]
fn the_filter_holds() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "payload", "--nocapture", "--test-threads=1"])
        .env(PAYLOAD, dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("PAYLOAD-CHECKED"), "{stdout}\n{stderr}");
    assert!(!stdout.contains("ESCAPED"), "{stdout}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGSYS),
        "starting a program kills it: {:?}\n{stderr}",
        out.status
    );
    assert!(!dir.path().join("made").exists());
}

const X32_PAYLOAD: &str = "SANDBOX_NET_SEAL_X32";

/// An x32 system call (x86_64's numbers with bit 30 set), which no rule written for x86_64's
/// numbers matches: the filter kills the process that makes one, where the kernel would run it.
#[cfg(target_arch = "x86_64")]
#[test]
fn x32_payload() {
    if std::env::var_os(X32_PAYLOAD).is_none() {
        return;
    }
    sandbox_net::seal::seal().expect("sealed");
    println!("X32-SEALED");
    // SAFETY: getpid under x32's number: no memory is touched.
    let r = unsafe { libc::syscall(0x4000_0000 | libc::SYS_getpid) };
    println!("ESCAPED {r}");
}

#[cfg(target_arch = "x86_64")]
#[test]
fn an_x32_call_kills_it() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "x32_payload", "--nocapture", "--test-threads=1"])
        .env(X32_PAYLOAD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("X32-SEALED"), "{stdout}");
    assert!(!stdout.contains("ESCAPED"), "{stdout}");
    assert_eq!(out.status.signal(), Some(libc::SIGSYS), "{:?}", out.status);
}
