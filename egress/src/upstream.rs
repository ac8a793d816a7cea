//! The connection out: the pinned name is resolved again at connect time (so a DNS answer that
//! changed to an internal address since is caught), every address is checked, and the stack
//! connects to exactly an address it checked.
//!
//! Who connects is a [`Dial`]: [`Direct`] here, in the process that runs the stack (tests,
//! benches), or the service on behalf of a network process that has no network of its own
//! (`sandbox_net::dial`), which calls [`connect`] itself.

use std::sync::Arc;

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use async_trait::async_trait;
use thiserror::Error;
use tokio::net::TcpStream;

use crate::addr::Blocked;
use crate::resolve::{ResolveOverrides, check_target};

/// How long resolving may take.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting may take, over all addresses.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why no connection was made.
#[derive(Debug, Error)]
pub enum UpstreamError {
    /// The name did not resolve.
    #[error("resolving {name}: {source}")]
    Resolve {
        /// The name.
        name: String,
        /// What the resolver said.
        source: io::Error,
    },
    /// An address of the name is internal: the whole name is refused (a name that mixes public
    /// and internal answers is not trusted with either).
    #[error("{name} resolves to {addr}, a {} address", why.as_str())]
    Internal {
        /// The name.
        name: String,
        /// The internal address.
        addr: SocketAddr,
        /// Its range.
        why: Blocked,
    },
    /// No address accepted the connection.
    #[error("connecting to {name}: {source}")]
    Connect {
        /// The name.
        name: String,
        /// The last error.
        source: io::Error,
    },
}

/// Name resolution, replaceable in tests (a resolver that changes its answers, for rebinding).
#[async_trait]
pub trait Resolve: Send + Sync {
    /// The addresses of `name:port`.
    async fn lookup(&self, name: &str, port: u16) -> io::Result<Vec<SocketAddr>>;
}

/// The host's resolver.
#[derive(Debug, Default)]
pub struct SystemResolver;

#[async_trait]
impl Resolve for SystemResolver {
    async fn lookup(&self, name: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
        Ok(tokio::net::lookup_host((name, port)).await?.collect())
    }
}

/// Makes the stack's upstream connections.
#[async_trait]
pub trait Dial: Send + Sync {
    /// A connection to `port` of `name`, to an address that was checked, and that address.
    async fn dial(&self, name: &str, port: u16) -> Result<(TcpStream, SocketAddr), UpstreamError>;
}

/// Connects from this process: [`connect`] with these overrides and this resolver.
pub struct Direct {
    /// The operator's overrides.
    pub overrides: Arc<ResolveOverrides>,
    /// The resolver of every other name.
    pub resolver: Arc<dyn Resolve>,
}

#[async_trait]
impl Dial for Direct {
    async fn dial(&self, name: &str, port: u16) -> Result<(TcpStream, SocketAddr), UpstreamError> {
        connect(name, port, &self.overrides, &*self.resolver).await
    }
}

/// Resolves `name` (operator overrides first), checks every address, and connects to the first
/// that answers, IPv4 first.
pub async fn connect(
    name: &str,
    port: u16,
    overrides: &ResolveOverrides,
    resolver: &dyn Resolve,
) -> Result<(TcpStream, SocketAddr), UpstreamError> {
    let (mut addrs, from_override) = match overrides.lookup(name, port) {
        Some(a) => (a, true),
        None => {
            let found = tokio::time::timeout(RESOLVE_TIMEOUT, resolver.lookup(name, port))
                .await
                .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "timed out")))
                .map_err(|source| UpstreamError::Resolve {
                    name: name.to_string(),
                    source,
                })?;
            (found, false)
        }
    };
    if addrs.is_empty() {
        return Err(UpstreamError::Resolve {
            name: name.to_string(),
            source: io::Error::new(io::ErrorKind::NotFound, "no addresses"),
        });
    }
    for a in &addrs {
        check_target(a.ip(), from_override).map_err(|why| UpstreamError::Internal {
            name: name.to_string(),
            addr: *a,
            why,
        })?;
    }
    addrs.sort_by_key(|a| a.is_ipv6());
    addrs.truncate(8);
    let attempt = async {
        let mut last = io::Error::new(io::ErrorKind::NotFound, "no addresses");
        for a in &addrs {
            match TcpStream::connect(a).await {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok((s, *a));
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    };
    tokio::time::timeout(CONNECT_TIMEOUT, attempt)
        .await
        .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "timed out")))
        .map_err(|source| UpstreamError::Connect {
            name: name.to_string(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A resolver whose answers the test sets (DNS rebinding: public first, internal later).
    struct Fixed(Mutex<Vec<SocketAddr>>);

    #[async_trait]
    impl Resolve for Fixed {
        async fn lookup(&self, _: &str, _: u16) -> io::Result<Vec<SocketAddr>> {
            Ok(self.0.lock().unwrap().clone())
        }
    }

    #[tokio::test]
    async fn overrides_reach_loopback_and_answers_are_checked_each_time() {
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        let o = ResolveOverrides::parse(&format!("api.example.com:{port}:127.0.0.1")).unwrap();
        let (_s, addr) = connect("api.example.com", port, &o, &SystemResolver)
            .await
            .unwrap();
        assert_eq!(addr.port(), port);

        // Without an override the same loopback answer is refused, as is any internal one, and a
        // name that answers public and internal addresses at once.
        let r = Fixed(Mutex::new(vec![
            format!("127.0.0.1:{port}").parse().unwrap(),
        ]));
        let none = ResolveOverrides::default();
        let e = connect("a.example.com", port, &none, &r).await.unwrap_err();
        assert!(
            matches!(
                e,
                UpstreamError::Internal {
                    why: Blocked::Loopback,
                    ..
                }
            ),
            "{e}"
        );
        *r.0.lock().unwrap() = vec![
            "93.184.215.14:443".parse().unwrap(),
            "[::ffff:169.254.169.254]:443".parse().unwrap(),
        ];
        let e = connect("a.example.com", 443, &none, &r).await.unwrap_err();
        assert!(
            matches!(
                e,
                UpstreamError::Internal {
                    why: Blocked::LinkLocal,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("link_local"), "{e}");
        // An override may not point at other internal ranges.
        let bad = ResolveOverrides::parse("x.example.com:80:10.0.0.1").unwrap();
        assert!(matches!(
            connect("x.example.com", 80, &bad, &SystemResolver).await,
            Err(UpstreamError::Internal {
                why: Blocked::Private,
                ..
            })
        ));
    }

    #[tokio::test]
    async fn refused_connections_say_so() {
        // A port nobody listens on (bound, then closed).
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let o = ResolveOverrides::parse(&format!("down.example.com:{port}:127.0.0.1")).unwrap();
        let e = connect("down.example.com", port, &o, &SystemResolver)
            .await
            .unwrap_err();
        assert!(matches!(e, UpstreamError::Connect { .. }), "{e}");
    }
}
