//! Egress stack figures (issue 5), without a VM: a simulated guest (smoltcp on the guest's side of
//! the link, on this thread) drives the real stack (a one-worker tokio runtime: one core), which
//! talks to real sockets on loopback. Kernel loopback, measured in the same run, is the reference.
//!
//! - bulk throughput of one spliced flow guest -> upstream (a real ClientHello for an allowed
//!   name, then bulk bytes: the stack copies them unread, as it does any spliced TLS);
//! - connection set-up of a spliced connection: connect, ClientHello, first byte back;
//! - first byte of an HTTPS request, end to end (guest TLS client, loopback TLS server), spliced
//!   against intercepted: what interception adds.
//! - What hostile connections cost: 128 connections whose upstream answers without end and whose
//!   guest never reads, spliced and served as HTTP: the process's resident memory they add,
//!   against what the sandbox's egress memory counts for them and its limit (issue 29, item 8).
//! - The network process (issue 32): one flow through `sandbox-net` against the same stack in
//!   this process, its start and its resident memory (`SANDBOX_HOST_BENCH_ONLY=process`).
//! - Response scanning: a body streamed through the echo scan (every secret's forms looked for and
//!   masked) against the same body copied, as a share of the stack's measured throughput; and the
//!   flow the scan runs in, end to end: a large model-output response downloaded over
//!   intercepted TLS (the stack's TLS to the guest and to the server, hyper between), in a
//!   sandbox with secrets (every response scanned) against one without, interleaved.
//!
//! `cargo bench -p sandbox-benches --bench egress` (SANDBOX_HOST_BENCH_MIB, default 256).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sandbox_benches::{header, row, stats};
use sandbox_egress::net::guest_mac;
use sandbox_egress::policy::Allowlist;
use sandbox_egress::resolve::ResolveOverrides;
use sandbox_egress::sim::GuestSim;
use sandbox_egress::{Egress, EgressConfig, Limits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A loopback server on `rt` that runs `each` as a task of its own for every connection; its port.
fn loopback_server<F, Fut>(rt: &tokio::runtime::Runtime, each: F) -> u16
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let l = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = l.local_addr().unwrap().port();
    rt.spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(each(s));
        }
    });
    port
}

/// A loopback server that counts and discards what it gets and answers each connection's first
/// read with one byte.
fn sink(rt: &tokio::runtime::Runtime, got: Arc<AtomicU64>) -> u16 {
    loopback_server(rt, move |mut s| {
        let got = got.clone();
        async move {
            let _ = s.set_nodelay(true);
            let mut buf = vec![0u8; 256 * 1024];
            let mut first = true;
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        got.fetch_add(n as u64, Ordering::Relaxed);
                        if first {
                            first = false;
                            let _ = s.write_all(b"!").await;
                        }
                    }
                }
            }
            let _ = s.shutdown().await;
        }
    })
}

fn start(
    rt: &tokio::runtime::Runtime,
    port: u16,
    socket_buffer: usize,
) -> (Egress, GuestSim, Ipv4Addr) {
    let mac = guest_mac("bench");
    let mut cfg = EgressConfig::new(mac, Allowlist::parse(["sink.test"]).unwrap());
    cfg.overrides =
        Arc::new(ResolveOverrides::parse(&format!("sink.test:{port}:127.0.0.1")).unwrap());
    cfg.limits = Limits {
        socket_buffer,
        // The stack's own cost, not the pacing of a guest's new connections (20 a second after
        // a burst of 64) that the set-up figures would otherwise measure.
        connect_rate: 1_000_000,
        connect_burst: 1_000_000,
        ..Limits::default()
    };
    let (egress, link) = {
        let _in = rt.enter();
        Egress::start(cfg)
    };
    let mut guest = GuestSim::new(link, mac);
    let addr = guest
        .resolve("sink.test", Duration::from_secs(5))
        .expect("the stack answers DNS");
    (egress, guest, addr)
}

/// The first TLS record a client sends to an allowed name: what decides a connection is spliced.
fn head(_port: u16) -> Vec<u8> {
    sandbox_egress::sim::client_hello("sink.test")
}

/// Sends `total` bytes through the stack on one connection; Gbit/s.
fn through_stack(total: usize, socket_buffer: usize) -> f64 {
    let rt = runtime();
    let got = Arc::new(AtomicU64::new(0));
    let port = sink(&rt, got.clone());
    let (_egress, mut g, addr) = start(&rt, port, socket_buffer);
    one_flow(&mut g, addr, port, socket_buffer, total, &got)
}

/// Sends `total` bytes from `g` to the sink at `port` (which counts into `got`), through its
/// stack wherever it runs; Gbit/s.
fn one_flow(
    g: &mut GuestSim,
    addr: Ipv4Addr,
    port: u16,
    socket_buffer: usize,
    total: usize,
    got: &AtomicU64,
) -> f64 {
    got.store(0, Ordering::Relaxed);
    let h = g.connect(addr, port, socket_buffer);
    let head = head(port);
    let chunk = vec![0x5au8; 64 * 1024];
    let mut sent = 0usize;
    let mut head_sent = 0usize;
    let want = (head.len() + total) as u64;
    let t = Instant::now();
    let done = g.run_until(Duration::from_secs(120), |g| {
        let s = g.tcp(h);
        while s.can_send() {
            let n = if head_sent < head.len() {
                let n = s.send_slice(&head[head_sent..]).unwrap_or(0);
                head_sent += n;
                n
            } else if sent < total {
                let n = s
                    .send_slice(&chunk[..chunk.len().min(total - sent)])
                    .unwrap_or(0);
                sent += n;
                n
            } else {
                0
            };
            if n == 0 {
                break;
            }
        }
        while s.can_recv() {
            let _ = s.recv(|b| (b.len(), ()));
        }
        got.load(Ordering::Relaxed) >= want
    });
    let secs = t.elapsed().as_secs_f64();
    assert!(
        done,
        "the flow did not finish: {} of {want}",
        got.load(Ordering::Relaxed)
    );
    g.remove(h);
    want as f64 * 8.0 / secs / 1e9
}

/// `sandbox-net` as the service starts it (unjailed here: the jail's cost is its start, measured
/// by `benches/jail.rs`), with a guest simulated behind its frames' socket.
struct NetChild {
    child: std::process::Child,
    _channel: std::os::unix::net::UnixStream,
}

impl Drop for NetChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl NetChild {
    /// Its resident memory, KiB.
    fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            })
            .unwrap_or(0)
    }
}

/// The release `sandbox-net` beside this bench (`target/release/deps/..`), if it was built.
fn net_program() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("SANDBOX_HOST_NET_BINARY") {
        return Some(p.into());
    }
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("sandbox-net");
    p.is_file().then_some(p)
}

/// A simulated guest whose frames go over `frames` as a VM process sends them (each a 4-byte
/// length and the frame).
fn guest_over_socket(
    rt: &tokio::runtime::Runtime,
    frames: std::os::unix::net::UnixStream,
    mac: [u8; 6],
) -> GuestSim {
    let (guest, stack) = sandbox_egress::link::link();
    // The VM process's side of the socket: each frame as a 4-byte length and the frame.
    frames.set_nonblocking(true).unwrap();
    let frames = {
        let _in = rt.enter();
        tokio::net::UnixStream::from_std(frames).unwrap()
    };
    let (r, mut w) = frames.into_split();
    let mut r = tokio::io::BufReader::with_capacity(64 * 1024, r);
    let stack = Arc::new(stack);
    let from_guest = stack.clone();
    rt.spawn(async move {
        let mut out = Vec::with_capacity(64 * 1024);
        loop {
            out.clear();
            let f = from_guest.recv().await;
            out.extend_from_slice(&(f.len() as u32).to_be_bytes());
            out.extend_from_slice(&f);
            while let Some(f) = from_guest.try_recv() {
                out.extend_from_slice(&(f.len() as u32).to_be_bytes());
                out.extend_from_slice(&f);
                if out.len() > 60 * 1024 {
                    break;
                }
            }
            if w.write_all(&out).await.is_err() {
                return;
            }
        }
    });
    rt.spawn(async move {
        let mut buf = vec![0u8; 65_600];
        while let Ok(n) = r.read_u32().await {
            let n = n as usize;
            if n > buf.len() || r.read_exact(&mut buf[..n]).await.is_err() {
                return;
            }
            stack.send(&buf[..n]);
        }
    });
    GuestSim::new(guest, mac)
}

/// The stack in this process behind a frames' socket, as the service ran it before issue 32 (its
/// pump on the socket the VM process shares), with a guest on the socket's other end.
fn in_process_over_socket(rt: &tokio::runtime::Runtime, port: u16) -> (Egress, GuestSim, Ipv4Addr) {
    let mac = guest_mac("bench-socket");
    let mut cfg = EgressConfig::new(mac, Allowlist::parse(["sink.test"]).unwrap());
    cfg.overrides =
        Arc::new(ResolveOverrides::parse(&format!("sink.test:{port}:127.0.0.1")).unwrap());
    let (egress, link) = {
        let _in = rt.enter();
        Egress::start(cfg)
    };
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    theirs.set_nonblocking(true).unwrap();
    let theirs = {
        let _in = rt.enter();
        tokio::net::UnixStream::from_std(theirs).unwrap()
    };
    rt.spawn(sandbox_control::pump::run(
        theirs,
        Arc::new(sandbox_net::GuestLink(link)),
    ));
    let mut g = guest_over_socket(rt, ours, mac);
    let addr = g
        .resolve("sink.test", Duration::from_secs(5))
        .expect("the stack answers DNS");
    (egress, g, addr)
}

/// Starts `sandbox-net` for a guest that may reach the sink at `port`, and the guest; the time
/// from the spawn to its answer.
fn process_guest(
    rt: &tokio::runtime::Runtime,
    program: &std::path::Path,
    port: u16,
) -> (NetChild, GuestSim, Ipv4Addr, Duration) {
    use sandbox_control::line::{Reader, send};
    use sandbox_control::net::{Event, NetConfig, Request};
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;
    let mac = guest_mac("bench-process");
    let (channel, theirs) = UnixStream::pair().unwrap();
    let (frames, their_frames) = UnixStream::pair().unwrap();
    let t = Instant::now();
    let child = std::process::Command::new(program)
        .stdin(std::process::Stdio::from(OwnedFd::from(theirs)))
        .stdout(std::process::Stdio::from(OwnedFd::from(their_frames)))
        .spawn()
        .expect("sandbox-net starts");
    let cfg = NetConfig {
        version: sandbox_control::net::VERSION,
        sandbox: "bench".into(),
        mac,
        allow: vec!["sink.test".into()],
        meter: vec![],
        intercept_all: false,
        meter_strict: false,
        meter_body_max: 32 << 20,
        secrets: vec![],
        memory_bytes: 96 << 20,
        resolve: format!("sink.test:{port}:127.0.0.1"),
        upstream_ca_pem: None,
        token: String::new(),
    };
    // The service's dialer makes its upstream connections, as in the service.
    let (dialer, their_dialer) = UnixStream::pair().unwrap();
    let rules = sandbox_net::start::dial_rules(&cfg).unwrap();
    sandbox_net::dial::serve(dialer, rules, rt.handle().clone(), |e| panic!("{e}")).unwrap();
    send(
        &channel,
        &Request::Start(cfg),
        Some(std::os::fd::AsRawFd::as_raw_fd(&their_dialer)),
    )
    .unwrap();
    drop(their_dialer);
    let mut reader = Reader::new(&channel);
    assert!(
        matches!(reader.read::<Event>(), Ok(Some(Event::Started { .. }))),
        "sandbox-net started"
    );
    let started = t.elapsed();
    let mut g = guest_over_socket(rt, frames, mac);
    let addr = g
        .resolve("sink.test", Duration::from_secs(5))
        .expect("the process answers DNS");
    (
        NetChild {
            child,
            _channel: channel,
        },
        g,
        addr,
        started,
    )
}

/// Issue 32's "nothing lost": one flow through the stack in this process (as the service ran it)
/// and through `sandbox-net` (as it runs now), interleaved; the process's start and memory.
fn network_process(mib: usize, pairs: usize) {
    let Some(program) = net_program() else {
        println!(
            "network process: skipped, no release sandbox-net beside this bench \
             (cargo build --release -p sandbox-net --bins, or SANDBOX_HOST_NET_BINARY)"
        );
        return;
    };
    let total = mib << 20;
    let rt = runtime();
    let got = Arc::new(AtomicU64::new(0));
    let port = sink(&rt, got.clone());
    let (_egress, mut inproc, in_addr) = in_process_over_socket(&rt, port);
    let (child, mut g, addr, started) = process_guest(&rt, &program, port);
    let idle_kib = child.rss_kib();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..pairs {
        a.push(one_flow(&mut inproc, in_addr, port, 64 * 1024, total, &got));
        b.push(one_flow(&mut g, addr, port, 64 * 1024, total, &got));
    }
    let busy_kib = child.rss_kib();
    // A new connection's set-up: the guest's SYN is answered once upstream is connected, which
    // sandbox-net asks the service's dialer for.
    let (mut ca, mut cb) = (Vec::new(), Vec::new());
    for _ in 0..31 {
        ca.push(connect_time(&mut inproc, in_addr, port));
        cb.push(connect_time(&mut g, addr, port));
    }
    let mut starts = vec![started];
    for _ in 0..9 {
        starts.push(process_guest(&rt, &program, port).3);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|x, y| x.total_cmp(y));
        v[v.len() / 2]
    };
    starts.sort();
    let ms = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2].as_secs_f64() * 1e3
    };
    println!(
        "the network process (issue 32), one flow of {mib} MiB, median of {pairs} interleaved"
    );
    println!("| stack | Gbit/s |");
    println!("|---|---|");
    println!(
        "| in the service's process, its pump on the VM's socket (before) | {:.2} |",
        median(&mut a)
    );
    println!(
        "| in sandbox-net, frames over its socket (now) | {:.2} |",
        median(&mut b)
    );
    println!(
        "\nsandbox-net: start to answer (spawn, runtime, the system's TLS roots) median {:.1} ms \
         of 10; resident memory {:.1} MiB idle, {:.1} MiB after the flows",
        starts[starts.len() / 2].as_secs_f64() * 1e3,
        idle_kib as f64 / 1024.0,
        busy_kib as f64 / 1024.0
    );
    println!(
        "connection set-up (guest SYN to established, upstream on loopback), median of 31 \
         interleaved: in the service's process {:.3} ms, through sandbox-net and the service's \
         dialer {:.3} ms",
        ms(&mut ca),
        ms(&mut cb)
    );
}

/// How long one connection takes from the guest's SYN to established.
fn connect_time(g: &mut GuestSim, addr: Ipv4Addr, port: u16) -> Duration {
    let t = Instant::now();
    let h = g.connect(addr, port, 16 * 1024);
    let ok = g.run_until(Duration::from_secs(10), |g| g.tcp(h).may_send());
    assert!(ok, "connected");
    let took = t.elapsed();
    g.tcp(h).abort();
    g.poll();
    g.remove(h);
    took
}

/// The same through kernel loopback.
fn loopback(total: usize) -> f64 {
    let rt = runtime();
    let got = Arc::new(AtomicU64::new(0));
    let port = sink(&rt, got.clone());
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let head = head(port);
    let chunk = vec![0x5au8; 64 * 1024];
    let want = (head.len() + total) as u64;
    let t = Instant::now();
    s.write_all(&head).unwrap();
    let mut sent = 0;
    while sent < total {
        let n = chunk.len().min(total - sent);
        s.write_all(&chunk[..n]).unwrap();
        sent += n;
    }
    while got.load(Ordering::Relaxed) < want {
        std::thread::yield_now();
    }
    want as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e9
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// Connect, send a request head, wait for the first byte: through the stack.
fn setup_through_stack(n: usize) -> Vec<Duration> {
    let rt = runtime();
    let port = sink(&rt, Arc::new(AtomicU64::new(0)));
    let (_egress, mut g, addr) = start(&rt, port, 64 * 1024);
    let req = head(port);
    let mut out = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let h = g.connect(addr, port, 16 * 1024);
        let mut sent = false;
        let ok = g.run_until(Duration::from_secs(10), |g| {
            let s = g.tcp(h);
            if !sent && s.can_send() {
                sent = s.send_slice(&req).is_ok();
            }
            s.can_recv()
        });
        assert!(ok, "no answer through the stack");
        out.push(t.elapsed());
        g.tcp(h).abort();
        g.poll();
        g.remove(h);
    }
    out
}

fn setup_loopback(n: usize) -> Vec<Duration> {
    let rt = runtime();
    let port = sink(&rt, Arc::new(AtomicU64::new(0)));
    let req = head(port);
    (0..n)
        .map(|_| {
            let t = Instant::now();
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_nodelay(true).unwrap();
            s.write_all(&req).unwrap();
            let mut b = [0u8; 1];
            s.read_exact(&mut b).unwrap();
            t.elapsed()
        })
        .collect()
}

/// A loopback HTTPS server for `names` (HTTP/1.1, keep-alive) answering every request with one
/// byte; its port and its CA's PEM.
fn https_server(rt: &tokio::runtime::Runtime, names: &[&str]) -> (u16, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap()
            .signed_by(&leaf_key, &issuer)
            .unwrap();
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![leaf.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
    )
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let l = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = l.local_addr().unwrap().port();
    rt.spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let _ = tcp.set_nodelay(true);
                let Ok(mut s) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = Vec::new();
                let mut b = [0u8; 4096];
                loop {
                    match s.read(&mut b).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&b[..n]),
                    }
                    while let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        // `GET /big/<bytes>`: that many bytes of model output, in 16 KiB writes.
                        let big = std::str::from_utf8(&buf[..i])
                            .ok()
                            .and_then(|h| h.strip_prefix("GET /big/"))
                            .and_then(|r| r.split(' ').next())
                            .and_then(|n| n.parse::<usize>().ok());
                        buf.drain(..i + 4);
                        let Some(len) = big else {
                            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n!";
                            if s.write_all(answer).await.is_err() || s.flush().await.is_err() {
                                return;
                            }
                            continue;
                        };
                        let head = format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {len}\r\n\r\n");
                        if s.write_all(head.as_bytes()).await.is_err() {
                            return;
                        }
                        let chunk: Vec<u8> = MODEL_OUTPUT.iter().copied().cycle().take(16 * 1024).collect();
                        let mut left = len;
                        while left > 0 {
                            let n = left.min(chunk.len());
                            if s.write_all(&chunk[..n]).await.is_err() {
                                return;
                            }
                            left -= n;
                        }
                        if s.flush().await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (port, ca_cert.pem())
}

/// What a model's streamed answer looks like: SSE events of JSON deltas.
const MODEL_OUTPUT: &[u8] = b"data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello, world. \"}}\n\n";

/// Sends `GET path` over TLS from the simulated guest to `name` (a socket window of
/// `window`) and runs the session, handing it to `read` after each batch of records, until
/// `read` says it has what it wants or `within` passes; closes the connection. Whether it had.
#[allow(clippy::too_many_arguments)]
fn https_get(
    g: &mut GuestSim,
    (addr, port): (Ipv4Addr, u16),
    name: &str,
    cfg: &Arc<rustls::ClientConfig>,
    path: &str,
    window: usize,
    within: Duration,
    mut read: impl FnMut(&mut rustls::ClientConnection) -> bool,
) -> bool {
    let h = g.connect(addr, port, window);
    let mut tls =
        rustls::ClientConnection::new(cfg.clone(), name.to_string().try_into().unwrap()).unwrap();
    tls.writer()
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: {name}:{port}\r\n\r\n").as_bytes())
        .unwrap();
    let mut out: Vec<u8> = Vec::new();
    let mut done = false;
    let ok = g.run_until(within, |g| {
        let s = g.tcp(h);
        while tls.wants_write() {
            tls.write_tls(&mut out).unwrap();
        }
        if !out.is_empty() && s.can_send() {
            let n = s.send_slice(&out).unwrap_or(0);
            out.drain(..n);
        }
        while s.can_recv() {
            let _ = s.recv(|b| {
                let n = tls.read_tls(&mut &b[..]).unwrap_or(0);
                (n, ())
            });
            tls.process_new_packets()
                .expect("the guest's TLS accepts the server");
            // Read as it comes: rustls holds a bounded amount of plaintext.
            done |= read(&mut tls);
        }
        done || read(&mut tls)
    });
    g.tcp(h).abort();
    g.poll();
    g.remove(h);
    ok
}

/// Downloads `len` bytes of model output over HTTPS from `name` (from the first byte of the
/// answer to the last, in the guest's TLS client); Gbit/s of the body.
fn https_download(
    g: &mut GuestSim,
    to: (Ipv4Addr, u16),
    name: &str,
    cfg: &Arc<rustls::ClientConfig>,
    len: usize,
) -> f64 {
    let (mut got, mut buf, mut t) = (0usize, vec![0u8; 64 * 1024], None);
    let path = format!("/big/{len}");
    let within = Duration::from_secs(120);
    let ok = https_get(g, to, name, cfg, &path, 256 * 1024, within, |tls| {
        while let Ok(n) = tls.reader().read(&mut buf) {
            if n == 0 {
                break;
            }
            t.get_or_insert_with(Instant::now);
            got += n;
        }
        got >= len
    });
    assert!(
        ok,
        "the download from {name} did not finish: {got} of {len} bytes"
    );
    let secs = t.map_or(f64::NAN, |t: Instant| t.elapsed().as_secs_f64());
    len as f64 * 8.0 / secs / 1e9
}

/// A stack on `rt` whose config is `cfg` that intercepts `intercepted.test` (its upstream's
/// certificates signed by `server_ca`) with `secrets`, and its guest; and the sandbox CA's PEM.
fn intercepting(
    rt: &tokio::runtime::Runtime,
    mut cfg: EgressConfig,
    secrets: Vec<sandbox_egress::secrets::Secret>,
    server_ca: &str,
) -> (Egress, GuestSim, String) {
    use sandbox_egress::intercept::{Interception, upstream_client};
    use sandbox_egress::policy::HostPattern;
    let mac = cfg.guest_mac;
    let intercepted = vec![HostPattern::parse("intercepted.test").unwrap()];
    let icp = Interception::new(
        "bench",
        &intercepted,
        secrets,
        intercepted.clone(),
        Default::default(),
        upstream_client(Some(server_ca.as_bytes())).unwrap(),
    )
    .unwrap();
    let sandbox_ca = icp.ca_pem().to_string();
    cfg.intercept = intercepted;
    cfg.interception = Some(Arc::new(icp));
    let (egress, link) = {
        let _in = rt.enter();
        Egress::start(cfg)
    };
    (egress, GuestSim::new(link, mac), sandbox_ca)
}

/// The guest's TLS client, trusting the certificates in `pems`.
fn client_trusting(pems: &[&str]) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for pem in pems {
        for c in rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
    }
    Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth(),
    )
}

/// The processor time this process has used, user and system, in seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: rusage is plain integers, for which zero is a value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid rusage for the call to fill.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(u.ru_utime) + secs(u.ru_stime)
}

/// One side of [`intercepted_downloads`]: the median Gbit/s and the median processor time per
/// download (every thread of the bench: the guest's TLS, the egress stack and the upstream).
struct Side {
    gbit: f64,
    cpu: f64,
}

/// The scanned side against the open one, download pair by download pair (each pair run one
/// right after the other, so a drift of the machine's speed falls on both): the sorted ratios of
/// wall time and of processor time.
struct Pairs {
    time: Vec<f64>,
    cpu: Vec<f64>,
}

/// Model output downloaded over intercepted TLS, `len` bytes `n` times, in a sandbox whose
/// every response is scanned for three secrets, against one with none, interleaved.
fn intercepted_downloads(len: usize, n: usize) -> (Side, Side, Pairs) {
    use sandbox_egress::secrets::Secret;
    let rt = runtime();
    let (port, server_ca) = https_server(&rt, &["intercepted.test"]);
    let keys = [
        "sk-ant-api03-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJ-0123456789abcdefghij",
        "sk-proj-0123456789abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOP",
        "sk-or-v1-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    ];
    let mut sides = Vec::new();
    for scanned in [false, true] {
        let mac = guest_mac(if scanned {
            "bench-scan"
        } else {
            "bench-noscan"
        });
        let mut cfg = EgressConfig::new(mac, Allowlist::parse(["intercepted.test"]).unwrap());
        cfg.overrides = Arc::new(
            ResolveOverrides::parse(&format!("intercepted.test:{port}:127.0.0.1")).unwrap(),
        );
        // The secrets are for other hosts: their keys never go to this one, but every response
        // of the sandbox is scanned for them.
        let secrets: Vec<Secret> = if scanned {
            keys.iter()
                .enumerate()
                .map(|(i, k)| {
                    Secret::new(&format!("KEY_{i}"), k, &[format!("api{i}.test")], None).unwrap()
                })
                .collect()
        } else {
            vec![]
        };
        let (egress, mut g, sandbox_ca) = intercepting(&rt, cfg, secrets, &server_ca);
        let addr = g
            .resolve("intercepted.test", Duration::from_secs(5))
            .unwrap();
        let client = client_trusting(&[&sandbox_ca]);
        sides.push((egress, g, addr, client));
    }
    let mut runs: [(Vec<f64>, Vec<f64>); 2] = Default::default();
    for i in 0..=n {
        for (k, (_, g, addr, client)) in sides.iter_mut().enumerate() {
            let cpu = cpu_seconds();
            let gbit = https_download(g, (*addr, port), "intercepted.test", client, len);
            let cpu = cpu_seconds() - cpu;
            // The first of each is a warm-up (the leaf certificate, the upstream connection).
            if i > 0 {
                runs[k].0.push(gbit);
                runs[k].1.push(cpu);
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let [mut open, mut scanned] = runs;
    let sorted = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v
    };
    // Time is inverse to Gbit/s: the scanned download's time over the open one's.
    let pairs = Pairs {
        time: sorted(open.0.iter().zip(&scanned.0).map(|(o, s)| o / s).collect()),
        cpu: sorted(scanned.1.iter().zip(&open.1).map(|(s, o)| s / o).collect()),
    };
    (
        Side {
            gbit: median(&mut open.0),
            cpu: median(&mut open.1),
        },
        Side {
            gbit: median(&mut scanned.0),
            cpu: median(&mut scanned.1),
        },
        pairs,
    )
}

/// From connect to the first byte of the answer to one HTTPS request to `name`, with the guest's
/// TLS client (rustls, sans-I/O over the simulated guest's socket) trusting `roots`.
fn https_first_byte(
    g: &mut GuestSim,
    addr: Ipv4Addr,
    port: u16,
    name: &str,
    cfg: &Arc<rustls::ClientConfig>,
) -> Duration {
    let t = Instant::now();
    let within = Duration::from_secs(10);
    let mut first = None;
    let ok = https_get(g, (addr, port), name, cfg, "/", 64 * 1024, within, |tls| {
        let mut b = [0u8; 64];
        if matches!(tls.reader().read(&mut b), Ok(n) if n > 0) {
            first.get_or_insert_with(|| t.elapsed());
        }
        first.is_some()
    });
    assert!(ok, "no HTTPS answer for {name}");
    first.unwrap_or_else(|| t.elapsed())
}

/// First byte of an HTTPS request: spliced (the guest talks TLS to the server) against
/// intercepted (TLS ends in the stack with the sandbox CA; a second TLS session upstream).
fn interception(n: usize) -> (Vec<Duration>, Vec<Duration>) {
    let rt = runtime();
    let (port, server_ca) = https_server(&rt, &["spliced.test", "intercepted.test"]);
    let mac = guest_mac("bench-tls");
    let mut cfg = EgressConfig::new(
        mac,
        Allowlist::parse(["spliced.test", "intercepted.test"]).unwrap(),
    );
    cfg.overrides = Arc::new(
        ResolveOverrides::parse(&format!(
            "spliced.test:{port}:127.0.0.1,intercepted.test:{port}:127.0.0.1"
        ))
        .unwrap(),
    );
    // As in `start`: the stack's cost, not the pacing of new connections.
    cfg.limits = Limits {
        connect_rate: 1_000_000,
        connect_burst: 1_000_000,
        ..Limits::default()
    };
    let (_egress, mut g, sandbox_ca) = intercepting(&rt, cfg, vec![], &server_ca);
    let spliced_addr = g.resolve("spliced.test", Duration::from_secs(5)).unwrap();
    let intercepted_addr = g
        .resolve("intercepted.test", Duration::from_secs(5))
        .unwrap();
    let client = client_trusting(&[&server_ca, &sandbox_ca]);
    let (mut spliced, mut through) = (Vec::new(), Vec::new());
    // Interleaved, after one warm-up each (the first interception makes the leaf certificate).
    https_first_byte(&mut g, spliced_addr, port, "spliced.test", &client);
    https_first_byte(&mut g, intercepted_addr, port, "intercepted.test", &client);
    for _ in 0..n {
        spliced.push(https_first_byte(
            &mut g,
            spliced_addr,
            port,
            "spliced.test",
            &client,
        ));
        through.push(https_first_byte(
            &mut g,
            intercepted_addr,
            port,
            "intercepted.test",
            &client,
        ));
    }
    (spliced, through)
}

fn main() {
    let mib: usize = std::env::var("SANDBOX_HOST_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let total = mib << 20;
    let med = |f: &dyn Fn() -> f64| {
        let mut v: Vec<f64> = (0..3).map(|_| f()).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v[1]
    };
    // `SANDBOX_HOST_BENCH_ONLY=scan`: the response scan's rows alone (`SANDBOX_HOST_BENCH_PAIRS`
    // downloads of each kind), for issue 29's budget without the minutes the other rows take.
    if std::env::var("SANDBOX_HOST_BENCH_ONLY").as_deref() == Ok("process") {
        network_process(mib, 5);
        return;
    }
    if std::env::var("SANDBOX_HOST_BENCH_ONLY").as_deref() == Ok("scan") {
        let stack = med(&|| through_stack(total, 64 * 1024));
        scan_rows(mib, stack);
        return;
    }
    // `SANDBOX_HOST_BENCH_ONLY=scan-alone`: the scan of one body after another, without a flow
    // (seconds, for a profiler or an A/B of the scan's code).
    if std::env::var("SANDBOX_HOST_BENCH_ONLY").as_deref() == Ok("scan-alone") {
        scan_alone(total);
        return;
    }
    println!("egress stack, one flow guest -> upstream, {mib} MiB, MTU 1500 (median of 3)");
    let kernel = med(&|| loopback(total));
    let stack = med(&|| through_stack(total, 64 * 1024));
    let stack_256 = med(&|| through_stack(total, 256 * 1024));
    println!("| path | Gbit/s | vs kernel loopback |");
    println!("|---|---|---|");
    println!("| kernel loopback (reference) | {kernel:.2} | 1.00x |");
    println!(
        "| through the stack, 64 KiB socket buffers (production) | {stack:.2} | {:.2}x |",
        stack / kernel
    );
    println!(
        "| through the stack, 256 KiB socket buffers | {stack_256:.2} | {:.2}x |",
        stack_256 / kernel
    );
    println!();
    let n = 300;
    let reference = setup_loopback(n);
    let through = setup_through_stack(n);
    header();
    let (ref_median, _) = stats(&reference);
    row(
        "connect + ClientHello + first byte, kernel loopback",
        &reference,
        None,
    );
    row(
        "connect + ClientHello + first byte, spliced through the stack",
        &through,
        Some(ref_median),
    );
    let (m, p95) = stats(&through);
    let (rm, rp95) = stats(&reference);
    println!(
        "\nadded by the stack: median {:.0} us, p95 {:.0} us\n",
        (m - rm) * 1000.0,
        (p95 - rp95) * 1000.0
    );
    let (spliced, intercepted) = interception(100);
    header();
    let (sm, _) = stats(&spliced);
    row(
        "HTTPS request, first byte, spliced TLS (reference)",
        &spliced,
        None,
    );
    row(
        "HTTPS request, first byte, intercepted TLS",
        &intercepted,
        Some(sm),
    );
    let (im, ip95) = stats(&intercepted);
    let (_, sp95) = stats(&spliced);
    println!(
        "\nadded by interception: median {:.2} ms, p95 {:.2} ms",
        im - sm,
        ip95 - sp95
    );
    println!();
    hostile_connections();
    println!();
    scan_rows(mib, stack);
    println!();
    network_process(mib, 5);
}

/// SSE-like text: what model responses are.
const PLAIN: &[u8] = b"data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello, world. \"}}\n\n";
/// The same events with escaped quotes in their text (code in an answer), each a window of its
/// line for the regex to read.
const QUOTED: &[u8] = b"data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"say(\\\"hi\\\") \"}}\n\n";

/// The response scan's rows: the scan alone against a copy, and its share of an intercepted
/// flow; `stack` is the stack's one-flow Gbit/s the scan's cost is set against.
fn scan_rows(mib: usize, stack: f64) {
    let total = mib << 20;
    let med = |f: &dyn Fn() -> f64| {
        let mut v: Vec<f64> = (0..3).map(|_| f()).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v[1]
    };
    let (plain, quoted) = (PLAIN, QUOTED);
    let copied = med(&|| pass_through(total, false, plain));
    println!("response scanning for secrets, {mib} MiB in 16 KiB chunks, 3 secrets (median of 3)");
    println!("| path | Gbit/s | share of the stack's throughput | the scan's cost per flow |");
    println!("|---|---|---|---|");
    println!(
        "| copied unscanned (reference) | {copied:.2} | {:.1} % | |",
        100.0 * stack / copied
    );
    for (name, body) in [
        ("scanned and masked, model output", plain),
        (
            "scanned and masked, model output with escaped quotes",
            quoted,
        ),
    ] {
        let scanned = med(&|| pass_through(total, true, body));
        println!(
            "| {name} | {scanned:.2} | {:.1} % | {:.1} % |",
            100.0 * stack / scanned,
            100.0 * stack * (1.0 / scanned - 1.0 / copied)
        );
    }
    println!("\n(the cost per flow: at the stack's measured {stack:.2} Gbit/s)");
    println!();
    scan_share(mib);
}

/// The scan alone, each body `SANDBOX_HOST_BENCH_PAIRS` times (default 3), Gbit/s each.
fn scan_alone(total: usize) {
    let n: usize = std::env::var("SANDBOX_HOST_BENCH_PAIRS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    for (name, body) in [("model output", PLAIN), ("with escaped quotes", QUOTED)] {
        let runs: Vec<String> = (0..n)
            .map(|_| format!("{:.1}", pass_through(total, true, body)))
            .collect();
        println!("scan alone, {name}, Gbit/s: {}", runs.join(" "));
    }
}

/// The flow the scan runs in: an intercepted HTTPS response, end to end, with and without
/// secrets to scan for.
fn scan_share(mib: usize) {
    let len = (mib.min(64)) << 20;
    let n: usize = std::env::var("SANDBOX_HOST_BENCH_PAIRS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let (open, scanned, pairs) = intercepted_downloads(len, n);
    println!(
        "model output over intercepted TLS, {} MiB per download (median of {n}, interleaved)",
        len >> 20
    );
    println!(
        "| sandbox | Gbit/s | time added | processor ms per download | processor time added |"
    );
    println!("|---|---|---|---|---|");
    println!(
        "| no secrets, nothing scanned (reference) | {:.2} | | {:.1} | |",
        open.gbit,
        open.cpu * 1e3
    );
    println!(
        "| three secrets, every response scanned | {:.2} | {:.1} % | {:.1} | {:.1} % |",
        scanned.gbit,
        100.0 * (open.gbit / scanned.gbit - 1.0),
        scanned.cpu * 1e3,
        100.0 * (scanned.cpu / open.cpu - 1.0)
    );
    let pct = |v: &[f64], i: usize| 100.0 * (v[i] - 1.0);
    let (lo, mid, hi) = (0, pairs.time.len() / 2, pairs.time.len() - 1);
    println!(
        "\nthe scan's cost pair by pair ({n} pairs): time added median {:.1} % (min {:.1}, max {:.1}); \
         processor time added median {:.1} % (min {:.1}, max {:.1})",
        pct(&pairs.time, mid),
        pct(&pairs.time, lo),
        pct(&pairs.time, hi),
        pct(&pairs.cpu, mid),
        pct(&pairs.cpu, lo),
        pct(&pairs.cpu, hi),
    );
}

/// Streams `total` bytes of a response body (`event` over and over) in 16 KiB chunks
/// (TLS record-sized) as the proxy does, through the echo scan of three provider keys or copied
/// as they are; Gbit/s.
fn pass_through(total: usize, scan: bool, event: &[u8]) -> f64 {
    use sandbox_egress::echo::{EchoForms, EchoScanner};
    let keys = [
        "sk-ant-api03-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJ-0123456789abcdefghij",
        "sk-proj-0123456789abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOP",
        "sk-or-v1-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    ];
    let forms = EchoForms::new(keys).expect("compiles").expect("three keys");
    let chunk: Vec<u8> = event.iter().copied().cycle().take(16 * 1024).collect();
    // As hyper hands the proxy a body's chunks: shared, so giving one up copies nothing.
    let shared = bytes::Bytes::from(chunk.clone());
    let mut scanner = EchoScanner::new(forms);
    let mut out = Vec::with_capacity(chunk.len() + 256);
    let t = Instant::now();
    let mut moved = 0usize;
    while moved < total {
        if scan {
            let (released, n) = scanner.feed_bytes(shared.clone());
            assert_eq!(n, 0);
            std::hint::black_box(&released);
        } else {
            out.clear();
            out.extend_from_slice(&chunk);
        }
        std::hint::black_box(&out);
        moved += chunk.len();
    }
    moved as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e9
}

/// What an endless answer is written from (one buffer for every connection: the server's own
/// memory stays out of the figure).
static FLOOD: [u8; 64 * 1024] = [b'x'; 64 * 1024];

/// A loopback server that answers every connection, once it has said something, with an HTTP
/// head and bytes without end, as fast as the connection takes them.
fn flood_server(rt: &tokio::runtime::Runtime) -> u16 {
    loopback_server(rt, |mut s| async move {
        let mut buf = [0u8; 512];
        if !matches!(s.read(&mut buf).await, Ok(n) if n > 0) {
            return;
        }
        let head = b"HTTP/1.1 200 OK\r\ncontent-length: 100000000000\r\n\r\n";
        if s.write_all(head).await.is_err() {
            return;
        }
        while s.write_all(&FLOOD).await.is_ok() {}
    })
}

/// This process's resident memory, KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// `n` guest connections that each get an endless answer and never read it: spliced (a
/// ClientHello) or served as HTTP (a GET). The resident memory they add once every buffer on the
/// way is full (KiB), what the egress memory holds for them, how many were admitted and how many
/// refused as `memory_limit`.
fn hostile(n: usize, http: bool) -> (u64, usize, u64, u64) {
    use sandbox_egress::refusal::Reason;
    use sandbox_egress::stats::Stats;
    let rt = runtime();
    let port = flood_server(&rt);
    let (egress, mut g, addr) = start(&rt, port, 64 * 1024);
    let first = if http {
        format!("GET / HTTP/1.1\r\nHost: sink.test:{port}\r\n\r\n").into_bytes()
    } else {
        head(port)
    };
    // Settle the allocator and the runtime before the figure's start.
    g.run_until(Duration::from_millis(300), |_| false);
    let before = rss_kib();
    let mut handles = Vec::new();
    let st = egress.stats();
    let decided = || Stats::get(&st.spliced) + Stats::get(&st.http);
    // In waves of 16, each decided before the next (the stack lets 32 be undecided at once).
    while handles.len() < n {
        for _ in 0..16.min(n - handles.len()) {
            // A guest receive buffer of 4 KiB that is never read: the window closes at once.
            let h = g.connect(addr, port, 4 * 1024);
            handles.push((h, false));
        }
        let want = handles.len() as u64;
        g.run_until(Duration::from_secs(10), |g| {
            for (h, sent) in &mut handles {
                let s = g.tcp(*h);
                if !*sent && s.may_send() {
                    *sent = s.send_slice(&first).is_ok();
                }
            }
            decided() + st.refusals().total() >= want
        });
    }
    // Until every buffer on the way has filled: nothing more reaches the guest for a while.
    let mut last = (0u64, Instant::now());
    g.run_until(Duration::from_secs(30), |g| {
        for (h, sent) in &mut handles {
            let s = g.tcp(*h);
            if !*sent && s.may_send() {
                *sent = s.send_slice(&first).is_ok();
            }
        }
        let to_guest = Stats::get(&st.to_guest);
        if to_guest != last.0 {
            last = (to_guest, Instant::now());
        }
        handles.iter().all(|(_, sent)| *sent) && last.1.elapsed() > Duration::from_secs(2)
    });
    let after = rss_kib();
    let held = egress.memory().0;
    let admitted = Stats::get(&st.connections);
    let refused = st.refusals().count(Reason::MemoryLimit);
    drop(egress);
    (after.saturating_sub(before), held, admitted, refused)
}

/// The figures of [`hostile`], spliced and as HTTP, with the default egress memory.
fn hostile_connections() {
    let n = 128;
    let limit = Limits::default().memory;
    println!(
        "{n} hostile connections (an endless answer, never read), egress memory limit {} MiB (default)",
        limit >> 20
    );
    println!(
        "| connections | admitted | refused (memory_limit) | resident memory added | counted by the egress memory | per admitted connection |"
    );
    println!("|---|---|---|---|---|---|");
    for (label, http) in [
        ("spliced TLS", false),
        ("plain HTTP, served by the proxy", true),
    ] {
        let (rss, held, admitted, refused) = hostile(n, http);
        println!(
            "| {label} | {admitted} | {refused} | {:.1} MiB | {:.1} MiB | {:.0} KiB resident, {:.0} KiB counted |",
            rss as f64 / 1024.0,
            held as f64 / 1048576.0,
            rss as f64 / admitted.max(1) as f64,
            held as f64 / 1024.0 / admitted.max(1) as f64,
        );
    }
}
