//! Running a process: spawn in its own process group, stream its output under the window, feed
//! its stdin, enforce its timeout on the whole group, report how it ended.
//!
//! An exec whose host goes away is abandoned, not ended: its process group runs on with stdin at
//! EOF, its output read and dropped, its timeout still enforced, and its exit reported to no one.
//!
//! An exec may run on a pseudo terminal instead of pipes (`pty.rs`): then its processes are a
//! session rather than a group, its output is the terminal's (all of it as stdout), and it ends
//! when the session's leader exits.

use std::io::{self, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use sandbox_protocol::Kind;
use sandbox_protocol::message::{ExecRequest, ExitStatus, code};

use crate::pty::{self, Pty};
use crate::reaper::{Reaper, Status};
use crate::streams::{StreamCtx, kill_job};
use crate::transfer::Download;

/// PATH of every exec unless the request sets its own.
const BASE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How long output pipes may stay open after a kill before the agent stops waiting for them
/// (a process that left the group with `setsid` can hold them open forever).
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(5);

/// Runs `req` to its end: its output streamed as it comes, its exit status last (only the
/// first if the stream is abandoned on the way, see the module's doc).
pub fn run(mut ctx: StreamCtx, req: ExecRequest, reaper: &Reaper) {
    let mut cmd = match command(&req) {
        Ok(c) => c,
        Err(msg) => return ctx.fail(code::BAD_REQUEST, msg),
    };
    let master = match req.pty {
        None => None,
        Some(size) => {
            if let Err(msg) = size.check() {
                return ctx.fail(code::BAD_REQUEST, msg);
            }
            if !req.stdin {
                return ctx.fail(
                    code::BAD_REQUEST,
                    "a terminal needs stdin: set stdin with pty",
                );
            }
            match Pty::open(size).and_then(|p| p.attach(&mut cmd)) {
                Ok(m) => Some(m),
                Err(e) => return ctx.fail(code::IO, format!("cannot open a terminal: {e}")),
            }
        }
    };
    let session = master.is_some();
    let started = Instant::now();
    let spawned = reaper.spawn(&mut cmd);
    // The command holds the terminal's slave side until dropped: only the child may, or the
    // master would never read the session's end.
    drop(cmd);
    let (mut child, status_rx) = match spawned {
        Ok(x) => x,
        Err(e) => {
            return ctx.fail(
                code::SPAWN_FAILED,
                format!("cannot start `{}`: {e}", program(&req)),
            );
        }
    };
    let pgid = child.id() as i32;
    ctx.pgid.store(pgid, Ordering::SeqCst);
    let stop = Arc::new(AtomicBool::new(false));
    let (stdin, outputs) = match master {
        Some(master) => {
            let (writer, resizer) = match (master.try_clone(), master.try_clone()) {
                (Ok(w), Ok(r)) => (w, r),
                (Err(e), _) | (_, Err(e)) => {
                    kill_job(pgid, true, libc::SIGKILL);
                    return ctx.fail(code::IO, format!("cannot share the terminal: {e}"));
                }
            };
            let mut slot = ctx.tty.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(size) = slot.pending.take() {
                let _ = pty::set_size(&resizer, size);
            }
            slot.master = Some(resizer);
            drop(slot);
            let output = pty::Output::new(master, stop.clone());
            (
                Some(Box::new(writer) as Box<dyn Write + Send>),
                [
                    (Some(Box::new(output) as Box<dyn Read + Send>), Kind::Stdout),
                    (None, Kind::Stderr),
                ],
            )
        }
        None => (
            child
                .stdin
                .take()
                .map(|p| Box::new(p) as Box<dyn Write + Send>),
            [
                (
                    child
                        .stdout
                        .take()
                        .map(|p| Box::new(p) as Box<dyn Read + Send>),
                    Kind::Stdout,
                ),
                (
                    child
                        .stderr
                        .take()
                        .map(|p| Box::new(p) as Box<dyn Read + Send>),
                    Kind::Stderr,
                ),
            ],
        ),
    };
    if ctx.cancelled.load(Ordering::SeqCst) {
        kill_job(pgid, session, libc::SIGKILL);
    }
    if let (Some(stdin), Some(upload)) = (stdin, ctx.take_upload()) {
        std::thread::spawn(move || feed_stdin(stdin, upload));
    }
    let (done_rx, pumps) = start_pumps(&ctx, outputs);
    // The deadline holds whether or not the host is still there: an abandoned exec is killed at
    // its deadline like any other, by this same wait, which is simpler than a second mechanism.
    let deadline = req.timeout_ms.map(|ms| started + Duration::from_millis(ms));
    let (status, timed_out) = wait_status(&status_rx, deadline, pgid, session);
    let duration_ms = started.elapsed().as_millis() as u64;
    // A terminal's session ends with its leader: what is left of its output is read, and a job
    // left in the background does not hold the exec open.
    stop.store(true, Ordering::SeqCst);
    drain(&done_rx, pumps, deadline, timed_out, pgid, session);
    ctx.tty.lock().unwrap_or_else(|e| e.into_inner()).master = None;
    let (exit_code, signal) = match status {
        Some(Status::Exited(c)) => (Some(c), None),
        Some(Status::Signaled(s)) => (None, Some(s)),
        None => (None, None),
    };
    let exit = ExitStatus {
        exit_code,
        signal,
        timed_out,
        duration_ms,
    };
    // Dropped by the outbox if the stream was abandoned: a later host never hears of it.
    ctx.out.send_json(Kind::Exit, ctx.id, &exit);
}

/// Copies the host's stdin stream into the process; once the process stops reading, keeps
/// draining it so the host is never stuck.
fn feed_stdin(mut stdin: Box<dyn Write + Send>, mut upload: impl Read) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut open = true;
    loop {
        let n = match upload.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if open && stdin.write_all(&buf[..n]).is_err() {
            open = false;
        }
    }
}

/// A thread per output pipe, each streaming it under the window; what each says when its pipe
/// is done, and how many there are.
fn start_pumps(
    ctx: &StreamCtx,
    outputs: [(Option<Box<dyn Read + Send>>, Kind); 2],
) -> (Receiver<()>, usize) {
    let (done_tx, done_rx) = channel::<()>();
    let mut pumps = 0;
    for (pipe, kind) in outputs {
        if let Some(pipe) = pipe {
            let dl = Download::new(ctx.out.clone(), ctx.id, kind, ctx.credit.clone());
            let abandoned = ctx.abandoned.clone();
            let done = done_tx.clone();
            std::thread::spawn(move || {
                pump(pipe, dl, &abandoned);
                let _ = done.send(());
            });
            pumps += 1;
        }
    }
    (done_rx, pumps)
}

/// The process's status, and whether its timeout killed its group first.
fn wait_status(
    status_rx: &Receiver<Status>,
    deadline: Option<Instant>,
    pgid: i32,
    session: bool,
) -> (Option<Status>, bool) {
    let mut timed_out = false;
    loop {
        let r = match deadline {
            // Killed: its status follows at once (a process stuck in the kernel gets a bound).
            _ if timed_out => status_rx.recv_timeout(DRAIN_AFTER_KILL),
            Some(d) => status_rx.recv_timeout(d.saturating_duration_since(Instant::now())),
            None => status_rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match r {
            Ok(s) => return (Some(s), timed_out),
            Err(RecvTimeoutError::Timeout) if !timed_out => {
                timed_out = true;
                kill_job(pgid, session, libc::SIGKILL);
            }
            Err(_) => return (None, timed_out),
        }
    }
}

/// Waits for the output to be complete: every writer of the pipes gone. Processes left in the
/// group keep them open (as with ssh); the timeout, if any, still applies to them.
fn drain(
    done_rx: &Receiver<()>,
    mut pumps: usize,
    deadline: Option<Instant>,
    timed_out: bool,
    pgid: i32,
    session: bool,
) {
    let mut killed_at: Option<Instant> = timed_out.then(Instant::now);
    while pumps > 0 {
        let wait = match (killed_at, deadline) {
            (Some(k), _) => (k + DRAIN_AFTER_KILL).saturating_duration_since(Instant::now()),
            (None, Some(d)) => d.saturating_duration_since(Instant::now()),
            (None, None) => Duration::from_secs(3600),
        };
        match done_rx.recv_timeout(wait) {
            Ok(()) => pumps -= 1,
            Err(RecvTimeoutError::Timeout) if killed_at.is_none() => {
                if deadline.is_some() {
                    kill_job(pgid, session, libc::SIGKILL);
                    killed_at = Some(Instant::now());
                }
            }
            Err(_) => break,
        }
    }
}

/// Streams one output pipe to the host until its writers are gone. Once the stream can send no
/// more: if it was abandoned, the rest is read and dropped, so the process never blocks on a
/// full pipe nor gets EPIPE; otherwise (cancelled, or ended) the pipe is closed, which gives a
/// writer still there EPIPE.
fn pump(mut pipe: Box<dyn Read + Send>, mut dl: Download, abandoned: &AtomicBool) {
    let mut buf = vec![0u8; sandbox_protocol::DATA_CHUNK];
    loop {
        match pipe.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                if dl.send_now(&buf[..n]).is_err() {
                    if abandoned.load(Ordering::SeqCst) {
                        let _ = io::copy(&mut pipe, &mut io::sink());
                    }
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

fn program(req: &ExecRequest) -> &str {
    match (&req.argv, &req.command) {
        (Some(argv), _) => argv.first().map_or("", String::as_str),
        _ => "/bin/sh",
    }
}

fn command(req: &ExecRequest) -> Result<Command, String> {
    let mut cmd = match (&req.argv, &req.command) {
        (Some(_), Some(_)) => return Err("give either argv or command, not both".into()),
        (None, None) => return Err("give argv or command".into()),
        (Some(argv), None) => {
            let Some((prog, args)) = argv.split_first() else {
                return Err("argv is empty".into());
            };
            let mut c = Command::new(prog);
            c.args(args);
            c
        }
        (None, Some(line)) => {
            let mut c = Command::new("/bin/sh");
            c.arg("-c").arg(line);
            c
        }
    };
    let cwd = req.cwd.as_deref().unwrap_or("/workspace");
    if !Path::new(cwd).is_dir() {
        return Err(format!(
            "working directory {cwd} does not exist or is not a directory"
        ));
    }
    if let Some(bad) = req
        .env
        .keys()
        .find(|k| k.is_empty() || k.contains('=') || k.contains('\0'))
    {
        return Err(format!("environment variable name `{bad}` is not valid"));
    }
    if req.env.values().any(|v| v.contains('\0')) {
        return Err("environment variable values cannot contain NUL".into());
    }
    cmd.env_clear()
        .env("PATH", BASE_PATH)
        .env("HOME", "/root")
        .env("USER", "root")
        .env("LANG", "C.UTF-8")
        .env(
            "TERM",
            if req.pty.is_some() {
                "xterm-256color"
            } else {
                "dumb"
            },
        )
        .envs(&req.env)
        .current_dir(cwd);
    // On a terminal the process is a session's leader and the terminal is its stdio
    // (`Pty::attach`); a group of its own would keep it from starting a session.
    if req.pty.is_none() {
        cmd.process_group(0)
            .stdin(if req.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
    }
    Ok(cmd)
}
