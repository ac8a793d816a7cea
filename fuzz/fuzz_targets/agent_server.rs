//! The agent's frame server (`server::serve`, over a pair of pipes as its channel) fed frames by
//! a hostile host: pings, execs, stdin and upload data (empty closes), signals of any number,
//! windows of any value (0 and u32::MAX too), cancels, errors, unknown kinds and the agent's own
//! kinds, file and archive puts and gets, on streams reused, unknown, 0 and u32::MAX; written
//! in chunks that split frames anywhere, with garbage, frames with broken checksums, reserved
//! bytes or huge lengths between them, and short waits.
//!
//! This runs on the development machine, as root, and the agent runs what it is told to at the
//! paths it is told. So the harness alone builds every request: paths are a fresh scratch
//! directory plus a name of [a-z0-9] (one level), programs come from a fixed harmless list
//! ([`PROGRAMS`]), archives uploaded are built by the harness (files and directories with such
//! names), `Shutdown` (sync, then exit or reboot) and `Identity` (sets the clock) are never sent, and bytes from the input (data,
//! garbage, raw payloads) have every frame magic defused. Before anything is written, the whole
//! byte stream is decoded (at once and in the chunks it is written in) and the input is skipped
//! unless every frame in it is one the harness meant to send.
//!
//! Invariants: serve returns once the host closes its side and every stream ends within 5 s of
//! that (a watchdog aborts otherwise: the host's going away abandons the streams without killing
//! their programs, and every program of [`PROGRAMS`] ends once its stdin is closed), without a
//! panic; every frame the agent sends decodes, is
//! of a kind the agent sends, and its JSON payload parses; on no stream does the agent send more
//! data than the windows the host granted (the initial window per request on that stream id
//! plus every grant); no child process of the fuzzer is left once the streams ended; nothing
//! beside the scratch directory changed.
#![no_main]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use sandbox_agent::{ChannelSpec, Conn, Reaper};
use sandbox_fuzz::Input;
use sandbox_protocol::message::{
    Done, ErrorMessage, ExecRequest, ExitStatus, FilePut, PathRequest, Ready, SignalRequest,
    TermSize,
};
use sandbox_protocol::{Decoder, Frame, INITIAL_WINDOW, Kind};

/// What an `Exec` may run: argv (or a shell line, for `command`), all harmless. `WORD` is
/// replaced by a word of the input ([a-z0-9]).
const PROGRAMS: &[&[&str]] = &[
    &["/bin/cat"],
    &["/bin/echo", "WORD"],
    &["/bin/sh", "-c", "exit 3"],
    &["/bin/sleep", "0.05"],
    // 100 KB of output, and more than the initial window.
    &["/bin/sh", "-c", "head -c 102400 /dev/zero"],
    &["/bin/sh", "-c", "head -c 1200000 /dev/zero"],
    &["/bin/sh", "-c", "echo oops >&2; exit 1"],
    &["/nonexistent/sandbox-fuzz-no-such-program"],
];

/// How long the streams may take to end once the host closed its side.
const END_WITHIN: Duration = Duration::from_secs(5);
/// Waits (op 15) per input, in total.
const WAIT_BUDGET_MS: u64 = 30;
/// Execs per input (each is a process and up to four threads).
const MAX_EXECS: usize = 12;

/// Frame kinds a host frame built from the input's raw bytes may never have.
fn dangerous(kind: u8) -> bool {
    matches!(
        Kind::from_u8(kind),
        Some(
            Kind::Exec
                | Kind::FilePut
                | Kind::ArchivePut
                | Kind::ArchiveGet
                | Kind::FileGet
                | Kind::Shutdown
                // It reseeds the kernel's random generator and sets the clock of the machine
                // the fuzzer runs on.
                | Kind::Identity
                // It watches the fuzzer machine's directories (up to 8192 inotify watches each).
                | Kind::Watch
                // It connects to the fuzzer machine's ports.
                | Kind::PortOpen
        )
    )
}

/// The input's bytes with every frame magic defused.
fn defuse(b: &[u8]) -> Vec<u8> {
    let mut v = b.to_vec();
    for i in 0..v.len().saturating_sub(3) {
        if &v[i..i + 4] == b"SBX1" {
            v[i + 3] = b'2';
        }
    }
    v
}

/// A word of [a-z0-9] from the input (at most 12 characters).
fn word(input: &mut Input, empty_ok: bool) -> String {
    let n = usize::from(input.byte().unwrap_or(1) % 13);
    let w: String = input
        .bytes(n)
        .iter()
        .map(|b| char::from(b"abcdefghijklmnopqrstuvwxyz0123456789"[usize::from(*b) % 36]))
        .collect();
    if w.is_empty() && !empty_ok {
        "f".into()
    } else {
        w
    }
}

/// The watchdog: aborts the process (a crash libFuzzer keeps) when a deadline passes.
static DEADLINE: Mutex<Option<(Instant, &'static str)>> = Mutex::new(None);

fn arm(within: Duration, what: &'static str) {
    *DEADLINE.lock().unwrap() = Some((Instant::now() + within, what));
}

fn disarm() {
    *DEADLINE.lock().unwrap() = None;
}

fn reaper() -> &'static Reaper {
    static R: OnceLock<Reaper> = OnceLock::new();
    R.get_or_init(|| {
        // As the agent's binary runs: Rust's runtime ignores SIGPIPE before main (libFuzzer's
        // main is not Rust's), so writing to a process that exited is EPIPE, not death.
        // SAFETY: setting a signal's disposition to SIG_IGN has no memory preconditions.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        std::thread::spawn(|| {
            loop {
                std::thread::sleep(Duration::from_millis(50));
                if let Some((at, what)) = *DEADLINE.lock().unwrap() {
                    if Instant::now() > at {
                        eprintln!("agent_server watchdog: {what}");
                        std::process::abort();
                    }
                }
            }
        });
        Reaper::start()
    })
}

/// What the harness writes: bytes, or a pause.
enum Seg {
    Bytes(Vec<u8>),
    Wait(u64),
}

struct Session {
    segs: Vec<Seg>,
    /// Every intact frame written, as (kind, stream, payload).
    intended: HashSet<(u8, u32, Vec<u8>)>,
    /// Per stream id: requests opened on it, and bytes granted by Window frames.
    opens: HashMap<u32, u64>,
    grants: HashMap<u32, u64>,
    /// Stream ids an ArchivePut was sent on: raw data never goes there.
    archives: HashSet<u32>,
    execs: usize,
    waited: u64,
}

impl Session {
    fn frame(&mut self, kind: impl Into<u8>, stream: u32, payload: Vec<u8>) {
        let f = Frame::new(kind, stream, payload);
        if let Some(k) = Kind::from_u8(f.kind) {
            if matches!(
                k,
                Kind::Exec | Kind::FilePut | Kind::ArchivePut | Kind::ArchiveGet | Kind::FileGet
            ) {
                *self.opens.entry(stream).or_default() += 1;
            }
            if k == Kind::Window && f.payload.len() == 4 {
                let n = u32::from_le_bytes(f.payload[..].try_into().unwrap());
                *self.grants.entry(stream).or_default() += u64::from(n);
            }
        }
        self.segs.push(Seg::Bytes(f.encode()));
        self.intended.insert((f.kind, f.stream, f.payload));
    }

    fn json(&mut self, kind: Kind, stream: u32, v: &impl serde::Serialize) {
        self.frame(kind, stream, serde_json::to_vec(v).unwrap());
    }

    fn raw(&mut self, b: Vec<u8>) {
        self.segs.push(Seg::Bytes(b));
    }
}

fn stream(input: &mut Input) -> u32 {
    match input.byte().unwrap_or(1) % 10 {
        n @ 0..=6 => u32::from(n),
        7 => u32::MAX,
        8 => 0x8000_0000,
        _ => input.u32_le().unwrap_or(9),
    }
}

/// A tar of files and directories with [a-z0-9] names, as the harness allows.
fn safe_tar(input: &mut Input) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for _ in 0..input.byte().unwrap_or(1) % 4 {
        let dir = input.byte().unwrap_or(0) & 1 == 1;
        let name = word(input, false);
        let mut h = tar::Header::new_gnu();
        h.set_mode(u32::from(input.byte().unwrap_or(0x1a)) | 0o600);
        if dir {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_size(0);
            b.append_data(&mut h, &name, &[][..]).unwrap();
        } else {
            let n = usize::from(input.byte().unwrap_or(0));
            let data = input.bytes(n).to_vec();
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(data.len() as u64);
            b.append_data(&mut h, &name, &data[..]).unwrap();
        }
    }
    b.into_inner().unwrap()
}

/// The host's side of one input.
fn session(input: &mut Input, scratch: &Path) -> Session {
    let mut s = Session {
        segs: vec![],
        intended: HashSet::new(),
        opens: HashMap::new(),
        grants: HashMap::new(),
        archives: HashSet::new(),
        execs: 0,
        waited: 0,
    };
    let path = |name: &str| scratch.join(name).to_string_lossy().into_owned();
    for _ in 0..256 {
        let Some(op) = input.byte() else { break };
        match op % 16 {
            0 => {
                let id = stream(input);
                s.frame(Kind::Ping, id, vec![]);
            }
            1 => {
                let id = stream(input);
                let how = input.byte().unwrap_or(0);
                let w = word(input, true);
                if s.execs >= MAX_EXECS {
                    continue;
                }
                s.execs += 1;
                let argv: Vec<String> = PROGRAMS[usize::from(how) % PROGRAMS.len()]
                    .iter()
                    .map(|a| {
                        if *a == "WORD" {
                            w.clone()
                        } else {
                            (*a).to_owned()
                        }
                    })
                    .collect();
                let mut req = ExecRequest {
                    stdin: how & 0x10 != 0,
                    timeout_ms: (how & 0x20 != 0).then(|| u64::from(input.byte().unwrap_or(0))),
                    cwd: Some(path("")),
                    ..Default::default()
                };
                match how >> 6 {
                    0 | 1 => req.argv = Some(argv),
                    // The shell form, with a fixed line; or both forms, or neither (refused).
                    2 => req.command = Some("echo via-shell; exit 0".into()),
                    _ => {
                        if w.len() % 2 == 0 {
                            req.argv = Some(argv);
                            req.command = Some("true".into());
                        }
                    }
                }
                // On a terminal, now and then; a size of 0 rows is refused.
                if w.len() % 3 == 1 {
                    req.pty = Some(TermSize {
                        rows: u16::from(how & 0x0f),
                        cols: 80,
                    });
                }
                if how & 0x40 != 0 && how >> 6 < 2 {
                    req.env.insert("FUZZ_WORD".into(), w.clone());
                    // A working directory that may not exist.
                    req.cwd = Some(path(&w));
                }
                s.json(Kind::Exec, id, &req);
            }
            2 | 3 => {
                let kind = if op % 16 == 2 {
                    Kind::Stdin
                } else {
                    Kind::Data
                };
                let id = stream(input);
                let n = usize::from(input.byte().unwrap_or(0));
                let data = defuse(input.bytes(n));
                if !s.archives.contains(&id) {
                    s.frame(kind, id, data);
                }
            }
            4 => {
                let id = stream(input);
                let b = input.byte().unwrap_or(0);
                if b == 203 {
                    // A terminal's new size (0 and over 4096 refused).
                    let rows = u16::from(input.byte().unwrap_or(0)) * 20;
                    let cols = u16::from(input.byte().unwrap_or(0)) * 20;
                    s.json(Kind::Resize, id, &TermSize { rows, cols });
                    continue;
                }
                let sig = match b {
                    b @ 0..=100 => i32::from(b) - 10,
                    200 => i32::MIN,
                    201 => i32::MAX,
                    202 => -1,
                    _ => input.u32_le().unwrap_or(9) as i32,
                };
                s.json(Kind::Signal, id, &SignalRequest { signal: sig });
            }
            5 => {
                let id = stream(input);
                let payload = match input.byte().unwrap_or(0) % 6 {
                    0 => 0u32.to_le_bytes().to_vec(),
                    1 => u32::MAX.to_le_bytes().to_vec(),
                    2 => (1u32 << 20).to_le_bytes().to_vec(),
                    3 => input.u32_le().unwrap_or(0).to_le_bytes().to_vec(),
                    // Not four bytes.
                    4 => vec![],
                    _ => defuse(input.bytes(5)),
                };
                s.frame(Kind::Window, id, payload);
            }
            6 => {
                let id = stream(input);
                s.frame(Kind::Cancel, id, vec![]);
            }
            7 => {
                let id = stream(input);
                if input.byte().unwrap_or(0) & 1 == 0 {
                    s.json(
                        Kind::Error,
                        id,
                        &ErrorMessage::new("cancelled", word(input, true)),
                    );
                } else {
                    let n = usize::from(input.byte().unwrap_or(0) % 64);
                    let p = defuse(input.bytes(n));
                    s.frame(Kind::Error, id, p);
                }
            }
            8 => {
                // Any kind but the dangerous ones (unknown ones, the agent's own), raw payload.
                let mut kind = input.byte().unwrap_or(0x7f);
                let id = stream(input);
                let upload = matches!(Kind::from_u8(kind), Some(Kind::Stdin | Kind::Data));
                if dangerous(kind) || (upload && s.archives.contains(&id)) {
                    kind = 0x7f;
                }
                let n = usize::from(input.byte().unwrap_or(0) % 64);
                let p = defuse(input.bytes(n));
                s.frame(kind, id, p);
            }
            9 => {
                let id = stream(input);
                let name = word(input, false);
                let mode = input.u16_le().filter(|m| m & 1 == 1).map(u32::from);
                s.json(
                    Kind::FilePut,
                    id,
                    &FilePut {
                        path: path(&name),
                        mode,
                    },
                );
            }
            10 | 12 => {
                let id = stream(input);
                let name = word(input, true);
                let kind = if op % 16 == 10 {
                    Kind::FileGet
                } else {
                    Kind::ArchiveGet
                };
                s.json(kind, id, &PathRequest { path: path(&name) });
            }
            11 => {
                // An archive put and its whole upload, in chunks, maybe not closed.
                let id = stream(input);
                let name = word(input, false);
                let how = input.byte().unwrap_or(0);
                let tar = safe_tar(input);
                s.json(Kind::ArchivePut, id, &PathRequest { path: path(&name) });
                s.archives.insert(id);
                let chunk = usize::from(how % 16) * 97 + 1;
                for c in tar.chunks(chunk) {
                    s.frame(Kind::Data, id, c.to_vec());
                }
                if how & 0x80 == 0 {
                    s.frame(Kind::Data, id, vec![]);
                }
            }
            13 => {
                let n = usize::from(input.byte().unwrap_or(0));
                let g = defuse(input.bytes(n));
                s.raw(g);
            }
            14 => {
                // A frame the decoder must refuse: bad checksum, reserved bytes, huge length,
                // or cut short (its bytes become the next frame's prefix).
                let kind = input.byte().unwrap_or(0);
                let id = stream(input);
                let how = input.byte().unwrap_or(0);
                let n = usize::from(input.byte().unwrap_or(0) % 64);
                let mut f = Frame::new(kind, id, defuse(input.bytes(n))).encode();
                match how % 4 {
                    0 => f[16] ^= 1,
                    1 => f[6] = 1,
                    2 => f[12..16].copy_from_slice(&u32::MAX.to_le_bytes()),
                    _ => f.truncate(f.len() - 1 - usize::from(how) % f.len().max(1).min(19)),
                }
                s.raw(f);
            }
            _ => {
                let ms = u64::from(input.byte().unwrap_or(0) % 16).min(WAIT_BUDGET_MS - s.waited);
                s.waited += ms;
                s.segs.push(Seg::Wait(ms));
            }
        }
    }
    s
}

/// The chunks the session is written in: 1 to 64 bytes by a sequence seeded from the input, or
/// each segment whole (seed 0).
fn chunks(segs: &[Seg], seed: u8) -> Vec<Seg> {
    let mut out = vec![];
    let mut state = u32::from(seed);
    for s in segs {
        match s {
            Seg::Wait(ms) => out.push(Seg::Wait(*ms)),
            Seg::Bytes(b) if seed == 0 => out.push(Seg::Bytes(b.clone())),
            Seg::Bytes(b) => {
                let mut rest = &b[..];
                while !rest.is_empty() {
                    state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    let n = ((state >> 16) as usize % 64 + 1).min(rest.len());
                    out.push(Seg::Bytes(rest[..n].to_vec()));
                    rest = &rest[n..];
                }
            }
        }
    }
    out
}

/// Whether every frame in the bytes, decoded as `chunks` deliver them, is an intended one.
fn only_intended(chunks: &[&[u8]], intended: &HashSet<(u8, u32, Vec<u8>)>) -> bool {
    let mut d = Decoder::new();
    for c in chunks {
        d.push(c);
        while let Some(r) = d.next_frame() {
            if let Ok(f) = r {
                if !intended.contains(&(f.kind, f.stream, f.payload)) {
                    return false;
                }
            }
        }
    }
    true
}

/// Child processes of this process (their pid and /proc stat line).
fn children() -> Vec<(u32, String)> {
    let me = std::process::id();
    let mut out = vec![];
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let ppid = after
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        // libFuzzer keeps a symbolizer running (for NEW_FUNC lines): not the agent's.
        let symbolizer = stat.contains("(llvm-symbolizer)") || stat.contains("(addr2line)");
        if ppid == Some(me) && !symbolizer {
            out.push((pid, stat));
        }
    }
    out
}

fn pipe() -> (File, File) {
    let (r, w) = std::io::pipe().unwrap();
    (
        File::from(std::os::fd::OwnedFd::from(r)),
        File::from(std::os::fd::OwnedFd::from(w)),
    )
}

/// Every path under `d` with its kind, size and content (files), `skip` excluded.
fn state(d: &Path, skip: &Path) -> BTreeMap<PathBuf, (bool, u64, Vec<u8>)> {
    let mut m = BTreeMap::new();
    for e in fs::read_dir(d).unwrap().flatten() {
        let p = e.path();
        if p == skip {
            continue;
        }
        let meta = fs::symlink_metadata(&p).unwrap();
        let content = if meta.is_file() {
            fs::read(&p).unwrap()
        } else {
            vec![]
        };
        m.insert(p, (meta.is_dir(), meta.len(), content));
    }
    m
}

fn check(data: &[u8]) {
    let reaper = reaper();
    let mut input = Input(data);
    let seed = input.byte().unwrap_or(0);
    let dir = sandbox_fuzz::scratch_dir("agent-server");
    let d = dir.path().canonicalize().unwrap();
    let scratch = d.join("s");
    fs::create_dir(&scratch).unwrap();
    fs::write(d.join("bait"), b"bait\n").unwrap();
    let before = state(&d, &scratch);

    let s = session(&mut input, &scratch);
    let segs = chunks(&s.segs, seed);
    let whole: Vec<u8> = s
        .segs
        .iter()
        .flat_map(|g| match g {
            Seg::Bytes(b) => b.clone(),
            Seg::Wait(_) => vec![],
        })
        .collect();
    let pieces: Vec<&[u8]> = segs
        .iter()
        .filter_map(|g| match g {
            Seg::Bytes(b) => Some(&b[..]),
            Seg::Wait(_) => None,
        })
        .collect();
    if !only_intended(&[&whole], &s.intended) || !only_intended(&pieces, &s.intended) {
        // The input's bytes made a frame the harness did not build: never sent.
        if std::env::var_os("AGENT_SERVER_DEBUG").is_some() {
            eprintln!("skipped: a frame the harness did not build");
        }
        return;
    }

    let (agent_reads, mut host_writes) = pipe();
    let (mut host_reads, agent_writes) = pipe();
    let conn = Conn {
        reader: agent_reads,
        writer: agent_writes,
    };
    arm(
        Duration::from_secs(8),
        "writing the session to the agent took over 8 s",
    );
    let server = std::thread::spawn(move || {
        sandbox_agent::serve(conn, &ChannelSpec::Vsock(1024), reaper);
    });
    let reader = std::thread::spawn(move || {
        let mut d = Decoder::new();
        let mut frames = vec![];
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match host_reads.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => panic!("reading the agent: {e}"),
            };
            d.push(&buf[..n]);
            while let Some(r) = d.next_frame() {
                frames.push(
                    r.unwrap_or_else(|e| panic!("the agent sent bytes that do not decode: {e}")),
                );
            }
        }
        assert_eq!(
            d.pending(),
            0,
            "the agent's output ends in the middle of a frame"
        );
        frames
    });
    for g in &segs {
        match g {
            Seg::Bytes(b) => {
                if host_writes.write_all(b).is_err() {
                    break;
                }
            }
            Seg::Wait(ms) => std::thread::sleep(Duration::from_millis(*ms)),
        }
    }
    arm(
        END_WITHIN,
        "the agent's streams did not end within 5 s of the host closing its side",
    );
    drop(host_writes);
    server
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e));
    let frames = reader
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e));
    disarm();

    if std::env::var_os("AGENT_SERVER_DEBUG").is_some() {
        for f in &frames {
            let p = &f.payload;
            let shown = if p.len() > 120 {
                format!("{} bytes", p.len())
            } else {
                String::from_utf8_lossy(p).into_owned()
            };
            eprintln!("agent: {:#04x} stream {} {shown}", f.kind, f.stream);
        }
    }
    // What the agent sent.
    let mut sent: HashMap<u32, u64> = HashMap::new();
    for f in &frames {
        let kind =
            Kind::from_u8(f.kind).unwrap_or_else(|| panic!("the agent sent kind {:#x}", f.kind));
        let p = &f.payload[..];
        match kind {
            Kind::Ready => drop(serde_json::from_slice::<Ready>(p).unwrap()),
            Kind::Exit => drop(serde_json::from_slice::<ExitStatus>(p).unwrap()),
            Kind::Done => drop(serde_json::from_slice::<Done>(p).unwrap()),
            Kind::Error => drop(serde_json::from_slice::<ErrorMessage>(p).unwrap()),
            Kind::Window => assert_eq!(p.len(), 4, "a window of {} bytes", p.len()),
            Kind::Stdout | Kind::Stderr | Kind::Output => {
                *sent.entry(f.stream).or_default() += p.len() as u64;
            }
            other => panic!("the agent sent {other:?}, a host's kind"),
        }
    }
    for (id, n) in &sent {
        let allowed = s.opens.get(id).copied().unwrap_or(0) * u64::from(INITIAL_WINDOW)
            + s.grants.get(id).copied().unwrap_or(0);
        assert!(
            n <= &allowed,
            "the agent sent {n} bytes on stream {id}, the host granted {allowed}"
        );
    }

    // No child left (killed ones may wait a moment for the reaper).
    let until = Instant::now() + Duration::from_secs(2);
    loop {
        let left = children();
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < until,
            "child processes outlived the input: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        state(&d, &scratch),
        before,
        "something beside the scratch directory changed"
    );
    drop(dir);
}

fuzz_target!(|data: &[u8]| check(data));
