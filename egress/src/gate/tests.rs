use super::*;

const GUEST_MAC: [u8; 6] = [0x02, 0x53, 0x42, 1, 2, 3];

fn gate() -> Gate {
    Gate::new(
        GUEST_MAC,
        Allowlist::parse(["api.example.com", "*.npmjs.org"]).unwrap(),
    )
}

fn eth(ethertype: EthernetProtocol, payload_len: usize, fill: impl FnOnce(&mut [u8])) -> Vec<u8> {
    let mut out = vec![0u8; 14 + payload_len];
    let mut f = EthernetFrame::new_unchecked(&mut out[..]);
    EthernetRepr {
        src_addr: EthernetAddress(GUEST_MAC),
        dst_addr: EthernetAddress(GATEWAY_MAC),
        ethertype,
    }
    .emit(&mut f);
    fill(f.payload_mut());
    out
}

fn ip_frame(dst: Ipv4Addr, proto: IpProtocol, len: usize, fill: impl FnOnce(&mut [u8])) -> Vec<u8> {
    let ipr = Ipv4Repr {
        src_addr: GUEST_IP,
        dst_addr: dst,
        next_header: proto,
        payload_len: len,
        hop_limit: 64,
    };
    eth(EthernetProtocol::Ipv4, 20 + len, |b| {
        let mut p = Ipv4Packet::new_unchecked(b);
        ipr.emit(&mut p, &ChecksumCapabilities::default());
        fill(p.payload_mut());
    })
}

fn udp(dst: Ipv4Addr, port: u16, payload: &[u8]) -> Vec<u8> {
    let repr = UdpRepr {
        src_port: 40000,
        dst_port: port,
    };
    ip_frame(dst, IpProtocol::Udp, 8 + payload.len(), |b| {
        repr.emit(
            &mut UdpPacket::new_unchecked(b),
            &IpAddress::Ipv4(GUEST_IP),
            &IpAddress::Ipv4(dst),
            payload.len(),
            |p| p.copy_from_slice(payload),
            &ChecksumCapabilities::default(),
        )
    })
}

fn syn(dst: Ipv4Addr, port: u16) -> Vec<u8> {
    let repr = TcpRepr {
        src_port: 50000,
        dst_port: port,
        control: TcpControl::Syn,
        seq_number: TcpSeqNumber(1000),
        ack_number: None,
        window_len: 64240,
        window_scale: Some(7),
        max_seg_size: Some(1460),
        sack_permitted: true,
        sack_ranges: [None; 3],
        timestamp: None,
        payload: &[],
    };
    ip_frame(dst, IpProtocol::Tcp, repr.buffer_len(), |b| {
        repr.emit(
            &mut TcpPacket::new_unchecked(b),
            &IpAddress::Ipv4(GUEST_IP),
            &IpAddress::Ipv4(dst),
            &ChecksumCapabilities::default(),
        )
    })
}

fn dns_query(name: &str, qtype: u16) -> Vec<u8> {
    let mut q = Vec::new();
    for v in [0x4242u16, 0x0100, 1, 0, 0, 0] {
        q.extend_from_slice(&v.to_be_bytes());
    }
    for l in name.split('.') {
        q.push(l.len() as u8);
        q.extend_from_slice(l.as_bytes());
    }
    q.extend_from_slice(&[0, (qtype >> 8) as u8, qtype as u8, 0, 1]);
    udp(GATEWAY_IP, 53, &q)
}

/// The IPv4 payload of a frame the gate sent, checked as the guest's stack would.
fn ipv4_of(frame: &[u8]) -> (Ipv4Repr, Vec<u8>) {
    let f = EthernetFrame::new_checked(frame).unwrap();
    assert_eq!(f.dst_addr(), EthernetAddress(GUEST_MAC));
    assert_eq!(f.src_addr(), EthernetAddress(GATEWAY_MAC));
    let p = Ipv4Packet::new_checked(f.payload()).unwrap();
    let r = Ipv4Repr::parse(&p, &ChecksumCapabilities::default()).unwrap();
    (r, p.payload().to_vec())
}

/// The DNS answer's rcode and A address.
fn dns_answer(v: Verdict) -> (u8, Option<Ipv4Addr>) {
    let Verdict::Reply(frame) = v else {
        panic!("no answer: {v:?}")
    };
    let (ip, body) = ipv4_of(&frame);
    let u = UdpPacket::new_checked(&body[..]).unwrap();
    UdpRepr::parse(
        &u,
        &IpAddress::Ipv4(ip.src_addr),
        &IpAddress::Ipv4(ip.dst_addr),
        &ChecksumCapabilities::default(),
    )
    .expect("checksum");
    assert_eq!((u.src_port(), u.dst_port()), (53, 40000));
    let m = u.payload();
    let ancount = u16::from_be_bytes([m[6], m[7]]);
    let addr = (ancount == 1).then(|| {
        let n = m.len();
        Ipv4Addr::new(m[n - 4], m[n - 3], m[n - 2], m[n - 1])
    });
    (m[3] & 0x0f, addr)
}

#[test]
fn arp_answers_for_the_gateway_only() {
    let mut g = gate();
    let now = Instant::now();
    let req = |sender: Ipv4Addr, target: Ipv4Addr| {
        let r = ArpRepr::EthernetIpv4 {
            operation: ArpOperation::Request,
            source_hardware_addr: EthernetAddress(GUEST_MAC),
            source_protocol_addr: sender,
            target_hardware_addr: EthernetAddress([0; 6]),
            target_protocol_addr: target,
        };
        eth(EthernetProtocol::Arp, r.buffer_len(), |b| {
            r.emit(&mut ArpPacket::new_unchecked(b))
        })
    };
    let Verdict::Reply(reply) = g.inspect(&req(GUEST_IP, GATEWAY_IP), now) else {
        panic!("no ARP reply")
    };
    let f = EthernetFrame::new_checked(&reply[..]).unwrap();
    let r = ArpRepr::parse(&ArpPacket::new_checked(f.payload()).unwrap()).unwrap();
    assert_eq!(
        r,
        ArpRepr::EthernetIpv4 {
            operation: ArpOperation::Reply,
            source_hardware_addr: EthernetAddress(GATEWAY_MAC),
            source_protocol_addr: GATEWAY_IP,
            target_hardware_addr: EthernetAddress(GUEST_MAC),
            target_protocol_addr: GUEST_IP,
        }
    );
    // Nobody else lives on this link, and the guest cannot speak for another address.
    assert_eq!(
        g.inspect(&req(GUEST_IP, Ipv4Addr::new(10, 233, 0, 3)), now),
        Verdict::Drop
    );
    assert_eq!(
        g.inspect(&req(GUEST_IP, Ipv4Addr::new(8, 8, 8, 8)), now),
        Verdict::Drop
    );
    assert_eq!(
        g.inspect(&req(Ipv4Addr::new(10, 233, 0, 9), GATEWAY_IP), now),
        Verdict::Drop
    );
    // The guest's answer to the stack's own question goes to the stack (it learns the guest's
    // hardware address from it); an answer for anyone else does not.
    let answer = |sender: Ipv4Addr| {
        let r = ArpRepr::EthernetIpv4 {
            operation: ArpOperation::Reply,
            source_hardware_addr: EthernetAddress(GUEST_MAC),
            source_protocol_addr: sender,
            target_hardware_addr: EthernetAddress(GATEWAY_MAC),
            target_protocol_addr: GATEWAY_IP,
        };
        eth(EthernetProtocol::Arp, r.buffer_len(), |b| {
            r.emit(&mut ArpPacket::new_unchecked(b))
        })
    };
    assert_eq!(g.inspect(&answer(GUEST_IP), now), Verdict::ArpReply);
    assert_eq!(
        g.inspect(&answer(Ipv4Addr::new(10, 233, 0, 7)), now),
        Verdict::Drop
    );
    // A frame from another MAC is not the guest's.
    let mut spoofed = req(GUEST_IP, GATEWAY_IP);
    spoofed[11] ^= 1;
    assert_eq!(g.inspect(&spoofed, now), Verdict::Drop);
}

#[test]
fn dns_answers_allowed_names_from_the_pool_and_refuses_the_rest() {
    let mut g = gate();
    let now = Instant::now();
    let a = dns_answer(g.inspect(&dns_query("API.example.com", 1), now));
    assert_eq!(a, (0, Some(Ipv4Addr::new(198, 18, 0, 1))));
    assert_eq!(
        dns_answer(g.inspect(&dns_query("api.example.com", 1), now)),
        a,
        "stable"
    );
    assert_eq!(
        dns_answer(g.inspect(&dns_query("registry.npmjs.org", 1), now)),
        (0, Some(Ipv4Addr::new(198, 18, 0, 2)))
    );
    assert_eq!(
        dns_answer(g.inspect(&dns_query("api.example.com", 28), now)),
        (0, None),
        "AAAA: no data"
    );
    assert_eq!(
        dns_answer(g.inspect(&dns_query("evil.com", 1), now)),
        (3, None)
    );
    assert_eq!(
        dns_answer(g.inspect(&dns_query("npmjs.org", 1), now)),
        (3, None)
    );
    assert_eq!(
        dns_answer(g.inspect(&dns_query("1.2.3.4", 1), now)),
        (3, None)
    );
    assert_eq!(g.refusals().count(Reason::NameNotAllowed), 3);
    assert_eq!(
        g.name_of(Ipv4Addr::new(198, 18, 0, 2)),
        Some("registry.npmjs.org")
    );
    assert_eq!(g.name_of(Ipv4Addr::new(198, 18, 0, 3)), None);
}

#[test]
fn tcp_goes_on_only_to_names_from_our_dns() {
    let mut g = gate();
    let now = Instant::now();
    dns_answer(g.inspect(&dns_query("api.example.com", 1), now));
    assert_eq!(
        g.inspect(&syn(Ipv4Addr::new(198, 18, 0, 1), 443), now),
        Verdict::Tcp {
            name: "api.example.com".into(),
            dst: "198.18.0.1:443".parse().unwrap()
        }
    );
    // An IP literal, a pool address never handed out, the gateway itself: reset at once.
    for (dst, port) in [
        (Ipv4Addr::new(1, 1, 1, 1), 443),
        (Ipv4Addr::new(198, 18, 0, 9), 443),
        (GATEWAY_IP, 3004),
        (Ipv4Addr::new(169, 254, 169, 254), 80),
    ] {
        let Verdict::Reply(rst) = g.inspect(&syn(dst, port), now) else {
            panic!("no reset for {dst}:{port}")
        };
        let (ip, body) = ipv4_of(&rst);
        assert_eq!((ip.src_addr, ip.dst_addr), (dst, GUEST_IP));
        let t = TcpPacket::new_checked(&body[..]).unwrap();
        let r = TcpRepr::parse(
            &t,
            &IpAddress::Ipv4(dst),
            &IpAddress::Ipv4(GUEST_IP),
            &ChecksumCapabilities::default(),
        )
        .expect("checksum");
        assert_eq!(r.control, TcpControl::Rst);
        assert_eq!(r.ack_number, Some(TcpSeqNumber(1001)), "acks the SYN");
        assert_eq!((r.src_port, r.dst_port), (port, 50000));
    }
    assert_eq!(g.refusals().count(Reason::IpLiteral), 4);
    // DNS over TCP to someone else's resolver.
    assert!(matches!(
        g.inspect(&syn(Ipv4Addr::new(8, 8, 8, 8), 53), now),
        Verdict::Reply(_)
    ));
    assert_eq!(g.refusals().count(Reason::DnsBypass), 1);
}

#[test]
fn udp_icmp_and_ipv6_are_refused_and_counted() {
    let mut g = gate();
    let now = Instant::now();
    // QUIC: ICMP port unreachable, so the guest falls back or fails fast.
    let Verdict::Reply(icmp) = g.inspect(&udp(Ipv4Addr::new(1, 1, 1, 1), 443, b"quic"), now) else {
        panic!("no ICMP error")
    };
    let (ip, body) = ipv4_of(&icmp);
    assert_eq!(ip.next_header, IpProtocol::Icmp);
    let r = Icmpv4Repr::parse(
        &Icmpv4Packet::new_checked(&body[..]).unwrap(),
        &ChecksumCapabilities::default(),
    )
    .unwrap();
    assert!(matches!(
        r,
        Icmpv4Repr::DstUnreachable {
            reason: Icmpv4DstUnreachable::PortUnreachable,
            ..
        }
    ));
    assert_eq!(g.refusals().count(Reason::Udp), 1);
    assert!(matches!(
        g.inspect(&udp(Ipv4Addr::new(8, 8, 8, 8), 53, b"q"), now),
        Verdict::Reply(_)
    ));
    assert_eq!(g.refusals().count(Reason::DnsBypass), 1);

    // Ping: the gateway answers; nobody else is reachable.
    let echo = |dst| {
        let r = Icmpv4Repr::EchoRequest {
            ident: 7,
            seq_no: 1,
            data: b"ping",
        };
        ip_frame(dst, IpProtocol::Icmp, r.buffer_len(), |b| {
            r.emit(
                &mut Icmpv4Packet::new_unchecked(b),
                &ChecksumCapabilities::default(),
            )
        })
    };
    assert!(matches!(
        g.inspect(&echo(GATEWAY_IP), now),
        Verdict::Reply(_)
    ));
    assert_eq!(
        g.inspect(&echo(Ipv4Addr::new(1, 1, 1, 1)), now),
        Verdict::Drop
    );
    assert_eq!(g.refusals().count(Reason::Icmp), 1);

    // IPv6 TCP is counted; other protocols over IPv4 too.
    // A bare IPv6 header: version 6, no payload, next header TCP, hop limit 64.
    let f = eth(EthernetProtocol::Ipv6, 40, |b| {
        b[0] = 0x60;
        b[6] = 6;
        b[7] = 64;
    });
    assert_eq!(g.inspect(&f, now), Verdict::Drop);
    assert_eq!(g.refusals().count(Reason::Ipv6), 1);
    let gre = ip_frame(
        Ipv4Addr::new(1, 1, 1, 1),
        IpProtocol::Unknown(47),
        4,
        |_| {},
    );
    assert_eq!(g.inspect(&gre, now), Verdict::Drop);
    assert_eq!(g.refusals().count(Reason::IpProtocol), 1);
}

#[test]
fn floods_are_rate_limited() {
    let mut g = gate();
    let t0 = Instant::now();
    let answered = (0..1000)
        .filter(|_| {
            matches!(
                g.inspect(&dns_query("api.example.com", 1), t0),
                Verdict::Reply(_)
            )
        })
        .count();
    assert_eq!(answered, DNS_BURST as usize);
    assert_eq!(
        g.refusals().count(Reason::RateLimit),
        1,
        "counted once a second, not per query"
    );
    // A second later the bucket has refilled by the rate.
    let t1 = t0 + Duration::from_secs(1);
    let answered = (0..1000)
        .filter(|_| {
            matches!(
                g.inspect(&dns_query("api.example.com", 1), t1),
                Verdict::Reply(_)
            )
        })
        .count();
    assert_eq!(answered, DNS_PER_SEC as usize);
    assert_eq!(g.refusals().count(Reason::RateLimit), 2);
    // Resets too: the guest cannot make us send more than the burst.
    let resets = (0..1000)
        .filter(|_| {
            matches!(
                g.inspect(&syn(Ipv4Addr::new(1, 1, 1, 1), 443), t0),
                Verdict::Reply(_)
            )
        })
        .count();
    assert_eq!(resets, REJECTS_BURST as usize);
    assert_eq!(
        g.refusals().count(Reason::IpLiteral),
        1000,
        "every refusal is counted"
    );
}

#[test]
fn garbage_frames_never_panic() {
    let mut g = gate();
    let now = Instant::now();
    let valid = [
        dns_query("api.example.com", 1),
        syn(Ipv4Addr::new(198, 18, 0, 1), 443),
        udp(Ipv4Addr::new(1, 1, 1, 1), 443, b"x"),
    ];
    for f in &valid {
        for n in 0..f.len() {
            let _ = g.inspect(&f[..n], now);
        }
        for i in 0..f.len() {
            for v in [0u8, 0xff, f[i] ^ 0x80] {
                let mut m = f.clone();
                m[i] = v;
                if let Verdict::Reply(r) = g.inspect(&m, now) {
                    assert!(r.len() <= 14 + 20 + 8 + 512 + 16, "answers stay small");
                }
            }
        }
    }
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = (x % 1600) as usize;
        let mut f: Vec<u8> = (0..len)
            .map(|i| (x.rotate_left(i as u32 % 64)) as u8)
            .collect();
        if f.len() >= 14 {
            f[..6].copy_from_slice(&GATEWAY_MAC);
            f[6..12].copy_from_slice(&GUEST_MAC);
            f[12..14].copy_from_slice(&[0x08, (x >> 60) as u8 & 0x06]);
        }
        let _ = g.inspect(&f, now);
    }
}
