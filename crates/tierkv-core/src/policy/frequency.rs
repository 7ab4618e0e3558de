//! The adaptive policy's third order: GreedyDual over use counts, remembered past eviction.
//!
//! **Why.** On multi-turn conversations a small cache holds none of a conversation's chunks
//! until its next turn: the turns come minutes apart, after thousands of other chunks. What a
//! cache that size can still do is keep the chunks most likely to be asked for again, and how
//! often a chunk was asked for so far is the best sign of that the traces offer (a conversation
//! that reached its fourth turn goes on twice as often as one at its first). ARC's lists tell
//! only "used once" from "used again while cached", and forget a chunk a few capacities after
//! its eviction; this order counts every use of the last [`HISTORY_FACTOR`] capacities of
//! chunks, cached or not, and ranks by the count.
//!
//! **The order** (GreedyDual, Cao and Irani 1997, with a chunk's value taken from its use
//! count, as GreedyDual-Frequency does). Each use of a cached key gives it the priority
//! `floor + value(uses)`, where `value` grows with the cube of the uses (1, 8, 27, ... for
//! 1, 2, 3, ... uses, up to [`CLASSES`]), and the victim is the key of lowest priority, the
//! least recently used among equals. Each eviction raises `floor` to the victim's priority,
//! so a key not used again ages out however often it was used before: a count is worth its
//! value once, not forever. A chain stays a prefix: every request that names a chain's tail
//! names its root too, so the root's count is never below the tail's, and it is used later.
//!
//! **Cost.** Keys of equal uses share a class, and within a class priorities follow the order
//! of use (the floor only rises), so each class is a recency list and the victim is the lowest
//! of the [`CLASSES`] lists' backs: O(1) per use, O(`CLASSES`) per victim, no allocation in
//! steady state. The history is a set-associative table of 8-byte entries for [`HISTORY_FACTOR`]
//! times the tracked keys, rounded up to a power of two of sets: under 512 bytes a cached chunk,
//! a few hundredths of a percent of a 2 MiB chunk.
//!
//! Constants (the value's exponent, six classes, a history of 32 capacities) were chosen on
//! Mooncake's conversation trace and checked on the synthetic trace: exponents 3-4 and 6-8
//! classes read within 0.003 of each other in a Python prototype of the same rules; histories of
//! 32 and 64 capacities read the same summed over 37 capacities, 16 less (docs/performance.md,
//! "Counting uses past eviction").

use std::hash::Hash;

use super::list::{KeyedLists, NodeId};

/// Keys are classed by uses: 1, 2, ... up to this many, the last class for more.
pub(super) const CLASSES: usize = 6;

/// The history counts the uses of up to this many times the tracked keys.
pub(super) const HISTORY_FACTOR: usize = 32;

/// The priority a use adds to the floor for a key of `class` (`class + 1` uses): the cube of
/// its uses, so a key used twice outlasts eight keys used once that came with it.
pub(super) fn class_value(class: usize) -> u64 {
    let uses = class as u64 + 1;
    uses * uses * uses
}

/// The class of a key used `uses` times (at least once).
pub(super) fn class_of(uses: u32) -> usize {
    (uses.max(1) as usize).min(CLASSES) - 1
}

/// Keys per set of the history: one 64-byte cache line.
const WAYS: usize = 32;

/// The low bits of a history entry that hold the key's uses; the bits above hold its tag, and
/// the top [`PLACE_BITS`] of those where it is placed.
const USES_BITS: u32 = 8;

/// The bits of a key's place, which chooses its set: up to 2^24 sets.
const PLACE_BITS: u32 = 24;

/// How many times each recently seen key was used, cached or not: a set-associative table of
/// key fingerprints with their counts, each set of [`WAYS`] in order of use. A key is forgotten
/// when [`WAYS`] more recently used keys share its set: about the least recently used of the
/// table's keys, as an LRU list would forget them, without the list's pointers (one random
/// access per count instead of five; the policy's accesses took half as long again with the
/// list).
///
/// A key's set comes from its [`SampleKey::sample_bits`](super::SampleKey::sample_bits), its tag
/// within the set from its [`SampleKey::identity_bits`](super::SampleKey::identity_bits): a trace
/// chunk and the daemon's chunk of the same id share a set, and are forgotten at the same time,
/// so the daemon still counts what the simulation counts, while the ranks of one chunk are
/// counted apart. Two keys of one set with the same 32-bit tag would share a count: by chance,
/// one pair in 2^32 in a set.
pub(super) struct UseHistory {
    /// `sets * WAYS` entries, each `place << 56 | tag << 8 | uses` (uses at least 1), 0 when
    /// empty; within a set the most recently used first.
    entries: Vec<u64>,
}

impl UseHistory {
    pub(super) fn new() -> Self {
        UseHistory { entries: Vec::new() }
    }

    /// splitmix64's finalizer: a trace's chunk ids are consecutive.
    fn mix(bits: u64) -> u64 {
        let mut z = bits;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A key's entry without its uses: its place (from `sample_bits`) above its tag (from
    /// `identity_bits`).
    fn key(sample_bits: u64, identity_bits: u64) -> u64 {
        let place = Self::mix(sample_bits) >> (64 - PLACE_BITS);
        let tag = Self::mix(identity_bits) & 0xFFFF_FFFF;
        (place << 32 | tag) << USES_BITS
    }

    /// The first entry of the set of an entry's `key`.
    fn set_of(&self, key: u64) -> usize {
        let sets = self.entries.len() / WAYS;
        ((key >> (64 - PLACE_BITS)) as usize & (sets - 1)) * WAYS
    }

    /// Grows the table to hold at least `bound` keys, if it holds fewer; it never shrinks.
    pub(super) fn reserve(&mut self, bound: usize) {
        if bound > self.entries.len() {
            self.grow(bound);
        }
    }

    /// Counts one use of the key of these bits and returns its uses so far.
    pub(super) fn record(&mut self, sample_bits: u64, identity_bits: u64) -> u32 {
        if self.entries.is_empty() {
            self.grow(1);
        }
        let key = Self::key(sample_bits, identity_bits);
        let start = self.set_of(key);
        let uses = Self::use_in(&mut self.entries[start..start + WAYS], key, 1);
        u32::from(uses)
    }

    /// Adds `uses` to `key`'s count in `set` (a new entry when it has none, pushing out the
    /// least recently used) and moves it first; returns its count.
    fn use_in(set: &mut [u64], key: u64, uses: u8) -> u8 {
        let found = Self::find(set, key);
        let at = found.unwrap_or(WAYS - 1);
        let before = found.map_or(0, |at| set[at] as u8);
        let count = before.saturating_add(uses);
        // The used entry goes first; those before it move down one (the last one out).
        set.copy_within(0..at, 1);
        set[0] = key | u64::from(count);
        count
    }

    /// Where `key` is in `set`.
    fn find(set: &[u64], key: u64) -> Option<usize> {
        set.iter().position(|e| e >> USES_BITS << USES_BITS == key)
    }

    /// The uses counted for the key of these bits, 1 when it is not remembered.
    #[cfg(test)]
    pub(super) fn uses(&self, sample_bits: u64, identity_bits: u64) -> u32 {
        if self.entries.is_empty() {
            return 1;
        }
        let key = Self::key(sample_bits, identity_bits);
        let start = self.set_of(key);
        let set = &self.entries[start..start + WAYS];
        Self::find(set, key).map_or(1, |at| u32::from(set[at] as u8))
    }

    /// Grows the table to the next power of two of sets that holds `bound` keys (at most 2^24
    /// sets), moving every remembered count to its new set, each old set's least recently used
    /// first.
    fn grow(&mut self, bound: usize) {
        let sets = bound.div_ceil(WAYS).next_power_of_two().min(1 << PLACE_BITS);
        if sets * WAYS <= self.entries.len() {
            return;
        }
        let old = std::mem::replace(&mut self.entries, vec![0; sets * WAYS]);
        for entry in old.chunks_exact(WAYS).flat_map(|set| set.iter().rev()) {
            if *entry != 0 {
                let key = entry >> USES_BITS << USES_BITS;
                let start = self.set_of(key);
                Self::use_in(&mut self.entries[start..start + WAYS], key, *entry as u8);
            }
        }
    }

    /// The number of keys remembered.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.entries.iter().filter(|e| **e != 0).count()
    }

    /// The entries the table has room for, used or not: its memory, 8 bytes each.
    #[cfg(test)]
    pub(super) fn slots(&self) -> usize {
        self.entries.len()
    }
}

/// Where a key stands in the frequency order: its priority, then the stamp of its last use.
/// The victim is the smallest.
pub(super) type Standing = (u64, u64);

/// The standing of an empty class: above every key's.
const NO_STANDING: Standing = (u64::MAX, u64::MAX);

/// Cached keys by class, each class in order of use, each key with its [`Standing`].
pub(super) struct FrequencyLists<K> {
    keys: KeyedLists<K, Standing, CLASSES>,
    /// The standing of each class's oldest key ([`NO_STANDING`] when empty), kept as the oldest
    /// change, so that the lowest of all is found without reading a key.
    backs: [Standing; CLASSES],
    /// The priority of the last victim: what a use adds its value to. In a group, the group's
    /// floor is used instead and this one stays 0.
    pub(super) floor: u64,
}

impl<K: Hash + Eq + Clone> FrequencyLists<K> {
    pub(super) fn new() -> Self {
        FrequencyLists { keys: KeyedLists::new(), backs: [NO_STANDING; CLASSES], floor: 0 }
    }

    pub(super) fn len(&self) -> usize {
        (0..CLASSES).map(|class| self.keys.len(class)).sum()
    }

    pub(super) fn contains(&self, key: &K) -> bool {
        self.keys.find(key).is_some()
    }

    /// Reads `class`'s oldest key's standing again, after its oldest key changed.
    fn refresh(&mut self, class: usize) {
        self.backs[class] = self.keys.back(class).map_or(NO_STANDING, |id| *self.keys.value(id));
    }

    /// A use of `key`, tracked or not, now used `uses` times in all, stamped `stamp`, above
    /// `floor`: it goes to the front of its class.
    pub(super) fn use_key(&mut self, key: K, uses: u32, stamp: u64, floor: u64) {
        let class = class_of(uses);
        let standing = (floor.saturating_add(class_value(class)), stamp);
        let (id, added) = self.keys.push_front_if_absent(class, key, standing);
        if !added {
            let was = self.keys.list_of(id);
            let was_back = self.keys.back(was) == Some(id);
            *self.keys.value_mut(id) = standing;
            self.keys.move_to_front(id, class);
            if was_back {
                self.refresh(was);
            }
        }
        if self.keys.back(class) == Some(id) {
            self.backs[class] = standing;
        }
    }

    pub(super) fn remove(&mut self, key: &K) -> bool {
        match self.keys.remove_from_list(key) {
            Some((class, was_back, _)) => {
                if was_back {
                    self.refresh(class);
                }
                true
            }
            None => false,
        }
    }

    /// The lowest standing of any key, eligible or not: what a group compares across shards.
    pub(super) fn lowest(&self) -> Option<Standing> {
        self.backs.iter().copied().filter(|s| *s != NO_STANDING).min()
    }

    /// The next victim at or after the cursors, without removing it: the eligible key of
    /// lowest standing. Each class's cursor moves past the ineligible keys it meets.
    pub(super) fn next_victim(
        &self,
        cursors: &mut FrequencyScan,
        eligible: &mut dyn FnMut(&K) -> bool,
    ) -> Option<(NodeId, Standing)> {
        let mut best: Option<(NodeId, Standing)> = None;
        for cursor in &mut cursors.0 {
            while let Some(id) = *cursor {
                if eligible(self.keys.key(id)) {
                    break;
                }
                *cursor = self.keys.newer(id);
            }
            if let Some(id) = *cursor {
                let standing = *self.keys.value(id);
                if best.is_none_or(|(_, lowest)| standing < lowest) {
                    best = Some((id, standing));
                }
            }
        }
        best
    }

    /// Starts a scan at the back of every class.
    pub(super) fn scan(&self) -> FrequencyScan {
        FrequencyScan(std::array::from_fn(|class| self.keys.back(class)))
    }

    /// Removes the node `id` (found by [`next_victim`](Self::next_victim)), first moving
    /// `cursors` past it; returns its key.
    pub(super) fn take(&mut self, id: NodeId, cursors: &mut FrequencyScan) -> K {
        for cursor in &mut cursors.0 {
            if *cursor == Some(id) {
                *cursor = self.keys.newer(id);
            }
        }
        let class = self.keys.list_of(id);
        let was_back = self.keys.back(class) == Some(id);
        let key = self.keys.remove_node(id).0;
        if was_back {
            self.refresh(class);
        }
        key
    }

    /// Evicts the key of lowest standing, every key eligible, raising the floor to its
    /// priority: the order alone, as the shadow replays it.
    pub(super) fn evict_one(&mut self) -> Option<K> {
        let mut scan = self.scan();
        let (id, (priority, _)) = self.next_victim(&mut scan, &mut |_| true)?;
        self.floor = self.floor.max(priority);
        Some(self.take(id, &mut scan))
    }
}

/// Where one eviction call has got to on each class: every key older than a class's cursor was
/// found ineligible in this call; `None` means the whole class was.
pub(super) struct FrequencyScan([Option<NodeId>; CLASSES]);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_history_counts_uses_and_forgets_the_least_recent_of_a_set() {
        let mut history = UseHistory::new();
        // A table of one set.
        history.reserve(WAYS);
        assert_eq!(history.record(1, 1), 1);
        assert_eq!(history.record(2, 2), 1);
        assert_eq!(history.record(1, 1), 2);
        assert_eq!(history.record(2, 2), 2);
        assert_eq!(history.record(1, 1), 3);
        assert_eq!((history.uses(1, 1), history.uses(2, 2), history.uses(3, 3)), (3, 2, 1));
        // More keys fill the set, pushing out 2, then 1: the least recently used go first.
        for key in 10..(10 + WAYS as u64 - 1) {
            history.record(key, key);
        }
        assert_eq!(history.len(), WAYS);
        assert_eq!((history.uses(1, 1), history.uses(2, 2)), (3, 1), "2 is forgotten");
        history.record(100, 100);
        assert_eq!(history.uses(1, 1), 1, "then 1");
        assert_eq!(history.record(1, 1), 1, "a forgotten key starts again");
    }

    #[test]
    fn a_key_is_placed_by_its_sample_bits_and_told_apart_by_its_identity() {
        let mut history = UseHistory::new();
        history.reserve(64 * WAYS);
        // One chunk (sample bits 7) of two ranks: counted apart.
        history.record(7, 70);
        history.record(7, 70);
        history.record(7, 71);
        assert_eq!((history.uses(7, 70), history.uses(7, 71)), (2, 1));
        // Fed the same sample bits in the same order, under other identities (a trace's chunk
        // ids, the daemon's keys), two histories count and forget alike.
        let (mut trace, mut daemon) = (UseHistory::new(), UseHistory::new());
        for i in 0..20_000u64 {
            let chunk = i * 7_919 % 1_000;
            trace.reserve(4 * WAYS);
            daemon.reserve(4 * WAYS);
            let identity = chunk.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xABCD;
            assert_eq!(trace.record(chunk, chunk), daemon.record(chunk, identity), "at {i}");
        }
    }

    #[test]
    fn the_history_keeps_its_counts_when_it_grows() {
        let mut history = UseHistory::new();
        history.reserve(2 * WAYS);
        let keys = 2 * WAYS as u64;
        for key in 0..keys {
            for _ in 0..=key % 3 {
                history.record(key, key);
            }
        }
        history.reserve(4_096);
        assert_eq!(history.entries.len(), 4_096);
        let counts: Vec<u32> = (0..keys).map(|key| history.uses(key, key)).collect();
        let kept = counts.iter().zip(0u32..).filter(|(c, k)| **c == k % 3 + 1).count();
        // Two sets of 32 keys may have pushed a few out before the table grew.
        assert!(kept as u64 >= keys - 8, "{kept} of {keys} counts kept: {counts:?}");
    }

    #[test]
    fn a_key_used_more_often_outlasts_keys_used_once_until_the_floor_passes_it() {
        let mut lists = FrequencyLists::new();
        // Key 0 used three times (value 27), keys 1.. once each (value 1), in room for 4.
        lists.use_key(0u32, 3, 1, lists.floor);
        let mut victims = vec![];
        for key in 1..200u32 {
            lists.use_key(key, 1, u64::from(key) + 1, lists.floor);
            if lists.len() > 4 {
                victims.push(lists.evict_one().unwrap_or(u32::MAX));
            }
        }
        // Each key used once enters one above the floor, and the floor rises to each victim's
        // priority: by one every three evictions, the three other keys' turn. Key 0 goes once
        // it has risen past 27, where LRU would have evicted it first.
        assert_eq!(victims.iter().position(|k| *k == 0), Some(104), "{victims:?}");
        assert_eq!(victims[..104], (1..105).collect::<Vec<_>>()[..]);
    }

    #[test]
    fn equal_priorities_go_least_recently_used_first_across_classes() {
        let mut lists = FrequencyLists::new();
        // Used once above floor 0 (priority 1), twice above 0 (8), once above 7 (8).
        lists.use_key(10u32, 1, 1, 0);
        lists.use_key(20u32, 2, 2, 0);
        lists.use_key(30u32, 1, 3, 7);
        assert_eq!(lists.lowest(), Some((1, 1)));
        assert_eq!(lists.evict_one(), Some(10));
        assert_eq!(lists.evict_one(), Some(20), "8 and 8: the older use goes first");
        assert_eq!(lists.evict_one(), Some(30));
        assert_eq!(lists.evict_one(), None);
        assert_eq!(lists.floor, 8);
    }

    #[test]
    fn classes_stop_at_the_last() {
        assert_eq!(class_of(0), 0);
        assert_eq!(class_of(1), 0);
        assert_eq!(class_of(6), CLASSES - 1);
        assert_eq!(class_of(u32::MAX), CLASSES - 1);
        assert_eq!((class_value(0), class_value(1), class_value(5)), (1, 8, 216));
    }
}
