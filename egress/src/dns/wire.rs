//! DNS messages as the guest's stub resolver sends them (RFC 1035): one question, no compression
//! in the query, at most 512 bytes; and the answers the stack sends back. Everything here is
//! guest-controlled input: every length is checked against the buffer, and nothing allocates more
//! than the 512 bytes a query may have.

use std::net::Ipv4Addr;

use thiserror::Error;

/// Largest query accepted (classic UDP DNS; EDNS cannot raise it here).
pub const MAX_QUERY: usize = 512;
/// Time to live of every answer: long enough that resolvers do not ask again for each connection.
pub const TTL_SECS: u32 = 300;

/// Resource record types the stack cares about.
pub mod qtype {
    /// IPv4 address.
    pub const A: u16 = 1;
    /// IPv6 address.
    pub const AAAA: u16 = 28;
    /// EDNS(0) pseudo-record.
    pub const OPT: u16 = 41;
}

/// Why a query is not one the stack answers normally.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DnsWireError {
    /// Shorter than a header, or the question runs past the end.
    #[error("truncated DNS message")]
    Truncated,
    /// More than [`MAX_QUERY`] bytes.
    #[error("DNS query of {0} bytes (at most 512)")]
    TooLong(usize),
    /// A response, a non-QUERY opcode, not exactly one question, answers in a query, or more
    /// than one additional record.
    #[error("not a standard query with one question")]
    NotAQuery,
    /// A compression pointer, a label over 63 bytes, a name over 255 bytes, or a byte that is
    /// not printable ASCII.
    #[error("malformed name in DNS query")]
    BadName,
}

/// A parsed query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    /// The id to echo.
    pub id: u16,
    /// Recursion desired (echoed).
    pub rd: bool,
    /// The name, lowercase ASCII, without the trailing dot.
    pub name: String,
    /// The type asked for.
    pub qtype: u16,
    /// The class asked for (1 = IN).
    pub qclass: u16,
    /// The question section as received, echoed in the answer.
    question: Vec<u8>,
}

/// What to answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// One A record.
    A(Ipv4Addr),
    /// The name exists but has no record of the type asked for (AAAA, TXT, …).
    NoData,
    /// The name does not exist (not allowed).
    NxDomain,
    /// The stack cannot answer (its address table is full).
    ServFail,
    /// The query was malformed.
    FormErr,
}

fn u16_at(b: &[u8], i: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*b.get(i)?, *b.get(i + 1)?]))
}

/// Parses a query from the guest.
pub fn parse_query(buf: &[u8]) -> Result<Query, DnsWireError> {
    if buf.len() > MAX_QUERY {
        return Err(DnsWireError::TooLong(buf.len()));
    }
    if buf.len() < 12 {
        return Err(DnsWireError::Truncated);
    }
    let id = u16_at(buf, 0).ok_or(DnsWireError::Truncated)?;
    let flags = u16_at(buf, 2).ok_or(DnsWireError::Truncated)?;
    let (qd, an, ns, ar) = (
        u16_at(buf, 4).unwrap_or(0),
        u16_at(buf, 6).unwrap_or(0),
        u16_at(buf, 8).unwrap_or(0),
        u16_at(buf, 10).unwrap_or(0),
    );
    let is_response = flags & 0x8000 != 0;
    let opcode = (flags >> 11) & 0xf;
    if is_response || opcode != 0 || qd != 1 || an != 0 || ns != 0 || ar > 1 {
        return Err(DnsWireError::NotAQuery);
    }
    let mut i = 12;
    let mut name = String::new();
    loop {
        let len = usize::from(*buf.get(i).ok_or(DnsWireError::Truncated)?);
        i += 1;
        if len == 0 {
            break;
        }
        // 0xC0 is a compression pointer, 0x40/0x80 reserved label types: none belong in a query.
        if len > 63 {
            return Err(DnsWireError::BadName);
        }
        let label = buf.get(i..i + len).ok_or(DnsWireError::Truncated)?;
        if !label.iter().all(|b| b.is_ascii_graphic() && *b != b'.') {
            return Err(DnsWireError::BadName);
        }
        if !name.is_empty() {
            name.push('.');
        }
        name.extend(label.iter().map(|b| char::from(b.to_ascii_lowercase())));
        if name.len() > 253 {
            return Err(DnsWireError::BadName);
        }
        i += len;
    }
    let qtype = u16_at(buf, i).ok_or(DnsWireError::Truncated)?;
    let qclass = u16_at(buf, i + 2).ok_or(DnsWireError::Truncated)?;
    i += 4;
    // The only additional record allowed is EDNS's OPT, which we read no further than its type.
    if ar == 1 {
        let root = *buf.get(i).ok_or(DnsWireError::Truncated)?;
        if root != 0 || u16_at(buf, i + 1) != Some(qtype::OPT) {
            return Err(DnsWireError::NotAQuery);
        }
    }
    Ok(Query {
        id,
        rd: flags & 0x0100 != 0,
        name,
        qtype,
        qclass,
        question: buf[12..i].to_vec(),
    })
}

/// The response to `q`: the question echoed, and for [`Answer::A`] one record pointing back at
/// the question's name.
pub fn response(q: &Query, answer: Answer) -> Vec<u8> {
    let rcode: u16 = match answer {
        Answer::A(_) | Answer::NoData => 0,
        Answer::FormErr => 1,
        Answer::ServFail => 2,
        Answer::NxDomain => 3,
    };
    // QR, the RD bit echoed, RA (we answer as a recursive resolver would), and the rcode.
    let flags = 0x8000 | (u16::from(q.rd) << 8) | 0x0080 | rcode;
    let ancount: u16 = u16::from(matches!(answer, Answer::A(_)));
    let mut out = Vec::with_capacity(12 + q.question.len() + 16);
    for v in [q.id, flags, 1, ancount, 0, 0] {
        out.extend_from_slice(&v.to_be_bytes());
    }
    out.extend_from_slice(&q.question);
    if let Answer::A(ip) = answer {
        out.extend_from_slice(&0xc00cu16.to_be_bytes()); // the name at offset 12
        out.extend_from_slice(&qtype::A.to_be_bytes());
        out.extend_from_slice(&1u16.to_be_bytes()); // IN
        out.extend_from_slice(&TTL_SECS.to_be_bytes());
        out.extend_from_slice(&4u16.to_be_bytes());
        out.extend_from_slice(&ip.octets());
    }
    out
}

/// A FORMERR for a message too broken to parse, when at least its id can be read; `None` for
/// anything that does not even look like a query (it is dropped).
pub fn format_error(buf: &[u8]) -> Option<Vec<u8>> {
    let id = u16_at(buf, 0)?;
    let flags = u16_at(buf, 2)?;
    if flags & 0x8000 != 0 {
        return None; // never answer a response: no reflection loops
    }
    let mut out = Vec::with_capacity(12);
    for v in [id, 0x8081, 0, 0, 0, 0] {
        out.extend_from_slice(&v.to_be_bytes());
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A query as glibc sends it.
    fn query(id: u16, name: &str, qt: u16) -> Vec<u8> {
        let mut q = Vec::new();
        for v in [id, 0x0100, 1, 0, 0, 0] {
            q.extend_from_slice(&v.to_be_bytes());
        }
        for l in name.split('.') {
            q.push(l.len() as u8);
            q.extend_from_slice(l.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qt.to_be_bytes());
        q.extend_from_slice(&1u16.to_be_bytes());
        q
    }

    #[test]
    fn a_query_and_its_answer() {
        let q = parse_query(&query(0x1234, "Api.Example.COM", qtype::A)).unwrap();
        assert_eq!(
            (q.id, q.name.as_str(), q.qtype, q.qclass, q.rd),
            (0x1234, "api.example.com", 1, 1, true)
        );
        let r = response(&q, Answer::A(Ipv4Addr::new(198, 18, 0, 1)));
        assert_eq!(&r[0..2], &[0x12, 0x34]);
        assert_eq!(u16_at(&r, 2), Some(0x8180));
        assert_eq!(u16_at(&r, 6), Some(1), "one answer");
        assert_eq!(&r[r.len() - 4..], &[198, 18, 0, 1]);
        assert_eq!(&r[r.len() - 10..r.len() - 6], &TTL_SECS.to_be_bytes());
        let nx = response(&q, Answer::NxDomain);
        assert_eq!(u16_at(&nx, 2), Some(0x8183));
        assert_eq!(u16_at(&nx, 6), Some(0));
        let aaaa = parse_query(&query(7, "a.com", qtype::AAAA)).unwrap();
        assert_eq!(u16_at(&response(&aaaa, Answer::NoData), 2), Some(0x8180));
    }

    #[test]
    fn edns_is_accepted_and_other_additions_are_not() {
        let mut q = query(1, "a.com", qtype::A);
        q[11] = 1; // ARCOUNT
        q.extend_from_slice(&[0, 0, 41, 0x10, 0, 0, 0, 0, 0, 0, 0]);
        assert!(parse_query(&q).is_ok());
        let n = q.len();
        q[n - 10] = 1; // not OPT
        assert_eq!(parse_query(&q), Err(DnsWireError::NotAQuery));
    }

    #[test]
    fn hostile_queries_are_refused_without_panics() {
        let good = query(9, "a.example.com", qtype::A);
        // Every truncation.
        for n in 0..good.len() {
            assert!(parse_query(&good[..n]).is_err(), "{n}");
        }
        // A compression pointer, a long label, a response, two questions, a dot in a label.
        let mut ptr = query(9, "a.com", qtype::A);
        ptr[12] = 0xc0;
        assert!(parse_query(&ptr).is_err());
        let long = query(9, &format!("{}.com", "a".repeat(64)), qtype::A);
        assert_eq!(parse_query(&long), Err(DnsWireError::BadName));
        let mut resp = good.clone();
        resp[2] |= 0x80;
        assert_eq!(parse_query(&resp), Err(DnsWireError::NotAQuery));
        assert_eq!(format_error(&resp), None, "never answer a response");
        let mut two = good.clone();
        two[5] = 2;
        assert_eq!(parse_query(&two), Err(DnsWireError::NotAQuery));
        assert_eq!(parse_query(&vec![0; 513]), Err(DnsWireError::TooLong(513)));
        let mut dot = query(9, "ab.com", qtype::A);
        dot[14] = b'.';
        assert_eq!(parse_query(&dot), Err(DnsWireError::BadName));
        // A name over 253 bytes made of legal labels.
        let huge = query(9, &vec!["a".repeat(60); 5].join("."), qtype::A);
        assert_eq!(parse_query(&huge), Err(DnsWireError::BadName));
        assert_eq!(u16_at(&format_error(&good).unwrap(), 2), Some(0x8081));
        // Random bytes: no panic, no answer bigger than a header plus the query.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 64) as usize;
            let mut b: Vec<u8> = (0..len).map(|i| (x >> (i % 8 * 8)) as u8).collect();
            if b.len() > 5 {
                b[2] &= 0x07; // mostly queries
                b[4] = 0;
                b[5] = 1;
            }
            if let Ok(q) = parse_query(&b) {
                assert!(response(&q, Answer::NoData).len() <= 12 + b.len());
            }
        }
    }
}
