//! The KVM backend's snapshot state, which a VM process its guest took over may have written:
//! the file parsed and checked as a restore reads it, and each structure KVM would be handed
//! (segments and control registers, XSAVE, events, the local APIC, the PICs, the IOAPIC, the
//! PIT) filled with any bytes and checked. Invariants: no panic; a state that passes once passes
//! again after it is written out.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_vm::snapshot::{Expect, MachineState, VcpuState, VmState};
use sandbox_vm::state_check;

/// A `T` whose first bytes come from `data` (zeros past its end), `data` advanced past them.
/// `T` is one of KVM's plain structures of integers: every byte pattern is one of its values.
fn fill<T: Default>(data: &mut &[u8]) -> T {
    let mut v = T::default();
    let n = std::mem::size_of::<T>().min(data.len());
    // SAFETY: `n` bytes fit both the source and the destination; T holds only integers.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), (&raw mut v).cast::<u8>(), n) };
    *data = &data[n..];
    v
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, mut rest)) = data.split_first() else {
        return;
    };
    if mode & 1 == 0 {
        let expect = Expect {
            memory_mib: 128,
            vcpus: 1 + (mode >> 1) % 4,
            devices: 2,
        };
        if let Ok(state) = MachineState::parse(rest, &expect) {
            let again = state.encode().expect("a parsed state encodes");
            MachineState::parse(&again, &expect).expect("a state that passed passes again");
        }
        return;
    }
    let vcpu = VcpuState {
        regs: fill(&mut rest),
        sregs: fill(&mut rest),
        xsave: fill(&mut rest),
        xcrs: fill(&mut rest),
        debugregs: fill(&mut rest),
        lapic: fill(&mut rest),
        mp_state: fill(&mut rest),
        events: fill(&mut rest),
        msrs: vec![],
    };
    let _ = state_check::vcpu(usize::from(mode >> 1), &vcpu);
    let mut vm = VmState {
        irqchips: vec![fill(&mut rest), fill(&mut rest), fill(&mut rest)],
        pit: fill(&mut rest),
        clock: fill(&mut rest),
    };
    // The chips in their places, so the checks of each are reached.
    for (i, c) in vm.irqchips.iter_mut().enumerate() {
        c.chip_id = i as u32;
    }
    let _ = state_check::vm(&vm);
});
