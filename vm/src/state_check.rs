//! What a restore hands KVM, checked against what the architecture allows before any of it
//! reaches the kernel (issue 30). A state file is written by a VM process the guest may have
//! taken over, so each field KVM would take (segments and control registers, the XSAVE header,
//! debug registers, the local APIC, pending events, the PIC, the IOAPIC and the PIT) is held to
//! the values a real x86_64 processor and chipset can be in. KVM checks much of this itself;
//! these checks do not rely on every kernel's version of that.

use kvm_bindings::{
    KVM_MAX_XCRS, KVM_PIT_FLAGS_HPET_LEGACY, KVM_PIT_FLAGS_SPEAKER_DATA_ON,
    KVM_VCPUEVENT_VALID_NMI_PENDING, KVM_VCPUEVENT_VALID_PAYLOAD, KVM_VCPUEVENT_VALID_SHADOW,
    KVM_VCPUEVENT_VALID_SIPI_VECTOR, KVM_VCPUEVENT_VALID_SMM, KVM_VCPUEVENT_VALID_TRIPLE_FAULT,
    kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_pit_state2, kvm_segment, kvm_sregs,
    kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use thiserror::Error;

use crate::saved::{VcpuState, VmState};

/// A field of a saved state that no processor or chipset could be in.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("{what}: {why}")]
pub struct Refused {
    /// Which field.
    pub what: String,
    /// What is wrong with it.
    pub why: String,
}

fn refuse(what: impl Into<String>, why: impl Into<String>) -> Result<(), Refused> {
    Err(Refused {
        what: what.into(),
        why: why.into(),
    })
}

fn flag(what: &str, v: u8) -> Result<(), Refused> {
    if v > 1 {
        return refuse(what, format!("{v} for a flag"));
    }
    Ok(())
}

/// CR0 bits a processor has (PE, MP, EM, TS, ET, NE, WP, AM, NW, CD, PG).
const CR0_KNOWN: u64 = 0x8005_003f | (1 << 29) | (1 << 30);
const CR0_PE: u64 = 1;
const CR0_PG: u64 = 1 << 31;
/// CR4 bits a guest of ours may have: any but VMXE (13) and SMXE (14), which no guest is
/// offered (KVM holds the rest to the guest's CPUID; FRED is bit 32).
const CR4_ALLOWED: u64 = !((1 << 13) | (1 << 14));
const CR4_PAE: u64 = 1 << 5;
/// EFER: SCE, LME, LMA, NXE, LMSLE, FFXSR, TCE, AutoIBRS; no SVME (12): no guest is offered
/// SVM.
const EFER_ALLOWED: u64 =
    1 | (1 << 8) | (1 << 10) | (1 << 11) | (1 << 13) | (1 << 14) | (1 << 15) | (1 << 21);
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
/// IA32_APIC_BASE: BSP (8), x2APIC enable (10), global enable (11), the base's page.
const APIC_BASE_ALLOWED: u64 = (1 << 8) | (1 << 10) | (1 << 11) | 0x000f_ffff_ffff_f000;

fn segment(name: &str, s: &kvm_segment) -> Result<(), Refused> {
    let what = format!("segment {name}");
    if s.type_ > 15 {
        return refuse(&what, format!("type {}", s.type_));
    }
    if s.dpl > 3 {
        return refuse(&what, format!("privilege level {}", s.dpl));
    }
    for (f, v) in [
        ("present", s.present),
        ("db", s.db),
        ("s", s.s),
        ("l", s.l),
        ("g", s.g),
        ("avl", s.avl),
        ("unusable", s.unusable),
    ] {
        flag(&format!("{what}.{f}"), v)?;
    }
    if name == "cs" && s.unusable == 0 && s.l == 1 && s.db == 1 {
        return refuse(&what, "64-bit code with a 32-bit default size");
    }
    Ok(())
}

fn sregs(s: &kvm_sregs) -> Result<(), Refused> {
    for (name, seg) in [
        ("cs", &s.cs),
        ("ds", &s.ds),
        ("es", &s.es),
        ("fs", &s.fs),
        ("gs", &s.gs),
        ("ss", &s.ss),
        ("tr", &s.tr),
        ("ldt", &s.ldt),
    ] {
        segment(name, seg)?;
    }
    if s.cr0 & !CR0_KNOWN != 0 {
        return refuse("CR0", format!("reserved bits in {:#x}", s.cr0));
    }
    if s.cr0 & CR0_PG != 0 && s.cr0 & CR0_PE == 0 {
        return refuse("CR0", "paging without protected mode");
    }
    if s.cr4 & !CR4_ALLOWED != 0 {
        return refuse("CR4", format!("bits no guest is offered in {:#x}", s.cr4));
    }
    if s.cr8 > 15 {
        return refuse("CR8", format!("priority {}", s.cr8));
    }
    if s.efer & !EFER_ALLOWED != 0 {
        return refuse("EFER", format!("bits no guest is offered in {:#x}", s.efer));
    }
    let long = s.efer & EFER_LMA != 0;
    if long && (s.efer & EFER_LME == 0 || s.cr0 & CR0_PG == 0 || s.cr4 & CR4_PAE == 0) {
        return refuse("EFER", "long mode active without LME, paging and PAE");
    }
    if s.apic_base & !APIC_BASE_ALLOWED != 0 {
        return refuse("APIC base", format!("reserved bits in {:#x}", s.apic_base));
    }
    // At most one external interrupt is pending in KVM's bitmap.
    if s.interrupt_bitmap
        .iter()
        .map(|w| w.count_ones())
        .sum::<u32>()
        > 1
    {
        return refuse("pending interrupt", "more than one");
    }
    Ok(())
}

/// The XSAVE area's header: the standard (not compacted) format, the reserved bytes zero; MXCSR
/// without reserved bits. XSTATE_BV is left to KVM, which holds it to what the guest's CPUID
/// supports: it may hold state the guest's XCR0 never enabled (the host's PKRU, on hosts with
/// protection keys, for a guest kernel without them).
fn xsave(x: &kvm_xsave) -> Result<(), Refused> {
    let word = |i: usize| u64::from(x.region[i]) | (u64::from(x.region[i + 1]) << 32);
    let mxcsr = x.region[6];
    let mxcsr_mask = match x.region[7] {
        0 => 0xffbf,
        m => m,
    };
    if mxcsr & !mxcsr_mask != 0 {
        return refuse("XSAVE", format!("MXCSR {mxcsr:#x} has reserved bits"));
    }
    if word(130) != 0 {
        return refuse("XSAVE", "a compacted area where KVM takes the standard one");
    }
    if x.region[132..144].iter().any(|w| *w != 0) {
        return refuse("XSAVE", "reserved header bytes set");
    }
    Ok(())
}

/// XCR0 itself: x87 always, AVX only with SSE, nothing past what the guest's CPUID offers
/// (KVM checks that last part against the CPUID set before the restore).
fn xcrs(x: &kvm_xcrs) -> Result<(), Refused> {
    if x.nr_xcrs > KVM_MAX_XCRS || x.flags != 0 {
        refuse(
            "XCRs",
            format!("{} of them, flags {:#x}", x.nr_xcrs, x.flags),
        )?;
    }
    let mut xcr0 = 1;
    for r in &x.xcrs[..x.nr_xcrs as usize] {
        if r.xcr != 0 || r.reserved != 0 {
            refuse("XCRs", format!("XCR{} (only XCR0 exists)", r.xcr))?;
        }
        xcr0 = r.value;
    }
    if xcr0 & 1 == 0 || (xcr0 & 4 != 0 && xcr0 & 2 == 0) {
        refuse("XCR0", format!("{xcr0:#x}"))?;
    }
    Ok(())
}

fn debugregs(d: &kvm_debugregs) -> Result<(), Refused> {
    if d.flags != 0 || d.reserved.iter().any(|r| *r != 0) {
        return refuse("debug registers", "flags or reserved words set");
    }
    if d.dr6 >> 32 != 0 || d.dr7 >> 32 != 0 {
        return refuse("debug registers", "DR6 or DR7 past 32 bits");
    }
    Ok(())
}

/// The local APIC page: its id is the vCPU's, and no local interrupt is set to a vector below
/// 16 (reserved for exceptions) while unmasked.
fn lapic(id: usize, l: &kvm_lapic_state) -> Result<(), Refused> {
    let reg = |off: usize| {
        u32::from_le_bytes([
            l.regs[off] as u8,
            l.regs[off + 1] as u8,
            l.regs[off + 2] as u8,
            l.regs[off + 3] as u8,
        ])
    };
    let apic_id = reg(0x20) >> 24;
    if apic_id as usize != id {
        return refuse("local APIC", format!("id {apic_id} on vCPU {id}"));
    }
    // LVT timer, thermal, performance, LINT0, LINT1, error: unmasked fixed delivery needs a
    // vector of 16 or more.
    for off in [0x320, 0x330, 0x340, 0x350, 0x360, 0x370] {
        let lvt = reg(off);
        let masked = lvt & (1 << 16) != 0;
        let fixed = (lvt >> 8) & 7 == 0;
        if !masked && fixed && lvt & 0xff < 16 {
            return refuse(
                "local APIC",
                format!("LVT {off:#x} delivers vector {}", lvt & 0xff),
            );
        }
    }
    Ok(())
}

fn events(e: &kvm_vcpu_events) -> Result<(), Refused> {
    let known = KVM_VCPUEVENT_VALID_NMI_PENDING
        | KVM_VCPUEVENT_VALID_SIPI_VECTOR
        | KVM_VCPUEVENT_VALID_SHADOW
        | KVM_VCPUEVENT_VALID_SMM
        | KVM_VCPUEVENT_VALID_PAYLOAD
        | KVM_VCPUEVENT_VALID_TRIPLE_FAULT;
    if e.flags & !known != 0 {
        return refuse("events", format!("flags {:#x}", e.flags));
    }
    for (f, v) in [
        ("exception.injected", e.exception.injected),
        ("exception.pending", e.exception.pending),
        ("exception.has_error_code", e.exception.has_error_code),
        ("interrupt.injected", e.interrupt.injected),
        ("interrupt.soft", e.interrupt.soft),
        ("nmi.injected", e.nmi.injected),
        ("nmi.masked", e.nmi.masked),
        ("triple_fault.pending", e.triple_fault.pending),
        ("exception_has_payload", e.exception_has_payload),
    ] {
        flag(&format!("events {f}"), v)?;
    }
    // KVM keeps up to two NMIs pending (one being delivered, one latched).
    if e.nmi.pending > 2 {
        return refuse("events", format!("{} pending NMIs", e.nmi.pending));
    }
    if (e.exception.injected == 1 || e.exception.pending == 1) && e.exception.nr >= 32 {
        return refuse("events", format!("exception {}", e.exception.nr));
    }
    if e.interrupt.injected == 1 && e.interrupt.soft == 0 && e.interrupt.nr < 16 {
        return refuse(
            "events",
            format!("external interrupt vector {}", e.interrupt.nr),
        );
    }
    if e.sipi_vector > 0xff {
        return refuse("events", format!("SIPI vector {}", e.sipi_vector));
    }
    // No guest has System Management Mode.
    if e.smi.smm != 0 || e.smi.pending != 0 || e.smi.smm_inside_nmi != 0 {
        return refuse("events", "System Management Mode");
    }
    Ok(())
}

/// One vCPU's state.
pub fn vcpu(id: usize, s: &VcpuState) -> Result<(), Refused> {
    let at = |r: Refused| Refused {
        what: format!("vCPU {id}: {}", r.what),
        why: r.why,
    };
    sregs(&s.sregs).map_err(at)?;
    xcrs(&s.xcrs).map_err(at)?;
    xsave(&s.xsave).map_err(at)?;
    debugregs(&s.debugregs).map_err(at)?;
    lapic(id, &s.lapic).map_err(at)?;
    events(&s.events).map_err(at)
}

fn pic(name: &str, c: &kvm_irqchip) -> Result<(), Refused> {
    // SAFETY: the chip id says which member of the union KVM filled (checked by the caller).
    let p = unsafe { c.chip.pic };
    for (f, v) in [
        ("read_reg_select", p.read_reg_select),
        ("poll", p.poll),
        ("special_mask", p.special_mask),
        ("auto_eoi", p.auto_eoi),
        ("rotate_on_auto_eoi", p.rotate_on_auto_eoi),
        ("special_fully_nested_mode", p.special_fully_nested_mode),
        ("init4", p.init4),
    ] {
        flag(&format!("{name} {f}"), v)?;
    }
    if p.init_state > 3 {
        return refuse(name, format!("initialisation step {}", p.init_state));
    }
    if p.priority_add > 7 || p.irq_base & 7 != 0 {
        return refuse(
            name,
            format!("priority {} or base vector {}", p.priority_add, p.irq_base),
        );
    }
    Ok(())
}

fn ioapic(c: &kvm_irqchip) -> Result<(), Refused> {
    // SAFETY: as in `pic`.
    let io = unsafe { c.chip.ioapic };
    if io.base_address != 0xfec0_0000 {
        return refuse("IOAPIC", format!("at {:#x}", io.base_address));
    }
    if io.ioregsel > 0xff {
        return refuse("IOAPIC", format!("register select {}", io.ioregsel));
    }
    for (pin, entry) in io.redirtbl.iter().enumerate() {
        // SAFETY: both members of the union are plain integers over the same 8 bytes.
        let bits = unsafe { entry.bits };
        let (vector, mode, masked) = (bits & 0xff, (bits >> 8) & 7, bits & (1 << 16) != 0);
        // Delivery modes 3 and 6 are reserved; fixed and lowest-priority need a vector of 16
        // or more.
        if !masked && (mode == 3 || mode == 6 || (mode <= 1 && vector < 16)) {
            return refuse("IOAPIC", format!("pin {pin}: mode {mode}, vector {vector}"));
        }
    }
    Ok(())
}

fn pit(p: &kvm_pit_state2) -> Result<(), Refused> {
    if p.flags & !(KVM_PIT_FLAGS_HPET_LEGACY | KVM_PIT_FLAGS_SPEAKER_DATA_ON) != 0 {
        return refuse("PIT", format!("flags {:#x}", p.flags));
    }
    for (i, c) in p.channels.iter().enumerate() {
        let what = format!("PIT channel {i}");
        if c.count > 0x1_0000 {
            return refuse(&what, format!("count {}", c.count));
        }
        // Modes 0 to 5 as programmed (KVM folds 6 and 7 onto 2 and 3), or 0xff: a channel no
        // one programmed since the reset.
        if (c.mode > 5 && c.mode != 0xff) || c.rw_mode > 3 || c.read_state > 4 || c.write_state > 4
        {
            return refuse(
                &what,
                format!(
                    "mode {}, access {}, read step {}, write step {}",
                    c.mode, c.rw_mode, c.read_state, c.write_state
                ),
            );
        }
        for (f, v) in [("bcd", c.bcd), ("gate", c.gate)] {
            flag(&format!("{what} {f}"), v)?;
        }
        if c.count_latched > 3 || c.status_latched > 1 {
            return refuse(&what, "latch state");
        }
    }
    Ok(())
}

/// The VM's in-kernel devices: the two PICs and the IOAPIC, in their order, and the PIT.
pub fn vm(s: &VmState) -> Result<(), Refused> {
    use kvm_bindings::{KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE};
    if s.irqchips.len() != 3 {
        return refuse("irqchips", format!("{} of them", s.irqchips.len()));
    }
    for (c, want) in s.irqchips.iter().zip([
        KVM_IRQCHIP_PIC_MASTER,
        KVM_IRQCHIP_PIC_SLAVE,
        KVM_IRQCHIP_IOAPIC,
    ]) {
        if c.chip_id != want {
            return refuse(
                "irqchips",
                format!("chip {} where {want} belongs", c.chip_id),
            );
        }
    }
    pic("PIC master", &s.irqchips[0])?;
    pic("PIC slave", &s.irqchips[1])?;
    ioapic(&s.irqchips[2])?;
    pit(&s.pit)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state as a freshly booted 64-bit guest has it.
    fn sane_sregs() -> kvm_sregs {
        let code = kvm_segment {
            type_: 11,
            present: 1,
            s: 1,
            l: 1,
            g: 1,
            ..Default::default()
        };
        let data = kvm_segment {
            type_: 3,
            present: 1,
            s: 1,
            db: 1,
            g: 1,
            ..Default::default()
        };
        kvm_sregs {
            cs: code,
            ds: data,
            es: data,
            fs: data,
            gs: data,
            ss: data,
            tr: kvm_segment {
                type_: 11,
                present: 1,
                ..Default::default()
            },
            ldt: kvm_segment {
                type_: 2,
                unusable: 1,
                ..Default::default()
            },
            cr0: 0x8005_0033,
            cr4: 0x0036_06f0,
            efer: 0xd01,
            apic_base: 0xfee0_0900,
            ..Default::default()
        }
    }

    #[test]
    fn a_running_guests_control_registers_pass_and_forged_ones_do_not() {
        assert_eq!(sregs(&sane_sregs()), Ok(()));
        type Forge = fn(&mut kvm_sregs);
        let bad: [(&str, Forge); 9] = [
            ("VMXE", |s| s.cr4 |= 1 << 13),
            ("SVME", |s| s.efer |= 1 << 12),
            ("CR0 reserved", |s| s.cr0 |= 1 << 40),
            ("PG without PE", |s| s.cr0 &= !1),
            ("LMA without PAE", |s| s.cr4 &= !CR4_PAE),
            ("segment type", |s| s.cs.type_ = 16),
            ("privilege level", |s| s.ss.dpl = 4),
            ("L and D", |s| s.cs.db = 1),
            ("two pending interrupts", |s| s.interrupt_bitmap[0] = 3),
        ];
        for (what, f) in bad {
            let mut s = sane_sregs();
            f(&mut s);
            assert!(sregs(&s).is_err(), "{what} passed");
        }
    }

    fn sane_xsave() -> kvm_xsave {
        let mut x = kvm_xsave::default();
        x.region[6] = 0x1f80; // MXCSR's reset value
        x.region[128] = 0b11; // x87 and SSE
        x
    }

    #[test]
    fn the_xsave_header_is_held_to_xcr0() {
        let x = sane_xsave();
        assert_eq!(xsave(&x), Ok(()));
        // The host's PKRU in a guest whose XCR0 has no PKRU: KVM's to judge, not refused.
        let mut p = sane_xsave();
        p.region[128] |= 1 << 9;
        assert_eq!(xsave(&p), Ok(()));
        let mut c = sane_xsave();
        c.region[131] = 1 << 31; // XCOMP_BV's compacted bit
        assert!(xsave(&c).is_err());
        let mut r = sane_xsave();
        r.region[140] = 1;
        assert!(xsave(&r).is_err());
        let mut m = sane_xsave();
        m.region[6] = 1 << 20;
        assert!(xsave(&m).is_err(), "MXCSR reserved bits");
    }

    #[test]
    fn events_vectors_and_smm_are_checked() {
        let ok = kvm_vcpu_events::default();
        assert_eq!(events(&ok), Ok(()));
        let mut e = ok;
        e.exception.injected = 1;
        e.exception.nr = 40;
        assert!(events(&e).is_err());
        let mut e = ok;
        e.smi.smm = 1;
        assert!(events(&e).is_err());
        let mut e = ok;
        e.nmi.pending = 2;
        assert_eq!(events(&e), Ok(()), "KVM's two pending NMIs");
        e.nmi.pending = 3;
        assert!(events(&e).is_err());
        let mut e = ok;
        e.flags = 1 << 20;
        assert!(events(&e).is_err());
    }

    #[test]
    fn pit_counts_and_modes_are_what_an_8254_has() {
        let mut p = kvm_pit_state2::default();
        for c in &mut p.channels {
            c.count = 0x1_0000;
            c.rw_mode = 3;
            c.mode = 2;
        }
        assert_eq!(pit(&p), Ok(()));
        let mut q = p;
        q.channels[1].count = 0x1_0001;
        assert!(pit(&q).is_err());
        let mut q = p;
        q.channels[2].mode = 6;
        assert!(pit(&q).is_err());
        // KVM's reset state: a channel never programmed has mode 0xff.
        let mut q = p;
        q.channels[1].mode = 0xff;
        assert_eq!(pit(&q), Ok(()));
        let mut q = p;
        q.flags = 1 << 5;
        assert!(pit(&q).is_err());
    }

    #[test]
    fn a_lapic_with_another_vcpus_id_or_an_exception_vector_is_refused() {
        let mut l = kvm_lapic_state::default();
        for off in [0x320, 0x330, 0x340, 0x350, 0x360, 0x370] {
            l.regs[off + 2] = 1; // masked
        }
        l.regs[0x23] = 2; // APIC id 2
        assert_eq!(lapic(2, &l), Ok(()));
        assert!(lapic(0, &l).is_err());
        let mut u = l;
        u.regs[0x322] = 0; // the timer unmasked, vector 0
        assert!(lapic(2, &u).is_err());
    }

    #[test]
    fn the_ioapic_stays_where_it_is_and_delivers_no_exception_vector() {
        let mut c = kvm_irqchip {
            chip_id: kvm_bindings::KVM_IRQCHIP_IOAPIC,
            ..Default::default()
        };
        // SAFETY: writing the union's IOAPIC member of a zeroed chip.
        unsafe {
            c.chip.ioapic.base_address = 0xfec0_0000;
            for e in &mut c.chip.ioapic.redirtbl {
                e.bits = 1 << 16; // masked
            }
        }
        assert_eq!(ioapic(&c), Ok(()));
        let mut moved = c;
        moved.chip.ioapic.base_address = 0;
        assert!(ioapic(&moved).is_err());
        let mut low = c;
        // SAFETY: as above.
        unsafe { low.chip.ioapic.redirtbl[3].bits = 2 };
        assert!(ioapic(&low).is_err());
    }
}
