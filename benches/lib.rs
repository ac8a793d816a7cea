//! Helpers shared by the benchmarks: statistics, table printing, and running a bench inside the
//! nested test host.
#![allow(missing_docs)]

use std::time::Duration;

/// Median and 95th percentile of a set of durations, in milliseconds.
pub fn stats(samples: &[Duration]) -> (f64, f64) {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    ms.sort_by(|a, b| a.total_cmp(b));
    if ms.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let pick = |q: f64| ms[((ms.len() as f64 - 1.0) * q).round() as usize];
    (pick(0.5), pick(0.95))
}

/// Prints one table row: what, median, p95, runs, and the ratio to a reference median.
pub fn row(what: &str, samples: &[Duration], reference_median: Option<f64>) {
    let (median, p95) = stats(samples);
    let ratio = reference_median.map_or(String::new(), |r| format!("{:.2}x", median / r));
    println!(
        "| {what:<58} | {median:>9.1} | {p95:>9.1} | {:>4} | {ratio:>6} |",
        samples.len()
    );
}

/// Prints the table header.
pub fn header() {
    println!(
        "| {:<58} | {:>9} | {:>9} | {:>4} | {:>6} |",
        "measurement", "median ms", "p95 ms", "runs", "vs ref"
    );
    println!(
        "|{}|{}|{}|{}|{}|",
        "-".repeat(60),
        "-".repeat(11),
        "-".repeat(11),
        "-".repeat(6),
        "-".repeat(8)
    );
}

/// The number of runs: `BENCH_RUNS`, or `default` when it is unset or not a number.
pub fn runs(default: usize) -> usize {
    std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Whether this bench runs inside the nested test host (`tests/nested/run.sh` sets it).
pub fn in_nested() -> bool {
    std::env::var("SANDBOX_HOST_IN_NESTED").as_deref() == Ok("1")
}

/// Runs this bench again inside the nested test host, whose KVM boots Linux, with `sandbox-vm`
/// taken along (each KVM VM runs in it), and exits with its status. A missing `sandbox-vm` is a
/// skip that says how to build it.
#[cfg(target_os = "linux")]
pub fn run_nested(runs: usize) -> ! {
    std::process::exit(run_nested_with(runs, &[]));
}

/// [`run_nested`] with `env` (`SANDBOX_HOST_*` names, which the nested host passes on) for the
/// run inside, returning its exit status: a bench that boots more guests than one nested host
/// runs (about twenty, tests/nested/README.md, "Wedged") runs in parts, one nested host each.
#[cfg(target_os = "linux")]
pub fn run_nested_with(runs: usize, env: &[(&str, &str)]) -> i32 {
    let me = std::env::current_exe().expect("exe");
    let name = me.file_name().unwrap().to_string_lossy().into_owned();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let vm = match sandbox_vmm::kvm::process::vm_binary() {
        Ok(p) => p,
        Err(why) => {
            println!(
                "skipped: {why}; build it first with `cargo build --release -p sandbox-vm --bins`"
            );
            std::process::exit(0);
        }
    };
    let st = std::process::Command::new("bash")
        .arg(root.join("tests/nested/run.sh"))
        .args([
            "--with",
            me.to_str().unwrap(),
            "--with",
            vm.to_str().unwrap(),
            "--",
        ])
        .arg(format!(
            "SANDBOX_HOST_IN_NESTED=1 BENCH_RUNS={runs} ./{name} --bench"
        ))
        .envs(env.iter().copied())
        // The nested console streams to stderr; stdout would print it all once more.
        .stdout(std::process::Stdio::null())
        .status()
        .expect("nested run");
    st.code().unwrap_or(1)
}

/// Proportional set size of a process, KiB (shared pages split among their users), from its
/// `smaps_rollup`; 0 where it cannot be read.
pub fn pss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// A sandbox of `spec` on `backend` with its agent ready, within 300 s; `None` (the failure
/// printed) when it does not start.
pub async fn ready(
    backend: &dyn sandbox_vmm::Backend,
    spec: sandbox_vmm::VmSpec,
) -> Option<sandbox_vmm::Sandbox> {
    let name = spec.id.clone();
    match sandbox_vmm::boot(backend, spec, Duration::from_secs(300)).await {
        Ok(sb) => Some(sb),
        Err(e) => {
            println!("start failure ({name} on {}): {e}", backend.name());
            None
        }
    }
}
