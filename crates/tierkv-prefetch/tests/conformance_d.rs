//! CONFORMANCE D: the PrefetchController, one test per id, on the real L1Manager with a real
//! HostStore and DiskStore; the fault-injecting fake only where a scenario needs a failure or a
//! task held in flight (D9, D13, D14).

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::unbounded;
use tierkv_core::{
    Completion, ExtraCount, Layout, ManualClock, ObjectKey, StoreItem, TierAdapter, VecChunk,
};
use tierkv_disk::{BLOCK, DiskStore, DiskStoreConfig, record_bytes};
use tierkv_l1::{DeviceKind, L1Config, L1Context, L1Manager, OwnerId, Presence, Readers};
use tierkv_l2::{HostMemory, HostStore, HostStoreConfig};
use tierkv_prefetch::{
    PrefetchConfig, PrefetchController, PrefetchError, PrefetchRequest, Prefetched, TierRouter,
};
use tierkv_testkit::contract::{key, keys, payload};
use tierkv_testkit::metrics::counter;
use tierkv_testkit::{FakeTier, eventually};

const CHUNK: u64 = 16 << 10;
const OWNER: OwnerId = OwnerId(7);
const WAIT: Duration = Duration::from_secs(20);

struct Rig {
    l1: Arc<L1Manager>,
    router: Arc<TierRouter>,
    prefetch: PrefetchController,
    _dirs: Vec<tempfile::TempDir>,
}

fn l1(slots: u64) -> Arc<L1Manager> {
    let config = L1Config { device: DeviceKind::Emulated, ..L1Config::new(slots * CHUNK, CHUNK) };
    Arc::new(L1Manager::build(config, L1Context::default()).unwrap())
}

fn host() -> Arc<dyn TierAdapter> {
    let config =
        HostStoreConfig { memory: HostMemory::Plain, ..HostStoreConfig::new(64 * CHUNK, CHUNK) };
    Arc::new(HostStore::open(config).unwrap())
}

fn disk(dir: &tempfile::TempDir) -> Arc<dyn TierAdapter> {
    let segment_bytes = BLOCK + 8 * record_bytes(CHUNK);
    let config = DiskStoreConfig {
        segment_bytes,
        ..DiskStoreConfig::new(dir.path(), 8 * segment_bytes, CHUNK)
    };
    Arc::new(DiskStore::open(config).unwrap())
}

fn rig_with(
    tiers: Vec<Arc<dyn TierAdapter>>,
    dirs: Vec<tempfile::TempDir>,
    config: PrefetchConfig,
) -> Rig {
    let l1 = l1(32);
    let router = Arc::new(TierRouter::start(tiers).unwrap());
    let prefetch = PrefetchController::start(l1.clone(), router.clone(), config).unwrap();
    Rig { l1, router, prefetch, _dirs: dirs }
}

/// A rig over the fake `tiers` whose request timeout is measured on `clock`.
fn rig_with_clock(
    tiers: Vec<Arc<dyn TierAdapter>>,
    config: PrefetchConfig,
    clock: Arc<ManualClock>,
) -> Rig {
    let l1 = l1(32);
    let router = Arc::new(TierRouter::start(tiers).unwrap());
    let prefetch =
        PrefetchController::start_with_clock(l1.clone(), router.clone(), config, clock).unwrap();
    Rig { l1, router, prefetch, _dirs: vec![] }
}

/// A rig with the HostStore as its only lower tier.
fn rig_l2() -> Rig {
    rig_with(vec![host()], vec![], PrefetchConfig::default())
}

/// A rig with the HostStore and then the DiskStore.
fn rig_l2_disk() -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let disk = disk(&dir);
    rig_with(vec![host(), disk], vec![dir], PrefetchConfig::default())
}

/// A fault-injecting tier named `name` holding `keys`, each with its payload.
fn fake_holding(name: &str, keys: Vec<ObjectKey>) -> Arc<FakeTier> {
    let fake = Arc::new(FakeTier::new(name, 64, CHUNK));
    for k in keys {
        fake.insert(k, payload(&k, CHUNK));
    }
    fake
}

impl Rig {
    /// Stores `keys` into tier `tier` with `bytes(key)`, through the router.
    fn seed_with(&self, tier: usize, keys: &[ObjectKey], bytes: impl Fn(&ObjectKey) -> Vec<u8>) {
        let (reply, done) = unbounded();
        let items: Vec<StoreItem> = keys
            .iter()
            .map(|k| StoreItem { key: *k, source: Box::new(VecChunk(bytes(k))) })
            .collect();
        self.router.submit(tier, &reply, |t| t.submit_store(items)).unwrap();
        match done.recv_timeout(WAIT).unwrap().completion {
            Completion::Stored { result, .. } => result.unwrap(),
            _ => panic!("not a store completion"),
        }
    }

    fn seed(&self, tier: usize, keys: &[ObjectKey]) {
        self.seed_with(tier, keys, |k| payload(k, CHUNK));
    }

    fn prefetch(&self, keys: Vec<ObjectKey>, extra: i64) -> Prefetched {
        let request = PrefetchRequest::prefix(
            OWNER,
            ExtraCount::new(extra).unwrap(),
            Layout::bytes(CHUNK).unwrap(),
            keys,
        );
        let id = self.prefetch.submit(request).unwrap();
        self.prefetch.wait(id, WAIT).unwrap()
    }

    fn bytes(&self, result: &Prefetched, reader: u8, key: &ObjectKey) -> Vec<u8> {
        let guard = self.l1.read_access(result.lease.unwrap(), reader, key).unwrap();
        let mut bytes = vec![0; CHUNK as usize];
        guard.read_at(0, &mut bytes).unwrap();
        bytes
    }

    fn locks(&self) -> Vec<u64> {
        self.router.tiers().map(|t| t.usage().locks).collect()
    }

    fn absent(&self, keys: &[ObjectKey]) -> bool {
        keys.iter().all(|k| self.l1.presence(k) == Presence::Absent)
    }
}

#[test]
fn d1_starts_and_stops_cleanly_with_one_adapter_and_with_none() {
    let one = rig_l2();
    one.prefetch.stop();
    one.prefetch.stop();
    let none = rig_with(vec![], vec![], PrefetchConfig::default());
    let started = Instant::now();
    none.prefetch.stop();
    assert!(started.elapsed() < Duration::from_secs(2));
    let request =
        PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, Layout::bytes(CHUNK).unwrap(), keys(0..1));
    assert_eq!(none.prefetch.submit(request), Err(PrefetchError::Stopped));
}

#[test]
fn d2_five_keys_in_the_lower_tier_are_five_hits_all_leased() {
    let rig = rig_l2();
    rig.seed(0, &keys(0..5));
    let result = rig.prefetch(keys(0..5), 0);
    assert_eq!(result.hit_chunks, 5);
    for k in keys(0..5) {
        assert_eq!(rig.l1.presence(&k), Presence::Ready { shares: 1, temporary: true });
        assert_eq!(rig.bytes(&result, 0, &k), payload(&k, CHUNK));
    }
    assert_eq!(rig.locks(), vec![0]);
}

#[test]
fn d3_a_gap_trims_the_hit_to_the_leading_run() {
    let rig = rig_l2();
    rig.seed(0, &[key(0), key(1), key(3), key(4)]);
    let result = rig.prefetch(keys(0..5), 0);
    assert_eq!(result.hit_chunks, 2);
    assert_eq!(result.leased, vec![vec![true, true, false, false, false]]);
    assert!(matches!(rig.l1.presence(&key(1)), Presence::Ready { shares: 1, .. }));
    assert!(rig.absent(&keys(2..5)), "keys past the gap were promoted");
    assert_eq!(rig.locks(), vec![0], "keys past the gap are unlocked in the tier");
}

#[test]
fn d4_a_missing_first_key_is_zero_hits() {
    let rig = rig_l2();
    rig.seed(0, &keys(1..4));
    let result = rig.prefetch(keys(0..4), 0);
    assert_eq!((result.hit_chunks, result.lease), (0, None));
    assert!(rig.absent(&keys(0..4)));
    assert_eq!(rig.l1.usage().used_bytes, 0);
    assert_eq!(rig.locks(), vec![0]);
}

#[test]
fn d5_two_tiers_combine_and_overlaps_come_from_the_faster() {
    let rig = rig_l2_disk();
    rig.seed(0, &keys(0..2));
    rig.seed(1, &keys(2..4));
    let result = rig.prefetch(keys(0..4), 0);
    assert_eq!(result.hit_chunks, 4);
    for k in keys(0..4) {
        assert_eq!(rig.bytes(&result, 0, &k), payload(&k, CHUNK));
    }
    rig.l1.release_lease(result.lease.unwrap()).unwrap();

    // Overlap: key 11 in both tiers. The disk's copy is marked, so the bytes tell the source.
    let rig = rig_l2_disk();
    rig.seed(0, &[key(10), key(11)]);
    rig.seed_with(1, &[key(11), key(12)], |k| {
        if *k == key(11) { vec![0xdd; CHUNK as usize] } else { payload(k, CHUNK) }
    });
    let result = rig.prefetch(keys(10..13), 0);
    assert_eq!(result.hit_chunks, 3);
    assert_eq!(
        rig.bytes(&result, 0, &key(11)),
        payload(&key(11), CHUNK),
        "key 11 came from the slower tier"
    );
    assert_eq!(rig.bytes(&result, 0, &key(12)), payload(&key(12), CHUNK));
    assert_eq!(rig.locks(), vec![0, 0]);
}

#[test]
fn d6_no_hits_and_no_tiers_complete_at_once() {
    let rig = rig_l2();
    let started = Instant::now();
    assert_eq!(rig.prefetch(keys(0..3), 0).hit_chunks, 0);
    let none = rig_with(vec![], vec![], PrefetchConfig::default());
    assert_eq!(none.prefetch(keys(0..3), 0).hit_chunks, 0);
    // "At once": on the controller's thread, waiting for no deadline (a request's is 30 s).
    assert!(started.elapsed() < PrefetchConfig::default().request_timeout / 15);
}

#[test]
fn d7_a_result_is_handed_out_once() {
    let rig = rig_l2();
    rig.seed(0, &keys(0..2));
    let request =
        PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, Layout::bytes(CHUNK).unwrap(), keys(0..2));
    let id = rig.prefetch.submit(request).unwrap();
    let deadline = Instant::now() + WAIT;
    let first = loop {
        if let Some(outcome) = rig.prefetch.query(id) {
            break outcome;
        }
        assert!(Instant::now() < deadline, "the prefetch never finished");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(first.unwrap().hit_chunks, 2);
    assert_eq!(rig.prefetch.query(id), None, "a second query yields nothing");
    assert_eq!(
        rig.prefetch.query(tierkv_prefetch::RequestId(999_999)),
        None,
        "an unknown id yields nothing"
    );
    assert!(matches!(
        rig.prefetch.wait(id, Duration::from_millis(10)),
        Err(PrefetchError::Invalid(_))
    ));
}

#[test]
fn d8_no_tier_holds_a_lock_after_any_kind_of_request() {
    let rig = rig_l2_disk();
    rig.seed(0, &keys(0..3));
    rig.seed(1, &keys(2..6));
    rig.seed(0, &[key(8)]);
    let full = rig.prefetch(keys(0..6), 0); // full hit, overlap on key 2
    let trimmed = rig.prefetch(vec![key(8), key(9), key(3)], 0); // trimmed after key 8
    let zero = rig.prefetch(vec![key(20), key(0)], 0); // zero hits
    assert_eq!((full.hit_chunks, trimmed.hit_chunks, zero.hit_chunks), (6, 1, 0));
    assert_eq!(rig.locks(), vec![0, 0]);
}

#[test]
fn d9_max_in_flight_two_runs_four_requests_in_submission_order() {
    let fake = fake_holding("fake", keys(0..8));
    fake.hold();
    let config = PrefetchConfig { max_in_flight: 2, ..PrefetchConfig::default() };
    let rig = rig_with(vec![fake.clone()], vec![], config);
    let ids: Vec<_> = (0..4)
        .map(|r| {
            let request = PrefetchRequest::prefix(
                OWNER,
                ExtraCount::ZERO,
                Layout::bytes(CHUNK).unwrap(),
                keys(2 * r..2 * r + 2),
            );
            rig.prefetch.submit(request).unwrap()
        })
        .collect();
    let deadline = Instant::now() + WAIT;
    while fake.held_tasks() < 2 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(fake.held_tasks(), 2, "only two requests may be in flight");
    fake.release_held();
    for (n, id) in ids.into_iter().enumerate() {
        let result = rig.prefetch.wait(id, WAIT).unwrap();
        assert_eq!(result.hit_chunks, 2);
        assert_eq!(result.started, n as u64, "requests start in submission order");
    }
    assert_eq!(rig.locks(), vec![0]);
}

#[test]
fn d10_extra_count_sets_the_releases_needed_per_loaded_key() {
    for extra in [0u8, 1, 3] {
        let rig = rig_l2();
        rig.seed(0, &keys(0..2));
        let result = rig.prefetch(keys(0..2), i64::from(extra));
        assert_eq!(result.readers, 1 + u32::from(extra));
        let lease = result.lease.unwrap();
        for reader in 0..=extra {
            assert!(
                matches!(rig.l1.presence(&key(0)), Presence::Ready { .. }),
                "freed before reader {reader}"
            );
            rig.l1.finish_read(lease, Readers::One(reader), None).unwrap();
        }
        assert!(rig.absent(&keys(0..2)), "temporary objects are freed by their last release");
    }
}

#[test]
fn d11_extra_count_one_with_a_gap() {
    let rig = rig_l2();
    rig.seed(0, &[key(0), key(1), key(3), key(4)]);
    let result = rig.prefetch(keys(0..5), 1);
    assert_eq!(result.hit_chunks, 2);
    for k in keys(0..2) {
        assert_eq!(rig.l1.presence(&k), Presence::Ready { shares: 2, temporary: true });
    }
    assert!(rig.absent(&keys(2..5)));
    let lease = result.lease.unwrap();
    rig.l1.finish_read(lease, Readers::One(0), None).unwrap();
    assert!(matches!(rig.l1.presence(&key(0)), Presence::Ready { shares: 1, .. }));
    rig.l1.finish_read(lease, Readers::One(1), None).unwrap();
    assert!(rig.absent(&keys(0..2)));
}

#[test]
fn d12_a_key_being_written_in_l1_trims_the_hit() {
    let rig = rig_l2();
    rig.seed(0, &keys(0..3));
    let writer = OwnerId(99);
    let layout = Layout::bytes(CHUNK).unwrap();
    let reserved = rig.l1.reserve_write(
        writer,
        &[key(1)],
        &layout,
        tierkv_l1::WriteMode::Create,
        tierkv_l1::Lifetime::Cached,
    );
    assert!(reserved.unwrap()[0].is_ok());
    let result = rig.prefetch(keys(0..3), 1);
    assert_eq!(result.hit_chunks, 1);
    assert_eq!(
        rig.l1.presence(&key(0)),
        Presence::Ready { shares: 2, temporary: true },
        "all shares taken"
    );
    assert_eq!(
        rig.l1.presence(&key(1)),
        Presence::Writing,
        "the other writer's reservation is untouched"
    );
    assert!(rig.absent(&[key(2)]), "key 2 was not left behind in L1");
    assert_eq!(rig.locks(), vec![0]);
}

#[test]
fn d13_a_failed_load_is_never_visible_and_what_loaded_past_it_is_released() {
    let fake = fake_holding("fake", keys(0..3));
    fake.fail_loads_of(&[key(1)]);
    let rig = rig_with(vec![fake.clone()], vec![], PrefetchConfig::default());
    let result = rig.prefetch(keys(0..3), 2);
    assert_eq!(result.hit_chunks, 1);
    assert_eq!(rig.l1.presence(&key(0)), Presence::Ready { shares: 3, temporary: true });
    assert!(rig.absent(&keys(1..3)), "the failed key and the one loaded past it are gone");
    assert_eq!(rig.bytes(&result, 2, &key(0)), payload(&key(0), CHUNK));
    assert_eq!(rig.locks(), vec![0]);
    rig.l1.audit().unwrap();
}

#[test]
fn d14_stop_with_requests_in_flight_neither_hangs_nor_leaks() {
    let fake = fake_holding("fake", keys(0..4));
    fake.hold_loads();
    let config =
        PrefetchConfig { drain_timeout: Duration::from_millis(200), ..PrefetchConfig::default() };
    let rig = rig_with(vec![fake.clone()], vec![], config);
    let request =
        PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, Layout::bytes(CHUNK).unwrap(), keys(0..4));
    let id = rig.prefetch.submit(request).unwrap();
    let deadline = Instant::now() + WAIT;
    while fake.held_tasks() == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    // The load is in flight: four temporary slots are reserved and four tier locks are held.
    assert_eq!(rig.l1.usage().writing, 4);
    assert_eq!(rig.locks(), vec![4]);
    let started = Instant::now();
    rig.prefetch.stop();
    assert!(started.elapsed() < Duration::from_secs(5), "stop hung");
    assert_eq!(rig.prefetch.wait(id, WAIT), Err(PrefetchError::Stopped));
    assert!(rig.absent(&keys(0..4)), "every reservation was aborted");
    assert_eq!(rig.locks(), vec![0], "every tier lock was returned");
    // The tier gives the sinks back when it closes; then the slots are free again.
    fake.close();
    let deadline = Instant::now() + WAIT;
    while rig.l1.usage().free_bytes != rig.l1.usage().capacity_bytes {
        assert!(Instant::now() < deadline, "slots stayed pinned: {:?}", rig.l1.usage());
        std::thread::sleep(Duration::from_millis(5));
    }
    rig.l1.audit().unwrap();
}

/// The rule for waits: a timed-out wait must not orphan the lease. The outcome stays
/// claimable; the lease in it belongs to the request's owner from the start, so the owner's
/// release (a disconnect) returns its shares if nobody ever claims it.
#[test]
fn a_timed_out_wait_leaves_the_result_claimable_and_the_lease_owned() {
    let fake = fake_holding("fake", keys(0..4));
    fake.hold_loads();
    let rig = rig_with(vec![fake.clone()], vec![], PrefetchConfig::default());
    let submit = |range| {
        let request = PrefetchRequest::prefix(
            OWNER,
            ExtraCount::ZERO,
            Layout::bytes(CHUNK).unwrap(),
            keys(range),
        );
        rig.prefetch.submit(request).unwrap()
    };
    let claimed = submit(0..2);
    let abandoned = submit(2..4);
    assert_eq!(rig.prefetch.wait(claimed, Duration::from_millis(50)), Err(PrefetchError::Timeout));
    fake.release_held();
    let result = rig.prefetch.wait(claimed, WAIT).unwrap();
    assert_eq!(result.hit_chunks, 2, "the result outlived the timed-out wait");
    // Nobody claims the other one; its owner goes away, and the shares come back.
    let deadline = Instant::now() + WAIT;
    while rig.l1.presence(&key(3)) == Presence::Absent
        || rig.l1.presence(&key(3)) == Presence::Writing
    {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    let released = rig.l1.release_owner(OWNER);
    assert_eq!(released.leases, 2, "both leases belonged to the owner");
    assert!(rig.absent(&keys(0..4)));
    assert!(
        rig.prefetch.wait(abandoned, WAIT).is_ok(),
        "still claimable, though its shares are back"
    );
}

/// A tier that panics when asked to unlock: a bug inside the controller thread's reach.
#[test]
fn a_tier_that_panics_returning_locks_costs_those_locks_and_nothing_else() {
    let fake = fake_holding("fake", keys(0..4));
    fake.panic_on_unlock();
    let rig = rig_with(vec![fake.clone()], vec![], PrefetchConfig::default());
    // A gap makes the controller return the lock of the key past it, and the tier panics.
    // (Before, that panic stopped the controller and failed every request in it.)
    let request = PrefetchRequest::prefix(
        OWNER,
        ExtraCount::ZERO,
        Layout::bytes(CHUNK).unwrap(),
        vec![key(0), key(9), key(1)],
    );
    let id = rig.prefetch.submit(request).unwrap();
    let result = rig.prefetch.wait(id, WAIT).unwrap();
    assert_eq!(result.hit_chunks, 1);
    assert_eq!(rig.bytes(&result, 0, &key(0)), payload(&key(0), CHUNK));
    assert!(rig.absent(&keys(1..4)), "nothing past the gap was promoted");
    // The controller goes on.
    assert_eq!(rig.prefetch(keys(2..4), 0).hit_chunks, 2);
    rig.l1.audit().unwrap();
}

#[test]
fn a_tier_that_panics_taking_a_lookup_is_a_miss_there_and_the_others_still_serve() {
    let broken = fake_holding("broken", keys(0..2));
    let good = fake_holding("good", keys(0..2));
    broken.panic_on_lookup();
    let rig = rig_with(vec![broken, good.clone()], vec![], PrefetchConfig::default());
    let result = rig.prefetch(keys(0..2), 0);
    assert_eq!(result.hit_chunks, 2, "served by the tier that did not panic");
    assert_eq!(rig.bytes(&result, 0, &key(1)), payload(&key(1), CHUNK));
    assert_eq!(good.usage().locks, 0);
    rig.l1.audit().unwrap();
}

/// Issue 16 #15: a lookup-and-lock still in flight when a stop gives up (past the drain timeout)
/// answers later with locks; nobody else will unlock them, so the controller's leftovers do.
#[test]
fn h16_15_locks_of_a_lookup_that_answers_after_the_drain_timeout_are_returned() {
    let fake = fake_holding("fake", keys(0..4));
    fake.hold();
    let config = PrefetchConfig { drain_timeout: Duration::ZERO, ..PrefetchConfig::default() };
    let rig = rig_with(vec![fake.clone()], vec![], config);
    let request =
        PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, Layout::bytes(CHUNK).unwrap(), keys(0..4));
    let id = rig.prefetch.submit(request).unwrap();
    let deadline = Instant::now() + WAIT;
    while fake.held_tasks() == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    rig.prefetch.stop();
    assert_eq!(rig.prefetch.wait(id, WAIT), Err(PrefetchError::Stopped));
    // The lookup runs now, after the controller gave its request up, and locks four keys.
    fake.release_held();
    while fake.usage().locks != 0 {
        assert!(Instant::now() < deadline, "late locks stay held: {:?}", fake.usage());
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A request's allowance of L1 slots (`max_promoted`, a session's lease budget in the daemon):
/// the hit past it stays in its tier under the lock it has, and the hit is still whole.
#[test]
fn a_hit_past_the_requests_allowance_of_l1_slots_is_held_in_its_tier() {
    let rig = rig_l2();
    rig.seed(0, &keys(0..5));
    let layout = Layout::bytes(CHUNK).unwrap();
    let mut request = PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, layout, keys(0..5));
    request.max_promoted = 2;
    let id = rig.prefetch.submit(request).unwrap();
    let result = rig.prefetch.wait(id, WAIT).unwrap();
    assert_eq!(result.hit_chunks, 5);
    assert_eq!(result.leased[0], vec![true, true, false, false, false], "the root first");
    let below = result.below.as_ref().unwrap();
    assert_eq!(below.len(), 3);
    assert!(keys(2..5).iter().all(|k| below.tier_of(k) == Some(0)));
    assert!(rig.absent(&keys(2..5)), "nothing past the allowance took an L1 slot");
    assert_eq!(rig.locks(), vec![3], "the chunks held below keep their locks");
    assert_eq!(rig.bytes(&result, 0, &key(1)), payload(&key(1), CHUNK));
    rig.l1.finish_read(result.lease.unwrap(), Readers::One(0), None).unwrap();
    drop(result);
    assert_eq!(rig.locks(), vec![0], "every lock back once the result goes");
}

#[test]
fn a_load_into_a_reservation_its_owner_lost_never_finishes_a_later_one_of_the_key() {
    // Tier 0 will hold key 0 but fail to load it; tier 1 holds keys 0 and 1 and holds loads.
    let x = fake_holding("x", Vec::new());
    let y = fake_holding("y", keys(0..2));
    x.fail_loads_of(&[key(0)]);
    y.hold_loads();
    let rig = rig_with(vec![x.clone(), y.clone()], vec![], PrefetchConfig::default());
    let submit = |keys: Vec<ObjectKey>| {
        let request =
            PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, Layout::bytes(CHUNK).unwrap(), keys);
        rig.prefetch.submit(request).unwrap()
    };
    // A reserves key 0 and loads it from tier 1; meanwhile its owner's client disconnects.
    let a = submit(vec![key(0)]);
    eventually("A's load is held", || y.held_tasks() == 1);
    rig.l1.release_owner(OWNER);
    // B, of the same owner, reserves key 0 again (to load from tier 0, which fails at once)
    // and key 1 (from tier 1, held).
    x.insert(key(0), payload(&key(0), CHUNK));
    let b = submit(keys(0..2));
    eventually("B's load is held too", || y.held_tasks() == 2);
    // Time for B's failed load of key 0 to come back, so its slot has no writer left.
    std::thread::sleep(Duration::from_millis(100));
    y.release_held();
    let a = rig.prefetch.wait(a, WAIT).unwrap();
    let b = rig.prefetch.wait(b, WAIT).unwrap();
    // A's reservation was gone: B's slot of key 0, which nobody wrote, is not A's hit.
    assert_eq!(a.hit_chunks, 0, "A loaded into a reservation it no longer had");
    assert_eq!(b.hit_chunks, 0, "B's first key failed to load");
    assert!(rig.absent(&keys(0..2)), "nothing unwritten is visible");
    assert_eq!(rig.locks(), vec![0, 0]);
    rig.l1.audit().unwrap();
}

#[test]
fn a_chunk_that_moves_down_while_it_is_looked_up_is_found_in_the_tier_below() {
    // Under the cascade a chunk leaves L2 for the disk: the disk indexes it, then L2 stops
    // serving its copy on its way. Asked both at once, the disk could answer before the chunk
    // arrived and L2 after it left: a miss in both tiers for a chunk the node still holds
    // (about 6 runs in 100 of `a_chunk_on_its_way_to_disk_is_still_served_with_or_without_l2`
    // in tierkv-storage). Here the upper tier holds its lookups while both chunks move down.
    let upper = fake_holding("upper", keys(0..2));
    let lower = fake_holding("lower", vec![]);
    upper.hold();
    let config = PrefetchConfig { max_in_flight: 2, ..PrefetchConfig::default() };
    let rig = rig_with(vec![upper.clone(), lower.clone()], vec![], config);
    let layout = Layout::bytes(CHUNK).unwrap();
    let submit = |keys: Vec<ObjectKey>| {
        let request = PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, layout.clone(), keys);
        rig.prefetch.submit(request).unwrap()
    };
    let first = submit(keys(0..1));
    let second = submit(keys(1..2));
    // The controller starts its requests one after the other: once the second has asked the
    // upper tier, the first has asked every tier it asks before hearing from the upper one.
    eventually("both lookups wait on the upper tier", || upper.held_tasks() == 2);
    for k in keys(0..2) {
        lower.insert(k, payload(&k, CHUNK));
        assert_eq!(upper.delete(&[k]), 1, "{k:?} left the upper tier");
    }
    upper.release_held();
    for (id, k) in [(first, key(0)), (second, key(1))] {
        let result = rig.prefetch.wait(id, WAIT).unwrap();
        assert_eq!(result.hit_chunks, 1, "{k:?} missed in both tiers: {:?}", result.per_tier);
        assert_eq!(result.per_tier, vec![0, 1], "served by the tier it moved to");
        assert_eq!(rig.bytes(&result, 0, &k), payload(&k, CHUNK));
        rig.l1.release_lease(result.lease.unwrap()).unwrap();
    }
    assert_eq!(rig.locks(), vec![0, 0]);
    rig.l1.audit().unwrap();
}

#[test]
fn a_request_a_tier_never_answers_is_given_up_and_its_locks_come_back_when_it_does() {
    let stuck = fake_holding("stuck", keys(0..4));
    let good = fake_holding("good", keys(0..4));
    stuck.hold();
    let config = PrefetchConfig {
        max_in_flight: 1,
        request_timeout: Duration::from_millis(200),
        ..PrefetchConfig::default()
    };
    let rig = rig_with(vec![stuck.clone(), good.clone()], vec![], config);
    let request =
        PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, Layout::bytes(CHUNK).unwrap(), keys(0..2));
    let id = rig.prefetch.submit(request).unwrap();
    match rig.prefetch.wait(id, WAIT) {
        Err(PrefetchError::NoAnswer(_)) => {}
        other => panic!("a request a tier never answers ended {other:?}"),
    }
    assert_eq!(good.usage().locks, 0, "the tier that answered has its locks back");
    assert!(rig.absent(&keys(0..2)));
    // Its place in flight is free, and the tier's late answer returns the locks it took.
    stuck.release_held();
    eventually("the late lookup's locks come back", || stuck.usage().locks == 0);
    assert_eq!(rig.prefetch(keys(2..4), 0).hit_chunks, 2);
    assert_eq!(rig.locks(), vec![0, 0]);
    rig.l1.audit().unwrap();
}

#[test]
fn the_loaded_chunks_counter_counts_promotions_not_chunks_held_below() {
    // tierkv_prefetch_loaded_chunks_total: "chunks promoted from a lower tier into an L1 lease".
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (rig, fake) = metrics::with_local_recorder(&recorder, || {
        let fake = fake_holding("fake", keys(0..4));
        (rig_with(vec![fake.clone()], vec![], PrefetchConfig::default()), fake)
    });
    let layout = Layout::bytes(CHUNK).unwrap();
    let mut below = PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, layout.clone(), keys(0..2));
    below.max_promoted = 0;
    let held = rig.prefetch.submit(below).unwrap();
    let held = rig.prefetch.wait(held, WAIT).unwrap();
    assert_eq!(held.below.as_ref().map(|b| b.len()), Some(2));
    let promoted = PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, layout, keys(2..4));
    let promoted = rig.prefetch.submit(promoted).unwrap();
    assert_eq!(rig.prefetch.wait(promoted, WAIT).unwrap().hit_chunks, 2);
    let counted: u64 = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, ..)| k.key().name() == "tierkv_prefetch_loaded_chunks_total")
        .map(|(.., v)| match v {
            metrics_util::debugging::DebugValue::Counter(n) => n,
            _ => 0,
        })
        .sum();
    assert_eq!(counted, 2, "the two held below are not promotions");
    drop((held, fake));
}

/// `tierkv_errors_total{reason="prefetch_failed"}` as `snapshotter` counted it.
fn prefetch_failures(snapshotter: &metrics_util::debugging::Snapshotter) -> u64 {
    let seen = snapshotter.snapshot().into_vec();
    counter(&seen, "tierkv_errors_total", &[("reason", "prefetch_failed")])
}

/// Every request that ends in an error counts once, however it ended: given up in flight or
/// given up still queued. A stop ends requests without failing them, in flight (past the
/// drain timeout) or queued alike: it counted the first and not the second.
#[test]
fn prefetch_failed_counts_each_failed_request_once_and_none_a_stop_ended() {
    let layout = Layout::bytes(CHUNK).unwrap();
    let request =
        |range| PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, layout.clone(), keys(range));

    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let stuck = fake_holding("stuck", keys(0..4));
    stuck.hold();
    let config = PrefetchConfig {
        max_in_flight: 1,
        request_timeout: Duration::from_millis(200),
        ..PrefetchConfig::default()
    };
    let rig =
        metrics::with_local_recorder(&recorder, || rig_with(vec![stuck.clone()], vec![], config));
    let in_flight = rig.prefetch.submit(request(0..2)).unwrap();
    let queued = rig.prefetch.submit(request(2..4)).unwrap();
    assert!(matches!(rig.prefetch.wait(in_flight, WAIT), Err(PrefetchError::NoAnswer(_))));
    assert!(matches!(rig.prefetch.wait(queued, WAIT), Err(PrefetchError::Failed(_))));
    assert_eq!(prefetch_failures(&snapshotter), 2, "two requests given up");
    stuck.release_held();

    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let held = fake_holding("held", keys(0..4));
    held.hold_loads();
    let config = PrefetchConfig {
        max_in_flight: 1,
        drain_timeout: Duration::from_millis(200),
        ..PrefetchConfig::default()
    };
    let rig =
        metrics::with_local_recorder(&recorder, || rig_with(vec![held.clone()], vec![], config));
    let in_flight = rig.prefetch.submit(request(0..2)).unwrap();
    eventually("the load is in flight", || held.held_tasks() > 0);
    let queued = rig.prefetch.submit(request(2..4)).unwrap();
    rig.prefetch.stop();
    assert_eq!(rig.prefetch.wait(in_flight, WAIT), Err(PrefetchError::Stopped));
    assert_eq!(rig.prefetch.wait(queued, WAIT), Err(PrefetchError::Stopped));
    assert_eq!(prefetch_failures(&snapshotter), 0, "a stop fails no request");
    held.close();
}

#[test]
fn a_tier_that_panics_taking_a_load_of_a_chunk_held_below_fails_each_reader_at_once() {
    let fake = fake_holding("fake", keys(0..2));
    let rig = rig_with(vec![fake.clone()], vec![], PrefetchConfig::default());
    let layout = Layout::bytes(CHUNK).unwrap();
    let mut request =
        PrefetchRequest::prefix(OWNER, ExtraCount::new(1).unwrap(), layout, keys(0..2));
    request.max_promoted = 0;
    let id = rig.prefetch.submit(request).unwrap();
    let result = rig.prefetch.wait(id, WAIT).unwrap();
    let below = result.below.as_ref().unwrap();
    assert_eq!(below.len(), 2);
    fake.panic_on_load();
    // Two readers: the first's claim of the chunks must not outlive its failed load, or the
    // second would wait on it for the whole timeout.
    for reader in 0..2 {
        let read = below.read(&keys(0..2), CHUNK, WAIT, 2);
        assert!(
            matches!(read, Err(tierkv_prefetch::BelowError::LoadFailed { tier: 0 })),
            "reader {reader}: {read:?}"
        );
    }
    drop(result);
    assert_eq!(rig.locks(), vec![0]);
}

#[test]
fn a_chunk_held_below_whose_sink_the_tier_lost_is_not_served() {
    let fake = fake_holding("fake", keys(0..2));
    fake.lose_a_sink_of_loads();
    let rig = rig_with(vec![fake], vec![], PrefetchConfig::default());
    let layout = Layout::bytes(CHUNK).unwrap();
    let mut request = PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, layout, keys(0..2));
    request.max_promoted = 0;
    let id = rig.prefetch.submit(request).unwrap();
    let result = rig.prefetch.wait(id, WAIT).unwrap();
    let below = result.below.as_ref().unwrap();
    let read = below.read(&keys(0..2), CHUNK, WAIT, 1);
    assert!(
        matches!(read, Err(tierkv_prefetch::BelowError::LoadFailed { tier: 0 })),
        "a half-written chunk was served: {:?}",
        read.map(|chunks| chunks.iter().map(|c| c[0]).collect::<Vec<_>>())
    );
}

#[test]
fn a_lone_tier_that_panics_taking_a_lookup_is_a_miss_at_once() {
    let broken = fake_holding("broken", keys(0..2));
    broken.panic_on_lookup();
    let rig = rig_with(vec![broken], vec![], PrefetchConfig::default());
    // No tier answers: the request is planned at once, not left to the request timeout.
    let started = Instant::now();
    assert_eq!(rig.prefetch(keys(0..2), 0).hit_chunks, 0);
    assert!(started.elapsed() < PrefetchConfig::default().request_timeout);
    rig.l1.audit().unwrap();
}

#[test]
fn a_long_queue_of_requests_planned_at_once_does_not_recurse() {
    // Requests no tier looks up are planned at once, and a finished request starts the next
    // pending one: ten thousand of them queued behind one held request ran one stack frame
    // deeper each, and overflowed the controller thread's stack (aborting the process).
    let slow = fake_holding("slow", keys(0..1));
    slow.hold();
    let config = PrefetchConfig { max_in_flight: 1, ..PrefetchConfig::default() };
    let rig = rig_with(vec![slow.clone()], vec![], config);
    let layout = Layout::bytes(CHUNK).unwrap();
    let first = rig
        .prefetch
        .submit(PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, layout.clone(), keys(0..1)))
        .unwrap();
    eventually("the first request is held", || slow.held_tasks() == 1);
    let queued: Vec<_> = (0..10_000)
        .map(|_| {
            let empty = PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, layout.clone(), vec![]);
            rig.prefetch.submit(empty).unwrap()
        })
        .collect();
    slow.release_held();
    assert_eq!(rig.prefetch.wait(first, WAIT).unwrap().hit_chunks, 1);
    for id in queued {
        assert_eq!(rig.prefetch.wait(id, WAIT).unwrap().hit_chunks, 0);
    }
}

#[test]
fn a_large_load_is_given_time_for_its_bytes_past_the_request_timeout() {
    // A tier answers a load once, when all of it is in: 64 MiB from a slow disk is silent for
    // as long as it loads. The request timeout (300 ms) plus a second per 64 MiB is its due.
    const BIG: u64 = 4 << 20;
    let slow = Arc::new(FakeTier::new("slow", 16, BIG));
    for k in keys(0..16) {
        slow.insert(k, payload(&k, BIG));
    }
    slow.hold_loads();
    let l1 = Arc::new(
        L1Manager::build(
            L1Config { device: DeviceKind::Emulated, ..L1Config::new(16 * BIG, BIG) },
            L1Context::default(),
        )
        .unwrap(),
    );
    let router = Arc::new(TierRouter::start(vec![slow.clone() as Arc<dyn TierAdapter>]).unwrap());
    let config =
        PrefetchConfig { request_timeout: Duration::from_millis(300), ..PrefetchConfig::default() };
    let prefetch = PrefetchController::start(l1.clone(), router, config).unwrap();
    let request =
        PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, Layout::bytes(BIG).unwrap(), keys(0..16));
    let id = prefetch.submit(request).unwrap();
    eventually("the load is held", || slow.held_tasks() == 1);
    std::thread::sleep(Duration::from_millis(700));
    slow.release_held();
    let result = prefetch.wait(id, WAIT).unwrap();
    assert_eq!(result.hit_chunks, 16, "given up while its tier was still loading");
    let lease = result.lease.unwrap();
    let guard = l1.read_access(lease, 0, &key(15)).unwrap();
    let mut bytes = vec![0; BIG as usize];
    guard.read_at(0, &mut bytes).unwrap();
    assert_eq!(bytes, payload(&key(15), BIG));
}

/// The request timeout of the tests on a manual clock: long enough never to pass by itself.
const TIMEOUT: Duration = Duration::from_secs(1000);

/// Submits a prefix request for `keys` (16 KiB chunks) to `rig`.
fn submit_prefix(rig: &Rig, keys: Vec<ObjectKey>) -> tierkv_prefetch::RequestId {
    let layout = Layout::bytes(CHUNK).unwrap();
    rig.prefetch.submit(PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, layout, keys)).unwrap()
}

/// Waits for `id`, which must fail for want of an answer.
fn given_up(rig: &Rig, id: tierkv_prefetch::RequestId) {
    match rig.prefetch.wait(id, WAIT) {
        Err(PrefetchError::NoAnswer(_)) => {}
        other => panic!("a request past its timeout ended {other:?}"),
    }
}

#[test]
fn a_slower_tier_is_asked_only_for_what_the_faster_ones_did_not_find() {
    // What a faster tier found is loaded from there: asking a slower tier for it too cost that
    // tier a lookup and a lock to return (a round trip per key for the remote tier), and the
    // request the wait for its answer when the faster tiers had found everything.
    let l2 = fake_holding("l2", keys(0..2));
    let disk = fake_holding("disk", keys(0..4));
    let rig = rig_with(vec![l2.clone(), disk.clone()], vec![], PrefetchConfig::default());
    let result = rig.prefetch(keys(0..4), 0);
    assert_eq!((result.hit_chunks, result.per_tier.clone()), (4, vec![2, 2]));
    assert_eq!(disk.looked_up(), vec![keys(2..4)], "the disk was asked for what L2 found");
    for k in keys(0..4) {
        assert_eq!(rig.bytes(&result, 0, &k), payload(&k, CHUNK));
    }
    rig.l1.release_owner(OWNER);
    // Everything is in L2: the disk is not asked at all.
    assert_eq!(rig.prefetch(keys(0..2), 0).per_tier, vec![2, 0]);
    assert_eq!(disk.looked_up().len(), 1, "the disk was asked though L2 found every key");
    rig.l1.release_owner(OWNER);
    // A miss everywhere still asks every tier, each for every key.
    assert_eq!(rig.prefetch(keys(6..8), 0).hit_chunks, 0);
    assert_eq!(
        (l2.looked_up().last(), disk.looked_up().last()),
        (Some(&keys(6..8)), Some(&keys(6..8)))
    );
    assert_eq!(rig.locks(), vec![0, 0]);
    rig.l1.audit().unwrap();
}

#[test]
fn a_request_whose_tier_answers_step_by_step_within_its_timeout_is_not_given_up() {
    let clock = Arc::new(ManualClock::new());
    let slow = fake_holding("slow", keys(0..2));
    slow.hold();
    let config = PrefetchConfig { request_timeout: TIMEOUT, ..PrefetchConfig::default() };
    let rig = rig_with_clock(vec![slow.clone()], config, clock.clone());
    let id = submit_prefix(&rig, keys(0..2));
    // The lookup answers after 0.4 of the timeout, the load 0.4 after that.
    eventually("a task is held", || slow.held_tasks() == 1);
    clock.advance(TIMEOUT * 4 / 10);
    slow.run_held();
    eventually("a task is held", || slow.held_tasks() == 1);
    clock.advance(TIMEOUT * 4 / 10);
    slow.release_held();
    let result = rig.prefetch.wait(id, WAIT).unwrap();
    assert_eq!(result.hit_chunks, 2);
    assert_eq!(rig.bytes(&result, 0, &key(1)), payload(&key(1), CHUNK));
}

/// A rig over L2 and a disk, both holding their tasks, after a request of `keys(0..4)` was
/// given up: L2 answered its lookup at 0.9 of the timeout (it holds keys 0-1), and the disk,
/// asked for the rest then, still holds that lookup, 0.2 of a timeout later.
fn disk_left_holding_a_given_up_lookup() -> (Rig, Arc<FakeTier>, Arc<FakeTier>, Arc<ManualClock>) {
    disk_left_holding(TIMEOUT * 9 / 10, TIMEOUT * 2 / 10)
}

/// As [`disk_left_holding_a_given_up_lookup`], L2 answering `l2_after` from submission and the
/// request given up `disk_for` after the disk was asked.
fn disk_left_holding(
    l2_after: Duration,
    disk_for: Duration,
) -> (Rig, Arc<FakeTier>, Arc<FakeTier>, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new());
    let (l2, disk) = (fake_holding("l2", keys(0..2)), fake_holding("disk", keys(0..4)));
    l2.hold();
    disk.hold();
    let config = PrefetchConfig { request_timeout: TIMEOUT, ..PrefetchConfig::default() };
    let rig = rig_with_clock(vec![l2.clone(), disk.clone()], config, clock.clone());
    let id = submit_prefix(&rig, keys(0..4));
    eventually("L2 is asked", || l2.held_tasks() == 1);
    clock.advance(l2_after);
    l2.run_held();
    eventually("the disk is asked what L2 did not find", || disk.held_tasks() == 1);
    clock.advance(disk_for);
    given_up(&rig, id);
    (rig, l2, disk, clock)
}

/// Submits a request of `keys(2..4)`, which only L2 answers (a miss): the disk, holding
/// `disk_holds` tasks, is not asked (`why` if it is). Then it lets the disk's lookups go and
/// checks every lock came back.
fn only_l2_answers(rig: &Rig, l2: &FakeTier, disk: &FakeTier, disk_holds: usize, why: &str) {
    let request = submit_prefix(rig, keys(2..4));
    eventually("L2 is asked again", || l2.held_tasks() == 1);
    l2.run_held();
    assert_eq!(rig.prefetch.wait(request, WAIT).unwrap().hit_chunks, 0);
    assert_eq!(disk.held_tasks(), disk_holds, "{why}");
    disk.release_held();
    eventually("the late lookups' locks come back", || disk.usage().locks == 0);
    rig.l1.audit().unwrap();
}

#[test]
fn a_request_a_lower_tier_never_answers_is_given_up_one_timeout_after_it_was_submitted() {
    // L2 answers its lookup just before the timeout, and the disk never answers the rest. The
    // request is given up one timeout after it was submitted: each tier's answer restarted the
    // count, so a request could wait a timeout per lower tier (and one more for its loads).
    let (rig, l2, disk, _) = disk_left_holding_a_given_up_lookup();
    assert_eq!(l2.usage().locks, 0, "the tier that answered has its locks back");
    disk.release_held();
    eventually("the late lookup's locks come back", || disk.usage().locks == 0);
    rig.l1.audit().unwrap();
}

#[test]
fn a_tier_is_left_out_of_later_requests_only_once_it_was_slow_itself() {
    // The disk had its lookup for the last 0.2 of the request's time when the request was given
    // up: it was not slow, so the next request still asks it (it was left out, a miss there,
    // until it answered). A tier that had a task half a timeout or more when its request was
    // given up is left out.
    let (rig, l2, disk, clock) = disk_left_holding_a_given_up_lookup();
    let second = submit_prefix(&rig, keys(2..4));
    eventually("L2 is asked again", || l2.held_tasks() == 1);
    l2.run_held();
    eventually("the disk is asked again, its first lookup still out", || disk.held_tasks() == 2);
    // This one it keeps a whole timeout: the next request leaves it out, and misses there.
    clock.advance(TIMEOUT + Duration::from_millis(1));
    given_up(&rig, second);
    only_l2_answers(&rig, &l2, &disk, 2, "a tier that did not answer for a timeout was asked");
}

#[test]
fn a_tier_that_had_a_task_half_a_timeout_when_its_request_was_given_up_is_left_out_at_once() {
    // L2 answers at 0.4 of the timeout; the disk then keeps its lookup for the remaining 0.6
    // and more: past half a timeout, it was slow itself, and the next request, submitted right
    // after, does not ask it (it would wait for a tier that does not answer).
    let (rig, l2, disk, _) = disk_left_holding(TIMEOUT * 4 / 10, TIMEOUT * 7 / 10);
    only_l2_answers(&rig, &l2, &disk, 1, "a tier slow for most of a timeout was asked again");
}

#[test]
fn a_request_whose_loads_never_answer_is_given_up_one_timeout_after_it_was_submitted() {
    // The lookup answers at half the timeout, the load never: the load's silence is not
    // counted from the lookup's answer. (Two 16 KiB chunks are allowed well under a
    // millisecond past the timeout for their bytes.)
    let clock = Arc::new(ManualClock::new());
    let stuck = fake_holding("stuck", keys(0..2));
    stuck.hold_loads();
    stuck.hold();
    let config = PrefetchConfig { request_timeout: TIMEOUT, ..PrefetchConfig::default() };
    let rig = rig_with_clock(vec![stuck.clone()], config, clock.clone());
    let id = submit_prefix(&rig, keys(0..2));
    eventually("the lookup is held", || stuck.held_tasks() == 1);
    clock.advance(TIMEOUT / 2);
    stuck.run_held();
    eventually("the load is held", || stuck.held_tasks() == 1);
    clock.advance(TIMEOUT / 2 + Duration::from_millis(10));
    given_up(&rig, id);
    stuck.release_held();
    eventually("the late load's slots come back", || rig.absent(&keys(0..2)));
    assert_eq!(rig.locks(), vec![0]);
    rig.l1.audit().unwrap();
}

#[test]
fn a_request_waiting_in_the_queue_has_its_time_there_counted() {
    // One request in flight at a time: the second waits while a slow tier serves the first
    // for 0.9 of the timeout, then gets nothing more from it. It is given up one timeout after
    // it was submitted, not one timeout after it started.
    let clock = Arc::new(ManualClock::new());
    let slow = fake_holding("slow", keys(0..4));
    slow.hold();
    let config =
        PrefetchConfig { max_in_flight: 1, request_timeout: TIMEOUT, ..PrefetchConfig::default() };
    let rig = rig_with_clock(vec![slow.clone()], config, clock.clone());
    let first = submit_prefix(&rig, keys(0..2));
    let second = submit_prefix(&rig, keys(2..4));
    eventually("the first lookup is held", || slow.held_tasks() == 1);
    clock.advance(TIMEOUT * 4 / 10);
    slow.run_held();
    eventually("the first load is held", || slow.held_tasks() == 1);
    clock.advance(TIMEOUT * 5 / 10);
    slow.run_held();
    assert_eq!(rig.prefetch.wait(first, WAIT).unwrap().hit_chunks, 2);
    eventually("the second lookup is held", || slow.held_tasks() == 1);
    clock.advance(TIMEOUT * 2 / 10);
    given_up(&rig, second);
    slow.release_held();
    rig.l1.release_owner(OWNER);
    eventually("the late lookup's locks come back", || slow.usage().locks == 0);
    rig.l1.audit().unwrap();
}

#[test]
fn a_tier_that_never_answers_is_not_asked_again_until_it_does_so_what_it_leaves_is_bounded() {
    // Every lookup given to a tier that never answers is kept (its keys, to return the locks
    // its late answer takes). Asked again for each new request, such a tier grew that record
    // (and its own queue) by one task a request, for ever, and failed every request after the
    // timeout. Once one of its tasks is given up, it is left out of new requests (a miss there)
    // until it answers.
    let stuck = fake_holding("stuck", keys(0..6));
    let good = fake_holding("good", keys(0..4));
    stuck.hold();
    let config = PrefetchConfig {
        max_in_flight: 1,
        request_timeout: Duration::from_millis(100),
        ..PrefetchConfig::default()
    };
    let rig = rig_with(vec![stuck.clone(), good.clone()], vec![], config);
    let submit = |keys: Vec<ObjectKey>| {
        let request =
            PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, Layout::bytes(CHUNK).unwrap(), keys);
        rig.prefetch.wait(rig.prefetch.submit(request).unwrap(), WAIT)
    };
    match submit(keys(0..2)) {
        Err(PrefetchError::NoAnswer(_)) => {}
        other => panic!("a request a tier never answers ended {other:?}"),
    }
    for round in 0..5 {
        let result = submit(keys(0..2)).unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_eq!(result.hit_chunks, 2, "round {round}: the tier that answers serves the hit");
        assert_eq!(stuck.held_tasks(), 1, "round {round}: the hung tier was asked again");
        rig.l1.release_owner(OWNER);
    }
    assert_eq!(submit(keys(4..6)).unwrap().hit_chunks, 0, "what only the hung tier has: a miss");
    // The tier answers at last: the locks its late answer took come back, once, and it is
    // asked again.
    stuck.release_held();
    eventually("the late lookup's locks come back", || stuck.usage().locks == 0);
    let result = submit(keys(4..6)).unwrap();
    assert_eq!(result.hit_chunks, 2, "the tier that answered again serves its chunks");
    assert_eq!(rig.bytes(&result, 0, &key(5)), payload(&key(5), CHUNK));
    rig.l1.release_owner(OWNER);
    assert_eq!(rig.locks(), vec![0, 0]);
    rig.l1.audit().unwrap();
}

#[test]
fn a_tier_whose_loads_never_answer_is_not_given_more_of_them_until_it_does() {
    // Each load given to a tier that never answers keeps its L1 slots (the tier holds their
    // write guards). Given one for each new request, such a tier pinned more of L1 with every
    // request, and failed each after the timeout.
    let stuck = fake_holding("stuck", keys(0..4));
    stuck.hold_loads();
    let config = PrefetchConfig {
        max_in_flight: 1,
        request_timeout: Duration::from_millis(100),
        ..PrefetchConfig::default()
    };
    let rig = rig_with(vec![stuck.clone()], vec![], config);
    let submit = |keys: Vec<ObjectKey>| {
        let request =
            PrefetchRequest::prefix(OWNER, ExtraCount::ZERO, Layout::bytes(CHUNK).unwrap(), keys);
        rig.prefetch.wait(rig.prefetch.submit(request).unwrap(), WAIT)
    };
    assert!(matches!(submit(keys(0..2)), Err(PrefetchError::NoAnswer(_))));
    for round in 0..3 {
        let result = submit(keys(2..4)).unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_eq!(result.hit_chunks, 0, "round {round}: the hung tier was asked: a miss");
        assert_eq!(stuck.held_tasks(), 1, "round {round}: the hung tier was given another load");
    }
    assert_eq!(stuck.usage().locks, 0);
    stuck.release_held();
    // Its sinks go back, freeing their slots, once the controller has taken the late answer.
    eventually("the late load's slots are free", || {
        let usage = rig.l1.usage();
        usage.free_bytes == usage.capacity_bytes
    });
    assert_eq!(submit(keys(2..4)).unwrap().hit_chunks, 2, "asked again once it answered");
    rig.l1.release_owner(OWNER);
    assert_eq!(rig.locks(), vec![0]);
    rig.l1.audit().unwrap();
}

#[test]
fn a_request_submitted_as_the_controller_stops_ends_one_way_or_the_other() {
    // Threads submit while the controller stops. Each submission is refused, or ends: served,
    // or failed as stopped. A submission that found the controller accepting, then queued its
    // request after the worker had drained its inbox for the last time, was accepted and never
    // ended: `wait` timed out on it for ever.
    // (The window is a few instructions wide: this did not fail on the old code in three runs of
    // 200 rounds; it guards the order `submit` keeps now.)
    let layout = Layout::bytes(CHUNK).unwrap();
    for _ in 0..50 {
        let rig = rig_with(vec![], vec![], PrefetchConfig::default());
        let accepted = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    loop {
                        let request = PrefetchRequest::prefix(
                            OWNER,
                            ExtraCount::ZERO,
                            layout.clone(),
                            keys(0..1),
                        );
                        match rig.prefetch.submit(request) {
                            Ok(id) => accepted.lock().unwrap().push(id),
                            Err(PrefetchError::Stopped) => return,
                            Err(other) => panic!("a submission failed as {other:?}"),
                        }
                    }
                });
            }
            std::thread::sleep(Duration::from_micros(200));
            rig.prefetch.stop();
        });
        for id in accepted.into_inner().unwrap() {
            match rig.prefetch.wait(id, Duration::from_secs(2)) {
                Ok(_) | Err(PrefetchError::Stopped) => {}
                other => panic!("an accepted request ended {other:?}"),
            }
        }
    }
}
