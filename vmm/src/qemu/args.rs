//! The QEMU command line, as a pure function of the VM spec, so every argument set (x86_64
//! `microvm`, aarch64 `virt`, each accelerator) is unit-tested without running QEMU.

use std::ffi::OsString;
use std::path::PathBuf;

use sandbox_protocol::{MARKER_PORT_NAME, SERIAL_PORT_NAME};

use crate::backend::VmSpec;

pub use crate::arch::Arch;

/// QEMU accelerator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Linux hardware virtualisation.
    Kvm,
    /// macOS hardware virtualisation.
    Hvf,
    /// Software emulation.
    Tcg,
}

impl Accel {
    /// The name QEMU (and the API) uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Hvf => "hvf",
            Accel::Tcg => "tcg",
        }
    }
}

/// Kernel command line shared by both architectures: console, no reboot loop (`reboot=t` with
/// `-no-reboot` makes a guest restart end QEMU), panic ends the VM at once, and what the guest's
/// init and agent read.
pub fn kernel_cmdline(arch: Arch, spec: &VmSpec) -> String {
    let console = match arch {
        // `no_timer_check`: under TCG on a loaded host the kernel's check that the timer reaches
        // the IO-APIC can miss its window and panic the boot ("IO-APIC + timer doesn't work!",
        // 9 of 620 boots in the load test, 20 TCG guests on 2 cores; 0 of 200 with it).
        Arch::X86_64 => {
            "console=ttyS0 reboot=t i8042.noaux i8042.nomux i8042.dumbkbd no_timer_check"
        }
        Arch::Aarch64 => "console=ttyAMA0",
    };
    let mut words = vec![
        console.to_string(),
        "panic=-1".into(),
        "quiet".into(),
        format!("sandbox.memory_mib={}", spec.memory_mib),
        format!("sandbox.channel=serial:{SERIAL_PORT_NAME}"),
    ];
    words.extend(spec.cmdline.iter().cloned());
    words.join(" ")
}

/// How QEMU reaches what the host gives it. Every socket and disk is a descriptor QEMU inherits,
/// so in its jail it opens nothing by path but its kernel and initramfs, at their jail paths.
#[derive(Debug, Clone)]
pub struct Wiring {
    /// The kernel, as QEMU sees it.
    pub kernel: PathBuf,
    /// The initramfs, as QEMU sees it.
    pub initrd: Option<PathBuf>,
    /// A connected stream socket: the agent channel.
    pub agent_fd: i32,
    /// Whether `agent_fd` is a listening socket (a VM that may outlive the service: the next
    /// run of the service connects to it again) rather than a connected one.
    pub agent_listens: bool,
    /// A connected stream socket for the boot marker.
    pub marker_fd: Option<i32>,
    /// A connected stream socket for the guest's frames.
    pub net_fd: Option<i32>,
    /// Per disk of the spec, its descriptors: one read-only, and one read-write for a writable
    /// disk (QEMU opens a writable disk both ways).
    pub disk_fds: Vec<Vec<i32>>,
    /// A connected stream socket for QEMU's monitor (QMP): only a VM that may be snapshotted
    /// has one.
    pub qmp_fd: Option<i32>,
    /// A snapshot's memory file, open for reading: the VM starts from it instead of booting.
    pub restore_fd: Option<i32>,
    /// `/dev/kvm`, opened by the service: QEMU in its jail needs neither the device node nor
    /// the `kvm` group, so it keeps no group of the service's.
    pub kvm_fd: Option<i32>,
}

/// The fd set a snapshot's memory file is added to (by QMP's `add-fd`, when the snapshot is
/// taken): the snapshot is a migration to `file:/dev/fdset/N`. Emptied after each one, so the
/// next snapshot's file is the only one in it.
pub const SNAPSHOT_FDSET: u32 = 1000;
/// The fd set of [`Wiring::restore_fd`].
pub const RESTORE_FDSET: u32 = 1001;
/// The fd set of [`Wiring::kvm_fd`]: KVM's device is `/dev/fdset/N`.
pub const KVM_FDSET: u32 = 1002;

/// QEMU's own seccomp filter with every optional part set to deny: no obsolete system calls, no
/// privilege changes, no new processes or programs, no scheduling or resource changes.
pub const SANDBOX: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// The full argument list (program not included).
pub fn qemu_args(arch: Arch, accel: Accel, spec: &VmSpec, wiring: &Wiring) -> Vec<OsString> {
    let mut a = machine_args(arch, accel, spec, wiring);
    a.extend(kernel_args(arch, spec, wiring));
    a.extend(channel_args(arch, wiring));
    a.extend(disk_args(spec, wiring));
    a.extend(net_args(spec, wiring));
    a.extend(snapshot_args(wiring));
    a
}

/// The machine, its accelerator and processor, its size, and what QEMU leaves out or denies.
fn machine_args(arch: Arch, accel: Accel, spec: &VmSpec, wiring: &Wiring) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    let mut push = |s: &str| a.push(s.into());
    match arch {
        Arch::X86_64 => {
            // microvm: virtio-mmio only, no PCI, no ACPI (our kernel has none, and without ACPI
            // QEMU lists the virtio-mmio devices on the kernel command line).
            let mut machine = "microvm,acpi=off,isa-serial=on,rtc=off,x-option-roms=on".to_string();
            if accel == Accel::Kvm {
                // With KVM's in-kernel irqchip the legacy PIT/PIC are not needed.
                machine.push_str(",pit=off,pic=off");
            }
            push("-M");
            push(&machine);
        }
        Arch::Aarch64 => {
            // virt: virtio-mmio slots described by the device tree, a PL011 console, a PL031
            // clock, PSCI. GICv3 (the kernel's driver); with KVM, the best the host's GIC gives.
            push("-M");
            push(if accel == Accel::Kvm {
                "virt,highmem=on,gic-version=max,virtualization=off"
            } else {
                "virt,highmem=on,gic-version=3,virtualization=off"
            });
        }
    }
    match (accel, wiring.kvm_fd) {
        (Accel::Kvm, Some(fd)) => {
            push("-add-fd");
            push(&format!("fd={fd},set={KVM_FDSET}"));
            push("-accel");
            push(&format!("kvm,device=/dev/fdset/{KVM_FDSET}"));
        }
        _ => {
            push("-accel");
            push(accel.as_str());
        }
    }
    push("-cpu");
    push(match (arch, accel) {
        // QEMU's own pointer-authentication algorithm instead of the architected QARMA5, which
        // costs TCG several times more per signed return.
        (Arch::Aarch64, Accel::Tcg) => "max,pauth-impdef=on",
        (Arch::Aarch64, _) => "host",
        // No VMX or SVM: a guest never reaches the nested virtualisation of QEMU or of the
        // host's kernel (docs/threat-model.md, "CPUID").
        (_, Accel::Tcg) => "max,-vmx,-svm",
        _ => "host,-vmx,-svm",
    });
    push("-m");
    push(&spec.memory_mib.to_string());
    push("-smp");
    push(&spec.vcpus.to_string());
    for s in [
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-serial",
        "stdio",
    ] {
        push(s);
    }
    if cfg!(target_os = "linux") {
        push("-sandbox");
        push(SANDBOX);
    }
    a
}

/// The kernel, its initramfs and its command line, at their paths in QEMU's jail.
fn kernel_args(arch: Arch, spec: &VmSpec, wiring: &Wiring) -> Vec<OsString> {
    let mut a: Vec<OsString> = vec!["-kernel".into(), wiring.kernel.clone().into()];
    if let Some(initrd) = &wiring.initrd {
        a.push("-initrd".into());
        a.push(initrd.clone().into());
    }
    a.push("-append".into());
    a.push(kernel_cmdline(arch, spec).into());
    a
}

/// The agent channel, the guest's entropy, and the boot marker.
fn channel_args(arch: Arch, wiring: &Wiring) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    // The agent channel: a socket QEMU inherits, connected to the host before QEMU starts.
    a.extend([
        "-chardev".into(),
        if wiring.agent_listens {
            format!("socket,id=agent,fd={},server=on,wait=off", wiring.agent_fd)
        } else {
            format!("socket,id=agent,fd={}", wiring.agent_fd)
        }
        .into(),
    ]);
    for s in ["-device", "virtio-serial-device", "-device"] {
        a.push(s.into());
    }
    a.push(format!("virtserialport,chardev=agent,name={SERIAL_PORT_NAME}").into());
    // Entropy for getrandom() early in the guest (Node.js and Python ask for it at start).
    a.extend(["-device".into(), "virtio-rng-device".into()]);
    // The boot marker: the agent's first write as PID 1, which QEMU passes to a socket of the
    // host's, where the host times it. An I/O port (QEMU's debug console) on x86_64, as our KVM
    // backend decodes it; a second port of the virtio-serial device on aarch64, which has none.
    if let Some(fd) = wiring.marker_fd {
        a.extend([
            "-chardev".into(),
            format!("socket,id=marker,fd={fd}").into(),
            "-device".into(),
        ]);
        a.push(match arch {
            Arch::X86_64 => format!(
                "isa-debugcon,iobase={:#x},chardev=marker",
                sandbox_protocol::boot_marker::PORT
            )
            .into(),
            Arch::Aarch64 => {
                format!("virtserialport,chardev=marker,name={MARKER_PORT_NAME}").into()
            }
        });
    }
    a
}

/// The disks, each from its inherited descriptors.
fn disk_args(spec: &VmSpec, wiring: &Wiring) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    for (i, (disk, fds)) in spec.disks.iter().zip(&wiring.disk_fds).enumerate() {
        // The disk is a QEMU fd set of inherited descriptors; format=raw always: a
        // guest-written image must never be probed for a format. No image locking: each VM
        // has its own sandbox disk from the service, and QEMU's locks between its own two
        // descriptors of one disk refuse the `cont` that lets a fork's parent run on after its
        // migration ("Failed to get write lock").
        for fd in fds {
            a.extend(["-add-fd".into(), format!("fd={fd},set={}", i + 1).into()]);
        }
        a.extend([
            "-drive".into(),
            format!(
                "file=/dev/fdset/{},file.locking=off,if=none,id=disk{i},format=raw,readonly={}",
                i + 1,
                if disk.read_only { "on" } else { "off" }
            )
            .into(),
        ]);
        a.extend([
            "-device".into(),
            format!("virtio-blk-device,drive=disk{i},serial=disk{i}").into(),
        ]);
    }
    a
}

/// The network device, when the guest has one.
fn net_args(spec: &VmSpec, wiring: &Wiring) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    // The network: frames as a 4-byte big-endian length and the frame (`-netdev stream`) on an
    // inherited socket, with no offloads (the guest computes checksums).
    if let (Some(net), Some(fd)) = (&spec.net, wiring.net_fd) {
        a.extend([
            "-netdev".into(),
            format!("stream,id=net0,server=off,addr.type=fd,addr.str={fd}").into(),
            "-device".into(),
        ]);
        a.push(
            format!(
                "virtio-net-device,netdev=net0,mac={}",
                sandbox_control::link::format_mac(net.mac)
            )
            .into(),
        );
    }
    a
}

/// QEMU's monitor, and the snapshot a VM is restored from.
fn snapshot_args(wiring: &Wiring) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    // Snapshots: QEMU's migration to a file, through descriptors (its jail has no path to
    // write), and its monitor to start one. A VM restored from one starts with the machine
    // state in the file instead of booting its kernel.
    if let Some(fd) = wiring.qmp_fd {
        a.extend([
            "-chardev".into(),
            format!("socket,id=qmp,fd={fd}").into(),
            "-mon".into(),
            "chardev=qmp,mode=control".into(),
        ]);
    }
    if let Some(fd) = wiring.restore_fd {
        a.extend([
            "-add-fd".into(),
            format!("fd={fd},set={RESTORE_FDSET}").into(),
            "-incoming".into(),
            format!("file:/dev/fdset/{RESTORE_FDSET}").into(),
        ]);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Disk;
    use std::path::PathBuf;

    fn spec() -> VmSpec {
        VmSpec {
            id: "t".into(),
            memory_mib: 4096,
            vcpus: 2,
            kernel: "/img/vmlinux".into(),
            initrd: Some("/img/initramfs.cpio".into()),
            disks: vec![Disk {
                path: PathBuf::from("/d/base,1.ext4"),
                read_only: true,
            }],
            scratch_disk_mib: None,
            cmdline: vec!["extra=1".into()],
            state_dir: "/s".into(),
            net: None,
            start_timeout: None,
            snapshot_to: None,
            restore_from: None,
            outlive: false,
        }
    }

    fn wiring() -> Wiring {
        Wiring {
            kernel: "/vm/kernel".into(),
            initrd: Some("/vm/initrd".into()),
            agent_fd: 3,
            agent_listens: false,
            marker_fd: Some(4),
            net_fd: Some(5),
            disk_fds: vec![vec![6]],
            qmp_fd: None,
            restore_fd: None,
            kvm_fd: None,
        }
    }

    #[test]
    fn kvm_comes_as_a_descriptor_the_service_opened() {
        let w = Wiring {
            kvm_fd: Some(7),
            ..wiring()
        };
        for arch in [Arch::X86_64, Arch::Aarch64] {
            let s = qemu_args(arch, Accel::Kvm, &spec(), &w)
                .iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(" ");
            assert!(
                s.contains("-add-fd fd=7,set=1002 -accel kvm,device=/dev/fdset/1002 -cpu host"),
                "{s}"
            );
        }
        // Not for TCG, which has no device.
        let s = qemu_args(Arch::X86_64, Accel::Tcg, &spec(), &w)
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ");
        assert!(s.contains("-accel tcg") && !s.contains("set=1002"), "{s}");
    }

    #[test]
    fn snapshots_go_through_inherited_descriptors() {
        let s = joined(Arch::X86_64, Accel::Tcg);
        assert!(!s.contains("qmp") && !s.contains("-incoming") && !s.contains("set=1000"));
        let w = Wiring {
            qmp_fd: Some(7),
            restore_fd: Some(9),
            ..wiring()
        };
        let s = qemu_args(Arch::X86_64, Accel::Tcg, &spec(), &w)
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            s.contains("-chardev socket,id=qmp,fd=7 -mon chardev=qmp,mode=control -add-fd fd=9,set=1001 -incoming file:/dev/fdset/1001"),
            "{s}"
        );
        // The snapshot's own file is no argument: it comes over the monitor with the snapshot.
        assert!(!s.contains("set=1000"), "{s}");
    }

    fn joined(arch: Arch, accel: Accel) -> String {
        qemu_args(arch, accel, &spec(), &wiring())
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn x86_64_tcg_microvm() {
        let s = joined(Arch::X86_64, Accel::Tcg);
        assert!(s.starts_with("-M microvm,acpi=off,isa-serial=on,rtc=off,x-option-roms=on -accel tcg -cpu max,-vmx,-svm -m 4096 -smp 2 "), "{s}");
        assert!(!s.contains("pit=off"));
        assert!(s.contains("-kernel /vm/kernel -initrd /vm/initrd -append console=ttyS0 reboot=t"));
        assert!(s.contains("sandbox.memory_mib=4096 sandbox.channel=serial:sandbox.agent extra=1"));
        assert!(s.contains("-chardev socket,id=agent,fd=3 -device virtio-serial-device -device virtserialport,chardev=agent,name=sandbox.agent"));
        assert!(s.contains("-add-fd fd=6,set=1 -drive file=/dev/fdset/1,file.locking=off,if=none,id=disk0,format=raw,readonly=on -device virtio-blk-device,drive=disk0,serial=disk0"));
        assert!(s.contains(
            "-chardev socket,id=marker,fd=4 -device isa-debugcon,iobase=0x440,chardev=marker"
        ));
        assert!(s.contains(
            "-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
        ));
        assert!(s.contains("-no-reboot") && s.contains("-nodefaults"));
    }

    #[test]
    fn network_is_a_stream_netdev_to_the_hosts_socket() {
        struct NoLink;
        impl sandbox_control::link::FrameLink for NoLink {
            fn send(&self, _: &[u8]) -> bool {
                false
            }
            fn recv(&self, _: &mut [u8]) -> Option<usize> {
                None
            }
            fn set_waker(&self, _: Box<dyn Fn() + Send + Sync>) {}
        }
        let mut spec = spec();
        assert!(!joined(Arch::X86_64, Accel::Tcg).contains("netdev"));
        spec.net = Some(sandbox_control::link::NetAttachment {
            mac: [0x02, 0x53, 0x42, 0xab, 0x0c, 0x01],
            link: sandbox_control::link::NetLink::Frames(std::sync::Arc::new(NoLink)),
        });
        let s = qemu_args(Arch::X86_64, Accel::Tcg, &spec, &wiring())
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            s.contains("-netdev stream,id=net0,server=off,addr.type=fd,addr.str=5 -device virtio-net-device,netdev=net0,mac=02:53:42:ab:0c:01"),
            "{s}"
        );
    }

    #[test]
    fn x86_64_kvm_drops_legacy_timers() {
        let s = joined(Arch::X86_64, Accel::Kvm);
        assert!(
            s.contains("pit=off,pic=off -accel kvm -cpu host,-vmx,-svm"),
            "{s}"
        );
    }

    #[test]
    fn aarch64_hvf_virt() {
        let s = joined(Arch::Aarch64, Accel::Hvf);
        assert!(
            s.starts_with("-M virt,highmem=on,gic-version=3,virtualization=off -accel hvf -cpu host -m 4096 -smp 2"),
            "{s}"
        );
        assert!(s.contains("-append console=ttyAMA0 panic=-1"));
        assert!(!s.contains("microvm") && !s.contains("ttyS0") && !s.contains("debugcon"));
        assert!(s.contains(
            "-chardev socket,id=marker,fd=4 -device virtserialport,chardev=marker,name=sandbox.marker"
        ));
        assert!(s.contains("virtio-serial-device") && s.contains("virtio-blk-device,drive=disk0"));
        assert_eq!(Arch::Aarch64.qemu_program(), "qemu-system-aarch64");
    }

    #[test]
    fn aarch64_tcg_and_kvm_virt() {
        let s = joined(Arch::Aarch64, Accel::Tcg);
        assert!(
            s.starts_with(
                "-M virt,highmem=on,gic-version=3,virtualization=off -accel tcg -cpu max,pauth-impdef=on -m 4096"
            ),
            "{s}"
        );
        let s = joined(Arch::Aarch64, Accel::Kvm);
        assert!(
            s.starts_with(
                "-M virt,highmem=on,gic-version=max,virtualization=off -accel kvm -cpu host"
            ),
            "{s}"
        );
        assert!(!s.contains("isa-debugcon"));
    }
}
