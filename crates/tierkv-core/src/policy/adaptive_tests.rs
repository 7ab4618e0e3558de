//! The adaptive policy against a naive model of the same rules, and its own scenarios.

use proptest::prelude::*;

use super::adaptive::Adaptive;
use super::{EvictionPolicy, SampleKey};

/// The adaptive policy written as plainly as possible: vectors, linear searches, oldest first.
/// It shares no code with [`Adaptive`], so the two agreeing on every victim checks the lists,
/// the cursors, the ghosts, the shadows and the mode switch together.
#[derive(Default)]
struct Model {
    cache: ModelArc,
    shadow_lru: Vec<u32>,
    shadow_arc: ModelArc,
    score: [f64; 2],
    arc_mode: bool,
    /// Below this many tracked keys, recency order.
    min_judged: usize,
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
}

impl ModelArc {
    fn len(&self) -> usize {
        self.t1.len() + self.t2.len()
    }
    fn contains(&self, key: u32) -> bool {
        self.t1.iter().chain(&self.t2).any(|(k, _)| *k == key)
    }
    fn touch(&mut self, key: u32) {
        self.clock += 1;
        if let Some(at) = self.t1.iter().position(|(k, _)| *k == key) {
            self.t1.remove(at);
        } else if let Some(at) = self.t2.iter().position(|(k, _)| *k == key) {
            self.t2.remove(at);
        } else {
            self.clock -= 1;
            return;
        }
        self.t2.push((key, self.clock));
    }
    fn insert(&mut self, key: u32) {
        if self.contains(key) {
            return;
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

impl Model {
    fn shadow_access(&mut self, key: u32) {
        if key.sample_bits().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 62 != 0 {
            return;
        }
        let capacity = (self.cache.len() / 4).max(1);
        if let Some(at) = self.shadow_lru.iter().position(|k| *k == key) {
            self.shadow_lru.remove(at);
            self.shadow_lru.push(key);
            self.score[0] += 1.0;
        } else {
            while self.shadow_lru.len() >= capacity {
                self.shadow_lru.remove(0);
            }
            self.shadow_lru.push(key);
        }
        if self.shadow_arc.contains(key) {
            self.shadow_arc.touch(key);
            self.score[1] += 1.0;
        } else {
            while self.shadow_arc.len() >= capacity {
                self.shadow_arc.evict_one(true, &|_| true);
            }
            self.shadow_arc.insert(key);
        }
        let keep = 1.0 - 1.0 / (8.0 * capacity as f64);
        self.score = self.score.map(|s| s * keep);
    }
    fn insert(&mut self, key: u32) {
        if !self.cache.contains(key) {
            self.shadow_access(key);
            self.cache.insert(key);
        }
    }
    fn touch(&mut self, key: u32) {
        if self.cache.contains(key) {
            self.shadow_access(key);
            self.cache.touch(key);
        }
    }
    fn evict(&mut self, n: usize, eligible: &dyn Fn(u32) -> bool) -> Vec<u32> {
        let [recency, arc] = self.score;
        if self.cache.len() < self.min_judged {
            self.arc_mode = false;
        } else if !self.arc_mode && arc > recency * 1.05 + 1.0 {
            self.arc_mode = true;
        } else if self.arc_mode && recency > arc * 1.05 + 1.0 {
            self.arc_mode = false;
        }
        let mut victims = vec![];
        while victims.len() < n {
            match self.cache.evict_one(self.arc_mode, eligible) {
                Some(key) => victims.push(key),
                None => break,
            }
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
                Op::Remove(key) => prop_assert_eq!(policy.remove(&key), model.cache.remove(key)),
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
            prop_assert_eq!(policy.in_arc_order(), model.arc_mode, "after {:?}", op);
            prop_assert!(policy.ghosts() <= 2 * policy.len(), "after {:?}", op);
        }
    }
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
fn adaptive_switches_to_arc_when_a_scan_would_flush_a_hot_set() {
    let policy = hot_set_between_scans();
    assert!(policy.in_arc_order(), "{policy:?}");
    // Protected by ARC, most of the hot set survives the last scan.
    let kept = (0..600).filter(|key| policy.contains(key)).count();
    assert!(kept > 300, "only {kept} of the hot set kept: {policy:?}");
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
    assert!(!policy.in_arc_order(), "{policy:?}");
}

#[test]
fn adaptive_judges_only_from_enough_keys() {
    // The stream that switches a cache of 1,000 to ARC's order...
    let mut policy = hot_set_between_scans();
    assert!(policy.in_arc_order(), "{policy:?}");
    // ...then the cache shrinks below 64 keys: shadows of 16 keys or fewer are too small to
    // judge by, so the next eviction follows recency.
    let victims = policy.evict(policy.len() - 63, &mut |_| true);
    assert!(policy.in_arc_order(), "the mode is chosen before an eviction");
    assert_eq!(policy.len(), 63, "{} evicted", victims.len());
    policy.evict(1, &mut |_| true);
    assert!(!policy.in_arc_order(), "{policy:?}");
}

#[test]
fn adaptive_a_chain_loses_its_tail_before_its_root_in_either_mode() {
    for arc_mode in [false, true] {
        let mut policy = Adaptive::<u32>::new();
        if arc_mode {
            policy.force_arc_mode();
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
        let victims = policy.evict(8, &mut |_| true);
        let first = victims.iter().position(|k| *k < 4).unwrap_or(usize::MAX);
        let order: Vec<u32> = victims.iter().copied().filter(|k| *k < 4).collect();
        assert_eq!(order, vec![3, 2, 1, 0], "arc mode {arc_mode}: {victims:?}");
        let other: Vec<u32> = victims.iter().copied().filter(|k| *k >= 10).collect();
        assert_eq!(other, vec![13, 12, 11, 10], "arc mode {arc_mode}: {victims:?}");
        assert!(first < victims.len());
    }
}
