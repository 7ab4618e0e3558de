//! CONFORMANCE A: the L1Manager scenarios, one test per id, on an L1 of 8 slots ("64 MiB with
//! 8 MiB slots", scaled down to 8 KiB slots).

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tierkv_core::{ExtraCount, KeyError};
use tierkv_l1::{EvictionReason, L1Error, Lifetime, OwnerId, Presence, Readers, WriteMode};

// ----- reserve_read -----

#[test]
fn a1_missing_key_is_not_found() {
    let f = l1(8);
    let grant = f.l1.reserve_read(OWNER, &[key(0)], extra(0));
    assert_eq!(grant.results, vec![Err(KeyError::NotFound)]);
    assert_eq!(grant.lease, None, "no buffer and no lease for a miss");
    assert_eq!(f.l1.active_leases(), 0);
}

#[test]
fn a2_reserved_unfinished_key_is_not_readable() {
    let f = l1(8);
    f.reserve(&[key(0)]);
    f.fill(&key(0), 0);
    let grant = f.l1.reserve_read(OWNER, &[key(0)], extra(0));
    assert_eq!(grant.results, vec![Err(KeyError::NotReadable)]);
    assert_eq!(grant.lease, None);
}

#[test]
fn a3_finished_key_reads_back_the_written_bytes() {
    let f = l1(8);
    f.write(&[key(0)]);
    let lease = f.lease(&key(0), 0);
    assert_eq!(f.read(lease, 0, &key(0)), payload(&key(0), 0));
}

#[test]
fn a4_batch_answers_each_key_on_its_own() {
    let f = l1(8);
    f.write(&[key(0)]);
    f.reserve(&[key(2)]);
    let grant = f.l1.reserve_read(OWNER, &[key(0), key(1), key(2)], extra(0));
    assert!(grant.results[0].is_ok());
    assert_eq!(grant.results[1], Err(KeyError::NotFound));
    assert_eq!(grant.results[2], Err(KeyError::NotReadable));
    assert_eq!(grant.leading_hits(), 1);
    let lease = grant.lease.unwrap();
    assert_eq!(f.read(lease, 0, &key(0)), payload(&key(0), 0));
}

#[test]
fn a5_three_leases_need_three_releases() {
    let f = l1(8);
    f.write(&[key(0)]);
    let leases: Vec<_> = (0..3).map(|_| f.lease(&key(0), 0)).collect();
    assert_eq!(f.shares(&key(0)), 3);
    f.release(leases[0], 0);
    f.release(leases[1], 0);
    assert_eq!(f.shares(&key(0)), 1, "still leased after two of three releases");
    assert_eq!(f.usage().leased, 1);
    f.release(leases[2], 0);
    assert_eq!(f.shares(&key(0)), 0);
    assert_eq!(f.usage().cached, 1);
}

#[test]
fn a6_extra_count_two_needs_three_releases() {
    let f = l1(8);
    f.write(&[key(0)]);
    let lease = f.lease(&key(0), 2);
    f.release(lease, 0);
    assert_eq!(f.shares(&key(0)), 2);
    f.release(lease, 1);
    assert_eq!(f.shares(&key(0)), 1);
    f.release(lease, 2);
    assert_eq!(f.shares(&key(0)), 0);
}

#[test]
fn a7_extra_count_zero_one_release_unleases() {
    let f = l1(8);
    f.write(&[key(0)]);
    let lease = f.lease(&key(0), 0);
    let released = f.l1.finish_read(lease, Readers::One(0), None).unwrap();
    assert_eq!(released.shares, 1);
    assert!(released.lease_ended);
    assert_eq!(f.shares(&key(0)), 0);
}

#[test]
fn a8_extra_count_out_of_range_is_rejected_naming_the_bound() {
    // The L1 API takes a validated `ExtraCount`, so a bad count is refused where it enters and
    // never reaches the manager; the conversion is the check.
    for bad in [128, -1, 1000, i64::MIN] {
        let error = ExtraCount::new(bad).unwrap_err();
        assert!(error.to_string().contains("0..=127"), "{error}");
        assert!(error.to_string().contains(&bad.to_string()), "{error}");
    }
    assert_eq!(ExtraCount::new(127).unwrap().readers(), 128);
    // A lease of the largest valid count has 128 readers, and reader 128 does not exist.
    let f = l1(8);
    f.write(&[key(0)]);
    let lease = f.lease(&key(0), 127);
    let before = f.usage();
    let error = f.l1.finish_read(lease, Readers::Set(0), None).unwrap_err();
    assert!(matches!(error, L1Error::NoSuchReader { readers: 128, .. }), "{error}");
    assert_eq!(f.usage(), before);
    assert_eq!(f.shares(&key(0)), 128);
    f.l1.finish_read(lease, Readers::All, None).unwrap();
    assert_eq!(f.shares(&key(0)), 0);
}

// ----- finish_read / leases -----

/// Why a release of `key` by reader 0 of `lease` is refused as outside the lease.
fn not_leased(f: &Fixture, lease: LeaseId, key: tierkv_core::ObjectKey) -> KeyError {
    match f.l1.finish_read(lease, Readers::One(0), Some(&[key])) {
        Err(L1Error::NotLeased { error, .. }) => error,
        other => panic!("expected a NotLeased refusal, got {other:?}"),
    }
}

#[test]
fn a9_finish_read_of_missing_key_is_not_found() {
    let f = l1(8);
    f.write(&[key(0)]);
    let lease = f.lease(&key(0), 0);
    assert_eq!(not_leased(&f, lease, key(9)), KeyError::NotFound);
    assert_eq!(f.shares(&key(0)), 1, "the lease's own key is untouched");
}

#[test]
fn a10_finish_read_of_never_leased_ready_key_is_wrong_state() {
    let f = l1(8);
    f.write(&[key(0), key(1)]);
    let lease = f.lease(&key(0), 0);
    assert_eq!(not_leased(&f, lease, key(1)), KeyError::WrongState);
    assert_eq!(f.shares(&key(0)), 1);
    assert_eq!(f.shares(&key(1)), 0);
}

#[test]
fn a11_finish_read_of_writing_key_is_wrong_state() {
    let f = l1(8);
    f.write(&[key(0)]);
    f.reserve(&[key(1)]);
    let lease = f.lease(&key(0), 0);
    assert_eq!(not_leased(&f, lease, key(1)), KeyError::WrongState);
    assert_eq!(f.l1.presence(&key(1)), Presence::Writing);
}

#[test]
fn a12_temporary_entry_is_freed_when_its_last_share_returns() {
    let f = l1(8);
    let results =
        f.l1.reserve_write(OWNER, &[key(0)], &layout(), WriteMode::Create, Lifetime::Temporary)
            .unwrap();
    let generation = results[0].as_ref().unwrap().generation;
    f.fill(&key(0), 0);
    let grant = f.l1.finish_write_and_reserve_read(OWNER, &[(key(0), generation)], extra(2));
    let lease = grant.lease.unwrap();
    f.release(lease, 0);
    f.release(lease, 1);
    assert_eq!(
        f.l1.presence(&key(0)),
        Presence::Ready { shares: 1, temporary: true },
        "survives 2 of 3 releases"
    );
    assert_eq!(f.read(lease, 2, &key(0)), payload(&key(0), 0));
    f.release(lease, 2);
    assert_eq!(f.l1.presence(&key(0)), Presence::Absent);
    assert_eq!(f.usage().free_bytes, f.usage().capacity_bytes);
    f.assert_consistent();
}

#[test]
fn a13_batched_and_split_releases_of_an_extra_count_lease() {
    let f = l1(8);
    f.write(&[key(0)]);
    let lease = f.lease(&key(0), 2);
    let released = f.l1.finish_read(lease, Readers::All, None).unwrap();
    assert_eq!((released.shares, released.unleased), (3, 1));
    assert_eq!(f.shares(&key(0)), 0);

    let lease = f.lease(&key(0), 2);
    f.l1.finish_read(lease, Readers::Set(0b011), None).unwrap();
    assert_eq!(f.shares(&key(0)), 1, "still leased until the last share");
    f.l1.finish_read(lease, Readers::One(2), None).unwrap();
    assert_eq!(f.shares(&key(0)), 0);
}

#[test]
fn a14_double_release_is_an_error() {
    let f = l1(8);
    f.write(&[key(0)]);
    let lease = f.lease(&key(0), 2);
    f.release(lease, 1);
    let error = f.l1.finish_read(lease, Readers::One(1), None).unwrap_err();
    assert!(matches!(error, L1Error::AlreadyReleased { reader: 1, .. }), "{error}");
    assert_eq!(f.shares(&key(0)), 2, "the other readers' shares are untouched");
    // A batch that includes the reader again is refused whole, even though reader 0 holds a share.
    let error = f.l1.finish_read(lease, Readers::Set(0b011), None).unwrap_err();
    assert!(matches!(error, L1Error::AlreadyReleased { reader: 1, .. }), "{error}");
    assert_eq!(f.shares(&key(0)), 2);
    f.release(lease, 0);
    f.release(lease, 2);
    assert_eq!(f.shares(&key(0)), 0);
    let error = f.l1.finish_read(lease, Readers::One(0), None).unwrap_err();
    assert_eq!(error, L1Error::LeaseReleased(lease));
    f.assert_consistent();
}

#[test]
fn a15_lease_past_its_deadline_is_revoked_counted_and_reported() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let f = metrics::with_local_recorder(&recorder, || l1(1));
    f.write(&[key(0)]);
    let swept = f.lease(&key(0), 1);
    f.clock.advance(LEASE_TTL + Duration::from_millis(1));
    assert_eq!(f.l1.expire_leases(), 1);
    assert_eq!(f.shares(&key(0)), 0, "the shares returned");
    assert_eq!(f.l1.active_leases(), 0);
    // Evictable again: a new write into the full L1 evicts it.
    f.reserve(&[key(1)]);
    assert_eq!(f.l1.presence(&key(0)), Presence::Absent);
    assert_eq!(f.recorder.evicted.lock().as_slice(), &[(key(0), EvictionReason::OnDemand)]);
    let error = f.l1.finish_read(swept, Readers::One(0), None).unwrap_err();
    assert_eq!(error, L1Error::LeaseExpired(swept), "a late release reports the expiry");

    // A lease nobody swept is revoked by the late release itself.
    f.l1.finish_write(OWNER, &[key(1)]);
    let lazy = f.lease(&key(1), 0);
    f.clock.advance(LEASE_TTL);
    assert_eq!(
        f.l1.finish_read(lazy, Readers::One(0), None).unwrap_err(),
        L1Error::LeaseExpired(lazy)
    );
    assert_eq!(f.shares(&key(1)), 0);

    let expiries: u64 = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, ..)| k.key().name() == "tierkv_lease_expiries_total")
        .map(|(.., v)| match v {
            DebugValue::Counter(n) => n,
            _ => 0,
        })
        .sum();
    assert_eq!(expiries, 2);
    f.assert_consistent();
}

#[test]
fn a15_a_lease_past_its_deadline_is_revoked_when_its_owner_goes_too() {
    // A client that disconnects holding a lease nobody swept yet: its release must count the
    // expiry, as a sweep or a late release of its own would, not pass it off as a release.
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let f = metrics::with_local_recorder(&recorder, || l1(2));
    f.write(&keys(0..2));
    let expired = f.lease(&key(0), 1);
    f.clock.advance(LEASE_TTL);
    let live = f.lease(&key(1), 0);
    let report = f.l1.release_owner(OWNER);
    assert_eq!((report.leases, report.shares), (2, 3), "both leases end, every share returns");
    assert_eq!(
        f.l1.finish_read(expired, Readers::One(0), None),
        Err(L1Error::LeaseExpired(expired))
    );
    assert_eq!(f.l1.finish_read(live, Readers::One(0), None), Err(L1Error::LeaseReleased(live)));
    let snapshot = snapshotter.snapshot().into_vec();
    assert_eq!(metric(&snapshot, "tierkv_lease_expiries_total", None), 1.0);
    f.assert_consistent();
}

// ----- reserve_write / finish_write / abort -----

#[test]
fn a16_new_key_reserve_write_succeeds() {
    let f = l1(8);
    let results = f.try_reserve(&[key(0)]);
    let handle = results[0].unwrap();
    assert_eq!(handle.len, SLOT);
    assert_eq!(f.l1.presence(&key(0)), Presence::Writing);
    assert_eq!(f.usage().used_bytes, SLOT);
}

#[test]
fn a17_second_reserve_of_a_key_being_written_is_write_in_flight() {
    let f = l1(8);
    f.reserve(&[key(0)]);
    let results =
        f.l1.reserve_write(OwnerId(2), &[key(0)], &layout(), WriteMode::Create, Lifetime::Cached)
            .unwrap();
    assert_eq!(results, vec![Err(KeyError::WriteInFlight)]);
    assert_eq!(f.usage().writing, 1);
}

#[test]
fn a18_reserve_of_a_ready_key_is_already_present() {
    let f = l1(8);
    f.write(&[key(0)]);
    let results = f.try_reserve(&[key(0)]);
    assert_eq!(results, vec![Err(KeyError::AlreadyPresent)]);
    assert_eq!((f.usage().cached, f.usage().writing), (1, 0), "no second copy");
}

#[test]
fn a19_reserve_of_a_leased_key_is_already_present() {
    let f = l1(8);
    f.write(&[key(0)]);
    f.lease(&key(0), 0);
    let results = f.try_reserve(&[key(0)]);
    assert_eq!(results, vec![Err(KeyError::AlreadyPresent)]);
}

#[test]
fn a20_batch_of_five_gets_five_distinct_slots() {
    let f = l1(8);
    let results = f.try_reserve(&keys(0..5));
    let mut slots: Vec<_> = results.iter().map(|r| r.unwrap().slot).collect();
    slots.sort();
    slots.dedup();
    assert_eq!(slots.len(), 5);
    assert_eq!(f.usage().writing, 5);
}

#[test]
fn a21_batch_degrades_to_its_longest_allocatable_prefix() {
    let f = l1(8);
    let results = f.try_reserve(&keys(0..10));
    assert!(results[..8].iter().all(|r| r.is_ok()));
    assert_eq!(results[8..], [Err(KeyError::OutOfMemory), Err(KeyError::OutOfMemory)]);
    assert_eq!(f.usage().free_bytes, 0);
    f.assert_consistent();
}

#[test]
fn a22_cached_entries_make_room_but_leased_and_writing_ones_never_do() {
    // 8 slots: 4 cached, 2 leased, 2 being written. A batch of 5 new keys evicts the 4 cached
    // objects for its first 4 keys; the 5th finds nothing evictable and is refused.
    let f = l1(8);
    f.write(&keys(0..6));
    let leases = [f.lease(&key(4), 0), f.lease(&key(5), 0)];
    f.reserve(&keys(6..8));
    let results = f.try_reserve(&keys(10..15));
    assert!(results[..4].iter().all(|r| r.is_ok()), "{results:?}");
    assert_eq!(results[4], Err(KeyError::OutOfMemory));
    let evicted: Vec<_> = f.recorder.evicted.lock().iter().map(|(k, _)| *k).collect();
    assert_eq!(evicted, keys(0..4), "exactly the cached objects, least recently used first");
    assert!(matches!(f.l1.presence(&key(4)), Presence::Ready { shares: 1, .. }));
    assert!(matches!(f.l1.presence(&key(5)), Presence::Ready { shares: 1, .. }));
    assert_eq!(f.l1.presence(&key(6)), Presence::Writing);
    assert_eq!(f.l1.presence(&key(7)), Presence::Writing);
    assert_eq!(
        f.read(leases[0], 0, &key(4)),
        payload(&key(4), 0),
        "a leased object's bytes survive"
    );
    f.assert_consistent();
}

#[test]
fn a23_finish_write_twice_is_wrong_state_and_of_a_missing_key_not_found() {
    let f = l1(8);
    f.reserve(&[key(0)]);
    assert_eq!(f.l1.finish_write(OWNER, &[key(0)]), vec![Ok(())]);
    assert_eq!(f.l1.finish_write(OWNER, &[key(0)]), vec![Err(KeyError::WrongState)]);
    assert_eq!(f.l1.finish_write(OWNER, &[key(1)]), vec![Err(KeyError::NotFound)]);
    assert_eq!(f.recorder.finished.lock().as_slice(), &[key(0)], "the store pipeline is told once");
}

#[test]
fn a24_aborted_write_frees_its_slot_and_was_never_visible() {
    let f = Arc::new(l1(8));
    let stop = Arc::new(AtomicBool::new(false));
    // A reader polls the key the whole time; it must never be granted.
    let watcher = {
        let (f, stop) = (f.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut polls = 0u64;
            while !stop.load(Ordering::Acquire) || polls == 0 {
                let grant = f.l1.reserve_read(OwnerId(9), &[key(0)], extra(0));
                assert!(grant.results[0].is_err(), "an unfinished write became visible");
                polls += 1;
            }
            polls
        })
    };
    for round in 0..200 {
        f.reserve(&[key(0)]);
        f.fill(&key(0), round);
        assert_eq!(f.l1.abort_write(OWNER, &[key(0)]), vec![Ok(())]);
    }
    stop.store(true, Ordering::Release);
    assert!(watcher.join().unwrap() > 0);
    assert_eq!(f.l1.presence(&key(0)), Presence::Absent);
    assert_eq!(f.usage().free_bytes, f.usage().capacity_bytes);
    assert_eq!(f.l1.abort_write(OWNER, &[key(0)]), vec![Err(KeyError::NotFound)]);
    f.assert_consistent();
}

#[test]
fn a25_update_mode_relocks_the_same_slot_and_refuses_absent_keys() {
    let f = l1(8);
    let update = |k| {
        f.l1.reserve_write(OWNER, &[k], &layout(), WriteMode::Update, Lifetime::Cached).unwrap()[0]
    };
    assert_eq!(update(key(0)), Err(KeyError::NotFound));
    f.write(&[key(0)]);
    let lease = f.lease(&key(0), 0);
    assert_eq!(
        update(key(0)),
        Err(KeyError::Locked),
        "a leased object is not rewritten under its readers"
    );
    let original = f.l1.read_access(lease, 0, &key(0)).unwrap().handle().slot;
    f.release(lease, 0);
    let relocked = update(key(0)).unwrap();
    assert_eq!(relocked.slot, original);
    assert_eq!(f.l1.presence(&key(0)), Presence::Writing);
    let other = Layout::bytes(SLOT / 2).unwrap();
    f.l1.finish_write(OWNER, &[key(0)]);
    let mismatched =
        f.l1.reserve_write(OWNER, &[key(0)], &other, WriteMode::Update, Lifetime::Cached).unwrap();
    assert_eq!(mismatched, vec![Err(KeyError::LayoutMismatch)]);
    f.assert_consistent();
}

use tierkv_core::Layout;

// ----- finish_write_and_reserve_read -----

#[test]
fn a26_promotion_makes_a_writing_key_ready_and_leased() {
    let f = l1(8);
    let reserved = f.reserve(&[key(0)]);
    f.fill(&key(0), 0);
    let grant = f.l1.finish_write_and_reserve_read(OWNER, &reserved, extra(1));
    assert_eq!(grant.readers, 2);
    assert_eq!(f.shares(&key(0)), 2);
    let again = f.try_reserve(&[key(0)]);
    assert_eq!(again, vec![Err(KeyError::AlreadyPresent)], "not writable once promoted");
    assert_eq!(f.read(grant.lease.unwrap(), 1, &key(0)), payload(&key(0), 0));
}

#[test]
fn a27_promotion_of_a_missing_key_is_not_found() {
    let f = l1(8);
    let grant = f.l1.finish_write_and_reserve_read(OWNER, &[(key(0), 0)], extra(0));
    assert_eq!(grant.results, vec![Err(KeyError::NotFound)]);
    assert_eq!(grant.lease, None);
}

#[test]
fn a28_promotion_of_a_ready_key_is_wrong_state() {
    let f = l1(8);
    f.write(&[key(0)]);
    let grant = f.l1.finish_write_and_reserve_read(OWNER, &[(key(0), 0)], extra(0));
    assert_eq!(grant.results, vec![Err(KeyError::WrongState)]);
    assert_eq!(f.shares(&key(0)), 0, "no share was taken");
}

#[test]
fn a29_promotion_batch_answers_each_key_on_its_own() {
    let f = l1(8);
    let reserved = f.reserve(&[key(0)]);
    f.write(&[key(2)]);
    let promoted = [reserved[0], (key(1), 0), (key(2), 0)];
    let grant = f.l1.finish_write_and_reserve_read(OWNER, &promoted, extra(0));
    assert!(grant.results[0].is_ok());
    assert_eq!(grant.results[1], Err(KeyError::NotFound));
    assert_eq!(grant.results[2], Err(KeyError::WrongState));
    assert_eq!(f.shares(&key(0)), 1);
    f.assert_consistent();
}

#[test]
fn a_promotion_or_abort_naming_a_reservation_gone_and_made_again_leaves_the_new_one() {
    let f = l1(8);
    let first = f.reserve(&[key(0)]);
    // The owner's client disconnects while a load into the first reservation is under way,
    // and a queued request of the same owner reserves the key again.
    f.l1.release_owner(OWNER);
    let second = f.reserve(&[key(0)]);
    assert_ne!(first, second);
    let grant = f.l1.finish_write_and_reserve_read(OWNER, &first, extra(0));
    assert_eq!(grant.results, vec![Err(KeyError::NotFound)], "never visible unwritten");
    assert_eq!(grant.lease, None);
    assert_eq!(f.l1.abort_reserved(OWNER, &first), vec![Err(KeyError::NotFound)]);
    f.fill(&key(0), 7);
    let grant = f.l1.finish_write_and_reserve_read(OWNER, &second, extra(0));
    assert!(grant.results[0].is_ok());
    assert_eq!(f.read(grant.lease.unwrap(), 0, &key(0)), payload(&key(0), 7));
}

#[test]
fn a30_promotion_does_not_notify_the_store_pipeline() {
    let f = l1(8);
    let reserved = f.reserve(&keys(0..2));
    f.l1.finish_write_and_reserve_read(OWNER, &reserved[..1], extra(0));
    assert!(f.recorder.finished.lock().is_empty(), "a prefetch promotion is not a new write");
    f.l1.finish_write(OWNER, &[key(1)]);
    assert_eq!(f.recorder.finished.lock().as_slice(), &[key(1)]);
}

// ----- delete / clear -----

#[test]
fn a31_delete_of_a_missing_key_is_not_found() {
    let f = l1(8);
    assert_eq!(f.l1.delete(&[key(0)], false), vec![Err(KeyError::NotFound)]);
}

#[test]
fn a32_delete_of_a_ready_key_deletes_it() {
    let f = l1(8);
    f.write(&[key(0)]);
    assert_eq!(f.l1.delete(&[key(0)], false), vec![Ok(())]);
    assert_eq!(f.l1.presence(&key(0)), Presence::Absent);
    assert_eq!(f.usage().free_bytes, f.usage().capacity_bytes);
}

#[test]
fn a33_delete_of_writing_or_leased_is_locked_unless_forced() {
    let f = l1(8);
    f.reserve(&[key(0)]);
    f.write(&[key(1)]);
    let lease = f.lease(&key(1), 0);
    assert_eq!(
        f.l1.delete(&[key(0), key(1)], false),
        vec![Err(KeyError::Locked), Err(KeyError::Locked)]
    );
    assert_eq!(f.l1.delete(&[key(0), key(1)], true), vec![Ok(()), Ok(())]);
    assert_eq!(f.l1.presence(&key(0)), Presence::Absent);
    assert_eq!(f.l1.presence(&key(1)), Presence::Absent);
    // The lease outlives the forced delete; returning it touches nothing and is not an error.
    assert_eq!(f.l1.finish_read(lease, Readers::One(0), None).unwrap().unleased, 0);
    assert_eq!(f.l1.finish_write(OWNER, &[key(0)]), vec![Err(KeyError::NotFound)]);
    f.assert_consistent();
}

#[test]
fn a34_clear_keeps_leased_and_writing_entries_unless_forced() {
    let f = l1(8);
    f.write(&keys(0..3));
    f.lease(&key(0), 0);
    f.reserve(&[key(5)]);
    let cleared = f.l1.clear(false);
    assert_eq!((cleared.removed, cleared.kept), (2, 2));
    assert!(matches!(f.l1.presence(&key(0)), Presence::Ready { .. }));
    assert_eq!(f.l1.presence(&key(5)), Presence::Writing);
    let cleared = f.l1.clear(true);
    assert_eq!((cleared.removed, cleared.kept), (2, 0));
    assert_eq!(f.usage().free_bytes, f.usage().capacity_bytes);
    f.assert_consistent();
}

// ----- accounting (A35 runs as a property test in model.rs) -----

#[test]
fn a36_ready_unleased_entries_are_cached_never_used() {
    let f = l1(8);
    f.write(&keys(0..3));
    f.reserve(&[key(3)]);
    let u = f.usage();
    assert_eq!((u.cached_bytes, u.used_bytes), (3 * SLOT, SLOT));
    let leases = [f.lease(&key(0), 1), f.lease(&key(1), 0)];
    assert_eq!(f.usage().used_bytes, 3 * SLOT);
    f.l1.finish_read(leases[0], Readers::All, None).unwrap();
    f.l1.finish_read(leases[1], Readers::All, None).unwrap();
    let u = f.usage();
    assert_eq!(
        u.used_bytes,
        u.writing * SLOT,
        "after every lease returns, used == bytes being written"
    );
    assert_eq!(u.cached_bytes, 3 * SLOT);
    // Admission counts cached bytes as available: 7 more keys fit an L1 with 4 free slots.
    let results = f.try_reserve(&keys(10..17));
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
}

#[test]
fn a37_cloning_or_dropping_handles_changes_no_counter() {
    let f = l1(8);
    f.write(&keys(0..2));
    let grant = f.l1.reserve_read(OWNER, &keys(0..2), extra(1));
    let lease = grant.lease.unwrap();
    let before = (f.usage(), f.shares(&key(0)), f.l1.active_leases());
    let copies: Vec<_> = (0..100).map(|_| grant.clone()).collect();
    let handles: Vec<_> = copies.iter().flat_map(|g| g.results.iter().copied()).collect();
    drop(copies);
    drop(handles);
    // The handles that hold something: read guards (pins), many at once on both readers and
    // keys, then dropped in another order. Shares, leases and usage never move.
    let mut guards = Vec::new();
    for round in 0..10u8 {
        for k in keys(0..2) {
            guards.push(f.l1.read_access(lease, round % 2, &k).unwrap());
        }
        assert_eq!((f.usage(), f.shares(&key(0)), f.l1.active_leases()), before);
    }
    let (odd, even): (Vec<_>, Vec<_>) =
        guards.into_iter().enumerate().partition(|(i, _)| i % 2 == 1);
    drop(odd);
    assert_eq!((f.usage(), f.shares(&key(0)), f.l1.active_leases()), before);
    drop(even);
    assert_eq!((f.usage(), f.shares(&key(0)), f.l1.active_leases()), before);
    f.l1.finish_read(lease, Readers::All, None).unwrap();
    f.assert_consistent();
}

// ----- concurrency (A40 is in stress.rs) -----

#[test]
fn a38_eight_threads_reserve_distinct_keys() {
    let f = l1(64);
    std::thread::scope(|s| {
        for t in 0..8 {
            let f = &f;
            s.spawn(move || {
                let mine = keys(t * 8..t * 8 + 8);
                let results = f.l1.reserve_write(
                    OwnerId(t),
                    &mine,
                    &layout(),
                    WriteMode::Create,
                    Lifetime::Cached,
                );
                assert!(results.unwrap().iter().all(|r| r.is_ok()));
            });
        }
    });
    assert_eq!(f.usage().writing, 64);
    f.assert_consistent();
}

#[test]
fn a39_ten_threads_lease_one_key_and_ten_releases_unlease_it() {
    let f = l1(8);
    f.write(&[key(0)]);
    let leases: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..10).map(|_| s.spawn(|| f.lease(&key(0), 0))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(f.shares(&key(0)), 10);
    std::thread::scope(|s| {
        for lease in &leases {
            let f = &f;
            s.spawn(move || f.release(*lease, 0));
        }
    });
    assert_eq!(f.shares(&key(0)), 0);
    f.assert_consistent();
}

// ----- rules beyond the scenario list -----

#[test]
fn old_lease_never_reads_or_releases_a_recreated_key() {
    let f = l1(8);
    f.write(&[key(0)]);
    let old = f.lease(&key(0), 1);
    assert_eq!(f.l1.delete(&[key(0)], true), vec![Ok(())]);
    f.reserve(&[key(0)]);
    f.fill(&key(0), 7);
    f.l1.finish_write(OWNER, &[key(0)]);
    let error = f.l1.read_access(old, 0, &key(0)).err().unwrap();
    assert_eq!(error, L1Error::Key { key: key(0), error: KeyError::NotFound });
    let fresh = f.lease(&key(0), 0);
    assert_eq!(f.l1.finish_read(old, Readers::All, None).unwrap().unleased, 0);
    assert_eq!(f.shares(&key(0)), 1, "the old lease's release took nothing from the new object");
    assert_eq!(f.read(fresh, 0, &key(0)), payload(&key(0), 7));
    f.assert_consistent();
}

#[test]
fn half_written_object_cannot_be_finished_and_an_aborted_slot_waits_for_its_copy() {
    let f = l1(1);
    let reserved = f.reserve(&[key(0)]);
    let mut guard = f.l1.write_access(OWNER, &key(0)).unwrap();
    guard.write_at(0, &[1; 16]).unwrap();
    assert_eq!(
        f.l1.finish_write(OWNER, &[key(0)]),
        vec![Err(KeyError::Busy)],
        "finish waits for the copy"
    );
    assert_eq!(
        f.l1.finish_write_and_reserve_read(OWNER, &reserved, extra(0)).results,
        vec![Err(KeyError::Busy)]
    );
    assert!(matches!(
        f.l1.write_access(OWNER, &key(0)),
        Err(L1Error::Key { error: KeyError::Busy, .. })
    ));
    // Aborting under the copy hides the key at once but keeps the slot until the copy ends.
    assert_eq!(f.l1.abort_write(OWNER, &[key(0)]), vec![Ok(())]);
    assert_eq!(f.usage().retiring, 1);
    let results = f.try_reserve(&[key(1)]);
    assert_eq!(results, vec![Err(KeyError::OutOfMemory)], "the slot is not reused under the copy");
    drop(guard);
    assert_eq!(f.usage().retiring, 0);
    f.reserve(&[key(1)]);
    f.assert_consistent();
}

#[test]
fn reader_copying_out_keeps_its_slot_through_expiry_and_eviction_pressure() {
    let f = l1(1);
    f.write(&[key(0)]);
    let lease = f.lease(&key(0), 0);
    let guard = f.l1.read_access(lease, 0, &key(0)).unwrap();
    f.clock.advance(LEASE_TTL);
    assert_eq!(f.l1.expire_leases(), 1);
    // Unleased now, but a copy is under way: eviction must pass it over.
    let results = f.try_reserve(&[key(1)]);
    assert_eq!(results, vec![Err(KeyError::OutOfMemory)]);
    let mut bytes = vec![0; SLOT as usize];
    guard.read_at(0, &mut bytes).unwrap();
    assert_eq!(bytes, payload(&key(0), 0), "the bytes under a live copy are never overwritten");
    drop(guard);
    f.reserve(&[key(1)]);
    assert_eq!(f.l1.presence(&key(0)), Presence::Absent);
    f.assert_consistent();
}

/// Everything observable about the L1, to prove a refused request changed nothing.
fn fingerprint(f: &Fixture) -> (tierkv_l1::Usage, u64, Vec<Presence>) {
    (f.usage(), f.l1.active_leases(), keys(0..8).iter().map(|k| f.l1.presence(k)).collect())
}

#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let f = l1(8);
    f.write(&keys(0..3));
    f.reserve(&[key(3)]);
    let lease = f.l1.reserve_read(OWNER, &keys(0..2), extra(1)).lease.unwrap();
    f.release(lease, 1);
    let before = fingerprint(&f);

    let refusals: Vec<(&str, L1Error)> = vec![
        ("unknown lease", f.l1.finish_read(LeaseId(999), Readers::One(0), None).unwrap_err()),
        ("unknown lease (release all)", f.l1.release_lease(LeaseId(999)).unwrap_err()),
        ("reader without a share", f.l1.finish_read(lease, Readers::One(5), None).unwrap_err()),
        ("empty reader set", f.l1.finish_read(lease, Readers::Set(0), None).unwrap_err()),
        (
            "second release by reader 1",
            f.l1.finish_read(lease, Readers::One(1), Some(&[key(1)])).unwrap_err(),
        ),
        (
            "key named twice",
            f.l1.finish_read(lease, Readers::One(0), Some(&[key(0), key(0)])).unwrap_err(),
        ),
        (
            "key outside the lease after a good one",
            f.l1.finish_read(lease, Readers::One(0), Some(&[key(0), key(2)])).unwrap_err(),
        ),
        ("read by reader without a share", f.l1.read_access(lease, 1, &key(0)).err().unwrap()),
        ("read of a key outside the lease", f.l1.read_access(lease, 0, &key(2)).err().unwrap()),
        ("write into a finished key", f.l1.write_access(OWNER, &key(0)).err().unwrap()),
        (
            "write into another owner's reservation",
            f.l1.write_access(OwnerId(2), &key(3)).err().unwrap(),
        ),
        (
            "layout larger than a slot",
            f.l1.reserve_write(
                OWNER,
                &[key(7)],
                &Layout::bytes(SLOT + 1).unwrap(),
                WriteMode::Create,
                Lifetime::Cached,
            )
            .unwrap_err(),
        ),
    ];
    for (what, error) in &refusals {
        assert_eq!(fingerprint(&f), before, "{what} ({error}) changed the state");
    }
    let reasons: Vec<_> = refusals.iter().map(|(_, e)| e.reason()).collect();
    assert_eq!(
        reasons,
        [
            "unknown_lease",
            "unknown_lease",
            "no_such_reader",
            "no_such_reader",
            "already_released",
            "not_leased",
            "not_leased",
            "already_released",
            "not_leased",
            "wrong_state",
            "locked",
            "layout_too_large"
        ]
    );
    // Per-key refusals of batches change nothing either.
    assert_eq!(f.l1.finish_write(OwnerId(2), &[key(3)]), vec![Err(KeyError::Locked)]);
    assert_eq!(f.l1.abort_write(OwnerId(2), &[key(3)]), vec![Err(KeyError::Locked)]);
    assert_eq!(f.l1.delete(&[key(0)], false), vec![Err(KeyError::Locked)]);
    assert_eq!(fingerprint(&f), before);
    // The lease still works for the shares that remain.
    assert_eq!(f.l1.finish_read(lease, Readers::One(0), None).unwrap().shares, 2);
    f.assert_consistent();
}

use tierkv_l1::LeaseId;

/// One debugging recorder snapshot's entry.
type Snapshot = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

/// The sum of the series named `name` (with `label`, if given) in a snapshot.
fn metric(snapshot: &Snapshot, name: &str, label: Option<(&str, &str)>) -> f64 {
    snapshot
        .iter()
        .filter(|(k, ..)| k.key().name() == name)
        .filter(|(k, ..)| {
            label.is_none_or(|(l, v)| k.key().labels().any(|x| x.key() == l && x.value() == v))
        })
        .map(|(.., v)| match v {
            DebugValue::Counter(n) => *n as f64,
            DebugValue::Gauge(g) => g.into_inner(),
            DebugValue::Histogram(_) => f64::NAN,
        })
        .sum()
}

#[test]
fn metrics_report_usage_evictions_and_refusals() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let f = metrics::with_local_recorder(&recorder, || l1(2));
    f.write(&keys(0..2));
    f.lease(&key(0), 0);
    f.reserve(&[key(2)]); // evicts key 1, the only cached object
    let _ = f.l1.reserve_read(OWNER, &[key(9)], extra(0)); // one NotFound
    f.l1.publish_metrics();
    // One snapshot: taking one drains the debugging recorder.
    let snapshot = snapshotter.snapshot().into_vec();
    let value = |name: &str, label: Option<(&str, &str)>| metric(&snapshot, name, label);
    assert_eq!(value("tierkv_tier_capacity_bytes", Some(("tier", "l1"))), (2 * SLOT) as f64);
    assert_eq!(
        value("tierkv_tier_used_bytes", None),
        (2 * SLOT) as f64,
        "one leased, one being written"
    );
    assert_eq!(value("tierkv_l1_pinned_bytes", None), (2 * SLOT) as f64);
    assert_eq!(value("tierkv_tier_cached_bytes", None), 0.0);
    assert_eq!(value("tierkv_tier_free_bytes", None), 0.0);
    assert_eq!(value("tierkv_tier_objects", None), 2.0);
    assert_eq!(value("tierkv_l1_leases_active", None), 1.0);
    assert_eq!(value("tierkv_evictions_total", Some(("reason", "on_demand"))), 1.0);
    assert_eq!(value("tierkv_errors_total", Some(("reason", "not_found"))), 1.0);
    assert_eq!(value("tierkv_l1_writes_finished_total", None), 2.0);
}

#[test]
fn victims_leased_for_write_back_count_as_evicted_when_their_slots_are_freed() {
    // Write-back and a stop's hand-down lease their victims, copy them down, then return the
    // shares: the last share frees the slot, and that is when the object leaves L1.
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let f = metrics::with_local_recorder(&recorder, || l1(8));
    f.write(&keys(0..5));
    let written_back = f.l1.lease_eviction_candidates(OWNER, 2, EvictionReason::WriteBack);
    let handed_down = f.l1.lease_eviction_candidates(OWNER, 2, EvictionReason::Stop);
    let read = f.lease(&written_back.keys[0], 0);
    // Evictions since the last call: a snapshot drains the debugging recorder's counters.
    let evicted = |reason| {
        let snapshot = snapshotter.snapshot().into_vec();
        metric(&snapshot, "tierkv_evictions_total", Some(("reason", reason)))
    };
    f.l1.release_lease(written_back.lease.unwrap()).unwrap();
    assert_eq!(evicted("write_back"), 1.0, "the victim no reader holds goes with the lease");
    f.release(read, 0);
    assert_eq!(evicted("write_back"), 1.0, "the other when its reader is done");
    // A victim deleted before its lease returns was deleted, not evicted.
    assert_eq!(f.l1.delete(&handed_down.keys[..1], true), vec![Ok(())]);
    f.l1.release_lease(handed_down.lease.unwrap()).unwrap();
    assert_eq!(evicted("stop"), 1.0);
    assert_eq!(f.usage().cached, 1, "the one object never leased stays");
    f.assert_consistent();
}

#[test]
fn a_release_naming_no_key_is_counted_by_its_reason() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let f = metrics::with_local_recorder(&recorder, || l1(2));
    f.write(&keys(0..1));
    let lease = f.lease(&key(0), 0);
    let error = f.l1.finish_read(lease, Readers::One(0), Some(&[])).unwrap_err();
    assert_eq!(error, L1Error::EmptyRelease(lease));
    let snapshot = snapshotter.snapshot().into_vec();
    assert_eq!(metric(&snapshot, "tierkv_errors_total", Some(("reason", "empty_release"))), 1.0);
}

#[test]
fn used_bytes_count_every_state_and_pinned_bytes_what_eviction_cannot_free() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let f = metrics::with_local_recorder(&recorder, || l1(3));
    f.write(&keys(0..2));
    f.lease(&key(0), 0); // key 0 leased, key 1 cached, one slot free
    f.l1.publish_metrics();
    let snapshot = snapshotter.snapshot().into_vec();
    let gauge = |name: &str| metric(&snapshot, name, None);
    // The same meaning as the tiers below: used + free = capacity.
    assert_eq!(gauge("tierkv_tier_used_bytes"), (2 * SLOT) as f64);
    assert_eq!(gauge("tierkv_tier_free_bytes"), SLOT as f64);
    assert_eq!(gauge("tierkv_tier_capacity_bytes"), (3 * SLOT) as f64);
    assert_eq!(gauge("tierkv_tier_cached_bytes"), SLOT as f64);
    assert_eq!(gauge("tierkv_l1_pinned_bytes"), SLOT as f64);
}

#[test]
fn an_enormous_lease_ttl_means_never_not_a_panic() {
    let f = with_config(tierkv_l1::L1Config { lease_ttl: Duration::MAX, ..config(2) });
    f.write(&[key(0)]);
    let lease = f.lease(&key(0), 0);
    f.clock.advance(Duration::MAX);
    assert_eq!(f.l1.expire_leases(), 0);
    f.release(lease, 0);
}

#[test]
fn background_eviction_keeps_a_one_slot_l1s_chunk() {
    // The low watermark of one slot rounds down to none: L1 would hold nothing.
    let f = l1(1);
    f.write(&keys(0..1));
    assert!(f.l1.evict_to_watermark().is_empty(), "its only chunk was evicted");
    assert_eq!(f.l1.usage().cached_bytes, SLOT, "the chunk is still cached");
    f.assert_consistent();
}
