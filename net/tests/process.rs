//! The real `sandbox-net` program, started as the service starts it (the channel on its
//! descriptor 0, the guest's frames on 1, the dialer's socket with its settings, served by the
//! service's own dialer): a simulated guest behind the frames' socket resolves an
//! allowed name, fetches a page from a loopback server through the process's stack, is refused a
//! name outside its allowlist, and the report over the channel says so. Then the settings of
//! another version, and bad settings, are refused with the error the service shows.
//!
//! And the service's loss: given a listening socket on descriptor 3, the process outlives its
//! channel (the guest's connections made go on, new ones are reset at once) and is adopted by the
//! next connection there that asks it to (`Request::Adopt`), whatever came before it; without one,
//! the channel's end ends it.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbox_control::line::{Reader, send};
use sandbox_control::net::{ADOPT_FD, ADOPT_WITHIN, Event, MAX_REPORT, NetConfig, Request};
use sandbox_egress::link::{StackEnd, link};
use sandbox_egress::sim::GuestSim;
use smoltcp::socket::tcp::State;

const MAC: [u8; 6] = [0x02, 0x5a, 0, 0, 0, 9];
/// The sandbox's token of adoption, as the service makes one.
const TOKEN: &str = "5a1df00d5a1df00d5a1df00d5a1df00d5a1df00d5a1df00d5a1df00d5a1df00d";
/// A plain request for the hello server.
const GET: &[u8] = b"GET / HTTP/1.1\r\nhost: local.test\r\n\r\n";

/// A loopback server that answers every request with `hello`.
fn hello_server() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf);
            let _ = s.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
            );
        }
    });
    port
}

fn config(port: u16) -> NetConfig {
    NetConfig {
        version: sandbox_control::net::VERSION,
        sandbox: "net-test".into(),
        mac: MAC,
        allow: vec!["local.test".into()],
        meter: vec![],
        intercept_all: false,
        meter_strict: false,
        meter_body_max: 1 << 20,
        secrets: vec![],
        memory_bytes: 64 << 20,
        resolve: format!("local.test:{port}:127.0.0.1"),
        upstream_ca_pem: None,
        token: TOKEN.into(),
    }
}

/// `sandbox-net` with its two sockets, and `fd3` (the parent's) as its descriptor 3 when given;
/// the service's ends, and the dialer's two.
fn spawn(fd3: Option<RawFd>) -> (Child, UnixStream, UnixStream, (UnixStream, UnixStream)) {
    let (channel, theirs) = UnixStream::pair().unwrap();
    let dialer = UnixStream::pair().unwrap();
    let (frames, their_frames) = UnixStream::pair().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandbox-net"));
    cmd.stdin(Stdio::from(OwnedFd::from(theirs)))
        .stdout(Stdio::from(OwnedFd::from(their_frames)));
    if let Some(fd) = fd3 {
        // SAFETY: between fork and exec the closure makes only async-signal-safe calls (dup2,
        // fcntl) on a descriptor the parent keeps open across the spawn.
        unsafe {
            cmd.pre_exec(move || {
                // dup2 onto itself would keep close-on-exec: the flag is cleared instead.
                let r = if fd == ADOPT_FD {
                    libc::fcntl(fd, libc::F_SETFD, 0)
                } else {
                    libc::dup2(fd, ADOPT_FD)
                };
                if r < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let child = cmd.spawn().expect("sandbox-net starts");
    (child, channel, frames, dialer)
}

/// Sends the settings, the dialer's socket attached, as the service does.
fn start(channel: &UnixStream, cfg: NetConfig, dialer: &UnixStream) {
    send(channel, &Request::Start(cfg), Some(dialer.as_raw_fd())).unwrap();
}

/// Moves frames between the guest's link and the frames' socket, as the VM process would.
fn pump(rt: &tokio::runtime::Runtime, stack: Arc<StackEnd>, frames: UnixStream) {
    frames.set_nonblocking(true).unwrap();
    let _in = rt.enter();
    let frames = tokio::net::UnixStream::from_std(frames).unwrap();
    let (mut r, mut w) = frames.into_split();
    let from_guest = stack.clone();
    rt.spawn(async move {
        use tokio::io::AsyncWriteExt;
        loop {
            let f = from_guest.recv().await;
            if w.write_u32(f.len() as u32).await.is_err() || w.write_all(&f).await.is_err() {
                return;
            }
        }
    });
    rt.spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 65_600];
        while let Ok(n) = r.read_u32().await {
            let n = n as usize;
            if n > buf.len() || r.read_exact(&mut buf[..n]).await.is_err() {
                return;
            }
            stack.send(&buf[..n]);
        }
    });
}

/// A started `sandbox-net` and the service's ends of it.
struct Service {
    child: Child,
    channel: UnixStream,
    /// The VM process's end of the guest's frames.
    frames: UnixStream,
    /// The service's runtime, which makes the upstream connections.
    rt: tokio::runtime::Runtime,
    /// The channel's reader, the start's answer unread.
    reader: Reader,
    /// The service's end of the dialer (its dialer's threads hold it too): shut down, the
    /// service is gone.
    dialer: UnixStream,
}

/// `sandbox-net` started for a guest that may reach `local.test` at `port`, its upstream
/// connections made by the service's own dialer on a runtime of the test's, with `fd3` as its
/// descriptor 3 when given.
fn started(port: u16, fd3: Option<RawFd>) -> Service {
    let (child, channel, frames, (dial, their_dial)) = spawn(fd3);
    start(&channel, config(port), &their_dial);
    drop(their_dial);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let dialer = dial.try_clone().unwrap();
    let rules = sandbox_net::start::dial_rules(&config(port)).unwrap();
    sandbox_net::dial::serve(dial, rules, rt.handle().clone(), |e| panic!("{e}")).unwrap();
    let reader = Reader::with_limit(&channel, MAX_REPORT);
    Service {
        child,
        channel,
        frames,
        rt,
        reader,
        dialer,
    }
}

/// A service that came back: connects to the adoption socket at `path` and asks to adopt the
/// process, with a new dialer for `local.test` at `port` served on `rt`. The new channel and
/// its reader (the answer unread).
fn adopt(path: &Path, port: u16, rt: &tokio::runtime::Runtime) -> (UnixStream, Reader) {
    let channel = UnixStream::connect(path).expect("the adoption socket takes connections");
    let (dial, their_dial) = UnixStream::pair().unwrap();
    let rules = sandbox_net::start::dial_rules(&config(port)).unwrap();
    sandbox_net::dial::serve(dial, rules, rt.handle().clone(), |e| panic!("{e}")).unwrap();
    send(&channel, &Request::Adopt, Some(their_dial.as_raw_fd())).unwrap();
    let reader = Reader::with_limit(&channel, MAX_REPORT).within(Duration::from_secs(30));
    (channel, reader)
}

/// The process's end: the service's channel and its dialer end (it crashed).
fn service_dies(channel: UnixStream, reader: Reader, dialer: &UnixStream) {
    drop(reader);
    drop(channel);
    dialer.shutdown(Shutdown::Both).unwrap();
}

/// How `child` ended, within `within`.
fn ends_within(child: &mut Child, within: Duration) -> Option<ExitStatus> {
    let t = Instant::now();
    while t.elapsed() < within {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// Connects to `local.test` at `port` through the stack; the connection.
fn connected(
    g: &mut GuestSim,
    addr: Ipv4Addr,
    port: u16,
    within: Duration,
) -> smoltcp::iface::SocketHandle {
    let h = g.connect(addr, port, 16 * 1024);
    assert!(g.run_until(within, |g| g.tcp(h).may_send()), "connected");
    h
}

/// Asks for the hello server's page on connection `h`: what came back.
fn fetch(g: &mut GuestSim, h: smoltcp::iface::SocketHandle, within: Duration) -> Vec<u8> {
    g.tcp(h).send_slice(GET).unwrap();
    let (_, got) = read_answer(g, h, within);
    g.remove(h);
    got
}

/// Reads connection `h` until it has the hello server's body or its end (then `true`), or
/// `within` passes.
fn read_answer(
    g: &mut GuestSim,
    h: smoltcp::iface::SocketHandle,
    within: Duration,
) -> (bool, Vec<u8>) {
    let mut got = Vec::new();
    let done = g.run_until(within, |g| {
        let s = g.tcp(h);
        while s.can_recv() {
            let _ = s.recv(|b| {
                got.extend_from_slice(b);
                (b.len(), ())
            });
        }
        matches!(s.state(), State::CloseWait | State::Closed) || got.ends_with(b"hello")
    });
    (done, got)
}

fn report(channel: &UnixStream, reader: &mut Reader) -> sandbox_control::net::Report {
    send(channel, &Request::Report, None).unwrap();
    match reader.read::<Event>().unwrap() {
        Some(Event::Report(r)) => *r,
        other => panic!("not a report: {other:?}"),
    }
}

#[test]
fn the_network_process_carries_a_guest_and_reports_it() {
    let port = hello_server();
    let Service {
        mut child,
        channel,
        frames,
        rt,
        mut reader,
        ..
    } = started(port, None);
    match reader.read::<Event>().unwrap() {
        Some(Event::Started { ca_pem, env }) => {
            assert!(ca_pem.is_none(), "nothing to intercept, no CA");
            assert!(env.is_empty());
        }
        other => panic!("not started: {other:?}"),
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    assert!(
        status.lines().any(|l| l == "Seccomp:\t2"),
        "its own filter is on once it started: {status}"
    );
    let (guest, stack) = link();
    pump(&rt, Arc::new(stack), frames);
    let mut g = GuestSim::new(guest, MAC);
    let within = Duration::from_secs(20);
    let addr = g
        .resolve("local.test", within)
        .expect("the allowed name resolves");
    assert_eq!(g.resolve("blocked.test", Duration::from_secs(5)), None);
    let h = g.connect(addr, port, 16 * 1024);
    assert!(g.run_until(within, |g| g.tcp(h).may_send()), "connected");
    g.tcp(h)
        .send_slice(b"GET / HTTP/1.1\r\nhost: local.test\r\n\r\n")
        .unwrap();
    let (done, got) = read_answer(&mut g, h, within);
    assert!(done, "the answer came: {:?}", String::from_utf8_lossy(&got));
    assert!(
        got.starts_with(b"HTTP/1.1 200 OK"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );

    let r = report(&channel, &mut reader);
    let (reasons, unmetered) = sandbox_net::report::labels();
    r.check(&reasons, &unmetered)
        .expect("a report within its bounds");
    assert!(r.connections >= 1 && r.http >= 1, "{r:?}");
    assert!(r.to_guest >= 5, "the body's bytes are counted: {r:?}");
    assert!(
        r.refusals.iter().any(|(_, n)| *n > 0)
            && r.events.iter().any(|e| e.target.contains("blocked.test")),
        "the refused name is in the report: {r:?}"
    );
    // What /metrics asks for: the same counts, no lists.
    send(&channel, &Request::Counts, None).unwrap();
    match reader.read::<Event>().unwrap() {
        Some(Event::Report(c)) => {
            assert!(c.events.is_empty() && c.usage.calls.is_empty(), "{c:?}");
            assert_eq!(c.refusals, r.refusals);
            assert!(c.connections >= r.connections);
        }
        other => panic!("not a report: {other:?}"),
    }
    send(&channel, &Request::Stop, None).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
}

#[test]
fn settings_of_another_version_or_bad_ones_are_refused() {
    for (cfg, bad_request, says) in [
        (
            NetConfig {
                version: sandbox_control::net::VERSION + 1,
                ..config(1)
            },
            false,
            "SANDBOX_HOST_NET_BINARY",
        ),
        (
            NetConfig {
                allow: vec!["*.*.nope..".into()],
                ..config(1)
            },
            true,
            "",
        ),
    ] {
        let (mut child, channel, _frames, (_dial, their_dial)) = spawn(None);
        start(&channel, cfg, &their_dial);
        let mut reader = Reader::new(&channel);
        match reader.read::<Event>().unwrap() {
            Some(Event::Refused {
                bad_request: b,
                message,
            }) => {
                assert_eq!(b, bad_request, "{message}");
                assert!(message.contains(says), "{message}");
            }
            other => panic!("not refused: {other:?}"),
        }
        assert!(!child.wait().unwrap().success());
    }
}

#[test]
fn settings_without_the_dialer_are_refused() {
    let (mut child, channel, _frames, _dialer) = spawn(None);
    send(&channel, &Request::Start(config(1)), None).unwrap();
    assert!(!child.wait().unwrap().success(), "it ends with an error");
    let mut reader = Reader::new(&channel);
    assert!(matches!(reader.read::<Event>(), Ok(None)), "no answer");
}

/// A resumed sandbox's VM process gets a socket pair of its own: the service hands the network
/// process its end (`Request::Relink`), and the same stack carries the guest on through it.
#[test]
fn a_resumed_vm_gets_a_socket_of_its_own_and_the_stack_carries_on() {
    let port = hello_server();
    let Service {
        mut child,
        channel,
        frames,
        rt,
        mut reader,
        ..
    } = started(port, None);
    assert!(matches!(
        reader.read::<Event>().unwrap(),
        Some(Event::Started { .. })
    ));
    let (guest, stack) = link();
    let stack = Arc::new(stack);
    pump(&rt, stack.clone(), frames);
    let mut g = GuestSim::new(guest, MAC);
    let within = Duration::from_secs(20);
    let addr = g.resolve("local.test", within).expect("resolves");

    // The first VM process ends (its socket closes); the next one's socket is handed over.
    let (vm, theirs) = UnixStream::pair().unwrap();
    send(&channel, &Request::Relink, Some(theirs.as_raw_fd())).unwrap();
    drop(theirs);
    assert!(matches!(
        reader.read::<Event>().unwrap(),
        Some(Event::Relinked)
    ));
    pump(&rt, stack, vm);
    let h = g.connect(addr, port, 16 * 1024);
    assert!(
        g.run_until(within, |g| g.tcp(h).may_send()),
        "connected after the relink"
    );
    g.tcp(h)
        .send_slice(b"GET / HTTP/1.1\r\nhost: local.test\r\n\r\n")
        .unwrap();
    let (_, got) = read_answer(&mut g, h, within);
    assert!(
        got.ends_with(b"hello"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
    // A relink without its socket ends the process: it is not a service's request.
    send(&channel, &Request::Relink, None).unwrap();
    assert!(!child.wait().unwrap().success());
}

/// The service crashes and comes back: the process given a listening socket on descriptor 3
/// runs on without it (a connection made before carries on, a new one is reset at once, not
/// left hanging), and the next service adopts it there, with a dialer of its own. The stack is
/// the same: its counters hold the connections of before.
#[test]
fn a_service_that_came_back_adopts_the_running_process() {
    let port = hello_server();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("adopt.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let Service {
        mut child,
        channel,
        frames,
        rt,
        mut reader,
        dialer,
    } = started(port, Some(listener.as_raw_fd()));
    drop(listener); // the process's now
    assert!(matches!(
        reader.read::<Event>().unwrap(),
        Some(Event::Started { .. })
    ));
    let (guest, stack) = link();
    pump(&rt, Arc::new(stack), frames);
    let mut g = GuestSim::new(guest, MAC);
    let within = Duration::from_secs(20);
    let addr = g.resolve("local.test", within).expect("resolves");
    let h = connected(&mut g, addr, port, within);
    let got = fetch(&mut g, h, within);
    assert!(
        got.ends_with(b"hello"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
    // Made (its upstream too) while the service is there, used once it has gone.
    let held = connected(&mut g, addr, port, within);

    service_dies(channel, reader, &dialer);
    let got = fetch(&mut g, held, within);
    assert!(
        got.ends_with(b"hello"),
        "a connection made before carries on: {:?}",
        String::from_utf8_lossy(&got)
    );
    let t = Instant::now();
    let h = g.connect(addr, port, 16 * 1024);
    assert!(
        g.run_until(within, |g| g.tcp(h).state() == State::Closed),
        "a new connection is reset while no service makes it"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "at once, not at the dial's timeout: {:?}",
        t.elapsed()
    );
    g.remove(h);
    assert!(
        child.try_wait().unwrap().is_none(),
        "it runs on without its service"
    );

    let (channel, mut reader) = adopt(&path, port, &rt);
    match reader.read::<Event>().unwrap() {
        Some(Event::Adopted { version, token }) => {
            assert_eq!(
                (version, token.as_str()),
                (sandbox_control::net::VERSION, TOKEN)
            )
        }
        other => panic!("not adopted: {other:?}"),
    }
    let h = connected(&mut g, addr, port, within);
    let got = fetch(&mut g, h, within);
    assert!(
        got.ends_with(b"hello"),
        "dials go through the new service: {:?}",
        String::from_utf8_lossy(&got)
    );
    let r = report(&channel, &mut reader);
    assert!(
        r.connections >= 4 && r.http >= 3 && r.upstream_failures >= 1,
        "the counters of before are kept: {r:?}"
    );
    send(&channel, &Request::Stop, None).unwrap();
    let status = ends_within(&mut child, within).expect("it stops");
    assert!(status.success(), "{status}");
}

/// What connects to the adoption socket is read as hostile until it adopts the process: a
/// connection whose first line is anything but an adoption with its dialer, or that says nothing
/// for longer than its bound, is closed unanswered, and the process waits for the next. Once
/// adopted, an adoption on the channel is no service's request: the process ends.
#[test]
fn a_connection_that_does_not_adopt_is_closed_and_the_next_adopts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("adopt.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let Service {
        mut child,
        channel,
        rt,
        mut reader,
        dialer,
        ..
    } = started(1, Some(listener.as_raw_fd()));
    drop(listener);
    assert!(matches!(
        reader.read::<Event>().unwrap(),
        Some(Event::Started { .. })
    ));
    service_dies(channel, reader, &dialer);

    let closed = |c: &UnixStream, what: &str| {
        let mut r = Reader::new(c).within(Duration::from_secs(10));
        match r.read::<Event>() {
            Ok(None) => {}
            // Closed with some of what it sent unread.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("{what}: not closed unanswered: {other:?}"),
        }
    };
    let (spare, their_spare) = UnixStream::pair().unwrap();
    let c = UnixStream::connect(&path).unwrap();
    send(&c, &Request::Report, None).unwrap();
    closed(&c, "a report");
    let c = UnixStream::connect(&path).unwrap();
    send(&c, &Request::Adopt, None).unwrap();
    closed(&c, "an adoption without its dialer");
    let c = UnixStream::connect(&path).unwrap();
    send(
        &c,
        &Request::Start(config(1)),
        Some(their_spare.as_raw_fd()),
    )
    .unwrap();
    closed(&c, "a start");
    let mut c = UnixStream::connect(&path).unwrap();
    c.write_all(b"{\"adopt\":1}\n").unwrap();
    closed(&c, "a line that is no request");
    let mut c = UnixStream::connect(&path).unwrap();
    c.write_all(&[b'x'; 4096]).unwrap();
    closed(&c, "a line longer than an adoption");
    drop((spare, their_spare));
    assert!(child.try_wait().unwrap().is_none(), "it waits on");

    // One that says nothing holds the socket no longer than its bound: the next, behind it,
    // adopts the process.
    let silent = UnixStream::connect(&path).unwrap();
    let t = Instant::now();
    let (channel, mut reader) = adopt(&path, 1, &rt);
    match reader.read::<Event>().unwrap() {
        Some(Event::Adopted { version, token }) => {
            assert_eq!(
                (version, token.as_str()),
                (sandbox_control::net::VERSION, TOKEN)
            )
        }
        other => panic!("not adopted: {other:?}"),
    }
    let waited = t.elapsed();
    assert!(
        waited + Duration::from_millis(500) >= ADOPT_WITHIN && waited < 3 * ADOPT_WITHIN,
        "after the silent one's bound: {waited:?}"
    );
    closed(&silent, "a connection that says nothing");
    let r = report(&channel, &mut reader);
    assert!(r.connections == 0, "{r:?}");

    send(&channel, &Request::Adopt, None).unwrap();
    let status = ends_within(&mut child, Duration::from_secs(10)).expect("it ends");
    assert!(
        !status.success(),
        "an adoption on its channel is an error: {status}"
    );
}

/// Without a listening socket on descriptor 3 (none, or a socket that does not listen) the
/// channel's end ends the process, as it always did.
#[test]
fn without_an_adoption_socket_the_end_of_the_channel_ends_the_process() {
    let (not_listening, _peer) = UnixStream::pair().unwrap();
    for fd3 in [None, Some(not_listening.as_raw_fd())] {
        let Service {
            mut child,
            channel,
            mut reader,
            ..
        } = started(1, fd3);
        assert!(matches!(
            reader.read::<Event>().unwrap(),
            Some(Event::Started { .. })
        ));
        drop(reader);
        drop(channel);
        let status = ends_within(&mut child, Duration::from_secs(10))
            .unwrap_or_else(|| panic!("the process ends ({fd3:?})"));
        assert!(status.success(), "{status} ({fd3:?})");
    }
}
