//! Addresses no sandbox may reach, whatever name led there: the host's own loopback, private
//! networks, link-local and cloud metadata services, carrier-grade NAT, multicast, reserved and
//! documentation ranges, and IPv6 forms that embed such an IPv4 address.
//!
//! Every address a name resolves to is checked at connect time (DNS answers can change), and a
//! connection goes only to the address that was checked.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Why an address is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocked {
    /// 0.0.0.0/8, `::`: "this host".
    Unspecified,
    /// 127.0.0.0/8, `::1`.
    Loopback,
    /// RFC 1918, IPv6 unique local.
    Private,
    /// 100.64.0.0/10 (carrier-grade NAT; Alibaba's metadata service is in it).
    SharedNat,
    /// 169.254.0.0/16, fe80::/10 (cloud metadata services live here).
    LinkLocal,
    /// Azure's wire server, 168.63.129.16, inside a public range.
    Metadata,
    /// Multicast and broadcast.
    Multicast,
    /// IETF protocol assignments, documentation, benchmarking (our DNS pool), 6to4 relay,
    /// 240/4, site-local and other special-purpose ranges.
    Reserved,
    /// One of the machine's own addresses, public or not (`host_addrs`).
    HostAddress,
}

impl Blocked {
    /// Every range's reason.
    pub const ALL: [Blocked; 9] = [
        Blocked::Unspecified,
        Blocked::Loopback,
        Blocked::Private,
        Blocked::SharedNat,
        Blocked::LinkLocal,
        Blocked::Metadata,
        Blocked::Multicast,
        Blocked::Reserved,
        Blocked::HostAddress,
    ];

    /// The reason [`Blocked::as_str`] names (a dialer's answer carries the label).
    pub fn from_label(label: &str) -> Option<Blocked> {
        Blocked::ALL.into_iter().find(|b| b.as_str() == label)
    }

    /// The reason as a word for counters and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Blocked::Unspecified => "unspecified",
            Blocked::Loopback => "loopback",
            Blocked::Private => "private",
            Blocked::SharedNat => "shared_nat",
            Blocked::LinkLocal => "link_local",
            Blocked::Metadata => "metadata",
            Blocked::Multicast => "multicast",
            Blocked::Reserved => "reserved",
            Blocked::HostAddress => "host_address",
        }
    }
}

const V4: &[([u8; 4], u8, Blocked)] = &[
    ([0, 0, 0, 0], 8, Blocked::Unspecified),
    ([10, 0, 0, 0], 8, Blocked::Private),
    ([100, 64, 0, 0], 10, Blocked::SharedNat),
    ([127, 0, 0, 0], 8, Blocked::Loopback),
    ([168, 63, 129, 16], 32, Blocked::Metadata),
    ([169, 254, 0, 0], 16, Blocked::LinkLocal),
    ([172, 16, 0, 0], 12, Blocked::Private),
    ([192, 0, 0, 0], 24, Blocked::Reserved),
    ([192, 0, 2, 0], 24, Blocked::Reserved),
    ([192, 88, 99, 0], 24, Blocked::Reserved),
    ([192, 168, 0, 0], 16, Blocked::Private),
    ([198, 18, 0, 0], 15, Blocked::Reserved),
    ([198, 51, 100, 0], 24, Blocked::Reserved),
    ([203, 0, 113, 0], 24, Blocked::Reserved),
    ([224, 0, 0, 0], 4, Blocked::Multicast),
    ([255, 255, 255, 255], 32, Blocked::Multicast),
    ([240, 0, 0, 0], 4, Blocked::Reserved),
];

const V6: &[([u16; 8], u8, Blocked)] = &[
    ([0x0064, 0xff9b, 1, 0, 0, 0, 0, 0], 48, Blocked::Reserved),
    ([0x0100, 0, 0, 0, 0, 0, 0, 0], 64, Blocked::Reserved),
    ([0x2001, 0, 0, 0, 0, 0, 0, 0], 23, Blocked::Reserved),
    ([0x2001, 0x0db8, 0, 0, 0, 0, 0, 0], 32, Blocked::Reserved),
    ([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7, Blocked::Private),
    ([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10, Blocked::LinkLocal),
    ([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10, Blocked::Reserved),
    ([0xff00, 0, 0, 0, 0, 0, 0, 0], 8, Blocked::Multicast),
];

fn in_v4(a: Ipv4Addr, net: [u8; 4], len: u8) -> bool {
    let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
    u32::from(a) & mask == u32::from(Ipv4Addr::from(net)) & mask
}

fn in_v6(a: Ipv6Addr, net: [u16; 8], len: u8) -> bool {
    let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
    u128::from(a) & mask == u128::from(Ipv6Addr::from(net)) & mask
}

/// Why `addr` must not be connected to, or `None` if it is a public address.
pub fn blocked(addr: IpAddr) -> Option<Blocked> {
    match addr {
        IpAddr::V4(a) => blocked_v4(a),
        IpAddr::V6(a) => blocked_v6(a),
    }
}

fn blocked_v6(a: Ipv6Addr) -> Option<Blocked> {
    let v = u128::from(a);
    let low32 = Ipv4Addr::from((v & 0xffff_ffff) as u32);
    if v <= 1 {
        return Some(if v == 0 {
            Blocked::Unspecified
        } else {
            Blocked::Loopback
        });
    }
    // Forms that carry an IPv4 address are judged by it. Mapped (::ffff:a.b.c.d), SIIT's
    // translated (::ffff:0:a.b.c.d) and NAT64 (64:ff9b::a.b.c.d) reach that IPv4 host, public
    // or not; compatible (::a.b.c.d, deprecated) and 6to4 (2002:AABB:CCDD::) are never a
    // legitimate target, so only their reason differs.
    if embedded_v4(a).is_some() || in_v6(a, [0x0064, 0xff9b, 0, 0, 0, 0, 0, 0], 96) {
        return blocked_v4(low32);
    }
    if in_v6(a, [0; 8], 96) {
        return blocked_v4(low32).or(Some(Blocked::Reserved));
    }
    if in_v6(a, [0x2002, 0, 0, 0, 0, 0, 0, 0], 16) {
        let embedded = Ipv4Addr::from(((v >> 80) & 0xffff_ffff) as u32);
        return blocked_v4(embedded).or(Some(Blocked::Reserved));
    }
    V6.iter()
        .find(|(net, len, _)| in_v6(a, *net, *len))
        .map(|(_, _, why)| *why)
}

/// The IPv4 address a NAT64 address (`64:ff9b::/96`, RFC 6052's well-known prefix) reaches through
/// the network's translator.
pub(crate) fn nat64_v4(a: Ipv6Addr) -> Option<Ipv4Addr> {
    in_v6(a, [0x0064, 0xff9b, 0, 0, 0, 0, 0, 0], 96)
        .then(|| Ipv4Addr::from((u128::from(a) & 0xffff_ffff) as u32))
}

/// The IPv4 address an IPv4-mapped (`::ffff:0:0/96`) or SIIT-translated (`::ffff:0:0:0/96`)
/// IPv6 address stands for: the same host, whichever form names it.
pub(crate) fn embedded_v4(a: Ipv6Addr) -> Option<Ipv4Addr> {
    let v = u128::from(a);
    (in_v6(a, [0, 0, 0, 0, 0, 0xffff, 0, 0], 96) || in_v6(a, [0, 0, 0, 0, 0xffff, 0, 0, 0], 96))
        .then(|| Ipv4Addr::from((v & 0xffff_ffff) as u32))
}

fn blocked_v4(a: Ipv4Addr) -> Option<Blocked> {
    V4.iter()
        .find(|(net, len, _)| in_v4(a, *net, *len))
        .map(|(_, _, why)| *why)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Option<Blocked> {
        blocked(s.parse().unwrap())
    }

    #[test]
    fn internal_ipv4_ranges_are_refused() {
        for (a, why) in [
            ("0.0.0.0", Blocked::Unspecified),
            ("10.1.2.3", Blocked::Private),
            ("100.100.100.200", Blocked::SharedNat),
            ("127.0.0.1", Blocked::Loopback),
            ("127.255.255.254", Blocked::Loopback),
            ("169.254.169.254", Blocked::LinkLocal),
            ("169.254.170.2", Blocked::LinkLocal),
            ("168.63.129.16", Blocked::Metadata),
            ("172.16.0.1", Blocked::Private),
            ("172.31.255.255", Blocked::Private),
            ("192.168.1.1", Blocked::Private),
            ("192.0.0.170", Blocked::Reserved),
            ("198.18.0.1", Blocked::Reserved),
            ("198.19.255.254", Blocked::Reserved),
            ("224.0.0.1", Blocked::Multicast),
            ("255.255.255.255", Blocked::Multicast),
            ("240.0.0.1", Blocked::Reserved),
        ] {
            assert_eq!(b(a), Some(why), "{a}");
        }
    }

    #[test]
    fn public_addresses_pass() {
        for a in [
            "1.1.1.1",
            "8.8.8.8",
            "172.15.255.255",
            "172.32.0.0",
            "100.63.255.255",
            "100.128.0.0",
            "168.63.129.17",
            "198.17.255.255",
            "198.20.0.0",
            "2606:4700::1111",
            "2a00:1450:4001:80b::200e",
        ] {
            assert_eq!(b(a), None, "{a}");
        }
    }

    #[test]
    fn ipv6_forms_are_judged_by_what_they_mean() {
        assert_eq!(b("::"), Some(Blocked::Unspecified));
        assert_eq!(b("::1"), Some(Blocked::Loopback));
        assert_eq!(b("fe80::1"), Some(Blocked::LinkLocal));
        assert_eq!(b("fd00:ec2::254"), Some(Blocked::Private));
        assert_eq!(b("fc00::1"), Some(Blocked::Private));
        assert_eq!(b("ff02::1"), Some(Blocked::Multicast));
        assert_eq!(b("2001:db8::1"), Some(Blocked::Reserved));
        assert_eq!(b("2001::1"), Some(Blocked::Reserved), "Teredo");
        // Embedded IPv4: internal stays internal, public stays public.
        assert_eq!(b("::ffff:127.0.0.1"), Some(Blocked::Loopback));
        assert_eq!(b("::ffff:169.254.169.254"), Some(Blocked::LinkLocal));
        assert_eq!(b("::ffff:8.8.8.8"), None);
        // SIIT (RFC 7915's IPv4-translated form): the IPv4 host it names.
        assert_eq!(b("::ffff:0:127.0.0.1"), Some(Blocked::Loopback));
        assert_eq!(b("::ffff:0:169.254.169.254"), Some(Blocked::LinkLocal));
        assert_eq!(b("::ffff:0:10.0.0.1"), Some(Blocked::Private));
        assert_eq!(b("::ffff:0:8.8.8.8"), None);
        assert_eq!(b("::10.0.0.1"), Some(Blocked::Private));
        assert_eq!(b("64:ff9b::7f00:1"), Some(Blocked::Loopback));
        assert_eq!(b("64:ff9b::808:808"), None);
        assert_eq!(b("64:ff9b:1::1"), Some(Blocked::Reserved));
        assert_eq!(b("2002:7f00:1::"), Some(Blocked::Loopback));
        assert_eq!(b("2002:a9fe:a9fe::1"), Some(Blocked::LinkLocal));
        assert_eq!(
            b("2002:808:808::1"),
            Some(Blocked::Reserved),
            "6to4 is never a target"
        );
    }
}
