//! The adaptive policy: ARC's lists, evicted either in ARC's order or in plain recency order,
//! whichever two sampled shadow caches show is hitting more on the workload right now.
//!
//! **The lists** (Megiddo and Modha, "ARC", FAST'03). `T1` holds keys cached and not used since,
//! `T2` keys used at least once while cached; `B1` and `B2` remember, without data, keys recently
//! evicted from each. A key inserted while it is a ghost of `B1` was evicted too early from the
//! recency side, so ARC's target for `T1` grows; a ghost of `B2` shrinks it. A ghost is kept
//! while fewer evictions than twice the tracked keys have followed its own, so both ghost lists
//! together hold at most twice as many keys as are tracked (ARC's own bound is once: twice lets
//! it see the reuse of a conversation's next turn, which comes late, at small capacities). ARC
//! bounds its lists by count instead, `B1` first; bounding them by age is what lets the shards
//! of a [`PolicyGroup`] keep the ghosts one policy would, each bounding only its own lists
//! (docs/performance.md has both rules' figures).
//!
//! **Two orders over the same lists.** Every tracked key carries the tick of its last use, and
//! `T1` and `T2` are each ordered by it, so the least recently used key overall is the older of
//! their two backs. In recency mode the policy evicts that key: it is exactly LRU. In ARC mode it
//! evicts from `T1` while `T1` is above ARC's target, otherwise from `T2`. ARC protects keys that
//! proved themselves against a stream of new ones, which is what a small cache facing long
//! multi-turn conversations needs; at capacities where recency already reaches near the optimum
//! its protection costs hits, which is where LRU is right.
//!
//! **Choosing the mode, online.** One key in four (by a mix of [`SampleKey::sample_bits`], so a
//! key is sampled or not on every node, in every run and in the simulation) also goes through
//! two small caches of a quarter of the tracked count: a plain LRU and an ARC. Each counts its
//! hits, decayed by `1 - 1/(8 x capacity)` per sampled access so the count follows the workload
//! over about eight shadow capacities of accesses: at the hit ratios of small caches a shorter
//! memory holds a handful of hits, and the mode then flips on noise (with one capacity, 30
//! switches over the synthetic trace at 2,000 blocks, and 0.006 below LRU there). The
//! policy switches mode when the other shadow leads by more than 5% (plus one hit), so it does
//! not flap between two near-equal choices. The shadows cost a quarter of the keys' memory each
//! and O(1) per sampled access.
//!
//! **Prefix chains.** A chunk is useless without its parent. Callers insert a chain's new chunks
//! leaf first and touch a hit's chunks leaf first (so its root is the most recent); both orders
//! here follow insertion and use, so a chain loses its tail before its root in either mode.
//!
//! Constants: sampling one in four, the 5% margin and the ghost bound of twice the tracked keys
//! were chosen on Mooncake's conversation trace and checked on the synthetic one; the score's
//! memory of eight capacities was chosen on the synthetic trace (where the shorter one lost to
//! LRU) and checked on the conversation trace. docs/performance.md has the tables.

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use super::group::{Member, PolicyGroup, Published};
use super::list::{KeyedLists, NodeId};
use super::{EvictionPolicy, Lru, SampleKey};

/// Keys cached and not used since.
const T1: usize = 0;
/// Keys used at least once while cached.
const T2: usize = 1;
/// Ghosts of keys evicted from `T1`.
const B1: usize = 2;
/// Ghosts of keys evicted from `T2`.
const B2: usize = 3;

/// Ghosts, `B1` and `B2` together, are kept up to this many times the tracked keys.
const GHOST_FACTOR: usize = 2;

/// A key is sampled into the shadows when the top `SAMPLE_SHIFT` bits of its mixed sample bits
/// are zero: one key in four.
pub(super) const SAMPLE_SHIFT: u32 = 2;

/// Below this many tracked keys (shadows of 16 keys each) the policy evicts in recency order:
/// the shadows are too small to tell the orders apart (a disk tier's few segments, say).
pub(super) const MIN_JUDGED: usize = 64;

/// The shadows' hit counts decay over this many shadow capacities of sampled accesses.
pub(super) const SCORE_MEMORY: f64 = 8.0;

/// The other shadow must lead by this fraction (and one hit) before the mode changes.
const SWITCH_MARGIN: f64 = 0.05;

/// Whether `key` goes through the shadows: one key in four, by a mix of its sample bits.
pub(super) fn sampled(key: &impl SampleKey) -> bool {
    key.sample_bits().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SAMPLE_SHIFT) == 0
}

/// Which order evictions follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Least recently used first, over `T1` and `T2` together.
    Recency,
    /// ARC's choice between the back of `T1` and the back of `T2`.
    Arc,
}

impl Mode {
    /// The mode after this one given the decayed hits of a recency shadow and an ARC shadow:
    /// it changes when the other shadow leads by the margin (and one hit).
    pub(super) fn judged(self, [recency, arc]: [f64; 2]) -> Mode {
        match self {
            Mode::Recency if arc > recency * (1.0 + SWITCH_MARGIN) + 1.0 => Mode::Arc,
            Mode::Arc if recency > arc * (1.0 + SWITCH_MARGIN) + 1.0 => Mode::Recency,
            mode => mode,
        }
    }
}

/// The adaptive policy; see the module documentation.
///
/// Inserting, touching and removing a key are O(1); a sampled key also costs O(1) in each shadow.
/// Nothing is allocated once the policy has held its peak number of keys and ghosts. An eviction
/// costs O(1) per key it returns or skips.
pub struct Adaptive<K> {
    cache: ArcLists<K>,
    /// Sampled keys in a plain LRU of a quarter of the tracked count.
    shadow_lru: Lru<K>,
    /// Sampled keys in an ARC of a quarter of the tracked count.
    shadow_arc: ArcLists<K>,
    /// Decayed hits of `shadow_lru` and `shadow_arc`.
    score: [f64; 2],
    mode: Mode,
    /// [`MIN_JUDGED`], lowered by tests that need the mode switch on a handful of keys.
    min_judged: usize,
    /// The group this policy is one shard of, if any: the group then judges the order.
    member: Option<Member>,
}

impl<K: Hash + Eq + Clone + Send + SampleKey> Adaptive<K> {
    /// An empty policy, evicting in recency order until the shadows say otherwise.
    pub fn new() -> Self {
        Adaptive {
            cache: ArcLists::new(),
            shadow_lru: Lru::new(),
            shadow_arc: ArcLists::new(),
            score: [0.0; 2],
            mode: Mode::Recency,
            min_judged: MIN_JUDGED,
            member: None,
        }
    }

    /// The policy of one shard of a [`PolicyGroup`]: its keys are stamped by the group's clock,
    /// and the group judges the order and ARC's choice between `T1` and `T2` for all shards.
    pub(super) fn in_group(member: Member) -> Self {
        let cache = ArcLists {
            group: Some(Arc::clone(&member.group)),
            shard: member.shard,
            ..ArcLists::new()
        };
        Adaptive { cache, member: Some(member), ..Self::new() }
    }

    /// Tells the group, if any, where this shard's next victims stand.
    fn publish(&self) {
        if let Some(member) = &self.member {
            let keys = &self.cache.keys;
            let oldest = |list| keys.back(list).map(|id| *keys.value(id));
            member.publish(Published {
                len: [keys.len(T1), keys.len(T2)],
                oldest: [oldest(T1), oldest(T2)],
                ghosts: [keys.len(B1), keys.len(B2)],
                score: self.score,
            });
        }
    }

    /// Replays one access of a sampled `key` in both shadows: a hit counts for the shadow, a
    /// miss caches the key there, evicting to the shadow's capacity first.
    fn shadow_access(&mut self, key: &K) {
        if !sampled(key) {
            return;
        }
        let capacity = (self.cache.len() >> SAMPLE_SHIFT).max(1);
        if self.shadow_lru.contains(key) {
            self.shadow_lru.touch(key);
            self.score[0] += 1.0;
        } else {
            let over = (self.shadow_lru.len() + 1).saturating_sub(capacity);
            self.shadow_lru.evict(over, &mut |_| true);
            self.shadow_lru.insert(key.clone());
        }
        if self.shadow_arc.contains(key) {
            self.shadow_arc.touch(key);
            self.score[1] += 1.0;
        } else {
            while self.shadow_arc.len() >= capacity
                && self.shadow_arc.evict_one(Mode::Arc, &mut |_| true).is_some()
            {}
            self.shadow_arc.insert(key.clone());
        }
        let keep = 1.0 - 1.0 / (SCORE_MEMORY * capacity as f64);
        self.score = self.score.map(|s| s * keep);
    }

    /// Switches mode when the other shadow leads by the margin.
    fn choose_mode(&mut self) {
        if let Some(member) = &self.member {
            self.mode = member.group.judge();
            return;
        }
        if self.cache.len() < self.min_judged {
            // Shadows of a few keys are noise: too few keys to choose, so recency.
            self.mode = Mode::Recency;
            return;
        }
        self.mode = self.mode.judged(self.score);
    }
}

impl<K: Hash + Eq + Clone + Send + SampleKey> Default for Adaptive<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Hash + Eq + Clone> fmt::Debug for Adaptive<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Adaptive")
            .field("mode", &self.mode)
            .field("cache", &self.cache)
            .field("score", &self.score)
            .finish()
    }
}

impl<K: Hash + Eq + Clone + Send + SampleKey> EvictionPolicy<K> for Adaptive<K> {
    fn insert(&mut self, key: K) {
        if self.cache.contains(&key) {
            return;
        }
        self.shadow_access(&key);
        self.cache.insert(key);
        self.publish();
    }

    fn touch(&mut self, key: &K) {
        if self.cache.contains(key) {
            self.shadow_access(key);
            self.cache.touch(key);
            self.publish();
        }
    }

    fn remove(&mut self, key: &K) -> bool {
        let removed = self.cache.remove(key);
        self.publish();
        removed
    }

    fn len(&self) -> usize {
        self.cache.len()
    }

    fn contains(&self, key: &K) -> bool {
        self.cache.contains(key)
    }

    fn stamp_next(&mut self, stamp: Option<u64>) {
        if self.member.is_some() {
            self.cache.next = stamp;
        }
    }

    fn in_arc_order(&self) -> bool {
        match &self.member {
            Some(member) => member.group.in_arc_order(),
            None => self.mode == Mode::Arc,
        }
    }

    fn evict(&mut self, n: usize, eligible: &mut dyn FnMut(&K) -> bool) -> Vec<K> {
        self.choose_mode();
        let mut victims = Vec::with_capacity(n.min(self.len()));
        let mut scan = Scan { t1: self.cache.keys.back(T1), t2: self.cache.keys.back(T2) };
        while victims.len() < n {
            match self.cache.evict_scanning(self.mode, &mut scan, eligible) {
                Some(key) => victims.push(key),
                None => break,
            }
        }
        self.publish();
        victims
    }
}

/// ARC's target for `T1` after a hit of a ghost of `B1` (`from_b1`) or of `B2`, given the
/// ghost lists' lengths and the tracked keys: ARC's rule, between 0 and the tracked count.
pub(super) fn adapted_target(target: f64, from_b1: bool, [b1, b2]: [f64; 2], tracked: f64) -> f64 {
    if from_b1 {
        (target + (b2 / b1).max(1.0)).min(tracked.max(1.0))
    } else {
        (target - (b1 / b2).max(1.0)).max(0.0)
    }
}

/// ARC's four lists; each tracked key's value is the tick of its last use, each ghost's the
/// number of the eviction that left it.
struct ArcLists<K> {
    keys: KeyedLists<K, u64, 4>,
    /// ARC's target size of `T1`, between 0 and the tracked count (unused in a group, which
    /// keeps one for all its shards).
    target: f64,
    /// Ticks once per insert or use.
    clock: u64,
    /// Evictions so far (in a group, the group counts them).
    evictions: u64,
    /// The group whose clock stamps the keys and which decides ARC's choice, if any.
    group: Option<Arc<PolicyGroup>>,
    /// This policy's shard in the group.
    shard: usize,
    /// In a group, the stamp of the next use when the caller set one.
    next: Option<u64>,
}

/// Where one eviction call has got to on `T1` and `T2`: every key older than a cursor was seen
/// in this call and found ineligible; `None` means the whole list was.
struct Scan {
    t1: Option<NodeId>,
    t2: Option<NodeId>,
}

impl<K: Hash + Eq + Clone> ArcLists<K> {
    fn new() -> Self {
        ArcLists {
            keys: KeyedLists::new(),
            target: 0.0,
            clock: 0,
            evictions: 0,
            group: None,
            shard: 0,
            next: None,
        }
    }

    /// ARC's choice: evict from `T1` (rather than `T2`) while it is above the target; in a
    /// group, `T1` summed over its shards and the group's target.
    fn t1_due(&self) -> bool {
        match &self.group {
            Some(group) => group.t1_due(),
            None => self.keys.len(T1) as f64 > self.target,
        }
    }

    fn len(&self) -> usize {
        self.keys.len(T1) + self.keys.len(T2)
    }

    fn contains(&self, key: &K) -> bool {
        self.keys.find(key).is_some_and(|id| self.keys.list_of(id) <= T2)
    }

    fn tick(&mut self) -> u64 {
        if let Some(group) = &self.group {
            return self.next.take().unwrap_or_else(|| group.tick());
        }
        self.clock += 1;
        self.clock
    }

    /// A use of a tracked key: it moves to the front of `T2`.
    fn touch(&mut self, key: &K) {
        if let Some(id) = self.keys.find(key)
            && self.keys.list_of(id) <= T2
        {
            *self.keys.value_mut(id) = self.tick();
            self.keys.move_to_front(id, T2);
        }
    }

    /// Caches `key`: on `T1`, or on `T2` when it is a ghost, adapting the target as ARC does.
    /// A tracked key is left as it is.
    fn insert(&mut self, key: K) {
        // A ghost past its age goes before it could count as one: in a group, evictions in
        // other shards age this shard's ghosts too.
        self.trim_ghosts();
        let stamp = self.tick();
        let (id, added) = self.keys.push_front_if_absent(T1, key, stamp);
        if !added {
            let from_b1 = match self.keys.list_of(id) {
                B1 => true,
                B2 => false,
                _ => return,
            };
            self.adapt_target(from_b1);
            *self.keys.value_mut(id) = stamp;
            self.keys.move_to_front(id, T2);
        }
        self.count_keys(1);
    }

    /// Tells the group, if any, that this shard tracks `delta` keys more.
    fn count_keys(&self, delta: i64) {
        if let Some(group) = &self.group {
            group.count_keys(delta);
        }
    }

    /// Moves ARC's target on a hit of a ghost of `B1` (`from_b1`) or `B2`, still on its list.
    fn adapt_target(&mut self, from_b1: bool) {
        let ghosts = [self.keys.len(B1), self.keys.len(B2)];
        match &self.group {
            Some(group) => group.adapt_target(from_b1, self.shard, ghosts),
            None => {
                let ghosts = ghosts.map(|n| n as f64);
                self.target = adapted_target(self.target, from_b1, ghosts, self.len() as f64);
            }
        }
    }

    fn remove(&mut self, key: &K) -> bool {
        match self.keys.find(key) {
            Some(id) if self.keys.list_of(id) <= T2 => {
                self.keys.remove_node(id);
                self.count_keys(-1);
                self.trim_ghosts();
                true
            }
            _ => false,
        }
    }

    /// Drops the ghosts that more evictions than `GHOST_FACTOR` times the tracked keys have
    /// followed (in a group, evictions and keys of all its shards). Each ghost list is in the
    /// order of its evictions, the oldest at the back.
    fn trim_ghosts(&mut self) {
        let (evictions, tracked) = match &self.group {
            Some(group) => (group.evictions(), group.tracked()),
            None => (self.evictions, self.len()),
        };
        let horizon = evictions.saturating_sub((GHOST_FACTOR * tracked) as u64);
        for list in [B1, B2] {
            while self.keys.back(list).is_some_and(|id| *self.keys.value(id) <= horizon) {
                self.keys.pop_back(list);
            }
        }
    }

    /// Numbers an eviction, for the ghost it leaves.
    fn count_eviction(&mut self) -> u64 {
        if let Some(group) = &self.group {
            return group.count_eviction();
        }
        self.evictions += 1;
        self.evictions
    }

    /// Evicts one key in `mode`, every key eligible.
    fn evict_one(&mut self, mode: Mode, eligible: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        let mut scan = Scan { t1: self.keys.back(T1), t2: self.keys.back(T2) };
        self.evict_scanning(mode, &mut scan, eligible)
    }

    /// Moves `cursor` on list from its position to the first eligible key, newer and newer.
    fn first_eligible(
        &self,
        cursor: &mut Option<NodeId>,
        eligible: &mut dyn FnMut(&K) -> bool,
    ) -> Option<NodeId> {
        while let Some(id) = *cursor {
            if eligible(self.keys.key(id)) {
                return Some(id);
            }
            *cursor = self.keys.newer(id);
        }
        None
    }

    /// Chooses and evicts the next victim in `mode`, leaving its ghost; `None` when no tracked
    /// key is eligible.
    fn evict_scanning(
        &mut self,
        mode: Mode,
        scan: &mut Scan,
        eligible: &mut dyn FnMut(&K) -> bool,
    ) -> Option<K> {
        let t1 = self.first_eligible(&mut scan.t1, eligible);
        let t2 = self.first_eligible(&mut scan.t2, eligible);
        let from_t1 = match (t1, t2) {
            (None, None) => return None,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some(a), Some(b)) => match mode {
                Mode::Recency => self.keys.value(a) < self.keys.value(b),
                Mode::Arc => self.t1_due(),
            },
        };
        let (id, cursor, ghost) =
            if from_t1 { (t1?, &mut scan.t1, B1) } else { (t2?, &mut scan.t2, B2) };
        *cursor = self.keys.newer(id);
        *self.keys.value_mut(id) = self.count_eviction();
        self.keys.move_to_front(id, ghost);
        self.count_keys(-1);
        let key = self.keys.key(id).clone();
        self.trim_ghosts();
        Some(key)
    }
}

impl<K: Hash + Eq + Clone> fmt::Debug for ArcLists<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArcLists")
            .field("t1", &self.keys.len(T1))
            .field("t2", &self.keys.len(T2))
            .field("b1", &self.keys.len(B1))
            .field("b2", &self.keys.len(B2))
            .field("target", &self.target)
            .finish()
    }
}

#[cfg(test)]
impl<K: Hash + Eq + Clone> Adaptive<K> {
    /// Evicts in ARC's order from now on, until the shadows say otherwise.
    pub(super) fn force_arc_mode(&mut self) {
        self.mode = Mode::Arc;
        self.score = [0.0, 1.0e9];
        self.min_judged = 0;
    }

    /// Lets the shadows choose the mode from `keys` tracked keys on, instead of `MIN_JUDGED`.
    pub(super) fn judging_from(mut self, keys: usize) -> Self {
        self.min_judged = keys;
        self
    }

    /// The number of ghosts.
    pub(super) fn ghosts(&self) -> usize {
        self.cache.keys.len(B1) + self.cache.keys.len(B2)
    }
}
