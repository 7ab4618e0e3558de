//! Monotonic time behind a trait, so lease deadlines can be tested without sleeping.

use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// `wait` after `start`, or a year after it where `wait` is too long for an `Instant` (a
/// configured "forever"): a deadline that never panics.
pub fn deadline_after(start: Instant, wait: Duration) -> Instant {
    start.checked_add(wait).unwrap_or(start + Duration::from_secs(365 * 24 * 3600))
}

/// A monotonic clock: time since an arbitrary origin that never goes back.
pub trait Clock: Send + Sync + Debug {
    /// The time elapsed since this clock's origin.
    fn now(&self) -> Duration;
}

/// The real monotonic clock.
#[derive(Debug)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        SystemClock { origin: Instant::now() }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A clock that moves only when told to: deadlines in tests pass exactly when the test says.
#[derive(Debug, Default)]
pub struct ManualClock {
    nanos: AtomicU64,
}

impl ManualClock {
    /// A clock standing at its origin.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        // Saturate rather than wrap: a clock that jumped back to zero would un-expire leases.
        let _ = self
            .nanos
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| Some(now.saturating_add(by)));
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let clock = ManualClock::new();
        assert_eq!(clock.now(), Duration::ZERO);
        clock.advance(Duration::from_millis(1500));
        assert_eq!(clock.now(), Duration::from_millis(1500));
        let system = SystemClock::new();
        let a = system.now();
        assert!(system.now() >= a);
    }
}
