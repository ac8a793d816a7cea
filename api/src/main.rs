//! `sandbox-host`: the service that runs each agent run in its own microVM, and the operator's
//! command-line tool for it. This file only parses the command line and dispatches to the
//! library (`lib.rs`), which fuzz/ drives too.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use sandbox_host::{client, config, run, serve};

/// The sandbox host of the Vantik platform.
#[derive(Debug, Parser)]
#[command(name = "sandbox-host", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start the service (the HTTP API); what a bare `sandbox-host` does.
    Serve,
    /// Boot a one-off sandbox, run a command in it, stream its output, exit with its exit code.
    Run(run::RunArgs),
    /// Ask a running sandbox host whether it can start microVMs.
    Health,
    /// List the sandboxes of a running sandbox host.
    Ls,
    /// Run a command in a sandbox of a running sandbox host.
    Exec {
        /// Sandbox id.
        id: String,
        /// Kill the command after this many milliseconds.
        #[arg(long)]
        timeout_ms: Option<u64>,
        /// The command and its arguments.
        #[arg(last = true, required = true, num_args = 1..)]
        command: Vec<String>,
    },
    /// Open a terminal in a sandbox of a running sandbox host: a login shell, or the command
    /// given; exits with its exit code.
    Shell {
        /// Sandbox id.
        id: String,
        /// The command and its arguments (a login shell when none).
        #[arg(last = true, num_args = 0..)]
        command: Vec<String>,
    },
    /// Serve the API in front of a fleet of sandbox hosts (SANDBOX_HOST_GATEWAY_HOSTS or
    /// SANDBOX_HOST_GATEWAY_DNS), keeping no sandbox of its own.
    Gateway,
    /// Dispose of sandboxes of a running sandbox host.
    Rm {
        /// Sandbox ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

fn init_human_logs() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SANDBOX_HOST_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .without_time()
        .with_target(false)
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sandbox-host: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async {
        match cli.command.unwrap_or(Command::Serve) {
            Command::Serve => serve::serve().await,
            Command::Run(args) => {
                init_human_logs();
                if let Err(e) = config::load_dotenv() {
                    eprintln!("sandbox-host: {e}");
                    return ExitCode::from(125);
                }
                run::run(args).await
            }
            Command::Health => client::health().await,
            Command::Ls => client::ls().await,
            Command::Exec {
                id,
                timeout_ms,
                command,
            } => client::exec(id, command, timeout_ms).await,
            Command::Rm { ids } => client::rm(ids).await,
            Command::Shell { id, command } => sandbox_host::shell::shell(id, command).await,
            Command::Gateway => sandbox_host::gateway::run().await,
        }
    })
}
