//! The policies of one sharded cache, evicting as one policy over all its keys would.
//!
//! L1's index is split into shards, each behind its own lock and with its own policy, so that
//! requests for different keys do not wait for each other. Choosing the shard to evict from by
//! how many keys it holds, as L1 did, cost up to 0.04 of hit ratio with LRU and up to 0.08 with
//! the adaptive policy at L1's automatic shard counts (docs/performance.md): a shard's oldest key
//! is not the cache's oldest, so a chain's root in one shard went before its tail in another; and
//! each shard's adaptive policy judged its order from a sliver of the traffic and chose it alone.
//!
//! A [`PolicyGroup`] joins the shards' policies. They stamp their keys' uses with one clock, and
//! each publishes where its next victims stand (how many keys each of its queues holds, the
//! stamp of each queue's oldest key, the lengths of ARC's ghost lists, the lowest priority in the
//! frequency order, the shadows' wins over each other) in a few atomics of its own, written under
//! its shard's lock and read by nobody's lock. From those the group names the shard whose next
//! victim one policy over all the keys would take: the oldest key for LRU and for the adaptive policy in recency order; in ARC's order, the oldest
//! key of `T1` or of `T2`, as ARC decides from the summed `T1` and the group's one target; in the
//! frequency order, the key of lowest priority, each priority read on the group's one clock of
//! evictions. The
//! adaptive policy's order is judged once for the group, from the sum of every shard's shadows'
//! wins. For S3-FIFO, the oldest entry of the small FIFOs while they hold their share of the
//! keys summed over the shards, else of the main FIFOs.
//!
//! What ARC remembers is the group's too. Its target for `T1` is one atomic, moved on a ghost
//! hit in any shard by ARC's rule over the summed ghost lists. And a ghost lives as long as the
//! group's last evictions reach back (twice the tracked keys, counted by one eviction counter),
//! whichever shard holds it: each shard bounding its ghosts by its own keys, as one policy does,
//! kept fewer and different ghosts than one policy over all the keys (a shard's key count
//! wanders, and a ghost dropped while it is low stays dropped), and cost the sharded adaptive
//! policy up to 0.008 of hit ratio below LRU (docs/performance.md).
//!
//! Costs: one shared counter per use (the clock) and two per eviction (the eviction count and
//! the frequency order's clock of evictions), a few relaxed stores per
//! policy call, and, per eviction, a read of every shard's atomics (L1 has at most 64 shards by
//! default).
//!
//! A key's shard is [`shard_of`] its sample bits, the same in every process, so `tierkv replay
//! --simulate` models a sharded L1 ([`Joined`]) key for key and victim for victim.

use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::adaptive::{HalfLifeWins, Mode, Wins, judged_half_life};
use super::frequency::Standing as FrequencyStanding;
use super::s3fifo::DEFAULT_SMALL_PERCENT;
use super::{Adaptive, EvictionPolicy, Lru, Order, PolicyKind, S3Fifo, SampleKey};

/// Above this many slots per shard, L1's automatic shard count grows.
const SLOTS_PER_SHARD: u64 = 256;
/// More shards than this buys nothing on the machines tierkv runs on.
const MAX_AUTO_SHARDS: u64 = 64;

/// The index shards of an L1 of `slots` slots whose configuration leaves the count to the
/// daemon (`l1.shards = 0`): one per 256 slots, a power of two from 1 to 64. The simulation of
/// such a daemon takes its shard count from here too.
pub fn auto_shards(slots: u64) -> usize {
    (slots / SLOTS_PER_SHARD).clamp(1, MAX_AUTO_SHARDS).next_power_of_two() as usize
}

/// The shard, of `shards`, that `key` lives in. L1's index spreads its keys by it and the
/// simulation's [`Joined`] does too, so both put a chunk in the same shard in every run. It mixes
/// the key's sample bits (splitmix64's finalizer) otherwise than the adaptive policy's sampling
/// does, so each shard's keys are sampled as all keys are.
pub fn shard_of(key: &impl SampleKey, shards: usize) -> usize {
    let mut z = key.sample_bits();
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z >> 32) % shards.max(1) as u64) as usize
}

/// The shards' policies of one cache; see the module documentation.
#[derive(Debug)]
pub struct PolicyGroup {
    kind: PolicyKind,
    /// Stamps every use in every shard, so stamps compare across shards.
    clock: AtomicU64,
    standings: Box<[Standing]>,
    /// The adaptive policy's order for the whole group: an index into [`Mode::ALL`].
    mode: AtomicU64,
    /// The adaptive policy's frequency order's clock: evictions in every shard, a capacity of
    /// them [`CAPACITY_OF_EVICTIONS`](super::frequency::CAPACITY_OF_EVICTIONS) ticks.
    time: AtomicU64,
    /// The frequency order's clock in half-lives: each eviction's ticks divided by the
    /// half-life chosen then.
    aged: AtomicU64,
    /// The frequency order's half-life for the whole group: an index into
    /// [`HALF_LIVES`](super::frequency::HALF_LIVES).
    half_life: AtomicU64,
    /// The chunks the tiers below keep of what the group evicts ([`EvictionPolicy::keep_below`]).
    below: AtomicU64,
    /// The eviction count when the order was last judged from every shard's wins; `u64::MAX`
    /// before the first judgment.
    judged_at: AtomicU64,
    /// ARC's target for the summed `T1`, as `f64` bits.
    target: AtomicU64,
    /// Evictions by ARC's lists in every shard so far: a ghost is numbered by its eviction.
    evictions: AtomicU64,
    /// The keys ARC's lists track in every shard, counted as they change (the standings' sums
    /// are as of each shard's last call, and cost a read of every shard).
    keys: AtomicU64,
}

/// Where one shard's next victims stand, as its policy last published it.
#[repr(align(128))]
#[derive(Debug)]
struct Standing {
    /// Keys on each of the policy's two queues (`T1` and `T2`, S3-FIFO's small and main FIFOs;
    /// LRU uses the first).
    len: [AtomicU64; 2],
    /// The stamp of each queue's oldest key (for S3-FIFO, of its entry into the FIFO);
    /// `u64::MAX` when the queue is empty.
    oldest: [AtomicU64; 2],
    /// The lengths of ARC's ghost lists, `B1` and `B2`.
    ghosts: [AtomicU64; 2],
    /// The adaptive policy's shadows' decayed wins over each other ([`Wins`]), row by row,
    /// as `f64` bits.
    wins: [AtomicU64; 9],
    /// The frequency shadows' decayed wins over each other ([`HalfLifeWins`]), row by row, as
    /// `f64` bits.
    half_life_wins: [AtomicU64; 4],
    /// The adaptive policy's lowest standing in the frequency order, priority then stamp;
    /// `u64::MAX` when there is none.
    lowest: [AtomicU64; 2],
}

impl Default for Standing {
    /// A shard that has published nothing: no keys.
    fn default() -> Self {
        Standing {
            len: Default::default(),
            oldest: [AtomicU64::new(u64::MAX), AtomicU64::new(u64::MAX)],
            ghosts: Default::default(),
            wins: Default::default(),
            half_life_wins: Default::default(),
            lowest: [AtomicU64::new(u64::MAX), AtomicU64::new(u64::MAX)],
        }
    }
}

/// What a member policy publishes after each call.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Published {
    pub(super) len: [usize; 2],
    pub(super) oldest: [Option<u64>; 2],
    pub(super) ghosts: [usize; 2],
    pub(super) lowest: Option<FrequencyStanding>,
}

impl PolicyGroup {
    /// A group of `shards` policies of `kind`; build each with [`PolicyGroup::member`].
    pub fn new(kind: PolicyKind, shards: usize) -> Arc<Self> {
        Arc::new(PolicyGroup {
            kind,
            clock: AtomicU64::new(0),
            standings: (0..shards.max(1)).map(|_| Standing::default()).collect(),
            mode: AtomicU64::new(0),
            time: AtomicU64::new(0),
            aged: AtomicU64::new(0),
            half_life: AtomicU64::new(0),
            below: AtomicU64::new(0),
            judged_at: AtomicU64::new(u64::MAX),
            target: AtomicU64::new(0f64.to_bits()),
            evictions: AtomicU64::new(0),
            keys: AtomicU64::new(0),
        })
    }

    /// The policy of shard `shard` (below the shard count given to [`PolicyGroup::new`]).
    pub fn member<K>(self: &Arc<Self>, shard: usize) -> Box<dyn EvictionPolicy<K>>
    where
        K: Hash + Eq + Clone + Send + SampleKey + 'static,
    {
        let member =
            Member { group: Arc::clone(self), shard: shard % self.standings.len(), next: None };
        match self.kind {
            PolicyKind::Lru => Box::new(Lru::in_group(member)),
            PolicyKind::Adaptive => Box::new(Adaptive::in_group(member)),
            PolicyKind::S3Fifo => Box::new(S3Fifo::in_group(member)),
        }
    }

    /// The shard whose next victim one policy over all the group's keys would take, by what the
    /// shards last published; `None` when no shard holds a key. Reads every shard's atomics,
    /// takes no lock.
    pub fn victim_shard(&self) -> Option<usize> {
        let oldest = |queue: usize| self.oldest_of(|s| s.oldest[queue].load(Ordering::Relaxed));
        match self.kind {
            PolicyKind::Lru => oldest(0),
            PolicyKind::S3Fifo if self.small_is_due(DEFAULT_SMALL_PERCENT) => {
                oldest(0).or_else(|| oldest(1))
            }
            PolicyKind::S3Fifo => oldest(1).or_else(|| oldest(0)),
            PolicyKind::Adaptive => {
                let either = || {
                    self.oldest_of(|s| {
                        s.oldest[0].load(Ordering::Relaxed).min(s.oldest[1].load(Ordering::Relaxed))
                    })
                };
                match self.judge() {
                    Mode::Recency => either(),
                    Mode::Arc if self.t1_due() => oldest(0).or_else(either),
                    Mode::Arc => oldest(1).or_else(either),
                    Mode::Frequency => self.lowest_shard().or_else(either),
                }
            }
        }
    }

    /// The shard whose lowest standing in the frequency order is the group's lowest, if any
    /// shard has one; between equal priorities, the least recently used.
    fn lowest_shard(&self) -> Option<usize> {
        let standing = |s: &Standing| [0, 1].map(|i| s.lowest[i].load(Ordering::Relaxed));
        let (shard, lowest) =
            self.standings.iter().map(standing).enumerate().min_by_key(|(_, lowest)| *lowest)?;
        (lowest[0] != u64::MAX).then_some(shard)
    }

    /// The shard with the smallest stamp `of` its standing, if any stamp is set.
    fn oldest_of(&self, of: impl Fn(&Standing) -> u64) -> Option<usize> {
        let (shard, stamp) =
            self.standings.iter().map(of).enumerate().min_by_key(|(_, stamp)| *stamp)?;
        (stamp != u64::MAX).then_some(shard)
    }

    /// The next stamp of the group's clock.
    pub(super) fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Reserves `n` consecutive stamps and returns the first, for a batch of keys visited shard
    /// by shard: its `i`th key's use is stamped `first + i` ([`EvictionPolicy::stamp_next`]),
    /// so a chain handed over leaf first is ordered leaf first across the shards too, as one
    /// policy over all the keys would order it.
    pub fn reserve_stamps(&self, n: usize) -> u64 {
        self.clock.fetch_add(n as u64, Ordering::Relaxed) + 1
    }

    /// The adaptive policy's order for the group, as last judged.
    fn mode(&self) -> Mode {
        let index = self.mode.load(Ordering::Relaxed) as usize;
        Mode::ALL.get(index).copied().unwrap_or(Mode::Recency)
    }

    /// The group's order now.
    pub(super) fn order(&self) -> Order {
        self.mode().order()
    }

    /// Judges the adaptive policy's order for the whole group, from the sum of the shards'
    /// shadows' wins, with the rule and minimum each policy alone uses; returns it. The sum
    /// reads nine atomics of every shard, so it is taken once per as many evictions as there
    /// are shards (each eviction judged, with one shard), and the order judged last stands
    /// between: a shadow's wins move by a few in that many evictions.
    pub(super) fn judge(&self) -> Mode {
        if self.tracked() < super::adaptive::MIN_JUDGED {
            self.mode.store(Mode::Recency.index() as u64, Ordering::Relaxed);
            return Mode::Recency;
        }
        let evictions = self.evictions();
        let judged_at = self.judged_at.load(Ordering::Relaxed);
        if judged_at != u64::MAX && evictions < judged_at.saturating_add(self.shards() as u64) {
            return self.mode();
        }
        self.judged_at.store(evictions, Ordering::Relaxed);
        let wins: Wins =
            std::array::from_fn(|i| std::array::from_fn(|j| self.sum(|s| &s.wins[3 * i + j])));
        let mode = self.mode().judged(&wins);
        self.mode.store(mode.index() as u64, Ordering::Relaxed);
        let half_life_wins: HalfLifeWins = std::array::from_fn(|i| {
            std::array::from_fn(|j| self.sum(|s| &s.half_life_wins[2 * i + j]))
        });
        if self.below.load(Ordering::Relaxed) == 0 {
            let half_life = judged_half_life(self.half_life(), &half_life_wins);
            self.half_life.store(half_life as u64, Ordering::Relaxed);
        }
        mode
    }

    /// Evicts in `mode`'s order from now on, until the shards' shadows say otherwise.
    #[cfg(test)]
    pub(super) fn force_mode(&self, mode: Mode) {
        self.mode.store(mode.index() as u64, Ordering::Relaxed);
    }

    /// The number of shards.
    pub(super) fn shards(&self) -> usize {
        self.standings.len()
    }

    /// The evictions of every shard, a capacity of them
    /// [`CAPACITY_OF_EVICTIONS`](super::frequency::CAPACITY_OF_EVICTIONS) ticks.
    pub(super) fn time(&self) -> u64 {
        self.time.load(Ordering::Relaxed)
    }

    /// The frequency order's clock for every shard, in half-lives.
    pub(super) fn aged(&self) -> u64 {
        self.aged.load(Ordering::Relaxed)
    }

    /// The frequency order's half-life, an index into
    /// [`HALF_LIVES`](super::frequency::HALF_LIVES).
    pub(super) fn half_life(&self) -> usize {
        (self.half_life.load(Ordering::Relaxed) as usize).min(1)
    }

    /// Counts `chunks` kept below the group's cache in each capacity of its evictions; with
    /// any, the half-life is six capacities, whatever the shadows chose before.
    pub(super) fn keep_below(&self, chunks: usize) {
        self.below.store(chunks as u64, Ordering::Relaxed);
        if chunks > 0 {
            self.half_life.store(0, Ordering::Relaxed);
        }
    }

    /// The keys the adaptive policy's shards track, `T1` and `T2` of every shard.
    pub(super) fn tracked(&self) -> usize {
        self.keys.load(Ordering::Relaxed) as usize
    }

    /// Counts `delta` keys more tracked by one of the adaptive policy's shards.
    pub(super) fn count_keys(&self, delta: i64) {
        if delta >= 0 {
            self.keys.fetch_add(delta.unsigned_abs(), Ordering::Relaxed);
        } else {
            self.keys.fetch_sub(delta.unsigned_abs(), Ordering::Relaxed);
        }
    }

    /// ARC's choice for the whole group: whether `T1`, summed over the shards, is above the
    /// group's target.
    pub(super) fn t1_due(&self) -> bool {
        let t1: u64 = self.standings.iter().map(|s| s.len[0].load(Ordering::Relaxed)).sum();
        t1 as f64 > f64::from_bits(self.target.load(Ordering::Relaxed))
    }

    /// Moves the group's target as ARC does on a hit of a ghost of `B1` (`from_b1`) or of
    /// `B2` in `shard`, from the ghost lists summed over the shards, that shard's as they are
    /// now (`ghosts`) rather than as it last published them.
    pub(super) fn adapt_target(&self, from_b1: bool, shard: usize, ghosts: [usize; 2]) {
        let [b1, b2] = [0, 1].map(|i| {
            let others: u64 = (self.standings.iter().enumerate())
                .filter(|(s, _)| *s != shard)
                .map(|(_, s)| s.ghosts[i].load(Ordering::Relaxed))
                .sum();
            (others + ghosts[i] as u64) as f64
        });
        let tracked = self.tracked() as f64;
        let moved = |bits: u64| {
            let target = f64::from_bits(bits);
            let target = super::adaptive::adapted_target(target, from_b1, [b1, b2], tracked);
            Some(target.to_bits())
        };
        // The closure always answers, so the update cannot fail.
        let _ = self.target.fetch_update(Ordering::Relaxed, Ordering::Relaxed, moved);
    }

    /// Numbers an eviction by ARC's lists in any shard: the ghost it leaves carries the number.
    pub(super) fn count_eviction(&self) -> u64 {
        let turnover = self.tracked().saturating_add(self.below.load(Ordering::Relaxed) as usize);
        let tick = super::frequency::tick_among(turnover);
        self.time.fetch_add(tick, Ordering::Relaxed);
        let half_life = super::frequency::HALF_LIVES[self.half_life()];
        self.aged.fetch_add(tick / half_life, Ordering::Relaxed);
        self.evictions.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The evictions numbered so far.
    pub(super) fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// S3-FIFO's choice for the whole group: whether the small FIFOs, summed over the shards,
    /// hold at least `percent` of the tracked keys.
    pub(super) fn small_is_due(&self, percent: u8) -> bool {
        let (small, main) = self.standings.iter().fold((0, 0), |(small, main), s| {
            (small + s.len[0].load(Ordering::Relaxed), main + s.len[1].load(Ordering::Relaxed))
        });
        small * 100 >= (small + main) * u64::from(percent)
    }

    fn sum(&self, field: impl Fn(&Standing) -> &AtomicU64) -> f64 {
        self.standings.iter().map(|s| f64::from_bits(field(s).load(Ordering::Relaxed))).sum()
    }
}

/// One shard's place in its group, held by the shard's policy.
#[derive(Debug)]
pub(super) struct Member {
    pub(super) group: Arc<PolicyGroup>,
    pub(super) shard: usize,
    /// The stamp of the next use, when the caller set one ([`EvictionPolicy::stamp_next`]).
    pub(super) next: Option<u64>,
}

impl Member {
    /// The stamp the caller set for this use, else the next stamp of the group's clock.
    pub(super) fn tick(&mut self) -> u64 {
        self.next.take().unwrap_or_else(|| self.group.tick())
    }

    /// Publishes this shard's shadows' wins over each other, which change only when a sampled
    /// key is used.
    pub(super) fn publish_wins(&self, wins: &Wins, half_life_wins: &HalfLifeWins) {
        let standing = &self.group.standings[self.shard];
        for (stored, wins) in standing.wins.iter().zip(wins.as_flattened()) {
            stored.store(wins.to_bits(), Ordering::Relaxed);
        }
        for (stored, wins) in standing.half_life_wins.iter().zip(half_life_wins.as_flattened()) {
            stored.store(wins.to_bits(), Ordering::Relaxed);
        }
    }

    /// Publishes where this shard's next victims stand.
    pub(super) fn publish(&self, now: Published) {
        let standing = &self.group.standings[self.shard];
        for queue in 0..2 {
            standing.len[queue].store(now.len[queue] as u64, Ordering::Relaxed);
            standing.oldest[queue].store(now.oldest[queue].unwrap_or(u64::MAX), Ordering::Relaxed);
            standing.ghosts[queue].store(now.ghosts[queue] as u64, Ordering::Relaxed);
        }
        let (priority, stamp) = now.lowest.unwrap_or((u64::MAX, u64::MAX));
        standing.lowest[0].store(priority, Ordering::Relaxed);
        standing.lowest[1].store(stamp, Ordering::Relaxed);
    }
}

/// A group's members behind one [`EvictionPolicy`], in one thread: each key in its shard by
/// [`shard_of`], and victims taken as L1's index takes them, each from the shard the group names
/// first, else from the next shard that has an eligible key. The simulation's sharded L1.
pub struct Joined<K> {
    group: Arc<PolicyGroup>,
    members: Vec<Box<dyn EvictionPolicy<K>>>,
    len: usize,
}

impl<K> Joined<K>
where
    K: Hash + Eq + Clone + Send + SampleKey + 'static,
{
    /// `shards` (at least one) policies of `kind`, joined.
    pub fn new(kind: PolicyKind, shards: usize) -> Self {
        let group = PolicyGroup::new(kind, shards);
        let members = (0..shards.max(1)).map(|shard| group.member(shard)).collect();
        Joined { group, members, len: 0 }
    }

    fn member(&mut self, key: &K) -> &mut Box<dyn EvictionPolicy<K>> {
        let shard = shard_of(key, self.members.len());
        &mut self.members[shard]
    }
}

impl<K> EvictionPolicy<K> for Joined<K>
where
    K: Hash + Eq + Clone + Send + SampleKey + 'static,
{
    fn insert(&mut self, key: K) {
        let member = self.member(&key);
        let new = !member.contains(&key);
        member.insert(key);
        self.len += usize::from(new);
    }

    fn touch(&mut self, key: &K) {
        self.member(key).touch(key);
    }

    fn remove(&mut self, key: &K) -> bool {
        let removed = self.member(key).remove(key);
        self.len -= usize::from(removed);
        removed
    }

    fn len(&self) -> usize {
        self.len
    }

    fn contains(&self, key: &K) -> bool {
        self.members[shard_of(key, self.members.len())].contains(key)
    }

    fn order(&self) -> Order {
        self.group.order()
    }

    fn keep_below(&mut self, chunks: usize) {
        for member in &mut self.members {
            member.keep_below(chunks);
        }
    }

    fn evict(&mut self, n: usize, eligible: &mut dyn FnMut(&K) -> bool) -> Vec<K> {
        let shards = self.members.len();
        let mut victims = Vec::with_capacity(n.min(self.len));
        'victims: while victims.len() < n {
            let first = self.group.victim_shard().unwrap_or(0);
            for step in 0..shards {
                if let Some(key) = self.members[(first + step) % shards].evict(1, eligible).pop() {
                    victims.push(key);
                    continue 'victims;
                }
            }
            break;
        }
        self.len -= victims.len();
        victims
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

    use proptest::prelude::*;

    use super::*;

    /// A cache of `shards` joined policies ([`Joined`]) holding at most `capacity` keys; see
    /// [`single_victims`].
    fn sharded_victims(
        kind: PolicyKind,
        shards: usize,
        capacity: usize,
        steps: &[u32],
    ) -> Vec<u32> {
        single_victims(&mut Joined::new(kind, shards), capacity, steps)
    }

    /// Replays `steps` through `policy` as a cache of at most `capacity` keys: a key it holds is
    /// touched, a missing one inserted after one eviction when full. Returns the victims in order.
    fn single_victims(
        policy: &mut dyn EvictionPolicy<u32>,
        capacity: usize,
        steps: &[u32],
    ) -> Vec<u32> {
        let mut victims = Vec::new();
        for &key in steps {
            if policy.contains(&key) {
                policy.touch(&key);
                continue;
            }
            if policy.len() >= capacity {
                victims.extend(policy.evict(1, &mut |_| true));
            }
            policy.insert(key);
        }
        victims
    }

    /// Evicts `n` keys one at a time, each from the shard the group names.
    fn evict_as_named(
        group: &PolicyGroup,
        members: &mut [Box<dyn EvictionPolicy<u32>>],
        n: usize,
    ) -> Vec<u32> {
        let mut gone = Vec::new();
        for _ in 0..n {
            let from = group.victim_shard().unwrap();
            gone.extend(members[from].evict(1, &mut |_| true));
        }
        gone
    }

    proptest! {
        /// LRU over joined shards evicts exactly what one LRU over all keys evicts.
        #[test]
        fn joined_lru_shards_evict_as_one_lru(
            shards in 2usize..9,
            capacity in 1usize..40,
            steps in prop::collection::vec(0u32..80, 0..400),
        ) {
            let mut one = Lru::new();
            prop_assert_eq!(
                sharded_victims(PolicyKind::Lru, shards, capacity, &steps),
                single_victims(&mut one, capacity, &steps)
            );
        }

        /// A group of one policy evicts exactly what the policy alone evicts: the group's clock,
        /// its judge, ARC's choice between `T1` and `T2` and S3-FIFO's share of the small FIFO
        /// are the policy's own rules over the sums of its shards.
        #[test]
        fn one_joined_policy_evicts_as_the_policy_alone(
            kind in prop::sample::select(PolicyKind::ALL.to_vec()),
            capacity in 1usize..200,
            steps in prop::collection::vec(0u32..400, 0..3000),
        ) {
            let mut alone = kind.build::<u32>();
            prop_assert_eq!(
                sharded_victims(kind, 1, capacity, &steps),
                single_victims(alone.as_mut(), capacity, &steps)
            );
        }
    }

    /// The group's half-life is judged from every shard's shadows, as one policy's is from its
    /// own, and stays short when tiers below keep what the group evicts.
    #[test]
    fn the_group_lengthens_its_half_life_unless_tiers_below_keep_its_victims() {
        let keys = crate::policy::adaptive_tests::uses_back_after_eight_capacities(1_024);
        for (below, half_life) in [(0, 24), (256, 6)] {
            let mut joined = Joined::new(PolicyKind::Adaptive, 4);
            joined.keep_below(below);
            single_victims(&mut joined, 1_024, &keys);
            let chosen = super::super::frequency::HALF_LIVES[joined.group.half_life()];
            assert_eq!(chosen, half_life, "with {below} chunks below");
            // Tiers below added later bring it back to six.
            joined.keep_below(256);
            assert_eq!(super::super::frequency::HALF_LIVES[joined.group.half_life()], 6);
        }
    }

    /// A chain whose keys lie in different shards loses its tail before its root: the group
    /// names the shard holding the oldest key, wherever it is, not the fullest shard.
    #[test]
    fn a_chain_across_shards_loses_its_tail_first() {
        for kind in [PolicyKind::Lru, PolicyKind::Adaptive] {
            let group = PolicyGroup::new(kind, 4);
            let mut members: Vec<_> = (0..4).map(|i| group.member::<u32>(i)).collect();
            // Chain 0..8, stored leaf first (as the daemon inserts a store's new chunks), then
            // used leaf first (as a lookup touches a hit): its root, 0, is its most recent key.
            for key in (0..8u32).rev() {
                members[key as usize % 4].insert(key);
            }
            for key in (0..8u32).rev() {
                members[key as usize % 4].touch(&key);
            }
            // Newer keys make shard 0, which holds the root and key 4, the fullest shard.
            for key in [100u32, 104, 108, 112] {
                members[0].insert(key);
            }
            let gone = evict_as_named(&group, &mut members, 4);
            // From the fullest shard the victims would be 4 and then the root, 0.
            assert_eq!(gone, vec![7, 6, 5, 4], "{kind:?}");
        }
    }

    #[test]
    fn in_the_frequency_order_the_group_takes_the_lowest_priority_of_any_shard() {
        let mut joined = Joined::<u32>::new(PolicyKind::Adaptive, 4);
        // 120 keys (the group judges from 64 on), 0..60 used three times, then 60..120 twice:
        // recency would evict 0..60 first, the frequency order 60..120, the lower counts.
        for key in 0..120 {
            joined.insert(key);
        }
        for key in (0..60).chain(0..60).chain(60..120) {
            joined.touch(&key);
        }
        joined.group.force_mode(Mode::Frequency);
        let victims = joined.evict(50, &mut |_| true);
        assert_eq!(joined.order(), Order::Frequency, "the shadows saw too little to switch");
        // Wherever they live, the keys used twice go, least recently used first.
        assert_eq!(victims, (60..110).collect::<Vec<_>>());
        // Each advanced the group's one clock by a tracked key's share of a capacity.
        let ticks: u64 = (71..=120u64).map(|tracked| (1 << 32) / tracked).sum();
        assert_eq!(joined.group.time(), ticks);
        let shards: std::collections::HashSet<usize> =
            victims.iter().map(|k| shard_of(k, 4)).collect();
        assert_eq!(shards.len(), 4, "the victims came from every shard");
    }

    #[test]
    fn a_batch_visited_shard_by_shard_keeps_its_order_by_its_stamps() {
        for kind in PolicyKind::ALL {
            let group = PolicyGroup::new(kind, 2);
            let mut members: Vec<_> = (0..2).map(|i| group.member::<u32>(i)).collect();
            // The batch 0, 1, 2, 3: shard 1 (keys 1 and 3) is visited before shard 0.
            let first = group.reserve_stamps(4);
            for key in [1u32, 3, 0, 2] {
                let member = &mut members[key as usize % 2];
                member.stamp_next(Some(first + u64::from(key)));
                member.insert(key);
                member.stamp_next(None);
            }
            let gone = evict_as_named(&group, &mut members, 4);
            // Stamped as visited, the order would be 1, 3, 0, 2.
            assert_eq!(gone, vec![0, 1, 2, 3], "{kind:?}");
        }
    }

    #[test]
    fn a_ghost_ages_with_the_evictions_of_every_shard() {
        // Two adaptive shards of two keys each. Key 0 is evicted from shard 0 and comes back:
        // a ghost then, it returns to `T2`. After as many evictions in shard 1 alone as twice
        // the group's keys, it is forgotten and returns to `T1`, as one policy over all four
        // keys would have forgotten it; a shard counting only its own evictions would not.
        let t2_after = |evictions_elsewhere: u32| {
            let group = PolicyGroup::new(PolicyKind::Adaptive, 2);
            let mut members: Vec<_> = (0..2).map(|i| group.member::<u32>(i)).collect();
            for key in [0, 2] {
                members[0].insert(key);
            }
            for key in [1, 3] {
                members[1].insert(key);
            }
            assert_eq!(members[0].evict(1, &mut |k| *k == 0), vec![0]);
            members[0].insert(4);
            for i in 0..evictions_elsewhere {
                let key = 101 + 2 * i;
                members[1].insert(key);
                assert_eq!(members[1].evict(1, &mut |k| *k != key).len(), 1);
            }
            members[0].insert(0);
            group.standings[0].len[1].load(Ordering::Relaxed)
        };
        assert_eq!(t2_after(0), 1, "a ghost comes back to T2");
        assert_eq!(t2_after(7), 1, "seven evictions later it is still a ghost");
        assert_eq!(t2_after(8), 0, "eight (twice the group's keys) later it is forgotten");
    }

    #[test]
    fn an_empty_group_names_no_shard() {
        for kind in PolicyKind::ALL {
            let group = PolicyGroup::new(kind, 4);
            let mut member = group.member::<u32>(2);
            assert_eq!(group.victim_shard(), None, "{kind:?}");
            member.insert(1);
            assert_eq!(group.victim_shard(), Some(2), "{kind:?}");
            member.remove(&1);
            assert_eq!(group.victim_shard(), None, "{kind:?}");
        }
    }
}
