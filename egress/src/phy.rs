//! smoltcp's view of one end of a guest's link, for the stack (the gateway's end) and for the
//! simulated guest (`sim`): frames received wait in a queue until the interface polls them, and
//! frames the interface sends go straight onto the link (a full link drops them; TCP resends).

use std::collections::VecDeque;

use smoltcp::phy::{self, DeviceCapabilities, Medium};
use smoltcp::time::Instant;

use crate::link::{GuestEnd, MAX_FRAME, StackEnd};

/// An end of the link that takes frames.
pub(crate) trait Sink {
    /// Sends a frame; `false` if it was dropped.
    fn send(&self, frame: &[u8]) -> bool;
}

impl Sink for StackEnd {
    fn send(&self, frame: &[u8]) -> bool {
        StackEnd::send(self, frame)
    }
}

impl Sink for GuestEnd {
    fn send(&self, frame: &[u8]) -> bool {
        GuestEnd::send(self, frame)
    }
}

/// The device an interface runs on.
pub(crate) struct Device<S> {
    /// Frames for the interface.
    pub(crate) rx: VecDeque<Vec<u8>>,
    /// Where its frames go.
    pub(crate) link: S,
}

impl<S: Sink> Device<S> {
    pub(crate) fn new(link: S) -> Self {
        Device {
            rx: VecDeque::new(),
            link,
        }
    }
}

/// smoltcp's receive token.
pub struct Rx(Vec<u8>);

/// smoltcp's transmit token.
pub struct Tx<'a, S>(&'a S);

impl phy::RxToken for Rx {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

impl<S: Sink> phy::TxToken for Tx<'_, S> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut buf = vec![0u8; len];
        let r = f(&mut buf);
        self.0.send(&buf);
        r
    }
}

impl<S: Sink> phy::Device for Device<S> {
    type RxToken<'a>
        = Rx
    where
        S: 'a;
    type TxToken<'a>
        = Tx<'a, S>
    where
        S: 'a;

    fn receive(&mut self, _: Instant) -> Option<(Rx, Tx<'_, S>)> {
        let frame = self.rx.pop_front()?;
        Some((Rx(frame), Tx(&self.link)))
    }

    fn transmit(&mut self, _: Instant) -> Option<Tx<'_, S>> {
        Some(Tx(&self.link))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = MAX_FRAME - 4; // no VLAN tags
        caps
    }
}
