//! Issue 16 (hardening): the StorageManager's defects, one test each, named after the defect.

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

mod common;

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use parking_lot::Mutex;
use tierkv_core::{
    Completion, ExtraCount, LoadItem, ManualClock, ObjectKey, StoreItem, TaskId, TierAdapter,
    TierUsage,
};
use tierkv_l1::{L1Config, Readers, Watermark};
use tierkv_storage::{
    Durability, GroupKind, LookupGroup, LookupId, LookupRequest, StorageConfig, StorageError,
    StorageManager, StorePolicy,
};
use tierkv_testkit::contract::{key, keys, payload};
use tierkv_testkit::{FakeTier, eventually};

use common::{CHUNK, OWNER, WAIT, l1_config, layout};

/// A tier whose `submit_store` blocks the calling thread (the store pipeline) while the gate is
/// shut: the pipeline is then busy and cannot get to the next job.
struct GatedTier {
    inner: FakeTier,
    gate: Mutex<Option<mpsc::Receiver<()>>>,
    entered: mpsc::SyncSender<()>,
    /// The number of chunks of each store task, in order.
    tasks: Mutex<Vec<usize>>,
}

impl GatedTier {
    /// A shut gate: returns the tier, the sender that opens it, and the receiver told when the
    /// pipeline has entered the tier and waits.
    fn shut(name: &str) -> (Arc<Self>, mpsc::Sender<()>, mpsc::Receiver<()>) {
        let (open, gate) = mpsc::channel();
        let (entered_tx, entered) = mpsc::sync_channel(1);
        let tier = GatedTier {
            inner: FakeTier::new(name, 64, CHUNK),
            gate: Mutex::new(Some(gate)),
            entered: entered_tx,
            tasks: Mutex::new(Vec::new()),
        };
        (Arc::new(tier), open, entered)
    }
}

impl TierAdapter for GatedTier {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn submit_store(&self, items: Vec<StoreItem>) -> TaskId {
        self.tasks.lock().push(items.len());
        if let Some(gate) = self.gate.lock().take() {
            let _ = self.entered.send(());
            let _ = gate.recv();
        }
        self.inner.submit_store(items)
    }
    fn submit_lookup_and_lock(&self, keys: Vec<ObjectKey>) -> TaskId {
        self.inner.submit_lookup_and_lock(keys)
    }
    fn submit_load(&self, items: Vec<LoadItem>) -> TaskId {
        self.inner.submit_load(items)
    }
    fn unlock(&self, keys: &[ObjectKey]) {
        self.inner.unlock(keys)
    }
    fn delete(&self, keys: &[ObjectKey]) -> usize {
        self.inner.delete(keys)
    }
    fn clear(&self) -> usize {
        self.inner.clear()
    }
    fn usage(&self) -> TierUsage {
        self.inner.usage()
    }
    fn completions(&self) -> Receiver<Completion> {
        self.inner.completions()
    }
    fn close(&self) {
        self.inner.close()
    }
}

fn write(s: &StorageManager, keys: &[ObjectKey]) -> Arc<tierkv_storage::StoreTicket> {
    let reserved = s.reserve_write(OWNER, keys, &layout()).unwrap();
    assert!(reserved.iter().all(|r| r.is_ok()), "{reserved:?}");
    for k in keys {
        s.write_access(OWNER, k).unwrap().write_at(0, &payload(k, CHUNK)).unwrap();
    }
    let (results, ticket) = s.finish_write_tracked(OWNER, keys).unwrap();
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    ticket
}

fn shares(s: &StorageManager, k: &ObjectKey) -> u64 {
    match s.l1().presence(k) {
        tierkv_l1::Presence::Ready { shares, .. } => shares,
        other => panic!("{k:?} is {other:?}"),
    }
}

#[test]
fn h16_02_a_finished_chunk_stays_in_l1_until_its_tiers_have_it_and_the_ticket_says_durable() {
    let (disk, open, entered) = GatedTier::shut("disk");
    let tiers: Vec<Arc<dyn TierAdapter>> = vec![disk.clone()];
    let s = StorageManager::start_with_tiers(
        StorageConfig {
            store_policy: StorePolicy::WriteThrough,
            ..StorageConfig::new(l1_config(16))
        },
        Arc::new(ManualClock::new()),
        tiers,
    )
    .unwrap();
    // The pipeline takes the first batch and blocks inside the tier.
    let first = write(&s, &keys(0..2));
    entered.recv_timeout(WAIT).unwrap();
    // The second batch is acknowledged while the pipeline cannot get to it.
    let second = write(&s, &keys(2..5));
    assert!(
        keys(2..5).iter().all(|k| shares(&s, k) == 1),
        "an acknowledged chunk waits for the store pipeline unpinned, so eviction can drop it"
    );
    let cleared = s.clear_l1(false);
    assert_eq!(cleared.removed, 0, "nothing on its way down is evictable");
    open.send(()).unwrap();
    assert_eq!(
        first.wait_until(Instant::now() + WAIT),
        Some(Durability { durable: 2, not_durable: 0 })
    );
    assert_eq!(
        second.wait_until(Instant::now() + WAIT),
        Some(Durability { durable: 3, not_durable: 0 })
    );
    assert!(keys(0..5).iter().all(|k| disk.inner.contains(k)), "every acknowledged chunk is down");
    eventually("the pipeline's shares come back", || keys(0..5).iter().all(|k| shares(&s, k) == 0));
}

#[test]
fn a_cascade_stop_waits_for_copies_that_pin_l1_chunks_then_hands_them_down_once() {
    // Under the cascade a remote tier with write-through admission takes every finished write
    // at once, and the copy pins its chunks in L1 until the remote tier has them. A stop that
    // began while the copies were held still hands those chunks down to disk.
    let (disk, remote) =
        (Arc::new(FakeTier::new("disk", 64, CHUNK)), Arc::new(FakeTier::new("remote", 64, CHUNK)));
    let tiers: Vec<Arc<dyn TierAdapter>> = vec![disk.clone(), remote.clone()];
    let l1 = L1Config { watermark: Watermark { high: 1.0, low: 1.0 }, ..l1_config(8) };
    let config = StorageConfig { store_policy: StorePolicy::Cascade, ..StorageConfig::new(l1) };
    let s = Arc::new(
        StorageManager::start_with_tiers(config, Arc::new(ManualClock::new()), tiers).unwrap(),
    );
    remote.hold();
    write(&s, &keys(0..3));
    eventually("the remote copies are held", || remote.held_tasks() > 0);
    assert!(keys(0..3).iter().all(|k| shares(&s, k) == 1), "the copies pin the chunks");
    let stopping = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || s.stop())
    };
    std::thread::sleep(Duration::from_millis(50));
    assert!(!stopping.is_finished(), "the stop waits for the pinned chunks' copies");
    remote.release_held();
    stopping.join().unwrap();
    assert!(keys(0..3).iter().all(|k| remote.contains(k) && disk.contains(k)));
    assert_eq!(s.status().l1.cached, 0, "L1 was handed down whole");
    s.stop(); // a second stop (as Drop does) finds nothing to do and returns
}

#[test]
fn cascade_victims_queued_behind_a_busy_pipeline_go_down_as_one_task() {
    // L1 of two slots over one tier: every store past the second evicts, and the cascade sends
    // each victim to the pipeline as a job of its own. A task per chunk costs a disk tier more
    // than the write, so the jobs that queued while the pipeline was busy go as one.
    let (below, open, entered) = GatedTier::shut("l2");
    let tiers: Vec<Arc<dyn TierAdapter>> = vec![below.clone()];
    // Watermarks of 1.0: no background eviction adds a victim while the test counts tasks.
    let l1 = L1Config { watermark: Watermark { high: 1.0, low: 1.0 }, ..l1_config(2) };
    let config = StorageConfig { store_policy: StorePolicy::Cascade, ..StorageConfig::new(l1) };
    let s = StorageManager::start_with_tiers(config, Arc::new(ManualClock::new()), tiers).unwrap();
    write(&s, &keys(0..2));
    write(&s, &keys(2..3));
    entered.recv_timeout(WAIT).unwrap(); // the first victim's task holds the pipeline
    for i in 3..9 {
        write(&s, &keys(i..i + 1));
    }
    open.send(()).unwrap();
    eventually("every victim is down", || keys(0..7).iter().all(|k| below.inner.contains(k)));
    assert_eq!(*below.tasks.lock(), vec![1, 6], "the six queued victims went as one task");
    eventually("the pipeline is idle", || s.status().store_in_flight == 0);
}

#[test]
fn h16_02_writers_wait_for_the_store_pipeline_when_l1_is_full_of_chunks_going_down() {
    let disk = Arc::new(FakeTier::new("disk", 64, CHUNK));
    disk.hold();
    let tiers: Vec<Arc<dyn TierAdapter>> = vec![disk.clone()];
    let s = Arc::new(
        StorageManager::start_with_tiers(
            StorageConfig {
                store_policy: StorePolicy::WriteThrough,
                store_backpressure: WAIT,
                ..StorageConfig::new(l1_config(4))
            },
            Arc::new(ManualClock::new()),
            tiers,
        )
        .unwrap(),
    );
    write(&s, &keys(0..4));
    eventually("the copies are in flight", || disk.held_tasks() == 1);
    // A writer that must not wait (one of the daemon's runtime threads) is refused at once.
    let started = Instant::now();
    let now = s.reserve_write_now(OWNER, &keys(4..6), &layout()).unwrap();
    assert!(now.iter().all(|r| r.as_ref().err() == Some(&tierkv_core::KeyError::OutOfMemory)));
    assert!(started.elapsed() < WAIT / 2, "it waited for the pipeline");
    // L1 is full of chunks the disk does not have yet: a writer waits instead of evicting them.
    let writer = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || s.reserve_write(OWNER, &keys(4..6), &layout()).unwrap())
    };
    disk.release_held();
    let reserved = writer.join().unwrap();
    assert!(reserved.iter().all(|r| r.is_ok()), "room once the copies finished: {reserved:?}");
    assert!(keys(0..4).iter().all(|k| disk.contains(k)), "the chunks reached the disk first");
}

#[test]
fn h16_02_past_the_backpressure_limit_a_full_l1_refuses_rather_than_dropping_a_chunk() {
    let disk = Arc::new(FakeTier::new("disk", 64, CHUNK));
    disk.hold();
    let tiers: Vec<Arc<dyn TierAdapter>> = vec![disk.clone()];
    let config = StorageConfig {
        store_policy: StorePolicy::WriteThrough,
        store_backpressure: Duration::ZERO,
        ..StorageConfig::new(l1_config(4))
    };
    let s = StorageManager::start_with_tiers(config, Arc::new(ManualClock::new()), tiers).unwrap();
    write(&s, &keys(0..4));
    let reserved = s.reserve_write(OWNER, &keys(4..5), &layout()).unwrap();
    assert_eq!(reserved[0].as_ref().err(), Some(&tierkv_core::KeyError::OutOfMemory));
    assert!(keys(0..4).iter().all(|k| shares(&s, k) == 1), "nothing was evicted");
    disk.release_held();
    eventually("every chunk is down", || keys(0..4).iter().all(|k| disk.contains(k)));
}

/// `tierkv_errors_total{tier="l1",reason="out_of_memory"}` counts what a store is refused, once
/// per refused key: not each try of a writer that waits for the store pipeline to free room in
/// L1 (every try counted each key still without room, though the store then got it all).
#[test]
fn a_store_that_waits_for_room_counts_only_the_keys_it_is_refused_in_the_end() {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let disk = Arc::new(FakeTier::new("disk", 64, CHUNK));
    disk.hold();
    let tiers: Vec<Arc<dyn TierAdapter>> = vec![disk.clone()];
    let config = StorageConfig {
        store_policy: StorePolicy::WriteThrough,
        store_backpressure: WAIT,
        ..StorageConfig::new(l1_config(4))
    };
    let s = metrics::with_local_recorder(&recorder, || {
        StorageManager::start_with_tiers(config, Arc::new(ManualClock::new()), tiers)
    })
    .unwrap();
    let s = Arc::new(s);
    write(&s, &keys(0..4));
    eventually("the copies are in flight", || disk.held_tasks() == 1);
    let out_of_memory = || common::l1_out_of_memory(&snapshotter.snapshot().into_vec());
    // Refused in the end: tried at once, and again at the deadline. Each key counts once.
    let soon = Instant::now() + Duration::from_millis(50);
    let refused = s.reserve_write_until(OWNER, &keys(4..6), &layout(), soon, || false).unwrap();
    assert!(refused.iter().all(|r| r.as_ref().err() == Some(&tierkv_core::KeyError::OutOfMemory)));
    assert_eq!(out_of_memory(), 2, "the refused keys, once each");
    let now = s.reserve_write_now(OWNER, &keys(4..5), &layout()).unwrap();
    assert_eq!(now[0].as_ref().err(), Some(&tierkv_core::KeyError::OutOfMemory));
    assert_eq!(out_of_memory(), 1, "a writer that may not wait is refused, and counted, at once");
    // Waits, then gets room: refused nothing, counted nothing. (The pause lets the writer try
    // and wait before the copies end; without it the test checks less, never wrongly.)
    let writer = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || s.reserve_write(OWNER, &keys(4..6), &layout()).unwrap())
    };
    std::thread::sleep(Duration::from_millis(100));
    disk.release_held();
    let reserved = writer.join().unwrap();
    assert!(reserved.iter().all(|r| r.is_ok()), "room once the copies finished: {reserved:?}");
    assert_eq!(out_of_memory(), 0, "a store that got room was counted as refused");
}

#[test]
fn a_store_into_an_l1_full_of_lookup_leases_is_refused_at_once_under_the_cascade() {
    // Under the cascade the store pipeline's jobs are L1's victims on their way down: copies of
    // their bytes, which hold no room in L1. A store that finds L1 full of chunks lookups hold
    // waits for none of them, since nothing the pipeline finishes makes room. The wait is
    // endless: a writer that waited for the pipeline would wait until the tier answered.
    let below = Arc::new(FakeTier::new("disk", 64, CHUNK));
    let tiers: Vec<Arc<dyn TierAdapter>> = vec![below.clone()];
    let l1 = L1Config { watermark: Watermark { high: 1.0, low: 1.0 }, ..l1_config(2) };
    let config = StorageConfig {
        store_policy: StorePolicy::Cascade,
        store_backpressure: Duration::MAX,
        ..StorageConfig::new(l1)
    };
    let s = Arc::new(
        StorageManager::start_with_tiers(config, Arc::new(ManualClock::new()), tiers).unwrap(),
    );
    below.hold();
    write(&s, &keys(0..2));
    write(&s, &keys(2..3)); // evicts a chunk: its copy goes down, and the tier holds it
    eventually("the victim's store is held", || below.held_tasks() == 1);
    assert_eq!(s.status().store_in_flight, 1, "the pipeline is busy with the victim");
    let (kept, victim): (Vec<ObjectKey>, Vec<ObjectKey>) = keys(0..3)
        .into_iter()
        .partition(|k| matches!(s.l1().presence(k), tierkv_l1::Presence::Ready { .. }));
    let id = s.submit_prefetch(OWNER, kept, ExtraCount::ZERO, layout()).unwrap();
    assert_eq!(s.wait(id, WAIT).unwrap().hit_chunks, 2, "the lookup holds all of L1");
    assert!(!s.store_may_wait(), "nothing on its way down holds room in L1");
    let (answer, answered) = mpsc::channel();
    let writer = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || {
            let _ = answer.send(s.reserve_write(OWNER, &keys(3..4), &layout()).unwrap());
        })
    };
    let reserved =
        answered.recv_timeout(WAIT).expect("the writer waited for a copy that frees no room in L1");
    assert_eq!(reserved[0].as_ref().err(), Some(&tierkv_core::KeyError::OutOfMemory));
    assert_eq!(below.held_tasks(), 1, "answered while the victim's copy was still held");
    below.release_held();
    writer.join().unwrap();
    eventually("the victim is down", || below.contains(&victim[0]));
    s.release_all(id).unwrap();
}

fn lookup_rig(slots: u64) -> (StorageManager, Arc<FakeTier>, Arc<ManualClock>) {
    let l2 = Arc::new(FakeTier::new("l2", 64, CHUNK));
    let tiers: Vec<Arc<dyn TierAdapter>> = vec![l2.clone()];
    let clock = Arc::new(ManualClock::new());
    let config = StorageConfig {
        l1: L1Config { lease_ttl: Duration::from_secs(30), ..l1_config(slots) },
        maintenance_interval: Duration::from_millis(5),
        store_policy: StorePolicy::WriteThrough,
        ..StorageConfig::new(l1_config(slots))
    };
    let s = StorageManager::start_with_tiers(config, clock.clone(), tiers).unwrap();
    (s, l2, clock)
}

#[test]
fn h16_10_every_reader_of_an_empty_hit_returns_its_share_without_an_error() {
    let (s, ..) = lookup_rig(8);
    let id = s.submit_prefetch(OWNER, keys(0..3), ExtraCount::new(2).unwrap(), layout()).unwrap();
    let result = s.wait(id, WAIT).unwrap();
    assert_eq!((result.hit_chunks, result.readers), (0, 3));
    assert!(!s.release(id, Readers::One(0)).unwrap());
    assert!(!s.release(id, Readers::One(2)).unwrap());
    assert!(matches!(
        s.release(id, Readers::One(2)),
        Err(StorageError::ShareReturned { reader: 2, .. })
    ));
    assert!(matches!(s.release(id, Readers::One(3)), Err(StorageError::NoSuchReader { .. })));
    assert!(s.release(id, Readers::One(1)).unwrap(), "the last reader ends it");
    assert!(!s.is_open(id));
}

#[test]
fn h16_11_a_wait_that_claims_the_outcome_of_an_abandoned_lookup_settles_its_lease() {
    let (s, l2, _clock) = lookup_rig(8);
    for k in keys(0..3) {
        l2.insert(k, payload(&k, CHUNK));
    }
    l2.hold_loads();
    let s = Arc::new(s);
    let id = s.submit_prefetch(OWNER, keys(0..3), ExtraCount::ZERO, layout()).unwrap();
    eventually("the load is in flight", || l2.held_tasks() == 1);
    let waiter = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || s.wait(id, WAIT))
    };
    // Let the waiter block on the prefetch, then abandon the lookup under it.
    std::thread::sleep(Duration::from_millis(50));
    s.release_all(id).unwrap();
    l2.release_held();
    let waited = waiter.join().unwrap();
    assert!(matches!(waited, Err(StorageError::UnknownLookup(_))), "{waited:?}");
    // Whoever claimed the outcome settled it: no share is left, with no clock movement.
    eventually("the promoted chunks are unleased", || s.l1().usage().leased == 0);
}

#[test]
fn h16_12_a_refused_release_changes_nothing() {
    let (s, l2, clock) = lookup_rig(8);
    // k0 in L1 (leased at submit), k1 only below (leased by the prefetch, later).
    write(&s, &keys(0..1));
    eventually("k0's copy share is back", || shares(&s, &key(0)) == 0);
    l2.insert(key(1), payload(&key(1), CHUNK));
    // The leases sit in a hash map: try several lookups, so an order-dependent partial
    // release cannot hide.
    for _ in 0..8 {
        l2.hold_loads();
        let id =
            s.submit_prefetch(OWNER, keys(0..2), ExtraCount::new(1).unwrap(), layout()).unwrap();
        eventually("the load is in flight", || l2.held_tasks() == 1);
        // The prefetch's lease is taken 20 s after the L1 lease: it expires 20 s later.
        clock.advance(Duration::from_secs(20));
        l2.release_held();
        assert_eq!(s.wait(id, WAIT).unwrap().hit_chunks, 2);
        assert_eq!((shares(&s, &key(0)), shares(&s, &key(1))), (2, 2));
        clock.advance(Duration::from_secs(15));
        // The L1 lease is past its deadline, the prefetch's is not.
        assert!(s.release(id, Readers::One(0)).is_err());
        assert_eq!(shares(&s, &key(1)), 2, "a refused release returned a prefetched share");
        s.release_all(id).unwrap();
        // Promoted for this lookup alone: freed with its last share (or unleased, then deleted).
        s.l1().delete(&keys(1..2), false);
        assert_eq!(s.l1().presence(&key(1)), tierkv_l1::Presence::Absent);
        assert_eq!(shares(&s, &key(0)), 0, "k0 stays in L1, unleased, for the next round");
    }
}

#[test]
fn h16_13_an_l1_lease_that_expires_while_the_prefetch_loads_is_not_counted_as_a_hit() {
    let (s, l2, clock) = lookup_rig(8);
    write(&s, &keys(0..1));
    eventually("k0's copy share is back", || shares(&s, &key(0)) == 0);
    l2.insert(key(1), payload(&key(1), CHUNK));
    l2.hold_loads();
    let id = s.submit_prefetch(OWNER, keys(0..2), ExtraCount::ZERO, layout()).unwrap();
    assert_eq!(s.l1_hit(id).unwrap(), 1);
    eventually("the load is in flight", || l2.held_tasks() == 1);
    // The L1 lease passes its deadline while k1 loads.
    clock.advance(Duration::from_secs(31));
    s.l1().expire_leases();
    l2.release_held();
    let result = s.wait(id, WAIT).unwrap();
    assert_eq!(result.hit_chunks, 0, "k0's share is gone, so there is no prefix hit");
    assert_eq!(result.per_tier.iter().sum::<usize>(), 0);
    assert_eq!(s.l1().usage().leased, 0, "the loaded k1 is not held for a hit without it");
}

#[test]
fn h16_14_a_hybrid_lookup_never_counts_more_hit_tokens_than_requested() {
    let (s, ..) = lookup_rig(32);
    let group = |g: u16| -> Vec<ObjectKey> {
        keys(100 * u64::from(g)..100 * u64::from(g) + 4)
            .into_iter()
            .map(|k| ObjectKey { group: tierkv_core::GroupId(g), ..k })
            .collect()
    };
    let (full, window) = (group(0), group(1));
    write(&s, &full);
    write(&s, &window);
    let request = LookupRequest {
        owner: OWNER,
        extra: ExtraCount::ZERO,
        chunk_tokens: 256,
        groups: vec![
            LookupGroup { kind: GroupKind::FullAttention, layout: layout(), keys: full },
            LookupGroup {
                kind: GroupKind::SlidingWindow { window_tokens: 512 },
                layout: layout(),
                keys: window,
            },
        ],
        max_promoted: usize::MAX,
        defer_prefetch: false,
    };
    let id = s.submit_lookup(request).unwrap();
    let result = s.wait(id, WAIT).unwrap();
    assert_eq!((result.hit_chunks, result.hit_tokens), (4, 1024));
    assert_eq!(result.per_tier, vec![4, 0], "one count per chunk position, not per group");
    let totals = s.status().lookups;
    assert_eq!(totals.requested_tokens, 1024);
    assert!(
        totals.hit_tokens.iter().sum::<u64>() <= totals.requested_tokens,
        "hit {:?} of {} tokens",
        totals.hit_tokens,
        totals.requested_tokens
    );
}

#[test]
fn h16_15_a_complete_lookup_whose_leases_all_expired_is_forgotten() {
    let (s, _l2, clock) = lookup_rig(8);
    write(&s, &keys(0..2));
    eventually("the copy shares are back", || keys(0..2).iter().all(|k| shares(&s, k) == 0));
    let id = s.submit_prefetch(OWNER, keys(0..2), ExtraCount::ZERO, layout()).unwrap();
    assert_eq!(s.wait(id, WAIT).unwrap().hit_chunks, 2);
    assert_eq!(s.held_chunks(id), Some(2));
    // Its owner never releases it; once its lease is past the deadline it holds nothing, and the
    // maintenance tick forgets it instead of keeping it for the session's lifetime.
    clock.advance(Duration::from_secs(31));
    eventually("the lookup is forgotten", || !s.is_open(id));
    assert_eq!(s.status().open_lookups, 0);
    assert_eq!(s.held_chunks(id), None);
}

#[test]
fn h16_15_a_lookup_past_its_deadline_holds_nothing_before_the_tick_forgets_it() {
    // No maintenance tick during the test: only the deadline can make the lookups hold nothing.
    let l2 = Arc::new(FakeTier::new("l2", 64, CHUNK));
    let tiers: Vec<Arc<dyn TierAdapter>> = vec![l2.clone()];
    let clock = Arc::new(ManualClock::new());
    let config = StorageConfig {
        l1: L1Config { lease_ttl: Duration::from_secs(30), ..l1_config(8) },
        maintenance_interval: Duration::from_secs(3600),
        store_policy: StorePolicy::WriteThrough,
        ..StorageConfig::new(l1_config(8))
    };
    let s = StorageManager::start_with_tiers(config, clock.clone(), tiers).unwrap();
    write(&s, &keys(0..2));
    eventually("the copy shares are back", || keys(0..2).iter().all(|k| shares(&s, k) == 0));
    let in_l1 = s.submit_prefetch(OWNER, keys(0..2), ExtraCount::ZERO, layout()).unwrap();
    assert_eq!(s.wait(in_l1, WAIT).unwrap().hit_chunks, 2);
    for k in keys(10..13) {
        l2.insert(k, payload(&k, CHUNK));
    }
    let mut request = LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout(), keys(10..13));
    request.max_promoted = 0;
    let below = s.submit_lookup(request).unwrap();
    assert_eq!(s.wait(below, WAIT).unwrap().hit_chunks, 3);
    assert_eq!((s.held_chunks(in_l1), s.held_chunks(below)), (Some(2), Some(3)));
    // Past the deadline both are still open (the tick has not run), and hold nothing: a
    // session's allowance does not count them.
    clock.advance(Duration::from_secs(31));
    assert_eq!((s.held_chunks(in_l1), s.held_chunks(below)), (Some(0), Some(0)));
}

#[test]
fn h16_16_a_hit_held_below_l1_that_nobody_asks_for_returns_its_tier_locks_at_its_deadline() {
    let (s, l2, clock) = lookup_rig(8);
    for k in keys(0..3) {
        l2.insert(k, payload(&k, CHUNK));
    }
    // No allowance of L1 slots: the whole hit stays in L2, under the prefetch's tier locks.
    let mut request = LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout(), keys(0..3));
    request.max_promoted = 0;
    let id = s.submit_lookup(request).unwrap();
    eventually("the hit is held in L2", || l2.usage().locks == 3);
    // Its owner never asks for the outcome, nor releases it. The clock moves past the lease
    // deadline at every look, so whenever the lookup's clock starts, it runs out.
    eventually("the tier locks are returned", || {
        clock.advance(Duration::from_secs(31));
        l2.usage().locks == 0
    });
    assert!(!s.is_open(id), "the lookup is forgotten with its locks");
    assert!(matches!(s.query(id), Err(StorageError::UnknownLookup(_))));
}

#[test]
fn a_lookup_not_complete_yet_may_still_be_read_below_l1() {
    // The daemon decides before a retrieve whether it may wait on a tier (and moves it off the
    // runtime's threads). A lookup still prefetching may complete, the maintenance tick
    // included, with chunks held below L1 before the retrieve reads: it must count as one that
    // may read below, not as one held in L1.
    let (s, l2, _clock) = lookup_rig(8);
    write(&s, &keys(0..2));
    eventually("the copy shares are back", || keys(0..2).iter().all(|k| shares(&s, k) == 0));
    let in_l1 = s.submit_prefetch(OWNER, keys(0..2), ExtraCount::ZERO, layout()).unwrap();
    assert_eq!(s.wait(in_l1, WAIT).unwrap().hit_chunks, 2);
    assert!(!s.may_read_below(in_l1), "held in L1 alone");
    for k in keys(10..13) {
        l2.insert(k, payload(&k, CHUNK));
    }
    l2.hold();
    let mut request = LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout(), keys(10..13));
    request.max_promoted = 0;
    let below = s.submit_lookup(request).unwrap();
    eventually("the lookup waits on L2", || l2.held_tasks() == 1);
    assert_eq!(l2.usage().locks, 0, "nothing is held below yet");
    assert!(s.may_read_below(below), "but it may be by the time a read comes");
    l2.release_held();
    assert_eq!(s.wait(below, WAIT).unwrap().hit_chunks, 3);
    assert_eq!(l2.usage().locks, 3, "the hit is held below L1");
    assert!(s.may_read_below(below));
    assert!(!s.may_read_below(LookupId(u64::MAX)), "an unknown lookup reads nothing");
}

#[test]
fn a_store_a_lower_tier_never_answers_is_given_up_not_durable_and_its_shares_return() {
    // A hung disk write: without a limit the chunks stayed pinned by the pipeline for good,
    // every flush of the writer timed out, and writers waited for room that never came.
    let disk = Arc::new(FakeTier::new("disk", 64, CHUNK));
    disk.hold();
    let tiers: Vec<Arc<dyn TierAdapter>> = vec![disk.clone()];
    let config = StorageConfig {
        store_policy: StorePolicy::WriteThrough,
        store_timeout: Duration::from_millis(200),
        ..StorageConfig::new(l1_config(8))
    };
    let s = StorageManager::start_with_tiers(config, Arc::new(ManualClock::new()), tiers).unwrap();
    let ticket = write(&s, &keys(0..2));
    eventually("the copy is in flight", || disk.held_tasks() == 1);
    let outcome = ticket.wait_until(Instant::now() + WAIT).expect("the ticket never settled");
    assert_eq!((outcome.durable, outcome.not_durable), (0, 2));
    assert!(keys(0..2).iter().all(|k| shares(&s, k) == 0), "the pipeline's shares came back");
    assert_eq!(s.status().store_in_flight, 0);
    // The disk is told (what it has not started need not be), and its late answer, the task
    // failed as abandoned, changes nothing above (no share returned twice).
    eventually("the task was given up on at the disk", || disk.abandoned().len() == 1);
    assert_eq!(disk.held_tasks(), 0);
    assert!(keys(0..2).iter().all(|k| !disk.contains(k)));
    disk.release_held();
    let later = write(&s, &keys(2..4));
    let outcome = later.wait_until(Instant::now() + WAIT).expect("the ticket never settled");
    assert_eq!((outcome.durable, outcome.not_durable), (2, 0), "the disk works on");
    assert!(keys(0..4).iter().all(|k| shares(&s, k) == 0));
    s.l1().audit().unwrap();
}

/// How far the deadline of a store waiting for room lies in the tests below: a store that
/// returns before it was answered by what freed the room (or by its client giving up), not by
/// the deadline.
const FAR: Duration = Duration::from_secs(30);

/// A write-through node whose L1 of four chunks is full: two held by a lookup (returned), two
/// by copies the disk holds (so a store waits for room).
fn full_of_a_lookup_and_copies_held() -> (Arc<StorageManager>, LookupId, Arc<FakeTier>) {
    let disk = Arc::new(FakeTier::new("disk", 64, CHUNK));
    let tiers: Vec<Arc<dyn TierAdapter>> = vec![disk.clone()];
    let l1 = L1Config { watermark: Watermark { high: 1.0, low: 1.0 }, ..l1_config(4) };
    let config = StorageConfig {
        store_policy: StorePolicy::WriteThrough,
        store_backpressure: FAR,
        ..StorageConfig::new(l1)
    };
    let s = Arc::new(
        StorageManager::start_with_tiers(config, Arc::new(ManualClock::new()), tiers).unwrap(),
    );
    write(&s, &keys(0..2));
    eventually("the first copies are down", || s.status().store_in_flight == 0);
    let lookup = s.submit_prefetch(OWNER, keys(0..2), ExtraCount::ZERO, layout()).unwrap();
    assert_eq!(s.wait(lookup, WAIT).unwrap().hit_chunks, 2);
    disk.hold();
    write(&s, &keys(2..4));
    eventually("the copies are held", || disk.held_tasks() == 1);
    assert!(s.store_may_wait());
    (s, lookup, disk)
}

/// What a store reserved, and when it answered.
type Answered = (Vec<Result<tierkv_l1::SlotHandle, tierkv_core::KeyError>>, Instant);

/// A store of keys 4 and 5 on a thread of its own, with `deadline` and `gave_up`, returned once
/// it waits for room in L1.
fn store_waiting(
    s: &Arc<StorageManager>,
    deadline: Instant,
    gave_up: impl Fn() -> bool + Send + 'static,
) -> std::thread::JoinHandle<Answered> {
    let writer = {
        let s = Arc::clone(s);
        std::thread::spawn(move || {
            let reserved = s.reserve_write_until(OWNER, &keys(4..6), &layout(), deadline, gave_up);
            (reserved.unwrap(), Instant::now())
        })
    };
    eventually("the store waits for room", || s.l1().room_watchers() == 1);
    writer
}

/// A store waiting for room (L1 full of chunks a lookup holds and chunks still being copied
/// down) gets it as soon as the lookup is released, not when the copies end or its deadline
/// passes: the release wakes it.
#[test]
fn a_store_waiting_for_room_gets_it_when_a_lookup_is_released() {
    let (s, lookup, disk) = full_of_a_lookup_and_copies_held();
    let deadline = Instant::now() + FAR;
    let writer = store_waiting(&s, deadline, || false);
    s.release_all(lookup).unwrap();
    let (reserved, answered) = writer.join().unwrap();
    assert!(answered < deadline, "the store waited out its deadline");
    assert!(reserved.iter().all(|r| r.is_ok()), "{reserved:?}");
    assert_eq!(disk.held_tasks(), 1, "the room came before the copies ended");
    disk.release_held();
}

/// A store waiting for room whose client gives up stops waiting then, and holds nothing:
/// the keys without room are refused, and the caller (which asks again) aborts the rest.
#[test]
fn a_store_waiting_for_room_stops_when_its_client_gives_up() {
    let (s, lookup, disk) = full_of_a_lookup_and_copies_held();
    let gave_up = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let deadline = Instant::now() + FAR;
    let asked = Arc::clone(&gave_up);
    let writer =
        store_waiting(&s, deadline, move || asked.load(std::sync::atomic::Ordering::Acquire));
    gave_up.store(true, std::sync::atomic::Ordering::Release);
    let (reserved, answered) = writer.join().unwrap();
    assert!(answered < deadline, "the store waited out its deadline");
    assert!(reserved.iter().all(|r| r.as_ref().err() == Some(&tierkv_core::KeyError::OutOfMemory)));
    assert_eq!(s.l1().room_watchers(), 0);
    s.release_all(lookup).unwrap();
    disk.release_held();
}

/// A store that finds L1 full of chunks lookups hold, while the pipeline's copies hold the rest,
/// waits; once the last copy is over with the lookups still holding, it stops waiting at once
/// (nothing the pipeline does can free room any more), not at its deadline.
#[test]
fn a_store_waiting_for_room_stops_once_no_copy_holds_room_and_lookups_hold_the_rest() {
    let (s, lookup, disk) = full_of_a_lookup_and_copies_held();
    // The chunks being copied are leased by a lookup too: the copies' end frees no room.
    let held = s.submit_prefetch(OWNER, keys(2..4), ExtraCount::ZERO, layout()).unwrap();
    assert_eq!(s.wait(held, WAIT).unwrap().hit_chunks, 2);
    let deadline = Instant::now() + FAR;
    let writer = store_waiting(&s, deadline, || false);
    disk.release_held();
    let (reserved, answered) = writer.join().unwrap();
    assert!(answered < deadline, "the store waited out its deadline");
    assert!(reserved.iter().all(|r| r.as_ref().err() == Some(&tierkv_core::KeyError::OutOfMemory)));
    s.release_all(lookup).unwrap();
    s.release_all(held).unwrap();
}
