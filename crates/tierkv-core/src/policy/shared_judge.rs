//! A [`Judge`] that many threads tell their lookups without waiting on one another.
//!
//! The StorageManager tells the judge of the tiers below L1 every lookup's chunks, from every
//! connection's thread. Behind a plain mutex, a lookup would wait while another lookup's
//! sampled chunks went through the judge's shadows. Here a lookup queues the chunks the judge
//! samples (one in four or fewer; it ignores the rest) and hands the queue to the judge only if
//! no other thread holds it; a thread that finds it busy leaves its chunks to the one holding
//! it, which looks at the queue again once it lets go, or to the next lookup. So no lookup
//! waits on the judge, and the judge hears the chunks in the order they were queued: with one
//! lookup at a time, exactly the order a plain judge would, so the simulation's judge still
//! agrees with the daemon's.
//!
//! A lookup hands the judge at most twice its own sampled chunks and [`DRAIN_SLACK`] more, so
//! none pays for many others' (draining a queue of 65,536 at once took 23 ms in the policy
//! bench),
//! and the queue is bounded ([`QUEUED_AT_MOST`]): were the judge that far behind, a chunk beyond
//! it goes unheard (counted by [`SharedJudge::looked_up`]'s caller), which only thins the
//! judge's sample.

use std::hash::Hash;
use std::sync::atomic::{Ordering, fence};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use super::SampleKey;
use super::adaptive::{Judge, JudgedOrder, sampled_one_in};

/// The most sampled keys waiting for the judge.
const QUEUED_AT_MOST: usize = 1 << 12;

/// Queued keys a lookup hands the judge beyond twice its own sampled ones: what lets a lookup
/// with few sampled chunks help drain the queue.
const DRAIN_SLACK: usize = 64;

/// A [`Judge`] shared by the threads that look chunks up; see the module documentation.
pub struct SharedJudge<K> {
    judge: Mutex<Judge<K>>,
    queue: Sender<K>,
    queued: Receiver<K>,
    /// The judge's sample, read without its lock.
    shift: u32,
    order: JudgedOrder,
}

impl<K: Hash + Eq + Clone + Send + SampleKey> SharedJudge<K> {
    /// A judge for tiers that hold `capacity` chunks together ([`Judge::new`]).
    pub fn new(capacity: usize) -> Self {
        let judge = Judge::new(capacity);
        let (queue, queued) = crossbeam_channel::bounded(QUEUED_AT_MOST);
        SharedJudge {
            shift: judge.sample_shift(),
            order: judge.order(),
            judge: Mutex::new(judge),
            queue,
            queued,
        }
    }

    /// The order chosen, for the policies that follow it; read without a lock.
    pub fn order(&self) -> JudgedOrder {
        self.order.clone()
    }

    /// One lookup of `keys`, leaf first within each chain, as [`Judge::looked_up`] takes them.
    /// Never waits for another thread. Returns how many of its sampled keys the judge will
    /// never hear, the judge being 4,096 sampled keys behind.
    pub fn looked_up<'a>(&self, keys: impl IntoIterator<Item = &'a K>) -> u64
    where
        K: 'a,
    {
        let (mut own, mut dropped) = (0, 0);
        for key in keys.into_iter().filter(|key| sampled_one_in(*key, self.shift)) {
            own += 1;
            // Full (the receiver is this judge's own, so never gone): the judge is far behind.
            if self.queue.try_send(key.clone()).is_err() {
                dropped += 1;
            }
        }
        let mut budget = 2 * own + DRAIN_SLACK;
        while budget > 0 {
            // A key queued while another thread held the judge is seen by that thread's check
            // after it lets go, or this thread's lock succeeds (the fences order each thread's
            // queue and lock against the other's); what neither takes within its budget waits
            // for the next lookup.
            fence(Ordering::SeqCst);
            if self.queued.is_empty() {
                break;
            }
            let Some(mut judge) = self.judge.try_lock() else {
                break;
            };
            for key in self.queued.try_iter().take(budget) {
                judge.looked_up(&key);
                budget -= 1;
            }
        }
        dropped
    }
}

#[cfg(test)]
impl<K> SharedJudge<K> {
    /// Holds the judge, as a lookup telling it its chunks would, until the guard drops.
    pub(super) fn hold(&self) -> parking_lot::MutexGuard<'_, Judge<K>> {
        self.judge.lock()
    }

    /// Sampled keys waiting for the judge.
    pub(super) fn queued(&self) -> usize {
        self.queued.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::policy::Order;

    /// Lookups of a hot set between scans, as the adaptive tests judge them: the plain judge and
    /// the shared one, told the same lookups one at a time, choose the same order at every step.
    #[test]
    fn told_one_lookup_at_a_time_it_judges_as_a_plain_judge() {
        let capacity = 1_000;
        let (mut plain, shared) = (Judge::<u64>::new(capacity), SharedJudge::<u64>::new(capacity));
        let mut orders = Vec::new();
        for round in 0..60u64 {
            let hot: Vec<u64> = (0..600).collect();
            let scan: Vec<u64> = (0..1_200).map(|i| 1_000_000 + round * 1_200 + i).collect();
            for lookup in hot.chunks(8).chain(scan.chunks(8)) {
                lookup.iter().for_each(|key| plain.looked_up(key));
                shared.looked_up(lookup);
                assert_eq!(shared.order().order(), plain.order().order(), "round {round}");
                orders.push(shared.order().order());
            }
        }
        assert!(orders.contains(&Order::Recency) && orders.iter().any(|o| *o != Order::Recency));
        assert_eq!(shared.hold().heard(), plain.heard());
    }

    /// A lookup that finds the judge held returns at once, its sampled chunks queued; the next
    /// lookup after the judge is free hands them over, in order, with its own.
    #[test]
    fn no_lookup_waits_for_a_busy_judge() {
        let shared = Arc::new(SharedJudge::<u64>::new(1_000));
        let keys: Vec<u64> = (0..400).collect();
        let sampled = keys.iter().filter(|key| sampled_one_in(*key, shared.shift)).count() as u64;
        assert!(sampled > 50, "{sampled} of 400 sampled");
        let held = shared.hold();
        let (done, finished) = crossbeam_channel::bounded(1);
        let looking = Arc::clone(&shared);
        let lookup = std::thread::spawn(move || {
            let dropped = looking.looked_up(&(0..400).collect::<Vec<u64>>());
            let _ = done.send(dropped);
        });
        let returned = finished.recv_timeout(Duration::from_secs(30));
        assert_eq!(returned.ok(), Some(0), "the lookup waited for the judge, or dropped keys");
        assert!(lookup.join().is_ok());
        assert_eq!(held.heard(), 0, "nothing reached the judge while it was held");
        assert_eq!(shared.queued() as u64, sampled, "they wait in the queue");
        drop(held);
        // A lookup of no sampled chunks hands over what it may: [`DRAIN_SLACK`] of them.
        assert_eq!(shared.looked_up(&[]), 0);
        assert_eq!(shared.hold().heard(), DRAIN_SLACK as u64, "a lookup hands over its share");
        // One with as many sampled chunks as are left hands over every one.
        let more: Vec<u64> = (1_000..1_400).collect();
        let own = more.iter().filter(|key| sampled_one_in(*key, shared.shift)).count() as u64;
        assert_eq!(shared.looked_up(&more), 0);
        assert_eq!(shared.hold().heard(), sampled + own);
        assert_eq!(shared.queued(), 0);
    }

    /// Past [`QUEUED_AT_MOST`] keys behind, the judge misses samples and counts them; it never
    /// blocks the lookup that queues them.
    #[test]
    fn a_judge_far_behind_drops_samples_and_counts_them() {
        let shared = SharedJudge::<u64>::new(1_000);
        let keys: Vec<u64> = (0..8 * QUEUED_AT_MOST as u64).collect();
        let sampled = keys.iter().filter(|key| sampled_one_in(*key, shared.shift)).count();
        assert!(sampled > QUEUED_AT_MOST, "{sampled} sampled");
        let held = shared.hold();
        let dropped = shared.looked_up(&keys);
        drop(held);
        assert_eq!(shared.queued(), QUEUED_AT_MOST);
        assert_eq!(dropped, (sampled - QUEUED_AT_MOST) as u64);
    }

    /// Many threads at once, doing nothing else: every sampled chunk reaches the judge once or
    /// is counted as dropped, none twice, none lost.
    #[test]
    fn lookups_from_many_threads_all_reach_the_judge() {
        let shared = Arc::new(SharedJudge::<u64>::new(100_000));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let shared = Arc::clone(&shared);
                std::thread::spawn(move || {
                    (0..2_000u64)
                        .map(|lookup| {
                            let first = (t * 2_000 + lookup) * 16;
                            shared.looked_up(&(first..first + 16).collect::<Vec<u64>>())
                        })
                        .sum::<u64>()
                })
            })
            .collect();
        let mut dropped = 0;
        for thread in threads {
            dropped += thread.join().unwrap_or(u64::MAX);
        }
        while shared.queued() > 0 {
            shared.looked_up(&[]);
        }
        let sampled = (0..4 * 2_000 * 16u64).filter(|key| sampled_one_in(key, shared.shift));
        assert_eq!(shared.hold().heard() + dropped, sampled.count() as u64);
    }
}
