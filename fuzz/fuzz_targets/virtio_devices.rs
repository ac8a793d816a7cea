//! The virtio-mmio transport and each device behind it (block, net, vsock), driven as a hostile
//! guest driver would: register writes and reads, queue set-up, descriptors and guest memory all
//! from the input, kicks, resets, and host-side events (a frame for the guest, a host connection).
//! Invariants, checked after every kick: the device wrote guest memory only inside a
//! device-writable buffer of its queues' descriptor tables or its used rings; each event-loop
//! round completes at most the device's per-wake-up budget of chains per event (64 for block,
//! 256 for net and vsock); the loop goes idle within a bounded number of rounds.
#![no_main]

use std::collections::VecDeque;
use std::os::fd::RawFd;

use libfuzzer_sys::fuzz_target;
use sandbox_fuzz::Input;
use sandbox_devices::virtio::block::Block;
use sandbox_devices::virtio::net::{Net, NetBackend};
use sandbox_devices::virtio::testing::{Driver, queue_base};
use sandbox_devices::virtio::vsock::{Vsock, VsockHandle};
use sandbox_devices::virtio::{CHAINS_PER_WAKE, VirtioDevice};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};

/// Guest memory: the three queues' rings at the harness's addresses (64 KiB apart from 64 KiB)
/// and buffers around them. Small, because every kick compares all of it twice.
const MEM: usize = 0x4_0000;
/// Event-loop rounds after one kick before the device counts as never going idle.
const MAX_ROUNDS: usize = 4096;

/// A network backend whose frames for the guest come from the input.
#[derive(Default)]
struct FuzzNet {
    to_guest: VecDeque<Vec<u8>>,
}

impl NetBackend for FuzzNet {
    fn send(&mut self, _frame: &[u8]) {}
    fn recv(&mut self, buf: &mut [u8]) -> Option<usize> {
        let f = self.to_guest.pop_front()?;
        let n = f.len().min(buf.len());
        buf[..n].copy_from_slice(&f[..n]);
        Some(n)
    }
    fn ready_fd(&self) -> Option<RawFd> {
        None
    }
}

/// Byte ranges the device may write: every device-writable descriptor of each ready queue's
/// table, and each ready queue's used ring.
fn writable<D: VirtioDevice + 'static>(d: &Driver<D>) -> Vec<(u64, u64)> {
    let t = d.t.lock().unwrap();
    let mut out = vec![];
    for q in t.queues() {
        if !q.ready() {
            continue;
        }
        let size = u64::from(q.size());
        out.push((q.used_ring(), q.used_ring() + 6 + 8 * size));
        for i in 0..size {
            let at = GuestAddress(q.desc_table().wrapping_add(16 * i));
            let mut raw = [0u8; 16];
            if d.mem.read_slice(&mut raw, at).is_err() {
                continue;
            }
            let addr = u64::from_le_bytes(raw[0..8].try_into().unwrap());
            let len = u64::from(u32::from_le_bytes(raw[8..12].try_into().unwrap()));
            let flags = u16::from_le_bytes(raw[12..14].try_into().unwrap());
            if flags & 2 != 0 {
                out.push((addr, addr.saturating_add(len)));
            }
        }
    }
    out
}

fn snapshot<D: VirtioDevice + 'static>(d: &Driver<D>, into: &mut Vec<u8>) {
    into.resize(MEM, 0);
    d.mem.read_slice(into, GuestAddress(0)).unwrap();
}

thread_local! {
    /// The two copies of guest memory each kick compares, kept between kicks and inputs.
    static COPIES: std::cell::RefCell<(Vec<u8>, Vec<u8>)> = Default::default();
}

/// Each queue's count of chains completed, as the device keeps it (not the used index in guest
/// memory, which a device-writable buffer over another queue's used ring may also move).
fn used_idx<D: VirtioDevice + 'static>(d: &Driver<D>) -> Vec<u16> {
    let t = d.t.lock().unwrap();
    t.queues().iter().map(|q| q.next_used()).collect()
}

/// Runs the event loop to idle one round at a time, checking the work of each round, then
/// checks what the device wrote.
fn run_checked<D: VirtioDevice + 'static>(d: &mut Driver<D>, budget: usize) {
    COPIES.with_borrow_mut(|(before, after)| run_checked_with(d, budget, before, after))
}

fn run_checked_with<D: VirtioDevice + 'static>(
    d: &mut Driver<D>,
    budget: usize,
    before: &mut Vec<u8>,
    after: &mut Vec<u8>,
) {
    // What the device may write, gathered before every round: a write into a descriptor table
    // (a buffer over it) may make a later descriptor writable.
    let mut allowed: std::collections::HashSet<(u64, u64)> = writable(d).into_iter().collect();
    snapshot(d, before);
    let mut idx = used_idx(d);
    let mut rounds = 0;
    loop {
        let events = d.em.run_with_timeout(0).unwrap();
        if events == 0 {
            break;
        }
        rounds += 1;
        allowed.extend(writable(d));
        assert!(
            rounds < MAX_ROUNDS,
            "the device did not go idle after {MAX_ROUNDS} rounds"
        );
        let now = used_idx(d);
        for (q, (a, b)) in idx.iter().zip(&now).enumerate() {
            let done = usize::from(b.wrapping_sub(*a));
            assert!(
                done <= budget * events as usize,
                "queue {q} completed {done} chains in one round of {events} events (budget {budget} each)"
            );
        }
        idx = now;
    }
    snapshot(d, after);
    // Page by page (a memcmp each), bytes only where a page changed.
    if before == after {
        return;
    }
    for (p, (x, y)) in before.chunks(4096).zip(after.chunks(4096)).enumerate() {
        if x == y {
            continue;
        }
        for (i, (a, b)) in x.iter().zip(y).enumerate() {
            if a != b {
                let at = (p * 4096 + i) as u64;
                assert!(
                    allowed.iter().any(|&(s, e)| s <= at && at < e),
                    "the device wrote guest byte {at:#x}, outside every writable buffer and used ring"
                );
            }
        }
    }
}

/// One input's session against `d`. `host` delivers a host-side event for op 7.
fn drive<D: VirtioDevice + 'static>(
    d: &mut Driver<D>,
    budget: usize,
    input: &mut Input,
    mut host: impl FnMut(&mut Driver<D>, &mut Input),
) {
    let nq = d.t.lock().unwrap().queues().len();
    let mut next = vec![0u16; nq];
    let mut avail = vec![0u16; nq];
    let mut steps = 0;
    while let Some(op) = input.byte() {
        steps += 1;
        if steps > 512 {
            break;
        }
        match op % 8 {
            0 => {
                // A register write anywhere in the window (config space included).
                let off = u32::from(input.u16_le().unwrap_or(0) & 0x1fc);
                let v = input.u32_le().unwrap_or(0);
                d.write(off, v);
            }
            1 => {
                let off = u32::from(input.u16_le().unwrap_or(0) & 0x1ff);
                let _ = d.read(off);
            }
            2 => {
                // Guest memory: anything, anywhere (rings included).
                let at = u64::from(input.u32_le().unwrap_or(0)) % MEM as u64;
                let n = usize::from(input.byte().unwrap_or(0));
                let b = input.bytes(n).to_vec();
                let n = b.len().min(MEM - at as usize);
                d.put(at, &b[..n]);
            }
            3 => {
                // The driver's usual start, with the features the input offers.
                let features = u64::from(input.u32_le().unwrap_or(0)) | (1 << 32);
                for (reg, v) in [
                    (0x70, 1),
                    (0x70, 3),
                    (0x24, 0),
                    (0x20, features as u32),
                    (0x24, 1),
                    (0x20, (features >> 32) as u32),
                    (0x70, 11),
                ] {
                    d.write(reg, v);
                }
                for q in 0..nq {
                    let size = 1u16 << (input.byte().unwrap_or(8) % 9);
                    d.setup_queue(q, size);
                }
                d.write(0x70, 15);
            }
            4 => {
                // A chain of up to four descriptors on a queue, then published.
                let q = usize::from(input.byte().unwrap_or(0)) % nq.max(1);
                let n = 1 + usize::from(input.byte().unwrap_or(0) % 4);
                let head = next[q];
                for i in 0..n {
                    let addr = u64::from(input.u32_le().unwrap_or(0x3_8000)) % (MEM as u64 + 0x1000);
                    let len = u32::from(input.u16_le().unwrap_or(512));
                    let w = input.byte().unwrap_or(0) & 1 == 1;
                    let idx = head.wrapping_add(i as u16) % 256;
                    let last = i + 1 == n;
                    let flags = (if last { 0 } else { 1 }) | (if w { 2 } else { 0 });
                    d.put_desc(q, idx, addr, len, flags, idx.wrapping_add(1) % 256);
                }
                next[q] = head.wrapping_add(n as u16) % 256;
                // Publish on the avail ring at the harness's address (whatever size is set).
                let ring = queue_base(q) + 0x1000;
                let slot = u64::from(avail[q] % 256);
                let _ = d.mem.write_obj(head, GuestAddress(ring + 4 + 2 * slot));
                avail[q] = avail[q].wrapping_add(1);
                let _ = d.mem.write_obj(avail[q], GuestAddress(ring + 2));
            }
            5 => {
                let q = u32::from(input.byte().unwrap_or(0)) % (nq as u32 + 1);
                d.write(0x50, q);
                run_checked(d, budget);
            }
            6 => {
                d.write(0x70, 0);
                next.fill(0);
                avail.fill(0);
                run_checked(d, budget);
            }
            _ => {
                host(d, input);
                run_checked(d, budget);
            }
        }
    }
    run_checked(d, budget);
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    match input.byte().unwrap_or(0) % 3 {
        0 => {
            let file = tempfile::tempfile().unwrap();
            file.set_len(64 * 1024).unwrap();
            let read_only = input.byte().unwrap_or(0) & 1 == 1;
            let block = Block::from_file(file, read_only, "fuzz-disk").unwrap();
            let mut d = Driver::with_memory(block, MEM);
            drive(&mut d, CHAINS_PER_WAKE, &mut input, |_, _| {});
        }
        1 => {
            let mut d = Driver::with_memory(Net::new([2, 0, 0, 0, 0, 1], FuzzNet::default()), MEM);
            drive(&mut d, 256, &mut input, |d, input| {
                let n = usize::from(input.u16_le().unwrap_or(0) % 2048);
                let frame = input.bytes(n).to_vec();
                d.t.lock()
                    .unwrap()
                    .device_mut()
                    .backend_mut()
                    .to_guest
                    .push_back(frame);
                d.write(0x50, 0);
            });
        }
        _ => {
            let (vsock, handle): (Vsock, VsockHandle) = Vsock::new(3).unwrap();
            let mut d = Driver::with_memory(vsock, MEM);
            let mut held = vec![];
            drive(&mut d, 256, &mut input, |_, input| {
                // A host connection to a guest port, and bytes on it.
                let port = u32::from(input.u16_le().unwrap_or(1024));
                let tx = std::sync::Arc::new(std::sync::Mutex::new(None));
                let t = tx.clone();
                handle.connect(port, Box::new(move |r| *t.lock().unwrap() = r.ok()));
                held.push(tx);
            });
            drop(held);
        }
    }
});
