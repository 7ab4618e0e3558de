//! The sharded index: key -> entry, with each shard's own eviction order.
//!
//! Each shard is one mutex over a hash map and an eviction policy. Keeping the policy inside the
//! shard means the eligibility filter it is given sees exactly the entries it orders, under the
//! same lock, so a victim is never leased or written by the time it is removed.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use foldhash::fast::RandomState;
use parking_lot::{Condvar, Mutex, MutexGuard};
use tierkv_core::ObjectKey;
use tierkv_core::policy::{EvictionPolicy, PolicyGroup, PolicyKind, shard_of};

use crate::lease::OwnerId;
use crate::metrics::EvictionReason;
use crate::slots::{SlotId, Slots};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EntryState {
    /// Reserved by `owner`, invisible to readers.
    Writing { owner: OwnerId },
    /// Finished and visible.
    Ready,
}

pub(crate) struct Entry {
    pub(crate) slot: SlotId,
    /// Distinguishes this life of the key from earlier and later ones.
    pub(crate) generation: u64,
    /// Bytes of the object (its layout's size), at most the slot size.
    pub(crate) len: u64,
    pub(crate) state: EntryState,
    /// Freed when its last share returns instead of staying cached (prefetch promotions, and
    /// eviction victims leased to be copied down first).
    pub(crate) temporary: bool,
    /// Why an eviction victim was leased instead of evicted (`lease_eviction_candidates`): it
    /// is counted as evicted for this reason when its last share frees it. `None` otherwise.
    pub(crate) leaving: Option<EvictionReason>,
    /// Read shares outstanding, over every lease.
    pub(crate) shares: u64,
}

/// The accounting class of an entry: every slot is in exactly one class or free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    Writing,
    Leased,
    Cached,
    Gone,
}

impl Entry {
    /// A new reservation of `slot` for `owner` to write: invisible, no shares.
    pub(crate) fn writing(
        slot: SlotId,
        generation: u64,
        len: u64,
        owner: OwnerId,
        temporary: bool,
    ) -> Self {
        let state = EntryState::Writing { owner };
        Entry { slot, generation, len, state, temporary, leaving: None, shares: 0 }
    }

    pub(crate) fn class(&self) -> Class {
        match (self.state, self.shares) {
            (EntryState::Writing { .. }, _) => Class::Writing,
            (EntryState::Ready, 0) => Class::Cached,
            (EntryState::Ready, _) => Class::Leased,
        }
    }

    pub(crate) fn is_writing(&self) -> bool {
        matches!(self.state, EntryState::Writing { .. })
    }

    /// Evictable: finished, unleased, kept after reads, and no copy under way.
    pub(crate) fn is_evictable(&self, slots: &Slots) -> bool {
        self.class() == Class::Cached && !self.temporary && slots.is_idle(self.slot)
    }
}

/// Slot counts per class of one shard, changed only under the shard's lock together with the
/// entry transition they count. Per shard rather than global, so threads working on different
/// shards never contend on a shared counter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) writing: u64,
    pub(crate) leased: u64,
    pub(crate) cached: u64,
}

impl Counts {
    fn counter(&mut self, class: Class) -> Option<&mut u64> {
        match class {
            Class::Writing => Some(&mut self.writing),
            Class::Leased => Some(&mut self.leased),
            Class::Cached => Some(&mut self.cached),
            Class::Gone => None,
        }
    }

    /// Moves one slot from class `from` to class `to` (`Gone` for a new or removed entry).
    pub(crate) fn moved(&mut self, from: Class, to: Class) {
        if from == to {
            return;
        }
        if let Some(c) = self.counter(to) {
            *c += 1;
        }
        if let Some(c) = self.counter(from) {
            // Every entry was counted in its class when it entered it, so this cannot underflow
            // unless a transition was missed; the audit would then report the mismatch.
            *c = c.saturating_sub(1);
        }
    }

    pub(crate) fn add(&mut self, other: Counts) {
        self.writing += other.writing;
        self.leased += other.leased;
        self.cached += other.cached;
    }
}

pub(crate) struct Shard {
    pub(crate) map: HashMap<ObjectKey, Entry, RandomState>,
    /// Tracks exactly the finished, non-temporary entries of `map`.
    pub(crate) policy: Box<dyn EvictionPolicy<ObjectKey>>,
    /// The classes of the entries of `map`.
    pub(crate) counts: Counts,
    /// Keys absent from `map` that a write reservation has claimed while it evicts for their
    /// slots: every other writer of such a key waits for the claim to go ([`Index::unclaim`],
    /// [`Index::wait_unclaimed`]), so a chunk is never evicted for a key another writer then
    /// takes, and no writer is told `WriteInFlight` for a key the claimer then gives up for want
    /// of a slot. Empty whenever no reservation is under way.
    pub(crate) claims: HashSet<ObjectKey, RandomState>,
}

/// The claims a write reservation made, each in its key's shard ([`Shard::claims`]), recorded
/// as it makes them. The reservation removes each claim itself as it inserts or refuses the key,
/// then calls [`Claims::settle`]; dropped unsettled (a panic while it claims or evicts, or the
/// batch gave up), this withdraws every claim, so no key stays refused to every writer after its
/// reservation is gone.
pub(crate) struct Claims<'a> {
    index: &'a Index,
    keys: Vec<ObjectKey>,
}

impl<'a> Claims<'a> {
    /// None made yet.
    pub(crate) fn new(index: &'a Index) -> Self {
        Claims { index, keys: Vec::new() }
    }

    /// Records the claim just made on `key` in its shard (still locked by the caller: the
    /// record is taken before anything can unwind past it).
    pub(crate) fn made(&mut self, key: ObjectKey) {
        self.keys.push(key);
    }

    /// The reservation has removed every claim itself.
    pub(crate) fn settle(mut self) {
        self.keys.clear();
    }
}

impl Drop for Claims<'_> {
    fn drop(&mut self) {
        for key in &self.keys {
            self.index.unclaim(&mut self.index.shard(key), key);
        }
    }
}

/// A shard on its own cache line pair, so neighbouring locks do not share a line.
#[repr(align(128))]
struct Padded {
    lock: Mutex<Shard>,
    /// Notified whenever a claim of this shard goes: writers of a claimed key wait on it.
    unclaimed: Condvar,
}

/// A locked shard.
pub(crate) type ShardGuard<'a> = MutexGuard<'a, Shard>;

pub(crate) struct Index {
    shards: Box<[Padded]>,
    /// With more than one shard, their policies joined so that they evict as one.
    group: Option<Arc<PolicyGroup>>,
}

impl Index {
    pub(crate) fn new(shards: usize, policy: PolicyKind) -> Self {
        let group = (shards > 1).then(|| PolicyGroup::new(policy, shards));
        let shards = (0..shards)
            .map(|index| Padded {
                lock: Mutex::new(Shard {
                    map: HashMap::default(),
                    policy: match &group {
                        Some(group) => group.member(index),
                        None => policy.build(),
                    },
                    counts: Counts::default(),
                    claims: HashSet::default(),
                }),
                unclaimed: Condvar::new(),
            })
            .collect();
        Index { shards, group }
    }

    /// The shard whose next victim one policy over all of L1's keys would take, as the shards'
    /// policies last published; `None` with one shard, or when L1 holds no key.
    /// Takes no lock.
    pub(crate) fn victim_shard(&self) -> Option<usize> {
        self.group.as_ref()?.victim_shard()
    }

    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    fn shard_index(&self, key: &ObjectKey) -> usize {
        // By the chunk's hash, the same in every run, so the simulation puts every chunk in the
        // same shard. A client that chose its hashes to crowd one shard would only make that
        // shard's lock busier: the shards evict as one policy whatever they hold.
        shard_of(key, self.shards.len())
    }

    /// The shard a key lives in, locked.
    pub(crate) fn shard(&self, key: &ObjectKey) -> ShardGuard<'_> {
        self.shards[self.shard_index(key)].lock.lock()
    }

    /// Withdraws the claim on `key` from its locked `shard` and wakes the writers waiting for
    /// it.
    pub(crate) fn unclaim(&self, shard: &mut Shard, key: &ObjectKey) {
        if shard.claims.remove(key) {
            // Cheap with nobody waiting: one load.
            self.shards[self.shard_index(key)].unclaimed.notify_all();
        }
    }

    /// Returns once no reservation claims `key`, its shard (`guard`, `key`'s) unlocked while it
    /// waits. A claim lasts one reservation's eviction, which never waits for a claim: the
    /// caller must hold no claim of its own, so no two writers can wait for each other.
    pub(crate) fn wait_unclaimed(&self, guard: &mut ShardGuard<'_>, key: &ObjectKey) {
        while !guard.claims.is_empty() && guard.claims.contains(key) {
            self.shards[self.shard_index(key)].unclaimed.wait(guard);
        }
    }

    /// Calls `visit(shard, i)` for every item, grouped by the shard of `key(item)` so each shard
    /// is locked once per batch rather than once per key. Within a shard, items are visited in
    /// their order in `items`; the shards are taken as [`Index::for_each_free`] takes them.
    ///
    /// A use of an item's key made by `visit` is stamped by the item's place in `items`, not by
    /// when its shard was visited ([`PolicyGroup::reserve_stamps`]): the joined policies then
    /// order the batch's keys as one policy over all the shards would.
    pub(crate) fn visit_grouped<T>(
        &self,
        items: &[T],
        key: impl Fn(&T) -> &ObjectKey,
        mut visit: impl FnMut(&mut Shard, usize),
    ) {
        let Some(group) = &self.group else {
            let mut shard = self.shards[0].lock.lock();
            (0..items.len()).for_each(|i| visit(&mut shard, i));
            return;
        };
        let first = group.reserve_stamps(items.len());
        let mut visit = |shard: &mut Shard, i: usize| {
            shard.policy.stamp_next(Some(first + i as u64));
            visit(shard, i);
            shard.policy.stamp_next(None);
        };
        if self.shards.len() <= 64 {
            // A counting sort by shard (stable, so each group keeps the items' order): no
            // comparison sort on the hot path of every batch.
            let shard_of: Vec<u8> =
                items.iter().map(|item| self.shard_index(key(item)) as u8).collect();
            let mut starts = [0usize; 65];
            for s in &shard_of {
                starts[usize::from(*s) + 1] += 1;
            }
            for s in 0..64 {
                starts[s + 1] += starts[s];
            }
            let mut next = starts;
            let mut order = vec![0usize; items.len()];
            for (i, s) in shard_of.iter().enumerate() {
                order[next[usize::from(*s)]] = i;
                next[usize::from(*s)] += 1;
            }
            let mut groups: Vec<(usize, std::ops::Range<usize>)> = (0..64)
                .filter(|s| starts[s + 1] > starts[*s])
                .map(|s| (s, starts[s]..starts[s + 1]))
                .collect();
            self.for_each_free(
                &mut groups,
                |(shard, _)| *shard,
                |shard, (_, range)| order[range].iter().for_each(|&i| visit(shard, i)),
            );
            return;
        }
        // (shard, position) pairs are distinct, so sorting them groups the items by shard and
        // keeps each group in the items' order.
        let mut order: Vec<(usize, usize)> =
            items.iter().enumerate().map(|(i, item)| (self.shard_index(key(item)), i)).collect();
        order.sort_unstable();
        let mut groups: Vec<&[(usize, usize)]> = order.chunk_by(|a, b| a.0 == b.0).collect();
        self.for_each_free(
            &mut groups,
            |group| group[0].0,
            |shard, group| group.iter().for_each(|&(_, i)| visit(shard, i)),
        );
    }

    /// Calls `visit` once for each of `groups` with the shard `shard_of(group)` locked, taking
    /// the shards in the order they come free: a shard another thread holds is passed over
    /// while any other is free, and waited for only when every one left is held. Two writers
    /// whose batches span the same shards then work on different shards side by side instead
    /// of queueing behind each other on the first one (issue 13: with 4 shards, two evicting
    /// writers ran slower together than one alone). Each shard named is locked once, one at a
    /// time, so this cannot deadlock.
    pub(crate) fn for_each_free<G>(
        &self,
        groups: &mut Vec<G>,
        shard_of: impl Fn(&G) -> usize,
        mut visit: impl FnMut(&mut Shard, G),
    ) {
        while !groups.is_empty() {
            let free = groups.iter().enumerate().find_map(|(position, group)| {
                let shard = &self.shards[shard_of(group) % self.shards.len()];
                shard.lock.try_lock().map(|guard| (position, guard))
            });
            let (position, mut guard) = match free {
                Some(free) => free,
                None => (0, self.shards[shard_of(&groups[0]) % self.shards.len()].lock.lock()),
            };
            let group = groups.remove(position);
            visit(&mut guard, group);
        }
    }

    /// The class counts summed over every shard (each shard read under its lock, one at a time).
    pub(crate) fn totals(&self) -> Counts {
        let mut totals = Counts::default();
        for shard in self.shards.iter() {
            totals.add(shard.lock.lock().counts);
        }
        totals
    }

    /// Shard `index` (modulo the shard count), locked.
    pub(crate) fn shard_at(&self, index: usize) -> ShardGuard<'_> {
        self.shards[index % self.shards.len()].lock.lock()
    }

    /// Whether the shards' policies are joined (more than one shard): eviction then follows
    /// [`Index::victim_shard`] one victim at a time.
    pub(crate) fn joined(&self) -> bool {
        self.group.is_some()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

    use std::sync::mpsc;

    use tierkv_core::{ChunkHash, KvRank, Namespace};

    use super::*;

    fn keys(n: u128) -> Vec<ObjectKey> {
        (0..n)
            .map(|i| ObjectKey::new(Namespace::new("t", ""), ChunkHash(i), KvRank::Shared))
            .collect()
    }

    /// Every item is visited once, under its own shard's lock, each shard's items in their
    /// order in the batch; for every shard count the index supports, grouped both ways.
    #[test]
    fn a_batch_visits_every_item_once_in_order_within_its_shard() {
        for shards in [1, 2, 4, 64, 128] {
            let index = Index::new(shards, PolicyKind::Lru);
            let items = keys(300);
            let mut seen: Vec<(usize, usize)> = Vec::new();
            index.visit_grouped(&items, |k| k, |_, i| seen.push((index.shard_index(&items[i]), i)));
            let mut all: Vec<usize> = seen.iter().map(|(_, i)| *i).collect();
            all.sort_unstable();
            assert_eq!(all, (0..items.len()).collect::<Vec<_>>(), "{shards} shards");
            for shard in 0..shards {
                let mine: Vec<usize> =
                    seen.iter().filter(|(s, _)| *s == shard).map(|(_, i)| *i).collect();
                assert!(mine.is_sorted(), "{shards} shards: shard {shard} out of order");
                // One lock per shard: its items come in one run.
                let first = seen.iter().position(|(s, _)| *s == shard);
                if let Some(first) = first {
                    assert!(seen[first..first + mine.len()].iter().all(|(s, _)| *s == shard));
                }
            }
        }
    }

    /// A shard another thread holds is passed over: the batch does every other shard first and
    /// waits for the held one only at the end.
    #[test]
    fn a_batch_works_around_a_shard_another_thread_holds() {
        let index = Index::new(4, PolicyKind::Lru);
        let items = keys(64);
        let shard_of: Vec<usize> = items.iter().map(|k| index.shard_index(k)).collect();
        let held = shard_of[0];
        let elsewhere = shard_of.iter().filter(|s| **s != held).count();
        assert!(elsewhere > 0 && elsewhere < items.len());
        let guard = index.shard_at(held);
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|scope| {
            scope.spawn(|| index.visit_grouped(&items, |k| k, |_, i| tx.send(i).unwrap()));
            // Every item of the other shards arrives while the held shard stays locked.
            let first: Vec<usize> = (0..elsewhere).map(|_| rx.recv().unwrap()).collect();
            assert!(first.iter().all(|i| shard_of[*i] != held));
            drop(guard);
            let rest: Vec<usize> = (elsewhere..items.len()).map(|_| rx.recv().unwrap()).collect();
            assert!(rest.iter().all(|i| shard_of[*i] == held));
        });
    }
}
