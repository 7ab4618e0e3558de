//! A limit on how often one warning is logged: an event that can repeat on every request (a
//! damaged value loaded in a loop, a device copy failing for every victim) must not fill the
//! log. The metrics still count every event; the log says how many it left out.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// At most one event logged per interval; the others are counted, and their number goes with
/// the next one logged.
pub struct LogLimit {
    interval: Duration,
    /// When an event was last logged, and how many were left out since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimit {
    /// At most one event logged per `interval`.
    pub const fn new(interval: Duration) -> Self {
        LogLimit { interval, state: Mutex::new((None, 0)) }
    }

    /// Whether to log this event: `Some(n)` with the number of events left out since the last
    /// one logged, or `None` (counted) to leave it out.
    pub fn admit(&self) -> Option<u64> {
        let mut state = self.state.lock();
        let (last, left_out) = &mut *state;
        match last {
            Some(at) if at.elapsed() < self.interval => {
                *left_out += 1;
                None
            }
            _ => {
                *last = Some(Instant::now());
                Some(std::mem::take(left_out))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_per_interval_and_the_next_says_how_many_were_left_out() {
        let limit = LogLimit::new(Duration::from_millis(100));
        assert_eq!(limit.admit(), Some(0));
        for _ in 0..5 {
            assert_eq!(limit.admit(), None);
        }
        std::thread::sleep(Duration::from_millis(120));
        assert_eq!(limit.admit(), Some(5));
        assert_eq!(limit.admit(), None);
    }
}
