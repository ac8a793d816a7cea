//! A sandbox's network process (issue 32): `sandbox-net`, jailed with a uid of its own, in new
//! namespaces (an empty network namespace among them: it has no route anywhere), in a cgroup of
//! its own bounded by the sandbox's egress memory. The service starts it with the sandbox's
//! settings, hands the VM process the other end of its frames' socket, makes its upstream
//! connections for it (`sandbox_net::dial`: only to what the sandbox's allowlist names, never to
//! an internal address), and asks it for reports over a bounded channel it reads as hostile
//! (`sandbox_control::net`): the service never parses a guest's frames, and a guest that takes
//! its network process over holds that sandbox's secrets alone and reaches no more than it could
//! before.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandbox_control::line::{Reader, send};
use sandbox_control::net::{Event, MAX_COUNTS, MAX_REPORT, NetConfig, Report, Request, VERSION};
use sandbox_vmm::backend::VmExit;
use sandbox_vmm::supervised::{Classify, Ending, Kind, Spawn, Supervised};

/// How long the process may take to start its stack and answer.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a network process may take to answer an adoption (it answers at once: no stack
/// to start).
const ADOPT_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest path a Unix socket may be bound at (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;
/// How long a report may take.
const REPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the counts `/metrics` asks for may take (a late process is not asked again).
const COUNTS_TIMEOUT: Duration = Duration::from_secs(1);
/// What the process may hold besides its stack's buffers (its runtime, threads, the system's
/// roots; TLS sessions are the buffers' budget): its cgroup's memory is the egress memory plus
/// this, and admission counts both. It holds 5-6 MiB resident (benches/egress.rs).
pub const ALLOWANCE_MIB: u64 = 32;
/// The most of its messages kept for the log.
const MAX_LOG: usize = 16 * 1024;
/// The longest a reap waits after SIGKILL.
const REAP_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a sandbox's network process did not start.
#[derive(Debug, thiserror::Error)]
pub enum NetProcessError {
    /// The settings are the request's fault.
    #[error("{0}")]
    Bad(String),
    /// The host's side failed.
    #[error("{0}")]
    Internal(String),
}

/// A running network process.
pub struct NetProcess {
    process: Supervised,
    channel: Mutex<Channel>,
    /// The last report it gave: what the API shows once it has gone (its sandbox's VM died, or
    /// it did).
    last: Mutex<Report>,
    /// What the next run of the service needs to take it on again: its token and its cgroup's
    /// memory limit (`None`: it dies with this service).
    adoptable: Option<(String, u64)>,
}

/// What the service keeps of a sandbox's network process to take it on again after a restart
/// (issue 32): which process it is, and the token it must answer with. Its socket is found
/// from the sandbox's id ([`socket_path`]), not from the record.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetRecord {
    /// Its pid.
    pub pid: u32,
    /// Its start time (clock ticks since boot).
    pub start_time: u64,
    /// Its uid, when it has one of its own.
    pub uid: Option<u32>,
    /// Its cgroup's directories.
    pub cgroup: Vec<PathBuf>,
    /// Its cgroup's memory limit in MiB.
    pub memory_mib: u64,
    /// The token it was started with and answers an adoption with.
    pub token: String,
}

/// The directory of sandbox `id`'s network process under the state directory: the staging of
/// its root while it starts, then the socket it listens on for the service's next run.
fn process_dir(state_dir: &Path, id: &str) -> PathBuf {
    state_dir.join(format!("net-{id}"))
}

/// The socket sandbox `id`'s network process listens on (one that may outlive the service).
pub fn socket_path(state_dir: &Path, id: &str) -> PathBuf {
    process_dir(state_dir, id).join("control.sock")
}

struct Channel {
    sock: UnixStream,
    reader: Reader,
    /// Set once a request failed: the process is not asked again.
    broken: bool,
}

/// What a started network process gives the sandbox.
pub struct Started {
    /// The process.
    pub process: Arc<NetProcess>,
    /// The VM's end of the frames' socket.
    pub vm_socket: OwnedFd,
    /// The sandbox CA's certificate, when it intercepts anything.
    pub ca_pem: Option<String>,
    /// The guest's variables.
    pub env: Vec<(String, String)>,
}

/// Where `sandbox-net` is: `SANDBOX_HOST_NET_BINARY`, else beside this program (or one directory
/// up, for cargo's test binaries in `deps/`).
pub fn net_binary() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("SANDBOX_HOST_NET_BINARY").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    [dir.join("sandbox-net"), dir.join("../sandbox-net")]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "the network program sandbox-net is not beside {} (build it with `cargo build \
                 -p sandbox-net --bins`, or set SANDBOX_HOST_NET_BINARY)",
                exe.display()
            )
        })
}

/// The host's files the TLS roots are read from (before the process seals itself), where they
/// exist: bound read-only into the process's otherwise empty root. No resolver's file: the
/// service resolves its names.
fn host_files() -> Vec<sandbox_jail::Bind> {
    [
        // The roots' bundles only, never a private key directory beside them.
        "/etc/ssl/certs",
        "/etc/pki/ca-trust/extracted",
        "/etc/pki/tls/certs",
        "/etc/ca-certificates",
    ]
    .into_iter()
    .map(PathBuf::from)
    .filter(|p| p.exists())
    .map(|p| sandbox_jail::Bind {
        src: p.clone(),
        dst: p,
        writable: false,
    })
    .collect()
}

impl NetProcess {
    /// Starts the network process of sandbox `id` with `cfg`, its root staged under
    /// `state_dir`. One that may `outlive` the service listens on [`socket_path`] for its next
    /// run, which takes it on again with [`NetProcess::adopt`].
    pub async fn start(
        id: &str,
        cfg: &NetConfig,
        state_dir: &Path,
        outlive: bool,
    ) -> Result<Started, NetProcessError> {
        let program = net_binary().map_err(NetProcessError::Internal)?;
        let rules =
            sandbox_net::start::dial_rules(cfg).map_err(|e| NetProcessError::Bad(e.to_string()))?;
        let (sock, theirs) = UnixStream::pair().map_err(|e| internal("its channel", &e))?;
        let (vm_socket, frames) = UnixStream::pair().map_err(|e| internal("its frames", &e))?;
        let (log_r, log_w) = std::io::pipe().map_err(|e| internal("its log", &e))?;
        // A directory for its root's staging (and its socket), named apart from the sandboxes'.
        let dir = process_dir(state_dir, id);
        let staging = dir.join("root");
        std::fs::create_dir_all(&staging).map_err(|e| internal("its root", &e))?;
        let mut fds: Vec<OwnedFd> = vec![theirs.into(), frames.into(), log_w.into()];
        let mut cfg = cfg.clone();
        if outlive {
            let path = socket_path(state_dir, id);
            if path.as_os_str().len() > MAX_SOCKET_PATH {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(NetProcessError::Internal(format!(
                    "the network process's socket {} is longer than the {MAX_SOCKET_PATH} bytes a \
                     socket's path may have: give SANDBOX_HOST_STATE_DIR a shorter path",
                    path.display()
                )));
            }
            let made = std::os::unix::net::UnixListener::bind(&path)
                .map_err(|e| internal(&format!("its socket {}", path.display()), &e))
                .and_then(|l| {
                    let token =
                        sandbox_vmm::adopt::new_token().map_err(|e| internal("its token", &e))?;
                    Ok((l, token))
                });
            let (listener, token) = made.inspect_err(|_| {
                let _ = std::fs::remove_dir_all(&dir);
            })?;
            fds.push(listener.into());
            cfg.token = token;
        }
        let memory_mib = (cfg.memory_bytes >> 20) + ALLOWANCE_MIB;
        let process = Supervised::spawn(
            Spawn {
                kind: Kind {
                    name: "the network process",
                    state_dir: Some(dir.clone()),
                    reap_within: REAP_TIMEOUT,
                    line: std::convert::identity,
                },
                cmd: jail_command(id, program, &cfg, &dir, fds, outlive),
                outputs: vec![],
            },
            Box::new(NetEnd),
        )
        .await;
        // The root was built in the process's own mount namespace before the spawn returned:
        // the host's staging directory has done its part, so nothing is left for a crash.
        let _ = std::fs::remove_dir_all(&staging);
        if process.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let process = process.map_err(|e| {
            let e = match e {
                sandbox_vmm::VmError::Start(why) => why.to_string(),
                e => e.to_string(),
            };
            NetProcessError::Internal(format!("the sandbox's network process: {e}"))
        })?;
        let log_id = id.to_string();
        std::thread::spawn(move || log_lines(&log_id, log_r));
        let pid = process.pid();
        log_unasked_end(&process, id);
        let (their_dialer, me) = serve_dialer(id, pid, rules)?;
        let answer = handshake(sock, &cfg, their_dialer).await;
        let adoptable = outlive.then(|| (std::mem::take(&mut cfg.token), memory_mib));
        for s in &mut cfg.secrets {
            zeroize::Zeroize::zeroize(&mut s.value);
        }
        let (sock, reader, ca_pem, env) = answer?;
        #[cfg(target_os = "linux")]
        sealed(pid).map_err(|e| internal("its seal", &e))?;
        let process = Arc::new(NetProcess {
            process,
            channel: Mutex::new(Channel {
                sock,
                reader: reader.within(REPORT_TIMEOUT),
                broken: false,
            }),
            last: Mutex::new(Report::default()),
            adoptable,
        });
        let _ = me.set(Arc::downgrade(&process));
        Ok(Started {
            process,
            vm_socket: vm_socket.into(),
            ca_pem,
            env,
        })
    }

    /// Takes on again sandbox `id`'s network process that a previous run of the service left
    /// running (`record` says which): shown to be that process (its pid, start time, uid and
    /// cgroup), connected on its socket, given a new dialer (the old one ended with the old
    /// service) under the rules of `cfg` (the sandbox's settings, secrets' values not needed),
    /// and answering with its token. On failure a process that was adopted is killed.
    pub async fn adopt(
        id: &str,
        record: &NetRecord,
        cfg: &NetConfig,
        state_dir: &Path,
    ) -> Result<Arc<NetProcess>, String> {
        let rules = sandbox_net::start::dial_rules(cfg).map_err(|e| e.to_string())?;
        let identity = sandbox_jail::Identity {
            pid: record.pid,
            start_time: record.start_time,
            uid: record.uid,
            cgroup: record.cgroup.clone(),
        };
        let kind = Kind {
            name: "the network process",
            state_dir: Some(process_dir(state_dir, id)),
            reap_within: REAP_TIMEOUT,
            line: std::convert::identity,
        };
        let process = Supervised::adopt(
            kind,
            identity,
            format!("{id}-net"),
            record.memory_mib,
            Box::new(NetEnd),
        )
        .await
        .map_err(|e| e.to_string())?;
        let pid = process.pid();
        let (their_dialer, me) = serve_dialer(id, pid, rules).map_err(|e| e.to_string())?;
        let path = socket_path(state_dir, id);
        let token = record.token.clone();
        let answer = tokio::task::spawn_blocking(move || -> Result<_, String> {
            let sock = UnixStream::connect(&path)
                .map_err(|e| format!("connecting to {}: {e}", path.display()))?;
            let sent = send(&sock, &Request::Adopt, Some(their_dialer.as_raw_fd()));
            drop(their_dialer);
            sent.map_err(|e| format!("asking it to be adopted: {e}"))?;
            let mut reader = Reader::with_limit(&sock, MAX_REPORT).within(ADOPT_TIMEOUT);
            let event = reader
                .read::<Event>()
                .map_err(|e| format!("its answer: {e}"))?;
            if reader.take_fd().is_some() {
                return Err("it sent a descriptor".into());
            }
            match event {
                Some(Event::Adopted { version, .. }) if version != VERSION => Err(format!(
                    "it speaks version {version} of its channel, this sandbox host {VERSION} (an \
                     upgrade that changed the channel cannot take it on)"
                )),
                Some(Event::Adopted { token: t, .. })
                    if sandbox_vmm::adopt::same_token(&t, &token) =>
                {
                    Ok((sock, reader))
                }
                Some(Event::Adopted { .. }) => Err("it answered with another token".into()),
                Some(_) => Err("it answered an adoption with something else".into()),
                None => Err("it closed the connection".into()),
            }
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r);
        let (sock, reader) = match answer {
            Ok(a) => a,
            Err(e) => {
                process
                    .kill(format!("it could not be taken on again: {e}"))
                    .await;
                return Err(e);
            }
        };
        log_unasked_end(&process, id);
        let net = Arc::new(NetProcess {
            process,
            channel: Mutex::new(Channel {
                sock,
                reader: reader.within(REPORT_TIMEOUT),
                broken: false,
            }),
            last: Mutex::new(Report::default()),
            adoptable: Some((record.token.clone(), record.memory_mib)),
        });
        let _ = me.set(Arc::downgrade(&net));
        Ok(net)
    }

    /// What takes it on again after a restart (`None` for one that dies with the service, or
    /// has ended).
    pub fn record(&self) -> Option<NetRecord> {
        let (token, memory_mib) = self.adoptable.as_ref()?;
        let identity = self.process.identity()?;
        Some(NetRecord {
            pid: identity.pid,
            start_time: identity.start_time,
            uid: identity.uid,
            cgroup: identity.cgroup,
            memory_mib: *memory_mib,
            token: token.clone(),
        })
    }

    /// Its report now (blocking, bounded by [`REPORT_TIMEOUT`]); the last good one when it does
    /// not answer, or answers with what is not a report within its bounds.
    pub fn report(&self) -> Report {
        self.ask_for(Request::Report)
    }

    /// Its counts now, without the lists of a report (what `/metrics` reads), as
    /// [`NetProcess::report`] otherwise.
    pub fn counts(&self) -> Report {
        self.ask_for(Request::Counts)
    }

    fn ask_for(&self, request: Request) -> Report {
        let mut ch = self.channel.lock().unwrap_or_else(|e| e.into_inner());
        if !ch.broken {
            let full = matches!(request, Request::Report);
            match ask(&mut ch, &request) {
                Ok(r) if full => {
                    *self.last.lock().unwrap_or_else(|e| e.into_inner()) = r.clone();
                    return r;
                }
                Ok(r) if r.events.is_empty() && r.usage.calls.is_empty() => return r,
                Ok(_) => {
                    ch.broken = true;
                    tracing::warn!(
                        pid = self.process.pid(),
                        "a sandbox's network process answered a request for counts with lists"
                    );
                }
                Err(e) => {
                    ch.broken = true;
                    tracing::warn!(pid = self.process.pid(), "a sandbox's network process: {e}");
                }
            }
        }
        self.last.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Ends it for breaking the dialer's protocol: its end is not one the service asked for.
    pub fn kill(&self) {
        self.process.signal(libc::SIGKILL);
    }

    /// Ends it because its sandbox is disposed of (dropping the last reference does the same).
    pub fn end(&self) {
        self.process.end();
    }

    /// Its report, from an async context.
    pub async fn report_async(self: &Arc<Self>) -> Report {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.report())
            .await
            .unwrap_or_default()
    }

    /// Hands it `frames`, its end of the socket pair of the sandbox's next VM process (a
    /// resume): the service keeps no end of a VM's frames.
    pub fn relink(&self, frames: OwnedFd) -> Result<(), String> {
        let mut ch = self.channel.lock().unwrap_or_else(|e| e.into_inner());
        if ch.broken {
            return Err("it no longer answers".into());
        }
        let sent = send(&ch.sock, &Request::Relink, Some(frames.as_raw_fd()));
        drop(frames);
        let answer = sent
            .map_err(|e| format!("relinking it: {e}"))
            .and_then(|()| ch.reader.read::<Event>().map_err(|e| e.to_string()));
        let fd = ch.reader.take_fd();
        match answer {
            Ok(Some(Event::Relinked)) if fd.is_none() => Ok(()),
            other => {
                ch.broken = true;
                Err(format!(
                    "it did not take the resumed VM's frames: {other:?}"
                ))
            }
        }
    }

    /// [`NetProcess::relink`], from an async context.
    pub async fn relink_async(self: &Arc<Self>, frames: OwnedFd) -> Result<(), String> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.relink(frames))
            .await
            .map_err(|e| e.to_string())?
    }

    /// Its counts, from an async context.
    pub async fn counts_async(self: &Arc<Self>) -> Report {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.counts())
            .await
            .unwrap_or_default()
    }
}

/// Serves the dialer of sandbox `id`'s process `pid` under `rules`: the process's end of its
/// socket, and where the process goes once it exists, so that one which breaks the dialer's
/// protocol (it no longer follows its own code) is ended (its sandbox loses its network), not
/// only logged.
#[allow(clippy::type_complexity)]
fn serve_dialer(
    id: &str,
    pid: u32,
    rules: sandbox_net::dial::Rules,
) -> Result<
    (
        UnixStream,
        Arc<std::sync::OnceLock<std::sync::Weak<NetProcess>>>,
    ),
    NetProcessError,
> {
    let (dialer, their_dialer) = UnixStream::pair().map_err(|e| internal("its dialer", &e))?;
    let me: Arc<std::sync::OnceLock<std::sync::Weak<NetProcess>>> = Arc::default();
    let end = me.clone();
    let hostile = id.to_string();
    sandbox_net::dial::serve(dialer, rules, tokio::runtime::Handle::current(), move |e| {
        tracing::warn!(id = hostile, pid, "a sandbox's network process, ended: {e}");
        if let Some(p) = end.get().and_then(std::sync::Weak::upgrade) {
            p.kill();
        }
    })
    .map_err(|e| internal("its dialer", &e))?;
    Ok((their_dialer, me))
}

/// A failure on the host's side of starting the process, said as such.
fn internal(what: &str, e: &dyn std::fmt::Display) -> NetProcessError {
    NetProcessError::Internal(format!("the sandbox's network process: {what}: {e}"))
}

/// The jail of sandbox `id`'s network process: its own uid, an empty network namespace, a root
/// with the system's TLS roots alone, its memory the sandbox's egress memory and an allowance.
fn jail_command(
    id: &str,
    program: PathBuf,
    cfg: &NetConfig,
    dir: &Path,
    fds: Vec<OwnedFd>,
    outlive: bool,
) -> sandbox_jail::Command {
    sandbox_jail::Command {
        name: format!("{id}-net"),
        program: Some(program),
        args: vec![],
        fds,
        root: Some(sandbox_jail::Root {
            staging: dir.join("root"),
            system: true,
            binds: host_files(),
            ..Default::default()
        }),
        limits: sandbox_jail::Limits {
            memory_bytes: cfg.memory_bytes.saturating_add(ALLOWANCE_MIB << 20),
            // The runtime's worker and blocking threads, the dialer's two, the channel's.
            pids: 16,
            cpu_weight: 100,
            cpus: 2,
        },
        nofile: 1024,
        fsize: Some(0),
        keep_groups: vec![],
        seccomp: true,
        host_network: false,
        outlive,
    }
}

/// An end the service did not ask for is said in the log, with its cause.
fn log_unasked_end(process: &Supervised, id: &str) {
    let mut ended = process.exit_watch();
    let (id, pid) = (id.to_string(), process.pid());
    tokio::spawn(async move {
        if let Ok(e) = ended.wait_for(Option::is_some).await
            && let Some(e) = e.as_ref()
            && !e.requested
        {
            tracing::warn!(id, pid, "a sandbox's network process ended: {}", e.reason);
        }
    });
}

/// Sends the process its settings with its dialer's socket (the secrets' values overwritten
/// once sent) and reads its answer within [`START_TIMEOUT`]: the sandbox CA's certificate and
/// the guest's variables, or why it refused.
async fn handshake(
    sock: UnixStream,
    cfg: &NetConfig,
    their_dialer: UnixStream,
) -> Result<(UnixStream, Reader, Option<String>, Vec<(String, String)>), NetProcessError> {
    let mut start = Request::Start(cfg.clone());
    let answer = tokio::task::spawn_blocking(move || -> Result<_, String> {
        let sent = send(&sock, &start, Some(their_dialer.as_raw_fd()));
        drop(their_dialer);
        if let Request::Start(cfg) = &mut start {
            for s in &mut cfg.secrets {
                zeroize::Zeroize::zeroize(&mut s.value);
            }
        }
        sent.map_err(|e| e.to_string())?;
        let mut reader = Reader::with_limit(&sock, MAX_REPORT).within(START_TIMEOUT);
        let event = reader.read::<Event>().map_err(|e| e.to_string())?;
        if reader.take_fd().is_some() {
            return Err("it sent a descriptor".into());
        }
        Ok((sock, reader, event))
    })
    .await
    .map_err(|e| internal("its start", &e))?;
    let (sock, reader, event) = answer.map_err(|e| internal("its start", &e))?;
    match event {
        Some(Event::Started { ca_pem, env }) => Ok((sock, reader, ca_pem, env)),
        Some(Event::Refused {
            bad_request: true,
            message,
        }) => Err(NetProcessError::Bad(message)),
        Some(Event::Refused { message, .. }) => Err(NetProcessError::Internal(message)),
        Some(Event::Report(_) | Event::Relinked | Event::Adopted { .. }) => Err(internal(
            "its start",
            &"an answer to no request before it started",
        )),
        None => Err(internal("its start", &"it ended without an answer")),
    }
}

/// How a network process ended, for the log and the sandbox's errors.
struct NetEnd;

impl Classify for NetEnd {
    fn classify(self: Box<Self>, e: Ending) -> VmExit {
        let reason = if let Some(killed) = e.killed {
            killed
        } else if e.status.oom_kills > 0 {
            format!(
                "out of memory: the sandbox's network process used more than its limit of {} MiB \
                 (the egress memory, SANDBOX_HOST_EGRESS_MEMORY_MIB, and its allowance) and the \
                 kernel killed it",
                e.memory_mib
            )
        } else if e.status.signal() == Some(libc::SIGSYS) {
            "the network process made a system call outside its seccomp filter: a bug of \
             sandbox-net, or a guest that took it over"
                .into()
        } else if e.requested {
            "stopped by the host".into()
        } else if let Some(sig) = e.status.signal() {
            format!("the network process was killed by signal {sig}")
        } else {
            format!(
                "the network process exited with status {}",
                e.status.code().unwrap_or(-1)
            )
        };
        VmExit {
            reason,
            requested: e.requested,
            console: e.console,
        }
    }
}

/// Checks that the process `pid` runs under its own seccomp filter (it installs it before it
/// answers that it started): a `sandbox-net` that did not is not trusted with a guest. The
/// jail's floor alone has fewer programs than the process's own filter
/// ([`sandbox_net::seal::PROGRAMS`]), so the count tells them apart.
#[cfg(target_os = "linux")]
fn sealed(pid: u32) -> Result<(), String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("reading its status: {e}"))?;
    let filters = status
        .lines()
        .find_map(|l| l.strip_prefix("Seccomp_filters:"))
        .and_then(|n| n.trim().parse::<usize>().ok());
    let mode = status.lines().any(|l| l == "Seccomp:\t2");
    if mode && filters.is_none_or(|n| n >= sandbox_net::seal::PROGRAMS) {
        Ok(())
    } else {
        Err(format!(
            "process {pid} started without its seccomp filter: it is not the sandbox-net built \
             with this service (check SANDBOX_HOST_NET_BINARY)"
        ))
    }
}

/// One report over the channel, checked.
fn ask(ch: &mut Channel, request: &Request) -> Result<Report, String> {
    // Counts are small and asked of every sandbox on each scrape: a smaller line and less time.
    let (limit, within) = match request {
        Request::Counts => (MAX_COUNTS, COUNTS_TIMEOUT),
        _ => (MAX_REPORT, REPORT_TIMEOUT),
    };
    ch.reader.set_limit(limit);
    ch.reader.set_within(within);
    send(&ch.sock, request, None).map_err(|e| format!("asking for a report: {e}"))?;
    let event = ch.reader.read::<Event>();
    if ch.reader.take_fd().is_some() {
        return Err("it sent a descriptor on its channel".into());
    }
    match event {
        Ok(Some(Event::Report(r))) => {
            let (reasons, unmetered) = sandbox_net::report::labels();
            r.check(&reasons, &unmetered).map_err(|e| e.to_string())?;
            Ok(*r)
        }
        Ok(Some(_)) => Err("it answered a report with something else".into()),
        Ok(None) => Err("it has ended".into()),
        Err(e) => Err(format!("its report: {e}")),
    }
}

/// The process's own messages, a bounded amount of them, into the service's log: read in fixed
/// chunks, lines cut at 1 KiB (a process taken over by its guest could write without a line feed,
/// without end). Past [`MAX_LOG`] bytes the rest is read slowly and dropped: the writer is held
/// back by its full pipe, never failed (a write error to its standard error would end it).
fn log_lines(id: &str, mut r: std::io::PipeReader) {
    use std::io::Read;
    let (mut line, mut chunk, mut read) = (Vec::with_capacity(1024), [0u8; 4096], 0);
    let say = |line: &mut Vec<u8>| {
        if !line.is_empty() {
            tracing::warn!(id, "{}", String::from_utf8_lossy(line));
            line.clear();
        }
    };
    loop {
        let n = match r.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if read >= MAX_LOG {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        read += n;
        for &b in &chunk[..n] {
            if b == b'\n' || line.len() == 1024 {
                say(&mut line);
            }
            if b != b'\n' {
                line.push(b);
            }
        }
    }
    say(&mut line);
}
