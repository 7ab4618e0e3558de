//! S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).
//!
//! Three FIFOs: new keys enter a small probationary FIFO `S`; a key that reaches the back of `S`
//! goes to the front of the main FIFO `M` if it was used there often enough, and otherwise is
//! evicted, leaving its key in the ghost FIFO `G`. Inserting a key found in `G` puts it straight
//! into `M`. `M` is FIFO with reinsertion: a key at its back with a nonzero frequency goes back
//! to the front one lower, a key with frequency 0 is evicted. Frequencies saturate at 3 (two
//! bits). Eviction takes from `S` while it holds at least its share of the keys (or while `M` is
//! empty), otherwise from `M`.
//!
//! Where this implementation has to choose, it follows the paper's reference implementation,
//! libCacheSim's `S3FIFOv0.c` (the SOSP artifact):
//! - A key promoted from `S` starts in `M` with frequency 0: the reference inserts it into `M`
//!   as a new object, whose metadata is zeroed. Reinsertion within `M` keeps `freq - 1`.
//! - Only keys evicted from `S` become ghosts, and a ghost enters `M` with frequency 0.
//! - The policy has no capacity of its own, so "cache size" is the number of tracked keys: `S`
//!   is due while `|S| >= share * (|S| + |M|)`. For the same reason new keys always enter `S`
//!   (the later `S3FIFO.c` sends them to `M` while a cold cache is still filling).
//! - The ghost FIFO holds at most as many keys as are tracked. The reference sizes it at 90% of
//!   the cache, the share of `M`; on the traces below the two bounds differ by under 0.003 in hit
//!   ratio. It is trimmed at the end of every eviction and removal, so the bound always holds.
//! - [`EvictionPolicy::remove`] is a deletion, not an eviction: the key leaves no ghost. A key
//!   that is only a ghost is not tracked, so removing it changes nothing.
//!
//! Two defaults differ from the reference's, chosen by replaying the Mooncake traces as a prefix
//! cache of 1,000 to 30,000 blocks against LRU (`tierkv replay --simulate`, pinned by
//! `crates/tierkv-replay/tests/mooncake.rs`):
//! - Promotion threshold 0, promoting a key used once on probation; the reference's
//!   `move-to-main-threshold=2` is threshold 1 here. With threshold 1, no share of `S` from 10%
//!   to 80% beats LRU at 30,000 blocks on either trace.
//! - `S` takes 60% of the keys rather than 10%. In the conversation trace most second uses of a
//!   block come 3,000 to 30,000 distinct blocks after the first (the next turn of the same
//!   conversation), so a 10% probation queue demotes them shortly before they would hit. At 10%,
//!   S3-FIFO trails LRU there at 10,000 blocks (0.202 against 0.211) and 30,000 (0.286 against
//!   0.326). Shares from 54% to 64% beat LRU at all eight tested points; 60% has the largest
//!   smallest margin, yet that margin is only 0.0015 (conversation at 30,000), and at untested
//!   sizes LRU still wins (synthetic at 20,000 blocks, conversation at 40,000 and 50,000).
//!   [`S3Fifo::with_tuning`] restores the paper's 10%.
//!
//! Callers that insert a chain of prefix blocks should insert its new blocks leaf first: `S`
//! evicts in insertion order, so a chain then loses its tail before its root and what remains is
//! still a usable prefix.
//!
//! Eligibility: a key the caller's filter rejects is skipped where it stands. It keeps its FIFO,
//! its place and its frequency; it is neither promoted nor reinserted.

use std::fmt;
use std::hash::Hash;

use super::EvictionPolicy;
use super::group::{Member, Published};
use super::list::{KeyedLists, NodeId};

/// The small probationary FIFO, where new keys start.
pub(super) const SMALL: usize = 0;
/// The main FIFO with reinsertion, for keys that proved themselves.
pub(super) const MAIN: usize = 1;
/// The ghost FIFO: keys recently evicted from `SMALL`, kept without data.
pub(super) const GHOST: usize = 2;

/// The saturating frequency's ceiling: two bits per key.
const MAX_FREQ: u8 = 3;

/// Promote a key from the small FIFO once it has been used there at all.
const DEFAULT_PROMOTION_THRESHOLD: u8 = 0;

/// The small FIFO supplies victims while it holds at least 60% of the tracked keys.
pub(super) const DEFAULT_SMALL_PERCENT: u8 = 60;

/// A tracked key's state: its frequency, and the stamp of its entry into its FIFO (read only in
/// a [`super::PolicyGroup`], where the stamps of the shards' FIFOs are compared).
#[derive(Clone, Copy, Debug, Default)]
struct Place {
    freq: u8,
    stamp: u64,
}

/// S3-FIFO: a small probationary FIFO filters out keys used only once, a main FIFO with
/// reinsertion keeps the rest, and a ghost FIFO sends keys evicted too early straight back to the
/// main FIFO.
///
/// Inserting, touching and removing a key are O(1) and allocate nothing once the policy has held
/// its peak number of keys; an eviction costs O(1) per key it returns, skips or reinserts.
pub struct S3Fifo<K> {
    /// Every tracked key (on `SMALL` or `MAIN`) and every ghost (on `GHOST`), with the key's
    /// access frequency, 0 to `MAX_FREQ`, and its stamp. Ghosts keep a frequency of 0 that
    /// nothing reads.
    keys: KeyedLists<K, Place, 3>,
    /// A key leaves the small FIFO for the main one when its frequency exceeds this.
    promote_above: u8,
    /// The small FIFO's share of the tracked keys, in percent, from which it supplies victims.
    small_percent: u8,
    /// The group this policy is one shard of, if any: the small FIFO's share is then the
    /// group's.
    member: Option<Member>,
}

impl<K: Hash + Eq + Clone> S3Fifo<K> {
    /// An empty policy with the measured defaults: promotion after one use on probation, and a
    /// small FIFO of 60% (see the module documentation for why).
    pub fn new() -> Self {
        Self::with_tuning(DEFAULT_PROMOTION_THRESHOLD, DEFAULT_SMALL_PERCENT)
    }

    /// An empty policy that promotes a key from the small FIFO to the main one only when its
    /// frequency exceeds `threshold` (0 to 2; larger values act as 2, since the frequency
    /// saturates at 3). The paper's reference implementation uses 1; the default is 0.
    pub fn with_promotion_threshold(threshold: u8) -> Self {
        Self::with_tuning(threshold, DEFAULT_SMALL_PERCENT)
    }

    /// An empty policy with both tuning knobs set: the promotion threshold, as for
    /// [`S3Fifo::with_promotion_threshold`], and the small FIFO's share of the tracked keys in
    /// percent (1 to 99; other values are clamped). The paper uses 10%; workloads whose second
    /// use of an object comes late, such as multi-turn conversations, want a larger share.
    pub fn with_tuning(promotion_threshold: u8, small_percent: u8) -> Self {
        S3Fifo {
            keys: KeyedLists::new(),
            promote_above: promotion_threshold.min(MAX_FREQ - 1),
            small_percent: small_percent.clamp(1, 99),
            member: None,
        }
    }

    /// The policy of one shard of a [`super::PolicyGroup`], with the default tuning.
    pub(super) fn in_group(member: Member) -> Self {
        S3Fifo { member: Some(member), ..Self::new() }
    }

    /// A stamp for a key entering a FIFO: the group's clock, or 0 alone (nothing reads it).
    fn stamp(&mut self) -> u64 {
        self.member.as_mut().map_or(0, Member::tick)
    }

    /// Moves `id` to the front of `list` as a new entry there.
    fn enter(&mut self, id: NodeId, list: usize) {
        let stamp = self.stamp();
        self.keys.value_mut(id).stamp = stamp;
        self.keys.move_to_front(id, list);
    }

    /// Tells the group, if any, where this shard's next victims stand.
    fn publish(&self) {
        if let Some(member) = &self.member {
            let oldest = |list| self.keys.back(list).map(|id| self.keys.value(id).stamp);
            member.publish(Published {
                len: [self.keys.len(SMALL), self.keys.len(MAIN)],
                oldest: [oldest(SMALL), oldest(MAIN)],
                ..Published::default()
            });
        }
    }

    /// Whether the next victim should come from the small FIFO: it holds at least its share of
    /// the tracked keys.
    fn small_is_due(&self) -> bool {
        if let Some(member) = &self.member {
            return member.group.small_is_due(self.small_percent);
        }
        let small = self.keys.len(SMALL) as u64;
        let tracked = small + self.keys.len(MAIN) as u64;
        small * 100 >= tracked * u64::from(self.small_percent)
    }

    /// Drops the oldest ghosts until there are no more ghosts than tracked keys.
    fn trim_ghosts(&mut self) {
        let bound = self.keys.len(SMALL) + self.keys.len(MAIN);
        while self.keys.len(GHOST) > bound {
            self.keys.pop_back(GHOST);
        }
    }

    /// Takes the next victim from the small FIFO, promoting eligible keys used often enough to the
    /// main FIFO on the way. Returns `None` once the small FIFO has no eligible candidate left.
    fn evict_small(&mut self, scan: &mut Scan, eligible: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        while let Some(id) = scan.small {
            scan.steps += 1;
            scan.small = self.keys.newer(id);
            if !eligible(self.keys.key(id)) {
                continue;
            }
            if self.keys.value(id).freq > self.promote_above {
                self.keys.value_mut(id).freq = 0;
                self.enter(id, MAIN);
                // With the main scan finished, everything older on the main FIFO was seen and is
                // ineligible, so the promoted key is the scan's next candidate.
                scan.main.get_or_insert(id);
                continue;
            }
            // The victim stays behind as a ghost; `evict` trims the ghost FIFO once it is done.
            self.keys.value_mut(id).freq = 0;
            self.keys.move_to_front(id, GHOST);
            return Some(self.keys.key(id).clone());
        }
        None
    }

    /// Takes the next victim from the main FIFO, reinserting eligible keys with a nonzero
    /// frequency at its front, one lower. Returns `None` once the main FIFO has no eligible
    /// candidate left.
    fn evict_main(&mut self, scan: &mut Scan, eligible: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        while let Some(id) = scan.main {
            scan.steps += 1;
            let newer = self.keys.newer(id);
            if !eligible(self.keys.key(id)) {
                scan.main = newer;
                continue;
            }
            let freq = &mut self.keys.value_mut(id).freq;
            if *freq > 0 {
                *freq -= 1;
                self.enter(id, MAIN);
                // A key that was already the newest is its own successor.
                scan.main = Some(newer.unwrap_or(id));
                continue;
            }
            scan.main = newer;
            return Some(self.keys.remove_node(id).0);
        }
        None
    }
}

impl<K: Hash + Eq + Clone> Default for S3Fifo<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K> fmt::Debug for S3Fifo<K>
where
    K: Hash + Eq + Clone,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Fifo")
            .field("small", &self.keys.len(SMALL))
            .field("main", &self.keys.len(MAIN))
            .field("ghost", &self.keys.len(GHOST))
            .field("promote_above", &self.promote_above)
            .field("small_percent", &self.small_percent)
            .finish()
    }
}

impl<K: Hash + Eq + Clone + Send> EvictionPolicy<K> for S3Fifo<K> {
    fn insert(&mut self, key: K) {
        let stamp = self.stamp();
        let (id, added) = self.keys.push_front_if_absent(SMALL, key, Place { freq: 0, stamp });
        if !added && self.keys.list_of(id) == GHOST {
            // Evicted from the small FIFO too early: it goes straight to the main FIFO.
            self.keys.value_mut(id).stamp = stamp;
            self.keys.move_to_front(id, MAIN);
        }
        self.publish();
    }

    fn touch(&mut self, key: &K) {
        if let Some(id) = self.keys.find(key)
            && self.keys.list_of(id) != GHOST
        {
            let freq = &mut self.keys.value_mut(id).freq;
            *freq = (*freq + 1).min(MAX_FREQ);
        }
    }

    fn remove(&mut self, key: &K) -> bool {
        match self.keys.find(key) {
            Some(id) if self.keys.list_of(id) != GHOST => {
                self.keys.remove_node(id);
                self.trim_ghosts();
                self.publish();
                true
            }
            _ => false,
        }
    }

    fn len(&self) -> usize {
        self.keys.len(SMALL) + self.keys.len(MAIN)
    }

    fn contains(&self, key: &K) -> bool {
        self.keys.find(key).is_some_and(|id| self.keys.list_of(id) != GHOST)
    }

    fn stamp_next(&mut self, stamp: Option<u64>) {
        if let Some(member) = &mut self.member {
            member.next = stamp;
        }
    }

    fn evict(&mut self, n: usize, eligible: &mut dyn FnMut(&K) -> bool) -> Vec<K> {
        // Termination, even when nothing is eligible. Weigh each key not yet behind its FIFO's
        // cursor: 2 on `S`, and `freq + 1` (at most 4) on `M`. Every step lowers the total:
        // skipping or demoting a key of `S` by 2; promoting one by 1, since it lands ahead of the
        // `M` cursor with frequency 0; skipping or evicting a key of `M` by at least 1; and
        // reinserting one by 1, since its frequency drops. Nothing adds weight, so a call takes at
        // most `2 * |S| + 4 * |M|` steps. The loop below stops at its first round without a
        // victim, and a round makes at most three calls, so the calls add O(1) per victim.
        let (small_len, main_len) = (self.keys.len(SMALL), self.keys.len(MAIN));
        let mut victims = Vec::with_capacity(n.min(small_len + main_len));
        let mut scan = Scan { small: self.keys.back(SMALL), main: self.keys.back(MAIN), steps: 0 };
        while victims.len() < n {
            let victim = if scan.small.is_some() && (scan.main.is_none() || self.small_is_due()) {
                self.evict_small(&mut scan, eligible)
                    .or_else(|| self.evict_main(&mut scan, eligible))
            } else {
                // The small FIFO may promote keys on its way to a victim; if it finds none, those
                // promoted keys are the main FIFO's only candidates left.
                self.evict_main(&mut scan, eligible)
                    .or_else(|| self.evict_small(&mut scan, eligible))
                    .or_else(|| self.evict_main(&mut scan, eligible))
            };
            match victim {
                Some(key) => victims.push(key),
                None => break,
            }
        }
        debug_assert!(
            scan.steps <= 2 * small_len + 4 * main_len,
            "eviction scan ran past its bound"
        );
        self.trim_ghosts();
        self.publish();
        victims
    }
}

/// Where one call to `evict` has got to on each FIFO.
///
/// Every key older than a cursor on its FIFO has been seen in this call and found ineligible; a
/// cursor of `None` means the whole FIFO was.
struct Scan {
    small: Option<NodeId>,
    main: Option<NodeId>,
    /// Keys examined, checked against the bound proved in `evict`.
    steps: usize,
}

#[cfg(test)]
impl<K: Hash + Eq + Clone> S3Fifo<K> {
    /// The FIFO holding `key`, ghosts included.
    pub(super) fn queue_of(&self, key: &K) -> Option<usize> {
        self.keys.find(key).map(|id| self.keys.list_of(id))
    }

    /// The frequency of `key`, ghosts included.
    pub(super) fn freq_of(&self, key: &K) -> Option<u8> {
        self.keys.find(key).map(|id| self.keys.value(id).freq)
    }

    /// The number of keys on one FIFO.
    pub(super) fn queue_len(&self, queue: usize) -> usize {
        self.keys.len(queue)
    }
}
