//! One sandbox's network stack: the gate in front, smoltcp's TCP behind it, and a task per
//! connection. It runs as one tokio task that owns every socket; connection tasks exchange bytes
//! with it through bounded channels, so a guest's memory on the host is bounded by
//! [`Limits`], whatever it sends.

use std::collections::HashMap;
use std::net::SocketAddrV4;
use std::sync::Arc;
use std::time::{Duration, Instant};

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::socket::tcp;
use smoltcp::wire::{
    ArpOperation, ArpPacket, ArpRepr, EthernetAddress, EthernetFrame, EthernetProtocol,
    EthernetRepr, HardwareAddress, IpAddress, IpCidr, IpListenEndpoint, Ipv4Packet, TcpPacket,
};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;

use crate::conn::{self, Ctl, Io};
use crate::context::Context;
use crate::gate::{Gate, Verdict};
use crate::link::{self, GuestEnd, StackEnd};
use crate::memory::{CHUNK, CHUNKS};
use crate::net::{GATEWAY_IP, GATEWAY_MAC, GUEST_IP, PREFIX_LEN};
use crate::policy::{Allowlist, HostPattern};
use crate::refusal::Reason;
use crate::resolve::ResolveOverrides;
use crate::stats::Stats;
use crate::upstream::{Dial, Direct, SystemResolver};

use crate::phy::Device;

/// The bounds of one sandbox's stack.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections open at once.
    pub open: usize,
    /// Connections not yet decided (upstream connecting, or first bytes not read).
    pub half_open: usize,
    /// Receive and send buffer of each guest TCP socket, each.
    pub socket_buffer: usize,
    /// How long a connection may stay silent before its first bytes decide it.
    pub sniff_timeout: Duration,
    /// How long a connection may carry nothing either way.
    pub idle_timeout: Duration,
    /// How long a connection may take to close after its upstream side ended (a guest that
    /// never closes its side is reset then).
    pub linger: Duration,
    /// How long a proxied or intercepted HTTP/1 connection may take to send a request's head
    /// (no slowloris: a guest cannot hold a connection, and its upstream's, by a byte at a time).
    pub header_timeout: Duration,
    /// How long a request body from the guest may send nothing before it is cut (and its
    /// upstream request with it).
    pub body_idle_timeout: Duration,
    /// New upstream connections a second (no flood of handshakes from one guest).
    pub connect_rate: u32,
    /// How many new upstream connections may be saved up for a burst.
    pub connect_burst: u32,
    /// The bytes the sandbox's egress may hold on the host, every buffer of every connection and
    /// every body the meter holds together ([`crate::memory`]).
    pub memory: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            open: 128,
            half_open: 32,
            socket_buffer: 64 * 1024,
            sniff_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(600),
            linger: Duration::from_secs(30),
            header_timeout: Duration::from_secs(30),
            body_idle_timeout: Duration::from_secs(60),
            // npm, pip and git open a few dozen connections at most, mostly at once; a flood of
            // new ones (every one a TCP and often a TLS handshake with the upstream) is paced.
            connect_rate: 20,
            connect_burst: 64,
            memory: crate::memory::DEFAULT_MEMORY,
        }
    }
}

/// What a sandbox's egress is started with.
pub struct EgressConfig {
    /// The guest's MAC address (frames from any other are dropped).
    pub guest_mac: [u8; 6],
    /// Names the guest may reach.
    pub allow: Allowlist,
    /// Names whose TLS is terminated (secret and meter hosts).
    pub intercept: Vec<HostPattern>,
    /// The operator's resolution overrides (`SANDBOX_HOST_EGRESS_RESOLVE`).
    pub overrides: Arc<ResolveOverrides>,
    /// Who makes the upstream connections (`None`: this process, with `overrides` and the
    /// system's resolver; a network process without a network of its own asks the service).
    pub dial: Option<Arc<dyn Dial>>,
    /// Bounds.
    pub limits: Limits,
    /// TLS interception of the secret and meter hosts (the names in `intercept`).
    pub interception: Option<Arc<crate::intercept::Interception>>,
}

impl EgressConfig {
    /// A configuration with the system resolver, no overrides and default limits.
    pub fn new(guest_mac: [u8; 6], allow: Allowlist) -> Self {
        EgressConfig {
            guest_mac,
            allow,
            intercept: Vec::new(),
            overrides: Arc::default(),
            dial: None,
            limits: Limits::default(),
            interception: None,
        }
    }
}

/// A running stack; dropping it stops the stack and every connection.
pub struct Egress {
    stats: Arc<Stats>,
    memory: Arc<crate::memory::Budget>,
    task: JoinHandle<()>,
    link: StackEnd,
}

impl Egress {
    /// Starts the stack on the current tokio runtime; the returned end goes to the VM's network
    /// device.
    pub fn start(config: EgressConfig) -> (Egress, GuestEnd) {
        let (guest, stack_end) = link::link();
        let stats = Arc::new(Stats::default());
        let memory = crate::memory::Budget::new(config.limits.memory);
        let stack = Stack::new(config, stack_end.clone(), stats.clone(), memory.clone());
        let task = tokio::spawn(stack.run());
        (
            Egress {
                stats,
                memory,
                task,
                link: stack_end,
            },
            guest,
        )
    }

    /// The sandbox's counters and refusals.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The bytes of the sandbox's egress memory held now, and its size ([`crate::memory`]).
    pub fn memory(&self) -> (usize, usize) {
        (self.memory.used(), self.memory.max())
    }

    /// Frames dropped on the link: from the guest, and toward it.
    pub fn frames_dropped(&self) -> (u64, u64) {
        self.link.dropped()
    }
}

impl Drop for Egress {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The stack's side of one connection.
struct Conn {
    key: (u16, SocketAddrV4),
    to_task: Option<mpsc::Sender<Vec<u8>>>,
    from_task: mpsc::Receiver<Vec<u8>>,
    task_done: bool,
    /// When the task ended: a guest that never finishes closing is cut off after
    /// [`Limits::linger`].
    task_done_at: Option<Instant>,
    /// Bytes from the task that did not fit the socket yet.
    pending: Vec<u8>,
    ctl: Arc<Ctl>,
    accepted: bool,
    aborted: bool,
    /// Rounds served since the abort: the socket stays one interface poll longer, which sends
    /// its reset (smoltcp sends it from the closed state).
    rounds_since_abort: u8,
    task: JoinHandle<()>,
    born: Instant,
    /// The socket's share of the sandbox's egress memory, given back when the socket is gone.
    _memory: crate::memory::Hold,
}

impl Conn {
    /// What the connection's task asked for: a reset, or the handshake's answer. True if it
    /// changed the socket.
    fn apply_ctl(&mut self, socket: &mut tcp::Socket) -> bool {
        match self.ctl.get() {
            Ctl::ABORT if !self.aborted => {
                self.aborted = true;
                socket.abort();
                true
            }
            Ctl::ACCEPT | Ctl::RUNNING if !self.accepted => {
                self.accepted = true;
                socket.pause_synack(false);
                true
            }
            _ => false,
        }
    }

    /// The guest's bytes to the task, as far as its channel has room; EOF once the guest
    /// closed its side and everything it sent is passed on. True if anything moved.
    fn guest_to_task(&mut self, socket: &mut tcp::Socket) -> bool {
        let mut moved = false;
        while socket.can_recv() {
            let Some(tx) = &self.to_task else { break };
            let Ok(permit) = tx.try_reserve() else { break };
            let chunk = socket.recv(|b| {
                let n = b.len().min(CHUNK);
                (n, b[..n].to_vec())
            });
            match chunk {
                Ok(chunk) if !chunk.is_empty() => {
                    tracing::trace!(len = chunk.len(), "egress: guest -> task");
                    permit.send(chunk);
                    moved = true;
                }
                _ => break,
            }
        }
        let guest_done = matches!(
            socket.state(),
            tcp::State::CloseWait
                | tcp::State::LastAck
                | tcp::State::Closing
                | tcp::State::TimeWait
                | tcp::State::Closed
        );
        if self.to_task.is_some() && guest_done && !socket.can_recv() {
            self.to_task = None; // the guest closed its side: EOF to the task
            moved = true;
        }
        moved
    }

    /// The task's bytes to the guest, as far as the socket's buffer has room; a FIN after
    /// them once the task is done. True if anything moved.
    fn task_to_guest(&mut self, socket: &mut tcp::Socket) -> bool {
        let mut moved = false;
        loop {
            if !self.pending.is_empty() {
                if !socket.can_send() {
                    break;
                }
                match socket.send_slice(&self.pending) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        self.pending.drain(..n);
                        moved = true;
                    }
                }
                if !self.pending.is_empty() {
                    break;
                }
            }
            match self.from_task.try_recv() {
                Ok(chunk) => {
                    self.pending = chunk;
                    moved = true;
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    if !self.task_done {
                        self.task_done = true;
                        self.task_done_at = Some(Instant::now());
                        if !self.aborted && socket.may_send() {
                            socket.close(); // FIN after what is queued
                        }
                        moved = true;
                    }
                    break;
                }
            }
        }
        moved
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Stack {
    gate: Gate,
    iface: Interface,
    device: Device<StackEnd>,
    sockets: SocketSet<'static>,
    conns: HashMap<SocketHandle, Conn>,
    by_key: HashMap<(u16, SocketAddrV4), SocketHandle>,
    link: StackEnd,
    wake: Arc<Notify>,
    cx: Arc<Context>,
    limits: Limits,
    guest_mac: EthernetAddress,
    epoch: Instant,
    arp_refreshed: Option<Instant>,
}

/// Frames taken from the link per round before the interface polls (fairness with timers).
const FRAMES_PER_ROUND: usize = 64;
/// How often the guest's hardware address is re-taught to the interface, below smoltcp's
/// neighbour lifetime (60 s), so replies never wait for an ARP round trip.
const ARP_REFRESH: Duration = Duration::from_secs(20);
/// How long a listening socket may wait for the SYN it was made for.
const LISTEN_REAP: Duration = Duration::from_secs(5);

impl Stack {
    fn new(
        config: EgressConfig,
        link: StackEnd,
        stats: Arc<Stats>,
        memory: Arc<crate::memory::Budget>,
    ) -> Self {
        let mut device = Device::new(link.clone());
        let mut ic = Config::new(HardwareAddress::Ethernet(EthernetAddress(GATEWAY_MAC)));
        ic.random_seed = random_seed();
        let epoch = Instant::now();
        let mut iface = Interface::new(ic, &mut device, smoltcp::time::Instant::ZERO);
        iface.update_ip_addrs(|a| {
            let _ = a.push(IpCidr::new(IpAddress::Ipv4(GATEWAY_IP), PREFIX_LEN));
        });
        // Every pool address is ours; the gate in front decides which frames get here.
        iface.set_any_ip(true);
        // A port the operator routes for an allowed name (SANDBOX_HOST_EGRESS_RESOLVE, for tests
        // and private upstreams) is allowed for it too.
        let allow = config.allow.with_routed_ports(config.overrides.routes());
        let gate = Gate::with_refusals(config.guest_mac, allow, stats.refusal_log());
        let cx = Arc::new(Context {
            dial: config.dial.unwrap_or_else(|| {
                Arc::new(Direct {
                    overrides: config.overrides.clone(),
                    resolver: Arc::new(SystemResolver),
                })
            }),
            intercept: config.intercept,
            stats,
            sniff_timeout: config.limits.sniff_timeout,
            idle_timeout: config.limits.idle_timeout,
            header_timeout: config.limits.header_timeout,
            body_idle_timeout: config.limits.body_idle_timeout,
            connects: crate::pace::Bucket::new(
                config.limits.connect_rate,
                config.limits.connect_burst,
            ),
            log: crate::pace::LogLimit::default(),
            interception: config.interception,
            upstream: Arc::new(tokio::sync::Semaphore::new(
                crate::intercept::SANDBOX_UPSTREAM_CONNECTIONS,
            )),
            memory,
        });
        Stack {
            gate,
            iface,
            device,
            sockets: SocketSet::new(Vec::new()),
            conns: HashMap::new(),
            by_key: HashMap::new(),
            link,
            wake: Arc::new(Notify::new()),
            cx,
            limits: config.limits,
            guest_mac: EthernetAddress(config.guest_mac),
            epoch,
            arp_refreshed: None,
        }
    }

    fn now(&self) -> smoltcp::time::Instant {
        let us = self.epoch.elapsed().as_micros();
        smoltcp::time::Instant::from_micros(i64::try_from(us).unwrap_or(i64::MAX))
    }

    async fn run(mut self) {
        loop {
            let now = Instant::now();
            if self
                .arp_refreshed
                .is_none_or(|t| now.duration_since(t) >= ARP_REFRESH)
            {
                self.arp_refreshed = Some(now);
                self.device.rx.push_back(self.guest_arp_reply());
            }
            let mut n = 0;
            while n < FRAMES_PER_ROUND {
                let Some(frame) = self.link.try_recv() else {
                    break;
                };
                n += 1;
                self.frame(frame, now);
            }
            self.pump();
            let delay = self
                .iface
                .poll_delay(self.now(), &self.sockets)
                .map(|d| Duration::from_micros(d.total_micros()))
                .unwrap_or(ARP_REFRESH)
                .min(ARP_REFRESH)
                .min(self.next_linger_end());
            if n == FRAMES_PER_ROUND || delay.is_zero() {
                tokio::task::yield_now().await;
                continue;
            }
            tokio::select! {
                frame = self.link.recv() => self.frame(frame, Instant::now()),
                () = self.wake.notified() => {}
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// Time until the first lingering connection is due to be reset.
    fn next_linger_end(&self) -> Duration {
        self.conns
            .values()
            .filter(|c| !c.aborted)
            .filter_map(|c| c.task_done_at)
            .map(|t| (self.limits.linger + Duration::from_millis(1)).saturating_sub(t.elapsed()))
            .min()
            .unwrap_or(ARP_REFRESH)
    }

    /// One frame from the guest.
    fn frame(&mut self, frame: Vec<u8>, now: Instant) {
        match self.gate.inspect(&frame, now) {
            Verdict::Drop => {}
            Verdict::Reply(answer) => {
                self.link.send(&answer);
            }
            Verdict::ArpReply => self.device.rx.push_back(frame),
            Verdict::Tcp { name, dst } => {
                self.admit(&frame, name, dst);
                self.device.rx.push_back(frame);
            }
        }
    }

    /// A TCP segment to a name the guest resolved: a new SYN gets a listening socket (paused,
    /// so the SYN-ACK waits for the upstream connection) and a connection task.
    fn admit(&mut self, frame: &[u8], name: String, dst: SocketAddrV4) {
        let Some((src_port, syn)) = syn_of(frame) else {
            return;
        };
        if !syn || self.by_key.contains_key(&(src_port, dst)) {
            return; // a segment of a known connection, or smoltcp's to reset
        }
        let half_open = self
            .conns
            .values()
            .filter(|c| c.ctl.get() < Ctl::RUNNING)
            .count();
        if self.conns.len() >= self.limits.open || half_open >= self.limits.half_open {
            // No listener: smoltcp answers the SYN with a reset.
            self.cx
                .stats
                .refuse(Reason::ConnectionLimit, &format!("{name}:{}", dst.port()));
            return;
        }
        let buf = self.limits.socket_buffer;
        // The connection's worst case, before anything of it exists: its socket here, its task's
        // buffers there (grown by the task if it becomes HTTP).
        let memory = crate::memory::Hold::take(&self.cx.memory, crate::memory::socket_cost(buf));
        let task_memory = memory
            .as_ref()
            .and_then(|_| crate::memory::Hold::take(&self.cx.memory, crate::memory::TASK_COST));
        let (Some(memory), Some(task_memory)) = (memory, task_memory) else {
            self.cx
                .stats
                .refuse(Reason::MemoryLimit, &format!("{name}:{}", dst.port()));
            return;
        };
        let mut socket = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; buf]),
            tcp::SocketBuffer::new(vec![0; buf]),
        );
        socket.set_nagle_enabled(false);
        socket.set_ack_delay(None);
        socket.pause_synack(true);
        let endpoint = IpListenEndpoint {
            addr: Some(IpAddress::Ipv4(*dst.ip())),
            port: dst.port(),
        };
        if socket.listen(endpoint).is_err() {
            return;
        }
        let handle = self.sockets.add(socket);
        let (to_task, from_guest) = mpsc::channel(CHUNKS);
        let (to_guest, from_task) = mpsc::channel(CHUNKS);
        let ctl = Arc::new(Ctl::default());
        let io = Io {
            from_guest,
            to_guest,
            ctl: ctl.clone(),
            wake: self.wake.clone(),
        };
        tracing::debug!(%name, %dst, src_port, "egress: new connection");
        let cx = self.cx.clone();
        let wake = self.wake.clone();
        let task = tokio::spawn(async move {
            conn::run(io, name, dst.port(), cx, task_memory).await;
            wake.notify_one(); // its channels closed: the loop finishes the socket
        });
        Stats::add(&self.cx.stats.connections, 1);
        Stats::add(&self.cx.stats.open, 1);
        self.by_key.insert((src_port, dst), handle);
        self.conns.insert(
            handle,
            Conn {
                key: (src_port, dst),
                to_task: Some(to_task),
                from_task,
                task_done: false,
                task_done_at: None,
                pending: Vec::new(),
                ctl,
                accepted: false,
                aborted: false,
                rounds_since_abort: 0,
                task,
                born: Instant::now(),
                _memory: memory,
            },
        );
    }

    /// Polls the interface and moves bytes between sockets and tasks until nothing moves.
    fn pump(&mut self) {
        for _ in 0..16 {
            let now = self.now();
            let polled = self.iface.poll(now, &mut self.device, &mut self.sockets);
            let moved = self.service();
            if polled == smoltcp::iface::PollResult::None && !moved && self.device.rx.is_empty() {
                break;
            }
        }
    }

    /// Moves bytes for every connection; true if anything changed.
    fn service(&mut self) -> bool {
        let mut moved = false;
        let mut gone = Vec::new();
        let linger = self.limits.linger;
        for (handle, c) in &mut self.conns {
            let socket = self.sockets.get_mut::<tcp::Socket>(*handle);
            moved |= c.apply_ctl(socket);
            moved |= c.guest_to_task(socket);
            moved |= c.task_to_guest(socket);
            let state = socket.state();
            tracing::trace!(
                ?state,
                ctl = c.ctl.get(),
                pending = c.pending.len(),
                can_recv = socket.can_recv(),
                to_task = c.to_task.is_some(),
                "egress: conn"
            );
            if !c.aborted && c.task_done_at.is_some_and(|t| t.elapsed() > linger) {
                c.aborted = true;
                socket.abort();
                moved = true;
            }
            if c.aborted {
                c.rounds_since_abort = c.rounds_since_abort.saturating_add(1);
            }
            let finished = (matches!(state, tcp::State::Closed | tcp::State::TimeWait)
                && (c.accepted && !c.aborted || c.rounds_since_abort > 1))
                || (state == tcp::State::Listen && c.born.elapsed() > LISTEN_REAP);
            if finished {
                gone.push(*handle);
            }
        }
        for handle in gone {
            if let Some(c) = self.conns.remove(&handle) {
                self.by_key.remove(&c.key);
                self.cx
                    .stats
                    .open
                    .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            }
            self.sockets.remove(handle);
        }
        moved
    }

    /// An ARP reply from the guest to the gateway, as the guest would send it: teaches the
    /// interface the guest's hardware address.
    fn guest_arp_reply(&self) -> Vec<u8> {
        let repr = ArpRepr::EthernetIpv4 {
            operation: ArpOperation::Reply,
            source_hardware_addr: self.guest_mac,
            source_protocol_addr: GUEST_IP,
            target_hardware_addr: EthernetAddress(GATEWAY_MAC),
            target_protocol_addr: GATEWAY_IP,
        };
        let mut out = vec![0u8; 14 + repr.buffer_len()];
        let mut f = EthernetFrame::new_unchecked(&mut out[..]);
        EthernetRepr {
            src_addr: self.guest_mac,
            dst_addr: EthernetAddress(GATEWAY_MAC),
            ethertype: EthernetProtocol::Arp,
        }
        .emit(&mut f);
        repr.emit(&mut ArpPacket::new_unchecked(f.payload_mut()));
        out
    }
}

/// The source port of a TCP frame the gate already checked, and whether it opens a connection
/// (SYN without ACK).
fn syn_of(frame: &[u8]) -> Option<(u16, bool)> {
    let eth = EthernetFrame::new_checked(frame).ok()?;
    let ip = Ipv4Packet::new_checked(eth.payload()).ok()?;
    let tcp = TcpPacket::new_checked(ip.payload()).ok()?;
    Some((tcp.src_port(), tcp.syn() && !tcp.ack()))
}

/// Seeds smoltcp's initial sequence numbers and ports from the kernel's randomness.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
