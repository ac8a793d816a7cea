//! Counters of the service, rendered in the Prometheus text format at `/metrics`.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds (ms) of the boot-duration histogram buckets.
const BOOT_BUCKETS_MS: [u64; 8] = [100, 250, 500, 1000, 2500, 5000, 10_000, 30_000];

/// Why a sandbox was disposed of; a label of `sandbox_host_disposals_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposal {
    /// `DELETE /v1/sandboxes/{id}`.
    Deleted,
    /// No request for `SANDBOX_HOST_IDLE_MS`.
    Idle,
    /// Its run's time limit plus `SANDBOX_HOST_GRACE_MS` passed.
    TimeLimit,
    /// Its VM had stopped on its own.
    VmDied,
    /// The service was stopping.
    Shutdown,
}

impl Disposal {
    /// The label value and log word.
    pub fn as_str(self) -> &'static str {
        match self {
            Disposal::Deleted => "deleted",
            Disposal::Idle => "idle",
            Disposal::TimeLimit => "time_limit",
            Disposal::VmDied => "vm_died",
            Disposal::Shutdown => "shutdown",
        }
    }

    const ALL: [Disposal; 5] = [
        Disposal::Deleted,
        Disposal::Idle,
        Disposal::TimeLimit,
        Disposal::VmDied,
        Disposal::Shutdown,
    ];
}

/// Service-wide counters. Per-sandbox counters live on each sandbox; these aggregate them.
#[derive(Debug, Default)]
pub struct Metrics {
    boots: AtomicU64,
    /// Sandboxes restored from a template (the rest of `boots` booted).
    restores: AtomicU64,
    boot_failures: AtomicU64,
    capacity_refusals: AtomicU64,
    boot_ms_sum: AtomicU64,
    boot_buckets: [AtomicU64; BOOT_BUCKETS_MS.len()],
    /// Execs started.
    pub execs: AtomicU64,
    /// Bytes into guests (uploads, stdin).
    pub bytes_in: AtomicU64,
    /// Bytes out of guests (downloads, stdout, stderr).
    pub bytes_out: AtomicU64,
    disposals: [AtomicU64; 5],
    /// Egress refusals of sandboxes already disposed of, by reason label: `/metrics` adds the
    /// live sandboxes' counts, so the total never goes down when a sandbox goes.
    retired_refusals: Retired,
    /// Unmetered model calls of sandboxes already disposed of, by reason, likewise.
    retired_unmetered: Retired,
}

/// Per-reason counts of sandboxes that are gone.
#[derive(Debug, Default)]
struct Retired(std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>);

impl Retired {
    fn add(&self, counts: &[(&'static str, u64)]) {
        let mut r = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // Counts come from network processes a guest may have taken over: never wrapped.
        for (k, n) in counts {
            let c = r.entry(k).or_default();
            *c = c.saturating_add(*n);
        }
    }

    /// These plus `live`.
    fn totals(&self, live: &[(&'static str, u64)]) -> Vec<(String, u64)> {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for (k, n) in live {
            let c = all.entry(k).or_default();
            *c = c.saturating_add(*n);
        }
        all.into_iter().map(|(k, n)| (k.to_string(), n)).collect()
    }
}

impl Metrics {
    /// Records a successful boot and its duration.
    pub fn boot(&self, d: Duration) {
        let ms = d.as_millis() as u64;
        self.boots.fetch_add(1, Relaxed);
        self.boot_ms_sum.fetch_add(ms, Relaxed);
        for (i, le) in BOOT_BUCKETS_MS.iter().enumerate() {
            if ms <= *le {
                self.boot_buckets[i].fetch_add(1, Relaxed);
            }
        }
    }

    /// Records how a sandbox that came up started: restored from a template or booted.
    pub fn started(&self, restored: bool) {
        if restored {
            self.restores.fetch_add(1, Relaxed);
        }
    }

    /// Records a boot that failed.
    pub fn boot_failed(&self) {
        self.boot_failures.fetch_add(1, Relaxed);
    }

    /// Records a create refused because the host had no room for it.
    pub fn refused_for_capacity(&self) {
        self.capacity_refusals.fetch_add(1, Relaxed);
    }

    /// Records a disposal.
    pub fn disposed(&self, why: Disposal) {
        let i = Disposal::ALL.iter().position(|d| *d == why).unwrap_or(0);
        self.disposals[i].fetch_add(1, Relaxed);
    }

    /// Keeps a disposed sandbox's refusal and unmetered-call counts in the service's totals.
    pub fn retire_egress(
        &self,
        refusals: &[(&'static str, u64)],
        unmetered: &[(&'static str, u64)],
    ) {
        self.retired_refusals.add(refusals);
        self.retired_unmetered.add(unmetered);
    }

    /// Refusal totals by reason: the retired ones plus `live` (the live sandboxes' counts).
    pub fn refusal_totals(&self, live: &[(&'static str, u64)]) -> Vec<(String, u64)> {
        self.retired_refusals.totals(live)
    }

    /// Unmetered-call totals by reason: the retired ones plus `live`.
    pub fn unmetered_totals(&self, live: &[(&'static str, u64)]) -> Vec<(String, u64)> {
        self.retired_unmetered.totals(live)
    }

    /// The Prometheus text. `states` are (state, count) pairs of the live sandboxes; `refusals`
    /// and `unmetered` are (reason, count) pairs of egress refusals and of model calls the meter
    /// could not read, summed over sandboxes.
    pub fn render(
        &self,
        states: &[(&str, u64)],
        refusals: &[(String, u64)],
        unmetered: &[(String, u64)],
    ) -> String {
        let mut o = String::new();
        family(
            &mut o,
            ("sandbox_host_sandboxes", "gauge", "Sandboxes by state."),
            "state",
            states.iter().map(|&(s, n)| (s, n)),
        );
        counter(
            &mut o,
            "sandbox_host_boots_total",
            "MicroVMs booted.",
            self.boots.load(Relaxed),
        );
        counter(
            &mut o,
            "sandbox_host_template_restores_total",
            "Sandboxes restored from a template instead of booted (counted in sandbox_host_boots_total too).",
            self.restores.load(Relaxed),
        );
        counter(
            &mut o,
            "sandbox_host_boot_failures_total",
            "MicroVMs that failed to boot.",
            self.boot_failures.load(Relaxed),
        );
        counter(
            &mut o,
            "sandbox_host_capacity_refusals_total",
            "Creates refused with 503 no_capacity.",
            self.capacity_refusals.load(Relaxed),
        );
        self.render_boot_durations(&mut o);
        for (name, help, v) in [
            (
                "sandbox_host_execs_total",
                "Commands run in sandboxes.",
                &self.execs,
            ),
            (
                "sandbox_host_bytes_in_total",
                "Bytes sent into guests (archives, files, stdin).",
                &self.bytes_in,
            ),
            (
                "sandbox_host_bytes_out_total",
                "Bytes read out of guests (archives, files, stdout, stderr).",
                &self.bytes_out,
            ),
        ] {
            counter(&mut o, name, help, v.load(Relaxed));
        }
        family(
            &mut o,
            (
                "sandbox_host_disposals_total",
                "counter",
                "Sandboxes disposed of, by reason.",
            ),
            "reason",
            Disposal::ALL
                .iter()
                .zip(&self.disposals)
                .map(|(d, n)| (d.as_str(), n.load(Relaxed))),
        );
        family(
            &mut o,
            (
                "sandbox_host_egress_refusals_total",
                "counter",
                "Guest requests refused by the egress policy, by reason.",
            ),
            "reason",
            refusals.iter().map(|(r, n)| (r.as_str(), *n)),
        );
        family(
            &mut o,
            (
                "sandbox_host_unmetered_calls_total",
                "counter",
                "Model calls to meter or secret hosts whose usage could not be read, by reason.",
            ),
            "reason",
            unmetered.iter().map(|(r, n)| (r.as_str(), *n)),
        );
        o
    }

    /// The boot-time histogram, from start to agent ready.
    fn render_boot_durations(&self, o: &mut String) {
        let _ = writeln!(
            o,
            "# HELP sandbox_host_boot_duration_seconds From start to agent ready.\n# TYPE sandbox_host_boot_duration_seconds histogram"
        );
        for (i, le) in BOOT_BUCKETS_MS.iter().enumerate() {
            let _ = writeln!(
                o,
                "sandbox_host_boot_duration_seconds_bucket{{le=\"{}\"}} {}",
                *le as f64 / 1000.0,
                self.boot_buckets[i].load(Relaxed)
            );
        }
        let boots = self.boots.load(Relaxed);
        let _ = writeln!(
            o,
            "sandbox_host_boot_duration_seconds_bucket{{le=\"+Inf\"}} {boots}"
        );
        let _ = writeln!(
            o,
            "sandbox_host_boot_duration_seconds_sum {}",
            self.boot_ms_sum.load(Relaxed) as f64 / 1000.0
        );
        let _ = writeln!(o, "sandbox_host_boot_duration_seconds_count {boots}");
    }
}

/// A counter without labels: its HELP and TYPE lines and its value.
fn counter(o: &mut String, name: &str, help: &str, n: u64) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {n}");
}

/// A family of one label: its HELP and TYPE lines (`(name, type, help)`), then a line per value.
fn family<'a>(
    o: &mut String,
    (name, kind, help): (&str, &str, &str),
    label: &str,
    values: impl IntoIterator<Item = (&'a str, u64)>,
) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (value, n) in values {
        let _ = writeln!(o, "{name}{{{label}=\"{value}\"}} {n}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_moves_in_the_text() {
        let m = Metrics::default();
        let before = m.render(&[("ready", 0)], &[], &[]);
        m.boot(Duration::from_millis(700));
        m.boot_failed();
        m.execs.fetch_add(2, Relaxed);
        m.bytes_in.fetch_add(10, Relaxed);
        m.bytes_out.fetch_add(20, Relaxed);
        m.disposed(Disposal::Idle);
        let after = m.render(
            &[("ready", 1)],
            &[("name_not_allowed".into(), 3)],
            &[("no_usage".into(), 2)],
        );
        for line in [
            "sandbox_host_sandboxes{state=\"ready\"} 1",
            "sandbox_host_boots_total 1",
            "sandbox_host_boot_failures_total 1",
            "sandbox_host_boot_duration_seconds_bucket{le=\"1\"} 1",
            "sandbox_host_boot_duration_seconds_sum 0.7",
            "sandbox_host_execs_total 2",
            "sandbox_host_bytes_in_total 10",
            "sandbox_host_bytes_out_total 20",
            "sandbox_host_disposals_total{reason=\"idle\"} 1",
            "sandbox_host_egress_refusals_total{reason=\"name_not_allowed\"} 3",
            "sandbox_host_unmetered_calls_total{reason=\"no_usage\"} 2",
        ] {
            assert!(after.contains(line), "missing {line}\n{after}");
            assert!(!before.contains(line), "{line} did not move");
        }
        assert!(after.contains("sandbox_host_boot_duration_seconds_bucket{le=\"0.5\"} 0"));
    }

    #[test]
    fn retired_counts_stay_in_the_totals() {
        let m = Metrics::default();
        m.retire_egress(&[("udp", 2)], &[("no_usage", 1), ("unknown_request", 4)]);
        m.retire_egress(&[("udp", 1)], &[("no_usage", 1)]);
        assert_eq!(m.refusal_totals(&[("udp", 5)]), [("udp".to_string(), 8)]);
        assert_eq!(
            m.unmetered_totals(&[("body_too_large", 1)]),
            [
                ("body_too_large".to_string(), 1),
                ("no_usage".to_string(), 2),
                ("unknown_request".to_string(), 4)
            ]
        );
    }
}
