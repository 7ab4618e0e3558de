//! Conformance scenarios run against every policy, S3-FIFO's own scenarios, and model-based
//! property tests of both policies.

use proptest::prelude::*;

use super::s3fifo::{GHOST, MAIN, SMALL};
use super::{EvictionPolicy, InvalidRatio, Lru, PolicyKind, S3Fifo, evict_fraction};

/// An eligibility filter that lets every key go.
fn everything(_: &u32) -> bool {
    true
}

/// A policy of `kind` tracking `keys`, inserted in order.
fn with_keys(
    kind: PolicyKind,
    keys: impl IntoIterator<Item = u32>,
) -> Box<dyn EvictionPolicy<u32>> {
    let mut policy = kind.build();
    for key in keys {
        policy.insert(key);
    }
    policy
}

#[test]
fn b1_new_policy_tracks_and_proposes_nothing() {
    for kind in PolicyKind::ALL {
        let mut policy = kind.build::<u32>();
        assert_eq!(policy.len(), 0, "{kind:?}");
        assert!(policy.is_empty(), "{kind:?}");
        assert!(!policy.contains(&0), "{kind:?}");
        assert!(policy.evict(10, &mut everything).is_empty(), "{kind:?}");
        assert_eq!(evict_fraction(policy.as_mut(), 1.0, &mut everything), Ok(vec![]), "{kind:?}");
    }
}

#[test]
fn b2_created_twice_is_tracked_once() {
    for kind in PolicyKind::ALL {
        let mut policy = with_keys(kind, [7, 7]);
        assert_eq!(policy.len(), 1, "{kind:?}");
        assert!(policy.contains(&7), "{kind:?}");
        assert_eq!(policy.evict(10, &mut everything), vec![7], "{kind:?}");
        assert!(policy.is_empty(), "{kind:?}");
        assert!(!policy.contains(&7), "{kind:?}");
    }
}

#[test]
fn b3_lru_proposes_oldest_first_and_touch_moves_to_most_recent() {
    let mut lru = with_keys(PolicyKind::Lru, [1, 2, 3, 4]);
    lru.touch(&1);
    lru.touch(&3);
    // Inserting a tracked key is not a use: 2 stays the least recently used.
    lru.insert(2);
    assert_eq!(lru.evict(2, &mut everything), vec![2, 4]);
    assert_eq!(lru.evict(10, &mut everything), vec![1, 3]);
}

#[test]
fn b3_remove_or_touch_of_unknown_key_is_harmless() {
    for kind in PolicyKind::ALL {
        let mut policy = with_keys(kind, [1, 2, 3]);
        policy.touch(&9);
        assert!(!policy.remove(&9), "{kind:?}");
        assert_eq!(policy.len(), 3, "{kind:?}");
        assert!(!policy.contains(&9), "{kind:?}");
        assert!(policy.remove(&2), "{kind:?}");
        assert!(!policy.remove(&2), "{kind:?}: a key is removed only once");
        let mut victims = policy.evict(10, &mut everything);
        victims.sort_unstable();
        assert_eq!(victims, vec![1, 3], "{kind:?}");
    }
}

#[test]
fn b4_filter_skips_ineligible_and_still_returns_up_to_n() {
    for kind in PolicyKind::ALL {
        let mut policy = with_keys(kind, 0..10);
        // Make the odd keys hot, so that a policy that moved or reordered them would show it.
        for key in (1..10).step_by(2) {
            policy.touch(&key);
        }
        let mut even = |key: &u32| key.is_multiple_of(2);
        let first = policy.evict(3, &mut even);
        assert_eq!(first.len(), 3, "{kind:?}: {first:?}");
        assert!(first.iter().all(|key| key.is_multiple_of(2)), "{kind:?}: {first:?}");
        if kind == PolicyKind::Lru {
            assert_eq!(first, vec![0, 2, 4]);
        }
        // Asking for more than remain returns exactly the eligible rest.
        let rest = policy.evict(100, &mut even);
        let mut all: Vec<u32> = first.into_iter().chain(rest).collect();
        all.sort_unstable();
        assert_eq!(all, vec![0, 2, 4, 6, 8], "{kind:?}");
        assert_eq!(policy.len(), 5, "{kind:?}");
        for key in (1..10).step_by(2) {
            assert!(policy.contains(&key), "{kind:?}: ineligible {key} must stay tracked");
        }
        assert!(policy.evict(100, &mut even).is_empty(), "{kind:?}");
    }
}

#[test]
fn b5_ratio_zero_one_and_out_of_range() {
    for kind in PolicyKind::ALL {
        let mut policy = with_keys(kind, 0..10);
        let mut below_eight = |key: &u32| *key < 8;
        assert_eq!(evict_fraction(policy.as_mut(), 0.0, &mut below_eight), Ok(vec![]), "{kind:?}");
        assert_eq!(policy.len(), 10, "{kind:?}");
        for ratio in [-0.1, 1.1, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(
                evict_fraction(policy.as_mut(), ratio, &mut below_eight),
                Err(InvalidRatio(ratio)),
                "{kind:?}"
            );
        }
        let nan = evict_fraction(policy.as_mut(), f64::NAN, &mut below_eight);
        assert!(matches!(nan, Err(InvalidRatio(r)) if r.is_nan()), "{kind:?}: {nan:?}");
        assert_eq!(policy.len(), 10, "{kind:?}: a rejected ratio evicts nothing");

        let mut all = evict_fraction(policy.as_mut(), 1.0, &mut below_eight).unwrap();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>(), "{kind:?}");
        assert_eq!(policy.len(), 2, "{kind:?}");
        assert!(policy.contains(&8) && policy.contains(&9), "{kind:?}");
    }
}

/// Inserts `key` into a policy that holds at most `capacity` keys, evicting first when full, and
/// returns the victims.
fn insert_bounded(policy: &mut dyn EvictionPolicy<u32>, capacity: usize, key: u32) -> Vec<u32> {
    let victims = if policy.len() >= capacity { policy.evict(1, &mut everything) } else { vec![] };
    policy.insert(key);
    victims
}

#[test]
fn s3fifo_evicts_one_hit_wonders_before_keys_used_repeatedly() {
    const CAPACITY: usize = 10;
    let hot = 0..4;
    for kind in PolicyKind::ALL {
        let mut policy = with_keys(kind, hot.clone());
        for _ in 0..3 {
            hot.clone().for_each(|key| policy.touch(&key));
        }
        // A scan of keys used once, ten times the capacity, with no further use of the hot keys.
        let mut victims = vec![];
        for cold in 100..200 {
            victims.extend(insert_bounded(policy.as_mut(), CAPACITY, cold));
        }
        let hot_survivors = hot.clone().filter(|key| policy.contains(key)).count();
        match kind {
            PolicyKind::S3Fifo => {
                assert_eq!(hot_survivors, 4, "the scan must not flush keys used repeatedly");
                assert!(victims.iter().all(|key| *key >= 100), "{victims:?}");
            }
            // The contrast that makes the scenario meaningful: recency alone loses the hot keys.
            // So does the adaptive policy here: without evidence from its shadows it evicts in
            // recency order (`adaptive_switches_to_arc_when_a_scan_would_flush_a_hot_set`).
            PolicyKind::Lru | PolicyKind::Adaptive => assert_eq!(hot_survivors, 0),
        }
    }
}

#[test]
fn s3fifo_ghost_hit_goes_to_main_and_survives_a_scan() {
    const CAPACITY: usize = 10;
    let mut policy = S3Fifo::new();
    policy.insert(0);
    let mut cold = 100..;
    while policy.contains(&0) {
        let next = cold.next().unwrap();
        insert_bounded(&mut policy, CAPACITY, next);
    }
    assert_eq!(policy.queue_of(&0), Some(GHOST));

    // Back soon after its eviction: straight into the main FIFO.
    insert_bounded(&mut policy, CAPACITY, 0);
    assert_eq!(policy.queue_of(&0), Some(MAIN));
    // A key never seen before takes the same scan from the small FIFO.
    insert_bounded(&mut policy, CAPACITY, 1);
    for _ in 0..10 * CAPACITY {
        let next = cold.next().unwrap();
        insert_bounded(&mut policy, CAPACITY, next);
    }
    assert!(policy.contains(&0), "the ghost hit must survive the scan: {policy:?}");
    assert!(!policy.contains(&1), "a new key used once must not survive it");
}

#[test]
fn s3fifo_small_fifo_supplies_victims_only_while_it_holds_its_share() {
    for (policy, expected) in
        [(S3Fifo::new(), [0, 1, 2, 10]), (S3Fifo::with_tuning(0, 10), [10, 11, 0, 1])]
    {
        let mut policy = policy;
        for key in 0..4 {
            policy.insert(key);
            policy.touch(&key);
        }
        policy.insert(4);
        // With the main FIFO empty, the small one is due: it promotes 0 to 3 and evicts 4.
        assert_eq!(policy.evict(1, &mut everything), vec![4]);
        policy.insert(10);
        policy.insert(11);
        // Two of six keys are on probation: below the default 60%, at least the paper's 10%.
        assert_eq!(policy.evict(4, &mut everything), expected, "{policy:?}");
    }
}

#[test]
fn s3fifo_eviction_terminates_when_nothing_is_eligible() {
    let mut policy = S3Fifo::new();
    for key in 0..20 {
        policy.insert(key);
        policy.touch(&key);
    }
    // Every key was used on probation: the first eviction promotes them all, then takes the
    // oldest from the main FIFO.
    assert_eq!(policy.evict(1, &mut everything), vec![0]);
    for key in 20..30 {
        policy.insert(key);
    }
    for key in 1..30 {
        for _ in 0..key % 4 {
            policy.touch(&key);
        }
    }
    assert_eq!((policy.queue_len(SMALL), policy.queue_len(MAIN)), (10, 19));
    let tracked: Vec<u32> = (1..30).collect();

    assert!(policy.evict(usize::MAX, &mut |_| false).is_empty());
    assert!(tracked.iter().all(|key| policy.contains(key)));
    assert_eq!(policy.freq_of(&3), Some(3), "a skipped key keeps its frequency");

    // A lone eligible key is found wherever it is: at the top frequency on the main FIFO, it is
    // cycled down; on probation with a use, it is promoted and then taken from the main FIFO.
    assert_eq!(policy.evict(usize::MAX, &mut |key| *key == 3), vec![3]);
    assert_eq!(policy.evict(usize::MAX, &mut |key| *key == 21), vec![21]);
    assert_eq!(policy.len(), tracked.len() - 2);
}

#[test]
fn s3fifo_ineligible_keys_keep_their_fifo_and_frequency() {
    let mut policy = S3Fifo::new();
    for key in 0..10 {
        policy.insert(key);
    }
    policy.touch(&0);
    policy.touch(&0);
    let victims = policy.evict(3, &mut |key| *key != 0);
    assert_eq!(victims, vec![1, 2, 3]);
    assert_eq!((policy.queue_of(&0), policy.freq_of(&0)), (Some(SMALL), Some(2)));
}

#[test]
fn s3fifo_ghosts_are_bounded_by_the_tracked_keys() {
    const CAPACITY: usize = 10;
    let mut policy = S3Fifo::new();
    for key in 0..1000 {
        insert_bounded(&mut policy, CAPACITY, key);
        assert!(policy.queue_len(GHOST) <= policy.len(), "{policy:?}");
    }
    // The last eviction left one key fewer than the capacity, and as many ghosts.
    assert_eq!(policy.queue_len(GHOST), CAPACITY - 1);
    // Shrinking the cache shrinks the ghosts with it.
    policy.evict(4, &mut everything);
    assert_eq!(policy.queue_len(GHOST), 6);
    for key in 990..1000 {
        policy.remove(&key);
    }
    assert_eq!((policy.len(), policy.queue_len(GHOST)), (0, 0));
}

#[test]
fn s3fifo_remove_leaves_no_ghost() {
    let mut policy = S3Fifo::new();
    policy.insert(5);
    assert!(policy.remove(&5));
    assert_eq!(policy.queue_of(&5), None);
    policy.insert(5);
    assert_eq!(policy.queue_of(&5), Some(SMALL));
}

#[test]
fn s3fifo_promotion_threshold_is_honoured() {
    for (threshold, touches_to_promote) in [(0, 1), (1, 2), (2, 3), (7, 3)] {
        let mut policy = S3Fifo::with_promotion_threshold(threshold);
        for key in 0..3 {
            policy.insert(key);
        }
        // Key 0 just below the threshold, key 1 just above it; key 2 is never used.
        for _ in 1..touches_to_promote {
            policy.touch(&0);
        }
        for _ in 0..touches_to_promote {
            policy.touch(&1);
        }
        assert_eq!(policy.evict(2, &mut everything), vec![0, 2], "threshold {threshold}");
        // Promotion starts the key afresh on the main FIFO.
        assert_eq!((policy.queue_of(&1), policy.freq_of(&1)), (Some(MAIN), Some(0)));
    }
}

/// One step of a property test.
#[derive(Clone, Debug)]
enum Op {
    Insert(u32),
    Touch(u32),
    Remove(u32),
    /// Evict up to `n` keys; key `k` is eligible when bit `k` of the mask is set.
    Evict(usize, u16),
}

const KEYS: u32 = 16;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KEYS).prop_map(Op::Insert),
        3 => (0..KEYS).prop_map(Op::Touch),
        1 => (0..KEYS).prop_map(Op::Remove),
        2 => (0..6usize, any::<u16>()).prop_map(|(n, mask)| Op::Evict(n, mask)),
    ]
}

/// Applies `ops` to `policy` and to a model holding the tracked keys, least recently used first,
/// and checks after each step what every policy owes its caller. With `exact_lru`, evictions must
/// also return the model's least recently used eligible keys, in order.
fn check_against_model(mut policy: Box<dyn EvictionPolicy<u32>>, ops: &[Op], exact_lru: bool) {
    let mut model: Vec<u32> = vec![];
    for op in ops {
        match *op {
            Op::Insert(key) => {
                policy.insert(key);
                if !model.contains(&key) {
                    model.push(key);
                }
            }
            Op::Touch(key) => {
                policy.touch(&key);
                if let Some(at) = model.iter().position(|k| *k == key) {
                    let key = model.remove(at);
                    model.push(key);
                }
            }
            Op::Remove(key) => {
                let tracked = model.contains(&key);
                assert_eq!(policy.remove(&key), tracked, "{op:?}");
                model.retain(|k| *k != key);
            }
            Op::Evict(n, mask) => {
                let is_eligible = |key: &u32| mask & (1 << key) != 0;
                let victims = policy.evict(n, &mut |key| is_eligible(key));
                let expected: Vec<u32> =
                    model.iter().copied().filter(|key| is_eligible(key)).take(n).collect();
                assert_eq!(victims.len(), expected.len(), "{op:?}: {victims:?}");
                if exact_lru {
                    assert_eq!(victims, expected, "{op:?}");
                }
                for (i, key) in victims.iter().enumerate() {
                    assert!(model.contains(key) && is_eligible(key), "{op:?}: {key}");
                    assert!(!victims[..i].contains(key), "{op:?}: {key} returned twice");
                    assert!(!policy.contains(key), "{op:?}: {key} still tracked");
                }
                model.retain(|key| !victims.contains(key));
            }
        }
        assert_eq!(policy.len(), model.len(), "after {op:?}");
        for key in 0..KEYS {
            assert_eq!(policy.contains(&key), model.contains(&key), "key {key} after {op:?}");
        }
    }
}

proptest! {
    #[test]
    fn lru_agrees_with_a_naive_model(ops in prop::collection::vec(op(), 0..200)) {
        check_against_model(Box::new(Lru::new()), &ops, true);
    }

    #[test]
    fn s3fifo_agrees_with_a_set_model(
        ops in prop::collection::vec(op(), 0..200),
        threshold in 0u8..3,
        small_percent in prop_oneof![Just(10u8), Just(60), 1u8..100],
    ) {
        check_against_model(Box::new(S3Fifo::with_tuning(threshold, small_percent)), &ops, false);
    }

    #[test]
    fn s3fifo_never_holds_more_ghosts_than_keys(ops in prop::collection::vec(op(), 0..200)) {
        let mut policy = S3Fifo::new();
        for op in ops {
            match op {
                Op::Insert(key) => policy.insert(key),
                Op::Touch(key) => policy.touch(&key),
                Op::Remove(key) => {
                    policy.remove(&key);
                }
                Op::Evict(n, mask) => {
                    policy.evict(n, &mut |key| mask & (1 << key) != 0);
                }
            }
            prop_assert!(policy.queue_len(GHOST) <= policy.len(), "{:?}", policy);
        }
    }
}
