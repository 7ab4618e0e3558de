//! The HostStore: an index of fixed-size slots in one host arena, worker threads that run tasks,
//! and the `TierAdapter` face.
//!
//! Every entry is *being stored* (invisible) or *ready*. A store task reserves its slots under
//! the index lock, copies outside it, then publishes them all, or on any failure drops them all:
//! a failed store task leaves no trace. Loads copy out of slots pinned under the lock; eviction
//! and deletion skip pinned and locked entries, so a slot is never reused under a copy.
//!
//! Under a demoter (the cascade), a victim is *leaving*: its bytes go to the tier below as a
//! [`Departing`] chunk off the store's [`Departures`] board, and until that is dropped (the
//! tier below answered its store, or the chunk was given up) lookups still find, lock and load
//! it here, from the same bytes. A victim is never in neither tier while it is on its way.

use std::collections::{HashMap, HashSet};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, unbounded};
use foldhash::fast::RandomState;
use parking_lot::{Mutex, MutexGuard};
use tierkv_core::policy::{EvictionPolicy, JudgedOrder, Order};
use tierkv_core::{
    Bitmap, ChunkSource, Completion, Departing, Departures, JointLoad, LoadItem, ObjectKey,
    StoreItem, TaskId, TierAdapter, TierError, TierUsage,
};

use crate::arena::{Arena, MemoryKind};
use crate::config::HostStoreConfig;
use crate::error::L2Error;
use tierkv_tier_metrics::{DepartingMetrics, TierMetrics};

use crate::metrics::{self, Failure};

struct Entry {
    slot: u32,
    len: u64,
    /// False while its store task copies into it: invisible to lookups, loads and deletes.
    ready: bool,
    /// Locks taken by lookups and not yet returned.
    locks: u64,
    /// Loads copying out of the slot right now.
    pins: u64,
}

impl Entry {
    fn evictable(&self) -> bool {
        self.ready && !self.held()
    }

    /// Whether a lookup's lock or a load's pin keeps the entry.
    fn held(&self) -> bool {
        self.locks > 0 || self.pins > 0
    }
}

/// An evicted entry: its key, the slot it held and its length.
type Victim = (ObjectKey, u32, u64);

/// What a load copies from: a ready entry's slot (pinned) and its length, or the bytes of a
/// chunk on its way down.
enum Pin {
    Slot { key: ObjectKey, slot: u32, len: u64 },
    Leaving(Arc<[u8]>),
}

/// What a load pinned, one entry per item; the slots are unpinned when it is dropped, so a
/// panic between pin and unpin leaves no slot pinned for ever.
struct SlotPins<'a> {
    index: &'a Mutex<Index>,
    pins: Vec<Option<Pin>>,
}

impl Drop for SlotPins<'_> {
    fn drop(&mut self) {
        let mut index = self.index.lock();
        let Index { map, held, .. } = &mut *index;
        for pin in &self.pins {
            if let Some(Pin::Slot { key, .. }) = pin
                && let Some(entry) = map.get_mut(key)
            {
                entry.pins -= 1;
                *held -= u64::from(!entry.held());
            }
        }
    }
}

struct Index {
    map: HashMap<ObjectKey, Entry, RandomState>,
    free: Vec<u32>,
    /// Tracks exactly the ready entries.
    policy: Box<dyn EvictionPolicy<ObjectKey>>,
    locks: u64,
    ready: u64,
    /// Ready entries a lock or a pin keeps: the policy may give up `ready - held` of them.
    held: u64,
}

impl Index {
    /// `n` slots for a store task, evicting unlocked, unpinned entries that are not among the
    /// task's own keys. All or nothing: when `n` cannot be had, nothing is evicted, and the
    /// policy is not asked, so its order stays as it was (victims handed back to it would come
    /// back as its newest keys). Returns the slots and the victims, each with the slot
    /// it held (now among the returned ones, its bytes still in place) and its length.
    fn reserve_slots(
        &mut self,
        n: usize,
        task_keys: &HashSet<ObjectKey, RandomState>,
    ) -> Option<(Vec<u32>, Vec<Victim>)> {
        let from_free = n.min(self.free.len());
        let short = n - from_free;
        if short > 0 {
            let own = task_keys.iter().filter(|k| self.map.get(k).is_some_and(Entry::evictable));
            let evictable = self.ready.saturating_sub(self.held + own.count() as u64);
            if evictable < short as u64 {
                return None;
            }
        }
        let Index { map, policy, .. } = self;
        let victims = if short > 0 {
            policy.evict(short, &mut |k| {
                !task_keys.contains(k) && map.get(k).is_some_and(Entry::evictable)
            })
        } else {
            Vec::new()
        };
        if victims.len() < short {
            // Not reached: the policy tracks exactly the ready entries, and enough of them are
            // evictable. Should it be, nothing is lost: the victims stay, as its newest keys.
            for victim in victims {
                policy.insert(victim);
            }
            return None;
        }
        let mut slots = self.free.split_off(self.free.len() - from_free);
        let mut evicted = Vec::with_capacity(victims.len());
        for victim in victims {
            if let Some(entry) = self.map.remove(&victim) {
                slots.push(entry.slot);
                evicted.push((victim, entry.slot, entry.len));
                self.ready -= 1;
            }
        }
        Some((slots, evicted))
    }

    /// Drops entries that a store task reserved and did not publish.
    fn forget(&mut self, reserved: &[(ObjectKey, u32)]) {
        for (key, slot) in reserved {
            if self.map.remove(key).is_some() {
                self.free.push(*slot);
            }
        }
    }
}

/// One chunk to store, borrowed: a task's `StoreItem` or a chunk demoted from L1.
struct Source<'a> {
    key: ObjectKey,
    source: &'a dyn ChunkSource,
}

/// Takes each chunk the host store evicts, as a [`Departing`] copy of its bytes (the cascade
/// sends it to the next tier). Called under the index lock: it must not call back into the
/// store, except by dropping the chunk.
pub type Demote = Box<dyn Fn(ObjectKey, Departing) + Send + Sync>;

enum Job {
    Store(TaskId, Vec<StoreItem>),
    Lookup(TaskId, Vec<ObjectKey>),
    Load(TaskId, Vec<LoadItem>),
    /// One contiguous part of a load split over the workers: the items from `first` on.
    LoadPart {
        joint: Arc<JointLoad>,
        first: usize,
        items: Vec<LoadItem>,
    },
}

/// A load of fewer items, or fewer bytes, than these runs on one worker: splitting it buys less
/// than it costs.
const SPLIT_LOADS_FROM: usize = 4;
const SPLIT_LOADS_FROM_BYTES: u64 = 4 << 20;

struct Shared {
    arena: Arena,
    chunk_bytes: u64,
    slots: u32,
    index: Mutex<Index>,
    closed: AtomicBool,
    next_task: AtomicU64,
    done: Sender<Completion>,
    completions: Receiver<Completion>,
    metrics: TierMetrics,
    departing_metrics: DepartingMetrics,
    /// Where eviction victims go, once set; without it they are dropped.
    demote: OnceLock<Demote>,
    /// Victims handed to the demoter and not yet landed below (or still locked here). Locked
    /// after `index` when both are.
    departures: Departures,
}

/// The host-memory tier (L2).
pub struct HostStore {
    shared: Arc<Shared>,
    jobs: Mutex<Option<Sender<Job>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    config: HostStoreConfig,
}

impl HostStore {
    /// Allocates the arena and starts the workers.
    pub fn open(config: HostStoreConfig) -> Result<Self, L2Error> {
        let slots = config.slots()?;
        let arena =
            Arena::new(u64::from(slots) * config.chunk_bytes, config.memory, config.prefault)?;
        let (done, completions) = unbounded();
        let shared = Arc::new(Shared {
            arena,
            chunk_bytes: config.chunk_bytes,
            slots,
            index: Mutex::new(Index {
                map: HashMap::default(),
                free: (0..slots).rev().collect(),
                policy: config.policy.build(),
                locks: 0,
                ready: 0,
                held: 0,
            }),
            closed: AtomicBool::new(false),
            next_task: AtomicU64::new(1),
            done,
            completions,
            metrics: metrics::register(),
            departing_metrics: metrics::register_departing(),
            demote: OnceLock::new(),
            departures: Departures::new(),
        });
        let (jobs, queue) = unbounded::<Job>();
        let mut workers = Vec::with_capacity(config.workers);
        for n in 0..config.workers {
            let (shared, queue) = (Arc::clone(&shared), queue.clone());
            let worker = std::thread::Builder::new()
                .name(format!("tierkv-l2-{n}"))
                .spawn(move || shared.work(&queue))
                .map_err(|e| L2Error::Thread(e.to_string()));
            match worker {
                Ok(handle) => workers.push(handle),
                Err(e) => {
                    // Stop the workers already started before reporting.
                    drop(jobs);
                    workers.into_iter().for_each(|w: JoinHandle<()>| drop(w.join()));
                    return Err(e);
                }
            }
        }
        let store = HostStore {
            shared,
            jobs: Mutex::new(Some(jobs)),
            workers: Mutex::new(workers),
            config,
        };
        store.publish_metrics();
        Ok(store)
    }

    /// The memory the arena actually got.
    pub fn memory(&self) -> MemoryKind {
        self.shared.arena.kind()
    }

    /// The configuration the store was opened with.
    pub fn config(&self) -> &HostStoreConfig {
        &self.config
    }

    /// Evicts unlocked, idle objects by policy while more than `high` of the slots are occupied,
    /// down to `low`; returns how many. The storage layer calls this in the background, so stores
    /// rarely have to evict on their own path.
    pub fn evict_to_watermark(&self, high: f64, low: f64) -> usize {
        let slots = f64::from(self.shared.slots);
        let index = self.shared.index.lock();
        let occupied = u64::from(self.shared.slots) - index.free.len() as u64;
        if (occupied as f64) <= high * slots {
            return 0;
        }
        // At least one chunk stays: below ten slots `low` rounds down a whole slot, and a tier
        // of one would keep nothing.
        let target = ((low * slots).floor() as u64).max(1);
        self.evict_locked(index, occupied.saturating_sub(target) as usize)
    }

    /// Evicts up to `n` unlocked, idle objects by policy, handing each to the demoter as any
    /// eviction does; returns how many. How the storage layer empties L2 into the disk tier
    /// when it stops.
    pub fn evict(&self, n: usize) -> usize {
        self.evict_locked(self.shared.index.lock(), n)
    }

    fn evict_locked(&self, mut index: MutexGuard<'_, Index>, n: usize) -> usize {
        let mut evicted = 0;
        while evicted < n {
            let Index { map, policy, .. } = &mut *index;
            let Some(victim) =
                policy.evict(1, &mut |k| map.get(k).is_some_and(Entry::evictable)).pop()
            else {
                break;
            };
            if let Some(entry) = index.map.remove(&victim) {
                // The slot is free only once its bytes were handed down.
                self.shared.demote_all(&[(victim, entry.slot, entry.len)]);
                index.free.push(entry.slot);
                index.ready -= 1;
                evicted += 1;
            }
        }
        drop(index);
        self.shared.metrics.evicted(evicted as u64);
        evicted
    }

    /// Stores one chunk now, on the caller's thread, evicting as a store task would: how the
    /// storage layer's cascade moves an L1 victim here while L1 still holds its slot.
    pub fn store_now(&self, key: ObjectKey, source: &dyn ChunkSource) -> Result<(), TierError> {
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(TierError::Closed);
        }
        self.shared.store(&[Source { key, source }])
    }

    /// Sends every chunk this store evicts from now on to `demote`, with its bytes, instead of
    /// dropping it. Set once; a second call is refused (returns false).
    pub fn set_demoter(&self, demote: Demote) -> bool {
        self.shared.demote.set(demote).is_ok()
    }

    /// The order the policy evicts in (the adaptive policy's as of its last eviction).
    pub fn order(&self) -> Order {
        self.shared.index.lock().policy.order()
    }

    /// Evicts in the order `order` names from now on, instead of one the policy judges from
    /// this store's own traffic ([`EvictionPolicy::follow`]; only the adaptive policy has a
    /// choice).
    pub fn follow(&self, order: JudgedOrder) {
        self.shared.index.lock().policy.follow(order);
    }

    /// Sets the L2 gauges from the current state.
    pub fn publish_metrics(&self) {
        self.shared.publish();
    }

    fn submit(&self, make: impl FnOnce(TaskId) -> Job) -> TaskId {
        let task = TaskId(self.shared.next_task.fetch_add(1, Ordering::Relaxed));
        self.send(make(task));
        task
    }

    /// Queues a job for the workers, or completes it as failed when the store is closed.
    fn send(&self, job: Job) {
        let sender = self.jobs.lock().clone();
        match sender {
            Some(sender) if !self.shared.closed.load(Ordering::Acquire) => {
                if let Err(refused) = sender.send(job) {
                    self.shared.fail(refused.0, TierError::Closed);
                }
            }
            _ => self.shared.fail(job, TierError::Closed),
        }
    }
}

impl Shared {
    fn work(&self, queue: &Receiver<Job>) {
        while let Ok(job) = queue.recv() {
            if self.closed.load(Ordering::Acquire) {
                self.fail(job, TierError::Closed);
                continue;
            }
            let (task, kind) = match &job {
                Job::Store(task, _) => (*task, 0),
                Job::Lookup(task, keys) => (*task, 1 + keys.len()),
                Job::Load(task, _) => (*task, usize::MAX),
                // A part runs its own copies under catch_unwind (`run`), so it always reports.
                Job::LoadPart { joint, .. } => (joint.task(), usize::MAX),
            };
            match catch_unwind(AssertUnwindSafe(|| self.run(job))) {
                Ok(Some(completion)) => {
                    let _ = self.done.send(completion);
                }
                Ok(None) => {}
                // A bug in this crate, not in a caller's buffer (those are caught per copy): the
                // buffers went down with the panic, so the task completes as a failure without
                // them rather than never.
                Err(_) => {
                    self.metrics.failed(Failure::Panic);
                    let completion = match kind {
                        0 => Completion::Stored {
                            task,
                            result: Err(TierError::Io("internal panic".into())),
                            sources: vec![],
                        },
                        usize::MAX => {
                            Completion::Loaded { task, loaded: Bitmap::new(0), sinks: vec![] }
                        }
                        n => Completion::LookedUp { task, locked: Bitmap::new(n - 1) },
                    };
                    let _ = self.done.send(completion);
                }
            }
            self.publish();
        }
    }

    /// Returns the task's completion (`None` for a part of a split load that is not the last).
    fn run(&self, job: Job) -> Option<Completion> {
        Some(match job {
            Job::Store(task, sources) => {
                let borrowed: Vec<Source<'_>> = sources
                    .iter()
                    .map(|item| Source { key: item.key, source: item.source.as_ref() })
                    .collect();
                let result = self.store(&borrowed);
                drop(borrowed);
                Completion::Stored { task, result, sources }
            }
            Job::Lookup(task, keys) => {
                Completion::LookedUp { task, locked: self.lookup_and_lock(&keys) }
            }
            Job::Load(task, mut sinks) => {
                let loaded = self.load(&mut sinks);
                Completion::Loaded { task, loaded, sinks }
            }
            Job::LoadPart { joint, first, mut items } => {
                let loaded = catch_unwind(AssertUnwindSafe(|| self.load(&mut items)))
                    .unwrap_or_else(|_| {
                        self.metrics.failed(Failure::Panic);
                        Bitmap::new(items.len())
                    });
                return joint.part_done(first, items, &loaded);
            }
        })
    }

    /// Completes a job that will not run.
    fn fail(&self, job: Job, error: TierError) {
        self.metrics.failed(Failure::Closed);
        let completion = match job {
            Job::Store(task, sources) => Completion::Stored { task, result: Err(error), sources },
            Job::Lookup(task, keys) => {
                Completion::LookedUp { task, locked: Bitmap::new(keys.len()) }
            }
            Job::Load(task, sinks) => {
                Completion::Loaded { task, loaded: Bitmap::new(sinks.len()), sinks }
            }
            Job::LoadPart { joint, first, items } => {
                match joint.part_done(first, items, &Bitmap::new(0)) {
                    Some(completion) => completion,
                    None => return,
                }
            }
        };
        let _ = self.done.send(completion);
    }

    /// Hands each victim's bytes to the demoter, if one is set, and keeps them readable as
    /// leaving until the demoter drops them. Called under the index lock, the victims just taken
    /// out of it, so a lookup finds each victim in one of the two. Its slot must not be written
    /// until this returns.
    fn demote_all(&self, victims: &[Victim]) {
        let Some(demote) = self.demote.get() else { return };
        for (key, slot, len) in victims {
            let (offset, len) = self.slot_range(*slot, *len);
            // SAFETY: the victim left the index under the lock and its slot is not reused before
            // this returns (the callers guarantee it), so nothing writes these bytes meanwhile.
            let bytes: Arc<[u8]> = Arc::from(unsafe { self.arena.bytes(offset, len) });
            let departing = self.departures.depart(*key, bytes);
            // A demoter that panics (a bug) loses this chunk (a miss) and nothing else: the
            // callers still free or reuse the slots they took, and the victims after it go on.
            if catch_unwind(AssertUnwindSafe(|| demote(*key, departing))).is_err() {
                self.metrics.failed(Failure::Panic);
            }
        }
    }

    fn slot_range(&self, slot: u32, len: u64) -> (usize, usize) {
        ((u64::from(slot) * self.chunk_bytes) as usize, len as usize)
    }

    fn store(&self, items: &[Source<'_>]) -> Result<(), TierError> {
        // Each source's length, asked once: a source that answered differently later would
        // have its copy run past its slot into another key's.
        let lens: Vec<u64> = items.iter().map(|item| item.source.len()).collect();
        if let Some(&bytes) = lens.iter().find(|&&len| len > self.chunk_bytes) {
            self.metrics.failed(Failure::TooLarge);
            return Err(TierError::TooLarge { bytes, limit: self.chunk_bytes });
        }
        // Reserve a slot for every key not yet here (present or in flight: equal keys, equal
        // bytes), all at once, so a task that cannot fit evicts nothing.
        let task_keys: HashSet<ObjectKey, RandomState> =
            items.iter().map(|item| item.key).collect();
        let mut reserved: Vec<(ObjectKey, u32)> = Vec::with_capacity(items.len());
        let mut to_copy: Vec<(&Source<'_>, u64, u32)> = Vec::with_capacity(items.len());
        let evicted;
        {
            let mut index = self.index.lock();
            let mut seen: HashSet<ObjectKey, RandomState> = HashSet::default();
            let new: Vec<(&Source<'_>, u64)> = items
                .iter()
                .zip(lens)
                .filter(|(item, _)| !index.map.contains_key(&item.key) && seen.insert(item.key))
                .collect();
            let Some((slots, victims)) = index.reserve_slots(new.len(), &task_keys) else {
                drop(index);
                self.metrics.failed(Failure::NoSpace);
                return Err(TierError::NoSpace(format!(
                    "{} chunks do not fit: the other slots of {} are locked, pinned or being stored",
                    new.len(),
                    self.slots
                )));
            };
            evicted = victims.len() as u64;
            // The victims' slots are this task's now and are written only below, after their
            // bytes were handed down.
            self.demote_all(&victims);
            for ((item, len), slot) in new.into_iter().zip(slots) {
                let entry = Entry { slot, len, ready: false, locks: 0, pins: 0 };
                index.map.insert(item.key, entry);
                reserved.push((item.key, slot));
                to_copy.push((item, len, slot));
            }
        }
        self.metrics.evicted(evicted);
        // Copy outside the lock. The reserved slots are this task's alone.
        let mut failure = None;
        for (item, len, slot) in &to_copy {
            let (offset, len) = self.slot_range(*slot, *len);
            // SAFETY: the slot was reserved above for this task only; nothing reads an entry that
            // is not ready, and nothing else writes a reserved slot.
            let dst = unsafe { self.arena.bytes_mut(offset, len) };
            let copied = catch_unwind(AssertUnwindSafe(|| item.source.read_into(dst)));
            match copied {
                Ok(Ok(())) => {}
                Ok(Err(e)) => failure = Some(TierError::Buffer(e)),
                Err(_) => {
                    failure = Some(TierError::Io(format!("the source of {:?} panicked", item.key)))
                }
            }
            if failure.is_some() {
                break;
            }
        }
        let mut index = self.index.lock();
        if let Some(error) = failure {
            index.forget(&reserved);
            drop(index);
            self.metrics.failed(Failure::Copy);
            return Err(error);
        }
        for (key, _) in &reserved {
            if let Some(entry) = index.map.get_mut(key) {
                entry.ready = true;
            }
            index.policy.insert(*key);
            index.ready += 1;
        }
        drop(index);
        let bytes = to_copy.iter().map(|(_, len, _)| len).sum();
        self.metrics.stored(to_copy.len() as u64, bytes);
        Ok(())
    }

    /// Locks and touches every ready key. Lookups name a chain root first; the keys are touched
    /// leaf first, so the root ends up the most recent and eviction takes a chain's tail first.
    /// A chunk on its way to the tier below is found and locked too, without a touch: the
    /// policy no longer tracks it.
    fn lookup_and_lock(&self, keys: &[ObjectKey]) -> Bitmap {
        let mut index = self.index.lock();
        let mut board = self.departures.lock();
        let Index { map, policy, locks, held, .. } = &mut *index;
        let mut found = vec![false; keys.len()];
        for (i, key) in keys.iter().enumerate().rev() {
            if let Some(entry) = map.get_mut(key).filter(|e| e.ready) {
                *held += u64::from(!entry.held());
                entry.locks += 1;
                *locks += 1;
                policy.touch(key);
                found[i] = true;
            } else if board.lock(key) {
                *locks += 1;
                found[i] = true;
            }
        }
        Bitmap::from_bools(found)
    }

    fn load(&self, items: &mut [LoadItem]) -> Bitmap {
        // Each sink's length, asked once and outside the lock: a sink whose `len` panics (or
        // blocks) is the caller's code, so it is never run under the index lock or between a
        // pin and its unpin. One that panics is that key's miss.
        let lens: Vec<Option<u64>> = items
            .iter()
            .map(|item| {
                catch_unwind(AssertUnwindSafe(|| item.sink.len())).ok().or_else(|| {
                    self.metrics.failed(Failure::Copy);
                    None
                })
            })
            .collect();
        // Pin under the lock, copy outside it; the guard unpins under it again, on every path.
        // A chunk on its way down is copied from its own bytes, which the pin shares.
        let pins = {
            let mut index = self.index.lock();
            let board = self.departures.lock();
            let Index { map, held, .. } = &mut *index;
            let pins = items
                .iter()
                .zip(&lens)
                .map(|(item, len)| {
                    let len = (*len)?;
                    match map.get_mut(&item.key) {
                        Some(entry) if entry.ready && entry.len == len => {
                            *held += u64::from(!entry.held());
                            entry.pins += 1;
                            Some(Pin::Slot { key: item.key, slot: entry.slot, len })
                        }
                        _ => board.bytes(&item.key, len).map(Pin::Leaving),
                    }
                })
                .collect();
            SlotPins { index: &self.index, pins }
        };
        let mut loaded = Bitmap::new(items.len());
        let mut bytes = 0;
        let mut departing = 0;
        for (i, (item, pin)) in items.iter_mut().zip(&pins.pins).enumerate() {
            let src = match pin {
                None => continue,
                Some(Pin::Slot { slot, len, .. }) => {
                    let (offset, len) = self.slot_range(*slot, *len);
                    // SAFETY: the entry is ready and pinned: nobody writes or reuses its slot
                    // until the guard unpins it, after this loop.
                    unsafe { self.arena.bytes(offset, len) }
                }
                Some(Pin::Leaving(leaving)) => leaving,
            };
            let len = src.len();
            let copied = catch_unwind(AssertUnwindSafe(|| item.sink.write_from(src)));
            if matches!(copied, Ok(Ok(()))) {
                loaded.set(i, true);
                bytes += len as u64;
                departing += u64::from(matches!(pin, Some(Pin::Leaving(_))));
            } else {
                self.metrics.failed(Failure::Copy);
            }
        }
        drop(pins);
        self.metrics.loaded(loaded.count_ones() as u64, bytes);
        self.departing_metrics.loaded(departing);
        loaded
    }

    fn usage(&self) -> TierUsage {
        let index = self.index.lock();
        let occupied = u64::from(self.slots) - index.free.len() as u64;
        TierUsage {
            capacity_bytes: u64::from(self.slots) * self.chunk_bytes,
            used_bytes: occupied * self.chunk_bytes,
            objects: index.ready,
            locks: index.locks,
        }
    }

    fn publish(&self) {
        let usage = self.usage();
        self.metrics.publish(usage.capacity_bytes, usage.used_bytes, usage.objects);
        let order = self.index.lock().policy.order();
        let share = |o| if order == o { 1.0 } else { 0.0 };
        self.metrics.publish_orders(share(Order::Arc), share(Order::Frequency));
        let (objects, bytes) = self.departures.lock().departing();
        self.departing_metrics.publish(objects, bytes);
    }
}

impl TierAdapter for HostStore {
    fn name(&self) -> &str {
        "l2"
    }

    fn submit_store(&self, items: Vec<StoreItem>) -> TaskId {
        self.submit(|task| Job::Store(task, items))
    }

    fn submit_lookup_and_lock(&self, keys: Vec<ObjectKey>) -> TaskId {
        self.submit(|task| Job::Lookup(task, keys))
    }

    /// A load of several chunks is split into contiguous parts, one per worker, copied at once;
    /// the task still completes once, with every sink in order.
    fn submit_load(&self, items: Vec<LoadItem>) -> TaskId {
        let workers = self.workers.lock().len();
        let bytes: u64 = items.iter().map(|item| item.sink.len()).sum();
        if items.len() < SPLIT_LOADS_FROM || bytes < SPLIT_LOADS_FROM_BYTES || workers < 2 {
            return self.submit(|task| Job::Load(task, items));
        }
        let task = TaskId(self.shared.next_task.fetch_add(1, Ordering::Relaxed));
        let parts = workers.min(items.len());
        let (joint, jobs) = JointLoad::split(task, items, parts);
        for (first, items) in jobs {
            self.send(Job::LoadPart { joint: Arc::clone(&joint), first, items });
        }
        task
    }

    fn unlock(&self, keys: &[ObjectKey]) {
        let mut index = self.shared.index.lock();
        let mut board = self.shared.departures.lock();
        for key in keys {
            if let Some(entry) = index.map.get_mut(key)
                && entry.locks > 0
            {
                entry.locks -= 1;
                let released = !entry.held();
                index.locks -= 1;
                index.held -= u64::from(released);
            } else if board.unlock(key) {
                index.locks -= 1;
            }
        }
    }

    /// A key's copy on its way down stops being served here too, as its slot does, unless a
    /// lookup holds it, and its departures are withdrawn: the tier below does not keep them (a
    /// copy it already has is that tier's to delete). A key counts once, whichever of the two
    /// went.
    fn delete(&self, keys: &[ObjectKey]) -> usize {
        let mut index = self.shared.index.lock();
        let mut board = self.shared.departures.lock();
        let mut deleted = 0;
        for key in keys {
            // A key a lookup holds (here, or on the board) is not deleted in either place: its
            // departure withdrawn while it stays here would leave the tiers disagreeing.
            if index.map.get(key).is_some_and(Entry::held) || board.is_locked(key) {
                continue;
            }
            let mut gone = false;
            if index.map.get(key).is_some_and(Entry::evictable)
                && let Some(entry) = index.map.remove(key)
            {
                index.policy.remove(key);
                index.free.push(entry.slot);
                index.ready -= 1;
                gone = true;
            }
            gone |= board.delete(key);
            deleted += usize::from(gone);
        }
        deleted
    }

    fn clear(&self) -> usize {
        let index = self.shared.index.lock();
        let board = self.shared.departures.lock();
        let keys: Vec<ObjectKey> = index.map.keys().chain(board.keys()).copied().collect();
        drop((board, index));
        self.delete(&keys)
    }

    fn usage(&self) -> TierUsage {
        self.shared.usage()
    }

    fn completions(&self) -> Receiver<Completion> {
        self.shared.completions.clone()
    }

    fn close(&self) {
        self.shared.closed.store(true, Ordering::Release);
        // Disconnecting the queue lets the workers drain it (failing what is left) and exit.
        drop(self.jobs.lock().take());
        let workers = std::mem::take(&mut *self.workers.lock());
        for worker in workers {
            let _ = worker.join();
        }
        self.shared.publish();
    }
}

impl Drop for HostStore {
    fn drop(&mut self) {
        self.close();
    }
}
