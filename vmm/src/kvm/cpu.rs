//! Putting a vCPU in the state the PVH entry expects: 32-bit protected mode, paging off, flat
//! segments, `ebx` pointing at the start info; CPUID filtered for the guest; FPU and LAPIC set.

use kvm_bindings::{KVM_MAX_CPUID_ENTRIES, kvm_fpu, kvm_regs, kvm_segment};
use kvm_ioctls::{Kvm, VcpuFd};
use thiserror::Error;
use vm_memory::GuestAddress;

use super::layout;

/// A vCPU set-up step KVM refused.
#[derive(Debug, Error)]
#[error("setting up vCPU {cpu}: {step}: {source}")]
pub struct CpuError {
    cpu: u8,
    step: &'static str,
    #[source]
    source: kvm_ioctls::Error,
}

/// LAPIC register offsets and delivery modes.
const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// CPUID leaf 1 ECX: running under a hypervisor.
const CPUID_HYPERVISOR: u32 = 1 << 31;

/// Sets up vCPU `id` of `count` to start at `entry`.
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

    let mut cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(err("KVM_GET_SUPPORTED_CPUID"))?;
    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => {
                // Initial APIC id, logical processor count, and the hypervisor bit.
                e.ebx = (e.ebx & 0x0000_ffff) | (u32::from(count) << 16) | (u32::from(id) << 24);
                e.ecx |= CPUID_HYPERVISOR;
            }
            0xb => e.edx = u32::from(id),
            _ => {}
        }
    }
    vcpu.set_cpuid2(&cpuid).map_err(err("KVM_SET_CPUID2"))?;

    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(err("KVM_SET_FPU"))?;

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

    // LINT0 delivers the legacy PIC's interrupts (ExtINT), LINT1 NMIs, as on real boards.
    let mut lapic = vcpu.get_lapic().map_err(err("KVM_GET_LAPIC"))?;
    for (off, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
        let v = read_reg(&lapic.regs, off);
        write_reg(&mut lapic.regs, off, (v & !0x700) | (mode << 8));
    }
    vcpu.set_lapic(&lapic).map_err(err("KVM_SET_LAPIC"))?;
    Ok(())
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
