//! The head of a guest's plain HTTP/1 request: its method, target and the one Host it names.
//! CONNECT (a tunnel to anywhere) and the HTTP/2 cleartext preface are told apart so they can be
//! refused by name.

use thiserror::Error;

/// Largest request head accepted.
pub const MAX_HEAD: usize = 32 * 1024;
/// Most header fields accepted.
pub const MAX_HEADERS: usize = 100;

/// Why a request head is refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum HttpSniffError {
    /// Not HTTP/1 (httparse's verdict, or no method token at all).
    #[error("not an HTTP/1 request")]
    NotHttp,
    /// The HTTP/2 cleartext preface (`PRI * HTTP/2.0`).
    #[error("HTTP/2 without TLS is not supported")]
    H2Cleartext,
    /// A CONNECT request.
    #[error("HTTP CONNECT is refused")]
    Connect,
    /// Over [`MAX_HEAD`] bytes or [`MAX_HEADERS`] fields.
    #[error("the request head is too large")]
    TooLarge,
    /// No Host, several, or one that is empty or not ASCII.
    #[error("the request must name exactly one Host")]
    BadHost,
}

/// A request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    /// The method.
    pub method: String,
    /// The request target as sent (origin-form `/path`, or absolute-form `http://host/path`).
    pub target: String,
    /// The Host header's value, as sent.
    pub host: String,
    /// The authority of an absolute-form target, which must agree with Host.
    pub target_authority: Option<String>,
    /// Bytes of the head (the body, if any, starts after them).
    pub head_len: usize,
}

/// Parses the head from the bytes received so far; `Ok(None)` means it is not complete yet.
pub fn parse_head(buf: &[u8]) -> Result<Option<RequestHead>, HttpSniffError> {
    if buf.starts_with(b"PRI * HTTP/2.0") || b"PRI * HTTP/2.0".starts_with(buf) && !buf.is_empty() {
        return if buf.len() >= 14 {
            Err(HttpSniffError::H2Cleartext)
        } else {
            Ok(None)
        };
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let status = match req.parse(buf) {
        Ok(s) => s,
        Err(httparse::Error::TooManyHeaders) => return Err(HttpSniffError::TooLarge),
        Err(_) => return Err(HttpSniffError::NotHttp),
    };
    let head_len = match status {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial if buf.len() >= MAX_HEAD => return Err(HttpSniffError::TooLarge),
        httparse::Status::Partial => return Ok(None),
    };
    if head_len > MAX_HEAD {
        return Err(HttpSniffError::TooLarge);
    }
    let method = req.method.ok_or(HttpSniffError::NotHttp)?;
    if method.eq_ignore_ascii_case("CONNECT") {
        return Err(HttpSniffError::Connect);
    }
    let target = req.path.ok_or(HttpSniffError::NotHttp)?;
    let mut hosts = req
        .headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("host"));
    let host = match (hosts.next(), hosts.next()) {
        (Some(h), None) => std::str::from_utf8(h.value)
            .ok()
            .map(str::trim)
            .filter(|v| !v.is_empty() && v.is_ascii())
            .ok_or(HttpSniffError::BadHost)?,
        _ => return Err(HttpSniffError::BadHost),
    };
    let target_authority = ["http://", "https://"]
        .iter()
        .find_map(|scheme| {
            target
                .get(..scheme.len())
                .filter(|p| p.eq_ignore_ascii_case(scheme))
                .map(|_| &target[scheme.len()..])
        })
        .map(|rest| rest.split(['/', '?', '#']).next().unwrap_or("").to_string());
    Ok(Some(RequestHead {
        method: method.to_string(),
        target: target.to_string(),
        host: host.to_string(),
        target_authority,
        head_len,
    }))
}

/// Splits `host[:port]` (IPv6 literals in brackets) into the name and the port, if any.
pub fn split_authority(authority: &str) -> Option<(&str, Option<u16>)> {
    if let Some(rest) = authority.strip_prefix('[') {
        let (addr, after) = rest.split_once(']')?;
        return match after.strip_prefix(':') {
            Some(p) => Some((addr, Some(p.parse().ok()?))),
            None if after.is_empty() => Some((addr, None)),
            None => None,
        };
    }
    match authority.rsplit_once(':') {
        Some((h, p)) => Some((h, Some(p.parse().ok()?))),
        None => Some((authority, None)),
    }
}

/// Headers that belong to one hop and never pass (nor carry a secret).
pub(crate) const HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "upgrade",
    "trailer",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_head_names_its_host() {
        let req =
            b"GET /v1/x?y=1 HTTP/1.1\r\nHost: api.example.com:8080\r\nAccept: */*\r\n\r\nBODY";
        for n in 0..req.len() - 4 {
            assert_eq!(parse_head(&req[..n]), Ok(None), "{n}");
        }
        let h = parse_head(req).unwrap().unwrap();
        assert_eq!(
            (h.method.as_str(), h.target.as_str(), h.host.as_str()),
            ("GET", "/v1/x?y=1", "api.example.com:8080")
        );
        assert_eq!(h.head_len, req.len() - 4);
        assert_eq!(h.target_authority, None);
        assert_eq!(
            split_authority(&h.host),
            Some(("api.example.com", Some(8080)))
        );
        let abs = parse_head(b"GET HTTP://Evil.com/x HTTP/1.1\r\nHost: a.com\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(abs.target_authority.as_deref(), Some("Evil.com"));
        assert_eq!(split_authority("[::1]:443"), Some(("::1", Some(443))));
        assert_eq!(split_authority("a.com:x"), None);
    }

    #[test]
    fn tunnels_cleartext_h2_and_ambiguous_hosts_are_refused() {
        assert_eq!(
            parse_head(b"CONNECT a.com:443 HTTP/1.1\r\nHost: a.com:443\r\n\r\n"),
            Err(HttpSniffError::Connect)
        );
        assert_eq!(
            parse_head(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
            Err(HttpSniffError::H2Cleartext)
        );
        assert_eq!(parse_head(b"PRI * HT"), Ok(None));
        assert_eq!(
            parse_head(b"GET / HTTP/1.1\r\n\r\n"),
            Err(HttpSniffError::BadHost)
        );
        assert_eq!(
            parse_head(b"GET / HTTP/1.1\r\nHost: a.com\r\nhost: b.com\r\n\r\n"),
            Err(HttpSniffError::BadHost)
        );
        assert_eq!(
            parse_head(b"GET / HTTP/1.1\r\nHost: \r\n\r\n"),
            Err(HttpSniffError::BadHost)
        );
        assert_eq!(
            parse_head(b"\x16\x03\x01\x02\x00"),
            Err(HttpSniffError::NotHttp)
        );
        assert_eq!(
            parse_head(b"SSH-2.0-OpenSSH_9.2\r\n"),
            Err(HttpSniffError::NotHttp)
        );
    }

    #[test]
    fn heads_are_bounded() {
        let mut many = b"GET / HTTP/1.1\r\nHost: a.com\r\n".to_vec();
        for i in 0..MAX_HEADERS {
            many.extend(format!("X-{i}: 1\r\n").as_bytes());
        }
        many.extend(b"\r\n");
        assert_eq!(parse_head(&many), Err(HttpSniffError::TooLarge));
        let mut long = b"GET / HTTP/1.1\r\nHost: a.com\r\nX: ".to_vec();
        long.resize(MAX_HEAD, b'a');
        assert_eq!(parse_head(&long), Err(HttpSniffError::TooLarge));
    }
}
