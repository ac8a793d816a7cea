//! The seccomp filter every jailed program gets before its first instruction, whatever it is.
//!
//! For a program we do not write (QEMU) an allow-list would break with each release, so this is
//! the floor under QEMU's own `-sandbox`: the system calls no VMM needs and that an escaped guest
//! would use to leave the jail or attack the kernel (namespaces, mounts, tracing, modules, BPF,
//! keys, credentials) kill the process. Our own VM process adds deny-by-default filters per
//! thread on top (the kernel applies the strictest answer of all filters).

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

#[cfg(target_arch = "x86_64")]
const ARCH: TargetArch = TargetArch::x86_64;
#[cfg(target_arch = "aarch64")]
const ARCH: TargetArch = TargetArch::aarch64;

/// System calls that kill a jailed process.
pub fn denied() -> Vec<i64> {
    let mut v = vec![
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_pidfd_getfd,
        libc::SYS_kcmp,
        libc::SYS_kexec_load,
        libc::SYS_kexec_file_load,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_userfaultfd,
        libc::SYS_open_by_handle_at,
        libc::SYS_name_to_handle_at,
        libc::SYS_fsopen,
        libc::SYS_fsmount,
        libc::SYS_fsconfig,
        libc::SYS_fspick,
        libc::SYS_move_mount,
        libc::SYS_open_tree,
        libc::SYS_mount_setattr,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_reboot,
        libc::SYS_settimeofday,
        libc::SYS_clock_settime,
        libc::SYS_clock_adjtime,
        libc::SYS_adjtimex,
        libc::SYS_acct,
        libc::SYS_quotactl,
        libc::SYS_syslog,
        libc::SYS_vhangup,
        libc::SYS_setuid,
        libc::SYS_setgid,
        libc::SYS_setreuid,
        libc::SYS_setregid,
        libc::SYS_setresuid,
        libc::SYS_setresgid,
        libc::SYS_setgroups,
        libc::SYS_setfsuid,
        libc::SYS_setfsgid,
        libc::SYS_capset,
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([libc::SYS_iopl, libc::SYS_ioperm, libc::SYS_uselib]);
    v
}

/// Namespace flags of `clone`: a jailed process may make threads and processes, never new
/// namespaces (a nested user namespace would hand it capabilities again).
const CLONE_NAMESPACES: [u64; 7] = [
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWCGROUP as u64,
];

/// x86_64's third ABI, x32, numbers its system calls with bit 30 set under the same audit
/// architecture, so they match no rule of a filter written for x86_64's numbers and would all
/// be allowed where the kernel has x32 on. This program, installed before the others, kills a
/// process that makes one (none of ours does).
#[cfg(target_arch = "x86_64")]
pub fn no_x32() -> BpfProgram {
    use seccompiler::sock_filter;
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    // BPF_LD | BPF_W | BPF_ABS, BPF_JMP | BPF_JGE | BPF_K, BPF_RET | BPF_K.
    let (load, jge, ret) = (0x20, 0x35, 0x06);
    vec![
        // The call's number: `seccomp_data.nr`, at offset 0.
        sock_filter {
            code: load,
            jt: 0,
            jf: 0,
            k: 0,
        },
        sock_filter {
            code: jge,
            jt: 0,
            jf: 1,
            k: X32_SYSCALL_BIT,
        },
        sock_filter {
            code: ret,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_KILL_PROCESS,
        },
        sock_filter {
            code: ret,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ALLOW,
        },
    ]
}

/// The filters, in the order they are installed: on x86_64 [`no_x32`], the kill list, then the calls that answer
/// `ENOSYS` so the C library falls back (`clone3`, whose flags a filter cannot read, to `clone`;
/// `io_uring`, a large kernel surface, to `epoll`).
pub fn programs() -> Result<Vec<BpfProgram>, seccompiler::BackendError> {
    let mut kill: BTreeMap<i64, Vec<SeccompRule>> =
        denied().into_iter().map(|nr| (nr, vec![])).collect();
    let clone_rules = CLONE_NAMESPACES
        .iter()
        .map(|&flag| {
            SeccompRule::new(vec![SeccompCondition::new(
                clone_flags_arg(),
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(flag),
                flag,
            )?])
        })
        .collect::<Result<Vec<_>, _>>()?;
    kill.insert(libc::SYS_clone, clone_rules);
    let kill = SeccompFilter::new(kill, SeccompAction::Allow, SeccompAction::KillProcess, ARCH)?;

    let enosys: BTreeMap<i64, Vec<SeccompRule>> = [
        libc::SYS_clone3,
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
    ]
    .into_iter()
    .map(|nr| (nr, vec![]))
    .collect();
    let enosys = SeccompFilter::new(
        enosys,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        ARCH,
    )?;
    Ok([
        #[cfg(target_arch = "x86_64")]
        no_x32(),
        kill.try_into()?,
        enosys.try_into()?,
    ]
    .into())
}

/// `clone`'s flags are its first argument on both architectures we build for.
fn clone_flags_arg() -> u8 {
    0
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_filters_compile() {
        let p = super::programs().unwrap();
        assert_eq!(p.len(), if cfg!(target_arch = "x86_64") { 3 } else { 2 });
        assert!(p.iter().all(|f| !f.is_empty() && f.len() < 4096));
    }
}
