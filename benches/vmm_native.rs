//! The VMM's own costs on real KVM (issue 15), where emulation does not hide them: this machine's
//! `/dev/kvm` runs simple guest code natively though it cannot boot Linux, so the guest here is a
//! tiny payload (an ELF with a PVH entry, entered in 32-bit protected mode as a kernel is) that
//! writes the boot marker and then either halts or keeps writing it. Each VM is our `Machine`
//! in this process (no jail, no VM process: the VMM alone).
//!
//! - start → the guest's first marker write: building the VM (memory, irqchip, devices, vCPU,
//!   threads) and running its first instructions;
//! - restore of a small snapshot (128 MiB guest, a few pages written) → the restored guest's
//!   next marker write, against a fresh start in the same run;
//! - VMs created (started, marker seen, stopped) per second of this process's CPU time;
//! - the memory a running VM costs the VMM beyond guest RAM (this process's smaps, guest
//!   mappings left out), per VM with ten running;
//! - what the VM process's system call filters cost (issue 30: the per-thread lists with their
//!   argument rules, `vm/src/seal.rs`): start -> first marker write, and the time of one
//!   call a vCPU thread makes on every exit (`KVM_RUN`, here on no descriptor) and one every lock
//!   makes (`futex` wake), each in a child process of this bench without the filters and in one
//!   with them (a filter cannot be taken back), side by side.
//!
//! Compared with Firecracker's published figures (docs/performance.md). `BENCH_RUNS` sets the
//! number of runs (default 50).

use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbox_benches::{header, row, stats};
use sandbox_vm::{FileRef, Machine, MachineConfig, Restore};

const MEMORY_MIB: u32 = 128;
/// Where the payload's code starts (linux-loader puts PT_LOAD segments at their physical
/// address, at or above 1 MiB).
const LOAD: u64 = 0x10_0000;

/// `mov dx, 0x440; mov al, 0x7b; out dx, al`, then `hlt; jmp $-1` (halts for good: no
/// interrupt is enabled) or `out dx, al; jmp $-3` (writes the marker forever).
fn code(spin: bool) -> Vec<u8> {
    let mut c = vec![0x66, 0xba, 0x40, 0x04, 0xb0, 0x7b, 0xee];
    if spin {
        c.extend([0xee, 0xeb, 0xfd]);
    } else {
        c.extend([0xf4, 0xeb, 0xfd]);
    }
    c
}

/// A minimal ELF64 x86_64 executable: one PT_LOAD of `code` at [`LOAD`], and a PT_NOTE with the
/// Xen PHYS32_ENTRY note (type 18) naming it as the PVH entry.
fn payload(code: &[u8]) -> Vec<u8> {
    let (ehdr, phdr) = (64u64, 56u64);
    let note_off = ehdr + 2 * phdr;
    // namesz 4, descsz 4, type 18, "Xen\0", entry (u32).
    let mut note = Vec::new();
    note.extend(4u32.to_le_bytes());
    note.extend(4u32.to_le_bytes());
    note.extend(18u32.to_le_bytes());
    note.extend(b"Xen\0");
    note.extend((LOAD as u32).to_le_bytes());
    let code_off = (note_off + note.len() as u64).next_multiple_of(16);
    let mut f = Vec::new();
    // ELF header.
    f.extend([0x7f, b'E', b'L', b'F', 2, 1, 1, 0]);
    f.extend([0u8; 8]);
    f.extend(2u16.to_le_bytes()); // ET_EXEC
    f.extend(62u16.to_le_bytes()); // EM_X86_64
    f.extend(1u32.to_le_bytes());
    f.extend(LOAD.to_le_bytes()); // e_entry
    f.extend(ehdr.to_le_bytes()); // e_phoff
    f.extend(0u64.to_le_bytes()); // e_shoff
    f.extend(0u32.to_le_bytes()); // e_flags
    f.extend((ehdr as u16).to_le_bytes());
    f.extend((phdr as u16).to_le_bytes());
    f.extend(2u16.to_le_bytes()); // e_phnum
    f.extend(64u16.to_le_bytes()); // e_shentsize
    f.extend(0u16.to_le_bytes()); // e_shnum
    f.extend(0u16.to_le_bytes()); // e_shstrndx
    let ph =
        |f: &mut Vec<u8>, kind: u32, flags: u32, off: u64, addr: u64, size: u64, align: u64| {
            f.extend(kind.to_le_bytes());
            f.extend(flags.to_le_bytes());
            f.extend(off.to_le_bytes());
            f.extend(addr.to_le_bytes()); // p_vaddr
            f.extend(addr.to_le_bytes()); // p_paddr
            f.extend(size.to_le_bytes()); // p_filesz
            f.extend(size.to_le_bytes()); // p_memsz
            f.extend(align.to_le_bytes());
        };
    ph(&mut f, 1, 5, code_off, LOAD, code.len() as u64, 16); // PT_LOAD, R+X
    ph(&mut f, 4, 4, note_off, 0, note.len() as u64, 4); // PT_NOTE
    f.extend(&note);
    f.resize(code_off as usize, 0);
    f.extend(code);
    f
}

fn config(kernel: &std::path::Path, restore: Option<Restore>) -> MachineConfig {
    MachineConfig {
        kvm: None,
        kernel: kernel.to_path_buf().into(),
        initrd: None,
        console: None,
        cmdline: "payload".into(),
        memory_mib: MEMORY_MIB,
        vcpus: 1,
        disks: vec![],
        vsock_cid: 3,
        net: None,
        restore,
    }
}

/// Starts a machine and waits for its marker: (start → marker, the machine).
fn start(cfg: &MachineConfig) -> Option<(Duration, Machine)> {
    let t0 = Instant::now();
    let m = match Machine::start(cfg, None) {
        Ok(m) => m,
        Err(e) => {
            println!("the payload's VM did not start: {e}");
            return None;
        }
    };
    m.wait_boot_marker()?;
    Some((t0.elapsed(), m))
}

fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// This process's resident memory that is not guest RAM (guest RAM: the anonymous mappings of
/// exactly a guest's size), KiB.
fn rss_without_guest_kib() -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let (mut total, mut guest) = (0, false);
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            let path = words.nth(4);
            guest = path.is_none() && b - a == u64::from(MEMORY_MIB) << 20;
        } else if first == "Rss:" && !guest {
            total += words
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    total
}

/// The per-call figures: nanoseconds per call, over `n` calls on this thread.
fn per_call_ns(n: u32, mut call: impl FnMut()) -> f64 {
    let t0 = Instant::now();
    for _ in 0..n {
        call();
    }
    t0.elapsed().as_nanos() as f64 / f64::from(n)
}

/// The child's side of the filters' rows: with `sealed`, every machine thread applies its kind's
/// filter as in `sandbox-vm`, and so does the thread that times the calls (a vCPU's). Prints one
/// line: `FILTERS <start ms, space separated> | <KVM_RUN ns> <futex ns>`.
fn filters_child(halt: &std::path::Path, runs: usize, sealed: bool) {
    use sandbox_vm::seal;
    if sealed {
        seal::install(None).expect("the filters build");
    }
    let starts: Vec<String> = (0..runs)
        .filter_map(|_| start(&config(halt, None)))
        .map(|(d, m)| {
            drop(m);
            format!("{:.3}", d.as_secs_f64() * 1000.0)
        })
        .collect();
    let (run_ns, futex_ns) = std::thread::spawn(|| {
        seal::enter(seal::ThreadKind::Vcpu).expect("the vCPU filter applies");
        let n = 200_000;
        let word = 0u32;
        // SAFETY: an ioctl on no descriptor (EBADF) and a wake of a word nobody waits on.
        let run = per_call_ns(n, || unsafe {
            libc::ioctl(-1, 0xae80, 0);
        });
        // SAFETY: as above.
        let futex = per_call_ns(n, || unsafe {
            libc::syscall(
                libc::SYS_futex,
                &word as *const u32,
                libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                1,
            );
        });
        (run, futex)
    })
    .join()
    .expect("the timing thread");
    println!("FILTERS {} | {run_ns:.1} {futex_ns:.1}", starts.join(" "));
}

/// Runs [`filters_child`] in a child process of this bench: (start samples, KVM_RUN ns, futex ns).
fn filters_run(sealed: bool) -> Option<(Vec<Duration>, f64, f64)> {
    let out = std::process::Command::new(std::env::current_exe().ok()?)
        .env("VMM_NATIVE_FILTERS", if sealed { "sealed" } else { "open" })
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find_map(|l| l.strip_prefix("FILTERS "))?;
    let (starts, calls) = line.split_once(" | ")?;
    let starts = starts
        .split_whitespace()
        .filter_map(|v| v.parse::<f64>().ok())
        .map(|ms| Duration::from_secs_f64(ms / 1000.0))
        .collect();
    let mut calls = calls
        .split_whitespace()
        .filter_map(|v| v.parse::<f64>().ok());
    Some((starts, calls.next()?, calls.next()?))
}

fn main() {
    let runs = sandbox_benches::runs(50);
    if let Ok(mode) = std::env::var("VMM_NATIVE_FILTERS") {
        let dir = tempfile::tempdir().expect("tempdir");
        let halt = dir.path().join("halt.elf");
        std::fs::write(&halt, payload(&code(false))).expect("payload");
        filters_child(&halt, runs, mode == "sealed");
        return;
    }
    if std::fs::File::open("/dev/kvm").is_err() {
        println!("skipped: no usable /dev/kvm here");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let halt = dir.path().join("halt.elf");
    let spin = dir.path().join("spin.elf");
    std::fs::write(&halt, payload(&code(false))).expect("payload");
    std::fs::write(&spin, payload(&code(true))).expect("payload");
    let Some((_, warm)) = start(&config(&halt, None)) else {
        println!("skipped: this /dev/kvm does not run the payload");
        return;
    };
    drop(warm);

    // The snapshot every restore starts from: the spinning payload, paused mid-loop.
    let state = dir.path().join("snap.state");
    let memory = dir.path().join("snap.mem");
    let state_f = std::fs::File::create(&state).expect("state");
    // Read-write: the memory is written through a shared mapping of the file.
    let memory_f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&memory)
        .expect("memory");
    sandbox_vm::snapshot::size_memory_file(&memory_f, u64::from(MEMORY_MIB) << 20)
        .expect("sizing the memory file");
    let (_, m) = start(&config(&spin, None)).expect("the spinning payload starts");
    let done = m
        .pause_and_snapshot(&mut &state_f, &memory_f, false)
        .expect("the snapshot");
    drop(m);
    let expect = sandbox_vm::snapshot::Expect {
        memory_mib: MEMORY_MIB,
        vcpus: 1,
        devices: 1,
    };
    let saved = Arc::new(
        sandbox_vm::snapshot::MachineState::read_from(
            &std::fs::File::open(&state).expect("state"),
            &expect,
        )
        .expect("the state reads back"),
    );
    let restore = Restore {
        state: saved,
        memory: FileRef::Path(memory.clone()),
    };

    let (mut cold, mut restored, mut restore_build) = (vec![], vec![], vec![]);
    for _ in 0..runs {
        if let Some((d, m)) = start(&config(&halt, None)) {
            cold.push(d);
            drop(m);
        }
        let t0 = Instant::now();
        match Machine::start(&config(&spin, Some(restore.clone())), None) {
            Ok(m) => {
                restore_build.push(t0.elapsed());
                if m.wait_boot_marker().is_some() {
                    restored.push(t0.elapsed());
                }
            }
            Err(e) => println!("restore failed: {e}"),
        }
    }

    // VMs per CPU second: start, marker, stop, for two seconds of wall time.
    let (cpu0, wall0) = (cpu_time(), Instant::now());
    let mut made = 0u32;
    while wall0.elapsed() < Duration::from_secs(2) {
        if let Some((_, m)) = start(&config(&halt, None)) {
            m.stop();
            made += 1;
        }
    }
    let cpu = cpu_time().saturating_sub(cpu0).as_secs_f64();

    // Memory: ten running VMs against none.
    let base = rss_without_guest_kib();
    let vms: Vec<Machine> = (0..10)
        .filter_map(|_| start(&config(&halt, None)).map(|(_, m)| m))
        .collect();
    let with = rss_without_guest_kib();
    let per_vm = with.saturating_sub(base) / vms.len().max(1) as u64;
    drop(vms);

    println!(
        "\nOur VMM on this machine's /dev/kvm, a {MEMORY_MIB} MiB guest of a few instructions, the VM in this process\n"
    );
    header();
    let reference = stats(&cold).0;
    row(
        "start -> first marker write (reference)",
        &cold,
        Some(reference),
    );
    row(
        "restore of a snapshot -> machine built, vCPU running",
        &restore_build,
        Some(reference),
    );
    row(
        "restore of a snapshot -> the guest's next marker write",
        &restored,
        Some(reference),
    );
    println!(
        "\nsnapshot: {} KiB of guest memory written, vCPU stopped in {} us, written in {} us",
        done.memory_written >> 10,
        done.pause_us,
        done.write_us
    );
    println!(
        "VMs started, seen running and stopped: {made} in 2 s of wall time, {cpu:.2} s of CPU = {:.0} per CPU second",
        f64::from(made) / cpu.max(1e-9)
    );
    println!(
        "the VMM's memory beyond guest RAM: {per_vm} KiB per running VM (ten running, this process's smaps)"
    );

    // The filters, in two child processes of this bench, one after the other.
    match (filters_run(false), filters_run(true)) {
        (Some((open, open_run, open_futex)), Some((sealed, sealed_run, sealed_futex))) => {
            println!(
                "\nThe VM process's system call filters (per-thread lists with argument rules)\n"
            );
            header();
            let reference = stats(&open).0;
            row(
                "start -> first marker write, no filter (reference)",
                &open,
                Some(reference),
            );
            row(
                "start -> first marker write, every thread filtered",
                &sealed,
                Some(reference),
            );
            println!(
                "\none call on a vCPU thread, ns: KVM_RUN (ioctl rule) {open_run:.0} without, {sealed_run:.0} with the filter; futex wake (operation rule) {open_futex:.0} without, {sealed_futex:.0} with"
            );
        }
        _ => println!("\nthe filters' rows: a child run failed"),
    }
}
