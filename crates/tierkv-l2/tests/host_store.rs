//! HostStore behaviour beyond the contract: refusals, panicking buffers, metrics, concurrency,
//! and a model-based property test.

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use proptest::prelude::*;
use tierkv_core::{BufferError, ChunkSource, Departing, ObjectKey, StoreItem, TierError, VecChunk};
use tierkv_l2::{HostMemory, HostStore, HostStoreConfig};
use tierkv_testkit::contract::{Harness, OpenTier, SharedTier, key, keys, payload};

const CHUNK: u64 = 16 << 10;

/// A store of `chunks` slots of plain memory, run by `workers` threads.
fn plain(chunks: u64, workers: usize) -> HostStoreConfig {
    HostStoreConfig {
        memory: HostMemory::Plain,
        workers,
        ..HostStoreConfig::new(chunks * CHUNK, CHUNK)
    }
}

fn harness(chunks: u64, workers: usize) -> Harness {
    let config = plain(chunks, workers);
    let tier = Arc::new(HostStore::open(config).unwrap());
    Harness::new(OpenTier { tier, chunk_bytes: CHUNK, keep: Box::new(()) })
}

#[test]
fn a_chunk_larger_than_a_slot_is_refused_and_leaves_nothing() {
    let mut h = harness(4, 1);
    let item = StoreItem { key: key(1), source: Box::new(VecChunk(vec![0; CHUNK as usize + 1])) };
    let task = h.tier.submit_store(vec![item]);
    match h.wait(task) {
        tierkv_core::Completion::Stored { result, .. } => {
            assert_eq!(result, Err(TierError::TooLarge { bytes: CHUNK + 1, limit: CHUNK }))
        }
        _ => panic!("not a store completion"),
    }
    assert_eq!(h.tier.usage().used_bytes, 0);
}

struct Exploding;

impl ChunkSource for Exploding {
    fn len(&self) -> u64 {
        CHUNK
    }

    fn copy_to_host(&self, _dst: &mut [u8]) -> Result<(), BufferError> {
        panic!("this buffer explodes");
    }
}

#[test]
fn a_panicking_source_fails_its_task_whole_and_the_store_keeps_working() {
    let mut h = harness(8, 1);
    let items = vec![
        StoreItem { key: key(1), source: Box::new(VecChunk(payload(&key(1), CHUNK))) },
        StoreItem { key: key(2), source: Box::new(Exploding) },
    ];
    let task = h.tier.submit_store(items);
    match h.wait(task) {
        tierkv_core::Completion::Stored { result, sources, .. } => {
            assert!(result.is_err());
            assert_eq!(sources.len(), 2, "the buffers come back even though one panicked");
        }
        _ => panic!("not a store completion"),
    }
    assert_eq!(h.present(&keys(1..3)).count_ones(), 0, "nothing of a failed store task is visible");
    assert_eq!(h.tier.usage().used_bytes, 0, "its slots were freed");
    h.store(&[key(3)]).unwrap();
    h.assert_loads(&[key(3)]);
}

#[test]
fn metrics_count_stores_loads_bytes_and_evictions() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let mut h = metrics::with_local_recorder(&recorder, || harness(2, 1));
    h.store(&keys(0..2)).unwrap();
    h.store(&keys(2..3)).unwrap(); // evicts the first
    // A task cannot evict its own keys: three new keys never fit two slots at once.
    assert!(matches!(h.store(&keys(5..8)), Err(TierError::NoSpace(_))));
    h.assert_loads(&keys(1..3));
    let snapshot = snapshotter.snapshot().into_vec();
    let value = |name: &str| -> f64 {
        snapshot
            .iter()
            .filter(|(k, ..)| k.key().name() == name && k.key().labels().any(|l| l.value() == "l2"))
            .map(|(.., v)| match v {
                DebugValue::Counter(n) => *n as f64,
                DebugValue::Gauge(g) => g.into_inner(),
                DebugValue::Histogram(_) => f64::NAN,
            })
            .sum()
    };
    assert_eq!(value("tierkv_tier_stores_total"), 3.0);
    assert_eq!(value("tierkv_tier_bytes_written_total"), (3 * CHUNK) as f64);
    assert_eq!(value("tierkv_tier_loads_total"), 2.0);
    assert_eq!(value("tierkv_tier_bytes_read_total"), (2 * CHUNK) as f64);
    assert_eq!(value("tierkv_evictions_total"), 1.0);
    assert_eq!(value("tierkv_tier_used_bytes"), (2 * CHUNK) as f64);
    assert_eq!(value("tierkv_tier_capacity_bytes"), (2 * CHUNK) as f64);
}

#[test]
fn metrics_count_loads_from_copies_on_their_way_down_and_what_is_on_its_way() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (mut h, on_their_way, store) =
        metrics::with_local_recorder(&recorder, || with_demoter_and_store(2));
    h.store(&keys(0..2)).unwrap();
    h.store(&keys(2..4)).unwrap(); // keys 0 and 1 leave
    h.assert_loads(&keys(0..3)); // two from copies on their way, one from a slot
    // A snapshot takes the values it reads: one per step.
    let published = || -> Vec<(String, f64)> {
        store.publish_metrics();
        let snapshot = snapshotter.snapshot().into_vec();
        let departing = snapshot.iter().filter(|(k, ..)| {
            k.key().name().contains("departing") && k.key().labels().any(|l| l.value() == "l2")
        });
        let mut values: Vec<(String, f64)> = departing
            .map(|(k, .., v)| {
                let value = match v {
                    DebugValue::Counter(n) => *n as f64,
                    DebugValue::Gauge(g) => g.into_inner(),
                    DebugValue::Histogram(_) => f64::NAN,
                };
                (k.key().name().to_string(), value)
            })
            .collect();
        values.sort_by(|a, b| a.0.cmp(&b.0));
        values
    };
    let named = |pairs: &[(&str, f64)]| -> Vec<(String, f64)> {
        pairs.iter().map(|(name, value)| (format!("tierkv_departing_{name}"), *value)).collect()
    };
    let chunk = CHUNK as f64;
    assert_eq!(
        published(),
        named(&[("bytes", 2.0 * chunk), ("loads_total", 2.0), ("objects", 2.0)])
    );
    drop(on_their_way.lock().unwrap().remove(0));
    assert_eq!(published(), named(&[("bytes", chunk), ("loads_total", 0.0), ("objects", 1.0)]));
}

/// `steps` random stores, verified loads, lookups (each locked key must load, then is unlocked)
/// and deletes of keys `0..keys`, seeded by `thread`.
fn random_operations(shared: &SharedTier, thread: u64, steps: usize, keys: u64) {
    let mut seed = thread * 7919 + 1;
    for _ in 0..steps {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let k = key((seed >> 33) % keys);
        match (seed >> 20) % 4 {
            0 => drop(shared.store(&[k])),
            1 => drop(shared.load_verified(&[k])),
            2 => {
                if shared.lookup(&[k]).get(0) {
                    assert!(shared.load_verified(&[k]).get(0), "a locked key failed to load");
                    shared.tier.unlock(&[k]);
                }
            }
            _ => drop(shared.tier.delete(&[k])),
        }
    }
}

#[test]
fn concurrent_stores_loads_locks_and_deletes_never_serve_wrong_bytes() {
    let config = plain(24, 4);
    let shared = SharedTier::new(Arc::new(HostStore::open(config).unwrap()), CHUNK);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let shared = &shared;
            s.spawn(move || random_operations(shared, t, 200, 64));
        }
    });
    let usage = shared.tier.usage();
    assert_eq!(usage.locks, 0);
    assert_eq!(usage.used_bytes, usage.objects * CHUNK, "{usage:?}");
}

/// Counts a worker thread out when it ends, by return or by panic.
struct Done<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

#[test]
fn victims_landing_under_concurrent_stores_loads_locks_and_deletes_never_serve_wrong_bytes() {
    // As above, over a store whose victims go to a demoter, and a fifth thread landing them in
    // their order of departure: whatever is served, from a slot or on its way, is its own
    // bytes; a locked key always loads; and once every departure landed, nothing is served but
    // what the slots hold, and no lock is left.
    let config = plain(12, 4);
    let store = HostStore::open(config).unwrap();
    let on_their_way: Arc<Mutex<std::collections::VecDeque<Departing>>> = Arc::default();
    let keep = Arc::clone(&on_their_way);
    assert!(store.set_demoter(Box::new(move |_, departing| {
        keep.lock().unwrap().push_back(departing);
    })));
    let shared = SharedTier::new(Arc::new(store), CHUNK);
    let working = std::sync::atomic::AtomicUsize::new(4);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (shared, working) = (&shared, &working);
            s.spawn(move || {
                // Counted out however the thread ends, so a failed assertion ends the lander too.
                let _done = Done(working);
                random_operations(shared, t, 300, 48);
            });
        }
        let on_their_way = &on_their_way;
        let working = &working;
        s.spawn(move || {
            let mut landed = 0u64;
            while working.load(std::sync::atomic::Ordering::Acquire) > 0 {
                // Keep a few on their way: land one when more than four are.
                let next = {
                    let mut queue = on_their_way.lock().unwrap();
                    if queue.len() > 4 { queue.pop_front() } else { None }
                };
                match next {
                    Some(departing) => {
                        drop(departing);
                        landed += 1;
                    }
                    None => std::thread::yield_now(),
                }
            }
            assert!(landed > 0, "nothing was ever on its way");
        });
    });
    on_their_way.lock().unwrap().clear();
    let usage = shared.tier.usage();
    assert_eq!(usage.locks, 0);
    assert_eq!(usage.used_bytes, usage.objects * CHUNK, "{usage:?}");
    let all: Vec<ObjectKey> = (0..48).map(key).collect();
    let found = shared.lookup(&all);
    let locked: Vec<ObjectKey> = found.iter_ones().map(|i| all[i]).collect();
    shared.tier.unlock(&locked);
    assert_eq!(found.count_ones() as u64, usage.objects, "served: only what the slots hold");
}

#[test]
fn a_store_task_never_evicts_its_own_keys_and_a_failed_one_evicts_nothing() {
    let mut h = harness(4, 1);
    h.store(&[key(1), key(2), key(5)]).unwrap();
    assert_eq!(h.lookup(&[key(1), key(2), key(5)]).count_ones(), 3);
    h.store(&[key(0)]).unwrap();
    // Key 0 is the only evictable object, and it is part of the task: the task cannot fit.
    assert!(matches!(h.store(&[key(3), key(0)]), Err(TierError::NoSpace(_))));
    assert!(h.present(&[key(0)]).get(0), "the task evicted its own key");
    // Two new keys where one slot can be freed: refused, and the cached object survives.
    assert!(matches!(h.store(&[key(6), key(7)]), Err(TierError::NoSpace(_))));
    assert!(h.present(&[key(0)]).get(0), "a failed task evicted a cached object");
    h.assert_loads(&[key(0)]);
}

#[test]
fn a_store_that_cannot_fit_leaves_the_eviction_order_as_it_was() {
    // LRU, so the order is plain: 0 is the oldest, then 1, 2, 3.
    let config = HostStoreConfig { policy: tierkv_core::policy::PolicyKind::Lru, ..plain(4, 1) };
    let tier = Arc::new(HostStore::open(config).unwrap());
    let mut h = Harness::new(OpenTier { tier, chunk_bytes: CHUNK, keep: Box::new(()) });
    for k in 0..4 {
        h.store(&[key(k)]).unwrap();
    }
    // 2 and 3 locked: three new keys cannot fit in the two evictable slots.
    assert_eq!(h.lookup(&keys(2..4)).count_ones(), 2);
    assert!(matches!(h.store(&keys(10..13)), Err(TierError::NoSpace(_))));
    h.tier.unlock(&keys(2..4));
    // The refused store took nothing from the order: the next victim is still the oldest, 0,
    // not 2 (which 0 and 1 would be newer than had they gone back to the policy as new).
    // (Presence is read only at the end: a lookup touches what it finds.)
    h.store(&[key(20)]).unwrap();
    h.store(&[key(21)]).unwrap();
    let present = h.present(&[key(0), key(1), key(2), key(3), key(20), key(21)]);
    assert_eq!(
        (0..6).map(|i| present.get(i)).collect::<Vec<_>>(),
        [false, false, true, true, true, true],
        "the two oldest objects went, 0 and 1"
    );
    h.assert_loads(&keys(2..4));
}

#[test]
fn background_eviction_brings_occupancy_to_the_low_watermark_and_spares_locked_keys() {
    let config = plain(10, 1);
    let store = Arc::new(HostStore::open(config).unwrap());
    let mut h =
        Harness::new(OpenTier { tier: store.clone(), chunk_bytes: CHUNK, keep: Box::new(()) });
    h.store(&keys(0..10)).unwrap();
    assert!(h.lookup(&keys(0..2)).count_ones() == 2);
    assert_eq!(store.evict_to_watermark(0.95, 0.5), 5, "ten slots down to five");
    assert_eq!(h.tier.usage().objects, 5);
    assert_eq!(h.present(&keys(0..2)).count_ones(), 2, "locked keys are never evicted");
    assert_eq!(store.evict_to_watermark(0.95, 0.5), 0, "below the high watermark nothing happens");
    h.tier.unlock(&keys(0..2));
}

#[test]
fn background_eviction_keeps_a_one_slot_tiers_chunk() {
    // The low watermark of one slot rounds down to none: the tier would hold nothing.
    let store = Arc::new(HostStore::open(plain(1, 1)).unwrap());
    let mut h =
        Harness::new(OpenTier { tier: store.clone(), chunk_bytes: CHUNK, keep: Box::new(()) });
    h.store(&keys(0..1)).unwrap();
    assert_eq!(store.evict_to_watermark(0.95, 0.9), 0);
    h.assert_loads(&keys(0..1));
}

/// A sink that announces its load is under way, then waits (at most ten seconds) to be let go
/// before it copies, holding the load in flight.
struct GatedSink {
    started: crossbeam_channel::Sender<()>,
    proceed: crossbeam_channel::Receiver<()>,
    bytes: Vec<u8>,
    out: crossbeam_channel::Sender<Vec<u8>>,
}

impl tierkv_core::ChunkSink for GatedSink {
    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn copy_from_host(&mut self, src: &[u8]) -> Result<(), BufferError> {
        let _ = self.started.send(());
        let _ = self.proceed.recv_timeout(std::time::Duration::from_secs(10));
        self.bytes.copy_from_slice(src);
        let _ = self.out.send(self.bytes.clone());
        Ok(())
    }
}

#[test]
fn a_slot_being_loaded_is_never_evicted_under_the_copy() {
    let config = plain(1, 2);
    let tier = Arc::new(HostStore::open(config).unwrap());
    let mut h = Harness::new(OpenTier { tier, chunk_bytes: CHUNK, keep: Box::new(()) });
    h.store(&[key(0)]).unwrap();
    let (started, is_started) = crossbeam_channel::bounded(1);
    let (let_go, proceed) = crossbeam_channel::bounded(1);
    let (out, copied) = crossbeam_channel::bounded(1);
    let sink = GatedSink { started, proceed, bytes: vec![0; CHUNK as usize], out };
    let load =
        h.tier.submit_load(vec![tierkv_core::LoadItem { key: key(0), sink: Box::new(sink) }]);
    is_started.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
    // The only slot is pinned by the load: a store that needs it must be refused, not evict it.
    let reused = h.store(&[key(1)]);
    let_go.send(()).unwrap();
    let bytes = copied.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
    h.wait(load);
    assert!(matches!(reused, Err(TierError::NoSpace(_))), "a pinned slot was reused: {reused:?}");
    assert!(bytes == payload(&key(0), CHUNK), "the load saw another object's bytes");
    h.store(&[key(1)]).unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Store(Vec<u64>),
    Lookup(Vec<u64>),
    Unlock(Vec<u64>),
    Delete(Vec<u64>),
    Load(Vec<u64>),
}

fn op() -> impl Strategy<Value = Op> {
    let ks = || prop::collection::vec(0u64..8, 1..4);
    prop_oneof![
        3 => ks().prop_map(Op::Store),
        2 => ks().prop_map(Op::Lookup),
        2 => ks().prop_map(Op::Unlock),
        1 => ks().prop_map(Op::Delete),
        2 => ks().prop_map(Op::Load),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A model of presence and locks: locked keys are never evicted, lock counts agree, present
    /// keys load their own bytes, and usage adds up after every step.
    #[test]
    fn the_store_agrees_with_a_model_of_presence_and_locks(ops in prop::collection::vec(op(), 1..40)) {
        let mut h = harness(4, 1);
        let mut present: BTreeSet<u64> = BTreeSet::new();
        let mut locks: BTreeMap<u64, u64> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Store(ids) => {
                    let result = h.store(&ids.iter().map(|i| key(*i)).collect::<Vec<_>>());
                    let new: BTreeSet<u64> = ids.iter().copied().filter(|i| !present.contains(i)).collect();
                    // Evictable: present, unlocked and not one of the task's own keys. A store fits
                    // if free plus evictable slots suffice; a failed one changes nothing.
                    let task: BTreeSet<u64> = ids.iter().copied().collect();
                    let evictable = present.iter().filter(|i| !locks.contains_key(i) && !task.contains(i)).count();
                    let fits = new.len() <= 4 - present.len() + evictable;
                    prop_assert_eq!(result.is_ok(), fits, "store of {:?} with present {:?} locks {:?}", new, present, locks);
                    // Which keys were evicted is the policy's choice; read back what is present.
                    let found = h.present(&(0..8).map(key).collect::<Vec<_>>());
                    let now: BTreeSet<u64> = found.iter_ones().map(|i| i as u64).collect();
                    for locked in locks.keys() {
                        prop_assert!(now.contains(locked), "locked key {} was evicted", locked);
                    }
                    if fits {
                        for i in &new {
                            prop_assert!(now.contains(i), "stored key {} is missing", i);
                        }
                    } else {
                        prop_assert_eq!(&now, &present, "a failed store changed what is stored");
                    }
                    present = now;
                }
                Op::Lookup(ids) => {
                    let found = h.lookup(&ids.iter().map(|i| key(*i)).collect::<Vec<_>>());
                    for (n, i) in ids.iter().enumerate() {
                        prop_assert_eq!(found.get(n), present.contains(i));
                        if found.get(n) {
                            *locks.entry(*i).or_default() += 1;
                        }
                    }
                }
                Op::Unlock(ids) => {
                    h.tier.unlock(&ids.iter().map(|i| key(*i)).collect::<Vec<_>>());
                    for i in ids {
                        if let Some(n) = locks.get_mut(&i) {
                            *n -= 1;
                            if *n == 0 {
                                locks.remove(&i);
                            }
                        }
                    }
                }
                Op::Delete(ids) => {
                    let unique: BTreeSet<u64> = ids.iter().copied().collect();
                    let expected = unique.iter().filter(|i| present.contains(i) && !locks.contains_key(i)).count();
                    let deleted = h.tier.delete(&unique.iter().map(|i| key(*i)).collect::<Vec<_>>());
                    prop_assert_eq!(deleted, expected);
                    present.retain(|i| !unique.contains(i) || locks.contains_key(i));
                }
                Op::Load(ids) => {
                    let ks: Vec<_> = ids.iter().map(|i| key(*i)).collect();
                    let (loaded, bytes) = h.load(&ks);
                    for (n, i) in ids.iter().enumerate() {
                        prop_assert_eq!(loaded.get(n), present.contains(i));
                        if loaded.get(n) {
                            prop_assert!(bytes[n] == payload(&ks[n], CHUNK));
                        }
                    }
                }
            }
            let usage = h.tier.usage();
            prop_assert_eq!(usage.locks, locks.values().sum::<u64>());
            prop_assert_eq!(usage.objects, present.len() as u64);
            prop_assert_eq!(usage.used_bytes, present.len() as u64 * CHUNK);
        }
    }
}

/// A sink whose copy panics.
struct PanickingSink;

impl tierkv_core::ChunkSink for PanickingSink {
    fn len(&self) -> u64 {
        CHUNK
    }

    fn copy_from_host(&mut self, _: &[u8]) -> Result<(), BufferError> {
        panic!("a sink that cannot be copied into")
    }
}

#[test]
fn a_large_load_split_over_the_workers_answers_every_key_in_order() {
    // 600 chunks of 16 KiB (9.4 MiB): past the split threshold, so 3 workers copy 3 parts.
    let mut h = harness(600, 3);
    h.store(&keys(0..300)).unwrap();
    let asked: Vec<_> = (0..300).flat_map(|i| [key(i), key(10_000 + i)]).collect();
    let (loaded, bytes) = h.load(&asked);
    for (i, (k, b)) in asked.iter().zip(&bytes).enumerate() {
        assert_eq!(loaded.get(i), i % 2 == 0, "bit {i} of the split load");
        if i % 2 == 0 {
            assert!(*b == payload(k, CHUNK), "key {i} loaded other bytes");
        }
    }
    // A sink that panics fails its own chunk only; the task completes once, every sink back.
    let mut items: Vec<tierkv_core::LoadItem> = keys(0..300)
        .into_iter()
        .map(|key| tierkv_core::LoadItem { key, sink: Box::new(VecChunk(vec![0; CHUNK as usize])) })
        .collect();
    items[150].sink = Box::new(PanickingSink);
    let task = h.tier.submit_load(items);
    match h.wait(task) {
        tierkv_core::Completion::Loaded { loaded, sinks, .. } => {
            assert_eq!((loaded.len(), sinks.len()), (300, 300));
            assert_eq!(loaded.count_ones(), 299);
            assert!(!loaded.get(150));
            assert!(sinks.iter().zip(keys(0..300)).all(|(s, k)| s.key == k), "sinks out of order");
        }
        _ => panic!("not a load completion"),
    }
    assert_eq!(h.locks(), 0);
    // Nothing stayed pinned: every chunk can be deleted.
    assert_eq!(h.tier.delete(&keys(0..300)), 300);
}

/// A store of `chunks` slots whose victims go to a demoter that keeps them, as the cascade's
/// store pipeline does until the tier below has them.
fn with_demoter(chunks: u64) -> (Harness, Arc<Mutex<Vec<Departing>>>) {
    let (h, on_their_way, _) = with_demoter_and_store(chunks);
    (h, on_their_way)
}

/// [`with_demoter`], and the store itself.
fn with_demoter_and_store(chunks: u64) -> (Harness, Arc<Mutex<Vec<Departing>>>, Arc<HostStore>) {
    let store = HostStore::open(plain(chunks, 1)).unwrap();
    let on_their_way: Arc<Mutex<Vec<Departing>>> = Arc::default();
    let keep = Arc::clone(&on_their_way);
    assert!(store.set_demoter(Box::new(move |key, departing| {
        assert_eq!(departing.key(), key);
        keep.lock().unwrap().push(departing);
    })));
    let store = Arc::new(store);
    let tier = Arc::clone(&store);
    (Harness::new(OpenTier { tier, chunk_bytes: CHUNK, keep: Box::new(()) }), on_their_way, store)
}

#[test]
fn a_victim_on_its_way_down_is_found_locked_and_loaded_until_it_lands() {
    let (mut h, on_their_way) = with_demoter(2);
    h.store(&keys(0..2)).unwrap();
    h.store(&[key(2)]).unwrap();
    let departed: Vec<ObjectKey> = on_their_way.lock().unwrap().iter().map(|d| d.key()).collect();
    assert_eq!(departed.len(), 1, "one victim for one new chunk");
    let victim = departed[0];
    {
        let guard = on_their_way.lock().unwrap();
        let mut below = vec![0; CHUNK as usize];
        guard[0].copy_to_host(&mut below).unwrap();
        assert!(below == payload(&victim, CHUNK), "the tier below gets the victim's bytes");
    }
    // On its way: a lookup finds and locks it, a load copies its bytes, though the store holds
    // only its two slots' chunks.
    assert_eq!(h.lookup(&[victim]).count_ones(), 1);
    assert_eq!(h.locks(), 1);
    assert_eq!(h.tier.usage().objects, 2);
    h.assert_loads(&[victim]);
    // Landed while locked: still served to the lookup that holds it, until it unlocks.
    on_their_way.lock().unwrap().clear();
    h.assert_loads(&[victim]);
    h.tier.unlock(&[victim]);
    assert_eq!(h.locks(), 0);
    assert_eq!(h.present(&[victim]).count_ones(), 0, "landed and unlocked: served below only");
    let (loaded, _) = h.load(&[victim]);
    assert_eq!(loaded.count_ones(), 0);
}

#[test]
fn a_victim_given_up_or_deleted_on_its_way_is_gone_at_once() {
    let (mut h, on_their_way) = with_demoter(1);
    h.store(&[key(0)]).unwrap();
    h.store(&[key(1)]).unwrap();
    assert_eq!(h.present(&[key(0)]).count_ones(), 1);
    // The tier below refused it (or the pipeline dropped it): a miss from now on.
    on_their_way.lock().unwrap().clear();
    assert_eq!(h.present(&[key(0)]).count_ones(), 0);
    // A delete takes a chunk on its way down out of this store too, unless a lookup holds it.
    h.store(&[key(2)]).unwrap();
    assert_eq!(on_their_way.lock().unwrap().len(), 1);
    assert_eq!(h.lookup(&[key(1)]).count_ones(), 1);
    assert_eq!(h.tier.delete(&[key(1)]), 0, "a locked chunk is not deleted");
    h.tier.unlock(&[key(1)]);
    assert_eq!(h.tier.delete(&[key(1)]), 1);
    assert_eq!(h.present(&[key(1)]).count_ones(), 0);
    // Its departure is withdrawn: the tier below must not keep it. Landing later finds nothing
    // to take back.
    let withdrawn: Vec<(ObjectKey, bool)> =
        on_their_way.lock().unwrap().iter().map(|d| (d.key(), d.withdrawn())).collect();
    assert_eq!(withdrawn, [(key(1), true)]);
    on_their_way.lock().unwrap().clear();
    assert_eq!(h.present(&[key(2)]).count_ones(), 1);
    assert_eq!(h.locks(), 0);
}

#[test]
fn a_key_deleted_on_its_way_and_departing_again_withdraws_only_the_earlier_departure() {
    let (mut h, on_their_way) = with_demoter(1);
    h.store(&[key(0)]).unwrap();
    h.store(&[key(1)]).unwrap(); // key 0 leaves
    assert_eq!(h.tier.delete(&[key(0)]), 1);
    h.store(&[key(0)]).unwrap(); // stored again after the delete: key 1 leaves
    h.store(&[key(2)]).unwrap(); // key 0 leaves again
    let down: Vec<(ObjectKey, bool)> =
        on_their_way.lock().unwrap().iter().map(|d| (d.key(), d.withdrawn())).collect();
    assert_eq!(down, [(key(0), true), (key(1), false), (key(0), false)]);
    // The withdrawn departure landing does not settle the later one: key 0 is still served.
    drop(on_their_way.lock().unwrap().remove(0));
    assert_eq!(h.present(&[key(0)]).count_ones(), 1);
    drop(on_their_way.lock().unwrap().remove(1));
    assert_eq!(h.present(&[key(0)]).count_ones(), 0);
}

#[test]
fn a_delete_takes_a_key_from_its_slot_and_from_its_copy_on_its_way_alike() {
    let (mut h, on_their_way) = with_demoter(1);
    h.store(&[key(0)]).unwrap();
    h.store(&[key(1)]).unwrap(); // key 0 leaves
    h.store(&[key(0)]).unwrap(); // stored again while its first copy is on its way
    assert_eq!(on_their_way.lock().unwrap().len(), 2, "keys 0 and 1 left");
    assert_eq!(h.tier.delete(&[key(0)]), 1, "one key, counted once");
    assert_eq!(h.present(&[key(0)]).count_ones(), 0, "served from neither copy");
    assert_eq!(h.present(&[key(1)]).count_ones(), 1);
}

#[test]
fn a_key_locked_in_its_slot_is_not_deleted_from_its_copy_on_its_way_either() {
    // Stored again while its first copy is on its way down, then locked in its slot: a delete
    // skips it (C3), in both places. Withdrawing the copy on its way while the slot stays
    // would report it deleted and leave it served here.
    let (mut h, on_their_way) = with_demoter(1);
    h.store(&[key(0)]).unwrap();
    h.store(&[key(1)]).unwrap(); // key 0 leaves
    h.store(&[key(0)]).unwrap(); // stored again: key 1 leaves
    assert_eq!(h.lookup(&[key(0)]).count_ones(), 1);
    assert_eq!(h.tier.delete(&[key(0)]), 0, "a locked key is not deleted");
    let withdrawn: Vec<(ObjectKey, bool)> =
        on_their_way.lock().unwrap().iter().map(|d| (d.key(), d.withdrawn())).collect();
    assert_eq!(withdrawn, [(key(0), false), (key(1), false)], "nothing was withdrawn");
    h.tier.unlock(&[key(0)]);
    assert_eq!(h.tier.delete(&[key(0)]), 1);
    assert_eq!(h.present(&[key(0)]).count_ones(), 0);
}

#[test]
fn a_chunk_leaving_again_before_it_landed_is_served_until_every_departure_landed() {
    let (mut h, on_their_way) = with_demoter(1);
    h.store(&[key(0)]).unwrap();
    h.store(&[key(1)]).unwrap(); // key 0 leaves
    assert_eq!(h.lookup(&[key(0)]).count_ones(), 1);
    h.store(&[key(0)]).unwrap(); // stored again: key 1 leaves
    h.store(&[key(2)]).unwrap(); // key 0 leaves a second time, the first still on its way
    let keys_down: Vec<ObjectKey> = on_their_way.lock().unwrap().iter().map(|d| d.key()).collect();
    assert_eq!(keys_down, [key(0), key(1), key(0)]);
    // The first departure lands: the second is still on its way, and the lock still held.
    drop(on_their_way.lock().unwrap().remove(0));
    assert_eq!(h.locks(), 1);
    h.assert_loads(&[key(0)]);
    h.tier.unlock(&[key(0)]);
    assert_eq!(h.present(&[key(0)]).count_ones(), 1, "the second departure is on its way");
    drop(on_their_way.lock().unwrap().remove(1));
    assert_eq!(h.present(&[key(0)]).count_ones(), 0);
    assert_eq!(h.present(&[key(1)]).count_ones(), 1);
    // The other way round: the later departure lands first, the earlier is still on its way.
    h.store(&[key(0)]).unwrap(); // key 2 leaves
    h.store(&[key(3)]).unwrap(); // key 0 leaves
    h.store(&[key(0)]).unwrap(); // key 3 leaves
    h.store(&[key(4)]).unwrap(); // key 0 leaves again
    let keys_down: Vec<ObjectKey> = on_their_way.lock().unwrap().iter().map(|d| d.key()).collect();
    assert_eq!(keys_down, [key(1), key(2), key(0), key(3), key(0)]);
    drop(on_their_way.lock().unwrap().remove(4));
    assert_eq!(h.present(&[key(0)]).count_ones(), 1, "the first departure is on its way");
    drop(on_their_way.lock().unwrap().remove(2));
    assert_eq!(h.present(&[key(0)]).count_ones(), 0);
}

#[derive(Clone, Debug)]
enum DemotedOp {
    Store(Vec<u64>),
    Lookup(Vec<u64>),
    Unlock(Vec<u64>),
    Delete(Vec<u64>),
    Load(Vec<u64>),
    /// The tier below takes (or gives up) the departure at this place among those held, if any.
    Land(usize),
}

fn demoted_op() -> impl Strategy<Value = DemotedOp> {
    let ks = || prop::collection::vec(0u64..8, 1..4);
    prop_oneof![
        3 => ks().prop_map(DemotedOp::Store),
        2 => ks().prop_map(DemotedOp::Lookup),
        2 => ks().prop_map(DemotedOp::Unlock),
        1 => ks().prop_map(DemotedOp::Delete),
        2 => ks().prop_map(DemotedOp::Load),
        2 => (0usize..8).prop_map(DemotedOp::Land),
    ]
}

/// A chunk the model has on its way down: the entry its departures left with, how many of them
/// have not landed, and the locks lookups took on it.
#[derive(Clone, Copy, Debug)]
struct ModelLeaving {
    entry: usize,
    in_flight: u32,
    locks: u64,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// With a demoter that holds its departures until told to land them: a key is found, locked
    /// and loaded with its own bytes while it is in a slot or on its way down (a departure not
    /// landed, or all landed but the key still locked), never otherwise; a departure is
    /// withdrawn exactly when its key was deleted on its way; locks add up; only slots count
    /// as objects.
    #[test]
    fn victims_on_their_way_down_agree_with_a_model(ops in prop::collection::vec(demoted_op(), 1..50)) {
        let (mut h, on_their_way) = with_demoter(4);
        // Keys in slots and the locks on them; keys on their way; departures held, in order.
        let mut resident: BTreeMap<u64, u64> = BTreeMap::new();
        let mut leaving: BTreeMap<u64, ModelLeaving> = BTreeMap::new();
        let mut held: Vec<(u64, usize)> = Vec::new();
        let mut entries = 0usize;
        let mut withdrawn: BTreeSet<usize> = BTreeSet::new();
        let id = |k: &ObjectKey| (0..8).find(|i| key(*i) == *k).unwrap();
        for op in ops {
            match op {
                DemotedOp::Store(ids) => {
                    let before = on_their_way.lock().unwrap().len();
                    let result = h.store(&ids.iter().map(|i| key(*i)).collect::<Vec<_>>());
                    let task: BTreeSet<u64> = ids.iter().copied().collect();
                    let new: BTreeSet<u64> = task.iter().copied().filter(|i| !resident.contains_key(i)).collect();
                    let evictable = resident.iter().filter(|(i, locks)| **locks == 0 && !task.contains(i)).count();
                    let fits = new.len() <= 4 - resident.len() + evictable;
                    prop_assert_eq!(result.is_ok(), fits);
                    let victims: Vec<u64> =
                        on_their_way.lock().unwrap()[before..].iter().map(|d| id(&d.key())).collect();
                    prop_assert_eq!(victims.len(), if fits { (resident.len() + new.len()).saturating_sub(4) } else { 0 });
                    for v in &victims {
                        prop_assert_eq!(resident.remove(v), Some(0), "victim {} was locked or absent", v);
                        let l = leaving.entry(*v).or_insert_with(|| {
                            entries += 1;
                            ModelLeaving { entry: entries, in_flight: 0, locks: 0 }
                        });
                        l.in_flight += 1;
                        held.push((*v, l.entry));
                    }
                    if fits {
                        for i in new {
                            resident.insert(i, 0);
                        }
                    }
                }
                DemotedOp::Lookup(ids) => {
                    let found = h.lookup(&ids.iter().map(|i| key(*i)).collect::<Vec<_>>());
                    // Leaf first: the last key of the request is locked first.
                    for (n, i) in ids.iter().enumerate().rev() {
                        let expected = resident.contains_key(i) || leaving.contains_key(i);
                        prop_assert_eq!(found.get(n), expected, "lookup of {}", i);
                        if let Some(locks) = resident.get_mut(i) {
                            *locks += 1;
                        } else if let Some(l) = leaving.get_mut(i) {
                            l.locks += 1;
                        }
                    }
                }
                DemotedOp::Unlock(ids) => {
                    h.tier.unlock(&ids.iter().map(|i| key(*i)).collect::<Vec<_>>());
                    for i in ids {
                        if let Some(locks) = resident.get_mut(&i).filter(|l| **l > 0) {
                            *locks -= 1;
                        } else if let Some(l) = leaving.get_mut(&i).filter(|l| l.locks > 0) {
                            l.locks -= 1;
                            if l.locks == 0 && l.in_flight == 0 {
                                leaving.remove(&i);
                            }
                        }
                    }
                }
                DemotedOp::Delete(ids) => {
                    let unique: BTreeSet<u64> = ids.iter().copied().collect();
                    let mut expected = 0;
                    for i in &unique {
                        // Locked in its slot or on its way: not deleted in either place.
                        if resident.get(i).is_some_and(|locks| *locks > 0)
                            || leaving.get(i).is_some_and(|l| l.locks > 0)
                        {
                            continue;
                        }
                        let mut gone = false;
                        if resident.get(i) == Some(&0) {
                            resident.remove(i);
                            gone = true;
                        }
                        if leaving.get(i).is_some_and(|l| l.locks == 0)
                            && let Some(l) = leaving.remove(i)
                        {
                            withdrawn.insert(l.entry);
                            gone = true;
                        }
                        expected += usize::from(gone);
                    }
                    let deleted = h.tier.delete(&unique.iter().map(|i| key(*i)).collect::<Vec<_>>());
                    prop_assert_eq!(deleted, expected);
                }
                DemotedOp::Load(ids) => {
                    let ks: Vec<_> = ids.iter().map(|i| key(*i)).collect();
                    let (loaded, bytes) = h.load(&ks);
                    for (n, i) in ids.iter().enumerate() {
                        let expected = resident.contains_key(i) || leaving.contains_key(i);
                        prop_assert_eq!(loaded.get(n), expected, "load of {}", i);
                        if loaded.get(n) {
                            prop_assert!(bytes[n] == payload(&ks[n], CHUNK));
                        }
                    }
                }
                DemotedOp::Land(place) => {
                    if held.is_empty() {
                        continue;
                    }
                    let place = place % held.len();
                    let (i, entry) = held.remove(place);
                    let departing = on_their_way.lock().unwrap().remove(place);
                    prop_assert_eq!(departing.withdrawn(), withdrawn.contains(&entry), "departure of {}", i);
                    drop(departing);
                    if let Some(l) = leaving.get_mut(&i).filter(|l| l.entry == entry) {
                        l.in_flight -= 1;
                        if l.in_flight == 0 && l.locks == 0 {
                            leaving.remove(&i);
                        }
                    }
                }
            }
            let usage = h.tier.usage();
            let locks = resident.values().sum::<u64>() + leaving.values().map(|l| l.locks).sum::<u64>();
            prop_assert_eq!(usage.locks, locks);
            prop_assert_eq!(usage.objects, resident.len() as u64);
        }
    }
}

/// A source that says it is half a slot long when first asked, and twice a slot after.
struct Growing(std::sync::atomic::AtomicU32);

impl ChunkSource for Growing {
    fn len(&self) -> u64 {
        let asked = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if asked == 0 { CHUNK / 2 } else { 2 * CHUNK }
    }

    fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), BufferError> {
        dst.fill(0xee);
        Ok(())
    }
}

#[test]
fn a_source_whose_length_grows_once_asked_cannot_write_past_its_slot() {
    let mut h = harness(4, 1);
    h.store(&keys(0..4)).unwrap();
    assert_eq!(h.tier.delete(&[key(0)]), 1);
    let growing = Growing(std::sync::atomic::AtomicU32::new(0));
    let item = StoreItem { key: key(9), source: Box::new(growing) };
    let task = h.tier.submit_store(vec![item]);
    assert!(matches!(h.wait(task), tierkv_core::Completion::Stored { result: Ok(()), .. }));
    h.assert_loads(&keys(1..4));
    assert_eq!(h.tier.usage().objects, 4);
}

#[test]
fn a_demoter_that_panics_loses_its_victim_and_no_slot() {
    let store = HostStore::open(plain(1, 1)).unwrap();
    assert!(store.set_demoter(Box::new(|_, _| panic!("a demoter bug"))));
    let store = Arc::new(store);
    for i in 0..3 {
        store.store_now(key(i), &VecChunk(payload(&key(i), CHUNK))).unwrap();
    }
    let mut h = Harness::new(OpenTier { tier: store, chunk_bytes: CHUNK, keep: Box::new(()) });
    h.store(&[key(3)]).unwrap();
    assert_eq!(h.tier.usage().objects, 1, "each victim was lost, its slot was not");
    h.assert_loads(&[key(3)]);
}

/// A sink that answers its length once and panics when asked again.
struct PanicsOnSecondLen(std::sync::atomic::AtomicU32);

impl tierkv_core::ChunkSink for PanicsOnSecondLen {
    fn len(&self) -> u64 {
        let asked = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        assert!(asked == 0, "a sink whose length cannot be asked twice");
        CHUNK
    }

    fn copy_from_host(&mut self, _: &[u8]) -> Result<(), BufferError> {
        Ok(())
    }
}

#[test]
fn a_sink_whose_length_panics_when_asked_again_leaves_no_slot_pinned() {
    let mut h = harness(4, 1);
    h.store(&keys(0..2)).unwrap();
    // The load asks each sink's length once when it is submitted; the second sink panics when
    // the worker asks again, after the first key's slot may already be pinned.
    let items = vec![
        tierkv_core::LoadItem { key: key(0), sink: Box::new(VecChunk(vec![0; CHUNK as usize])) },
        tierkv_core::LoadItem {
            key: key(1),
            sink: Box::new(PanicsOnSecondLen(std::sync::atomic::AtomicU32::new(0))),
        },
    ];
    let task = h.tier.submit_load(items);
    let done = h.wait(task);
    assert_eq!(h.locks(), 0);
    // Nothing stayed pinned: both keys can be deleted.
    assert_eq!(h.tier.delete(&keys(0..2)), 2, "a pin leaked");
    match done {
        tierkv_core::Completion::Loaded { loaded, sinks, .. } => {
            assert_eq!(sinks.len(), 2, "every sink comes back, the panicking one too");
            assert!(loaded.get(0), "the other key still loads");
            assert!(!loaded.get(1), "the panicking sink is a miss");
        }
        _ => panic!("not a load completion"),
    }
}
