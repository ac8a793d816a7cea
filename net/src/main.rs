//! `sandbox-net`: one sandbox's network process (issue 32). It is started with two sockets: the
//! channel to the service on descriptor 0 and the guest's frames (shared with the sandbox's VM
//! process) on descriptor 1; its messages go to descriptor 2. A service that may come back for it
//! after it went away (a crash, an upgrade) also passes a listening Unix socket on descriptor 3
//! ([`ADOPT_FD`](sandbox_control::net::ADOPT_FD)).
//!
//! The messages (`sandbox_control::net`):
//!
//! 1. The channel's first line is `Request::Start`: the sandbox's settings, with the dialer's
//!    socket attached (the process has no network of its own: the service makes its upstream
//!    connections, `sandbox_net::dial`). The process starts the egress stack, seals itself
//!    (`sandbox_net::seal`) and answers `Event::Started` with the CA and the guest's variables;
//!    or `Event::Refused`, and ends.
//! 2. Then it moves the guest's frames and answers the channel, one request at a time: `Report`
//!    and `Counts` with `Event::Report`, `Relink` (the next VM process's frames attached) with
//!    `Event::Relinked`, until `Stop` ends it.
//! 3. When the channel ends without a stop (its end, or a reset: the service went), a process
//!    without descriptor 3 ends. One with it runs on: the stack and the frames' pump run on the
//!    runtime, connections already made carry on, and new ones are reset at once (no service
//!    makes them). It waits on descriptor 3; a connection there whose first line is
//!    `Request::Adopt` with a new dialer's socket attached is answered `Event::Adopted` with the
//!    settings' token, and is the channel from then on: back to 2. Any other connection is
//!    closed, unanswered, and the process waits for the next (`sandbox_net::adopt`).
//!
//! A second start, an adoption on a channel already adopted, a line that does not parse or a
//! relink without its socket are not what a service sends: the process ends.

// Forbidden but for one function: taking descriptor 3, which Rust cannot do safely.
#![deny(unsafe_code)]

use std::io::{self, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::ExitCode;
use std::sync::Arc;

use sandbox_control::line::{Reader, send};
use sandbox_control::link::FrameLink;
use sandbox_control::net::{Event, Request};
use sandbox_egress::Egress;
use sandbox_net::dial::Dialer;

/// The longest message the service sends: the settings with every secret (each value at most a
/// few KiB, a few dozen of them).
const MAX_REQUEST: usize = 1 << 20;

/// Descriptor `fd` of this process (0 or 1), as a socket of its own.
fn socket(fd: impl AsFd) -> std::io::Result<UnixStream> {
    Ok(UnixStream::from(fd.as_fd().try_clone_to_owned()?))
}

/// Writes a line to the process's log (descriptor 2), whatever comes of it: once the service
/// that read the log has gone, writes to it fail (a broken pipe), and the process runs on
/// without a log rather than dying of it (`eprintln!` would panic).
fn log(what: std::fmt::Arguments<'_>) {
    let _ = writeln!(io::stderr(), "sandbox-net: {what}");
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log(format_args!("{e}"));
            ExitCode::FAILURE
        }
    }
}

/// The listening socket the service passed on descriptor 3, if it did. Anything else there
/// (nothing, or a descriptor inherited by accident, such as a build tool's jobserver pipe) is
/// left as it is, and the process ends with its channel.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn adoption_socket() -> Option<UnixListener> {
    use std::os::fd::{BorrowedFd, FromRawFd};
    const FD: std::os::fd::RawFd = sandbox_control::net::ADOPT_FD;
    // SAFETY: F_GETFD only asks whether the number is open.
    if unsafe { libc::fcntl(FD, libc::F_GETFD) } < 0 {
        return None;
    }
    // SAFETY: the descriptor is open (above), and only this function takes it, before any other
    // thread runs: it stays open while it is borrowed here.
    let fd = unsafe { BorrowedFd::borrow_raw(FD) };
    let s = socket2::SockRef::from(&fd);
    let listens = s.domain().ok() == Some(socket2::Domain::UNIX)
        && s.r#type().ok() == Some(socket2::Type::STREAM)
        && s.is_listener().unwrap_or(false);
    if !listens {
        return None;
    }
    // SAFETY: an inherited, open, listening Unix socket (checked above), taken once: nothing
    // else of the process owns descriptor 3.
    Some(unsafe { UnixListener::from_raw_fd(FD) })
}

/// No adoption where the process is not sealed either (its tests' other systems).
#[cfg(not(target_os = "linux"))]
fn adoption_socket() -> Option<UnixListener> {
    None
}

fn run() -> Result<(), String> {
    let listener = adoption_socket();
    let channel = socket(std::io::stdin()).map_err(|e| format!("the channel (fd 0): {e}"))?;
    let frames = socket(std::io::stdout()).map_err(|e| format!("the frames (fd 1): {e}"))?;
    let mut reader = Reader::with_limit(&channel, MAX_REQUEST);
    let mut cfg = match reader.read::<Request>() {
        Ok(Some(Request::Start(cfg))) => cfg,
        Ok(Some(other)) => return Err(format!("the first message is not a start: {other:?}")),
        Ok(None) => return Ok(()), // the service went before it said anything
        Err(e) => return Err(format!("reading the settings: {e}")),
    };
    // Kept while the process may be adopted, and only then (it ends with the settings
    // otherwise); never logged.
    let token = if listener.is_some() {
        std::mem::take(&mut cfg.token)
    } else {
        String::new()
    };
    let dialer = reader
        .take_fd()
        .ok_or("the settings came without the dialer's socket")?;
    let dialer =
        Arc::new(Dialer::start(UnixStream::from(dialer)).map_err(|e| format!("the dialer: {e}"))?);
    // One worker: the stack is one task, and a sandbox's process on a loaded host is one of
    // many (two workers were a tenth slower here, beside the VM's threads: benches/egress.rs).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("net")
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    let _in = rt.enter();
    let started = sandbox_net::start(&cfg, dialer.clone(), || {
        sandbox_net::upstream_client(cfg.upstream_ca_pem.as_deref())
    });
    drop(cfg); // the secrets now live in the stack alone
    let running = match started {
        Ok(r) => r,
        Err(e) => {
            let bad_request = matches!(e, sandbox_net::StartError::Bad(_));
            let refused = Event::Refused {
                bad_request,
                message: e.to_string(),
            };
            send(&channel, &refused, None).map_err(|e| format!("answering: {e}"))?;
            return Err(e.to_string());
        }
    };
    // The stack runs: from here on the process only moves frames, connects upstream, answers
    // the channel and (with descriptor 3) waits for the service to come back.
    #[cfg(target_os = "linux")]
    sandbox_net::seal::seal().map_err(|e| e.to_string())?;
    let started = Event::Started {
        ca_pem: running.ca_pem.clone(),
        env: running.env.clone(),
    };
    send(&channel, &started, None).map_err(|e| format!("answering: {e}"))?;
    let link: Arc<dyn FrameLink> = Arc::new(sandbox_net::GuestLink(running.guest));
    let pump = pump_on(&rt, frames, link.clone())?;
    let mut net = Net {
        rt: &rt,
        egress: &running.egress,
        link,
        pump,
    };
    // The channel is read on this thread, and the adoption socket waited on; the stack and the
    // pump run on the runtime's, whatever this thread waits for.
    let mut channel = channel;
    loop {
        let lost = match serve(&channel, &mut reader, &mut net)? {
            Ended::Stop => return Ok(()),
            Ended::Gone => None,
            Ended::Lost(e) => Some(e),
        };
        let Some(listener) = &listener else {
            return lost.map_or(Ok(()), Err);
        };
        log(format_args!(
            "the channel ended{}: the network runs on, and waits for the service on descriptor 3",
            lost.map(|e| format!(" ({e})")).unwrap_or_default()
        ));
        channel = sandbox_net::adopt::wait(listener, &dialer, &token, |e| {
            log(format_args!("a connection on descriptor 3 was closed: {e}"))
        })
        .map_err(|e| e.to_string())?;
        reader = Reader::with_limit(&channel, MAX_REQUEST);
        log(format_args!("adopted: the channel is the new connection"));
    }
}

/// What the channel's requests act on.
struct Net<'a> {
    rt: &'a tokio::runtime::Runtime,
    egress: &'a Egress,
    /// The stack's end of the guest's frames.
    link: Arc<dyn FrameLink>,
    /// The task that moves them from the VM process's socket.
    pump: tokio::task::JoinHandle<()>,
}

/// How a channel ended.
enum Ended {
    /// The service said stop.
    Stop,
    /// Its end: the service has gone.
    Gone,
    /// It broke (a reset, an answer that could not be written): the service has gone too, but a
    /// process that cannot be adopted ends with this error, as it always did.
    Lost(String),
}

/// Answers the service's requests on `channel` until it says stop or goes away (`Ok`); a request
/// no service sends is an error.
fn serve(channel: &UnixStream, reader: &mut Reader, net: &mut Net<'_>) -> Result<Ended, String> {
    loop {
        let answer = match reader.read::<Request>() {
            Ok(Some(r @ (Request::Report | Request::Counts))) => {
                let mut report = sandbox_net::report(net.egress);
                if matches!(r, Request::Counts) {
                    report.events.clear();
                    report.usage.calls.clear();
                }
                Event::Report(Box::new(report))
            }
            Ok(Some(Request::Relink)) => {
                let frames = reader.take_fd().ok_or("a relink came without its socket")?;
                net.pump.abort();
                net.pump = pump_on(net.rt, UnixStream::from(frames), net.link.clone())?;
                Event::Relinked
            }
            Ok(Some(Request::Stop)) => return Ok(Ended::Stop),
            Ok(None) => return Ok(Ended::Gone),
            Ok(Some(Request::Start(_))) => return Err("a second start".into()),
            Ok(Some(Request::Adopt)) => {
                return Err("an adoption on a channel already adopted or started".into());
            }
            Err(e) if broken(&e) => return Ok(Ended::Lost(format!("reading the channel: {e}"))),
            Err(e) => return Err(format!("reading the channel: {e}")),
        };
        match send(channel, &answer, None) {
            Ok(()) => {}
            Err(e) if broken(&e) => return Ok(Ended::Lost(format!("answering: {e}"))),
            Err(e) => return Err(format!("answering: {e}")),
        }
    }
}

/// Whether an error of the channel's socket is the service's end rather than something it said:
/// a service killed with bytes unread resets the socket, and one gone before an answer was
/// written leaves a broken pipe.
fn broken(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

/// Moves the guest's frames between `frames` and the stack's link on the runtime, until the
/// socket ends (its VM process ended: a paused sandbox's) or a relink replaces it.
fn pump_on(
    rt: &tokio::runtime::Runtime,
    frames: UnixStream,
    link: Arc<dyn FrameLink>,
) -> Result<tokio::task::JoinHandle<()>, String> {
    frames
        .set_nonblocking(true)
        .map_err(|e| format!("the frames' socket: {e}"))?;
    let _in = rt.enter();
    let frames =
        tokio::net::UnixStream::from_std(frames).map_err(|e| format!("the frames' socket: {e}"))?;
    Ok(rt.spawn(async move {
        if let Err(e) = sandbox_control::pump::run(frames, link).await {
            log(format_args!("the guest's frames ended: {e}"));
        }
    }))
}
