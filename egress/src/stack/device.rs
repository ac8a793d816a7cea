//! smoltcp's view of the guest's link: frames the gate let through wait in a queue until the
//! interface polls them, and frames the interface sends go straight onto the link.

use std::collections::VecDeque;

use smoltcp::phy::{self, DeviceCapabilities, Medium};
use smoltcp::time::Instant;

use crate::link::{MAX_FRAME, StackEnd};

/// The device the stack's interface runs on.
pub(crate) struct Device {
    /// Frames for the interface, already checked by the gate.
    pub(crate) rx: VecDeque<Vec<u8>>,
    link: StackEnd,
}

impl Device {
    pub(crate) fn new(link: StackEnd) -> Self {
        Device {
            rx: VecDeque::new(),
            link,
        }
    }
}

pub(crate) struct Rx(Vec<u8>);

pub(crate) struct Tx<'a>(&'a StackEnd);

impl phy::RxToken for Rx {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

impl phy::TxToken for Tx<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut buf = vec![0u8; len];
        let r = f(&mut buf);
        // A full queue toward the guest drops the frame (counted by the link); TCP resends.
        self.0.send(&buf);
        r
    }
}

impl phy::Device for Device {
    type RxToken<'a> = Rx;
    type TxToken<'a> = Tx<'a>;

    fn receive(&mut self, _: Instant) -> Option<(Rx, Tx<'_>)> {
        let frame = self.rx.pop_front()?;
        Some((Rx(frame), Tx(&self.link)))
    }

    fn transmit(&mut self, _: Instant) -> Option<Tx<'_>> {
        Some(Tx(&self.link))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = MAX_FRAME - 4; // no VLAN tags from us
        caps.max_burst_size = None;
        caps
    }
}
