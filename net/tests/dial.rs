//! The service's dialer, asked by a network process that its guest took over (this test plays
//! it, over a real socket pair): what the sandbox may reach is connected and its socket arrives;
//! a name or a port outside the allowlist, an address spelled as a name, and a name that resolves
//! to the local network are refused; a descriptor sent to the service ends the dialer. And the
//! process's dialer outlives its service: it fails at once while none is there, and takes the
//! socket of the next.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::Duration;

use sandbox_control::line::{Reader, send};
use sandbox_control::net::{Dial, DialResult, Dialed, NetConfig};

fn config(allow: &[&str], resolve: &str) -> NetConfig {
    NetConfig {
        version: sandbox_control::net::VERSION,
        sandbox: "dial-test".into(),
        mac: [2, 0, 0, 0, 0, 1],
        allow: allow.iter().map(|s| s.to_string()).collect(),
        meter: vec![],
        intercept_all: false,
        meter_strict: false,
        meter_body_max: 1 << 20,
        secrets: vec![],
        memory_bytes: 1 << 20,
        resolve: resolve.into(),
        upstream_ca_pem: None,
        token: String::new(),
    }
}

/// The service's dialer for `cfg`, and the network process's end; violations come on the
/// receiver.
fn dialer(
    rt: &tokio::runtime::Runtime,
    cfg: &NetConfig,
) -> (UnixStream, Reader, mpsc::Receiver<String>) {
    let (service, process) = UnixStream::pair().unwrap();
    let (tx, rx) = mpsc::channel();
    let rules = sandbox_net::start::dial_rules(cfg).unwrap();
    sandbox_net::dial::serve(service, rules, rt.handle().clone(), move |e| {
        let _ = tx.send(e);
    })
    .unwrap();
    let reader = Reader::with_limit(&process, sandbox_control::net::MAX_DIAL_LINE)
        .within(Duration::from_secs(30));
    (process, reader, rx)
}

fn ask(sock: &UnixStream, reader: &mut Reader, id: u64, name: &str, port: u16) -> Dialed {
    let d = Dial {
        id,
        name: name.into(),
        port,
    };
    send(sock, &d, None).unwrap();
    reader.read::<Dialed>().unwrap().expect("an answer")
}

#[test]
fn the_service_connects_only_what_the_sandbox_may_reach() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut s in server.incoming().flatten() {
            let _ = s.write_all(b"hi");
        }
    });
    let cfg = config(
        &["local.test", "private.test"],
        &format!("local.test:{port}:127.0.0.1,private.test:443:10.0.0.1"),
    );
    let (sock, mut reader, violations) = dialer(&rt, &cfg);

    // An allowed name on its routed port: connected, and the socket carries its bytes.
    let d = ask(&sock, &mut reader, 1, "Local.Test.", port);
    assert_eq!(d.id, 1);
    assert!(
        matches!(d.result, DialResult::Connected { addr } if addr.port() == port),
        "{d:?}"
    );
    let mut s = std::net::TcpStream::from(reader.take_fd().expect("the socket came"));
    // It comes as the service's runtime made it, non-blocking.
    s.set_nonblocking(false).unwrap();
    let mut hi = [0u8; 2];
    s.read_exact(&mut hi).unwrap();
    assert_eq!(&hi, b"hi");

    // What the guest may not reach is never connected, whatever the process asks.
    for (id, name, p) in [
        (2, "other.test", 443),     // not in the allowlist
        (3, "local.test", 22),      // not a port of it
        (4, "127.0.0.1", port),     // an address, not a name
        (5, "169.254.169.254", 80), // the metadata service, spelled as an address
        (6, "", 443),
        (7, &"a".repeat(300) as &str, 443),
    ] {
        let d = ask(&sock, &mut reader, id, name, p);
        assert_eq!(
            (d.id, &d.result),
            (id, &DialResult::NotAllowed),
            "{name}:{p}"
        );
        assert!(reader.take_fd().is_none());
    }
    // An allowed name routed to the local network (only loopback may be routed, for tests).
    let d = ask(&sock, &mut reader, 8, "private.test", 443);
    assert!(
        matches!(&d.result, DialResult::Internal { why, .. } if why == "private"),
        "{d:?}"
    );
    assert!(reader.take_fd().is_none());
    assert!(violations.try_recv().is_err(), "nothing hostile yet");

    // A descriptor sent to the service: it stops answering, and says so.
    let d = Dial {
        id: 9,
        name: "local.test".into(),
        port,
    };
    send(&sock, &d, Some(sock.as_raw_fd())).unwrap();
    let said = violations
        .recv_timeout(Duration::from_secs(10))
        .expect("the violation is reported");
    assert!(said.contains("descriptor"), "{said}");
    assert!(
        matches!(reader.read::<Dialed>(), Ok(None)),
        "the dialer has closed its end"
    );
}

#[test]
fn a_line_that_is_not_a_request_ends_the_dialer() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (mut sock, mut reader, violations) = dialer(&rt, &config(&["local.test"], ""));
    sock.write_all(&[b'x'; 4096]).unwrap();
    let said = violations.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(said.contains("longer than"), "{said}");
    assert!(matches!(reader.read::<Dialed>(), Ok(None)));
}

#[test]
fn a_burst_beyond_the_bound_waits_its_turn_and_every_connection_is_made() {
    use sandbox_egress::upstream::Dial as _;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in server.incoming().flatten() {
            held.push(s); // kept open: each dial holds its connection until the test ends
        }
    });
    let cfg = config(&["local.test"], &format!("local.test:{port}:127.0.0.1"));
    let (service, process) = UnixStream::pair().unwrap();
    let rules = sandbox_net::start::dial_rules(&cfg).unwrap();
    sandbox_net::dial::serve(service, rules, rt.handle().clone(), |e| panic!("{e}")).unwrap();
    let dialer = std::sync::Arc::new(sandbox_net::dial::Dialer::start(process).unwrap());
    let n = 3 * sandbox_net::dial::MAX_DIALS;
    let made = rt.block_on(async {
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let d = dialer.clone();
                tokio::spawn(async move { d.dial("local.test", port).await.map(|(s, _)| s) })
            })
            .collect();
        let mut made = Vec::new();
        for t in tasks {
            made.push(t.await.unwrap().expect("connected"));
        }
        made
    });
    assert_eq!(made.len(), n);
    // Refused names come back as the stack's own errors.
    let e = rt
        .block_on(dialer.dial("other.test", 443))
        .map(|_| ())
        .unwrap_err();
    assert!(e.to_string().contains("allowlist"), "{e}");
}

/// The service goes away and the next one comes back: a dial waiting on the old socket fails when
/// that socket ends, each dial while there is none fails at once (no waiting for the dial's
/// timeout), and once the new socket is attached dials go through it.
#[test]
fn a_dialer_fails_at_once_while_its_service_is_away_and_works_once_attached() {
    use sandbox_egress::upstream::Dial as _;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in server.incoming().flatten() {
            held.push(s);
        }
    });
    let cfg = config(&["local.test"], &format!("local.test:{port}:127.0.0.1"));
    let (old, process) = UnixStream::pair().unwrap();
    let dialer = std::sync::Arc::new(sandbox_net::dial::Dialer::start(process).unwrap());

    // The old service takes a request, and ends without answering it.
    let waiting = {
        let d = dialer.clone();
        rt.spawn(async move { d.dial("local.test", port).await.map(|_| ()) })
    };
    let mut reader = Reader::with_limit(&old, sandbox_control::net::MAX_DIAL_LINE)
        .within(Duration::from_secs(10));
    assert!(reader.read::<Dial>().unwrap().is_some(), "the request came");
    let t = std::time::Instant::now();
    drop(reader);
    drop(old);
    let e = rt.block_on(waiting).unwrap().unwrap_err();
    assert!(e.to_string().contains("gone"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());

    // Away: each dial fails at once.
    for _ in 0..3 * sandbox_net::dial::MAX_DIALS {
        let t = std::time::Instant::now();
        let e = rt
            .block_on(dialer.dial("local.test", port))
            .map(|_| ())
            .unwrap_err();
        assert!(e.to_string().contains("gone"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }

    // Back: the new service's socket carries the dials.
    let (service, process) = UnixStream::pair().unwrap();
    let rules = sandbox_net::start::dial_rules(&cfg).unwrap();
    sandbox_net::dial::serve(service, rules, rt.handle().clone(), |e| panic!("{e}")).unwrap();
    dialer.attach(process).unwrap();
    let (_, addr) = rt
        .block_on(dialer.dial("local.test", port))
        .expect("connected through the new service");
    assert_eq!(addr.port(), port);
}
