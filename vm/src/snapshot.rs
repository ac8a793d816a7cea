//! A paused machine written to two files, and read back: the state file (vCPUs, the in-kernel
//! irqchip, PIT and clock, the serial port, every virtio transport) as JSON, and guest memory
//! as a raw image in which pages the guest never wrote are holes.
//!
//! A restored machine maps the memory file privately (copy on write): machines restored from one
//! snapshot share the page cache of its unchanged pages, and nothing a guest writes reaches the
//! file. Snapshots are host-local: the same KVM, the same processor model, the same kernel. One
//! from elsewhere is refused, as is one whose files do not match their own description, before
//! anything of them reaches KVM (a paused guest's snapshot is as hostile as the guest).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};

#[cfg(test)]
use kvm_bindings::kvm_lapic_state;
use kvm_bindings::{
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, Msrs, kvm_clock_data,
    kvm_irqchip, kvm_msr_entry,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use sandbox_devices::virtio::mmio::TransportState;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap, MemoryRegionAddress, MmapRegion,
};

use crate::layout;
pub use crate::saved::{VcpuState, VmState};

/// The state file's format; another is refused.
pub const FORMAT: u32 = 1;
/// Guest pages are looked at in runs of this many bytes when memory is written.
const CHUNK: usize = 2 << 20;
const PAGE: usize = 4096;

/// Why a snapshot could not be taken or restored.
#[derive(Debug, Error)]
pub enum SnapshotError {
    /// A KVM ioctl failed.
    #[error("{step}: {source}")]
    Kvm {
        /// What was being done.
        step: String,
        /// The error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Reading or writing a snapshot file failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// The state file is not one this build can restore.
    #[error("the snapshot's state file is unreadable ({0}); take the snapshot again")]
    Format(String),
    /// The snapshot was taken elsewhere or for another machine.
    #[error("the snapshot does not fit this machine: {0}")]
    Mismatch(String),
    /// The machine is not in a state a snapshot can be taken of.
    #[error("{0}")]
    State(String),
}

fn kvm_err(step: impl Into<String>) -> impl FnOnce(kvm_ioctls::Error) -> SnapshotError {
    let step = step.into();
    move |source| SnapshotError::Kvm { step, source }
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> SnapshotError {
    let context = context.into();
    move |source| SnapshotError::Io { context, source }
}

/// Where a snapshot may be restored: the same KVM on the same kind of processor and kernel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostId {
    /// CPUID vendor string and leaf 1 EAX (family, model, stepping).
    pub cpu: String,
    /// `uname -r`.
    pub kernel: String,
    /// KVM_GET_API_VERSION.
    pub kvm_api: i32,
}

impl HostId {
    /// This host's.
    pub fn here(kvm: &Kvm) -> HostId {
        HostId {
            cpu: cpu_signature(),
            kernel: kernel_release(),
            kvm_api: kvm.get_api_version(),
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn cpu_signature() -> String {
    let (l0, l1) = (std::arch::x86_64::__cpuid(0), std::arch::x86_64::__cpuid(1));
    let vendor: Vec<u8> = [l0.ebx, l0.edx, l0.ecx]
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .collect();
    format!("{} {:#x}", String::from_utf8_lossy(&vendor), l1.eax)
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_signature() -> String {
    std::env::consts::ARCH.to_string()
}

fn kernel_release() -> String {
    // SAFETY: uname fills the struct it is given.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: as above; the release field is NUL-terminated by the kernel.
    if unsafe { libc::uname(&mut u) } != 0 {
        return String::new();
    }
    // SAFETY: NUL-terminated (above).
    unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// The 16550's registers (vm-superio's `SerialState`, in a form we serialize).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialSnapshot {
    /// DLL, DLM, IER, IIR, LCR, LSR, MCR, MSR, SCR.
    pub registers: [u8; 9],
    /// Bytes the guest has not read.
    pub in_buffer: Vec<u8>,
}

impl SerialSnapshot {
    /// From vm-superio's state.
    pub fn of(s: &vm_superio::serial::SerialState) -> SerialSnapshot {
        SerialSnapshot {
            registers: [
                s.baud_divisor_low,
                s.baud_divisor_high,
                s.interrupt_enable,
                s.interrupt_identification,
                s.line_control,
                s.line_status,
                s.modem_control,
                s.modem_status,
                s.scratch,
            ],
            in_buffer: s.in_buffer.clone(),
        }
    }

    /// Back to vm-superio's state.
    pub fn state(&self) -> vm_superio::serial::SerialState {
        let r = self.registers;
        vm_superio::serial::SerialState {
            baud_divisor_low: r[0],
            baud_divisor_high: r[1],
            interrupt_enable: r[2],
            interrupt_identification: r[3],
            line_control: r[4],
            line_status: r[5],
            modem_control: r[6],
            modem_status: r[7],
            scratch: r[8],
            in_buffer: self.in_buffer.clone(),
        }
    }
}

/// Everything of a paused machine but its memory.
#[derive(Serialize, Deserialize)]
pub struct MachineState {
    /// [`FORMAT`].
    pub format: u32,
    /// Where it was taken.
    pub host: HostId,
    /// Guest memory, which the memory file holds in full.
    pub memory_mib: u32,
    /// One per vCPU, in id order.
    pub vcpus: Vec<VcpuState>,
    /// The irqchip, PIT and clock.
    pub vm: VmState,
    /// COM1.
    pub serial: SerialSnapshot,
    /// The virtio transports in bus order (vsock, disks, network).
    pub devices: Vec<TransportState>,
}

impl MachineState {
    /// The state file's bytes: at most [`MAX_STATE_BYTES`], as a restore reads.
    pub fn encode(&self) -> Result<Vec<u8>, SnapshotError> {
        let bytes = serde_json::to_vec(self).map_err(|e| SnapshotError::Format(e.to_string()))?;
        if bytes.len() as u64 > MAX_STATE_BYTES {
            return Err(SnapshotError::Format(format!(
                "a state of {} bytes, more than the {MAX_STATE_BYTES} a restore reads",
                bytes.len()
            )));
        }
        Ok(bytes)
    }

    /// Writes the state file.
    pub fn write_to(&self, file: &File) -> Result<(), SnapshotError> {
        Ok(write_state_file(&self.encode()?, file)?)
    }

    /// Reads a state file back, bounded, and checks it against `expect` (the machine checks
    /// the host when it restores it).
    pub fn read_from(mut file: &File, expect: &Expect) -> Result<MachineState, SnapshotError> {
        file.seek(SeekFrom::Start(0))
            .map_err(io("reading the state file"))?;
        let mut bytes = Vec::new();
        file.take(MAX_STATE_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(io("reading the state file"))?;
        MachineState::parse(&bytes, expect)
    }

    /// A state file's bytes, parsed and checked: bounded, this build's format, a machine like
    /// `expect`, and every vCPU and in-kernel device in a state the architecture allows
    /// ([`crate::state_check`]), before any of it reaches KVM.
    pub fn parse(bytes: &[u8], expect: &Expect) -> Result<MachineState, SnapshotError> {
        if bytes.len() as u64 > MAX_STATE_BYTES {
            return Err(SnapshotError::Format(format!(
                "longer than {MAX_STATE_BYTES} bytes"
            )));
        }
        let state: MachineState =
            serde_json::from_slice(bytes).map_err(|e| SnapshotError::Format(e.to_string()))?;
        if state.format != FORMAT {
            return Err(SnapshotError::Format(format!(
                "format {}, this build restores {FORMAT}",
                state.format
            )));
        }
        state.check_fits(expect)?;
        let refused = |e: crate::state_check::Refused| SnapshotError::Format(e.to_string());
        for (id, v) in state.vcpus.iter().enumerate() {
            crate::state_check::vcpu(id, v).map_err(refused)?;
        }
        crate::state_check::vm(&state.vm).map_err(refused)?;
        Ok(state)
    }

    /// Checks that the snapshot was taken on a host like this one.
    pub fn check_host(&self, here: &HostId) -> Result<(), SnapshotError> {
        if &self.host != here {
            return Err(SnapshotError::Mismatch(format!(
                "taken on {:?}, this host is {here:?} (snapshots are host-local)",
                self.host
            )));
        }
        Ok(())
    }

    /// Checks that the state is of a machine like `expect`, and bounded.
    pub fn check_fits(&self, expect: &Expect) -> Result<(), SnapshotError> {
        let mismatch = |s: String| Err(SnapshotError::Mismatch(s));
        if self.memory_mib != expect.memory_mib {
            return mismatch(format!(
                "{} MiB of memory, the machine has {}",
                self.memory_mib, expect.memory_mib
            ));
        }
        if self.vcpus.len() != usize::from(expect.vcpus) {
            return mismatch(format!(
                "{} vCPUs, the machine has {}",
                self.vcpus.len(),
                expect.vcpus
            ));
        }
        if self.devices.len() != expect.devices {
            return mismatch(format!(
                "{} devices, the machine has {}",
                self.devices.len(),
                expect.devices
            ));
        }
        if self.vm.irqchips.len() != 3 {
            return Err(SnapshotError::Format("not three irqchips".into()));
        }
        if self.serial.in_buffer.len() > 64 {
            return Err(SnapshotError::Format("an overfull serial FIFO".into()));
        }
        if self.vcpus.iter().any(|v| v.msrs.len() > MAX_MSRS) {
            return Err(SnapshotError::Format("too many MSRs".into()));
        }
        Ok(())
    }
}

/// What a restored machine has, which its snapshot must match.
#[derive(Debug, Clone)]
pub struct Expect {
    /// Guest memory.
    pub memory_mib: u32,
    /// vCPUs.
    pub vcpus: u8,
    /// virtio devices.
    pub devices: usize,
}

/// The most MSRs a vCPU's state may list (KVM knows a few hundred).
const MAX_MSRS: usize = 4096;

/// The MSRs to save: every one KVM lists that this vCPU can read. Built once per machine.
pub fn msr_list(kvm: &Kvm) -> Result<Vec<u32>, SnapshotError> {
    Ok(kvm
        .get_msr_index_list()
        .map_err(kvm_err("KVM_GET_MSR_INDEX_LIST"))?
        .as_slice()
        .to_vec())
}

/// The state of a vCPU that is out of KVM_RUN with its last exit completed.
pub fn save_vcpu(vcpu: &VcpuFd, msrs: &[u32]) -> Result<VcpuState, SnapshotError> {
    Ok(VcpuState {
        // KVM_GET_MP_STATE first: it flushes pending APIC events into the state read next.
        mp_state: vcpu.get_mp_state().map_err(kvm_err("KVM_GET_MP_STATE"))?,
        regs: vcpu.get_regs().map_err(kvm_err("KVM_GET_REGS"))?,
        sregs: vcpu.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?,
        xsave: vcpu.get_xsave().map_err(kvm_err("KVM_GET_XSAVE"))?,
        xcrs: vcpu.get_xcrs().map_err(kvm_err("KVM_GET_XCRS"))?,
        debugregs: vcpu
            .get_debug_regs()
            .map_err(kvm_err("KVM_GET_DEBUGREGS"))?,
        lapic: vcpu.get_lapic().map_err(kvm_err("KVM_GET_LAPIC"))?,
        events: vcpu
            .get_vcpu_events()
            .map_err(kvm_err("KVM_GET_VCPU_EVENTS"))?,
        msrs: read_msrs(vcpu, msrs)?,
    })
}

/// Reads the MSRs of `list` the vCPU has: KVM_GET_MSRS stops at the first it cannot read, which
/// is skipped (each at most once, so this ends).
fn read_msrs(vcpu: &VcpuFd, list: &[u32]) -> Result<Vec<(u32, u64)>, SnapshotError> {
    let mut out = Vec::with_capacity(list.len());
    let mut rest = list;
    while !rest.is_empty() {
        let take = rest.len().min(256);
        let entries: Vec<kvm_msr_entry> = rest[..take]
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries)
            .map_err(|e| SnapshotError::State(format!("building the MSR list: {e:?}")))?;
        let n = vcpu.get_msrs(&mut msrs).map_err(kvm_err("KVM_GET_MSRS"))?;
        out.extend(msrs.as_slice()[..n].iter().map(|e| (e.index, e.data)));
        // The one at `n` (if any) cannot be read here: skip it.
        rest = &rest[(n + usize::from(n < take)).min(rest.len())..];
    }
    Ok(out)
}

/// Puts a saved state into a freshly created vCPU whose CPUID is already set. `supported` is
/// KVM's MSR index list ([`msr_list`]): a state file is written by a VM process the guest may have
/// taken over, and restoring runs before the restoring process's filters, so only MSRs a
/// snapshot can hold are written, and only the run states an x86 vCPU has.
pub fn restore_vcpu(
    vcpu: &VcpuFd,
    id: usize,
    s: &VcpuState,
    supported: &[u32],
) -> Result<(), SnapshotError> {
    let step = |what: &str| format!("restoring vCPU {id}: {what}");
    if s.mp_state.mp_state > kvm_bindings::KVM_MP_STATE_SIPI_RECEIVED {
        return Err(SnapshotError::Format(format!(
            "vCPU {id}: run state {} is none an x86 vCPU has",
            s.mp_state.mp_state
        )));
    }
    let mut known = supported.to_vec();
    known.sort_unstable();
    if let Some((index, _)) = s
        .msrs
        .iter()
        .find(|(index, _)| known.binary_search(index).is_err())
    {
        return Err(SnapshotError::Format(format!(
            "vCPU {id}: MSR {index:#x} is not one KVM lists, so no snapshot holds it"
        )));
    }
    vcpu.set_mp_state(s.mp_state)
        .map_err(kvm_err(step("KVM_SET_MP_STATE")))?;
    vcpu.set_regs(&s.regs)
        .map_err(kvm_err(step("KVM_SET_REGS")))?;
    vcpu.set_sregs(&s.sregs)
        .map_err(kvm_err(step("KVM_SET_SREGS")))?;
    // SAFETY: a `kvm_xsave` is the 4096 bytes KVM_SET_XSAVE reads; guests here have no state
    // beyond them (AMX, which needs more, is never granted to this process).
    unsafe { vcpu.set_xsave(&s.xsave) }.map_err(kvm_err(step("KVM_SET_XSAVE")))?;
    vcpu.set_xcrs(&s.xcrs)
        .map_err(kvm_err(step("KVM_SET_XCRS")))?;
    vcpu.set_debug_regs(&s.debugregs)
        .map_err(kvm_err(step("KVM_SET_DEBUGREGS")))?;
    vcpu.set_lapic(&s.lapic)
        .map_err(kvm_err(step("KVM_SET_LAPIC")))?;
    for chunk in s.msrs.chunks(256) {
        let entries = crate::cpu::msr_entries(chunk);
        let msrs = Msrs::from_entries(&entries)
            .map_err(|e| SnapshotError::State(format!("building the MSR list: {e:?}")))?;
        let n = vcpu
            .set_msrs(&msrs)
            .map_err(kvm_err(step("KVM_SET_MSRS")))?;
        if n != entries.len() {
            return Err(SnapshotError::Mismatch(format!(
                "vCPU {id}: KVM took {n} of {} MSRs; MSR {:#x} is refused here",
                entries.len(),
                entries[n].index
            )));
        }
    }
    vcpu.set_vcpu_events(&s.events)
        .map_err(kvm_err(step("KVM_SET_VCPU_EVENTS")))?;
    Ok(())
}

/// The irqchip, PIT and clock of a VM whose vCPUs are all out of KVM_RUN.
pub fn save_vm(vm: &VmFd) -> Result<VmState, SnapshotError> {
    let mut irqchips = Vec::with_capacity(3);
    for chip in [
        KVM_IRQCHIP_PIC_MASTER,
        KVM_IRQCHIP_PIC_SLAVE,
        KVM_IRQCHIP_IOAPIC,
    ] {
        let mut c = kvm_irqchip {
            chip_id: chip,
            ..Default::default()
        };
        vm.get_irqchip(&mut c).map_err(kvm_err("KVM_GET_IRQCHIP"))?;
        irqchips.push(c);
    }
    Ok(VmState {
        irqchips,
        pit: vm.get_pit2().map_err(kvm_err("KVM_GET_PIT2"))?,
        clock: vm.get_clock().map_err(kvm_err("KVM_GET_CLOCK"))?,
    })
}

/// The most a guest's own clock reading may move its restored kvmclock past the saved one.
const MAX_CLOCK_LEAD_NS: u64 = 3600 * 1_000_000_000;

/// The kvmclock a restored machine starts from: the saved one, or the clock the guest itself
/// last saw if that is later. Where KVM cannot promise a stable TSC (no `PVCLOCK_TSC_STABLE_BIT`,
/// as in the nested test host), the guest never lets its clock go below the last value it read,
/// and that value, extrapolated from the TSC, can run seconds ahead of `KVM_GET_CLOCK`. Restored
/// below it, the guest's clock would stand still until KVM's caught up, and a time set in
/// between (`Identity`) would fall that far behind. QEMU's kvmclock device takes the same
/// maximum. The guest wrote what is read here: it is bounded, and can only move its own clock.
pub fn restored_clock(state: &MachineState, mem: &GuestMemoryMmap) -> u64 {
    let saved = state.vm.clock.clock;
    state
        .vcpus
        .iter()
        .filter_map(|v| guest_clock(v, mem))
        .map(|ns| ns.min(saved.saturating_add(MAX_CLOCK_LEAD_NS)))
        .fold(saved, u64::max)
}

/// What a vCPU's kvmclock read at the pause: its `pvclock_vcpu_time_info` (at the address in
/// `MSR_KVM_SYSTEM_TIME_NEW`) applied to its saved TSC, as the guest computes it.
fn guest_clock(v: &VcpuState, mem: &GuestMemoryMmap) -> Option<u64> {
    const MSR_IA32_TSC: u32 = 0x10;
    const MSR_KVM_SYSTEM_TIME_NEW: u32 = 0x4b56_4d01;
    let msr = |index: u32| v.msrs.iter().find(|(i, _)| *i == index).map(|&(_, v)| v);
    let area = msr(MSR_KVM_SYSTEM_TIME_NEW).filter(|a| a & 1 == 1)? & !1;
    let tsc = msr(MSR_IA32_TSC)?;
    let mut b = [0u8; 32];
    mem.read_slice(&mut b, GuestAddress(area)).ok()?;
    let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default());
    let version = u32::from_le_bytes(b[0..4].try_into().unwrap_or_default());
    if version & 1 == 1 {
        return None; // an update the pause cut in half
    }
    let (stamp, system_time) = (word(8), word(16));
    let mul = u32::from_le_bytes(b[24..28].try_into().unwrap_or_default());
    let shift = b[28] as i8;
    let delta = tsc.checked_sub(stamp)?;
    let delta = if shift < 0 {
        delta.checked_shr(u32::from(shift.unsigned_abs()))?
    } else {
        delta.checked_shl(shift as u32)?
    };
    let ns = (u128::from(delta) * u128::from(mul)) >> 32;
    system_time.checked_add(u64::try_from(ns).ok()?)
}

/// Puts the saved irqchip, PIT and the kvmclock (`restored_clock`) into a VM that has them
/// created.
pub fn restore_vm(vm: &VmFd, s: &VmState, clock_ns: u64) -> Result<(), SnapshotError> {
    vm.set_pit2(&s.pit)
        .map_err(kvm_err("restoring KVM_SET_PIT2"))?;
    // Only the value is restored: KVM refuses flags it set itself on the way out.
    let clock = kvm_clock_data {
        clock: clock_ns,
        ..Default::default()
    };
    vm.set_clock(&clock)
        .map_err(kvm_err("restoring KVM_SET_CLOCK"))?;
    for (c, want) in s.irqchips.iter().zip([
        KVM_IRQCHIP_PIC_MASTER,
        KVM_IRQCHIP_PIC_SLAVE,
        KVM_IRQCHIP_IOAPIC,
    ]) {
        if c.chip_id != want {
            return Err(SnapshotError::Format(format!(
                "irqchip {} where {want} belongs",
                c.chip_id
            )));
        }
        vm.set_irqchip(c)
            .map_err(kvm_err("restoring KVM_SET_IRQCHIP"))?;
    }
    Ok(())
}

pub use sandbox_control::files::{
    MAX_STATE_BYTES, memory_file_len, size_memory_file, write_state_file,
};

impl From<sandbox_control::files::FileError> for SnapshotError {
    fn from(e: sandbox_control::files::FileError) -> Self {
        SnapshotError::Io {
            context: e.context.to_string(),
            source: e.source,
        }
    }
}

/// A shared, writable mapping of part of a file, unmapped on drop.
struct FileMap {
    at: *mut u8,
    len: usize,
}

impl FileMap {
    fn new(file: &File, offset: u64, len: usize) -> Result<FileMap, SnapshotError> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh mapping of `len` bytes of an open file, at an address the kernel
        // picks; it is unmapped once, on drop.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(SnapshotError::Io {
                context: "mapping the memory file".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(FileMap { at: at.cast(), len })
    }

    /// Copies `bytes` to `at`. The pages are made writable first with
    /// `MADV_POPULATE_WRITE` (Linux 5.14), so a file system that has no room answers with an
    /// error instead of the `SIGBUS` a plain store would get; an older kernel copies without.
    fn write(&mut self, at: usize, bytes: &[u8]) -> Result<(), SnapshotError> {
        assert!(at + bytes.len() <= self.len, "inside the mapping");
        // SAFETY: madvise on a page-aligned range inside our mapping (runs start on pages).
        let r = unsafe {
            libc::madvise(
                self.at.add(at).cast(),
                bytes.len(),
                libc::MADV_POPULATE_WRITE,
            )
        };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(SnapshotError::Io {
                    context: "writing the memory file (is its file system full?)".into(),
                    source: e,
                });
            }
        }
        // SAFETY: the range was checked to lie inside the mapping, which lives as long as self;
        // `bytes` is guest memory, a separate mapping.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.at.add(at), bytes.len()) };
        Ok(())
    }
}

impl Drop for FileMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.at.cast(), self.len) };
    }
}

/// Writes guest memory into `file`, which the caller must have sized ([`size_memory_file`]; a
/// shorter file faults the process at its end): regions back to back; pages that hold only zeros
/// stay holes (reading a page the guest never touched maps the zero page: cheap). The bytes go
/// through a shared mapping of the file, so a VM process writes it whatever its file size limit
/// (its disks'), cannot make it any larger, and needs no call but `mmap` and `fdatasync` (its
/// main thread's filter has no `fstat`, `pwrite64` or `ftruncate`). Returns the bytes written.
pub fn write_memory(mem: &GuestMemoryMmap, file: &File) -> Result<u64, SnapshotError> {
    let mut offset = 0u64;
    let mut written = 0u64;
    for region in mem.iter() {
        let len = region.len() as usize;
        let host = region
            .get_host_address(MemoryRegionAddress(0))
            .map_err(|e| SnapshotError::State(format!("guest memory: {e}")))?;
        let mut out = FileMap::new(file, offset, len)?;
        let mut at = 0usize;
        while at < len {
            let n = CHUNK.min(len - at);
            // SAFETY: `host + at .. + n` lies inside the region's mapping, which `mem` keeps
            // alive; the guest is paused, so the bytes do not change under us, and the slice is
            // dropped before the guest runs again. Pages are judged by their content alone:
            // residency (mincore) would call a swapped-out page, or a restored guest's page
            // still only in its snapshot's file, a hole.
            let bytes = unsafe { std::slice::from_raw_parts(host.add(at), n) };
            let mut run: Option<usize> = None;
            for (p, page) in bytes.chunks(PAGE).enumerate() {
                let keep = page.iter().any(|&b| b != 0);
                match (keep, run) {
                    (true, None) => run = Some(p),
                    (false, Some(start)) => {
                        let b = &bytes[start * PAGE..p * PAGE];
                        out.write(at + start * PAGE, b)?;
                        written += b.len() as u64;
                        run = None;
                    }
                    _ => {}
                }
            }
            if let Some(start) = run {
                let b = &bytes[start * PAGE..];
                out.write(at + start * PAGE, b)?;
                written += b.len() as u64;
            }
            at += n;
        }
        offset += len as u64;
    }
    file.sync_data().map_err(io("syncing the memory file"))?;
    Ok(written)
}

/// Guest memory of `mem_bytes` mapped privately from `file` (copy on write). The file must hold
/// all of it: a shorter one would fault the VM process at the first page past its end.
pub fn map_memory(file: &File, mem_bytes: u64) -> Result<GuestMemoryMmap, SnapshotError> {
    let want = memory_file_len(mem_bytes);
    let have = file
        .metadata()
        .map_err(io("reading the memory file's size"))?
        .len();
    if have != want {
        return Err(SnapshotError::Mismatch(format!(
            "the memory file has {have} bytes, the machine's memory is {want}"
        )));
    }
    let file = std::sync::Arc::new(
        file.try_clone()
            .map_err(io("duplicating the memory file"))?,
    );
    let mut regions = Vec::new();
    let mut offset = 0u64;
    for (addr, len) in layout::ram_regions(mem_bytes) {
        let region = vm_memory::mmap::MmapRegionBuilder::new(len as usize)
            .with_file_offset(FileOffset::from_arc(file.clone(), offset))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
            .build()
            .map_err(|e| SnapshotError::State(format!("mapping the memory file: {e}")))?;
        let region: MmapRegion = region;
        regions.push(
            GuestRegionMmap::new(region, GuestAddress(addr.0))
                .ok_or_else(|| SnapshotError::State("a guest region out of range".into()))?,
        );
        offset += len;
    }
    GuestMemoryMmap::from_regions(regions)
        .map_err(|e| SnapshotError::State(format!("guest memory: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_vcpu_state_with_an_msr_or_run_state_kvm_does_not_list_is_refused() {
        // A real vCPU of this host's KVM (which runs simple guest code, so vCPUs exist).
        let Ok(kvm) = Kvm::new() else {
            assert!(
                std::env::var_os("SANDBOX_HOST_REQUIRE_E2E").is_none(),
                "no /dev/kvm here"
            );
            eprintln!("skipped: no /dev/kvm on this machine");
            return;
        };
        let vm = kvm.create_vm().unwrap();
        vm.set_tss_address(layout::KVM_TSS_ADDRESS).unwrap();
        vm.create_irq_chip().unwrap();
        let vcpu = vm.create_vcpu(0).unwrap();
        crate::cpu::set_cpuid(&kvm, &vcpu, 0, 1).unwrap();
        let supported = msr_list(&kvm).unwrap();
        let mut state = save_vcpu(&vcpu, &supported).unwrap();
        assert!(!state.msrs.is_empty());
        restore_vcpu(&vcpu, 0, &state, &supported).expect("its own state restores");

        state.msrs.push((0xdead_beef, 1));
        let e = restore_vcpu(&vcpu, 0, &state, &supported).unwrap_err();
        assert!(
            e.to_string()
                .contains("MSR 0xdeadbeef is not one KVM lists"),
            "{e}"
        );
        state.msrs.pop();
        state.mp_state.mp_state = 9;
        let e = restore_vcpu(&vcpu, 0, &state, &supported).unwrap_err();
        assert!(e.to_string().contains("run state 9"), "{e}");
    }

    /// Anonymous guest memory laid out as a machine of `mem_bytes` has it.
    fn guest_memory(mem_bytes: u64) -> GuestMemoryMmap {
        let ranges: Vec<_> = layout::ram_regions(mem_bytes)
            .into_iter()
            .map(|(a, l)| (a, l as usize))
            .collect();
        GuestMemoryMmap::<()>::from_ranges(&ranges).unwrap()
    }

    #[test]
    fn memory_round_trips_with_holes_where_the_guest_wrote_nothing() {
        let mem_bytes = 64u64 << 20;
        let mem = guest_memory(mem_bytes);
        mem.write_slice(b"hello", GuestAddress(0x1000)).unwrap();
        mem.write_slice(&[7u8; 3 * PAGE], GuestAddress(0x20_0000 - PAGE as u64))
            .unwrap();
        mem.write_obj(1u8, GuestAddress(mem_bytes - 1)).unwrap();
        let f = tempfile::tempfile().unwrap();
        size_memory_file(&f, mem_bytes).unwrap();
        let written = write_memory(&mem, &f).unwrap();
        assert_eq!(written, 5 * PAGE as u64, "only the pages with data");
        assert_eq!(f.metadata().unwrap().len(), memory_file_len(mem_bytes));

        let back = map_memory(&f, mem_bytes).unwrap();
        let mut b = [0u8; 5];
        back.read_slice(&mut b, GuestAddress(0x1000)).unwrap();
        assert_eq!(&b, b"hello");
        assert_eq!(back.read_obj::<u8>(GuestAddress(mem_bytes - 1)).unwrap(), 1);
        assert_eq!(
            back.read_obj::<u8>(GuestAddress(0x20_0000 + 2 * PAGE as u64 - 1))
                .unwrap(),
            7
        );
        // Copy on write: the clone's writes never reach the file.
        back.write_slice(b"HELLO", GuestAddress(0x1000)).unwrap();
        let mut on_disk = [0u8; 5];
        f.read_exact_at(&mut on_disk, 0x1000).unwrap();
        assert_eq!(&on_disk, b"hello");
    }

    #[test]
    fn the_clock_restored_is_never_behind_what_the_guest_saw() {
        let mem_bytes = 64u64 << 20;
        let mem = guest_memory(mem_bytes);
        // A pvclock area at 0x5000: stamped at TSC 1,000,000 with 7 s of system time, and a
        // TSC at 2 GHz (shift 0, mul 2^31: half a nanosecond a tick).
        let mut area = [0u8; 32];
        area[8..16].copy_from_slice(&1_000_000u64.to_le_bytes());
        area[16..24].copy_from_slice(&7_000_000_000u64.to_le_bytes());
        area[24..28].copy_from_slice(&(1u32 << 31).to_le_bytes());
        mem.write_slice(&area, GuestAddress(0x5000)).unwrap();
        let vcpu = |msrs: Vec<(u32, u64)>| VcpuState {
            regs: Default::default(),
            sregs: Default::default(),
            xsave: Default::default(),
            xcrs: Default::default(),
            debugregs: Default::default(),
            lapic: Default::default(),
            mp_state: Default::default(),
            events: Default::default(),
            msrs,
        };
        let state = |saved: u64, msrs: Vec<(u32, u64)>| MachineState {
            format: FORMAT,
            host: HostId {
                cpu: "x".into(),
                kernel: "k".into(),
                kvm_api: 12,
            },
            memory_mib: 64,
            vcpus: vec![vcpu(msrs)],
            vm: VmState {
                irqchips: vec![],
                pit: Default::default(),
                clock: kvm_clock_data {
                    clock: saved,
                    ..Default::default()
                },
            },
            serial: Default::default(),
            devices: vec![],
        };
        // 2,000,000 ticks after the stamp: the guest saw 7.001 s.
        let seen = vec![(0x10, 3_000_000), (0x4b56_4d01, 0x5001)];
        assert_eq!(
            restored_clock(&state(5_000_000_000, seen.clone()), &mem),
            7_001_000_000
        );
        // KVM's own clock ahead: it stays.
        assert_eq!(
            restored_clock(&state(9_000_000_000, seen), &mem),
            9_000_000_000
        );
        // Disabled, outside memory, or torn: the saved clock.
        for msrs in [
            vec![(0x10, 3_000_000), (0x4b56_4d01, 0x5000)],
            vec![(0x10, 3_000_000), (0x4b56_4d01, (1 << 40) | 1)],
            vec![(0x10, 3_000_000), (0x4b56_4d01, u64::MAX)],
            vec![(0x4b56_4d01, 0x5001)],
        ] {
            assert_eq!(restored_clock(&state(5, msrs), &mem), 5);
        }
        mem.write_obj(1u32, GuestAddress(0x5000)).unwrap();
        let seen = vec![(0x10, 3_000_000), (0x4b56_4d01, 0x5001)];
        assert_eq!(restored_clock(&state(5, seen.clone()), &mem), 5, "torn");
        // Hostile values: no panic, and at most an hour past the saved clock.
        mem.write_obj(0u32, GuestAddress(0x5000)).unwrap();
        mem.write_obj(u64::MAX - 1, GuestAddress(0x5010)).unwrap();
        assert_eq!(restored_clock(&state(5, seen.clone()), &mem), 5, "overflow");
        mem.write_obj(0u64, GuestAddress(0x5010)).unwrap();
        mem.write_obj(u32::MAX, GuestAddress(0x5018)).unwrap();
        mem.write_obj(63u8, GuestAddress(0x501c)).unwrap();
        let far = restored_clock(&state(5, seen.clone()), &mem);
        assert!(far <= 5 + MAX_CLOCK_LEAD_NS, "{far}");
        mem.write_obj(-128i8, GuestAddress(0x501c)).unwrap();
        assert_eq!(restored_clock(&state(5, seen), &mem), 5);
    }

    #[test]
    fn a_memory_file_of_the_wrong_length_is_refused_before_it_is_mapped() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(memory_file_len(64 << 20) - 4096).unwrap();
        let e = map_memory(&f, 64 << 20).unwrap_err();
        assert!(e.to_string().contains("the memory file has"), "{e}");
    }

    #[test]
    fn state_files_that_are_damaged_or_from_elsewhere_are_refused() {
        let here = HostId {
            cpu: "x".into(),
            kernel: "k".into(),
            kvm_api: 12,
        };
        let expect = Expect {
            memory_mib: 64,
            vcpus: 1,
            devices: 0,
        };
        // A vCPU and chips as KVM has them after a reset: local interrupts masked, the IOAPIC
        // at its address with every pin masked.
        let mut lapic = kvm_lapic_state::default();
        for off in [0x320, 0x330, 0x340, 0x350, 0x360, 0x370] {
            lapic.regs[off + 2] = 1;
        }
        let mut irqchips: Vec<kvm_irqchip> = (0..3u32)
            .map(|chip_id| kvm_irqchip {
                chip_id,
                ..Default::default()
            })
            .collect();
        // SAFETY: the IOAPIC member of the third chip's union, all integers.
        unsafe {
            irqchips[2].chip.ioapic.base_address = 0xfec0_0000;
            for e in &mut irqchips[2].chip.ioapic.redirtbl {
                e.bits = 1 << 16;
            }
        }
        let state = MachineState {
            format: FORMAT,
            host: here.clone(),
            memory_mib: 64,
            vcpus: vec![VcpuState {
                regs: Default::default(),
                sregs: Default::default(),
                xsave: Default::default(),
                xcrs: Default::default(),
                debugregs: Default::default(),
                lapic,
                mp_state: Default::default(),
                events: Default::default(),
                msrs: vec![(0x10, 5)],
            }],
            vm: VmState {
                irqchips,
                pit: Default::default(),
                clock: Default::default(),
            },
            serial: SerialSnapshot::default(),
            devices: vec![],
        };
        let f = tempfile::tempfile().unwrap();
        state.write_to(&f).unwrap();
        let back = MachineState::read_from(&f, &expect).unwrap();
        assert_eq!(back.vcpus[0].msrs, vec![(0x10, 5)]);
        back.check_host(&here).unwrap();

        let elsewhere = HostId {
            cpu: "y".into(),
            ..here.clone()
        };
        let e = back.check_host(&elsewhere).err().unwrap();
        assert!(e.to_string().contains("host-local"), "{e}");
        let e = MachineState::read_from(
            &f,
            &Expect {
                vcpus: 2,
                ..expect.clone()
            },
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains("1 vCPUs, the machine has 2"), "{e}");

        // A vCPU in a state no processor has (VMX on, though no guest is offered it) is refused
        // before KVM sees it.
        let mut forged = MachineState {
            vcpus: vec![],
            ..MachineState::parse(&state.encode().unwrap(), &expect).unwrap()
        };
        let mut v = MachineState::parse(&state.encode().unwrap(), &expect)
            .unwrap()
            .vcpus
            .remove(0);
        v.sregs.cr4 |= 1 << 13;
        forged.vcpus.push(v);
        let e = MachineState::parse(&forged.encode().unwrap(), &expect)
            .err()
            .unwrap();
        assert!(e.to_string().contains("vCPU 0: CR4"), "{e}");

        // Truncated, and garbage.
        let len = f.metadata().unwrap().len();
        f.set_len(len / 2).unwrap();
        let e = MachineState::read_from(&f, &expect).err().unwrap();
        assert!(e.to_string().contains("unreadable"), "{e}");
        f.set_len(0).unwrap();
        f.write_all_at(&[0xff; 100], 0).unwrap();
        assert!(MachineState::read_from(&f, &expect).is_err());
        // Too long to be read at all.
        f.set_len(MAX_STATE_BYTES + 10).unwrap();
        let e = MachineState::read_from(&f, &expect).err().unwrap();
        assert!(e.to_string().contains("longer than"), "{e}");
    }
}
