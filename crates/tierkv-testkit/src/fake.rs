//! An in-memory tier with fault injection.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_channel::{Receiver, Sender, unbounded};
use parking_lot::Mutex;
use tierkv_core::policy::{EvictionPolicy, Lru};
use tierkv_core::{
    Bitmap, Completion, LoadItem, ObjectKey, StoreItem, TaskId, TierAdapter, TierError, TierUsage,
};

enum Task {
    Store(TaskId, Vec<StoreItem>),
    Lookup(TaskId, Vec<ObjectKey>),
    Load(TaskId, Vec<LoadItem>),
}

struct State {
    objects: HashMap<ObjectKey, Vec<u8>>,
    locks: HashMap<ObjectKey, u64>,
    order: Lru<ObjectKey>,
    failing_loads: HashSet<ObjectKey>,
    holding: bool,
    holding_loads: bool,
    held: Vec<Task>,
    closed: bool,
    /// Deletes panic (a bug in the tier), as the pipeline's callers must survive.
    panicking_deletes: bool,
    /// Lookups panic as they are submitted (a bug in the tier).
    panicking_lookups: bool,
    panicking_loads: bool,
    losing_sinks: bool,
    /// Unlocks panic (a bug in the tier).
    panicking_unlocks: bool,
    /// Store tasks given up on while held (they completed as `Abandoned`).
    abandoned: Vec<TaskId>,
    /// The keys of every lookup-and-lock task submitted, in order.
    looked_up: Vec<Vec<ObjectKey>>,
}

/// An in-memory tier of a fixed number of objects, evicting least recently used unlocked ones.
///
/// Tasks run at once on the submitting thread unless [`FakeTier::hold`] is on, in which case
/// they wait, in flight, until [`FakeTier::release_held`] or [`TierAdapter::close`].
pub struct FakeTier {
    name: String,
    capacity: usize,
    chunk_bytes: u64,
    state: Mutex<State>,
    next_task: AtomicU64,
    sender: Sender<Completion>,
    receiver: Receiver<Completion>,
}

impl FakeTier {
    /// A tier holding at most `capacity` objects of `chunk_bytes` bytes.
    pub fn new(name: &str, capacity: usize, chunk_bytes: u64) -> Self {
        let (sender, receiver) = unbounded();
        FakeTier {
            name: name.to_string(),
            capacity,
            chunk_bytes,
            state: Mutex::new(State {
                objects: HashMap::new(),
                locks: HashMap::new(),
                order: Lru::new(),
                failing_loads: HashSet::new(),
                holding: false,
                holding_loads: false,
                held: Vec::new(),
                closed: false,
                panicking_deletes: false,
                panicking_lookups: false,
                panicking_loads: false,
                losing_sinks: false,
                panicking_unlocks: false,
                abandoned: Vec::new(),
                looked_up: Vec::new(),
            }),
            next_task: AtomicU64::new(1),
            sender,
            receiver,
        }
    }

    /// Stores `bytes` under `key` directly, outside any task (test setup).
    pub fn insert(&self, key: ObjectKey, bytes: Vec<u8>) {
        let mut state = self.state.lock();
        state.order.insert(key);
        state.objects.insert(key, bytes);
    }

    /// From now on, loads of these keys fail (the key reads as not loaded).
    pub fn fail_loads_of(&self, keys: &[ObjectKey]) {
        self.state.lock().failing_loads.extend(keys.iter().copied());
    }

    /// From now on, every delete panics (as a buggy tier's might).
    pub fn panic_on_delete(&self) {
        self.state.lock().panicking_deletes = true;
    }

    /// From now on, every unlock of some key panics (as a buggy tier's might).
    pub fn panic_on_unlock(&self) {
        self.state.lock().panicking_unlocks = true;
    }

    /// From now on, every lookup panics as it is submitted (as a buggy tier's might).
    pub fn panic_on_lookup(&self) {
        self.state.lock().panicking_lookups = true;
    }

    /// From now on, every load panics as it is submitted (as a buggy tier's might).
    pub fn panic_on_load(&self) {
        self.state.lock().panicking_loads = true;
    }

    /// From now on, every load half-writes its first chunk, then loses that sink (drops it) and
    /// answers for the others alone (as a buggy tier's worker might).
    pub fn lose_a_sink_of_loads(&self) {
        self.state.lock().losing_sinks = true;
    }

    /// From now on, tasks wait in flight instead of running.
    pub fn hold(&self) {
        self.state.lock().holding = true;
    }

    /// From now on, load tasks (only) wait in flight; lookups and stores still run.
    pub fn hold_loads(&self) {
        self.state.lock().holding_loads = true;
    }

    /// Runs every held task and stops holding.
    pub fn release_held(&self) {
        let held = {
            let mut state = self.state.lock();
            state.holding = false;
            state.holding_loads = false;
            std::mem::take(&mut state.held)
        };
        for task in held {
            self.run(task);
        }
    }

    /// Runs the tasks held so far; later ones are still held, as before.
    pub fn run_held(&self) {
        let held = std::mem::take(&mut self.state.lock().held);
        for task in held {
            self.run(task);
        }
    }

    /// Tasks submitted and not yet run.
    pub fn held_tasks(&self) -> usize {
        self.state.lock().held.len()
    }

    /// The held store tasks given up on ([`TierAdapter::abandon`]), in order.
    pub fn abandoned(&self) -> Vec<TaskId> {
        self.state.lock().abandoned.clone()
    }

    /// The keys of every lookup-and-lock task submitted so far, in order.
    pub fn looked_up(&self) -> Vec<Vec<ObjectKey>> {
        self.state.lock().looked_up.clone()
    }

    /// Whether the tier holds `key`.
    pub fn contains(&self, key: &ObjectKey) -> bool {
        self.state.lock().objects.contains_key(key)
    }

    fn task_id(&self) -> TaskId {
        TaskId(self.next_task.fetch_add(1, Ordering::Relaxed))
    }

    fn submit(&self, task: Task) {
        let mut state = self.state.lock();
        if state.closed {
            drop(state);
            self.fail(task, TierError::Closed);
        } else if state.holding || (state.holding_loads && matches!(task, Task::Load(..))) {
            state.held.push(task);
        } else {
            drop(state);
            self.run(task);
        }
    }

    fn fail(&self, task: Task, error: TierError) {
        let completion = match task {
            Task::Store(task, sources) => Completion::Stored { task, result: Err(error), sources },
            Task::Lookup(task, keys) => {
                Completion::LookedUp { task, locked: Bitmap::new(keys.len()) }
            }
            Task::Load(task, sinks) => {
                Completion::Loaded { task, loaded: Bitmap::new(sinks.len()), sinks }
            }
        };
        let _ = self.sender.send(completion);
    }

    fn run(&self, task: Task) {
        let completion = match task {
            Task::Store(task, sources) => {
                let result = self.store(&sources);
                Completion::Stored { task, result, sources }
            }
            Task::Lookup(task, keys) => {
                let mut state = self.state.lock();
                let locked = Bitmap::from_bools(keys.iter().map(|key| {
                    let present = state.objects.contains_key(key);
                    if present {
                        *state.locks.entry(*key).or_default() += 1;
                        state.order.touch(key);
                    }
                    present
                }));
                Completion::LookedUp { task, locked }
            }
            Task::Load(task, mut sinks) => {
                let state = self.state.lock();
                if state.losing_sinks && !sinks.is_empty() {
                    let mut lost = sinks.remove(0);
                    if let Some(bytes) = lost.sink.host_bytes_mut() {
                        let half = bytes.len() / 2;
                        bytes[..half].fill(0xee);
                    }
                }
                let loaded = Bitmap::from_bools(sinks.iter_mut().map(|item| {
                    !state.failing_loads.contains(&item.key)
                        && state
                            .objects
                            .get(&item.key)
                            .is_some_and(|bytes| item.sink.copy_from_host(bytes).is_ok())
                }));
                Completion::Loaded { task, loaded, sinks }
            }
        };
        let _ = self.sender.send(completion);
    }

    fn store(&self, items: &[StoreItem]) -> Result<(), TierError> {
        for item in items {
            let mut bytes = vec![0; item.source.len() as usize];
            item.source.copy_to_host(&mut bytes)?;
            let mut state = self.state.lock();
            if state.objects.contains_key(&item.key) {
                continue;
            }
            if state.objects.len() >= self.capacity {
                let State { order, locks, .. } = &mut *state;
                let Some(victim) = order.evict(1, &mut |k| !locks.contains_key(k)).pop() else {
                    return Err(TierError::NoSpace(format!(
                        "{} objects, all locked",
                        self.capacity
                    )));
                };
                state.objects.remove(&victim);
            }
            state.order.insert(item.key);
            state.objects.insert(item.key, bytes);
        }
        Ok(())
    }
}

impl TierAdapter for FakeTier {
    fn name(&self) -> &str {
        &self.name
    }

    fn submit_store(&self, items: Vec<StoreItem>) -> TaskId {
        let task = self.task_id();
        self.submit(Task::Store(task, items));
        task
    }

    fn submit_lookup_and_lock(&self, keys: Vec<ObjectKey>) -> TaskId {
        let mut state = self.state.lock();
        if state.panicking_lookups {
            drop(state);
            panic!("the fake tier was told to panic on lookups");
        }
        state.looked_up.push(keys.clone());
        drop(state);
        let task = self.task_id();
        self.submit(Task::Lookup(task, keys));
        task
    }

    fn submit_load(&self, items: Vec<LoadItem>) -> TaskId {
        if self.state.lock().panicking_loads {
            panic!("the fake tier was told to panic on loads");
        }
        let task = self.task_id();
        self.submit(Task::Load(task, items));
        task
    }

    fn unlock(&self, keys: &[ObjectKey]) {
        let mut state = self.state.lock();
        if state.panicking_unlocks && !keys.is_empty() {
            drop(state);
            panic!("the fake tier was told to panic on unlocks");
        }
        for key in keys {
            if let Some(count) = state.locks.get_mut(key) {
                *count -= 1;
                if *count == 0 {
                    state.locks.remove(key);
                }
            }
        }
    }

    fn delete(&self, keys: &[ObjectKey]) -> usize {
        let mut state = self.state.lock();
        if state.panicking_deletes {
            drop(state);
            panic!("the fake tier was told to panic on deletes");
        }
        let mut deleted = 0;
        for key in keys {
            if !state.locks.contains_key(key) && state.objects.remove(key).is_some() {
                state.order.remove(key);
                deleted += 1;
            }
        }
        deleted
    }

    fn clear(&self) -> usize {
        let mut state = self.state.lock();
        let doomed: Vec<ObjectKey> =
            state.objects.keys().filter(|k| !state.locks.contains_key(*k)).copied().collect();
        for key in &doomed {
            state.objects.remove(key);
            state.order.remove(key);
        }
        doomed.len()
    }

    fn usage(&self) -> TierUsage {
        let state = self.state.lock();
        TierUsage {
            capacity_bytes: self.capacity as u64 * self.chunk_bytes,
            used_bytes: state.objects.values().map(|b| b.len() as u64).sum(),
            objects: state.objects.len() as u64,
            locks: state.locks.values().sum(),
        }
    }

    fn completions(&self) -> Receiver<Completion> {
        self.receiver.clone()
    }

    /// A held store task completes at once, as `Abandoned`, storing nothing; any other task is
    /// ignored.
    fn abandon(&self, task: TaskId) {
        let given_up = {
            let mut state = self.state.lock();
            let at = state.held.iter().position(|t| matches!(t, Task::Store(id, _) if *id == task));
            let given_up = at.map(|at| state.held.remove(at));
            if given_up.is_some() {
                state.abandoned.push(task);
            }
            given_up
        };
        if let Some(task) = given_up {
            self.fail(task, TierError::Abandoned);
        }
    }

    fn close(&self) {
        let held = {
            let mut state = self.state.lock();
            state.closed = true;
            std::mem::take(&mut state.held)
        };
        for task in held {
            self.fail(task, TierError::Closed);
        }
    }
}
