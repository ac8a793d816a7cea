//! Putting a vCPU in the state the PVH entry expects: 32-bit protected mode, paging off, flat
//! segments, `ebx` pointing at the start info (the boot processor only: the others wait for
//! the kernel's INIT/SIPI in KVM's LAPIC); CPUID filtered for the guest (topology, no PMU,
//! the hypervisor bit); the MSRs a freshly reset processor has; FPU and LAPIC set.

use kvm_bindings::{KVM_MAX_CPUID_ENTRIES, Msrs, kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment};
use kvm_ioctls::{Kvm, VcpuFd};
use thiserror::Error;
use vm_memory::GuestAddress;

use crate::layout;

/// A vCPU set-up step KVM refused.
#[derive(Debug, Error)]
#[error("setting up vCPU {cpu}: {step}: {source}")]
pub struct CpuError {
    cpu: u8,
    step: &'static str,
    #[source]
    source: kvm_ioctls::Error,
}

impl CpuError {
    /// A machine asked for with no vCPU at all.
    pub fn zero() -> CpuError {
        CpuError {
            cpu: 0,
            step: "a machine needs at least one vCPU",
            source: kvm_ioctls::Error::new(libc::EINVAL),
        }
    }
}

/// LAPIC register offsets and delivery modes.
const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// CPUID leaf 1 ECX: running under a hypervisor.
const CPUID_HYPERVISOR: u32 = 1 << 31;
/// CPUID leaf 1 ECX: Intel VMX. Hidden: with it a guest drives the host kernel's nested-VMX code
/// (KVM refuses CR4.VMXE to a guest whose CPUID lacks it), which has had guest-to-host escapes.
const CPUID_VMX: u32 = 1 << 5;
/// CPUID leaf 0x8000_0001 ECX: AMD SVM. Hidden for the same reason (KVM refuses EFER.SVME).
const CPUID_SVM: u32 = 1 << 2;
/// CPUID leaf 0x8000_0001 ECX: AMD's core performance counters (there is no PMU).
const CPUID_PERFCTR_CORE: u32 = 1 << 23;
/// CPUID leaf 0x8000_000A: SVM's revision and features, meaningless without SVM.
const CPUID_SVM_FEATURES: u32 = 0x8000_000a;

/// MSRs set on every vCPU: SYSENTER and SYSCALL targets cleared, TSC from zero, fast strings
/// on, MTRRs enabled with write-back as the default type (else the guest maps all RAM
/// uncached).
const BOOT_MSRS: [(u32, u64); 11] = [
    (0x174, 0),             // IA32_SYSENTER_CS
    (0x175, 0),             // IA32_SYSENTER_ESP
    (0x176, 0),             // IA32_SYSENTER_EIP
    (0xc000_0081, 0),       // STAR
    (0xc000_0082, 0),       // LSTAR
    (0xc000_0083, 0),       // CSTAR
    (0xc000_0084, 0),       // SYSCALL_MASK
    (0xc000_0102, 0),       // KERNEL_GS_BASE
    (0x10, 0),              // IA32_TSC
    (0x1a0, 1),             // IA32_MISC_ENABLE: fast strings
    (0x2ff, (1 << 11) | 6), // MTRRdefType: enabled, write-back
];

/// KVM's entries for (index, value) pairs.
pub(crate) fn msr_entries(pairs: &[(u32, u64)]) -> Vec<kvm_msr_entry> {
    pairs
        .iter()
        .map(|&(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect()
}

/// The guest's CPUID for vCPU `id` of `count`: what a booted vCPU gets first, and a restored one
/// before its saved state (the same host gives the same CPUID, which the snapshot's host check
/// ensures).
pub fn set_cpuid(kvm: &Kvm, vcpu: &VcpuFd, id: u8, count: u8) -> Result<(), CpuError> {
    let err = |step| {
        move |source| CpuError {
            cpu: id,
            step,
            source,
        }
    };
    let mut cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(err("KVM_GET_SUPPORTED_CPUID"))?;
    filter_cpuid(cpuid.as_mut_slice(), id, count);
    vcpu.set_cpuid2(&cpuid).map_err(err("KVM_SET_CPUID2"))
}

/// Sets up vCPU `id` of `count`; the boot processor (0) starts at `entry`.
pub fn setup(
    kvm: &Kvm,
    vcpu: &VcpuFd,
    id: u8,
    count: u8,
    entry: GuestAddress,
) -> Result<(), CpuError> {
    let err = |step| {
        move |source| CpuError {
            cpu: id,
            step,
            source,
        }
    };

    set_cpuid(kvm, vcpu, id, count)?;

    let entries = msr_entries(&BOOT_MSRS);
    let msrs = Msrs::from_entries(&entries).map_err(|_| CpuError {
        cpu: id,
        step: "building the MSR list",
        source: kvm_ioctls::Error::new(libc::EINVAL),
    })?;
    vcpu.set_msrs(&msrs).map_err(err("KVM_SET_MSRS"))?;

    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(err("KVM_SET_FPU"))?;
    set_lapic(vcpu, id)?;
    if id != 0 {
        return Ok(());
    }

    let regs = kvm_regs {
        rip: entry.0,
        rbx: layout::START_INFO.0,
        rflags: 0x2,
        ..Default::default()
    };
    vcpu.set_regs(&regs).map_err(err("KVM_SET_REGS"))?;

    let mut sregs = vcpu.get_sregs().map_err(err("KVM_GET_SREGS"))?;
    let flat = |selector: u16, type_: u8| kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl: 0,
        db: 1,
        s: 1,
        l: 0,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    };
    sregs.cs = flat(0x08, 0xb);
    let data = flat(0x10, 0x3);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = kvm_segment {
        base: 0,
        limit: 0x67,
        selector: 0x18,
        type_: 0xb,
        present: 1,
        s: 0,
        g: 0,
        db: 0,
        ..flat(0, 0)
    };
    sregs.cr0 = 0x11; // PE | ET: protected mode, paging off
    sregs.cr4 = 0;
    sregs.efer = 0;
    vcpu.set_sregs(&sregs).map_err(err("KVM_SET_SREGS"))?;
    Ok(())
}

fn set_lapic(vcpu: &VcpuFd, id: u8) -> Result<(), CpuError> {
    let err = |step| {
        move |source| CpuError {
            cpu: id,
            step,
            source,
        }
    };
    // LINT0 delivers the legacy PIC's interrupts (ExtINT), LINT1 NMIs, as on real boards.
    let mut lapic = vcpu.get_lapic().map_err(err("KVM_GET_LAPIC"))?;
    for (off, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
        let v = read_reg(&lapic.regs, off);
        write_reg(&mut lapic.regs, off, (v & !0x700) | (mode << 8));
    }
    vcpu.set_lapic(&lapic).map_err(err("KVM_SET_LAPIC"))?;
    Ok(())
}

/// Topology: `count` single-threaded cores in one package, this one with APIC id `id`;
/// no performance monitoring (the guest would program counters KVM may not emulate); no VMX or
/// SVM, so no guest reaches the host's nested virtualisation (docs/threat-model.md, "CPUID"); the
/// hypervisor bit, so the guest takes the paravirtual paths.
fn filter_cpuid(entries: &mut [kvm_bindings::kvm_cpuid_entry2], id: u8, count: u8) {
    let (id, count) = (u32::from(id), u32::from(count));
    // Bits of an x2APIC id taken by the core number.
    let core_bits = 32 - (count.max(1) - 1).leading_zeros();
    for e in entries {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x0000_ffff) | (count << 16) | (id << 24);
                e.ecx = (e.ecx | CPUID_HYPERVISOR) & !CPUID_VMX;
                if count > 1 {
                    e.edx |= 1 << 28; // HTT: the logical processor count is valid
                }
            }
            4 => {
                // Cores per package, minus one.
                e.eax = (e.eax & 0x03ff_ffff) | ((count - 1) << 26);
            }
            0xa | CPUID_SVM_FEATURES => {
                e.eax = 0;
                e.ebx = 0;
                e.ecx = 0;
                e.edx = 0;
            }
            0xb | 0x1f => {
                e.edx = id;
                match e.index {
                    0 => {
                        // SMT level: one thread per core.
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = 1 << 8;
                    }
                    1 => {
                        // Core level.
                        e.eax = core_bits;
                        e.ebx = count;
                        e.ecx = (2 << 8) | 1;
                    }
                    i => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = i;
                    }
                }
            }
            0x8000_0001 => e.ecx &= !(CPUID_SVM | CPUID_PERFCTR_CORE),
            0x8000_0008 => e.ecx = (e.ecx & !0xff) | (count - 1),
            0x8000_001e => {
                e.eax = id;
                e.ebx = id & 0xff;
                e.ecx = 0;
            }
            _ => {}
        }
    }
}

fn read_reg(regs: &[std::os::raw::c_char; 1024], off: usize) -> u32 {
    let b: [u8; 4] = std::array::from_fn(|i| regs[off + i] as u8);
    u32::from_le_bytes(b)
}

fn write_reg(regs: &mut [std::os::raw::c_char; 1024], off: usize, v: u32) {
    for (i, b) in v.to_le_bytes().into_iter().enumerate() {
        regs[off + i] = b as std::os::raw::c_char;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, ecx: u32) -> kvm_bindings::kvm_cpuid_entry2 {
        kvm_bindings::kvm_cpuid_entry2 {
            function,
            ecx,
            eax: u32::MAX,
            ebx: u32::MAX,
            edx: u32::MAX,
            ..Default::default()
        }
    }

    /// Whatever KVM offers (nested=1 offers VMX or SVM), the guest is told of neither.
    #[test]
    fn virtualisation_extensions_are_hidden() {
        let mut e = [
            entry(1, u32::MAX),
            entry(0x8000_0001, u32::MAX),
            entry(0x8000_000a, 0),
        ];
        filter_cpuid(&mut e, 0, 2);
        assert_eq!(e[0].ecx & CPUID_VMX, 0, "VMX hidden");
        assert_ne!(e[0].ecx & CPUID_HYPERVISOR, 0, "hypervisor bit set");
        assert_eq!(e[1].ecx & CPUID_SVM, 0, "SVM hidden");
        assert_eq!(e[1].ecx & CPUID_PERFCTR_CORE, 0);
        assert_eq!(
            e[1].ecx | CPUID_SVM | CPUID_PERFCTR_CORE,
            u32::MAX,
            "the rest passed"
        );
        assert_eq!((e[2].eax, e[2].ebx, e[2].ecx, e[2].edx), (0, 0, 0, 0));
    }
}
