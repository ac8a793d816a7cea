//! The guest's side of the wire, fixed for every sandbox: each guest has a link of its own, so
//! the same addresses never meet.

use std::net::Ipv4Addr;

/// The guest's address.
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(10, 233, 0, 2);
/// The gateway and DNS server the stack answers as.
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(10, 233, 0, 1);
/// The guest's subnet prefix length.
pub const PREFIX_LEN: u8 = 24;
/// The gateway's MAC (locally administered).
pub const GATEWAY_MAC: [u8; 6] = [0x02, 0x53, 0x42, 0x00, 0x00, 0x01];
/// The link MTU: the virtio-net device carries frames of at most 1518 bytes.
pub const MTU: usize = 1500;
/// The first address of the pool DNS answers from (198.18.0.0/15, the benchmarking range: never
/// routed publicly, not private either, and refused as an upstream target).
pub const POOL_FIRST: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// How many names one sandbox may have addresses for.
pub const POOL_NAMES: u32 = 4096;

/// The guest's MAC, derived from the sandbox id so logs can tell guests apart.
pub fn guest_mac(sandbox_id: &str) -> [u8; 6] {
    // FNV-1a: stable across runs and releases, unlike std's hasher.
    let mut h: u32 = 0x811c_9dc5;
    for b in sandbox_id.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    let [a, b, c, _] = h.to_be_bytes();
    [0x02, 0x53, 0x42, a, b, c | 0x02]
}

/// The pool address for the `n`th name (0-based), if the pool has one.
pub fn pool_addr(n: u32) -> Option<Ipv4Addr> {
    if n >= POOL_NAMES {
        return None;
    }
    // Skip host parts 0 and 255 in every /24 so no address looks like a network or broadcast.
    let per_24 = 254;
    let (block, host) = (n / per_24, n % per_24 + 1);
    let base = u32::from(POOL_FIRST) - 1;
    Some(Ipv4Addr::from(base + block * 256 + host))
}

/// Which name number a pool address stands for, the inverse of [`pool_addr`].
pub fn pool_index(addr: Ipv4Addr) -> Option<u32> {
    let base = u32::from(POOL_FIRST) - 1;
    let off = u32::from(addr).checked_sub(base)?;
    let (block, host) = (off / 256, off % 256);
    if host == 0 || host == 255 {
        return None;
    }
    let n = block * 254 + host - 1;
    (n < POOL_NAMES).then_some(n)
}

/// The shell script (run as root in the guest, by the agent) that gives the guest its network:
/// the clock from the host first (when `now_unix_secs` is given) (QEMU's microvm has no real-time clock, and TLS certificates are
/// checked against the clock), IPv6 off (the stack carries IPv4 only), the interface with `mac`
/// up at [`GUEST_IP`] with the default route through [`GATEWAY_IP`], and `/etc/resolv.conf`
/// naming the stack's DNS. It needs only `sh`, `date` and `ip`, which busybox and Debian both
/// have. It may run again in a guest it ran in: a fork's child gets its own CA (or none) and
/// the same address this way.
pub fn guest_setup_script(
    mac: [u8; 6],
    now_unix_secs: Option<u64>,
    ca_pem: Option<&str>,
) -> String {
    let mac = mac
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":");
    format!(
        r#"set -e
{clock}dev=
for d in /sys/class/net/*; do
  [ "$(cat "$d/address" 2>/dev/null)" = "{mac}" ] && dev="${{d##*/}}"
done
[ -n "$dev" ] || {{ echo "no network interface with address {mac}" >&2; exit 1; }}
for f in /proc/sys/net/ipv6/conf/all/disable_ipv6 /proc/sys/net/ipv6/conf/default/disable_ipv6 "/proc/sys/net/ipv6/conf/$dev/disable_ipv6"; do
  [ -e "$f" ] && echo 1 > "$f"
done
ip link set dev lo up
ip link set dev "$dev" mtu {MTU} up
ip addr del {GUEST_IP}/{PREFIX_LEN} dev "$dev" 2>/dev/null || true
ip addr add {GUEST_IP}/{PREFIX_LEN} dev "$dev"
ip route del default 2>/dev/null || true
ip route add default via {GATEWAY_IP} dev "$dev"
mkdir -p /etc
rm -f /etc/resolv.conf
printf 'nameserver {GATEWAY_IP}\noptions attempts:2 timeout:2\n' > /etc/resolv.conf
[ -e /etc/nsswitch.conf ] || printf 'hosts: files dns\n' > /etc/nsswitch.conf
[ -e /etc/hosts ] || printf '127.0.0.1 localhost\n' > /etc/hosts
{ca}"#,
        // Whole seconds only (busybox's `date`): a guest restored from a snapshot had its
        // clock set to the nanosecond by the agent (`Identity`), which this would set back.
        clock = now_unix_secs.map_or(String::new(), |t| format!(
            "date -u -s \"@{t}\" >/dev/null\n"
        )),
        ca = match ca_pem {
            // The sandbox's CA, for the system bundle (the image's own, kept aside the first
            // time, plus this CA: a fork's child replaces its parent's) and for tools with
            // their own stores.
            Some(pem) => format!(
                "mkdir -p /etc/ssl/certs\ncat > {CA_FILE} <<'SANDBOX_EGRESS_CA'\n{}\nSANDBOX_EGRESS_CA\n[ -e {CA_BUNDLE_SYSTEM} ] || {{ cat {CA_BUNDLE} 2>/dev/null || true; }} > {CA_BUNDLE_SYSTEM}\ncat {CA_BUNDLE_SYSTEM} {CA_FILE} > {CA_BUNDLE}\n",
                pem.trim()
            ),
            // None, or no longer one (a fork's child whose run intercepts nothing).
            None => format!(
                "if [ -e {CA_BUNDLE_SYSTEM} ]; then cat {CA_BUNDLE_SYSTEM} > {CA_BUNDLE}; rm -f {CA_FILE}; fi\n"
            ),
        }
    )
}

/// Where the guest keeps the sandbox's CA certificate.
pub const CA_FILE: &str = "/etc/ssl/certs/sandbox-egress-ca.pem";
/// The guest's system bundle, which gets the CA appended.
pub const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// The image's bundle as it was before the first CA was appended.
pub const CA_BUNDLE_SYSTEM: &str = "/etc/ssl/certs/ca-certificates.crt.system";

/// The variables that point TLS clients with their own trust stores at the bundle (Node.js adds
/// `NODE_EXTRA_CA_CERTS` to its built-in roots).
pub fn guest_ca_env() -> [(&'static str, &'static str); 5] {
    [
        ("NODE_EXTRA_CA_CERTS", CA_FILE),
        ("SSL_CERT_FILE", CA_BUNDLE),
        ("REQUESTS_CA_BUNDLE", CA_BUNDLE),
        ("CURL_CA_BUNDLE", CA_BUNDLE),
        ("GIT_SSL_CAINFO", CA_BUNDLE),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_addresses_round_trip_and_stay_in_the_pool() {
        assert_eq!(pool_addr(0), Some(Ipv4Addr::new(198, 18, 0, 1)));
        assert_eq!(pool_addr(253), Some(Ipv4Addr::new(198, 18, 0, 254)));
        assert_eq!(pool_addr(254), Some(Ipv4Addr::new(198, 18, 1, 1)));
        assert_eq!(pool_addr(POOL_NAMES), None);
        for n in 0..POOL_NAMES {
            let a = pool_addr(n).unwrap();
            assert_eq!(pool_index(a), Some(n));
            let o = a.octets();
            assert!(
                o[0] == 198 && (o[1] & 0xfe) == 18 && o[3] != 0 && o[3] != 255,
                "{a}"
            );
        }
        assert_eq!(pool_index(Ipv4Addr::new(198, 18, 0, 0)), None);
        assert_eq!(pool_index(Ipv4Addr::new(198, 18, 0, 255)), None);
        assert_eq!(pool_index(Ipv4Addr::new(10, 0, 0, 1)), None);
        assert_eq!(pool_index(Ipv4Addr::new(198, 19, 255, 254)), None);
    }

    #[test]
    fn guest_macs_are_local_unicast_and_stable() {
        let m = guest_mac("sbx-1");
        assert_eq!(m, guest_mac("sbx-1"));
        assert_ne!(m, guest_mac("sbx-2"));
        assert_eq!(m[0] & 0x01, 0, "unicast");
        assert_eq!(m[0] & 0x02, 0x02, "locally administered");
        assert_ne!(m, GATEWAY_MAC);
    }
}
