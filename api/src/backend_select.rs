//! Picking the VMM backend: see `sandbox_vmm::select`.

pub use sandbox_vmm::select::select;
