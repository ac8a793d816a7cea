//! The host's protocol client (`sandbox_protocol::client`) with a hostile agent on the other end
//! of the channel. The host does what the service does (an exec with stdin, a file download, a
//! file upload, an archive download it does not read yet, a ping, waiting for READY) while the
//! input plays the agent: frames of every kind on any stream with payloads that are valid JSON
//! or not, windows of any size, repeats (floods), corrupt frames and raw bytes, at any time.
//! Time is tokio's paused clock, so an input runs in microseconds and timeouts are exact.
//!
//! Invariants: every frame the host sends decodes and is a host frame; the host never sends more
//! stdin or upload bytes on a stream than the window the agent granted; what a download or an
//! exec's stdout yields is a prefix of the bytes the agent sent on that stream; once the agent
//! hangs up, every operation of the host ends (none waits forever).
#![no_main]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use sandbox_fuzz::Input;
use sandbox_protocol::client::{Client, ExecEvent};
use sandbox_protocol::message::{
    Done, ErrorMessage, ExecRequest, ExitStatus, Ready, parse_window,
};
use sandbox_protocol::{Decoder, Frame, INITIAL_WINDOW, Kind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bytes one input may make the agent send (floods included).
const MAX_SENT: usize = 4 << 20;
/// Stream ids, in the order the host opens them below (then 3 the upload, 4 the unread archive
/// download, 5 the ping).
const EXEC: u32 = 1;
const FILE_GET: u32 = 2;

/// What the agent sent and granted, as the harness wrote it.
#[derive(Default)]
struct Agent {
    /// Window granted per stream (beyond the initial window).
    granted: HashMap<u32, u64>,
    /// Data bytes sent per stream and kind, in order.
    data: HashMap<(u32, u8), Vec<u8>>,
}

fn json(v: &impl serde::Serialize) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}

/// An agent frame from the input: its kind, stream and payload.
fn agent_frame(input: &mut Input) -> Frame {
    let k = input.byte().unwrap_or(0);
    let stream = u32::from(input.byte().unwrap_or(0) % 8);
    let n = u64::from(input.byte().unwrap_or(0));
    let kind = match k % 10 {
        0 => Kind::Ready,
        1 => Kind::Stdout,
        2 => Kind::Stderr,
        3 => Kind::Exit,
        4 => Kind::Output,
        5 => Kind::Done,
        6 => Kind::Error,
        7 => Kind::Window,
        8 => {
            // Any kind at all (host kinds and unknown ones included), raw payload.
            let kind = input.byte().unwrap_or(0);
            let len = usize::from(input.byte().unwrap_or(0));
            return Frame::new(kind, stream, input.bytes(len).to_vec());
        }
        _ => {
            let len = usize::from(input.byte().unwrap_or(0));
            return Frame::new(
                Kind::from_u8(k / 10 % 8 + 0x81).unwrap_or(Kind::Error),
                stream,
                input.bytes(len).to_vec(),
            );
        }
    };
    let payload = match kind {
        Kind::Ready => json(&Ready {
            version: "fuzz".into(),
            protocol: (n % 3) as u32,
            channel: "serial".into(),
            uptime_ms: n,
        }),
        Kind::Exit => json(&ExitStatus {
            exit_code: Some(n as i32 - 128),
            signal: None,
            timed_out: n & 1 == 1,
            duration_ms: n,
        }),
        Kind::Done => json(&Done {
            entries: n,
            bytes: n << 10,
        }),
        Kind::Error => json(&ErrorMessage {
            code: "not_found".into(),
            message: "no such file".into(),
        }),
        Kind::Window => {
            let b = input.bytes(if n & 1 == 0 { 4 } else { (n % 6) as usize });
            let mut w = b.to_vec();
            if n & 1 == 0 {
                w.resize(4, 0xff);
            }
            w
        }
        _ => {
            // Data: up to 16 KiB of a byte pattern from the input (a flood needs no input bytes).
            let len = usize::from(input.u16_be().unwrap_or(0)) % 16384;
            let seed = input.byte().unwrap_or(0);
            (0..len).map(|i| seed.wrapping_add(i as u8)).collect()
        }
    };
    Frame::new(kind, stream, payload)
}

fn record(agent: &Mutex<Agent>, f: &Frame) {
    let mut a = agent.lock().unwrap();
    match Kind::from_u8(f.kind) {
        Some(Kind::Window) => {
            if let Some(n) = parse_window(&f.payload) {
                *a.granted.entry(f.stream).or_default() += u64::from(n);
            }
        }
        Some(Kind::Stdout | Kind::Stderr | Kind::Output) => a
            .data
            .entry((f.stream, f.kind))
            .or_default()
            .extend_from_slice(&f.payload),
        _ => {}
    }
}

fn is_prefix(got: &[u8], sent: Option<&Vec<u8>>, what: &str) {
    let sent = sent.map_or(&[][..], |v| &v[..]);
    assert!(
        got.len() <= sent.len() && got == &sent[..got.len()],
        "{what}: the host yielded {} bytes that are not a prefix of the {} the agent sent",
        got.len(),
        sent.len()
    );
}

async fn session(data: &[u8]) {
    let (host, agent_io) = tokio::io::duplex(64 * 1024);
    let (hr, hw) = tokio::io::split(host);
    let (mut ar, mut aw) = tokio::io::split(agent_io);
    let client = Arc::new(Client::new(hr, hw));
    let agent = Arc::new(Mutex::new(Agent::default()));

    // The agent's reader: every frame the host sends is well formed, a host frame, and within
    // the window the agent granted.
    let a = agent.clone();
    let reader = tokio::spawn(async move {
        let mut dec = Decoder::new();
        let mut buf = vec![0u8; 64 * 1024];
        let mut sent: HashMap<u32, u64> = HashMap::new();
        loop {
            let n = match ar.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            dec.push(&buf[..n]);
            while let Some(f) = dec.next_frame() {
                let f = f.expect("the host sent a malformed frame");
                let kind = Kind::from_u8(f.kind).expect("the host sent an unknown kind");
                assert!(
                    f.kind < 0x80 || matches!(kind, Kind::Window | Kind::Error),
                    "the host sent {kind:?}, an agent frame"
                );
                if matches!(kind, Kind::Stdin | Kind::Data) {
                    let s = sent.entry(f.stream).or_default();
                    *s += f.payload.len() as u64;
                    let granted = u64::from(INITIAL_WINDOW)
                        + a.lock().unwrap().granted.get(&f.stream).copied().unwrap_or(0);
                    assert!(
                        *s <= granted,
                        "the host sent {s} bytes on stream {} with a window of {granted}",
                        f.stream
                    );
                }
            }
        }
    });

    // The host's side, opened in a fixed order so the stream ids are known.
    let exec = client
        .exec(&ExecRequest {
            argv: Some(vec!["cat".into()]),
            stdin: true,
            ..Default::default()
        })
        .await;
    let file = client.get_file("/f").await;
    let upload = client.file_upload("/g", Some(0o644)).await;
    let unread = client.get_archive("/d").await;
    let mut ops = tokio::task::JoinSet::new();
    let (stdin_tx, mut stdin_rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
    let (upload_tx, mut upload_rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
    if let Ok(mut exec) = exec {
        if let Some(mut stdin) = exec.stdin.take() {
            ops.spawn(async move {
                // Writes what the input says; 0 closes stdin.
                while let Some(n) = stdin_rx.recv().await {
                    if n == 0 {
                        let _ = stdin.close().await;
                        break;
                    }
                    if stdin.write(&vec![7u8; n]).await.is_err() {
                        break;
                    }
                }
                None
            });
        }
        ops.spawn(async move {
            let mut out = vec![];
            while let Some(Ok(ev)) = exec.output.next().await {
                if let ExecEvent::Stdout(b) = ev {
                    out.extend_from_slice(&b);
                }
            }
            Some(((EXEC, Kind::Stdout as u8), out))
        });
    }
    if let Ok(mut file) = file {
        ops.spawn(async move {
            let mut out = vec![];
            while let Some(Ok(b)) = file.next_chunk().await {
                out.extend_from_slice(&b);
            }
            Some(((FILE_GET, Kind::Output as u8), out))
        });
    }
    if let Ok(mut up) = upload {
        ops.spawn(async move {
            // Writes what the input says (past the initial window, it waits for the agent's
            // grants); 0 finishes the upload.
            while let Some(n) = upload_rx.recv().await {
                if n == 0 {
                    let _ = up.finish().await;
                    break;
                }
                if up.write(&vec![9u8; n]).await.is_err() {
                    break;
                }
            }
            None
        });
    }
    let c = client.clone();
    ops.spawn(async move {
        let _ = c.ping().await;
        None
    });
    let c = client.clone();
    ops.spawn(async move {
        let _ = c.wait_ready(Duration::from_secs(3600)).await;
        None
    });

    // The agent: what the input says, then it hangs up.
    let mut input = Input(data);
    let mut last: Option<Frame> = None;
    let mut sent = 0usize;
    let mut alive = true;
    let mut mirror = Decoder::new();
    let mut mirror_ok = true;
    while let Some(op) = input.byte() {
        if !alive || sent > MAX_SENT {
            break;
        }
        let mut out = Vec::new();
        match op % 6 {
            0 | 1 => {
                let f = agent_frame(&mut input);
                out = f.encode();
                last = Some(f);
            }
            2 => {
                // The last frame again, up to 1024 times.
                if let Some(f) = &last {
                    let times = 1 + usize::from(input.byte().unwrap_or(0)) * 4;
                    let one = f.encode();
                    for _ in 0..times.min((MAX_SENT - sent) / one.len().max(1) + 1) {
                        out.extend_from_slice(&one);
                    }
                }
            }
            3 => {
                // Raw bytes: garbage, or a frame cut short, or with a broken checksum.
                let n = usize::from(input.byte().unwrap_or(0));
                out = input.bytes(n).to_vec();
            }
            4 => {
                // The host writes stdin (up to 127 x 1 KiB) or, with the top bit, upload bytes
                // (up to 127 x 64 KiB, past the initial window), or closes or finishes them (0).
                let b = input.byte().unwrap_or(0);
                let n = usize::from(b & 0x7f);
                let _ = if b & 0x80 == 0 {
                    stdin_tx.send(n * 1024)
                } else {
                    upload_tx.send(n * 64 * 1024)
                };
            }
            _ => {
                // The host runs for a while.
                let ms = u64::from(input.byte().unwrap_or(0));
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
        }
        sent += out.len();
        // What the host will read, decoded as it decodes it (raw bytes can hold or complete a
        // frame too), recorded before the host can see it; the host stops at its first error.
        if mirror_ok {
            mirror.push(&out);
            while let Some(f) = mirror.next_frame() {
                match f {
                    Ok(f) => record(&agent, &f),
                    Err(_) => {
                        mirror_ok = false;
                        break;
                    }
                }
            }
        }
        if !out.is_empty() {
            // A host that stopped reading (it closed the channel) is not waited for.
            alive = matches!(
                tokio::time::timeout(Duration::from_secs(10), aw.write_all(&out)).await,
                Ok(Ok(()))
            );
        }
        tokio::task::yield_now().await;
    }
    drop((stdin_tx, upload_tx));
    let _ = aw.shutdown().await;
    drop(aw);

    // Every operation ends once the agent hung up.
    let all = async {
        let mut yielded = vec![];
        while let Some(r) = ops.join_next().await {
            if let Some(y) = r.expect("a host operation panicked") {
                yielded.push(y);
            }
        }
        yielded
    };
    let yielded = tokio::time::timeout(Duration::from_secs(3600), all)
        .await
        .expect("a host operation still waits an hour after the agent hung up");
    let a = agent.lock().unwrap();
    for (key, got) in &yielded {
        is_prefix(got, a.data.get(key), &format!("stream {} kind {:#x}", key.0, key.1));
    }
    drop(a);
    // The unread download: whatever it yields now is a prefix of what was sent on it.
    if let Ok(mut d) = unread {
        let mut out = vec![];
        while let Some(Ok(b)) = d.next_chunk().await {
            out.extend_from_slice(&b);
        }
        is_prefix(&out, agent.lock().unwrap().data.get(&(4, Kind::Output as u8)), "stream 4");
        assert!(out.len() <= INITIAL_WINDOW as usize, "an unread download yielded {} bytes", out.len());
    }
    drop(client);
    let _ = tokio::time::timeout(Duration::from_secs(3600), reader).await;
}

fuzz_target!(|data: &[u8]| {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
        .block_on(session(data));
});
