//! A guest without a VM: smoltcp on the guest's side of a [`GuestEnd`], configured the way the
//! agent configures a real guest (10.233.0.2/24, default route through the gateway). Tests use it
//! to drive the stack with real TCP from the other end, and to feed it hostile frames; the
//! benchmark uses it to measure the stack without a VM's own costs.
//!
//! It is synchronous: the caller polls it from one thread, while the stack runs on a tokio
//! runtime elsewhere.

use std::net::Ipv4Addr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::ChecksumCapabilities;
use smoltcp::socket::tcp;
use smoltcp::wire::{
    EthernetAddress, EthernetFrame, EthernetProtocol, EthernetRepr, HardwareAddress, IpAddress,
    IpCidr, IpProtocol, Ipv4Packet, Ipv4Repr, UdpPacket, UdpRepr,
};

use crate::link::{GuestEnd, MAX_FRAME};
use crate::net::{GATEWAY_IP, GATEWAY_MAC, GUEST_IP, PREFIX_LEN};
use crate::phy::Device;

/// The simulated guest.
pub struct GuestSim {
    iface: Interface,
    sockets: SocketSet<'static>,
    dev: Device<GuestEnd>,
    mac: EthernetAddress,
    epoch: Instant,
    signal: Arc<(Mutex<bool>, Condvar)>,
    next_port: u16,
    dns_id: u16,
}

impl GuestSim {
    /// A guest with `mac` on `link`.
    pub fn new(link: GuestEnd, mac: [u8; 6]) -> Self {
        let signal = Arc::new((Mutex::new(false), Condvar::new()));
        let s = signal.clone();
        link.set_waker(move || {
            *s.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
            s.1.notify_all();
        });
        let mut dev = Device::new(link);
        let cfg = Config::new(HardwareAddress::Ethernet(EthernetAddress(mac)));
        let mut iface = Interface::new(cfg, &mut dev, smoltcp::time::Instant::ZERO);
        iface.update_ip_addrs(|a| {
            let _ = a.push(IpCidr::new(IpAddress::Ipv4(GUEST_IP), PREFIX_LEN));
        });
        let _ = iface.routes_mut().add_default_ipv4_route(GATEWAY_IP);
        GuestSim {
            iface,
            sockets: SocketSet::new(Vec::new()),
            dev,
            mac: EthernetAddress(mac),
            epoch: Instant::now(),
            signal,
            next_port: 40000,
            dns_id: 1,
        }
    }

    fn now(&self) -> smoltcp::time::Instant {
        smoltcp::time::Instant::from_micros(
            i64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(i64::MAX),
        )
    }

    /// Takes the frames the stack sent, and runs the guest's interface once.
    pub fn poll(&mut self) {
        let mut buf = vec![0u8; MAX_FRAME];
        while let Some(n) = self.dev.link.recv(&mut buf) {
            self.dev.rx.push_back(buf[..n].to_vec());
        }
        let now = self.now();
        self.iface.poll(now, &mut self.dev, &mut self.sockets);
    }

    /// Waits until the stack sends a frame, the guest's own timers are due, or `max` passed.
    pub fn wait(&mut self, max: Duration) {
        let delay = self
            .iface
            .poll_delay(self.now(), &self.sockets)
            .map_or(max, |d| Duration::from_micros(d.total_micros()).min(max));
        let (m, c) = &*self.signal;
        let mut ready = m.lock().unwrap_or_else(|e| e.into_inner());
        if !*ready && !delay.is_zero() {
            ready = c
                .wait_timeout(ready, delay)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *ready = false;
    }

    /// Polls until `done` holds or `timeout` passes; whether it held.
    pub fn run_until(
        &mut self,
        timeout: Duration,
        mut done: impl FnMut(&mut Self) -> bool,
    ) -> bool {
        let t = Instant::now();
        loop {
            self.poll();
            if done(self) {
                return true;
            }
            if t.elapsed() >= timeout {
                return false;
            }
            self.wait(Duration::from_millis(5));
        }
    }

    /// Sends a frame as the guest's device would.
    pub fn send_raw(&self, frame: &[u8]) -> bool {
        self.dev.link.send(frame)
    }

    /// Asks the stack's DNS for the A record of `name`; the address, or `None` (NXDOMAIN, no
    /// answer within `timeout`).
    pub fn resolve(&mut self, name: &str, timeout: Duration) -> Option<Ipv4Addr> {
        let id = self.dns_id;
        self.dns_id = self.dns_id.wrapping_add(1);
        self.send_raw(&self.dns_query(id, name, 53000));
        let t = Instant::now();
        let mut buf = vec![0u8; MAX_FRAME];
        while t.elapsed() < timeout {
            while let Some(n) = self.dev.link.recv(&mut buf) {
                match dns_answer(&buf[..n], id) {
                    Some(a) => return a,
                    None => self.dev.rx.push_back(buf[..n].to_vec()),
                }
            }
            self.wait(Duration::from_millis(5));
        }
        None
    }

    /// A DNS query frame for `name` (type A) from the guest's `port`.
    pub fn dns_query(&self, id: u16, name: &str, port: u16) -> Vec<u8> {
        let mut q = Vec::with_capacity(64);
        q.extend_from_slice(&id.to_be_bytes());
        q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
        for label in name.split('.') {
            q.push(u8::try_from(label.len()).unwrap_or(63));
            q.extend_from_slice(label.as_bytes());
        }
        q.extend_from_slice(&[0, 0, 1, 0, 1]);
        self.udp_frame(port, GATEWAY_IP, 53, &q)
    }

    /// A UDP frame from the guest.
    pub fn udp_frame(
        &self,
        src_port: u16,
        dst: Ipv4Addr,
        dst_port: u16,
        payload: &[u8],
    ) -> Vec<u8> {
        let udp = UdpRepr { src_port, dst_port };
        let ip = Ipv4Repr {
            src_addr: GUEST_IP,
            dst_addr: dst,
            next_header: IpProtocol::Udp,
            payload_len: udp.header_len() + payload.len(),
            hop_limit: 64,
        };
        let mut out = vec![0u8; 14 + ip.buffer_len() + ip.payload_len];
        let mut f = EthernetFrame::new_unchecked(&mut out[..]);
        EthernetRepr {
            src_addr: self.mac,
            dst_addr: EthernetAddress(GATEWAY_MAC),
            ethertype: EthernetProtocol::Ipv4,
        }
        .emit(&mut f);
        let caps = ChecksumCapabilities::default();
        let mut p = Ipv4Packet::new_unchecked(f.payload_mut());
        ip.emit(&mut p, &caps);
        udp.emit(
            &mut UdpPacket::new_unchecked(p.payload_mut()),
            &IpAddress::Ipv4(GUEST_IP),
            &IpAddress::Ipv4(dst),
            payload.len(),
            |b| b.copy_from_slice(payload),
            &caps,
        );
        out
    }

    /// Opens a TCP connection (not yet established: poll until it is) with `buffer` bytes of
    /// socket buffer each way.
    pub fn connect(&mut self, addr: Ipv4Addr, port: u16, buffer: usize) -> SocketHandle {
        let mut s = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; buffer]),
            tcp::SocketBuffer::new(vec![0; buffer]),
        );
        s.set_nagle_enabled(false);
        s.set_ack_delay(None);
        self.next_port = self.next_port.wrapping_add(1).max(40000);
        let local = self.next_port;
        let cx = self.iface.context();
        let _ = s.connect(cx, (IpAddress::Ipv4(addr), port), local);
        self.sockets.add(s)
    }

    /// A socket of the guest.
    pub fn tcp(&mut self, h: SocketHandle) -> &mut tcp::Socket<'static> {
        self.sockets.get_mut::<tcp::Socket>(h)
    }

    /// Drops a socket.
    pub fn remove(&mut self, h: SocketHandle) {
        self.sockets.remove(h);
    }
}

/// The answer in `frame` to DNS query `id`: `Some(Some(addr))`, `Some(None)` for an answer
/// without an address, `None` if the frame is something else.
fn dns_answer(frame: &[u8], id: u16) -> Option<Option<Ipv4Addr>> {
    let eth = EthernetFrame::new_checked(frame).ok()?;
    if eth.ethertype() != EthernetProtocol::Ipv4 {
        return None;
    }
    let ip = Ipv4Packet::new_checked(eth.payload()).ok()?;
    if ip.next_header() != IpProtocol::Udp {
        return None;
    }
    let udp = UdpPacket::new_checked(ip.payload()).ok()?;
    let m = udp.payload();
    if udp.src_port() != 53 || m.len() < 12 || m[..2] != id.to_be_bytes() {
        return None;
    }
    let answers = u16::from_be_bytes([m[6], m[7]]);
    if answers == 0 {
        return Some(None);
    }
    // One question echoed, then the answer ends with RDLENGTH 4 and the address.
    let a = &m[m.len().checked_sub(4)?..];
    Some(Some(Ipv4Addr::new(a[0], a[1], a[2], a[3])))
}

/// The first TLS record a real client (rustls) sends to `name`: a ClientHello, for tests and
/// benchmarks of what the stack decides from it. No roots are needed to write one.
pub fn client_hello(name: &str) -> Vec<u8> {
    let cfg = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("ring supports the default versions")
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_no_client_auth();
    let server =
        rustls::pki_types::ServerName::try_from(name.to_string()).expect("a valid server name");
    let mut c = rustls::ClientConnection::new(std::sync::Arc::new(cfg), server)
        .expect("a client connection");
    let mut out = Vec::new();
    let _ = c.write_tls(&mut out);
    out
}

/// [`client_hello`] with an `encrypted_client_hello` extension (type 0xfe0d) added, as a client
/// that uses ECH (or sends ECH "GREASE") writes it.
pub fn client_hello_with_ech(name: &str) -> Vec<u8> {
    let mut rec = client_hello(name);
    // Record (5) and handshake (4) headers, then version, random, and the variable fields.
    let mut at = 5 + 4 + 2 + 32;
    at += 1 + usize::from(rec[at]); // session id
    at += 2 + usize::from(u16::from_be_bytes([rec[at], rec[at + 1]])); // cipher suites
    at += 1 + usize::from(rec[at]); // compression methods
    let ext_len_at = at;
    // An outer ECH extension: type, length, then a made-up config id, key and payload.
    let body: Vec<u8> = [0u8, 0, 1, 0, 1, 7, 0, 4, 1, 2, 3, 4, 0, 4, 9, 9, 9, 9].to_vec();
    let mut ext = vec![0xfe, 0x0d];
    ext.extend((body.len() as u16).to_be_bytes());
    ext.extend(body);
    rec.extend(&ext);
    let grow = |at: usize, width: usize, rec: &mut Vec<u8>| {
        let mut v = 0usize;
        for i in 0..width {
            v = (v << 8) | usize::from(rec[at + i]);
        }
        v += ext.len();
        for i in 0..width {
            rec[at + width - 1 - i] = (v >> (8 * i)) as u8;
        }
    };
    grow(ext_len_at, 2, &mut rec);
    grow(6, 3, &mut rec); // handshake length
    grow(3, 2, &mut rec); // record length
    rec
}
