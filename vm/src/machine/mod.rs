//! One KVM virtual machine: memory, the in-kernel irqchip and PIT, the legacy devices on the I/O
//! bus (serial console, i8042 reset, boot marker), the virtio-mmio devices, one thread per vCPU,
//! a device thread (event-manager) and a supervisor thread that ends them all.
//!
//! How it ends: the first of a guest reset (i8042), a triple fault or reboot, a KVM failure, a
//! panic of one of its threads, [`Machine::fail`] or [`Machine::stop`] is recorded as the
//! machine's exit; the supervisor then kicks every vCPU out of KVM_RUN (a signal, repeated until
//! each thread has left) and stops the device thread. [`Machine::stop`] waits for that at most
//! [`STOP_TIMEOUT`]: normally no thread of the machine is left when it returns; a thread that
//! cannot be brought down in time (stuck in a host syscall) is reported and left to end on its
//! own, never waited for without bound.

use crate::seal::ThreadKind;
use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use kvm_bindings::{KVM_PIT_SPEAKER_DUMMY, kvm_pit_config, kvm_userspace_memory_region};
use kvm_ioctls::{IoEventAddress, Kvm, VcpuExit, VcpuFd, VmFd};
use sandbox_control::console::ConsoleLog;
use sandbox_devices::BootMarker;
use sandbox_devices::virtio::block::Block;
use sandbox_devices::virtio::mmio::{MmioDevice, MmioTransport, WINDOW};
use sandbox_devices::virtio::net::Net;
use sandbox_devices::virtio::vsock::{Vsock, VsockHandle};
use sandbox_devices::virtio::{Interrupt, VirtioDevice};
use thiserror::Error;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, MemoryRegionAddress};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::{boot, cpu, layout, mptable, serial, snapshot};

mod build;
pub mod config;
mod pause;
mod supervisor;
mod vcpu;

pub use config::{ConsoleFn, ConsoleSink, DiskConfig, FileRef, MachineConfig, Restore};
use supervisor::{park_devices, supervise};
use vcpu::{exit_name, install_kick_handler, kick, vcpu_loop};

/// Where the virtio-mmio windows start (inside the hole below 4 GiB), one page each.
pub const MMIO_BASE: u64 = 0xd000_0000;
/// The interrupt lines handed to virtio devices, in order (ISA lines nothing else uses here).
const DEVICE_IRQS: [u32; 8] = [5, 6, 7, 9, 10, 11, 14, 15];
/// The QueueNotify register's offset in a window.
const QUEUE_NOTIFY: u64 = 0x50;
/// The longest [`Machine::stop`] waits for the machine's threads to end.
pub use sandbox_control::vm::STOP_TIMEOUT;
/// How often the supervisor re-kicks vCPUs still in KVM_RUN: often at first (a kick that lands
/// just before KVM_RUN is lost), then rarely, so a thread stuck elsewhere costs no CPU.
const KICK_FAST: Duration = Duration::from_millis(5);
const KICK_SLOW: Duration = Duration::from_secs(1);

/// A machine built, before its threads start: what [`Machine::boot`] and [`Machine::restore`]
/// hand to the shared rest.
struct Built {
    t0: Instant,
    kvm: Kvm,
    vm: VmFd,
    mem: GuestMemoryMmap,
    devices: build::Devices,
    log: Arc<Mutex<ConsoleLog>>,
    console: Arc<Mutex<serial::Console>>,
    vcpus: Vec<VcpuFd>,
    msr_list: Option<Vec<u32>>,
}

/// What [`Machine::snapshot`] wrote.
#[derive(Debug, Clone, Copy)]
pub struct SnapshotStats {
    /// Guest memory bytes written (pages with data; the rest are holes).
    pub memory_written: u64,
    /// How long the vCPUs took to stop.
    pub pause: Duration,
    /// How long the state and memory took to write.
    pub write: Duration,
}

/// How the guest ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineExit {
    /// For a person.
    pub reason: String,
    /// The guest asked for it (reboot, power-off, triple fault), as opposed to a failure.
    pub by_guest: bool,
    /// The host stopped it.
    pub requested: bool,
    /// The last console lines.
    pub console: Vec<String>,
}

/// Why a machine could not be built.
#[derive(Debug, Error)]
pub enum MachineError {
    /// A KVM ioctl failed.
    #[error("{step}: {source}")]
    Kvm {
        /// What was being done.
        step: &'static str,
        /// The error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Guest memory could not be mapped.
    #[error("guest memory: {0}")]
    Memory(String),
    /// The guest could not be loaded.
    #[error(transparent)]
    Boot(#[from] boot::LoadError),
    /// A vCPU could not be set up.
    #[error(transparent)]
    Cpu(#[from] cpu::CpuError),
    /// The MP table could not be written.
    #[error(transparent)]
    MpTable(#[from] mptable::MpTableError),
    /// Too many devices for the interrupt lines we hand out.
    #[error("{0} virtio devices are more than the {max} this machine wires up", max = DEVICE_IRQS.len())]
    TooManyDevices(usize),
    /// The snapshot could not be restored.
    #[error(transparent)]
    Snapshot(#[from] snapshot::SnapshotError),
    /// A device's saved state was refused.
    #[error("device {index}: {source}")]
    DeviceState {
        /// Its place on the bus.
        index: usize,
        /// Why.
        #[source]
        source: sandbox_devices::virtio::mmio::RestoreError,
    },
    /// A host resource (disk file, eventfd, thread) failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
}

fn kvm_err(step: &'static str) -> impl Fn(kvm_ioctls::Error) -> MachineError {
    move |source| MachineError::Kvm { step, source }
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> MachineError {
    let context = context.into();
    move |source| MachineError::Io { context, source }
}

type Subscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;
/// Runs once when the machine has fully stopped.
pub type OnExit = Box<dyn FnOnce(&MachineExit) + Send>;
type SharedOnExit = Arc<Mutex<Option<OnExit>>>;
type BusDevice = Arc<Mutex<dyn MmioDevice>>;

/// State shared by the machine's threads.
struct Shared {
    exit: Mutex<Option<MachineExit>>,
    ended: Condvar,
    /// Set once everything of the machine has stopped.
    finished: Mutex<bool>,
    finished_cv: Condvar,
    stopping: AtomicBool,
    running_vcpus: AtomicUsize,
    log: Arc<Mutex<ConsoleLog>>,
    marker: BootMarker,
    /// Per vCPU: what it last left KVM_RUN for, to tell a spinning guest from a stuck thread.
    vcpu_stats: Vec<VcpuStats>,
    /// A stop gave up waiting for the threads once; later stops do not wait again.
    abandoned: AtomicBool,
    /// Set while the machine is to be paused: vCPU and device threads park at their next turn.
    pausing: AtomicBool,
    pause: Mutex<PauseState>,
    pause_cv: Condvar,
    /// The vCPUs wait here, sealed, for every other thread's filter.
    gate: crate::gate::Gate,
}

/// Where a pause stands; under [`Shared::pause`].
#[derive(Default)]
struct PauseState {
    /// Counts pauses: a thread parked for one pause never answers for the next.
    epoch: u64,
    /// Per vCPU: out of KVM_RUN with its last exit completed.
    stopped: Vec<bool>,
    device_parked: bool,
    /// Every thread stopped: the vCPUs read their state now.
    save: bool,
    /// Per vCPU: its state (or why it could not be read), once read.
    saved: Vec<Option<Result<snapshot::VcpuState, String>>>,
}

/// What one vCPU thread has been doing, readable from any thread.
#[derive(Debug, Default)]
struct VcpuStats {
    exits: AtomicU64,
    /// The last exit: its kind (see [`vcpu::exit_kind`]) in the low byte, its address or port above.
    last: AtomicU64,
    /// Set while the thread is inside KVM_RUN.
    in_guest: AtomicBool,
}

impl Shared {
    /// The state of a machine of `vcpus` started at `t0`, its console in `log`.
    fn new(t0: Instant, vcpus: u8, log: Arc<Mutex<ConsoleLog>>) -> Shared {
        Shared {
            exit: Mutex::new(None),
            ended: Condvar::new(),
            finished: Mutex::new(false),
            finished_cv: Condvar::new(),
            stopping: AtomicBool::new(false),
            running_vcpus: AtomicUsize::new(usize::from(vcpus)),
            log,
            marker: BootMarker::new(t0),
            vcpu_stats: (0..vcpus).map(|_| VcpuStats::default()).collect(),
            abandoned: AtomicBool::new(false),
            pausing: AtomicBool::new(false),
            pause: Mutex::new(PauseState::default()),
            pause_cv: Condvar::new(),
            // The device thread, the supervisor and the caller's release.
            gate: crate::gate::Gate::new(3),
        }
    }

    fn tail(&self, n: usize) -> Vec<String> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).tail(n)
    }

    /// One line per vCPU: exits taken, the last one, and whether it is in the guest now.
    fn vcpu_report(&self) -> String {
        self.vcpu_stats
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let last = v.last.load(Ordering::Relaxed);
                format!(
                    "vCPU {i}: {} exits, last {} {:#x}, {}",
                    v.exits.load(Ordering::Relaxed),
                    exit_name(last as u8),
                    last >> 8,
                    if v.in_guest.load(Ordering::Relaxed) {
                        "inside KVM_RUN"
                    } else {
                        "in the VMM"
                    }
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Records how the machine ended (the first report wins) and wakes the supervisor.
    fn end(&self, reason: String, by_guest: bool, requested: bool) {
        let mut exit = self.exit.lock().unwrap_or_else(|e| e.into_inner());
        if exit.is_none() {
            *exit = Some(MachineExit {
                reason,
                by_guest,
                requested,
                console: self.tail(20),
            });
        }
        self.stopping.store(true, Ordering::SeqCst);
        self.ended.notify_all();
        drop(exit);
        self.gate.shut();
        // Parked threads wake to see `stopping`.
        let _p = self.pause.lock().unwrap_or_else(|e| e.into_inner());
        self.pause_cv.notify_all();
    }
}

/// Runs `f`, which hands a snapshot's saved state to KVM, on a thread of its own under the
/// restore filter ([`ThreadKind::Restore`]: only the `KVM_SET_*` calls a restore makes), so
/// what a state file a guest may have shaped reaches in the kernel is that list (issue 30).
/// Without a sealer (the in-process machine) it is only a thread.
fn restoring<F>(f: F) -> Result<(), MachineError>
where
    F: FnOnce() -> Result<(), snapshot::SnapshotError> + Send,
{
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("vm-restore".into())
            .spawn_scoped(s, || -> Result<(), MachineError> {
                crate::seal::enter(ThreadKind::Restore).map_err(|e| MachineError::Io {
                    context: "sealing the restore".into(),
                    source: std::io::Error::other(e.to_string()),
                })?;
                Ok(f()?)
            })
            .map_err(io_err("starting the restore thread"))?
            .join()
            .unwrap_or_else(|_| {
                Err(MachineError::Io {
                    context: "restoring the snapshot".into(),
                    source: std::io::Error::other("the restore thread panicked"),
                })
            })
    })
}

/// A running (or ended) machine.
pub struct Machine {
    shared: Arc<Shared>,
    vsock: VsockHandle,
    supervisor: Mutex<Option<JoinHandle<()>>>,
    on_exit: SharedOnExit,
    parts: Option<Parts>,
    /// [`Machine::release`] passed the gate: once, whoever calls it again.
    released: AtomicBool,
}

/// What a snapshot reads besides the vCPUs. Field order is drop order: the VM before the memory
/// its slots point into.
struct Parts {
    vm: Arc<VmFd>,
    host: snapshot::HostId,
    mem: GuestMemoryMmap,
    bus: Arc<Vec<(u64, BusDevice)>>,
    console: Arc<Mutex<serial::Console>>,
    device_kick: Arc<EventFd>,
    vcpu_threads: Vec<libc::pthread_t>,
    memory_mib: u32,
}

impl Machine {
    /// Builds the machine and starts its threads. `on_exit` runs once, on the supervisor
    /// thread, when the machine has fully stopped.
    pub fn start(cfg: &MachineConfig, on_exit: Option<OnExit>) -> Result<Machine, MachineError> {
        let m = Machine::start_held(cfg, on_exit)?;
        m.release();
        Ok(m)
    }

    /// [`Machine::start`] with the guest held: its vCPUs wait, each sealed, until the caller
    /// has sealed its own thread and calls [`Machine::release`] (the VM process's main thread),
    /// and the machine's device and supervisor threads have sealed theirs. A machine whose
    /// configuration names a snapshot is restored from it, any other booted.
    pub fn start_held(
        cfg: &MachineConfig,
        on_exit: Option<OnExit>,
    ) -> Result<Machine, MachineError> {
        if cfg.vcpus == 0 {
            return Err(MachineError::Cpu(cpu::CpuError::zero()));
        }
        match &cfg.restore {
            None => Machine::boot(cfg, on_exit),
            Some(r) => Machine::restore(cfg, r, on_exit),
        }
    }

    /// A fresh machine: its memory, its devices, its kernel loaded, its console, its vCPUs at the
    /// kernel's entry; in the order KVM needs (the in-kernel devices before the memory).
    fn boot(cfg: &MachineConfig, on_exit: Option<OnExit>) -> Result<Machine, MachineError> {
        let t0 = Instant::now();
        let kvm = build::open_kvm(cfg)?;
        let vm = build::create_vm(&kvm)?;
        let mem = build::fresh_memory(&vm, cfg)?;
        let devices = build::attach_devices(&vm, &mem, cfg)?;
        let entry = build::load_kernel(&mem, cfg, &devices)?;
        let log = Arc::new(Mutex::new(ConsoleLog::default()));
        let console = build::console(&vm, cfg, None, log.clone())?;
        let (vcpus, msr_list) = build::boot_vcpus(&kvm, &vm, cfg, entry)?;
        let parts = Built {
            t0,
            kvm,
            vm,
            mem,
            devices,
            log,
            console,
            vcpus,
            msr_list,
        };
        Machine::run(cfg, parts, on_exit)
    }

    /// A machine restored from the snapshot `r`, once it is known to be of this host and this
    /// machine: its memory mapped from the snapshot, its devices and VM-wide state handed back,
    /// its console and vCPUs as they were saved.
    fn restore(
        cfg: &MachineConfig,
        r: &Restore,
        on_exit: Option<OnExit>,
    ) -> Result<Machine, MachineError> {
        let t0 = Instant::now();
        let kvm = build::open_kvm(cfg)?;
        let vm = build::create_vm(&kvm)?;
        build::check_snapshot(cfg, r, &kvm)?;
        let mem = build::snapshot_memory(&vm, cfg, r)?;
        let devices = build::attach_devices(&vm, &mem, cfg)?;
        build::restore_state(&vm, &mem, r, &devices)?;
        let log = Arc::new(Mutex::new(ConsoleLog::default()));
        let console = build::console(&vm, cfg, Some(r), log.clone())?;
        let (vcpus, msr_list) = build::restored_vcpus(&kvm, &vm, cfg, r)?;
        let parts = Built {
            t0,
            kvm,
            vm,
            mem,
            devices,
            log,
            console,
            vcpus,
            msr_list,
        };
        Machine::run(cfg, parts, on_exit)
    }

    /// The built machine's threads, the same for a boot and a restore: each seals itself before
    /// anything the guest can reach, and the vCPUs wait at the gate for the device thread, the
    /// supervisor and the caller's release.
    fn run(
        cfg: &MachineConfig,
        b: Built,
        on_exit: Option<OnExit>,
    ) -> Result<Machine, MachineError> {
        let Built {
            t0,
            kvm,
            vm,
            mem,
            devices,
            log,
            console,
            vcpus,
            msr_list,
        } = b;
        let shared = Arc::new(Shared::new(t0, cfg.vcpus, log));
        install_kick_handler();
        let vm = Arc::new(vm);
        let running = build::start_devices(&shared, devices.list)?;
        let vcpu_threads = build::start_vcpus(&shared, vcpus, &running.bus, &console, msr_list);
        let parts = Parts {
            vm: vm.clone(),
            host: snapshot::HostId::here(&kvm),
            mem: mem.clone(),
            bus: running.bus.clone(),
            console: console.clone(),
            device_kick: running.kick.clone(),
            vcpu_threads: vcpu_threads.iter().map(|h| h.as_pthread_t()).collect(),
            memory_mib: cfg.memory_mib,
        };
        let on_exit: SharedOnExit = Arc::new(Mutex::new(on_exit));
        let supervisor =
            build::start_supervisor(&shared, vcpu_threads, running, vm, mem, on_exit.clone())?;
        Ok(Machine {
            shared,
            vsock: devices.vsock,
            supervisor: Mutex::new(Some(supervisor)),
            on_exit,
            parts: Some(parts),
            released: AtomicBool::new(false),
        })
    }

    /// Lets the vCPUs of a [`Machine::start_held`] machine into the guest once the machine's
    /// own threads have sealed.
    pub fn release(&self) {
        if !self.released.swap(true, Ordering::SeqCst) {
            self.shared.gate.pass();
        }
    }

    /// Opens connections to guest vsock ports.
    pub fn vsock(&self) -> &VsockHandle {
        &self.vsock
    }

    /// How the machine ended, once it has.
    pub fn exit(&self) -> Option<MachineExit> {
        self.shared
            .exit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits up to `timeout` for the machine to end by itself.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<MachineExit> {
        let exit = self.shared.exit.lock().unwrap_or_else(|e| e.into_inner());
        let (exit, _) = self
            .shared
            .ended
            .wait_timeout_while(exit, timeout, |e| e.is_none())
            .unwrap_or_else(|e| e.into_inner());
        exit.clone()
    }

    /// Ends the machine (if it has not ended) and returns once every thread of it is gone, or
    /// after [`STOP_TIMEOUT`] with the threads that would not end named in the exit's reason
    /// (they are left to finish on their own; later calls do not wait again).
    pub fn stop(&self) -> MachineExit {
        self.shared.end("stopped by the host".into(), false, true);
        self.wait_finished(STOP_TIMEOUT)
    }

    /// Ends the machine as failed for `reason` (the host gave up on the guest: it stopped
    /// answering), unless it already ended, and waits for it as [`Machine::stop`] does.
    pub fn fail(&self, reason: String) -> MachineExit {
        self.shared.end(reason, false, false);
        self.wait_finished(STOP_TIMEOUT)
    }

    fn wait_finished(&self, timeout: Duration) -> MachineExit {
        let fallback = || MachineExit {
            reason: "stopped by the host".into(),
            by_guest: false,
            requested: true,
            console: Vec::new(),
        };
        if self.shared.abandoned.load(Ordering::SeqCst) {
            return self.exit().unwrap_or_else(fallback);
        }
        let finished = {
            let guard = self
                .shared
                .finished
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let (guard, _) = self
                .shared
                .finished_cv
                .wait_timeout_while(guard, timeout, |f| !*f)
                .unwrap_or_else(|e| e.into_inner());
            *guard
        };
        let handle = self
            .supervisor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let mut exit = self.exit().unwrap_or_else(fallback);
        if finished {
            if let Some(h) = handle {
                // The supervisor has set `finished` as its last step: this join is immediate.
                let _ = h.join();
            }
        } else {
            self.shared.abandoned.store(true, Ordering::SeqCst);
            let report = self.shared.vcpu_report();
            tracing::error!(
                vcpus = %report,
                "a VM's threads did not end within {timeout:?} of its stop; they are left behind"
            );
            exit.reason = format!(
                "{}; its threads did not end within {timeout:?} and were left behind ({report})",
                exit.reason
            );
            // Whoever waits on the machine learns that it is over for us now: the supervisor
            // would only tell them when the stuck thread ends.
            if let Some(f) = self
                .on_exit
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
            {
                f(&exit);
            }
        }
        exit
    }

    /// One line per vCPU (exits taken, the last one, in the guest or not): what to look at
    /// when a guest stops answering.
    pub fn vcpu_report(&self) -> String {
        self.shared.vcpu_report()
    }

    /// The last `n` console lines.
    pub fn console_tail(&self, n: usize) -> Vec<String> {
        self.shared.tail(n)
    }

    /// From the start of building the VM to the guest's boot marker, once it came.
    pub fn boot_marker(&self) -> Option<Duration> {
        self.shared.marker.elapsed()
    }

    /// Blocks until the guest's boot marker comes (its time) or the machine ends (`None`).
    pub fn wait_boot_marker(&self) -> Option<Duration> {
        let exit = self.shared.exit.lock().unwrap_or_else(|e| e.into_inner());
        let _exit = self
            .shared
            .ended
            .wait_while(exit, |e| {
                e.is_none() && self.shared.marker.elapsed().is_none()
            })
            .unwrap_or_else(|e| e.into_inner());
        self.shared.marker.elapsed()
    }

    /// Drops the exit callback (the caller lost interest).
    pub fn forget_on_exit(&self) {
        self.on_exit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Adds a virtio device: its window on the bus, its irqfd and ioeventfds, its command-line entry.
fn add_device<D: VirtioDevice + 'static>(
    vm: &VmFd,
    mem: &GuestMemoryMmap,
    device: D,
    devices: &mut Vec<(BusDevice, Subscriber, Vec<EventFd>)>,
    cmdline: &mut String,
) -> Result<(), MachineError> {
    let i = devices.len();
    let (base, irq) = (MMIO_BASE + i as u64 * WINDOW, DEVICE_IRQS[i]);
    let evt = EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?;
    vm.register_irqfd(&evt, irq)
        .map_err(kvm_err("KVM_IRQFD (virtio)"))?;
    let t = MmioTransport::new(device, mem.clone(), Arc::new(Interrupt::new(evt)))
        .map_err(io_err("creating a virtio transport"))?;
    let mut ioevents = Vec::new();
    for (q, e) in t.queue_evts().iter().enumerate() {
        let e = e.try_clone().map_err(io_err("eventfd"))?;
        vm.register_ioevent(&e, &IoEventAddress::Mmio(base + QUEUE_NOTIFY), q as u32)
            .map_err(kvm_err("KVM_IOEVENTFD"))?;
        ioevents.push(e);
    }
    let t = Arc::new(Mutex::new(t));
    cmdline.push_str(&format!(" virtio_mmio.device=4K@{base:#x}:{irq}"));
    devices.push((t.clone(), t, ioevents));
    Ok(())
}

/// Wakes the device thread's epoll so it notices `stopping`.
struct Wake(Arc<EventFd>);

impl MutEventSubscriber for Wake {
    fn init(&mut self, ops: &mut EventOps) {
        let _ = ops.add(Events::new(&*self.0, EventSet::IN));
    }
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.0.read();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f`; a panic in it ends the machine with `who` and the panic's message as the reason
/// instead of unwinding the thread silently (which would leave the machine running without it).
fn guarded(shared: &Shared, who: &str, f: impl FnOnce()) {
    if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        shared.end(
            format!("{who} panicked: {}", panic_text(&panic)),
            false,
            false,
        );
    }
}

/// The message of a caught panic.
fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// Guest RAM, anonymous and MAP_NORESERVE: a guest costs what it touches.
fn anonymous_memory(mem_bytes: u64) -> Result<GuestMemoryMmap, MachineError> {
    let ranges: Vec<_> = layout::ram_regions(mem_bytes)
        .into_iter()
        .map(|(a, l)| (a, l as usize))
        .collect();
    GuestMemoryMmap::from_ranges(&ranges).map_err(|e| MachineError::Memory(e.to_string()))
}

/// Registers each region of guest RAM with KVM.
fn register_memory(vm: &VmFd, mem: &GuestMemoryMmap) -> Result<(), MachineError> {
    for (slot, region) in mem.iter().enumerate() {
        let host = region
            .get_host_address(MemoryRegionAddress(0))
            .map_err(|e| MachineError::Memory(e.to_string()))?;
        let r = kvm_userspace_memory_region {
            slot: slot as u32,
            flags: 0,
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: host as u64,
        };
        // SAFETY: the region is a live mapping of `memory_size` bytes owned by `mem`, which the
        // machine drops only after the VM fd (and every vCPU) is closed.
        unsafe { vm.set_user_memory_region(r) }.map_err(kvm_err("KVM_SET_USER_MEMORY_REGION"))?;
    }
    Ok(())
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(vcpus: u8) -> Arc<Shared> {
        let log = Arc::new(Mutex::new(ConsoleLog::default()));
        Arc::new(Shared::new(Instant::now(), vcpus, log))
    }

    #[test]
    fn a_machine_that_ends_before_its_threads_sealed_never_runs_its_guest() {
        // A vCPU thread, sealed, at the gate; the supervisor cannot seal and ends the machine.
        let s = shared(1);
        let vcpu = {
            let s = s.clone();
            std::thread::spawn(move || s.gate.wait())
        };
        s.gate.pass(); // the device thread
        s.end(
            "applying the main thread's system call filter: refused".into(),
            false,
            false,
        );
        assert!(!vcpu.join().unwrap(), "the vCPU went on into the guest");
        // A release after that changes nothing.
        s.gate.pass();
        s.gate.pass();
        assert!(!s.gate.wait());
    }

    #[test]
    fn a_panicking_thread_ends_the_machine_with_its_message() {
        let s = shared(1);
        let t = {
            let s = s.clone();
            std::thread::spawn(move || {
                guarded(&s, "vCPU 0's thread", || panic!("a device model bug"));
                s.running_vcpus.fetch_sub(1, Ordering::SeqCst);
            })
        };
        t.join()
            .expect("the panic is caught, the thread ends normally");
        let exit = s.exit.lock().unwrap().clone().expect("the machine ended");
        assert_eq!(exit.reason, "vCPU 0's thread panicked: a device model bug");
        assert!(!exit.requested && !exit.by_guest);
        assert!(s.stopping.load(Ordering::SeqCst));
        assert_eq!(s.running_vcpus.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn stop_gives_up_on_threads_that_never_end_and_says_so() {
        let s = shared(1);
        // A supervisor that never finishes (a vCPU thread stuck in a host syscall).
        let (release, stuck) = std::sync::mpsc::channel::<()>();
        let supervisor = std::thread::spawn(move || {
            let _ = stuck.recv();
        });
        let (told, heard) = std::sync::mpsc::channel::<String>();
        let on_exit: OnExit = Box::new(move |e| {
            let _ = told.send(e.reason.clone());
        });
        let m = Machine {
            shared: s.clone(),
            vsock: Vsock::new(3).expect("eventfd").1,
            supervisor: Mutex::new(Some(supervisor)),
            on_exit: Arc::new(Mutex::new(Some(on_exit))),
            parts: None,
            released: AtomicBool::new(true),
        };
        let t = Instant::now();
        let exit = m.wait_finished(Duration::from_millis(200));
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(
            exit.reason.contains("did not end within 200ms"),
            "{}",
            exit.reason
        );
        assert!(exit.reason.contains("vCPU 0: 0 exits"), "{}", exit.reason);
        assert_eq!(
            heard.try_recv().ok(),
            Some(exit.reason.clone()),
            "waiters are told"
        );
        // Later stops (and the drop) do not wait again.
        let t = Instant::now();
        drop(m);
        assert!(t.elapsed() < Duration::from_secs(1));
        let _ = release.send(());
    }
}
