//! Helpers shared by the benchmarks: statistics and table printing.
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
