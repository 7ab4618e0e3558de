//! Issue 16: the L1 operations the storage layer's fixes stand on.

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

mod common;

use std::sync::{Arc, OnceLock, Weak, mpsc};
use std::time::Duration;

use parking_lot::Mutex;
use common::*;
use tierkv_core::{ChunkSource, KeyError, ObjectKey};
use tierkv_l1::{
    Demoter, L1Config, L1Context, L1Error, L1Manager, Lifetime, OwnerId, Presence, Readers,
    WriteMode,
};

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

/// What the demoter saw while it held a victim's bytes.
#[derive(Default)]
struct Seen {
    /// The victim and whether its bytes were its payload.
    demoted: Vec<(ObjectKey, bool)>,
    /// Whether another thread's look at the victim's shard finished during the copy.
    shard_free: Vec<bool>,
}

/// A cascade's demoter standing in for L2: it reads the victim's bytes and, while it holds
/// them, has another thread look up a key of the victim's (only) shard.
struct Probe {
    l1: OnceLock<Weak<L1Manager>>,
    other: ObjectKey,
    seen: Mutex<Seen>,
}

impl Demoter for Probe {
    fn demote(&self, key: &ObjectKey, bytes: &dyn ChunkSource) {
        let mut copy = vec![0u8; bytes.len() as usize];
        let intact = bytes.copy_to_host(&mut copy).is_ok() && copy == payload(key, 0);
        let l1 = self.l1.get().and_then(Weak::upgrade);
        let (tx, rx) = mpsc::channel();
        let other = self.other;
        std::thread::spawn(move || {
            if let Some(l1) = l1 {
                let _ = tx.send(l1.presence(&other));
            }
        });
        let free = rx.recv_timeout(Duration::from_secs(5)).is_ok();
        let mut seen = self.seen.lock();
        seen.demoted.push((*key, intact));
        seen.shard_free.push(free);
    }
}

/// The cascade copies an eviction victim into the tier below with no shard locked: the victim
/// has left its shard's map (nobody can pin or be given its slot) and its bytes stay put until
/// the copy is over, so the shard's other lookups need not wait behind it.
#[test]
fn an_eviction_victim_is_demoted_without_holding_up_its_shard() {
    let probe =
        Arc::new(Probe { l1: OnceLock::new(), other: key(1), seen: Mutex::new(Seen::default()) });
    let context = L1Context { demoter: Some(probe.clone()), ..L1Context::default() };
    let l1 = Arc::new(L1Manager::build(L1Config { shards: 1, ..config(4) }, context).unwrap());
    let _ = probe.l1.set(Arc::downgrade(&l1));
    let write = |keys: &[ObjectKey]| {
        let reserved =
            l1.reserve_write(OWNER, keys, &layout(), WriteMode::Create, Lifetime::Cached).unwrap();
        assert!(reserved.iter().all(|r| r.is_ok()), "{reserved:?}");
        for k in keys {
            l1.write_access(OWNER, k).unwrap().write_at(0, &payload(k, 0)).unwrap();
        }
        assert!(l1.finish_write(OWNER, keys).iter().all(|r| r.is_ok()));
    };
    write(&keys(0..4));
    // Full: the fifth write evicts the oldest, key 0, and demotes it.
    write(&keys(4..5));
    let seen = probe.seen.lock();
    assert_eq!(seen.demoted, vec![(key(0), true)], "the victim's own bytes, demoted once");
    assert_eq!(
        seen.shard_free,
        vec![true],
        "a lookup of the victim's shard waited for the copy to the tier below"
    );
    assert!(matches!(l1.presence(&key(0)), Presence::Absent));
    l1.audit().unwrap();
}
