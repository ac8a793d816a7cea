//! TLS of intercepted connections: the sandbox's own CA and the certificates it issues.

pub mod ca;
