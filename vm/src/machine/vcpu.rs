//! A vCPU's thread: running the guest (`KVM_RUN`) and handling its exits, parking for a
//! pause, and the signal that kicks it out of the guest.

use super::*;

pub(super) fn vcpu_loop(
    mut vcpu: VcpuFd,
    id: usize,
    shared: &Shared,
    bus: &[(u64, BusDevice)],
    console: &Mutex<serial::Console>,
    msr_list: Option<&[u32]>,
) {
    while !shared.stopping.load(Ordering::SeqCst) {
        if shared.pausing.load(Ordering::SeqCst) {
            park_vcpu(&mut vcpu, id, shared, bus, console, msr_list);
            continue;
        }
        run_once(&mut vcpu, id, shared, bus, console);
    }
}

/// One KVM_RUN and the exit it gave, handled. True when KVM_RUN was interrupted (a kick, or
/// `immediate_exit`) rather than exiting for the guest.
pub(super) fn run_once(
    vcpu: &mut VcpuFd,
    id: usize,
    shared: &Shared,
    bus: &[(u64, BusDevice)],
    console: &Mutex<serial::Console>,
) -> bool {
    let find = |addr: u64| {
        bus.iter()
            .find(|(base, _)| (*base..*base + WINDOW).contains(&addr))
    };
    let stats = &shared.vcpu_stats[id];
    stats.in_guest.store(true, Ordering::Relaxed);
    let exit = vcpu.run();
    stats.in_guest.store(false, Ordering::Relaxed);
    stats.exits.fetch_add(1, Ordering::Relaxed);
    stats.last.store(exit_kind(&exit), Ordering::Relaxed);
    match exit {
        Ok(VcpuExit::IoOut(port, data)) => port_write(port, data, shared, console),
        Ok(VcpuExit::IoIn(port, data)) => data.fill(port_read(port, console)),
        Ok(VcpuExit::MmioRead(addr, data)) => match find(addr) {
            Some((base, dev)) => dev
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .mmio_read(addr - base, data),
            None => data.fill(0xff),
        },
        Ok(VcpuExit::MmioWrite(addr, data)) => {
            if let Some((base, dev)) = find(addr) {
                dev.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .mmio_write(addr - base, data);
            }
        }
        Ok(VcpuExit::Hlt) => shared.end("the guest halted".into(), true, false),
        Ok(VcpuExit::Shutdown) => shared.end(
            format!(
                "the guest powered off or restarted (triple fault{})",
                where_it_was(vcpu, id)
            ),
            true,
            false,
        ),
        Ok(VcpuExit::SystemEvent(kind, _)) => {
            shared.end(format!("the guest sent system event {kind}"), true, false)
        }
        Ok(VcpuExit::FailEntry(reason, cpu)) => shared.end(
            format!("KVM could not enter vCPU {cpu} (hardware reason {reason:#x})"),
            false,
            false,
        ),
        Ok(VcpuExit::InternalError) => shared.end(
            format!("KVM internal error on vCPU {id} (the host's KVM cannot run this guest)"),
            false,
            false,
        ),
        Ok(other) => shared.end(
            format!("unexpected exit of vCPU {id}: {other:?}"),
            false,
            false,
        ),
        Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => return true,
        Err(e) => shared.end(format!("KVM_RUN failed on vCPU {id}: {e}"), false, false),
    }
    false
}

/// A guest's write to an I/O port: the serial console, the i8042's reset line, the boot marker;
/// every other port ignores it.
fn port_write(port: u16, data: &[u8], shared: &Shared, console: &Mutex<serial::Console>) {
    match port {
        p if (serial::COM1_BASE..serial::COM1_BASE + serial::COM1_LEN).contains(&p) => {
            if let Some(&b) = data.first() {
                let _ = console
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .write((p - serial::COM1_BASE) as u8, b);
            }
        }
        // i8042 command 0xFE: pulse the reset line.
        0x64 if data.first() == Some(&0xfe) => {
            shared.end(
                "the guest powered off or restarted (i8042 reset)".into(),
                true,
                false,
            );
        }
        BootMarker::PORT => {
            if let Some(&b) = data.first()
                && shared.marker.write(b)
            {
                // Under the lock its waiters check the mark with: none misses it.
                let _held = shared.exit.lock().unwrap_or_else(|e| e.into_inner());
                shared.ended.notify_all();
            }
        }
        _ => {}
    }
}

/// What a guest reads from an I/O port: the serial console's registers, an i8042 with nothing
/// to say, all ones elsewhere.
fn port_read(port: u16, console: &Mutex<serial::Console>) -> u8 {
    match port {
        p if (serial::COM1_BASE..serial::COM1_BASE + serial::COM1_LEN).contains(&p) => console
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .read((p - serial::COM1_BASE) as u8),
        // i8042 status: no data, input buffer empty.
        0x64 | 0x60 => 0,
        _ => 0xff,
    }
}

/// Where a vCPU was when the guest shut down: it tells a reboot (reboot=t) from a crash early
/// in boot.
fn where_it_was(vcpu: &VcpuFd, id: usize) -> String {
    match (vcpu.get_regs(), vcpu.get_sregs()) {
        (Ok(r), Ok(s)) => format!(
            " on vCPU {id} at rip {:#x}, cr0 {:#x}, cr3 {:#x}, cr4 {:#x}",
            r.rip, s.cr0, s.cr3, s.cr4
        ),
        _ => String::new(),
    }
}

/// The most exits a vCPU handles while it completes its last one for a pause.
pub(super) const PARK_EXITS: usize = 2048;

/// Parks a vCPU thread for a pause. First it completes its last exit (KVM finishes an I/O or
/// MMIO read only on the next KVM_RUN, which `immediate_exit` makes return at once; an exit that
/// run starts is handled the same way) and says it stopped. Its state is read only once every
/// vCPU and the device thread have stopped ([`Machine::pause`] asks), so no interrupt sent by
/// another vCPU or a device can land after it was read. It waits until that pause ends or the
/// machine stops.
pub(super) fn park_vcpu(
    vcpu: &mut VcpuFd,
    id: usize,
    shared: &Shared,
    bus: &[(u64, BusDevice)],
    console: &Mutex<serial::Console>,
    msr_list: Option<&[u32]>,
) {
    let epoch = lock(&shared.pause).epoch;
    vcpu.set_kvm_immediate_exit(1);
    // Each turn handles one exit the completion started; a guest cannot chain them forever:
    // KVM emulates a `rep` string instruction on MMIO one exit per element but goes back to
    // the guest's entry (where `immediate_exit` stops it) every 1024 elements at most, so a
    // bound above that lets a guest that loops on one still be paused.
    let mut completed = false;
    for _ in 0..PARK_EXITS {
        if run_once(vcpu, id, shared, bus, console) || shared.stopping.load(Ordering::SeqCst) {
            completed = true;
            break;
        }
    }
    vcpu.set_kvm_immediate_exit(0);
    let mut p = lock(&shared.pause);
    if p.epoch != epoch {
        return; // that pause ended meanwhile
    }
    if let Some(slot) = p.stopped.get_mut(id) {
        *slot = true;
    }
    shared.pause_cv.notify_all();
    while shared.pausing.load(Ordering::SeqCst)
        && !shared.stopping.load(Ordering::SeqCst)
        && p.epoch == epoch
    {
        if p.save && matches!(p.saved.get(id), Some(None)) {
            drop(p);
            let state = if !completed {
                Err("its last exit did not complete".to_string())
            } else {
                match msr_list {
                    Some(list) => crate::snapshot::save_vcpu(vcpu, list).map_err(|e| e.to_string()),
                    None => Err("KVM did not list the MSRs to save".to_string()),
                }
            };
            p = lock(&shared.pause);
            if p.epoch == epoch
                && let Some(slot) = p.saved.get_mut(id)
            {
                *slot = Some(state);
            }
            shared.pause_cv.notify_all();
            continue;
        }
        p = shared.pause_cv.wait(p).unwrap_or_else(|e| e.into_inner());
    }
}

/// Kind (low byte) and address or port (above) of a vCPU exit, for [`VcpuStats::last`].
pub(super) fn exit_kind(exit: &Result<VcpuExit<'_>, kvm_ioctls::Error>) -> u64 {
    let (kind, at) = match exit {
        Ok(VcpuExit::IoOut(p, _)) => (1, u64::from(*p)),
        Ok(VcpuExit::IoIn(p, _)) => (2, u64::from(*p)),
        Ok(VcpuExit::MmioRead(a, _)) => (3, *a),
        Ok(VcpuExit::MmioWrite(a, _)) => (4, *a),
        Ok(VcpuExit::Hlt) => (5, 0),
        Ok(VcpuExit::Shutdown) => (6, 0),
        Ok(_) => (7, 0),
        Err(e) => (8, e.errno() as u64),
    };
    kind | (at << 8)
}

pub(super) fn exit_name(kind: u8) -> &'static str {
    match kind {
        0 => "none",
        1 => "port write",
        2 => "port read",
        3 => "MMIO read",
        4 => "MMIO write",
        5 => "HLT",
        6 => "shutdown",
        7 => "other exit",
        _ => "KVM_RUN error, errno",
    }
}

pub(super) fn install_kick_handler() {
    // Registering a handler for SIGRTMIN only fails for an invalid signal number.
    let _ =
        vmm_sys_util::signal::register_signal_handler(vmm_sys_util::signal::SIGRTMIN(), on_kick);
}

pub(super) fn kick(thread: libc::pthread_t) {
    // SAFETY: `thread` belongs to a JoinHandle not yet joined, so the thread id is valid; the
    // signal has a no-op handler installed, so its only effect is to interrupt KVM_RUN.
    unsafe { libc::pthread_kill(thread, vmm_sys_util::signal::SIGRTMIN()) };
}
