//! sandbox-agent: the process inside each sandbox guest that serves the host's requests (the
//! binary; the work is in the library, lib.rs).
//!
//! It runs as PID 1 of the stock image (after `/init` has mounted the filesystems) or is started
//! by the full image's init. It opens its channel to the host (a virtio-serial port or a vsock
//! port, chosen by `sandbox.channel=` on the kernel command line or `--channel`), announces itself
//! with `READY` and then serves frames until the host asks it to shut down.

use std::process::ExitCode;

use sandbox_agent::{ChannelSpec, Reaper, VERSION};

fn main() -> ExitCode {
    if std::process::id() == 1 {
        sandbox_agent::mark_boot();
    }
    let spec = match channel_spec() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("sandbox-agent: {e}");
            return ExitCode::from(2);
        }
    };
    let reaper = Reaper::start();
    loop {
        let conn = match sandbox_agent::open_channel(&spec) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("sandbox-agent: cannot open channel {spec}: {e}; retrying");
                std::thread::sleep(std::time::Duration::from_millis(200));
                continue;
            }
        };
        sandbox_agent::serve(conn, &spec, &reaper);
        // The host went away (EOF): its streams were abandoned and run on. Wait for it to come
        // back.
        if spec.is_serial() {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

/// The channel from `--channel X` or else `sandbox.channel=X` on the kernel command line,
/// defaulting to the virtio-serial port.
fn channel_spec() -> Result<ChannelSpec, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        [] => {}
        ["--channel", v] => return v.parse(),
        ["--channel"] => return Err("--channel needs a value, e.g. serial:sandbox.agent".into()),
        ["--version"] => {
            println!("sandbox-agent {VERSION}");
            std::process::exit(0);
        }
        other => {
            return Err(format!(
                "unknown arguments {other:?}; use --channel <spec> or --version"
            ));
        }
    }
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    match cmdline
        .split_whitespace()
        .find_map(|w| w.strip_prefix("sandbox.channel="))
    {
        Some(v) => v.parse(),
        None => Ok(ChannelSpec::Serial(
            sandbox_protocol::SERIAL_PORT_NAME.to_owned(),
        )),
    }
}
