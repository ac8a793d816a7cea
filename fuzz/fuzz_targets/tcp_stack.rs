//! One sandbox's whole network stack (gate, smoltcp, connection tasks, a real loopback upstream)
//! driven by a hostile guest that speaks raw TCP: DNS first, then segments whose flags, sequence
//! and acknowledgement numbers (relative to what the stack sent, so they land in and around its
//! window), windows, options and payloads come from the input, interleaved with raw frames and
//! waits. The stack runs on its own tokio runtime as in the service; a panic in any of its tasks
//! aborts the process (libFuzzer's panic hook).
//!
//! Invariants: every frame toward the guest is from the gateway to the guest, no bigger than the
//! MTU, from the gateway's address or a pool address; TCP other than a reset comes only from the
//! address DNS handed out for the allowed name; the upstream is never connected to unless DNS
//! answered for its name and the guest then opened a connection to that address; and the stack
//! holds no more connections open than its limit. Nothing leaves the machine: every allowed name
//! resolves through an override to loopback.
#![no_main]

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use sandbox_egress::link::{GuestEnd, MAX_FRAME};
use sandbox_egress::net::{GATEWAY_IP, GATEWAY_MAC, GUEST_IP, MTU, pool_addr, pool_index};
use sandbox_egress::policy::Allowlist;
use sandbox_egress::resolve::ResolveOverrides;
use sandbox_egress::stack::Limits;
use sandbox_egress::{Egress, EgressConfig};
use sandbox_fuzz::{Input, frame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;

const GUEST_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x09];
/// The allowed name, pointed at the loopback upstream by a resolution override.
const NAME: &str = "echo.test";
/// An allowed name whose upstream refuses every connection.
const OTHER: &str = "other.test";
/// Connection slots the input addresses (source ports 50000 + slot).
const SLOTS: usize = 4;
/// The stack's bound on open connections in this target.
const OPEN: usize = 6;

/// A loopback port with no listener (bound once, then closed).
fn closed_port() -> u16 {
    static PORT: OnceLock<u16> = OnceLock::new();
    *PORT.get_or_init(|| {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    })
}

fn runtime() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    })
}

/// A loopback upstream that echoes every byte, counting connections accepted.
struct Upstream {
    port: u16,
    accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    fn start(rt: &Runtime) -> Self {
        let l = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = l.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let a = accepted.clone();
        let task = rt.spawn(async move {
            // Dropped with the accept loop when the input ends, which aborts every connection.
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((mut s, _)) = l.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                conns.spawn(async move {
                    let mut b = vec![0u8; 16 * 1024];
                    while let Ok(n @ 1..) = s.read(&mut b).await {
                        if s.write_all(&b[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        Upstream {
            port,
            accepted,
            task,
        }
    }
}

/// Wakes the guest's side when the stack sends a frame.
#[derive(Default)]
struct Signal(Mutex<bool>, Condvar);

/// One TCP connection slot as the guest sees it.
#[derive(Clone, Copy, Default)]
struct Slot {
    /// The guest's next sequence number.
    snd_nxt: u32,
    /// The stack's next sequence number, once its SYN-ACK came.
    rcv_nxt: Option<u32>,
}

struct Guest {
    link: GuestEnd,
    signal: Arc<Signal>,
    slots: [Slot; SLOTS],
    /// The address DNS handed out for NAME, once it did.
    echo_addr: Option<Ipv4Addr>,
    /// Whether the guest sent any DNS query yet (the gate reads names in ways a byte compare
    /// here would not: case, trailing bytes).
    asked: bool,
    /// Where the guest sent SYNs after it asked (the answer may still be on its way).
    syns: Vec<(Ipv4Addr, u16)>,
    port: u16,
}

impl Guest {
    fn send(&self, f: &[u8]) {
        let _ = self.link.send(f);
    }

    fn ipv4(&self, dst: Ipv4Addr, proto: u8, l4: Vec<u8>, csum_at: Option<usize>) -> Vec<u8> {
        frame::ipv4((GUEST_MAC, GUEST_IP), (GATEWAY_MAC, dst), proto, l4, csum_at)
    }

    /// Takes the stack's frames, checking each, until it has been quiet for a moment after
    /// answering, or `max` passed.
    fn pump(&mut self, max: Duration) {
        let end = Instant::now() + max;
        let mut buf = vec![0u8; MAX_FRAME];
        let mut answered = false;
        loop {
            while let Some(n) = self.link.recv(&mut buf) {
                self.check(&buf[..n]);
                answered = true;
            }
            let mut left = end.saturating_duration_since(Instant::now());
            if answered {
                left = left.min(Duration::from_micros(300));
            }
            if left.is_zero() {
                return;
            }
            let mut ready = self.signal.0.lock().unwrap();
            if !*ready {
                let (r, t) = self.signal.1.wait_timeout(ready, left).unwrap();
                ready = r;
                if t.timed_out() && answered {
                    return;
                }
            }
            *ready = false;
        }
    }

    fn check(&mut self, f: &[u8]) {
        assert!(f.len() <= 14 + MTU, "a frame of {} bytes", f.len());
        assert!(f.len() >= 14, "a runt frame of {} bytes", f.len());
        assert_eq!(f[..6], GUEST_MAC, "a frame to someone else");
        assert_eq!(f[6..12], GATEWAY_MAC, "a frame not from the gateway");
        if f[12..14] != [0x08, 0x00] {
            assert_eq!(f[12..14], [0x08, 0x06], "neither IPv4 nor ARP");
            return;
        }
        let ip = &f[14..];
        assert!(ip.len() >= 20);
        let hl = usize::from(ip[0] & 0xf) * 4;
        let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
        let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
        assert_eq!(dst, GUEST_IP, "a packet to {dst}");
        assert!(
            src == GATEWAY_IP || pool_index(src).is_some(),
            "a packet from {src}, neither the gateway nor a pool address"
        );
        let l4 = &ip[hl..];
        match ip[9] {
            17 if l4.len() >= 8 + 12 && l4[..2] == [0, 53] => {
                // A DNS answer with a record for NAME (as the gate reads names: any case): its
                // last four bytes are the address handed out.
                let dns = &l4[8..];
                let ancount = u16::from_be_bytes([dns[6], dns[7]]);
                if ancount > 0 && question(dns).as_deref() == Some(NAME) && dns.len() >= 16 {
                    let n = dns.len();
                    let a = Ipv4Addr::new(dns[n - 4], dns[n - 3], dns[n - 2], dns[n - 1]);
                    assert!(pool_index(a).is_some(), "DNS answered {a}, not a pool address");
                    self.echo_addr = Some(a);
                }
            }
            6 if l4.len() >= 20 => {
                let flags = l4[13];
                let rst = flags & 0x04 != 0;
                assert!(
                    rst || Some(src) == self.echo_addr,
                    "TCP (flags {flags:#x}) from {src}, which DNS never handed out"
                );
                let dport = u16::from_be_bytes([l4[2], l4[3]]);
                let Some(k) = dport.checked_sub(50000).map(usize::from) else {
                    return;
                };
                if k >= SLOTS || rst {
                    return;
                }
                let seq = u32::from_be_bytes([l4[4], l4[5], l4[6], l4[7]]);
                let doff = usize::from(l4[12] >> 4) * 4;
                let len = l4.len().saturating_sub(doff) as u32
                    + u32::from(flags & 0x01 != 0)
                    + u32::from(flags & 0x02 != 0);
                let slot = &mut self.slots[k];
                let next = seq.wrapping_add(len);
                // Keep the furthest point the stack reached (a retransmission moves nothing).
                match slot.rcv_nxt {
                    Some(r) if (next.wrapping_sub(r) as i32) <= 0 => {}
                    _ => slot.rcv_nxt = Some(next),
                }
            }
            _ => {}
        }
    }
}

/// A real client's ClientHello for NAME (made once: building a TLS client is slow).
fn hello() -> &'static [u8] {
    static HELLO: OnceLock<Vec<u8>> = OnceLock::new();
    HELLO.get_or_init(|| sandbox_egress::sim::client_hello(NAME))
}

/// The question's name of a DNS message, lower-cased, dot-separated.
fn question(dns: &[u8]) -> Option<String> {
    let mut at = 12;
    let mut labels = vec![];
    loop {
        let len = usize::from(*dns.get(at)?);
        if len == 0 {
            return Some(labels.join("."));
        }
        let label = dns.get(at + 1..at + 1 + len)?;
        labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
        at += 1 + len;
    }
}

/// TCP options the input picks from (each a valid encoding, so it reaches the parser behind).
fn options(pick: u8) -> Vec<u8> {
    let mut o = vec![];
    if pick & 1 != 0 {
        o.extend_from_slice(&[2, 4, 0x05, 0xb4]); // MSS 1460
    }
    if pick & 2 != 0 {
        o.extend_from_slice(&[3, 3, pick >> 4]); // window scale, 0-15 (over 14 is invalid)
    }
    if pick & 4 != 0 {
        o.extend_from_slice(&[4, 2]); // SACK permitted
    }
    if pick & 8 != 0 {
        o.extend_from_slice(&[8, 10, 0, 0, 0, 1, 0, 0, 0, 0]); // timestamps
    }
    while o.len() % 4 != 0 {
        o.push(1);
    }
    o
}

fuzz_target!(|data: &[u8]| {
    let rt = runtime();
    let up = Upstream::start(rt);
    // Every allowed name resolves through an override, so nothing leaves this machine: NAME to
    // the upstream, OTHER to a loopback port nobody listens on (its connections are refused).
    let closed = closed_port();
    let mut cfg = EgressConfig::new(
        GUEST_MAC,
        Allowlist::parse([format!("{NAME}:{}", up.port), format!("{OTHER}:{closed}")].iter().map(String::as_str))
            .unwrap(),
    );
    cfg.overrides = Arc::new(
        ResolveOverrides::parse(&format!(
            "{NAME}:{}:127.0.0.1,{OTHER}:{closed}:127.0.0.1",
            up.port
        ))
        .unwrap(),
    );
    cfg.limits = Limits {
        open: OPEN,
        half_open: 3,
        socket_buffer: 8 * 1024,
        sniff_timeout: Duration::from_millis(200),
        idle_timeout: Duration::from_secs(2),
        linger: Duration::from_millis(200),
        header_timeout: Duration::from_secs(2),
        body_idle_timeout: Duration::from_secs(2),
        // One stack serves every input: pacing its upstream connections would slow the run,
        // not find more.
        connect_rate: 100_000,
        connect_burst: 100_000,
        // Room for every connection the input may open: the budget's refusals are the stack
        // tests' subject, the stack's parsing this target's.
        memory: sandbox_egress::memory::DEFAULT_MEMORY,
    };
    let (egress, link) = {
        let _in = rt.enter();
        Egress::start(cfg)
    };
    let signal = Arc::new(Signal::default());
    let s = signal.clone();
    link.set_waker(move || {
        *s.0.lock().unwrap() = true;
        s.1.notify_all();
    });
    let mut g = Guest {
        link,
        signal,
        slots: [Slot::default(); SLOTS],
        echo_addr: None,
        asked: false,
        syns: vec![],
        port: up.port,
    };
    for (k, s) in g.slots.iter_mut().enumerate() {
        s.snd_nxt = 0x1000_0000 * (k as u32 + 1);
    }

    let mut input = Input(data);
    let mut steps = 0;
    // What one input may spend waiting for the stack, so that an input is a few milliseconds.
    let mut waits_ms = 40;
    while let Some(op) = input.byte() {
        steps += 1;
        if steps > 256 {
            break;
        }
        match op % 5 {
            0 => {
                // DNS: the allowed name, another, or any name.
                let pick = input.byte().unwrap_or(0);
                let qname = match pick % 4 {
                    0 | 1 => frame::qname(NAME),
                    2 => frame::qname(OTHER),
                    _ => {
                        let n = usize::from(input.byte().unwrap_or(0));
                        input.bytes(n).to_vec()
                    }
                };
                g.asked = true;
                let q = frame::dns_query(u16::from(pick), &qname, 1);
                let f = g.ipv4(GATEWAY_IP, 17, frame::udp(0xc001, 53, &q), Some(6));
                g.send(&f);
            }
            1 | 2 => {
                // A segment on a slot's connection.
                let k = usize::from(input.byte().unwrap_or(0)) % SLOTS;
                let flags = input.byte().unwrap_or(0x10);
                let seq_off = i32::from(input.u16_be().unwrap_or(0) as i16);
                let ack_off = i32::from(input.u16_be().unwrap_or(0) as i16);
                let window = input.u16_be().unwrap_or(0xffff);
                let opts = options(input.byte().unwrap_or(0));
                let kind = input.byte().unwrap_or(0);
                let payload: Vec<u8> = match kind % 4 {
                    0 => vec![],
                    1 => format!("GET / HTTP/1.1\r\nHost: {NAME}:{}\r\n\r\n", g.port).into_bytes(),
                    2 => hello().to_vec(),
                    _ => {
                        let n = usize::from(input.u16_be().unwrap_or(0)) % 1400;
                        input.bytes(n).to_vec()
                    }
                };
                let to = input.byte().unwrap_or(0);
                let dst = match to % 4 {
                    0 | 1 => g.echo_addr.unwrap_or(pool_addr(0).unwrap()),
                    2 => pool_addr(u32::from(to >> 2)).unwrap(),
                    _ => GATEWAY_IP,
                };
                let dport = if to & 0x80 == 0 {
                    g.port
                } else {
                    input.u16_be().unwrap_or(80)
                };
                let slot = g.slots[k];
                let seq = slot.snd_nxt.wrapping_add(seq_off as u32);
                let ack = slot.rcv_nxt.unwrap_or(0).wrapping_add(ack_off as u32);
                let mut tcp = (50000 + k as u16).to_be_bytes().to_vec();
                tcp.extend_from_slice(&dport.to_be_bytes());
                tcp.extend_from_slice(&seq.to_be_bytes());
                tcp.extend_from_slice(&ack.to_be_bytes());
                tcp.push(((20 + opts.len()) / 4 << 4) as u8);
                tcp.push(flags);
                tcp.extend_from_slice(&window.to_be_bytes());
                tcp.extend_from_slice(&[0, 0, 0, 0]);
                tcp.extend_from_slice(&opts);
                tcp.extend_from_slice(&payload);
                let f = g.ipv4(dst, 6, tcp, Some(16));
                if flags & 0x02 != 0 && g.asked {
                    g.syns.push((dst, dport));
                }
                // In order: the guest's own sequence moves on by what it sent.
                if seq_off == 0 {
                    let used = payload.len() as u32
                        + u32::from(flags & 0x01 != 0)
                        + u32::from(flags & 0x02 != 0);
                    g.slots[k].snd_nxt = seq.wrapping_add(used);
                }
                if flags & 0x04 != 0 {
                    g.slots[k].rcv_nxt = None;
                }
                g.send(&f);
            }
            3 => {
                // Any frame at all.
                let n = usize::from(input.u16_be().unwrap_or(0)) % 1600;
                let f = input.bytes(n).to_vec();
                g.send(&f);
            }
            _ => {
                // A wait, within the input's total of waiting.
                let ms = u64::from(input.byte().unwrap_or(0) % 16).min(waits_ms);
                waits_ms -= ms;
                g.pump(Duration::from_millis(ms));
            }
        }
        g.pump(Duration::ZERO);
        let open = egress.stats().open.load(Ordering::SeqCst);
        assert!(
            open <= OPEN as u64,
            "{open} connections open, over the stack's limit of {OPEN}"
        );
    }
    g.pump(Duration::from_millis(2));
    let accepted = up.accepted.load(Ordering::SeqCst);
    let syns = g
        .syns
        .iter()
        .filter(|&&(dst, port)| Some(dst) == g.echo_addr && port == g.port)
        .count();
    // (Not one upstream connection per SYN: the HTTP proxy connects again for a request after
    // the upstream closed.)
    assert!(
        accepted == 0 || syns > 0,
        "the upstream accepted {accepted} connections, but the guest never opened one to the \
         address DNS gave its name"
    );
    drop(egress);
    up.task.abort();
});
