//! TLS of the API (issue 33): a host or a gateway serves https when `SANDBOX_HOST_TLS_CERT` and
//! `SANDBOX_HOST_TLS_KEY` name a certificate chain and its key, and what reaches one over https
//! (a gateway its hosts, the operator commands `SANDBOX_HOST_URL`) trusts the authorities of
//! `SANDBOX_HOST_CA_FILE`, else the system's. rustls on ring, as the egress crate's interception.
//!
//! A client's handshake runs in a task of its own, bounded in time (10 s) and in number (1024
//! at once, 8 from one address), so a client that opens connections and never finishes their
//! handshakes holds neither the accept loop nor more than a few slots.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use thiserror::Error;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// The certificate chain a host or gateway serves https with (PEM).
pub const CERT_VAR: &str = "SANDBOX_HOST_TLS_CERT";
/// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
pub const KEY_VAR: &str = "SANDBOX_HOST_TLS_KEY";
/// The authorities trusted for https to a host or a gateway (PEM), instead of the system's.
pub const CA_VAR: &str = "SANDBOX_HOST_CA_FILE";

/// The name a host's certificate is checked against by what reaches it (a gateway, the
/// operator commands) when the URL's host is not that name.
pub const NAME_VAR: &str = "SANDBOX_HOST_TLS_NAME";

/// How long a client has to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes under way at once; past it, connections wait in the kernel's backlog (one costs
/// a task and a few KiB).
const HANDSHAKES: usize = 1024;
/// Handshakes under way at once from one address: past it, its connections are closed at once,
/// so one peer holding handshakes open holds a few slots, not the listener.
const HANDSHAKES_PER_PEER: usize = 8;

/// A TLS setting that cannot be used; each message names the variable and what to do.
#[derive(Debug, Error)]
pub enum TlsError {
    /// One of the two server settings without the other.
    #[error(
        "{CERT_VAR} and {KEY_VAR} go together: set both (the API is served over https) or neither \
         (http)"
    )]
    Half,
    /// A file that could not be read, or is not PEM.
    #[error(
        "{var} is `{path}`, which could not be read as PEM ({why}); give a PEM file the service's user can read"
    )]
    Read {
        /// The setting.
        var: &'static str,
        /// Its value.
        path: String,
        /// What failed.
        why: String,
    },
    /// A PEM file without what it should hold.
    #[error("{var} is `{path}`, which holds no {what}")]
    Empty {
        /// The setting.
        var: &'static str,
        /// Its value.
        path: String,
        /// What is missing.
        what: &'static str,
    },
    /// rustls refused the certificate and key (a key that is not the certificate's, say).
    #[error("the certificate of {CERT_VAR} and the key of {KEY_VAR} cannot serve TLS: {0}")]
    Server(rustls::Error),
    /// The client side could not be made.
    #[error("TLS to hosts cannot be set up: {0}")]
    Client(String),
}

fn read_err(var: &'static str, path: &Path, why: impl std::fmt::Display) -> TlsError {
    TlsError::Read {
        var,
        path: path.display().to_string(),
        why: why.to_string(),
    }
}

fn certificates(var: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| read_err(var, path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| read_err(var, path, e))?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            var,
            path: path.display().to_string(),
            what: "certificate (-----BEGIN CERTIFICATE-----)",
        });
    }
    Ok(certs)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn var(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(Into::into)
}

/// The server side of `SANDBOX_HOST_TLS_CERT` and `SANDBOX_HOST_TLS_KEY`: `None` when neither
/// is set (plain http).
pub fn server_from_env() -> Result<Option<Arc<ServerConfig>>, TlsError> {
    match (var(CERT_VAR), var(KEY_VAR)) {
        (None, None) => Ok(None),
        (Some(cert), Some(key)) => server_config(&cert, &key).map(Some),
        _ => Err(TlsError::Half),
    }
}

/// A server's configuration from a PEM chain and key: TLS 1.2 and 1.3, HTTP/1.1.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = certificates(CERT_VAR, cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => TlsError::Empty {
            var: KEY_VAR,
            path: key.display().to_string(),
            what: "private key (PKCS#8, PKCS#1 or SEC1)",
        },
        e => read_err(KEY_VAR, key, e),
    })?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Server)?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(TlsError::Server)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A client's configuration: the authorities of `SANDBOX_HOST_CA_FILE` when set, else the
/// system's.
pub fn client_config() -> Result<ClientConfig, TlsError> {
    let mut roots = RootCertStore::empty();
    match var(CA_VAR) {
        Some(path) => {
            for c in certificates(CA_VAR, &path)? {
                roots.add(c).map_err(|e| read_err(CA_VAR, &path, e))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                return Err(TlsError::Client(format!(
                    "{CA_VAR} is not set and the system has no certificate authorities to trust \
                     ({:?}); set {CA_VAR} to the PEM file of the authority that signed the \
                     hosts' certificates",
                    found.errors
                )));
            }
        }
    }
    ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map(|b| b.with_root_certificates(roots).with_no_client_auth())
        .map_err(|e| TlsError::Client(e.to_string()))
}

/// A client configuration that trusts no one: for a connector that is only ever given http URLs
/// (it still wants one).
pub fn no_authorities() -> Result<ClientConfig, TlsError> {
    ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map(|b| {
            b.with_root_certificates(RootCertStore::empty())
                .with_no_client_auth()
        })
        .map_err(|e| TlsError::Client(e.to_string()))
}

/// Serves `app` on `listener` until `shutdown` resolves: over TLS with `tls`, else plain; each
/// connection with `TCP_NODELAY` (an exec's lines are small: with Nagle's algorithm, a client
/// that delays its acknowledgements got each answer's next write 40 ms late).
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<ServerConfig>>,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    match tls {
        None => {
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
                keepalive(tcp);
            });
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
        Some(config) => {
            axum::serve(TlsListener::new(listener, config), app)
                .with_graceful_shutdown(shutdown)
                .await
        }
    }
}

/// TCP keepalive on a client's connection: a peer that vanished (a laptop closed on a
/// terminal, a dropped network) is found within about 90 s, and what it held (a terminal's
/// session in the guest, a gateway's joined connection) is let go. An idle but live connection
/// is never ended by it.
pub fn keepalive(tcp: &TcpStream) {
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(60))
        .with_interval(Duration::from_secs(10))
        .with_retries(3);
    let _ = socket2::SockRef::from(tcp).set_tcp_keepalive(&ka);
}

/// Connections whose handshake is done, from a task that accepts and hands each handshake to a
/// task of its own.
struct TlsListener {
    done: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: std::io::Result<SocketAddr>,
    accepting: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    fn new(listener: TcpListener, config: Arc<ServerConfig>) -> TlsListener {
        let local = listener.local_addr();
        let (tx, done) = mpsc::channel(64);
        let acceptor = TlsAcceptor::from(config);
        let slots = Arc::new(Semaphore::new(HANDSHAKES));
        let per_peer: Peers = Arc::default();
        let accepting = tokio::spawn(async move {
            loop {
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) if is_connection_error(&e) => continue,
                    Err(e) => {
                        // Out of descriptors, mostly: wait rather than spin.
                        tracing::warn!("accepting a connection failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let Some(peer_slot) = PeerSlot::take(&per_peer, peer.ip()) else {
                    tracing::debug!(%peer, "too many TLS handshakes from one address; closed");
                    continue;
                };
                let _ = tcp.set_nodelay(true);
                keepalive(&tcp);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let shaken =
                        tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
                    drop(slot);
                    drop(peer_slot);
                    match shaken {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, "a TLS handshake failed: {e}"),
                        Err(_) => tracing::debug!(%peer, "a TLS handshake did not finish in time"),
                    }
                });
            }
        });
        TlsListener {
            done,
            local,
            accepting,
        }
    }
}

/// Errors of one connection, not of the listener: the next accept goes on at once.
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// Handshakes under way, by address.
type Peers = Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>;

/// One of an address's handshake slots, given back when dropped.
struct PeerSlot {
    map: Peers,
    ip: std::net::IpAddr,
}

impl PeerSlot {
    fn take(map: &Peers, ip: std::net::IpAddr) -> Option<PeerSlot> {
        let mut m = map.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(ip).or_default();
        if *n >= HANDSHAKES_PER_PEER {
            return None;
        }
        *n += 1;
        Some(PeerSlot {
            map: map.clone(),
            ip,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.done.recv().await {
            Some(c) => c,
            // The accepting task ended (it does not, but for its abort): nothing comes again.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        match &self.local {
            Ok(a) => Ok(*a),
            Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_that_are_not_what_they_should_be_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let none = dir.path().join("none.pem");
        let e = server_config(&none, &none).unwrap_err().to_string();
        assert!(
            e.contains("SANDBOX_HOST_TLS_CERT is") && e.contains("could not be read"),
            "{e}"
        );
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not pem at all\n").unwrap();
        let e = server_config(&junk, &junk).unwrap_err().to_string();
        assert!(e.contains("holds no certificate"), "{e}");
    }
}
