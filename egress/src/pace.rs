//! Rates one sandbox may not exceed, whatever its guest does: new upstream connections (so a
//! guest cannot make the host's address hammer a provider, or any allowed name) and the lines its
//! egress writes to the service's log (so a guest that repeats a refused request cannot flood
//! it). Both are per sandbox: a guest that hits them slows only itself (issue 29, item 8).

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A token bucket: `rate` tokens a second, at most `burst` saved up. A taker that finds none
/// reserves the next and waits for it, so waiters are served in turn and the rate holds however
/// many wait (at most the sandbox's open connections).
#[derive(Debug)]
pub(crate) struct Bucket {
    rate: f64,
    burst: f64,
    /// Tokens (negative: reserved ahead) as of the instant.
    state: Mutex<(f64, Instant)>,
}

impl Bucket {
    pub(crate) fn new(rate: u32, burst: u32) -> Bucket {
        let burst = f64::from(burst.max(1));
        Bucket {
            rate: f64::from(rate.max(1)),
            burst,
            state: Mutex::new((burst, Instant::now())),
        }
    }

    /// Takes a token: how long to wait before using it.
    pub(crate) fn take(&self) -> Duration {
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let refill = now.saturating_duration_since(s.1).as_secs_f64() * self.rate;
        s.0 = (s.0 + refill).min(self.burst) - 1.0;
        s.1 = now;
        if s.0 >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-s.0 / self.rate)
        }
    }

    /// Takes a token and waits for it.
    pub(crate) async fn pace(&self) {
        let wait = self.take();
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

/// Lines one sandbox's egress may log per window; the rest are counted and the count logged when
/// the next window opens.
pub(crate) const LOG_LINES: u32 = 20;
pub(crate) const LOG_WINDOW: Duration = Duration::from_secs(60);

/// The sandbox's share of the service's log.
#[derive(Debug)]
pub(crate) struct LogLimit {
    /// When the window opened, lines logged in it, lines held back since the last report.
    state: Mutex<(Instant, u32, u64)>,
}

impl Default for LogLimit {
    fn default() -> Self {
        LogLimit {
            state: Mutex::new((Instant::now(), 0, 0)),
        }
    }
}

impl LogLimit {
    /// Runs `line` (a `tracing` call) if the window has room; reports the lines held back
    /// before, once a window opens.
    pub(crate) fn log(&self, line: impl FnOnce()) {
        let held = {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            if now.saturating_duration_since(s.0) >= LOG_WINDOW {
                *s = (now, 0, s.2);
            }
            if s.1 >= LOG_LINES {
                s.2 += 1;
                return;
            }
            s.1 += 1;
            std::mem::take(&mut s.2)
        };
        if held > 0 {
            tracing::warn!(
                "egress: {held} more lines of this sandbox were not logged (at most {LOG_LINES} a minute)"
            );
        }
        line();
    }

    /// Lines held back and not yet reported.
    #[cfg(test)]
    fn held(&self) -> u64 {
        self.state.lock().unwrap().2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_gives_its_burst_then_its_rate() {
        let b = Bucket::new(20, 5);
        let waits: Vec<Duration> = (0..9).map(|_| b.take()).collect();
        assert!(waits[..5].iter().all(|w| w.is_zero()), "{waits:?}");
        // Each taker after the burst waits one more interval: 50 ms apart at 20 a second.
        for (i, w) in waits[5..].iter().enumerate() {
            let want = 0.05 * (i + 1) as f64;
            assert!((w.as_secs_f64() - want).abs() < 0.02, "{i}: {w:?}");
        }
    }

    #[test]
    fn the_log_keeps_its_window() {
        let l = LogLimit::default();
        let mut written = 0;
        for _ in 0..1000 {
            l.log(|| written += 1);
        }
        assert_eq!(written, LOG_LINES);
        assert_eq!(l.held(), 1000 - u64::from(LOG_LINES));
    }
}
