//! The tier adapter contract, CONFORMANCE C1-C8, written once for every implementation.
//!
//! An implementation's test file opens a tier of a given capacity and hands the opener to
//! [`tier_contract_tests!`](crate::tier_contract_tests), which expands to one `#[test]` per
//! scenario, named after its id. Every wait has a deadline: a tier that hangs fails the test
//! instead of hanging it.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;
use tierkv_core::{
    Bitmap, ChunkHash, Completion, KvRank, LoadItem, Namespace, ObjectKey, StoreItem, TaskId,
    TierAdapter, TierError, VecChunk,
};

/// How long any single task may take before the tier counts as hung.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// A tier opened for one test.
pub struct OpenTier {
    /// The tier under test.
    pub tier: Arc<dyn TierAdapter>,
    /// Bytes of every chunk the tests store.
    pub chunk_bytes: u64,
    /// Whatever must outlive the tier, such as its temporary directory.
    pub keep: Box<dyn Any>,
}

/// Opens an empty tier that holds `capacity` chunks.
pub type Opener<'a> = &'a dyn Fn(u64) -> OpenTier;

/// The `i`-th test key.
pub fn key(i: u64) -> ObjectKey {
    ObjectKey::new(
        Namespace::new("contract", ""),
        ChunkHash(u128::from(i) << 64 | 0x5eed),
        KvRank::Shared,
    )
}

/// The keys `range`.
pub fn keys(range: std::ops::Range<u64>) -> Vec<ObjectKey> {
    range.map(key).collect()
}

/// The bytes stored for `key`: different for every key and every offset.
pub fn payload(key: &ObjectKey, len: u64) -> Vec<u8> {
    let seed = (key.chunk.0 >> 64) as u64;
    (0..len)
        .map(|i| (seed.wrapping_mul(0x9e37_79b9).wrapping_add(i.wrapping_mul(31)) >> 3) as u8)
        .collect()
}

/// Submits tasks and waits for their completions, keeping those that arrive for other tasks.
pub struct Harness {
    /// The tier under test.
    pub tier: Arc<dyn TierAdapter>,
    /// Bytes per chunk.
    pub chunk_bytes: u64,
    completions: Receiver<Completion>,
    early: HashMap<TaskId, Completion>,
    _keep: Box<dyn Any>,
}

impl Harness {
    /// Wraps a freshly opened tier.
    pub fn new(open: OpenTier) -> Self {
        let completions = open.tier.completions();
        Harness {
            tier: open.tier,
            chunk_bytes: open.chunk_bytes,
            completions,
            early: HashMap::new(),
            _keep: open.keep,
        }
    }

    /// The completion of `task`; panics if it does not come within [`DEADLINE`].
    pub fn wait(&mut self, task: TaskId) -> Completion {
        if let Some(done) = self.early.remove(&task) {
            return done;
        }
        loop {
            let done = self
                .completions
                .recv_timeout(DEADLINE)
                .unwrap_or_else(|_| panic!("task {task:?} hung"));
            if done.task() == task {
                return done;
            }
            assert!(self.early.insert(done.task(), done).is_none(), "a task completed twice");
        }
    }

    /// Submits a store of `keys` with their payloads.
    pub fn submit_store(&self, keys: &[ObjectKey]) -> TaskId {
        let items = keys
            .iter()
            .map(|k| StoreItem {
                key: *k,
                source: Box::new(VecChunk(payload(k, self.chunk_bytes))),
            })
            .collect();
        self.tier.submit_store(items)
    }

    /// Stores `keys` and waits for the outcome.
    pub fn store(&mut self, keys: &[ObjectKey]) -> Result<(), TierError> {
        let task = self.submit_store(keys);
        match self.wait(task) {
            Completion::Stored { result, sources, .. } => {
                assert_eq!(sources.len(), keys.len(), "a store hands every source back");
                result
            }
            _ => panic!("a store completed as something else"),
        }
    }

    /// Looks up and locks `keys`.
    pub fn lookup(&mut self, keys: &[ObjectKey]) -> Bitmap {
        let task = self.tier.submit_lookup_and_lock(keys.to_vec());
        match self.wait(task) {
            Completion::LookedUp { locked, .. } => {
                assert_eq!(locked.len(), keys.len(), "one bit per key");
                locked
            }
            _ => panic!("a lookup completed as something else"),
        }
    }

    /// Whether each key is present, leaving no lock behind.
    pub fn present(&mut self, keys: &[ObjectKey]) -> Bitmap {
        let found = self.lookup(keys);
        let locked: Vec<_> = found.iter_ones().map(|i| keys[i]).collect();
        self.tier.unlock(&locked);
        found
    }

    /// Submits a load of `keys` into fresh buffers.
    pub fn submit_load(&self, keys: &[ObjectKey]) -> TaskId {
        let items = keys
            .iter()
            .map(|k| LoadItem {
                key: *k,
                sink: Box::new(VecChunk(vec![0; self.chunk_bytes as usize])),
            })
            .collect();
        self.tier.submit_load(items)
    }

    /// Loads `keys`; returns which loaded and the bytes of each buffer.
    pub fn load(&mut self, keys: &[ObjectKey]) -> (Bitmap, Vec<Vec<u8>>) {
        let task = self.submit_load(keys);
        match self.wait(task) {
            Completion::Loaded { loaded, sinks, .. } => {
                assert_eq!(
                    (loaded.len(), sinks.len()),
                    (keys.len(), keys.len()),
                    "one bit and one sink per key"
                );
                let mut bytes = Vec::with_capacity(keys.len());
                for (mut item, k) in sinks.into_iter().zip(keys) {
                    assert_eq!(item.key, *k, "sinks come back in request order");
                    let host =
                        item.sink.host_bytes_mut().expect("the harness loads into host buffers");
                    bytes.push(host.to_vec());
                }
                (loaded, bytes)
            }
            _ => panic!("a load completed as something else"),
        }
    }

    /// Loads `keys` and asserts each arrived with exactly its payload.
    pub fn assert_loads(&mut self, keys: &[ObjectKey]) {
        let (loaded, bytes) = self.load(keys);
        assert_eq!(loaded.count_ones(), keys.len(), "not every key loaded: {loaded:?}");
        for (k, b) in keys.iter().zip(bytes) {
            assert!(b == payload(k, self.chunk_bytes), "{k:?} loaded other bytes than were stored");
        }
    }

    /// Locks outstanding in the tier.
    pub fn locks(&self) -> u64 {
        self.tier.usage().locks
    }
}

fn open(opener: Opener<'_>, capacity: u64) -> Harness {
    Harness::new(opener(capacity))
}

/// C1: a store completes with success, once.
pub fn c1_store_completes_once_and_only_once(opener: Opener<'_>) {
    let mut h = open(opener, 8);
    h.store(&[key(0)]).unwrap();
    assert!(
        h.completions.recv_timeout(Duration::from_millis(200)).is_err(),
        "a second completion arrived"
    );
    assert_eq!(h.tier.usage().objects, 1);
}

/// C2: lookups answer per key.
pub fn c2_lookup_answers_per_key(opener: Opener<'_>) {
    let mut h = open(opener, 8);
    assert_eq!(h.lookup(&keys(0..3)), Bitmap::new(3), "unknown keys are misses");
    h.store(&[key(0), key(2)]).unwrap();
    let found = h.lookup(&keys(0..4));
    assert_eq!(found, Bitmap::from_bools([true, false, true, false]));
    assert_eq!(h.locks(), 2, "one lock per present key");
    h.tier.unlock(&[key(0), key(2)]);
    assert_eq!(h.locks(), 0);
}

/// C3: a lock protects a key from this tier's eviction until it is unlocked; unlocking a key that
/// was never locked changes nothing.
pub fn c3_lock_protects_from_eviction_until_unlock(opener: Opener<'_>) {
    let mut h = open(opener, 4);
    h.store(&[key(0)]).unwrap();
    assert!(h.lookup(&[key(0)]).get(0));
    h.tier.unlock(&[key(100), key(101)]);
    assert_eq!(h.locks(), 1, "unlocking never-locked keys is harmless");
    for i in 1..=12 {
        h.store(&[key(i)]).unwrap();
    }
    assert!(h.present(&[key(0)]).get(0), "a locked key was evicted");
    h.assert_loads(&[key(0)]);
    h.tier.unlock(&[key(0)]);
    assert_eq!(h.locks(), 0);
    for i in 13..=40 {
        h.store(&[key(i)]).unwrap();
    }
    assert!(!h.present(&[key(0)]).get(0), "an unlocked key survived a full turnover of the tier");
}

/// C4: loads copy the exact bytes; absent keys are reported and the others still load.
pub fn c4_load_copies_exact_bytes_and_reports_absent_keys(opener: Opener<'_>) {
    let mut h = open(opener, 8);
    h.store(&[key(0), key(2)]).unwrap();
    let (loaded, bytes) = h.load(&keys(0..3));
    assert_eq!(loaded, Bitmap::from_bools([true, false, true]));
    assert!(bytes[0] == payload(&key(0), h.chunk_bytes));
    assert!(bytes[2] == payload(&key(2), h.chunk_bytes));
}

/// C5: one task of five keys stores them all; task ids are unique.
pub fn c5_five_keys_in_one_task_and_unique_task_ids(opener: Opener<'_>) {
    let mut h = open(opener, 8);
    let a = h.submit_store(&keys(0..5));
    let b = h.submit_store(&keys(5..6));
    let c = h.tier.submit_lookup_and_lock(keys(0..1));
    assert!(a != b && b != c && a != c, "task ids repeat: {a:?} {b:?} {c:?}");
    for task in [a, b, c] {
        h.wait(task);
    }
    h.tier.unlock(&keys(0..1));
    h.assert_loads(&keys(0..6));
}

/// C6: store, lookup, load, verify and unlock, for 1 and for 100 keys.
pub fn c6_round_trip_of_1_and_100_keys(opener: Opener<'_>) {
    let mut h = open(opener, 128);
    for n in [1, 100] {
        let batch = keys(1000 * n..1000 * n + n);
        h.store(&batch).unwrap();
        assert_eq!(h.lookup(&batch).count_ones() as u64, n);
        h.assert_loads(&batch);
        h.tier.unlock(&batch);
        assert_eq!(h.locks(), 0);
    }
}

/// C7: in a full tier eviction skips locked keys, and when nothing can be evicted a store fails
/// cleanly: the locked keys still load, and the tier works again once they are unlocked.
pub fn c7_full_tier_skips_locked_keys_and_fails_cleanly(opener: Opener<'_>) {
    let mut h = open(opener, 4);
    for i in 0..4 {
        h.store(&[key(i)]).unwrap();
    }
    let resident: Vec<_> = {
        let found = h.present(&keys(0..4));
        found.iter_ones().map(|i| key(i as u64)).collect()
    };
    assert!(!resident.is_empty());
    assert_eq!(h.lookup(&resident).count_ones(), resident.len());
    let mut refused = false;
    for i in 4..12 {
        if h.store(&[key(i)]).is_err() {
            refused = true;
            break;
        }
    }
    assert!(refused, "a tier full of locked keys kept accepting stores");
    h.assert_loads(&resident);
    h.tier.unlock(&resident);
    assert_eq!(h.locks(), 0);
    h.store(&[key(20)]).unwrap();
    h.assert_loads(&[key(20)]);
}

/// C8: closing with tasks in flight neither hangs nor panics; every task completes, those that
/// did not run as failures, and tasks submitted after closing fail at once.
pub fn c8_close_with_tasks_in_flight(opener: Opener<'_>) {
    let mut h = open(opener, 64);
    h.store(&keys(0..4)).unwrap();
    let mut tasks = Vec::new();
    for i in 0..16 {
        tasks.push(h.submit_store(&keys(100 + 4 * i..104 + 4 * i)));
        tasks.push(h.submit_load(&keys(0..4)));
        tasks.push(h.tier.submit_lookup_and_lock(keys(0..2)));
    }
    h.tier.close();
    let chunk_bytes = h.chunk_bytes;
    for task in tasks {
        match h.wait(task) {
            Completion::LookedUp { locked, .. } => {
                let held: Vec<_> = locked.iter_ones().map(|i| key(i as u64)).collect();
                h.tier.unlock(&held);
            }
            // A load that ran before the close may have loaded; what it says it loaded is the
            // stored bytes, whatever the close cut short.
            Completion::Loaded { loaded, mut sinks, .. } => {
                for i in loaded.iter_ones() {
                    let item = &mut sinks[i];
                    let bytes = item.sink.host_bytes_mut().expect("host buffers").to_vec();
                    assert!(bytes == payload(&item.key, chunk_bytes), "a load across close");
                }
            }
            // Stored, or failed as a whole: either is a completion, which is what C8 asks.
            Completion::Stored { .. } => {}
        }
    }
    assert!(
        matches!(h.store(&[key(999)]), Err(TierError::Closed)),
        "a store after close must fail as closed"
    );
    let (loaded, _) = h.load(&keys(0..4));
    assert_eq!(loaded.count_ones(), 0, "a load after close must fail");
    assert_eq!(h.lookup(&keys(0..4)).count_ones(), 0, "a lookup after close locks nothing");
}

/// Clearing a tier deletes every object no lookup holds locked, and nothing else.
pub fn clear_deletes_every_unlocked_object(opener: Opener<'_>) {
    let mut h = open(opener, 8);
    h.store(&keys(0..4)).unwrap();
    assert_eq!(h.lookup(&[key(1)]).count_ones(), 1);
    assert_eq!(h.tier.clear(), 3);
    assert_eq!(h.present(&keys(0..4)), Bitmap::from_bools([false, true, false, false]));
    h.assert_loads(&[key(1)]);
    h.tier.unlock(&[key(1)]);
    assert_eq!(h.tier.clear(), 1);
    assert_eq!(h.tier.usage().objects, 0);
}

/// Expands to one `#[test]` per contract scenario, each opening tiers with `$open`, an
/// expression of type `impl Fn(u64) -> OpenTier` (capacity in chunks).
#[macro_export]
macro_rules! tier_contract_tests {
    ($open:expr) => {
        $crate::tier_contract_tests!(@each $open;
            c1_store_completes_once_and_only_once,
            c2_lookup_answers_per_key,
            c3_lock_protects_from_eviction_until_unlock,
            c4_load_copies_exact_bytes_and_reports_absent_keys,
            c5_five_keys_in_one_task_and_unique_task_ids,
            c6_round_trip_of_1_and_100_keys,
            c7_full_tier_skips_locked_keys_and_fails_cleanly,
            c8_close_with_tasks_in_flight,
            clear_deletes_every_unlocked_object,
        );
    };
    (@each $open:expr; $($name:ident,)*) => {
        $(
            #[test]
            fn $name() {
                $crate::contract::$name(&$open);
            }
        )*
    };
}

/// A tier shared by several test threads: one router thread owns the completion channel (it has
/// one consumer by contract) and hands each completion to the thread that submitted its task.
pub struct SharedTier {
    /// The tier under test.
    pub tier: Arc<dyn TierAdapter>,
    /// Bytes per chunk.
    pub chunk_bytes: u64,
    waiting: Arc<parking_lot::Mutex<HashMap<TaskId, crossbeam_channel::Sender<Completion>>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    router: Option<std::thread::JoinHandle<()>>,
}

impl SharedTier {
    /// Starts routing the completions of `tier`.
    pub fn new(tier: Arc<dyn TierAdapter>, chunk_bytes: u64) -> Self {
        let waiting: Arc<
            parking_lot::Mutex<HashMap<TaskId, crossbeam_channel::Sender<Completion>>>,
        > = Arc::default();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let completions = tier.completions();
        let router = {
            let (waiting, stop) = (Arc::clone(&waiting), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Acquire) {
                    if let Ok(done) = completions.recv_timeout(Duration::from_millis(20)) {
                        // The submitter registered its task under this lock before the
                        // completion could be routed, so the sender is always there.
                        if let Some(reply) = waiting.lock().remove(&done.task()) {
                            let _ = reply.send(done);
                        }
                    }
                }
            })
        };
        SharedTier { tier, chunk_bytes, waiting, stop, router: Some(router) }
    }

    /// Submits with `submit` and waits for that task's completion.
    pub fn call(&self, submit: impl FnOnce(&dyn TierAdapter) -> TaskId) -> Completion {
        let (reply, done) = crossbeam_channel::bounded(1);
        {
            let mut waiting = self.waiting.lock();
            let task = submit(self.tier.as_ref());
            waiting.insert(task, reply);
        }
        done.recv_timeout(DEADLINE).unwrap_or_else(|_| panic!("a task hung"))
    }

    /// Stores `keys` with their payloads.
    pub fn store(&self, keys: &[ObjectKey]) -> Result<(), TierError> {
        let items: Vec<StoreItem> = keys
            .iter()
            .map(|k| StoreItem {
                key: *k,
                source: Box::new(VecChunk(payload(k, self.chunk_bytes))),
            })
            .collect();
        match self.call(|tier| tier.submit_store(items)) {
            Completion::Stored { result, .. } => result,
            _ => panic!("a store completed as something else"),
        }
    }

    /// Looks up and locks `keys`.
    pub fn lookup(&self, keys: &[ObjectKey]) -> Bitmap {
        match self.call(|tier| tier.submit_lookup_and_lock(keys.to_vec())) {
            Completion::LookedUp { locked, .. } => locked,
            _ => panic!("a lookup completed as something else"),
        }
    }

    /// Loads `keys` and asserts every key that loaded holds exactly its payload; returns which
    /// loaded.
    pub fn load_verified(&self, keys: &[ObjectKey]) -> Bitmap {
        let items: Vec<LoadItem> = keys
            .iter()
            .map(|k| LoadItem {
                key: *k,
                sink: Box::new(VecChunk(vec![0; self.chunk_bytes as usize])),
            })
            .collect();
        match self.call(|tier| tier.submit_load(items)) {
            Completion::Loaded { loaded, mut sinks, .. } => {
                for i in loaded.iter_ones() {
                    let bytes = sinks[i]
                        .sink
                        .host_bytes_mut()
                        .expect("the harness loads into host buffers");
                    assert!(
                        *bytes == payload(&keys[i], self.chunk_bytes),
                        "{:?} loaded another object's bytes",
                        keys[i]
                    );
                }
                loaded
            }
            _ => panic!("a load completed as something else"),
        }
    }
}

impl Drop for SharedTier {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(router) = self.router.take() {
            let _ = router.join();
        }
    }
}
