//! What a sandbox's egress has done, as the channel carries it.

use std::time::{SystemTime, UNIX_EPOCH};

use sandbox_control::net::{Call, CallUsage, MAX_CALLS, MAX_EVENTS, Refusal, Report, Usage};
use sandbox_egress::Egress;
use sandbox_egress::meter::request::Unmetered;
use sandbox_egress::refusal::Reason;
use sandbox_egress::stats::Stats;

/// Milliseconds since the Unix epoch (0 before it).
fn millis(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The labels a report may use: every refusal reason, every reason a call went unmetered (what
/// the service checks a report against, [`Report::check`]).
pub fn labels() -> (Vec<&'static str>, Vec<&'static str>) {
    (
        Reason::ALL.iter().map(|r| r.as_str()).collect(),
        Unmetered::ALL.iter().map(|u| u.as_str()).collect(),
    )
}

/// The report of `egress` now.
pub fn report(egress: &Egress) -> Report {
    let s = egress.stats();
    let (refusals, events, events_dropped) = {
        let r = s.refusals();
        let counts = Reason::ALL
            .iter()
            .map(|x| (x.as_str().to_string(), r.count(*x)))
            .collect();
        let (events, dropped) = r.events();
        let events: Vec<Refusal> = events
            .map(|e| Refusal {
                at_ms: millis(e.at),
                reason: e.reason.as_str().to_string(),
                target: e.target.clone(),
            })
            .collect();
        (counts, events, dropped)
    };
    let usage = {
        let u = s.usage();
        let t = u.totals;
        Usage {
            calls: u.calls.iter().map(call).collect(),
            calls_dropped: u.dropped,
            total_calls: t.calls,
            input_tokens: t.input_tokens,
            output_tokens: t.output_tokens,
            cache_read_tokens: t.cache_read_tokens,
            cache_write_tokens: t.cache_write_tokens,
            billed_cost_usd: t.billed_cost_usd,
            unmetered: Unmetered::ALL
                .iter()
                .map(|x| (x.as_str().to_string(), t.unmetered(*x)))
                .collect(),
        }
    };
    let (from_guest, to_guest) = egress.frames_dropped();
    let (held, limit) = egress.memory();
    debug_assert!(events.len() <= MAX_EVENTS && usage.calls.len() <= MAX_CALLS);
    Report {
        refusals,
        events,
        events_dropped,
        open: Stats::get(&s.open),
        connections: Stats::get(&s.connections),
        spliced: Stats::get(&s.spliced),
        intercepted: Stats::get(&s.intercepted),
        http: Stats::get(&s.http),
        upstream_failures: Stats::get(&s.upstream_failures),
        to_upstream: Stats::get(&s.to_upstream),
        to_guest: Stats::get(&s.to_guest),
        frames_dropped_from_guest: from_guest,
        frames_dropped_to_guest: to_guest,
        memory_held: held as u64,
        memory_limit: limit as u64,
        usage,
    }
}

/// One metered call as the channel carries it.
fn call(c: &sandbox_egress::stats::Call) -> Call {
    Call {
        at_ms: millis(c.at),
        host: c.host.clone(),
        status: c.status,
        complete: c.complete,
        unmetered: c.unmetered.map(|u| u.as_str().to_string()),
        usage: c.usage.as_ref().map(|r| CallUsage {
            provider: r.provider.to_string(),
            estimated: r.estimated,
            response_id: r.response_id.clone(),
            model: r.model.clone(),
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            cache_read_tokens: r.cache_read_tokens,
            cache_write_tokens: r.cache_write_tokens,
            cost: r.cost,
            service_tier: r.details.service_tier.clone(),
            server_tool_use: r.details.server_tool_use.clone(),
            cache_write_5m_tokens: r.details.cache_write_5m_tokens,
            cache_write_1h_tokens: r.details.cache_write_1h_tokens,
            input_audio_tokens: r.details.input_audio_tokens,
            output_audio_tokens: r.details.output_audio_tokens,
            input_image_tokens: r.details.input_image_tokens,
            output_image_tokens: r.details.output_image_tokens,
            reasoning_tokens: r.details.reasoning_tokens,
        }),
    }
}
