//! `sandbox-host`: the service that runs each agent run in its own microVM, and the operator's
//! command-line tool for it. This file only parses the command line and dispatches.

mod backend_select;
mod run;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The sandbox host of the Vantik platform.
#[derive(Debug, Parser)]
#[command(name = "sandbox-host", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Boot a one-off sandbox, run a command in it, stream its output, exit with its exit code.
    Run(run::RunArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SANDBOX_HOST_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .without_time()
        .with_target(false)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sandbox-host: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run::run(args).await,
        }
    })
}
