//! The virtio-mmio transport (virtio 1.2, section 4.2.2, version 2 register layout).
//!
//! The rules the driver must follow are enforced here rather than trusted: the status bits
//! only move forward (ACKNOWLEDGE, DRIVER, FEATURES_OK, DRIVER_OK) or back to zero (reset);
//! features outside the offer are refused at FEATURES_OK; queue registers take writes only
//! between FEATURES_OK and DRIVER_OK; a queue is only used if the driver made it ready with a
//! valid size and rings inside guest memory. A device that fails is marked DEVICE_NEEDS_RESET
//! and left alone; nothing the guest writes reaches the host process as a panic.

use std::sync::Arc;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
};
use virtio_bindings::virtio_mmio as reg;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::{HOST_EVENT_BASE, Interrupt, Queues, VIRTIO_F_VERSION_1, VirtioDevice};

/// "virt", little-endian.
const MAGIC: u32 = 0x7472_6976;
/// The modern (non-legacy) register layout.
const VERSION: u32 = 2;
/// "SBXH": our vendor id.
const VENDOR: u32 = 0x4858_4253;
/// Size of a device's register window (one page).
pub const WINDOW: u64 = 0x1000;

/// A guest's access to a device's register window (offset within it), from a vCPU, and the
/// transport's state for a snapshot.
pub trait MmioDevice: Send {
    /// A read of `data.len()` bytes at `offset`.
    fn mmio_read(&mut self, offset: u64, data: &mut [u8]);
    /// A write of `data` at `offset`.
    fn mmio_write(&mut self, offset: u64, data: &[u8]);
    /// The registers and queues as the driver left them (the machine is paused).
    fn save(&self) -> TransportState;
    /// Puts a fresh transport back in the state `save` gave; see [`MmioTransport::restore`].
    fn restore(&mut self, state: &TransportState) -> Result<(), RestoreError>;
}

/// One queue of a snapshot: what virtio-queue's `QueueState` holds, in a form we serialize.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    /// The size the driver chose.
    pub size: u16,
    /// Whether the driver made it ready.
    pub ready: bool,
    /// The next available index the device will look at.
    pub next_avail: u16,
    /// The next used index the device will write.
    pub next_used: u16,
    /// VIRTIO_F_RING_EVENT_IDX in use.
    pub event_idx: bool,
    /// Guest addresses of the rings.
    pub desc_table: u64,
    /// The available ring.
    pub avail_ring: u64,
    /// The used ring.
    pub used_ring: u64,
}

/// A transport's state in a snapshot. Read back from a file, it is checked like guest input:
/// a snapshot may be damaged, and a paused guest's own snapshot is as hostile as the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportState {
    /// The device type, checked against the device it is restored into.
    pub device_type: u32,
    /// The status register.
    pub status: u32,
    /// DeviceFeaturesSel.
    pub device_features_sel: u32,
    /// DriverFeaturesSel.
    pub driver_features_sel: u32,
    /// The features the driver acknowledged.
    pub driver_features: u64,
    /// QueueSel.
    pub queue_sel: u32,
    /// ConfigGeneration.
    pub config_generation: u32,
    /// Whether the device was active (DRIVER_OK and not failed).
    pub active: bool,
    /// InterruptStatus bits not yet acknowledged.
    pub interrupt_status: u32,
    /// Why the device failed, if it had.
    pub failure: Option<String>,
    /// Every queue, in order.
    pub queues: Vec<QueueSnapshot>,
}

/// Why a transport's saved state was refused.
#[derive(Debug, Error)]
pub enum RestoreError {
    /// The state belongs to another kind of device.
    #[error("the snapshot has a device of type {saved} where this machine has type {here}")]
    DeviceType {
        /// In the snapshot.
        saved: u32,
        /// In this machine.
        here: u32,
    },
    /// The queue count differs.
    #[error("the snapshot's device of type {device_type} has {saved} queues, not {here}")]
    QueueCount {
        /// The device.
        device_type: u32,
        /// In the snapshot.
        saved: usize,
        /// This device's.
        here: usize,
    },
    /// A queue is invalid (size, rings outside guest memory).
    #[error("queue {index} of the snapshot's device of type {device_type} is invalid: {what}")]
    Queue {
        /// The device.
        device_type: u32,
        /// The queue.
        index: usize,
        /// What is wrong.
        what: String,
    },
    /// Registers that the driver could never have reached.
    #[error("the snapshot's device of type {device_type} has an impossible state: {what}")]
    State {
        /// The device.
        device_type: u32,
        /// What is wrong.
        what: String,
    },
    /// The device refused to come back.
    #[error("the snapshot's device of type {device_type} could not be activated: {what}")]
    Activate {
        /// The device.
        device_type: u32,
        /// Why.
        what: String,
    },
}

/// A device behind the virtio-mmio register interface.
pub struct MmioTransport<D: VirtioDevice> {
    device: D,
    mem: GuestMemoryMmap,
    interrupt: Arc<Interrupt>,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_sel: u32,
    config_generation: u32,
    active: bool,
    /// Guest accesses the transport ignored (bad width, bad state, unknown register): kept
    /// for diagnostics and tests.
    ignored: u64,
    /// Why the device failed, if it did.
    failure: Option<String>,
}

impl<D: VirtioDevice> MmioTransport<D> {
    /// Wraps `device`, interrupting through `interrupt`. Its queue kicks arrive on the
    /// eventfds of [`queue_evts`](Self::queue_evts), which the VMM registers with KVM as
    /// ioeventfds on the QueueNotify register.
    pub fn new(
        device: D,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
    ) -> std::io::Result<Self> {
        let sizes = device.queue_max_sizes().to_vec();
        let mut queues = Vec::with_capacity(sizes.len());
        let mut queue_evts = Vec::with_capacity(sizes.len());
        for max in sizes {
            // virtio-queue refuses sizes that are zero, above 32768 or not powers of two: a
            // device of ours offering one is a bug in this crate, not guest input.
            queues.push(Queue::new(max).map_err(|e| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{e:?}"))
            })?);
            queue_evts.push(EventFd::new(EFD_NONBLOCK)?);
        }
        Ok(MmioTransport {
            device,
            mem,
            interrupt,
            queues,
            queue_evts,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            config_generation: 0,
            active: false,
            ignored: 0,
            failure: None,
        })
    }

    /// The eventfds the driver's QueueNotify writes should signal, one per queue in order.
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The device, mutably (host-side control from the VMM).
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// The device status register.
    pub fn status(&self) -> u32 {
        self.status
    }

    /// Whether the driver activated the device and it has not failed.
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// Why the device stopped working, if it did (for diagnostics).
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// The queues as the driver set them up (for diagnostics and the fuzz targets' checks).
    pub fn queues(&self) -> &[Queue] {
        &self.queues
    }

    /// How many guest accesses were ignored as invalid.
    pub fn ignored_accesses(&self) -> u64 {
        self.ignored
    }

    /// The registers and queues as the driver left them.
    pub fn save_state(&self) -> TransportState {
        TransportState {
            device_type: self.device.device_type(),
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            queue_sel: self.queue_sel,
            config_generation: self.config_generation,
            active: self.active,
            interrupt_status: self.interrupt.status(),
            failure: self.failure.clone(),
            queues: self
                .queues
                .iter()
                .map(|q| QueueSnapshot {
                    size: q.size(),
                    ready: q.ready(),
                    next_avail: q.next_avail(),
                    next_used: q.next_used(),
                    event_idx: q.event_idx_enabled(),
                    desc_table: q.desc_table(),
                    avail_ring: q.avail_ring(),
                    used_ring: q.used_ring(),
                })
                .collect(),
        }
    }

    /// Puts this fresh transport in `state`: registers, queues (each checked as the guest's
    /// QueueReady is), and, for an active device, the device activated again and told it was
    /// restored ([`VirtioDevice::restored`]). Every queue is then kicked: a notification the
    /// guest made just before the snapshot was taken may not have been seen.
    pub fn restore_state(&mut self, state: &TransportState) -> Result<(), RestoreError> {
        let device_type = self.device.device_type();
        let bad = |what: &str| RestoreError::State {
            device_type,
            what: what.into(),
        };
        if state.device_type != device_type {
            return Err(RestoreError::DeviceType {
                saved: state.device_type,
                here: device_type,
            });
        }
        if state.queues.len() != self.queues.len() {
            return Err(RestoreError::QueueCount {
                device_type,
                saved: state.queues.len(),
                here: self.queues.len(),
            });
        }
        let known = VIRTIO_CONFIG_S_ACKNOWLEDGE
            | VIRTIO_CONFIG_S_DRIVER
            | VIRTIO_CONFIG_S_FEATURES_OK
            | VIRTIO_CONFIG_S_DRIVER_OK
            | VIRTIO_CONFIG_S_FAILED
            | VIRTIO_CONFIG_S_NEEDS_RESET;
        if state.status & !known != 0 {
            return Err(bad("unknown status bits"));
        }
        if state.driver_features & !self.device.features() != 0 {
            return Err(bad("features the device never offered"));
        }
        let running = state.status & VIRTIO_CONFIG_S_DRIVER_OK != 0
            && state.status & (VIRTIO_CONFIG_S_FAILED | VIRTIO_CONFIG_S_NEEDS_RESET) == 0;
        if state.active != (running && state.failure.is_none()) {
            return Err(bad("active without DRIVER_OK, or failed and active"));
        }
        let mut queues = Vec::with_capacity(self.queues.len());
        for (index, (saved, q)) in state.queues.iter().zip(&self.queues).enumerate() {
            let qerr = |what: String| RestoreError::Queue {
                device_type,
                index,
                what,
            };
            let mut n = Queue::new(q.max_size()).map_err(|e| qerr(format!("{e:?}")))?;
            if saved.size != 0 {
                n.try_set_size(saved.size)
                    .map_err(|e| qerr(format!("size {}: {e:?}", saved.size)))?;
            }
            n.set_next_avail(saved.next_avail);
            n.set_next_used(saved.next_used);
            n.set_event_idx(saved.event_idx);
            n.try_set_desc_table_address(vm_memory::GuestAddress(saved.desc_table))
                .map_err(|e| qerr(format!("{e:?}")))?;
            n.try_set_avail_ring_address(vm_memory::GuestAddress(saved.avail_ring))
                .map_err(|e| qerr(format!("{e:?}")))?;
            n.try_set_used_ring_address(vm_memory::GuestAddress(saved.used_ring))
                .map_err(|e| qerr(format!("{e:?}")))?;
            if saved.ready {
                n.set_ready(true);
                if !n.is_valid(&self.mem) {
                    return Err(qerr("its rings are not inside guest memory".into()));
                }
            }
            queues.push(n);
        }
        self.queues = queues;
        self.status = state.status;
        self.device_features_sel = state.device_features_sel;
        self.driver_features_sel = state.driver_features_sel;
        self.driver_features = state.driver_features;
        self.queue_sel = state.queue_sel;
        self.config_generation = state.config_generation;
        self.failure = state.failure.clone();
        self.interrupt.set_status(state.interrupt_status);
        self.active = false;
        if state.active {
            let mut q = Queues {
                mem: &self.mem,
                queues: &mut self.queues,
                interrupt: &self.interrupt,
                resume: 0,
            };
            let activated = self
                .device
                .activate(self.driver_features, &mut q)
                .and_then(|()| self.device.restored(&mut q));
            activated.map_err(|e| RestoreError::Activate {
                device_type,
                what: e.to_string(),
            })?;
            self.active = true;
            for evt in &self.queue_evts {
                let _ = evt.write(1);
            }
        }
        Ok(())
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    /// Queue registers may only be written between FEATURES_OK and DRIVER_OK.
    fn queue_writable(&self) -> bool {
        self.status & VIRTIO_CONFIG_S_FEATURES_OK != 0
            && self.status & VIRTIO_CONFIG_S_DRIVER_OK == 0
            && self.status & VIRTIO_CONFIG_S_FAILED == 0
    }

    fn read_reg(&mut self, offset: u32) -> u32 {
        match offset {
            reg::VIRTIO_MMIO_MAGIC_VALUE => MAGIC,
            reg::VIRTIO_MMIO_VERSION => VERSION,
            reg::VIRTIO_MMIO_DEVICE_ID => self.device.device_type(),
            reg::VIRTIO_MMIO_VENDOR_ID => VENDOR,
            reg::VIRTIO_MMIO_DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device.features() as u32,
                1 => (self.device.features() >> 32) as u32,
                _ => 0,
            },
            reg::VIRTIO_MMIO_QUEUE_NUM_MAX => {
                self.selected_queue().map_or(0, |q| u32::from(q.max_size()))
            }
            reg::VIRTIO_MMIO_QUEUE_READY => {
                self.selected_queue().map_or(0, |q| u32::from(q.ready()))
            }
            reg::VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt.status(),
            reg::VIRTIO_MMIO_STATUS => self.status,
            reg::VIRTIO_MMIO_CONFIG_GENERATION => self.config_generation,
            _ => {
                self.ignored += 1;
                0
            }
        }
    }

    fn write_reg(&mut self, offset: u32, v: u32) {
        let writable = self.queue_writable();
        match offset {
            reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.device_features_sel = v,
            reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            reg::VIRTIO_MMIO_DRIVER_FEATURES => {
                // Only while negotiating: after FEATURES_OK the set is frozen.
                if self.status & VIRTIO_CONFIG_S_DRIVER != 0
                    && self.status & VIRTIO_CONFIG_S_FEATURES_OK == 0
                {
                    match self.driver_features_sel {
                        0 => {
                            self.driver_features =
                                (self.driver_features & !0xffff_ffff) | u64::from(v)
                        }
                        1 => {
                            self.driver_features =
                                (self.driver_features & 0xffff_ffff) | (u64::from(v) << 32)
                        }
                        _ => self.ignored += 1,
                    }
                } else {
                    self.ignored += 1;
                }
            }
            reg::VIRTIO_MMIO_QUEUE_SEL => self.queue_sel = v,
            reg::VIRTIO_MMIO_QUEUE_NUM if writable => match self.selected_queue() {
                // virtio-queue keeps the old size if the new one is zero, above the
                // maximum or not a power of two; the queue then fails validation at
                // QueueReady/DRIVER_OK instead of being used with a bad size.
                Some(q) => q.set_size(v as u16),
                None => self.ignored += 1,
            },
            reg::VIRTIO_MMIO_QUEUE_READY if writable => {
                let mem = self.mem.clone();
                match self.queues.get_mut(self.queue_sel as usize) {
                    Some(q) => {
                        // A queue whose size or rings are invalid never becomes ready
                        // (virtio-queue validates only a queue marked ready).
                        q.set_ready(v == 1);
                        let ready = v == 1 && q.is_valid(&mem);
                        q.set_ready(ready);
                        if v == 1 && !ready {
                            self.ignored += 1;
                        }
                    }
                    None => self.ignored += 1,
                }
            }
            reg::VIRTIO_MMIO_QUEUE_DESC_LOW
            | reg::VIRTIO_MMIO_QUEUE_DESC_HIGH
            | reg::VIRTIO_MMIO_QUEUE_AVAIL_LOW
            | reg::VIRTIO_MMIO_QUEUE_AVAIL_HIGH
            | reg::VIRTIO_MMIO_QUEUE_USED_LOW
            | reg::VIRTIO_MMIO_QUEUE_USED_HIGH
                if writable =>
            {
                let Some(q) = self.queues.get_mut(self.queue_sel as usize) else {
                    self.ignored += 1;
                    return;
                };
                if q.ready() {
                    // Addresses of a live queue do not change under the device.
                    self.ignored += 1;
                    return;
                }
                match offset {
                    reg::VIRTIO_MMIO_QUEUE_DESC_LOW => q.set_desc_table_address(Some(v), None),
                    reg::VIRTIO_MMIO_QUEUE_DESC_HIGH => q.set_desc_table_address(None, Some(v)),
                    reg::VIRTIO_MMIO_QUEUE_AVAIL_LOW => q.set_avail_ring_address(Some(v), None),
                    reg::VIRTIO_MMIO_QUEUE_AVAIL_HIGH => q.set_avail_ring_address(None, Some(v)),
                    reg::VIRTIO_MMIO_QUEUE_USED_LOW => q.set_used_ring_address(Some(v), None),
                    _ => q.set_used_ring_address(None, Some(v)),
                }
            }
            reg::VIRTIO_MMIO_QUEUE_NOTIFY => {
                // Normally an ioeventfd catches this write before it leaves KVM; when it does
                // not (tests, or a VMM without ioeventfd), signal the same eventfd.
                match self.queue_evts.get(v as usize) {
                    Some(evt) => {
                        let _ = evt.write(1);
                    }
                    None => self.ignored += 1,
                }
            }
            reg::VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt.ack(v),
            reg::VIRTIO_MMIO_STATUS => self.set_status(v),
            _ => self.ignored += 1,
        }
    }

    fn set_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        if v & VIRTIO_CONFIG_S_FAILED != 0 {
            self.status |= VIRTIO_CONFIG_S_FAILED;
            self.active = false;
            return;
        }
        // Bits only accumulate, one step at a time, in the spec's order.
        let old = self.status;
        if v & old != old {
            self.ignored += 1;
            return;
        }
        let added = v & !old;
        let order = [
            VIRTIO_CONFIG_S_ACKNOWLEDGE,
            VIRTIO_CONFIG_S_DRIVER,
            VIRTIO_CONFIG_S_FEATURES_OK,
            VIRTIO_CONFIG_S_DRIVER_OK,
        ];
        for (i, bit) in order.iter().enumerate() {
            if added & bit != 0 && order[..i].iter().any(|b| v & b == 0) {
                self.ignored += 1;
                return;
            }
        }
        if added & !(order.iter().fold(0, |a, b| a | b)) != 0 {
            self.ignored += 1;
            return;
        }
        if added & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            let offered = self.device.features();
            if self.driver_features & !offered != 0
                || self.driver_features & VIRTIO_F_VERSION_1 == 0
            {
                // Leave FEATURES_OK clear: the driver reads it back and gives up.
                self.status = v & !VIRTIO_CONFIG_S_FEATURES_OK & !VIRTIO_CONFIG_S_DRIVER_OK;
                return;
            }
        }
        self.status = v;
        if added & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            self.activate();
        }
    }

    fn activate(&mut self) {
        let mem = self.mem.clone();
        let usable = self.queues.iter().all(|q| !q.ready() || q.is_valid(&mem));
        if !usable {
            self.fail("a ready queue has an invalid size or rings outside guest memory".into());
            return;
        }
        let mut q = Queues {
            mem: &self.mem,
            queues: &mut self.queues,
            interrupt: &self.interrupt,
            resume: 0,
        };
        match self.device.activate(self.driver_features, &mut q) {
            Ok(()) => self.active = true,
            Err(e) => self.fail(e.to_string()),
        }
    }

    /// Marks the device broken and tells the driver (DEVICE_NEEDS_RESET + config interrupt).
    fn fail(&mut self, why: String) {
        self.failure = Some(why);
        self.active = false;
        self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
        self.interrupt.signal_config();
    }

    fn reset(&mut self) {
        self.device.reset();
        for q in &mut self.queues {
            q.reset();
        }
        self.interrupt.clear();
        self.status = 0;
        self.driver_features = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.queue_sel = 0;
        self.active = false;
        self.failure = None;
        self.config_generation = self.config_generation.wrapping_add(1);
    }
}

impl<D: VirtioDevice> MmioDevice for MmioTransport<D> {
    fn mmio_read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= u64::from(reg::VIRTIO_MMIO_CONFIG) {
            self.device
                .read_config(offset - u64::from(reg::VIRTIO_MMIO_CONFIG), data);
            return;
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            self.ignored += 1;
            data.fill(0);
            return;
        }
        let v = self.read_reg(offset as u32);
        data.copy_from_slice(&v.to_le_bytes());
    }

    fn mmio_write(&mut self, offset: u64, data: &[u8]) {
        if offset >= u64::from(reg::VIRTIO_MMIO_CONFIG) {
            self.device
                .write_config(offset - u64::from(reg::VIRTIO_MMIO_CONFIG), data);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            self.ignored += 1;
            return;
        };
        if !offset.is_multiple_of(4) {
            self.ignored += 1;
            return;
        }
        self.write_reg(offset as u32, u32::from_le_bytes(bytes));
    }

    fn save(&self) -> TransportState {
        self.save_state()
    }

    fn restore(&mut self, state: &TransportState) -> Result<(), RestoreError> {
        self.restore_state(state)
    }
}

impl<D: VirtioDevice> MutEventSubscriber for MmioTransport<D> {
    fn init(&mut self, ops: &mut EventOps) {
        for (i, evt) in self.queue_evts.iter().enumerate() {
            // Registration only fails for a closed fd or a full epoll set, both bugs of ours;
            // the device would then simply never see kicks of that queue.
            let _ = ops.add(Events::with_data(evt, i as u32, EventSet::IN));
        }
        self.device.init(ops);
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let data = events.data();
        let (result, resume) = if data < HOST_EVENT_BASE {
            let index = data as usize;
            if let Some(evt) = self.queue_evts.get(index) {
                let _ = evt.read();
            }
            if !self.active || index >= self.queues.len() {
                return;
            }
            let mut q = Queues {
                mem: &self.mem,
                queues: &mut self.queues,
                interrupt: &self.interrupt,
                resume: 0,
            };
            let r = self.device.queue_notify(index, &mut q, ops);
            (r, q.resume)
        } else if self.active {
            let mut q = Queues {
                mem: &self.mem,
                queues: &mut self.queues,
                interrupt: &self.interrupt,
                resume: 0,
            };
            let r = self
                .device
                .host_event(data, events.event_set(), Some(&mut q), ops);
            (r, q.resume)
        } else {
            (
                self.device.host_event(data, events.event_set(), None, ops),
                0,
            )
        };
        // Work left at the device's budget: its queue's eventfd brings the loop back to it after
        // the other ready devices (a level-triggered eventfd, read at the top of the next turn).
        for (i, evt) in self.queue_evts.iter().enumerate() {
            if resume & (1 << i) != 0 {
                let _ = evt.write(1);
            }
        }
        if let Err(e) = result {
            self.fail(e.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::block::Block;
    use crate::virtio::testing::{Driver, MEM_SIZE, queue_base};

    fn block() -> (tempfile::NamedTempFile, Driver<Block>) {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let d = Driver::new(Block::open(f.path(), false, "t").unwrap());
        (f, d)
    }

    #[test]
    fn a_saved_state_restores_to_the_same_registers_and_bad_ones_are_refused() {
        let (f, mut d) = block();
        d.setup(VIRTIO_F_VERSION_1);
        let saved = d.t.lock().unwrap().save_state();
        assert!(saved.active);
        let fresh = || Block::open(f.path(), false, "t").unwrap();
        let r = d.restored(fresh()).expect("restores");
        assert_eq!(r.t.lock().unwrap().save_state(), saved);
        assert_eq!(r.read(reg::VIRTIO_MMIO_STATUS), 15);

        let refused = |change: &dyn Fn(&mut TransportState)| {
            let mut s = saved.clone();
            change(&mut s);
            let irq = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
            let mut t = MmioTransport::new(fresh(), d.mem.clone(), irq).unwrap();
            let e = t.restore_state(&s).expect_err("refused");
            assert!(!t.is_active(), "{e}");
            e.to_string()
        };
        assert!(refused(&|s| s.device_type = 19).contains("type 19"));
        assert!(refused(&|s| s.queues.push(s.queues[0].clone())).contains("2 queues"));
        assert!(refused(&|s| s.queues[0].size = 3).contains("size 3"));
        assert!(
            refused(&|s| s.queues[0].used_ring = MEM_SIZE as u64 - 8)
                .contains("not inside guest memory")
        );
        assert!(refused(&|s| s.status |= 0x100).contains("unknown status"));
        assert!(refused(&|s| s.driver_features |= 1 << 40).contains("never offered"));
        assert!(refused(&|s| s.status = 3).contains("active without"));
    }

    #[test]
    fn identifies_itself_and_ignores_bad_widths() {
        let (_f, d) = block();
        assert_eq!(d.read(reg::VIRTIO_MMIO_MAGIC_VALUE), MAGIC);
        assert_eq!(d.read(reg::VIRTIO_MMIO_VERSION), 2);
        assert_eq!(d.read(reg::VIRTIO_MMIO_DEVICE_ID), 2);
        let mut two = [0xaau8; 2];
        d.t.lock().unwrap().mmio_read(0, &mut two);
        assert_eq!(two, [0, 0]);
        d.t.lock().unwrap().mmio_write(0x70, &[1]);
        assert_eq!(d.read(reg::VIRTIO_MMIO_STATUS), 0);
        d.t.lock().unwrap().mmio_write(0x71, &1u32.to_le_bytes());
        assert_eq!(d.read(reg::VIRTIO_MMIO_STATUS), 0);
        assert!(d.t.lock().unwrap().ignored_accesses() >= 3);
    }

    #[test]
    fn features_outside_the_offer_or_without_version_1_are_refused() {
        let (_f, d) = block();
        d.write(reg::VIRTIO_MMIO_STATUS, 1);
        d.write(reg::VIRTIO_MMIO_STATUS, 3);
        d.write(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
        d.write(reg::VIRTIO_MMIO_DRIVER_FEATURES, 1 << 20); // not offered
        d.write(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        d.write(reg::VIRTIO_MMIO_DRIVER_FEATURES, 1);
        d.write(reg::VIRTIO_MMIO_STATUS, 11);
        assert_eq!(d.read(reg::VIRTIO_MMIO_STATUS) & 8, 0);
        // Without VERSION_1 (legacy drivers) likewise.
        d.write(reg::VIRTIO_MMIO_STATUS, 0);
        d.write(reg::VIRTIO_MMIO_STATUS, 1);
        d.write(reg::VIRTIO_MMIO_STATUS, 3);
        d.write(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        d.write(reg::VIRTIO_MMIO_DRIVER_FEATURES, 0);
        d.write(reg::VIRTIO_MMIO_STATUS, 11);
        assert_eq!(d.read(reg::VIRTIO_MMIO_STATUS) & 8, 0);
    }

    #[test]
    fn status_bits_move_forward_in_order_only() {
        let (_f, d) = block();
        d.write(reg::VIRTIO_MMIO_STATUS, 4); // DRIVER_OK first
        assert_eq!(d.read(reg::VIRTIO_MMIO_STATUS), 0);
        d.write(reg::VIRTIO_MMIO_STATUS, 1);
        d.write(reg::VIRTIO_MMIO_STATUS, 1 | 8); // FEATURES_OK before DRIVER
        assert_eq!(d.read(reg::VIRTIO_MMIO_STATUS), 1);
        d.write(reg::VIRTIO_MMIO_STATUS, 3);
        d.write(reg::VIRTIO_MMIO_STATUS, 2); // dropping a bit
        assert_eq!(d.read(reg::VIRTIO_MMIO_STATUS), 3);
        assert!(!d.t.lock().unwrap().is_active());
    }

    #[test]
    fn zero_oversized_and_odd_queue_sizes_never_become_ready() {
        let (_f, d) = block();
        d.write(reg::VIRTIO_MMIO_STATUS, 1);
        d.write(reg::VIRTIO_MMIO_STATUS, 3);
        d.write(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        d.write(reg::VIRTIO_MMIO_DRIVER_FEATURES, 1);
        d.write(reg::VIRTIO_MMIO_STATUS, 11);
        assert_eq!(d.read(reg::VIRTIO_MMIO_QUEUE_NUM_MAX), 256);
        for size in [0u16, 512, 100] {
            d.write(reg::VIRTIO_MMIO_QUEUE_SEL, 0);
            d.write(reg::VIRTIO_MMIO_QUEUE_NUM, u32::from(size));
            // The size is refused, so the queue keeps its maximum and the rings must fit it;
            // put them outside memory to see that nothing becomes ready.
            d.write(reg::VIRTIO_MMIO_QUEUE_DESC_LOW, MEM_SIZE as u32);
            d.write(reg::VIRTIO_MMIO_QUEUE_READY, 1);
            assert_eq!(d.read(reg::VIRTIO_MMIO_QUEUE_READY), 0, "size {size}");
        }
        // A queue that does not exist reads as size 0 and cannot be made ready.
        d.write(reg::VIRTIO_MMIO_QUEUE_SEL, 7);
        assert_eq!(d.read(reg::VIRTIO_MMIO_QUEUE_NUM_MAX), 0);
        d.write(reg::VIRTIO_MMIO_QUEUE_READY, 1);
        assert_eq!(d.read(reg::VIRTIO_MMIO_QUEUE_READY), 0);
    }

    #[test]
    fn queue_registers_are_frozen_after_driver_ok() {
        let (_f, mut d) = block();
        d.setup(VIRTIO_F_VERSION_1);
        assert!(d.t.lock().unwrap().is_active());
        let before = d.t.lock().unwrap().ignored_accesses();
        d.write(reg::VIRTIO_MMIO_QUEUE_SEL, 0);
        d.write(reg::VIRTIO_MMIO_QUEUE_DESC_LOW, 0xdead_0000);
        d.write(reg::VIRTIO_MMIO_QUEUE_NUM, 2);
        d.write(reg::VIRTIO_MMIO_QUEUE_READY, 0);
        assert_eq!(d.t.lock().unwrap().ignored_accesses(), before + 3);
        assert_eq!(d.read(reg::VIRTIO_MMIO_QUEUE_READY), 1);
        // The queue still works where it was set up.
        d.put(0x20_0000, &[8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]); // GET_ID
        d.add_chain(
            0,
            &[
                (0x20_0000, 16, false),
                (0x20_1000, 20, true),
                (0x20_2000, 1, true),
            ],
        );
        d.kick(0);
        assert_eq!(d.used(0), vec![(0, 21)]);
        assert_eq!(d.get(0x20_2000, 1), vec![0]);
        let _ = queue_base(0);
    }

    #[test]
    fn rings_outside_guest_memory_are_refused() {
        let (_f, d) = block();
        d.write(reg::VIRTIO_MMIO_STATUS, 1);
        d.write(reg::VIRTIO_MMIO_STATUS, 3);
        d.write(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        d.write(reg::VIRTIO_MMIO_DRIVER_FEATURES, 1);
        d.write(reg::VIRTIO_MMIO_STATUS, 11);
        d.write(reg::VIRTIO_MMIO_QUEUE_SEL, 0);
        d.write(reg::VIRTIO_MMIO_QUEUE_DESC_LOW, 0);
        d.write(reg::VIRTIO_MMIO_QUEUE_DESC_HIGH, 7); // 28 GiB: no such memory
        d.write(reg::VIRTIO_MMIO_QUEUE_AVAIL_LOW, 0x1000);
        d.write(reg::VIRTIO_MMIO_QUEUE_USED_LOW, 0x2000);
        d.write(reg::VIRTIO_MMIO_QUEUE_READY, 1);
        assert_eq!(d.read(reg::VIRTIO_MMIO_QUEUE_READY), 0);
    }

    #[test]
    fn reset_forgets_the_driver() {
        let (_f, mut d) = block();
        d.setup(VIRTIO_F_VERSION_1);
        let generation = d.read(reg::VIRTIO_MMIO_CONFIG_GENERATION);
        d.write(reg::VIRTIO_MMIO_STATUS, 0);
        assert_eq!(d.read(reg::VIRTIO_MMIO_STATUS), 0);
        assert_eq!(d.read(reg::VIRTIO_MMIO_QUEUE_READY), 0);
        assert!(!d.t.lock().unwrap().is_active());
        assert_ne!(d.read(reg::VIRTIO_MMIO_CONFIG_GENERATION), generation);
        // And it can be set up again.
        d.setup(VIRTIO_F_VERSION_1);
        assert!(d.t.lock().unwrap().is_active());
    }
}
