//! virtio-vsock in userspace (no vhost): the host opens stream connections to ports the guest
//! listens on; the agent channel is one of them.
//!
//! The caller asks for a connection with [`VsockHandle::connect`] from any thread and gets, once
//! the guest accepts, one end of a Unix socket pair whose other end this device pumps to and
//! from the guest. The guest cannot open connections to the host (its requests are answered
//! with RST), connections are capped at [`MAX_CONNECTIONS`], and every buffer is bounded by
//! the credit each side advertised (virtio 1.2, section 5.10.6.3).

mod conn;
pub mod packet;

use std::collections::{BTreeMap, VecDeque};
use std::io::Read;
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use event_manager::{EventOps, EventSet, Events};
use thiserror::Error;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use self::conn::{BUF_ALLOC, Conn, State};
use self::packet::{HEADER_LEN, HOST_CID, Header, TYPE_STREAM, op};
use super::queue::{add_used, pop, reader, writer};
use super::{DeviceError, HOST_EVENT_BASE, Queues, VIRTIO_F_VERSION_1, VirtioDevice};

/// virtio device id of vsock.
pub const DEVICE_TYPE: u32 = 19;
/// Queue order: guest-bound packets, host-bound packets, events.
const RX: usize = 0;
const TX: usize = 1;
const EVENT: usize = 2;
/// virtio_vsock_event id: every connection of the guest is gone (after a snapshot's restore).
const EVENT_TRANSPORT_RESET: u32 = 0;
const QUEUE_SIZES: [u16; 3] = [256, 256, 256];
/// Most packets one queue moves per wake-up (one ring's worth); more wait for the next round.
const PACKETS_PER_WAKE: usize = 256;
/// Most simultaneous connections per VM.
pub const MAX_CONNECTIONS: usize = 64;
/// Largest payload a guest packet may carry (Linux sends at most 64 KiB).
pub const MAX_PAYLOAD: u32 = 64 * 1024;
/// Most RSTs owed to the guest for packets of unknown connections; more are dropped.
const MAX_PENDING_RESETS: usize = 64;
/// Host ports handed to connections, cycled.
const FIRST_LOCAL_PORT: u32 = 1 << 20;
const LOCAL_PORTS: u32 = 1 << 16;

/// Event data of the connect-request eventfd; connections use REQUEST_DATA + 1 + port index.
const REQUEST_DATA: u32 = HOST_EVENT_BASE;

/// Why a connection was not made.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum ConnectError {
    /// Nothing listens on the port in the guest (yet).
    #[error("the guest refused the connection to vsock port {0} (nothing listening there yet)")]
    Refused(u32),
    /// Too many connections are open.
    #[error("too many vsock connections (the limit is {MAX_CONNECTIONS})")]
    TooMany,
    /// The device was reset or stopped before the guest answered.
    #[error("the vsock device was reset")]
    Reset,
    /// A socket pair could not be made.
    #[error("creating the socket pair: {0}")]
    Socket(String),
}

/// Called once with the caller's end of the connection, or why there is none.
pub type ConnectDone = Box<dyn FnOnce(Result<UnixStream, ConnectError>) + Send>;

struct ConnectRequest {
    port: u32,
    done: ConnectDone,
}

/// Counters, readable from any thread.
#[derive(Debug, Default)]
pub struct VsockStats {
    /// Guest packets dropped or answered with RST because they were malformed or unexpected.
    pub bad_packets: AtomicU64,
    /// Connections reset because the guest broke flow control.
    pub credit_violations: AtomicU64,
    /// Connections established.
    pub connections: AtomicU64,
}

/// Host-side control of a vsock device, usable from any thread.
#[derive(Clone)]
pub struct VsockHandle {
    requests: Arc<Mutex<VecDeque<ConnectRequest>>>,
    evt: Arc<EventFd>,
    stats: Arc<VsockStats>,
}

impl VsockHandle {
    /// Asks the device to connect to `port` in the guest; `done` runs on the device thread.
    pub fn connect(&self, port: u32, done: ConnectDone) {
        let mut q = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= MAX_CONNECTIONS {
            drop(q);
            done(Err(ConnectError::TooMany));
            return;
        }
        q.push_back(ConnectRequest { port, done });
        drop(q);
        let _ = self.evt.write(1);
    }

    /// The device's counters.
    pub fn stats(&self) -> &VsockStats {
        &self.stats
    }
}

/// The device.
pub struct Vsock {
    guest_cid: u64,
    requests: Arc<Mutex<VecDeque<ConnectRequest>>>,
    evt: Arc<EventFd>,
    stats: Arc<VsockStats>,
    conns: BTreeMap<u32, Conn>,
    next_port: u32,
    resets: VecDeque<Header>,
    active: bool,
    /// Connections a device reset dropped, kept open until their fds are taken off the event
    /// loop (a reset has no access to it): else a new connection's socket, given the same fd
    /// number, could not be registered.
    retired: Vec<Conn>,
    /// Restored from a snapshot: the guest is owed a transport reset event (its connections
    /// had host ends in another process, which are gone), sent on its first event buffer.
    reset_owed: bool,
}

impl Vsock {
    /// A device for a guest with context id `guest_cid` (3 or more).
    pub fn new(guest_cid: u64) -> std::io::Result<(Vsock, VsockHandle)> {
        let requests = Arc::new(Mutex::new(VecDeque::new()));
        let evt = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        let stats = Arc::new(VsockStats::default());
        let handle = VsockHandle {
            requests: requests.clone(),
            evt: evt.clone(),
            stats: stats.clone(),
        };
        Ok((
            Vsock {
                guest_cid,
                requests,
                evt,
                stats,
                conns: BTreeMap::new(),
                next_port: 0,
                resets: VecDeque::new(),
                active: false,
                retired: Vec::new(),
                reset_owed: false,
            },
            handle,
        ))
    }

    fn conn_data(port: u32) -> u32 {
        REQUEST_DATA + 1 + (port - FIRST_LOCAL_PORT)
    }

    fn header(&self, c: &Conn, op: u16, len: u32, flags: u32) -> Header {
        Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: c.local_port,
            dst_port: c.peer_port,
            len,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc: BUF_ALLOC,
            fwd_cnt: c.fwd_cnt.0,
        }
    }

    fn bad_packet(&self) {
        self.stats.bad_packets.fetch_add(1, Ordering::Relaxed);
    }

    /// Queues an RST for a packet that belongs to no connection we have (bounded).
    fn reset_unknown(&mut self, h: &Header) {
        if h.op == op::RST || self.resets.len() >= MAX_PENDING_RESETS {
            return;
        }
        self.resets.push_back(Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: h.dst_port,
            dst_port: h.src_port,
            type_: TYPE_STREAM,
            op: op::RST,
            ..Header::default()
        });
    }

    /// Ends a connection: tells the guest (RST) unless it ended it, and unregisters it.
    fn close(&mut self, port: u32, tell_guest: bool, ops: &mut EventOps) {
        let Some(c) = self.conns.remove(&port) else {
            return;
        };
        let _ = ops.remove(Events::empty(&c.host));
        if tell_guest && self.resets.len() < MAX_PENDING_RESETS {
            self.resets.push_back(self.header(&c, op::RST, 0, 0));
        }
        if let Some((_, done)) = c.connecting {
            done(Err(if c.state == State::Connecting {
                ConnectError::Refused(c.peer_port)
            } else {
                ConnectError::Reset
            }));
        }
    }

    /// Takes the connections of a reset off the event loop and closes them.
    fn unregister_retired(&mut self, ops: &mut EventOps) {
        for c in self.retired.drain(..) {
            let _ = ops.remove(Events::empty(&c.host));
        }
    }

    fn take_requests(&mut self, ops: &mut EventOps) {
        self.unregister_retired(ops);
        let _ = self.evt.read();
        // Before the driver is up, requests wait for it (activation takes them): a caller
        // does not poll through the seconds an emulated guest's boot takes.
        if !self.active {
            return;
        }
        let reqs: Vec<ConnectRequest> = self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        for r in reqs {
            if self.conns.len() >= MAX_CONNECTIONS {
                (r.done)(Err(ConnectError::TooMany));
                continue;
            }
            let Some(port) = self.free_port() else {
                (r.done)(Err(ConnectError::TooMany));
                continue;
            };
            let (host, caller) = match UnixStream::pair() {
                Ok(p) => p,
                Err(e) => {
                    (r.done)(Err(ConnectError::Socket(e.to_string())));
                    continue;
                }
            };
            if let Err(e) = host.set_nonblocking(true) {
                (r.done)(Err(ConnectError::Socket(e.to_string())));
                continue;
            }
            let ev = Events::with_data(
                &host,
                Self::conn_data(port),
                EventSet::IN | EventSet::OUT | EventSet::EDGE_TRIGGERED | EventSet::READ_HANG_UP,
            );
            if let Err(e) = ops.add(ev) {
                (r.done)(Err(ConnectError::Socket(format!("{e:?}"))));
                continue;
            }
            self.conns
                .insert(port, Conn::new(port, r.port, host, caller, r.done));
        }
    }

    fn free_port(&mut self) -> Option<u32> {
        for _ in 0..LOCAL_PORTS {
            let port = FIRST_LOCAL_PORT + self.next_port;
            self.next_port = (self.next_port + 1) % LOCAL_PORTS;
            if !self.conns.contains_key(&port) {
                return Some(port);
            }
        }
        None
    }

    /// Handles every packet the guest queued on the tx queue.
    fn process_tx(&mut self, q: &mut Queues, ops: &mut EventOps) -> Result<(), DeviceError> {
        let mut used = false;
        // Bounded per wake-up: a guest refilling the ring as fast as we drain it gets the rest
        // on the event loop's next round, after the VM's other devices.
        for taken in 0.. {
            if taken == PACKETS_PER_WAKE {
                q.resume_later(TX);
                break;
            }
            let Some(chain) = pop(TX, &mut q.queues[TX], q.mem)? else {
                break;
            };
            let head = chain.head_index();
            let mut payload = Vec::new();
            let header = match reader(q.mem, &chain) {
                Some(mut r) => {
                    let mut b = [0u8; HEADER_LEN];
                    match r.read_exact(&mut b) {
                        Ok(()) => {
                            let h = Header::decode(&b);
                            if h.op == op::RW
                                && h.len <= MAX_PAYLOAD
                                && r.available_bytes() >= h.len as usize
                            {
                                payload.resize(h.len as usize, 0);
                                if r.read_exact(&mut payload).is_err() {
                                    payload.clear();
                                }
                            }
                            Some(h)
                        }
                        Err(_) => None,
                    }
                }
                None => None,
            };
            add_used(TX, &mut q.queues[TX], q.mem, head, 0)?;
            used = true;
            match header {
                Some(h) => self.guest_packet(h, payload, ops),
                None => self.bad_packet(),
            }
        }
        if used {
            q.interrupt.signal_used();
        }
        Ok(())
    }

    fn guest_packet(&mut self, h: Header, payload: Vec<u8>, ops: &mut EventOps) {
        if h.src_cid != self.guest_cid || h.dst_cid != HOST_CID || h.type_ != TYPE_STREAM {
            self.bad_packet();
            self.reset_unknown(&h);
            return;
        }
        let Some(c) = self.conns.get_mut(&h.dst_port) else {
            // Includes REQUEST: the guest may not connect to the host.
            if h.op != op::REQUEST {
                self.bad_packet();
            }
            self.reset_unknown(&h);
            return;
        };
        if c.peer_port != h.src_port {
            self.bad_packet();
            self.reset_unknown(&h);
            return;
        }
        c.peer_buf_alloc = h.buf_alloc;
        c.peer_fwd_cnt = Wrapping(h.fwd_cnt);
        // Any packet carries the guest's buffer state: an outstanding credit request is answered.
        c.credit_requested = false;
        let port = c.local_port;
        match (h.op, c.state) {
            (op::RESPONSE, State::Connecting) => {
                c.state = State::Established;
                c.readable = true;
                if let Some((caller, done)) = c.connecting.take() {
                    done(Ok(caller));
                }
                self.stats.connections.fetch_add(1, Ordering::Relaxed);
            }
            (op::RW, State::Established) => {
                if h.len > MAX_PAYLOAD || payload.len() != h.len as usize {
                    self.bad_packet();
                    self.close(port, true, ops);
                    return;
                }
                if c.to_host.len() + payload.len() > BUF_ALLOC as usize || c.guest_done_sending {
                    self.stats.credit_violations.fetch_add(1, Ordering::Relaxed);
                    self.close(port, true, ops);
                    return;
                }
                c.to_host.extend(payload);
                if !c.flush_to_host() {
                    self.close(port, true, ops);
                }
            }
            (op::CREDIT_UPDATE, _) => {}
            (op::CREDIT_REQUEST, State::Established) => c.pending.credit_update = true,
            (op::SHUTDOWN, State::Established) => {
                if h.flags & packet::SHUTDOWN_SEND != 0 && h.flags & packet::SHUTDOWN_RCV != 0 {
                    // Linux closes with SHUTDOWN(both) and waits for our RST.
                    let _ = c.flush_to_host();
                    self.close(port, true, ops);
                } else if h.flags & packet::SHUTDOWN_SEND != 0 {
                    c.guest_done_sending = true;
                    if !c.flush_to_host() {
                        self.close(port, true, ops);
                    }
                }
            }
            (op::RST, _) => self.close(port, false, ops),
            _ => {
                self.bad_packet();
                self.close(port, true, ops);
            }
        }
    }

    /// Whether anything is waiting for an rx buffer.
    fn has_rx_work(&mut self, ops: &mut EventOps) -> bool {
        if !self.resets.is_empty() {
            return true;
        }
        let mut gone = Vec::new();
        let mut work = false;
        for c in self.conns.values_mut() {
            if !c.fill_stage() {
                gone.push(c.local_port);
                continue;
            }
            work |= c.pending.request
                || c.pending.credit_update
                || c.pending.credit_request
                || c.staged_len() > 0;
        }
        for port in gone {
            // The host closed its end: the guest sees a reset connection.
            self.close(port, true, ops);
            work = true;
        }
        work
    }

    /// Fills the guest's rx buffers with what is owed to it: resets, requests, credit updates
    /// and host data, until either runs out.
    fn process_rx(&mut self, q: &mut Queues, ops: &mut EventOps) -> Result<(), DeviceError> {
        let mut used = false;
        // Bounded per wake-up: each round uses an rx buffer or ends the loop.
        for taken in 0.. {
            if !self.has_rx_work(ops) {
                break;
            }
            if taken == PACKETS_PER_WAKE {
                q.resume_later(RX);
                break;
            }
            let Some(chain) = pop(RX, &mut q.queues[RX], q.mem)? else {
                break;
            };
            let head = chain.head_index();
            let Some(mut w) = writer(q.mem, &chain) else {
                self.bad_packet();
                add_used(RX, &mut q.queues[RX], q.mem, head, 0)?;
                used = true;
                continue;
            };
            if w.available_bytes() < HEADER_LEN {
                self.bad_packet();
                add_used(RX, &mut q.queues[RX], q.mem, head, 0)?;
                used = true;
                continue;
            }
            let room = w.available_bytes() - HEADER_LEN;
            let (hdr, data) = self.next_rx_packet(room);
            let mut written = 0usize;
            if std::io::Write::write_all(&mut w, &hdr.encode()).is_ok() {
                written += HEADER_LEN;
                if !data.is_empty() && std::io::Write::write_all(&mut w, &data).is_ok() {
                    written += data.len();
                }
            }
            add_used(RX, &mut q.queues[RX], q.mem, head, written as u32)?;
            used = true;
        }
        if used {
            q.interrupt.signal_used();
        }
        Ok(())
    }

    /// The next packet for the guest, with at most `room` bytes of payload.
    fn next_rx_packet(&mut self, room: usize) -> (Header, Vec<u8>) {
        if let Some(h) = self.resets.pop_front() {
            return (h, Vec::new());
        }
        let ports: Vec<u32> = self.conns.keys().copied().collect();
        for port in ports {
            let Some(c) = self.conns.get(&port) else {
                continue;
            };
            if c.pending.request {
                let h = self.header(c, op::REQUEST, 0, 0);
                if let Some(c) = self.conns.get_mut(&port) {
                    c.pending.request = false;
                    c.fwd_cnt_sent = c.fwd_cnt;
                }
                return (h, Vec::new());
            }
            // A buffer with room for the header alone carries no data: a data packet of 0
            // bytes would count as one in flight that no credit update retires.
            if c.staged_len() > 0 && room > 0 {
                let n = c.staged_len().min(room);
                let h = self.header(c, op::RW, n as u32, 0);
                let Some(c) = self.conns.get_mut(&port) else {
                    continue;
                };
                let data = c.staged[c.staged_off..c.staged_off + n].to_vec();
                c.staged_off += n;
                c.sent_packet(n as u32);
                c.fwd_cnt_sent = c.fwd_cnt;
                c.pending.credit_update = false;
                return (h, data);
            }
            if c.pending.credit_request {
                let h = self.header(c, op::CREDIT_REQUEST, 0, 0);
                if let Some(c) = self.conns.get_mut(&port) {
                    c.pending.credit_request = false;
                    c.credit_requested = true;
                    c.fwd_cnt_sent = c.fwd_cnt;
                }
                return (h, Vec::new());
            }
            if c.pending.credit_update {
                let h = self.header(c, op::CREDIT_UPDATE, 0, 0);
                if let Some(c) = self.conns.get_mut(&port) {
                    c.pending.credit_update = false;
                    c.fwd_cnt_sent = c.fwd_cnt;
                }
                return (h, Vec::new());
            }
        }
        // has_rx_work said there was work; if a race took it, send a harmless credit update
        // for no connection (the guest ignores packets of unknown connections after an RST).
        (
            Header {
                src_cid: HOST_CID,
                dst_cid: self.guest_cid,
                type_: TYPE_STREAM,
                op: op::RST,
                ..Header::default()
            },
            Vec::new(),
        )
    }

    /// Tells the guest's driver that every connection is gone, on the event queue's next
    /// buffer (the driver posts them at probe and after each event).
    fn send_reset_event(&mut self, q: &mut Queues) -> Result<(), DeviceError> {
        if !self.reset_owed {
            return Ok(());
        }
        let Some(chain) = pop(EVENT, &mut q.queues[EVENT], q.mem)? else {
            return Ok(());
        };
        let head = chain.head_index();
        let mut written = 0;
        if let Some(mut w) = writer(q.mem, &chain)
            && std::io::Write::write_all(&mut w, &EVENT_TRANSPORT_RESET.to_le_bytes()).is_ok()
        {
            written = 4;
        } else {
            self.bad_packet();
        }
        add_used(EVENT, &mut q.queues[EVENT], q.mem, head, written)?;
        q.interrupt.signal_used();
        self.reset_owed = false;
        Ok(())
    }

    fn drop_all(&mut self) {
        for (_, mut c) in std::mem::take(&mut self.conns) {
            if let Some((_, done)) = c.connecting.take() {
                done(Err(ConnectError::Reset));
            }
            // The host side sees EOF now; the socket closes once it is off the event loop.
            let _ = c.host.shutdown(std::net::Shutdown::Both);
            self.retired.push(c);
        }
        self.resets.clear();
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let cfg = self.guest_cid.to_le_bytes();
        crate::virtio::read_config_bytes(&cfg, offset, data);
    }

    fn init(&mut self, ops: &mut EventOps) {
        let _ = ops.add(Events::with_data(&*self.evt, REQUEST_DATA, EventSet::IN));
    }

    fn activate(&mut self, _features: u64, _q: &mut Queues) -> Result<(), DeviceError> {
        self.active = true;
        // Requests that came before the driver: the event loop takes them now.
        let _ = self.evt.write(1);
        Ok(())
    }

    fn queue_notify(
        &mut self,
        index: usize,
        q: &mut Queues,
        ops: &mut EventOps,
    ) -> Result<(), DeviceError> {
        self.unregister_retired(ops);
        self.send_reset_event(q)?;
        if index == TX {
            self.process_tx(q, ops)?;
        }
        // A tx packet may have freed guest credit or owe an answer; an rx kick brought buffers.
        self.process_rx(q, ops)
    }

    fn host_event(
        &mut self,
        data: u32,
        events: EventSet,
        q: Option<&mut Queues>,
        ops: &mut EventOps,
    ) -> Result<(), DeviceError> {
        self.unregister_retired(ops);
        if data == REQUEST_DATA {
            self.take_requests(ops);
        } else {
            let port = data - REQUEST_DATA - 1 + FIRST_LOCAL_PORT;
            if let Some(c) = self.conns.get_mut(&port) {
                if events.intersects(EventSet::IN | EventSet::READ_HANG_UP | EventSet::HANG_UP) {
                    c.readable = true;
                }
                if events.contains(EventSet::OUT) && !c.flush_to_host() {
                    self.close(port, true, ops);
                }
            }
        }
        match q {
            Some(q) => self.process_rx(q, ops),
            None => Ok(()),
        }
    }

    fn restored(&mut self, _q: &mut Queues) -> Result<(), DeviceError> {
        // Sent from the event loop: the transport kicks every queue once restored.
        self.reset_owed = true;
        Ok(())
    }

    fn reset(&mut self) {
        self.active = false;
        self.reset_owed = false;
        self.drop_all();
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::sync::mpsc;

    use super::*;
    use crate::virtio::testing::Driver;

    const GUEST_CID: u64 = 3;
    const RX_BUFS: u64 = 0x20_0000;
    const TX_BUF: u64 = 0x80_0000;

    fn device() -> (Driver<Vsock>, VsockHandle) {
        let (v, h) = Vsock::new(GUEST_CID).unwrap();
        let mut d = Driver::new(v);
        d.setup(VIRTIO_F_VERSION_1);
        for _ in 0..16 {
            add_rx_buffer(&mut d);
        }
        d.kick(RX);
        (d, h)
    }

    /// Each rx buffer lives at an address given by its head index, so a used entry finds it.
    fn add_rx_buffer(d: &mut Driver<Vsock>) {
        let addr = RX_BUFS + u64::from(d.next_head(RX)) * 0x1100;
        d.add_chain(RX, &[(addr, 4096 + 44, true)]);
    }

    /// Packets the device put in rx buffers since the last call.
    fn received(d: &mut Driver<Vsock>) -> Vec<(Header, Vec<u8>)> {
        let mut out = Vec::new();
        for (id, len) in d.used(RX) {
            let addr = RX_BUFS + u64::from(id) * 0x1100;
            let b = d.get(addr, len as usize);
            let h = Header::decode(b[..HEADER_LEN].try_into().unwrap());
            out.push((h, b[HEADER_LEN..].to_vec()));
            // Give a buffer back, as the driver does.
            add_rx_buffer(d);
        }
        if !out.is_empty() {
            d.kick(RX);
        }
        out
    }

    fn guest_header(op: u16, local: u32, len: u32) -> Header {
        Header {
            src_cid: GUEST_CID,
            dst_cid: HOST_CID,
            src_port: 52,
            dst_port: local,
            len,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: 256 * 1024,
            fwd_cnt: 0,
        }
    }

    fn send(d: &mut Driver<Vsock>, h: Header, payload: &[u8]) {
        d.put(TX_BUF, &h.encode());
        d.put(TX_BUF + 0x1000, payload);
        if payload.is_empty() {
            d.add_chain(TX, &[(TX_BUF, HEADER_LEN as u32, false)]);
        } else {
            d.add_chain(
                TX,
                &[
                    (TX_BUF, HEADER_LEN as u32, false),
                    (TX_BUF + 0x1000, payload.len() as u32, false),
                ],
            );
        }
        d.kick(TX);
    }

    /// Connects to guest port 52 and accepts in the "guest"; returns the host end and the
    /// host's port.
    #[test]
    fn a_restored_device_tells_the_guest_its_connections_are_gone_and_connects_again() {
        let (mut d, h) = device();
        let (mut before, _) = connect(&mut d, &h);
        // The guest's driver keeps event buffers posted.
        const EVENT_BUF: u64 = 0xc0_0000;
        d.put(EVENT_BUF, &[0xff; 8]);
        d.add_chain(EVENT, &[(EVENT_BUF, 8, true)]);
        d.kick(EVENT);
        assert!(d.used(EVENT).is_empty(), "no event before a restore");

        // Restored into a new device (another process in the real thing): the old host end is
        // not carried over, the guest hears of it on the event queue.
        let (v, h2) = Vsock::new(GUEST_CID).unwrap();
        let mut r = d.restored(v).expect("the saved state restores");
        r.run();
        assert_eq!(r.used(EVENT), vec![(0, 4)]);
        assert_eq!(r.get(EVENT_BUF, 4), EVENT_TRANSPORT_RESET.to_le_bytes());
        assert_eq!(
            r.get(EVENT_BUF + 4, 4),
            [0xff; 4],
            "only the event was written"
        );
        // The rx buffers the guest posted before the snapshot still serve the new connection.
        let (mut after, port) = connect(&mut r, &h2);
        after.write_all(b"hello").unwrap();
        r.run();
        let pkts = received(&mut r);
        assert_eq!(pkts.len(), 1);
        assert_eq!(
            (pkts[0].0.op, pkts[0].1.as_slice()),
            (op::RW, &b"hello"[..])
        );
        send(&mut r, guest_header(op::RW, port, 5), b"world");
        let mut buf = [0u8; 5];
        after.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"world");
        // The old device's connection is its own business: it still works until it is dropped.
        before.write_all(b"x").unwrap();
    }

    fn connect(d: &mut Driver<Vsock>, h: &VsockHandle) -> (UnixStream, u32) {
        let (tx, rx) = mpsc::channel();
        h.connect(52, Box::new(move |r| tx.send(r).unwrap()));
        d.run();
        let pkts = received(d);
        assert_eq!(pkts.len(), 1, "{pkts:?}");
        let req = pkts[0].0;
        assert_eq!(
            (req.op, req.dst_port, req.dst_cid, req.src_cid),
            (op::REQUEST, 52, GUEST_CID, HOST_CID)
        );
        assert!(
            rx.try_recv().is_err(),
            "completed before the guest answered"
        );
        send(d, guest_header(op::RESPONSE, req.src_port, 0), &[]);
        let stream = rx.try_recv().unwrap().unwrap();
        (stream, req.src_port)
    }

    #[test]
    fn host_connects_and_bytes_flow_both_ways() {
        let (mut d, h) = device();
        let (mut s, port) = connect(&mut d, &h);
        s.write_all(b"hello").unwrap();
        d.run();
        let pkts = received(&mut d);
        assert_eq!(pkts.len(), 1);
        assert_eq!(pkts[0].0.op, op::RW);
        assert_eq!(pkts[0].1, b"hello");

        send(&mut d, guest_header(op::RW, port, 5), b"world");
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"world");

        // The guest closes: SHUTDOWN(both) is answered with RST and the host end sees EOF.
        let mut sh = guest_header(op::SHUTDOWN, port, 0);
        sh.flags = packet::SHUTDOWN_RCV | packet::SHUTDOWN_SEND;
        send(&mut d, sh, &[]);
        assert_eq!(s.read(&mut buf).unwrap(), 0);
        assert!(received(&mut d).iter().any(|(p, _)| p.op == op::RST));
    }

    #[test]
    fn refused_connections_complete_with_refused() {
        let (mut d, h) = device();
        let (tx, rx) = mpsc::channel();
        h.connect(52, Box::new(move |r| tx.send(r).unwrap()));
        d.run();
        let req = received(&mut d)[0].0;
        send(&mut d, guest_header(op::RST, req.src_port, 0), &[]);
        assert_eq!(
            rx.try_recv().unwrap().unwrap_err(),
            ConnectError::Refused(52)
        );
    }

    #[test]
    fn a_request_before_the_driver_is_ready_waits_for_it() {
        let (v, h) = Vsock::new(GUEST_CID).unwrap();
        let mut d = Driver::new(v);
        let (tx, rx) = mpsc::channel();
        h.connect(52, Box::new(move |r| tx.send(r).unwrap()));
        d.run();
        assert!(rx.try_recv().is_err(), "answered before the driver was up");
        d.setup(VIRTIO_F_VERSION_1);
        for _ in 0..4 {
            add_rx_buffer(&mut d);
        }
        d.kick(RX);
        d.run();
        let req = received(&mut d);
        assert_eq!(req.len(), 1, "{req:?}");
        assert_eq!((req[0].0.op, req[0].0.dst_port), (op::REQUEST, 52));
        send(
            &mut d,
            guest_header(op::RESPONSE, req[0].0.src_port, 0),
            &[],
        );
        assert!(rx.try_recv().unwrap().is_ok());
    }

    #[test]
    fn bad_lengths_unknown_ops_and_strangers_get_resets() {
        let (mut d, h) = device();
        let (mut s, port) = connect(&mut d, &h);
        // Guest-initiated connection: refused.
        send(&mut d, guest_header(op::REQUEST, 9999, 0), &[]);
        // A packet from a CID that is not the guest's.
        let mut spoof = guest_header(op::RW, port, 0);
        spoof.src_cid = 7;
        send(&mut d, spoof, &[]);
        let pkts = received(&mut d);
        assert_eq!(
            pkts.iter().filter(|(p, _)| p.op == op::RST).count(),
            2,
            "{pkts:?}"
        );
        // A length larger than the payload kills the connection.
        send(&mut d, guest_header(op::RW, port, 100), b"0123456789");
        let mut buf = [0u8; 1];
        assert_eq!(s.read(&mut buf).unwrap(), 0);
        assert!(
            received(&mut d)
                .iter()
                .any(|(p, _)| p.op == op::RST && p.src_port == port)
        );
        // An unknown op on a live connection likewise.
        let (mut s2, port2) = connect(&mut d, &h);
        send(&mut d, guest_header(42, port2, 0), &[]);
        assert_eq!(s2.read(&mut buf).unwrap(), 0);
        // A header shorter than 44 bytes.
        d.put(TX_BUF, &[1, 2, 3]);
        d.add_chain(TX, &[(TX_BUF, 3, false)]);
        d.kick(TX);
        assert!(h.stats().bad_packets.load(Ordering::Relaxed) >= 4);
        assert!(d.t.lock().unwrap().is_active());
    }

    #[test]
    fn header_only_buffers_carry_no_empty_data_packets() {
        // Buffers with room for a header alone, while host data waits: each would have carried
        // a data packet of 0 bytes, counted in flight for ever (the guest grew the VM process's
        // memory by 256 entries a wake-up).
        let (v, h) = Vsock::new(GUEST_CID).unwrap();
        let mut d = Driver::new(v);
        d.setup(VIRTIO_F_VERSION_1);
        add_rx_buffer(&mut d);
        d.kick(RX);
        let (mut s, _port) = connect(&mut d, &h);
        s.write_all(&[1u8; 100]).unwrap();
        d.run();
        let first: Vec<_> = received(&mut d).into_iter().map(|(p, _)| p.op).collect();
        assert_eq!(first, vec![op::RW], "the data, in the one full buffer");
        // `received` gave one full buffer back: more data than it holds, so some waits for the
        // header-only buffers that follow.
        let tiny = 0x60_0000u64;
        s.write_all(&[2u8; 10_000]).unwrap();
        for i in 0..100u64 {
            d.add_chain(RX, &[(tiny + i * 64, HEADER_LEN as u32, true)]);
        }
        d.kick(RX);
        d.run();
        for (id, len) in d.used(RX) {
            let b = d.get(tiny + u64::from(id) * 64, len as usize);
            if b.len() < HEADER_LEN {
                continue;
            }
            let p = Header::decode(b[..HEADER_LEN].try_into().unwrap());
            assert_ne!(p.op, op::RW, "a data packet in a header-only buffer: {p:?}");
        }
        let dev = d.t.lock().unwrap();
        let in_flight: usize = dev.device().conns.values().map(|c| c.sent_ends.len()).sum();
        assert!(in_flight <= 2, "{in_flight} packets counted in flight");
    }

    #[test]
    fn many_small_writes_never_flood_the_guest_with_packets() {
        let (mut d, h) = device();
        let (mut s, port) = connect(&mut d, &h);
        let mut rw = 0usize;
        let mut requests = 0usize;
        // The guest never reads (its fwd_cnt stays 0): small writes, one packet each.
        for _ in 0..conn::MAX_PACKETS_IN_FLIGHT + 20 {
            s.write_all(&[7u8; 300]).unwrap();
            d.run();
            for (p, _) in received(&mut d) {
                match p.op {
                    op::RW => rw += 1,
                    op::CREDIT_REQUEST => requests += 1,
                    _ => {}
                }
            }
        }
        assert_eq!(rw, conn::MAX_PACKETS_IN_FLIGHT, "packets beyond the cap");
        assert_eq!(requests, 1, "one credit request, not a storm");
        // The guest answers: it has read everything so far; the rest flows.
        let mut upd = guest_header(op::CREDIT_UPDATE, port, 0);
        upd.fwd_cnt = (rw * 300) as u32;
        send(&mut d, upd, &[]);
        let rest: usize = received(&mut d)
            .iter()
            .filter(|(p, _)| p.op == op::RW)
            .map(|(_, b)| b.len())
            .sum();
        assert_eq!(rest, 20 * 300);
    }

    #[test]
    fn the_host_connects_again_after_the_guest_resets_the_device() {
        let (mut d, h) = device();
        let (mut s, _) = connect(&mut d, &h);
        // The guest's driver resets the device (a kernel kexec, a driver reload, a hostile guest).
        d.reset();
        let mut buf = [0u8; 1];
        assert_eq!(s.read(&mut buf).unwrap(), 0, "the old connection ends");
        d.setup(VIRTIO_F_VERSION_1);
        for _ in 0..16 {
            add_rx_buffer(&mut d);
        }
        d.kick(RX);
        for _ in 0..3 {
            let (mut s, port) = connect(&mut d, &h);
            s.write_all(b"again").unwrap();
            d.run();
            let pkts = received(&mut d);
            assert_eq!(pkts.last().map(|p| p.1.as_slice()), Some(&b"again"[..]));
            send(&mut d, guest_header(op::RST, port, 0), &[]);
        }
    }

    #[test]
    fn a_guest_overrunning_its_credit_is_reset() {
        let (mut d, h) = device();
        let (mut s, port) = connect(&mut d, &h);
        let chunk = vec![7u8; 60 * 1024];
        // Nobody reads the host end: the socket buffer fills, then our 256 KiB, then the guest
        // is over its credit.
        for _ in 0..40 {
            send(
                &mut d,
                guest_header(op::RW, port, chunk.len() as u32),
                &chunk,
            );
        }
        assert!(h.stats().credit_violations.load(Ordering::Relaxed) >= 1);
        // What was accepted can still be read, then EOF.
        let mut total = 0;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match s.read(&mut buf).unwrap() {
                0 => break,
                n => total += n,
            }
        }
        assert!(total > 0 && total < 40 * chunk.len(), "{total}");
    }
}
