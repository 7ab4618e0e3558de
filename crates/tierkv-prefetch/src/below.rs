//! The part of a hit that L1 had no room for: chunks left in their lower tier, locked there, and
//! read straight from it when a reader asks for them.
//!
//! A prefetch promotes a hit's lower-tier chunks into temporary L1 slots. When L1 cannot give
//! every one of them a slot (the hit is larger than L1, or L1 is full of leased chunks), the rest
//! stay where they are, under the tier lock the lookup took, and [`HeldBelow`] owns those locks:
//! each is returned exactly once, by [`HeldBelow::release`] or when the last handle is dropped.
//! A read copies the chunk from its tier into a buffer; a read that fails or runs out of time is
//! an error for that reader (a miss and a recompute for the engine), never partial bytes.
//!
//! Where a hit has several readers (MLA: every TP rank reads the same bytes), the first reader to
//! ask for a chunk loads it and the others take the same buffer: the tier is read once per chunk,
//! not once per reader, and the bytes are held once, until every reader has had them. A reader
//! waits for a load another reader started; if that load fails, a waiting reader loads the chunk
//! itself, so a failure costs only the reader it struck. What one hit keeps for readers still to
//! come is bounded ([`KEPT_FOR_READERS`]): a reader running ahead of the others (or alone, the
//! others gone) does not hold the whole hit in memory; past the bound, the readers behind load
//! their own copies.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::unbounded;
use parking_lot::{Condvar, Mutex};
use tierkv_core::{BufferError, ChunkSink, Completion, LoadItem, ObjectKey, deadline_after};

use crate::router::TierRouter;

/// Why chunks held below L1 could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BelowError {
    /// The key is not one this hit holds below L1 (or its lock was already returned).
    #[error("the chunk is not held below L1 for this lookup")]
    NotHeld,
    /// The tier did not load the chunk whole.
    #[error("tier {tier} could not load the chunk")]
    LoadFailed {
        /// The tier (index, fastest first).
        tier: usize,
    },
    /// The tier did not answer in time.
    #[error("the lower tiers did not answer within {0:?}")]
    Timeout(Duration),
}

/// Bytes of loaded chunks one hit keeps for its readers still to come, at most: what a
/// retrieve's window takes (the daemon reads a hit held below L1 in windows of 64 MiB).
pub const KEPT_FOR_READERS: u64 = 64 << 20;

/// Chunks of one hit held in their lower tiers, each under one tier lock.
pub struct HeldBelow {
    router: Arc<TierRouter>,
    /// Each held key and its tier (index, fastest first); a key leaves when its lock goes back.
    held: Mutex<HashMap<ObjectKey, usize>>,
    /// Chunks one reader is loading, or loaded, for the hit's other readers.
    shared: Mutex<SharedLoads>,
    /// Signalled when a load for the other readers ends, whole or not.
    landed: Condvar,
    /// Bytes of loaded chunks kept for the readers to come, at most.
    keep_bytes: u64,
}

/// The chunks loaded, or being loaded, for a hit's several readers.
#[derive(Default)]
struct SharedLoads {
    chunks: HashMap<ObjectKey, Shared>,
    /// Bytes of the `Loaded` chunks.
    kept: u64,
}

impl SharedLoads {
    /// Forgets `key`'s entry, counting out its bytes if it was loaded.
    fn remove(&mut self, key: &ObjectKey) {
        if let Some(Shared::Loaded { bytes, .. }) = self.chunks.remove(key) {
            self.kept -= bytes.len() as u64;
        }
    }
}

/// A chunk loaded once for every reader of the hit.
enum Shared {
    /// A reader is loading it; the others wait.
    Loading,
    /// Loaded whole; `taken` readers have had it. It goes when every reader has.
    Loaded { bytes: Arc<Vec<u8>>, taken: u32 },
    /// Loaded by `taken` readers, not kept (the hit kept enough already): the next reader
    /// loads it again.
    NotKept { taken: u32 },
}

impl HeldBelow {
    /// Takes over one tier lock per entry of `held`.
    /// `held` names each key once: a lookup's lock on a key is one lock, whatever the groups.
    pub(crate) fn new(router: Arc<TierRouter>, held: HashMap<ObjectKey, usize>) -> Self {
        Self::keeping(router, held, KEPT_FOR_READERS)
    }

    /// As [`HeldBelow::new`], keeping at most `keep_bytes` of loaded chunks for other readers.
    fn keeping(router: Arc<TierRouter>, held: HashMap<ObjectKey, usize>, keep_bytes: u64) -> Self {
        HeldBelow {
            router,
            held: Mutex::new(held),
            shared: Mutex::new(SharedLoads::default()),
            landed: Condvar::new(),
            keep_bytes,
        }
    }

    /// The tier holding `key` for this hit, if it still does.
    pub fn tier_of(&self, key: &ObjectKey) -> Option<usize> {
        self.held.lock().get(key).copied()
    }

    /// How many chunks are held.
    pub fn len(&self) -> usize {
        self.held.lock().len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.held.lock().is_empty()
    }

    /// Returns the locks of `keys` (those still held); the others stay held.
    pub fn release(&self, keys: &[ObjectKey]) {
        let mut held = self.held.lock();
        let returned: Vec<(ObjectKey, usize)> =
            keys.iter().filter_map(|key| held.remove(key).map(|tier| (*key, tier))).collect();
        drop(held);
        let mut shared = self.shared.lock();
        for (key, _) in &returned {
            if matches!(
                shared.chunks.get(key),
                Some(Shared::Loaded { .. } | Shared::NotKept { .. })
            ) {
                shared.remove(key);
            }
        }
        drop(shared);
        self.unlock(returned);
    }

    /// Every chunk of `keys` (each `chunk_bytes` long), out of its tier, in order, for one of the
    /// hit's `readers`. All or nothing: any chunk not held, not loaded whole, or not loaded by
    /// `timeout` fails the read. With more than one reader, each chunk is loaded once for all.
    pub fn read(
        &self,
        keys: &[ObjectKey],
        chunk_bytes: u64,
        timeout: Duration,
        readers: u32,
    ) -> Result<Vec<Arc<Vec<u8>>>, BelowError> {
        let deadline = deadline_after(Instant::now(), timeout);
        let tiers: Vec<usize> = keys
            .iter()
            .map(|k| self.tier_of(k).ok_or(BelowError::NotHeld))
            .collect::<Result<_, _>>()?;
        if readers <= 1 {
            let loaded = self.load(keys, &tiers, chunk_bytes, deadline, timeout)?;
            return Ok(loaded.into_iter().map(Arc::new).collect());
        }
        let mut got: Vec<Option<Arc<Vec<u8>>>> = vec![None; keys.len()];
        loop {
            // Take what another reader loaded, claim what nobody loads, wait for the rest.
            let mut claimed = Vec::new();
            let mut shared = self.shared.lock();
            let mut waiting = false;
            for (i, key) in keys.iter().enumerate() {
                if got[i].is_some() {
                    continue;
                }
                match shared.chunks.get_mut(key) {
                    None => {
                        shared.chunks.insert(*key, Shared::Loading);
                        claimed.push((i, 0));
                    }
                    Some(Shared::NotKept { taken }) => {
                        let taken = *taken;
                        shared.chunks.insert(*key, Shared::Loading);
                        claimed.push((i, taken));
                    }
                    Some(Shared::Loading) => waiting = true,
                    Some(Shared::Loaded { bytes, taken }) => {
                        got[i] = Some(Arc::clone(bytes));
                        *taken += 1;
                        if *taken >= readers {
                            shared.remove(key);
                        }
                    }
                }
            }
            if claimed.is_empty() {
                if !waiting {
                    break;
                }
                if self.landed.wait_until(&mut shared, deadline).timed_out() {
                    return Err(BelowError::Timeout(timeout));
                }
                continue;
            }
            drop(shared);
            // This reader loads what it claimed, while nothing is locked; others wait for it.
            let mine: Vec<ObjectKey> = claimed.iter().map(|(i, _)| keys[*i]).collect();
            let their_tiers: Vec<usize> = claimed.iter().map(|(i, _)| tiers[*i]).collect();
            let result = self.load(&mine, &their_tiers, chunk_bytes, deadline, timeout);
            let mut shared = self.shared.lock();
            let loaded = match result {
                Ok(loaded) => loaded,
                Err(e) => {
                    // Unclaimed again: a waiting reader loads them itself.
                    for (i, taken) in &claimed {
                        match taken {
                            0 => shared.remove(&keys[*i]),
                            _ => {
                                shared.chunks.insert(keys[*i], Shared::NotKept { taken: *taken });
                            }
                        }
                    }
                    drop(shared);
                    self.landed.notify_all();
                    return Err(e);
                }
            };
            for ((i, taken), bytes) in claimed.into_iter().zip(loaded) {
                let bytes = Arc::new(bytes);
                got[i] = Some(Arc::clone(&bytes));
                let (taken, len) = (taken + 1, bytes.len() as u64);
                if taken >= readers {
                    shared.chunks.remove(&keys[i]);
                } else if shared.kept + len <= self.keep_bytes {
                    shared.kept += len;
                    shared.chunks.insert(keys[i], Shared::Loaded { bytes, taken });
                } else {
                    // Not kept: a reader to come loads its own copy.
                    shared.chunks.insert(keys[i], Shared::NotKept { taken });
                }
            }
            drop(shared);
            self.landed.notify_all();
        }
        got.into_iter()
            .enumerate()
            .map(|(i, bytes)| bytes.ok_or(BelowError::LoadFailed { tier: tiers[i] }))
            .collect()
    }

    /// Copies `keys` (held in `tiers`) out of their tiers into buffers of their own, by `deadline`.
    fn load(
        &self,
        keys: &[ObjectKey],
        tiers: &[usize],
        chunk_bytes: u64,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, BelowError> {
        let landed: Landed = Arc::new(Mutex::new(vec![None; keys.len()]));
        let (reply, answers) = unbounded();
        let mut waiting = 0;
        // Sinks handed to each tier: a whole load hands every one back, each loaded.
        let mut submitted = vec![0; self.router.len()];
        for (tier, submitted) in submitted.iter_mut().enumerate() {
            let items: Vec<LoadItem> = (0..keys.len())
                .filter(|i| tiers[*i] == tier)
                .map(|i| LoadItem {
                    key: keys[i],
                    sink: Box::new(Landing::new(chunk_bytes, i, Arc::clone(&landed))),
                })
                .collect();
            if items.is_empty() {
                continue;
            }
            *submitted = items.len();
            // A tier that panics taking the load (a bug) failed it; the claims of the caller
            // are given back as for any failure.
            let task = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.router.submit(tier, &reply, |t| t.submit_load(items))
            }));
            if !matches!(task, Ok(Some(_))) {
                return Err(BelowError::LoadFailed { tier });
            }
            waiting += 1;
        }
        for _ in 0..waiting {
            let left = deadline.saturating_duration_since(Instant::now());
            let event = answers.recv_timeout(left).map_err(|_| BelowError::Timeout(timeout))?;
            let Completion::Loaded { loaded, sinks, .. } = event.completion else {
                return Err(BelowError::LoadFailed { tier: event.tier });
            };
            // Every sink hands its bytes over as it is dropped (one the tier lost, perhaps half
            // written, too); only whole loads count: every sink handed to the tier back, each
            // with its bit set.
            let expected = submitted.get(event.tier).copied().unwrap_or(0);
            let whole = sinks.len() == expected
                && loaded.len() == expected
                && loaded.count_ones() == expected;
            drop(sinks);
            if !whole {
                return Err(BelowError::LoadFailed { tier: event.tier });
            }
        }
        let mut landed = landed.lock();
        landed
            .iter_mut()
            .enumerate()
            .map(|(i, bytes)| bytes.take().ok_or(BelowError::LoadFailed { tier: tiers[i] }))
            .collect()
    }

    fn unlock(&self, keys: impl IntoIterator<Item = (ObjectKey, usize)>) {
        let keys: Vec<(ObjectKey, usize)> = keys.into_iter().collect();
        for tier in 0..self.router.len() {
            let mine: Vec<ObjectKey> =
                keys.iter().filter(|(_, t)| *t == tier).map(|(k, _)| *k).collect();
            if let (Some(adapter), false) = (self.router.tier(tier), mine.is_empty()) {
                // A tier that panics keeps its locks (its bug); the panic goes no further: this
                // runs in `Drop` too, where a second panic while unwinding would abort the
                // daemon.
                let unlocked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    adapter.unlock(&mine);
                }));
                if unlocked.is_err() {
                    tracing::error!(tier, keys = mine.len(), "a tier panicked returning locks");
                }
            }
        }
    }
}

impl Drop for HeldBelow {
    fn drop(&mut self) {
        let rest = std::mem::take(&mut *self.held.lock());
        self.unlock(rest);
    }
}

impl fmt::Debug for HeldBelow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeldBelow").field("held", &self.held.lock().len()).finish()
    }
}

impl PartialEq for HeldBelow {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other) || *self.held.lock() == *other.held.lock()
    }
}

impl Eq for HeldBelow {}

/// Where a load's chunks land: entry `i` takes the bytes of the load's sink `i` once the tier
/// gave that sink back (`None` until then, or if nothing was written into it).
pub type Landed = Arc<Mutex<Vec<Option<Vec<u8>>>>>;

/// A load's buffer that hands its bytes to its entry of a [`Landed`] table when the tier gives
/// it back. Whether the load was whole is the completion's to say: a sink the tier wrote only
/// part of hands its bytes over too.
pub struct Landing {
    bytes: Vec<u8>,
    index: usize,
    written: bool,
    table: Landed,
}

impl Landing {
    /// A buffer of `len` bytes for entry `index` of `table`.
    pub fn new(len: u64, index: usize, table: Landed) -> Self {
        Landing { bytes: vec![0; len as usize], index, written: false, table }
    }
}

impl ChunkSink for Landing {
    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn copy_from_host(&mut self, src: &[u8]) -> Result<(), BufferError> {
        if src.len() != self.bytes.len() {
            return Err(BufferError::LengthMismatch {
                buffer: self.bytes.len() as u64,
                copy: src.len() as u64,
            });
        }
        self.bytes.copy_from_slice(src);
        self.written = true;
        Ok(())
    }

    fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        // A tier may write in place; whether the load was whole is the completion's to say.
        self.written = true;
        Some(&mut self.bytes)
    }
}

impl Drop for Landing {
    fn drop(&mut self) {
        if self.written
            && let Some(slot) = self.table.lock().get_mut(self.index)
        {
            *slot = Some(std::mem::take(&mut self.bytes));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierkv_testkit::FakeTier;
    use tierkv_testkit::contract::{keys, payload};

    const CHUNK: u64 = 4096;
    const WAIT: Duration = Duration::from_secs(5);

    #[test]
    fn a_reader_ahead_of_the_others_keeps_no_more_than_the_bound_for_them() {
        let tier = Arc::new(FakeTier::new("l2", 64, CHUNK));
        for key in keys(0..8) {
            tier.insert(key, payload(&key, CHUNK));
        }
        let router = Arc::new(TierRouter::start(vec![tier.clone()]).unwrap());
        let held = keys(0..8).into_iter().map(|key| (key, 0)).collect();
        let below = HeldBelow::keeping(Arc::clone(&router), held, 3 * CHUNK);
        // Reader 0 of two reads the whole hit and lets its copies go.
        let first = below.read(&keys(0..8), CHUNK, WAIT, 2).unwrap();
        let copies: Vec<_> = first.iter().map(Arc::downgrade).collect();
        drop(first);
        let kept = copies.iter().filter(|c| c.upgrade().is_some()).count();
        assert_eq!(kept, 3, "three chunks are kept for reader 1, the others let go");
        assert_eq!(below.shared.lock().kept, 3 * CHUNK);
        // Reader 1 still reads every chunk, right: three kept for it, five loaded again.
        let second = below.read(&keys(0..8), CHUNK, WAIT, 2).unwrap();
        for (key, bytes) in keys(0..8).iter().zip(&second) {
            assert!(**bytes == payload(key, CHUNK), "{key:?} read other bytes");
        }
        assert_eq!(below.shared.lock().kept, 0, "the last reader took what was kept");
        assert!(below.shared.lock().chunks.is_empty());
        drop(below);
        router.stop();
    }

    #[test]
    fn a_tier_that_panics_returning_locks_is_no_second_panic_while_unwinding() {
        // Something else panics while a hit is held below; dropping it returns its locks, and
        // the tier panics there too: a second panic while unwinding would abort the daemon.
        let tier = Arc::new(FakeTier::new("l2", 64, CHUNK));
        let router = Arc::new(TierRouter::start(vec![tier.clone()]).unwrap());
        tier.panic_on_unlock();
        let held: HashMap<ObjectKey, usize> = keys(0..2).into_iter().map(|k| (k, 0)).collect();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _below = HeldBelow::keeping(Arc::clone(&router), held, KEPT_FOR_READERS);
            panic!("elsewhere");
        }));
        assert!(outcome.is_err(), "the first panic reached its catcher, the process lives");
        router.stop();
    }
}
