//! One KVM virtual machine: memory, the in-kernel irqchip and PIT, the legacy devices on the I/O
//! bus (serial console, i8042 reset), and the vCPU run loop.
//!
//! This is the first step of the KVM backend (issue 3): it boots the guest kernel on one vCPU to
//! its console and reports how the guest ended. The virtio-mmio devices (and with them the agent
//! channel) come next; until then [`KvmBackend`](super) is not offered by backend selection.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvm_bindings::{KVM_PIT_SPEAKER_DUMMY, kvm_pit_config, kvm_userspace_memory_region};
use kvm_ioctls::{Kvm, VcpuExit, VmFd};
use sandbox_devices::ConsoleLog;
use thiserror::Error;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, MemoryRegionAddress};
use vmm_sys_util::eventfd::EventFd;

use super::{boot, cpu, layout, serial};

/// What to boot.
#[derive(Debug, Clone)]
pub struct MachineConfig {
    /// Uncompressed kernel with a PVH note.
    pub kernel: PathBuf,
    /// Initramfs.
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: String,
    /// Guest memory.
    pub memory_mib: u32,
    /// Give up (and report a timeout) after this long.
    pub timeout: Duration,
}

/// How the guest ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineExit {
    /// For a person.
    pub reason: String,
    /// The guest asked for it (reboot, power-off), as opposed to a failure or a timeout.
    pub by_guest: bool,
    /// The last console lines.
    pub console: Vec<String>,
}

/// Why a machine could not be built or run.
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
    /// An eventfd could not be made.
    #[error("eventfd: {0}")]
    EventFd(std::io::Error),
}

fn kvm_err(step: &'static str) -> impl Fn(kvm_ioctls::Error) -> MachineError {
    move |source| MachineError::Kvm { step, source }
}

/// Builds the machine and runs it on this thread until the guest ends, fails, or times out.
pub fn run(cfg: &MachineConfig) -> Result<MachineExit, MachineError> {
    let kvm = Kvm::new().map_err(kvm_err("opening /dev/kvm"))?;
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
    let mem = guest_memory(&vm, mem_bytes)?;
    let entry = boot::load(
        &mem,
        mem_bytes,
        &cfg.kernel,
        cfg.initrd.as_deref(),
        &cfg.cmdline,
    )?;

    let log = Arc::new(Mutex::new(ConsoleLog::default()));
    let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(MachineError::EventFd)?;
    vm.register_irqfd(&irq, serial::COM1_IRQ)
        .map_err(kvm_err("KVM_IRQFD (serial)"))?;
    let mut console = serial::console(irq, log.clone());

    let mut vcpu = vm.create_vcpu(0).map_err(kvm_err("KVM_CREATE_VCPU"))?;
    cpu::setup(&kvm, &vcpu, 0, 1, entry)?;

    // A watchdog ends a guest that runs past its time: it sets `expired` and kicks the vCPU out of
    // KVM_RUN with a signal (the handler does nothing; KVM_RUN returns EINTR).
    let expired = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    install_kick_handler();
    let vcpu_thread = current_pthread();
    let watchdog = {
        let (expired, done, timeout) = (expired.clone(), done.clone(), cfg.timeout);
        std::thread::spawn(move || {
            let start = Instant::now();
            while !done.load(Ordering::SeqCst) {
                if start.elapsed() > timeout {
                    expired.store(true, Ordering::SeqCst);
                    kick(vcpu_thread);
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let tail =
        |log: &Arc<Mutex<ConsoleLog>>| log.lock().unwrap_or_else(|e| e.into_inner()).tail(20);
    let exit = loop {
        match vcpu.run() {
            Ok(VcpuExit::IoOut(port, data)) => match port {
                p if (serial::COM1_BASE..serial::COM1_BASE + serial::COM1_LEN).contains(&p) => {
                    if let Some(&b) = data.first() {
                        let _ = console.write((p - serial::COM1_BASE) as u8, b);
                    }
                }
                // i8042 command 0xFE: pulse the reset line.
                0x64 if data.first() == Some(&0xfe) => {
                    break MachineExit {
                        reason: "the guest reset the machine (i8042)".into(),
                        by_guest: true,
                        console: tail(&log),
                    };
                }
                _ => {}
            },
            Ok(VcpuExit::IoIn(port, data)) => {
                let v = match port {
                    p if (serial::COM1_BASE..serial::COM1_BASE + serial::COM1_LEN).contains(&p) => {
                        console.read((p - serial::COM1_BASE) as u8)
                    }
                    // i8042 status: no data, input buffer empty.
                    0x64 | 0x60 => 0,
                    _ => 0xff,
                };
                data.fill(v);
            }
            Ok(VcpuExit::MmioRead(_, data)) => data.fill(0xff),
            Ok(VcpuExit::MmioWrite(..)) => {}
            Ok(VcpuExit::Hlt) => {
                break MachineExit {
                    reason: "the guest halted".into(),
                    by_guest: true,
                    console: tail(&log),
                };
            }
            Ok(VcpuExit::Shutdown) => {
                break MachineExit {
                    reason: "the guest restarted (triple fault or reboot)".into(),
                    by_guest: true,
                    console: tail(&log),
                };
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                break MachineExit {
                    reason: format!("the guest sent system event {kind}"),
                    by_guest: true,
                    console: tail(&log),
                };
            }
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                break MachineExit {
                    reason: format!("KVM could not enter vCPU {cpu} (hardware reason {reason:#x})"),
                    by_guest: false,
                    console: tail(&log),
                };
            }
            Ok(VcpuExit::InternalError) => {
                break MachineExit {
                    reason: "KVM internal error (the host's KVM cannot run this guest)".into(),
                    by_guest: false,
                    console: tail(&log),
                };
            }
            Ok(other) => {
                break MachineExit {
                    reason: format!("unexpected vCPU exit {other:?}"),
                    by_guest: false,
                    console: tail(&log),
                };
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                if expired.load(Ordering::SeqCst) {
                    break MachineExit {
                        reason: format!("the guest ran past its {:?}", cfg.timeout),
                        by_guest: false,
                        console: tail(&log),
                    };
                }
            }
            Err(e) => {
                break MachineExit {
                    reason: format!("KVM_RUN failed: {e}"),
                    by_guest: false,
                    console: tail(&log),
                };
            }
        }
    };
    done.store(true, Ordering::SeqCst);
    let _ = watchdog.join();
    Ok(exit)
}

/// Maps guest RAM (anonymous, MAP_NORESERVE: a guest costs what it touches) and registers each
/// region with KVM.
fn guest_memory(vm: &VmFd, mem_bytes: u64) -> Result<GuestMemoryMmap, MachineError> {
    let ranges: Vec<_> = layout::ram_regions(mem_bytes)
        .into_iter()
        .map(|(a, l)| (a, l as usize))
        .collect();
    let mem =
        GuestMemoryMmap::from_ranges(&ranges).map_err(|e| MachineError::Memory(e.to_string()))?;
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
        // caller keeps for as long as the VM exists (the VM fd is dropped first).
        unsafe { vm.set_user_memory_region(r) }.map_err(kvm_err("KVM_SET_USER_MEMORY_REGION"))?;
    }
    Ok(mem)
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

fn install_kick_handler() {
    // Failure leaves the default action of a real-time signal (terminate), so it must not fail
    // silently; registering a handler for SIGRTMIN only fails for an invalid signal number.
    let _ =
        vmm_sys_util::signal::register_signal_handler(vmm_sys_util::signal::SIGRTMIN(), on_kick);
}

fn current_pthread() -> libc::pthread_t {
    // SAFETY: pthread_self has no preconditions.
    unsafe { libc::pthread_self() }
}

fn kick(thread: libc::pthread_t) {
    // SAFETY: the thread is the vCPU thread, alive until it sets `done` after the watchdog exits
    // its loop; the signal has a no-op handler installed.
    unsafe { libc::pthread_kill(thread, vmm_sys_util::signal::SIGRTMIN()) };
}
