//! The Intel MultiProcessor table (MP spec 1.4): how a guest without ACPI learns its CPUs, its
//! IOAPIC and how the ISA interrupts are wired to it.
//!
//! Linux looks for the floating pointer in the last KiB of base memory (0x9fc00), which our e820
//! map reserves. Every interrupt line 0..23 goes to the IOAPIC pin of the same number, edge
//! triggered, active high (ISA's "conforms" polarity), which is what our devices' irqfds raise.

use thiserror::Error;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout;

/// The IOAPIC's MMIO address and its number of pins (KVM's in-kernel IOAPIC).
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
const IOAPIC_PINS: u8 = 24;
const LAPIC_ADDR: u32 = 0xfee0_0000;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;

/// The table could not be written.
#[derive(Debug, Error)]
pub enum MpTableError {
    /// More vCPUs than an MP table holds APIC ids for (the IOAPIC takes the id after them).
    #[error("{0} vCPUs do not fit in an MP table (at most 254)")]
    TooManyCpus(u8),
    /// Guest memory refused the write.
    #[error("writing the MP table: {0}")]
    Memory(String),
    /// The table does not fit in the reserved area.
    #[error("the MP table ({0} bytes) does not fit below 1 MiB")]
    TooBig(usize),
}

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// Builds the floating pointer and configuration table for `cpus` processors.
pub fn build(cpus: u8) -> Result<Vec<u8>, MpTableError> {
    if cpus == 0 || cpus > 254 {
        return Err(MpTableError::TooManyCpus(cpus));
    }
    let ioapic_id = cpus;
    let base = layout::EBDA_START as u32;
    let table_addr = base + 16;

    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for id in 0..cpus {
        let mut e = [0u8; 20];
        e[0] = 0; // processor
        e[1] = id;
        e[2] = APIC_VERSION;
        e[3] = 1 | if id == 0 { 2 } else { 0 }; // enabled, bootstrap processor
        e[4..8].copy_from_slice(&0x600u32.to_le_bytes()); // family 6 signature
        e[8..12].copy_from_slice(&0x201u32.to_le_bytes()); // FPU + APIC present
        entries.extend_from_slice(&e);
        count += 1;
    }
    entries.extend_from_slice(&[1, 0, b'I', b'S', b'A', b' ', b' ', b' ']); // bus 0: ISA
    count += 1;
    let mut io = [2u8, ioapic_id, IOAPIC_VERSION, 1, 0, 0, 0, 0];
    io[4..8].copy_from_slice(&IOAPIC_ADDR.to_le_bytes());
    entries.extend_from_slice(&io);
    count += 1;
    for irq in 0..IOAPIC_PINS {
        // I/O interrupt: INT, conforming polarity/trigger, from ISA bus irq to the same pin.
        entries.extend_from_slice(&[3, 0, 0, 0, 0, irq, ioapic_id, irq]);
        count += 1;
    }
    // Local interrupts: LINT0 is the 8259's ExtINT, LINT1 is NMI, on every local APIC.
    entries.extend_from_slice(&[4, 3, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, 1, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let mut header = [0u8; 44];
    header[0..4].copy_from_slice(b"PCMP");
    let table_len = (header.len() + entries.len()) as u16;
    header[4..6].copy_from_slice(&table_len.to_le_bytes());
    header[6] = 4; // spec revision 1.4
    header[8..16].copy_from_slice(b"SANDBOX ");
    header[16..28].copy_from_slice(b"SANDBOX-HOST");
    header[34..36].copy_from_slice(&count.to_le_bytes());
    header[36..40].copy_from_slice(&LAPIC_ADDR.to_le_bytes());
    let mut table = header.to_vec();
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut fp = [0u8; 16];
    fp[0..4].copy_from_slice(b"_MP_");
    fp[4..8].copy_from_slice(&table_addr.to_le_bytes());
    fp[8] = 1; // length in 16-byte units
    fp[9] = 4;
    fp[10] = checksum(&fp);

    let mut out = fp.to_vec();
    out.extend_from_slice(&table);
    if u64::from(base) + out.len() as u64 > layout::HIMEM_START.0 {
        return Err(MpTableError::TooBig(out.len()));
    }
    Ok(out)
}

/// Writes the table for `cpus` processors into guest memory.
pub fn write(mem: &GuestMemoryMmap, cpus: u8) -> Result<(), MpTableError> {
    let bytes = build(cpus)?;
    mem.write_slice(&bytes, GuestAddress(layout::EBDA_START))
        .map_err(|e| MpTableError::Memory(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_and_counts_hold() {
        for cpus in [1u8, 2, 64, 254] {
            let t = build(cpus).unwrap();
            assert_eq!(&t[0..4], b"_MP_");
            assert_eq!(t[..16].iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
            let table = &t[16..];
            assert_eq!(&table[0..4], b"PCMP");
            let len = u16::from_le_bytes([table[4], table[5]]) as usize;
            assert_eq!(len, table.len());
            assert_eq!(table.iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
            let count = u16::from_le_bytes([table[34], table[35]]);
            assert_eq!(count, u16::from(cpus) + 1 + 1 + 24 + 2);
        }
        assert!(build(0).is_err());
        assert!(build(255).is_err());
    }
}
