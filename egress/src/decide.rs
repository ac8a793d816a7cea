//! What to do with a guest connection, from its first bytes and the name its destination address
//! stands for: splice TLS straight through, intercept it (the host holds a secret or is metered),
//! proxy plain HTTP, or refuse with a reason.

use crate::policy::{HostPattern, normalize};
use crate::refusal::Reason;
use crate::sniff::http::{self, HttpSniffError};
use crate::sniff::tls::{HelloReader, TlsSniffError};

/// The decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Not enough bytes yet.
    NeedMore,
    /// TLS to a host we need not read: copy bytes both ways, the guest verifies the server.
    Splice,
    /// TLS to a secret or meter host: terminate with the sandbox CA.
    Intercept,
    /// Plain HTTP/1: through the proxy, which checks every request.
    Http,
    /// Refuse the connection.
    Refuse(Reason),
}

/// Reads a connection's first bytes until it can decide.
#[derive(Debug)]
pub struct Decider {
    pinned: String,
    port: u16,
    intercept: Vec<HostPattern>,
    hello: HelloReader,
    http: Vec<u8>,
}

impl Decider {
    /// For a connection to `port` of the address handed out for `pinned`; `intercept` are the
    /// secret and meter hosts.
    pub fn new(pinned: &str, port: u16, intercept: Vec<HostPattern>) -> Self {
        Decider {
            pinned: pinned.to_string(),
            port,
            intercept,
            hello: HelloReader::new(),
            http: Vec::new(),
        }
    }

    /// Every byte received so far (to send on when spliced or proxied).
    pub fn received(&self) -> &[u8] {
        if self.http.is_empty() {
            self.hello.raw()
        } else {
            &self.http
        }
    }

    /// Takes the next bytes.
    pub fn feed(&mut self, bytes: &[u8]) -> Decision {
        let first = self
            .hello
            .raw()
            .first()
            .or(self.http.first())
            .or(bytes.first());
        match first {
            None => Decision::NeedMore,
            Some(0x16) => self.tls(bytes),
            Some(b) if b.is_ascii_uppercase() => self.plain(bytes),
            Some(_) => Decision::Refuse(Reason::Protocol),
        }
    }

    fn tls(&mut self, bytes: &[u8]) -> Decision {
        match self.hello.feed(bytes) {
            Ok(None) => Decision::NeedMore,
            Err(
                TlsSniffError::TooLarge
                | TlsSniffError::Malformed
                | TlsSniffError::NotHandshake
                | TlsSniffError::NotClientHello,
            ) => Decision::Refuse(Reason::Protocol),
            Err(TlsSniffError::BadServerName) => Decision::Refuse(Reason::SniHostMismatch),
            Ok(Some(hello)) => {
                let Some(sni) = hello.server_name else {
                    return Decision::Refuse(Reason::SniMissing);
                };
                let Some(name) = normalize(&sni) else {
                    return Decision::Refuse(if sni.parse::<std::net::IpAddr>().is_ok() {
                        Reason::IpLiteral
                    } else {
                        Reason::SniHostMismatch
                    });
                };
                if name != self.pinned {
                    return Decision::Refuse(Reason::SniHostMismatch);
                }
                if self.intercept.iter().any(|p| p.matches(&name)) {
                    Decision::Intercept
                } else if hello.ech {
                    // The outer name is checked, the inner one is encrypted: it could name any
                    // host behind the same front. Only interception would read it.
                    Decision::Refuse(Reason::Ech)
                } else {
                    Decision::Splice
                }
            }
        }
    }

    fn plain(&mut self, bytes: &[u8]) -> Decision {
        if self.http.len() + bytes.len() > http::MAX_HEAD + 1 {
            return Decision::Refuse(Reason::Protocol);
        }
        self.http.extend_from_slice(bytes);
        let head = match http::parse_head(&self.http) {
            Ok(None) => return Decision::NeedMore,
            Ok(Some(h)) => h,
            Err(HttpSniffError::Connect) => return Decision::Refuse(Reason::HttpConnect),
            Err(HttpSniffError::BadHost) => return Decision::Refuse(Reason::SniHostMismatch),
            Err(_) => return Decision::Refuse(Reason::Protocol),
        };
        let authorities =
            std::iter::once(head.host.as_str()).chain(head.target_authority.as_deref());
        for authority in authorities {
            let Some((host, port)) = http::split_authority(authority) else {
                return Decision::Refuse(Reason::SniHostMismatch);
            };
            if normalize(host).as_deref() != Some(self.pinned.as_str())
                || port.is_some_and(|p| p != self.port)
            {
                return Decision::Refuse(Reason::SniHostMismatch);
            }
        }
        Decision::Http
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sniff::tls::tests::client_hello;

    fn decider(pinned: &str) -> Decider {
        Decider::new(
            pinned,
            443,
            vec![HostPattern::parse("api.anthropic.com").unwrap()],
        )
    }

    #[test]
    fn tls_is_spliced_or_intercepted_by_name() {
        for (pinned, sni, want) in [
            (
                "registry.npmjs.org",
                Some("registry.npmjs.org"),
                Decision::Splice,
            ),
            (
                "api.anthropic.com",
                Some("API.anthropic.com."),
                Decision::Intercept,
            ),
            (
                "registry.npmjs.org",
                Some("evil.com"),
                Decision::Refuse(Reason::SniHostMismatch),
            ),
            (
                "registry.npmjs.org",
                None,
                Decision::Refuse(Reason::SniMissing),
            ),
            (
                "registry.npmjs.org",
                Some("1.2.3.4"),
                Decision::Refuse(Reason::IpLiteral),
            ),
        ] {
            let hello = client_hello(sni, 200);
            let mut d = decider(pinned);
            let mut got = Decision::NeedMore;
            for c in hello.chunks(3) {
                assert_eq!(got, Decision::NeedMore);
                got = d.feed(c);
            }
            assert_eq!(got, want, "{pinned} {sni:?}");
            assert_eq!(d.received(), &hello[..]);
        }
    }

    #[test]
    fn plain_http_must_name_the_pinned_host() {
        let mut d = Decider::new("example.com", 80, vec![]);
        assert_eq!(d.feed(b"GET / HTTP/1.1\r\nHo"), Decision::NeedMore);
        assert_eq!(d.feed(b"st: Example.com:80\r\n\r\n"), Decision::Http);
        for (req, why) in [
            (
                &b"GET / HTTP/1.1\r\nHost: evil.com\r\n\r\n"[..],
                Reason::SniHostMismatch,
            ),
            (
                b"GET / HTTP/1.1\r\nHost: example.com:8080\r\n\r\n",
                Reason::SniHostMismatch,
            ),
            (
                b"GET http://evil.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n",
                Reason::SniHostMismatch,
            ),
            (
                b"CONNECT evil.com:443 HTTP/1.1\r\nHost: evil.com\r\n\r\n",
                Reason::HttpConnect,
            ),
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", Reason::Protocol),
            (b"SSH-2.0-x\r\n", Reason::Protocol),
            (b"\x00\x01binary", Reason::Protocol),
        ] {
            let mut d = Decider::new("example.com", 80, vec![]);
            assert_eq!(
                d.feed(req),
                Decision::Refuse(why),
                "{}",
                String::from_utf8_lossy(req)
            );
        }
        // A head that never ends is refused once it passes the limit.
        let mut d = Decider::new("example.com", 80, vec![]);
        let mut last = d.feed(b"GET / HTTP/1.1\r\nX: ");
        while last == Decision::NeedMore {
            last = d.feed(&[b'a'; 1000]);
        }
        assert_eq!(last, Decision::Refuse(Reason::Protocol));
        assert!(d.received().len() <= http::MAX_HEAD + 1);
    }
}
