//! The supervisor thread, which ends every other thread of the machine once it has ended, and
//! the device thread's parking for a pause.

use super::*;

/// Waits for the machine to end, then brings every thread down and releases the VM.
pub(super) fn supervise(
    shared: &Shared,
    vcpu_threads: Vec<JoinHandle<()>>,
    device_thread: JoinHandle<()>,
    device_kick: &EventFd,
    vm: Arc<VmFd>,
    ioevents: Vec<EventFd>,
    mem: GuestMemoryMmap,
) {
    {
        let exit = shared.exit.lock().unwrap_or_else(|e| e.into_inner());
        let _exit = shared
            .ended
            .wait_while(exit, |e| e.is_none())
            .unwrap_or_else(|e| e.into_inner());
    }
    // A kick can land just before a vCPU enters KVM_RUN and be lost; repeat until each is out.
    let kicking = Instant::now();
    while shared.running_vcpus.load(Ordering::SeqCst) > 0 {
        for h in &vcpu_threads {
            kick(h.as_pthread_t());
        }
        let pause = if kicking.elapsed() < STOP_TIMEOUT {
            KICK_FAST
        } else {
            KICK_SLOW
        };
        let guard = shared.exit.lock().unwrap_or_else(|e| e.into_inner());
        let _ = shared.ended.wait_timeout(guard, pause);
    }
    for h in vcpu_threads {
        let _ = h.join();
    }
    let _ = device_kick.write(1);
    let _ = device_thread.join();
    drop(ioevents);
    drop(vm);
    drop(mem);
}

/// Parks the device thread for a pause (no device touches guest memory until it ends).
pub(super) fn park_devices(shared: &Shared) {
    let mut p = lock(&shared.pause);
    let epoch = p.epoch;
    p.device_parked = true;
    shared.pause_cv.notify_all();
    while shared.pausing.load(Ordering::SeqCst)
        && !shared.stopping.load(Ordering::SeqCst)
        && p.epoch == epoch
    {
        p = shared.pause_cv.wait(p).unwrap_or_else(|e| e.into_inner());
    }
}
