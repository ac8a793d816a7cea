//! Upstream connections for a network process that has no network of its own.
//!
//! `sandbox-net` runs in an empty network namespace: were a guest to take it over, it would find
//! no route to the host's loopback, a cloud metadata service or the local network. Each upstream
//! connection its stack needs it asks for over the dialer's socket ([`Dialer`], in the network
//! process); the service answers ([`serve`]): it checks the name and port against the sandbox's
//! allowlist, resolves the name itself and checks every address
//! ([`sandbox_egress::upstream::connect`]), connects, and passes the connected socket back. The
//! service never reads what flows over that socket.
//!
//! Both sides read the other as hostile: lines are bounded ([`MAX_DIAL_LINE`]), the service
//! makes at most [`MAX_DIALS`] connections of one sandbox at once and refuses a descriptor sent
//! its way, and the network process waits at most [`DIAL_TIMEOUT`] for an answer.
//!
//! The service may go away and come back (a crash, an upgrade) while the process runs on. The
//! dialer's socket ends with it: the dials waiting on it fail, and so does each later one, at
//! once (the guest's connection is reset, not left hanging), until the service that adopts the
//! process brings a new socket ([`Dialer::attach`]).

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sandbox_control::line::{Reader, send};
use sandbox_control::net::{Dial, DialResult, Dialed, MAX_DIAL_LINE};
use sandbox_egress::addr::Blocked;
use sandbox_egress::policy::Allowlist;
use sandbox_egress::resolve::ResolveOverrides;
use sandbox_egress::upstream::{self, UpstreamError};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// Connections the service makes for one sandbox at once. The network process keeps its own
/// requests to this many in flight (more wait their turn), so only a process that no longer
/// follows its own code is answered [`DialResult::Busy`]. Each may hold one of the service's
/// resolver threads for up to [`upstream::RESOLVE_TIMEOUT`]: the bound keeps a few hostile
/// sandboxes from taking them all.
pub const MAX_DIALS: usize = 16;
/// How long the network process waits for an answer: the service's own bounds (resolving,
/// then connecting) and a margin.
pub const DIAL_TIMEOUT: Duration = upstream::RESOLVE_TIMEOUT
    .saturating_add(upstream::CONNECT_TIMEOUT)
    .saturating_add(Duration::from_secs(5));

/// The service's send buffer on a dialer's socket.
const SEND_BUFFER: usize = 8 * 1024;
/// How long the service waits to write an answer before it stops answering that process.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// An answer as the network process takes it: the result, and the socket that came with it.
type Answer = (DialResult, Option<OwnedFd>);
/// An answer as the service sends it.
type Reply = (Dialed, Option<OwnedFd>);

/// The network process's side: asks the service for each upstream connection, over a socket
/// the service may replace ([`Dialer::attach`]): a service that went away and came back
/// (`Request::Adopt`) brings a new one. While there is none, each dial fails at once.
pub struct Dialer {
    /// Requests, each with the generation of the socket it is meant for, to the thread that
    /// writes them.
    requests: SyncSender<(Dial, u64)>,
    /// Requests in flight, at most [`MAX_DIALS`].
    slots: tokio::sync::Semaphore,
    shared: Arc<Shared>,
    next: AtomicU64,
}

/// What the dialer and its threads share.
#[derive(Default)]
struct Shared {
    /// The socket requests go out on.
    link: Mutex<Link>,
    /// Answers awaited, by request id.
    pending: Mutex<HashMap<u64, Waiter>>,
}

/// The dialer's socket now: each one attached is a generation of its own, so the end of one
/// fails only the requests that went out on it, and its late answers resolve nothing of the next.
#[derive(Default)]
struct Link {
    /// `None` while the service is away.
    sock: Option<Arc<UnixStream>>,
    generation: u64,
}

/// One dial waiting for its answer.
struct Waiter {
    /// The generation of the socket its request went out on.
    generation: u64,
    answer: oneshot::Sender<Answer>,
}

/// Locks `m`, whatever a thread that panicked holding it left (the maps stay consistent: each
/// change is one call).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// The socket of the generation now, if one is attached.
    fn current(&self) -> Option<(Arc<UnixStream>, u64)> {
        let link = lock(&self.link);
        link.sock.clone().map(|s| (s, link.generation))
    }

    /// Lets generation `generation`'s socket go, if it is still the one: the service is away
    /// until a new one is attached. The socket is shut down, so the service (if still there)
    /// sees the end, and a write blocked on it returns.
    fn detach(&self, generation: u64) {
        let mut link = lock(&self.link);
        if link.generation == generation
            && let Some(s) = link.sock.take()
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Fails request `id` now: its waiter is dropped, and its dial answers with an error.
    fn fail(&self, id: u64) {
        lock(&self.pending).remove(&id);
    }
}

impl Dialer {
    /// Starts the threads that write requests to `sock` and read its answers (the stack's
    /// runtime never blocks on the socket).
    pub fn start(sock: UnixStream) -> io::Result<Dialer> {
        let shared: Arc<Shared> = Arc::default();
        let (requests, rx) = sync_channel::<(Dial, u64)>(MAX_DIALS);
        let out = shared.clone();
        // One writer for every socket the dialer is given: a request meant for a socket that
        // has gone since, or whose write fails, fails at once.
        std::thread::Builder::new()
            .name("dial-out".into())
            .spawn(move || {
                for (d, generation) in rx {
                    let sent = match out.current() {
                        Some((sock, g)) if g == generation => {
                            let sent = send(&sock, &d, None).is_ok();
                            if !sent {
                                out.detach(generation);
                            }
                            sent
                        }
                        _ => false,
                    };
                    if !sent {
                        out.fail(d.id);
                    }
                }
            })?;
        let dialer = Dialer {
            requests,
            slots: tokio::sync::Semaphore::new(MAX_DIALS),
            shared,
            next: AtomicU64::new(1),
        };
        dialer.attach(sock)?;
        Ok(dialer)
    }

    /// Makes `sock` the dialer's socket (the service came back: `Request::Adopt`), with a thread
    /// that reads its answers. The socket it replaces, if any, is shut down: the dials waiting on
    /// it fail, as they do when it ends by itself.
    pub fn attach(&self, sock: UnixStream) -> io::Result<()> {
        let sock = Arc::new(sock);
        let mut link = lock(&self.shared.link);
        let generation = link.generation + 1;
        let (shared, reading) = (self.shared.clone(), sock.clone());
        std::thread::Builder::new()
            .name("dial-in".into())
            .spawn(move || answers(&shared, &reading, generation))?;
        if let Some(old) = link.sock.replace(sock) {
            let _ = old.shutdown(std::net::Shutdown::Both);
        }
        link.generation = generation;
        Ok(())
    }

    /// Lets the socket go (the connection that brought it was not adopted after all): dials
    /// fail at once until another is attached.
    pub fn detach(&self) {
        let generation = lock(&self.shared.link).generation;
        self.shared.detach(generation);
    }

    fn forget(&self, id: u64) {
        self.shared.fail(id);
    }
}

/// Reads the answers on `sock` (generation `generation`) until it ends, and hands each to its
/// dial.
fn answers(shared: &Shared, sock: &UnixStream, generation: u64) {
    let mut reader = Reader::with_limit(sock, MAX_DIAL_LINE);
    while let Ok(Some(d)) = reader.read::<Dialed>() {
        // Only a connected answer carries a socket: one read may bring a failed answer and then
        // a connected one with its socket, which stays queued for it.
        let fd = match d.result {
            DialResult::Connected { .. } => reader.take_fd(),
            _ => None,
        };
        let waiter = {
            let mut pending = lock(&shared.pending);
            match pending.get(&d.id) {
                Some(w) if w.generation == generation => pending.remove(&d.id),
                _ => None,
            }
        };
        if let Some(w) = waiter {
            let _ = w.answer.send((d.result, fd));
        }
    }
    // The socket has ended (the service has gone, or said something that is no answer): first
    // no request goes out on it any more, then every dial waiting on it fails. In that order, a
    // dial that registers in between finds the socket gone when its request is to be written,
    // and fails then.
    shared.detach(generation);
    lock(&shared.pending).retain(|_, w| w.generation != generation);
}

/// Why a dial failed that no service answers: it has gone, and no other has come back yet.
const GONE: &str = "the service's dialer has gone";

fn failed(name: &str, message: impl Into<String>) -> UpstreamError {
    UpstreamError::Connect {
        name: name.to_string(),
        source: io::Error::other(message.into()),
    }
}

#[async_trait]
impl upstream::Dial for Dialer {
    async fn dial(&self, name: &str, port: u16) -> Result<(TcpStream, SocketAddr), UpstreamError> {
        tokio::time::timeout(DIAL_TIMEOUT, self.dial_in_turn(name, port))
            .await
            .unwrap_or_else(|_| Err(failed(name, "the service did not answer in time")))
    }
}

impl Dialer {
    async fn dial_in_turn(
        &self,
        name: &str,
        port: u16,
    ) -> Result<(TcpStream, SocketAddr), UpstreamError> {
        let _slot = self
            .slots
            .acquire()
            .await
            .map_err(|_| failed(name, "the dialer has stopped"))?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        // The service is away (it ended and has not come back yet): no request can go out.
        let Some((_, generation)) = self.shared.current() else {
            return Err(failed(name, GONE));
        };
        let (tx, rx) = oneshot::channel();
        lock(&self.shared.pending).insert(
            id,
            Waiter {
                generation,
                answer: tx,
            },
        );
        let request = Dial {
            id,
            name: name.to_string(),
            port,
        };
        if let Err(e) = self.requests.try_send((request, generation)) {
            self.forget(id);
            return Err(failed(
                name,
                match e {
                    TrySendError::Full(_) => "too many connections are being made at once",
                    TrySendError::Disconnected(_) => "the dialer has stopped",
                },
            ));
        }
        // Dropped by the timeout above, the request is forgotten and its late answer's socket
        // closed; answered, it is already gone.
        let _forget = Forget(self, id);
        let answer = match rx.await {
            Ok(a) => a,
            Err(_) => return Err(failed(name, GONE)),
        };
        match answer {
            (DialResult::Connected { addr }, Some(fd)) => {
                let s = std::net::TcpStream::from(fd);
                s.set_nonblocking(true)
                    .map_err(|e| failed(name, e.to_string()))?;
                let s = TcpStream::from_std(s).map_err(|e| failed(name, e.to_string()))?;
                Ok((s, addr))
            }
            (DialResult::Connected { .. }, None) => {
                Err(failed(name, "the service's answer came without its socket"))
            }
            (DialResult::Resolve { message }, _) => Err(UpstreamError::Resolve {
                name: name.to_string(),
                source: io::Error::other(message),
            }),
            (DialResult::Internal { addr, why }, _) => match Blocked::from_label(&why) {
                Some(why) => Err(UpstreamError::Internal {
                    name: name.to_string(),
                    addr,
                    why,
                }),
                None => Err(failed(name, format!("{addr} is refused ({why})"))),
            },
            (DialResult::Connect { message }, _) => Err(failed(name, message)),
            (DialResult::NotAllowed, _) => Err(failed(
                name,
                "the service refused it: not in the sandbox's allowlist",
            )),
            (DialResult::Busy, _) => Err(failed(
                name,
                "the service is making too many connections for this sandbox at once",
            )),
        }
    }
}

/// Forgets request `.1` when dropped (its dial was given up).
struct Forget<'a>(&'a Dialer, u64);

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.0.forget(self.1);
    }
}

/// What the service may connect to for one sandbox.
pub struct Rules {
    /// The sandbox's allowlist, with the operator's routed ports.
    pub allow: Allowlist,
    /// The operator's resolution overrides.
    pub overrides: Arc<ResolveOverrides>,
}

/// Why the service stopped answering a network process's dials.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Starting its threads.
    #[error("starting the dialer's threads: {0}")]
    Start(#[from] io::Error),
}

/// The service's side: answers the dials of one network process on `sock` until it goes away,
/// making the connections on `rt`. Returns once its threads run.
pub fn serve(
    sock: UnixStream,
    rules: Rules,
    rt: tokio::runtime::Handle,
    on_violation: impl FnOnce(String) + Send + 'static,
) -> Result<(), ServeError> {
    // Room for every connection in flight and as many immediate refusals: a task never waits
    // for room (it never blocks the service's runtime); only a process that stopped reading its
    // answers fills it, and then loses answers, which it would not read anyway.
    let (answers, rx) = sync_channel::<Reply>(2 * MAX_DIALS);
    // Sockets in flight to a process that stops reading are few (a small send buffer holds
    // some ten answers), and a write that cannot go on for long ends the dialer: each is a
    // descriptor the kernel charges to the service's user.
    socket2::SockRef::from(&sock).set_send_buffer_size(SEND_BUFFER)?;
    sock.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let writer = sock.try_clone()?;
    std::thread::Builder::new()
        .name("dialer-out".into())
        .spawn(move || {
            for (d, fd) in rx {
                if send(&writer, &d, fd.as_ref().map(AsRawFd::as_raw_fd)).is_err() {
                    return;
                }
            }
        })?;
    let rules = Arc::new(rules);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_DIALS));
    let resolver = Arc::new(Bounded {
        threads: Arc::new(tokio::sync::Semaphore::new(MAX_DIALS)),
    });
    std::thread::Builder::new()
        .name("dialer-in".into())
        .spawn(move || {
            let mut reader = Reader::with_limit(&sock, MAX_DIAL_LINE);
            loop {
                let d = match reader.read::<Dial>() {
                    Ok(Some(d)) => d,
                    Ok(None) => return,
                    Err(e) => return on_violation(format!("its dialer's request: {e}")),
                };
                if reader.take_fd().is_some() {
                    return on_violation("it sent a descriptor to the dialer".into());
                }
                let reply = |result| (Dialed { id: d.id, result }, None);
                let name = match sandbox_egress::policy::normalize(&d.name) {
                    Some(n) if rules.allow.allows_port(&n, d.port) => n,
                    _ => {
                        if answers.send(reply(DialResult::NotAllowed)).is_err() {
                            return;
                        }
                        continue;
                    }
                };
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    if answers.send(reply(DialResult::Busy)).is_err() {
                        return;
                    }
                    continue;
                };
                let (answers, rules, resolver) = (answers.clone(), rules.clone(), resolver.clone());
                rt.spawn(async move {
                    let answer = connect(d.id, &name, d.port, &rules, &resolver).await;
                    // Given back before the answer goes: the process may ask again as soon as
                    // it has it, and must not find this slot still taken.
                    drop(slot);
                    let _ = answers.try_send(answer);
                });
            }
        })?;
    Ok(())
}

/// The host's resolver for one sandbox's dials, each lookup holding one of its threads' slots
/// until the lookup's thread is done: a lookup that times out keeps running (the C library's
/// resolver cannot be cancelled), so the slots bound the service's threads one sandbox's names
/// can hold, not only its waiting dials.
struct Bounded {
    threads: Arc<tokio::sync::Semaphore>,
}

#[async_trait]
impl upstream::Resolve for Bounded {
    async fn lookup(&self, name: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
        let slot = self
            .threads
            .clone()
            .acquire_owned()
            .await
            .map_err(io::Error::other)?;
        let target = (name.to_string(), port);
        tokio::task::spawn_blocking(move || {
            let _slot = slot;
            std::net::ToSocketAddrs::to_socket_addrs(&target).map(Iterator::collect)
        })
        .await
        .map_err(io::Error::other)?
    }
}

/// One connection, as the answer to request `id`.
async fn connect(id: u64, name: &str, port: u16, rules: &Rules, resolver: &Bounded) -> Reply {
    let result = upstream::connect(name, port, &rules.overrides, resolver).await;
    let (result, fd) = match result {
        Ok((s, addr)) => match s.into_std() {
            Ok(s) => (DialResult::Connected { addr }, Some(OwnedFd::from(s))),
            Err(e) => (
                DialResult::Connect {
                    message: e.to_string(),
                },
                None,
            ),
        },
        Err(UpstreamError::Resolve { source, .. }) => (
            DialResult::Resolve {
                message: source.to_string(),
            },
            None,
        ),
        Err(UpstreamError::Internal { addr, why, .. }) => (
            DialResult::Internal {
                addr,
                why: why.as_str().to_string(),
            },
            None,
        ),
        Err(UpstreamError::Connect { source, .. }) => (
            DialResult::Connect {
                message: source.to_string(),
            },
            None,
        ),
    };
    (Dialed { id, result }, fd)
}
