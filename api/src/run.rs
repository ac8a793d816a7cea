//! `sandbox-host run`: one command in a fresh sandbox, output streamed, exit code passed on.

use std::collections::BTreeMap;
use std::process::ExitCode;

use clap::Args;
use sandbox_protocol::client::ExecEvent;
use sandbox_protocol::message::ExecRequest;
use sandbox_vmm::{ImageStore, config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use sandbox_vmm::select as backend_select;

/// `sandbox-host run`'s options: one sandbox, one command, without the service.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(128..=262144))]
    memory_mib: u32,
    /// Guest vCPUs.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=64))]
    vcpus: u8,
    /// Image from the image store.
    #[arg(long, default_value = "stock")]
    image: String,
    /// Size of the sandbox's disk in MiB (images with a root file system; the stock image keeps
    /// /workspace in memory). Sparse: it costs only what the command writes.
    #[arg(long, default_value_t = 20480, value_parser = clap::value_parser!(u64).range(64..=16_777_216))]
    disk_mib: u64,
    /// Working directory in the guest.
    #[arg(long, default_value = "/workspace")]
    cwd: String,
    /// Environment variable for the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "NAME=VALUE", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// Kill the command (and every process it started) after this many milliseconds.
    #[arg(long)]
    timeout_ms: Option<u64>,
    /// Pass this process's stdin to the command.
    #[arg(long, short = 'i')]
    stdin: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true, num_args = 1..)]
    command: Vec<String>,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("`{s}` is not NAME=VALUE")),
    }
}

/// Exit code when the sandbox itself failed (not the command).
const HOST_FAILURE: u8 = 125;

/// Boots the sandbox, runs the command with its output on ours, and exits with its exit code
/// (125 when the sandbox itself failed).
pub async fn run(args: RunArgs) -> ExitCode {
    match run_inner(args).await {
        Ok(code) => code,
        Err(msg) => {
            eprintln!("sandbox-host: {msg}");
            ExitCode::from(HOST_FAILURE)
        }
    }
}

async fn run_inner(args: RunArgs) -> Result<ExitCode, String> {
    let t = std::time::Instant::now();
    let store = ImageStore::new(config::image_dir());
    let selected = backend_select::select(&store)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(select_ms = t.elapsed().as_millis() as u64, backend = selected.backend.name(), accel = %selected.backend.accel(), "backend selected");
    let image = store.resolve(&args.image).map_err(|e| e.to_string())?;
    if let Some(w) = &selected.warning {
        tracing::warn!("{w}");
    }
    remove_stale_runs(&config::state_dir());
    let id = format!("run-{}-{}", std::process::id(), unique());
    let spec = image.vm_spec(
        id.clone(),
        args.memory_mib,
        args.vcpus,
        args.disk_mib,
        config::state_dir().join(&id),
    );
    let liveness = sandbox_vmm::Liveness::from_env().map_err(|e| e.to_string())?;
    let sandbox = sandbox_vmm::boot_watched(
        selected.backend.as_ref(),
        spec,
        crate::lifecycle::BOOT_TIMEOUT,
        liveness,
    )
    .await
    .map_err(|e| e.to_string())?;
    tracing::info!(
        boot_ms = sandbox.boot_time.as_millis() as u64,
        "sandbox ready"
    );

    let req = ExecRequest {
        argv: Some(args.command),
        command: None,
        env: args.env.into_iter().collect::<BTreeMap<_, _>>(),
        cwd: Some(args.cwd),
        stdin: args.stdin,
        timeout_ms: args.timeout_ms,
        pty: None,
    };
    let result = tokio::select! {
        r = exec(&sandbox.client, req) => r,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("sandbox-host: interrupted; disposing of the sandbox");
            Ok(ExitCode::from(130))
        }
        exit = sandbox.vm.wait() => Err(format!("the VM stopped during the command: {}{}", exit.reason, sandbox_vmm::backend::console_suffix(&exit.console))),
    };
    let t = std::time::Instant::now();
    sandbox.stop().await;
    tracing::info!(
        stop_ms = t.elapsed().as_millis() as u64,
        "sandbox disposed of"
    );
    result
}

async fn exec(
    client: &sandbox_protocol::client::Client,
    req: ExecRequest,
) -> Result<ExitCode, String> {
    let exec = client.exec(&req).await.map_err(|e| e.to_string())?;
    let mut output = exec.output;
    if let Some(mut stdin) = exec.stdin {
        tokio::spawn(async move {
            let mut input = tokio::io::stdin();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match input.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if stdin.write(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                }
            }
            let _ = stdin.close().await;
        });
    }
    let mut out = tokio::io::stdout();
    let mut err = tokio::io::stderr();
    while let Some(ev) = output.next().await {
        match ev.map_err(|e| e.to_string())? {
            ExecEvent::Stdout(b) => {
                out.write_all(&b)
                    .await
                    .map_err(|e| format!("writing stdout: {e}"))?;
                out.flush()
                    .await
                    .map_err(|e| format!("writing stdout: {e}"))?;
            }
            ExecEvent::Stderr(b) => {
                err.write_all(&b)
                    .await
                    .map_err(|e| format!("writing stderr: {e}"))?;
                err.flush()
                    .await
                    .map_err(|e| format!("writing stderr: {e}"))?;
            }
            ExecEvent::Exit(s) => {
                let code = match (s.exit_code, s.signal) {
                    _ if s.timed_out => {
                        eprintln!(
                            "sandbox-host: the command timed out after {} ms and was killed",
                            s.duration_ms
                        );
                        124
                    }
                    (Some(c), _) => c.clamp(0, 255) as u8,
                    (None, Some(sig)) => (128 + sig).clamp(0, 255) as u8,
                    (None, None) => HOST_FAILURE,
                };
                return Ok(ExitCode::from(code));
            }
        }
    }
    Err("the command's output ended without an exit status".into())
}

/// A short value that differs between runs of this process.
fn unique() -> String {
    use std::time::{SystemTime, UNIX_EPOCH};
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{nanos:08x}")
}

/// Removes the state directories of earlier `run`s whose process is gone (killed before it could
/// clean up; on Linux their QEMU died with them through PR_SET_PDEATHSIG).
fn remove_stale_runs(state_dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(state_dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("run-"))
            .and_then(|r| r.split('-').next())
        else {
            continue;
        };
        if pid
            .parse::<u32>()
            .is_ok_and(|p| !sandbox_vmm::host::process_alive(p))
        {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}
