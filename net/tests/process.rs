//! The real `sandbox-net` program, started as the service starts it (the channel on its
//! descriptor 0, the guest's frames on 1, the dialer's socket with its settings, served by the
//! service's own dialer): a simulated guest behind the frames' socket resolves an
//! allowed name, fetches a page from a loopback server through the process's stack, is refused a
//! name outside its allowlist, and the report over the channel says so. Then the settings of
//! another version, and bad settings, are refused with the error the service shows.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use sandbox_control::line::{Reader, send};
use sandbox_control::net::{Event, MAX_REPORT, NetConfig, Request};
use sandbox_egress::link::{StackEnd, link};
use sandbox_egress::sim::GuestSim;
use smoltcp::socket::tcp::State;

const MAC: [u8; 6] = [0x02, 0x5a, 0, 0, 0, 9];

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
    }
}

/// `sandbox-net` with its two sockets; the service's ends, and the dialer's two.
fn spawn() -> (Child, UnixStream, UnixStream, (UnixStream, UnixStream)) {
    let (channel, theirs) = UnixStream::pair().unwrap();
    let dialer = UnixStream::pair().unwrap();
    let (frames, their_frames) = UnixStream::pair().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_sandbox-net"))
        .stdin(Stdio::from(OwnedFd::from(theirs)))
        .stdout(Stdio::from(OwnedFd::from(their_frames)))
        .spawn()
        .expect("sandbox-net starts");
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

/// `sandbox-net` started for a guest that may reach `local.test` at `port`, its upstream
/// connections made by the service's own dialer on a runtime of the test's: the process, the
/// channel, the frames' socket, the runtime and the channel's reader (its first answer unread).
fn started(
    port: u16,
) -> (
    Child,
    UnixStream,
    UnixStream,
    tokio::runtime::Runtime,
    Reader,
) {
    let (child, channel, frames, (dial, their_dial)) = spawn();
    start(&channel, config(port), &their_dial);
    drop(their_dial);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let rules = sandbox_net::start::dial_rules(&config(port)).unwrap();
    sandbox_net::dial::serve(dial, rules, rt.handle().clone(), |e| panic!("{e}")).unwrap();
    let reader = Reader::with_limit(&channel, MAX_REPORT);
    (child, channel, frames, rt, reader)
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
    let (mut child, channel, frames, rt, mut reader) = started(port);
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
        let (mut child, channel, _frames, (_dial, their_dial)) = spawn();
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
    let (mut child, channel, _frames, _dialer) = spawn();
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
    let (mut child, channel, frames, rt, mut reader) = started(port);
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
