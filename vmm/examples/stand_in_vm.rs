//! A stand-in for `sandbox-vm` that acts as one a guest took over might, for the service's
//! tests (`vmm/src/kvm/process.rs`). The configuration's command line says what it does:
//!
//! - `lie`: reports that the host asked it to stop, then ends with the seccomp trap's status
//!   (159). The service must record what the kernel says.
//! - `grow`: tries to write past the end of its first disk and to lengthen it, and reports what
//!   the kernel answered as its start-up error.
//! - `hold`: reports itself started, answers a connection request with one end of a socket
//!   pair, and waits for the service to stop it, so a test can look at what it holds.

#[cfg(target_os = "linux")]
mod stand_in {
    use std::io::{BufRead, BufReader};
    use std::os::fd::{AsRawFd, FromRawFd, RawFd};
    use std::os::unix::net::UnixStream;

    use sandbox_control::vm::{self as control, Event, Request, VmConfig};

    fn say(ctl: &UnixStream, e: &Event) {
        let _ = control::send(ctl, e, None);
    }

    /// Writes one byte at `at` and lengthens the file to `at + 1`: what the kernel says to each.
    fn grow(fd: RawFd, at: u64) -> String {
        // SAFETY: pwrite and ftruncate on an inherited descriptor, from a valid buffer; SIGXFSZ
        // ignored so a refusal is an error code, not the end of the process.
        let (w, t) = unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let w = libc::pwrite(fd, b"x".as_ptr().cast(), 1, at as libc::off_t);
            let w = if w < 0 {
                std::io::Error::last_os_error().to_string()
            } else {
                "written".into()
            };
            let t = libc::ftruncate(fd, (at + 1) as libc::off_t);
            let t = if t < 0 {
                std::io::Error::last_os_error().to_string()
            } else {
                "lengthened".into()
            };
            (w, t)
        };
        format!("write: {w}; truncate: {t}")
    }

    pub fn main() {
        // SAFETY: descriptor 3 is the control socket the service passes every VM process.
        let ctl = unsafe { UnixStream::from_raw_fd(3) };
        let mut reader = BufReader::new(ctl.try_clone().expect("the control socket"));
        let mut line = String::new();
        let _ = reader.read_line(&mut line);
        let cfg: VmConfig = match serde_json::from_str::<Request>(&line) {
            Ok(Request::Start(cfg)) => cfg,
            other => {
                say(&ctl, &Event::Error(format!("no configuration: {other:?}")));
                std::process::exit(2);
            }
        };
        match cfg.cmdline.as_str() {
            "lie" => {
                say(
                    &ctl,
                    &Event::Exit {
                        reason: "stopped by the host as it asked".into(),
                        requested: true,
                        console: vec![],
                    },
                );
                std::process::exit(159);
            }
            "grow" => {
                let disk = cfg.disks.first().map(|d| d.fd).unwrap_or(-1);
                // SAFETY: a zeroed stat is a valid value to fill.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: fstat into our struct on an inherited descriptor.
                unsafe { libc::fstat(disk, &raw mut st) };
                let len = st.st_size as u64;
                say(&ctl, &Event::Error(grow(disk, len)));
            }
            "hold" => {
                say(&ctl, &Event::Started);
                // Until the service closes the socket or asks for a stop.
                loop {
                    line.clear();
                    match reader.read_line(&mut line) {
                        Ok(0) | Err(_) => break,
                        Ok(_) if line.contains("stop") => break,
                        Ok(_) if line.contains("connect") => {
                            let (ours, theirs) = UnixStream::pair().expect("a socket pair");
                            let _ =
                                control::send(&ctl, &Event::Connected, Some(theirs.as_raw_fd()));
                            // Kept open: the service's agent channel stays up.
                            std::mem::forget(ours);
                        }
                        Ok(_) => {}
                    }
                }
                say(
                    &ctl,
                    &Event::Exit {
                        reason: "stopped by the host".into(),
                        requested: true,
                        console: vec![],
                    },
                );
            }
            other => say(&ctl, &Event::Error(format!("unknown part {other:?}"))),
        }
    }
}

#[cfg(target_os = "linux")]
fn main() {
    stand_in::main();
}

/// The KVM backend, and so a VM process, exists on Linux alone.
#[cfg(not(target_os = "linux"))]
fn main() {}
