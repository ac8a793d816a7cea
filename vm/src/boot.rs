//! Loading the kernel (ELF `vmlinux`, PVH entry), the initramfs and the command line, and writing
//! the PVH start info with the memory map: everything the guest finds in memory at its first
//! instruction.

use std::io::Read;

use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{Cmdline, KernelLoader, load_cmdline};
use thiserror::Error;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout;
use crate::machine::config::FileRef;

/// The PVH start info magic.
const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;

/// Largest initramfs accepted (the stock one is a few MB; full images boot from disks).
const MAX_INITRD: u64 = 1 << 30;

/// Why the guest could not be put in memory.
#[derive(Debug, Error)]
pub enum LoadError {
    /// The kernel file could not be opened or read.
    #[error("cannot read the kernel {path}: {source}")]
    Kernel {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// linux-loader refused the kernel.
    #[error("cannot load the kernel: {0}")]
    Load(String),
    /// The kernel has no PVH entry note.
    #[error("the kernel has no PVH entry point (build it with CONFIG_PVH=y)")]
    NoPvh,
    /// The initramfs could not be read or does not fit.
    #[error("initramfs {path}: {why}")]
    Initrd {
        /// The file.
        path: String,
        /// Why.
        why: String,
    },
    /// The command line is too long or malformed.
    #[error("kernel command line: {0}")]
    Cmdline(String),
    /// The start info or memory map could not be written.
    #[error("writing the PVH start info: {0}")]
    StartInfo(String),
}

/// Loads everything and returns the PVH entry point.
pub fn load(
    mem: &GuestMemoryMmap,
    mem_bytes: u64,
    kernel: &FileRef,
    initrd: Option<&FileRef>,
    cmdline: &str,
) -> Result<GuestAddress, LoadError> {
    let mut f = kernel.open(false).map_err(|e| LoadError::Kernel {
        path: kernel.to_string(),
        source: e,
    })?;
    let loaded = Elf::load(mem, None, &mut f, Some(layout::HIMEM_START))
        .map_err(|e| LoadError::Load(e.to_string()))?;
    let PvhBootCapability::PvhEntryPresent(entry) = loaded.pvh_boot_cap else {
        return Err(LoadError::NoPvh);
    };

    let mut cl =
        Cmdline::new(layout::CMDLINE_MAX).map_err(|e| LoadError::Cmdline(e.to_string()))?;
    cl.insert_str(cmdline)
        .map_err(|e| LoadError::Cmdline(e.to_string()))?;
    load_cmdline(mem, layout::CMDLINE, &cl).map_err(|e| LoadError::Cmdline(e.to_string()))?;

    let mut start = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: layout::CMDLINE.0,
        memmap_paddr: layout::MEMMAP.0,
        ..Default::default()
    };
    let memmap: Vec<hvm_memmap_table_entry> = layout::e820(mem_bytes)
        .into_iter()
        .map(|(addr, size, type_)| hvm_memmap_table_entry {
            addr,
            size,
            type_,
            reserved: 0,
        })
        .collect();
    start.memmap_entries = memmap.len() as u32;

    let mut module = None;
    if let Some(path) = initrd {
        let bad = |why: String| LoadError::Initrd {
            path: path.to_string(),
            why,
        };
        let mut file = path.open(false).map_err(|e| bad(e.to_string()))?;
        let size = file.metadata().map_err(|e| bad(e.to_string()))?.len();
        if size > MAX_INITRD {
            return Err(bad(format!(
                "{size} bytes is more than the {MAX_INITRD}-byte limit"
            )));
        }
        let addr = layout::initrd_address(mem_bytes, size, loaded.kernel_end)
            .ok_or_else(|| bad(format!("{size} bytes do not fit below the MMIO hole above the kernel; give the guest more memory")))?;
        let mut data = Vec::with_capacity(size as usize);
        std::io::Read::take(&mut file, size)
            .read_to_end(&mut data)
            .map_err(|e| bad(e.to_string()))?;
        mem.write_slice(&data, addr)
            .map_err(|e| bad(e.to_string()))?;
        module = Some(hvm_modlist_entry {
            paddr: addr.0,
            size,
            ..Default::default()
        });
        start.nr_modules = 1;
        start.modlist_paddr = layout::MODLIST.0;
    }

    let mut params = BootParams::new::<hvm_start_info>(&start, layout::START_INFO);
    params.set_sections::<hvm_memmap_table_entry>(&memmap, layout::MEMMAP);
    if let Some(m) = module {
        params.set_modules::<hvm_modlist_entry>(&[m], layout::MODLIST);
    }
    PvhBootConfigurator::write_bootparams::<GuestMemoryMmap>(&params, mem)
        .map_err(|e| LoadError::StartInfo(e.to_string()))?;
    Ok(entry)
}
