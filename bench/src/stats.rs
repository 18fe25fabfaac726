//! Percentiles over measured samples, and how figures are written in the table.

use std::time::{Duration, Instant};

/// Measured durations, sorted. Percentiles are nearest-rank: the smallest sample such that at
/// least p % of the samples are less than or equal to it (no interpolation, so every figure is
/// a duration that was actually measured).
#[derive(Debug, Clone)]
pub struct Samples {
    sorted: Vec<Duration>,
}

impl Samples {
    pub fn new(mut samples: Vec<Duration>) -> Samples {
        assert!(!samples.is_empty(), "a benchmark produced no samples");
        samples.sort_unstable();
        Samples { sorted: samples }
    }

    /// How many were measured (never none: see [`Samples::new`]).
    pub fn count(&self) -> usize {
        self.sorted.len()
    }

    /// Nearest-rank percentile, `p` in (0, 100].
    pub fn percentile(&self, p: f64) -> Duration {
        let n = self.sorted.len();
        let rank = ((p / 100.0) * n as f64).ceil() as usize;
        self.sorted[rank.clamp(1, n) - 1]
    }

    pub fn p50(&self) -> Duration {
        self.percentile(50.0)
    }

    pub fn p90(&self) -> Duration {
        self.percentile(90.0)
    }

    pub fn p99(&self) -> Duration {
        self.percentile(99.0)
    }

    pub fn min(&self) -> Duration {
        self.sorted[0]
    }

    pub fn max(&self) -> Duration {
        self.sorted[self.sorted.len() - 1]
    }

    /// `p50 … / p99 …` (and p90 with `with_p90`), e.g. `p50 61 µs / p90 80 µs / p99 130 µs`.
    pub fn summary(&self, with_p90: bool) -> String {
        let mut parts = vec![format!("p50 {}", duration(self.p50()))];
        if with_p90 {
            parts.push(format!("p90 {}", duration(self.p90())));
        }
        parts.push(format!("p99 {}", duration(self.p99())));
        parts.join(" / ")
    }
}

/// Times `f` once.
pub async fn time<T, F: Future<Output = T>>(f: F) -> (T, Duration) {
    let started = Instant::now();
    let out = f.await;
    (out, started.elapsed())
}

/// `850 ns`, `61.2 µs`, `1.35 ms`, `2.41 s`: three significant digits or so.
pub fn duration(d: Duration) -> String {
    let ns = d.as_nanos() as f64;
    let (value, unit) = if ns < 1e3 {
        (ns, "ns")
    } else if ns < 1e6 {
        (ns / 1e3, "µs")
    } else if ns < 1e9 {
        (ns / 1e6, "ms")
    } else {
        (ns / 1e9, "s")
    };
    let text = if value < 10.0 {
        format!("{value:.2}")
    } else if value < 100.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.0}")
    };
    format!("{text} {unit}")
}

/// Bytes as MB (10^6), one decimal: `23.4 MB`.
pub fn megabytes(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

/// `1.23×`.
pub fn ratio(r: f64) -> String {
    format!("{r:.2}×")
}

/// `a / b` as a ratio of their lengths.
pub fn div(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64().max(f64::MIN_POSITIVE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(v: &[u64]) -> Samples {
        Samples::new(v.iter().map(|&x| Duration::from_micros(x)).collect())
    }

    #[test]
    fn nearest_rank() {
        let s = us(&[5, 1, 4, 2, 3, 6, 7, 8, 9, 10]);
        assert_eq!(s.p50(), Duration::from_micros(5));
        assert_eq!(s.p90(), Duration::from_micros(9));
        assert_eq!(s.p99(), Duration::from_micros(10));
        assert_eq!(s.percentile(100.0), Duration::from_micros(10));
        assert_eq!(s.percentile(0.1), Duration::from_micros(1));
        let one = us(&[7]);
        assert_eq!(one.p50(), Duration::from_micros(7));
        assert_eq!(one.p99(), Duration::from_micros(7));
        // 100 samples 1..=100: p99 is the 99th.
        let hundred = us(&(1..=100).rev().collect::<Vec<_>>());
        assert_eq!(hundred.p99(), Duration::from_micros(99));
        assert_eq!(hundred.p50(), Duration::from_micros(50));
    }

    #[test]
    fn formatting() {
        assert_eq!(duration(Duration::from_nanos(850)), "850 ns");
        assert_eq!(duration(Duration::from_nanos(61_240)), "61.2 µs");
        assert_eq!(duration(Duration::from_micros(1_350)), "1.35 ms");
        assert_eq!(duration(Duration::from_millis(2_410)), "2.41 s");
        assert_eq!(megabytes(23_440_000), "23.4 MB");
        assert_eq!(ratio(1.234), "1.23×");
    }
}
