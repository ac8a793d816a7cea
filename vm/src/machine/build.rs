//! The steps that build a machine, in the order [`Machine::boot`] and [`Machine::restore`] take
//! them: open KVM and create the VM with its in-kernel devices, (for a restore: check the
//! snapshot against this host and machine,) give the guest its memory (fresh, or the snapshot's
//! mapped privately), attach the virtio devices, load the kernel (or hand KVM the saved state),
//! make the console, create the vCPUs (at the kernel's entry, or as they were saved); then, the
//! same for both, start the device thread, the vCPU threads and the supervisor.

use super::*;

/// The virtio devices of a machine, attached: each on the bus with its subscriber and queue
/// eventfds, the command line that names them, and the vsock device's handle.
pub(super) struct Devices {
    pub(super) list: Vec<(BusDevice, Subscriber, Vec<EventFd>)>,
    pub(super) cmdline: String,
    pub(super) vsock: VsockHandle,
}

/// The device thread, running, and what the others need of it.
pub(super) struct RunningDevices {
    pub(super) thread: JoinHandle<()>,
    pub(super) bus: Arc<Vec<(u64, BusDevice)>>,
    pub(super) kick: Arc<EventFd>,
    /// The queues' ioeventfds: registered with the VM, which owns them until it is closed.
    pub(super) ioevents: Vec<EventFd>,
}

/// `/dev/kvm`: the descriptor the caller passed (a duplicate of it), or opened here.
pub(super) fn open_kvm(cfg: &MachineConfig) -> Result<Kvm, MachineError> {
    match &cfg.kvm {
        Some(f) => {
            use std::os::fd::{FromRawFd, IntoRawFd};
            let dup = f
                .try_clone()
                .map_err(io_err("duplicating the /dev/kvm descriptor"))?;
            // SAFETY: a descriptor of /dev/kvm that we own (a fresh duplicate), handed over.
            Ok(unsafe { Kvm::from_raw_fd(dup.into_raw_fd()) })
        }
        None => Kvm::new().map_err(kvm_err("opening /dev/kvm")),
    }
}

/// The VM with its TSS, in-kernel irqchip and PIT.
pub(super) fn create_vm(kvm: &Kvm) -> Result<VmFd, MachineError> {
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
    Ok(vm)
}

/// How many virtio devices `cfg` asks for: vsock, the disks, the network.
fn device_count(cfg: &MachineConfig) -> usize {
    1 + cfg.disks.len() + usize::from(cfg.net.is_some())
}

/// Whether `r` was taken on this kind of host, of this machine: checked before anything of it
/// reaches KVM.
pub(super) fn check_snapshot(
    cfg: &MachineConfig,
    r: &Restore,
    kvm: &Kvm,
) -> Result<(), MachineError> {
    r.state.check_host(&snapshot::HostId::here(kvm))?;
    r.state.check_fits(&snapshot::Expect {
        memory_mib: cfg.memory_mib,
        vcpus: cfg.vcpus,
        devices: device_count(cfg),
    })?;
    Ok(())
}

/// Fresh guest memory, registered with the VM.
pub(super) fn fresh_memory(
    vm: &VmFd,
    cfg: &MachineConfig,
) -> Result<GuestMemoryMmap, MachineError> {
    let mem = anonymous_memory(u64::from(cfg.memory_mib) << 20)?;
    register_memory(vm, &mem)?;
    Ok(mem)
}

/// The snapshot's guest memory, its file mapped privately (the guest's writes never reach it),
/// registered with the VM.
pub(super) fn snapshot_memory(
    vm: &VmFd,
    cfg: &MachineConfig,
    r: &Restore,
) -> Result<GuestMemoryMmap, MachineError> {
    let file = r.memory.open(false).map_err(io_err(format!(
        "opening the snapshot's memory file {}",
        r.memory
    )))?;
    let mem = snapshot::map_memory(&file, u64::from(cfg.memory_mib) << 20)?;
    register_memory(vm, &mem)?;
    Ok(mem)
}

/// The virtio devices: vsock first (the agent channel), then the disks in order, then the
/// network; each named on the kernel command line.
pub(super) fn attach_devices(
    vm: &VmFd,
    mem: &GuestMemoryMmap,
    cfg: &MachineConfig,
) -> Result<Devices, MachineError> {
    let mut list: Vec<(BusDevice, Subscriber, Vec<EventFd>)> = Vec::new();
    let mut cmdline = cfg.cmdline.clone();
    let (vsock, handle) = Vsock::new(cfg.vsock_cid).map_err(io_err("creating the vsock device"))?;
    let count = device_count(cfg);
    if count > DEVICE_IRQS.len() {
        return Err(MachineError::TooManyDevices(count));
    }
    add_device(vm, mem, vsock, &mut list, &mut cmdline)?;
    for (i, d) in cfg.disks.iter().enumerate() {
        let blk = d
            .file
            .open(!d.read_only)
            .and_then(|f| Block::from_file(f, d.read_only, &format!("disk{i}")))
            .map_err(io_err(format!("opening disk {}", d.file)))?;
        add_device(vm, mem, blk, &mut list, &mut cmdline)?;
    }
    if let Some(net) = &cfg.net {
        let link: Arc<dyn sandbox_control::link::FrameLink> = match &net.link {
            sandbox_control::link::NetLink::Frames(l) => l.clone(),
            // A socket to a network process: framed as the VM process frames it.
            sandbox_control::link::NetLink::Socket(fd) => Arc::new(
                fd.try_clone()
                    .map(std::os::unix::net::UnixStream::from)
                    .and_then(crate::stream_link::StreamLink::new)
                    .map_err(io_err("starting the network link"))?,
            ),
        };
        let backend = crate::net::LinkBackend::new(link)
            .map_err(io_err("creating the network device's eventfd"))?;
        add_device(vm, mem, Net::new(net.mac, backend), &mut list, &mut cmdline)?;
    }
    Ok(Devices {
        list,
        cmdline,
        vsock: handle,
    })
}

/// The guest's kernel loaded, with its initramfs, command line and MP table: its entry point.
pub(super) fn load_kernel(
    mem: &GuestMemoryMmap,
    cfg: &MachineConfig,
    devices: &Devices,
) -> Result<vm_memory::GuestAddress, MachineError> {
    let entry = boot::load(
        mem,
        u64::from(cfg.memory_mib) << 20,
        &cfg.kernel,
        cfg.initrd.as_ref(),
        &devices.cmdline,
    )?;
    mptable::write(mem, cfg.vcpus)?;
    Ok(entry)
}

/// A restored guest's VM-wide state and devices handed back: it is past its boot, so no kernel
/// is loaded (the irqchip first: the devices' restore may raise interrupts).
pub(super) fn restore_state(
    vm: &VmFd,
    mem: &GuestMemoryMmap,
    r: &Restore,
    devices: &Devices,
) -> Result<(), MachineError> {
    let clock = snapshot::restored_clock(&r.state, mem);
    restoring(|| snapshot::restore_vm(vm, &r.state.vm, clock))?;
    for (index, ((device, _, _), saved)) in devices.list.iter().zip(&r.state.devices).enumerate() {
        device
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .restore(saved)
            .map_err(|source| MachineError::DeviceState { index, source })?;
    }
    Ok(())
}

/// The serial console on COM1, its interrupt through an irqfd: fresh, or as the snapshot `r`
/// had it.
pub(super) fn console(
    vm: &VmFd,
    cfg: &MachineConfig,
    r: Option<&Restore>,
    log: Arc<Mutex<ConsoleLog>>,
) -> Result<Arc<Mutex<serial::Console>>, MachineError> {
    let irq = EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?;
    vm.register_irqfd(&irq, serial::COM1_IRQ)
        .map_err(kvm_err("KVM_IRQFD (serial)"))?;
    let console = match r {
        None => serial::console(irq, log, cfg.console.clone()),
        Some(r) => serial::restored(&r.state.serial, irq, log, cfg.console.clone())
            .map_err(|e| MachineError::Snapshot(snapshot::SnapshotError::Format(e)))?,
    };
    Ok(Arc::new(Mutex::new(console)))
}

/// A booted machine's vCPUs, each set up at the kernel's `entry`; and the host's MSR list,
/// without which no snapshot can be taken (each says so; the machine runs anyway).
pub(super) fn boot_vcpus(
    kvm: &Kvm,
    vm: &VmFd,
    cfg: &MachineConfig,
    entry: vm_memory::GuestAddress,
) -> Result<(Vec<VcpuFd>, Option<Vec<u32>>), MachineError> {
    let msr_list = snapshot::msr_list(kvm);
    let mut vcpus = Vec::with_capacity(usize::from(cfg.vcpus));
    for id in 0..cfg.vcpus {
        let vcpu = create_vcpu(vm, id)?;
        cpu::setup(kvm, &vcpu, id, cfg.vcpus, entry)?;
        vcpus.push(vcpu);
    }
    Ok((vcpus, msr_list.ok()))
}

/// A restored machine's vCPUs, each given its CPUID and then the state `r` saved of it; the
/// host's MSR list is needed to restore them.
pub(super) fn restored_vcpus(
    kvm: &Kvm,
    vm: &VmFd,
    cfg: &MachineConfig,
    r: &Restore,
) -> Result<(Vec<VcpuFd>, Option<Vec<u32>>), MachineError> {
    let msr_list = snapshot::msr_list(kvm);
    let mut vcpus = Vec::with_capacity(usize::from(cfg.vcpus));
    for id in 0..cfg.vcpus {
        let vcpu = create_vcpu(vm, id)?;
        cpu::set_cpuid(kvm, &vcpu, id, cfg.vcpus)?;
        vcpus.push(vcpu);
    }
    let supported = msr_list
        .as_ref()
        .map_err(|e| snapshot::SnapshotError::Mismatch(format!("this host's MSR list: {e}")))?;
    restoring(|| {
        for (id, vcpu) in vcpus.iter().enumerate() {
            let saved = r.state.vcpus.get(id).ok_or_else(|| {
                snapshot::SnapshotError::Mismatch(format!("no state for vCPU {id}"))
            })?;
            snapshot::restore_vcpu(vcpu, id, saved, supported)?;
        }
        Ok(())
    })?;
    Ok((vcpus, msr_list.ok()))
}

fn create_vcpu(vm: &VmFd, id: u8) -> Result<VcpuFd, MachineError> {
    vm.create_vcpu(u64::from(id))
        .map_err(kvm_err("KVM_CREATE_VCPU"))
}

/// The device thread: the virtio devices' event loop (and their parking for a pause), sealed
/// as a device thread before it runs any of it.
pub(super) fn start_devices(
    shared: &Arc<Shared>,
    devices: Vec<(BusDevice, Subscriber, Vec<EventFd>)>,
) -> Result<RunningDevices, MachineError> {
    let kick = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?);
    let mut em: EventManager<Subscriber> = EventManager::new().map_err(|e| MachineError::Io {
        context: "creating the device event loop".into(),
        source: std::io::Error::other(format!("{e:?}")),
    })?;
    em.add_subscriber(Arc::new(Mutex::new(Wake(kick.clone()))));
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
    let ioevents: Vec<EventFd> = devices.into_iter().flat_map(|(_, _, e)| e).collect();
    let shared = shared.clone();
    let thread = std::thread::Builder::new()
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
        .map_err(io_err("starting the device thread"))?;
    Ok(RunningDevices {
        thread,
        bus,
        kick,
        ioevents,
    })
}

/// One thread per vCPU, each sealed before its first `KVM_RUN` and held at the gate. A thread
/// that cannot start ends the machine (its vCPU counted out, so nobody waits for it).
pub(super) fn start_vcpus(
    shared: &Arc<Shared>,
    vcpus: Vec<VcpuFd>,
    bus: &Arc<Vec<(u64, BusDevice)>>,
    console: &Arc<Mutex<serial::Console>>,
    msr_list: Option<Vec<u32>>,
) -> Vec<JoinHandle<()>> {
    let mut threads = Vec::new();
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
            Ok(h) => threads.push(h),
            Err(e) => {
                shared.end(format!("starting vCPU thread {id}: {e}"), false, false);
                shared.running_vcpus.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
    threads
}

/// The supervisor: sealed as a main thread (unsealed, it ends the machine and only tears it
/// down), it waits for the machine's end, brings every thread down, runs `on_exit` and says the
/// machine finished. If it cannot start, the threads already started end (the vCPUs at the
/// gate, never in the guest).
pub(super) fn start_supervisor(
    shared: &Arc<Shared>,
    vcpu_threads: Vec<JoinHandle<()>>,
    devices: RunningDevices,
    vm: Arc<VmFd>,
    mem: GuestMemoryMmap,
    on_exit: SharedOnExit,
) -> Result<JoinHandle<()>, MachineError> {
    let outer = shared.clone();
    let shared = shared.clone();
    std::thread::Builder::new()
        .name("vm-supervisor".into())
        .spawn(move || {
            guarded(&shared, "the VM's supervisor", || {
                match crate::seal::enter(ThreadKind::Main) {
                    Ok(()) => shared.gate.pass(),
                    Err(e) => shared.end(e.to_string(), false, false),
                }
                supervise(
                    &shared,
                    vcpu_threads,
                    devices.thread,
                    &devices.kick,
                    vm,
                    devices.ioevents,
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
        .inspect_err(|_| outer.end("the supervisor could not start".into(), false, false))
}
