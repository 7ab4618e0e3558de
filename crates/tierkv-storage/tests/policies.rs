//! The store policies and the maintenance thread, end to end on the real tiers.

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tierkv_core::policy::Order;
use tierkv_core::{ExtraCount, Layout, ManualClock, ObjectKey};
use tierkv_disk::{BLOCK, DiskStoreConfig, record_bytes};
use tierkv_l1::{DeviceKind, L1Config, OwnerId, Presence, Readers, Watermark};
use tierkv_l2::{HostMemory, HostStoreConfig};
use tierkv_prefetch::BelowError;
use tierkv_storage::{HitChunk, StorageConfig, StorageError, StorageManager, StorePolicy};
use tierkv_testkit::contract::{keys, payload};
use tierkv_testkit::eventually;

use common::counter;

const CHUNK: u64 = 16 << 10;
const OWNER: OwnerId = OwnerId(5);
const WAIT: Duration = Duration::from_secs(20);

fn config(slots: u64, policy: StorePolicy, dir: &tempfile::TempDir) -> StorageConfig {
    let segment_bytes = BLOCK + 8 * record_bytes(CHUNK);
    StorageConfig {
        l1: L1Config {
            device: DeviceKind::Emulated,
            lease_ttl: Duration::from_secs(10),
            watermark: Watermark { high: 0.75, low: 0.5 },
            ..L1Config::new(slots * CHUNK, CHUNK)
        },
        l2: Some(HostStoreConfig {
            memory: HostMemory::Plain,
            ..HostStoreConfig::new(64 * CHUNK, CHUNK)
        }),
        disk: Some(DiskStoreConfig {
            segment_bytes,
            ..DiskStoreConfig::new(dir.path(), 16 * segment_bytes, CHUNK)
        }),
        store_policy: policy,
        maintenance_interval: Duration::from_millis(5),
        ..StorageConfig::new(L1Config::new(CHUNK, CHUNK))
    }
}

fn write(s: &StorageManager, keys: &[ObjectKey]) {
    let layout = Layout::bytes(CHUNK).unwrap();
    let reserved = s.reserve_write(OWNER, keys, &layout).unwrap();
    let refused: Vec<_> =
        reserved.iter().zip(keys).filter_map(|(r, k)| r.as_ref().err().map(|e| (k, e))).collect();
    assert!(refused.is_empty(), "refused: {refused:?}; L1 {:?}", s.status().l1);
    for k in keys {
        s.write_access(OWNER, k).unwrap().write_at(0, &payload(k, CHUNK)).unwrap();
    }
    assert!(s.finish_write(OWNER, keys).unwrap().iter().all(|r| r.is_ok()));
}

/// The bytes of `key` of lookup `id` for reader 0, from L1 or from the tier holding it.
fn read_bytes(s: &StorageManager, id: tierkv_storage::LookupId, key: &ObjectKey) -> Vec<u8> {
    bytes_of(s.read_hit(id, 0, std::slice::from_ref(key), CHUNK).unwrap().pop().unwrap())
}

/// A read chunk's bytes, copied out of L1 or taken from the tier's load.
fn bytes_of(chunk: HitChunk) -> Vec<u8> {
    match chunk {
        HitChunk::L1(access) => {
            let mut bytes = vec![0; CHUNK as usize];
            access.read_at(0, &mut bytes).unwrap();
            bytes
        }
        HitChunk::Loaded(bytes) => bytes.to_vec(),
    }
}

fn lookup_all(s: &StorageManager, keys: Vec<ObjectKey>) -> tierkv_storage::LookupResult {
    let layout = Layout::bytes(CHUNK).unwrap();
    let id = s.submit_prefetch(OWNER, keys.clone(), ExtraCount::ZERO, layout).unwrap();
    let result = s.wait(id, WAIT).unwrap();
    for k in &keys[..result.hit_chunks] {
        assert!(read_bytes(s, id, k) == payload(k, CHUNK), "{k:?} read other bytes");
    }
    s.release(id, Readers::All).unwrap();
    result
}

#[test]
fn write_back_copies_victims_down_before_letting_them_go() {
    let dir = tempfile::tempdir().unwrap();
    let s = StorageManager::start(config(8, StorePolicy::WriteBack, &dir)).unwrap();
    write(&s, &keys(0..4));
    assert_eq!(s.status().tiers[0].1.objects, 0, "nothing is copied at write time");
    write(&s, &keys(4..8));
    // Eight of eight slots: above the high watermark, the background writes victims back down
    // to the low watermark (four slots) and then frees them.
    eventually("write-back brings L1 to its low watermark", || {
        let status = s.status();
        status.l1.slots - status.l1.free_bytes / CHUNK <= 4 && status.store_in_flight == 0
    });
    let status = s.status();
    assert_eq!(
        (status.tiers[0].1.objects, status.tiers[1].1.objects),
        (4, 4),
        "victims went to both tiers"
    );
    let result = lookup_all(&s, keys(0..8));
    assert_eq!(result.hit_chunks, 8, "nothing was lost: {result:?}");
    assert_eq!(result.per_tier[0] + result.per_tier[1], 8);
    s.l1().audit().unwrap();
}

#[test]
fn write_back_hands_down_what_a_store_evicts_before_the_background_writes_it_back() {
    // L1 evicts on demand only (watermarks at 1.0): the background never writes anything back,
    // so every chunk that leaves L1 is a victim of a store's reservation. Each goes where a
    // write-back would have taken it, L2 and the disk, rather than nowhere.
    let dir = tempfile::tempdir().unwrap();
    let s = StorageManager::start(tiered(4, 8, Some(&dir), StorePolicy::WriteBack)).unwrap();
    write_each(&s, &keys(0..8));
    eventually("the pipeline is idle", || s.status().store_in_flight == 0);
    let status = s.status();
    assert_eq!(
        (status.l1.cached, status.tiers[0].1.objects, status.tiers[1].1.objects),
        (4, 4, 4),
        "L1 holds the newest four; its four victims are in L2 and on disk"
    );
    assert_eq!(lookup_all(&s, keys(0..4)).per_tier, vec![0, 4, 0]);
    s.l1().audit().unwrap();
}

#[test]
fn a_stopped_write_back_writes_l1_back_so_a_restart_keeps_it() {
    // Nothing was written back before the stop (watermarks at 1.0): the stop writes L1's
    // chunks back, as the cascade hands them down, and the disk keeps them.
    let dir = tempfile::tempdir().unwrap();
    let s = StorageManager::start(tiered(4, 8, Some(&dir), StorePolicy::WriteBack)).unwrap();
    write_each(&s, &keys(0..4));
    assert_eq!(s.status().tiers[1].1.objects, 0, "nothing on disk before the stop");
    s.stop();
    assert_eq!(s.status().l1.cached, 0, "every chunk of L1 was written back and freed");
    assert_eq!(s.status().tiers[0].1.objects, 0, "none to L2, which closes with the daemon");
    drop(s);
    let s = StorageManager::start(tiered(4, 8, Some(&dir), StorePolicy::WriteBack)).unwrap();
    assert_eq!(lookup_all(&s, keys(0..4)).per_tier, vec![0, 0, 4], "a restart finds them");
}

#[test]
fn write_back_copies_to_the_remote_tier_only_under_write_through_admission() {
    use tierkv_storage::RemoteAdmission;
    use tierkv_testkit::FakeTier;
    for (admission, copied) in [
        (RemoteAdmission::WriteThrough, true),
        (RemoteAdmission::AfterReads { min_reads: 1 }, false),
    ] {
        let (l2, remote) = (
            Arc::new(FakeTier::new("l2", 64, CHUNK)),
            Arc::new(FakeTier::new("remote", 64, CHUNK)),
        );
        let tiers: Vec<Arc<dyn tierkv_core::TierAdapter>> = vec![l2.clone(), remote.clone()];
        let tiered = tiered(4, 2, None, StorePolicy::WriteBack);
        // Chunks leave L1 both ways: written back by the background above three of four slots,
        // and taken by a store's reservation when the background has not got there yet.
        let config = StorageConfig {
            l1: L1Config { watermark: Watermark { high: 0.75, low: 0.5 }, ..tiered.l1 },
            remote_admission: admission,
            l2: None,
            ..tiered
        };
        let s =
            StorageManager::start_with_tiers(config, Arc::new(ManualClock::new()), tiers).unwrap();
        write_each(&s, &keys(0..12));
        eventually("the pipeline is idle", || s.status().store_in_flight == 0);
        let in_l1 = |k: &ObjectKey| matches!(s.l1().presence(k), Presence::Ready { .. });
        let left: Vec<ObjectKey> = keys(0..12).into_iter().filter(|k| !in_l1(k)).collect();
        assert!(left.len() >= 8, "four slots for twelve chunks: {} left L1", left.len());
        for key in &left {
            assert!(l2.contains(key), "{key:?} left L1 for nowhere ({admission:?})");
            assert_eq!(remote.contains(key), copied, "{key:?} ({admission:?})");
        }
        drop(s);
    }
}

#[test]
fn disk_admission_writes_a_chunk_to_disk_only_once_it_was_read_enough() {
    let dir = tempfile::tempdir().unwrap();
    let s = StorageManager::start(config(16, StorePolicy::DiskAdmission { min_reads: 2 }, &dir))
        .unwrap();
    write(&s, &keys(0..3));
    eventually("the host tier has the writes", || s.status().tiers[0].1.objects == 3);
    assert_eq!(lookup_all(&s, keys(0..2)).hit_chunks, 2);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(s.status().tiers[1].1.objects, 0, "read once: not on disk yet");
    assert_eq!(lookup_all(&s, keys(0..2)).hit_chunks, 2);
    eventually("chunks read twice reach the disk", || s.status().tiers[1].1.objects == 2);
    assert_eq!(s.status().tiers[0].1.objects, 3);
}

#[test]
fn disk_admission_counts_a_lookup_of_several_readers_as_one_read() {
    // MLA over four TP ranks: one lookup, four readers, each reading every chunk of the hit.
    // That is one read of each chunk for admission, not four.
    let dir = tempfile::tempdir().unwrap();
    let s = StorageManager::start(config(16, StorePolicy::DiskAdmission { min_reads: 2 }, &dir))
        .unwrap();
    write(&s, &keys(0..2));
    eventually("the host tier has the writes", || s.status().tiers[0].1.objects == 2);
    let layout = Layout::bytes(CHUNK).unwrap();
    let read_by_four = || {
        let extra = ExtraCount::new(3).unwrap();
        let id = s.submit_prefetch(OWNER, keys(0..2), extra, layout.clone()).unwrap();
        assert_eq!(s.wait(id, WAIT).unwrap().hit_chunks, 2);
        for reader in 0..4 {
            for k in keys(0..2) {
                drop(s.read(id, reader, &k).unwrap());
            }
            s.release(id, Readers::One(reader)).unwrap();
        }
    };
    read_by_four();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(s.status().tiers[1].1.objects, 0, "one lookup of four readers counted as more");
    read_by_four();
    eventually("chunks looked up twice reach the disk", || s.status().tiers[1].1.objects == 2);
}

#[test]
fn write_through_copies_every_write_to_every_tier() {
    let dir = tempfile::tempdir().unwrap();
    let s = StorageManager::start(config(16, StorePolicy::WriteThrough, &dir)).unwrap();
    write(&s, &keys(0..5));
    eventually("both tiers have the writes", || {
        let status = s.status();
        status.tiers[0].1.objects == 5
            && status.tiers[1].1.objects == 5
            && status.store_in_flight == 0
    });
}

#[test]
fn a_lease_nobody_releases_is_revoked_by_the_maintenance_thread() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new());
    let s = StorageManager::start_with_clock(
        config(16, StorePolicy::WriteThrough, &dir),
        clock.clone(),
    )
    .unwrap();
    write(&s, &keys(0..3));
    eventually("the store pipeline settled", || {
        s.status().store_in_flight == 0 && s.status().tiers[0].1.objects == 3
    });
    let layout = Layout::bytes(CHUNK).unwrap();
    let id = s.submit_prefetch(OWNER, keys(0..3), ExtraCount::new(1).unwrap(), layout).unwrap();
    assert_eq!(s.wait(id, WAIT).unwrap().hit_chunks, 3);
    s.release(id, Readers::One(0)).unwrap(); // reader 1 never releases
    assert!(matches!(s.l1().presence(&keys(0..1)[0]), Presence::Ready { shares: 1, .. }));
    clock.advance(Duration::from_secs(11));
    eventually("the lease expired", || s.l1().usage().leased == 0);
    assert!(s.release(id, Readers::One(1)).is_err(), "a late release is told the lease expired");
    s.l1().audit().unwrap();
}

#[test]
fn stopping_with_work_in_flight_is_clean_and_the_disk_keeps_what_was_written() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = StorageManager::start(config(16, StorePolicy::WriteThrough, &dir)).unwrap();
        write(&s, &keys(0..6));
        eventually("the disk has the writes", || s.status().tiers[1].1.objects == 6);
        let layout = Layout::bytes(CHUNK).unwrap();
        s.submit_prefetch(OWNER, keys(0..6), ExtraCount::ZERO, layout).unwrap();
        let started = Instant::now();
        s.stop();
        assert!(started.elapsed() < Duration::from_secs(10));
        let layout = Layout::bytes(CHUNK).unwrap();
        assert!(
            s.reserve_write(OWNER, &keys(9..10), &layout).is_err(),
            "a stopped manager refuses work"
        );
    }
    let s = StorageManager::start(config(16, StorePolicy::WriteThrough, &dir)).unwrap();
    assert_eq!(
        lookup_all(&s, keys(0..6)).per_tier,
        vec![0, 0, 6],
        "a restart finds the disk's chunks"
    );
}

/// A tier whose stores panic inside the store pipeline's thread.
struct PanicsOnStore(tierkv_testkit::FakeTier);

impl tierkv_core::TierAdapter for PanicsOnStore {
    fn name(&self) -> &str {
        "l2"
    }
    fn submit_store(&self, _items: Vec<tierkv_core::StoreItem>) -> tierkv_core::TaskId {
        panic!("store exploded");
    }
    fn submit_lookup_and_lock(&self, keys: Vec<ObjectKey>) -> tierkv_core::TaskId {
        self.0.submit_lookup_and_lock(keys)
    }
    fn submit_load(&self, items: Vec<tierkv_core::LoadItem>) -> tierkv_core::TaskId {
        self.0.submit_load(items)
    }
    fn unlock(&self, keys: &[ObjectKey]) {
        self.0.unlock(keys)
    }
    fn delete(&self, keys: &[ObjectKey]) -> usize {
        self.0.delete(keys)
    }
    fn clear(&self) -> usize {
        self.0.clear()
    }
    fn usage(&self) -> tierkv_core::TierUsage {
        self.0.usage()
    }
    fn completions(&self) -> crossbeam_channel::Receiver<tierkv_core::Completion> {
        self.0.completions()
    }
    fn close(&self) {
        self.0.close()
    }
}

#[test]
fn a_panic_in_the_store_pipeline_is_counted_and_the_pipeline_carries_on() {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let clock = Arc::new(ManualClock::new());
    let tier: Arc<dyn tierkv_core::TierAdapter> =
        Arc::new(PanicsOnStore(tierkv_testkit::FakeTier::new("l2", 64, CHUNK)));
    let mut config = StorageConfig::new(L1Config {
        device: DeviceKind::Emulated,
        lease_ttl: Duration::from_secs(10),
        ..L1Config::new(16 * CHUNK, CHUNK)
    });
    config.maintenance_interval = Duration::from_millis(5);
    config.store_policy = StorePolicy::WriteThrough;
    let s = metrics::with_local_recorder(&recorder, || {
        StorageManager::start_with_tiers(config, clock.clone(), vec![tier])
    })
    .unwrap();
    write(&s, &keys(0..2));
    write(&s, &keys(2..4));
    // Both jobs finish (as failed copies) and return their shares at once: nothing waits for a
    // deadline, and the pipeline is idle and alive.
    eventually("the store pipeline is idle", || s.status().store_in_flight == 0);
    assert_eq!(s.l1().usage().leased, 0, "the failed copies returned their shares");
    assert_eq!(lookup_all(&s, keys(0..4)).hit_chunks, 4);
    let snapshot = snapshotter.snapshot().into_vec();
    let panics: u64 = snapshot
        .into_iter()
        .filter(|(k, ..)| {
            k.key().name() == "tierkv_errors_total"
                && k.key().labels().any(|l| l.value().ends_with("_panic"))
        })
        .map(|(.., v)| if let metrics_util::debugging::DebugValue::Counter(n) = v { n } else { 0 })
        .sum();
    assert_eq!(panics, 2, "each panic was counted");
}

/// L1 of `l1` slots over an L2 of `l2` chunks and, if `disk` is given, a disk tier; L1 evicts on
/// demand only, so every eviction comes from a reservation.
fn tiered(
    l1: u64,
    l2: u64,
    disk: Option<&tempfile::TempDir>,
    policy: StorePolicy,
) -> StorageConfig {
    let segment_bytes = BLOCK + 2 * record_bytes(CHUNK);
    StorageConfig {
        l1: L1Config {
            device: DeviceKind::Emulated,
            lease_ttl: Duration::from_secs(10),
            watermark: Watermark { high: 1.0, low: 1.0 },
            ..L1Config::new(l1 * CHUNK, CHUNK)
        },
        l2: Some(HostStoreConfig {
            memory: HostMemory::Plain,
            ..HostStoreConfig::new(l2 * CHUNK, CHUNK)
        }),
        disk: disk.map(|dir| DiskStoreConfig {
            segment_bytes,
            ..DiskStoreConfig::new(dir.path(), 8 * segment_bytes, CHUNK)
        }),
        store_policy: policy,
        l2_watermark: Watermark { high: 1.0, low: 1.0 },
        maintenance_interval: Duration::from_millis(5),
        ..StorageConfig::new(L1Config::new(CHUNK, CHUNK))
    }
}

/// Writes each key in a store of its own, oldest first.
fn write_each(s: &StorageManager, keys: &[ObjectKey]) {
    for key in keys {
        write(s, std::slice::from_ref(key));
    }
}

#[test]
fn cascade_tiers_add_up_where_write_through_tiers_hold_copies() {
    // Four L1 slots over four L2 slots, eight chunks written one by one.
    let s = StorageManager::start(tiered(4, 4, None, StorePolicy::Cascade)).unwrap();
    write_each(&s, &keys(0..8));
    eventually("the pipeline is idle", || s.status().store_in_flight == 0);
    let status = s.status();
    assert_eq!(status.tiers[0].1.objects, 4, "L1's four victims are in L2");
    // The newest four from L1, then the oldest four from L2 (each read through an L1 slot; the
    // four in L2 are locked by the lookup, so L1's victims cannot push them out meanwhile).
    assert_eq!(lookup_all(&s, keys(4..8)).per_tier, vec![4, 0]);
    assert_eq!(lookup_all(&s, keys(0..4)).per_tier, vec![0, 4]);
    s.l1().audit().unwrap();
    drop(s);

    // The same writes through write-through tiers: L2 holds copies of what L1 holds, so the
    // first four chunks are gone from both.
    let s = StorageManager::start(tiered(4, 4, None, StorePolicy::WriteThrough)).unwrap();
    write_each(&s, &keys(0..8));
    eventually("the pipeline is idle", || s.status().store_in_flight == 0);
    let kept = keys(0..8).into_iter().filter(|k| lookup_all(&s, vec![*k]).hit_chunks == 1).count();
    assert_eq!(kept, 4);
}

/// Six chunks through an L1 and an L2 of two each, under the cascade: the newest two in L1, the
/// two before in L2, the oldest two on disk. Returns once the disk has them.
fn fill_two_by_two(s: &StorageManager) {
    write_each(s, &keys(0..6));
    eventually("L2's victims reached the disk", || {
        let status = s.status();
        status.store_in_flight == 0 && status.tiers[1].1.objects == 2
    });
}

#[test]
fn cascade_sends_the_host_tiers_victims_to_disk_and_serves_every_tier() {
    let dir = tempfile::tempdir().unwrap();
    let s = StorageManager::start(tiered(2, 2, Some(&dir), StorePolicy::Cascade)).unwrap();
    fill_two_by_two(&s);
    // Newest in L1, the two before in L2, the oldest two on disk: each lookup says so, and
    // every byte read back is the chunk's own (checked in `lookup_all`).
    let served = |range: std::ops::Range<u64>| {
        let result = lookup_all(&s, keys(range));
        (result.hit_chunks, result.per_tier.clone())
    };
    assert_eq!(served(4..6), (2, vec![2, 0, 0]));
    assert_eq!(served(2..4), (2, vec![0, 2, 0]));
    assert_eq!(served(0..2), (2, vec![0, 0, 2]));
    s.l1().audit().unwrap();
}

#[test]
fn a_stopped_cascade_hands_l1_and_l2_down_to_disk_so_a_restart_keeps_them() {
    // Two chunks in L1, two in L2, two on disk (disk room: eight segments of two records).
    let dir = tempfile::tempdir().unwrap();
    let s = StorageManager::start(tiered(2, 2, Some(&dir), StorePolicy::Cascade)).unwrap();
    fill_two_by_two(&s);
    s.stop();
    let status = s.status();
    assert_eq!((status.l1.cached, status.tiers[0].1.objects), (0, 0), "{status:?}");
    drop(s);

    // The same directory after a restart: every chunk is a disk hit, with its own bytes.
    let s = StorageManager::start(tiered(2, 2, Some(&dir), StorePolicy::Cascade)).unwrap();
    for key in keys(0..6) {
        assert_eq!(lookup_all(&s, vec![key]).per_tier, vec![0, 0, 1], "{key:?}");
    }

    // Without the hand-down (no time for it), only what the disk already held survives.
    let dir = tempfile::tempdir().unwrap();
    let no_time = || StorageConfig {
        stop_drain_timeout: Duration::ZERO,
        ..tiered(2, 2, Some(&dir), StorePolicy::Cascade)
    };
    let s = StorageManager::start(no_time()).unwrap();
    fill_two_by_two(&s);
    drop(s);
    let s = StorageManager::start(no_time()).unwrap();
    let kept = keys(0..6).into_iter().filter(|k| lookup_all(&s, vec![*k]).hit_chunks == 1);
    assert_eq!(kept.collect::<Vec<_>>(), keys(0..2));
}

#[test]
fn under_the_cascade_the_remote_tier_still_takes_every_finished_write_at_once() {
    use tierkv_storage::RemoteAdmission;
    use tierkv_testkit::FakeTier;
    // The node's own tiers take only L1's victims; the tier the nodes share takes each store
    // as it finishes (write-through admission).
    for (admission, at_once) in [
        (RemoteAdmission::WriteThrough, true),
        (RemoteAdmission::AfterReads { min_reads: 1 }, false),
    ] {
        let (l2, remote) =
            (Arc::new(FakeTier::new("l2", 2, CHUNK)), Arc::new(FakeTier::new("remote", 64, CHUNK)));
        let tiers: Vec<Arc<dyn tierkv_core::TierAdapter>> = vec![l2.clone(), remote.clone()];
        let config = StorageConfig {
            store_policy: StorePolicy::Cascade,
            remote_admission: admission,
            ..tiered(2, 2, None, StorePolicy::Cascade)
        };
        let config = StorageConfig { l2: None, ..config };
        let s =
            StorageManager::start_with_tiers(config, Arc::new(ManualClock::new()), tiers).unwrap();
        write_each(&s, &keys(0..6));
        eventually("the pipeline is idle", || s.status().store_in_flight == 0);
        let in_remote = keys(0..6).iter().filter(|k| remote.contains(k)).count();
        // Nothing was read, so after-reads admission took nothing.
        assert_eq!(in_remote, if at_once { 6 } else { 0 }, "{admission:?}");
        // L1's victims went to L2 (two slots), under either admission.
        assert_eq!(keys(0..6).iter().filter(|k| l2.contains(k)).count(), 2, "{admission:?}");
        drop(s);
    }
}

#[test]
fn cascade_writes_nothing_down_at_store_time() {
    let dir = tempfile::tempdir().unwrap();
    let s = StorageManager::start(tiered(8, 8, Some(&dir), StorePolicy::Cascade)).unwrap();
    write_each(&s, &keys(0..4));
    std::thread::sleep(Duration::from_millis(50));
    let status = s.status();
    assert_eq!((status.tiers[0].1.objects, status.tiers[1].1.objects), (0, 0));
    assert_eq!(lookup_all(&s, keys(0..4)).per_tier, vec![4, 0, 0]);
}

#[test]
fn cascade_under_concurrent_writers_and_readers_serves_only_right_bytes_and_leaks_nothing() {
    // L1 victims are copied into L2 under their L1 shard's lock, and L2's victims go to the store
    // pipeline: four threads writing and reading overlapping chains through tiny tiers exercise
    // every one of those paths at once. Any deadlock trips the deadline below.
    let dir = tempfile::tempdir().unwrap();
    let s =
        Arc::new(StorageManager::start(tiered(4, 6, Some(&dir), StorePolicy::Cascade)).unwrap());
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for thread in 0..4u64 {
        let (s, done_tx) = (Arc::clone(&s), done_tx.clone());
        std::thread::spawn(move || {
            // A failed check answers at once (a thread that only died would cost the deadline).
            let _answers = Answer(done_tx);
            let owner = OwnerId(100 + thread);
            let layout = Layout::bytes(CHUNK).unwrap();
            for round in 0..60u64 {
                // Chains of 1 to 3 chunks out of 24 keys, different for each thread and round.
                let start = (round * 7 + thread * 5) % 22;
                let chain = keys(start..start + 1 + (round + thread) % 3);
                let reserved = s.reserve_write(owner, &chain, &layout).unwrap();
                let mut written = Vec::new();
                for (key, result) in chain.iter().zip(reserved) {
                    if result.is_ok() {
                        s.write_access(owner, key)
                            .unwrap()
                            .write_at(0, &payload(key, CHUNK))
                            .unwrap();
                        written.push(*key);
                    }
                }
                s.finish_write(owner, &written).unwrap();
                let id = s.submit_prefetch(owner, chain.clone(), ExtraCount::ZERO, layout.clone());
                let id = id.unwrap();
                let result = s.wait(id, WAIT).unwrap();
                // With four threads leasing chains of L1's four slots, part of a hit may find
                // no L1 room: it is read from the tier that holds it.
                for key in &chain[..result.hit_chunks] {
                    let bytes = read_bytes(&s, id, key);
                    assert!(bytes == payload(key, CHUNK), "{key:?} served other bytes");
                }
                s.release(id, Readers::All).unwrap();
            }
        });
    }
    for _ in 0..4 {
        let passed = done_rx
            .recv_timeout(Duration::from_secs(120))
            .expect("a thread finished (no deadlock)");
        assert!(passed, "a thread's check failed (its message is above)");
    }
    eventually("the pipelines are idle", || s.status().store_in_flight == 0);
    let status = s.status();
    assert_eq!(status.open_lookups, 0);
    assert!(status.tiers.iter().all(|(_, usage)| usage.locks == 0), "{status:?}");
    assert!(status.tiers[1].1.objects > 0, "L2's victims reached the disk: {status:?}");
    s.l1().audit().unwrap();
}

/// Tells a test's main thread, as a worker thread ends, whether it ended normally or panicked.
struct Answer(std::sync::mpsc::Sender<bool>);

impl Drop for Answer {
    fn drop(&mut self) {
        let _ = self.0.send(!std::thread::panicking());
    }
}

/// Writes `keys` as one chain the way the daemon's session does: in windows of
/// `StorageManager::store_window`, each finished before the next is reserved.
fn write_in_windows(s: &StorageManager, keys: &[ObjectKey]) {
    for window in keys.chunks(s.store_window()) {
        write(s, window);
    }
}

#[test]
fn a_store_larger_than_l1_goes_in_windows_and_all_of_it_reaches_the_tiers_below() {
    for policy in [StorePolicy::Cascade, StorePolicy::WriteThrough, StorePolicy::WriteBack] {
        let dir = tempfile::tempdir().unwrap();
        let s = StorageManager::start(tiered(4, 16, Some(&dir), policy)).unwrap();
        assert_eq!(s.store_window(), 1, "an eighth of L1's four slots, at least one");
        write_in_windows(&s, &keys(0..12));
        eventually("the pipeline is idle", || s.status().store_in_flight == 0);
        // Every chunk of the twelve is somewhere, the whole chain is a hit, and every byte read
        // back (from L1 or from the tier holding it) is the chunk's own.
        assert_eq!(lookup_all(&s, keys(0..12)).hit_chunks, 12, "{policy:?}");
        s.l1().audit().unwrap();
    }
    // Without lower tiers a store is one reservation: what does not fit is refused.
    let alone = StorageManager::start(StorageConfig {
        l2: None,
        disk: None,
        ..tiered(4, 16, None, StorePolicy::WriteThrough)
    })
    .unwrap();
    assert_eq!(alone.store_window(), usize::MAX);
}

/// Twelve chunks stored under cascade into an L1 of four and an L2 of sixteen (L1 holds the last
/// four, L2 the first eight), then looked up whole with `readers` readers. The lookup leases the
/// four (all of L1), so the eight find no L1 slot: they stay in L2, locked, and the hit is still
/// all twelve. Metrics go to the returned snapshotter.
fn hit_held_in_l2(
    readers: i64,
) -> (StorageManager, metrics_util::debugging::Snapshotter, tierkv_storage::LookupId) {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let s = metrics::with_local_recorder(&recorder, || {
        StorageManager::start(tiered(4, 16, None, StorePolicy::Cascade))
    })
    .unwrap();
    write_in_windows(&s, &keys(0..12));
    let layout = Layout::bytes(CHUNK).unwrap();
    let extra = ExtraCount::new(readers - 1).unwrap();
    let id = s.submit_prefetch(OWNER, keys(0..12), extra, layout).unwrap();
    let result = s.wait(id, WAIT).unwrap();
    assert_eq!((result.hit_chunks, result.per_tier.clone()), (12, vec![4, 8]));
    (s, snapshotter, id)
}

#[test]
fn a_hit_larger_than_l1_is_read_by_every_reader_from_the_tier_that_holds_it() {
    let (s, snapshotter, id) = hit_held_in_l2(2);
    assert_eq!(s.status().tiers[0].1.locks, 8, "one lock per chunk held below");
    assert_eq!(s.held_chunks(id), Some(12));
    for reader in 0..2u8 {
        let chunks = s.read_hit(id, reader, &keys(0..12), CHUNK).unwrap();
        let from_l2 = chunks.iter().filter(|c| matches!(c, HitChunk::Loaded(_))).count();
        assert_eq!(from_l2, 8);
        for (key, chunk) in keys(0..12).iter().zip(chunks) {
            let bytes = bytes_of(chunk);
            assert!(bytes == payload(key, CHUNK), "reader {reader}: {key:?} read other bytes");
        }
        s.release(id, Readers::One(reader)).unwrap();
        let locks = if reader == 0 { 8 } else { 0 };
        assert_eq!(s.status().tiers[0].1.locks, locks, "the locks go with the last reader");
    }
    assert!(!s.is_open(id));
    assert_eq!(s.status().tiers[0].1.objects, 8, "reading from L2 left the chunks there");
    let seen = snapshotter.snapshot().into_vec();
    assert_eq!(
        counter(&seen, "tierkv_lookup_held_below_l1_chunks_total", &[]),
        8,
        "the chunks held below L1 were counted"
    );
    assert_eq!(
        counter(&seen, "tierkv_tier_loads_total", &[("tier", "l2")]),
        8,
        "the second reader took the chunks the first loaded: L2 was read once per chunk"
    );
    s.l1().audit().unwrap();
}

/// A chunk of a hit that finds no room in L1 is held in its tier and read from there, by
/// design: the lookup's promotion tried to reserve it in L1, and no client was refused
/// anything. `tierkv_errors_total{tier="l1",reason="out_of_memory"}` counts none of it (it
/// counted each such chunk as a refused key).
#[test]
fn a_hit_partly_held_below_l1_counts_no_refusal() {
    let (s, snapshotter, id) = hit_held_in_l2(1);
    let seen = snapshotter.snapshot().into_vec();
    assert_eq!(counter(&seen, "tierkv_lookup_held_below_l1_chunks_total", &[]), 8);
    assert_eq!(common::l1_out_of_memory(&seen), 0, "a chunk held below counted as refused");
    s.release_all(id).unwrap();
}

#[test]
fn a_hit_held_below_is_loaded_once_for_all_its_readers_reading_at_once() {
    // Four readers (MLA over four TP ranks); eight chunks stay in L2.
    let (s, snapshotter, id) = hit_held_in_l2(4);
    let barrier = std::sync::Barrier::new(4);
    std::thread::scope(|scope| {
        for reader in 0..4u8 {
            let (s, barrier) = (&s, &barrier);
            scope.spawn(move || {
                barrier.wait();
                // Each reader asks in its own order, so loads and waits interleave.
                let mut wanted = keys(0..12);
                wanted.rotate_left(3 * usize::from(reader));
                let chunks = s.read_hit(id, reader, &wanted, CHUNK).unwrap();
                for (key, chunk) in wanted.iter().zip(chunks) {
                    let bytes = bytes_of(chunk);
                    assert!(
                        bytes == payload(key, CHUNK),
                        "reader {reader}: {key:?} read other bytes"
                    );
                }
                s.release(id, Readers::One(reader)).unwrap();
            });
        }
    });
    assert!(!s.is_open(id));
    assert_eq!(
        counter(&snapshotter.snapshot().into_vec(), "tierkv_tier_loads_total", &[("tier", "l2")]),
        8,
        "four readers read L2 once per chunk"
    );
    assert_eq!(s.status().tiers[0].1.locks, 0, "every lock went back");
    s.l1().audit().unwrap();
}

#[test]
fn disk_admission_counts_the_reads_of_chunks_held_below_l1_and_copies_them_from_their_tier() {
    // Twelve chunks over an L1 of four: a lookup leases the four L1 holds, and the eight L1 has
    // no room for are read straight from L2, where they stay. Read twice, every chunk of the
    // hit reaches the disk: those eight copied there from L2, not from L1.
    let dir = tempfile::tempdir().unwrap();
    let policy = StorePolicy::DiskAdmission { min_reads: 2 };
    let s = StorageManager::start(tiered(4, 16, Some(&dir), policy)).unwrap();
    write_in_windows(&s, &keys(0..12));
    eventually("L2 has the writes", || {
        s.status().tiers[0].1.objects == 12 && s.status().store_in_flight == 0
    });
    assert_eq!(lookup_all(&s, keys(0..12)).per_tier, vec![4, 8, 0]);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(s.status().tiers[1].1.objects, 0, "read once: not on disk yet");
    assert_eq!(lookup_all(&s, keys(0..12)).per_tier, vec![4, 8, 0]);
    eventually("every chunk read twice reaches the disk", || {
        s.status().tiers[1].1.objects == 12 && s.status().store_in_flight == 0
    });
    assert!(s.status().tiers.iter().all(|(_, t)| t.locks == 0), "every lock went back");
    // What reached the disk is each chunk's own bytes (`lookup_all` reads them from there).
    assert_eq!(s.clear_tier(0), Some(12));
    assert_eq!(lookup_all(&s, keys(0..12)).per_tier, vec![4, 0, 8]);
    s.l1().audit().unwrap();
}

#[test]
fn remote_admission_counts_the_reads_of_chunks_held_below_and_never_sends_back_its_own() {
    use tierkv_storage::RemoteAdmission;
    use tierkv_testkit::FakeTier;
    let (l2, remote) =
        (Arc::new(FakeTier::new("l2", 64, CHUNK)), Arc::new(FakeTier::new("remote", 64, CHUNK)));
    let tiers: Vec<Arc<dyn tierkv_core::TierAdapter>> = vec![l2.clone(), remote.clone()];
    let config = StorageConfig {
        remote_admission: RemoteAdmission::AfterReads { min_reads: 2 },
        l2: None,
        ..tiered(4, 16, None, StorePolicy::WriteThrough)
    };
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let s = metrics::with_local_recorder(&recorder, || {
        StorageManager::start_with_tiers(config, Arc::new(ManualClock::new()), tiers)
    })
    .unwrap();
    // This node's chunks, in L2 and L1's last four: the eight L1 has no room for are read
    // from L2, and reach the remote tier at their second read as the other four do.
    let local = keys(0..12);
    write_in_windows(&s, &local);
    eventually("L2 has the writes", || s.status().store_in_flight == 0);
    assert_eq!(lookup_all(&s, local.clone()).per_tier, vec![4, 8, 0]);
    assert_eq!(lookup_all(&s, local.clone()).per_tier, vec![4, 8, 0]);
    eventually("every chunk read twice reaches the remote tier", || {
        local.iter().all(|k| remote.contains(k)) && s.status().store_in_flight == 0
    });
    // Chunks the remote tier served, most of them read from it where they stay: read as
    // often, none is stored back there (nor anywhere: write-through stores only writes).
    // Each snapshot counts what was stored since the one before.
    let stored = || counter(&snapshotter.snapshot().into_vec(), "tierkv_store_chunks_total", &[]);
    assert!(stored() >= 24, "this node's chunks went to L2, then to the remote tier");
    let served = keys(100..112);
    for key in &served {
        remote.insert(*key, payload(key, CHUNK));
    }
    for _ in 0..3 {
        let result = lookup_all(&s, served.clone());
        assert!(result.per_tier[2] >= 8, "held in the remote tier: {:?}", result.per_tier);
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(s.status().store_in_flight, 0);
    assert_eq!(stored(), 0, "a chunk the remote tier served was stored back");
    assert!(s.status().tiers.iter().all(|(_, t)| t.locks == 0), "every lock went back");
}

#[test]
fn an_admission_from_below_returns_its_locks_whether_its_load_fails_hangs_or_lands() {
    use tierkv_core::TierAdapter as _;
    use tierkv_storage::LookupRequest;
    use tierkv_testkit::FakeTier;
    for (case, admitted) in [("fails", false), ("hangs", false), ("lands", true)] {
        let (l2, disk) =
            (Arc::new(FakeTier::new("l2", 64, CHUNK)), Arc::new(FakeTier::new("disk", 64, CHUNK)));
        let held = keys(0..4);
        for key in &held {
            l2.insert(*key, payload(key, CHUNK));
        }
        let tiers: Vec<Arc<dyn tierkv_core::TierAdapter>> = vec![l2.clone(), disk.clone()];
        let config = StorageConfig {
            l2: None,
            store_timeout: Duration::from_millis(100),
            ..tiered(4, 16, None, StorePolicy::DiskAdmission { min_reads: 1 })
        };
        let s =
            StorageManager::start_with_tiers(config, Arc::new(ManualClock::new()), tiers).unwrap();
        // Promoted into L1 nothing: the whole hit is read from L2 and admitted from there.
        let layout = Layout::bytes(CHUNK).unwrap();
        let lookup = LookupRequest {
            max_promoted: 0,
            ..LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout, held.clone())
        };
        match case {
            "fails" => l2.fail_loads_of(&held),
            "hangs" => l2.hold_loads(),
            _ => {}
        }
        let id = s.submit_lookup(lookup).unwrap();
        assert_eq!(s.wait(id, WAIT).unwrap().per_tier, vec![0, 4, 0], "{case}");
        s.release(id, Readers::All).unwrap();
        eventually("the admission ended", || s.status().store_in_flight == 0);
        assert_eq!(l2.usage().locks, 0, "{case}: a lock of the admission stayed");
        l2.release_held();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(l2.usage().locks, 0, "{case}: a late answer took a lock for good");
        assert!(held.iter().all(|k| disk.contains(k) == admitted), "{case}");
        drop(s);
    }
}

#[test]
fn a_load_below_that_fails_fails_every_reader_at_once_and_serves_no_bytes() {
    let dir = tempfile::tempdir().unwrap();
    // L2 holds one chunk: what L1 has no room for is held on disk.
    let s = StorageManager::start(tiered(4, 1, Some(&dir), StorePolicy::WriteThrough)).unwrap();
    write_in_windows(&s, &keys(0..12));
    eventually("the pipeline is idle", || s.status().store_in_flight == 0);
    let layout = Layout::bytes(CHUNK).unwrap();
    let id = s.submit_prefetch(OWNER, keys(0..12), ExtraCount::new(3).unwrap(), layout).unwrap();
    let result = s.wait(id, WAIT).unwrap();
    assert_eq!(result.hit_chunks, 12);
    assert!(result.per_tier[2] > 0, "chunks held on disk: {:?}", result.per_tier);
    // Every record on disk is damaged (zeroed after each segment's superblock): every load of a
    // chunk held there fails, for the reader that loads it and for those waiting on that load.
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "tkv") {
            let len = std::fs::metadata(&path).unwrap().len();
            let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            std::os::unix::fs::FileExt::write_all_at(
                &file,
                &vec![0; (len - BLOCK) as usize],
                BLOCK,
            )
            .unwrap();
            file.sync_all().unwrap();
        }
    }
    let started = Instant::now();
    let barrier = std::sync::Barrier::new(4);
    std::thread::scope(|scope| {
        for reader in 0..4u8 {
            let (s, barrier) = (&s, &barrier);
            scope.spawn(move || {
                barrier.wait();
                let read = s.read_hit(id, reader, &keys(0..12), CHUNK);
                assert!(read.is_err(), "reader {reader} was served damaged chunks");
            });
        }
    });
    assert!(started.elapsed() < Duration::from_secs(5), "a reader waited for a failed load");
    s.release(id, Readers::All).unwrap();
    assert!(!s.is_open(id));
    assert!(s.status().tiers.iter().all(|(_, t)| t.locks == 0), "every lock went back");
    s.l1().audit().unwrap();
}

#[test]
fn tier_locks_of_a_hit_held_below_go_back_however_the_lookup_ends() {
    let layout = Layout::bytes(CHUNK).unwrap();
    type End = fn(&StorageManager, tierkv_storage::LookupId, &ManualClock);
    let ends: [(&str, End); 4] = [
        ("released", |s, id, _| s.release_all(id).unwrap()),
        ("owner gone", |s, _, _| {
            s.release_owner(OWNER);
        }),
        ("every share", |s, id, _| assert!(s.release(id, Readers::All).unwrap())),
        ("expired", |_, _, clock| clock.advance(Duration::from_secs(11))),
    ];
    for (how, end) in ends {
        let clock = Arc::new(ManualClock::new());
        let config = tiered(4, 16, None, StorePolicy::Cascade);
        let s = StorageManager::start_with_clock(config, clock.clone()).unwrap();
        write_in_windows(&s, &keys(0..12));
        let id = s.submit_prefetch(OWNER, keys(0..12), ExtraCount::ZERO, layout.clone()).unwrap();
        assert_eq!(s.wait(id, WAIT).unwrap().per_tier, vec![4, 8], "{how}");
        end(&s, id, &clock);
        eventually(how, || s.status().tiers[0].1.locks == 0 && !s.is_open(id));
        // The chunks are still in L2, unlocked: a second lookup holds them again.
        assert_eq!(lookup_all(&s, keys(0..12)).hit_chunks, 12, "{how}");
        assert_eq!(s.status().tiers[0].1.locks, 0, "{how}");
        s.l1().audit().unwrap();
    }
}

#[test]
fn a_read_below_that_fails_or_hangs_is_an_error_never_bytes_and_the_locks_go_back() {
    let tier = Arc::new(tierkv_testkit::FakeTier::new("l2", 64, CHUNK));
    for key in keys(0..4) {
        tier.insert(key, payload(&key, CHUNK));
    }
    let config = StorageConfig {
        l2: None,
        disk: None,
        l1: L1Config {
            device: DeviceKind::Emulated,
            lease_ttl: Duration::from_secs(1),
            watermark: Watermark { high: 1.0, low: 1.0 },
            ..L1Config::new(2 * CHUNK, CHUNK)
        },
        ..tiered(2, 2, None, StorePolicy::Cascade)
    };
    let tiers: Vec<Arc<dyn tierkv_core::TierAdapter>> = vec![tier.clone()];
    let s =
        StorageManager::start_with_tiers(config, Arc::new(tierkv_core::SystemClock::new()), tiers)
            .unwrap();
    let layout = Layout::bytes(CHUNK).unwrap();
    let id = s.submit_prefetch(OWNER, keys(0..4), ExtraCount::ZERO, layout).unwrap();
    // Two chunks load into L1's two slots; the other two stay in the tier.
    assert_eq!(s.wait(id, WAIT).unwrap().hit_chunks, 4);
    tier.fail_loads_of(&[key_of(3)]);
    let failed = s.read_hit(id, 0, &keys(0..4), CHUNK);
    assert!(
        matches!(failed, Err(StorageError::Below(BelowError::LoadFailed { tier: 0 }))),
        "a failed load is an error for the whole read"
    );
    // What did not fail is still readable, and right.
    let chunks = s.read_hit(id, 0, &keys(0..3), CHUNK).unwrap();
    assert!(matches!(&chunks[2], HitChunk::Loaded(bytes) if **bytes == payload(&key_of(2), CHUNK)));
    drop(chunks);
    // A tier that does not answer: the read gives up after the lease's time to live.
    tier.hold_loads();
    let hung = s.read_hit(id, 0, &keys(2..3), CHUNK);
    assert!(matches!(hung, Err(StorageError::Below(BelowError::Timeout(_)))), "{:?}", hung.err());
    tier.release_held();
    // Meanwhile the lookup's L1 lease may have passed its deadline too, which ends the lookup.
    match s.release_all(id) {
        Ok(()) | Err(StorageError::UnknownLookup(_)) => {}
        Err(e) => panic!("{e}"),
    }
    eventually("the tier locks went back", || s.status().tiers[0].1.locks == 0);
    s.l1().audit().unwrap();
}

#[test]
fn a_reader_that_leaves_while_the_lookup_prefetches_returns_its_share_when_it_completes() {
    // Two readers (MLA over two TP ranks); the hit is in a lower tier whose loads are held, so
    // the lookup is still prefetching when reader 1's session ends.
    let (s, tier) = over_a_fake_tier_holding(keys(0..4), 4);
    tier.hold_loads();
    let layout = Layout::bytes(CHUNK).unwrap();
    let id =
        s.submit_prefetch(OWNER, keys(0..4), ExtraCount::new(1).unwrap(), layout.clone()).unwrap();
    assert!(s.query(id).unwrap().is_none(), "still prefetching");
    assert!(
        matches!(s.read_hit(id, 0, &keys(0..4), CHUNK), Err(StorageError::Pending(_))),
        "a read before the hit is known is told to wait"
    );
    assert!(!s.release(id, Readers::One(1)).unwrap(), "reader 0 still reads");
    assert!(matches!(
        s.release(id, Readers::One(1)),
        Err(StorageError::ShareReturned { reader: 1, .. })
    ));
    tier.release_held();
    assert_eq!(s.wait(id, WAIT).unwrap().hit_chunks, 4);
    assert!(matches!(
        s.read_hit(id, 1, &keys(0..4), CHUNK),
        Err(StorageError::ShareReturned { reader: 1, .. })
    ));
    let chunks = s.read_hit(id, 0, &keys(0..4), CHUNK).unwrap();
    for (key, chunk) in keys(0..4).iter().zip(chunks) {
        assert!(bytes_of(chunk) == payload(key, CHUNK), "{key:?} read other bytes");
    }
    assert!(s.release(id, Readers::One(0)).unwrap(), "the last reader ends it");
    assert!(!s.is_open(id));
    assert_eq!(s.l1().usage().leased, 0, "no share is left out");
    s.l1().audit().unwrap();
    // Both readers leaving before the hit is known end the lookup at once.
    tier.hold_loads();
    let id = s.submit_prefetch(OWNER, keys(0..4), ExtraCount::new(1).unwrap(), layout).unwrap();
    assert!(!s.release(id, Readers::One(0)).unwrap());
    assert!(s.release(id, Readers::One(1)).unwrap());
    assert!(!s.is_open(id));
    tier.release_held();
    eventually("the prefetch's leases went back", || s.l1().usage().leased == 0);
    s.l1().audit().unwrap();
}

#[test]
fn two_readers_waiting_on_one_prefetch_both_get_its_hit() {
    // MLA: each TP rank's session waits on the same lookup. The outcome goes to whichever
    // waiter takes it first; the other must get the hit too, not a timeout of its own.
    let (s, tier) = over_a_fake_tier_holding(keys(0..4), 8);
    let layout = Layout::bytes(CHUNK).unwrap();
    for round in 0..200 {
        tier.hold_loads();
        let extra = ExtraCount::new(1).unwrap();
        let id = s.submit_prefetch(OWNER, keys(0..4), extra, layout.clone()).unwrap();
        let hits: Vec<_> = std::thread::scope(|scope| {
            let waiters: Vec<_> =
                (0..2).map(|_| scope.spawn(|| s.wait(id, WAIT).map(|r| r.hit_chunks))).collect();
            std::thread::sleep(Duration::from_millis(1));
            tier.release_held();
            waiters.into_iter().map(|w| w.join().unwrap()).collect()
        });
        for hit in hits {
            assert_eq!(hit.ok(), Some(4), "round {round}: a waiter did not get the hit");
        }
        s.release_all(id).unwrap();
    }
}

/// A manager with an L1 of `l1_slots` over one fake lower tier that holds `held`.
fn over_a_fake_tier_holding(
    held: Vec<ObjectKey>,
    l1_slots: u64,
) -> (StorageManager, Arc<tierkv_testkit::FakeTier>) {
    let tier = Arc::new(tierkv_testkit::FakeTier::new("l2", 64, CHUNK));
    for key in held {
        tier.insert(key, payload(&key, CHUNK));
    }
    let config =
        StorageConfig { l2: None, disk: None, ..tiered(l1_slots, 4, None, StorePolicy::Cascade) };
    let tiers: Vec<Arc<dyn tierkv_core::TierAdapter>> = vec![tier.clone()];
    let s =
        StorageManager::start_with_tiers(config, Arc::new(tierkv_core::SystemClock::new()), tiers)
            .unwrap();
    (s, tier)
}

fn key_of(n: u64) -> ObjectKey {
    keys(n..n + 1)[0]
}

#[test]
fn the_tiers_below_l1_follow_one_judge_of_every_lookup() {
    let dir = tempfile::tempdir().unwrap();
    // L1 16 + L2 64 + disk 128 chunks: a judge of 208, whose shadows hold 52 sampled keys each.
    let s = StorageManager::start(config(16, StorePolicy::Cascade, &dir)).unwrap();
    let status = s.status();
    assert_eq!(status.judged_order, Some(Order::Recency), "recency until the judge says otherwise");
    assert_eq!(status.below_orders, vec![("l2", Order::Recency), ("disk", Order::Recency)]);
    // Lookups only (nothing is stored, so no tier evicts or judges on its own traffic): a hot
    // set of 120 chunks, each round followed by a scan of 240 chunks never asked for again,
    // which a cache of 208 in recency order loses the hot set to.
    let hot = keys(0..120);
    let mut fresh = 1_000;
    for _round in 0..60 {
        let mut lookups = vec![hot.clone()];
        for _ in 0..2 {
            lookups.push(keys(fresh..fresh + 120));
            fresh += 120;
        }
        for chunks in lookups {
            let result = lookup_all(&s, chunks);
            assert_eq!(result.hit_chunks, 0, "nothing was stored");
        }
    }
    let judged = s.status().judged_order.unwrap();
    assert_ne!(judged, Order::Recency);
    // L2 and the disk take the judge's order at their next eviction: fill them past their
    // room, in windows of L1's size, each handed down as L1 evicts it.
    for window in 0..20 {
        write(&s, &keys(100_000 + window * 16..100_000 + (window + 1) * 16));
    }
    // A tier below L1 takes ARC's order for any order but recency: what it could count is the
    // uses of what reached it, not the requests' uses.
    let expected = vec![("l2", Order::Arc), ("disk", Order::Arc)];
    eventually("L2 and the disk evicted", || {
        let status = s.status();
        status.store_in_flight == 0 && status.below_orders == expected
    });
    // A write-through store keeps copies in every tier as they come: nothing to judge.
    let dir = tempfile::tempdir().unwrap();
    let s = StorageManager::start(config(16, StorePolicy::WriteThrough, &dir)).unwrap();
    assert_eq!(s.status().judged_order, None);
}

#[test]
fn a_chunk_on_its_way_to_disk_is_still_served_with_or_without_l2() {
    // L1 and L2 of two chunks each over a disk that holds all the rest. Every store past the
    // fourth sends an L2 victim to the disk through the store pipeline; looked up at once, newest
    // first, before its disk write can have landed, it is still a hit (L2 serves it until the
    // disk has it), never a miss in neither tier, and its bytes are its own. Without an L2,
    // every store past the second sends an L1 victim straight to the disk, which serves it from
    // its copy until it is written.
    for l2 in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let config = tiered(2, 2, Some(&dir), StorePolicy::Cascade);
        let config = StorageConfig { l2: config.l2.filter(|_| l2), ..config };
        let s = StorageManager::start(config).unwrap();
        for n in 0..12 {
            write(&s, &keys(n..n + 1));
            for k in (0..=n).rev() {
                let result = lookup_all(&s, keys(k..k + 1));
                assert_eq!(result.hit_chunks, 1, "l2 {l2}: {k} missed after store {n}: {result:?}");
            }
        }
        eventually("the pipeline is idle", || s.status().store_in_flight == 0);
        s.l1().audit().unwrap();
    }
}
