//! Where things go in guest physical memory, as pure functions of the memory size.
//!
//! ```text
//! 0x0000_6000  PVH start info           0x0000_7000  memory map (e820 entries)
//! 0x0000_8000  module list (initrd)     0x0002_0000  kernel command line
//! 0x0010_0000  kernel (at its ELF physical addresses, from 1 MiB)
//! ..low end    initramfs, at the top of low memory, page-aligned
//! 0xC000_0000 .. 0x1_0000_0000  hole: virtio-mmio devices and the LAPIC/IOAPIC pages
//! 0x1_0000_0000 ..              the rest of RAM, for guests above 3 GiB
//! ```

use vm_memory::GuestAddress;

/// PVH `hvm_start_info`.
pub const START_INFO: GuestAddress = GuestAddress(0x6000);
/// PVH memory map.
pub const MEMMAP: GuestAddress = GuestAddress(0x7000);
/// PVH module list (the initramfs).
pub const MODLIST: GuestAddress = GuestAddress(0x8000);
/// Kernel command line.
pub const CMDLINE: GuestAddress = GuestAddress(0x2_0000);
/// Longest command line (the x86 kernel's COMMAND_LINE_SIZE).
pub const CMDLINE_MAX: usize = 2048;
/// Where the kernel may start loading (high memory).
pub const HIMEM_START: GuestAddress = GuestAddress(0x10_0000);
/// Start of the Extended BIOS Data Area, the end of low RAM below 1 MiB.
pub const EBDA_START: u64 = 0x9_fc00;
/// Start of the MMIO hole below 4 GiB.
pub const MMIO_HOLE_START: u64 = 0xc000_0000;
/// First address above the hole.
pub const HIGH_RAM_START: u64 = 0x1_0000_0000;
/// Where KVM's TSS goes (three pages, inside the hole, as Intel needs).
pub const KVM_TSS_ADDRESS: usize = 0xfffb_d000;

/// E820 type of usable RAM.
pub const E820_RAM: u32 = 1;
/// E820 type of reserved memory.
pub const E820_RESERVED: u32 = 2;

/// The RAM regions (start, length) for `mem_bytes` of guest memory.
pub fn ram_regions(mem_bytes: u64) -> Vec<(GuestAddress, u64)> {
    if mem_bytes <= MMIO_HOLE_START {
        vec![(GuestAddress(0), mem_bytes)]
    } else {
        vec![
            (GuestAddress(0), MMIO_HOLE_START),
            (GuestAddress(HIGH_RAM_START), mem_bytes - MMIO_HOLE_START),
        ]
    }
}

/// The e820 map the guest sees: (start, length, type).
pub fn e820(mem_bytes: u64) -> Vec<(u64, u64, u32)> {
    let mut map = vec![
        (0, EBDA_START, E820_RAM),
        (EBDA_START, HIMEM_START.0 - EBDA_START, E820_RESERVED),
    ];
    for (start, len) in ram_regions(mem_bytes) {
        let s = start.0.max(HIMEM_START.0);
        let end = start.0 + len;
        if end > s {
            map.push((s, end - s, E820_RAM));
        }
    }
    map
}

/// Where an initramfs of `size` bytes goes: the top of low RAM, page-aligned, above the kernel.
pub fn initrd_address(mem_bytes: u64, size: u64, kernel_end: u64) -> Option<GuestAddress> {
    let low_end = mem_bytes.min(MMIO_HOLE_START);
    let addr = low_end.checked_sub(size)? & !0xfff;
    (addr >= kernel_end).then_some(GuestAddress(addr))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_guest_is_one_region() {
        assert_eq!(ram_regions(512 << 20), vec![(GuestAddress(0), 512 << 20)]);
        let m = e820(512 << 20);
        assert_eq!(m[0], (0, EBDA_START, E820_RAM));
        assert_eq!(m[2], (0x10_0000, (512 << 20) - 0x10_0000, E820_RAM));
    }

    #[test]
    fn large_guest_skips_the_hole() {
        let r = ram_regions(4096 << 20);
        assert_eq!(
            r,
            vec![
                (GuestAddress(0), MMIO_HOLE_START),
                (GuestAddress(HIGH_RAM_START), 1 << 30)
            ]
        );
        assert_eq!(r.iter().map(|x| x.1).sum::<u64>(), 4096 << 20);
        let m = e820(4096 << 20);
        assert!(
            m.iter()
                .all(|(s, l, _)| s + l <= MMIO_HOLE_START || *s >= HIGH_RAM_START)
        );
    }

    #[test]
    fn initrd_goes_high_and_never_over_the_kernel() {
        let a = initrd_address(512 << 20, 4 << 20, 20 << 20).unwrap();
        assert_eq!(a.0, (508 << 20) & !0xfff);
        assert_eq!(
            initrd_address(4096 << 20, 4096, 0).unwrap().0,
            MMIO_HOLE_START - 4096
        );
        assert!(initrd_address(16 << 20, 8 << 20, 12 << 20).is_none());
        assert!(initrd_address(1 << 20, 2 << 20, 0).is_none());
    }
}
