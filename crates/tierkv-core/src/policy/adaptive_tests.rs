//! The adaptive policy against a naive model of the same rules, and its own scenarios.

use proptest::prelude::*;

use super::adaptive::{Adaptive, Judge, JudgedOrder, Mode};
use super::{EvictionPolicy, Order, SampleKey};

/// The adaptive policy written as plainly as possible: vectors, linear searches, oldest first.
/// It shares no code with [`Adaptive`], so the two agreeing on every victim checks the lists,
/// the cursors, the ghosts, the use counts, the shadows and the mode switch together.
#[derive(Default)]
struct Model {
    cache: ModelArc,
    frequency: ModelFrequency,
    history: ModelHistory,
    shadow_lru: Vec<u32>,
    shadow_arc: ModelArc,
    shadow_frequency: ModelFrequency,
    shadow_clock: u64,
    /// `[i][j]`: decayed sampled accesses the shadow of order `i` (recency, ARC, frequency)
    /// hit and that of order `j` missed.
    wins: [[f64; 3]; 3],
    /// The frequency shadows at half-lives of six and of 24 capacities, of one key in 16, with
    /// their histories.
    half_life_shadows: [ModelFrequency; 2],
    half_life_histories: [ModelHistory; 2],
    /// The same as `wins` for those two shadows.
    half_life_wins: [[f64; 2]; 2],
    /// 0 recency, 1 ARC, 2 frequency.
    mode: usize,
    /// 0: a half-life of six capacities of evictions, 1: of 24.
    half_life: usize,
    /// Below this many tracked keys, recency order.
    min_judged: usize,
}

/// Decayed use counts: each key with its priority and the stamp of its last use.
#[derive(Default)]
struct ModelFrequency {
    keys: Vec<(u32, u64, u64)>,
}

impl ModelFrequency {
    fn contains(&self, key: u32) -> bool {
        self.keys.iter().any(|(k, _, _)| *k == key)
    }
    fn use_key(&mut self, key: u32, priority: u64, stamp: u64) {
        self.keys.retain(|(k, _, _)| *k != key);
        self.keys.push((key, priority, stamp));
    }
    fn remove(&mut self, key: u32) {
        self.keys.retain(|(k, _, _)| *k != key);
    }
    /// The eligible key of lowest priority, the least recently used of equals.
    fn victim(&self, eligible: &dyn Fn(u32) -> bool) -> Option<u32> {
        (self.keys.iter().filter(|(k, _, _)| eligible(*k)))
            .min_by_key(|(_, priority, stamp)| (*priority, *stamp))
            .map(|(k, _, _)| *k)
    }
}

/// ARC's lists, each oldest first, tracked keys with their last-use tick, ghosts with the
/// number of their eviction.
#[derive(Default)]
struct ModelArc {
    t1: Vec<(u32, u64)>,
    t2: Vec<(u32, u64)>,
    b1: Vec<(u32, u64)>,
    b2: Vec<(u32, u64)>,
    target: f64,
    clock: u64,
    evictions: u64,
    /// Evictions, 2^32 for as many as the keys tracked at each.
    time: u64,
    /// The same in half-lives: each eviction's share divided by the half-life then.
    aged: u64,
    /// The half-life evictions age keys by, in capacities: six or 24 (0 reads as six).
    half_life: u64,
}

impl ModelArc {
    fn len(&self) -> usize {
        self.t1.len() + self.t2.len()
    }
    fn contains(&self, key: u32) -> bool {
        self.t1.iter().chain(&self.t2).any(|(k, _)| *k == key)
    }
    fn touch(&mut self, key: u32) -> u64 {
        self.clock += 1;
        if let Some(at) = self.t1.iter().position(|(k, _)| *k == key) {
            self.t1.remove(at);
        } else if let Some(at) = self.t2.iter().position(|(k, _)| *k == key) {
            self.t2.remove(at);
        } else {
            self.clock -= 1;
            return self.clock;
        }
        self.t2.push((key, self.clock));
        self.clock
    }
    /// Evicts `key`, chosen by another order, leaving its ghost.
    fn evict_key(&mut self, key: u32) {
        if self.contains(key) {
            self.age();
        }
        self.evictions += 1;
        if let Some(at) = self.t1.iter().position(|(k, _)| *k == key) {
            self.t1.remove(at);
            self.b1.push((key, self.evictions));
        } else if let Some(at) = self.t2.iter().position(|(k, _)| *k == key) {
            self.t2.remove(at);
            self.b2.push((key, self.evictions));
        } else {
            self.evictions -= 1;
        }
        self.trim();
    }
    fn insert(&mut self, key: u32) -> u64 {
        if self.contains(key) {
            return self.clock;
        }
        self.trim();
        let tracked = self.len() as f64;
        self.clock += 1;
        let (b1, b2) = (self.b1.len() as f64, self.b2.len() as f64);
        if let Some(at) = self.b1.iter().position(|(k, _)| *k == key) {
            self.b1.remove(at);
            self.target = (self.target + (b2 / b1).max(1.0)).min(tracked.max(1.0));
            self.t2.push((key, self.clock));
        } else if let Some(at) = self.b2.iter().position(|(k, _)| *k == key) {
            self.b2.remove(at);
            self.target = (self.target - (b1 / b2).max(1.0)).max(0.0);
            self.t2.push((key, self.clock));
        } else {
            self.t1.push((key, self.clock));
        }
        self.clock
    }
    fn remove(&mut self, key: u32) -> bool {
        let before = self.len();
        self.t1.retain(|(k, _)| *k != key);
        self.t2.retain(|(k, _)| *k != key);
        let removed = self.len() < before;
        if removed {
            self.trim();
        }
        removed
    }
    /// Counts an eviction on the clocks.
    fn age(&mut self) {
        let tick = (1 << 32) / self.len() as u64;
        self.time += tick;
        self.aged += tick / self.half_life.max(6);
    }
    /// Keeps the ghosts of the last `2 x tracked` evictions.
    fn trim(&mut self) {
        let horizon = self.evictions.saturating_sub(2 * self.len() as u64);
        self.b1.retain(|(_, n)| *n > horizon);
        self.b2.retain(|(_, n)| *n > horizon);
    }
    /// One victim: the oldest eligible of each list, then the mode's choice between them.
    fn evict_one(&mut self, arc_mode: bool, eligible: &dyn Fn(u32) -> bool) -> Option<u32> {
        let a = self.t1.iter().position(|(k, _)| eligible(*k));
        let b = self.t2.iter().position(|(k, _)| eligible(*k));
        let from_t1 = match (a, b) {
            (None, None) => return None,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some(_), Some(_)) if arc_mode => self.t1.len() as f64 > self.target,
            (Some(a), Some(b)) => self.t1[a].1 < self.t2[b].1,
        };
        self.evictions += 1;
        self.age();
        let key = if from_t1 {
            let key = self.t1.remove(a?).0;
            self.b1.push((key, self.evictions));
            key
        } else {
            let key = self.t2.remove(b?).0;
            self.b2.push((key, self.evictions));
            key
        };
        self.trim();
        Some(key)
    }
}

/// A history of uses: sets of up to 32 tags of keys with their scores (`log2` of the decayed
/// uses plus the clock, in 1/256 of a half-life), most recently used first.
#[derive(Default)]
struct ModelHistory {
    sets: Vec<Vec<(u64, u64)>>,
}

impl ModelHistory {
    /// The history's tag of `key`: splitmix64's finalizer, its top 20 bits (which choose the
    /// set) above its low 24 (which tell keys of a set apart, 1 for 0).
    fn tag(key: u32) -> u64 {
        let mut z = u64::from(key);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 44) << 24 | (z & 0xFF_FFFF).max(1)
    }
    /// Puts `tag` with `score` first in its set, 32 keys at most; returns its score before, if
    /// it had one.
    fn put_tag(&mut self, tag: u64, score: u64) -> Option<u64> {
        let sets = self.sets.len() as u64;
        let set = &mut self.sets[((tag >> 24) % sets) as usize];
        let before = set.iter().position(|(t, _)| *t == tag).map(|at| set.remove(at).1);
        set.insert(0, (tag, score));
        set.truncate(32);
        before
    }
    /// Counts a use of `key` at `now` (in half-lives, 2^32 ticks each) and returns its
    /// priority: the clock plus a quarter of a half-life for each quarter doubling of its
    /// decayed uses (`C = 1 + C_before * 2^-age`, 23 quarters at most). The history first grows
    /// to sets of 32 for `bound` keys (one set at least), a power of two of them.
    fn record(&mut self, key: u32, now: u64, bound: usize) -> u64 {
        if bound.max(1) > 32 * self.sets.len() {
            let old = std::mem::replace(
                &mut self.sets,
                vec![vec![]; bound.max(1).div_ceil(32).next_power_of_two()],
            );
            for (tag, score) in old.into_iter().flat_map(|set| set.into_iter().rev()) {
                self.put_tag(tag, score);
            }
        }
        let tag = Self::tag(key);
        let before = self.put_tag(tag, 0);
        let log_uses = match before {
            // Its log decayed uses before this one, `y`, then `log2(1 + 2^y)`; past 16
            // half-lives its uses count nothing, and `2^-|y|` that far counts nothing either.
            Some(score) => {
                let y = (score as f64 - (now >> 24) as f64) / 256.0;
                if y < -16.0 {
                    0.0
                } else if y.abs() > 16.0 {
                    y.max(0.0)
                } else {
                    y.max(0.0) + (-y.abs()).exp2().ln_1p() / std::f64::consts::LN_2
                }
            }
            None => 0.0,
        };
        let score = (now + (log_uses * 4_294_967_296.0) as u64 + (1 << 23)) >> 24;
        self.put_tag(tag, score);
        let quarters = ((log_uses * 4.0) as u64).min(23);
        now + quarters * (1 << 30)
    }
}

impl Model {
    /// Counts a use of `key` in the history of 48 times the tracked keys (twice the longer
    /// half-life) and returns its priority, on the clock in half-lives.
    fn record_use(&mut self, key: u32) -> u64 {
        let bound = 48 * self.cache.len().max(1);
        self.history.record(key, self.cache.aged, bound)
    }
    fn shadow_access(&mut self, key: u32, priority: u64) {
        let mixed = key.sample_bits().wrapping_mul(0x9E37_79B9_7F4A_7C15);
        if mixed >> 62 != 0 {
            return;
        }
        let capacity = (self.cache.len() / 4).max(1);
        let hits = [
            self.shadow_lru.contains(&key),
            self.shadow_arc.contains(key),
            self.shadow_frequency.contains(key),
        ];
        let keep = 1.0 - 1.0 / (8.0 * capacity as f64);
        for i in 0..3 {
            for j in 0..3 {
                self.wins[i][j] =
                    self.wins[i][j] * keep + if hits[i] && !hits[j] { 1.0 } else { 0.0 };
            }
        }
        if let Some(at) = self.shadow_lru.iter().position(|k| *k == key) {
            self.shadow_lru.remove(at);
        } else {
            while self.shadow_lru.len() >= capacity {
                self.shadow_lru.remove(0);
            }
        }
        self.shadow_lru.push(key);
        if hits[1] {
            self.shadow_arc.touch(key);
        } else {
            while self.shadow_arc.len() >= capacity {
                self.shadow_arc.evict_one(true, &|_| true);
            }
            self.shadow_arc.insert(key);
        }
        if !hits[2] {
            while self.shadow_frequency.keys.len() >= capacity {
                if let Some(victim) = self.shadow_frequency.victim(&|_| true) {
                    self.shadow_frequency.remove(victim);
                }
            }
        }
        self.shadow_clock += 1;
        self.shadow_frequency.use_key(key, priority, self.shadow_clock);
        if mixed >> 60 == 0 {
            self.half_life_access(key, (capacity / 4).max(1));
        }
    }
    /// One key in 16 goes through the half-lives' shadows too, of a quarter of the others'
    /// capacity, each with its own history on the clock of evictions.
    fn half_life_access(&mut self, key: u32, capacity: usize) {
        let hits = [0, 1].map(|i| self.half_life_shadows[i].contains(key));
        let keep = 1.0 - 1.0 / (8.0 * capacity as f64);
        for i in 0..2 {
            for j in 0..2 {
                let won = hits[i] && !hits[j];
                self.half_life_wins[i][j] =
                    self.half_life_wins[i][j] * keep + if won { 1.0 } else { 0.0 };
            }
        }
        let bound = 48 * (self.half_life_shadows[0].keys.len() + 1);
        for (i, half_life) in [6, 24].into_iter().enumerate() {
            let now = self.cache.time / half_life;
            let priority = self.half_life_histories[i].record(key, now, bound);
            let shadow = &mut self.half_life_shadows[i];
            if !hits[i] {
                while shadow.keys.len() >= capacity {
                    if let Some(victim) = shadow.victim(&|_| true) {
                        shadow.remove(victim);
                    }
                }
            }
            shadow.use_key(key, priority, self.shadow_clock);
        }
    }
    fn insert(&mut self, key: u32) {
        if !self.cache.contains(key) {
            let priority = self.record_use(key);
            self.shadow_access(key, priority);
            let stamp = self.cache.insert(key);
            self.frequency.use_key(key, priority, stamp);
        }
    }
    fn touch(&mut self, key: u32) {
        if self.cache.contains(key) {
            let priority = self.record_use(key);
            self.shadow_access(key, priority);
            let stamp = self.cache.touch(key);
            self.frequency.use_key(key, priority, stamp);
        }
    }
    fn remove(&mut self, key: u32) -> bool {
        self.frequency.remove(key);
        self.cache.remove(key)
    }
    /// The sign test: another order's shadow must have won 2.5 standard deviations more of the
    /// accesses on which it and the current order's disagree.
    fn judge(&mut self) {
        if self.cache.len() < self.min_judged {
            self.mode = 0;
            return;
        }
        let now = self.mode;
        let mut best = (2.5, now);
        for other in 0..3 {
            let (won, lost) = (self.wins[other][now], self.wins[now][other]);
            let lead = (won - lost) / (won + lost + 1.0).sqrt();
            if other != now && lead > best.0 {
                best = (lead, other);
            }
        }
        self.mode = best.1;
        // The half-life, by the same test at three standard deviations.
        let (now, other) = (self.half_life, 1 - self.half_life);
        let (won, lost) = (self.half_life_wins[other][now], self.half_life_wins[now][other]);
        if (won - lost) / (won + lost + 1.0).sqrt() > 3.0 {
            self.half_life = other;
        }
        self.cache.half_life = [6, 24][self.half_life];
    }
    fn evict(&mut self, n: usize, eligible: &dyn Fn(u32) -> bool) -> Vec<u32> {
        self.judge();
        let mut victims = vec![];
        while victims.len() < n {
            let victim = if self.mode == 2 {
                let Some(key) = self.frequency.victim(eligible) else { break };
                self.frequency.remove(key);
                self.cache.evict_key(key);
                key
            } else {
                let Some(key) = self.cache.evict_one(self.mode == 1, eligible) else { break };
                self.frequency.remove(key);
                key
            };
            victims.push(victim);
        }
        victims
    }
}

#[derive(Clone, Debug)]
enum Op {
    Insert(u32),
    Touch(u32),
    Remove(u32),
    /// Evict up to `n` keys; key `k` is eligible unless `k % m == r` for the given `(m, r)`.
    Evict(usize, u32, u32),
    /// Fill to `capacity` tracked keys with fresh keys from `from`, evicting one per insert.
    Stream {
        from: u32,
        count: u32,
        capacity: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..64u32).prop_map(Op::Insert),
        4 => (0..64u32).prop_map(Op::Touch),
        1 => (0..64u32).prop_map(Op::Remove),
        2 => (0..6usize, 2..5u32, 0..5u32).prop_map(|(n, m, r)| Op::Evict(n, m, r)),
        1 => (0..200u32, 1..40u32, 4..40usize)
            .prop_map(|(from, count, capacity)| Op::Stream { from, count, capacity }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn adaptive_agrees_with_a_naive_model_victim_for_victim(
        ops in prop::collection::vec(op(), 0..300),
        min_judged in prop_oneof![Just(0usize), Just(64), 0..80usize],
    ) {
        let mut policy = Adaptive::<u32>::new().judging_from(min_judged);
        let mut model = Model { min_judged, ..Model::default() };
        let mut peak = 0;
        for op in &ops {
            match *op {
                Op::Insert(key) => {
                    policy.insert(key);
                    model.insert(key);
                }
                Op::Touch(key) => {
                    policy.touch(&key);
                    model.touch(key);
                }
                Op::Remove(key) => prop_assert_eq!(policy.remove(&key), model.remove(key)),
                Op::Evict(n, m, r) => {
                    let eligible = |key: u32| key % m != r;
                    let victims = policy.evict(n, &mut |key| eligible(*key));
                    prop_assert_eq!(victims, model.evict(n, &eligible), "{:?}", op);
                }
                Op::Stream { from, count, capacity } => {
                    for key in from..from + count {
                        if policy.len() >= capacity {
                            let victims = policy.evict(1, &mut |_| true);
                            prop_assert_eq!(victims, model.evict(1, &|_| true));
                        }
                        policy.insert(key);
                        model.insert(key);
                    }
                }
            }
            prop_assert_eq!(policy.len(), model.cache.len(), "after {:?}", op);
            prop_assert_eq!(policy.order(), Mode::ALL[model.mode].order(), "after {:?}", op);
            prop_assert!(policy.ghosts() <= 2 * policy.len(), "after {:?}", op);
            // The history holds 48 times the most keys tracked, rounded up to a power of two.
            peak = peak.max(policy.len());
            prop_assert!(policy.remembered() <= 96 * peak.max(1), "after {:?}", op);
        }
    }
}

/// A use keeps counting for two of the longer half-life (48 capacities of evictions, a quarter
/// of its weight left), however its set of the history fills: at 1,000 tracked keys, whose
/// table rounds up least, the uses of 98% of a cache of keys are still counted after 40
/// capacities of one-off keys. The history of 32 capacities before forgot nine in ten of them
/// here, and read 0.002 less at conversation 1,000 blocks.
#[test]
fn a_use_is_remembered_for_two_of_the_longer_half_life() {
    let capacity = 1_000u32;
    let mut policy = Adaptive::<u32>::new();
    for key in 0..capacity {
        policy.insert(key);
    }
    for key in capacity..41 * capacity {
        policy.evict(1, &mut |_| true);
        policy.insert(key);
    }
    let remembered = (0..capacity).filter(|key| policy.remembers(key)).count();
    assert!(remembered >= 980, "{remembered} of the first {capacity} keys remembered");
}

/// Uses `key` in `policy` and in `model`, each holding at most `capacity` keys, evicting one
/// first when full; both must name the same victim.
fn use_key_in_both(policy: &mut Adaptive<u32>, model: &mut Model, capacity: usize, key: u32) {
    if policy.contains(&key) {
        policy.touch(&key);
        model.touch(key);
        return;
    }
    if policy.len() >= capacity {
        assert_eq!(policy.evict(1, &mut |_| true), model.evict(1, &|_| true), "before {key}");
    }
    policy.insert(key);
    model.insert(key);
}

/// For a cache of `capacity` keys: 40 rounds of three quarters of `capacity` keys used again
/// every eight capacities of evictions, with eight capacities of keys never seen again between.
/// With a half-life of six capacities a key's uses decay by more than half between two, it
/// ranks below the new keys long before it returns, and the frequency order misses it every
/// time; with 24 its uses add up and it stays.
pub(super) fn uses_back_after_eight_capacities(capacity: u32) -> Vec<u32> {
    let mut keys = Vec::new();
    let mut fresh = 1 << 24;
    for _round in 0..40 {
        keys.extend(0..capacity / 4 * 3);
        keys.extend(fresh..fresh + 8 * capacity);
        fresh += 8 * capacity;
    }
    keys
}

#[test]
fn the_half_life_lengthens_where_uses_come_back_after_many_capacities() {
    let mut policy = Adaptive::new();
    let mut model = Model { min_judged: 64, ..Model::default() };
    for key in uses_back_after_eight_capacities(256) {
        use_key_in_both(&mut policy, &mut model, 256, key);
    }
    assert_eq!(policy.half_life(), 24, "{policy:?}");
    assert_eq!(model.half_life, 1, "the model switched with the policy, victim for victim");
}

#[test]
fn under_tiers_below_the_half_life_stays_short() {
    // The tiers below keep 64 chunks of what this cache evicts: its clock already runs slower
    // than its own evictions (by the tiers' size, here a quarter), and the lead of its shadow
    // at 24 capacities does not lengthen it further.
    let mut policy = Adaptive::new();
    policy.keep_below(64);
    for key in uses_back_after_eight_capacities(256) {
        use_key(&mut policy, 256, key);
    }
    assert_eq!(policy.half_life(), 6, "{policy:?}");
    // Tiers below added after the shadows chose 24 capacities bring it back to six.
    let mut policy = Adaptive::new();
    for key in uses_back_after_eight_capacities(256) {
        use_key(&mut policy, 256, key);
    }
    assert_eq!(policy.half_life(), 24, "{policy:?}");
    policy.keep_below(64);
    assert_eq!(policy.half_life(), 6, "{policy:?}");
}

/// Inserts `key` into `policy` holding at most `capacity` keys, evicting one first when full.
fn use_key(policy: &mut Adaptive<u32>, capacity: usize, key: u32) {
    if policy.contains(&key) {
        policy.touch(&key);
        return;
    }
    if policy.len() >= capacity {
        policy.evict(1, &mut |_| true);
    }
    policy.insert(key);
}

/// A cache of 1,000 after 60 rounds of a hot set of 600 keys, each round followed by a scan of
/// 1,200 keys never seen again: longer than the cache, so LRU loses the hot set to every scan.
fn hot_set_between_scans() -> Adaptive<u32> {
    let mut policy = Adaptive::new();
    let mut fresh = 100_000;
    for _round in 0..60 {
        for key in 0..600 {
            use_key(&mut policy, 1_000, key);
        }
        for _ in 0..1_200 {
            use_key(&mut policy, 1_000, fresh);
            fresh += 1;
        }
    }
    policy
}

#[test]
fn adaptive_leaves_recency_when_a_scan_would_flush_a_hot_set() {
    let policy = hot_set_between_scans();
    // ARC and the use counts protect the hot set alike; either will do.
    assert_ne!(policy.order(), Order::Recency, "{policy:?}");
    // Protected, most of the hot set survives the last scan.
    let kept = (0..600).filter(|key| policy.contains(key)).count();
    assert!(kept > 300, "only {kept} of the hot set kept: {policy:?}");
}

/// A cache of 1,000 after 40 rounds of 300 popular keys, each round followed by 2,700 keys
/// never seen again: a popular key comes back after 3,000 accesses, when LRU has evicted it and
/// ARC has forgotten its ghost (twice the keys), but the history of uses still counts it.
/// Returns the policy and the popular keys' hits in the last round.
fn popular_keys_beyond_ghosts() -> (Adaptive<u32>, usize) {
    let mut policy = Adaptive::new();
    let mut fresh = 100_000;
    let mut hits = 0;
    for _round in 0..40 {
        hits = (0..300).filter(|key| policy.contains(key)).count();
        for key in 0..300 {
            use_key(&mut policy, 1_000, key);
        }
        for _ in 0..2_700 {
            use_key(&mut policy, 1_000, fresh);
            fresh += 1;
        }
    }
    (policy, hits)
}

#[test]
fn adaptive_switches_to_use_counts_when_keys_return_after_arc_forgot_them() {
    let (policy, hits) = popular_keys_beyond_ghosts();
    assert_eq!(policy.order(), Order::Frequency, "{policy:?}");
    assert!(hits > 250, "only {hits} of 300 popular keys hit in the last round: {policy:?}");
    // The contrast: recency and ARC alone keep none of them.
    for mode in [Mode::Recency, Mode::Arc] {
        let mut forced = Adaptive::new();
        forced.force_mode(mode);
        let mut fresh = 100_000;
        let mut hits = 0;
        for _round in 0..40 {
            hits = (0..300).filter(|key| forced.contains(key)).count();
            for key in 0..300 {
                use_key_forced(&mut forced, 1_000, key, mode);
            }
            for _ in 0..2_700 {
                use_key_forced(&mut forced, 1_000, fresh, mode);
                fresh += 1;
            }
        }
        assert!(hits < 30, "{mode:?} kept {hits} popular keys");
    }
}

/// [`use_key`] with the policy held in `mode` whatever its shadows say.
fn use_key_forced(policy: &mut Adaptive<u32>, capacity: usize, key: u32, mode: Mode) {
    policy.force_mode(mode);
    use_key(policy, capacity, key);
}

#[test]
fn adaptive_stays_lru_where_recency_is_right() {
    let mut policy = Adaptive::new();
    // A sliding window: every key is used twice, 300 keys apart, in a cache of 1,000.
    for key in 0..100_000u32 {
        use_key(&mut policy, 1_000, key);
        if key >= 300 {
            use_key(&mut policy, 1_000, key - 300);
        }
    }
    assert_eq!(policy.order(), Order::Recency, "{policy:?}");
}

#[test]
fn adaptive_judges_only_from_enough_keys() {
    // The stream that switches a cache of 1,000 from recency...
    let mut policy = hot_set_between_scans();
    let judged = policy.order();
    assert_ne!(judged, Order::Recency, "{policy:?}");
    // ...then the cache shrinks below 64 keys: shadows of 16 keys or fewer are too small to
    // judge by, so the next eviction follows recency.
    let victims = policy.evict(policy.len() - 63, &mut |_| true);
    assert_eq!(policy.order(), judged, "the mode is chosen before an eviction");
    assert_eq!(policy.len(), 63, "{} evicted", victims.len());
    policy.evict(1, &mut |_| true);
    assert_eq!(policy.order(), Order::Recency, "{policy:?}");
}

#[test]
fn adaptive_a_chain_loses_its_tail_before_its_root_in_every_mode() {
    for mode in Mode::ALL {
        let mut policy = Adaptive::<u32>::new();
        policy.force_mode(mode);
        // A chain used twice before, so its keys count more uses than the next chain's.
        for key in (20..24).rev() {
            policy.insert(key);
        }
        for key in (20..24).rev() {
            policy.touch(&key);
        }
        // Two chains stored as callers store them, new chunks leaf first: 3, 2, 1, 0.
        for key in (0..4).rev() {
            policy.insert(key);
        }
        for key in (10..14).rev() {
            policy.insert(key);
        }
        // The first chain is hit again, touched leaf first, so its root is the most recent.
        for key in (0..4).rev() {
            policy.touch(&key);
        }
        // A longer chain sharing the first's root and next chunk: 0 and 1 are used more often
        // than the rest of either chain.
        for key in [31, 30] {
            policy.insert(key);
        }
        for key in (0..2).rev() {
            policy.touch(&key);
        }
        let victims = policy.evict(14, &mut |_| true);
        let chain = |keys: std::ops::Range<u32>| -> Vec<u32> {
            victims.iter().copied().filter(|k| keys.contains(k)).collect()
        };
        assert_eq!(chain(0..4), vec![3, 2, 1, 0], "{mode:?}: {victims:?}");
        assert_eq!(chain(10..14), vec![13, 12, 11, 10], "{mode:?}: {victims:?}");
        assert_eq!(chain(20..24), vec![23, 22, 21, 20], "{mode:?}: {victims:?}");
        // 30 and 31 hang below 1: they go before it.
        let at = |key| victims.iter().position(|k| *k == key);
        assert!(at(30) < at(1) && at(31) < at(1), "{mode:?}: {victims:?}");
    }
}

/// A judge of tiers of `capacity` chunks after 60 rounds of a hot set of `hot` chunks, each round
/// followed by a scan of `scan` chunks never asked for again.
fn judge_of_hot_set_between_scans(capacity: usize, hot: u32, scan: u32) -> Judge<u32> {
    let mut judge = Judge::new(capacity);
    let mut fresh = 100_000u32;
    for _round in 0..60 {
        (0..hot).for_each(|key| judge.looked_up(&key));
        (fresh..fresh + scan).for_each(|key| judge.looked_up(&key));
        fresh += scan;
    }
    judge
}

#[test]
fn a_judge_chooses_from_lookups_as_one_cache_of_its_size_would() {
    // A scan longer than the cache between rounds of a hot set: one adaptive cache of 1,000
    // leaves recency, and so does a judge of 1,000 fed the same keys.
    assert_ne!(hot_set_between_scans().order(), Order::Recency);
    let judge = judge_of_hot_set_between_scans(1_000, 600, 1_200);
    assert_ne!(judge.order().order(), Order::Recency);
    // A sliding window, where recency is right: the judge stays there.
    let mut judge = Judge::new(1_000);
    for key in 0..100_000u32 {
        judge.looked_up(&key);
        if key >= 300 {
            judge.looked_up(&(key - 300));
        }
    }
    assert_eq!(judge.order().order(), Order::Recency);
    // Too few chunks to judge by: recency, whatever the lookups.
    let small = judge_of_hot_set_between_scans(63, 40, 80);
    assert_eq!(small.order().order(), Order::Recency);
}

#[test]
fn a_judge_of_any_size_models_a_bounded_sample() {
    let judge = Judge::<u64>::new(usize::MAX);
    assert!(judge.shadow_capacity() <= 1 << 17, "{}", judge.shadow_capacity());
    assert!(judge.shadow_capacity() >= 1 << 16, "{}", judge.shadow_capacity());
    assert_eq!(Judge::<u64>::new(1_000).shadow_capacity(), 250, "one key in four below that");
    assert_eq!(judge.history_slots(), 0, "nothing is reserved for the size it models");
    // Lookups grow its memory with the keys its shadows hold: tiers of 16 M chunks are judged on
    // one chunk in 128 (shadows of 2^17 keys), so 20,000 chunks looked up put about 160 in the
    // shadows and their history of 48 entries each, not 48 x 2^17.
    let mut judge = Judge::<u64>::new(1 << 24);
    assert_eq!(judge.shadow_capacity(), 1 << 17);
    (0..20_000u64).for_each(|key| judge.looked_up(&key));
    let slots = judge.history_slots();
    assert!((1..=1 << 14).contains(&slots), "{slots} history entries");
}

#[test]
fn a_follower_evicts_in_the_judged_order_whatever_its_own_traffic_says() {
    let judged = judge_of_hot_set_between_scans(1_000, 600, 1_200).order();
    assert_ne!(judged.order(), Order::Recency);
    // A lower tier whose own traffic is a sliding window: its own shadows keep recency, the
    // follower takes ARC's order for the judge's (its own use counts are of what reached it,
    // not of the requests), and evicts exactly as a policy held in ARC's order.
    let (mut own, mut follower, mut forced) = (Adaptive::new(), Adaptive::new(), Adaptive::new());
    follower.follow(judged.clone());
    for key in 0..20_000u32 {
        let keys = if key >= 300 { vec![key, key - 300] } else { vec![key] };
        for key in keys {
            use_key(&mut own, 1_000, key);
            use_key(&mut follower, 1_000, key);
            use_key_forced(&mut forced, 1_000, key, Mode::Arc);
        }
    }
    assert_eq!(own.order(), Order::Recency, "{own:?}");
    assert_eq!(follower.order(), Order::Arc, "{follower:?}");
    forced.force_mode(Mode::Arc);
    assert_eq!(follower.evict(500, &mut |_| true), forced.evict(500, &mut |_| true));
    // The judge's next choice is followed at the next eviction.
    for (chosen, followed) in
        [(Mode::Recency, Order::Recency), (Mode::Frequency, Order::Arc), (Mode::Arc, Order::Arc)]
    {
        let order = JudgedOrder::fixed(Mode::Recency);
        let mut follower = Adaptive::<u32>::new();
        follower.follow(order.clone());
        (0..100).for_each(|key| use_key(&mut follower, 100, key));
        assert_eq!(follower.order(), Order::Recency);
        order.choose(chosen);
        follower.evict(1, &mut |_| true);
        assert_eq!(follower.order(), followed, "{chosen:?}");
    }
}

/// Evictions until key 0, used four times, goes from a policy of 64 keys in the frequency order
/// that fresh keys stream through, `below` chunks being kept by the tiers below it.
fn evictions_until_a_key_used_often_goes(below: usize) -> usize {
    let mut policy = Adaptive::<u32>::new();
    policy.keep_below(below);
    policy.force_mode(Mode::Frequency);
    for key in 0..64 {
        policy.insert(key);
    }
    for _ in 0..3 {
        policy.touch(&0);
    }
    for (evictions, fresh) in (64..100_000).enumerate() {
        if policy.evict(1, &mut |_| true) == [0] {
            return evictions;
        }
        policy.insert(fresh);
    }
    usize::MAX
}

#[test]
fn tiers_below_l1_slow_the_ageing_of_its_uses_to_their_turnover() {
    // Four uses at once count two doublings: two half-lives of six capacities of evictions, 768
    // among 64 keys, before key 0 ranks below a fresh key, and it goes once the 63 fresh keys
    // cached with it were used after that.
    let alone = evictions_until_a_key_used_often_goes(0);
    assert!((825..=835).contains(&alone), "{alone}");
    // With 640 chunks below, a capacity of evictions is 704: eleven times as long.
    let cascaded = evictions_until_a_key_used_often_goes(640);
    assert!((8_500..=8_520).contains(&cascaded), "{cascaded}");
}
