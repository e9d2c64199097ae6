//! Rate limits: the quota notation flows use, and a keyed GCRA limiter (governor) that says
//! when a key may pass next.
//!
//! The limiter's counters live in process memory: they decide whether a message may pass
//! now, not what happens to it. What is held back lives in node state (durable, committed
//! with its wave); after a restart a key may pass one extra burst (documented).

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};

/// `N/s`, `N/min`, `N/h`: how many per period.
pub fn parse_rate(s: &str) -> Result<(u32, Duration), String> {
    let (n, per) = s
        .split_once('/')
        .ok_or_else(|| format!("`{s}` is not a rate (write e.g. 10/s, 1/min, 100/h)"))?;
    let n: u32 = n
        .trim()
        .parse()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("`{s}`: the count is a whole number above 0"))?;
    let per = match per.trim() {
        "s" | "sec" => Duration::from_secs(1),
        "min" | "m" => Duration::from_secs(60),
        "h" => Duration::from_secs(3600),
        other => return Err(format!("`{s}`: unknown period `{other}` (s, min or h)")),
    };
    Ok((n, per))
}

/// Checks between two sweeps of idle keys.
const SWEEP_EVERY: u64 = 4096;

/// One GCRA limiter per key. A key whose state is back to "full burst available" holds no
/// information and is dropped at the next sweep, so memory follows the active keys only.
pub struct Limiter {
    inner: RateLimiter<String, DefaultKeyedStateStore<String>, DefaultClock>,
    clock: DefaultClock,
    checks: AtomicU64,
}

impl Limiter {
    /// `n` per `per`, with bursts of `burst` (default `n`).
    pub fn new(n: u32, per: Duration, burst: Option<u32>) -> Result<Limiter, String> {
        let cell = per / n;
        let quota = Quota::with_period(cell)
            .ok_or_else(|| "the rate is too fast to measure".to_string())?
            .allow_burst(
                NonZeroU32::new(burst.unwrap_or(n))
                    .ok_or_else(|| "`burst` is at least 1".to_string())?,
            );
        let clock = DefaultClock::default();
        Ok(Limiter {
            inner: RateLimiter::hashmap_with_clock(quota, clock.clone()),
            clock,
            checks: AtomicU64::new(0),
        })
    }

    /// Take one from `key`'s quota now, or say how long until one is there.
    pub fn check(&self, key: &str) -> Result<(), Duration> {
        if self.checks.fetch_add(1, Ordering::Relaxed) % SWEEP_EVERY == SWEEP_EVERY - 1 {
            self.inner.retain_recent();
            self.inner.shrink_to_fit();
        }
        self.inner
            .check_key(&key.to_string())
            .map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }

    /// Keys the limiter remembers now.
    pub fn keys(&self) -> usize {
        self.inner.len()
    }

    /// Drop the keys that have nothing to remember.
    pub fn sweep(&self) {
        self.inner.retain_recent();
        self.inner.shrink_to_fit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates() {
        assert_eq!(super::parse_rate("10/s").unwrap().0, 10);
        assert_eq!(super::parse_rate("1/min").unwrap().1.as_secs(), 60);
        assert!(super::parse_rate("0/s").is_err());
        assert!(super::parse_rate("5/day").is_err());
    }

    #[test]
    fn a_burst_passes_then_the_next_waits_about_one_cell() {
        let l = Limiter::new(5, Duration::from_secs(1), None).unwrap();
        for _ in 0..5 {
            assert!(l.check("k").is_ok());
        }
        let wait = l.check("k").unwrap_err();
        assert!(
            wait > Duration::from_millis(100) && wait <= Duration::from_millis(200),
            "{wait:?}"
        );
        assert!(l.check("other").is_ok(), "each key has its own quota");
    }

    #[test]
    fn idle_keys_are_forgotten() {
        let l = Limiter::new(1000, Duration::from_secs(1), Some(1)).unwrap();
        for k in 0..100 {
            let _ = l.check(&k.to_string());
        }
        assert_eq!(l.keys(), 100);
        std::thread::sleep(Duration::from_millis(20));
        l.sweep();
        assert_eq!(l.keys(), 0, "every key is back to a full burst");
    }
}

#[cfg(test)]
mod slow_rates {
    #[test]
    fn one_a_minute_lets_the_first_through() {
        let l = super::Limiter::new(1, std::time::Duration::from_secs(60), None).unwrap();
        assert!(l.check("home/kitchen/temperature").is_ok());
        assert!(l.check("home/kitchen/temperature").is_err());
    }
}
