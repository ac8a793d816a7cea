//! The state KVM gives back of a paused machine's vCPUs and in-kernel devices, as a snapshot
//! keeps it: what `snapshot` writes and reads, and what `state_check` checks before any of it
//! reaches KVM again.

use kvm_bindings::{
    kvm_clock_data, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_pit_state2,
    kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use serde::{Deserialize, Serialize};

/// One vCPU, as KVM gives it back.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    /// General registers.
    pub regs: kvm_regs,
    /// Segments, control registers, EFER, the APIC base.
    pub sregs: kvm_sregs,
    /// FPU, SSE and AVX state.
    pub xsave: kvm_xsave,
    /// XCR0.
    pub xcrs: kvm_xcrs,
    /// Debug registers.
    pub debugregs: kvm_debugregs,
    /// The local APIC's registers.
    pub lapic: kvm_lapic_state,
    /// Running, halted, or waiting for INIT/SIPI.
    pub mp_state: kvm_mp_state,
    /// Pending exceptions, interrupts and NMIs.
    pub events: kvm_vcpu_events,
    /// Every MSR KVM would give, as (index, value).
    pub msrs: Vec<(u32, u64)>,
}

/// The in-kernel devices of the VM.
#[derive(Clone, Serialize, Deserialize)]
pub struct VmState {
    /// The two 8259s and the IOAPIC, in that order.
    pub irqchips: Vec<kvm_irqchip>,
    /// The 8254.
    pub pit: kvm_pit_state2,
    /// kvmclock.
    pub clock: kvm_clock_data,
}
