//! The gate every guest frame meets first (ARP, IPv4, UDP/DNS, TCP, ICMP), driven by frames
//! built from the input with valid checksums (so they reach the policy) and by raw frames.
//! Invariants: a TCP segment goes to the stack only for a name the guest resolved through our
//! DNS and an allowed port of it; DNS hands out pool addresses for allowed names only; every
//! frame sent back is from the gateway to the guest, no bigger than the link's MTU allows.
#![no_main]

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use sandbox_fuzz::{Input, frame};
use sandbox_egress::gate::{Gate, Verdict};
use sandbox_egress::net::{GATEWAY_IP, GATEWAY_MAC, GUEST_IP, MTU, pool_addr, pool_index};
use sandbox_egress::policy::Allowlist;

const GUEST_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x07];
const ALLOW: [&str; 3] = ["api.example.com", "*.example.org", "only.example.net:443"];

fn ipv4(dst: Ipv4Addr, proto: u8, l4: Vec<u8>, csum_at: Option<usize>) -> Vec<u8> {
    frame::ipv4((GUEST_MAC, GUEST_IP), (GATEWAY_MAC, dst), proto, l4, csum_at)
}

fn dns_name(name_pick: u8, input: &mut Input) -> Vec<u8> {
    let names = [
        "api.example.com",
        "a.example.org",
        "only.example.net",
        "evil.test",
        "API.Example.COM.",
    ];
    if name_pick < 200 {
        frame::qname(names[usize::from(name_pick) % names.len()])
    } else {
        let n = usize::from(input.byte().unwrap_or(0));
        input.bytes(n).to_vec()
    }
}

fuzz_target!(|data: &[u8]| {
    let allow = Allowlist::parse(ALLOW).unwrap();
    let check = Allowlist::parse(ALLOW).unwrap();
    let mut gate = Gate::new(GUEST_MAC, allow);
    let start = Instant::now();
    let mut input = Input(data);
    let mut resolved: Vec<(String, Ipv4Addr)> = vec![];
    let mut steps = 0u64;
    while let Some(op) = input.byte() {
        steps += 1;
        let now = start + Duration::from_millis(steps * u64::from(op >> 4));
        let frame = match op % 4 {
            0 => {
                let n = usize::from(input.u16_be().unwrap_or(0)) % 1600;
                input.bytes(n).to_vec()
            }
            1 => {
                // A DNS query to the gateway.
                let id = input.u16_be().unwrap_or(0);
                let qtype: u16 = if input.byte().unwrap_or(0) & 1 == 0 {
                    1
                } else {
                    28
                };
                let pick = input.byte().unwrap_or(0);
                let q = frame::dns_query(id, &dns_name(pick, &mut input), qtype);
                ipv4(GATEWAY_IP, 17, frame::udp(0xc001, 53, &q), Some(6))
            }
            2 => {
                // A TCP segment to a pool address (or anywhere) and a port.
                let pick = input.u16_be().unwrap_or(0);
                let dst = if pick & 0x8000 == 0 {
                    pool_addr(u32::from(pick & 0xff)).unwrap()
                } else {
                    let b = input.bytes(4);
                    let mut o = [0u8; 4];
                    o[..b.len()].copy_from_slice(b);
                    Ipv4Addr::from(o)
                };
                let port = input.u16_be().unwrap_or(443);
                let flags = input.byte().unwrap_or(0x02);
                let mut tcp = vec![0xc0, 0x02];
                tcp.extend_from_slice(&port.to_be_bytes());
                tcp.extend_from_slice(&[
                    0, 0, 0, 1, 0, 0, 0, 0, 0x50, flags, 0xff, 0xff, 0, 0, 0, 0,
                ]);
                let n = usize::from(input.byte().unwrap_or(0));
                tcp.extend_from_slice(input.bytes(n));
                ipv4(dst, 6, tcp, Some(16))
            }
            _ => {
                // Any other protocol or a UDP datagram elsewhere, with a good checksum.
                let proto = input.byte().unwrap_or(17);
                let b = input.bytes(4);
                let mut o = [0u8; 4];
                o[..b.len()].copy_from_slice(b);
                let n = usize::from(input.byte().unwrap_or(0));
                let body = input.bytes(n).to_vec();
                let at = match proto {
                    17 => Some(6),
                    6 => Some(16),
                    1 => Some(2),
                    _ => None,
                };
                ipv4(Ipv4Addr::from(o), proto, body, at)
            }
        };
        match gate.inspect(&frame, now) {
            Verdict::Drop | Verdict::ArpReply => {}
            Verdict::Reply(r) => {
                assert!(r.len() <= 14 + MTU, "a reply of {} bytes", r.len());
                assert_eq!(r[..6], GUEST_MAC, "a reply to someone else");
                assert_eq!(r[6..12], GATEWAY_MAC, "a reply not from the gateway");
                // A DNS answer with a record: the address is a pool address for an allowed name.
                if r.len() > 14 + 20 + 8 + 12 && r[23] == 17 && r[34..36] == [0, 53] {
                    let dns = &r[42..];
                    let ancount = u16::from_be_bytes([dns[6], dns[7]]);
                    if ancount > 0 {
                        let a = Ipv4Addr::new(
                            dns[dns.len() - 4],
                            dns[dns.len() - 3],
                            dns[dns.len() - 2],
                            dns[dns.len() - 1],
                        );
                        assert!(
                            pool_index(a).is_some(),
                            "DNS answered {a}, outside the pool"
                        );
                        let name = gate
                            .name_of(a)
                            .expect("a pool address the gate knows")
                            .to_string();
                        assert!(
                            check.allows(&name),
                            "DNS answered for {name}, which is not allowed"
                        );
                        resolved.push((name, a));
                    }
                }
            }
            Verdict::Tcp { name, dst } => {
                assert!(
                    check.allows_port(&name, dst.port()),
                    "TCP to {name}:{} passed",
                    dst.port()
                );
                assert!(
                    resolved.iter().any(|(n, a)| *n == name && *a == *dst.ip()),
                    "TCP to {dst} ({name}) that our DNS never answered"
                );
            }
        }
    }
});
