//! The coordinator's clock for retention and garbage collection.
//!
//! The system clock, plus an offset that only tests move forward: a test
//! makes a week pass ([`Clock::advance`]) to see a finished workspace
//! expire or a grace period end, without waiting for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// The system clock, possibly advanced (see the module doc).
#[derive(Debug, Clone, Default)]
pub struct Clock {
    advanced_ms: Arc<AtomicU64>,
}

impl Clock {
    /// The system clock.
    pub fn system() -> Self {
        Self::default()
    }

    pub fn now(&self) -> SystemTime {
        SystemTime::now() + Duration::from_millis(self.advanced_ms.load(Ordering::Relaxed))
    }

    /// Moves this clock (and every clone of it) forward by `by`.
    pub fn advance(&self, by: Duration) {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.advanced_ms.fetch_add(ms, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_advanced_clock_runs_ahead_by_as_much_in_every_clone() {
        let clock = Clock::system();
        let clone = clock.clone();
        clock.advance(Duration::from_secs(7 * 24 * 3600));
        let ahead = clone.now().duration_since(SystemTime::now()).unwrap();
        assert!(ahead >= Duration::from_secs(7 * 24 * 3600 - 1), "{ahead:?}");
        assert!(
            ahead <= Duration::from_secs(7 * 24 * 3600 + 60),
            "{ahead:?}"
        );
    }
}
