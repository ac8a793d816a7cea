//! `sandbox-net`: one sandbox's network process (issue 32). It is started with two sockets: the
//! channel to the service on descriptor 0 and the guest's frames (shared with the sandbox's VM
//! process) on descriptor 1; its messages go to descriptor 2. It reads the sandbox's settings
//! from the channel, with the dialer's socket attached (it has no network of its own: the
//! service makes its upstream connections, `sandbox_net::dial`), starts the egress stack,
//! answers with the CA and the guest's variables, and then moves frames and answers reports until
//! the service says stop or goes away.

#![forbid(unsafe_code)]

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::sync::Arc;

use sandbox_control::line::{Reader, send};
use sandbox_control::link::FrameLink;
use sandbox_control::net::{Event, Request};

/// The longest message the service sends: the settings with every secret (each value at most a
/// few KiB, a few dozen of them).
const MAX_REQUEST: usize = 1 << 20;

/// Descriptor `fd` of this process (0 or 1), as a socket of its own.
fn socket(fd: impl AsFd) -> std::io::Result<UnixStream> {
    Ok(UnixStream::from(fd.as_fd().try_clone_to_owned()?))
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sandbox-net: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let channel = socket(std::io::stdin()).map_err(|e| format!("the channel (fd 0): {e}"))?;
    let frames = socket(std::io::stdout()).map_err(|e| format!("the frames (fd 1): {e}"))?;
    let mut reader = Reader::with_limit(&channel, MAX_REQUEST);
    let cfg = match reader.read::<Request>() {
        Ok(Some(Request::Start(cfg))) => cfg,
        Ok(Some(other)) => return Err(format!("the first message is not a start: {other:?}")),
        Ok(None) => return Ok(()), // the service went before it said anything
        Err(e) => return Err(format!("reading the settings: {e}")),
    };
    let dialer = reader
        .take_fd()
        .ok_or("the settings came without the dialer's socket")?;
    let dialer = sandbox_net::dial::Dialer::start(UnixStream::from(dialer))
        .map_err(|e| format!("the dialer: {e}"))?;
    // One worker: the stack is one task, and a sandbox's process on a loaded host is one of
    // many (two workers were a tenth slower here, beside the VM's threads: benches/egress.rs).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("net")
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    let _in = rt.enter();
    let started = sandbox_net::start(&cfg, Arc::new(dialer), || {
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
    // The stack runs: from here on the process only moves frames, connects upstream and answers
    // the channel.
    #[cfg(target_os = "linux")]
    sandbox_net::seal::seal().map_err(|e| e.to_string())?;
    let started = Event::Started {
        ca_pem: running.ca_pem.clone(),
        env: running.env.clone(),
    };
    send(&channel, &started, None).map_err(|e| format!("answering: {e}"))?;
    let link: Arc<dyn FrameLink> = Arc::new(sandbox_net::GuestLink(running.guest));
    let mut pump = pump_on(&rt, frames, link.clone())?;
    // The channel is read on this thread; the stack and the pump run on the runtime's.
    loop {
        match reader.read::<Request>() {
            Ok(Some(r @ (Request::Report | Request::Counts))) => {
                let mut report = sandbox_net::report(&running.egress);
                if matches!(r, Request::Counts) {
                    report.events.clear();
                    report.usage.calls.clear();
                }
                let report = Event::Report(Box::new(report));
                send(&channel, &report, None).map_err(|e| format!("answering: {e}"))?;
            }
            Ok(Some(Request::Relink)) => {
                let frames = reader.take_fd().ok_or("a relink came without its socket")?;
                pump.abort();
                pump = pump_on(&rt, UnixStream::from(frames), link.clone())?;
                send(&channel, &Event::Relinked, None).map_err(|e| format!("answering: {e}"))?;
            }
            Ok(Some(Request::Stop)) | Ok(None) => return Ok(()),
            Ok(Some(Request::Start(_))) => return Err("a second start".into()),
            Err(e) => return Err(format!("reading the channel: {e}")),
        }
    }
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
            eprintln!("sandbox-net: the guest's frames ended: {e}");
        }
    }))
}
