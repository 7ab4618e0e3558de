//! CONFORMANCE E: the StorageManager, one test per id, with the real L1, HostStore and DiskStore
//! (the fault-injecting fake only for E10, which needs a copy held in flight).

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tierkv_core::{Clock, ExtraCount, ManualClock, ObjectKey, SystemClock, TierAdapter};
use tierkv_disk::{BLOCK, DiskStoreConfig, record_bytes};
use tierkv_l1::{Presence, Readers};
use tierkv_l2::{HostMemory, HostStoreConfig};
use tierkv_storage::{
    GroupKind, LookupGroup, LookupId, LookupRequest, LookupResult, StorageConfig, StorageError,
    StorageManager, StorePolicy,
};
use tierkv_testkit::FakeTier;
use tierkv_testkit::contract::{key, keys, payload};

use common::{CHUNK, OWNER, WAIT, l1_config, layout};
use tierkv_l1::{L1Config, OwnerId, Watermark};

struct Rig {
    s: StorageManager,
    _dir: tempfile::TempDir,
}

/// L1 of `slots` slots, an L2 of 64 chunks, and (if `disk`) a disk tier; write-through.
fn rig(slots: u64, disk: bool) -> Rig {
    rig_with(l1_config(slots), disk, Arc::new(SystemClock::new()))
}

/// [`rig`] with the L1 of `l1`, its deadlines measured on `clock`.
fn rig_with(l1: L1Config, disk: bool, clock: Arc<dyn Clock>) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let segment_bytes = BLOCK + 8 * record_bytes(CHUNK);
    let config = StorageConfig {
        l2: Some(HostStoreConfig {
            memory: HostMemory::Plain,
            ..HostStoreConfig::new(64 * CHUNK, CHUNK)
        }),
        disk: disk.then(|| DiskStoreConfig {
            segment_bytes,
            ..DiskStoreConfig::new(dir.path(), 16 * segment_bytes, CHUNK)
        }),
        store_policy: StorePolicy::WriteThrough,
        ..StorageConfig::new(l1)
    };
    Rig { s: StorageManager::start_with_clock(config, clock).unwrap(), _dir: dir }
}

impl Rig {
    /// Writes `keys` and waits until the store pipeline has copied them to L2 and returned its
    /// shares, so share counts seen afterwards are the lookups' alone.
    fn write(&self, keys: &[ObjectKey]) {
        let before = self.s.status().tiers[0].1.objects;
        self.write_unsettled(keys);
        let deadline = Instant::now() + WAIT;
        loop {
            let status = self.s.status();
            let copied = status.tiers[0].1.objects >= before + keys.len() as u64;
            if copied && status.store_in_flight == 0 && keys.iter().all(|k| self.shares(k) == 0) {
                return;
            }
            assert!(Instant::now() < deadline, "the store pipeline never settled: {status:?}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn write_unsettled(&self, keys: &[ObjectKey]) {
        let reserved = self.s.reserve_write(OWNER, keys, &layout()).unwrap();
        assert!(reserved.iter().all(|r| r.is_ok()), "{reserved:?}");
        for k in keys {
            self.s.write_access(OWNER, k).unwrap().write_at(0, &payload(k, CHUNK)).unwrap();
        }
        assert!(self.s.finish_write(OWNER, keys).unwrap().iter().all(|r| r.is_ok()));
    }

    /// Waits until lower tier `tier` holds `n` objects and no copy is in flight.
    fn settle(&self, tier: usize, n: u64) {
        let deadline = Instant::now() + WAIT;
        loop {
            let status = self.s.status();
            if status.store_in_flight == 0 && status.tiers[tier].1.objects == n {
                return;
            }
            assert!(Instant::now() < deadline, "tier {tier} never held {n} objects: {status:?}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn lookup(&self, keys: Vec<ObjectKey>, extra: i64) -> (LookupId, LookupResult) {
        let id =
            self.s.submit_prefetch(OWNER, keys, ExtraCount::new(extra).unwrap(), layout()).unwrap();
        (id, self.s.wait(id, WAIT).unwrap())
    }

    fn bytes(&self, id: LookupId, reader: u8, key: &ObjectKey) -> Vec<u8> {
        let guard = self.s.read(id, reader, key).unwrap();
        let mut bytes = vec![0; CHUNK as usize];
        guard.read_at(0, &mut bytes).unwrap();
        bytes
    }

    fn shares(&self, key: &ObjectKey) -> u64 {
        match self.s.l1().presence(key) {
            Presence::Ready { shares, .. } => shares,
            _ => 0,
        }
    }
}

#[test]
fn e1_written_keys_are_hits_at_once_without_the_prefetch_pipeline() {
    let rig = rig(16, false);
    rig.write(&keys(0..5));
    let id = rig.s.submit_prefetch(OWNER, keys(0..5), ExtraCount::ZERO, layout()).unwrap();
    let result = rig.s.query(id).unwrap().expect("an all-L1 hit completes within submit");
    assert_eq!((result.hit_chunks, result.per_tier.clone()), (5, vec![5, 0]), "[l1, l2]");
    assert!(keys(0..5).iter().all(|k| rig.shares(k) == 1));
}

#[test]
fn e2_a_gap_trims_the_hit_and_the_keys_past_it_keep_no_shares() {
    let rig = rig(16, false);
    rig.write(&[key(0), key(1), key(3), key(4)]);
    let (_, result) = rig.lookup(keys(0..5), 0);
    assert_eq!(result.hit_chunks, 2);
    assert_eq!((rig.shares(&key(0)), rig.shares(&key(1))), (1, 1));
    assert_eq!(
        (rig.shares(&key(3)), rig.shares(&key(4))),
        (0, 0),
        "shares past the gap were returned"
    );
}

#[test]
fn e3_read_the_prefetched_buffers_then_release_everything() {
    let rig = rig(16, false);
    rig.write(&keys(0..3));
    let (id, result) = rig.lookup(keys(0..3), 0);
    assert_eq!(result.hit_chunks, 3);
    for k in keys(0..3) {
        assert_eq!(rig.bytes(id, 0, &k), payload(&k, CHUNK));
    }
    rig.s.release(id, Readers::One(0)).unwrap();
    assert!(keys(0..3).iter().all(|k| rig.shares(k) == 0));
    assert!(matches!(rig.s.release(id, Readers::One(0)), Err(StorageError::UnknownLookup(_))));
    rig.s.l1().audit().unwrap();
}

#[test]
fn e4_reading_a_key_the_lookup_does_not_cover_is_an_error_and_changes_nothing() {
    let rig = rig(16, false);
    rig.write(&keys(0..2));
    let (id, result) = rig.lookup(keys(0..3), 0);
    assert_eq!(result.hit_chunks, 2);
    for outside in [key(2), key(9)] {
        assert!(matches!(rig.s.read(id, 0, &outside), Err(StorageError::NotCovered { .. })));
    }
    assert!(
        matches!(rig.s.read(id, 1, &key(0)), Err(StorageError::L1(_))),
        "reader 1 does not exist"
    );
    assert_eq!((rig.shares(&key(0)), rig.shares(&key(1))), (1, 1), "no share moved");
    rig.s.release(id, Readers::One(0)).unwrap();
    assert_eq!(rig.shares(&key(0)), 0);
}

#[test]
fn e5_extra_count_two_releases_three_shares_in_any_mix() {
    let rig = rig(16, false);
    rig.write(&keys(0..2));
    for mix in [
        vec![Readers::All],
        vec![Readers::One(0), Readers::Set(0b110)],
        vec![Readers::One(2), Readers::One(0), Readers::One(1)],
    ] {
        let (id, _) = rig.lookup(keys(0..2), 2);
        assert_eq!(rig.shares(&key(0)), 3);
        for (n, readers) in mix.iter().enumerate() {
            rig.s.release(id, *readers).unwrap();
            let left = rig.shares(&key(0));
            assert_eq!(
                left == 0,
                n + 1 == mix.len(),
                "{mix:?} after {} releases left {left}",
                n + 1
            );
        }
    }
}

#[test]
fn e6_after_clearing_l1_the_chunks_come_back_from_l2() {
    let rig = rig(16, false);
    rig.write(&keys(0..5));
    rig.settle(0, 5);
    assert_eq!(rig.s.clear_l1(false).removed, 5);
    let (id, result) = rig.lookup(keys(0..5), 0);
    assert_eq!((result.hit_chunks, result.per_tier.clone()), (5, vec![0, 5]));
    for k in keys(0..5) {
        assert_eq!(rig.bytes(id, 0, &k), payload(&k, CHUNK));
    }
}

#[test]
fn e7_a_hit_combines_l1_and_l2() {
    let rig = rig(16, false);
    rig.write(&keys(0..5));
    rig.settle(0, 5);
    rig.s.l1().delete(&keys(2..5), false);
    let (id, result) = rig.lookup(keys(0..5), 0);
    assert_eq!((result.hit_chunks, result.per_tier.clone()), (5, vec![2, 3]));
    for k in keys(0..5) {
        assert_eq!(rig.bytes(id, 0, &k), payload(&k, CHUNK));
    }
}

#[test]
fn e8_l2_alone_with_a_gap_and_l1_plus_l2_in_full() {
    let gap = rig(16, false);
    gap.write(&[key(0), key(1), key(3), key(4)]);
    gap.settle(0, 4);
    assert_eq!(gap.s.clear_l1(false).removed, 4, "L1 empty");
    let found = gap.lookup(keys(0..5), 0).1;
    assert_eq!((found.hit_chunks, found.per_tier), (2, vec![0, 2]), "both from L2");

    let both = rig(16, false);
    both.write(&keys(0..5));
    both.settle(0, 5);
    both.s.l1().delete(&keys(2..5), false);
    let found = both.lookup(keys(0..5), 0).1;
    assert_eq!((found.hit_chunks, found.per_tier), (5, vec![2, 3]), "k0, k1 from L1");
}

#[test]
fn e9_with_l1_and_l2_cleared_the_disk_serves_all() {
    let rig = rig(16, true);
    rig.write(&keys(0..5));
    rig.settle(0, 5);
    rig.settle(1, 5);
    rig.s.clear_l1(false);
    assert_eq!(rig.s.clear_tier(0), Some(5));
    let (id, result) = rig.lookup(keys(0..5), 0);
    assert_eq!((result.hit_chunks, result.per_tier.clone()), (5, vec![0, 0, 5]));
    for k in keys(0..5) {
        assert_eq!(rig.bytes(id, 0, &k), payload(&k, CHUNK));
    }
}

#[test]
fn e10_the_store_pipeline_holds_one_share_per_key_until_every_target_finished() {
    let l2 = Arc::new(FakeTier::new("l2", 64, CHUNK));
    let disk = Arc::new(FakeTier::new("disk", 64, CHUNK));
    disk.hold();
    let tiers: Vec<Arc<dyn TierAdapter>> = vec![l2.clone(), disk.clone()];
    let s = StorageManager::start_with_tiers(
        StorageConfig {
            store_policy: StorePolicy::WriteThrough,
            ..StorageConfig::new(l1_config(16))
        },
        Arc::new(ManualClock::new()),
        tiers,
    )
    .unwrap();
    let rig = Rig { s, _dir: tempfile::tempdir().unwrap() };
    rig.write_unsettled(&keys(0..3));
    let deadline = Instant::now() + WAIT;
    while !(l2.contains(&key(2)) && disk.held_tasks() == 1) {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    // L2 is done, the disk is not: the share is still held.
    assert!(
        keys(0..3).iter().all(|k| rig.shares(k) == 1),
        "a share was returned before every target finished"
    );
    disk.release_held();
    while keys(0..3).iter().any(|k| rig.shares(k) != 0) {
        assert!(Instant::now() < deadline, "the share was never returned");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(keys(0..3).iter().all(|k| disk.contains(k)));
}

#[test]
fn e11_a_prefetch_promotion_is_not_stored_again() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rig = metrics::with_local_recorder(&recorder, || rig(16, false));
    rig.write(&keys(0..4));
    rig.settle(0, 4);
    rig.s.clear_l1(false);
    let (id, result) = rig.lookup(keys(0..4), 0);
    assert_eq!(result.per_tier, vec![0, 4], "promoted from L2");
    rig.s.release(id, Readers::All).unwrap();
    // A store of the promotion would have been submitted by now (finishing it is what would
    // submit one): once the pipeline is idle, it would have been counted.
    tierkv_testkit::eventually("the store pipeline is idle", || {
        rig.s.status().store_in_flight == 0
    });
    let stored: u64 = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, ..)| k.key().name() == "tierkv_store_chunks_total")
        .map(|(.., v)| if let DebugValue::Counter(n) = v { n } else { 0 })
        .sum();
    assert_eq!(stored, 4, "only the four written chunks were stored; the promotion was not");
    assert_eq!(rig.s.status().store_in_flight, 0);
}

#[test]
fn e12_hybrid_groups_lease_every_l1_hit_before_a_load_evicts() {
    // Two groups of six chunks of 256 tokens: full attention, and a sliding window of 2 chunks.
    let rig = rig(8, false);
    let group = |g: u16| -> Vec<ObjectKey> {
        keys(100 * u64::from(g)..100 * u64::from(g) + 6)
            .into_iter()
            .map(|k| ObjectKey { group: tierkv_core::GroupId(g), ..k })
            .collect()
    };
    let (full, window) = (group(0), group(1));
    // The last chunk of each group is only in L2.
    rig.write(&[full[5], window[5]]);
    rig.settle(0, 2);
    rig.s.l1().delete(&[full[5], window[5]], false);
    // L1 holds the rest of the hit (written first: least recently used) and two fillers:
    // full. A load needs two slots and must evict.
    rig.write(&full[..5]);
    rig.write(&[window[4]]);
    rig.write(&keys(900..902));
    assert_eq!(rig.s.l1().usage().free_bytes, 0);
    let request = LookupRequest {
        owner: OWNER,
        extra: ExtraCount::ZERO,
        chunk_tokens: 256,
        groups: vec![
            LookupGroup { kind: GroupKind::FullAttention, layout: layout(), keys: full.clone() },
            LookupGroup {
                kind: GroupKind::SlidingWindow { window_tokens: 512 },
                layout: layout(),
                keys: window.clone(),
            },
        ],
        max_promoted: usize::MAX,
        defer_prefetch: false,
    };
    let id = rig.s.submit_lookup(request).unwrap();
    let result = rig.s.wait(id, WAIT).unwrap();
    assert_eq!((result.hit_chunks, result.hit_tokens), (6, 1536));
    // Per chunk position, the slowest tier a group needed it from: positions 0-4 came from L1
    // (both groups), position 5 from L2 (both groups). It adds up to the hit (H16 #14).
    assert_eq!(result.per_tier, vec![5, 1], "five positions from L1, the last loaded");
    for k in full.iter().chain(&window[4..]) {
        assert_eq!(rig.bytes(id, 0, k), payload(k, CHUNK));
    }
    assert!(
        keys(900..902).iter().all(|k| rig.s.l1().presence(k) == Presence::Absent),
        "the fillers made room"
    );
    rig.s.release(id, Readers::All).unwrap();
    rig.s.l1().audit().unwrap();
}

/// The lookups of one request on two TP ranks without MLA: each rank its own copy of the KV
/// (`keys(0..3)` rank 0's, `keys(10..13)` rank 1's), made by its own owner. The first two chunks
/// of each are in L1, rank 1's least recently used, with no room left; the third is in L2 only.
/// Returns each rank's result, the lookups made one after the other (`deferred`: both made,
/// deferred, before either starts).
fn two_ranks_look_up(deferred: bool) -> [LookupResult; 2] {
    // No background eviction: only the lookups' loads make room.
    let full = Watermark { high: 1.0, low: 1.0 };
    let rig =
        rig_with(L1Config { watermark: full, ..l1_config(4) }, false, Arc::new(SystemClock::new()));
    let (rank0, rank1) = (keys(0..3), keys(10..13));
    rig.write(&[rank0[2], rank1[2]]);
    rig.settle(0, 2);
    rig.s.l1().delete(&[rank0[2], rank1[2]], false);
    rig.write(&rank1[..2]);
    rig.write(&rank0[..2]);
    assert_eq!(rig.s.l1().usage().free_bytes, 0);
    let owners = [OWNER, OwnerId(OWNER.0 + 1)];
    let request = |rank: usize, keys: &[ObjectKey]| LookupRequest {
        defer_prefetch: deferred,
        ..LookupRequest::prefix(owners[rank], ExtraCount::ZERO, layout(), keys.to_vec())
    };
    let results = if deferred {
        let first = rig.s.submit_lookup(request(0, &rank0)).unwrap();
        // Time for a prefetch to run, were it started: a deferred one is not.
        std::thread::sleep(Duration::from_millis(50));
        assert_ne!(rig.s.l1().presence(&rank1[0]), Presence::Absent, "nothing was loaded");
        let second = rig.s.submit_lookup(request(1, &rank1)).unwrap();
        // Rank 0's lookup runs to its end before rank 1's starts.
        rig.s.start_prefetch(first).unwrap();
        let first = rig.s.wait(first, WAIT).unwrap();
        rig.s.start_prefetch(second).unwrap();
        [first, rig.s.wait(second, WAIT).unwrap()]
    } else {
        let first = rig.s.submit_lookup(request(0, &rank0)).unwrap();
        let first = rig.s.wait(first, WAIT).unwrap();
        let second = rig.s.submit_lookup(request(1, &rank1)).unwrap();
        [first, rig.s.wait(second, WAIT).unwrap()]
    };
    rig.s.l1().audit().unwrap();
    results
}

#[test]
fn the_lookups_of_a_requests_ranks_lease_every_ranks_l1_hits_before_any_load_evicts() {
    // Made one after the other, rank 0's load of its third chunk takes the slot of the least
    // recently used chunk: rank 1's first, the hit rank 1's lookup was about to lease. This is
    // the case deferred lookups exist for; if it stops evicting, the test below proves nothing.
    let [first, second] = two_ranks_look_up(false);
    assert_eq!(first.per_tier, vec![2, 1]);
    assert_eq!(second.per_tier, vec![1, 2], "rank 1's first chunk came back from L2");
    // Deferred, both ranks' L1 hits are leased before either loads: no rank loses a hit to
    // another's load (L1 has no room, so the third chunks are read from L2 where they are).
    for (rank, result) in two_ranks_look_up(true).iter().enumerate() {
        assert_eq!(result.hit_chunks, 3, "rank {rank}");
        assert_eq!(result.per_tier, vec![2, 1], "rank {rank}: its L1 hits stayed");
    }
}

#[test]
fn a_deferred_lookup_starts_at_its_first_query_and_fails_unstarted_at_its_deadline() {
    let clock = Arc::new(ManualClock::new());
    let rig = rig_with(l1_config(8), false, clock.clone());
    rig.write(&keys(0..3));
    rig.settle(0, 3);
    rig.s.l1().delete(&keys(1..3), false);
    let deferred = |keys: Vec<ObjectKey>| LookupRequest {
        defer_prefetch: true,
        ..LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout(), keys)
    };
    // Whole in L1: complete at once, deferred or not.
    let whole = rig.s.submit_lookup(deferred(keys(0..1))).unwrap();
    assert_eq!(rig.s.result_if_complete(whole).unwrap().map(|r| r.hit_chunks), Some(1));
    rig.s.release(whole, Readers::All).unwrap();
    // Started by its first query.
    let started = rig.s.submit_lookup(deferred(keys(0..3))).unwrap();
    assert_eq!(rig.s.result_if_complete(started).unwrap(), None);
    assert_eq!(rig.shares(&key(0)), 1, "its L1 hit is leased at once");
    assert!(matches!(rig.s.check_hit(started, 0, &keys(0..1)), Err(StorageError::Pending(_))));
    let _ = rig.s.query(started).unwrap();
    let result = rig.s.wait(started, WAIT).unwrap();
    assert_eq!(result.per_tier, vec![1, 2]);
    rig.s.release(started, Readers::All).unwrap();
    // Never started: failed at its deadline, its L1 shares returned.
    let forgotten = rig.s.submit_lookup(deferred(keys(0..3))).unwrap();
    assert_eq!(rig.shares(&key(0)), 1);
    clock.advance(Duration::from_secs(31));
    let deadline = Instant::now() + WAIT;
    while rig.shares(&key(0)) != 0 {
        assert!(Instant::now() < deadline, "the unstarted lookup kept its lease");
        std::thread::sleep(Duration::from_millis(1));
    }
    let failed = rig.s.start_prefetch(forgotten).unwrap_err();
    assert!(matches!(failed, StorageError::NotStarted(id) if id == forgotten), "{failed}");
    assert!(failed.to_string().contains("not started"), "{failed}");
    assert!(matches!(rig.s.query(forgotten), Err(StorageError::NotStarted(_))));
    assert!(matches!(rig.s.result_if_complete(forgotten), Err(StorageError::NotStarted(_))));
    assert_eq!(rig.s.status().tiers[0].1.objects, 3, "nothing was lost");
    rig.s.l1().audit().unwrap();
}
