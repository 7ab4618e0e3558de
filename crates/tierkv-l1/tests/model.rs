//! A35/A36 and the lease rules as a property: random sequences of every L1 operation run
//! against the real manager and against a small reference model, compared after every step.
//!
//! The L1 has one shard and LRU eviction, so the model can predict every on-demand and
//! watermark victim exactly. After each step the test checks: the operation's answer equals the
//! model's; every key's state and share count equals the model's; the usage counters equal the
//! model's and add up to the capacity (A35); after every lease returns, used bytes are those of
//! objects being written (A36); the manager's own audit passes (no slot owned twice, share
//! counts equal the lease ledger, policy tracking exact); the observer heard exactly the
//! evictions and finished writes the model predicts; and every byte read back is the byte
//! written. A share that was released or revoked can never be released again because the model
//! answers such a release with an error and the manager must agree.
//!
//! A read or write guard may outlive its step (`keep`, until a `DropGuard`): the model then
//! refuses another writer and `finish_write` with `Busy`, keeps pinned objects from eviction and
//! updates, and counts the slot of an entry removed under a guard (a forced delete, an abort, a
//! disconnect, a temporary object's last share) as retiring, not free, until its last guard drops.

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::*;
use proptest::prelude::*;
use tierkv_core::{ExtraCount, KeyError, ObjectKey};
use tierkv_l1::{
    EvictionReason, L1Error, LeaseId, Lifetime, OwnerId, Presence, Readers, Released, Watermark,
    WriteMode,
};

const KEYS: u8 = 6;
const SLOTS: u64 = 4;
const TTL: Duration = Duration::from_millis(10);

#[derive(Clone, Debug)]
enum Op {
    ReserveWrite {
        keys: Vec<u8>,
        update: bool,
        temporary: bool,
        owner: u8,
    },
    /// Copies into a reserved key; with `keep`, the write guard stays open after the step.
    Fill {
        key: u8,
        owner: u8,
        keep: bool,
    },
    FinishWrite {
        keys: Vec<u8>,
        owner: u8,
    },
    AbortWrite {
        keys: Vec<u8>,
        owner: u8,
    },
    ReserveRead {
        keys: Vec<u8>,
        extra: u8,
        owner: u8,
    },
    Promote {
        keys: Vec<u8>,
        extra: u8,
        owner: u8,
    },
    FinishRead {
        lease: usize,
        readers: Readers,
        keys: Option<Vec<u8>>,
    },
    ReleaseLease {
        lease: usize,
    },
    /// Reads a leased key; with `keep`, the read guard stays open after the step.
    Read {
        lease: usize,
        reader: u8,
        key: u8,
        keep: bool,
    },
    /// Drops a guard kept open (one pick among them).
    DropGuard {
        pick: usize,
    },
    Delete {
        keys: Vec<u8>,
        force: bool,
    },
    Clear {
        force: bool,
    },
    EvictWatermark,
    Advance {
        millis: u64,
    },
    ExpireLeases,
    ReleaseOwner {
        owner: u8,
    },
    LeaseForEviction {
        n: usize,
        owner: u8,
    },
}

fn key_list() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0..KEYS, 1..5)
}

fn readers() -> impl Strategy<Value = Readers> {
    prop_oneof![
        (0u8..5).prop_map(Readers::One),
        Just(Readers::All),
        (0u128..32).prop_map(Readers::Set)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let owner = 0u8..2;
    let extra = prop_oneof![4 => 0u8..4, 1 => Just(127u8)];
    prop_oneof![
        4 => (key_list(), prop::bool::weighted(0.15), prop::bool::weighted(0.2), owner.clone())
            .prop_map(|(keys, update, temporary, owner)| Op::ReserveWrite { keys, update, temporary, owner }),
        3 => (0..KEYS, owner.clone(), prop::bool::weighted(0.25))
            .prop_map(|(key, owner, keep)| Op::Fill { key, owner, keep }),
        4 => (key_list(), owner.clone()).prop_map(|(keys, owner)| Op::FinishWrite { keys, owner }),
        1 => (key_list(), owner.clone()).prop_map(|(keys, owner)| Op::AbortWrite { keys, owner }),
        4 => (key_list(), extra.clone(), owner.clone()).prop_map(|(keys, extra, owner)| Op::ReserveRead { keys, extra, owner }),
        2 => (key_list(), extra, owner.clone()).prop_map(|(keys, extra, owner)| Op::Promote { keys, extra, owner }),
        5 => (0usize..64, readers(), prop::option::weighted(0.4, prop::collection::vec(0u8..16, 1..5)))
            .prop_map(|(lease, readers, keys)| Op::FinishRead { lease, readers, keys }),
        1 => (0usize..64).prop_map(|lease| Op::ReleaseLease { lease }),
        2 => (0usize..64, 0u8..5, 0u8..16, prop::bool::weighted(0.5))
            .prop_map(|(lease, reader, key, keep)| Op::Read { lease, reader, key, keep }),
        1 => (0usize..8).prop_map(|pick| Op::DropGuard { pick }),
        1 => (key_list(), prop::bool::weighted(0.3)).prop_map(|(keys, force)| Op::Delete { keys, force }),
        1 => prop::bool::weighted(0.3).prop_map(|force| Op::Clear { force }),
        1 => Just(Op::EvictWatermark),
        2 => (0u64..15).prop_map(|millis| Op::Advance { millis }),
        1 => Just(Op::ExpireLeases),
        1 => owner.prop_map(|owner| Op::ReleaseOwner { owner }),
        1 => (1usize..4, 0u8..2).prop_map(|(n, owner)| Op::LeaseForEviction { n, owner }),
    ]
}

// ----- the model -----

#[derive(Clone, Debug)]
struct MEntry {
    writer: Option<u8>,
    temporary: bool,
    shares: u64,
    generation: u64,
    /// The payload version in the slot, when known (a fresh slot holds someone else's bytes).
    content: Option<u64>,
}

#[derive(Clone, Debug)]
struct MLease {
    owner: u8,
    readers: u32,
    deadline: Duration,
    keys: BTreeMap<u8, (u64, u128)>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Ended {
    Released,
    Revoked,
}

#[derive(Default)]
struct Model {
    entries: BTreeMap<u8, MEntry>,
    /// Finished, non-temporary entries, least recently used first.
    lru: Vec<u8>,
    /// The guards kept open, as (key, generation of the entry pinned, writer): each pins its
    /// entry's slot, which stays retiring after the entry goes until its last guard drops.
    pins: Vec<(u8, u64, bool)>,
    leases: BTreeMap<u64, MLease>,
    ended: BTreeMap<u64, Ended>,
    issued: Vec<u64>,
    next_lease: u64,
    next_generation: u64,
    next_version: u64,
    now: Duration,
    evicted: Vec<(u8, EvictionReason)>,
    finished: Vec<u8>,
    /// The generation the manager gave each key's latest reservation: what its writer knows,
    /// and names when it promotes the key.
    handed: BTreeMap<u8, u64>,
}

fn all(readers: u32) -> u128 {
    if readers >= 128 { u128::MAX } else { (1 << readers) - 1 }
}

impl Model {
    fn new() -> Self {
        Model { next_lease: 1, ..Model::default() }
    }

    fn touch(&mut self, k: u8) {
        if let Some(pos) = self.lru.iter().position(|x| *x == k) {
            self.lru.remove(pos);
            self.lru.push(k);
        }
    }

    fn untrack(&mut self, k: u8) {
        self.lru.retain(|x| *x != k);
    }

    fn remove(&mut self, k: u8) {
        if self.entries.remove(&k).is_some() {
            self.untrack(k);
        }
    }

    /// Whether a guard (a write guard, for `writer`) pins the live entry of `k`.
    fn pinned(&self, k: u8, writer: bool) -> bool {
        let Some(entry) = self.entries.get(&k) else { return false };
        self.pins.iter().any(|&(key, generation, w)| {
            key == k && generation == entry.generation && (w || !writer)
        })
    }

    /// Slots whose entry is gone while a guard still pins them.
    fn retiring(&self) -> u64 {
        let gone: BTreeSet<(u8, u64)> = self
            .pins
            .iter()
            .filter(|(key, generation, _)| {
                self.entries.get(key).is_none_or(|e| e.generation != *generation)
            })
            .map(|&(key, generation, _)| (key, generation))
            .collect();
        gone.len() as u64
    }

    fn free(&self) -> u64 {
        SLOTS - self.entries.len() as u64 - self.retiring()
    }

    /// Evictable: finished, unleased and no guard pins it.
    fn evictable(&self, k: u8) -> bool {
        self.entries[&k].shares == 0 && !self.pinned(k, false)
    }

    /// Evicts the least recently used cached entry; false when none is evictable.
    fn evict_one(&mut self, reason: EvictionReason) -> bool {
        let victim = self.lru.iter().copied().find(|k| self.evictable(*k));
        match victim {
            Some(k) => {
                self.remove(k);
                self.evicted.push((k, reason));
                true
            }
            None => false,
        }
    }

    /// Mostly a lease that was issued (live or ended); one pick in `issued + 1` is a lease id
    /// that never existed.
    fn lease_id(&self, pick: usize) -> LeaseId {
        let pick = pick % (self.issued.len() + 1);
        LeaseId(self.issued.get(pick).copied().unwrap_or(1_000_000 + pick as u64))
    }

    /// `Ok` with the live lease id, or the error a dead one is answered with (revoking it first
    /// if it just expired).
    fn live(&mut self, id: LeaseId) -> Result<u64, L1Error> {
        match self.leases.get(&id.0) {
            None => Err(match self.ended.get(&id.0) {
                Some(Ended::Released) => L1Error::LeaseReleased(id),
                Some(Ended::Revoked) => L1Error::LeaseExpired(id),
                None => L1Error::UnknownLease(id),
            }),
            Some(lease) if lease.deadline <= self.now => {
                self.revoke(id.0);
                Err(L1Error::LeaseExpired(id))
            }
            Some(_) => Ok(id.0),
        }
    }

    fn revoke(&mut self, id: u64) {
        if let Some(mut lease) = self.leases.remove(&id) {
            let keys: Vec<u8> = lease.keys.keys().copied().collect();
            self.give_back(&mut lease, &keys, None);
            self.ended.insert(id, Ended::Revoked);
        }
    }

    /// Returns the shares of `mask` (every outstanding share for `None`) of `keys`.
    fn give_back(&mut self, lease: &mut MLease, keys: &[u8], mask: Option<u128>) -> Released {
        let mut released = Released::default();
        for k in keys {
            let Some((generation, outstanding)) = lease.keys.get_mut(k) else {
                continue;
            };
            let returning = mask.unwrap_or(*outstanding) & *outstanding;
            *outstanding &= !returning;
            let n = u64::from(returning.count_ones());
            released.shares += n;
            let generation = *generation;
            if n == 0 {
                continue;
            }
            if let Some(entry) = self.entries.get_mut(k).filter(|e| e.generation == generation) {
                entry.shares -= n;
                if entry.shares == 0 {
                    released.unleased += 1;
                    if entry.temporary {
                        self.remove(*k);
                    }
                }
            }
        }
        lease.keys.retain(|_, (_, outstanding)| *outstanding != 0);
        released
    }

    fn end_if_empty(&mut self, id: u64, lease: MLease, released: &mut Released) {
        if lease.keys.is_empty() {
            self.ended.insert(id, Ended::Released);
            released.lease_ended = true;
        } else {
            self.leases.insert(id, lease);
        }
    }

    /// Mostly a key the lease covers; one pick in `covered + 1` is any key.
    fn lease_key(&self, id: LeaseId, pick: u8) -> u8 {
        let covered: Vec<u8> =
            self.leases.get(&id.0).map(|l| l.keys.keys().copied().collect()).unwrap_or_default();
        let pick = usize::from(pick);
        covered.get(pick % (covered.len() + 1)).copied().unwrap_or((pick % usize::from(KEYS)) as u8)
    }

    fn classify(&self, k: u8) -> KeyError {
        if self.entries.contains_key(&k) { KeyError::WrongState } else { KeyError::NotFound }
    }

    fn grant(
        &mut self,
        owner: u8,
        keys: &[u8],
        extra: u8,
        promote: bool,
    ) -> Vec<Result<(), KeyError>> {
        let readers = u32::from(extra) + 1;
        let generation_of = |e: &MEntry| e.generation;
        let mut lease = MLease { owner, readers, deadline: self.now + TTL, keys: BTreeMap::new() };
        let mut results = Vec::new();
        for &k in keys {
            let result = if lease.keys.contains_key(&k) {
                Err(KeyError::Duplicate)
            } else {
                match self.entries.get(&k).cloned() {
                    None => Err(KeyError::NotFound),
                    Some(e) if !promote && e.writer.is_some() => Err(KeyError::NotReadable),
                    Some(_) if !promote => {
                        self.touch(k);
                        Ok(())
                    }
                    Some(e) => match e.writer {
                        Some(w) if w == owner && self.pinned(k, true) => Err(KeyError::Busy),
                        Some(w) if w == owner => {
                            if !e.temporary {
                                self.lru.push(k);
                            }
                            Ok(())
                        }
                        Some(_) => Err(KeyError::Locked),
                        None => Err(KeyError::WrongState),
                    },
                }
            };
            if result.is_ok() {
                let entry = self.entries.get_mut(&k).unwrap_or_else(|| unreachable!());
                entry.writer = None;
                entry.shares += u64::from(readers);
                lease.keys.insert(k, (generation_of(entry), all(readers)));
            }
            results.push(result);
        }
        if !lease.keys.is_empty() {
            let id = self.next_lease;
            self.next_lease += 1;
            self.issued.push(id);
            self.leases.insert(id, lease);
        }
        results
    }
}

// ----- the harness -----

fn k(i: u8) -> ObjectKey {
    key(u64::from(i))
}

fn ks(list: &[u8]) -> Vec<ObjectKey> {
    list.iter().copied().map(k).collect()
}

fn owner(o: u8) -> OwnerId {
    OwnerId(u64::from(o) + 1)
}

fn unit<T>(results: Vec<Result<T, KeyError>>) -> Vec<Result<(), KeyError>> {
    results.into_iter().map(|r| r.map(|_| ())).collect()
}

/// Compares errors; for a whole-lease release the key an `AlreadyReleased` names depends on
/// hash order, so only the variant is compared there.
fn same_error(actual: &L1Error, expected: &L1Error, whole_lease: bool) -> bool {
    match (actual, expected) {
        (L1Error::AlreadyReleased { lease: a, .. }, L1Error::AlreadyReleased { lease: b, .. })
            if whole_lease =>
        {
            a == b
        }
        _ => actual == expected,
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let f = with_config(tierkv_l1::L1Config {
        shards: 1,
        lease_ttl: TTL,
        watermark: Watermark { high: 0.75, low: 0.5 },
        ..config(SLOTS)
    });
    let mut m = Model::new();
    let mut held = Vec::new();
    for (step, op) in ops.into_iter().enumerate() {
        apply(&f, &mut m, &mut held, &op)
            .map_err(|e| TestCaseError::fail(format!("step {step} {op:?}: {e}")))?;
        check(&f, &m).map_err(|e| TestCaseError::fail(format!("after step {step} {op:?}: {e}")))?;
    }
    // Quiescence: dropping every guard, returning every lease and aborting every write leaves
    // used == 0.
    drop(held);
    f.l1.release_owner(owner(0));
    f.l1.release_owner(owner(1));
    let u = f.usage();
    prop_assert_eq!(u.used_bytes, 0, "{:?}", u);
    prop_assert!(f.l1.audit().is_ok());
    Ok(())
}

/// `held` keeps the guards that outlive their step, in the order of `Model::pins`.
fn apply(
    f: &Fixture,
    m: &mut Model,
    held: &mut Vec<Box<dyn std::any::Any>>,
    op: &Op,
) -> Result<(), String> {
    macro_rules! expect_eq {
        ($actual:expr, $expected:expr) => {{
            let (a, e) = ($actual, $expected);
            if a != e {
                return Err(format!("manager answered {a:?}, model {e:?}"));
            }
        }};
    }
    match op {
        Op::ReserveWrite { keys, update, temporary, owner: o } => {
            let mode = if *update { WriteMode::Update } else { WriteMode::Create };
            let lifetime = if *temporary { Lifetime::Temporary } else { Lifetime::Cached };
            let actual =
                f.l1.reserve_write(owner(*o), &ks(keys), &layout(), mode, lifetime)
                    .map_err(|e| e.to_string())?;
            for (key, result) in keys.iter().zip(&actual) {
                if let Ok(handle) = result {
                    m.handed.insert(*key, handle.generation);
                }
            }
            let mut expected = Vec::new();
            let mut out_of_memory = false;
            for &key in keys {
                let result = if out_of_memory {
                    Err(KeyError::OutOfMemory)
                } else if *update {
                    match m.entries.get(&key).cloned() {
                        None => Err(KeyError::NotFound),
                        Some(e) if e.writer.is_some() => Err(KeyError::WriteInFlight),
                        Some(e) if e.shares > 0 || m.pinned(key, false) => Err(KeyError::Locked),
                        Some(_) => {
                            m.untrack(key);
                            m.next_generation += 1;
                            let entry = m.entries.get_mut(&key).unwrap_or_else(|| unreachable!());
                            entry.writer = Some(*o);
                            entry.temporary = *temporary;
                            entry.generation = m.next_generation;
                            Ok(())
                        }
                    }
                } else {
                    match m.entries.get(&key).map(|e| e.writer.is_some()) {
                        Some(true) => Err(KeyError::WriteInFlight),
                        Some(_) => Err(KeyError::AlreadyPresent),
                        None if m.free() == 0 && !m.evict_one(EvictionReason::OnDemand) => {
                            Err(KeyError::OutOfMemory)
                        }
                        None => {
                            m.next_generation += 1;
                            let entry = MEntry {
                                writer: Some(*o),
                                temporary: *temporary,
                                shares: 0,
                                generation: m.next_generation,
                                content: None,
                            };
                            m.entries.insert(key, entry);
                            Ok(())
                        }
                    }
                };
                out_of_memory |= result == Err(KeyError::OutOfMemory);
                expected.push(result);
            }
            expect_eq!(unit(actual), expected);
        }
        Op::Fill { key, owner: o, keep } => {
            let expected = match m.entries.get(key) {
                None => Err(KeyError::NotFound),
                Some(e) => match e.writer {
                    Some(w) if w == *o && m.pinned(*key, true) => Err(KeyError::Busy),
                    Some(w) if w == *o => Ok(()),
                    Some(_) => Err(KeyError::Locked),
                    None => Err(KeyError::WrongState),
                },
            };
            match f.l1.write_access(owner(*o), &k(*key)) {
                Ok(mut guard) => {
                    expect_eq!(Ok::<(), KeyError>(()), expected);
                    m.next_version += 1;
                    guard
                        .write_at(0, &payload(&k(*key), m.next_version))
                        .map_err(|e| e.to_string())?;
                    let entry = m.entries.get_mut(key).unwrap_or_else(|| unreachable!());
                    entry.content = Some(m.next_version);
                    if *keep {
                        m.pins.push((*key, entry.generation, true));
                        held.push(Box::new(guard));
                    }
                }
                Err(L1Error::Key { error, .. }) => expect_eq!(Err::<(), KeyError>(error), expected),
                Err(other) => return Err(format!("unexpected {other}")),
            }
        }
        Op::FinishWrite { keys, owner: o } => {
            let actual = f.l1.finish_write(owner(*o), &ks(keys));
            let expected: Vec<_> = keys
                .iter()
                .map(|&key| match m.entries.get(&key).cloned() {
                    None => Err(KeyError::NotFound),
                    Some(e) => match e.writer {
                        Some(w) if w != *o => Err(KeyError::Locked),
                        None => Err(KeyError::WrongState),
                        Some(_) if m.pinned(key, true) => Err(KeyError::Busy),
                        Some(_) if e.temporary => Err(KeyError::WrongState),
                        Some(_) => {
                            m.entries.get_mut(&key).unwrap_or_else(|| unreachable!()).writer = None;
                            m.lru.push(key);
                            m.finished.push(key);
                            Ok(())
                        }
                    },
                })
                .collect();
            expect_eq!(actual, expected);
        }
        Op::AbortWrite { keys, owner: o } => {
            let actual = f.l1.abort_write(owner(*o), &ks(keys));
            let expected: Vec<_> = keys
                .iter()
                .map(|&key| match m.entries.get(&key).map(|e| e.writer) {
                    None => Err(KeyError::NotFound),
                    Some(None) => Err(KeyError::WrongState),
                    Some(Some(w)) if w != *o => Err(KeyError::Locked),
                    Some(Some(_)) => {
                        m.remove(key);
                        Ok(())
                    }
                })
                .collect();
            expect_eq!(actual, expected);
        }
        Op::ReserveRead { keys, extra, owner: o } | Op::Promote { keys, extra, owner: o } => {
            let promote = matches!(op, Op::Promote { .. });
            let count = ExtraCount::new(i64::from(*extra)).map_err(|e| e.to_string())?;
            let grant = if promote {
                let reservations: Vec<(ObjectKey, u64)> = keys
                    .iter()
                    .map(|key| (k(*key), m.handed.get(key).copied().unwrap_or(0)))
                    .collect();
                f.l1.finish_write_and_reserve_read(owner(*o), &reservations, count)
            } else {
                f.l1.reserve_read(owner(*o), &ks(keys), count)
            };
            let expected_id = m.next_lease;
            let expected = m.grant(*o, keys, *extra, promote);
            let granted = expected.iter().any(|r| r.is_ok());
            expect_eq!(unit(grant.results), expected);
            expect_eq!(grant.lease, granted.then_some(LeaseId(expected_id)));
        }
        Op::FinishRead { lease, readers, keys } => {
            let id = m.lease_id(*lease);
            let keys: Option<Vec<u8>> =
                keys.as_ref().map(|picks| picks.iter().map(|p| m.lease_key(id, *p)).collect());
            let actual = f.l1.finish_read(id, *readers, keys.as_ref().map(|l| ks(l)).as_deref());
            let expected = model_finish_read(m, id, *readers, keys.as_deref());
            match (&actual, &expected) {
                (Ok(a), Ok(e)) => expect_eq!(a, e),
                (Err(a), Err(e)) if same_error(a, e, keys.is_none()) => {}
                _ => return Err(format!("manager answered {actual:?}, model {expected:?}")),
            }
        }
        Op::ReleaseLease { lease } => {
            let id = m.lease_id(*lease);
            let actual = f.l1.release_lease(id);
            let expected = m.live(id).map(|live| {
                let mut record = m.leases.remove(&live).unwrap_or_else(|| unreachable!());
                let keys: Vec<u8> = record.keys.keys().copied().collect();
                let mut released = m.give_back(&mut record, &keys, None);
                m.end_if_empty(live, record, &mut released);
                released
            });
            expect_eq!(actual, expected);
        }
        Op::Read { lease, reader, key, keep } => {
            let id = m.lease_id(*lease);
            let key = &m.lease_key(id, *key);
            let expected = model_read(m, id, *reader, *key);
            match f.l1.read_access(id, *reader, &k(*key)) {
                Ok(guard) => {
                    let content =
                        expected.map_err(|e| format!("manager granted a read, model says {e}"))?;
                    if let Some(version) = content {
                        let mut bytes = vec![0; SLOT as usize];
                        guard.read_at(0, &mut bytes).map_err(|e| e.to_string())?;
                        if bytes != payload(&k(*key), version) {
                            return Err(format!("bytes of {key} differ from version {version}"));
                        }
                    }
                    if *keep {
                        let generation = m.entries[key].generation;
                        m.pins.push((*key, generation, false));
                        held.push(Box::new(guard));
                    }
                }
                Err(actual) => match expected {
                    Err(e) if e == actual => {}
                    other => {
                        return Err(format!("manager refused with {actual}, model says {other:?}"));
                    }
                },
            }
        }
        Op::Delete { keys, force } => {
            let actual = f.l1.delete(&ks(keys), *force);
            let expected: Vec<_> = keys
                .iter()
                .map(|&key| match m.entries.get(&key) {
                    None => Err(KeyError::NotFound),
                    Some(e) if !force && (e.writer.is_some() || e.shares > 0) => {
                        Err(KeyError::Locked)
                    }
                    Some(_) => {
                        m.remove(key);
                        Ok(())
                    }
                })
                .collect();
            expect_eq!(actual, expected);
        }
        Op::Clear { force } => {
            let cleared = f.l1.clear(*force);
            let doomed: Vec<u8> = m
                .entries
                .iter()
                .filter(|(_, e)| *force || (e.writer.is_none() && e.shares == 0))
                .map(|(k, _)| *k)
                .collect();
            let kept = m.entries.len() - doomed.len();
            for key in &doomed {
                m.remove(*key);
            }
            expect_eq!((cleared.removed, cleared.kept), (doomed.len(), kept));
        }
        Op::EvictWatermark => {
            let victims = f.l1.evict_to_watermark();
            let before = m.evicted.len();
            let occupied = |m: &Model| SLOTS - m.free();
            if occupied(m) as f64 > 0.75 * SLOTS as f64 {
                let target = (0.5 * SLOTS as f64).floor() as u64;
                while occupied(m) > target && m.evict_one(EvictionReason::Watermark) {}
            }
            let expected: Vec<ObjectKey> =
                m.evicted[before..].iter().map(|(key, _)| k(*key)).collect();
            expect_eq!(victims, expected);
        }
        Op::DropGuard { pick } => {
            if !held.is_empty() {
                let i = pick % held.len();
                drop(held.remove(i));
                m.pins.remove(i);
            }
        }
        Op::Advance { millis } => {
            f.clock.advance(Duration::from_millis(*millis));
            m.now += Duration::from_millis(*millis);
        }
        Op::ExpireLeases => {
            let due: Vec<u64> =
                m.leases.iter().filter(|(_, l)| l.deadline <= m.now).map(|(id, _)| *id).collect();
            for id in &due {
                m.revoke(*id);
            }
            expect_eq!(f.l1.expire_leases(), due.len());
        }
        Op::LeaseForEviction { n, owner: o } => {
            let grant = f.l1.lease_eviction_candidates(owner(*o), *n, EvictionReason::WriteBack);
            let mut victims = Vec::new();
            while victims.len() < *n {
                let Some(k) = m.lru.iter().copied().find(|k| m.evictable(*k)) else {
                    break;
                };
                m.untrack(k);
                victims.push(k);
            }
            // No deadline: the write-back returns it once the victims are copied down.
            let mut lease =
                MLease { owner: *o, readers: 1, deadline: Duration::MAX, keys: BTreeMap::new() };
            for k in &victims {
                let entry = m.entries.get_mut(k).unwrap_or_else(|| unreachable!());
                entry.temporary = true;
                entry.shares += 1;
                lease.keys.insert(*k, (entry.generation, 1));
            }
            let expected_id = (!victims.is_empty()).then(|| {
                let id = m.next_lease;
                m.next_lease += 1;
                m.issued.push(id);
                m.leases.insert(id, lease);
                LeaseId(id)
            });
            expect_eq!(grant.keys, ks(&victims));
            expect_eq!(grant.lease, expected_id);
        }
        Op::ReleaseOwner { owner: o } => {
            let report = f.l1.release_owner(owner(*o));
            let owned: Vec<u64> =
                m.leases.iter().filter(|(_, l)| l.owner == *o).map(|(id, _)| *id).collect();
            let mut shares = 0;
            for id in &owned {
                let mut record = m.leases.remove(id).unwrap_or_else(|| unreachable!());
                let keys: Vec<u8> = record.keys.keys().copied().collect();
                shares += m.give_back(&mut record, &keys, None).shares;
                // One past its deadline is revoked, as any call that finds it is.
                let ended = if record.deadline <= m.now { Ended::Revoked } else { Ended::Released };
                m.ended.insert(*id, ended);
            }
            let writes: Vec<u8> =
                m.entries.iter().filter(|(_, e)| e.writer == Some(*o)).map(|(k, _)| *k).collect();
            for key in &writes {
                m.remove(*key);
            }
            expect_eq!(
                (report.leases, report.shares, report.aborted_writes),
                (owned.len(), shares, writes.len())
            );
        }
    }
    Ok(())
}

fn model_finish_read(
    m: &mut Model,
    id: LeaseId,
    readers: Readers,
    keys: Option<&[u8]>,
) -> Result<Released, L1Error> {
    let live = m.live(id)?;
    let record = &m.leases[&live];
    let everyone = all(record.readers);
    let mask = match readers {
        Readers::One(r) if u32::from(r) < record.readers => 1u128 << r,
        Readers::All => everyone,
        Readers::Set(s) if s != 0 && s & !everyone == 0 => s,
        Readers::One(reader) => {
            return Err(L1Error::NoSuchReader { lease: id, reader, readers: record.readers });
        }
        Readers::Set(s) => {
            let outside = s & !everyone;
            let reader = if outside == 0 { 0 } else { outside.trailing_zeros() as u8 };
            return Err(L1Error::NoSuchReader { lease: id, reader, readers: record.readers });
        }
    };
    let selected: Vec<u8> = match keys {
        None => record.keys.keys().copied().collect(),
        Some([]) => return Err(L1Error::EmptyRelease(id)),
        Some(list) => list.to_vec(),
    };
    let mut seen = BTreeSet::new();
    for &key in &selected {
        let Some((_, outstanding)) = record.keys.get(&key) else {
            return Err(L1Error::NotLeased { lease: id, key: k(key), error: m.classify(key) });
        };
        if !seen.insert(key) {
            return Err(L1Error::NotLeased { lease: id, key: k(key), error: KeyError::Duplicate });
        }
        if outstanding & mask != mask {
            let reader = (mask & !outstanding).trailing_zeros() as u8;
            return Err(L1Error::AlreadyReleased { lease: id, reader, key: k(key) });
        }
    }
    let mut record = m.leases.remove(&live).unwrap_or_else(|| unreachable!());
    let mut released = m.give_back(&mut record, &selected, Some(mask));
    m.end_if_empty(live, record, &mut released);
    Ok(released)
}

/// The content version a read must return (`None`: unknown bytes), or the refusal.
fn model_read(m: &mut Model, id: LeaseId, reader: u8, key: u8) -> Result<Option<u64>, L1Error> {
    let live = m.live(id)?;
    let record = &m.leases[&live];
    if u32::from(reader) >= record.readers {
        return Err(L1Error::NoSuchReader { lease: id, reader, readers: record.readers });
    }
    let Some((generation, outstanding)) = record.keys.get(&key) else {
        return Err(L1Error::NotLeased { lease: id, key: k(key), error: m.classify(key) });
    };
    if outstanding & (1 << reader) == 0 {
        return Err(L1Error::AlreadyReleased { lease: id, reader, key: k(key) });
    }
    match m.entries.get(&key) {
        Some(e) if e.generation == *generation => Ok(e.content),
        _ => Err(L1Error::Key { key: k(key), error: KeyError::NotFound }),
    }
}

fn check(f: &Fixture, m: &Model) -> Result<(), String> {
    for i in 0..KEYS {
        let expected = match m.entries.get(&i) {
            None => Presence::Absent,
            Some(e) if e.writer.is_some() => Presence::Writing,
            Some(e) => Presence::Ready { shares: e.shares, temporary: e.temporary },
        };
        let actual = f.l1.presence(&k(i));
        if actual != expected {
            return Err(format!("key {i} is {actual:?}, model says {expected:?}"));
        }
    }
    let u = f.usage();
    let writing = m.entries.values().filter(|e| e.writer.is_some()).count() as u64;
    let leased = m.entries.values().filter(|e| e.writer.is_none() && e.shares > 0).count() as u64;
    let cached = m.entries.values().filter(|e| e.writer.is_none() && e.shares == 0).count() as u64;
    let (free, retiring) = (m.free(), m.retiring());
    if (u.writing, u.leased, u.cached, u.free_bytes / SLOT, u.retiring)
        != (writing, leased, cached, free, retiring)
    {
        return Err(format!(
            "usage {u:?}, model writing {writing} leased {leased} cached {cached} free {free} \
             retiring {retiring}"
        ));
    }
    if u.used_bytes + u.cached_bytes + u.free_bytes != u.capacity_bytes {
        return Err(format!("A35: used + cached + free != capacity: {u:?}"));
    }
    if m.leases.is_empty() && u.used_bytes != (writing + retiring) * SLOT {
        return Err(format!(
            "A36: no lease is live, yet used bytes {} != bytes written or retiring",
            u.used_bytes
        ));
    }
    if f.l1.active_leases() != m.leases.len() as u64 {
        return Err(format!(
            "{} active leases, model has {}",
            f.l1.active_leases(),
            m.leases.len()
        ));
    }
    let evicted: Vec<_> = f.recorder.evicted.lock().iter().map(|(key, r)| (*key, *r)).collect();
    let expected: Vec<_> = m.evicted.iter().map(|(key, r)| (k(*key), *r)).collect();
    if evicted != expected {
        return Err(format!("evictions {evicted:?}, model {expected:?}"));
    }
    if *f.recorder.finished.lock() != ks(&m.finished) {
        return Err("the store pipeline heard of other writes than the model finished".into());
    }
    f.l1.audit()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn a35_model_agrees_and_accounting_holds_after_every_step(ops in prop::collection::vec(op(), 1..80)) {
        run(ops)?;
    }
}

/// Guards that outlive their step, in the sequences the random ones reach only rarely: a read
/// guard keeps an unleased object from an update and from eviction, a write guard keeps its
/// write from finishing, and a slot freed under a guard is free only once the guard drops.
#[test]
fn guards_kept_open_across_steps_pin_their_slots() {
    let o = 0;
    let write = |key| {
        [
            Op::ReserveWrite { keys: vec![key], update: false, temporary: false, owner: o },
            Op::Fill { key, owner: o, keep: false },
            Op::FinishWrite { keys: vec![key], owner: o },
        ]
    };
    let mut ops: Vec<Op> = write(0).into();
    ops.extend([
        Op::ReserveRead { keys: vec![0], extra: 0, owner: o },
        Op::Read { lease: 0, reader: 0, key: 0, keep: true },
        Op::ReleaseLease { lease: 0 },
        Op::ReserveWrite { keys: vec![0], update: true, temporary: false, owner: o },
    ]);
    ops.extend((1..5).flat_map(write));
    ops.extend([
        Op::ReserveWrite { keys: vec![5], update: false, temporary: false, owner: o },
        Op::Fill { key: 5, owner: o, keep: true },
        Op::FinishWrite { keys: vec![5], owner: o },
        Op::Delete { keys: vec![0, 5], force: true },
        Op::DropGuard { pick: 0 },
        Op::DropGuard { pick: 0 },
    ]);
    if let Err(e) = run(ops) {
        panic!("{e}");
    }
}
