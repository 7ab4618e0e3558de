//! The adaptive policy: ARC's lists and decayed use counts, evicted in plain recency order, in
//! ARC's order or by decayed use counts, whichever of three sampled shadow caches shows is
//! hitting most on the workload right now.
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
//! **Three orders over the same keys.** Every tracked key carries the tick of its last use, and
//! `T1` and `T2` are each ordered by it, so the least recently used key overall is the older of
//! their two backs. In recency mode the policy evicts that key: it is exactly LRU. In ARC mode it
//! evicts from `T1` while `T1` is above ARC's target, otherwise from `T2`. ARC protects keys that
//! proved themselves against a stream of new ones, which is what a small cache facing long
//! multi-turn conversations needs; at capacities where recency already reaches near the optimum
//! its protection costs hits, which is where LRU is right. In frequency mode it evicts the key
//! of lowest priority by its decayed use counts (LRFU), which a history remembers past eviction
//! ([`super::frequency`]): at the smaller capacities, where neither recency nor ARC's two
//! lists hold a conversation until its next turn, how often a chunk was asked for lately is
//! what tells the chunks worth keeping. Every key is in ARC's lists and in the frequency classes at once,
//! so the mode can change between two evictions.
//!
//! **Choosing the mode, online.** One key in four (by a mix of [`SampleKey::sample_bits`], so a
//! key is sampled or not on every node, in every run and in the simulation) also goes through
//! three small caches of a quarter of the tracked count: a plain LRU, an ARC and a frequency
//! order (ranking keys as the policy does). For each pair, the policy counts the sampled
//! accesses one shadow hit and the other missed, decayed by `1 - 1/(8 x capacity)` per sampled
//! access so the counts follow the workload over about eight shadow capacities of accesses: at the
//! hit ratios of small caches a shorter memory holds a handful of hits, and the mode then flips on
//! noise (with one capacity, 30 switches over the synthetic trace at 2,000 blocks, and 0.006
//! below LRU there). It switches to another order when that order's shadow won significantly more
//! of the accesses the two disagree on ([`Mode::judged`]), so it does not flap between two
//! near-equal choices: a switch flushes what the other order protected. The shadows cost a
//! quarter of the keys' memory each and O(1) per sampled access.
//!
//! **Choosing the half-life, online.** The frequency order's half-life is six capacities of
//! evictions or 24 ([`HALF_LIVES`]). One sampled key in four (one key in 16) also goes through
//! two frequency shadows of a quarter of the others' size, one at each half-life, each with a
//! history of those keys' uses of its own, and the half-life changes when the other one's
//! shadow leads by [`HALF_LIFE_SWITCH_CONFIDENCE`] standard deviations of the accesses the two
//! disagree on (the sign test of the modes over a quarter of their accesses, so three where
//! they take 2.5; over every sampled key and at six, the same hits for twice the cost). A change
//! costs nothing at once: the clock runs in half-lives, so only how fast uses decay from then on
//! changes. Under tiers below ([`EvictionPolicy::keep_below`]) the half-life stays six: the clock
//! is already slower by their size (docs/performance.md, "Two half-lives"). The two shadows and
//! their histories cost about 50 bytes per tracked key and O(1) for one access in 16.
//!
//! **Prefix chains.** A chunk is useless without its parent. Callers insert a chain's new chunks
//! leaf first and touch a hit's chunks leaf first (so its root is the most recent); every order
//! here follows insertion and use, and a root is used at least as often as its tail, so a chain
//! loses its tail before its root in every mode.
//!
//! Constants: sampling one in four, the ghost bound of twice the tracked keys, the switch's
//! 2.5 standard deviations and the half-life switch's three were chosen on Mooncake's
//! conversation trace and checked on the synthetic one; the counts' memory of eight capacities
//! was chosen on the synthetic trace (where the shorter one lost to LRU) and checked on the
//! conversation trace; the frequency order's own constants are in [`super::frequency`].
//! docs/performance.md has the tables.

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use super::frequency::{FrequencyLists, HALF_LIVES, HISTORY_FACTOR, Use, UseHistory, tick_among};
use super::group::{Member, PolicyGroup, Published};
use super::list::{KeyedLists, NodeId};
use super::{EvictionPolicy, Lru, Order, SampleKey};

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

/// How many standard deviations another shadow's lead must reach before the mode changes.
const SWITCH_CONFIDENCE: f64 = 2.5;

/// How many standard deviations the other half-life's shadow's lead must reach before the
/// frequency order's half-life changes: its shadows see a quarter of the sampled accesses.
const HALF_LIFE_SWITCH_CONFIDENCE: f64 = 3.0;

/// Whether `key` goes through the shadows: one key in four, by a mix of its sample bits.
pub(super) fn sampled(key: &impl SampleKey) -> bool {
    sampled_one_in(key, SAMPLE_SHIFT)
}

/// Whether `key` is one of the keys sampled at one in `2^shift` (those at a larger `shift`
/// are among those at a smaller one).
pub(super) fn sampled_one_in(key: &impl SampleKey, shift: u32) -> bool {
    shift == 0 || key.sample_bits().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - shift) == 0
}

/// The most keys a [`Judge`]'s shadows each model: past this, it samples fewer keys, so its
/// memory stays under about 100 MiB for tiers of any size.
const MAX_JUDGE_SHADOW: usize = 1 << 17;

/// The shadows' decayed wins over each other: `[i][j]` counts the sampled accesses that the
/// shadow of mode `i` hit and the shadow of mode `j` missed (modes in [`Mode::ALL`]'s order).
pub(super) type Wins = [[f64; 3]; 3];

/// Counts one sampled access that `N` shadows hit or missed (`hits`, in the order of `wins`:
/// [`Wins`] or [`HalfLifeWins`]), after decaying every count by `keep`.
fn count_wins<const N: usize>(wins: &mut [[f64; N]; N], hits: [bool; N], keep: f64) {
    for (i, row) in wins.iter_mut().enumerate() {
        for (j, count) in row.iter_mut().enumerate() {
            *count *= keep;
            if hits[i] && !hits[j] {
                *count += 1.0;
            }
        }
    }
}

/// Which order evictions follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Least recently used first, over `T1` and `T2` together.
    Recency,
    /// ARC's choice between the back of `T1` and the back of `T2`.
    Arc,
    /// The lowest priority by decayed use counts ([`super::frequency`]).
    Frequency,
}

impl Mode {
    /// The modes, in the order of [`Wins`].
    pub(super) const ALL: [Mode; 3] = [Mode::Recency, Mode::Arc, Mode::Frequency];

    /// The mode after this one given the shadows' decayed `wins`: a sign test on the sampled
    /// accesses where two shadows disagree. Another mode's shadow must have won
    /// [`SWITCH_CONFIDENCE`] standard deviations more of them than this mode's, `(a - b) /
    /// sqrt(a + b + 1)`; of several, the one that leads by most. Accesses both shadows hit, or
    /// both missed, say nothing about which order is better, and counting only the others lets
    /// two orders that agree on almost everything still be told apart, while two that differ by
    /// chance are not (a fixed 5% lead in total hits switched between ARC's and the frequency
    /// order on noise, and each switch flushes what the other order protected).
    pub(super) fn judged(self, wins: &Wins) -> Mode {
        let current = self.index();
        let mut best = (SWITCH_CONFIDENCE, self);
        for (i, mode) in Mode::ALL.into_iter().enumerate() {
            let (won, lost) = (wins[i][current], wins[current][i]);
            let lead = (won - lost) / (won + lost + 1.0).sqrt();
            if mode != self && lead > best.0 {
                best = (lead, mode);
            }
        }
        best.1
    }

    /// This mode's place in [`Mode::ALL`].
    pub(super) fn index(self) -> usize {
        match self {
            Mode::Recency => 0,
            Mode::Arc => 1,
            Mode::Frequency => 2,
        }
    }

    /// The public name of this mode.
    pub(super) fn order(self) -> Order {
        match self {
            Mode::Recency => Order::Recency,
            Mode::Arc => Order::Arc,
            Mode::Frequency => Order::Frequency,
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
    /// The same keys by decayed use counts, for the frequency order.
    frequency: FrequencyLists<K>,
    /// Uses of every recently seen key, cached or not, read by `frequency` and its shadow.
    history: UseHistory,
    /// The three orders, replayed over the sampled keys.
    shadows: Shadows<K>,
    mode: Mode,
    /// [`MIN_JUDGED`], lowered by tests that need the mode switch on a handful of keys.
    min_judged: usize,
    /// The group this policy is one shard of, if any: the group then judges the order.
    member: Option<Member>,
    /// The judge this policy takes its order from instead of its shadows, if any
    /// ([`EvictionPolicy::follow`]). A follower keeps ARC's lists only: it never evicts by use
    /// counts ([`JudgedOrder::mode_below`]) and never judges, so it counts no uses and feeds no
    /// shadows.
    followed: Option<JudgedOrder>,
}

/// Three small caches over the sampled keys, one per order, and two over a quarter of them,
/// one per half-life, and how often each hit where another of its kind missed: what the
/// adaptive policy chooses an order and a half-life by, and a [`Judge`] an order (it leaves the
/// half-lives' two empty).
struct Shadows<K> {
    /// Sampled keys in a plain LRU.
    lru: Lru<K>,
    /// Sampled keys in an ARC.
    arc: ArcLists<K>,
    /// Sampled keys in the frequency order, ranked as the policy ranks them.
    frequency: FrequencyLists<K>,
    /// One in four of the sampled keys in a frequency order at each of [`HALF_LIVES`], at a
    /// quarter of the capacity.
    half_lives: [FrequencyLists<K>; 2],
    /// Those keys' uses, at each of [`HALF_LIVES`].
    histories: [UseHistory; 2],
    /// Stamps the uses in `frequency` and `half_lives`.
    clock: u64,
    /// The shadows' decayed wins over each other: recency, ARC, frequency.
    wins: Wins,
    /// The half-lives' shadows' decayed wins over each other, in the order of [`HALF_LIVES`].
    half_life_wins: HalfLifeWins,
}

/// `[i][j]` counts the sampled accesses that the frequency shadow at half-life `i` of
/// [`HALF_LIVES`] hit and the one at `j` missed.
pub(super) type HalfLifeWins = [[f64; 2]; 2];

impl<K: Hash + Eq + Clone + Send + SampleKey> Shadows<K> {
    fn new() -> Self {
        Shadows {
            lru: Lru::new(),
            arc: ArcLists::new(),
            frequency: FrequencyLists::new(),
            half_lives: [FrequencyLists::new(), FrequencyLists::new()],
            histories: [UseHistory::new(), UseHistory::new()],
            clock: 0,
            wins: [[0.0; 3]; 3],
            half_life_wins: [[0.0; 2]; 2],
        }
    }

    /// Replays one access of a sampled `key`, ranked `used`, in the three orders' shadows of
    /// `capacity` keys each: a hit counts for the shadow, a miss caches the key there, evicting
    /// to the shadow's capacity first.
    fn access(&mut self, key: &K, used: Use, capacity: usize) {
        let capacity = capacity.max(1);
        let hits = [self.lru.contains(key), self.arc.contains(key), self.frequency.contains(key)];
        let keep = 1.0 - 1.0 / (SCORE_MEMORY * capacity as f64);
        count_wins(&mut self.wins, hits, keep);
        if hits[0] {
            self.lru.touch(key);
        } else {
            while self.lru.len() >= capacity && self.lru.evict_oldest().is_some() {}
            self.lru.insert(key.clone());
        }
        if hits[1] {
            self.arc.touch(key);
        } else {
            while self.arc.len() >= capacity
                && self.arc.evict_one(Mode::Arc, &mut |_| true).is_some()
            {}
            self.arc.insert(key.clone());
        }
        if !hits[2] {
            while self.frequency.len() >= capacity && self.frequency.evict_one().is_some() {}
        }
        self.clock += 1;
        self.frequency.use_key(key.clone(), used, self.clock);
    }

    /// Replays one access of `key` in the half-lives' shadows of `capacity` keys each, each
    /// ranking it by its own history at `time` (the evictions, before a half-life divides
    /// them).
    fn access_half_lives(&mut self, key: &K, capacity: usize, time: u64) {
        let hits = [self.half_lives[0].contains(key), self.half_lives[1].contains(key)];
        let keep = 1.0 - 1.0 / (SCORE_MEMORY * capacity as f64);
        count_wins(&mut self.half_life_wins, hits, keep);
        // The histories grow with the keys the shadows hold, as the adaptive policy's grows
        // with the keys it tracks.
        let bound = HISTORY_FACTOR.saturating_mul(self.half_lives[0].len() + 1);
        for (i, half_life) in HALF_LIVES.into_iter().enumerate() {
            let history = &mut self.histories[i];
            history.reserve(bound);
            let used = history.record(key.sample_bits(), key.identity_bits(), time / half_life);
            let shadow = &mut self.half_lives[i];
            if !hits[i] {
                while shadow.len() >= capacity && shadow.evict_one().is_some() {}
            }
            shadow.use_key(key.clone(), used, self.clock);
        }
    }
}

/// The half-life (an index into [`HALF_LIVES`]) after `chosen`, given the frequency shadows'
/// decayed wins: the other one's shadow must lead by [`HALF_LIFE_SWITCH_CONFIDENCE`] standard
/// deviations of the accesses the two disagree on, as for the modes.
pub(super) fn judged_half_life(chosen: usize, wins: &HalfLifeWins) -> usize {
    let other = 1 - chosen.min(1);
    let (won, lost) = (wins[other][chosen.min(1)], wins[chosen.min(1)][other]);
    let lead = (won - lost) / (won + lost + 1.0).sqrt();
    if lead > HALF_LIFE_SWITCH_CONFIDENCE { other } else { chosen.min(1) }
}

impl<K: Hash + Eq + Clone + Send + SampleKey> Adaptive<K> {
    /// An empty policy, evicting in recency order until the shadows say otherwise.
    pub fn new() -> Self {
        Adaptive {
            cache: ArcLists::new(),
            frequency: FrequencyLists::new(),
            history: UseHistory::new(),
            shadows: Shadows::new(),
            mode: Mode::Recency,
            min_judged: MIN_JUDGED,
            member: None,
            followed: None,
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
                lowest: self.frequency.lowest(),
            });
        }
    }

    /// The frequency order's clock, in half-lives: the evictions so far, each divided by the
    /// half-life chosen when it happened; the group's if any.
    fn now(&self) -> u64 {
        match &self.member {
            Some(member) => member.group.aged(),
            None => self.cache.aged,
        }
    }

    /// The evictions so far, the group's if any: the shadows' clock.
    fn evictions_time(&self) -> u64 {
        match &self.member {
            Some(member) => member.group.time(),
            None => self.cache.time,
        }
    }

    /// The keys whose uses the history must remember room for: [`HISTORY_FACTOR`] times those
    /// tracked (in a group, this shard's part of the group's).
    fn history_bound(&self) -> usize {
        let tracked = match &self.member {
            Some(member) => member.group.tracked().div_ceil(member.group.shards()),
            None => self.cache.len(),
        };
        HISTORY_FACTOR.saturating_mul(tracked.max(1))
    }

    /// Counts a use of `key` in the history and returns it as the frequency order ranks it; on
    /// an insert, the history first grows to `bound` keys ([`Self::history_bound`] before the
    /// insert).
    fn record_use(&mut self, key: &K, bound: Option<usize>) -> Use {
        if let Some(bound) = bound {
            self.history.reserve(bound);
        }
        let now = self.now();
        self.history.record(key.sample_bits(), key.identity_bits(), now)
    }

    /// The frequency order's part of a use of `key`, stamped `stamp`, ranked `used`.
    fn use_frequency(&mut self, key: &K, used: Use, stamp: u64) {
        self.frequency.use_key(key.clone(), used, stamp);
    }

    /// Replays one access of `key` in the shadows of a policy tracking `tracked` keys, if it
    /// is sampled.
    fn shadow_access(&mut self, key: &K, used: Use, tracked: usize) {
        if !sampled(key) {
            return;
        }
        let capacity = (tracked >> SAMPLE_SHIFT).max(1);
        self.shadows.access(key, used, capacity);
        if sampled_one_in(key, 2 * SAMPLE_SHIFT) {
            let time = self.evictions_time();
            self.shadows.access_half_lives(key, (capacity >> SAMPLE_SHIFT).max(1), time);
        }
        if let Some(member) = &self.member {
            member.publish_wins(&self.shadows.wins, &self.shadows.half_life_wins);
        }
    }

    /// Switches mode when another shadow leads with confidence.
    fn choose_mode(&mut self) {
        if let Some(followed) = &self.followed {
            self.mode = followed.mode_below();
            return;
        }
        if let Some(member) = &self.member {
            self.mode = member.group.judge();
            return;
        }
        if self.cache.len() < self.min_judged {
            // Shadows of a few keys are noise: too few keys to choose, so recency.
            self.mode = Mode::Recency;
            return;
        }
        self.mode = self.mode.judged(&self.shadows.wins);
        if self.cache.below == 0 {
            let wins = &self.shadows.half_life_wins;
            self.cache.half_life = judged_half_life(self.cache.half_life, wins);
        }
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
            .field("wins", &self.shadows.wins)
            .finish()
    }
}

impl<K: Hash + Eq + Clone + Send + SampleKey> EvictionPolicy<K> for Adaptive<K> {
    fn insert(&mut self, key: K) {
        let (tracked, bound) = (self.cache.len(), self.history_bound());
        let Some(stamp) = self.cache.insert(key.clone()) else {
            return;
        };
        if self.followed.is_none() {
            let used = self.record_use(&key, Some(bound));
            self.shadow_access(&key, used, tracked);
            self.use_frequency(&key, used, stamp);
        }
        self.publish();
    }

    fn touch(&mut self, key: &K) {
        if let Some(stamp) = self.cache.touch(key) {
            if self.followed.is_none() {
                let used = self.record_use(key, None);
                self.shadow_access(key, used, self.cache.len());
                self.use_frequency(key, used, stamp);
            }
            self.publish();
        }
    }

    fn remove(&mut self, key: &K) -> bool {
        let removed = self.cache.remove(key);
        self.frequency.remove(key);
        self.publish();
        removed
    }

    fn len(&self) -> usize {
        self.cache.len()
    }

    fn contains(&self, key: &K) -> bool {
        self.cache.contains(key)
    }

    fn keep_below(&mut self, chunks: usize) {
        match &self.member {
            Some(member) => member.group.keep_below(chunks),
            None => {
                self.cache.below = chunks;
                // Under tiers below the half-life is six, whatever the shadows chose before.
                if chunks > 0 {
                    self.cache.half_life = 0;
                }
            }
        }
    }

    fn follow(&mut self, order: JudgedOrder) {
        self.mode = order.mode_below();
        self.followed = Some(order);
    }

    fn stamp_next(&mut self, stamp: Option<u64>) {
        if self.member.is_some() {
            self.cache.next = stamp;
        }
    }

    fn order(&self) -> Order {
        match &self.member {
            Some(member) => member.group.order(),
            None => self.mode.order(),
        }
    }

    fn evict(&mut self, n: usize, eligible: &mut dyn FnMut(&K) -> bool) -> Vec<K> {
        self.choose_mode();
        let mut victims = Vec::with_capacity(n.min(self.len()));
        if self.mode == Mode::Frequency {
            let mut scan = self.frequency.scan();
            while victims.len() < n {
                let Some((id, _)) = self.frequency.next_victim(&mut scan, eligible) else {
                    break;
                };
                let key = self.frequency.take(id, &mut scan);
                self.cache.evict_key(&key);
                victims.push(key);
            }
        } else {
            let mut scan = Scan { t1: self.cache.keys.back(T1), t2: self.cache.keys.back(T2) };
            while victims.len() < n {
                match self.cache.evict_scanning(self.mode, &mut scan, eligible) {
                    Some(key) => {
                        self.frequency.remove(&key);
                        victims.push(key);
                    }
                    None => break,
                }
            }
        }
        self.publish();
        victims
    }
}

/// The order a [`Judge`] chose, shared with the policies that follow it
/// ([`EvictionPolicy::follow`]): read at each of their evictions, without a lock.
#[derive(Clone, Debug, Default)]
pub struct JudgedOrder(Arc<AtomicU8>);

impl JudgedOrder {
    /// The order chosen last.
    pub fn order(&self) -> Order {
        self.mode().order()
    }

    fn mode(&self) -> Mode {
        Mode::ALL[usize::from(self.0.load(Ordering::Relaxed)).min(Mode::ALL.len() - 1)]
    }

    /// The mode a tier below L1 evicts in: recency when the judge chose it, ARC's order
    /// otherwise. A lower tier counts the uses of what reached it (chunks L1 demoted, lookups L1
    /// missed), not the requests' uses the judge's frequency order ranks by; ranked by those
    /// counts it loses hits where one cache of the tiers' size gains them (docs/performance.md,
    /// "One judge for the tiers below L1"), and ARC's order, which asks only whether a chunk was
    /// used again since it came, stands in for it.
    pub(super) fn mode_below(&self) -> Mode {
        match self.mode() {
            Mode::Recency => Mode::Recency,
            Mode::Arc | Mode::Frequency => Mode::Arc,
        }
    }

    fn set(&self, mode: Mode) {
        self.0.store(mode.index() as u8, Ordering::Relaxed);
    }
}

/// Chooses the order of the tiers below L1 as the adaptive policy of one cache of all the
/// tiers' size would: the same three shadows and sign test, fed every lookup's chunks.
///
/// Each tier's own shadows see only the traffic the tiers above let through: L2 the chunks L1
/// demoted and the lookups L1 missed, in the order L1 evicted them. That traffic tells the orders
/// apart badly, and the tiers below then pick recency where one cache of their combined size
/// (what a cascade should add up to) gains from ARC's order or the counts. The judge replays
/// every lookup into shadows of a quarter of the combined capacity, so it chooses what the
/// one cache would, and L2 and the disk follow it (docs/performance.md, "One judge for the
/// tiers below L1"). L1 keeps its own shadows: it is a cache of its own size in front of the
/// rest, and judged on the combined size it loses hits at some sizes.
///
/// Its frequency shadow keeps a half-life of six capacities: the tiers below never evict by
/// use counts, so a half-life of its own would only move the judge's choice between ARC's
/// order and recency, and it moved no simulated tier size (docs/performance.md, "Two
/// half-lives").
///
/// Cost: O(1) per sampled key of a lookup. Memory: three shadows of a quarter of the combined
/// capacity and a history of 48 entries of 8 bytes for each of their keys
/// (twice the longer half-life), rounded up to a power of two of sets: about 200 bytes per chunk of the
/// combined capacity as the tiers fill, up to 2^17 keys a shadow (about 100 MiB, 64 of them the
/// history); tiers larger than that are judged on a sparser sample, one key in `4 x 2^k`.
pub struct Judge<K> {
    shadows: Shadows<K>,
    /// Uses of the sampled keys recently looked up.
    history: UseHistory,
    /// The frequency order's clock: sampled lookups, a capacity of them
    /// [`CAPACITY_OF_EVICTIONS`](super::frequency::CAPACITY_OF_EVICTIONS) ticks.
    time: u64,
    /// Keys are sampled at one in `2^shift`.
    shift: u32,
    /// The keys each shadow holds: the combined capacity, sampled.
    capacity: usize,
    /// Whether the tiers are large enough for the shadows to tell the orders apart.
    judges: bool,
    mode: Mode,
    order: JudgedOrder,
}

impl<K: Hash + Eq + Clone + Send + SampleKey> Judge<K> {
    /// A judge for tiers that hold `capacity` chunks together; recency until the shadows say
    /// otherwise.
    pub fn new(capacity: usize) -> Self {
        let mut shift = SAMPLE_SHIFT;
        while capacity >> shift > MAX_JUDGE_SHADOW {
            shift += 1;
        }
        Judge {
            shadows: Shadows::new(),
            history: UseHistory::new(),
            time: 0,
            shift,
            capacity: (capacity >> shift).max(1),
            judges: capacity >= MIN_JUDGED,
            mode: Mode::Recency,
            order: JudgedOrder::default(),
        }
    }

    /// The order chosen, for the policies that follow it.
    pub fn order(&self) -> JudgedOrder {
        self.order.clone()
    }

    /// The judge samples the keys [`sampled_one_in`] this shift; told of any other, it changes
    /// nothing.
    pub(super) fn sample_shift(&self) -> u32 {
        self.shift
    }

    /// One lookup of `key`. Callers pass a lookup's chunks leaf first, as the tiers touch them.
    pub fn looked_up(&mut self, key: &K) {
        if !sampled_one_in(key, self.shift) {
            return;
        }
        // The history grows with the keys the shadows hold, as the adaptive policy's grows
        // with the keys it tracks.
        self.history.reserve(HISTORY_FACTOR.saturating_mul(self.shadows.lru.len().max(1)));
        self.time += tick_among(self.capacity);
        // Its half-life stays the first: see the type's documentation.
        let now = self.time / HALF_LIVES[0];
        let used = self.history.record(key.sample_bits(), key.identity_bits(), now);
        self.shadows.access(key, used, self.capacity);
        if self.judges {
            self.mode = self.mode.judged(&self.shadows.wins);
            self.order.set(self.mode);
        }
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
    /// The frequency order's clock: evictions, a capacity of them
    /// [`CAPACITY_OF_EVICTIONS`](super::frequency::CAPACITY_OF_EVICTIONS) ticks (in a group,
    /// the group keeps it).
    time: u64,
    /// The frequency order's clock in half-lives: each eviction's ticks divided by the
    /// half-life then (in a group, the group keeps it).
    aged: u64,
    /// The half-life the next eviction ages keys by, an index into [`HALF_LIVES`] (in a group,
    /// the group keeps it).
    half_life: usize,
    /// The chunks the tiers below keep of what this policy evicts
    /// ([`EvictionPolicy::keep_below`]): a capacity of evictions counts them too.
    below: usize,
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
            time: 0,
            aged: 0,
            half_life: 0,
            below: 0,
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

    /// A use of a tracked key: it moves to the front of `T2`. Returns the use's stamp, `None`
    /// for a key not tracked.
    fn touch(&mut self, key: &K) -> Option<u64> {
        let id = self.keys.find(key).filter(|id| self.keys.list_of(*id) <= T2)?;
        let stamp = self.tick();
        *self.keys.value_mut(id) = stamp;
        self.keys.move_to_front(id, T2);
        Some(stamp)
    }

    /// Caches `key`: on `T1`, or on `T2` when it is a ghost, adapting the target as ARC does.
    /// Returns the stamp of the insert; `None`, and nothing changes, for a key tracked already.
    fn insert(&mut self, key: K) -> Option<u64> {
        // A ghost past its age goes before it could count as one: in a group, evictions in
        // other shards age this shard's ghosts too.
        self.trim_ghosts();
        let stamp = self.tick();
        let (id, added) = self.keys.push_front_if_absent(T1, key, stamp);
        if !added {
            let from_b1 = match self.keys.list_of(id) {
                B1 => true,
                B2 => false,
                _ => return None,
            };
            self.adapt_target(from_b1);
            *self.keys.value_mut(id) = stamp;
            self.keys.move_to_front(id, T2);
        }
        self.count_keys(1);
        Some(stamp)
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
        let tick = tick_among(self.len().saturating_add(self.below));
        self.time += tick;
        self.aged += tick / HALF_LIVES[self.half_life];
        self.evictions
    }

    /// Evicts the tracked `key` chosen by another order, leaving its ghost as an eviction of
    /// ARC's own would.
    fn evict_key(&mut self, key: &K) {
        if let Some(id) = self.keys.find(key).filter(|id| self.keys.list_of(*id) <= T2) {
            self.evict_node(id);
        }
    }

    /// Turns the tracked node `id` into the ghost of its list.
    fn evict_node(&mut self, id: NodeId) {
        let ghost = if self.keys.list_of(id) == T1 { B1 } else { B2 };
        *self.keys.value_mut(id) = self.count_eviction();
        self.keys.move_to_front(id, ghost);
        self.count_keys(-1);
        self.trim_ghosts();
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
                Mode::Arc => self.t1_due(),
                // The frequency order has lists of its own; ARC's evict in recency order.
                Mode::Recency | Mode::Frequency => self.keys.value(a) < self.keys.value(b),
            },
        };
        let (id, cursor) = if from_t1 { (t1?, &mut scan.t1) } else { (t2?, &mut scan.t2) };
        *cursor = self.keys.newer(id);
        let key = self.keys.key(id).clone();
        self.evict_node(id);
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
impl JudgedOrder {
    /// An order no judge changes: `mode`'s.
    pub(super) fn fixed(mode: Mode) -> Self {
        let order = JudgedOrder::default();
        order.set(mode);
        order
    }

    /// Changes the order, as the judge does.
    pub(super) fn choose(&self, mode: Mode) {
        self.set(mode);
    }
}

#[cfg(test)]
impl<K> Judge<K> {
    /// The keys each shadow holds at most.
    pub(super) fn shadow_capacity(&self) -> usize {
        self.capacity
    }

    /// The entries its history of uses has room for.
    pub(super) fn history_slots(&self) -> usize {
        self.history.slots()
    }

    /// The sampled keys it has been told of.
    pub(super) fn heard(&self) -> u64 {
        self.time / tick_among(self.capacity)
    }
}

#[cfg(test)]
impl<K: Hash + Eq + Clone> Adaptive<K> {
    /// Evicts in `mode`'s order from now on, until the shadows say otherwise.
    pub(super) fn force_mode(&mut self, mode: Mode) {
        self.mode = mode;
        self.shadows.wins = [[0.0; 3]; 3];
        for loser in Mode::ALL {
            self.shadows.wins[mode.index()][loser.index()] =
                if loser == mode { 0.0 } else { 1.0e9 };
        }
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

    /// The frequency order's half-life, in capacities of evictions.
    pub(super) fn half_life(&self) -> u64 {
        HALF_LIVES[self.cache.half_life]
    }

    /// The number of keys whose uses the history remembers.
    pub(super) fn remembered(&self) -> usize {
        self.history.len()
    }

    /// Whether the history still counts a use of `key`.
    pub(super) fn remembers(&self, key: &K) -> bool
    where
        K: Send + SampleKey,
    {
        let now = self.now();
        self.history.log_uses(key.sample_bits(), key.identity_bits(), now) > f64::NEG_INFINITY
    }
}
