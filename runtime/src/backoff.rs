//! The one backoff rule for everything the agent retries (a crashed module's cell, a refused
//! registration, the wait for a kubelet): a first wait, doubled for each failure in a row, up to
//! a cap. Hand-written rather than a crate: every caller already owns its loop and its timer
//! (`tokio::select!` against other events), and needs only the next delay.

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    pub const fn new(first: Duration, max: Duration) -> Self {
        Backoff {
            first,
            max,
            failures: 0,
        }
    }

    /// The wait before the next attempt after the failures counted so far: `first`, then twice
    /// that per failure in a row, never more than `max`.
    pub fn current(&self) -> Duration {
        self.first
            .saturating_mul(1 << self.failures.min(20))
            .min(self.max)
    }

    /// Returns [`current`](Self::current), then counts one more failure in a row.
    pub fn failed(&mut self) -> Duration {
        let delay = self.current();
        self.failures = self.failures.saturating_add(1);
        delay
    }

    /// A success: the next failure waits `first` again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_per_failure_up_to_the_cap_and_starts_over_after_a_success() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(100), ms(1000));
        let waits: Vec<_> = (0..6).map(|_| b.failed()).collect();
        assert_eq!(
            waits,
            [ms(100), ms(200), ms(400), ms(800), ms(1000), ms(1000)]
        );
        b.reset();
        assert_eq!(b.failed(), ms(100));
        let mut long = Backoff::new(ms(1), Duration::MAX);
        for _ in 0..100 {
            long.failed();
        }
        assert!(long.failed() > ms(1));
    }
}
