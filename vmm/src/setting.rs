//! The error of a setting read from the environment, which every setting of the VMM layer
//! (`config`, `arch`) gives.

use thiserror::Error;

/// A setting with a value it does not accept.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("{var} must be {allowed}; it is `{value}`. Fix it in the environment or in .env")]
pub struct SettingError {
    /// The variable.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What it may be.
    pub allowed: &'static str,
}
