//! Every request the stack refuses, counted per sandbox by reason, with a bounded list of the
//! most recent ones for operators (`GET /v1/sandboxes/{id}/egress`).

use std::collections::VecDeque;
use std::time::SystemTime;

/// Why something the guest sent did not leave.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// DNS query or connection for a name outside the allowlist.
    NameNotAllowed,
    /// A connection to an address the guest did not get from our DNS (an IP literal).
    IpLiteral,
    /// DNS to another server than the stack's (UDP or TCP 53, 853).
    DnsBypass,
    /// UDP other than DNS to the stack (QUIC included).
    Udp,
    /// ICMP other than echo to the gateway.
    Icmp,
    /// IPv6 traffic.
    Ipv6,
    /// An IP protocol other than TCP, UDP and ICMP.
    IpProtocol,
    /// DNS queries above the per-sandbox rate.
    RateLimit,
    /// The per-sandbox table of DNS names is full.
    DnsTableFull,
    /// A connection that is neither TLS nor HTTP/1 (or says nothing), or HTTP/2 without TLS.
    Protocol,
    /// A TLS ClientHello without a server name.
    SniMissing,
    /// The TLS server name or HTTP Host differs from the name the connection's address stands for.
    SniHostMismatch,
    /// An HTTP CONNECT request.
    HttpConnect,
    /// A secret's placeholder in a request to a host it does not belong to.
    PlaceholderLeak,
    /// The name resolves (now) to an internal address.
    InternalAddress,
    /// Too many connections open or opening.
    ConnectionLimit,
    /// A secret's real value (or an encoding of it) in a response of an intercepted host:
    /// masked before it reached the guest.
    SecretEcho,
    /// A connection to a port of an allowed name that its entry does not allow (443 and 80
    /// without a port in the entry).
    PortNotAllowed,
    /// A TLS ClientHello with Encrypted Client Hello on a connection that is not intercepted:
    /// its inner server name cannot be checked.
    Ech,
    /// A model call whose usage the meter could not read, under the run's `meter_strict`.
    Unmeterable,
    /// A request that would carry a secret's value to a path of its host the secret is not for
    /// (its `paths`, or a known provider's inference endpoints).
    PathNotAllowed,
    /// A connection or request beyond the sandbox's egress memory
    /// (`SANDBOX_HOST_EGRESS_MEMORY_MIB`, [`crate::memory`]): its other connections hold it.
    MemoryLimit,
}

impl Reason {
    /// Every reason, for counters that list zeros too.
    pub const ALL: [Reason; 22] = [
        Reason::NameNotAllowed,
        Reason::IpLiteral,
        Reason::DnsBypass,
        Reason::Udp,
        Reason::Icmp,
        Reason::Ipv6,
        Reason::IpProtocol,
        Reason::RateLimit,
        Reason::DnsTableFull,
        Reason::Protocol,
        Reason::SniMissing,
        Reason::SniHostMismatch,
        Reason::HttpConnect,
        Reason::PlaceholderLeak,
        Reason::InternalAddress,
        Reason::ConnectionLimit,
        Reason::SecretEcho,
        Reason::PortNotAllowed,
        Reason::Ech,
        Reason::Unmeterable,
        Reason::PathNotAllowed,
        Reason::MemoryLimit,
    ];

    /// The reason's name in counters, metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::NameNotAllowed => "name_not_allowed",
            Reason::IpLiteral => "ip_literal",
            Reason::DnsBypass => "dns_bypass",
            Reason::Udp => "udp",
            Reason::Icmp => "icmp",
            Reason::Ipv6 => "ipv6",
            Reason::IpProtocol => "ip_protocol",
            Reason::RateLimit => "rate_limit",
            Reason::DnsTableFull => "dns_table_full",
            Reason::Protocol => "protocol",
            Reason::SniMissing => "sni_missing",
            Reason::SniHostMismatch => "sni_host_mismatch",
            Reason::HttpConnect => "http_connect",
            Reason::PlaceholderLeak => "placeholder_leak",
            Reason::InternalAddress => "internal_address",
            Reason::ConnectionLimit => "connection_limit",
            Reason::SecretEcho => "secret_echo",
            Reason::PortNotAllowed => "port_not_allowed",
            Reason::Ech => "ech",
            Reason::Unmeterable => "unmeterable",
            Reason::PathNotAllowed => "path_not_allowed",
            Reason::MemoryLimit => "memory_limit",
        }
    }

    /// The HTTP status a refused request is answered with: `503` for what a retry may get past
    /// (the sandbox's memory is in use), `403` for what policy forbids.
    pub fn status_line(self) -> &'static str {
        match self {
            Reason::MemoryLimit => "503 Service Unavailable",
            _ => "403 Forbidden",
        }
    }
}

/// One refused request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// When.
    pub at: SystemTime,
    /// Why.
    pub reason: Reason,
    /// What the guest asked for (a name, or `address:port`), at most 256 bytes.
    pub target: String,
}

/// Most recent events kept.
pub const EVENTS: usize = 256;

/// The counters and recent events of one sandbox.
#[derive(Debug, Default)]
pub struct Refusals {
    counts: [u64; Reason::ALL.len()],
    events: VecDeque<Event>,
    dropped_events: u64,
}

impl Refusals {
    /// Counts a refusal and remembers it (the oldest event goes when the list is full).
    pub fn record(&mut self, reason: Reason, target: &str) {
        let i = Reason::ALL.iter().position(|r| *r == reason).unwrap_or(0);
        self.counts[i] = self.counts[i].saturating_add(1);
        if self.events.len() == EVENTS {
            self.events.pop_front();
            self.dropped_events = self.dropped_events.saturating_add(1);
        }
        let mut target = target.to_string();
        if target.len() > 256 {
            let mut cut = 256;
            while !target.is_char_boundary(cut) {
                cut -= 1;
            }
            target.truncate(cut);
        }
        self.events.push_back(Event {
            at: SystemTime::now(),
            reason,
            target,
        });
    }

    /// How many refusals of `reason`.
    pub fn count(&self, reason: Reason) -> u64 {
        Reason::ALL
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.counts[i])
    }

    /// All refusals.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The most recent events, oldest first, and how many older ones were let go.
    pub fn events(&self) -> (impl Iterator<Item = &Event>, u64) {
        (self.events.iter(), self.dropped_events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_stay_and_events_are_bounded() {
        let mut r = Refusals::default();
        for i in 0..(EVENTS + 10) {
            r.record(Reason::Udp, &format!("10.0.0.{i}:53"));
        }
        r.record(Reason::NameNotAllowed, &"x".repeat(1000));
        assert_eq!(r.count(Reason::Udp), EVENTS as u64 + 10);
        assert_eq!(r.total(), EVENTS as u64 + 11);
        let (events, dropped) = r.events();
        let events: Vec<_> = events.collect();
        assert_eq!(events.len(), EVENTS);
        assert_eq!(dropped, 11);
        assert_eq!(events.last().unwrap().target.len(), 256);
        assert_eq!(Reason::DnsBypass.as_str(), "dns_bypass");
    }
}
