//! A `sandbox-vm` refuses a service that speaks another version of the control protocol (a
//! binary left from another build beside a new service), saying so before it builds anything.

#![cfg(target_os = "linux")]

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use sandbox_control::vm::{self as control, Event, Request, VmConfig};

/// Starts the real `sandbox-vm` with its control socket as descriptor 3, sends it a start of
/// protocol `version`, and returns its answer and its exit code.
fn start_speaking(version: u32) -> (Option<Event>, Option<i32>) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let fd = theirs.as_raw_fd();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandbox-vm"));
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: between fork and exec only dup2, which is async-signal-safe, on a descriptor
    // this process owns.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, sandbox_vm::program::CONTROL_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    drop(theirs);
    let cfg = VmConfig {
        version,
        kvm_fd: 4,
        kernel_fd: 5,
        initrd_fd: None,
        cmdline: String::new(),
        memory_mib: 128,
        vcpus: 1,
        disks: vec![],
        vsock_cid: 3,
        net: None,
        restore: None,
        adopt_fd: None,
        token: String::new(),
    };
    control::send(&ours, &Request::Start(cfg), None).unwrap();
    let answer = control::Reader::new(&ours).read::<Event>().unwrap_or(None);
    let status = child.wait().unwrap();
    (answer, status.code())
}

#[test]
fn a_service_of_another_protocol_version_is_refused() {
    for version in [0, control::VERSION + 1] {
        let (answer, code) = start_speaking(version);
        match answer {
            Some(Event::Error(e)) => assert!(
                e.contains("control protocol") && e.contains("SANDBOX_HOST_VM_BINARY"),
                "{e}"
            ),
            other => panic!("version {version}: {other:?}"),
        }
        assert_eq!(code, Some(1), "version {version}");
    }
}
