//! Latency summaries (nearest-rank percentiles) and errors counted by gRPC code.

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
