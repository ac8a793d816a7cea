//! How a VM ended, as the service tells it: one line for a person, whether the host asked for
//! it, and the guest's last words. Its own module because both the backends' errors and their
//! VMs' ends carry it.

/// How and why a VM ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmExit {
    /// One line for a person: what ended the VM.
    pub reason: String,
    /// Whether the host asked for it (a stop), as opposed to the guest or a failure.
    pub requested: bool,
    /// The last lines the guest (and the VMM) printed.
    pub console: Vec<String>,
}

/// " Last console lines: a | b" when there are any.
pub fn console_suffix(lines: &[String]) -> String {
    let lines: Vec<&str> = lines
        .iter()
        .map(String::as_str)
        .filter(|l| !l.trim().is_empty())
        .collect();
    if lines.is_empty() {
        String::new()
    } else {
        format!(
            ". Last console lines: {}",
            lines[lines.len().saturating_sub(8)..].join(" | ")
        )
    }
}
