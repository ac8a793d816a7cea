//! What a KVM backend's guest is told: its kernel command line (its console, its memory, the
//! agent's channel), its vsock context id, and the port its agent listens on.

use crate::backend::VmSpec;

/// The vsock port the agent listens on.
pub const AGENT_PORT: u32 = 1024;
/// The guest's vsock context id (each VM has its own device, so every guest can be 3).
pub const GUEST_CID: u64 = 3;

/// The kernel command line of a KVM guest.
pub fn kernel_cmdline(spec: &VmSpec) -> String {
    let mut words = vec![
        "console=ttyS0".to_string(),
        "reboot=k".into(),
        "panic=-1".into(),
        "quiet".into(),
        "i8042.noaux".into(),
        "i8042.nomux".into(),
        "i8042.dumbkbd".into(),
        format!("sandbox.memory_mib={}", spec.memory_mib),
        format!("sandbox.channel=vsock:{AGENT_PORT}"),
    ];
    words.extend(spec.cmdline.iter().cloned());
    words.join(" ")
}
