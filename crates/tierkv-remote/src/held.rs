//! What this node stored in the remote tier and may still be there: the tier's `used_bytes` and
//! `objects`. Redis does not say when a value leaves (its TTL, the server's eviction, another
//! node's overwrite), so this is an upper bound: stores add, and with a TTL a store leaves the
//! count once its values have certainly expired. Without one, nothing subtracts (this node
//! never deletes from the shared tier). A chunk stored twice within its TTL counts twice.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Stores are counted in buckets of `ttl / BUCKETS`: a bucket leaves the count one bucket's
/// width after its last store's TTL ended.
const BUCKETS: u32 = 32;

/// Objects and bytes in one bucket of time.
#[derive(Clone, Copy, Default)]
struct Bucket {
    since: Option<Instant>,
    objects: u64,
    bytes: u64,
}

pub(crate) struct Held {
    /// `None`: values never expire.
    ttl: Option<Duration>,
    buckets: Mutex<VecDeque<Bucket>>,
}

impl Held {
    pub(crate) fn new(ttl: Option<Duration>) -> Self {
        Held { ttl, buckets: Mutex::new(VecDeque::new()) }
    }

    fn width(&self) -> Option<Duration> {
        self.ttl.map(|ttl| ttl / BUCKETS)
    }

    /// `objects` values of `bytes` payload bytes in all were stored now.
    pub(crate) fn stored(&self, objects: u64, bytes: u64) {
        if objects == 0 {
            return;
        }
        let now = Instant::now();
        let mut buckets = self.buckets.lock();
        let open = match (buckets.back(), self.width()) {
            // A width past what an instant can hold (a TTL of centuries): one bucket forever.
            (Some(last), Some(width)) => {
                last.since.is_some_and(|s| s.checked_add(width).is_none_or(|end| now < end))
            }
            (Some(_), None) => true,
            (None, _) => false,
        };
        if !open {
            buckets.push_back(Bucket { since: Some(now), objects: 0, bytes: 0 });
        }
        if let Some(last) = buckets.back_mut() {
            last.objects += objects;
            last.bytes += bytes;
        }
    }

    /// Objects and bytes stored and not yet certainly gone.
    pub(crate) fn now(&self) -> (u64, u64) {
        let mut buckets = self.buckets.lock();
        // A TTL too long to add to (a file can name centuries) never ends.
        if let Some(gone_after) = self.ttl.zip(self.width()).and_then(|(t, w)| t.checked_add(w)) {
            while buckets
                .front()
                .is_some_and(|b| b.since.is_some_and(|s| s.elapsed() >= gone_after))
            {
                buckets.pop_front();
            }
        }
        buckets.iter().fold((0, 0), |(o, b), bucket| (o + bucket.objects, b + bucket.bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_leave_the_count_once_expired() {
        let held = Held::new(Some(Duration::from_millis(320)));
        held.stored(2, 2000);
        std::thread::sleep(Duration::from_millis(200));
        held.stored(1, 1000);
        assert_eq!(held.now(), (3, 3000));
        // Past the first stores' TTL (and a bucket's width), before the last one's.
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(held.now(), (1, 1000));
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(held.now(), (0, 0));

        // A TTL no instant or duration can be added to: counted, never a panic, never gone.
        let centuries = Held::new(Some(Duration::MAX));
        centuries.stored(1, 1000);
        centuries.stored(2, 2000);
        assert_eq!(centuries.now(), (3, 3000));

        let forever = Held::new(None);
        forever.stored(3, 3000);
        forever.stored(1, 1000);
        assert_eq!(forever.now(), (4, 4000));
    }
}
