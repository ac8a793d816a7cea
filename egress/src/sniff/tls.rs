//! The ClientHello of a guest's TLS connection, read across any split into TCP segments and TLS
//! records (RFC 8446 §4.1.2, §5.1), for the server name (SNI, RFC 6066 §3), the ALPN protocols
//! (RFC 7301) and whether Encrypted Client Hello is offered. The bytes are kept so a spliced
//! connection can send them on unchanged.

use thiserror::Error;

/// Largest ClientHello message accepted (a post-quantum key share makes them about 1.8 KiB).
pub const MAX_HELLO: usize = 16 * 1024;
/// Most records a ClientHello may be split into.
pub const MAX_RECORDS: usize = 8;
/// Most raw bytes kept while reading (records carry a 5-byte header each).
pub const MAX_RAW: usize = MAX_HELLO + MAX_RECORDS * 5;

const HANDSHAKE: u8 = 0x16;
const CLIENT_HELLO: u8 = 0x01;
const EXT_SNI: u16 = 0;
const EXT_ALPN: u16 = 16;
const EXT_ECH: u16 = 0xfe0d;

/// Why the first bytes are not a ClientHello we let through.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TlsSniffError {
    /// A record that is not a handshake record, or not TLS at all.
    #[error("not a TLS handshake")]
    NotHandshake,
    /// The first handshake message is not a ClientHello.
    #[error("the first TLS handshake message is not a ClientHello")]
    NotClientHello,
    /// Over [`MAX_HELLO`] bytes or [`MAX_RECORDS`] records, or a record over 16 KiB.
    #[error("the ClientHello is too large")]
    TooLarge,
    /// A length that does not fit, or a field out of its range.
    #[error("malformed ClientHello")]
    Malformed,
    /// The SNI extension holds no host name, two, or one that is not ASCII text.
    #[error("malformed server name in the ClientHello")]
    BadServerName,
}

/// What the ClientHello says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClientHello {
    /// The server name, as sent (checked against the pinned name by the caller).
    pub server_name: Option<String>,
    /// ALPN protocols offered, in order.
    pub alpn: Vec<String>,
    /// Whether an Encrypted Client Hello extension is present (the outer SNI is what counts).
    pub ech: bool,
}

/// Reads a ClientHello from guest bytes as they arrive.
#[derive(Debug, Default)]
pub struct HelloReader {
    raw: Vec<u8>,
    parsed_to: usize,
    records: usize,
    handshake: Vec<u8>,
}

impl HelloReader {
    /// A reader that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every byte received so far, to send upstream when the connection is spliced.
    pub fn raw(&self) -> &[u8] {
        &self.raw
    }

    /// Takes the next bytes; `Ok(None)` means the ClientHello is not complete yet.
    pub fn feed(&mut self, data: &[u8]) -> Result<Option<ClientHello>, TlsSniffError> {
        if self.raw.len() + data.len() > MAX_RAW {
            return Err(TlsSniffError::TooLarge);
        }
        self.raw.extend_from_slice(data);
        loop {
            let rest = &self.raw[self.parsed_to..];
            if rest.is_empty() {
                return Ok(None);
            }
            if rest[0] != HANDSHAKE {
                return Err(TlsSniffError::NotHandshake);
            }
            if rest.len() < 5 {
                return Ok(None);
            }
            if rest[1] != 3 {
                return Err(TlsSniffError::NotHandshake);
            }
            let len = usize::from(u16::from_be_bytes([rest[3], rest[4]]));
            if len == 0 {
                return Err(TlsSniffError::Malformed);
            }
            if len > 16 * 1024 {
                return Err(TlsSniffError::TooLarge);
            }
            if rest.len() < 5 + len {
                return Ok(None);
            }
            self.records += 1;
            if self.records > MAX_RECORDS {
                return Err(TlsSniffError::TooLarge);
            }
            self.handshake.extend_from_slice(&rest[5..5 + len]);
            self.parsed_to += 5 + len;
            if self.handshake.len() >= 4 {
                if self.handshake[0] != CLIENT_HELLO {
                    return Err(TlsSniffError::NotClientHello);
                }
                let hl = usize::from(self.handshake[1]) << 16
                    | usize::from(self.handshake[2]) << 8
                    | usize::from(self.handshake[3]);
                if hl > MAX_HELLO {
                    return Err(TlsSniffError::TooLarge);
                }
                if self.handshake.len() >= 4 + hl {
                    return parse_body(&self.handshake[4..4 + hl]).map(Some);
                }
            }
        }
    }
}

/// A cursor over a byte slice whose every read is checked.
struct Cur<'a>(&'a [u8]);

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], TlsSniffError> {
        if self.0.len() < n {
            return Err(TlsSniffError::Malformed);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, TlsSniffError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, TlsSniffError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    /// A vector with a `width`-byte length prefix.
    fn vec(&mut self, width: usize) -> Result<Cur<'a>, TlsSniffError> {
        let n = match width {
            1 => usize::from(self.u8()?),
            _ => usize::from(self.u16()?),
        };
        Ok(Cur(self.take(n)?))
    }
}

fn parse_body(body: &[u8]) -> Result<ClientHello, TlsSniffError> {
    let mut c = Cur(body);
    let _legacy_version = c.u16()?;
    c.take(32)?; // random
    if c.vec(1)?.0.len() > 32 {
        return Err(TlsSniffError::Malformed); // legacy session id
    }
    let suites = c.vec(2)?;
    if suites.0.is_empty() || suites.0.len() % 2 != 0 {
        return Err(TlsSniffError::Malformed);
    }
    if c.vec(1)?.0.is_empty() {
        return Err(TlsSniffError::Malformed); // compression methods
    }
    let mut hello = ClientHello::default();
    if c.0.is_empty() {
        return Ok(hello); // no extensions at all (a very old client)
    }
    let mut exts = c.vec(2)?;
    if !c.0.is_empty() {
        return Err(TlsSniffError::Malformed);
    }
    let mut seen: Vec<u16> = Vec::new();
    while !exts.0.is_empty() {
        let ty = exts.u16()?;
        let mut data = exts.vec(2)?;
        // RFC 8446 §4.2: no two extensions of one type. Bounded: a 16 KiB hello holds at most
        // 4096 empty extensions, and the list is searched once per extension.
        if seen.contains(&ty) {
            return Err(TlsSniffError::Malformed);
        }
        seen.push(ty);
        match ty {
            EXT_SNI => hello.server_name = Some(server_name(&mut data)?),
            EXT_ALPN => {
                let mut list = data.vec(2)?;
                while !list.0.is_empty() {
                    let p = list.vec(1)?;
                    if p.0.is_empty() {
                        return Err(TlsSniffError::Malformed);
                    }
                    hello.alpn.push(String::from_utf8_lossy(p.0).into_owned());
                }
            }
            EXT_ECH => hello.ech = true,
            _ => {}
        }
    }
    Ok(hello)
}

fn server_name(data: &mut Cur<'_>) -> Result<String, TlsSniffError> {
    let mut list = data.vec(2).map_err(|_| TlsSniffError::BadServerName)?;
    let mut name = None;
    while !list.0.is_empty() {
        let kind = list.u8().map_err(|_| TlsSniffError::BadServerName)?;
        let n = list.vec(2).map_err(|_| TlsSniffError::BadServerName)?;
        if kind != 0 {
            continue; // not host_name: no other type is defined
        }
        if name.is_some()
            || n.0.is_empty()
            || n.0.len() > 255
            || !n.0.iter().all(|b| b.is_ascii_graphic())
        {
            return Err(TlsSniffError::BadServerName);
        }
        name = Some(String::from_utf8_lossy(n.0).into_owned());
    }
    name.ok_or(TlsSniffError::BadServerName)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn vec16(b: &[u8]) -> Vec<u8> {
        let mut v = (b.len() as u16).to_be_bytes().to_vec();
        v.extend_from_slice(b);
        v
    }

    fn ext(ty: u16, data: &[u8]) -> Vec<u8> {
        let mut v = ty.to_be_bytes().to_vec();
        v.extend(vec16(data));
        v
    }

    /// A TLS 1.3 ClientHello like a browser's: SNI, ALPN h2 and http/1.1, a 1216-byte
    /// post-quantum key share, split into records of at most `record` bytes.
    pub(crate) fn client_hello(sni: Option<&str>, record: usize) -> Vec<u8> {
        let mut exts = Vec::new();
        if let Some(s) = sni {
            let mut entry = vec![0u8];
            entry.extend(vec16(s.as_bytes()));
            exts.extend(ext(EXT_SNI, &vec16(&entry)));
        }
        let mut alpn = Vec::new();
        for p in ["h2", "http/1.1"] {
            alpn.push(p.len() as u8);
            alpn.extend_from_slice(p.as_bytes());
        }
        exts.extend(ext(EXT_ALPN, &vec16(&alpn)));
        exts.extend(ext(43, &[2, 3, 4])); // supported_versions: TLS 1.3
        let mut share = 0x11ecu16.to_be_bytes().to_vec();
        share.extend(vec16(&[0x42; 1216]));
        exts.extend(ext(51, &vec16(&share))); // key_share
        let mut body = vec![3, 3];
        body.extend([7u8; 32]);
        body.push(32);
        body.extend([9u8; 32]);
        body.extend(vec16(&[0x13, 0x01, 0x13, 0x02]));
        body.extend([1, 0]);
        body.extend(vec16(&exts));
        let mut hs = vec![CLIENT_HELLO];
        hs.extend(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend(body);
        let mut out = Vec::new();
        for chunk in hs.chunks(record) {
            out.extend([HANDSHAKE, 3, 1]);
            out.extend(vec16(chunk));
        }
        out
    }

    #[test]
    fn reads_the_name_whatever_the_segments_and_records() {
        for record in [16 * 1024, 700, 300] {
            let hello = client_hello(Some("api.anthropic.com"), record);
            for seg in [hello.len(), 100, 7, 1] {
                let mut r = HelloReader::new();
                let mut got = None;
                for (i, chunk) in hello.chunks(seg).enumerate() {
                    match r.feed(chunk).unwrap() {
                        Some(h) => {
                            assert_eq!(i, hello.len().div_ceil(seg) - 1, "only at the end");
                            got = Some(h);
                        }
                        None => assert!(got.is_none()),
                    }
                }
                let h = got.expect("complete");
                assert_eq!(h.server_name.as_deref(), Some("api.anthropic.com"));
                assert_eq!(h.alpn, ["h2", "http/1.1"]);
                assert!(!h.ech);
                assert_eq!(r.raw(), &hello[..], "kept for the splice");
            }
        }
    }

    #[test]
    fn missing_or_doubled_names_and_non_tls_are_refused() {
        let mut r = HelloReader::new();
        assert_eq!(
            r.feed(&client_hello(None, 16384))
                .unwrap()
                .unwrap()
                .server_name,
            None
        );
        assert_eq!(
            HelloReader::new().feed(b"GET / HTTP/1.1\r\n"),
            Err(TlsSniffError::NotHandshake)
        );
        assert_eq!(
            HelloReader::new().feed(&[0x16, 2, 0, 0, 1]),
            Err(TlsSniffError::NotHandshake)
        );
        // Two host names in one SNI extension.
        let mut entry = vec![0u8];
        entry.extend(vec16(b"a.com"));
        entry.push(0);
        entry.extend(vec16(b"b.com"));
        let mut c = Cur(&[]);
        let list = vec16(&entry);
        c.0 = &list;
        assert_eq!(server_name(&mut c), Err(TlsSniffError::BadServerName));
        // A ServerHello is not a ClientHello.
        let mut sh = client_hello(Some("a.com"), 16384);
        sh[5] = 2;
        assert_eq!(
            HelloReader::new().feed(&sh),
            Err(TlsSniffError::NotClientHello)
        );
    }

    #[test]
    fn oversized_and_garbage_input_is_bounded() {
        // A handshake length far beyond the cap is refused at once, not waited for.
        let mut r = HelloReader::new();
        assert_eq!(
            r.feed(&[0x16, 3, 1, 0, 4, 1, 0xff, 0xff, 0xff]),
            Err(TlsSniffError::TooLarge)
        );
        // More raw bytes than any hello may have.
        let mut r = HelloReader::new();
        assert_eq!(
            r.feed(&vec![0x16; MAX_RAW + 1]),
            Err(TlsSniffError::TooLarge)
        );
        // Nine one-byte records.
        let mut r = HelloReader::new();
        let mut res = Ok(None);
        for _ in 0..9 {
            res = r.feed(&[0x16, 3, 1, 0, 1, 1]);
            if res.is_err() {
                break;
            }
        }
        assert_eq!(res, Err(TlsSniffError::TooLarge));
        // Every truncation of a valid hello asks for more; every corruption of one byte either
        // parses or is refused, without panicking.
        let hello = client_hello(Some("x.example.com"), 512);
        for n in 0..hello.len() {
            assert_eq!(HelloReader::new().feed(&hello[..n]), Ok(None), "{n}");
        }
        for i in 0..hello.len() {
            for v in [0u8, 0xff, hello[i].wrapping_add(1)] {
                let mut h = hello.clone();
                h[i] = v;
                let _ = HelloReader::new().feed(&h);
            }
        }
    }
}
