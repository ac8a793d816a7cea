//! The network process's own filter, tried from inside a process that installed it: this test
//! binary runs itself as the payload (`SANDBOX_NET_SEAL_PAYLOAD`), seals, and tries what a guest
//! that took the process over would try next. Reading a file and opening an upstream socket still
//! work; writing a file and a packet socket fail with EACCES; starting a program kills it.

#![cfg(target_os = "linux")]

use std::os::unix::process::ExitStatusExt;

const PAYLOAD: &str = "SANDBOX_NET_SEAL_PAYLOAD";

#[test]
fn payload() {
    if std::env::var_os(PAYLOAD).is_none() {
        return;
    }
    let dir = std::env::var(PAYLOAD).unwrap();
    sandbox_net::seal::seal().expect("sealed");
    // What it still does.
    std::fs::read_to_string("/proc/self/status").expect("a file can be read");
    std::net::UdpSocket::bind("127.0.0.1:0").expect("an IPv4 socket");
    // What it may no longer do.
    let wrote = std::fs::File::create(format!("{dir}/made"));
    assert_eq!(
        wrote.err().and_then(|e| e.raw_os_error()),
        Some(libc::EACCES),
        "a file cannot be made"
    );
    // SAFETY: a plain socket call; the descriptor, if any, is closed at once.
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
