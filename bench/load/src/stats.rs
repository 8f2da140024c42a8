//! Latency summaries (nearest-rank percentiles, or read from a
//! coordinator's histogram) and errors counted by gRPC code.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

/// Percentiles of a set of durations, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Latency {
    pub count: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Latency {
    /// Summarises `samples` (sorted here); all zero when there are none.
    pub fn of(mut samples: Vec<Duration>) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_unstable();
        Self {
            count: samples.len() as u64,
            p50_ms: ms(nearest_rank(&samples, 50.0)),
            p99_ms: ms(nearest_rank(&samples, 99.0)),
            max_ms: ms(*samples.last().expect("not empty")),
        }
    }
}

/// The nearest-rank `percentile` of sorted, non-empty `samples`: the
/// smallest sample at or above which `percentile`% of them lie.
pub fn nearest_rank(samples: &[Duration], percentile: f64) -> Duration {
    debug_assert!(!samples.is_empty());
    let n = samples.len();
    let rank = ((percentile / 100.0) * n as f64).ceil() as usize;
    samples[rank.clamp(1, n) - 1]
}

fn ms(d: Duration) -> f64 {
    // Microsecond resolution is plenty for a report.
    (d.as_micros() as f64) / 1000.0
}

/// Failed calls by gRPC code (`Unavailable`, `DeadlineExceeded`, …), with
/// the first message seen for each code.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Errors {
    pub total: u64,
    pub by_code: BTreeMap<String, u64>,
    pub first_message: BTreeMap<String, String>,
}

impl Errors {
    pub fn record(&mut self, status: &tonic::Status) {
        self.record_kind(&format!("{:?}", status.code()), status.message());
    }

    /// An error that is not a gRPC status (e.g. `TimedOut`, `Http`).
    pub fn record_kind(&mut self, kind: &str, message: &str) {
        self.total += 1;
        *self.by_code.entry(kind.to_owned()).or_default() += 1;
        self.first_message
            .entry(kind.to_owned())
            .or_insert_with(|| message.chars().take(300).collect());
    }

    pub fn merge(&mut self, other: Errors) {
        self.total += other.total;
        for (code, n) in other.by_code {
            *self.by_code.entry(code).or_default() += n;
        }
        for (code, message) in other.first_message {
            self.first_message.entry(code).or_insert(message);
        }
    }
}

/// Events per second over `span` (0 when the span is empty).
pub fn rate(events: u64, span: Duration) -> f64 {
    let secs = span.as_secs_f64();
    if secs > 0.0 {
        events as f64 / secs
    } else {
        0.0
    }
}

/// Percentiles of what a coordinator timed itself, read from one of its
/// latency histograms on `/metrics` as Prometheus' `histogram_quantile`
/// reads them: interpolated within a bucket, so within one bucket's width
/// (a bucket is half again the one before it).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Served {
    pub count: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

impl Served {
    /// Reads histogram `name` from `scrape` (Prometheus' text format).
    /// None when the scrape has no observation of it.
    pub fn of(scrape: &str, name: &str) -> Option<Self> {
        let prefix = format!("{name}_bucket{{le=\"");
        let mut buckets: Vec<(f64, f64)> = scrape
            .lines()
            .filter_map(|line| {
                let rest = line.strip_prefix(&prefix)?;
                let (le, rest) = rest.split_once("\"}")?;
                let count: f64 = rest.trim().parse().ok()?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, count))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let total = buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let quantile = |q: f64| {
            let rank = q * total;
            let mut below = (0.0, 0.0);
            for &(le, count) in &buckets {
                if count >= rank {
                    if le.is_infinite() {
                        return below.0;
                    }
                    let share = if count > below.1 {
                        (rank - below.1) / (count - below.1)
                    } else {
                        1.0
                    };
                    return below.0 + (le - below.0) * share;
                }
                below = (le, count);
            }
            below.0
        };
        Some(Self {
            count: total as u64,
            p50_ms: quantile(0.5) * 1000.0,
            p99_ms: quantile(0.99) * 1000.0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_takes_the_smallest_sample_covering_the_share() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(nearest_rank(&samples, 50.0), Duration::from_millis(50));
        assert_eq!(nearest_rank(&samples, 99.0), Duration::from_millis(99));
        assert_eq!(nearest_rank(&samples, 100.0), Duration::from_millis(100));
        let one = [Duration::from_millis(7)];
        assert_eq!(nearest_rank(&one, 50.0), one[0]);
        assert_eq!(nearest_rank(&one, 99.0), one[0]);
        let summary = Latency::of(vec![
            Duration::from_millis(3),
            Duration::from_millis(1),
            Duration::from_millis(2),
        ]);
        assert_eq!(summary.count, 3);
        assert_eq!(summary.p50_ms, 2.0);
        assert_eq!(summary.max_ms, 3.0);
        assert_eq!(Latency::of(Vec::new()), Latency::default());
    }

    #[test]
    fn served_percentiles_are_interpolated_within_their_bucket() {
        let scrape = "# TYPE cairn_heartbeat_duration_seconds histogram
cairn_heartbeat_duration_seconds_sum 1.5
cairn_heartbeat_duration_seconds_count 100
cairn_heartbeat_duration_seconds_bucket{le=\"0.01\"} 50
cairn_heartbeat_duration_seconds_bucket{le=\"0.02\"} 90
cairn_heartbeat_duration_seconds_bucket{le=\"0.04\"} 100
cairn_heartbeat_duration_seconds_bucket{le=\"+Inf\"} 100
cairn_other_bucket{le=\"0.01\"} 7
";
        let served = Served::of(scrape, "cairn_heartbeat_duration_seconds").unwrap();
        assert_eq!(served.count, 100);
        // The 50th of 100 is the last of the first bucket: its top.
        assert!((served.p50_ms - 10.0).abs() < 1e-9, "{served:?}");
        // The 99th is 9 of the last bucket's 10: 20 ms + 0.9 × 20 ms.
        assert!((served.p99_ms - 38.0).abs() < 1e-9, "{served:?}");
        // Beyond the last finite bucket: its top, as Prometheus says.
        let past = "h_bucket{le=\"0.5\"} 1\nh_bucket{le=\"+Inf\"} 10\n";
        assert_eq!(Served::of(past, "h").unwrap().p99_ms, 500.0);
        assert_eq!(Served::of("h_bucket{le=\"+Inf\"} 0\n", "h"), None);
        assert_eq!(Served::of(scrape, "cairn_missing"), None);
    }

    #[test]
    fn errors_count_by_code_and_keep_the_first_message() {
        let mut errors = Errors::default();
        errors.record(&tonic::Status::unavailable("busy"));
        errors.record(&tonic::Status::unavailable("busy again"));
        let mut other = Errors::default();
        other.record(&tonic::Status::internal("oops"));
        errors.merge(other);
        assert_eq!(errors.total, 3);
        assert_eq!(errors.by_code["Unavailable"], 2);
        assert_eq!(errors.by_code["Internal"], 1);
        assert_eq!(errors.first_message["Unavailable"], "busy");
    }
}
