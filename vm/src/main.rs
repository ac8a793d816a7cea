//! `sandbox-vm`: one KVM virtual machine, started by the sandbox host in a jail of its own (see
//! `sandbox_vm::child`). Not meant to be run by hand.

#[cfg(target_os = "linux")]
fn main() {
    std::process::exit(sandbox_vm::program::main());
}

/// The KVM backend is Linux's: elsewhere the service runs VMs on QEMU and never starts this.
#[cfg(not(target_os = "linux"))]
fn main() {
    eprintln!("sandbox-vm: the KVM backend runs on Linux only; the sandbox host uses QEMU here");
    std::process::exit(2);
}
