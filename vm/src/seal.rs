//! The system call filters of the VM process, one per kind of thread, deny by default (issue 12):
//! each thread applies its own before it runs anything the guest can reach, so a vCPU thread
//! never enters `KVM_RUN` unfiltered, and what an escaped guest gets on a thread is that
//! thread's short list, on top of the jail's floor (`sandbox_jail::filter`; the kernel answers
//! with the strictest filter of all).
//!
//! A call outside its list raises `SIGSYS`; the handler writes the call's number and the
//! thread's kind to the VM's log and ends the process, so the sandbox is reported dead with a
//! reason an operator can act on, instead of an unexplained signal.
//!
//! The machine's threads call [`enter`] as they start; only the VM process is to install a
//! sealer ([`install`]), so the in-process machine of the benchmarks and tests runs unfiltered.
//!
//! `sandbox-vm` installs the sealer before it reads its configuration's files, and its main
//! thread enters once the machine runs (the control and boot-marker threads it then starts
//! inherit the main filter). The lists come from tracing each thread through the KVM end-to-end
//! suite in the nested test host (`tests/nested/syscalls/`).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
use thiserror::Error;

/// The kinds of thread of a VM process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadKind {
    /// The main thread and those it starts once the machine runs (control, boot marker,
    /// supervisor): the control channel, and tearing the machine down.
    Main,
    /// A vCPU: `KVM_RUN` and the exits it handles (MMIO, the serial port).
    Vcpu,
    /// The device thread and the network link's threads: the virtio queues, the disks, the
    /// frame socket.
    Device,
    /// The thread that hands a snapshot's saved state to KVM, before the guest runs: the
    /// `KVM_SET_*` calls of a restore and nothing else.
    Restore,
}

impl ThreadKind {
    fn name(self) -> &'static str {
        match self {
            ThreadKind::Main => "main",
            ThreadKind::Vcpu => "vCPU",
            ThreadKind::Device => "device",
            ThreadKind::Restore => "restore",
        }
    }
}

/// A filter that could not be built or applied.
#[derive(Debug, Error)]
pub enum VmSealError {
    /// seccompiler refused the rules (a bug of ours).
    #[error("building the {0} thread's system call filter: {1}")]
    Build(&'static str, String),
    /// The kernel refused the filter.
    #[error("applying the {0} thread's system call filter: {1}")]
    Apply(&'static str, String),
}

type Sealer = Box<dyn Fn(ThreadKind) -> Result<(), VmSealError> + Send + Sync>;

static SEALER: OnceLock<Sealer> = OnceLock::new();

/// Makes every later [`enter`] apply its kind's filter: the VM process calls this before it
/// builds the machine. `adopt_fd` is the listening socket a VM that outlives the service waits
/// for its next run on: the only descriptor a main thread may `accept4` on.
pub fn install(adopt_fd: Option<i32>) -> Result<(), VmSealError> {
    // Built once, up front: a thread that starts later only loads its program.
    let programs: Vec<(ThreadKind, BpfProgram)> = [
        ThreadKind::Main,
        ThreadKind::Vcpu,
        ThreadKind::Device,
        ThreadKind::Restore,
    ]
    .into_iter()
    .map(|k| Ok((k, program(k, adopt_fd)?)))
    .collect::<Result<_, VmSealError>>()?;
    settle_the_allocator();
    install_sigsys_handler();
    let _ = SEALER.set(Box::new(move |kind| {
        let (_, p) = programs
            .iter()
            .find(|(k, _)| *k == kind)
            .expect("a program per kind");
        seccompiler::apply_filter(p).map_err(|e| VmSealError::Apply(kind.name(), e.to_string()))
    }));
    Ok(())
}

/// Has glibc make, before any filter, the one open its allocator makes lazily: the first time
/// a thread's own arena shrinks, glibc reads `/proc/sys/vm/overcommit_memory` (`openat`; malloc's
/// `check_may_shrink_heap`) and keeps the answer for the process. Under a filter that open is a
/// trap, and a device thread that had moved a large transfer through its own buffers died of it
/// (issue 15). A thread of its own gets an arena of its own at its first allocation; freeing
/// blocks above the trim threshold (128 KiB) from the top shrinks it.
fn settle_the_allocator() {
    let warm = std::thread::Builder::new()
        .name("allocator".into())
        .spawn(|| {
            // Below the mmap threshold (128 KiB), so they come from this thread's arena.
            let blocks: Vec<Vec<u8>> = (0..8)
                .map(|_| std::hint::black_box(Vec::with_capacity(100 << 10)))
                .collect();
            for b in blocks.into_iter().rev() {
                drop(std::hint::black_box(b));
            }
        });
    // A thread that cannot start leaves the allocator as it was: the filter still holds, and a
    // later shrink is reported as the call it is.
    if let Ok(t) = warm {
        let _ = t.join();
    }
}

/// Applies this thread's filter if the process installed a sealer; a no-op otherwise.
pub fn enter(kind: ThreadKind) -> Result<(), VmSealError> {
    KIND.with(|k| k.set(Some(kind)));
    match SEALER.get() {
        Some(seal) => seal(kind),
        None => Ok(()),
    }
}

/// Names this thread's kind for the `SIGSYS` report without applying anything: for a thread
/// started by one that had already entered, whose filter it inherited.
pub fn inherited(kind: ThreadKind) {
    KIND.with(|k| k.set(Some(kind)));
}

/// [`enter`] for a thread that cannot end the VM by itself: a filter that cannot be applied
/// ends the process (the sandbox is reported dead), with the reason in the VM's log.
pub fn enter_or_abort(kind: ThreadKind) {
    if let Err(e) = enter(kind) {
        eprintln!("{e}");
        std::process::abort();
    }
}

thread_local! {
    /// This thread's kind, for the `SIGSYS` report.
    static KIND: std::cell::Cell<Option<ThreadKind>> = const { std::cell::Cell::new(None) };
}

#[cfg(target_arch = "x86_64")]
const ARCH: TargetArch = TargetArch::x86_64;
#[cfg(target_arch = "aarch64")]
const ARCH: TargetArch = TargetArch::aarch64;

/// The KVM calls a vCPU thread makes once it runs: `KVM_RUN`, and reading the registers to say
/// where a vCPU that triple-faulted was (vmm-sys-util's macros, as kvm-ioctls defines them).
mod requests {
    #![allow(missing_docs)]
    use kvm_bindings::KVMIO;
    use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iow_nr, ioctl_iowr_nr};

    ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
    ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_bindings::kvm_regs);
    ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_bindings::kvm_sregs);
    // A vCPU's state for a snapshot, read by its own thread when it parks (issue 15).
    ioctl_iowr_nr!(KVM_GET_MSRS, KVMIO, 0x88, kvm_bindings::kvm_msrs);
    ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_bindings::kvm_lapic_state);
    ioctl_ior_nr!(KVM_GET_MP_STATE, KVMIO, 0x98, kvm_bindings::kvm_mp_state);
    ioctl_ior_nr!(
        KVM_GET_VCPU_EVENTS,
        KVMIO,
        0x9f,
        kvm_bindings::kvm_vcpu_events
    );
    ioctl_ior_nr!(KVM_GET_DEBUGREGS, KVMIO, 0xa1, kvm_bindings::kvm_debugregs);
    ioctl_ior_nr!(KVM_GET_XSAVE, KVMIO, 0xa4, kvm_bindings::kvm_xsave);
    ioctl_ior_nr!(KVM_GET_XCRS, KVMIO, 0xa6, kvm_bindings::kvm_xcrs);
    // The VM's in-kernel devices for a snapshot, read by the control thread.
    ioctl_iowr_nr!(KVM_GET_IRQCHIP, KVMIO, 0x62, kvm_bindings::kvm_irqchip);
    ioctl_ior_nr!(KVM_GET_CLOCK, KVMIO, 0x7c, kvm_bindings::kvm_clock_data);
    ioctl_ior_nr!(KVM_GET_PIT2, KVMIO, 0x9f, kvm_bindings::kvm_pit_state2);
    // A restore: the VM's in-kernel devices, then each vCPU (the kernel's own encodings, as
    // kvm-ioctls has them: KVM_SET_IRQCHIP is an _IOR).
    ioctl_ior_nr!(KVM_SET_IRQCHIP, KVMIO, 0x63, kvm_bindings::kvm_irqchip);
    ioctl_iow_nr!(KVM_SET_CLOCK, KVMIO, 0x7b, kvm_bindings::kvm_clock_data);
    ioctl_iow_nr!(KVM_SET_PIT2, KVMIO, 0xa0, kvm_bindings::kvm_pit_state2);
    ioctl_iow_nr!(KVM_SET_MP_STATE, KVMIO, 0x99, kvm_bindings::kvm_mp_state);
    ioctl_iow_nr!(KVM_SET_REGS, KVMIO, 0x82, kvm_bindings::kvm_regs);
    ioctl_iow_nr!(KVM_SET_SREGS, KVMIO, 0x84, kvm_bindings::kvm_sregs);
    ioctl_iow_nr!(KVM_SET_XSAVE, KVMIO, 0xa5, kvm_bindings::kvm_xsave);
    ioctl_iow_nr!(KVM_SET_XCRS, KVMIO, 0xa7, kvm_bindings::kvm_xcrs);
    ioctl_iow_nr!(KVM_SET_DEBUGREGS, KVMIO, 0xa2, kvm_bindings::kvm_debugregs);
    ioctl_iow_nr!(KVM_SET_LAPIC, KVMIO, 0x8f, kvm_bindings::kvm_lapic_state);
    ioctl_iow_nr!(KVM_SET_MSRS, KVMIO, 0x89, kvm_bindings::kvm_msrs);
    ioctl_iow_nr!(
        KVM_SET_VCPU_EVENTS,
        KVMIO,
        0xa0,
        kvm_bindings::kvm_vcpu_events
    );
}
use requests::*;

/// `FIONBIO` (Rust's `set_nonblocking` on sockets).
const FIONBIO: u64 = libc::FIONBIO;

/// What every thread needs without a rule on its arguments: memory given back, signals (the
/// vCPU kick and this filter's own report), time, writing to its log, closing what it owns, and
/// ending. The memory and futex calls every thread also makes come with rules ([`ArgRules`]).
fn common() -> Vec<i64> {
    vec![
        libc::SYS_munmap,
        libc::SYS_mremap,
        libc::SYS_brk,
        libc::SYS_rt_sigreturn,
        libc::SYS_rt_sigprocmask,
        libc::SYS_sigaltstack,
        libc::SYS_sched_yield,
        libc::SYS_sched_getaffinity,
        libc::SYS_clock_gettime,
        libc::SYS_clock_nanosleep,
        libc::SYS_nanosleep,
        libc::SYS_getpid,
        libc::SYS_gettid,
        libc::SYS_write,
        libc::SYS_close,
        libc::SYS_exit,
        libc::SYS_exit_group,
        libc::SYS_restart_syscall,
        libc::SYS_getrandom,
    ]
}

/// Calls the C library makes under other names on x86_64 than on aarch64.
#[cfg(target_arch = "x86_64")]
const LEGACY_WAITS: [i64; 2] = [libc::SYS_poll, libc::SYS_epoll_wait];
#[cfg(target_arch = "aarch64")]
const LEGACY_WAITS: [i64; 0] = [];

/// A condition on one argument's low 32 bits: every argument our rules read is an `int`, or
/// (`clone`'s flags) holds what they test there.
fn arg(
    index: u8,
    op: SeccompCmpOp,
    value: u64,
) -> Result<SeccompCondition, seccompiler::BackendError> {
    SeccompCondition::new(index, SeccompCmpArgLen::Dword, op, value)
}

/// One rule: the call passes when every condition holds.
fn only(
    conditions: Vec<Result<SeccompCondition, seccompiler::BackendError>>,
) -> Result<Vec<SeccompRule>, seccompiler::BackendError> {
    Ok(vec![SeccompRule::new(
        conditions.into_iter().collect::<Result<_, _>>()?,
    )?])
}

/// A rule per value an argument may take.
fn one_of(index: u8, values: &[u64]) -> Result<Vec<SeccompRule>, seccompiler::BackendError> {
    values
        .iter()
        .map(|&v| SeccompRule::new(vec![arg(index, SeccompCmpOp::Eq, v)?]))
        .collect()
}

/// The futex operations of glibc's and Rust's locks, condition variables and thread joins
/// (wait and wake, plain or with a bit set; private or shared; either clock). Not the
/// priority-inheritance, requeue or wake-op families, whose kernel paths have had the
/// privilege escalations (CVE-2014-3153, CVE-2021-3347).
const FUTEX_OPS: [u64; 4] = [
    libc::FUTEX_WAIT as u64,
    libc::FUTEX_WAKE as u64,
    libc::FUTEX_WAIT_BITSET as u64,
    libc::FUTEX_WAKE_BITSET as u64,
];

/// The bits of a futex operation that name it, without its private and clock flags.
const FUTEX_CMD_MASK: u64 =
    !((libc::FUTEX_PRIVATE_FLAG | libc::FUTEX_CLOCK_REALTIME) as u64) & 0xffff_ffff;

/// `madvise` advice every thread may give: the allocator handing pages back.
const ADVICE: [u64; 2] = [libc::MADV_DONTNEED as u64, libc::MADV_FREE as u64];

/// `fcntl` commands a thread may make on what it already holds: its descriptor and status
/// flags. No duplicates (`F_DUPFD*`: a sealed thread needs no new descriptor numbers), no
/// locks, leases, owners, notifications or pipe sizes.
const FCNTL: [u64; 4] = [
    libc::F_GETFD as u64,
    libc::F_SETFD as u64,
    libc::F_GETFL as u64,
    libc::F_SETFL as u64,
];

/// `PR_SET_VMA`, with which a newer glibc names the memory it maps (not in every libc crate).
const PR_SET_VMA: u64 = 0x5356_4d41;

/// The system calls of one kind of thread, with their argument rules; `pid` is the process's,
/// the only one whose threads it may signal.
// `c_ulong` (the ioctl numbers' type) is `u64` on every target we build; `from` keeps it so.
#[allow(clippy::useless_conversion)]
fn rules(
    kind: ThreadKind,
    pid: u32,
    adopt_fd: Option<i32>,
) -> Result<BTreeMap<i64, Vec<SeccompRule>>, seccompiler::BackendError> {
    use SeccompCmpOp::{Eq, MaskedEq};
    let mut m: BTreeMap<i64, Vec<SeccompRule>> =
        common().into_iter().map(|nr| (nr, vec![])).collect();
    let ioctl = |codes: &[u64]| one_of(1, codes);
    let add = |m: &mut BTreeMap<i64, Vec<SeccompRule>>, nrs: &[i64]| {
        for &nr in nrs {
            m.insert(nr, vec![]);
        }
    };
    // Memory, for every thread: nothing mapped or made executable (the process's code was
    // mapped before it sealed, so new executable memory could only be an escaped guest's
    // payload) and no hugetlbfs pages (a pool the host's other tenants draw on).
    let no_exec = || arg(2, MaskedEq(libc::PROT_EXEC as u64), 0);
    m.insert(
        libc::SYS_mmap,
        only(vec![
            no_exec(),
            arg(3, MaskedEq(libc::MAP_HUGETLB as u64), 0),
        ])?,
    );
    m.insert(libc::SYS_mprotect, only(vec![no_exec()])?);
    let mut advice = ADVICE.to_vec();
    if kind == ThreadKind::Main {
        // A snapshot's memory file is populated before the copy, so a full file system is a
        // refusal there and not a SIGBUS in the middle (`snapshot::write_memory`).
        advice.push(libc::MADV_POPULATE_WRITE as u64);
    }
    m.insert(libc::SYS_madvise, one_of(2, &advice)?);
    m.insert(
        libc::SYS_futex,
        FUTEX_OPS
            .iter()
            .map(|&op| SeccompRule::new(vec![arg(1, MaskedEq(FUTEX_CMD_MASK), op)?]))
            .collect::<Result<_, _>>()?,
    );
    // Signals only to the process's own threads (the vCPU kick, an abort).
    m.insert(libc::SYS_tgkill, only(vec![arg(0, Eq, u64::from(pid))])?);
    add(&mut m, &LEGACY_WAITS);
    match kind {
        ThreadKind::Vcpu => {
            // Of KVM, running and reading its own registers: everything else was set up before
            // the thread started.
            m.insert(
                libc::SYS_ioctl,
                ioctl(&[
                    u64::from(KVM_RUN()),
                    u64::from(KVM_GET_REGS()),
                    u64::from(KVM_GET_SREGS()),
                    u64::from(KVM_GET_MSRS()),
                    u64::from(KVM_GET_LAPIC()),
                    u64::from(KVM_GET_MP_STATE()),
                    u64::from(KVM_GET_VCPU_EVENTS()),
                    u64::from(KVM_GET_DEBUGREGS()),
                    u64::from(KVM_GET_XSAVE()),
                    u64::from(KVM_GET_XCRS()),
                ])?,
            );
            // `shutdown`: a guest that resets its vsock device does it through an MMIO write on
            // this thread, and the device shuts its open connections' host ends down (the main
            // threads may shut sockets down already, so a compromise gains nothing by it).
            add(&mut m, &[libc::SYS_read, libc::SYS_shutdown]);
            // A build with debug assertions checks a descriptor is open before closing it (as
            // the thread's vCPU descriptor is at its end): reading its flags, nothing more.
            m.insert(
                libc::SYS_fcntl,
                only(vec![arg(1, Eq, libc::F_GETFD as u64)])?,
            );
        }
        ThreadKind::Device => {
            add(
                &mut m,
                &[
                    libc::SYS_epoll_pwait,
                    libc::SYS_epoll_ctl,
                    libc::SYS_read,
                    libc::SYS_readv,
                    libc::SYS_writev,
                    libc::SYS_pread64,
                    libc::SYS_pwrite64,
                    libc::SYS_preadv,
                    libc::SYS_pwritev,
                    libc::SYS_lseek,
                    libc::SYS_fsync,
                    libc::SYS_fdatasync,
                    libc::SYS_recvfrom,
                    libc::SYS_sendto,
                    libc::SYS_recvmsg,
                    libc::SYS_sendmsg,
                    libc::SYS_shutdown,
                    libc::SYS_eventfd2,
                ],
            );
            m.insert(libc::SYS_fcntl, one_of(1, &FCNTL)?);
            // A vsock connection's two ends (`UnixStream::pair`), and no other kind of socket.
            m.insert(
                libc::SYS_socketpair,
                only(vec![arg(0, Eq, libc::AF_UNIX as u64)])?,
            );
            m.insert(libc::SYS_ioctl, ioctl(&[FIONBIO])?);
            // Only to give blocks back: with FALLOC_FL_KEEP_SIZE alone a thread could allocate
            // blocks past a disk's end, which its file size limit does not count.
            m.insert(
                libc::SYS_fallocate,
                only(vec![arg(
                    1,
                    Eq,
                    (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE) as u64,
                )])?,
            );
        }
        ThreadKind::Restore => {
            m.insert(
                libc::SYS_ioctl,
                ioctl(&[
                    u64::from(KVM_SET_IRQCHIP()),
                    u64::from(KVM_SET_CLOCK()),
                    u64::from(KVM_SET_PIT2()),
                    u64::from(KVM_SET_MP_STATE()),
                    u64::from(KVM_SET_REGS()),
                    u64::from(KVM_SET_SREGS()),
                    u64::from(KVM_SET_XSAVE()),
                    u64::from(KVM_SET_XCRS()),
                    u64::from(KVM_SET_DEBUGREGS()),
                    u64::from(KVM_SET_LAPIC()),
                    u64::from(KVM_SET_MSRS()),
                    u64::from(KVM_SET_VCPU_EVENTS()),
                ])?,
            );
        }
        ThreadKind::Main => {
            add(
                &mut m,
                &[
                    libc::SYS_read,
                    libc::SYS_recvfrom,
                    libc::SYS_sendto,
                    libc::SYS_recvmsg,
                    libc::SYS_sendmsg,
                    libc::SYS_shutdown,
                    libc::SYS_ppoll,
                    // Threads: the jail's floor answers `clone3` with ENOSYS (a filter cannot
                    // read its flags), and this list lets it through to it (the strictest
                    // answer of all filters wins, and a trap here would beat its ENOSYS).
                    // Then what a new thread does as it starts.
                    libc::SYS_clone3,
                    libc::SYS_set_robust_list,
                    libc::SYS_rseq,
                    libc::SYS_eventfd2,
                    libc::SYS_epoll_ctl,
                    // A snapshot: the state written into the pipe that came with the request
                    // (`write`), guest memory copied into a shared mapping of the memory file
                    // the service sized (`mmap`), then synced. No `pwrite64` or `ftruncate`: a
                    // main thread writes no file and sizes none.
                    libc::SYS_fdatasync,
                ],
            );
            m.insert(libc::SYS_fcntl, one_of(1, &FCNTL)?);
            // The service's next run, on the socket a VM that outlives the service was handed
            // listening, and on no other descriptor (a VM that does not outlive has none).
            if let Some(fd) = adopt_fd {
                m.insert(libc::SYS_accept4, only(vec![arg(0, Eq, fd as u64)])?);
            }
            // `clone` only for a thread: a new process (a fork, or one of `vfork`'s kind) would
            // be a second program outside the threads' accounting.
            m.insert(
                libc::SYS_clone,
                only(vec![arg(
                    0,
                    MaskedEq(libc::CLONE_THREAD as u64),
                    libc::CLONE_THREAD as u64,
                )])?,
            );
            // A new thread names itself (`PR_SET_NAME`); no other process control.
            m.insert(
                libc::SYS_prctl,
                one_of(
                    0,
                    &[
                        libc::PR_SET_NAME as u64,
                        libc::PR_GET_NAME as u64,
                        PR_SET_VMA,
                    ],
                )?,
            );
            m.insert(
                libc::SYS_ioctl,
                ioctl(&[
                    FIONBIO,
                    u64::from(KVM_GET_IRQCHIP()),
                    u64::from(KVM_GET_CLOCK()),
                    u64::from(KVM_GET_PIT2()),
                ])?,
            );
        }
    }
    Ok(m)
}

/// The program of one kind of thread ([`install`] says what `adopt_fd` is).
pub fn program(kind: ThreadKind, adopt_fd: Option<i32>) -> Result<BpfProgram, VmSealError> {
    let err = |e: &dyn std::fmt::Display| VmSealError::Build(kind.name(), e.to_string());
    let rules = rules(kind, std::process::id(), adopt_fd).map_err(|e| err(&e))?;
    let f = SeccompFilter::new(rules, SeccompAction::Trap, SeccompAction::Allow, ARCH)
        .map_err(|e| err(&e))?;
    f.try_into().map_err(|e: seccompiler::BackendError| err(&e))
}

fn install_sigsys_handler() {
    // SAFETY: a handler that only calls async-signal-safe functions (write, _exit) on data it
    // formats on the stack.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigsys as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut());
    }
}

pub use sandbox_control::vm::SIGSYS_EXIT;

/// The first three arguments of the call a `SIGSYS` interrupted, from the thread's saved
/// registers: with argument rules, the number alone does not say which rule a call broke.
#[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
fn call_args(ctx: *mut libc::c_void) -> Option<[u64; 3]> {
    if ctx.is_null() {
        return None;
    }
    // SAFETY: an SA_SIGINFO handler's third argument is the interrupted thread's ucontext.
    let g = unsafe { &(*ctx.cast::<libc::ucontext_t>()).uc_mcontext.gregs };
    Some([libc::REG_RDI, libc::REG_RSI, libc::REG_RDX].map(|r| g[r as usize] as u64))
}

#[cfg(all(target_arch = "aarch64", target_env = "gnu"))]
fn call_args(ctx: *mut libc::c_void) -> Option<[u64; 3]> {
    if ctx.is_null() {
        return None;
    }
    // SAFETY: as on x86_64.
    let r = unsafe { &(*ctx.cast::<libc::ucontext_t>()).uc_mcontext.regs };
    Some([r[0], r[1], r[2]])
}

#[cfg(not(all(
    any(target_arch = "x86_64", target_arch = "aarch64"),
    target_env = "gnu"
)))]
fn call_args(_: *mut libc::c_void) -> Option<[u64; 3]> {
    None
}

extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // The call's number is `si_syscall`: after si_signo, si_errno, si_code (padded to 16 bytes
    // on 64-bit targets) and the 8-byte si_call_addr of the SIGSYS member of the union.
    const SI_SYSCALL: usize = 24;
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let nr = unsafe {
        info.cast::<u8>()
            .add(SI_SYSCALL)
            .cast::<i32>()
            .read_unaligned()
    };
    let kind = KIND.try_with(|k| k.get()).ok().flatten();
    let mut buf = [0u8; 256];
    let mut n = 0;
    let mut put = |s: &[u8]| {
        for &b in s {
            if n < buf.len() {
                buf[n] = b;
                n += 1;
            }
        }
    };
    put(b"the ");
    put(kind.map_or("unsealed", ThreadKind::name).as_bytes());
    put(b" thread made system call ");
    let mut digits = [0u8; 12];
    let mut d = digits.len();
    let mut v = nr.unsigned_abs();
    loop {
        d -= 1;
        digits[d] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    put(&digits[d..]);
    put(b", outside its seccomp filter");
    if let Some(args) = call_args(ctx) {
        put(b" (arguments");
        for (i, a) in args.into_iter().enumerate() {
            put(if i == 0 { b" 0x" } else { b", 0x" });
            let mut hex = [0u8; 16];
            let mut h = hex.len();
            let mut v = a;
            loop {
                h -= 1;
                hex[h] = b"0123456789abcdef"[(v & 0xf) as usize];
                v >>= 4;
                if v == 0 {
                    break;
                }
            }
            put(&hex[h..]);
        }
        put(b")");
    }
    put(b"; the VM stops\n");
    // SAFETY: write and _exit are async-signal-safe; `buf` is ours.
    unsafe {
        libc::write(2, buf.as_ptr().cast(), n);
        libc::_exit(SIGSYS_EXIT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvm_request_numbers_are_the_kernels() {
        assert_eq!(KVM_RUN(), 0xae80);
        assert_eq!(KVM_GET_REGS(), 0x8090_ae81);
        assert_eq!(KVM_GET_SREGS(), 0x8138_ae83);
        // From the kernel's uapi headers, as `strace -X raw` prints them.
        assert_eq!(KVM_GET_MSRS(), 0xc008_ae88);
        assert_eq!(KVM_GET_LAPIC(), 0x8400_ae8e);
        assert_eq!(KVM_GET_MP_STATE(), 0x8004_ae98);
        assert_eq!(KVM_GET_VCPU_EVENTS(), 0x8040_ae9f);
        assert_eq!(KVM_GET_XSAVE(), 0x9000_aea4);
        assert_eq!(KVM_GET_IRQCHIP(), 0xc208_ae62);
        assert_eq!(KVM_GET_CLOCK(), 0x8030_ae7c);
        assert_eq!(KVM_GET_PIT2(), 0x8070_ae9f);
        assert_eq!(KVM_SET_IRQCHIP(), 0x8208_ae63);
        assert_eq!(KVM_SET_CLOCK(), 0x4030_ae7b);
        assert_eq!(KVM_SET_PIT2(), 0x4070_aea0);
        assert_eq!(KVM_SET_MP_STATE(), 0x4004_ae99);
        assert_eq!(KVM_SET_REGS(), 0x4090_ae82);
        assert_eq!(KVM_SET_SREGS(), 0x4138_ae84);
        assert_eq!(KVM_SET_XSAVE(), 0x5000_aea5);
        assert_eq!(KVM_SET_XCRS(), 0x4188_aea7);
        assert_eq!(KVM_SET_DEBUGREGS(), 0x4080_aea2);
        assert_eq!(KVM_SET_LAPIC(), 0x4400_ae8f);
        assert_eq!(KVM_SET_MSRS(), 0x4008_ae89);
        assert_eq!(KVM_SET_VCPU_EVENTS(), 0x4040_aea0);
    }

    #[test]
    fn every_kind_compiles_and_stays_small() {
        for k in [
            ThreadKind::Main,
            ThreadKind::Vcpu,
            ThreadKind::Device,
            ThreadKind::Restore,
        ] {
            let p = program(k, Some(ADOPT_FD)).unwrap();
            assert!(!p.is_empty() && p.len() < 512, "{k:?}: {}", p.len());
        }
    }

    #[test]
    fn a_thread_that_frees_a_large_heap_stays_inside_its_filter() {
        // glibc shrinks a thread's own arena when much of it is freed, and the first time any
        // arena shrinks it opens /proc/sys/vm/overcommit_memory (openat): a device thread that
        // moved a large transfer through its own buffers died of it (issue 15).
        let me = std::env::current_exe().unwrap();
        if std::env::var_os("SEAL_CHILD").is_some() {
            // SAFETY: PR_SET_NO_NEW_PRIVS takes no pointers.
            unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
            install(None).unwrap();
            std::thread::spawn(|| {
                enter(ThreadKind::Device).unwrap();
                for _ in 0..4 {
                    // Below the mmap threshold, so they come from this thread's arena.
                    let blocks: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 100 << 10]).collect();
                    for b in blocks.into_iter().rev() {
                        std::hint::black_box(b);
                    }
                }
            })
            .join()
            .unwrap();
            return;
        }
        let out = std::process::Command::new(me)
            .args([
                "--exact",
                "seal::tests::a_thread_that_frees_a_large_heap_stays_inside_its_filter",
                "--nocapture",
            ])
            .env("SEAL_CHILD", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{:?}: {err}", out.status);
    }

    #[test]
    fn a_main_thread_writes_a_snapshot_through_its_mapping_and_sizes_no_file() {
        // The snapshot's path under the main filter: guest memory copied into the memory file
        // the service sized, the state into a pipe. Then `ftruncate`, which a main thread no
        // longer has, is trapped.
        let me = std::env::current_exe().unwrap();
        if std::env::var_os("SEAL_CHILD").is_some() {
            use std::io::Write;
            use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
            // SAFETY: PR_SET_NO_NEW_PRIVS takes no pointers.
            unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
            let bytes = 4u64 << 20;
            let mem =
                GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), bytes as usize)]).unwrap();
            mem.write_slice(b"a page of the guest", GuestAddress(0x1000))
                .unwrap();
            let file = tempfile::tempfile().unwrap();
            crate::snapshot::size_memory_file(&file, bytes).unwrap();
            let (_r, mut w) = std::io::pipe().unwrap();
            install(None).unwrap();
            enter(ThreadKind::Main).unwrap();
            let written = crate::snapshot::write_memory(&mem, &file).unwrap();
            assert_eq!(written, 4096);
            w.write_all(b"{\"state\": true}").unwrap();
            eprintln!("snapshot written under the main filter");
            let _ = file.set_len(0);
            unreachable!("the filter let ftruncate(2) through");
        }
        let out = std::process::Command::new(me)
            .args([
                "--exact",
                "seal::tests::a_main_thread_writes_a_snapshot_through_its_mapping_and_sizes_no_file",
                "--nocapture",
            ])
            .env("SEAL_CHILD", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("snapshot written under the main filter"),
            "{err}"
        );
        assert_eq!(out.status.code(), Some(SIGSYS_EXIT), "{err}");
        assert!(
            err.contains(&format!(
                "the main thread made system call {}, outside its seccomp filter",
                libc::SYS_ftruncate
            )),
            "{err}"
        );
    }

    #[test]
    fn a_device_thread_may_punch_holes_but_not_allocate_past_a_disks_end() {
        let me = std::env::current_exe().unwrap();
        if std::env::var_os("SEAL_CHILD").is_some() {
            use std::os::fd::AsRawFd;
            // SAFETY: PR_SET_NO_NEW_PRIVS takes no pointers.
            unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
            let disk = tempfile::tempfile().unwrap();
            disk.set_len(1 << 20).unwrap();
            install(None).unwrap();
            enter(ThreadKind::Device).unwrap();
            let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            // SAFETY: fallocate on a descriptor we own.
            let r = unsafe { libc::fallocate(disk.as_raw_fd(), punch, 0, 4096) };
            eprintln!("punched a hole: {r}");
            // SAFETY: as above; blocks past the end, the size kept: trapped.
            unsafe {
                libc::fallocate(
                    disk.as_raw_fd(),
                    libc::FALLOC_FL_KEEP_SIZE,
                    1 << 20,
                    1 << 30,
                )
            };
            unreachable!("the filter let fallocate(KEEP_SIZE) through");
        }
        let out = std::process::Command::new(me)
            .args([
                "--exact",
                "seal::tests::a_device_thread_may_punch_holes_but_not_allocate_past_a_disks_end",
                "--nocapture",
            ])
            .env("SEAL_CHILD", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("punched a hole"), "{err}");
        assert_eq!(out.status.code(), Some(SIGSYS_EXIT), "{err}");
        assert!(
            err.contains(&format!(
                "the device thread made system call {}, outside its seccomp filter",
                libc::SYS_fallocate
            )),
            "{err}"
        );
    }

    #[test]
    fn a_restore_may_only_set_state() {
        // Under the restore filter a KVM_SET_* call reaches the kernel (here: a bad descriptor,
        // EBADF), and anything else, KVM_RUN included, is trapped.
        let me = std::env::current_exe().unwrap();
        if std::env::var_os("SEAL_CHILD").is_some() {
            // SAFETY: PR_SET_NO_NEW_PRIVS takes no pointers.
            unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
            install(None).unwrap();
            enter(ThreadKind::Restore).unwrap();
            // SAFETY: ioctls on a descriptor that is not open; nothing is read or written.
            let r = unsafe { libc::ioctl(-1, KVM_SET_REGS() as _, 0) };
            eprintln!("KVM_SET_REGS reached the kernel: {r}");
            // SAFETY: as above.
            unsafe { libc::ioctl(-1, KVM_RUN() as _, 0) };
            unreachable!("the filter let KVM_RUN through");
        }
        let out = std::process::Command::new(me)
            .args([
                "--exact",
                "seal::tests::a_restore_may_only_set_state",
                "--nocapture",
            ])
            .env("SEAL_CHILD", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("KVM_SET_REGS reached the kernel: -1"), "{err}");
        assert_eq!(out.status.code(), Some(SIGSYS_EXIT), "{err}");
        assert!(
            err.contains(&format!(
                "the restore thread made system call {}, outside its seccomp filter",
                libc::SYS_ioctl
            )),
            "{err}"
        );
    }

    #[test]
    fn a_call_outside_the_list_is_reported_and_ends_the_process() {
        // In a child process: the filter cannot be taken back.
        let me = std::env::current_exe().unwrap();
        if std::env::var_os("SEAL_CHILD").is_some() {
            // SAFETY: PR_SET_NO_NEW_PRIVS takes no pointers.
            unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
            let owned = std::fs::File::open("/dev/null").unwrap();
            let (sock, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
            install(None).unwrap();
            enter(ThreadKind::Vcpu).unwrap();
            // Closing what the thread owns is allowed (debug builds check it is open first), and
            // so is shutting a socket down (a vsock device reset does, on this thread).
            drop(owned);
            sock.shutdown(std::net::Shutdown::Both).unwrap();
            // socket(2) is on no list.
            // SAFETY: a plain system call.
            unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
            unreachable!("the filter let socket(2) through");
        }
        let out = std::process::Command::new(me)
            .args([
                "--exact",
                "seal::tests::a_call_outside_the_list_is_reported_and_ends_the_process",
                "--nocapture",
            ])
            .env("SEAL_CHILD", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(SIGSYS_EXIT), "{err}");
        assert!(
            err.contains(&format!(
                "the vCPU thread made system call {}, outside its seccomp filter",
                libc::SYS_socket
            )),
            "{err}"
        );
    }

    /// A call a rule lets through, then one it traps, on one kind of thread.
    struct Case {
        kind: ThreadKind,
        what: &'static str,
        /// The call that passes; its result is printed.
        allowed: fn() -> i64,
        /// The call that is trapped, and its number.
        trapped: fn(),
        nr: i64,
    }

    /// A raw system call of a case.
    fn raw(nr: i64, a: [u64; 6]) -> i64 {
        // SAFETY: the cases pass null or addresses of memory they own (a fresh mapping, a word on
        // their stack, a pair of ints), descriptors they own or none, and signal 0 (a check,
        // nothing delivered): nothing the test harness holds is touched.
        unsafe { libc::syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]) }
    }

    fn anon(prot: i32, flags: i32) -> i64 {
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags;
        raw(
            libc::SYS_mmap,
            [0, 4096, prot as u64, flags as u64, u64::MAX, 0],
        )
    }

    fn page() -> u64 {
        anon(libc::PROT_READ | libc::PROT_WRITE, 0) as u64
    }

    fn futex(op: i32) -> i64 {
        let word = 0u32;
        raw(
            libc::SYS_futex,
            [&word as *const u32 as u64, op as u64, 1, 0, 0, 0],
        )
    }

    fn pair(domain: i32) -> i64 {
        let mut fds = [0i32; 2];
        let (d, t) = (domain as u64, libc::SOCK_STREAM as u64);
        raw(
            libc::SYS_socketpair,
            [d, t, 0, fds.as_mut_ptr() as u64, 0, 0],
        )
    }

    fn fcntl(cmd: i32, value: u64) -> i64 {
        raw(libc::SYS_fcntl, [2, cmd as u64, value, 0, 0, 0])
    }

    /// Where the cases' process holds a listening socket with a connection waiting, as a VM
    /// that outlives the service holds its adoption socket; descriptor `ADOPT_FD + 1` is
    /// another listening socket.
    const ADOPT_FD: i32 = 60;

    fn listen_on_adopt_fd() {
        let dir = tempfile::tempdir().unwrap();
        for (i, fd) in [ADOPT_FD, ADOPT_FD + 1].into_iter().enumerate() {
            let path = dir.path().join(format!("s{i}"));
            let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
            let c = std::os::unix::net::UnixStream::connect(&path).unwrap();
            std::mem::forget(c);
            use std::os::fd::IntoRawFd;
            // SAFETY: dup2 onto numbers this test process does not use otherwise.
            assert_eq!(unsafe { libc::dup2(l.into_raw_fd(), fd) }, fd);
        }
    }

    fn accept_on(fd: i32) -> i64 {
        raw(libc::SYS_accept4, [fd as u64, 0, 0, 0, 0, 0])
    }

    /// The parent test process's id, read before the filter (`getppid` is on no list).
    static PARENT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

    const CASES: &[Case] = &[
        Case {
            kind: ThreadKind::Device,
            what: "mmap without PROT_EXEC, then with it",
            allowed: || anon(libc::PROT_READ | libc::PROT_WRITE, 0),
            trapped: || {
                anon(libc::PROT_READ | libc::PROT_EXEC, 0);
            },
            nr: libc::SYS_mmap,
        },
        Case {
            kind: ThreadKind::Vcpu,
            what: "mmap of hugetlbfs pages",
            allowed: || anon(libc::PROT_NONE, libc::MAP_NORESERVE),
            trapped: || {
                anon(libc::PROT_READ | libc::PROT_WRITE, libc::MAP_HUGETLB);
            },
            nr: libc::SYS_mmap,
        },
        Case {
            kind: ThreadKind::Main,
            what: "mprotect to read-only, then to executable",
            allowed: || {
                raw(
                    libc::SYS_mprotect,
                    [page(), 4096, libc::PROT_READ as u64, 0, 0, 0],
                )
            },
            trapped: || {
                let prot = (libc::PROT_READ | libc::PROT_EXEC) as u64;
                raw(libc::SYS_mprotect, [page(), 4096, prot, 0, 0, 0]);
            },
            nr: libc::SYS_mprotect,
        },
        Case {
            kind: ThreadKind::Device,
            what: "madvise DONTNEED, then MERGEABLE",
            allowed: || {
                raw(
                    libc::SYS_madvise,
                    [page(), 4096, libc::MADV_DONTNEED as u64, 0, 0, 0],
                )
            },
            trapped: || {
                raw(
                    libc::SYS_madvise,
                    [page(), 4096, libc::MADV_MERGEABLE as u64, 0, 0, 0],
                );
            },
            nr: libc::SYS_madvise,
        },
        Case {
            kind: ThreadKind::Vcpu,
            what: "futex WAKE_PRIVATE, then LOCK_PI",
            allowed: || futex(libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG),
            trapped: || {
                futex(libc::FUTEX_LOCK_PI | libc::FUTEX_PRIVATE_FLAG);
            },
            nr: libc::SYS_futex,
        },
        Case {
            kind: ThreadKind::Device,
            what: "tgkill of its own thread, then of another process",
            allowed: || {
                let me = raw(libc::SYS_getpid, [0; 6]) as u64;
                let tid = raw(libc::SYS_gettid, [0; 6]) as u64;
                raw(libc::SYS_tgkill, [me, tid, 0, 0, 0, 0])
            },
            trapped: || {
                let parent = PARENT.load(std::sync::atomic::Ordering::SeqCst) as u64;
                raw(libc::SYS_tgkill, [parent, parent, 0, 0, 0, 0]);
            },
            nr: libc::SYS_tgkill,
        },
        Case {
            kind: ThreadKind::Main,
            what: "a thread, then a fork",
            allowed: || std::thread::spawn(|| 7i64).join().unwrap(),
            trapped: || {
                raw(libc::SYS_clone, [libc::SIGCHLD as u64, 0, 0, 0, 0, 0]);
            },
            nr: libc::SYS_clone,
        },
        Case {
            kind: ThreadKind::Main,
            what: "prctl PR_SET_NAME, then PR_SET_DUMPABLE",
            allowed: || {
                let name = c"sealed".as_ptr() as u64;
                raw(
                    libc::SYS_prctl,
                    [libc::PR_SET_NAME as u64, name, 0, 0, 0, 0],
                )
            },
            trapped: || {
                raw(
                    libc::SYS_prctl,
                    [libc::PR_SET_DUMPABLE as u64, 1, 0, 0, 0, 0],
                );
            },
            nr: libc::SYS_prctl,
        },
        Case {
            kind: ThreadKind::Device,
            what: "fcntl F_GETFL, then F_DUPFD_CLOEXEC",
            allowed: || fcntl(libc::F_GETFL, 0),
            trapped: || {
                fcntl(libc::F_DUPFD_CLOEXEC, 100);
            },
            nr: libc::SYS_fcntl,
        },
        Case {
            kind: ThreadKind::Main,
            what: "fcntl F_SETFD, then F_DUPFD",
            allowed: || fcntl(libc::F_SETFD, libc::FD_CLOEXEC as u64),
            trapped: || {
                fcntl(libc::F_DUPFD, 100);
            },
            nr: libc::SYS_fcntl,
        },
        Case {
            kind: ThreadKind::Device,
            what: "socketpair AF_UNIX, then AF_INET",
            allowed: || pair(libc::AF_UNIX),
            trapped: || {
                pair(libc::AF_INET);
            },
            nr: libc::SYS_socketpair,
        },
        Case {
            kind: ThreadKind::Main,
            what: "accept4 on the adoption socket, then on another",
            allowed: || accept_on(ADOPT_FD),
            trapped: || {
                accept_on(ADOPT_FD + 1);
            },
            nr: libc::SYS_accept4,
        },
        Case {
            kind: ThreadKind::Main,
            what: "no socketpair on a main thread",
            allowed: || raw(libc::SYS_getpid, [0; 6]),
            trapped: || {
                pair(libc::AF_UNIX);
            },
            nr: libc::SYS_socketpair,
        },
    ];

    #[test]
    fn every_argument_rule_lets_its_calls_through_and_traps_the_rest() {
        let me = std::env::current_exe().unwrap();
        let name = "seal::tests::every_argument_rule_lets_its_calls_through_and_traps_the_rest";
        if let Some(i) = std::env::var_os("SEAL_CASE") {
            let case = &CASES[i.to_str().unwrap().parse::<usize>().unwrap()];
            // SAFETY: getppid and PR_SET_NO_NEW_PRIVS take no pointers.
            unsafe {
                PARENT.store(libc::getppid(), std::sync::atomic::Ordering::SeqCst);
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
            }
            listen_on_adopt_fd();
            install(Some(ADOPT_FD)).unwrap();
            enter(case.kind).unwrap();
            let r = (case.allowed)();
            eprintln!("allowed: {r}");
            (case.trapped)();
            unreachable!("the filter let the call through");
        }
        for (i, case) in CASES.iter().enumerate() {
            let out = std::process::Command::new(&me)
                .args(["--exact", name, "--nocapture"])
                .env("SEAL_CASE", i.to_string())
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            let what = case.what;
            assert!(
                err.contains("allowed: ") && !err.contains("allowed: -1"),
                "{what}: the allowed call failed or trapped: {err}"
            );
            assert_eq!(out.status.code(), Some(SIGSYS_EXIT), "{what}: {err}");
            assert!(
                err.contains(&format!(
                    "the {} thread made system call {}, outside its seccomp filter (arguments 0x",
                    case.kind.name(),
                    case.nr
                )),
                "{what}: {err}"
            );
        }
    }
}
