//! Deletes, clears and restarts as a property: random sequences of stores (some failing: a source
//! that cannot be read, a panic on the write thread), lookups, loads, deletes, clears, stores held
//! in the queue behind a lookup that evicts ahead of them, deletes and clears racing stores, and
//! restarts, run against a real store of a few small segments (so that eviction, segment reuse
//! and stale records, `Segment::stale`, happen all the time) and against a model of what each key
//! may hold.
//!
//! The model keeps, for each key, the generations of its payload that the store may serve: a
//! payload is made of its key and a generation, fresh for every item stored, so a record of an
//! earlier store of the key is told from the last. A store that succeeds adds its generation (the
//! store may have skipped the key as present, so the earlier ones stay); a store that fails adds
//! nothing; a delete or a clear empties the key's set; eviction changes nothing (the sets say what
//! may be there, not what must). A store and a delete or clear in flight together are applied
//! delete first: every order they may really take ends in a subset of that.
//!
//! A kill is a copy of the segment files taken while stores may be in flight, reopened: the keys
//! of those stores may or may not be there (their generations are allowed in the copy, whatever
//! their stores' outcome), and nothing else the model disallows may come back.
//!
//! Checked along the way: every byte loaded is a generation the model allows for its key (a
//! deleted or cleared key, or a failed store, is never served, before or after a restart or a
//! kill); a key a lookup found and locked loads; a delete or a clear counts no more keys than could
//! be there; after a clean close and reopen every key found is one the model allows, with allowed
//! bytes, and every key found just before the close is found again (a mark that landed on a live
//! record would lose it); and once closed the store holds no lock, pin, unpublished record or mark
//! in progress, and the close returned.

use std::collections::BTreeSet;

use proptest::prelude::*;
use tierkv_core::VecChunk;
use tierkv_testkit::contract::{Harness, OpenTier, key};

use super::*;

/// Keys `0..KEYS`: few, so that stores, deletes and evictions keep meeting the same keys.
const KEYS: u8 = 16;

/// Payload bytes of every chunk.
const CHUNK: u64 = 4096;

/// The payload of generation `generation` of key `k`: its first bytes name both, the rest depend
/// on both.
fn payload(k: u8, generation: u32) -> Vec<u8> {
    let seed = (u64::from(k) << 32 | u64::from(generation)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut bytes: Vec<u8> = (0..CHUNK)
        .map(|i| (seed.rotate_left((i % 64) as u32) ^ i.wrapping_mul(31)) as u8)
        .collect();
    bytes[0] = k;
    bytes[1..5].copy_from_slice(&generation.to_le_bytes());
    bytes
}

/// The key and generation a payload was made of; `None` for bytes no payload has.
fn made_of(bytes: &[u8]) -> Option<(u8, u32)> {
    let k = *bytes.first()?;
    let generation = u32::from_le_bytes(bytes.get(1..5)?.try_into().ok()?);
    (payload(k, generation) == bytes).then_some((k, generation))
}

/// A store task: its keys (distinct), and which item's source refuses its copy, if any.
#[derive(Clone, Debug)]
struct Batch {
    keys: Vec<u8>,
    refused: Option<usize>,
}

/// What runs after the lookup of a [`Op::Stores`], while its stores are queued or in flight.
#[derive(Clone, Debug)]
enum Then {
    Nothing,
    Delete(Vec<u8>),
    Clear,
}

/// A panic injected on the write thread, armed for one shot during a [`Op::Stores`].
#[derive(Clone, Copy, Debug)]
enum WritePanic {
    /// While a finished write is collected: the record is on disk, its task fails.
    Collecting,
    /// Once a record has gone to a writer thread: it is written, its task fails.
    HandedOver,
}

impl WritePanic {
    fn armed(self, faults: &WriteFaults) -> &AtomicBool {
        match self {
            WritePanic::Collecting => &faults.collecting,
            WritePanic::HandedOver => &faults.handed_over,
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Submits the stores; with `held`, keeps them queued (as behind a store being prepared)
    /// while the lookup (which evicts ahead of them) and `then` run, else lets them run meanwhile.
    Stores {
        stores: Vec<Batch>,
        held: bool,
        lookup: Option<Vec<u8>>,
        then: Then,
        panic: Option<WritePanic>,
    },
    /// Looks up and locks the keys, loads those found, unlocks them.
    Lookup(Vec<u8>),
    /// Loads the keys, found or not.
    Load(Vec<u8>),
    Delete(Vec<u8>),
    Clear,
    /// Closes the store and opens it again on its directory.
    Restart,
    /// Submits the stores and, while they may be in flight, copies the segment files (what a
    /// kill leaves on disk); then goes on with a store opened on the copy.
    Kill(Vec<Batch>),
}

fn some_keys() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0..KEYS, 1..=6)
}

fn batch() -> impl Strategy<Value = Batch> {
    (prop::collection::vec(0..KEYS, 1..=3), prop::option::weighted(0.25, 0usize..3)).prop_map(
        |(mut keys, refused)| {
            let mut seen = BTreeSet::new();
            keys.retain(|k| seen.insert(*k));
            let refused = refused.map(|i| i % keys.len());
            Batch { keys, refused }
        },
    )
}

fn op() -> impl Strategy<Value = Op> {
    let then = prop_oneof![
        2 => Just(Then::Nothing),
        4 => some_keys().prop_map(Then::Delete),
        1 => Just(Then::Clear),
    ];
    let panic = prop_oneof![
        8 => Just(None),
        1 => Just(Some(WritePanic::Collecting)),
        1 => Just(Some(WritePanic::HandedOver)),
    ];
    let stores = (
        prop::collection::vec(batch(), 1..=3),
        prop::bool::weighted(0.6),
        prop::option::weighted(0.8, some_keys()),
        then,
        panic,
    )
        .prop_map(|(stores, held, lookup, then, panic)| Op::Stores {
            stores,
            held,
            lookup,
            then,
            panic,
        });
    prop_oneof![
        8 => stores,
        3 => some_keys().prop_map(Op::Lookup),
        2 => some_keys().prop_map(Op::Load),
        3 => some_keys().prop_map(Op::Delete),
        1 => Just(Op::Clear),
        2 => Just(Op::Restart),
        1 => prop::collection::vec(batch(), 0..=2).prop_map(Op::Kill),
    ]
}

/// A store configuration: `segments` segments of `per_segment` records of `CHUNK` bytes.
fn config(dir: &Path, segments: u64, per_segment: u64, policy: PolicyKind) -> DiskStoreConfig {
    let segment_bytes = BLOCK + per_segment * record_bytes(CHUNK);
    DiskStoreConfig {
        segment_bytes,
        io_threads: 2,
        policy,
        ..DiskStoreConfig::new(dir, segments * segment_bytes, CHUNK)
    }
}

/// What the store may hold: for each key, the generations it may serve.
struct Model {
    allowed: Vec<BTreeSet<u32>>,
    generations: u32,
}

impl Model {
    fn new() -> Self {
        Model { allowed: vec![BTreeSet::new(); KEYS as usize], generations: 0 }
    }

    fn next_generation(&mut self) -> u32 {
        self.generations += 1;
        self.generations
    }

    fn holds(&self, k: u8) -> bool {
        !self.allowed[k as usize].is_empty()
    }

    /// Checks bytes loaded for key `k`.
    fn check_loaded(&self, k: u8, bytes: &[u8], what: &str) {
        let allowed = &self.allowed[k as usize];
        match made_of(bytes) {
            Some((of, generation)) => assert!(
                of == k && allowed.contains(&generation),
                "{what}: key {k} served generation {generation} of key {of}; allowed {allowed:?}"
            ),
            None => panic!("{what}: key {k} served bytes no store wrote; allowed {allowed:?}"),
        }
    }

    /// A store task ended: each item's generation counts if it succeeded.
    fn stored(&mut self, items: &[(u8, u32)], succeeded: bool) {
        if succeeded {
            for &(k, generation) in items {
                self.allowed[k as usize].insert(generation);
            }
        }
    }

    fn deleted(&mut self, keys: &[u8]) {
        for &k in keys {
            self.allowed[k as usize].clear();
        }
    }

    /// The most keys of `keys` a delete can count: those that may be there (`also` may be on
    /// their way).
    fn deletable(&self, keys: &[u8], also: &BTreeSet<u8>) -> usize {
        let distinct: BTreeSet<u8> = keys.iter().copied().collect();
        distinct.into_iter().filter(|k| self.holds(*k) || also.contains(k)).count()
    }
}

fn object_keys(keys: &[u8]) -> Vec<ObjectKey> {
    keys.iter().map(|k| key(u64::from(*k))).collect()
}

/// A store on a directory that outlives it, and the model of what it holds.
struct Rig {
    config: DiskStoreConfig,
    store: Option<(Arc<DiskStore>, Harness)>,
    model: Model,
    /// The directories of the copies a kill left, the store's now the last.
    copies: Vec<tempfile::TempDir>,
}

impl Rig {
    fn open(config: DiskStoreConfig) -> Self {
        let mut rig = Rig { config, store: None, model: Model::new(), copies: Vec::new() };
        rig.reopen();
        rig
    }

    fn reopen(&mut self) {
        let store = Arc::new(DiskStore::open(self.config.clone()).unwrap());
        let tier = OpenTier { tier: store.clone(), chunk_bytes: CHUNK, keep: Box::new(()) };
        self.store = Some((store, Harness::new(tier)));
    }

    fn store(&self) -> &Arc<DiskStore> {
        &self.store.as_ref().unwrap().0
    }

    fn h(&mut self) -> &mut Harness {
        &mut self.store.as_mut().unwrap().1
    }

    fn run(&mut self, op: &Op) {
        match op {
            Op::Stores { stores, held, lookup, then, panic } => {
                self.stores(stores, *held, lookup.as_deref(), then, *panic);
            }
            Op::Lookup(keys) => {
                self.check_found(keys, "a lookup");
            }
            Op::Load(keys) => {
                let (loaded, bytes) = self.h().load(&object_keys(keys));
                for i in loaded.iter_ones() {
                    self.model.check_loaded(keys[i], &bytes[i], "a load");
                }
            }
            Op::Delete(keys) => self.delete(keys, &BTreeSet::new()),
            Op::Clear => self.clear(&BTreeSet::new()),
            Op::Restart => {
                let all: Vec<u8> = (0..KEYS).collect();
                let before = self.check_found(&all, "before a restart");
                self.close();
                self.reopen();
                let after = self.check_found(&all, "after a restart");
                let lost: Vec<u8> = before.into_iter().filter(|k| !after.contains(k)).collect();
                assert!(lost.is_empty(), "keys {lost:?} found before a clean restart, not after");
            }
            Op::Kill(stores) => self.kill(stores),
        }
    }

    /// Submits `stores`, copies the segment files while they may be in flight, and goes on with
    /// a store opened on the copy, the keys of those stores allowed whatever their outcome.
    fn kill(&mut self, stores: &[Batch]) {
        let store = Arc::clone(self.store());
        let mut submitted = Vec::new();
        for batch in stores {
            let (items, made) = self.items(batch);
            submitted.push(store.submit_store(items));
            for (k, generation) in made {
                self.model.allowed[k as usize].insert(generation);
            }
        }
        let copy = tempfile::tempdir().unwrap();
        copy_segment_files(&self.config.dir, copy.path());
        for task in submitted {
            match self.h().wait(task) {
                Completion::Stored { .. } => {}
                _ => panic!("a store completed as something else"),
            }
        }
        self.close();
        self.config.dir = copy.path().to_owned();
        self.copies.push(copy);
        self.reopen();
        // A record the copy caught half written (its header, not its payload) is found by the
        // scan and fails its load's check: a miss, as after a real crash.
        self.check_found_torn(&(0..KEYS).collect::<Vec<_>>(), "after a kill", true);
    }

    /// The items of `batch`, each of a fresh generation, and each key with its generation.
    fn items(&mut self, batch: &Batch) -> (Vec<StoreItem>, Vec<(u8, u32)>) {
        let mut items = Vec::new();
        let mut made = Vec::new();
        for (i, &k) in batch.keys.iter().enumerate() {
            let generation = self.model.next_generation();
            let source: Box<dyn tierkv_core::ChunkSource> = if batch.refused == Some(i) {
                Box::new(Unreadable)
            } else {
                Box::new(VecChunk(payload(k, generation)))
            };
            items.push(StoreItem { key: key(u64::from(k)), source });
            made.push((k, generation));
        }
        (items, made)
    }

    /// Looks up and locks `keys`, checks each found is one the model allows and loads with
    /// allowed bytes, and unlocks them; returns those found.
    fn check_found(&mut self, keys: &[u8], what: &str) -> Vec<u8> {
        self.check_found_torn(keys, what, false)
    }

    /// [`Rig::check_found`]; with `torn`, a key found need not load (a record a kill left half
    /// written), but what loads must be allowed.
    fn check_found_torn(&mut self, keys: &[u8], what: &str, torn: bool) -> Vec<u8> {
        let found = self.h().lookup(&object_keys(keys));
        let found: Vec<u8> = found.iter_ones().map(|i| keys[i]).collect();
        for &k in &found {
            let allowed = &self.model.allowed[k as usize];
            assert!(self.model.holds(k), "{what}: key {k} found; allowed {allowed:?}");
        }
        let locked = object_keys(&found);
        let (loaded, bytes) = self.h().load(&locked);
        if !torn {
            assert_eq!(
                loaded.count_ones(),
                found.len(),
                "{what}: keys {found:?} found, not loaded"
            );
        }
        for (i, (k, bytes)) in found.iter().zip(&bytes).enumerate() {
            if loaded.get(i) {
                self.model.check_loaded(*k, bytes, what);
            }
        }
        self.h().tier.unlock(&locked);
        found
    }

    /// Deletes `keys`; `coming` are keys of stores in flight.
    fn delete(&mut self, keys: &[u8], coming: &BTreeSet<u8>) {
        let most = self.model.deletable(keys, coming);
        let deleted = within("a delete", || self.store().delete(&object_keys(keys)));
        assert!(deleted <= most, "deleted {deleted} of {keys:?}; at most {most} were there");
        self.model.deleted(keys);
    }

    fn clear(&mut self, coming: &BTreeSet<u8>) {
        let all: Vec<u8> = (0..KEYS).collect();
        let most = self.model.deletable(&all, coming);
        let cleared = within("a clear", || self.store().clear());
        assert!(cleared <= most, "cleared {cleared}; at most {most} were there");
        self.model.deleted(&all);
    }

    fn stores(
        &mut self,
        stores: &[Batch],
        held: bool,
        lookup: Option<&[u8]>,
        then: &Then,
        panic: Option<WritePanic>,
    ) {
        let store = Arc::clone(self.store());
        if let Some(panic) = panic {
            panic.armed(&store.shared.faults).store(true, Ordering::SeqCst);
        }
        if held {
            hold_stores(&store);
        }
        let mut submitted = Vec::new();
        let mut coming = BTreeSet::new();
        for batch in stores {
            let (items, made) = self.items(batch);
            coming.extend(batch.keys.iter().copied());
            submitted.push((store.submit_store(items), made));
        }
        if let Some(keys) = lookup {
            // Held stores are not found; stores let run may be.
            let found = self.h().present(&object_keys(keys));
            for k in found.iter_ones().map(|i| keys[i]) {
                let allowed = &self.model.allowed[k as usize];
                assert!(
                    self.model.holds(k) || (!held && coming.contains(&k)),
                    "a lookup ahead of stores: key {k} found; allowed {allowed:?}"
                );
            }
        }
        match then {
            Then::Nothing => {}
            Then::Delete(keys) => self.delete(keys, &coming),
            Then::Clear => self.clear(&coming),
        }
        if held {
            store.shared.queue.stored(0);
        }
        for (task, made) in submitted {
            match self.h().wait(task) {
                Completion::Stored { result, sources, .. } => {
                    assert_eq!(sources.len(), made.len(), "a store hands every source back");
                    self.model.stored(&made, result.is_ok());
                }
                _ => panic!("a store completed as something else"),
            }
        }
        if let Some(panic) = panic {
            // Unfired when no record was written (every key present, or refused first).
            panic.armed(&store.shared.faults).store(false, Ordering::SeqCst);
        }
        // A store that failed is a miss; one that succeeded serves its bytes (or earlier ones).
        let keys: Vec<u8> = coming.into_iter().collect();
        self.check_found(&keys, "after stores");
    }

    /// Closes the store (within a deadline: a close that hangs fails the case) and checks that
    /// nothing is left held.
    fn close(&mut self) {
        let (store, h) = self.store.take().unwrap();
        assert_eq!(h.locks(), 0, "locks left before closing");
        drop(h);
        let closing = std::thread::spawn({
            let store = Arc::clone(&store);
            move || store.close()
        });
        let deadline = Instant::now() + DEADLINE;
        while !closing.is_finished() {
            assert!(Instant::now() < deadline, "closing the store hangs");
            std::thread::sleep(Duration::from_millis(1));
        }
        closing.join().unwrap();
        let index = store.shared.index.lock();
        assert_eq!((index.lock_total, index.locks.len()), (0, 0), "locks left after closing");
        for (id, s) in index.segments.iter().enumerate() {
            let left = (s.locked, s.pins, s.unpublished, s.marking);
            assert_eq!(left, (0, 0, 0, 0), "segment {id}: (locked, pins, unpublished, marking)");
        }
    }
}

/// Runs `f`, which must not hang: a delete or a clear waits for a write on its way (a few
/// milliseconds), never for one that is over, which it would wait for as long as a store waits for
/// a hung write (`BUFFER_WAIT`: 10 s outside tests, 120 s in the tests' build, so such a case takes
/// that long to fail here, and each shrinking step of it as long: `max_shrink_time` bounds them).
fn within<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let out = f();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "{what} hung for {took:?}");
    out
}

/// Keeps the stores submitted from now on queued, as behind a store being prepared, until
/// `Queue::stored`. Waits for the turn of a store that ended to be over first (a store's
/// completion can come before its turn ends), or its end would let them go.
fn hold_stores(store: &DiskStore) {
    loop {
        let mut queue = store.shared.queue.state.lock();
        if !queue.storing {
            queue.storing = true;
            return;
        }
        drop(queue);
        std::thread::yield_now();
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 192,
        max_shrink_iters: 400,
        // A case that hangs takes `BUFFER_WAIT` (120 s) a run: shrinking stops after 5 minutes.
        max_shrink_time: 300_000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn deletes_clears_and_failed_stores_stay_gone_across_restarts(
        segments in 4u64..=6,
        per_segment in 1u64..=3,
        policy in prop::sample::select(PolicyKind::ALL.to_vec()),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut rig = Rig::open(config(dir.path(), segments, per_segment, policy));
        for op in &ops {
            rig.run(op);
        }
        rig.run(&Op::Restart);
        rig.close();
    }
}
