//! The first look at every frame the guest sends, before any stack state is touched: what it
//! is, whether it may go on, and the answer when the stack answers at once. ARP for the gateway,
//! ping of the gateway and DNS are answered here; TCP to a name the guest resolved through us
//! goes on to the TCP stack; everything else is refused, counted, and answered with a TCP reset or
//! an ICMP "port unreachable" so the guest's program fails fast instead of waiting for a timeout.
//!
//! Frames are guest-controlled: every header is parsed by smoltcp's checked wire types (lengths,
//! checksums), nothing here allocates more than one answer frame, and the answers the guest can
//! provoke are rate-limited.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{
    ArpOperation, ArpPacket, ArpRepr, EthernetAddress, EthernetFrame, EthernetProtocol,
    EthernetRepr, Icmpv4DstUnreachable, Icmpv4Packet, Icmpv4Repr, IpAddress, IpProtocol,
    Ipv4Packet, Ipv4Repr, TcpControl, TcpPacket, TcpRepr, TcpSeqNumber, UdpPacket, UdpRepr,
};

use crate::dns::wire::{self, Answer};
use crate::net::{self, GATEWAY_IP, GATEWAY_MAC, GUEST_IP};
use crate::policy::{Allowlist, normalize};
use crate::refusal::{Reason, Refusals};

/// DNS queries answered per second, and the burst allowed above that.
pub const DNS_PER_SEC: u32 = 50;
/// See [`DNS_PER_SEC`].
pub const DNS_BURST: u32 = 200;
/// Resets and ICMP errors sent per second, and the burst.
pub const REJECTS_PER_SEC: u32 = 100;
/// See [`REJECTS_PER_SEC`].
pub const REJECTS_BURST: u32 = 200;
/// Pings of the gateway answered per second (and burst).
pub const PINGS_PER_SEC: u32 = 10;

/// What to do with one guest frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing to send: dropped (malformed, not for us, or over a rate).
    Drop,
    /// Send this frame back to the guest.
    Reply(Vec<u8>),
    /// The guest's answer to the stack's own ARP question: the TCP stack learns the guest's
    /// hardware address from it.
    ArpReply,
    /// A TCP segment for `dst`, which the guest got from our DNS for `name`: the TCP stack's.
    Tcp {
        /// The name the destination address stands for.
        name: String,
        /// The pool address and port the guest connects to.
        dst: SocketAddrV4,
    },
}

/// A token bucket: `rate` per second, up to `burst` saved.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    rate: f64,
    burst: f64,
    last: Option<Instant>,
}

impl Bucket {
    fn new(rate: u32, burst: u32) -> Self {
        Bucket {
            tokens: f64::from(burst),
            rate: f64::from(rate),
            burst: f64::from(burst),
            last: None,
        }
    }

    fn take(&mut self, now: Instant) -> bool {
        if let Some(last) = self.last {
            let dt = now.saturating_duration_since(last).as_secs_f64();
            self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        }
        self.last = Some(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// The per-sandbox gate.
#[derive(Debug)]
pub struct Gate {
    guest_mac: EthernetAddress,
    allow: Allowlist,
    names: Vec<String>,
    index: HashMap<String, u32>,
    refusals: Arc<Mutex<Refusals>>,
    dns: Bucket,
    rejects: Bucket,
    pings: Bucket,
    /// When the rate limit was last counted as a refusal (at most once a second).
    rate_limit_counted: Option<Instant>,
}

impl Gate {
    /// A gate for the guest with this MAC and allowlist.
    pub fn new(guest_mac: [u8; 6], allow: Allowlist) -> Self {
        Self::with_refusals(guest_mac, allow, Arc::default())
    }

    /// A gate that counts into `refusals`, which the connection layer and the API share.
    pub fn with_refusals(
        guest_mac: [u8; 6],
        allow: Allowlist,
        refusals: Arc<Mutex<Refusals>>,
    ) -> Self {
        Gate {
            guest_mac: EthernetAddress(guest_mac),
            allow,
            names: Vec::new(),
            index: HashMap::new(),
            refusals,
            dns: Bucket::new(DNS_PER_SEC, DNS_BURST),
            rejects: Bucket::new(REJECTS_PER_SEC, REJECTS_BURST),
            pings: Bucket::new(PINGS_PER_SEC, PINGS_PER_SEC),
            rate_limit_counted: None,
        }
    }

    /// The refusals so far.
    pub fn refusals(&self) -> MutexGuard<'_, Refusals> {
        self.refusals.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, reason: Reason, target: &str) {
        self.refusals().record(reason, target);
    }

    /// The name a pool address was given for.
    pub fn name_of(&self, addr: Ipv4Addr) -> Option<&str> {
        let i = net::pool_index(addr)?;
        self.names.get(usize::try_from(i).ok()?).map(String::as_str)
    }

    /// Looks at one frame from the guest.
    pub fn inspect(&mut self, frame: &[u8], now: Instant) -> Verdict {
        let Ok(eth) = EthernetFrame::new_checked(frame) else {
            return Verdict::Drop;
        };
        // Only the guest's own MAC, sent to us or to everyone.
        if eth.src_addr() != self.guest_mac
            || !(eth.dst_addr() == EthernetAddress(GATEWAY_MAC) || eth.dst_addr().is_broadcast())
        {
            return Verdict::Drop;
        }
        match eth.ethertype() {
            EthernetProtocol::Arp => self.arp(eth.payload()),
            EthernetProtocol::Ipv4 => self.ipv4(eth.payload(), now),
            EthernetProtocol::Ipv6 => {
                // Router and neighbour solicitations are noise; only count what tries to leave.
                if is_ipv6_transport(eth.payload()) {
                    self.record(Reason::Ipv6, "ipv6");
                }
                Verdict::Drop
            }
            _ => Verdict::Drop,
        }
    }

    fn arp(&mut self, payload: &[u8]) -> Verdict {
        let Ok(packet) = ArpPacket::new_checked(payload) else {
            return Verdict::Drop;
        };
        let Ok(ArpRepr::EthernetIpv4 {
            operation,
            source_hardware_addr,
            source_protocol_addr,
            target_protocol_addr,
            ..
        }) = ArpRepr::parse(&packet)
        else {
            return Verdict::Drop;
        };
        // Only the guest talking to the gateway: we are nobody else on this link.
        if source_hardware_addr != self.guest_mac
            || source_protocol_addr != GUEST_IP
            || target_protocol_addr != GATEWAY_IP
        {
            return Verdict::Drop;
        }
        match operation {
            ArpOperation::Request => {}
            ArpOperation::Reply => return Verdict::ArpReply,
            ArpOperation::Unknown(_) => return Verdict::Drop,
        }
        let reply = ArpRepr::EthernetIpv4 {
            operation: ArpOperation::Reply,
            source_hardware_addr: EthernetAddress(GATEWAY_MAC),
            source_protocol_addr: GATEWAY_IP,
            target_hardware_addr: self.guest_mac,
            target_protocol_addr: GUEST_IP,
        };
        let mut out = vec![0u8; 14 + reply.buffer_len()];
        let mut f = self.eth_header(&mut out, EthernetProtocol::Arp);
        reply.emit(&mut ArpPacket::new_unchecked(f.payload_mut()));
        Verdict::Reply(out)
    }

    fn ipv4(&mut self, payload: &[u8], now: Instant) -> Verdict {
        let caps = ChecksumCapabilities::default();
        let Ok(packet) = Ipv4Packet::new_checked(payload) else {
            return Verdict::Drop;
        };
        // No options, no fragments (Ipv4Repr::parse refuses fragments), a good checksum, and
        // the guest's own source address.
        let Ok(ip) = Ipv4Repr::parse(&packet, &caps) else {
            return Verdict::Drop;
        };
        if packet.header_len() != 20 || ip.src_addr != GUEST_IP {
            return Verdict::Drop;
        }
        let body = &packet.payload()[..ip.payload_len.min(packet.payload().len())];
        match ip.next_header {
            IpProtocol::Udp => self.udp(&ip, body, now),
            IpProtocol::Tcp => self.tcp(&ip, body, now),
            IpProtocol::Icmp => self.icmp(&ip, body, now),
            _ => {
                self.record(Reason::IpProtocol, &ip.dst_addr.to_string());
                Verdict::Drop
            }
        }
    }

    fn udp(&mut self, ip: &Ipv4Repr, body: &[u8], now: Instant) -> Verdict {
        let caps = ChecksumCapabilities::default();
        let Ok(packet) = UdpPacket::new_checked(body) else {
            return Verdict::Drop;
        };
        let (src, dst) = (IpAddress::Ipv4(ip.src_addr), IpAddress::Ipv4(ip.dst_addr));
        let Ok(udp) = UdpRepr::parse(&packet, &src, &dst, &caps) else {
            return Verdict::Drop;
        };
        if ip.dst_addr == GATEWAY_IP && udp.dst_port == 53 {
            return self.dns(ip, &udp, packet.payload(), now);
        }
        if ip.dst_addr.is_broadcast() && udp.dst_port == 67 {
            return Verdict::Drop; // DHCP: the agent configures the address itself
        }
        let reason = if matches!(udp.dst_port, 53 | 853) {
            Reason::DnsBypass
        } else {
            Reason::Udp
        };
        self.record(reason, &format!("{}:{}", ip.dst_addr, udp.dst_port));
        self.unreachable(ip, body, now)
    }

    fn dns(&mut self, ip: &Ipv4Repr, udp: &UdpRepr, query: &[u8], now: Instant) -> Verdict {
        if !self.dns.take(now) {
            let due = self
                .rate_limit_counted
                .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(1));
            if due {
                self.rate_limit_counted = Some(now);
                self.record(Reason::RateLimit, "dns");
            }
            return Verdict::Drop;
        }
        let answer = match wire::parse_query(query) {
            Ok(q) => {
                let a = self.answer(&q);
                wire::response(&q, a)
            }
            Err(_) => match wire::format_error(query) {
                Some(r) => r,
                None => return Verdict::Drop,
            },
        };
        let reply = UdpRepr {
            src_port: 53,
            dst_port: udp.src_port,
        };
        Verdict::Reply(self.udp_frame(&reply, ip.dst_addr, &answer))
    }

    fn answer(&mut self, q: &wire::Query) -> Answer {
        let Some(name) = normalize(&q.name) else {
            self.record(Reason::NameNotAllowed, &q.name);
            return Answer::NxDomain;
        };
        if q.qclass != 1 || !self.allow.allows(&name) {
            self.record(Reason::NameNotAllowed, &name);
            return Answer::NxDomain;
        }
        if q.qtype != wire::qtype::A {
            return Answer::NoData;
        }
        let n = match self.index.get(&name) {
            Some(n) => *n,
            None => {
                let n = u32::try_from(self.names.len()).unwrap_or(u32::MAX);
                if net::pool_addr(n).is_none() {
                    self.record(Reason::DnsTableFull, &name);
                    return Answer::ServFail;
                }
                self.names.push(name.clone());
                self.index.insert(name, n);
                n
            }
        };
        net::pool_addr(n).map_or(Answer::ServFail, Answer::A)
    }

    fn tcp(&mut self, ip: &Ipv4Repr, body: &[u8], now: Instant) -> Verdict {
        let caps = ChecksumCapabilities::default();
        let Ok(packet) = TcpPacket::new_checked(body) else {
            return Verdict::Drop;
        };
        let (src, dst) = (IpAddress::Ipv4(ip.src_addr), IpAddress::Ipv4(ip.dst_addr));
        let Ok(tcp) = TcpRepr::parse(&packet, &src, &dst, &caps) else {
            return Verdict::Drop;
        };
        let (reason, target) = match self.name_of(ip.dst_addr) {
            // Checked here, before any upstream connection: no port scan of an allowed host.
            Some(name) if self.allow.allows_port(name, tcp.dst_port) => {
                return Verdict::Tcp {
                    name: name.to_string(),
                    dst: SocketAddrV4::new(ip.dst_addr, tcp.dst_port),
                };
            }
            Some(name) => (Reason::PortNotAllowed, format!("{name}:{}", tcp.dst_port)),
            None if matches!(tcp.dst_port, 53 | 853) => (
                Reason::DnsBypass,
                format!("{}:{}", ip.dst_addr, tcp.dst_port),
            ),
            None => (
                Reason::IpLiteral,
                format!("{}:{}", ip.dst_addr, tcp.dst_port),
            ),
        };
        if tcp.control == TcpControl::Rst {
            return Verdict::Drop; // never answer a reset
        }
        // Counted once per connection attempt, not per retransmitted segment.
        if (tcp.control == TcpControl::Syn && tcp.ack_number.is_none())
            || reason != Reason::PortNotAllowed
        {
            self.record(reason, &target);
        }
        if !self.rejects.take(now) {
            return Verdict::Drop;
        }
        // RFC 9293 §3.10.7.1: a reset for a segment to no connection.
        let (seq, ack) = match tcp.ack_number {
            Some(a) => (a, None),
            None => (TcpSeqNumber(0), Some(tcp.seq_number + tcp.segment_len())),
        };
        let rst = TcpRepr {
            src_port: tcp.dst_port,
            dst_port: tcp.src_port,
            control: TcpControl::Rst,
            seq_number: seq,
            ack_number: ack,
            window_len: 0,
            window_scale: None,
            max_seg_size: None,
            sack_permitted: false,
            sack_ranges: [None; 3],
            timestamp: None,
            payload: &[],
        };
        let from = ip.dst_addr;
        let out = self.ipv4_frame(from, IpProtocol::Tcp, rst.buffer_len(), |b| {
            rst.emit(
                &mut TcpPacket::new_unchecked(b),
                &IpAddress::Ipv4(from),
                &IpAddress::Ipv4(GUEST_IP),
                &ChecksumCapabilities::default(),
            );
        });
        Verdict::Reply(out)
    }

    fn icmp(&mut self, ip: &Ipv4Repr, body: &[u8], now: Instant) -> Verdict {
        let caps = ChecksumCapabilities::default();
        let Ok(packet) = Icmpv4Packet::new_checked(body) else {
            return Verdict::Drop;
        };
        match Icmpv4Repr::parse(&packet, &caps) {
            Ok(Icmpv4Repr::EchoRequest {
                ident,
                seq_no,
                data,
            }) if ip.dst_addr == GATEWAY_IP => {
                if !self.pings.take(now) {
                    return Verdict::Drop;
                }
                let reply = Icmpv4Repr::EchoReply {
                    ident,
                    seq_no,
                    data,
                };
                Verdict::Reply(self.icmp_frame(&reply, GATEWAY_IP))
            }
            _ => {
                self.record(Reason::Icmp, &ip.dst_addr.to_string());
                Verdict::Drop
            }
        }
    }

    /// ICMP port unreachable for a refused datagram (the guest's socket sees ECONNREFUSED).
    fn unreachable(&mut self, ip: &Ipv4Repr, body: &[u8], now: Instant) -> Verdict {
        if !self.rejects.take(now) {
            return Verdict::Drop;
        }
        // The offending header and the first 8 bytes of its payload, as RFC 792 asks.
        let data = &body[..body.len().min(8)];
        let header = Ipv4Repr {
            payload_len: data.len(),
            ..*ip
        };
        let reply = Icmpv4Repr::DstUnreachable {
            reason: Icmpv4DstUnreachable::PortUnreachable,
            header,
            data,
        };
        Verdict::Reply(self.icmp_frame(&reply, ip.dst_addr))
    }

    fn icmp_frame(&self, icmp: &Icmpv4Repr, from: Ipv4Addr) -> Vec<u8> {
        self.ipv4_frame(from, IpProtocol::Icmp, icmp.buffer_len(), |b| {
            icmp.emit(
                &mut Icmpv4Packet::new_unchecked(b),
                &ChecksumCapabilities::default(),
            );
        })
    }

    fn udp_frame(&self, udp: &UdpRepr, from: Ipv4Addr, payload: &[u8]) -> Vec<u8> {
        let len = udp.header_len() + payload.len();
        self.ipv4_frame(from, IpProtocol::Udp, len, |b| {
            udp.emit(
                &mut UdpPacket::new_unchecked(b),
                &IpAddress::Ipv4(from),
                &IpAddress::Ipv4(GUEST_IP),
                payload.len(),
                |p| p.copy_from_slice(payload),
                &ChecksumCapabilities::default(),
            );
        })
    }

    /// A frame to the guest from `from` carrying `len` bytes of `proto`, written by `fill`.
    fn ipv4_frame(
        &self,
        from: Ipv4Addr,
        proto: IpProtocol,
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> Vec<u8> {
        let ipr = Ipv4Repr {
            src_addr: from,
            dst_addr: GUEST_IP,
            next_header: proto,
            payload_len: len,
            hop_limit: 64,
        };
        let mut out = vec![0u8; 14 + ipr.buffer_len() + len];
        let mut f = self.eth_header(&mut out, EthernetProtocol::Ipv4);
        let mut p = Ipv4Packet::new_unchecked(f.payload_mut());
        ipr.emit(&mut p, &ChecksumCapabilities::default());
        fill(p.payload_mut());
        out
    }

    fn eth_header<'a>(
        &self,
        out: &'a mut [u8],
        ethertype: EthernetProtocol,
    ) -> EthernetFrame<&'a mut [u8]> {
        let mut f = EthernetFrame::new_unchecked(out);
        EthernetRepr {
            src_addr: EthernetAddress(GATEWAY_MAC),
            dst_addr: self.guest_mac,
            ethertype,
        }
        .emit(&mut f);
        f
    }
}

/// Whether an IPv6 packet carries TCP or UDP (something trying to leave), as opposed to
/// neighbour discovery.
fn is_ipv6_transport(payload: &[u8]) -> bool {
    // The next-header byte of the fixed header; extension headers are not followed (a packet
    // that hides its transport behind them is dropped all the same, only not counted).
    matches!(payload.get(6), Some(6 | 17))
}

#[cfg(test)]
mod tests;
