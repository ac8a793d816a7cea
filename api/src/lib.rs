//! The sandbox host as a library: the HTTP API, its state and the operator's commands. The
//! binary (`main.rs`) parses the command line and calls in here; the fuzz targets (fuzz/) drive
//! the API's router in process through [`fuzzing`].
#![forbid(unsafe_code)]

mod adopt;
mod auth;
mod capacity;
pub mod client;
pub mod config;
mod egress;
mod error;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod gateway;
mod json;
mod lifecycle;
mod metrics;
mod netproc;
pub(crate) mod port_link;
mod registry;
mod routes;
pub mod run;
pub mod serve;
pub mod shell;
mod state;
mod state_dir;
mod templates;
mod time;
pub mod tls;
