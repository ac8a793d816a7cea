//! What an escaped VM process would try, tried from inside the jail, one case per process.
//!
//! This test binary is also the payload: the jailed process is this very executable, run with
//! `--exact payload`, reading its case from descriptor 3. Each case must end "BLOCKED" (exit 0)
//! or be killed by the seccomp filter (SIGSYS); "ESCAPED" (exit 1) fails the test. Cases other
//! than the filter's own run twice, with and without the filter, so each other layer is shown to
//! hold on its own.
//!
//! Needs root or subordinate ids, user namespaces and cgroups: says "skipped" and why where the
//! host has none of them (CI runs it as root).

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use sandbox_jail::{Command, Jailer, Limits, Mode, Root, Settings};

const MEMORY: u64 = 64 << 20;
const PIDS: u64 = 16;
const FSIZE: u64 = 1 << 20;

/// Set in the run of this binary as the ordinary user `sandbox-host` (see
/// `the_same_escapes_fail_when_the_service_is_an_ordinary_user`).
const INNER: &str = "SANDBOX_HOST_JAIL_TEST_UNPRIVILEGED";

fn jailer() -> Option<Jailer> {
    let j = Jailer::new(&Settings {
        mode: Mode::Required,
        ids: None,
        cgroup_parent: std::env::var("SANDBOX_HOST_CGROUP")
            .unwrap_or_else(|_| "sandbox-host-test".into()),
        instance: format!("pid-{}", std::process::id()),
    });
    if std::env::var_os(INNER).is_some() {
        // The documented setup: an ordinary user whose subordinate ids give each VM its own.
        assert_eq!(j.status().ids, "per-vm", "{:?}", j.status());
    }
    if let Some(r) = &j.status().refusal {
        if std::env::var_os("SANDBOX_HOST_REQUIRE_E2E").is_some() {
            panic!("the jail cannot be applied here, and CI requires it: {r}");
        }
        eprintln!("skipped: the jail cannot be applied here: {r}");
        return None;
    }
    Some(j)
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 into our array.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: two new descriptors we own.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

struct Outcome {
    out: String,
    exit: sandbox_jail::Exit,
    uid: Option<u32>,
    /// The limits files of its groups, read while it ran: (file name, content).
    limits: Vec<(String, String)>,
}

/// The CPU and memory limits of the groups `pid` is in, as the kernel shows them.
fn group_limits(pid: u32) -> Vec<(String, String)> {
    let groups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let mut dirs = vec![];
    for line in groups.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let path = path.trim_start_matches('/');
        if ctrls.is_empty() {
            dirs.push(Path::new("/sys/fs/cgroup").join(path));
        } else if ctrls.split(',').any(|c| c == "cpu") {
            dirs.push(Path::new("/sys/fs/cgroup/cpu").join(path));
        }
    }
    let files = [
        "cpu.max",
        "memory.oom.group",
        "cpu.cfs_quota_us",
        "cpu.cfs_period_us",
    ];
    dirs.iter()
        .flat_map(|d| files.iter().map(move |f| (f, d.join(f))))
        .filter_map(|(f, p)| {
            Some((
                f.to_string(),
                std::fs::read_to_string(p).ok()?.trim().to_string(),
            ))
        })
        .collect()
}

/// Runs one case of the payload in a fresh jail.
fn run_case(j: &Jailer, case: &str, seccomp: bool, scratch: &Path) -> Outcome {
    let (case_r, case_w) = pipe();
    let (out_r, out_w) = pipe();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(scratch.join(format!("file-{}", rand_suffix())))
        .unwrap();
    let null = std::fs::File::open("/dev/null").unwrap();
    let staging = tempfile::tempdir_in(scratch).unwrap();
    let mut w = std::fs::File::from(case_w);
    w.write_all(case.as_bytes()).unwrap();
    drop(w);
    let name = format!("t{}-{}", std::process::id(), rand_suffix());
    let jailed = j
        .spawn(Command {
            name,
            program: Some(std::env::current_exe().unwrap()),
            args: [
                "--exact",
                "payload",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
                "-q",
            ]
            .map(Into::into)
            .to_vec(),
            fds: vec![
                null.into(),
                out_w.try_clone().unwrap(),
                out_w,
                case_r,
                file.into(),
            ],
            root: Some(Root {
                staging: staging.path().to_path_buf(),
                system: true,
                ..Root::default()
            }),
            limits: Limits {
                memory_bytes: MEMORY,
                pids: PIDS,
                cpu_weight: 100,
                cpus: 1,
            },
            nofile: 64,
            fsize: Some(FSIZE),
            keep_groups: vec![],
            seccomp,
            host_network: false,
            outlive: false,
        })
        .unwrap_or_else(|e| panic!("spawning the payload for {case}: {e}"));
    let uid = status_uid(jailed.pid());
    let limits = group_limits(jailed.pid());
    let mut out = String::new();
    let mut r = std::fs::File::from(out_r);
    // The payload's output ends when it (and every process it made) is gone.
    let reader = std::thread::spawn(move || {
        let _ = r.read_to_string(&mut out);
        out
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let exit = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(60), jailed.wait()).await })
        .unwrap_or_else(|_| panic!("case {case} did not end within 60 s"));
    let out = reader.join().unwrap();
    Outcome {
        out,
        exit,
        uid,
        limits,
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn status_uid(pid: u32) -> Option<u32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The cases every layer but the filter must stop alone.
const CASES: &[&str] = &[
    "host_file",
    "service_dirs",
    "proc_of_service",
    "signal_service",
    "ptrace_service",
    "network",
    "abstract_socket",
    "mount",
    "new_user_namespace",
    "regain_root",
    "write_outside",
    "devices",
    "descriptors_and_environment",
    "file_size",
    "capabilities",
    "fork_past_pids_max",
];

#[test]
fn every_escape_fails() {
    let Some(j) = jailer() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let secret = scratch.path().join("secret");
    std::fs::write(&secret, "the real key").unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let abstract_name = format!("sandbox-jail-test-{}", std::process::id());
    let _abstract = abstract_listener(&abstract_name);
    let me = std::process::id();
    let mut failures = vec![];
    for seccomp in [true, false] {
        for case in CASES {
            let arg = match *case {
                "host_file" => secret.display().to_string(),
                "service_dirs" => scratch.path().display().to_string(),
                "proc_of_service" | "signal_service" | "ptrace_service" => me.to_string(),
                "network" => port.to_string(),
                "abstract_socket" => abstract_name.clone(),
                _ => String::new(),
            };
            let o = run_case(&j, &format!("{case} {arg}"), seccomp, scratch.path());
            let killed_by_filter = o.exit.signal() == Some(libc::SIGSYS);
            let blocked = o.exit.code() == Some(0) && o.out.contains("BLOCKED");
            eprintln!(
                "{case:28} seccomp={seccomp:5} -> {}",
                if killed_by_filter {
                    "killed by seccomp".to_string()
                } else {
                    o.out.trim().lines().last().unwrap_or("").to_string()
                }
            );
            if !(blocked || seccomp && killed_by_filter) {
                failures.push(format!(
                    "{case} (seccomp {seccomp}): status {:#x}, output {:?}",
                    o.exit.status, o.out
                ));
            }
        }
    }
    assert!(failures.is_empty(), "escapes: {failures:#?}");
}

#[test]
fn a_syscall_outside_the_filter_kills() {
    let Some(j) = jailer() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let o = run_case(&j, "keyctl", true, scratch.path());
    assert_eq!(o.exit.signal(), Some(libc::SIGSYS), "{}", o.out);
    // The same call without the filter is merely refused, which is what the filter adds.
    let o = run_case(&j, "keyctl", false, scratch.path());
    assert_eq!(o.exit.code(), Some(0), "{}", o.out);
}

#[test]
fn memory_past_the_limit_is_killed_by_the_oom_killer() {
    let Some(j) = jailer() else { return };
    if j.status().cgroup.is_none() {
        eprintln!("skipped: no cgroup here");
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let o = run_case(&j, "memory", true, scratch.path());
    assert_eq!(o.exit.signal(), Some(libc::SIGKILL), "{}", o.out);
    assert!(o.exit.oom_kills > 0, "{o:?}", o = o.out);
}

#[test]
fn a_group_bounds_its_cpu_time_to_its_cpus_and_is_killed_whole() {
    let Some(j) = jailer() else { return };
    let Some(version) = j.status().cgroup else {
        eprintln!("skipped: no cgroup here");
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let o = run_case(&j, "sleep", true, scratch.path());
    let get = |f: &str| {
        o.limits
            .iter()
            .find(|(n, _)| n == f)
            .map(|(_, v)| v.as_str())
    };
    // One CPU (the case's `cpus: 1`) per 100 ms period, where the kernel has the files (what it
    // lacks is listed under `unenforced`).
    let lacks = |what: &str| j.status().unenforced.iter().any(|u| u.contains(what));
    if lacks("processor time") {
        eprintln!("skipped: {:?}", j.status().unenforced);
        return;
    }
    if version == "v2" {
        assert_eq!(get("cpu.max"), Some("100000 100000"), "{:?}", o.limits);
        if !lacks("OOM kill") {
            assert_eq!(get("memory.oom.group"), Some("1"), "{:?}", o.limits);
        }
    } else {
        assert_eq!(get("cpu.cfs_quota_us"), Some("100000"), "{:?}", o.limits);
        assert_eq!(get("cpu.cfs_period_us"), Some("100000"), "{:?}", o.limits);
    }
}

#[test]
fn no_two_jails_share_a_uid() {
    let Some(j) = jailer() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| run_case(&j, "sleep", true, scratch.path()));
        let b = s.spawn(|| run_case(&j, "sleep", true, scratch.path()));
        (a.join().unwrap(), b.join().unwrap())
    });
    let (ua, ub) = (a.uid.expect("uid of a"), b.uid.expect("uid of b"));
    assert_ne!(ua, ub);
    // SAFETY: getuid cannot fail.
    let me = unsafe { libc::getuid() };
    assert!(
        ua != me && ub != me,
        "a jail runs as the service's uid {me}"
    );
}

/// The same jail, applied by a service that runs as the ordinary user `sandbox-host` (with the
/// subordinate ids and the delegated cgroup of the operator guide's "The jail"): this binary runs
/// its escape, uid and memory tests again as that user.
#[test]
fn the_same_escapes_fail_when_the_service_is_an_ordinary_user() {
    if std::env::var_os(INNER).is_some() {
        return;
    }
    let require = std::env::var_os("SANDBOX_HOST_REQUIRE_E2E").is_some();
    // SAFETY: getuid cannot fail.
    if unsafe { libc::getuid() } != 0 {
        eprintln!("skipped: becoming the user sandbox-host needs root");
        return;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let Some((uid, gid)) = passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.first() == Some(&"sandbox-host") && f.len() > 3)
            .then(|| (f[2].to_string(), f[3].to_string()))
    }) else {
        assert!(
            !require,
            "no user sandbox-host: scripts/install-deps.sh adds it"
        );
        eprintln!("skipped: no user sandbox-host (scripts/install-deps.sh adds it)");
        return;
    };
    // The binary where that user can run it.
    let dir = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let copy = dir.path().join("escape");
    std::fs::copy(std::env::current_exe().unwrap(), &copy).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
    // The cgroup the operator gives the service's user.
    let parent = format!("sandbox-host-unprivileged-{}", std::process::id());
    let mut made = vec![];
    if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        let d = Path::new("/sys/fs/cgroup").join(&parent);
        std::fs::create_dir_all(&d).unwrap();
        let _ = std::fs::write(
            "/sys/fs/cgroup/cgroup.subtree_control",
            "+memory +pids +cpu",
        );
        let _ = std::fs::write(d.join("cgroup.subtree_control"), "+memory +pids +cpu");
        for f in ["", "cgroup.procs", "cgroup.subtree_control"] {
            chown(&d.join(f), &uid, &gid);
        }
        made.push(d);
    } else {
        for c in ["memory", "pids", "cpu"] {
            let d = Path::new("/sys/fs/cgroup").join(c).join(&parent);
            if std::fs::create_dir_all(&d).is_ok() {
                chown(&d, &uid, &gid);
                made.push(d);
            }
        }
    }
    let out = std::process::Command::new("setpriv")
        .args(["--reuid", &uid, "--regid", &gid, "--clear-groups", "--"])
        .arg(&copy)
        .args([
            "--exact",
            "every_escape_fails",
            "no_two_jails_share_a_uid",
            "memory_past_the_limit_is_killed_by_the_oom_killer",
            "a_syscall_outside_the_filter_kills",
            "--test-threads",
            "1",
        ])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("HOME", "/tmp")
        .env(INNER, "1")
        .env("SANDBOX_HOST_CGROUP", &parent)
        .env("SANDBOX_HOST_REQUIRE_E2E", "1")
        .output()
        .unwrap();
    // Nested groups first, then the parents.
    for d in &made {
        if let Ok(entries) = std::fs::read_dir(d) {
            for e in entries.flatten().filter(|e| e.path().is_dir()) {
                if let Ok(leaves) = std::fs::read_dir(e.path()) {
                    for l in leaves.flatten().filter(|l| l.path().is_dir()) {
                        let _ = std::fs::remove_dir(l.path());
                    }
                }
                let _ = std::fs::remove_dir(e.path());
            }
        }
        let _ = std::fs::remove_dir(d);
    }
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "as the user sandbox-host: {text}");
    assert!(text.contains("test result: ok. 4 passed"), "{text}");
}

fn chown(p: &Path, uid: &str, gid: &str) {
    let st = std::process::Command::new("chown")
        .arg(format!("{uid}:{gid}"))
        .arg(p)
        .status()
        .unwrap();
    assert!(st.success(), "chown {}", p.display());
}

fn abstract_listener(name: &str) -> OwnedFd {
    // SAFETY: socket/bind/listen on a sockaddr_un we fill in.
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let mut addr: libc::sockaddr_un = std::mem::zeroed();
        addr.sun_family = libc::AF_UNIX as u16;
        for (i, b) in name.bytes().enumerate() {
            addr.sun_path[i + 1] = b as libc::c_char;
        }
        let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as u32;
        assert_eq!(libc::bind(fd, (&raw const addr).cast(), len), 0);
        assert_eq!(libc::listen(fd, 4), 0);
        OwnedFd::from_raw_fd(fd)
    }
}

// ---- The payload: runs inside the jail. ----

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn say(blocked: bool, what: &str) -> ! {
    println!("{} {what}", if blocked { "BLOCKED" } else { "ESCAPED" });
    let _ = std::io::stdout().flush();
    // SAFETY: ends the process.
    unsafe { libc::_exit(if blocked { 0 } else { 1 }) }
}

fn c(s: &str) -> std::ffi::CString {
    std::ffi::CString::new(s).unwrap()
}

#[test]
#[ignore = "the jailed payload of every_escape_fails, run only inside the jail"]
fn payload() {
    // Descriptor 3 holds the case; run outside the jail, there is none and this does nothing.
    // SAFETY: F_GETFD on a number.
    if unsafe { libc::fcntl(3, libc::F_GETFD) } < 0 {
        return;
    }
    // SAFETY: descriptor 3 is the case pipe the test passed.
    let mut f = unsafe { std::fs::File::from_raw_fd(3) };
    let mut case = String::new();
    f.read_to_string(&mut case).unwrap();
    let mut words = case.split_whitespace();
    let name = words.next().unwrap_or("");
    let arg = words.next().unwrap_or("");
    // SAFETY: (the whole block) raw system calls with local buffers, the point of this payload.
    unsafe {
        match name {
            "host_file" => {
                for p in ["/etc/passwd", "/etc/shadow", "/root/.bashrc", arg] {
                    if libc::open(c(p).as_ptr(), libc::O_RDONLY) >= 0 {
                        say(false, &format!("opened {p}"));
                    }
                }
                say(true, "no host file is visible")
            }
            "service_dirs" => {
                let p = c(arg);
                let fd = libc::open(p.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY);
                say(
                    fd < 0,
                    &format!("open of the service's directory: errno {}", errno()),
                )
            }
            "proc_of_service" => {
                for p in [
                    format!("/proc/{arg}/environ"),
                    format!("/proc/{arg}/mem"),
                    "/proc/1/environ".into(),
                ] {
                    if p.starts_with("/proc/1/") {
                        continue; // our own process in our own pid namespace
                    }
                    if libc::open(c(&p).as_ptr(), libc::O_RDONLY) >= 0 {
                        say(false, &format!("opened {p}"));
                    }
                }
                say(true, "the service's /proc is not visible")
            }
            "signal_service" => {
                let pid: i32 = arg.parse().unwrap();
                let r = libc::kill(pid, 0);
                let e = errno();
                let all = libc::kill(-1, libc::SIGCONT);
                say(
                    r != 0 && e == libc::ESRCH && all != 0,
                    &format!("kill: errno {e}"),
                )
            }
            "ptrace_service" => {
                let pid: i32 = arg.parse().unwrap();
                let r = libc::ptrace(libc::PTRACE_ATTACH, pid, 0, 0);
                say(r != 0, &format!("ptrace: errno {}", errno()))
            }
            "network" => {
                let port: u16 = arg.parse().unwrap();
                for ip in [[127, 0, 0, 1], [1, 1, 1, 1], [10, 0, 2, 2]] {
                    let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
                    if fd < 0 {
                        continue;
                    }
                    let addr = libc::sockaddr_in {
                        sin_family: libc::AF_INET as u16,
                        sin_port: if ip == [127, 0, 0, 1] {
                            port.to_be()
                        } else {
                            80u16.to_be()
                        },
                        sin_addr: libc::in_addr {
                            s_addr: u32::from_ne_bytes(ip),
                        },
                        sin_zero: [0; 8],
                    };
                    let r = libc::connect(
                        fd,
                        (&raw const addr).cast(),
                        std::mem::size_of_val(&addr) as u32,
                    );
                    if r == 0 {
                        say(false, &format!("connected to {ip:?}"));
                    }
                }
                say(true, "no network")
            }
            "abstract_socket" => {
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let mut addr: libc::sockaddr_un = std::mem::zeroed();
                addr.sun_family = libc::AF_UNIX as u16;
                for (i, b) in arg.bytes().enumerate() {
                    addr.sun_path[i + 1] = b as libc::c_char;
                }
                let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + arg.len()) as u32;
                let r = libc::connect(fd, (&raw const addr).cast(), len);
                say(
                    r != 0,
                    &format!(
                        "connect to the service's abstract socket: errno {}",
                        errno()
                    ),
                )
            }
            "mount" => {
                let r = libc::mount(
                    c("tmpfs").as_ptr(),
                    c("/usr").as_ptr(),
                    c("tmpfs").as_ptr(),
                    0,
                    std::ptr::null(),
                );
                let r2 = libc::umount2(c("/usr").as_ptr(), libc::MNT_DETACH);
                say(r != 0 && r2 != 0, &format!("mount: errno {}", errno()))
            }
            "new_user_namespace" => {
                // From a single-threaded child: unshare refuses a user namespace to a
                // multi-threaded process anyway (EINVAL), which would prove nothing.
                let pid = libc::fork();
                if pid == 0 {
                    let r = libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS);
                    let e = errno();
                    libc::_exit(if r == 0 {
                        1
                    } else if e == libc::ENOSPC || e == libc::EPERM {
                        0
                    } else {
                        2
                    });
                }
                let mut status = 0;
                libc::waitpid(pid, &raw mut status, 0);
                let blocked = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
                    || libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS;
                say(
                    blocked,
                    &format!("unshare from a single-threaded child: status {status:#x}"),
                )
            }
            "regain_root" => {
                let ok = libc::setresuid(1, 1, 1) != 0
                    && libc::setgroups(0, std::ptr::null()) != 0
                    && libc::chroot(c("/usr").as_ptr()) != 0;
                say(
                    ok,
                    &format!("setresuid/setgroups/chroot: errno {}", errno()),
                )
            }
            "write_outside" => {
                for p in ["/evil", "/usr/evil", "/dev/evil"] {
                    if libc::open(c(p).as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o644) >= 0 {
                        say(false, &format!("created {p}"));
                    }
                }
                say(true, "the root is read-only")
            }
            "devices" => {
                for p in ["/dev/kvm", "/dev/sda", "/dev/vda", "/dev/mem"] {
                    if libc::open(c(p).as_ptr(), libc::O_RDWR) >= 0 {
                        say(false, &format!("opened {p}"));
                    }
                }
                let r = libc::mknod(
                    c("/dev/mem2").as_ptr(),
                    libc::S_IFCHR | 0o600,
                    libc::makedev(1, 1),
                );
                say(r != 0, "no device but the basic ones")
            }
            "descriptors_and_environment" => {
                for fd in 5..1024 {
                    if libc::fcntl(fd, libc::F_GETFD) >= 0 {
                        say(false, &format!("descriptor {fd} is open"));
                    }
                }
                // libtest itself sets nothing; the parent passed an empty environment.
                let env: Vec<_> = std::env::vars().collect();
                say(env.is_empty(), &format!("environment: {env:?}"))
            }
            "file_size" => {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                let buf = vec![7u8; 64 * 1024];
                let mut total = 0u64;
                while total < 4 * FSIZE {
                    let n = libc::write(4, buf.as_ptr().cast(), buf.len());
                    if n <= 0 {
                        break;
                    }
                    total += n as u64;
                }
                say(
                    total <= FSIZE,
                    &format!("wrote {total} bytes (limit {FSIZE})"),
                )
            }
            "capabilities" => {
                let nnp = libc::prctl(libc::PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0);
                let bound = (0..40)
                    .filter(|&c| libc::prctl(libc::PR_CAPBSET_READ, c, 0, 0, 0) == 1)
                    .count();
                let mut core = libc::rlimit {
                    rlim_cur: 1,
                    rlim_max: 1,
                };
                libc::getrlimit(libc::RLIMIT_CORE, &raw mut core);
                say(
                    nnp == 1 && bound == 0 && core.rlim_max == 0,
                    &format!(
                        "no_new_privs {nnp}, {bound} capabilities in the bounding set, core limit {}",
                        core.rlim_max
                    ),
                )
            }
            "fork_past_pids_max" => {
                let mut made = 0u64;
                for _ in 0..(PIDS * 4) {
                    let pid = libc::fork();
                    if pid == 0 {
                        libc::pause();
                        libc::_exit(0);
                    }
                    if pid < 0 {
                        break;
                    }
                    made += 1;
                }
                say(
                    made < PIDS,
                    &format!("made {made} processes (limit {PIDS})"),
                )
            }
            "keyctl" => {
                let r = libc::syscall(libc::SYS_keyctl, 0, 0, 0, 0, 0);
                say(r != 0, &format!("keyctl: errno {}", errno()))
            }
            "memory" => {
                let mut v: Vec<Vec<u8>> = vec![];
                for _ in 0..((4 * MEMORY) >> 20) {
                    v.push(vec![1u8; 1 << 20]);
                }
                say(false, &format!("touched {} MiB", v.len()))
            }
            "sleep" => {
                std::thread::sleep(Duration::from_millis(500));
                say(true, "slept")
            }
            other => say(false, &format!("unknown case {other:?}")),
        }
    }
}
