//! A control group per VM, so one guest touching all of its memory, forking without end or
//! spinning its vCPUs is stopped by the kernel at its own limit, not by the OOM killer choosing
//! among every sandbox (and the service) on the host.
//!
//! cgroup v2 (one unified hierarchy) is used where the host has it with its controllers; else the
//! v1 controllers `memory`, `pids` and `cpu` under `/sys/fs/cgroup/<controller>`. Each service
//! instance keeps its VMs under `<parent>/<instance>/vm-<name>`, so a restarted service can
//! remove what a crashed one left without touching another instance's VMs.

use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

use crate::spec::Limits;

/// Why a VM's control group could not be made or used.
#[derive(Debug, Error)]
pub enum CgroupError {
    /// A file or directory of the hierarchy could not be written.
    #[error("cgroup: {what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError {
    let path = path.to_path_buf();
    move |source| CgroupError::Io { what, path, source }
}

#[derive(Debug, Clone)]
enum Layout {
    /// The instance's directory in the unified hierarchy.
    V2(PathBuf),
    /// The instance's directory under each v1 controller that could be used.
    V1 {
        memory: Option<PathBuf>,
        pids: Option<PathBuf>,
        cpu: Option<PathBuf>,
        /// With a weight file: the host's I/O scheduler shares by weight (BFQ).
        blkio: Option<PathBuf>,
    },
}

/// Where this service instance makes its VMs' groups.
#[derive(Debug, Clone)]
pub struct Cgroups {
    layout: Layout,
    /// The optional limits' files this host has, probed at discovery.
    optional: Optional,
    /// The limits every VM's group lacks on this host, in the operator's words.
    unenforced: Vec<String>,
}

/// Files of limits a host may lack (an older kernel, no CFS bandwidth control, no I/O weight
/// scheduler): written where present, said where not, never a reason to refuse a VM.
#[derive(Debug, Clone, Default)]
struct Optional {
    /// `cpu.max` (v2) or `cpu.cfs_quota_us` (v1).
    cpu_bound: bool,
    /// `memory.oom.group` (v2, Linux 4.19).
    oom_group: bool,
    /// The I/O weight's file: `io.weight` (blk-iocost) or `io.bfq.weight` on v2,
    /// `blkio.weight` or `blkio.bfq.weight` on v1 (BFQ).
    io_weight: Option<&'static str>,
}

impl Optional {
    /// What is there under `dir` (a group whose parent enabled the controllers, as the VMs'
    /// groups will have them), and in words what is not.
    fn probe(
        cpu_dir: Option<&Path>,
        memory_dir: Option<&Path>,
        io_dir: Option<&Path>,
        v2: bool,
    ) -> (Optional, Vec<String>) {
        let has = |d: Option<&Path>, f: &str| d.is_some_and(|d| d.join(f).is_file());
        // A weight file is there whenever its scheduler is built; it weighs only where the
        // scheduler runs: blk-iocost enabled for a disk, or BFQ a disk's scheduler.
        let iocost_on = std::fs::read_to_string(Path::new(ROOT).join("io.cost.qos"))
            .is_ok_and(|q| q.contains("enable=1"));
        let bfq_on = std::fs::read_dir("/sys/block").is_ok_and(|disks| {
            disks.flatten().any(|d| {
                std::fs::read_to_string(d.path().join("queue/scheduler"))
                    .is_ok_and(|s| s.contains("[bfq]"))
            })
        });
        let weighs = |f: &&str| f.contains("bfq") && bfq_on || !f.contains("bfq") && iocost_on;
        let o = Optional {
            cpu_bound: has(cpu_dir, if v2 { "cpu.max" } else { "cpu.cfs_quota_us" }),
            oom_group: v2 && has(memory_dir, "memory.oom.group"),
            io_weight: if v2 {
                ["io.weight", "io.bfq.weight"]
            } else {
                ["blkio.weight", "blkio.bfq.weight"]
            }
            .into_iter()
            .filter(weighs)
            .find(|f| has(io_dir, f)),
        };
        let mut unenforced = vec![];
        if !o.cpu_bound {
            unenforced.push(
                "a bound on each VM's processor time (the kernel has no CFS bandwidth control \
                 here); the CPU weight still shares the processors"
                    .to_string(),
            );
        }
        if v2 && !o.oom_group {
            unenforced.push(
                "one OOM kill for the whole group (no memory.oom.group before Linux 4.19); \
                 each VM is one process, so its end is whole anyway"
                    .to_string(),
            );
        }
        if o.io_weight.is_none() {
            unenforced.push(
                "an I/O weight per VM (no disk here has blk-iocost enabled or the BFQ \
                 scheduler); one VM's disk traffic can slow the others'"
                    .to_string(),
            );
        }
        (o, unenforced)
    }
}

/// One VM's group, removed by [`Leaf::remove`] once its processes are gone.
#[derive(Debug)]
pub struct Leaf {
    dirs: Vec<PathBuf>,
    v2: bool,
    memory_dir: Option<PathBuf>,
}

const ROOT: &str = "/sys/fs/cgroup";

impl Cgroups {
    /// Finds (or, as root, makes) the directory for `instance` under `parent` (a path relative
    /// to the hierarchy's root, `sandbox-host` by default). Returns the groups and the controllers
    /// that are missing, or why none can be used.
    pub fn discover(parent: &str, instance: &str) -> Result<(Cgroups, Vec<String>), String> {
        let parent = parent.trim_matches('/');
        if Path::new(ROOT).join("cgroup.controllers").is_file() {
            return v2(parent, instance).map(|c| (c, vec![]));
        }
        // The I/O weight: only where the blkio controller has one (BFQ); not a part of the
        // jail whose absence refuses VMs, but the operator is told.
        let blkio = {
            let dir = Path::new(ROOT).join("blkio").join(parent).join(instance);
            let base = Path::new(ROOT).join("blkio");
            let weighted = ["blkio.weight", "blkio.bfq.weight"]
                .iter()
                .any(|f| base.join(f).is_file());
            (weighted && std::fs::create_dir_all(&dir).is_ok() && writable(&dir)).then_some(dir)
        };

        let mut missing = vec![];
        let mut one = |ctrl: &str| {
            let base = Path::new(ROOT).join(ctrl);
            if !base.join("cgroup.procs").is_file() {
                missing.push(format!("{ctrl} (not mounted)"));
                return None;
            }
            let dir = base.join(parent).join(instance);
            match std::fs::create_dir_all(&dir) {
                Ok(()) if writable(&dir) => Some(dir),
                Ok(()) => {
                    missing.push(format!("{ctrl} ({} is not writable)", dir.display()));
                    None
                }
                Err(e) => {
                    missing.push(format!("{ctrl} ({}: {e})", dir.display()));
                    None
                }
            }
        };
        let memory = one("memory");
        let pids = one("pids");
        let cpu = one("cpu");
        // v1 groups have the files of their controller as soon as they are made.
        let (optional, unenforced) =
            Optional::probe(cpu.as_deref(), memory.as_deref(), blkio.as_deref(), false);
        if memory.is_none() && pids.is_none() && cpu.is_none() {
            return Err(format!(
                "no cgroup controller can be used: {}",
                missing.join(", ")
            ));
        }
        Ok((
            Cgroups {
                layout: Layout::V1 {
                    memory,
                    pids,
                    cpu,
                    blkio,
                },
                optional,
                unenforced,
            },
            missing,
        ))
    }

    /// Removes the (empty) groups of instances named `pid-N` whose process is gone: tools and
    /// tests that start VMs without the service name their groups after their pid.
    pub fn remove_dead_instances(&self) {
        for dir in self.dirs() {
            let Some(parent) = dir.parent() else { continue };
            let Ok(entries) = std::fs::read_dir(parent) else {
                continue;
            };
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let Some(pid) = name
                    .strip_prefix("pid-")
                    .and_then(|p| p.parse::<u32>().ok())
                else {
                    continue;
                };
                if !Path::new(&format!("/proc/{pid}")).exists() {
                    let p = e.path();
                    if let Ok(leaves) = std::fs::read_dir(&p) {
                        for l in leaves.flatten().filter(|l| l.path().is_dir()) {
                            kill_all(&l.path());
                            remove_dir(&l.path());
                        }
                    }
                    let _ = std::fs::remove_dir(&p);
                }
            }
        }
    }

    /// The limits every VM's group lacks on this host, for the start-up warning and
    /// `/v1/health`: fairness between VMs, not confinement, so they never refuse VMs.
    pub fn unenforced(&self) -> &[String] {
        &self.unenforced
    }

    /// `v2` or `v1`, for the operator.
    pub fn version(&self) -> &'static str {
        match self.layout {
            Layout::V2(_) => "v2",
            Layout::V1 { .. } => "v1",
        }
    }

    fn dirs(&self) -> Vec<PathBuf> {
        match &self.layout {
            Layout::V2(d) => vec![d.clone()],
            Layout::V1 {
                memory,
                pids,
                cpu,
                blkio,
            } => [memory, pids, cpu, blkio]
                .into_iter()
                .flatten()
                .cloned()
                .collect(),
        }
    }

    /// Removes the groups a previous run of this instance left (killing what is still in them),
    /// except those in `keep` (the groups of processes this run adopted); returns how many VMs'
    /// groups there were.
    pub fn remove_stale(&self, keep: &[PathBuf]) -> usize {
        let mut removed = std::collections::BTreeSet::new();
        for dir in self.dirs() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                let p = e.path();
                if keep.contains(&p) {
                    continue;
                }
                if p.is_dir() && e.file_name().to_string_lossy().starts_with("vm-") {
                    kill_all(&p);
                    if remove_dir(&p) {
                        removed.insert(e.file_name());
                    }
                }
            }
        }
        removed.len()
    }

    /// The group at `dirs` (as [`Leaf::dirs`] gave them) of process `pid`, which a previous
    /// run of this service made for a process named `name`: each directory must be that
    /// process's group (`vm-<name>.<n>`) directly under one of this instance's, one per
    /// controller it uses, and hold `pid`. The record is the
    /// service's own, but it is read as if it were not: no path leads elsewhere.
    pub fn adopt(&self, dirs: &[PathBuf], pid: u32, name: &str) -> Result<Leaf, String> {
        let mine = self.dirs();
        if dirs.len() != mine.len() {
            return Err(format!(
                "{} directories recorded, this host uses {}",
                dirs.len(),
                mine.len()
            ));
        }
        let mut leaf = Leaf {
            dirs: vec![],
            v2: matches!(self.layout, Layout::V2(_)),
            memory_dir: None,
        };
        for (d, parent) in dirs.iter().zip(&mine) {
            let plain = d
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("vm-")?.strip_prefix(name)?.strip_prefix('.'))
                .is_some_and(|seq| !seq.is_empty() && seq.bytes().all(|b| b.is_ascii_digit()));
            if d.parent() != Some(parent.as_path()) || !plain {
                return Err(format!("{} is not one of this host's", d.display()));
            }
            let procs = std::fs::read_to_string(d.join("cgroup.procs"))
                .map_err(|e| format!("{}: {e}", d.display()))?;
            if !procs.lines().any(|l| l.trim().parse() == Ok(pid)) {
                return Err(format!("{} does not hold process {pid}", d.display()));
            }
            leaf.dirs.push(d.clone());
        }
        leaf.memory_dir = match &self.layout {
            Layout::V2(_) => leaf.dirs.first().cloned(),
            Layout::V1 { memory, .. } => memory
                .as_ref()
                .and_then(|m| leaf.dirs.iter().find(|d| d.parent() == Some(m.as_path())))
                .cloned(),
        };
        Ok(leaf)
    }

    /// Makes `vm-<name>.<n>` with `limits`, `n` counting this process's groups: two VMs given
    /// the same name (a caller's mistake, or tests) never share a group, and making one never
    /// touches another's. A group of the same full name (left by a crash of an earlier process
    /// of this instance) is replaced.
    pub fn create(&self, name: &str, limits: &Limits) -> Result<Leaf, CgroupError> {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let leaf_name = format!("vm-{name}.{n}");
        let mut leaf = Leaf {
            dirs: vec![],
            v2: matches!(self.layout, Layout::V2(_)),
            memory_dir: None,
        };
        let made = match &self.layout {
            Layout::V2(d) => self.make_v2(&mut leaf, d.join(&leaf_name), limits),
            Layout::V1 {
                memory,
                pids,
                cpu,
                blkio,
            } => {
                let under = |c: &Option<PathBuf>| c.as_ref().map(|d| d.join(&leaf_name));
                let dirs = [under(memory), under(pids), under(cpu), under(blkio)];
                self.make_v1(&mut leaf, dirs, limits)
            }
        };
        made.inspect_err(|_| leaf.remove())?;
        Ok(leaf)
    }

    /// The group in the unified hierarchy, at `dir`, with `limits`.
    fn make_v2(&self, leaf: &mut Leaf, dir: PathBuf, limits: &Limits) -> Result<(), CgroupError> {
        fresh_dir(&dir)?;
        leaf.dirs.push(dir.clone());
        leaf.memory_dir = Some(dir.clone());
        write(&dir.join("memory.max"), &limits.memory_bytes.to_string())?;
        // Swap would let a guest exceed its memory at the host's disk's expense.
        let swap = dir.join("memory.swap.max");
        if swap.exists() {
            write(&swap, "0")?;
        }
        write(&dir.join("pids.max"), &limits.pids.to_string())?;
        write(
            &dir.join("cpu.weight"),
            &limits.cpu_weight.clamp(1, 10_000).to_string(),
        )?;
        let o = &self.optional;
        if limits.cpus > 0 && o.cpu_bound {
            optional(
                &dir.join("cpu.max"),
                &format!("{} {CPU_PERIOD_US}", cpu_quota_us(limits.cpus)),
            );
        }
        // The kernel's OOM killer ends the whole group, never a part of it.
        if o.oom_group {
            optional(&dir.join("memory.oom.group"), "1");
        }
        if let Some(f) = o.io_weight {
            // BFQ's scale ends at 1000, iocost's at 10000.
            let top = if f.contains("bfq") { 1000 } else { 10_000 };
            let w = limits.cpu_weight.clamp(1, top);
            optional(&dir.join(f), &format!("default {w}"));
        }
        Ok(())
    }

    /// The groups under each v1 controller this host lets us use (memory, pids, cpu, blkio:
    /// `dirs` in that order), with `limits`.
    fn make_v1(
        &self,
        leaf: &mut Leaf,
        dirs: [Option<PathBuf>; 4],
        limits: &Limits,
    ) -> Result<(), CgroupError> {
        let [memory, pids, cpu, blkio] = dirs;
        let mut memory_dir = None;
        let mut fresh = |dir: Option<PathBuf>| -> Result<Option<PathBuf>, CgroupError> {
            let Some(dir) = dir else { return Ok(None) };
            fresh_dir(&dir)?;
            leaf.dirs.push(dir.clone());
            Ok(Some(dir))
        };
        if let Some(dir) = fresh(memory)? {
            write(
                &dir.join("memory.limit_in_bytes"),
                &limits.memory_bytes.to_string(),
            )?;
            let memsw = dir.join("memory.memsw.limit_in_bytes");
            if memsw.exists() {
                write(&memsw, &limits.memory_bytes.to_string())?;
            }
            memory_dir = Some(dir);
        }
        if let Some(dir) = fresh(pids)? {
            write(&dir.join("pids.max"), &limits.pids.to_string())?;
        }
        if let Some(dir) = fresh(cpu)? {
            let shares = (u64::from(limits.cpu_weight.clamp(1, 10_000)) * 1024 / 100).max(2);
            write(&dir.join("cpu.shares"), &shares.to_string())?;
            if limits.cpus > 0 && self.optional.cpu_bound {
                optional(&dir.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string());
                // Refused (EINVAL) above a parent's own quota: the parent bounds it.
                optional(
                    &dir.join("cpu.cfs_quota_us"),
                    &cpu_quota_us(limits.cpus).to_string(),
                );
            }
        }
        if let Some(dir) = fresh(blkio)? {
            // v1's scale is 10 to 1000, 500 a default group (100 on v2's).
            let weight = (limits.cpu_weight.clamp(1, 10_000) * 5).clamp(10, 1000);
            if let Some(f) = self.optional.io_weight {
                optional(&dir.join(f), &weight.to_string());
            }
        }
        leaf.memory_dir = memory_dir;
        Ok(())
    }
}

impl Leaf {
    /// Moves `pid` (and all its threads) into the group.
    pub fn add(&self, pid: u32) -> Result<(), CgroupError> {
        for d in &self.dirs {
            write(&d.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    /// How many times the kernel's OOM killer killed a process of this group for its limit.
    pub fn oom_kills(&self) -> u64 {
        let Some(d) = &self.memory_dir else {
            return 0;
        };
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        std::fs::read_to_string(d.join(file))
            .ok()
            .and_then(|t| {
                t.lines().find_map(|l| {
                    l.strip_prefix("oom_kill ")
                        .and_then(|n| n.trim().parse().ok())
                })
            })
            .unwrap_or(0)
    }

    /// The group's memory limit, as set.
    pub fn memory_limit(&self) -> Option<u64> {
        let d = self.memory_dir.as_ref()?;
        let file = if self.v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        };
        std::fs::read_to_string(d.join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// The directories of the group (one on v2, one per controller on v1).
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Removes the group once it is empty; kills anything still in it first.
    pub fn remove(&self) {
        for d in &self.dirs {
            kill_all(d);
            if !remove_dir(d) {
                tracing::warn!(dir = %d.display(), "could not remove a VM's cgroup");
            }
        }
    }
}

/// The CFS period of a VM's CPU bound: 100 ms, the kernel's default.
const CPU_PERIOD_US: u64 = 100_000;

fn cpu_quota_us(cpus: u32) -> u64 {
    u64::from(cpus) * CPU_PERIOD_US
}

fn v2(parent: &str, instance: &str) -> Result<Cgroups, String> {
    let root = Path::new(ROOT);
    let wanted = ["memory", "pids", "cpu"];
    // The parent chain must pass the controllers down: enable them from the root to the
    // instance's directory (as root), or find them already enabled (a delegated subtree).
    let dir = root.join(parent).join(instance);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut d = root.to_path_buf();
    for part in Path::new(parent).join(instance).components() {
        enable(&d, &wanted)?;
        d = d.join(part);
    }
    enable(&dir, &wanted)?;
    if !writable(&dir) {
        return Err(format!("{} is not writable", dir.display()));
    }
    // The io controller where the host already passes it down (systemd does): enabled in our
    // own groups only, never at the hierarchy's root. Its absence is said, not refused
    // (fairness between VMs, not confinement).
    let mut io = root_has(&root.join("cgroup.subtree_control"), "io");
    let mut d = root.to_path_buf();
    for part in Path::new(parent).join(instance).components() {
        d = d.join(part);
        io = io && enable(&d, &["io"]).is_ok();
    }
    // A group of the instance's shows the files its VMs' groups will have.
    let probe = dir.join(format!("probe-{}", std::process::id()));
    let _ = std::fs::create_dir(&probe);
    let (optional, unenforced) = Optional::probe(
        Some(&probe),
        Some(&probe),
        io.then_some(probe.as_path()),
        true,
    );
    let _ = std::fs::remove_dir(&probe);
    Ok(Cgroups {
        layout: Layout::V2(dir),
        optional,
        unenforced,
    })
}

/// Whether `control` (a `cgroup.subtree_control`) lists `controller`.
fn root_has(control: &Path, controller: &str) -> bool {
    std::fs::read_to_string(control)
        .unwrap_or_default()
        .split_whitespace()
        .any(|c| c == controller)
}

fn enable(dir: &Path, wanted: &[&str]) -> Result<(), String> {
    let control = dir.join("cgroup.subtree_control");
    let have = std::fs::read_to_string(&control).unwrap_or_default();
    let missing: Vec<String> = wanted
        .iter()
        .filter(|w| !have.split_whitespace().any(|h| h == **w))
        .map(|w| format!("+{w}"))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    std::fs::write(&control, missing.join(" ")).map_err(|e| {
        format!(
            "cannot enable {} in {}: {e}",
            missing.join(" "),
            control.display()
        )
    })
}

fn writable(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: access with a valid NUL-terminated path.
    unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
}

fn fresh_dir(dir: &Path) -> Result<(), CgroupError> {
    if dir.exists() {
        kill_all(dir);
        remove_dir(dir);
    }
    std::fs::create_dir(dir).map_err(io("creating", dir))
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(path, value).map_err(io("writing", path))
}

/// Writes a limit the host may refuse (a parent's tighter quota, a file of a scheduler that is
/// not the disk's): the VM runs without it, and the log says so.
fn optional(path: &Path, value: &str) {
    if let Err(e) = std::fs::write(path, value) {
        tracing::warn!(file = %path.display(), error = %e, "a VM's cgroup limit was not applied");
    }
}

/// SIGKILLs every process of a group (a stale one, or one whose VM process is gone). Each
/// through a pidfd, opened before the process's cgroup is checked to still be this one: a pid
/// that ended and was given to another process between the read and the kill is never signalled.
fn kill_all(dir: &Path) {
    let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) else {
        return;
    };
    let Some(group) = dir.file_name().and_then(|n| n.to_str()) else {
        return;
    };
    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        if pid <= 0 {
            continue;
        }
        // SAFETY: pidfd_open with integer arguments; a non-negative result is ours.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            continue;
        }
        // SAFETY: the descriptor is new and ours.
        let pidfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
        let mine = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .is_ok_and(|c| c.lines().any(|l| l.ends_with(&format!("/{group}"))));
        if mine {
            // SAFETY: pidfd_send_signal on our pidfd with no siginfo.
            unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    std::os::fd::AsRawFd::as_raw_fd(&pidfd),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            };
        }
    }
}

/// rmdir, retried for a moment: a group is busy until its last process is fully gone.
fn remove_dir(dir: &Path) -> bool {
    for _ in 0..50 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return true,
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    false
}
