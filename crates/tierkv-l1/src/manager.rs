//! The L1 manager: the entry state machine, read leases, write reservations and accounting.
//!
//! Lock order, everywhere: a lease shard, then index shards one at a time (only the audit holds
//! several), then the free list. No lock is held across a byte copy: copies happen through
//! guards after the locks are released. Writers waiting for room are woken once the locks that
//! freed it are let go (`Room`), but for a lease revoked where a call found it expired.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::MutexGuard;
use tierkv_core::policy::Order;
use tierkv_core::{
    ChunkSource, Clock, ExtraCount, KeyError, Layout, LogLimit, ObjectKey, SystemClock,
};

use crate::access::{ReadAccess, SlotHandle, SlotView, WriteAccess};
use crate::config::L1Config;
use crate::device::{self, DeviceArena};
use crate::error::L1Error;
use crate::index::{Claims, Class, Counts, Entry, EntryState, Index, Shard};
use crate::lease::{
    KeyShares, LeaseId, LeaseRecord, LeaseShard, LeaseTable, OwnerId, Readers, all_readers,
};
use crate::metrics::{EvictionReason, L1Metrics};
use crate::room::RoomWatch;
use crate::slots::{SlotId, Slots};

/// Victims `lease_eviction_candidates` leases per hold of its lease shard: enough that the
/// lock is not taken per victim, few enough that a release of another lease of that shard
/// waits for one batch (tens of microseconds), not for a write-back tick of thousands.
const VICTIMS_PER_HOLD: usize = 64;

/// Hears about L1 events that other components act on. Called outside every L1 lock.
pub trait L1Observer: Send + Sync {
    /// Objects became visible through `finish_write` (never through a prefetch promotion): the
    /// store pipeline copies them to the lower tiers.
    fn writes_finished(&self, keys: &[ObjectKey]) {
        let _ = keys;
    }

    /// Objects were evicted.
    fn evicted(&self, keys: &[ObjectKey], reason: EvictionReason) {
        let _ = (keys, reason);
    }
}

/// An observer that ignores everything.
#[derive(Debug, Default)]
pub struct NoObserver;

impl L1Observer for NoObserver {}

/// Takes each object eviction removes from L1, with its bytes, before its slot is reused: the
/// storage layer's cascade moves it to the next tier down this way, so L1's victims are kept
/// rather than lost (the tiers then add up instead of holding copies of one another).
///
/// It is called under the lock of the victim's index shard, so it must not call back into L1;
/// it may be slow only as long as a copy into host memory is. A panic in `demote` costs that
/// victim alone (counted in `tierkv_errors_total{tier="l1",reason="demoter_panic"}`): its slot
/// is reused all the same and the eviction goes on.
pub trait Demoter: Send + Sync {
    /// `bytes` reads the victim's slot; it is valid during the call only.
    fn demote(&self, key: &ObjectKey, bytes: &dyn ChunkSource);
}

/// What an L1 shares with the rest of the node: the clock leases expire by, and who listens.
#[derive(Clone)]
pub struct L1Context {
    /// The clock lease deadlines are measured on.
    pub clock: Arc<dyn Clock>,
    /// Told of finished writes and evictions.
    pub observer: Arc<dyn L1Observer>,
    /// Given every eviction victim's bytes, when the storage layer cascades them down.
    pub demoter: Option<Arc<dyn Demoter>>,
}

impl Default for L1Context {
    fn default() -> Self {
        L1Context {
            clock: Arc::new(SystemClock::new()),
            observer: Arc::new(NoObserver),
            demoter: None,
        }
    }
}

/// How `reserve_write` treats a key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WriteMode {
    /// A new object: refused if the key is present or being written.
    #[default]
    Create,
    /// Rewrite a finished, unleased object in its own slot: refused if absent. Aborting an
    /// update deletes the object, because its old bytes may already be overwritten.
    Update,
}

/// What happens to an object when its last read share returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Lifetime {
    /// It stays cached until evicted or deleted.
    #[default]
    Cached,
    /// It is freed at once: a prefetch promotion that exists only to be read. Temporary
    /// objects become visible only through `finish_write_and_reserve_read`.
    Temporary,
}

/// The answer to a lease request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadGrant {
    /// The lease holding every granted key; `None` when no key was granted.
    pub lease: Option<LeaseId>,
    /// Readers of the lease, `1 + extra_count`: each must return its share.
    pub readers: u32,
    /// Per requested key, where its bytes are, or why it was refused.
    pub results: Vec<Result<SlotHandle, KeyError>>,
}

impl ReadGrant {
    /// The number of keys granted from the start of the request without a gap: the prefix hit.
    pub fn leading_hits(&self) -> usize {
        self.results.iter().take_while(|r| r.is_ok()).count()
    }
}

/// Eviction victims leased instead of evicted (for write-back).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvictionLease {
    /// The lease holding one share of every victim; `None` when nothing was evictable.
    pub lease: Option<LeaseId>,
    /// The victims, in the order eviction chose them.
    pub keys: Vec<ObjectKey>,
}

/// What a release returned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Shares returned (one per reader per key).
    pub shares: u64,
    /// Keys whose last share this returned.
    pub unleased: usize,
    /// Whether the lease has no share left and is gone.
    pub lease_ended: bool,
}

/// What `clear` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cleared {
    /// Objects removed.
    pub removed: usize,
    /// Leased or in-flight objects left in place (non-forced clear only).
    pub kept: usize,
}

/// What `release_owner` returned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnerReleased {
    /// Leases ended.
    pub leases: usize,
    /// Shares returned.
    pub shares: u64,
    /// Write reservations aborted.
    pub aborted_writes: usize,
}

/// Where a key stands, without taking a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presence {
    /// Not in L1.
    Absent,
    /// Reserved and being written: invisible to readers.
    Writing,
    /// Finished and visible.
    Ready {
        /// Read shares outstanding.
        shares: u64,
        /// Freed when the last share returns.
        temporary: bool,
    },
}

/// Occupancy, in slots and bytes. Exact when no operation is in flight; while operations run, a
/// snapshot may straddle one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes of all slots.
    pub capacity_bytes: u64,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Slots in the arena.
    pub slots: u64,
    /// Bytes that cannot be reclaimed now: objects being written, leased objects, and slots
    /// still pinned by a copy after their object was removed.
    pub used_bytes: u64,
    /// Bytes of finished, unleased objects: evictable, so admission counts them as available.
    pub cached_bytes: u64,
    /// Bytes of free slots.
    pub free_bytes: u64,
    /// Objects being written.
    pub writing: u64,
    /// Finished objects with read shares outstanding.
    pub leased: u64,
    /// Finished objects with no share outstanding.
    pub cached: u64,
    /// Slots whose object is gone but a copy still pins them.
    pub retiring: u64,
}

/// The L1 tier: every read and write of tierkv passes through it.
pub struct L1Manager {
    slots: Arc<Slots>,
    index: Index,
    leases: LeaseTable,
    generations: AtomicU64,
    config: L1Config,
    clock: Arc<dyn Clock>,
    observer: Arc<dyn L1Observer>,
    demoter: Option<Arc<dyn Demoter>>,
    /// Panics of the demoter so far (contained: see `take_victim`).
    demoter_panics: AtomicU64,
    /// Its log: one a minute.
    demoter_panic_log: LogLimit,
    metrics: L1Metrics,
}

impl std::fmt::Debug for L1Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("L1Manager")
            .field("arena", &self.slots.arena())
            .field("usage", &self.usage())
            .finish()
    }
}

/// Which shares a release returns.
enum Selection<'a> {
    /// The readers of `mask`, on `keys` (every key of the lease for `None`); each named reader
    /// must still hold its share of each named key.
    Strict { mask: u128, keys: Option<&'a [ObjectKey]> },
    /// Every share still outstanding.
    Everything,
}

impl L1Manager {
    /// Validates the configuration, opens the device arena and builds an empty L1.
    pub fn build(config: L1Config, context: L1Context) -> Result<Self, L1Error> {
        let (slot_count, shards) = config.validate()?;
        let arena = device::open_arena(
            config.device,
            u64::from(slot_count) * config.slot_bytes,
            config.prefault,
        )?;
        let manager = L1Manager {
            slots: Arc::new(Slots::new(arena, config.slot_bytes, slot_count)),
            index: Index::new(shards, config.policy),
            leases: LeaseTable::new(),
            generations: AtomicU64::new(1),
            config,
            clock: context.clock,
            observer: context.observer,
            demoter: context.demoter,
            demoter_panics: AtomicU64::new(0),
            demoter_panic_log: LogLimit::new(Duration::from_secs(60)),
            metrics: L1Metrics::register(),
        };
        manager.publish_metrics();
        Ok(manager)
    }

    /// The configuration the manager was built with.
    pub fn config(&self) -> &L1Config {
        &self.config
    }

    /// The device arena the slots live in.
    pub fn arena(&self) -> &dyn DeviceArena {
        self.slots.arena()
    }

    // ----- writes -----

    /// Reserves a slot per key for a write. Reserved objects are invisible to every reader until
    /// `finish_write`.
    ///
    /// When no slot is free, cached objects are evicted by policy. When nothing more can be
    /// evicted, this key and every later key of the batch get `OutOfMemory`: a batch degrades to
    /// its longest allocatable prefix, never to a prefix with holes.
    ///
    /// A key that must wait for an eviction is claimed first: until the reservation inserts it
    /// (or gives it up for want of a slot), other writers of the key wait (one eviction), then
    /// find it reserved (`WriteInFlight`) or, given up, try for it themselves. So every chunk
    /// evicted for a reservation is replaced by one of its keys, never evicted for a key that
    /// another writer reserved meanwhile, and no writer hears `WriteInFlight` (which a store
    /// counts as present) for a key nobody then writes.
    ///
    /// Every refusal, of a key or of the request, counts in `tierkv_errors_total`.
    pub fn reserve_write(
        &self,
        owner: OwnerId,
        keys: &[ObjectKey],
        layout: &Layout,
        mode: WriteMode,
        lifetime: Lifetime,
    ) -> Result<Vec<Result<SlotHandle, KeyError>>, L1Error> {
        let reserved = self.reserve_write_uncounted(owner, keys, layout, mode, lifetime);
        self.count_refused(&reserved);
        reserved
    }

    /// [`L1Manager::reserve_write`], counting no refusal: for a caller whose refusal is no
    /// client's final answer. A writer that waits for room tries again (it counts what it is
    /// refused in the end, with [`L1Manager::count_refused`]), and a lookup that promotes a
    /// hit into L1 reads a chunk that finds no room from the tier that holds it. Counted per
    /// try, `tierkv_errors_total{reason="out_of_memory"}` grew by every key of every try of a
    /// store that then got its room, and by every chunk of a hit held below L1 by design.
    pub fn reserve_write_uncounted(
        &self,
        owner: OwnerId,
        keys: &[ObjectKey],
        layout: &Layout,
        mode: WriteMode,
        lifetime: Lifetime,
    ) -> Result<Vec<Result<SlotHandle, KeyError>>, L1Error> {
        let len = layout.size_bytes();
        if len > self.slots.slot_bytes() {
            let slot_bytes = self.slots.slot_bytes();
            return Err(L1Error::LayoutTooLarge { layout_bytes: len, slot_bytes });
        }
        let temporary = lifetime == Lifetime::Temporary;
        let mut evicted = Vec::new();
        if mode == WriteMode::Create
            && keys.len() > 1
            && let Some(results) = self.create_batch(owner, keys, len, temporary, &mut evicted)
        {
            self.announce_evictions(&evicted, EvictionReason::OnDemand);
            return Ok(results);
        }
        let mut out_of_memory = false;
        let results = keys
            .iter()
            .map(|key| {
                let result = if out_of_memory {
                    Err(KeyError::OutOfMemory)
                } else {
                    match mode {
                        WriteMode::Create => self.create(owner, key, len, temporary, &mut evicted),
                        WriteMode::Update => self.relock_for_update(owner, key, len, temporary),
                    }
                };
                out_of_memory |= result == Err(KeyError::OutOfMemory);
                result
            })
            .collect();
        self.announce_evictions(&evicted, EvictionReason::OnDemand);
        Ok(results)
    }

    /// Reserves a batch of keys none of which L1 holds, with one lock per touched shard for the
    /// check and one for the inserts, one free-list lock for the slots, and victims taken
    /// several per shard lock: what two writers contended on when each key took its locks one
    /// by one. Returns `None`, having changed nothing, when a key is present, claimed by another
    /// reservation or named twice (the key-by-key path then gives the exact refusals: a present
    /// key might be one of the victims an earlier key of the batch evicts), or when the free
    /// slots it counted were taken before it could allocate them unclaimed. The results are
    /// those of the key-by-key path: the longest prefix that gets slots, `OutOfMemory` from the
    /// first key that does not.
    ///
    /// Short of free slots, the batch claims its keys as it checks them ([`Shard::claims`]), so
    /// no other writer can reserve one between the check and the inserts: every victim evicted
    /// for the batch then gets a key. (Unclaimed, a key another writer took meanwhile made the
    /// batch evict a chunk for nothing, and hand that chunk's slot back to the free list while
    /// a later key of the batch was refused `OutOfMemory`.)
    fn create_batch(
        &self,
        owner: OwnerId,
        keys: &[ObjectKey],
        len: u64,
        temporary: bool,
        evicted: &mut Vec<ObjectKey>,
    ) -> Option<Vec<Result<SlotHandle, KeyError>>> {
        // Short of free slots, the keys are claimed. The slots are counted, not taken, before
        // the check: a batch that turns out to clash (a store of chunks already here is
        // routine) must not hold slots meanwhile that another writer would evict for.
        let claim = self.slots.free_count() < keys.len() as u64;
        // Dropped unsettled, this withdraws the claims: on a clash, or a panic while claiming
        // or evicting.
        let mut claims = Claims::new(&self.index);
        let mut seen: foldhash::HashSet<ObjectKey> =
            foldhash::HashSet::with_capacity_and_hasher(keys.len(), Default::default());
        let mut clash = false;
        self.index.visit_grouped(
            keys,
            |k| k,
            |shard, i| {
                let key = &keys[i];
                if !seen.insert(*key) || create_conflict(shard, key).is_some() {
                    clash = true;
                } else if claim {
                    shard.claims.insert(*key);
                    claims.made(*key);
                }
            },
        );
        if clash {
            return None;
        }
        let mut slots = self.slots.alloc_many(keys.len());
        if slots.len() < keys.len() {
            if !claim {
                // Free slots were taken since they were counted: the key-by-key path claims
                // each key before it evicts for it.
                self.slots.give_back_many(slots);
                self.slots.room.freed();
                return None;
            }
            self.evict_many(keys.len() - slots.len(), evicted, &mut slots);
            // A slot may have come free since, when too little was evictable.
            if slots.len() < keys.len() {
                slots.extend(self.slots.alloc_many(keys.len() - slots.len()));
            }
        }
        let granted = slots.len();
        let mut results: Vec<Result<SlotHandle, KeyError>> =
            vec![Err(KeyError::OutOfMemory); keys.len()];
        let mut leftover = Vec::new();
        // One shared counter update for the batch, not one per key (two writers would bounce
        // its cache line between cores for every key).
        let first_generation = self.generations.fetch_add(granted as u64, Ordering::Relaxed);
        // Unclaimed keys another reservation claimed since the check, with their slots.
        let mut contested = Vec::new();
        let insert = |shard: &mut Shard, i: usize, slot: SlotId| {
            let generation = first_generation + i as u64;
            let entry = Entry::writing(slot, generation, len, owner, temporary);
            shard.map.insert(keys[i], entry);
            shard.counts.moved(Class::Gone, Class::Writing);
            self.handle(slot, generation, len)
        };
        self.index.visit_grouped(
            keys,
            |k| k,
            |shard, i| {
                let key = &keys[i];
                if claim {
                    self.index.unclaim(shard, key);
                }
                let Some(&slot) = slots.get(i) else { return };
                // Unclaimed, another writer may have reserved the key since the check: it keeps
                // it (rule 3), and the slot, which no eviction freed, goes back. Or it may have
                // claimed it, evicting for it: whether it gets a slot is not known yet, so the
                // key waits (below). Claimed, no writer could do either.
                if !shard.claims.is_empty()
                    && shard.claims.contains(key)
                    && !shard.map.contains_key(key)
                {
                    contested.push((i, slot));
                    return;
                }
                if let Some(refusal) = create_conflict(shard, key) {
                    results[i] = Err(refusal);
                    leftover.push(slot);
                    return;
                }
                results[i] = Ok(insert(shard, i, slot));
            },
        );
        claims.settle();
        // Only an unclaimed batch gets here, so it holds no claim while it waits.
        for (i, slot) in contested {
            let mut shard = self.index.shard(&keys[i]);
            self.index.wait_unclaimed(&mut shard, &keys[i]);
            match create_conflict(&shard, &keys[i]) {
                Some(refusal) => {
                    results[i] = Err(refusal);
                    leftover.push(slot);
                }
                None => results[i] = Ok(insert(&mut shard, i, slot)),
            }
        }
        if !leftover.is_empty() {
            self.slots.give_back_many(leftover);
            self.slots.room.freed();
        }
        Some(results)
    }

    /// Reserves one key. With a free slot, under one lock of the key's shard. Without, the key
    /// is claimed before a victim is evicted for it, so that no other writer can take the key
    /// meanwhile and the victim's slot is always used.
    fn create(
        &self,
        owner: OwnerId,
        key: &ObjectKey,
        len: u64,
        temporary: bool,
        evicted: &mut Vec<ObjectKey>,
    ) -> Result<SlotHandle, KeyError> {
        let mut shard = self.index.shard(key);
        // Another reservation evicting for this key decides it first: it reserves the key (then
        // refused below) or gives it up for want of a slot (then it is this writer's to try).
        // This writer holds no claim: its earlier keys are reserved or refused.
        self.index.wait_unclaimed(&mut shard, key);
        // Refuse present keys before allocating, so a duplicate write never evicts anything.
        if let Some(refusal) = create_conflict(&shard, key) {
            return Err(refusal);
        }
        // The free list nests inside a shard lock (the lock order).
        if let Some(slot) = self.slots.alloc() {
            return Ok(self.insert_writing(&mut shard, key, slot, len, owner, temporary));
        }
        shard.claims.insert(*key);
        let mut claims = Claims::new(&self.index);
        claims.made(*key);
        drop(shard);
        // A slot may have come free since, when nothing is evictable.
        let slot = self.evict_one(evicted).or_else(|| self.slots.alloc());
        let mut shard = self.index.shard(key);
        self.index.unclaim(&mut shard, key);
        claims.settle();
        let slot = slot.ok_or(KeyError::OutOfMemory)?;
        // The claim kept every other writer off the key; the insert below, under the shard lock,
        // is still the one place that decides who writes it (rule 3).
        if let Some(refusal) = create_conflict(&shard, key) {
            drop(shard);
            self.slots.give_back(slot);
            self.slots.room.freed();
            return Err(refusal);
        }
        Ok(self.insert_writing(&mut shard, key, slot, len, owner, temporary))
    }

    /// Inserts a fresh reservation of `slot` for `key`, absent from its locked `shard`.
    fn insert_writing(
        &self,
        shard: &mut Shard,
        key: &ObjectKey,
        slot: SlotId,
        len: u64,
        owner: OwnerId,
        temporary: bool,
    ) -> SlotHandle {
        let generation = self.generations.fetch_add(1, Ordering::Relaxed);
        shard.map.insert(*key, Entry::writing(slot, generation, len, owner, temporary));
        shard.counts.moved(Class::Gone, Class::Writing);
        self.handle(slot, generation, len)
    }

    fn relock_for_update(
        &self,
        owner: OwnerId,
        key: &ObjectKey,
        len: u64,
        temporary: bool,
    ) -> Result<SlotHandle, KeyError> {
        let mut guard = self.index.shard(key);
        let Shard { map, policy, counts, .. } = &mut *guard;
        let entry = map.get_mut(key).ok_or(KeyError::NotFound)?;
        if entry.is_writing() {
            return Err(KeyError::WriteInFlight);
        }
        if entry.shares > 0 || !self.slots.is_idle(entry.slot) {
            return Err(KeyError::Locked);
        }
        if entry.len != len {
            return Err(KeyError::LayoutMismatch);
        }
        let before = entry.class();
        entry.state = EntryState::Writing { owner };
        entry.temporary = temporary;
        entry.generation = self.generations.fetch_add(1, Ordering::Relaxed);
        policy.remove(key);
        counts.moved(before, Class::Writing);
        Ok(self.handle(entry.slot, entry.generation, len))
    }

    /// Pins the slot of a key `owner` is writing, for copying bytes in. Until the guard drops, the
    /// write cannot be finished, so a half-copied object never becomes visible.
    pub fn write_access(&self, owner: OwnerId, key: &ObjectKey) -> Result<WriteAccess, L1Error> {
        let result = (|| {
            let shard = self.index.shard(key);
            let entry = shard.map.get(key).ok_or(KeyError::NotFound)?;
            self.check_writer(entry, owner)?;
            if !self.slots.pin_write(entry.slot) {
                return Err(KeyError::Busy);
            }
            Ok(WriteAccess::new(Arc::clone(&self.slots), entry.slot, entry.generation, entry.len))
        })();
        result.map_err(|error| self.refuse(L1Error::Key { key: *key, error }))
    }

    /// Makes written objects visible and tells the store pipeline about them.
    pub fn finish_write(&self, owner: OwnerId, keys: &[ObjectKey]) -> Vec<Result<(), KeyError>> {
        // One lock per touched shard. A key named twice is finished once: its second naming
        // finds it `Ready` and is refused, as key by key.
        let mut results = vec![Err(KeyError::NotFound); keys.len()];
        self.index.visit_grouped(
            keys,
            |k| k,
            |shard, i| {
                let key = &keys[i];
                results[i] = self.finish_in(shard, owner, key, |entry, policy| {
                    if entry.temporary {
                        return Err(KeyError::WrongState);
                    }
                    entry.state = EntryState::Ready;
                    policy.insert(*key);
                    Ok(())
                });
            },
        );
        results.iter().for_each(|result| self.count_refusal(result));
        let finished: Vec<ObjectKey> =
            keys.iter().zip(&results).filter(|(_, r)| r.is_ok()).map(|(k, _)| *k).collect();
        if !finished.is_empty() {
            // Finished without a lease, the objects are cached: room a waiting writer may evict.
            self.slots.room.freed();
            self.metrics.writes_finished(finished.len());
            self.observer.writes_finished(&finished);
        }
        results
    }

    /// Applies `finish` to the `Writing` entry of `key` owned by `owner`, once no write guard
    /// copies into it, and keeps the accounting in step.
    fn finish_in(
        &self,
        shard: &mut Shard,
        owner: OwnerId,
        key: &ObjectKey,
        finish: impl FnOnce(
            &mut Entry,
            &mut dyn tierkv_core::policy::EvictionPolicy<ObjectKey>,
        ) -> Result<(), KeyError>,
    ) -> Result<(), KeyError> {
        let Shard { map, policy, counts, .. } = shard;
        let entry = map.get_mut(key).ok_or(KeyError::NotFound)?;
        self.check_writer(entry, owner)?;
        if self.slots.has_writer(entry.slot) {
            return Err(KeyError::Busy);
        }
        let before = entry.class();
        finish(entry, policy.as_mut())?;
        counts.moved(before, entry.class());
        Ok(())
    }

    /// Drops write reservations. Nothing of an aborted write was ever visible; its slot is freed
    /// as soon as no copy pins it.
    pub fn abort_write(&self, owner: OwnerId, keys: &[ObjectKey]) -> Vec<Result<(), KeyError>> {
        self.freed_if_any(keys.iter().map(|key| self.abort_one(owner, key, None)).collect())
    }

    /// [`abort_write`](Self::abort_write) of reservations, each named with the generation it was
    /// given: one that is gone and made again (by another request of the same owner) is left.
    pub fn abort_reserved(
        &self,
        owner: OwnerId,
        reservations: &[(ObjectKey, u64)],
    ) -> Vec<Result<(), KeyError>> {
        self.freed_if_any(
            reservations
                .iter()
                .map(|(key, generation)| self.abort_one(owner, key, Some(*generation)))
                .collect(),
        )
    }

    fn abort_one(
        &self,
        owner: OwnerId,
        key: &ObjectKey,
        generation: Option<u64>,
    ) -> Result<(), KeyError> {
        let result = (|| {
            let mut shard = self.index.shard(key);
            let entry = shard.map.get(key).ok_or(KeyError::NotFound)?;
            self.check_writer(entry, owner)?;
            if generation.is_some_and(|g| g != entry.generation) {
                return Err(KeyError::NotFound);
            }
            self.remove_entry(&mut shard, key);
            Ok(())
        })();
        self.count_refusal(&result);
        result
    }

    /// Refuses a write operation on an entry that is not `owner`'s reservation.
    fn check_writer(&self, entry: &Entry, owner: OwnerId) -> Result<(), KeyError> {
        match entry.state {
            EntryState::Writing { owner: writer } if writer == owner => Ok(()),
            EntryState::Writing { .. } => Err(KeyError::Locked),
            EntryState::Ready => Err(KeyError::WrongState),
        }
    }

    // ----- reads -----

    /// Leases every ready key for `1 + extra_count` readers. Each key is answered on its own;
    /// one lease holds all the keys granted.
    pub fn reserve_read(&self, owner: OwnerId, keys: &[ObjectKey], extra: ExtraCount) -> ReadGrant {
        self.lease_keys(owner, keys, extra, Some(self.config.lease_ttl), |_, key, entry, policy| {
            match entry.state {
                EntryState::Writing { .. } => Err(KeyError::NotReadable),
                EntryState::Ready => {
                    policy.touch(key);
                    Ok(())
                }
            }
        })
    }

    /// Makes `owner`'s written objects visible and leases them in one step, so no eviction can
    /// slip between the two. This is how prefetched objects are promoted into L1: it does not
    /// tell the store pipeline, because the bytes came from a lower tier.
    ///
    /// Each key is named with the generation its reservation was given ([`SlotHandle`]): a
    /// reservation aborted under the caller (its owner disconnected) and made again by another
    /// request of the same owner is not this one, and is refused (`NotFound`), never made
    /// visible with bytes that request has not written.
    pub fn finish_write_and_reserve_read(
        &self,
        owner: OwnerId,
        reservations: &[(ObjectKey, u64)],
        extra: ExtraCount,
    ) -> ReadGrant {
        let keys: Vec<ObjectKey> = reservations.iter().map(|(key, _)| *key).collect();
        let ttl = Some(self.config.lease_ttl);
        self.lease_keys(owner, &keys, extra, ttl, |i, key, entry, policy| {
            match entry.state {
                EntryState::Writing { owner: writer } if writer == owner => {}
                EntryState::Writing { .. } => return Err(KeyError::Locked),
                EntryState::Ready => return Err(KeyError::WrongState),
            }
            if entry.generation != reservations[i].1 {
                return Err(KeyError::NotFound);
            }
            if self.slots.has_writer(entry.slot) {
                return Err(KeyError::Busy);
            }
            entry.state = EntryState::Ready;
            if !entry.temporary {
                policy.insert(*key);
            }
            Ok(())
        })
    }

    /// Makes `writer`'s written objects visible and leases each with one share for `holder`
    /// in the same step, under the key's shard lock, so no eviction can take an object between
    /// the two. The lease never expires: the store pipeline holds it while it copies the objects
    /// down, so a chunk is not evicted from L1 before the tiers its store policy names have it
    /// (write-through means what it says). Like `finish_write` it refuses temporary entries; it
    /// does not tell the observer (the caller hands the lease to the store pipeline itself).
    pub fn finish_write_leased(
        &self,
        writer: OwnerId,
        holder: OwnerId,
        keys: &[ObjectKey],
    ) -> ReadGrant {
        let grant =
            self.lease_keys(holder, keys, ExtraCount::ZERO, None, |_, key, entry, policy| {
                match entry.state {
                    EntryState::Writing { owner } if owner == writer => {}
                    EntryState::Writing { .. } => return Err(KeyError::Locked),
                    EntryState::Ready => return Err(KeyError::WrongState),
                }
                if entry.temporary {
                    return Err(KeyError::WrongState);
                }
                if self.slots.has_writer(entry.slot) {
                    return Err(KeyError::Busy);
                }
                entry.state = EntryState::Ready;
                policy.insert(*key);
                Ok(())
            });
        let finished = grant.results.iter().filter(|r| r.is_ok()).count();
        if finished > 0 {
            self.metrics.writes_finished(finished);
        }
        grant
    }

    /// Takes `1 + extra` shares of every key that `admit` accepts (it may change the entry's
    /// state, e.g. finish it), under the key's shard lock, and records them in one new lease
    /// that expires after `ttl` (never for `None`). The new lease's shard is locked first (the
    /// lock order) and held until the lease is recorded, so no audit sees an entry's shares
    /// before the ledger holds them.
    fn lease_keys(
        &self,
        owner: OwnerId,
        keys: &[ObjectKey],
        extra: ExtraCount,
        ttl: Option<Duration>,
        mut admit: impl FnMut(
            usize,
            &ObjectKey,
            &mut Entry,
            &mut dyn tierkv_core::policy::EvictionPolicy<ObjectKey>,
        ) -> Result<(), KeyError>,
    ) -> ReadGrant {
        let readers = extra.readers();
        // Saturating: a TTL near `Duration::MAX` means "never", not a panic.
        let deadline = self.clock.now().saturating_add(ttl.unwrap_or(Duration::MAX));
        let mut record = LeaseRecord::new(owner, readers, deadline, keys.len());
        let (id, ledger) = self.leases.mint();
        let mut results = vec![Err(KeyError::NotFound); keys.len()];
        self.index.visit_grouped(
            keys,
            |k| k,
            |shard, i| {
                let key = &keys[i];
                results[i] = (|| {
                    if record.keys.contains_key(key) {
                        return Err(KeyError::Duplicate);
                    }
                    let Shard { map, policy, counts, .. } = shard;
                    let entry = map.get_mut(key).ok_or(KeyError::NotFound)?;
                    let before = entry.class();
                    admit(i, key, entry, policy.as_mut())?;
                    entry.shares += u64::from(readers);
                    counts.moved(before, entry.class());
                    let shares = KeyShares {
                        generation: entry.generation,
                        outstanding: all_readers(readers),
                        marked: false,
                    };
                    record.keys.insert(*key, shares);
                    Ok(self.handle(entry.slot, entry.generation, entry.len))
                })();
            },
        );
        let granted = record.keys.len() as u64;
        let lease = self.leases.open(ledger, id, record);
        results.iter().for_each(|result| self.count_refusal(result));
        self.metrics.read_shares(granted * u64::from(readers));
        ReadGrant { lease, readers, results }
    }

    /// Pins the slot of a leased key for reading by `reader`, who must still hold its share.
    pub fn read_access(
        &self,
        lease: LeaseId,
        reader: u8,
        key: &ObjectKey,
    ) -> Result<ReadAccess, L1Error> {
        let result = (|| {
            let mut shard = self.leases.shard(lease);
            let record = self.live_lease(&mut shard, lease)?;
            let mask = Readers::One(reader).mask(lease, record.readers)?;
            let Some(shares) = record.keys.get(key) else {
                return Err(L1Error::NotLeased { lease, key: *key, error: self.classify(key) });
            };
            if shares.outstanding & mask == 0 {
                return Err(L1Error::AlreadyReleased { lease, reader, key: *key });
            }
            let index = self.index.shard(key);
            match index.map.get(key) {
                Some(entry) if entry.generation == shares.generation => {
                    self.slots.pin_read(entry.slot);
                    Ok(ReadAccess::new(
                        Arc::clone(&self.slots),
                        entry.slot,
                        entry.generation,
                        entry.len,
                    ))
                }
                // Force-deleted under the lease.
                _ => Err(L1Error::Key { key: *key, error: KeyError::NotFound }),
            }
        })();
        result.map_err(|e| self.refuse(e))
    }

    /// Returns the shares of `readers` on `keys` of a lease (every key for `None`).
    ///
    /// The whole request is checked before anything changes: a reader that already returned its
    /// share of one of the keys, a reader the lease does not have, a key the lease does not cover
    /// or a key named twice refuses the request and leaves every share where it was.
    pub fn finish_read(
        &self,
        lease: LeaseId,
        readers: Readers,
        keys: Option<&[ObjectKey]>,
    ) -> Result<Released, L1Error> {
        let result = (|| {
            let mut shard = self.leases.shard(lease);
            let record = self.live_lease(&mut shard, lease)?;
            let mask = readers.mask(lease, record.readers)?;
            self.release(&mut shard, lease, Selection::Strict { mask, keys })
        })();
        self.freed_by(&result);
        result.map_err(|e| self.refuse(e))
    }

    /// Checks what `finish_read(lease, readers, keys)` would check, and changes nothing (a lease
    /// past its deadline is revoked, as every call does). Lets a caller that releases several
    /// leases as one request refuse it whole before returning any share.
    pub fn check_finish_read(
        &self,
        lease: LeaseId,
        readers: Readers,
        keys: Option<&[ObjectKey]>,
    ) -> Result<(), L1Error> {
        let mut shard = self.leases.shard(lease);
        let record = self.live_lease(&mut shard, lease)?;
        let mask = readers.mask(lease, record.readers)?;
        let checked = self.check_release(record, lease, mask, keys);
        for key in keys.unwrap_or(&[]) {
            if let Some(shares) = record.keys.get_mut(key) {
                shares.marked = false;
            }
        }
        checked
    }

    /// Whether `lease` is live: not released, not past its deadline (revoked now if it is).
    pub fn lease_live(&self, lease: LeaseId) -> bool {
        let mut shard = self.leases.shard(lease);
        self.live_lease(&mut shard, lease).is_ok()
    }

    /// Returns every share still outstanding on a lease: for keys the engine decided not to read,
    /// or a lookup that is abandoned.
    pub fn release_lease(&self, lease: LeaseId) -> Result<Released, L1Error> {
        let result = (|| {
            let mut shard = self.leases.shard(lease);
            self.live_lease(&mut shard, lease)?;
            self.release(&mut shard, lease, Selection::Everything)
        })();
        self.freed_by(&result);
        result.map_err(|e| self.refuse(e))
    }

    /// The live record of `lease`, revoking it first if its deadline passed.
    fn live_lease<'s>(
        &self,
        shard: &'s mut LeaseShard,
        lease: LeaseId,
    ) -> Result<&'s mut LeaseRecord, L1Error> {
        let now = self.clock.now();
        match shard.live.get(&lease.0) {
            None => return Err(shard.gone(lease)),
            Some(record) if record.deadline <= now => {
                // The one wake-up under a lock: it would otherwise have to travel out through
                // every caller's error. It is rare (the tick revokes most expired leases), paid
                // only while a writer waits, and a woken writer takes no lease shard.
                if self.revoke(shard, lease).unleased > 0 {
                    self.slots.room.freed();
                }
                return Err(L1Error::LeaseExpired(lease));
            }
            Some(_) => {}
        }
        shard.live.get_mut(&lease.0).ok_or(L1Error::UnknownLease(lease))
    }

    fn release(
        &self,
        shard: &mut LeaseShard,
        lease: LeaseId,
        selection: Selection<'_>,
    ) -> Result<Released, L1Error> {
        let Some(record) = shard.live.get_mut(&lease.0) else {
            return Err(shard.gone(lease));
        };
        let mut released = match selection {
            Selection::Strict { mask, keys } => {
                self.check_release(record, lease, mask, keys)?;
                self.return_shares(record, keys, |_| mask)
            }
            Selection::Everything => self.return_shares(record, None, |outstanding| outstanding),
        };
        if record.keys.is_empty() {
            shard.live.remove(&lease.0);
            shard.bury_released(lease);
            released.lease_ended = true;
        }
        Ok(released)
    }

    /// Checks that every reader of `mask` holds its share of every selected key, each key named
    /// once. Changes nothing when it fails (the marks it sets are cleared again).
    fn check_release(
        &self,
        record: &mut LeaseRecord,
        lease: LeaseId,
        mask: u128,
        keys: Option<&[ObjectKey]>,
    ) -> Result<(), L1Error> {
        let missing = |key: &ObjectKey, outstanding: u128| {
            let reader = (mask & !outstanding).trailing_zeros() as u8;
            L1Error::AlreadyReleased { lease, reader, key: *key }
        };
        let Some(list) = keys else {
            return match record.keys.iter().find(|(_, s)| s.outstanding & mask != mask) {
                Some((key, shares)) => Err(missing(key, shares.outstanding)),
                None => Ok(()),
            };
        };
        if list.is_empty() {
            return Err(L1Error::EmptyRelease(lease));
        }
        let mut failure = None;
        for key in list {
            match record.keys.get_mut(key) {
                None => {
                    failure =
                        Some(L1Error::NotLeased { lease, key: *key, error: self.classify(key) })
                }
                Some(s) if s.marked => {
                    failure =
                        Some(L1Error::NotLeased { lease, key: *key, error: KeyError::Duplicate })
                }
                Some(s) if s.outstanding & mask != mask => {
                    failure = Some(missing(key, s.outstanding))
                }
                Some(s) => s.marked = true,
            }
            if failure.is_some() {
                break;
            }
        }
        match failure {
            None => Ok(()),
            Some(error) => {
                for key in list {
                    if let Some(s) = record.keys.get_mut(key) {
                        s.marked = false;
                    }
                }
                Err(error)
            }
        }
    }

    /// Returns `take(outstanding)` readers' shares of each selected key and drops keys with no
    /// share left from the lease.
    fn return_shares(
        &self,
        record: &mut LeaseRecord,
        keys: Option<&[ObjectKey]>,
        take: impl Fn(u128) -> u128,
    ) -> Released {
        let mut released = Released::default();
        // First the ledger (no index lock needed), then the entries, a shard at a time.
        let mut returned: Vec<(ObjectKey, u64, u64)> = Vec::new();
        let mut give_back = |key: &ObjectKey, shares: &mut KeyShares| {
            shares.marked = false;
            let returning = take(shares.outstanding) & shares.outstanding;
            shares.outstanding &= !returning;
            let n = u64::from(returning.count_ones());
            released.shares += n;
            if n > 0 {
                returned.push((*key, shares.generation, n));
            }
        };
        match keys {
            None => record.keys.iter_mut().for_each(|(key, shares)| give_back(key, shares)),
            Some(list) => {
                for key in list {
                    if let Some(shares) = record.keys.get_mut(key) {
                        give_back(key, shares);
                    }
                }
            }
        }
        record.keys.retain(|_, shares| shares.outstanding != 0);
        self.index.visit_grouped(
            &returned,
            |r| &r.0,
            |shard, i| {
                let (key, generation, n) = &returned[i];
                if self.return_to_entry(shard, key, *generation, *n) {
                    released.unleased += 1;
                }
            },
        );
        released
    }

    /// Takes `n` shares off the entry of `key` in its (locked) shard; a temporary entry whose last
    /// share this was is freed. Returns whether the entry has no share left. An entry
    /// force-deleted (or deleted and written again) under the lease has another generation and is
    /// left alone.
    fn return_to_entry(&self, shard: &mut Shard, key: &ObjectKey, generation: u64, n: u64) -> bool {
        let Some(entry) = shard.map.get_mut(key) else {
            return false;
        };
        if entry.generation != generation {
            return false;
        }
        let before = entry.class();
        // The lease ledger holds at least `n` of this entry's shares; the audit checks that the
        // two agree, so saturation here would only hide a bug the audit reports.
        entry.shares = entry.shares.saturating_sub(n);
        if entry.shares > 0 {
            return false;
        }
        shard.counts.moved(before, Class::Cached);
        if entry.temporary {
            // A victim leased for write-back or a stop leaves L1 now: an eviction, counted as
            // the others are (it is no deletion, nor a prefetch promotion read and done with).
            let leaving = entry.leaving;
            self.remove_entry(shard, key);
            if let Some(reason) = leaving {
                self.metrics.evicted(reason, 1);
            }
        }
        true
    }

    /// Revokes a lease whose deadline passed: returns every share, remembers why, counts it.
    /// Returns what it returned (nothing for a lease that is not live).
    fn revoke(&self, shard: &mut LeaseShard, lease: LeaseId) -> Released {
        let Some(mut record) = shard.live.remove(&lease.0) else {
            return Released::default();
        };
        let mut released = self.return_shares(&mut record, None, |outstanding| outstanding);
        released.lease_ended = true;
        shard.bury_revoked(lease);
        self.metrics.lease_expired();
        released
    }

    /// Revokes every lease past its deadline. Returns how many. The storage layer calls this
    /// periodically; a late release of a revoked lease is answered `LeaseExpired`.
    pub fn expire_leases(&self) -> usize {
        let now = self.clock.now();
        let (mut expired, mut unleased) = (0, 0);
        for shard in self.leases.shards() {
            let mut shard = shard.lock();
            let due: Vec<u64> =
                shard.live.iter().filter(|(_, r)| r.deadline <= now).map(|(id, _)| *id).collect();
            for id in due {
                unleased += self.revoke(&mut shard, LeaseId(id)).unleased;
                expired += 1;
            }
        }
        if unleased > 0 {
            self.slots.room.freed();
        }
        expired
    }

    // ----- removal -----

    /// Deletes objects. Leased objects and objects being written are refused with `Locked`
    /// unless `force`; a forced delete leaves the leases in place, but their shares no longer
    /// touch anything, and a copy under way finishes on the old slot before it is reused.
    pub fn delete(&self, keys: &[ObjectKey], force: bool) -> Vec<Result<(), KeyError>> {
        let deleted = keys
            .iter()
            .map(|key| {
                let result = (|| {
                    let mut shard = self.index.shard(key);
                    let entry = shard.map.get(key).ok_or(KeyError::NotFound)?;
                    if !force && entry.class() != Class::Cached {
                        return Err(KeyError::Locked);
                    }
                    self.remove_entry(&mut shard, key);
                    Ok(())
                })();
                self.count_refusal(&result);
                result
            })
            .collect();
        self.freed_if_any(deleted)
    }

    /// Deletes every cached object, or with `force` every object.
    pub fn clear(&self, force: bool) -> Cleared {
        let mut cleared = Cleared::default();
        for i in 0..self.index.shard_count() {
            let mut guard = self.index.shard_at(i);
            let Shard { map, policy, counts, .. } = &mut *guard;
            map.retain(|key, entry| {
                if !force && entry.class() != Class::Cached {
                    cleared.kept += 1;
                    return true;
                }
                policy.remove(key);
                counts.moved(entry.class(), Class::Gone);
                self.slots.retire(entry.slot);
                cleared.removed += 1;
                false
            });
        }
        if cleared.removed > 0 {
            self.slots.room.freed();
        }
        cleared
    }

    /// Returns everything `owner` holds: ends its leases (every share) and aborts its write
    /// reservations. Called when a client disconnects. A lease past its deadline is revoked, as
    /// any call that finds one does: counted as an expiry, and a late release is told so.
    pub fn release_owner(&self, owner: OwnerId) -> OwnerReleased {
        let mut report = OwnerReleased::default();
        let mut unleased = 0;
        let now = self.clock.now();
        for shard in self.leases.shards() {
            let mut shard = shard.lock();
            let owned: Vec<(u64, bool)> = shard
                .live
                .iter()
                .filter(|(_, r)| r.owner == owner)
                .map(|(id, r)| (*id, r.deadline <= now))
                .collect();
            for (id, expired) in owned {
                let lease = LeaseId(id);
                let released = if expired {
                    Ok(self.revoke(&mut shard, lease))
                } else {
                    self.release(&mut shard, lease, Selection::Everything)
                };
                if let Ok(released) = released {
                    report.leases += 1;
                    report.shares += released.shares;
                    unleased += released.unleased;
                }
            }
        }
        for i in 0..self.index.shard_count() {
            let mut guard = self.index.shard_at(i);
            let Shard { map, counts, .. } = &mut *guard;
            map.retain(|_, entry| {
                if entry.state != (EntryState::Writing { owner }) {
                    return true;
                }
                counts.moved(Class::Writing, Class::Gone);
                self.slots.retire(entry.slot);
                report.aborted_writes += 1;
                false
            });
        }
        if unleased > 0 || report.aborted_writes > 0 {
            self.slots.room.freed();
        }
        report
    }

    /// Removes `key`'s entry from its (locked) shard and retires its slot.
    fn remove_entry(&self, shard: &mut Shard, key: &ObjectKey) {
        if let Some(entry) = shard.map.remove(key) {
            shard.policy.remove(key);
            shard.counts.moved(entry.class(), Class::Gone);
            self.slots.retire(entry.slot);
        }
    }

    // ----- eviction -----

    /// Finds the next eviction victim and hands it, with its locked shard, to `take`.
    ///
    /// The shard comes first whose next victim one policy over all of L1 would take
    /// ([`tierkv_core::policy::PolicyGroup`]: the shards' policies are joined); then every other
    /// shard in turn, so `None` means no shard has anything evictable. With one shard the order
    /// is exactly the policy's. The victim has already left the policy's tracking when `take`
    /// sees it.
    fn with_victim<R>(&self, take: impl FnOnce(&mut Shard, ObjectKey) -> R) -> Option<R> {
        let shards = self.index.shard_count();
        let first = self.index.victim_shard().unwrap_or(0);
        for step in 0..shards {
            let mut guard = self.index.shard_at(first + step);
            let shard = &mut *guard;
            let slots = &*self.slots;
            let map = &shard.map;
            let mut eligible =
                |key: &ObjectKey| map.get(key).is_some_and(|e| e.is_evictable(slots));
            if let Some(key) = shard.policy.evict(1, &mut eligible).pop() {
                return Some(take(shard, key));
            }
        }
        None
    }

    /// Evicts up to `n` cached objects and appends their slots to `slots`: with one shard, under
    /// one lock in its policy's order; with joined shards, one victim at a time, each from the
    /// shard `with_victim` names.
    fn evict_many(&self, n: usize, victims: &mut Vec<ObjectKey>, slots: &mut Vec<SlotId>) {
        if !self.index.joined() {
            let mut guard = self.index.shard_at(0);
            let shard = &mut *guard;
            let chosen = {
                let (map, all) = (&shard.map, &*self.slots);
                let mut eligible =
                    |key: &ObjectKey| map.get(key).is_some_and(|e| e.is_evictable(all));
                shard.policy.evict(n, &mut eligible)
            };
            for key in chosen {
                if let Some(slot) = self.take_victim(shard, &key) {
                    victims.push(key);
                    slots.push(slot);
                }
            }
            return;
        }
        for _ in 0..n {
            let taken = self
                .with_victim(|shard, key| self.take_victim(shard, &key).map(|slot| (key, slot)));
            let Some(Some((key, slot))) = taken else { return };
            victims.push(key);
            slots.push(slot);
        }
    }

    /// Evicts one cached object and hands its slot to the caller.
    fn evict_one(&self, victims: &mut Vec<ObjectKey>) -> Option<SlotId> {
        self.with_victim(|shard, key| {
            let slot = self.take_victim(shard, &key)?;
            victims.push(key);
            Some(slot)
        })
        .flatten()
    }

    /// Removes the policy's victim `key` from its locked `shard`, hands its bytes to the demoter
    /// (if any) and recycles its slot, which it returns. Every eviction goes through here.
    fn take_victim(&self, shard: &mut Shard, key: &ObjectKey) -> Option<SlotId> {
        let entry = shard.map.remove(key)?;
        shard.counts.moved(entry.class(), Class::Gone);
        if let Some(demoter) = &self.demoter {
            // The slot is idle and cannot be pinned while this shard is locked.
            let view = SlotView { slots: &self.slots, slot: entry.slot, len: entry.len };
            // A demoter that panics (a bug below L1) loses this victim, as a failed copy down
            // does, never its slot: unwinding past the recycle below would leak the slot for
            // good and fail the reservation or tick that evicted it. The shard is consistent
            // here (the entry and its counts are gone), so going on is sound.
            if catch_unwind(AssertUnwindSafe(|| demoter.demote(key, &view))).is_err() {
                self.demoter_panicked(key);
            }
        }
        // The filter saw the slot idle under this lock, and pins are only taken under it.
        self.slots.recycle(entry.slot);
        Some(entry.slot)
    }

    /// Counts a demoter's panic over `key`; logs at most one a minute (`LogLimit`, as the
    /// storage manager limits its own per-victim warnings), so a demoter that always panics
    /// cannot flood the log.
    fn demoter_panicked(&self, key: &ObjectKey) {
        let panics = self.demoter_panics.fetch_add(1, Ordering::Relaxed) + 1;
        self.metrics.demoter_panicked();
        if let Some(left_out) = self.demoter_panic_log.admit() {
            tracing::error!(
                ?key,
                panics,
                left_out,
                "the demoter panicked over an L1 victim: the victim is lost, its slot reused (at \
                 most one such error a minute; left_out: those since the last)"
            );
        }
    }

    /// How many times the demoter has panicked (each cost one victim its demotion).
    pub fn demoter_panics(&self) -> u64 {
        self.demoter_panics.load(Ordering::Relaxed)
    }

    /// Leases up to `n` eviction victims, chosen as eviction would choose them, to `owner` instead
    /// of evicting them: each becomes temporary, so it is freed when its last share returns.
    ///
    /// This is how write-back works: the caller copies the victims to the next tier and then
    /// returns the shares. Readers may still lease a victim meanwhile; it goes when they are done,
    /// and is then counted in `tierkv_evictions_total` by `reason` (a victim deleted first is
    /// not). The observer is not told: it hears of evictions outside every L1 lock, and a victim
    /// goes inside the release that returns its last share; the caller chose the victims.
    ///
    /// A tick may lease thousands of victims, so the lease's shard is held for
    /// `VICTIMS_PER_HOLD` of them at a time, not for the whole grant: the lease is live from its
    /// first batch (each batch recorded in the same hold that takes its shares, so the audit
    /// never sees a share the ledger lacks), and the other leases of its shard are served
    /// between batches. Should the lease end between two batches (its owner released
    /// everything), the grant stops there.
    pub fn lease_eviction_candidates(
        &self,
        owner: OwnerId,
        n: usize,
        reason: EvictionReason,
    ) -> EvictionLease {
        let readers = ExtraCount::ZERO.readers();
        // No deadline: the caller always returns the lease once the victims are copied down.
        // Revoked on a deadline, a write-back slower than the lease's time to live would free
        // victims that were never copied, and under write-back they are the only copy.
        let deadline = Duration::MAX;
        let mut record = LeaseRecord::new(owner, readers, deadline, n);
        let mut keys = Vec::with_capacity(n);
        // The lease's shard first, held until the first batch is recorded (as `lease_keys`).
        let (id, ledger) = self.leases.mint();
        let mut more = self.lease_victims(&mut record, n.min(VICTIMS_PER_HOLD), reason, &mut keys);
        let lease = self.leases.open(ledger, id, record);
        while more
            && keys.len() < n
            && let Some(id) = lease
        {
            #[cfg(test)]
            tests::between_holds(self);
            let mut ledger = self.leases.shard(id);
            let Some(record) = ledger.live.get_mut(&id.0) else { break };
            let batch = (n - keys.len()).min(VICTIMS_PER_HOLD);
            more = self.lease_victims(record, batch, reason, &mut keys);
            // Fair: a release waiting for the shard gets it before the next batch does.
            MutexGuard::unlock_fair(ledger);
        }
        self.metrics.read_shares(keys.len() as u64);
        EvictionLease { lease, keys }
    }

    /// Leases up to `n` eviction victims into `record` (whose shard the caller holds) and appends
    /// them to `keys`. Returns whether it found all `n`.
    fn lease_victims(
        &self,
        record: &mut LeaseRecord,
        n: usize,
        reason: EvictionReason,
        keys: &mut Vec<ObjectKey>,
    ) -> bool {
        let readers = record.readers;
        for _ in 0..n {
            let leased = self.with_victim(|shard, key| {
                let entry = shard.map.get_mut(&key)?;
                let before = entry.class();
                entry.temporary = true;
                entry.leaving = Some(reason);
                entry.shares += u64::from(readers);
                shard.counts.moved(before, entry.class());
                let shares = KeyShares {
                    generation: entry.generation,
                    outstanding: all_readers(readers),
                    marked: false,
                };
                record.keys.insert(key, shares);
                Some(key)
            });
            match leased.flatten() {
                Some(key) => keys.push(key),
                None => return false,
            }
        }
        true
    }

    /// Evicts cached objects while more than the high watermark of slots is occupied, down to the
    /// low watermark. Returns the victims. The storage layer calls this in the background so
    /// reservations rarely have to evict on their own path.
    pub fn evict_to_watermark(&self) -> Vec<ObjectKey> {
        let slots = self.slots.count() as f64;
        let occupied = || u64::from(self.slots.count()) - self.slots.free_count();
        let mut victims = Vec::new();
        if occupied() as f64 > self.config.watermark.high * slots {
            // At least one chunk stays: below ten slots `low` rounds down a whole slot, and a
            // tier of one would keep nothing.
            let target = ((self.config.watermark.low * slots).floor() as u64).max(1);
            while occupied() > target {
                match self.evict_one(&mut victims) {
                    Some(slot) => self.slots.give_back(slot),
                    None => break,
                }
            }
        }
        // A writer that looked while a victim was between its shard and the free list found it
        // in neither.
        if !victims.is_empty() {
            self.slots.room.freed();
        }
        self.announce_evictions(&victims, EvictionReason::Watermark);
        victims
    }

    /// Evicts up to `n` cached objects, chosen and handed to the demoter as any eviction is;
    /// returns the victims. How the storage layer empties L1 into the tiers below when it stops.
    pub fn evict(&self, n: usize, reason: EvictionReason) -> Vec<ObjectKey> {
        let mut victims = Vec::new();
        while victims.len() < n {
            match self.evict_one(&mut victims) {
                Some(slot) => self.slots.give_back(slot),
                None => break,
            }
        }
        if !victims.is_empty() {
            self.slots.room.freed();
        }
        self.announce_evictions(&victims, reason);
        victims
    }

    fn announce_evictions(&self, victims: &[ObjectKey], reason: EvictionReason) {
        if !victims.is_empty() {
            self.metrics.evicted(reason, victims.len());
            self.observer.evicted(victims, reason);
        }
    }

    // ----- room -----

    /// Starts watching for room in L1, for a writer that waits for it when a reservation found
    /// none: taken before the first try, the watch's [`RoomWatch::wait_until`] returns once
    /// anything may have freed room since (a lease's last share returned or revoked, a
    /// reservation aborted, a write finished without a lease, an object deleted, cleared or
    /// evicted, the last copy out of a slot ended). While no writer watches, each of those
    /// pays one atomic load for it.
    pub fn watch_room(&self) -> RoomWatch<'_> {
        self.slots.room.watch()
    }

    /// Wakes the writers watching for room, to look again: for a caller whose own bookkeeping
    /// tells them whether to go on waiting (the store pipeline, done with a job that held L1
    /// shares). One atomic load while none watches.
    pub fn wake_room_watchers(&self) {
        self.slots.room.freed();
    }

    /// Writers watching for room now ([`L1Manager::watch_room`]).
    pub fn room_watchers(&self) -> usize {
        self.slots.room.watchers()
    }

    /// Wakes the writers watching for room if any of `results` removed an entry; returns them.
    fn freed_if_any(&self, results: Vec<Result<(), KeyError>>) -> Vec<Result<(), KeyError>> {
        if results.iter().any(|r| r.is_ok()) {
            self.slots.room.freed();
        }
        results
    }

    /// Wakes the writers watching for room if a release returned some key's last share.
    fn freed_by(&self, released: &Result<Released, L1Error>) {
        if released.as_ref().is_ok_and(|r| r.unleased > 0) {
            self.slots.room.freed();
        }
    }

    // ----- inspection -----

    /// Tells L1's eviction policy that the tiers below keep `chunks` more of what L1 evicts (the
    /// cascade), so that it ages uses over the turnover of all the tiers together
    /// ([`tierkv_core::policy::EvictionPolicy::keep_below`]).
    pub fn keep_below(&self, chunks: usize) {
        for shard in 0..self.index.shard_count() {
            self.index.shard_at(shard).policy.keep_below(chunks);
        }
    }

    /// Where `key` stands, without leasing it.
    pub fn presence(&self, key: &ObjectKey) -> Presence {
        match self.index.shard(key).map.get(key) {
            None => Presence::Absent,
            Some(entry) if entry.is_writing() => Presence::Writing,
            Some(entry) => Presence::Ready { shares: entry.shares, temporary: entry.temporary },
        }
    }

    /// Occupancy now: each shard's counts are read under its lock, one shard at a time.
    pub fn usage(&self) -> Usage {
        self.usage_of(self.index.totals(), self.slots.retiring_count())
    }

    fn usage_of(&self, counts: Counts, retiring: u64) -> Usage {
        let slot_bytes = self.slots.slot_bytes();
        let slots = u64::from(self.slots.count());
        let Counts { writing, leased, cached } = counts;
        let used = writing + leased + retiring;
        Usage {
            capacity_bytes: slots * slot_bytes,
            slot_bytes,
            slots,
            used_bytes: used * slot_bytes,
            cached_bytes: cached * slot_bytes,
            free_bytes: slots.saturating_sub(used + cached) * slot_bytes,
            writing,
            leased,
            cached,
            retiring,
        }
    }

    /// Leases not yet fully released or revoked.
    pub fn active_leases(&self) -> u64 {
        self.leases.shards().map(|shard| shard.lock().live.len() as u64).sum()
    }

    /// Sets the L1 gauges (bytes used / cached / free / capacity, objects, active leases, the
    /// shares of index shards evicting in ARC's order and by use counts) from the current state.
    /// Counters move with the events they count; gauges are refreshed here, on the caller's
    /// metrics tick, so the hot paths never pay for them.
    pub fn publish_metrics(&self) {
        let shards = self.index.shard_count();
        let share = |order| {
            let n = (0..shards).filter(|i| self.index.shard_at(*i).policy.order() == order).count();
            n as f64 / shards.max(1) as f64
        };
        let orders = [share(Order::Arc), share(Order::Frequency)];
        self.metrics.publish(&self.usage(), self.active_leases(), orders);
    }

    /// Recounts everything under every lock and checks the invariants: every slot is owned by
    /// exactly one entry, or free, or retiring; the class counters match the entries; each
    /// entry's share count equals the shares its leases hold; the policies track exactly the
    /// finished, non-temporary entries; no key is claimed.
    ///
    /// Expensive. For tests and for operators verifying a live daemon. Slot ownership is exact
    /// while guards drop (the last one frees a retired slot atomically with respect to the
    /// audit's snapshot), but not while a write reservation is under way (it holds slots and
    /// claims it has not yet given keys).
    pub fn audit(&self) -> Result<(), String> {
        let leases: Vec<_> = self.leases.shards().map(|s| s.lock()).collect();
        let shards: Vec<_> =
            (0..self.index.shard_count()).map(|i| self.index.shard_at(i)).collect();
        let (free, retiring, retiring_count) = self.slots.snapshot();

        let mut held: HashMap<(ObjectKey, u64), u64> = HashMap::new();
        for shard in &leases {
            for (id, record) in &shard.live {
                if record.keys.is_empty() {
                    return Err(format!("lease #{id} is live with no key"));
                }
                for (key, shares) in &record.keys {
                    if shares.outstanding == 0
                        || shares.marked
                        || shares.outstanding & !all_readers(record.readers) != 0
                    {
                        return Err(format!("lease #{id} holds a malformed share set for {key:?}"));
                    }
                    *held.entry((*key, shares.generation)).or_default() +=
                        u64::from(shares.outstanding.count_ones());
                }
            }
        }

        let mut owner = vec![false; self.slots.count() as usize];
        let mut claim =
            |slot: SlotId, what: &dyn Fn() -> String| match owner.get_mut(slot.0 as usize) {
                Some(taken) if !*taken => {
                    *taken = true;
                    Ok(())
                }
                Some(_) => Err(format!("slot {} is claimed twice (second by {})", slot.0, what())),
                None => Err(format!("slot {} does not exist ({})", slot.0, what())),
            };
        let mut totals = Counts::default();
        for shard in &shards {
            if let Some(key) = shard.claims.iter().next() {
                return Err(format!("{key:?} is claimed by a write reservation under way"));
            }
            let mut tracked = 0;
            let mut recount = Counts::default();
            for (key, entry) in &shard.map {
                claim(entry.slot, &|| format!("{key:?}"))?;
                let expected = held.get(&(*key, entry.generation)).copied().unwrap_or(0);
                if entry.shares != expected {
                    return Err(format!(
                        "{key:?} counts {} shares, its leases hold {expected}",
                        entry.shares
                    ));
                }
                if entry.len > self.slots.slot_bytes() {
                    return Err(format!("{key:?} is longer than a slot"));
                }
                let should_track = !entry.is_writing() && !entry.temporary;
                if shard.policy.contains(key) != should_track {
                    return Err(format!(
                        "{key:?}: policy tracking is {}, should be {should_track}",
                        !should_track
                    ));
                }
                tracked += usize::from(should_track);
                match entry.class() {
                    Class::Writing => recount.writing += 1,
                    Class::Leased => recount.leased += 1,
                    Class::Cached if entry.temporary => {
                        return Err(format!("{key:?} is temporary and unleased"));
                    }
                    Class::Cached => recount.cached += 1,
                    Class::Gone => {}
                }
            }
            if recount != shard.counts {
                return Err(format!(
                    "a shard counts {:?}, its entries are {recount:?}",
                    shard.counts
                ));
            }
            totals.add(recount);
            if shard.policy.len() != tracked {
                return Err(format!(
                    "a policy tracks {} keys, its shard has {tracked}",
                    shard.policy.len()
                ));
            }
        }
        for slot in &free {
            claim(*slot, &|| "the free list".into())?;
        }
        for slot in &retiring {
            claim(*slot, &|| "retirement".into())?;
        }
        if let Some(lost) = owner.iter().position(|taken| !taken) {
            return Err(format!("slot {lost} is neither owned, free nor retiring"));
        }
        if retiring.len() as u64 != retiring_count {
            return Err(format!(
                "{} slots are retiring, the counter says {retiring_count}",
                retiring.len(),
            ));
        }
        let usage = self.usage_of(totals, retiring.len() as u64);
        if usage.used_bytes + usage.cached_bytes + usage.free_bytes != usage.capacity_bytes
            || usage.free_bytes != free.len() as u64 * usage.slot_bytes
        {
            return Err(format!("usage does not add up: {usage:?} with {} free slots", free.len()));
        }
        Ok(())
    }

    // ----- helpers -----

    fn handle(&self, slot: SlotId, generation: u64, len: u64) -> SlotHandle {
        SlotHandle { slot, offset: self.slots.offset(slot), len, generation }
    }

    /// `NotFound` for a key not in L1, `WrongState` for one that is.
    fn classify(&self, key: &ObjectKey) -> KeyError {
        if self.index.shard(key).map.contains_key(key) {
            KeyError::WrongState
        } else {
            KeyError::NotFound
        }
    }

    /// Counts in `tierkv_errors_total` what a reservation was refused: each refused key, or the
    /// whole request. For the caller of [`L1Manager::reserve_write_uncounted`] that answers a
    /// client, once, with its final answer.
    pub fn count_refused(&self, reserved: &Result<Vec<Result<SlotHandle, KeyError>>, L1Error>) {
        match reserved {
            Ok(results) => results.iter().for_each(|result| self.count_refusal(result)),
            Err(error) => self.metrics.request_error(error),
        }
    }

    fn count_refusal<T>(&self, result: &Result<T, KeyError>) {
        if let Err(error) = result {
            self.metrics.key_error(*error);
        }
    }

    fn refuse(&self, error: L1Error) -> L1Error {
        self.metrics.request_error(&error);
        error
    }
}

/// Why a key cannot be reserved for a new write.
fn write_conflict(entry: &Entry) -> KeyError {
    if entry.is_writing() { KeyError::WriteInFlight } else { KeyError::AlreadyPresent }
}

/// Why `key` cannot be reserved for a new write now, if it cannot: its entry in its locked
/// `shard`, or another reservation's claim on it (which will write it, or give it up: the
/// writers that must answer for the key wait for it first, `Index::wait_unclaimed`).
fn create_conflict(shard: &Shard, key: &ObjectKey) -> Option<KeyError> {
    match shard.map.get(key) {
        Some(entry) => Some(write_conflict(entry)),
        None => shard.claims.contains(key).then_some(KeyError::WriteInFlight),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use tierkv_core::{ChunkHash, KvRank, Namespace};

    use super::*;
    use crate::device::DeviceKind;
    use crate::lease::LEASE_SHARDS;

    /// What another thread does while `lease_eviction_candidates` on this one is between two
    /// holds of its lease shard.
    type Hook = Box<dyn FnMut(&L1Manager)>;

    thread_local! {
        static BETWEEN_HOLDS: RefCell<Option<Hook>> = const { RefCell::new(None) };
    }

    /// Called by `lease_eviction_candidates` between two holds of its lease shard.
    pub(super) fn between_holds(l1: &L1Manager) {
        BETWEEN_HOLDS.with(|hook| {
            if let Some(hook) = hook.borrow_mut().as_mut() {
                hook(l1);
            }
        });
    }

    fn key(i: u64) -> ObjectKey {
        ObjectKey::new(Namespace::new("t", ""), ChunkHash(u128::from(i)), KvRank::Shared)
    }

    #[test]
    fn a_large_write_back_grant_lets_other_leases_of_its_shard_go_between_batches() {
        const OWNER: OwnerId = OwnerId(1);
        const SLOTS: u64 = 256;
        let config = L1Config { device: DeviceKind::Emulated, ..L1Config::new(SLOTS * 64, 64) };
        let l1 = L1Manager::build(config, L1Context::default()).unwrap();
        let keys: Vec<ObjectKey> = (0..SLOTS).map(key).collect();
        let layout = Layout::bytes(64).unwrap();
        let reserved = l1.reserve_write(OWNER, &keys, &layout, WriteMode::Create, Lifetime::Cached);
        assert!(reserved.unwrap().iter().all(|r| r.is_ok()));
        assert!(l1.finish_write(OWNER, &keys).iter().all(|r| r.is_ok()));
        // Another lease in the shard the grant's lease will have: ids are consecutive.
        let other = l1.reserve_read(OWNER, &keys[..1], ExtraCount::ZERO).lease.unwrap();
        for _ in 1..LEASE_SHARDS {
            let burnt = l1.reserve_read(OWNER, &keys[..1], ExtraCount::ZERO).lease.unwrap();
            l1.release_lease(burnt).unwrap();
        }
        let shard = (other.0 % LEASE_SHARDS as u64) as usize;
        let seen = std::rc::Rc::new(RefCell::new(Vec::new()));
        let log = std::rc::Rc::clone(&seen);
        BETWEEN_HOLDS.with(|hook| {
            *hook.borrow_mut() = Some(Box::new(move |l1: &L1Manager| {
                // Only with the shard free can another lease of it be released (or the audit
                // run) here; a held shard would wait for the whole grant.
                let free = l1.leases.shards().nth(shard).is_some_and(|s| s.try_lock().is_some());
                let released = free && l1.finish_read(other, Readers::All, None).is_ok();
                let audit = if free { l1.audit() } else { Err("not run".into()) };
                log.borrow_mut().push((free, released, audit));
            }));
        });
        let n = 3 * VICTIMS_PER_HOLD + 1;
        let granted = l1.lease_eviction_candidates(OWNER, n, EvictionReason::WriteBack);
        BETWEEN_HOLDS.with(|hook| hook.borrow_mut().take());

        let lease = granted.lease.unwrap();
        assert_eq!(lease.0 % LEASE_SHARDS as u64, other.0 % LEASE_SHARDS as u64);
        assert_eq!(granted.keys.len(), n);
        let seen = seen.borrow();
        // Three holds after the first, each after the shard was let go; the other lease was
        // released after the first batch, and the audit found the grant live and whole there.
        assert_eq!(seen.len(), 3, "{seen:?}");
        assert!(seen.iter().all(|(free, _, audit)| *free && audit.is_ok()), "{seen:?}");
        assert!(seen[0].1, "{seen:?}");
        assert_eq!(l1.finish_read(other, Readers::All, None), Err(L1Error::LeaseReleased(other)));
        assert_eq!(l1.release_lease(lease).unwrap().shares, n as u64);
        l1.audit().unwrap();
    }
}
