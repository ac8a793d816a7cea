//! A VM process's network served from this process (the in-process link the benches and the
//! stack's own VM tests use): the VM process (QEMU's `-netdev stream`, `sandbox-vm`'s net device)
//! inherits one end of a socket pair; [`sandbox_control::pump`] moves its frames to and from the
//! VM's [`FrameLink`] until the VM ends. Sandboxes' networks are their network processes'.

use std::sync::Arc;

use tokio::net::UnixStream;
use tokio::sync::watch;

use crate::backend::VmExit;
use sandbox_control::link::FrameLink;

/// Moves frames between QEMU's socket and the link until the VM or the socket ends.
pub(crate) async fn run(
    stream: UnixStream,
    link: Arc<dyn FrameLink>,
    mut exit: watch::Receiver<Option<VmExit>>,
) {
    let work = async {
        if let Err(e) = sandbox_control::pump::run(stream, link).await {
            tracing::warn!("the guest's network link to its VM process ended: {e}");
        }
    };
    tokio::select! {
        () = work => {}
        _ = exit.wait_for(Option::is_some) => {}
    }
}
