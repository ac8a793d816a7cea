//! The VM process (`sandbox-vm`): one KVM machine, run in the jail the service started it in.
//!
//! It holds nothing but its guest: `/dev/kvm`, its kernel, initramfs and disks as descriptors, a
//! socket for the guest's frames, the control socket (descriptor 3), the console pipe
//! (descriptor 1) and its own log (descriptor 2). The service's keys, other guests, the network
//! and the host's files are out of its reach (see `docs/threat-model.md`).

use std::io::Write;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use sandbox_devices::virtio::vsock::ConnectError;

use crate::machine::{ConsoleSink, DiskConfig, FileRef, Machine, MachineConfig, MachineExit};
use crate::seal::{self, ThreadKind};
use sandbox_control::vm::{self as control, Event, Request, VmConfig};

/// The control socket's descriptor.
pub const CONTROL_FD: RawFd = 3;

type Writer = Arc<Mutex<UnixStream>>;

fn say(w: &Writer, e: &Event, fd: Option<RawFd>) {
    let sock = w.lock().unwrap_or_else(|e| e.into_inner());
    // The service gone: nothing to tell. The parent-death signal ends us, or, for a VM that
    // outlives the service, the service's next run takes the socket's place (`serve_requests`).
    let _ = control::send(&sock, e, fd);
}

/// What a VM that outlives the service waits for its next run with: the socket it listens on
/// and the token it answers with.
struct Adoption {
    listener: std::os::unix::net::UnixListener,
    token: String,
}

/// Takes an inherited descriptor as a file (each number once).
fn file(fd: RawFd, taken: &mut Vec<RawFd>) -> Result<std::fs::File, String> {
    if fd <= CONTROL_FD || taken.contains(&fd) {
        return Err(format!("descriptor {fd} is not one of the VM's files"));
    }
    // SAFETY: F_GETFD only checks the number.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(format!("descriptor {fd} is not open"));
    }
    taken.push(fd);
    // SAFETY: an inherited descriptor, checked open above, taken once.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

fn machine_config(cfg: VmConfig) -> Result<(MachineConfig, Option<Adoption>), String> {
    let mut taken = vec![];
    let adoption = match cfg.adopt_fd {
        Some(fd) => {
            if cfg.token.is_empty() || cfg.token.len() > control::MAX_TOKEN {
                return Err("the token of adoption is empty or too long".into());
            }
            let f = file(fd, &mut taken)?;
            Some(Adoption {
                listener: std::os::unix::net::UnixListener::from(std::os::fd::OwnedFd::from(f)),
                token: cfg.token.clone(),
            })
        }
        None => None,
    };
    let kvm = file(cfg.kvm_fd, &mut taken)?;
    let restore = match cfg.restore {
        Some(s) => {
            let state = file(s.state_fd, &mut taken)?;
            let memory = file(s.memory_fd, &mut taken)?;
            let expect = crate::snapshot::Expect {
                memory_mib: cfg.memory_mib,
                vcpus: cfg.vcpus,
                devices: 1 + cfg.disks.len() + usize::from(cfg.net.is_some()),
            };
            let state = crate::snapshot::MachineState::read_from(&state, &expect)
                .map_err(|e| e.to_string())?;
            Some(crate::machine::Restore {
                state: Arc::new(state),
                memory: FileRef::Open(Arc::new(memory), "the snapshot's memory file".into()),
            })
        }
        None => None,
    };
    let kernel = FileRef::Open(
        Arc::new(file(cfg.kernel_fd, &mut taken)?),
        "the kernel".into(),
    );
    let initrd = match cfg.initrd_fd {
        Some(fd) => Some(FileRef::Open(
            Arc::new(file(fd, &mut taken)?),
            "the initramfs".into(),
        )),
        None => None,
    };
    let mut disks = vec![];
    for (i, d) in cfg.disks.iter().enumerate() {
        disks.push(DiskConfig {
            file: FileRef::Open(Arc::new(file(d.fd, &mut taken)?), format!("disk {i}")),
            read_only: d.read_only,
        });
    }
    let net = match cfg.net {
        Some(n) => {
            let sock = UnixStream::from(std::os::fd::OwnedFd::from(file(n.fd, &mut taken)?));
            let link = crate::stream_link::StreamLink::new(sock)
                .map_err(|e| format!("starting the network link: {e}"))?;
            Some(sandbox_control::link::NetAttachment {
                mac: n.mac,
                link: sandbox_control::link::NetLink::Frames(Arc::new(link)),
            })
        }
        None => None,
    };
    // The console goes to the service as it comes; a service that does not keep up loses
    // bytes here rather than stalling the guest's vCPU.
    // SAFETY: F_SETFL on our stdout.
    unsafe {
        let flags = libc::fcntl(1, libc::F_GETFL);
        libc::fcntl(1, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
    let console = ConsoleSink(Arc::new(|bytes: &[u8]| {
        // SAFETY: a write to our stdout from a valid slice.
        unsafe { libc::write(1, bytes.as_ptr().cast(), bytes.len()) };
    }));
    let mcfg = MachineConfig {
        restore,
        kvm: Some(Arc::new(kvm)),
        kernel,
        initrd,
        console: Some(console),
        cmdline: cfg.cmdline,
        memory_mib: cfg.memory_mib,
        vcpus: cfg.vcpus,
        disks,
        vsock_cid: cfg.vsock_cid,
        net,
    };
    Ok((mcfg, adoption))
}

/// Pauses the machine and writes its snapshot with the two descriptors that came with the
/// request (the state's pipe, the memory file); resumes it if asked or if anything failed.
/// Both are closed before the answer: the service reads the pipe to its end.
fn snapshot(
    m: &Machine,
    reader: &mut control::Reader,
    resume: bool,
) -> Result<sandbox_control::vm::SnapshotDone, String> {
    let (Some(state), Some(memory)) = (reader.take_fd(), reader.take_fd()) else {
        return Err("the snapshot request came without its two descriptors".into());
    };
    let mut state = std::fs::File::from(state);
    let memory = std::fs::File::from(memory);
    m.pause_and_snapshot(&mut state, &memory, resume)
        .map_err(|e| e.to_string())
}

/// Connects to a guest port for the service, retrying while nothing listens yet.
fn connect(machine: &Machine, w: &Writer, port: u32, within: Duration) {
    let deadline = Instant::now() + within;
    let mut last: Option<ConnectError> = None;
    let mut refusals = 0;
    loop {
        if let Some(e) = machine.exit() {
            say(
                w,
                &Event::ConnectFailed(format!("the VM ended: {}", e.reason)),
                None,
            );
            return;
        }
        let (tx, rx) = mpsc::channel();
        machine.vsock().connect(
            port,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Ok(stream)) => {
                use std::os::fd::AsRawFd;
                say(w, &Event::Connected, Some(stream.as_raw_fd()));
                // Our copy closes here; the service holds the channel now.
                return;
            }
            Ok(Err(e @ ConnectError::Refused(_))) if Instant::now() < deadline => {
                last = Some(e);
                std::thread::sleep(crate::connect_pause(refusals));
                refusals += 1;
            }
            Ok(Err(e)) => {
                say(w, &Event::ConnectFailed(e.to_string()), None);
                return;
            }
            Err(_) => {
                let why = match last {
                    Some(e) => e.to_string(),
                    None => "the guest's vsock driver never came up, or its kernel never answered"
                        .into(),
                };
                say(w, &Event::ConnectFailed(why), None);
                return;
            }
        }
    }
}

fn exit_event(e: &MachineExit) -> Event {
    Event::Exit {
        reason: e.reason.clone(),
        requested: e.requested,
        console: e.console.clone(),
    }
}

/// The VM process's `main`: returns its exit code.
pub fn main() -> i32 {
    // SAFETY: descriptor 3 is the control socket the service passed; taken once.
    let ctl = unsafe { UnixStream::from_raw_fd(CONTROL_FD) };
    let writer: Writer = match ctl.try_clone() {
        Ok(w) => Arc::new(Mutex::new(w)),
        Err(e) => {
            eprintln!("the control socket: {e}");
            return 2;
        }
    };
    let mut reader = control::Reader::new(&ctl);
    let cfg = match reader.read::<Request>() {
        Ok(Some(Request::Start(cfg))) => cfg,
        other => {
            eprintln!("expected the VM's configuration first, got {other:?}");
            return 2;
        }
    };
    let (machine, exit_rx, adoption) = match build(cfg) {
        Ok(built) => built,
        Err(e) => {
            say(&writer, &Event::Error(e), None);
            return 1;
        }
    };
    // Every thread of the process is sealed (the machine's own before its vCPUs pass the gate,
    // the network link's before it was handed over): the guest may run.
    machine.release();
    say(&writer, &Event::Started, None);
    spawn_main_kind("vm-marker", {
        let (m, w) = (machine.clone(), writer.clone());
        move || {
            if m.wait_boot_marker().is_some() {
                say(&w, &Event::Marker, None);
            }
        }
    });
    spawn_main_kind("vm-control", {
        let (m, w) = (machine.clone(), writer.clone());
        move || serve_requests(reader, &m, &w, adoption)
    });
    let exit = exit_rx
        .recv()
        .unwrap_or_else(|_| machine.exit().unwrap_or_else(|| machine.stop()));
    say(&writer, &exit_event(&exit), None);
    let _ = std::io::stderr().flush();
    0
}

/// Builds the machine `cfg` describes, held before its first instruction, with every thread
/// of this process sealed; the machine and where its exit is told. The error is said to the
/// service as it is.
#[allow(clippy::type_complexity)]
fn build(
    cfg: VmConfig,
) -> Result<(Arc<Machine>, mpsc::Receiver<MachineExit>, Option<Adoption>), String> {
    if cfg.version != control::VERSION {
        return Err(format!(
            "this sandbox-vm speaks control protocol {} and the service {}: install the \
             sandbox-vm built with this sandbox-host (beside it, or SANDBOX_HOST_VM_BINARY)",
            control::VERSION,
            cfg.version
        ));
    }
    // From here on each thread the machine starts applies its kind's filter before it runs
    // (seal.rs): the network link's threads, started by `machine_config`, are the first.
    seal::install(cfg.adopt_fd).map_err(|e| e.to_string())?;
    let (mcfg, adoption) = machine_config(cfg)?;
    let (exit_tx, exit_rx) = mpsc::channel::<MachineExit>();
    let machine = Machine::start_held(
        &mcfg,
        Some(Box::new(move |e| {
            let _ = exit_tx.send(e.clone());
        })),
    )
    .map(Arc::new)
    .map_err(|e| e.to_string())?;
    drop(mcfg);
    // This thread, and the control and marker threads it starts, are of the main kind. Fail
    // closed: a VM whose main thread cannot be sealed never reports itself started.
    if let Err(e) = seal::enter(ThreadKind::Main) {
        machine.fail(e.to_string());
        return Err(e.to_string());
    }
    Ok((machine, exit_rx, adoption))
}

/// A thread of the main kind (it inherits this thread's seal).
fn spawn_main_kind(name: &str, f: impl FnOnce() + Send + 'static) {
    let _ = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            seal::inherited(ThreadKind::Main);
            f()
        });
}

/// The service's requests, until it closes the socket: it is gone, and the VM stops; or, for a
/// VM that outlives the service, the machine runs on and the service's next run takes the
/// socket's place ([`adopted`]).
fn serve_requests(
    mut reader: control::Reader,
    m: &Machine,
    w: &Writer,
    adoption: Option<Adoption>,
) {
    loop {
        match reader.read::<Request>() {
            Ok(Some(Request::Connect { port, timeout_ms })) => {
                connect(m, w, port, Duration::from_millis(timeout_ms))
            }
            Ok(Some(Request::Stop)) => {
                m.stop();
            }
            Ok(Some(Request::Fail { reason })) => {
                m.fail(reason);
            }
            Ok(Some(Request::Diagnostics)) => say(w, &Event::Diagnostics(m.vcpu_report()), None),
            Ok(Some(Request::Snapshot { id, resume })) => {
                let result = snapshot(m, &mut reader, resume);
                say(w, &Event::Snapshot { id, result }, None)
            }
            Ok(Some(Request::Resume)) => m.resume(),
            // The service went (its socket ended, or was reset with our words unread); a line it
            // garbled still stops the VM below.
            Ok(None) if adoption.is_some() && m.exit().is_none() => {
                if !wait_for_adoption(&mut reader, m, w, &adoption) {
                    return;
                }
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::ConnectionReset
                    && adoption.is_some()
                    && m.exit().is_none() =>
            {
                if !wait_for_adoption(&mut reader, m, w, &adoption) {
                    return;
                }
            }
            Ok(Some(Request::Start(_) | Request::Adopt)) | Err(_) | Ok(None) => {
                m.stop();
                return;
            }
        }
    }
}

/// Waits for the service's next run ([`adopted`]) and puts its reader in place; `false` (the
/// machine stopped) if the socket it waits on fails.
fn wait_for_adoption(
    reader: &mut control::Reader,
    m: &Machine,
    w: &Writer,
    adoption: &Option<Adoption>,
) -> bool {
    let Some(a) = adoption else {
        return false;
    };
    match adopted(a, w) {
        Some(next) => {
            *reader = next;
            true
        }
        None => {
            m.stop();
            false
        }
    }
}

/// How long a connection on the adoption socket has to send its first line (the service's next
/// run sends it at once).
const FIRST_LINE: Duration = Duration::from_secs(5);

/// Whether a whole first line is waiting on `conn` within `bound`: looked at without reading it
/// (the reader then reads it, with any descriptors that came along). A line longer than any
/// `Adopt`, an end, or an error is `false`.
fn first_line_within(conn: &UnixStream, bound: Duration) -> bool {
    use std::os::fd::AsRawFd;
    let deadline = Instant::now() + bound;
    let mut buf = [0u8; 512];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let mut pfd = libc::pollfd {
            fd: conn.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ts = libc::timespec {
            tv_sec: left.as_secs() as libc::time_t,
            tv_nsec: left.subsec_nanos() as libc::c_long,
        };
        // SAFETY: one pollfd of ours, a timespec on the stack, no signal mask.
        let ready = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
        if ready < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if ready <= 0 {
            return false;
        }
        // SAFETY: a peek into our buffer, within its length.
        let got = unsafe {
            libc::recv(
                conn.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if got <= 0 {
            return false;
        }
        let got = got as usize;
        if buf[..got].contains(&b'\n') {
            return true;
        }
        if got == buf.len() {
            return false;
        }
        // Part of a line: the rest may follow (the poll would answer at once meanwhile).
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for the service's next run on the adoption socket: the first connection whose first
/// line is [`Request::Adopt`] is answered with the version and the token, and becomes the
/// control socket (the writer's too). Anything else first is closed. Only the service's user
/// can connect (the socket is in its own directory; this process's root is empty). The
/// reader reads the socket the writer holds from then on (one socket both ways: this process's
/// filter allows no `dup`); `None` if the listening socket itself fails.
fn adopted(a: &Adoption, w: &Writer) -> Option<control::Reader> {
    loop {
        let conn = match a.listener.accept() {
            Ok((c, _)) => c,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // What cannot change (the socket is not a listening one, or not ours to use) ends
            // the wait; a shortage (descriptors, memory) passes: a moment, and again.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::InvalidInput
                        | std::io::ErrorKind::PermissionDenied
                        | std::io::ErrorKind::Unsupported
                ) =>
            {
                return None;
            }
            Err(_) => {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        // A connection that does not say its first line in time is closed: it cannot hold the
        // wait for the service's next run.
        if !first_line_within(&conn, FIRST_LINE) {
            continue;
        }
        let mut reader = control::Reader::new(&conn);
        if !matches!(reader.read::<Request>(), Ok(Some(Request::Adopt))) {
            continue;
        }
        // Descriptors that came with it are no request's: a later snapshot must not take them.
        while reader.take_fd().is_some() {}
        let answer = Event::Adopted {
            version: control::VERSION,
            token: a.token.clone(),
        };
        if control::send(&conn, &answer, None).is_err() {
            continue;
        }
        // The old socket goes with its replacement; the reader's descriptor is `conn`'s, which
        // lives in the writer until the next adoption replaces both.
        *w.lock().unwrap_or_else(|e| e.into_inner()) = conn;
        return Some(reader);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_adoption_socket_waits_for_a_first_line_only_so_long() {
        let bound = Duration::from_millis(300);
        // Silent: refused at the bound, not later.
        let (a, _silent) = UnixStream::pair().unwrap();
        let t0 = Instant::now();
        assert!(!first_line_within(&a, bound));
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        // A whole line, and a line sent in two parts.
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(b"{\"Adopt\":null}\n").unwrap();
        assert!(first_line_within(&a, bound));
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(b"{\"Ado").unwrap();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            b.write_all(b"pt\":null}\n").unwrap();
            b
        });
        assert!(first_line_within(&a, bound));
        drop(late.join());
        // Part of a line that never ends, a line longer than any request, an end.
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(b"{\"Ado").unwrap();
        assert!(!first_line_within(&a, bound));
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(&[b'x'; 600]).unwrap();
        assert!(!first_line_within(&a, bound));
        let (a, b) = UnixStream::pair().unwrap();
        drop(b);
        assert!(!first_line_within(&a, bound));
    }
}
