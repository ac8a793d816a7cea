//! The machine's own addresses. Whatever a name resolves to, a guest never reaches the host it
//! runs on by one of the host's public addresses: the sandbox host's API, a provider proxy or a
//! database bound to `0.0.0.0` would answer there as on loopback (issue 29, item 9).
//!
//! The list comes from the interfaces (`getifaddrs`, through `if-addrs`) and is read again at
//! most once a second: addresses change (DHCP, a VPN coming up), and a connect must not cost a
//! netlink dump each.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a list of the host's addresses is used before it is read again.
const REFRESH: Duration = Duration::from_secs(1);

static CACHE: Mutex<Option<(Instant, Arc<Vec<IpAddr>>)>> = Mutex::new(None);

/// The host's addresses, at most [`REFRESH`] old; `None` when they cannot be read at all.
fn current() -> Option<Arc<Vec<IpAddr>>> {
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((at, list)) = cache.as_ref()
        && at.elapsed() < REFRESH
    {
        return Some(list.clone());
    }
    match if_addrs::get_if_addrs() {
        Ok(ifs) => {
            let list = Arc::new(ifs.into_iter().map(|i| i.ip()).collect::<Vec<_>>());
            *cache = Some((Instant::now(), list.clone()));
            Some(list)
        }
        Err(e) => {
            // The last list stands in until the interfaces can be read again.
            tracing::warn!("cannot list the host's addresses: {e}");
            cache.as_ref().map(|(_, l)| l.clone())
        }
    }
}

/// Whether `addr` is one of `own` (IPv4-mapped, -translated and NAT64 forms judged by their
/// IPv4: on a DNS64 network a name can resolve to the NAT64 form of the host's own address, which
/// the translator sends back to the host).
pub fn is_among(addr: IpAddr, own: &[IpAddr]) -> bool {
    let canon = |a: IpAddr| match a {
        IpAddr::V6(v6) => {
            match crate::addr::embedded_v4(v6).or_else(|| crate::addr::nat64_v4(v6)) {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(v6),
            }
        }
        v4 => v4,
    };
    let addr = canon(addr);
    own.iter().any(|o| canon(*o) == addr)
}

/// Whether `addr` is an address of this machine. Fails closed: if the host's addresses were
/// never readable, every address counts as the host's.
pub fn is_host_address(addr: IpAddr) -> bool {
    match current() {
        Some(own) => is_among(addr, &own),
        None => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_interfaces_are_its_addresses() {
        assert!(is_host_address("127.0.0.1".parse().unwrap()));
        // Every address `ip` lists for this machine (the ones a test here can name).
        let own: Vec<IpAddr> = if_addrs::get_if_addrs()
            .unwrap()
            .into_iter()
            .map(|i| i.ip())
            .collect();
        assert!(!own.is_empty());
        for a in &own {
            assert!(is_host_address(*a), "{a}");
        }
        assert!(
            !is_host_address("8.8.8.8".parse().unwrap())
                || own.contains(&"8.8.8.8".parse().unwrap())
        );
    }

    #[test]
    fn mapped_forms_of_a_host_address_are_the_host() {
        let own: Vec<IpAddr> = vec![
            "203.0.113.5".parse().unwrap(),
            "2001:db8::5".parse().unwrap(),
        ];
        for a in [
            "203.0.113.5",
            "::ffff:203.0.113.5",
            "::ffff:0:203.0.113.5",
            "64:ff9b::cb00:7105",
            "2001:db8::5",
        ] {
            assert!(is_among(a.parse().unwrap(), &own), "{a}");
        }
        for a in ["203.0.113.6", "2001:db8::6", "64:ff9b::cb00:7106"] {
            assert!(!is_among(a.parse().unwrap(), &own), "{a}");
        }
    }
}
