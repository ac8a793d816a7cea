//! `sandbox-vm`: one KVM virtual machine, started by the sandbox host in a jail of its own (see
//! `sandbox_vmm::kvm::child`). Not meant to be run by hand.

fn main() {
    std::process::exit(sandbox_vmm::kvm::child::main());
}
