//! Issue 16: the L1 operations the storage layer's fixes stand on.

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

mod common;

use std::time::Duration;

use common::*;
use tierkv_core::KeyError;
use tierkv_l1::{L1Error, OwnerId, Presence, Readers};

const PIPELINE: OwnerId = OwnerId(99);

#[test]
fn h16_02_finish_write_leased_makes_visible_and_pins_in_one_step_without_a_deadline() {
    let f = l1(4);
    f.reserve(&keys(0..4));
    for k in keys(0..4) {
        f.fill(&k, 0);
    }
    let grant = f.l1.finish_write_leased(OWNER, PIPELINE, &keys(0..4));
    assert!(grant.results.iter().all(|r| r.is_ok()));
    let lease = grant.lease.unwrap();
    assert!(f.recorder.finished.lock().is_empty(), "the caller hands the job on itself");
    // Visible and pinned: readable, not evictable, and no new write finds room.
    assert!(matches!(f.l1.presence(&key(0)), Presence::Ready { shares: 1, .. }));
    assert_eq!(f.try_reserve(&keys(4..5))[0], Err(KeyError::OutOfMemory));
    assert_eq!(f.l1.clear(false).removed, 0);
    // Long past any lease deadline it still holds.
    f.clock.advance(LEASE_TTL * 1000);
    assert_eq!(f.l1.expire_leases(), 0);
    assert!(f.l1.lease_live(lease));
    f.l1.finish_read(lease, Readers::One(0), None).unwrap();
    assert!(matches!(f.l1.presence(&key(0)), Presence::Ready { shares: 0, .. }));
    f.l1.audit().unwrap();
}

#[test]
fn h16_02_finish_write_leased_refuses_what_finish_write_refuses() {
    let f = l1(4);
    f.write(&keys(0..1));
    f.reserve(&keys(1..2));
    let grant = f.l1.finish_write_leased(OwnerId(7), PIPELINE, &keys(0..3));
    assert_eq!(
        grant.results.iter().map(|r| r.as_ref().err().copied()).collect::<Vec<_>>(),
        vec![Some(KeyError::WrongState), Some(KeyError::Locked), Some(KeyError::NotFound)]
    );
    assert!(grant.lease.is_none());
    f.l1.audit().unwrap();
}

#[test]
fn h16_12_check_finish_read_answers_like_finish_read_and_changes_nothing() {
    let f = l1(4);
    f.write(&keys(0..2));
    let grant = f.l1.reserve_read(OWNER, &keys(0..2), extra(1));
    let lease = grant.lease.unwrap();
    f.l1.check_finish_read(lease, Readers::One(0), Some(&keys(0..2))).unwrap();
    f.l1.check_finish_read(lease, Readers::One(0), Some(&keys(0..2))).unwrap();
    assert!(matches!(f.l1.presence(&key(0)), Presence::Ready { shares: 2, .. }));
    f.l1.finish_read(lease, Readers::One(0), Some(&keys(0..1))).unwrap();
    assert!(matches!(
        f.l1.check_finish_read(lease, Readers::One(0), Some(&keys(0..2))),
        Err(L1Error::AlreadyReleased { .. })
    ));
    // The refused check left key 1's share in place: the real release still works.
    f.l1.finish_read(lease, Readers::One(0), Some(&keys(1..2))).unwrap();
    f.clock.advance(LEASE_TTL + Duration::from_secs(1));
    assert!(matches!(
        f.l1.check_finish_read(lease, Readers::One(1), None),
        Err(L1Error::LeaseExpired(_))
    ));
    assert!(!f.l1.lease_live(lease));
    f.l1.audit().unwrap();
}
