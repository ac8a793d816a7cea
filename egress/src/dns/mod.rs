//! The guest's DNS: the stack answers queries for allowed names with addresses it owns, so every
//! connection names its host before its first byte, and nothing is looked up upstream at query
//! time (DNS is not a way out).

pub mod wire;
