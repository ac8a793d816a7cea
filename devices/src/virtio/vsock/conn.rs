//! One host-initiated vsock stream: its host socket, its credit on both sides and the bytes in
//! flight. All buffers are bounded: the guest may never have more than our advertised
//! `buf_alloc` unforwarded, and we read from the host no more than the guest's credit.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::num::Wrapping;
use std::os::unix::net::UnixStream;

use super::ConnectDone;

/// Our receive buffer per connection, as advertised to the guest.
pub const BUF_ALLOC: u32 = 256 * 1024;
/// Most bytes read from the host socket at once (one rx packet's payload at most).
pub const MAX_STAGE: usize = 64 * 1024;
/// Most data packets the guest may hold unread. Linux (6.12) also counts each queued packet's
/// metadata (about 700 bytes) against its 256 KiB receive buffer and resets the connection when
/// many small packets exceed it (about 370), however few bytes they carry. At this many we stop
/// and ask the guest for its buffer state (CREDIT_REQUEST) until it has read some.
pub const MAX_PACKETS_IN_FLIGHT: usize = 128;

/// Where a connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// REQUEST queued or sent, no answer yet.
    Connecting,
    /// RESPONSE received.
    Established,
}

/// Control packets a connection owes the guest (at most one of each pending: bounded).
#[derive(Debug, Default, Clone, Copy)]
pub struct Pending {
    /// Our connection request.
    pub request: bool,
    /// Our buffer state, because the guest asked or we freed a lot.
    pub credit_update: bool,
    /// Ask the guest for its buffer state: we hold back data until it has read more packets.
    pub credit_request: bool,
}

/// One connection.
pub struct Conn {
    pub local_port: u32,
    pub peer_port: u32,
    pub state: State,
    pub host: UnixStream,
    /// The caller's end and its completion, until the guest answers the request.
    pub connecting: Option<(UnixStream, ConnectDone)>,
    pub pending: Pending,
    /// The guest's receive buffer and how much of it it has consumed.
    pub peer_buf_alloc: u32,
    pub peer_fwd_cnt: Wrapping<u32>,
    /// `tx_cnt` at the end of each data packet the guest may not have read yet (bounded by
    /// MAX_PACKETS_IN_FLIGHT).
    pub sent_ends: VecDeque<Wrapping<u32>>,
    /// A credit request is out and unanswered.
    pub credit_requested: bool,
    /// Bytes we sent the guest, ever.
    pub tx_cnt: Wrapping<u32>,
    /// Bytes of the guest we wrote to the host socket, ever, and what we last told the guest.
    pub fwd_cnt: Wrapping<u32>,
    pub fwd_cnt_sent: Wrapping<u32>,
    /// Guest bytes the host socket has not taken yet (at most BUF_ALLOC).
    pub to_host: VecDeque<u8>,
    /// Host bytes read, waiting for an rx buffer.
    pub staged: Vec<u8>,
    pub staged_off: usize,
    /// The host socket may have data (edge-triggered: cleared on WouldBlock).
    pub readable: bool,
    /// The guest will send no more: shut the host socket's write side once drained.
    pub guest_done_sending: bool,
}

impl Conn {
    pub fn new(
        local_port: u32,
        peer_port: u32,
        host: UnixStream,
        caller: UnixStream,
        done: ConnectDone,
    ) -> Conn {
        Conn {
            local_port,
            peer_port,
            state: State::Connecting,
            host,
            connecting: Some((caller, done)),
            pending: Pending {
                request: true,
                credit_update: false,
                credit_request: false,
            },
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            sent_ends: VecDeque::new(),
            credit_requested: false,
            tx_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            fwd_cnt_sent: Wrapping(0),
            to_host: VecDeque::new(),
            staged: Vec::new(),
            staged_off: 0,
            readable: false,
            guest_done_sending: false,
        }
    }

    /// Bytes the guest can still take.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.tx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Data packets the guest has not read yet, as far as its last `fwd_cnt` tells.
    pub fn packets_in_flight(&mut self) -> usize {
        while let Some(end) = self.sent_ends.front() {
            // Wrapping comparison: the guest has read up to `peer_fwd_cnt`.
            if (self.peer_fwd_cnt - *end).0 < (1 << 31) {
                self.sent_ends.pop_front();
            } else {
                break;
            }
        }
        self.sent_ends.len()
    }

    /// Records a data packet sent to the guest.
    pub fn sent_packet(&mut self, len: u32) {
        self.tx_cnt += len;
        self.sent_ends.push_back(self.tx_cnt);
    }

    /// Unsent staged host bytes.
    pub fn staged_len(&self) -> usize {
        self.staged.len() - self.staged_off
    }

    /// Reads from the host socket into the stage, within the guest's credit. Returns false when
    /// the host closed its end (or the socket failed).
    pub fn fill_stage(&mut self) -> bool {
        if self.state != State::Established || !self.readable || self.staged_len() > 0 {
            return true;
        }
        if self.packets_in_flight() >= MAX_PACKETS_IN_FLIGHT {
            if !self.credit_requested {
                self.pending.credit_request = true;
            }
            return true;
        }
        let want = (self.peer_credit() as usize).min(MAX_STAGE);
        if want == 0 {
            return true;
        }
        self.staged.clear();
        self.staged_off = 0;
        self.staged.resize(want, 0);
        match self.host.read(&mut self.staged) {
            Ok(0) => {
                self.staged.clear();
                false
            }
            Ok(n) => {
                self.staged.truncate(n);
                true
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                self.staged.clear();
                self.readable = false;
                true
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {
                self.staged.clear();
                true
            }
            Err(_) => {
                self.staged.clear();
                false
            }
        }
    }

    /// Writes what the guest sent to the host socket. Returns false if the host end is gone.
    pub fn flush_to_host(&mut self) -> bool {
        while !self.to_host.is_empty() {
            let (a, _) = self.to_host.as_slices();
            match self.host.write(a) {
                Ok(0) => return false,
                Ok(n) => {
                    self.to_host.drain(..n);
                    self.fwd_cnt += n as u32;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        if self.to_host.is_empty() && self.guest_done_sending {
            let _ = self.host.shutdown(std::net::Shutdown::Write);
        }
        // Tell the guest about freed space before it runs dry, not after every byte.
        if (self.fwd_cnt - self.fwd_cnt_sent).0 >= BUF_ALLOC / 4 {
            self.pending.credit_update = true;
        }
        true
    }
}
