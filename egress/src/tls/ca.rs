//! A certificate authority made for one sandbox alone, held in memory and gone with it. The guest
//! trusts it (the agent installs it at boot) so the stack can terminate TLS to the hosts it must
//! read (secret and meter hosts). Its name constraints limit it to those hosts: even if its key
//! leaked, no TLS client that checks constraints would accept it for any other name.

use std::collections::HashMap;
use std::sync::Mutex;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose,
    GeneralSubtree, IsCa, Issuer, KeyPair, KeyUsagePurpose, NameConstraints,
};
use thiserror::Error;
use time::{Duration, OffsetDateTime};

use crate::policy::{HostPattern, normalize};

/// Most leaf certificates kept; older ones are made again when asked for.
pub const LEAF_CACHE: usize = 64;

/// Why a certificate could not be made.
#[derive(Debug, Error)]
pub enum CaError {
    /// rcgen refused (should not happen with our parameters).
    #[error("making a certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
    /// A leaf for a name the CA may not vouch for.
    #[error("the sandbox CA does not issue certificates for `{0}`")]
    NotPermitted(String),
}

/// A leaf certificate and its private key, DER.
#[derive(Clone)]
pub struct Leaf {
    /// The certificate.
    pub cert_der: Vec<u8>,
    /// Its PKCS#8 private key.
    pub key_der: Vec<u8>,
}

/// One sandbox's CA.
pub struct SandboxCa {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
    permitted: Vec<HostPattern>,
    leaves: Mutex<HashMap<String, Leaf>>,
}

impl std::fmt::Debug for SandboxCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxCa")
            .field("permitted", &self.permitted)
            .finish_non_exhaustive()
    }
}

impl SandboxCa {
    /// A fresh CA for `sandbox_id` that may issue certificates for `hosts` only.
    pub fn new(sandbox_id: &str, hosts: &[HostPattern]) -> Result<SandboxCa, CaError> {
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "sandbox-host");
        dn.push(
            DnType::CommonName,
            format!(
                "sandbox-host egress CA for {}",
                sandbox_id.chars().take(40).collect::<String>()
            ),
        );
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let now = OffsetDateTime::now_utc();
        // A day of slack for a guest clock that runs behind; a run lasts at most a week.
        params.not_before = now - Duration::days(1);
        params.not_after = now + Duration::days(8);
        params.name_constraints = Some(NameConstraints {
            permitted_subtrees: hosts
                .iter()
                .map(|h| match h {
                    // A DNS name constraint holds the name and everything below it (RFC 5280
                    // §4.2.1.10); issuing is further limited to the patterns themselves.
                    HostPattern::Exact(n) | HostPattern::Subdomains(n) => {
                        GeneralSubtree::DnsName(n.clone())
                    }
                })
                .collect(),
            excluded_subtrees: vec![],
        });
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        Ok(SandboxCa {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
            permitted: hosts.to_vec(),
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA certificate, PEM, for the guest's trust store.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The certificate for `name`, made on first use.
    pub fn leaf(&self, name: &str) -> Result<Leaf, CaError> {
        let name = normalize(name).ok_or_else(|| CaError::NotPermitted(name.to_string()))?;
        if !self.permitted.iter().any(|p| p.matches(&name)) {
            return Err(CaError::NotPermitted(name));
        }
        let mut leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = leaves.get(&name) {
            return Ok(l.clone());
        }
        let mut params = CertificateParams::new(vec![name.clone()])?;
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, name.clone());
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::days(1);
        params.not_after = now + Duration::days(8);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let leaf = Leaf {
            cert_der: cert.der().to_vec(),
            key_der: key.serialize_der(),
        };
        if leaves.len() >= LEAF_CACHE {
            leaves.clear();
        }
        leaves.insert(name, leaf.clone());
        Ok(leaf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn pem(der: &[u8]) -> String {
        // The base64 of the DER, wrapped, as openssl reads it.
        const T: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut b64 = String::new();
        for c in der.chunks(3) {
            let n = (u32::from(c[0]) << 16)
                | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
                | u32::from(*c.get(2).unwrap_or(&0));
            for i in 0..4 {
                if i <= c.len() {
                    b64.push(char::from(T[(n >> (18 - 6 * i) & 63) as usize]));
                } else {
                    b64.push('=');
                }
            }
        }
        let lines: Vec<&str> = b64
            .as_bytes()
            .chunks(64)
            .map(|l| std::str::from_utf8(l).unwrap())
            .collect();
        format!(
            "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
            lines.join("\n")
        )
    }

    /// `openssl verify` of a leaf against the CA for a host name, as a TLS client would.
    fn verify(ca: &SandboxCa, leaf: &[u8], host: &str) -> Option<String> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.cert_pem()).unwrap();
        std::fs::write(dir.path().join("leaf.pem"), pem(leaf)).unwrap();
        let out = Command::new("openssl")
            .arg("verify")
            .arg("-CAfile")
            .arg(dir.path().join("ca.pem"))
            .args(["-verify_hostname", host, "-purpose", "sslserver"])
            .arg(dir.path().join("leaf.pem"))
            .output()
            .ok()?;
        Some(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }

    #[test]
    fn leaves_verify_for_permitted_names_only() {
        let hosts = [
            HostPattern::parse("api.anthropic.com").unwrap(),
            HostPattern::parse("*.openrouter.ai").unwrap(),
        ];
        let ca = SandboxCa::new("sbx-test", &hosts).unwrap();
        assert!(ca.cert_pem().starts_with("-----BEGIN CERTIFICATE-----"));
        let leaf = ca.leaf("API.Anthropic.com").unwrap();
        assert_eq!(
            ca.leaf("api.anthropic.com").unwrap().cert_der,
            leaf.cert_der,
            "cached"
        );
        assert!(ca.leaf("evil.com").is_err());
        assert!(
            ca.leaf("openrouter.ai").is_err(),
            "a wildcard does not hold its apex"
        );
        let sub = ca.leaf("eu.openrouter.ai").unwrap();
        let Some(ok) = verify(&ca, &leaf.cert_der, "api.anthropic.com") else {
            eprintln!("skipped: openssl is not installed (Debian's openssl package)");
            return;
        };
        assert!(ok.contains(": OK"), "{ok}");
        assert!(
            verify(&ca, &sub.cert_der, "eu.openrouter.ai")
                .unwrap()
                .contains(": OK")
        );
        let wrong = verify(&ca, &leaf.cert_der, "evil.com").unwrap();
        assert!(!wrong.contains(": OK"), "{wrong}");
        // The name constraints hold even for a certificate the CA's key signed for another
        // name (as if the key leaked): a constraint-checking client refuses it.
        let mut params = CertificateParams::new(vec!["evil.com".to_string()]).unwrap();
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().unwrap();
        let forged = params.signed_by(&key, &ca.issuer).unwrap();
        let refused = verify(&ca, forged.der(), "evil.com").unwrap();
        assert!(refused.contains("permitted subtree violation"), "{refused}");
        // Another sandbox's CA does not vouch for this one's leaves.
        let other = SandboxCa::new("sbx-other", &hosts).unwrap();
        let cross = verify(&other, &leaf.cert_der, "api.anthropic.com").unwrap();
        assert!(!cross.contains(": OK"), "{cross}");
    }
}
