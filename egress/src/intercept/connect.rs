//! A guest connection's upstream connections as its proxy takes them: a free one from the pool,
//! or a new one made through the sandbox's dialer (paced, checked like any other connection) and,
//! to an intercepted host, over verified TLS.

use rustls::pki_types::ServerName;

use super::bodies::ProxyBody;
use super::pool::{Sender, Slots, handshake};
use super::{HANDSHAKE_TIMEOUT, Proxy};
use crate::memory::{self, Hold};

impl Proxy {
    /// An upstream HTTP/1.1 sender that is free: a pooled one, or a new connection. Waits (never
    /// fails for lack of room) while this guest connection has all its [`UPSTREAM_CONNECTIONS`]
    /// busy, and for a place among the sandbox's [`SANDBOX_UPSTREAM_CONNECTIONS`].
    /// `Err(None)`: the sandbox's egress memory has no room for another connection.
    pub(super) async fn sender(&self) -> Result<Sender, Option<String>> {
        loop {
            {
                let mut pool = self.pool.lock().await;
                pool.retain(|s| !s.is_closed());
                if let Some(i) = pool.iter().position(Sender::is_ready) {
                    return Ok(pool.swap_remove(i));
                }
            }
            // No free connection: a new one when both bounds have room, else wait for one to be
            // given back (its response read to the end) or to close (its places come back).
            let slot = tokio::select! {
                slot = self.slots.clone().acquire_owned() => slot.map_err(|e| Some(e.to_string()))?,
                _ = self.returned.notified() => continue,
            };
            let shared = tokio::select! {
                shared = self.cx.upstream.clone().acquire_owned() => shared.map_err(|e| Some(e.to_string()))?,
                _ = self.returned.notified() => continue,
            };
            // Its buffers' worst case too; a sandbox whose other connections hold its egress
            // memory does not wait for them (they may never end).
            let Some(memory) = Hold::take(&self.cx.memory, memory::UPSTREAM_COST) else {
                return Err(None);
            };
            let send = self.connect((slot, shared, memory)).await.map_err(Some)?;
            return Ok(Sender { send });
        }
    }

    async fn connect(
        &self,
        slots: Slots,
    ) -> Result<hyper::client::conn::http1::SendRequest<ProxyBody>, String> {
        let first = self.first.lock().unwrap_or_else(|e| e.into_inner()).take();
        let tcp = match first {
            Some(t) => t,
            None => {
                self.cx.connects.pace().await;
                self.cx
                    .dial
                    .dial(&self.name, self.port)
                    .await
                    .map_err(|e| e.to_string())?
                    .0
            }
        };
        let icp = match (&self.icp, self.tls) {
            (Some(icp), true) => icp,
            _ => return handshake(tcp, slots).await,
        };
        let server_name = ServerName::try_from(self.name.clone()).map_err(|e| e.to_string())?;
        let tls = tokio::time::timeout(
            HANDSHAKE_TIMEOUT,
            tokio_rustls::TlsConnector::from(icp.client.clone()).connect(server_name, tcp),
        )
        .await
        .map_err(|_| "the upstream TLS handshake timed out".to_string())?
        .map_err(|e| format!("upstream TLS: {e}"))?;
        handshake(tls, slots).await
    }
}
