//! `sandbox-host gateway` (issue 33): the API of a sandbox host, served in front of a fleet of
//! them. It keeps no sandbox of its own: a create goes to a host chosen by the hosts' own
//! health figures (`place.rs`), every other request about a sandbox to the host its id names
//! (`registry::host_of`: each host's ids end with its `SANDBOX_HOST_NAME`), streamed both ways
//! (`proxy.rs`); the list and the health are the hosts' merged. Several gateways can serve the
//! same fleet behind one address: they share nothing but the hosts.
//!
//! A module of the service's crate rather than a crate of its own: it serves the same API
//! with the same token rules, body limit and errors (`auth.rs`, `error.rs`, `routes/`), which
//! it must not drift from.

pub mod config;
mod fleet;
mod place;
pub(crate) mod proxy;

pub use proxy::causes;
mod routes;
mod srv;

use std::net::SocketAddr;
use std::process::ExitCode;

/// Runs the gateway until SIGINT or SIGTERM.
pub async fn run() -> ExitCode {
    let dotenv = crate::config::load_dotenv();
    crate::serve::init_json_logs();
    if let Err(e) = dotenv {
        tracing::error!("{e}");
        return ExitCode::from(1);
    }
    let cfg = match config::GatewayConfig::from_env() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::from(1);
        }
    };
    let (tls, client) = match (crate::tls::server_from_env(), proxy::client(&cfg)) {
        (Ok(t), Ok(c)) => (t, c),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!("{e}");
            return ExitCode::from(1);
        }
    };
    let addr = SocketAddr::new(cfg.bind, cfg.port);
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("cannot listen on {addr}: {e}; set SANDBOX_HOST_PORT to a free port");
            return ExitCode::from(1);
        }
    };
    let fleet = fleet::Fleet::new(&cfg, client);
    // The first poll before serving: a gateway that answers knows its hosts.
    fleet.poll().await;
    fleet.watch(cfg.poll);
    let up = fleet.all().iter().filter(|h| h.seen().up).count();
    tracing::info!(
        address = %listener.local_addr().unwrap_or(addr),
        hosts = fleet.all().len(),
        up,
        https = tls.is_some(),
        "Listening on {}: the gateway of a fleet of sandbox hosts",
        listener.local_addr().unwrap_or(addr)
    );
    let app = routes::app(routes::Gateway::new(cfg, fleet));
    let stop = async {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut t), Ok(mut i)) => {
                tokio::select! {
                    _ = t.recv() => {}
                    _ = i.recv() => {}
                }
            }
            _ => std::future::pending::<()>().await,
        }
    };
    match crate::tls::serve(listener, tls, app, stop).await {
        Ok(()) => {
            tracing::info!("Stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!("the HTTP server failed: {e}");
            ExitCode::from(1)
        }
    }
}
