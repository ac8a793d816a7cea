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
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use kvm_bindings::{KVM_PIT_SPEAKER_DUMMY, kvm_pit_config, kvm_userspace_memory_region};
use kvm_ioctls::{IoEventAddress, Kvm, VcpuExit, VcpuFd, VmFd};
use sandbox_devices::virtio::block::Block;
use sandbox_devices::virtio::mmio::{MmioDevice, MmioTransport, WINDOW};
use sandbox_devices::virtio::net::Net;
use sandbox_devices::virtio::vsock::{Vsock, VsockHandle};
use sandbox_devices::virtio::{Interrupt, VirtioDevice};
use sandbox_devices::{BootMarker, ConsoleLog};
use thiserror::Error;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, MemoryRegionAddress};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::{boot, cpu, layout, mptable, serial, snapshot};

/// Where the virtio-mmio windows start (inside the hole below 4 GiB), one page each.
pub const MMIO_BASE: u64 = 0xd000_0000;
/// The interrupt lines handed to virtio devices, in order (ISA lines nothing else uses here).
const DEVICE_IRQS: [u32; 8] = [5, 6, 7, 9, 10, 11, 14, 15];
/// The QueueNotify register's offset in a window.
const QUEUE_NOTIFY: u64 = 0x50;
/// The longest [`Machine::stop`] waits for the machine's threads to end.
pub use sandbox_vm_control::STOP_TIMEOUT;
/// How often the supervisor re-kicks vCPUs still in KVM_RUN: often at first (a kick that lands
/// just before KVM_RUN is lost), then rarely, so a thread stuck elsewhere costs no CPU.
const KICK_FAST: Duration = Duration::from_millis(5);
const KICK_SLOW: Duration = Duration::from_secs(1);

/// A file the machine reads or writes: a path it opens, or a file opened for it. A jailed VM
/// process gets every file as a descriptor: its jail has no path to any of them.
#[derive(Debug, Clone)]
pub enum FileRef {
    /// Opened by the machine.
    Path(PathBuf),
    /// Already open (read-write where the machine writes it); named for messages.
    Open(Arc<std::fs::File>, String),
}

impl FileRef {
    /// The file, opened for writing too when `write`.
    pub fn open(&self, write: bool) -> std::io::Result<std::fs::File> {
        match self {
            FileRef::Path(p) => std::fs::OpenOptions::new().read(true).write(write).open(p),
            FileRef::Open(f, _) => f.try_clone(),
        }
    }
}

impl std::fmt::Display for FileRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FileRef::Path(p) => write!(f, "{}", p.display()),
            FileRef::Open(_, name) => f.write_str(name),
        }
    }
}

impl From<PathBuf> for FileRef {
    fn from(p: PathBuf) -> Self {
        FileRef::Path(p)
    }
}

/// Where the guest's console bytes go besides the machine's own log (the VM process passes them
/// to the service).
#[derive(Clone)]
pub struct ConsoleSink(pub Arc<ConsoleFn>);

/// What a [`ConsoleSink`] calls with each piece of console output.
pub type ConsoleFn = dyn Fn(&[u8]) + Send + Sync;

impl std::fmt::Debug for ConsoleSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConsoleSink")
    }
}

/// A disk for the machine.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// Raw image.
    pub file: FileRef,
    /// Whether the guest may write it.
    pub read_only: bool,
}

/// What to boot.
#[derive(Debug, Clone)]
pub struct MachineConfig {
    /// `/dev/kvm`, opened by the caller; `None` opens it here.
    pub kvm: Option<Arc<std::fs::File>>,
    /// Uncompressed kernel with a PVH note.
    pub kernel: FileRef,
    /// Initramfs.
    pub initrd: Option<FileRef>,
    /// A copy of the guest's console output.
    pub console: Option<ConsoleSink>,
    /// Kernel command line; the machine appends a `virtio_mmio.device=` entry per device.
    pub cmdline: String,
    /// Guest memory.
    pub memory_mib: u32,
    /// vCPUs (1 to 254).
    pub vcpus: u8,
    /// Disks, as /dev/vda, /dev/vdb, ... in this order.
    pub disks: Vec<DiskConfig>,
    /// The guest's vsock context id (3 or more).
    pub vsock_cid: u64,
    /// A network device and the link behind it, if the guest has a network.
    pub net: Option<sandbox_vm_control::link::NetAttachment>,
    /// Restore this snapshot instead of booting the kernel (which is then not read). The
    /// machine must be the one it was taken of: memory, vCPUs and devices.
    pub restore: Option<Restore>,
}

/// A snapshot to start from: its state, read and checked, and its memory file.
#[derive(Clone)]
pub struct Restore {
    /// Read with [`snapshot::MachineState::read_from`].
    pub state: Arc<snapshot::MachineState>,
    /// Mapped privately: the guest's writes never reach it.
    pub memory: FileRef,
}

impl std::fmt::Debug for Restore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Restore({} vCPUs, memory {})",
            self.state.vcpus.len(),
            self.memory
        )
    }
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
    Boot(#[from] boot::BootError),
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
    /// The last exit: its kind (see [`exit_kind`]) in the low byte, its address or port above.
    last: AtomicU64,
    /// Set while the thread is inside KVM_RUN.
    in_guest: AtomicBool,
}

impl Shared {
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
    /// and the machine's device and supervisor threads have sealed theirs.
    pub fn start_held(
        cfg: &MachineConfig,
        on_exit: Option<OnExit>,
    ) -> Result<Machine, MachineError> {
        let t0 = Instant::now();
        if cfg.vcpus == 0 {
            return Err(MachineError::Cpu(cpu::CpuError::zero()));
        }
        let kvm = match &cfg.kvm {
            Some(f) => {
                use std::os::fd::{FromRawFd, IntoRawFd};
                let dup = f
                    .try_clone()
                    .map_err(io_err("duplicating the /dev/kvm descriptor"))?;
                // SAFETY: a descriptor of /dev/kvm that we own (a fresh duplicate), handed over.
                unsafe { Kvm::from_raw_fd(dup.into_raw_fd()) }
            }
            None => Kvm::new().map_err(kvm_err("opening /dev/kvm"))?,
        };
        let vm = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
        vm.set_tss_address(layout::KVM_TSS_ADDRESS)
            .map_err(kvm_err("KVM_SET_TSS_ADDR"))?;
        vm.create_irq_chip()
            .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        vm.create_pit2(pit).map_err(kvm_err("KVM_CREATE_PIT2"))?;

        let mem_bytes = u64::from(cfg.memory_mib) << 20;
        let device_count = 1 + cfg.disks.len() + usize::from(cfg.net.is_some());
        let restore = match &cfg.restore {
            Some(r) => {
                r.state.check_host(&snapshot::HostId::here(&kvm))?;
                r.state.check_fits(&snapshot::Expect {
                    memory_mib: cfg.memory_mib,
                    vcpus: cfg.vcpus,
                    devices: device_count,
                })?;
                Some(r)
            }
            None => None,
        };
        let mem = match restore {
            Some(r) => {
                let file = r.memory.open(false).map_err(io_err(format!(
                    "opening the snapshot's memory file {}",
                    r.memory
                )))?;
                snapshot::map_memory(&file, mem_bytes)?
            }
            None => anonymous_memory(mem_bytes)?,
        };
        register_memory(&vm, &mem)?;

        // Devices: vsock first (the agent channel), then the disks in order, then the network.
        let mut devices: Vec<(BusDevice, Subscriber, Vec<EventFd>)> = Vec::new();
        let mut cmdline = cfg.cmdline.clone();
        let (vsock, vsock_handle) =
            Vsock::new(cfg.vsock_cid).map_err(io_err("creating the vsock device"))?;
        if device_count > DEVICE_IRQS.len() {
            return Err(MachineError::TooManyDevices(device_count));
        }
        add_device(&vm, &mem, vsock, &mut devices, &mut cmdline)?;
        for (i, d) in cfg.disks.iter().enumerate() {
            let blk = d
                .file
                .open(!d.read_only)
                .and_then(|f| Block::from_file(f, d.read_only, &format!("disk{i}")))
                .map_err(io_err(format!("opening disk {}", d.file)))?;
            add_device(&vm, &mem, blk, &mut devices, &mut cmdline)?;
        }
        if let Some(net) = &cfg.net {
            let backend = crate::net::LinkBackend::new(net.link.clone())
                .map_err(io_err("creating the network device's eventfd"))?;
            add_device(
                &vm,
                &mem,
                Net::new(net.mac, backend),
                &mut devices,
                &mut cmdline,
            )?;
        }

        // A restored guest is already past its boot: no kernel is loaded, and what the devices
        // and vCPUs had comes back from the snapshot (the irqchip first: the devices' restore
        // may raise interrupts).
        let boot_entry = match restore {
            None => {
                let entry =
                    boot::load(&mem, mem_bytes, &cfg.kernel, cfg.initrd.as_ref(), &cmdline)?;
                mptable::write(&mem, cfg.vcpus)?;
                Some(entry)
            }
            Some(r) => {
                let clock = snapshot::restored_clock(&r.state, &mem);
                restoring(|| snapshot::restore_vm(&vm, &r.state.vm, clock))?;
                for (index, ((device, _, _), saved)) in
                    devices.iter().zip(&r.state.devices).enumerate()
                {
                    device
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .restore(saved)
                        .map_err(|source| MachineError::DeviceState { index, source })?;
                }
                None
            }
        };

        let log = Arc::new(Mutex::new(ConsoleLog::default()));
        let irq = EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?;
        vm.register_irqfd(&irq, serial::COM1_IRQ)
            .map_err(kvm_err("KVM_IRQFD (serial)"))?;
        let console = match restore {
            None => serial::console(irq, log.clone(), cfg.console.clone()),
            Some(r) => serial::restored(&r.state.serial, irq, log.clone(), cfg.console.clone())
                .map_err(|e| MachineError::Snapshot(snapshot::SnapshotError::Format(e)))?,
        };
        let console = Arc::new(Mutex::new(console));

        // Without it no snapshot can be taken (each says so) and none restored; a booted
        // machine runs anyway.
        let msr_list = snapshot::msr_list(&kvm);
        let mut vcpus = Vec::with_capacity(usize::from(cfg.vcpus));
        for id in 0..cfg.vcpus {
            let vcpu = vm
                .create_vcpu(u64::from(id))
                .map_err(kvm_err("KVM_CREATE_VCPU"))?;
            if restore.is_some() {
                cpu::set_cpuid(&kvm, &vcpu, id, cfg.vcpus)?;
            } else if let Some(entry) = boot_entry {
                cpu::setup(&kvm, &vcpu, id, cfg.vcpus, entry)?;
            }
            vcpus.push(vcpu);
        }
        if let Some(r) = restore {
            let supported = msr_list.as_ref().map_err(|e| {
                snapshot::SnapshotError::Mismatch(format!("this host's MSR list: {e}"))
            })?;
            restoring(|| {
                for (id, vcpu) in vcpus.iter().enumerate() {
                    let saved = r.state.vcpus.get(id).ok_or_else(|| {
                        snapshot::SnapshotError::Mismatch(format!("no state for vCPU {id}"))
                    })?;
                    snapshot::restore_vcpu(vcpu, id, saved, supported)?;
                }
                Ok(())
            })?;
        }
        let msr_list = msr_list.ok();

        let shared = Arc::new(Shared {
            exit: Mutex::new(None),
            ended: Condvar::new(),
            finished: Mutex::new(false),
            finished_cv: Condvar::new(),
            stopping: AtomicBool::new(false),
            running_vcpus: AtomicUsize::new(vcpus.len()),
            log,
            marker: BootMarker::new(t0),
            vcpu_stats: (0..cfg.vcpus).map(|_| VcpuStats::default()).collect(),
            abandoned: AtomicBool::new(false),
            pausing: AtomicBool::new(false),
            pause: Mutex::new(PauseState::default()),
            pause_cv: Condvar::new(),
            // The device thread, the supervisor and the caller's release.
            gate: crate::gate::Gate::new(3),
        });
        install_kick_handler();
        let vm = Arc::new(vm);

        // The device thread.
        let device_kick = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?);
        let mut em: EventManager<Subscriber> =
            EventManager::new().map_err(|e| MachineError::Io {
                context: "creating the device event loop".into(),
                source: std::io::Error::other(format!("{e:?}")),
            })?;
        em.add_subscriber(Arc::new(Mutex::new(Wake(device_kick.clone()))));
        let bus: Arc<Vec<(u64, BusDevice)>> = Arc::new(
            devices
                .iter()
                .enumerate()
                .map(|(i, (dev, sub, _))| {
                    em.add_subscriber(sub.clone());
                    (MMIO_BASE + i as u64 * WINDOW, dev.clone())
                })
                .collect(),
        );
        // The ioeventfds stay registered with the VM, which owns them until it is closed.
        let ioevents: Vec<EventFd> = devices.into_iter().flat_map(|(_, _, e)| e).collect();

        let device_thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("vm-devices".into())
                .spawn(move || {
                    guarded(&shared, "the VM's device thread", || {
                        if let Err(e) = crate::seal::enter(ThreadKind::Device) {
                            shared.end(e.to_string(), false, false);
                            return;
                        }
                        shared.gate.pass();
                        while !shared.stopping.load(Ordering::SeqCst) {
                            if shared.pausing.load(Ordering::SeqCst) {
                                park_devices(&shared);
                                continue;
                            }
                            if em.run_with_timeout(1000).is_err() {
                                shared.end("the device event loop failed".into(), false, false);
                            }
                        }
                    })
                })
                .map_err(io_err("starting the device thread"))?
        };

        let mut vcpu_threads = Vec::new();
        let msr_list = Arc::new(msr_list);
        for (id, vcpu) in vcpus.into_iter().enumerate() {
            let (thread_shared, bus, console) = (shared.clone(), bus.clone(), console.clone());
            let msr_list = msr_list.clone();
            let handle = std::thread::Builder::new()
                .name(format!("vcpu{id}"))
                .spawn(move || {
                    // A panic (a bug of a device model on this thread) ends the VM with its
                    // message; the thread is counted out either way, so the supervisor never
                    // waits for a thread that is gone.
                    guarded(&thread_shared, &format!("vCPU {id}'s thread"), || {
                        // Filtered before its first KVM_RUN: no guest instruction runs unsealed.
                        match crate::seal::enter(ThreadKind::Vcpu) {
                            Ok(()) if !thread_shared.gate.wait() => {}
                            Ok(()) => vcpu_loop(
                                vcpu,
                                id,
                                &thread_shared,
                                &bus,
                                &console,
                                msr_list.as_deref(),
                            ),
                            Err(e) => thread_shared.end(e.to_string(), false, false),
                        }
                    });
                    thread_shared.running_vcpus.fetch_sub(1, Ordering::SeqCst);
                    thread_shared.ended.notify_all();
                });
            match handle {
                Ok(h) => vcpu_threads.push(h),
                Err(e) => {
                    shared.end(format!("starting vCPU thread {id}: {e}"), false, false);
                    shared.running_vcpus.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }

        let parts = Parts {
            vm: vm.clone(),
            host: snapshot::HostId::here(&kvm),
            mem: mem.clone(),
            bus: bus.clone(),
            console: console.clone(),
            device_kick: device_kick.clone(),
            vcpu_threads: vcpu_threads.iter().map(|h| h.as_pthread_t()).collect(),
            memory_mib: cfg.memory_mib,
        };
        let on_exit: SharedOnExit = Arc::new(Mutex::new(on_exit));
        let supervisor = {
            let outer = shared.clone();
            let shared = shared.clone();
            let on_exit = on_exit.clone();
            std::thread::Builder::new()
                .name("vm-supervisor".into())
                .spawn(move || {
                    guarded(&shared, "the VM's supervisor", || {
                        // Fail closed: unsealed, it ends the machine (the gate shuts, so no
                        // vCPU runs the guest) and only tears it down.
                        match crate::seal::enter(ThreadKind::Main) {
                            Ok(()) => shared.gate.pass(),
                            Err(e) => shared.end(e.to_string(), false, false),
                        }
                        supervise(
                            &shared,
                            vcpu_threads,
                            device_thread,
                            &device_kick,
                            vm,
                            ioevents,
                            mem,
                        )
                    });
                    let exit = shared
                        .exit
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .clone();
                    if let (Some(exit), Some(f)) = (
                        exit,
                        on_exit.lock().unwrap_or_else(|e| e.into_inner()).take(),
                    ) {
                        f(&exit);
                    }
                    *shared.finished.lock().unwrap_or_else(|e| e.into_inner()) = true;
                    shared.finished_cv.notify_all();
                })
                .map_err(io_err("starting the supervisor thread"))
                // The threads already started end (the vCPUs at the gate, never in the guest).
                .inspect_err(|_| outer.end("the supervisor could not start".into(), false, false))?
        };

        Ok(Machine {
            shared,
            vsock: vsock_handle,
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

    /// Stops every vCPU and the device thread where they are, each vCPU's last exit completed
    /// and its state read; the guest does not run until [`Machine::resume`]. Bounded by
    /// [`STOP_TIMEOUT`]: a thread that does not park in time resumes the others and fails it.
    pub fn pause(&self) -> Result<Duration, snapshot::SnapshotError> {
        let t0 = Instant::now();
        let parts = self.parts()?;
        let n = parts.vcpu_threads.len();
        {
            let mut p = lock(&self.shared.pause);
            if self.shared.pausing.load(Ordering::SeqCst) {
                return Err(snapshot::SnapshotError::State(
                    "the machine is already paused".into(),
                ));
            }
            p.epoch += 1;
            p.stopped = vec![false; n];
            p.saved = (0..n).map(|_| None).collect();
            p.save = false;
            p.device_parked = false;
            self.shared.pausing.store(true, Ordering::SeqCst);
        }
        let _ = parts.device_kick.write(1);
        let deadline = t0 + STOP_TIMEOUT;
        let fail = |what: String| {
            self.resume();
            Err(snapshot::SnapshotError::State(what))
        };
        // First every thread out of the guest; then the vCPUs read their state.
        loop {
            {
                // Under the exit lock: no thread of the machine has been joined while it is
                // unset, so every pthread id is still valid to signal.
                let exit = lock(&self.shared.exit);
                if let Some(e) = exit.as_ref() {
                    let reason = e.reason.clone();
                    drop(exit);
                    return fail(format!("the machine ended: {reason}"));
                }
                let mut p = lock(&self.shared.pause);
                let stopped = p.device_parked && p.stopped.iter().all(|s| *s);
                if stopped && !p.save {
                    p.save = true;
                    self.shared.pause_cv.notify_all();
                }
                if p.save && p.saved.iter().all(Option::is_some) {
                    return Ok(t0.elapsed());
                }
                if !stopped {
                    for (i, t) in parts.vcpu_threads.iter().enumerate() {
                        if !p.stopped[i] {
                            kick(*t);
                        }
                    }
                }
            }
            if Instant::now() >= deadline {
                let report = self.shared.vcpu_report();
                return fail(format!(
                    "the machine's threads did not stop within {STOP_TIMEOUT:?} ({report})"
                ));
            }
            let p = lock(&self.shared.pause);
            let _ = self.shared.pause_cv.wait_timeout(p, KICK_FAST);
        }
    }

    /// Lets a paused machine run again.
    pub fn resume(&self) {
        let mut p = lock(&self.shared.pause);
        self.shared.pausing.store(false, Ordering::SeqCst);
        p.epoch += 1;
        p.stopped.clear();
        p.saved.clear();
        p.save = false;
        p.device_parked = false;
        self.shared.pause_cv.notify_all();
    }

    /// Writes the state of a paused machine to `state` (a pipe to the service, or a file the
    /// caller emptied) and its memory into `memory` (sized by the caller with
    /// [`snapshot::size_memory_file`]; never a file a machine is mapped from). The machine stays
    /// paused.
    pub fn snapshot(
        &self,
        state: &mut dyn std::io::Write,
        memory: &std::fs::File,
    ) -> Result<u64, snapshot::SnapshotError> {
        let parts = self.parts()?;
        let vcpus = {
            let mut p = lock(&self.shared.pause);
            if !self.shared.pausing.load(Ordering::SeqCst)
                || !p.device_parked
                || !p.save
                || p.saved.is_empty()
                || p.saved.iter().any(Option::is_none)
            {
                return Err(snapshot::SnapshotError::State(
                    "the machine must be paused for a snapshot".into(),
                ));
            }
            // Taken: one snapshot per pause (a second one of the same pause is refused above).
            let taken: Vec<_> = p.saved.iter_mut().map(Option::take).collect();
            taken
                .into_iter()
                .enumerate()
                .map(|(i, s)| match s {
                    Some(Ok(s)) => Ok(s),
                    Some(Err(e)) => Err(snapshot::SnapshotError::State(format!(
                        "reading vCPU {i}'s state: {e}"
                    ))),
                    None => Err(snapshot::SnapshotError::State(format!(
                        "vCPU {i} is not paused"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        let devices = parts
            .bus
            .iter()
            .map(|(_, d)| d.lock().unwrap_or_else(|e| e.into_inner()).save())
            .collect();
        let serial = snapshot::SerialSnapshot::of(
            &parts
                .console
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .state(),
        );
        let machine = snapshot::MachineState {
            format: snapshot::FORMAT,
            host: parts.host.clone(),
            memory_mib: parts.memory_mib,
            vcpus,
            vm: snapshot::save_vm(&parts.vm)?,
            serial,
            devices,
        };
        let bytes = machine.encode()?;
        let written = snapshot::write_memory(&parts.mem, memory)?;
        state
            .write_all(&bytes)
            .and_then(|()| state.flush())
            .map_err(|source| snapshot::SnapshotError::Io {
                context: "writing the state".into(),
                source,
            })?;
        Ok(written)
    }

    /// Pauses, writes the snapshot, and lets the guest run again if `resume` or if the
    /// snapshot failed (a failed pause has already resumed it).
    pub fn pause_and_snapshot(
        &self,
        state: &mut dyn std::io::Write,
        memory: &std::fs::File,
        resume: bool,
    ) -> Result<sandbox_vm_control::SnapshotDone, snapshot::SnapshotError> {
        let pause = self.pause()?;
        let t = Instant::now();
        let written = self.snapshot(state, memory);
        let write = t.elapsed();
        if resume || written.is_err() {
            self.resume();
        }
        Ok(sandbox_vm_control::SnapshotDone {
            memory_written: written?,
            pause_us: pause.as_micros() as u64,
            write_us: write.as_micros() as u64,
        })
    }

    fn parts(&self) -> Result<&Parts, snapshot::SnapshotError> {
        self.parts
            .as_ref()
            .ok_or_else(|| snapshot::SnapshotError::State("this machine cannot be paused".into()))
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

/// Waits for the machine to end, then brings every thread down and releases the VM.
fn supervise(
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

fn vcpu_loop(
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
fn run_once(
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
        Ok(VcpuExit::IoOut(port, data)) => match port {
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
        },
        Ok(VcpuExit::IoIn(port, data)) => {
            let v = match port {
                p if (serial::COM1_BASE..serial::COM1_BASE + serial::COM1_LEN).contains(&p) => {
                    console
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .read((p - serial::COM1_BASE) as u8)
                }
                // i8042 status: no data, input buffer empty.
                0x64 | 0x60 => 0,
                _ => 0xff,
            };
            data.fill(v);
        }
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
        Ok(VcpuExit::Shutdown) => {
            // Where the vCPU was helps tell a reboot (reboot=t) from a crash early in boot.
            let at = match (vcpu.get_regs(), vcpu.get_sregs()) {
                (Ok(r), Ok(s)) => format!(
                    " on vCPU {id} at rip {:#x}, cr0 {:#x}, cr3 {:#x}, cr4 {:#x}",
                    r.rip, s.cr0, s.cr3, s.cr4
                ),
                _ => String::new(),
            };
            shared.end(
                format!("the guest powered off or restarted (triple fault{at})"),
                true,
                false,
            )
        }
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

/// The most exits a vCPU handles while it completes its last one for a pause.
const PARK_EXITS: usize = 2048;

/// Parks a vCPU thread for a pause. First it completes its last exit (KVM finishes an I/O or
/// MMIO read only on the next KVM_RUN, which `immediate_exit` makes return at once; an exit that
/// run starts is handled the same way) and says it stopped. Its state is read only once every
/// vCPU and the device thread have stopped ([`Machine::pause`] asks), so no interrupt sent by
/// another vCPU or a device can land after it was read. It waits until that pause ends or the
/// machine stops.
fn park_vcpu(
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

/// Parks the device thread for a pause (no device touches guest memory until it ends).
fn park_devices(shared: &Shared) {
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Kind (low byte) and address or port (above) of a vCPU exit, for [`VcpuStats::last`].
fn exit_kind(exit: &Result<VcpuExit<'_>, kvm_ioctls::Error>) -> u64 {
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

fn exit_name(kind: u8) -> &'static str {
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

fn install_kick_handler() {
    // Registering a handler for SIGRTMIN only fails for an invalid signal number.
    let _ =
        vmm_sys_util::signal::register_signal_handler(vmm_sys_util::signal::SIGRTMIN(), on_kick);
}

fn kick(thread: libc::pthread_t) {
    // SAFETY: `thread` belongs to a JoinHandle not yet joined, so the thread id is valid; the
    // signal has a no-op handler installed, so its only effect is to interrupt KVM_RUN.
    unsafe { libc::pthread_kill(thread, vmm_sys_util::signal::SIGRTMIN()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(vcpus: usize) -> Arc<Shared> {
        Arc::new(Shared {
            exit: Mutex::new(None),
            ended: Condvar::new(),
            finished: Mutex::new(false),
            finished_cv: Condvar::new(),
            stopping: AtomicBool::new(false),
            running_vcpus: AtomicUsize::new(vcpus),
            log: Arc::new(Mutex::new(ConsoleLog::default())),
            marker: BootMarker::new(Instant::now()),
            vcpu_stats: (0..vcpus).map(|_| VcpuStats::default()).collect(),
            abandoned: AtomicBool::new(false),
            pausing: AtomicBool::new(false),
            pause: Mutex::new(PauseState::default()),
            pause_cv: Condvar::new(),
            gate: crate::gate::Gate::new(3),
        })
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
