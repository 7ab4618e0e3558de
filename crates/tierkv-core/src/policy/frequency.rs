//! The adaptive policy's third order: decayed use counts (LRFU), remembered past eviction.
//!
//! **Why.** On multi-turn conversations a small cache holds none of a conversation's chunks
//! until its next turn: the turns come minutes apart, after thousands of other chunks. What a
//! cache that size can still do is keep the chunks most likely to be asked for again, and how
//! often a chunk was asked for lately is the best sign of that the traces offer (a conversation
//! that reached its fourth turn goes on twice as often as one at its first). ARC's lists tell
//! only "used once" from "used again while cached", and forget a chunk a few capacities after
//! its eviction; this order remembers every use of the last [`HISTORY_FACTOR`] capacities of
//! chunks, cached or not, and ranks by how many there were and how long ago.
//!
//! **The order** (LRFU, Lee et al. 2001). A key's decayed uses are `C = sum of 2^-(age /
//! half-life)` over its uses, the age counted in evictions (six or 24 capacities of them,
//! [`HALF_LIVES`], halve a use's weight), and its priority is the clock at its last use plus
//! `log2 C` half-lives: a key used twice as often is kept one half-life longer than a key used as
//! lately. The victim is the key of lowest priority, the least recently used among equals. So
//! a key not used again ages out however often it was used before, and a burst of uses long ago
//! counts less than a few lately (the cube of plain use counts, as GreedyDual-Frequency ranks
//! them, kept such keys: 0.02 less hit ratio at conversation 5,000 blocks). A chain stays a
//! prefix: every request that names a chain's tail names its root too, so the root's uses are
//! never fewer than the tail's, and it is used later.
//!
//! **Cost.** `log2 C` is taken in quarters of a doubling, [`CLASSES`] of them (`C` up to 64).
//! Keys of one class share a recency list, and within a class priorities follow the order of
//! use (the clock only advances), so the victim is the lowest of the [`CLASSES`] lists' backs:
//! O(1) per use (the decay is a table lookup and an add), O(`CLASSES`) per victim, no
//! allocation in steady state. The history is a set-associative table of 8-byte entries for
//! [`HISTORY_FACTOR`] times the tracked keys, rounded up to a power of two of sets: 384 to 768
//! bytes a cached chunk, a few hundredths of a percent of a 2 MiB chunk.
//!
//! **The half-life.** How long a use should count depends on how far apart a workload's uses
//! of one chunk come, measured in the cache's own turnover: on Mooncake's conversation trace a
//! cache of 1,000 to 2,000 blocks hits most with a half-life of 16 to 32 capacities, one of
//! 2,500 blocks and more with six. The adaptive policy keeps two shadows of this order, one per
//! half-life, and ages its keys by the one whose shadow is hitting more
//! ([`super::adaptive`]). Its clock is kept in half-lives, each eviction adding its share
//! divided by the half-life of the moment, so a change of half-life changes how fast uses
//! decay from then on and leaves every score read as it was.
//!
//! Constants (half-lives of six and 24 capacities, quarters of a doubling) were chosen on
//! Mooncake's conversation trace and checked on the synthetic trace (docs/performance.md,
//! "Decayed use counts" and "Two half-lives"); the history's length follows from the longer
//! half-life ("A history as long as two half-lives").

use std::hash::Hash;
use std::sync::LazyLock;

use super::list::{KeyedLists, NodeId};

/// The frequency order's clock runs in evictions: one capacity of evictions (as many as the
/// keys tracked) is this many ticks, whatever the capacity.
pub(super) const CAPACITY_OF_EVICTIONS: u64 = 1 << 32;

/// A use counts half as much after this many capacities of evictions: the half-lives the
/// adaptive policy chooses between, the first until its shadows say otherwise.
pub(super) const HALF_LIVES: [u64; 2] = [6, 24];

/// The ticks of one event among `tracked` keys: an eviction, for a policy; a sampled lookup,
/// for a [`Judge`](super::adaptive::Judge)'s shadows. At least one: past 2^32 keys tracked (a
/// disk of many small chunks below L1) the clock runs slower than it should, but it runs.
pub(super) fn tick_among(tracked: usize) -> u64 {
    (CAPACITY_OF_EVICTIONS / tracked.max(1) as u64).max(1)
}

/// Keys are classed by their decayed uses `C`, a quarter of a doubling apart: class `i` holds
/// `log2 C` in `[i/4, (i+1)/4)`, the last class everything above (`C` of 64 and more).
pub(super) const CLASSES: usize = 24;

/// Classes per doubling of the decayed uses.
const CLASSES_PER_DOUBLING: f64 = 4.0;

/// How far one class is above the one below: a quarter of a half-life of the clock.
const CLASS_STEP: u64 = CAPACITY_OF_EVICTIONS / 4;

/// The history counts the uses of up to this many times the tracked keys: two of the longer
/// half-life, so that a use weighing a quarter is still remembered. Its sets fill unevenly, so
/// some keys go well before the table's length: with 32 capacities (the length before the
/// half-life of 24 came), on the conversation trace at 1,000 blocks, the size whose table
/// rounds up least, the frequency order alone at 24 capacities read 0.0787 against 0.0817 with
/// 48 (or with an exact LRU list of 24 capacities), and the adaptive policy 0.0773 against
/// 0.0793 (docs/performance.md, "A history as long as two half-lives").
pub(super) const HISTORY_FACTOR: usize = 2 * HALF_LIVES[1] as usize;

/// One use of a key as the frequency order ranks it: its class and its priority, the clock (in
/// half-lives) when it was used plus its class's `log2 C`, so that one use is worth a
/// half-life more of keeping for each doubling of its decayed uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Use {
    pub(super) class: usize,
    pub(super) priority: u64,
}

impl Use {
    /// A use at `now` (half-lives, [`CAPACITY_OF_EVICTIONS`] ticks each) of a key whose decayed
    /// uses, this one included, are `2^log_uses`.
    pub(super) fn at(now: u64, log_uses: f64) -> Use {
        let class = ((log_uses.max(0.0) * CLASSES_PER_DOUBLING) as usize).min(CLASSES - 1);
        Use { class, priority: now.saturating_add(class as u64 * CLASS_STEP) }
    }
}

/// `log2(1 + 2^y)`, the log of the decayed uses after one more use, given `y`, the log of those
/// before it decayed to now, `-age` half-lives with `age` in [`SCORE_UNITS_PER_HALF_LIFE`]s:
/// `max(y, 0) + log2(1 + 2^-|y|)`, the second term read from a table (the two floating-point
/// functions cost a quarter of the policy's time per access). It is 0 past the table's
/// [`FORGOTTEN_AFTER`] half-lives (below 2^-16 there).
fn one_more(age: i64) -> f64 {
    static CORRECTION: LazyLock<Box<[f64]>> = LazyLock::new(|| {
        (0..=FORGOTTEN_AFTER * SCORE_UNITS_PER_HALF_LIFE)
            .map(|units| {
                let y = units as f64 / SCORE_UNITS_PER_HALF_LIFE as f64;
                (-y).exp2().ln_1p() / std::f64::consts::LN_2
            })
            .collect()
    });
    let correction = usize::try_from(age.unsigned_abs())
        .ok()
        .and_then(|units| CORRECTION.get(units))
        .copied()
        .unwrap_or(0.0);
    (-age as f64 / SCORE_UNITS_PER_HALF_LIFE as f64).max(0.0) + correction
}

/// Keys per set of the history: 256 bytes, four 64-byte cache lines.
const WAYS: usize = 32;

/// The low bits of a history entry that hold the key's score; the bits above hold its tag, and
/// the top [`PLACE_BITS`] of those where it is placed.
const SCORE_BITS: u32 = 20;

/// The bits of a key's tag, which tells the keys of a set apart.
const TAG_BITS: u32 = 24;

/// The bits of a key's place, which chooses its set: up to 2^20 sets, 2^25 keys.
const PLACE_BITS: u32 = 64 - SCORE_BITS - TAG_BITS;

/// A score's unit, in ticks of the clock in half-lives: 1/256 of a half-life.
const SCORE_SHIFT: u32 = 24;

/// The mask of an entry's score.
const SCORE_MASK: u64 = (1 << SCORE_BITS) - 1;

/// A score's units in a half-life.
const SCORE_UNITS_PER_HALF_LIFE: u64 = 1 << (32 - SCORE_SHIFT);

/// A score more than this many half-lives old counts nothing (its weight is below 2^-16): its
/// key is used as if for the first time. It is far inside the score's range (2^20 units of 1/256
/// half-life: 4,096 half-lives), so a score is read back as what it was, not as one a wrap of the
/// range away.
const FORGOTTEN_AFTER: u64 = 16;

/// Every recently seen key's decayed uses, cached or not, held as a score: `log2 C` plus the
/// clock of the key's last use, `C` the sum over its uses of `2^-(age / half-life)`, as LRFU
/// ranks keys (Lee et al., "LRFU", IEEE Trans. Computers 2001). Stored as `log2 C + now`, a
/// score decays by itself: read at a later `now`, it is the log of the decayed sum.
///
/// A set-associative table of key fingerprints with their scores, each set of [`WAYS`] in order
/// of use. A key is forgotten when [`WAYS`] more recently used keys share its set: about the
/// least recently used of the table's keys, as an LRU list would forget them, without the list's
/// pointers (one random access per use instead of five; the policy's accesses took half as long
/// again with the list).
///
/// A key's set comes from its [`SampleKey::sample_bits`](super::SampleKey::sample_bits), its tag
/// within the set from its [`SampleKey::identity_bits`](super::SampleKey::identity_bits): a trace
/// chunk and the daemon's chunk of the same id share a set, and are forgotten at the same time,
/// so the daemon still counts what the simulation counts, while the ranks of one chunk are
/// counted apart. Two keys of one set with the same 24-bit tag would share a score: by chance,
/// about one lookup in 2^19.
pub(super) struct UseHistory {
    /// `sets * WAYS` entries, each `place << 44 | tag << 20 | score` (the tag never 0), 0 when
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

    /// A key's entry without its score: its place (from `sample_bits`) above its tag (from
    /// `identity_bits`, never 0, so an entry is never 0).
    fn key(sample_bits: u64, identity_bits: u64) -> u64 {
        let place = Self::mix(sample_bits) >> (64 - PLACE_BITS);
        let tag = (Self::mix(identity_bits) & ((1 << TAG_BITS) - 1)).max(1);
        (place << TAG_BITS | tag) << SCORE_BITS
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

    /// Counts one use, at `now` (the clock in half-lives), of the key of these bits, and returns
    /// the use as the frequency order ranks it.
    pub(super) fn record(&mut self, sample_bits: u64, identity_bits: u64, now: u64) -> Use {
        if self.entries.is_empty() {
            self.grow(1);
        }
        let key = Self::key(sample_bits, identity_bits);
        let start = self.set_of(key);
        let set = &mut self.entries[start..start + WAYS];
        let found = Self::find(set, key);
        let log_uses = match found {
            Some(at) => Self::age(set[at] & SCORE_MASK, now).map_or(0.0, one_more),
            None => 0.0,
        };
        let score = now.wrapping_add((log_uses * CAPACITY_OF_EVICTIONS as f64) as u64);
        // Rounded to the nearest unit, so that scores carried from use to use do not drift.
        let score = score.wrapping_add(1 << (SCORE_SHIFT - 1)) >> SCORE_SHIFT;
        Self::put_first(set, found, key | (score & SCORE_MASK));
        Use::at(now, log_uses)
    }

    /// How long before `now` a stored `score` is, in score units: minus the log of the key's
    /// decayed uses then; `None` when they count nothing any more.
    fn age(score: u64, now: u64) -> Option<i64> {
        let range = 1i64 << SCORE_BITS;
        let behind = ((now >> SCORE_SHIFT).wrapping_sub(score) & SCORE_MASK) as i64;
        // A score ahead of now (its uses count more than one) reads as a small negative age.
        let age = if behind >= range / 2 { behind - range } else { behind };
        (age <= (FORGOTTEN_AFTER * SCORE_UNITS_PER_HALF_LIFE) as i64).then_some(age)
    }

    /// Puts `entry` first in `set`, where it was at `found`, or else in place of the least
    /// recently used entry; those before it move down one.
    fn put_first(set: &mut [u64], found: Option<usize>, entry: u64) {
        let at = found.unwrap_or(WAYS - 1);
        set.copy_within(0..at, 1);
        set[0] = entry;
    }

    /// Where `key` is in `set`.
    fn find(set: &[u64], key: u64) -> Option<usize> {
        set.iter().position(|e| e >> SCORE_BITS << SCORE_BITS == key)
    }

    /// The log of the decayed uses of the key of these bits at `now`, minus infinity when it is
    /// not remembered.
    #[cfg(test)]
    pub(super) fn log_uses(&self, sample_bits: u64, identity_bits: u64, now: u64) -> f64 {
        if self.entries.is_empty() {
            return f64::NEG_INFINITY;
        }
        let key = Self::key(sample_bits, identity_bits);
        let start = self.set_of(key);
        let set = &self.entries[start..start + WAYS];
        Self::find(set, key)
            .and_then(|at| Self::age(set[at] & SCORE_MASK, now))
            .map_or(f64::NEG_INFINITY, |age| -age as f64 / SCORE_UNITS_PER_HALF_LIFE as f64)
    }

    /// Grows the table to the next power of two of sets that holds `bound` keys (at most 2^20
    /// sets), moving every remembered score to its new set, each old set's least recently used
    /// first.
    fn grow(&mut self, bound: usize) {
        let sets = bound.div_ceil(WAYS).next_power_of_two().min(1 << PLACE_BITS);
        if sets * WAYS <= self.entries.len() {
            return;
        }
        let old = std::mem::replace(&mut self.entries, vec![0; sets * WAYS]);
        for entry in old.chunks_exact(WAYS).flat_map(|set| set.iter().rev()) {
            if *entry != 0 {
                let start = self.set_of(*entry);
                Self::put_first(&mut self.entries[start..start + WAYS], None, *entry);
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
}

impl<K: Hash + Eq + Clone> FrequencyLists<K> {
    pub(super) fn new() -> Self {
        FrequencyLists { keys: KeyedLists::new(), backs: [NO_STANDING; CLASSES] }
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

    /// A use of `key`, tracked or not, ranked `used`, stamped `stamp`: it goes to the front of
    /// its class.
    pub(super) fn use_key(&mut self, key: K, used: Use, stamp: u64) {
        let (class, standing) = (used.class, (used.priority, stamp));
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

    /// Evicts the key of lowest standing, every key eligible: the order alone, as the shadow
    /// replays it.
    pub(super) fn evict_one(&mut self) -> Option<K> {
        let mut scan = self.scan();
        let (id, _) = self.next_victim(&mut scan, &mut |_| true)?;
        Some(self.take(id, &mut scan))
    }
}

/// Where one eviction call has got to on each class: every key older than a class's cursor was
/// found ineligible in this call; `None` means the whole class was.
pub(super) struct FrequencyScan([Option<NodeId>; CLASSES]);

#[cfg(test)]
mod tests {
    use super::*;

    /// One half-life of the clock, in its ticks.
    const HALF: u64 = CAPACITY_OF_EVICTIONS;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 0.01
    }

    #[test]
    fn the_history_sums_uses_that_halve_each_half_life() {
        let mut history = UseHistory::new();
        history.reserve(WAYS);
        // Two uses at once: C = 2, a whole doubling, class 4 of quarters.
        assert_eq!(history.record(1, 1, 10 * HALF), Use::at(10 * HALF, 0.0));
        let second = history.record(1, 1, 10 * HALF);
        assert_eq!(second, Use { class: 4, priority: 10 * HALF + HALF });
        // One half-life later the two count as one; a third use then makes two.
        assert!(close(history.log_uses(1, 1, 11 * HALF), 0.0));
        let third = history.record(1, 1, 11 * HALF);
        assert_eq!(third.class, 4, "{third:?}");
        // Two half-lives after that, C = 2 / 4 = 1/2; a use makes 3/2.
        assert!(close(history.log_uses(1, 1, 13 * HALF), -1.0));
        let fourth = history.record(1, 1, 13 * HALF);
        assert_eq!(fourth.class, (1.5f64.log2() * 4.0) as usize);
        // A key not used for 64 half-lives counts as new.
        assert_eq!(history.log_uses(1, 1, 78 * HALF), f64::NEG_INFINITY);
        assert_eq!(history.record(1, 1, 78 * HALF), Use::at(78 * HALF, 0.0));
        // A key never seen, likewise.
        assert_eq!(history.log_uses(2, 2, 78 * HALF), f64::NEG_INFINITY);
    }

    #[test]
    fn a_key_used_often_ranks_ahead_of_one_used_once_until_its_uses_decay() {
        let mut history = UseHistory::new();
        history.reserve(WAYS);
        let mut often = Use::at(0, 0.0);
        for _ in 0..6 {
            often = history.record(1, 1, 0);
        }
        // Six uses: log2 6 = 2.58, ten quarters of a half-life ahead of a key used once at the
        // same time.
        assert_eq!(often, Use { class: 10, priority: 10 * HALF / 4 });
        assert!(history.record(2, 2, 2 * HALF).priority < often.priority);
        assert!(history.record(3, 3, 3 * HALF).priority > often.priority);
        // Used again at 4, it ranks ahead of the key used once at 4 by its decayed uses:
        // 1 + 6/16.
        let again = history.record(1, 1, 4 * HALF);
        assert_eq!(again.class, (1.375f64.log2() * 4.0) as usize, "{again:?}");
        assert!(again.priority > history.record(4, 4, 4 * HALF).priority);
    }

    #[test]
    fn the_history_forgets_the_least_recent_of_a_set() {
        let mut history = UseHistory::new();
        // A table of one set.
        history.reserve(WAYS);
        history.record(1, 1, 0);
        history.record(2, 2, 0);
        history.record(1, 1, 0);
        assert!(close(history.log_uses(1, 1, 0), 1.0));
        assert!(close(history.log_uses(2, 2, 0), 0.0));
        // More keys fill the set, pushing out 2, then 1: the least recently used go first.
        for key in 10..(10 + WAYS as u64 - 1) {
            history.record(key, key, 0);
        }
        assert_eq!(history.len(), WAYS);
        assert_eq!(history.log_uses(2, 2, 0), f64::NEG_INFINITY, "2 is forgotten");
        assert!(close(history.log_uses(1, 1, 0), 1.0), "1 is not");
        history.record(100, 100, 0);
        assert_eq!(history.log_uses(1, 1, 0), f64::NEG_INFINITY, "then 1");
        assert_eq!(history.record(1, 1, 0).class, 0, "a forgotten key starts again");
    }

    #[test]
    fn a_score_reads_back_across_the_wrap_of_its_range() {
        let mut history = UseHistory::new();
        history.reserve(WAYS);
        // The score's range is 4,096 half-lives; uses either side of its wrap still add up.
        let wrap = 4_096 * HALF;
        history.record(1, 1, wrap - HALF / 2);
        assert!(close(history.log_uses(1, 1, wrap + HALF / 2), -1.0));
        assert_eq!(history.record(1, 1, wrap - HALF / 2).class, 4);
        assert!(close(history.log_uses(1, 1, wrap + HALF / 2), 0.0));
    }

    #[test]
    fn a_key_is_placed_by_its_sample_bits_and_told_apart_by_its_identity() {
        let mut history = UseHistory::new();
        history.reserve(64 * WAYS);
        // One chunk (sample bits 7) of two ranks: counted apart.
        history.record(7, 70, 0);
        history.record(7, 70, 0);
        history.record(7, 71, 0);
        assert!(close(history.log_uses(7, 70, 0), 1.0));
        assert!(close(history.log_uses(7, 71, 0), 0.0));
        // Fed the same sample bits in the same order, under other identities (a trace's chunk
        // ids, the daemon's keys), two histories count and forget alike.
        let (mut trace, mut daemon) = (UseHistory::new(), UseHistory::new());
        for i in 0..20_000u64 {
            let chunk = i * 7_919 % 1_000;
            trace.reserve(4 * WAYS);
            daemon.reserve(4 * WAYS);
            let identity = chunk.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xABCD;
            let now = i * HALF / 500;
            assert_eq!(trace.record(chunk, chunk, now), daemon.record(chunk, identity, now));
        }
    }

    #[test]
    fn the_history_keeps_its_scores_when_it_grows() {
        let mut history = UseHistory::new();
        history.reserve(2 * WAYS);
        let keys = 2 * WAYS as u64;
        for key in 0..keys {
            for _ in 0..=key % 3 {
                history.record(key, key, 0);
            }
        }
        history.reserve(4_096);
        assert_eq!(history.entries.len(), 4_096);
        let kept = (0..keys)
            .filter(|key| close(history.log_uses(*key, *key, 0), ((key % 3 + 1) as f64).log2()))
            .count() as u64;
        // Two sets of 32 keys may have pushed a few out before the table grew.
        assert!(kept >= keys - 8, "{kept} of {keys} scores kept");
    }

    #[test]
    fn keys_go_by_priority_then_least_recently_used_across_classes() {
        let mut lists = FrequencyLists::new();
        // Used in this order, at these times, with these decayed uses.
        lists.use_key(20u32, Use::at(0, 1.0), 1);
        lists.use_key(30u32, Use::at(0, 0.0), 2);
        lists.use_key(40u32, Use::at(0, 2.0), 3);
        lists.use_key(10u32, Use::at(HALF, 0.0), 4);
        assert_eq!(lists.lowest(), Some((0, 2)));
        assert_eq!(lists.evict_one(), Some(30));
        assert_eq!(lists.evict_one(), Some(20), "a doubling is worth a half-life; 20 is older");
        assert_eq!(lists.evict_one(), Some(10));
        assert_eq!(lists.evict_one(), Some(40));
        assert_eq!(lists.evict_one(), None);
    }

    #[test]
    fn the_clock_ticks_among_any_number_of_keys() {
        assert_eq!(tick_among(0), CAPACITY_OF_EVICTIONS);
        assert_eq!(tick_among(1 << 20), CAPACITY_OF_EVICTIONS >> 20);
        assert_eq!(tick_among(1 << 40), 1, "past 2^32 keys it runs slow, but it runs");
    }

    #[test]
    fn classes_stop_at_the_last() {
        assert_eq!(Use::at(0, 0.0).class, 0);
        assert_eq!(Use::at(0, 0.26).class, 1);
        assert_eq!(Use::at(0, 5.99).class, CLASSES - 1);
        assert_eq!(Use::at(0, 1e9).class, CLASSES - 1);
        assert_eq!(Use::at(u64::MAX, 1e9).priority, u64::MAX);
    }
}
