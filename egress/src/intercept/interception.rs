//! What a sandbox intercepts with, made once at its start: its CA, its secrets and the forms
//! the response scan looks for, its meter hosts and policy, and the upstream TLS client.

use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use thiserror::Error;

use crate::echo::{EchoError, EchoForms};
use crate::policy::HostPattern;
use crate::secrets::Secret;
use crate::tls::ca::{CaError, SandboxCa};

/// Why an intercepted connection ended early.
#[derive(Debug, Error)]
pub enum InterceptError {
    /// No certificate for the name (not a secret or meter host).
    #[error("no certificate for {0}: {1}")]
    Certificate(String, CaError),
    /// TLS configuration.
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// A handshake failed or took too long.
    #[error("TLS handshake with the {0} failed: {1}")]
    Handshake(&'static str, String),
    /// The system's roots could not be read.
    #[error("reading the system's root certificates: {0}")]
    Roots(String),
    /// `SANDBOX_HOST_EGRESS_CA_FILE` holds no usable certificate.
    #[error("SANDBOX_HOST_EGRESS_CA_FILE: {0}")]
    ExtraRoots(String),
    /// HTTP on either side.
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    /// The sandbox's CA could not be made.
    #[error("the sandbox's CA: {0}")]
    Ca(#[from] CaError),
    /// The response scan for the sandbox's secrets could not be compiled.
    #[error(transparent)]
    Echo(#[from] EchoError),
}

/// What a sandbox intercepts with: its CA, its secrets, its meter hosts, and the upstream TLS
/// client configuration.
pub struct Interception {
    pub(crate) ca: SandboxCa,
    pub(crate) secrets: Vec<Secret>,
    /// Every form of every secret's value, looked for in every response.
    pub(crate) echo: Option<Arc<EchoForms>>,
    pub(crate) meter: Vec<HostPattern>,
    pub(crate) policy: MeterPolicy,
    pub(crate) client: Arc<rustls::ClientConfig>,
}

/// How strictly a sandbox's model calls are metered.
#[derive(Debug, Clone, Copy)]
pub struct MeterPolicy {
    /// Refuse, before it goes upstream, a POST to a meter or secret host whose usage the meter
    /// could not read (the run's `egress.meter_strict`).
    pub strict: bool,
    /// The largest request body held to ask for usage (`SANDBOX_HOST_METER_BODY_MAX_MIB`); what
    /// the sandbox holds of all of them at once counts against its egress memory.
    pub body_max: usize,
}

impl Default for MeterPolicy {
    fn default() -> Self {
        MeterPolicy {
            strict: false,
            body_max: DEFAULT_BODY_MAX,
        }
    }
}

/// The default largest request body the meter holds: Anthropic's own request size limit.
pub const DEFAULT_BODY_MAX: usize = 32 << 20;

impl Interception {
    /// The interception of sandbox `id`. `intercepted` are the names its CA may sign for (the
    /// secrets' hosts and the meter hosts).
    pub fn new(
        id: &str,
        intercepted: &[HostPattern],
        secrets: Vec<Secret>,
        meter: Vec<HostPattern>,
        policy: MeterPolicy,
        client: Arc<rustls::ClientConfig>,
    ) -> Result<Self, InterceptError> {
        Ok(Interception {
            ca: SandboxCa::new(id, intercepted)?,
            echo: EchoForms::new(secrets.iter().map(Secret::value))?,
            secrets,
            meter,
            policy,
            client,
        })
    }

    /// The CA certificate (PEM) the guest must trust.
    pub fn ca_pem(&self) -> &str {
        self.ca.cert_pem()
    }

    /// The secrets.
    pub(crate) fn secrets(&self) -> &[Secret] {
        &self.secrets
    }

    /// The guest's environment: each secret's variable with its placeholder.
    pub fn placeholders(&self) -> Vec<(String, String)> {
        self.secrets
            .iter()
            .map(|s| (s.env.clone(), s.placeholder.clone()))
            .collect()
    }
}

impl std::fmt::Debug for Interception {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interception")
            .field("secrets", &self.secrets)
            .field("meter", &self.meter)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// The upstream TLS client: the system's roots and the PEM certificates of `extra` (the
/// operator's `SANDBOX_HOST_EGRESS_CA_FILE`). HTTP/1.1 only.
pub fn upstream_client(extra: Option<&[u8]>) -> Result<Arc<rustls::ClientConfig>, InterceptError> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    let (added, _) = roots.add_parsable_certificates(native.certs);
    if let Some(pem) = extra {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<_, _>>()
            .map_err(|e| InterceptError::ExtraRoots(e.to_string()))?;
        if certs.is_empty() {
            return Err(InterceptError::ExtraRoots(
                "no PEM certificate in the file".into(),
            ));
        }
        for c in certs {
            roots
                .add(c)
                .map_err(|e| InterceptError::ExtraRoots(e.to_string()))?;
        }
    } else if added == 0 {
        return Err(InterceptError::Roots(format!(
            "none found ({:?})",
            native.errors
        )));
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}
