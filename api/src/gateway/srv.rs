//! SRV records of a fleet's hosts (`SANDBOX_HOST_GATEWAY_DNS=http://_api._tcp.<name>`): each
//! record names a host and its port (RFC 2782), as a Kubernetes headless Service publishes its
//! named ports. The system's resolver (`getaddrinfo`) has no SRV lookup, so the query goes to
//! the servers of `/etc/resolv.conf` itself: over UDP, again over TCP when the answer is
//! truncated, each bounded in time; `simple-dns` builds the query and reads the answer (every
//! length checked, compression loops refused). The targets' addresses are then asked of the
//! system's resolver when a connection is made, as for any host URL.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use simple_dns::rdata::RData;
use simple_dns::{CLASS, Name, Packet, PacketFlag, QCLASS, QTYPE, Question, RCODE, TYPE};
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long one server has to answer one query.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);
/// The most servers and search domains of `/etc/resolv.conf` used (the resolver's own limits).
const SERVERS: usize = 3;
const SEARCH: usize = 6;
/// The most records taken of one answer.
const RECORDS: usize = 256;
/// The largest answer read over TCP (a DNS message's own limit).
const TCP_MAX: usize = 65_535;

/// Why the SRV records could not be had.
#[derive(Debug, Error)]
pub enum SrvError {
    /// The name cannot be put in a query.
    #[error("`{0}` is not a DNS name")]
    BadName(String),
    /// No server answered, or every answer was unusable.
    #[error("no DNS server of /etc/resolv.conf answered for `{name}` ({why})")]
    NoAnswer {
        /// The name asked.
        name: String,
        /// The last failure.
        why: String,
    },
    /// The name does not exist, with or without the search domains.
    #[error("`{0}` does not exist (NXDOMAIN)")]
    NoSuchName(String),
}

/// A host an SRV record names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Target {
    /// Its DNS name, without the trailing dot.
    pub host: String,
    /// Its port.
    pub port: u16,
}

/// The servers, search domains and `ndots` of a `resolv.conf`.
#[derive(Debug, PartialEq, Eq)]
struct Conf {
    servers: Vec<SocketAddr>,
    search: Vec<String>,
    ndots: usize,
}

impl Default for Conf {
    fn default() -> Conf {
        Conf {
            servers: vec![],
            search: vec![],
            ndots: 1,
        }
    }
}

fn parse_conf(text: &str) -> Conf {
    let mut conf = Conf::default();
    for line in text.lines().take(1000) {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("nameserver") => {
                if let Some(ip) = words.next().and_then(|w| w.parse::<IpAddr>().ok())
                    && conf.servers.len() < SERVERS
                {
                    conf.servers.push(SocketAddr::new(ip, 53));
                }
            }
            Some("search" | "domain") => {
                conf.search = words
                    .take(SEARCH)
                    .map(|w| w.trim_end_matches('.').to_string())
                    .collect();
            }
            Some("options") => {
                for w in words {
                    if let Some(n) = w.strip_prefix("ndots:").and_then(|n| n.parse().ok()) {
                        conf.ndots = std::cmp::min(n, 15);
                    }
                }
            }
            _ => {}
        }
    }
    if conf.servers.is_empty() {
        // What the C library does without a nameserver line.
        conf.servers
            .push(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 53));
    }
    conf
}

/// The names to ask for `name`, in the C library's order: as given first only when it ends
/// with a dot or has at least `ndots` dots; else the search domains' first (a short name such
/// as `_api._tcp.hosts.prod` must not go to the public DNS, where `prod` is a real domain,
/// before the cluster's).
fn candidates(name: &str, conf: &Conf) -> Vec<String> {
    let bare = name.trim_end_matches('.');
    if name.ends_with('.') {
        return vec![bare.to_string()];
    }
    let searched = conf.search.iter().map(|d| format!("{bare}.{d}"));
    if bare.matches('.').count() >= conf.ndots {
        std::iter::once(bare.to_string()).chain(searched).collect()
    } else {
        searched.chain(std::iter::once(bare.to_string())).collect()
    }
}

/// The SRV records of `name` (with `/etc/resolv.conf`'s search domains, as the C library
/// orders them): sorted, at most 256, each target a host name under the zone the records are
/// of (`_api._tcp.<zone>`), since the gateway sends those hosts its token. `Ok` with none is
/// an answer that names no host: the caller keeps the hosts it had.
pub async fn lookup(name: &str) -> Result<Vec<Target>, SrvError> {
    let conf = parse_conf(
        &tokio::fs::read_to_string("/etc/resolv.conf")
            .await
            .unwrap_or_default(),
    );
    let bare = name.trim_end_matches('.');
    let names = candidates(name, &conf);
    let mut why = String::from("no server");
    for candidate in &names {
        for server in &conf.servers {
            match ask(*server, candidate).await {
                Ok(Some(targets)) => return Ok(targets),
                // This name does not exist: the next one (a search domain's).
                Ok(None) => {
                    why = format!("{candidate}: NXDOMAIN");
                    break;
                }
                Err(e) => why = format!("{server}: {e}"),
            }
        }
    }
    if why.ends_with("NXDOMAIN") {
        return Err(SrvError::NoSuchName(bare.to_string()));
    }
    Err(SrvError::NoAnswer {
        name: bare.to_string(),
        why,
    })
}

/// One question to one server: the targets, or `None` for NXDOMAIN.
async fn ask(server: SocketAddr, name: &str) -> Result<Option<Vec<Target>>, String> {
    let id: u16 = rand_id();
    let query = query(id, name).map_err(|e| e.to_string())?;
    let answer = tokio::time::timeout(ANSWER_TIMEOUT, over_udp(server, &query, id))
        .await
        .map_err(|_| format!("no answer within {ANSWER_TIMEOUT:?}"))??;
    // From the header itself: a truncated answer may not parse whole.
    let truncated = answer.get(2).is_some_and(|b| b & 0x02 != 0);
    let answer = if truncated {
        tokio::time::timeout(ANSWER_TIMEOUT, over_tcp(server, &query))
            .await
            .map_err(|_| format!("no answer over TCP within {ANSWER_TIMEOUT:?}"))??
    } else {
        answer
    };
    targets(&answer, id, name)
}

fn query(id: u16, name: &str) -> Result<Vec<u8>, SrvError> {
    let mut p = Packet::new_query(id);
    p.set_flags(PacketFlag::RECURSION_DESIRED);
    let qname = Name::new(name).map_err(|_| SrvError::BadName(name.to_string()))?;
    p.questions.push(Question::new(
        qname,
        QTYPE::TYPE(TYPE::SRV),
        QCLASS::CLASS(CLASS::IN),
        false,
    ));
    p.build_bytes_vec()
        .map_err(|_| SrvError::BadName(name.to_string()))
}

/// An id no one on the path can guess in advance (the answer must echo it): from the system's
/// random source, through rustls' provider.
fn rand_id() -> u16 {
    let mut b = [0u8; 2];
    match rustls::crypto::ring::default_provider()
        .secure_random
        .fill(&mut b)
    {
        Ok(()) => u16::from_ne_bytes(b),
        Err(_) => std::process::id() as u16,
    }
}

async fn over_udp(server: SocketAddr, query: &[u8], id: u16) -> Result<Vec<u8>, String> {
    let local: SocketAddr = if server.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = tokio::net::UdpSocket::bind(local)
        .await
        .map_err(|e| e.to_string())?;
    sock.connect(server).await.map_err(|e| e.to_string())?;
    sock.send(query).await.map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 4096];
    // Datagrams that are not the answer (another id) are dropped; the caller's timeout bounds it.
    loop {
        let n = sock.recv(&mut buf).await.map_err(|e| e.to_string())?;
        if n >= 2 && u16::from_be_bytes([buf[0], buf[1]]) == id {
            buf.truncate(n);
            return Ok(buf);
        }
    }
}

async fn over_tcp(server: SocketAddr, query: &[u8]) -> Result<Vec<u8>, String> {
    let mut tcp = tokio::net::TcpStream::connect(server)
        .await
        .map_err(|e| e.to_string())?;
    let len = u16::try_from(query.len()).map_err(|_| "query too long".to_string())?;
    let mut out = len.to_be_bytes().to_vec();
    out.extend_from_slice(query);
    tcp.write_all(&out).await.map_err(|e| e.to_string())?;
    let n = tcp.read_u16().await.map_err(|e| e.to_string())? as usize;
    let mut buf = vec![0u8; n.min(TCP_MAX)];
    tcp.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
    Ok(buf)
}

/// The SRV records of an answer to query `id` for `name`: `None` for NXDOMAIN. Only records
/// of `name` whose target is a host name under `name`'s zone (what follows `_service._proto.`)
/// count.
fn targets(answer: &[u8], id: u16, name: &str) -> Result<Option<Vec<Target>>, String> {
    let p = Packet::parse(answer).map_err(|e| format!("an answer that is not DNS ({e})"))?;
    if p.id() != id || !p.has_flags(PacketFlag::RESPONSE) {
        return Err("not an answer to this query".into());
    }
    let asked = |n: &Name| {
        n.to_string()
            .trim_end_matches('.')
            .eq_ignore_ascii_case(name)
    };
    if p.questions.len() != 1
        || !asked(&p.questions[0].qname)
        || p.questions[0].qtype != QTYPE::TYPE(TYPE::SRV)
    {
        return Err("an answer to another question".into());
    }
    let zone = zone_of(name);
    match p.rcode() {
        RCODE::NoError => {}
        RCODE::NameError => return Ok(None),
        other => return Err(format!("the server answered {other:?}")),
    }
    let mut out: Vec<Target> = p
        .answers
        .iter()
        .take(RECORDS)
        .filter(|rr| asked(&rr.name))
        .filter_map(|rr| match &rr.rdata {
            RData::SRV(srv) if srv.port != 0 && srv.target.is_valid_hostname() => Some(Target {
                host: srv.target.to_string().trim_end_matches('.').to_lowercase(),
                port: srv.port,
            }),
            _ => None,
        })
        // "." is RFC 2782's "no such service here"; a target elsewhere is not this fleet's.
        .filter(|t| {
            !t.host.is_empty() && t.host.len() > zone.len() && t.host.ends_with(&format!(".{zone}"))
        })
        .collect();
    out.sort();
    out.dedup();
    Ok(Some(out))
}

/// The zone of an SRV name: what follows its `_service._proto.` labels, lowercase.
fn zone_of(name: &str) -> String {
    let mut labels = name.trim_end_matches('.').splitn(3, '.');
    match (labels.next(), labels.next(), labels.next()) {
        (Some(s), Some(p), Some(zone)) if s.starts_with('_') && p.starts_with('_') => {
            zone.to_lowercase()
        }
        _ => name.trim_end_matches('.').to_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use simple_dns::ResourceRecord;
    use simple_dns::rdata::SRV;

    #[test]
    fn resolv_conf_gives_servers_and_search_domains() {
        let c = parse_conf(
            "# k8s\nnameserver 10.96.0.10\nsearch ns.svc.cluster.local svc.cluster.local\n\
             options ndots:5\nnameserver fd00::10\nnameserver 1.1.1.1\nnameserver 8.8.8.8\n",
        );
        assert_eq!(c.servers.len(), 3);
        assert_eq!(c.servers[0], "10.96.0.10:53".parse().unwrap());
        assert_eq!(c.search, ["ns.svc.cluster.local", "svc.cluster.local"]);
        assert_eq!(
            parse_conf("").servers,
            vec![SocketAddr::from(([127, 0, 0, 1], 53))]
        );
    }

    const ASKED: &str = "_api._tcp.hosts.test";

    fn answer(id: u16, rcode: RCODE, records: &[(&str, u16)]) -> Vec<u8> {
        let mut p = Packet::new_reply(id);
        *p.rcode_mut() = rcode;
        p.questions.push(Question::new(
            Name::new_unchecked(ASKED),
            QTYPE::TYPE(TYPE::SRV),
            QCLASS::CLASS(CLASS::IN),
            false,
        ));
        for (target, port) in records {
            p.answers.push(ResourceRecord::new(
                Name::new_unchecked(ASKED),
                CLASS::IN,
                30,
                RData::SRV(SRV {
                    priority: 0,
                    weight: 10,
                    port: *port,
                    target: Name::new_unchecked(target),
                }),
            ));
        }
        p.build_bytes_vec_compressed().unwrap()
    }

    #[test]
    fn answers_give_targets_and_refuse_what_is_not_one() {
        let a = answer(
            7,
            RCODE::NoError,
            &[("h1.hosts.test", 3004), ("H0.Hosts.Test.", 3005)],
        );
        assert_eq!(
            targets(&a, 7, ASKED).unwrap().unwrap(),
            vec![
                Target {
                    host: "h0.hosts.test".into(),
                    port: 3005
                },
                Target {
                    host: "h1.hosts.test".into(),
                    port: 3004
                },
            ]
        );
        // Another query's id or question, NXDOMAIN, a refusal, port 0, and bytes that are not
        // DNS.
        assert!(targets(&a, 8, ASKED).is_err());
        assert!(targets(&a, 7, "_api._tcp.other.test").is_err());
        assert_eq!(
            targets(&answer(7, RCODE::NameError, &[]), 7, ASKED),
            Ok(None)
        );
        assert!(targets(&answer(7, RCODE::Refused, &[]), 7, ASKED).is_err());
        assert_eq!(
            targets(&answer(7, RCODE::NoError, &[("h.hosts.test", 0)]), 7, ASKED),
            Ok(Some(vec![]))
        );
        // Targets outside the zone asked, or that are not host names, are not the fleet's.
        for bad in [
            "evil.example",
            "hosts.test",
            "a@b.hosts.test",
            "xhosts.test",
        ] {
            assert_eq!(
                targets(&answer(7, RCODE::NoError, &[(bad, 3004)]), 7, ASKED),
                Ok(Some(vec![])),
                "{bad}"
            );
        }
        // Our own query echoed back is no answer.
        assert!(targets(&query(7, ASKED).unwrap(), 7, ASKED).is_err());
        for junk in [&b""[..], &[0u8; 11], &[0xff; 40]] {
            assert!(targets(junk, 0, ASKED).is_err());
        }
        // A name whose compression pointer points at itself.
        let mut looped = answer(7, RCODE::NoError, &[("h.hosts.test", 1)]);
        let at = looped.len() - 2;
        looped[at] = 0xc0;
        looped[at + 1] = at as u8;
        let _ = targets(&looped, 7, ASKED);
    }

    #[test]
    fn short_names_go_to_the_search_domains_first() {
        let conf = parse_conf("search ns.svc.cluster.local\noptions ndots:5\n");
        assert_eq!(conf.ndots, 5);
        assert_eq!(
            candidates("_api._tcp.hosts.prod", &conf),
            [
                "_api._tcp.hosts.prod.ns.svc.cluster.local",
                "_api._tcp.hosts.prod"
            ]
        );
        assert_eq!(
            candidates("_a._tcp.h.example.", &conf),
            ["_a._tcp.h.example"]
        );
        let conf = parse_conf("search example\n");
        assert_eq!(
            candidates("_api._tcp.hosts.test", &conf),
            ["_api._tcp.hosts.test", "_api._tcp.hosts.test.example"]
        );
        assert_eq!(zone_of("_api._tcp.Hosts.Test."), "hosts.test");
    }

    #[test]
    fn queries_are_standard_srv_questions() {
        let q = query(0x1234, "_api._tcp.hosts.test").unwrap();
        let p = Packet::parse(&q).unwrap();
        assert_eq!(p.id(), 0x1234);
        assert_eq!(p.questions.len(), 1);
        assert_eq!(p.questions[0].qtype, QTYPE::TYPE(TYPE::SRV));
        assert!(query(1, &"a".repeat(300)).is_err());
    }
}
