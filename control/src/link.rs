//! The guest's network as both backends see it: a link of Ethernet frames to a userspace stack
//! in the host (the egress crate), attached to the VM's virtio-net device. The VMM carries
//! frames and never looks into them.

use std::fmt;
use std::sync::Arc;

/// A bidirectional queue of Ethernet frames between the guest's network device and a stack.
/// Implementations are bounded: a frame that does not fit is dropped (TCP resends).
pub trait FrameLink: Send + Sync {
    /// A frame the guest sent; `false` when it was dropped.
    fn send(&self, frame: &[u8]) -> bool;
    /// The next frame for the guest, copied into `buf`; `None` when none is waiting.
    fn recv(&self, buf: &mut [u8]) -> Option<usize>;
    /// Called (from any thread) whenever a frame for the guest arrives in an empty queue.
    fn set_waker(&self, wake: Box<dyn Fn() + Send + Sync>);
}

/// A network device for a VM: its MAC address and the link behind it.
#[derive(Clone)]
pub struct NetAttachment {
    /// The guest's MAC address (the stack drops frames from any other).
    pub mac: [u8; 6],
    /// Where the frames go.
    pub link: NetLink,
}

/// Where a VM's frames go.
#[derive(Clone)]
pub enum NetLink {
    /// A queue in this process, to a stack in this process (the benchmarks' in-process VMM, the
    /// tests of the stack with a VM, a VM process's own device side).
    Frames(Arc<dyn FrameLink>),
    /// The VM's end of a socket pair whose other end the sandbox's network process holds: the
    /// service hands it over and never reads it (issue 32).
    Socket(Arc<std::os::fd::OwnedFd>),
}

impl fmt::Debug for NetAttachment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NetAttachment")
            .field("mac", &format_mac(self.mac))
            .finish_non_exhaustive()
    }
}

/// `aa:bb:cc:dd:ee:ff`, as QEMU and Linux write MAC addresses.
pub fn format_mac(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}
