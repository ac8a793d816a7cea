//! The network process's own seccomp filter, on top of the jail's floor (which already kills
//! mounts, namespaces, ptrace, BPF, module and key calls, and identity changes), installed on
//! every thread once the stack runs: what a guest that took the process over would reach for
//! next. It may not start a program or another process (a thread only), change a file, open a
//! file or a socket, listen or connect: it works only on the descriptors it holds and the
//! connected sockets the service hands it (`crate::dial`). The one socket call it keeps is
//! `accept4`, on the listening socket the service passed it (`crate::adopt`): a guest that took
//! the process over could take connections on a socket it already holds, and open nothing by it.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

#[cfg(target_arch = "x86_64")]
const ARCH: TargetArch = TargetArch::x86_64;
#[cfg(target_arch = "aarch64")]
const ARCH: TargetArch = TargetArch::aarch64;

/// Why the filter could not be installed (the process then ends: fail closed).
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// Building it.
    #[error("building the network process's seccomp filter: {0}")]
    Build(String),
    /// Installing it.
    #[error("installing the network process's seccomp filter: {0}")]
    Apply(String),
}

/// The filter's programs: what kills the process, and what fails with an error.
fn programs() -> Result<Vec<BpfProgram>, seccompiler::BackendError> {
    let mut kill: BTreeMap<i64, Vec<SeccompRule>> = [
        libc::SYS_execve,
        libc::SYS_execveat,
        libc::SYS_unlinkat,
        libc::SYS_renameat2,
        libc::SYS_linkat,
        libc::SYS_symlinkat,
        libc::SYS_mkdirat,
        libc::SYS_mknodat,
        libc::SYS_fchmodat,
        libc::SYS_fchownat,
        libc::SYS_fchmod,
        libc::SYS_fchown,
        libc::SYS_truncate,
        libc::SYS_memfd_create,
        libc::SYS_utimensat,
        libc::SYS_setxattr,
        libc::SYS_lsetxattr,
        libc::SYS_fsetxattr,
        libc::SYS_removexattr,
        libc::SYS_lremovexattr,
        libc::SYS_fremovexattr,
        // fchmodat2 (Linux 6.6), by number: the same on both architectures.
        452,
    ]
    .into_iter()
    .map(|nr| (nr, vec![]))
    .collect();
    #[cfg(target_arch = "x86_64")]
    kill.extend(
        [
            libc::SYS_fork,
            libc::SYS_vfork,
            libc::SYS_unlink,
            libc::SYS_rename,
            libc::SYS_renameat,
            libc::SYS_link,
            libc::SYS_symlink,
            libc::SYS_mkdir,
            libc::SYS_rmdir,
            libc::SYS_mknod,
            libc::SYS_chmod,
            libc::SYS_chown,
            libc::SYS_lchown,
            libc::SYS_creat,
        ]
        .into_iter()
        .map(|nr| (nr, vec![])),
    );
    // A thread, never a process.
    kill.insert(
        libc::SYS_clone,
        vec![SeccompRule::new(vec![SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64),
            0,
        )?])?],
    );
    let kill = SeccompFilter::new(kill, SeccompAction::Allow, SeccompAction::KillProcess, ARCH)?;

    // It opens nothing: no file (what it reads, the TLS roots, it read before the filter), no
    // socket (its upstream connections come from the service, its channels were given to it),
    // and it neither listens nor connects. Each fails with EACCES, which its code reports as an
    // error of that one connection rather than dying mid-stream. `accept4` stays: a service that
    // came back connects to the process's adoption socket (`crate::adopt`; std accepts with it,
    // close-on-exec at once). The old `accept` is refused: nothing of the process calls it.
    let mut refuse: BTreeMap<i64, Vec<SeccompRule>> = [
        libc::SYS_openat,
        libc::SYS_openat2,
        libc::SYS_open_by_handle_at,
        libc::SYS_socket,
        libc::SYS_socketpair,
        libc::SYS_connect,
        libc::SYS_bind,
        libc::SYS_listen,
        libc::SYS_accept,
    ]
    .into_iter()
    .map(|nr| (nr, vec![]))
    .collect();
    #[cfg(target_arch = "x86_64")]
    refuse.insert(libc::SYS_open, vec![]);
    let refuse = SeccompFilter::new(
        refuse,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EACCES as u32),
        ARCH,
    )?;
    // `clone3`'s flags sit in memory a filter cannot read: it answers ENOSYS, and the C library
    // falls back to `clone`, whose flags the rule above reads (the jail's floor does the same).
    let clone3 = SeccompFilter::new(
        [(libc::SYS_clone3, vec![])].into_iter().collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        ARCH,
    )?;
    Ok([
        // x32's numbers match none of the rules below (the jail's floor kills them too, when it
        // is applied).
        #[cfg(target_arch = "x86_64")]
        sandbox_jail::filter::no_x32(),
        kill.try_into()?,
        refuse.try_into()?,
        clone3.try_into()?,
    ]
    .into())
}

/// How many programs [`seal`] installs: the service checks that a started process has at least
/// these (`Seccomp_filters` of its status; the jail's floor has fewer).
#[cfg(target_arch = "x86_64")]
pub const PROGRAMS: usize = 4;
/// How many programs [`seal`] installs.
#[cfg(target_arch = "aarch64")]
pub const PROGRAMS: usize = 3;

/// Installs the filter on every thread of the process.
pub fn seal() -> Result<(), SealError> {
    for p in programs().map_err(|e| SealError::Build(e.to_string()))? {
        seccompiler::apply_filter_all_threads(&p).map_err(|e| SealError::Apply(e.to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn it_has_the_programs_the_service_counts() {
        assert_eq!(super::programs().unwrap().len(), super::PROGRAMS);
    }
}
