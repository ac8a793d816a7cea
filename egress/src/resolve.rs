//! `SANDBOX_HOST_EGRESS_RESOLVE`: fixed answers for chosen `name:port` pairs, like curl's
//! `--resolve`, so tests can point an allowed name at a server on this machine without any
//! traffic leaving it. Such an entry may point at loopback, which the internal-range rule refuses
//! for every other answer; any other internal address stays refused.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use thiserror::Error;

use crate::addr::{Blocked, blocked};
use crate::policy::normalize;

/// The variable the overrides come from, named in every error about them.
pub const VAR: &str = "SANDBOX_HOST_EGRESS_RESOLVE";

/// Why the overrides cannot be used.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ResolveError {
    /// An entry is not `name:port:address`.
    #[error(
        "{VAR}: `{0}` is not `name:port:address` (e.g. `api.example.com:443:127.0.0.1`, IPv6 in \
         brackets: `api.example.com:443:[::1]`); entries are separated by commas"
    )]
    BadEntry(String),
}

/// The fixed answers, by normalized name and port.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolveOverrides {
    map: BTreeMap<(String, u16), Vec<IpAddr>>,
}

impl ResolveOverrides {
    /// Parses the variable's value; empty means none. Repeated `name:port` entries add addresses.
    pub fn parse(value: &str) -> Result<Self, ResolveError> {
        let mut map: BTreeMap<(String, u16), Vec<IpAddr>> = BTreeMap::new();
        for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = || ResolveError::BadEntry(entry.to_string());
            let mut parts = entry.splitn(3, ':');
            let (Some(name), Some(port), Some(addr)) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(bad());
            };
            let name = normalize(name).ok_or_else(bad)?;
            let port: u16 = port.parse().ok().filter(|p| *p != 0).ok_or_else(bad)?;
            let addr = addr
                .strip_prefix('[')
                .and_then(|a| a.strip_suffix(']'))
                .unwrap_or(addr);
            let ip: IpAddr = addr.parse().map_err(|_| bad())?;
            if ip.is_ipv6() && !entry.ends_with(']') {
                return Err(bad());
            }
            map.entry((name, port)).or_default().push(ip);
        }
        Ok(ResolveOverrides { map })
    }

    /// The fixed answer for `name:port`, if there is one.
    pub fn lookup(&self, name: &str, port: u16) -> Option<Vec<SocketAddr>> {
        let name = normalize(name)?;
        self.map
            .get(&(name, port))
            .map(|ips| ips.iter().map(|ip| SocketAddr::new(*ip, port)).collect())
    }

    /// Every `name:port` with a fixed answer.
    pub fn routes(&self) -> impl Iterator<Item = (&str, u16)> {
        self.map.keys().map(|(n, p)| (n.as_str(), *p))
    }

    /// The overrides as the variable spells them (what [`ResolveOverrides::parse`] reads back),
    /// for a process that is given them as text.
    pub fn to_value(&self) -> String {
        let mut out = Vec::new();
        for ((name, port), ips) in &self.map {
            for ip in ips {
                out.push(match ip {
                    IpAddr::V4(a) => format!("{name}:{port}:{a}"),
                    IpAddr::V6(a) => format!("{name}:{port}:[{a}]"),
                });
            }
        }
        out.join(",")
    }

    /// Whether there is no override.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Whether a connection may go to `addr`: public addresses that are not the machine's own;
/// loopback only when an operator override named it; every other internal address never.
pub fn check_target(addr: IpAddr, from_override: bool) -> Result<(), Blocked> {
    judge(addr, from_override, crate::host_addrs::is_host_address)
}

fn judge(
    addr: IpAddr,
    from_override: bool,
    is_host: impl Fn(IpAddr) -> bool,
) -> Result<(), Blocked> {
    match blocked(addr) {
        Some(Blocked::Loopback) if from_override => Ok(()),
        Some(why) => Err(why),
        None if is_host(addr) => Err(Blocked::HostAddress),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse_like_curls_resolve() {
        let o = ResolveOverrides::parse(
            " api.Example.com:443:127.0.0.1, api.example.com:443:[::1],other.test:8080:127.0.0.2 ",
        )
        .unwrap();
        assert_eq!(
            o.lookup("API.example.com.", 443).unwrap(),
            vec![
                "127.0.0.1:443".parse::<SocketAddr>().unwrap(),
                "[::1]:443".parse().unwrap()
            ]
        );
        assert_eq!(o.lookup("api.example.com", 80), None);
        assert_eq!(o.lookup("other.test", 8080).unwrap().len(), 1);
        assert!(ResolveOverrides::parse("").unwrap().is_empty());
        // Given to a network process as text, it reads back the same.
        assert_eq!(ResolveOverrides::parse(&o.to_value()).unwrap(), o);
        assert_eq!(ResolveOverrides::default().to_value(), "");
    }

    #[test]
    fn bad_entries_name_the_variable() {
        for bad in [
            "a.com:443",
            "a.com:0:127.0.0.1",
            "a.com:99999:127.0.0.1",
            "a.com:443:localhost",
            "a.com:443:::1",
            "127.0.0.1:443:127.0.0.1",
            ":443:127.0.0.1",
        ] {
            let e = ResolveOverrides::parse(bad).unwrap_err().to_string();
            assert!(e.starts_with("SANDBOX_HOST_EGRESS_RESOLVE: `"), "{e}");
        }
    }

    #[test]
    fn overrides_may_reach_loopback_and_nothing_else_internal() {
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        assert_eq!(check_target(lo, true), Ok(()));
        assert_eq!(check_target(lo, false), Err(Blocked::Loopback));
        let md: IpAddr = "169.254.169.254".parse().unwrap();
        assert_eq!(check_target(md, true), Err(Blocked::LinkLocal));
        assert_eq!(check_target("8.8.8.8".parse().unwrap(), false), Ok(()));
        // A public address of the machine itself (this one's are all in internal ranges, so
        // the list is given): refused, in its mapped forms too, even from an override.
        let own: Vec<IpAddr> = vec!["8.8.4.4".parse().unwrap()];
        let is_host = |a| crate::host_addrs::is_among(a, &own);
        for a in ["8.8.4.4", "::ffff:8.8.4.4", "::ffff:0:8.8.4.4"] {
            for from_override in [false, true] {
                assert_eq!(
                    judge(a.parse().unwrap(), from_override, is_host),
                    Err(Blocked::HostAddress),
                    "{a}"
                );
            }
        }
        assert_eq!(judge("8.8.8.8".parse().unwrap(), false, is_host), Ok(()));
    }
}
