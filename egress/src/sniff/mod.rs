//! What a guest connection is, from its first bytes: a TLS ClientHello (and the name it asks
//! for) or an HTTP/1 request head (and its Host). Guest bytes arrive in segments of any size:
//! each reader takes them as they come, keeps at most a fixed number, and answers "more",
//! "this is it" or "refuse".

pub mod http;
pub mod tls;
