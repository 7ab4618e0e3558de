//! The PrefetchController: promotes chunks from the lower tiers into L1 read leases.
//!
//! One thread owns a submission queue (fed from any thread), a FIFO of pending requests and at
//! most `max_in_flight` active ones. Each active request goes through:
//!
//! 1. lookup-and-lock of its keys (those not already leased in L1) on every tier, one tier after
//!    the other, fastest first: the next tier is asked once the one before answered, for the
//!    keys no tier before it found (see [`Worker::look_up_from`]);
//! 2. plan: the hit over all groups given what L1 and the tiers hold; each needed key comes from
//!    the fastest tier that has it; every other lock is returned;
//! 3. reserve temporary L1 slots for the needed keys; a key that finds no slot (the hit is
//!    larger than L1's room) stays in its tier under the lock it has, to be read from there;
//! 4. load into the reserved slots;
//! 5. finalize: plan again over what loaded and what stays below; the needed keys that loaded
//!    are made visible and leased in one step (`finish_write_and_reserve_read` with the
//!    request's `extra_count`), the needed keys below keep their tier locks in a [`HeldBelow`];
//!    everything else reserved is aborted, never visible; every other tier lock is returned.
//!
//! The caller keeps the L1 hits it leased before submitting (rule 4: pin before you allocate);
//! the controller never touches them.
//!
//! A request not done one request timeout after it was submitted (plus the time its loads'
//! bytes take at [`LOAD_FLOOR_BYTES_PER_S`]) is given up, whatever its tiers answered meanwhile
//! ([`PrefetchConfig::request_timeout`] says the bound).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, select, unbounded};
use parking_lot::{Condvar, Mutex};
use tierkv_core::{
    Bitmap, ChunkSink, Clock, Completion, ExtraCount, KeyError, Layout, LoadItem, ObjectKey,
    SystemClock, TaskId, deadline_after,
};
use tierkv_l1::{L1Manager, LeaseId, Lifetime, OwnerId, Readers, WriteMode};

use crate::below::HeldBelow;
use crate::hit::{GroupKind, hit_chunks};
use crate::metrics::PrefetchMetrics;
use crate::router::{TierEvent, TierRouter};

/// Identifies a submitted prefetch request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// How a PrefetchController runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefetchConfig {
    /// Requests worked on at once; the rest wait in FIFO order.
    pub max_in_flight: usize,
    /// How long `stop` waits for tier tasks still in flight before giving up on them.
    pub drain_timeout: Duration,
    /// How long a request may take, counted from its submission (its time in the queue, its
    /// lookups of every lower tier and its loads together), before it is given up (a tier that
    /// never answers, or tiers too slow): it fails, its reservations are aborted and its locks
    /// returned, and a lookup that answers later has its locks returned then. A tier that had
    /// a task given up on for half the timeout or more, or has had it a whole timeout (plus its
    /// loads' bytes' time), is left out of new requests (a miss there) until it answers.
    ///
    /// The bound: a request ends (done, or failed) at most `request_timeout`, plus the time
    /// its loads' bytes take at [`LOAD_FLOOR_BYTES_PER_S`] (a second per 64 MiB), plus one
    /// check of the controller (every 50 ms), after it was submitted, however many lower tiers
    /// there are. (An answer never restarts the count: it did, so a request could wait a
    /// timeout per lower tier and one more for its loads.)
    pub request_timeout: Duration,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        PrefetchConfig {
            max_in_flight: 8,
            drain_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// One KV-cache group of a request.
#[derive(Clone, Debug)]
pub struct GroupRequest {
    /// How the group attends, which decides which chunks a hit needs.
    pub kind: GroupKind,
    /// The layout of the group's chunks.
    pub layout: Layout,
    /// The group's chunk keys, in token order.
    pub keys: Vec<ObjectKey>,
    /// Which keys the caller already holds leased in L1 (they are neither looked up nor loaded).
    pub in_l1: Vec<bool>,
}

/// What to prefetch.
#[derive(Clone, Debug)]
pub struct PrefetchRequest {
    /// Who the temporary slots and the resulting lease belong to.
    pub owner: OwnerId,
    /// Readers beyond the first of the resulting lease.
    pub extra: ExtraCount,
    /// Tokens per chunk, for sliding windows.
    pub chunk_tokens: u64,
    /// The groups; one full-attention group for an ordinary model.
    pub groups: Vec<GroupRequest>,
    /// Chunks of the hit this request may load into L1 slots; the rest of the hit stays in its
    /// tier under the lock it has, read from there. `usize::MAX`: as many as L1 has room for.
    pub max_promoted: usize,
}

impl PrefetchRequest {
    /// A request for one full-attention group of `keys`, none of them in L1.
    pub fn prefix(owner: OwnerId, extra: ExtraCount, layout: Layout, keys: Vec<ObjectKey>) -> Self {
        let in_l1 = vec![false; keys.len()];
        PrefetchRequest {
            owner,
            extra,
            chunk_tokens: 1,
            groups: vec![GroupRequest { kind: GroupKind::FullAttention, layout, keys, in_l1 }],
            max_promoted: usize::MAX,
        }
    }
}

/// The outcome of a prefetch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prefetched {
    /// The hit over all groups, counting the caller's L1 hits: chunks before it are available.
    pub hit_chunks: usize,
    /// The lease holding the chunks loaded for this hit; `None` when nothing was loaded.
    pub lease: Option<LeaseId>,
    /// Readers of the lease (`1 + extra_count`).
    pub readers: u32,
    /// Per group, per key: whether the lease holds it.
    pub leased: Vec<Vec<bool>>,
    /// The order in which requests started (0 for the first ever started).
    pub started: u64,
    /// Chunks of the hit, one per group and position, by the tier (index, fastest first) they
    /// come from: loaded into the lease or held below.
    pub per_tier: Vec<usize>,
    /// Per group, per key: the tier (index, fastest first) a chunk of the hit comes from, loaded
    /// into the lease or held below.
    pub sources: Vec<Vec<Option<usize>>>,
    /// The chunks of the hit that found no L1 slot: locked in their tier and read from there.
    pub below: Option<Arc<HeldBelow>>,
}

/// Why a prefetch has no result.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PrefetchError {
    /// The controller stopped before the request finished.
    #[error("the prefetch controller stopped")]
    Stopped,
    /// The controller failed; the message says how.
    #[error("the prefetch controller failed: {0}")]
    Failed(String),
    /// No answer from the lower tiers within the request timeout of its submission: a miss,
    /// and what it held has been let go.
    #[error("no answer from the lower tiers within {0:?} of the request")]
    NoAnswer(Duration),
    /// The wait ended before the request did; its result stays claimable.
    #[error("the prefetch did not finish in time; its result can still be waited for")]
    Timeout,
    /// The request or id is malformed.
    #[error("invalid prefetch: {0}")]
    Invalid(String),
}

type Outcome = Result<Prefetched, PrefetchError>;

/// Where a key stands in a request: (group, index within the group).
type At = (usize, usize);

/// A task given to a lower tier: (tier, its task id there).
type Slot = (usize, TaskId);

struct Shared {
    /// `None` while a request runs, `Some` once its outcome is ready to hand out (once).
    results: Mutex<HashMap<RequestId, Option<Outcome>>>,
    ready: Condvar,
    next_id: AtomicU64,
    accepting: AtomicBool,
    metrics: PrefetchMetrics,
}

impl Shared {
    /// Hands `outcome` to the request's waiter. A request that ends in an error counts in
    /// `prefetch_failed` here, whichever path ended it, unless a stop ended it: the daemon
    /// stopping is no failure of the request.
    fn deliver(&self, id: RequestId, outcome: Outcome) {
        self.metrics.ended(&outcome);
        let mut results = self.results.lock();
        if let Some(slot) = results.get_mut(&id) {
            *slot = Some(outcome);
        }
        self.ready.notify_all();
    }
}

enum Command {
    /// A request, and when it was submitted on the controller's clock.
    Submit(RequestId, PrefetchRequest, Duration),
    Stop,
}

/// The prefetch pipeline: a thread, its queues, and the results it hands out.
pub struct PrefetchController {
    commands: Sender<Command>,
    shared: Arc<Shared>,
    /// What the request timeout is measured on, from each request's submission.
    clock: Arc<dyn Clock>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl PrefetchController {
    /// Starts the controller thread over `l1` and the routed lower tiers.
    pub fn start(
        l1: Arc<L1Manager>,
        router: Arc<TierRouter>,
        config: PrefetchConfig,
    ) -> std::io::Result<Self> {
        Self::start_with_clock(l1, router, config, Arc::new(SystemClock::new()))
    }

    /// Like [`PrefetchController::start`], with the clock the request timeout is measured on
    /// (a `ManualClock` lets a test pass it exactly when it says). The controller still checks
    /// its requests every 50 ms of real time.
    pub fn start_with_clock(
        l1: Arc<L1Manager>,
        router: Arc<TierRouter>,
        config: PrefetchConfig,
        clock: Arc<dyn Clock>,
    ) -> std::io::Result<Self> {
        let (commands, inbox) = unbounded();
        let shared = Arc::new(Shared {
            results: Mutex::new(HashMap::new()),
            ready: Condvar::new(),
            next_id: AtomicU64::new(1),
            accepting: AtomicBool::new(true),
            metrics: PrefetchMetrics::register(),
        });
        let (events_tx, events) = unbounded();
        let worker = Worker {
            l1,
            router,
            config,
            clock: Arc::clone(&clock),
            shared: Arc::clone(&shared),
            events_tx,
            pending: VecDeque::new(),
            active: HashMap::new(),
            tasks: HashMap::new(),
            lookup_keys: HashMap::new(),
            late: HashMap::new(),
            started: 0,
            starting: false,
        };
        let thread = std::thread::Builder::new()
            .name("tierkv-prefetch".into())
            .spawn(move || worker.run(&inbox, &events))?;
        Ok(PrefetchController { commands, shared, clock, thread: Mutex::new(Some(thread)) })
    }

    /// Queues a request. Fails at once if the controller stopped or the request is malformed.
    pub fn submit(&self, request: PrefetchRequest) -> Result<RequestId, PrefetchError> {
        validate(&request)?;
        let id = RequestId(self.shared.next_id.fetch_add(1, Ordering::Relaxed));
        {
            // Checked and recorded under the results' lock: a stop's last pass over the results
            // (`fail_everything`, under the same lock, after it stopped accepting) either comes
            // after, and fails this request, or came before, and this one is refused. Checked
            // outside it, a submission could pass the check, then record its request after that
            // pass, and queue it to a worker that no longer reads its inbox: accepted, and never
            // ended.
            let mut results = self.shared.results.lock();
            if !self.shared.accepting.load(Ordering::Acquire) {
                return Err(PrefetchError::Stopped);
            }
            results.insert(id, None);
        }
        let submitted = self.clock.now();
        if self.commands.send(Command::Submit(id, request, submitted)).is_err() {
            self.shared.results.lock().remove(&id);
            return Err(PrefetchError::Stopped);
        }
        Ok(id)
    }

    /// The outcome of `id` if it is ready, handed out once; `None` while it runs, after it was
    /// handed out, and for ids never issued.
    pub fn query(&self, id: RequestId) -> Option<Outcome> {
        let mut results = self.shared.results.lock();
        match results.get(&id) {
            Some(Some(_)) => results.remove(&id).flatten(),
            _ => None,
        }
    }

    /// Whether `id` is still running or its outcome still waits to be claimed (a claimed outcome
    /// is never handed out again).
    pub fn is_known(&self, id: RequestId) -> bool {
        self.shared.results.lock().contains_key(&id)
    }

    /// Waits up to `timeout` for the outcome of `id` and hands it out.
    ///
    /// A wait that times out hands out nothing: the outcome stays claimable by a later `query`
    /// or `wait`, and the lease in it belongs to the request's owner all along, so it is never
    /// orphaned (the owner's release, or the lease's deadline, returns it if nobody claims it).
    pub fn wait(&self, id: RequestId, timeout: Duration) -> Outcome {
        let deadline = deadline_after(Instant::now(), timeout);
        let mut results = self.shared.results.lock();
        loop {
            match results.get(&id) {
                None => {
                    return Err(PrefetchError::Invalid(format!(
                        "no outcome is waiting for request {}",
                        id.0
                    )));
                }
                Some(Some(_)) => {
                    return results.remove(&id).flatten().unwrap_or(Err(PrefetchError::Stopped));
                }
                Some(None) => {
                    if self.shared.ready.wait_until(&mut results, deadline).timed_out() {
                        return Err(PrefetchError::Timeout);
                    }
                }
            }
        }
    }

    /// Stops the controller: pending requests fail as stopped, active ones finish (or, past the
    /// drain timeout, are cleaned up and fail as stopped). Idempotent.
    pub fn stop(&self) {
        self.shared.accepting.store(false, Ordering::Release);
        let _ = self.commands.send(Command::Stop);
        if let Some(thread) = self.thread.lock().take() {
            let _ = thread.join();
        }
    }
}

impl Drop for PrefetchController {
    fn drop(&mut self) {
        self.stop();
    }
}

fn validate(request: &PrefetchRequest) -> Result<(), PrefetchError> {
    let invalid = |why: &str| Err(PrefetchError::Invalid(why.into()));
    if request.groups.is_empty() {
        return invalid("a request needs at least one group");
    }
    if request.chunk_tokens == 0 {
        return invalid("chunk_tokens must be positive");
    }
    if request.groups.iter().any(|g| g.keys.len() != g.in_l1.len()) {
        return invalid("every group needs one in_l1 flag per key");
    }
    Ok(())
}

/// Where a request stands.
#[derive(Clone)]
enum Phase {
    /// Waiting for the lookup of one tier, asked after every faster one answered: per tier,
    /// its bitmap over `wanted` once it arrived; the tier to ask after this one; and the
    /// positions in `wanted` of the keys this one was asked (those no tier before found).
    LookingUp { found: Vec<Option<Bitmap>>, next: usize, asked: Vec<usize> },
    /// Waiting for loads.
    Loading { waiting: usize },
}

#[derive(Clone)]
struct Active {
    request: PrefetchRequest,
    started: u64,
    /// When it is given up unless it ended, on the controller's clock: one request timeout
    /// after it was submitted, and once its loads are planned, the time their bytes may take
    /// at [`LOAD_FLOOR_BYTES_PER_S`] more (a tier answers a load once, when the whole load is
    /// in, so a large hit from a slow tier takes as long as it loads). Fixed once the loads
    /// are planned: no answer moves it, so the lookups of several tiers one after the other
    /// share one timeout.
    due: Duration,
    /// The (group, index) of every key not in L1, in order: what was looked up.
    wanted: Vec<At>,
    phase: Phase,
    /// Locks held per tier (returned when the request ends).
    locked: Vec<Vec<ObjectKey>>,
    /// Where each needed key is loaded from.
    source: HashMap<At, usize>,
    /// Keys reserved in L1 (temporary slots), by position, with the generation of each
    /// reservation (which names it to L1 when it is finished or aborted). Positions are kept in
    /// ordered sets and maps, so the planning stays O(n log n) in the hit's length.
    reserved: BTreeMap<At, u64>,
    /// Keys whose load succeeded.
    loaded: BTreeSet<At>,
    /// Needed keys that found no room in L1: they stay locked in their tier.
    below: BTreeSet<At>,
}

impl Active {
    /// The L1 reservations at `positions`, each with its generation.
    fn reservations(&self, positions: &[At]) -> Vec<(ObjectKey, u64)> {
        positions.iter().filter_map(|at| Some((self.key(*at), *self.reserved.get(at)?))).collect()
    }

    fn key(&self, at: At) -> ObjectKey {
        self.request.groups[at.0].keys[at.1]
    }

    /// The hit if `available(group, index)` said which chunks are there, besides L1's.
    fn hit(&self, available: impl Fn(usize, usize) -> bool) -> usize {
        let present: Vec<Vec<bool>> = self
            .request
            .groups
            .iter()
            .enumerate()
            .map(|(g, group)| {
                (0..group.keys.len()).map(|i| group.in_l1[i] || available(g, i)).collect()
            })
            .collect();
        let groups: Vec<(GroupKind, &[bool])> = self
            .request
            .groups
            .iter()
            .zip(&present)
            .map(|(group, p)| (group.kind, p.as_slice()))
            .collect();
        hit_chunks(&groups, self.request.chunk_tokens)
    }

    /// The keys not in L1 that a hit of `n` needs.
    fn needed(&self, n: usize) -> BTreeSet<At> {
        let mut needed = BTreeSet::new();
        for (g, group) in self.request.groups.iter().enumerate() {
            for i in group.kind.needed(n, self.request.chunk_tokens) {
                if !group.in_l1[i] {
                    needed.insert((g, i));
                }
            }
        }
        needed
    }
}

struct Worker {
    l1: Arc<L1Manager>,
    router: Arc<TierRouter>,
    config: PrefetchConfig,
    /// What the request timeout is measured on.
    clock: Arc<dyn Clock>,
    shared: Arc<Shared>,
    events_tx: Sender<TierEvent>,
    /// Requests not started yet, each with when it was submitted (its time here counts).
    pending: VecDeque<(RequestId, PrefetchRequest, Duration)>,
    active: HashMap<RequestId, Active>,
    /// Every task in flight: its request, and when its tier counts as not answering it (see
    /// [`Worker::slow_at`]).
    tasks: HashMap<Slot, (RequestId, Duration)>,
    /// The keys of every lookup-and-lock task in flight: if its request is given up (past the
    /// drain timeout) before it answers, the locks it takes are returned when it does.
    lookup_keys: HashMap<Slot, Arc<[ObjectKey]>>,
    /// Tasks of requests given up (past the request timeout) before their tier answered, with
    /// a lookup's keys (`None` for a load), so that a late answer returns the locks it took.
    /// A tier with a task here that it kept long enough ([`Late::slow_from`]) is asked nothing
    /// new until it answers: what a tier that never answers leaves here is bounded by the tasks
    /// it had when it stopped answering (a lookup and a load per request in flight, and those
    /// handed to it within a timeout before that), not one more for each later request.
    late: HashMap<Slot, Late>,
    started: u64,
    /// `start_pending` is running: a request it plans at once (no tier took its lookup) ends in
    /// `finalize`, which asks for pending requests again; that call returns, and the running
    /// loop starts them. Recursing instead would go one frame deeper per pending request.
    starting: bool,
}

/// How long the thread returning late tier locks waits for the next answer.
const LATE_LOCKS: Duration = Duration::from_secs(60);

/// The least rate a tier is assumed to load at, for the time a request's loads may take past
/// the request timeout: a second per 64 MiB (a 20 GiB hit may take 5 minutes more). A tier
/// answers a load only once it is whole, so a slow disk shared by eight requests in flight can
/// be silent for longer than the timeout while it works.
pub const LOAD_FLOOR_BYTES_PER_S: f64 = (64u64 << 20) as f64;

/// A task of a request given up on before its tier answered ([`Worker::late`]).
struct Late {
    /// A lookup's keys, so that its late answer returns the locks it took; `None` for a load.
    keys: Option<Arc<[ObjectKey]>>,
    /// From when its tier counts as not answering it, and is left out of new requests: at once
    /// if the tier had had it for half a timeout or more when its request was given up,
    /// otherwise once it has had it for a whole timeout ([`Worker::slow_at`]). A task given up
    /// because its request ran out of time elsewhere (in the queue, or at a tier before it)
    /// says nothing of its tier until then.
    slow_from: Duration,
}

/// `at` plus `wait`, or the end of time where that overflows (a configured "forever").
fn after(at: Duration, wait: Duration) -> Duration {
    at.checked_add(wait).unwrap_or(Duration::MAX)
}

impl Worker {
    fn run(mut self, inbox: &Receiver<Command>, events: &Receiver<TierEvent>) {
        let mut stopping: Option<Instant> = None;
        loop {
            if let Some(since) = stopping
                && (self.active.is_empty() || since.elapsed() >= self.config.drain_timeout)
            {
                break;
            }
            let step = catch_unwind(AssertUnwindSafe(|| {
                select! {
                    recv(inbox) -> command => match command {
                        Ok(Command::Submit(id, request, submitted)) if stopping.is_none() => {
                            self.pending.push_back((id, request, submitted));
                            self.start_pending();
                        }
                        Ok(Command::Submit(id, ..)) => self.shared.deliver(id, Err(PrefetchError::Stopped)),
                        // A stop, or every controller handle gone: drain and end.
                        Ok(Command::Stop) | Err(_) => {
                            if stopping.is_none() {
                                stopping = Some(Instant::now());
                                for (id, ..) in std::mem::take(&mut self.pending) {
                                    self.shared.deliver(id, Err(PrefetchError::Stopped));
                                }
                            }
                        }
                    },
                    recv(events) -> event => {
                        if let Ok(event) = event {
                            self.on_event(event);
                        }
                    },
                    default(Duration::from_millis(50)) => {},
                }
                self.give_up_overdue();
                self.shared.metrics.queues(self.pending.len(), self.active.len());
            }));
            if let Err(panic) = step {
                let why = panic_message(&panic);
                tracing::error!(%why, "the prefetch controller panicked; failing every request and stopping");
                self.shared.metrics.panicked();
                self.fail_everything(PrefetchError::Failed(why));
                self.return_late_locks(events);
                return;
            }
        }
        // Past the drain timeout: give up on what is still in flight.
        self.fail_everything(PrefetchError::Stopped);
        self.return_late_locks(events);
    }

    /// Lookup-and-lock tasks still in flight when the controller gives up would lock keys that
    /// nobody unlocks. A thread outlives the controller to return those locks as the answers
    /// arrive; it ends when every such task answered or the router stops (the channel closes).
    fn return_late_locks(&mut self, events: &Receiver<TierEvent>) {
        let mut late = std::mem::take(&mut self.lookup_keys);
        late.extend(self.late.drain().filter_map(|(slot, late)| Some((slot, late.keys?))));
        if late.is_empty() {
            return;
        }
        let (router, events) = (Arc::clone(&self.router), events.clone());
        let spawned =
            std::thread::Builder::new().name("tierkv-prefetch-late".into()).spawn(move || {
                while !late.is_empty() {
                    // A tier that never answers (or a router that stops) ends the wait.
                    let Ok(TierEvent { tier, completion }) = events.recv_timeout(LATE_LOCKS) else {
                        return;
                    };
                    let Some(keys) = late.remove(&(tier, completion.task())) else { continue };
                    let held = locks_taken(&keys, &completion);
                    if let (Some(adapter), false) = (router.tier(tier), held.is_empty()) {
                        // A tier that panics keeps these; the others' still come back.
                        let _ = catch_unwind(AssertUnwindSafe(|| adapter.unlock(&held)));
                    }
                }
            });
        if spawned.is_err() {
            tracing::error!("cannot start a thread to return late tier locks; they stay held");
        }
    }

    /// Ends every request: pending ones fail, active ones are cleaned up from what their entries
    /// recorded (reservations aborted, locks returned) and fail, and so does any outcome still
    /// undelivered (a request that was in hand when a panic struck). Stops accepting.
    fn fail_everything(&mut self, error: PrefetchError) {
        self.shared.accepting.store(false, Ordering::Release);
        for (id, ..) in std::mem::take(&mut self.pending) {
            self.shared.deliver(id, Err(error.clone()));
        }
        for (id, active) in std::mem::take(&mut self.active) {
            let _ = catch_unwind(AssertUnwindSafe(|| {
                self.release_everything(&active, &BTreeSet::new())
            }));
            self.shared.deliver(id, Err(error.clone()));
        }
        let mut results = self.shared.results.lock();
        for outcome in results.values_mut().filter(|o| o.is_none()) {
            let failed = Err(error.clone());
            self.shared.metrics.ended(&failed);
            *outcome = Some(failed);
        }
        self.shared.ready.notify_all();
        drop(results);
        self.shared.metrics.queues(0, 0);
    }

    /// Gives up the requests past their due time (`Active::due`): a tier that never answers
    /// must not hold a place in flight, L1 reservations and the other tiers' locks for ever,
    /// nor slow tiers keep an engine waiting longer than the timeout. What they recorded is
    /// returned; their tasks still out move to `late` (`on_event` returns a late lookup's
    /// locks), and their tiers are asked nothing new until they answer. A request still queued
    /// past the timeout (the requests in flight before it took it all) fails without starting:
    /// it holds nothing.
    fn give_up_overdue(&mut self) {
        let timeout = self.config.request_timeout;
        let now = self.clock.now();
        // The queue is in submission order: the overdue are at its front (no walk of the whole
        // queue at every event).
        let mut queued = Vec::new();
        while self.pending.front().is_some_and(|(_, _, at)| now >= after(*at, timeout)) {
            queued.extend(self.pending.pop_front());
        }
        for (id, ..) in queued {
            let why = format!("not started within {timeout:?}: the lower tiers were busy");
            self.shared.deliver(id, Err(PrefetchError::Failed(why)));
        }
        let overdue: Vec<RequestId> =
            self.active.iter().filter(|(_, active)| now >= active.due).map(|(id, _)| *id).collect();
        if overdue.is_empty() {
            return;
        }
        let given_up: Vec<(Slot, Duration)> = self
            .tasks
            .iter()
            .filter(|(_, (id, _))| overdue.contains(id))
            .map(|(slot, (_, slow_at))| (*slot, *slow_at))
            .collect();
        for (slot, slow_at) in given_up {
            self.tasks.remove(&slot);
            let half = self.config.request_timeout / 2;
            let slow_from = if now >= slow_at.saturating_sub(half) { now } else { slow_at };
            if slow_from == now && !self.unanswering(slot.0) {
                tracing::warn!(
                    tier = slot.0,
                    timeout = ?timeout,
                    "a lower tier has not answered a prefetch task in time; it is left out of \
                     new prefetches (a miss there) until it answers"
                );
            }
            let keys = self.lookup_keys.remove(&slot);
            self.late.insert(slot, Late { keys, slow_from });
        }
        for id in overdue {
            let Some(active) = self.active.remove(&id) else { continue };
            self.release_everything(&active, &BTreeSet::new());
            self.shared.deliver(id, Err(PrefetchError::NoAnswer(timeout)));
        }
        self.start_pending();
    }

    fn start_pending(&mut self) {
        if std::mem::replace(&mut self.starting, true) {
            return;
        }
        self.start_pending_now();
        self.starting = false;
    }

    fn start_pending_now(&mut self) {
        while self.active.len() < self.config.max_in_flight.max(1) {
            let Some((id, request, submitted)) = self.pending.pop_front() else {
                break;
            };
            let wanted: Vec<At> = request
                .groups
                .iter()
                .enumerate()
                .flat_map(|(g, group)| {
                    (0..group.keys.len()).filter(|i| !group.in_l1[*i]).map(move |i| (g, i))
                })
                .collect();
            let tiers = self.router.len();
            let active = Active {
                request,
                started: self.started,
                due: after(submitted, self.config.request_timeout),
                wanted,
                phase: Phase::LookingUp { found: vec![None; tiers], next: 0, asked: Vec::new() },
                locked: vec![Vec::new(); tiers],
                source: HashMap::new(),
                reserved: BTreeMap::new(),
                loaded: BTreeSet::new(),
                below: BTreeSet::new(),
            };
            self.started += 1;
            self.shared.metrics.started();
            self.active.insert(id, active);
            self.look_up_from(id, 0);
        }
    }

    /// Asks the first tier from `first` on that takes the request's lookup of the keys no tier
    /// before it found, or plans the request once no tier is left to ask (or no key to ask for).
    ///
    /// A key a faster tier found is loaded from there (the fastest tier that has a key is its
    /// source, and every other lock is returned before loading), so a slower tier is not asked
    /// for it: that cost the tier a lookup and a lock to return (the remote tier, a round trip),
    /// and the request the wait for a tier it did not need.
    ///
    /// One tier at a time, fastest first, each once the one before answered: chunks move down
    /// the tiers (L1 to L2 to the disk under the cascade), and a chunk leaves a tier only once
    /// the tier below has it (a victim on its way is served from its copy until the disk
    /// indexed it). A chunk that a tier did not find when it answered had reached the tiers
    /// below by then (or left the node: deleted, evicted, dropped), so a tier asked afterwards
    /// finds it. Asked at once, the disk could answer before a victim of L2 arrived and L2
    /// after it had left: a miss in both tiers for a chunk the node holds. The manager leases
    /// the L1 hits before any of this, for the same reason.
    fn look_up_from(&mut self, id: RequestId, first: usize) {
        let Some(active) = self.active.get(&id) else { return };
        let found_before = |n: usize| match &active.phase {
            Phase::LookingUp { found, .. } => found.iter().flatten().any(|bits| bits.get(n)),
            Phase::Loading { .. } => false,
        };
        let asked: Vec<usize> = (0..active.wanted.len()).filter(|n| !found_before(*n)).collect();
        let keys: Arc<[ObjectKey]> = asked.iter().map(|n| active.key(active.wanted[*n])).collect();
        let tiers = if keys.is_empty() { 0 } else { self.router.len() };
        for tier in first..tiers {
            // A tier that has not answered a task given up on is not asked: it finds nothing.
            if self.unanswering(tier) {
                continue;
            }
            let submitted =
                self.submit(tier, |t| t.submit_lookup_and_lock(keys.to_vec()), "lookup");
            // A tier that panicked taking it found nothing; the next is asked.
            let Some(task) = submitted else { continue };
            self.tasks.insert((tier, task), (id, self.slow_at(0)));
            self.lookup_keys.insert((tier, task), keys);
            if let Some(Active { phase: Phase::LookingUp { next, asked: now, .. }, .. }) =
                self.active.get_mut(&id)
            {
                *next = tier + 1;
                *now = asked;
            }
            return;
        }
        // Every tier answered or was left out (or there was nothing to look up): the request
        // is planned on what the tiers found.
        if let Some(active) = self.active.get(&id).cloned() {
            self.plan(id, active);
        }
    }

    fn on_event(&mut self, event: TierEvent) {
        let TierEvent { tier, completion } = event;
        let slot = (tier, completion.task());
        let left_out = self.unanswering(tier);
        if let Some(Late { keys, .. }) = self.late.remove(&slot) {
            // The answer of a request given up (past the request timeout): a lookup's locks go
            // back; a load's sinks are dropped with the completion, freeing their slots. The
            // tier is asked again once it answered every task given up on.
            self.shared.metrics.late_completion();
            if let Some(keys) = keys {
                self.unlock(tier, &locks_taken(&keys, &completion));
            }
            // Said only of a tier that was left out (most late answers are of tiers that were
            // not slow: their requests ran out of time elsewhere).
            if left_out && !self.unanswering(tier) {
                tracing::info!(tier, "a lower tier answered its late prefetch tasks; asked again");
            }
            return;
        }
        let looked_up = self.lookup_keys.remove(&slot);
        let request = self.tasks.remove(&slot);
        // Record what the completion says in the request's entry first: if anything later in
        // this step panics, the entry still tells what to give back.
        let Some((id, active)) = request.and_then(|(id, _)| Some((id, self.active.get_mut(&id)?)))
        else {
            // An answer no request waits for: the locks it took go back all the same.
            self.shared.metrics.late_completion();
            if let Some(keys) = looked_up {
                self.unlock(tier, &locks_taken(&keys, &completion));
            }
            return;
        };
        let done = match completion {
            Completion::LookedUp { locked, .. } => {
                // Bit i is the i-th key the tier was asked: those no faster tier found.
                let asked = looked_up.as_deref().unwrap_or_default();
                active.locked[tier].extend(locked.iter_ones().filter_map(|i| asked.get(i)));
                match &mut active.phase {
                    Phase::LookingUp { found, asked, .. } => {
                        let mut bits = Bitmap::new(active.wanted.len());
                        for n in locked.iter_ones().filter_map(|i| asked.get(i)) {
                            bits.set(*n, true);
                        }
                        found[tier] = Some(bits);
                        true
                    }
                    Phase::Loading { .. } => false,
                }
            }
            Completion::Loaded { loaded, sinks, .. } => {
                // Drop the sinks (the write guards) before finishing or aborting their writes.
                let keys: Vec<ObjectKey> = sinks.iter().map(|item| item.key).collect();
                drop(sinks);
                // A bit for each sink, or none is trusted: one read against another sink's key
                // would take an unwritten slot for a loaded one.
                let loaded = if loaded.len() == keys.len() {
                    loaded
                } else {
                    tracing::error!(
                        tier,
                        bits = loaded.len(),
                        sinks = keys.len(),
                        "a tier answered a load with a bit per key asked, not per sink handed \
                         back: none of it counts as loaded"
                    );
                    Bitmap::new(keys.len())
                };
                let mut reserved_at: HashMap<ObjectKey, At> = HashMap::new();
                for at in active.reserved.keys() {
                    reserved_at.entry(active.key(*at)).or_insert(*at);
                }
                let arrived: Vec<At> = keys
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| loaded.get(*i))
                    .filter_map(|(_, key)| reserved_at.get(key).copied())
                    .collect();
                active.loaded.extend(arrived);
                match &mut active.phase {
                    Phase::Loading { waiting } => {
                        *waiting -= 1;
                        *waiting == 0
                    }
                    Phase::LookingUp { .. } => false,
                }
            }
            // Stores are not submitted by this pipeline.
            Completion::Stored { .. } => false,
        };
        if done {
            match active.phase {
                Phase::LookingUp { next, .. } => self.look_up_from(id, next),
                Phase::Loading { .. } => {
                    let active = active.clone();
                    self.finalize(id, active);
                }
            }
        }
    }

    /// Phase 2 and 3: choose sources, return the other locks, reserve slots, start loads.
    fn plan(&mut self, id: RequestId, mut active: Active) {
        let found: Vec<Option<Bitmap>> = match &active.phase {
            Phase::LookingUp { found, .. } => found.clone(),
            Phase::Loading { .. } => Vec::new(),
        };
        let position: HashMap<At, usize> =
            active.wanted.iter().enumerate().map(|(n, at)| (*at, n)).collect();
        let tier_of = |at: At| -> Option<usize> {
            let n = *position.get(&at)?;
            found.iter().position(|bits| bits.as_ref().is_some_and(|b| b.get(n)))
        };
        let n = active.hit(|g, i| tier_of((g, i)).is_some());
        for at in active.needed(n) {
            if let Some(tier) = tier_of(at) {
                active.source.insert(at, tier);
            }
        }
        self.unlock_all_but_sources(&mut active);
        self.active.insert(id, active.clone());

        // Reserve slots, group by group, and plan again over what was reserved. A promotion is
        // temporary (freed with its last reader), except from a tier that asks for its chunks to
        // stay cached in L1 (a remote tier: fetching them again costs the network).
        let keeps = |tier: Option<&usize>| {
            tier.and_then(|t| self.router.tier(*t)).is_some_and(|t| t.keep_promoted())
        };
        // Past the request's allowance of L1 slots, a key stays in its tier, as one that finds
        // no room does.
        let mut allowance = active.request.max_promoted;
        for g in 0..active.request.groups.len() {
            let wanted: Vec<At> = active.needed(n).into_iter().filter(|at| at.0 == g).collect();
            for lifetime in [Lifetime::Temporary, Lifetime::Cached] {
                let wanted: Vec<At> = wanted
                    .iter()
                    .copied()
                    .filter(|at| keeps(active.source.get(at)) == (lifetime == Lifetime::Cached))
                    .collect();
                let (wanted, past) = wanted.split_at(wanted.len().min(allowance));
                active.below.extend(past.iter().copied());
                if wanted.is_empty() {
                    continue;
                }
                let keys: Vec<ObjectKey> = wanted.iter().map(|at| active.key(*at)).collect();
                let layout = &active.request.groups[g].layout;
                // Uncounted: a key refused here is no client's refusal (it is read from its
                // tier, or trims the hit), so it is no error in `tierkv_errors_total`.
                let owner = active.request.owner;
                let results = self
                    .l1
                    .reserve_write_uncounted(owner, &keys, layout, WriteMode::Create, lifetime)
                    .unwrap_or_else(|_| vec![Err(KeyError::OutOfMemory); keys.len()]);
                for (at, result) in wanted.iter().zip(results) {
                    match result {
                        Ok(handle) => {
                            active.reserved.insert(*at, handle.generation);
                            allowance -= 1;
                        }
                        // No room: read from its tier instead. A key refused for any other
                        // reason (another writer has it in flight) trims the hit.
                        Err(KeyError::OutOfMemory) => {
                            active.below.insert(*at);
                        }
                        Err(_) => {}
                    }
                }
                self.active.insert(id, active.clone());
            }
        }
        let n = active
            .hit(|g, i| active.reserved.contains_key(&(g, i)) || active.below.contains(&(g, i)));
        let needed = active.needed(n);
        let drop_now: Vec<At> =
            active.reserved.keys().filter(|at| !needed.contains(at)).copied().collect();
        self.abort(&active, &drop_now);
        active.reserved.retain(|at, _| needed.contains(at));
        active.below.retain(|at| needed.contains(at));
        active.source.retain(|at, _| active.reserved.contains_key(at) || active.below.contains(at));
        self.unlock_all_but_sources(&mut active);
        // The entry says what is still held: a panic from here on returns only that.
        if let Some(entry) = self.active.get_mut(&id) {
            entry.locked.clone_from(&active.locked);
            entry.reserved.clone_from(&active.reserved);
        }

        // Load, tier by tier, into the reserved slots.
        let mut waiting = 0;
        let mut bytes = 0u64;
        for tier in 0..self.router.len() {
            let mut items: Vec<LoadItem> = Vec::new();
            let mut task_bytes = 0u64;
            for at in active.reserved.keys().filter(|at| active.source.get(at) == Some(&tier)) {
                let key = active.key(*at);
                if let Ok(access) = self.l1.write_access(active.request.owner, &key) {
                    task_bytes += access.handle().len;
                    items.push(LoadItem { key, sink: Box::new(access) as Box<dyn ChunkSink> });
                }
            }
            bytes += task_bytes;
            if items.is_empty() {
                continue;
            }
            if let Some(task) = self.submit(tier, |t| t.submit_load(items), "load") {
                self.tasks.insert((tier, task), (id, self.slow_at(task_bytes)));
                waiting += 1;
            }
        }
        if waiting == 0 {
            self.finalize(id, active);
        } else {
            active.phase = Phase::Loading { waiting };
            // The loads' bytes at the floor rate, once: the request's due time is final now.
            let allowance = Duration::try_from_secs_f64(bytes as f64 / LOAD_FLOOR_BYTES_PER_S)
                .unwrap_or(Duration::MAX);
            active.due = after(active.due, allowance);
            self.active.insert(id, active);
        }
    }

    /// Phase 5: lease what loaded for the hit, keep the tier locks of what stays below, abort
    /// the rest, return every other lock.
    fn finalize(&mut self, id: RequestId, mut active: Active) {
        let available = |active: &Active, g: usize, i: usize| {
            active.loaded.contains(&(g, i)) || active.below.contains(&(g, i))
        };
        let n = active.hit(|g, i| available(&active, g, i));
        let needed = active.needed(n);
        let to_lease: Vec<At> = active.loaded.intersection(&needed).copied().collect();
        let reservations = active.reservations(&to_lease);
        let grant = self.l1.finish_write_and_reserve_read(
            active.request.owner,
            &reservations,
            active.request.extra,
        );
        let granted: BTreeSet<At> = to_lease
            .iter()
            .zip(&grant.results)
            .filter(|(_, r)| r.is_ok())
            .map(|(at, _)| *at)
            .collect();
        // A key refused here vanished (its owner disconnected): plan once more without it and
        // hand back the shares of what the smaller hit does not need.
        let n = active.hit(|g, i| granted.contains(&(g, i)) || active.below.contains(&(g, i)));
        let needed = active.needed(n);
        let surplus: Vec<ObjectKey> =
            granted.iter().filter(|at| !needed.contains(at)).map(|at| active.key(*at)).collect();
        let mut lease = grant.lease;
        if let (Some(held), false) = (lease, surplus.is_empty())
            && let Ok(released) = self.l1.finish_read(held, Readers::All, Some(&surplus))
            && released.lease_ended
        {
            lease = None;
        }
        let leased_now: BTreeSet<At> = granted.intersection(&needed).copied().collect();
        // The tier locks of the needed keys below pass to the outcome, one lock each; the entry
        // is updated in the same step, so a panic after this cannot return them twice.
        let below_now: BTreeSet<At> = active.below.intersection(&needed).copied().collect();
        // Each key's tier; a key named by two groups is held once, its other lock returned below.
        let mut wanted: HashMap<ObjectKey, usize> = HashMap::with_capacity(below_now.len());
        for at in &below_now {
            wanted.entry(active.key(*at)).or_insert(active.source.get(at).copied().unwrap_or(0));
        }
        let mut held = HashMap::with_capacity(wanted.len());
        for (tier, locks) in active.locked.iter_mut().enumerate() {
            locks.retain(|key| {
                let take = wanted.get(key) == Some(&tier) && !held.contains_key(key);
                if take {
                    held.insert(*key, tier);
                }
                !take
            });
        }
        let below =
            (!held.is_empty()).then(|| Arc::new(HeldBelow::new(Arc::clone(&self.router), held)));
        self.active.insert(id, active.clone());
        self.release_everything(&active, &granted);
        if let Some(entry) = self.active.get_mut(&id) {
            // Returned: a panic from here on must not return them again (tier locks are
            // counted, and a second unlock would take another holder's).
            entry.locked.iter_mut().for_each(Vec::clear);
            entry.reserved.clear();
        }
        let of_hit = |at: &At| leased_now.contains(at) || below_now.contains(at);
        let leased = active
            .request
            .groups
            .iter()
            .enumerate()
            .map(|(g, group)| (0..group.keys.len()).map(|i| leased_now.contains(&(g, i))).collect())
            .collect();
        // Promoted into L1: the chunks of the hit left in their tier are read from there.
        self.shared.metrics.finished(leased_now.len() as u64);
        let mut per_tier = vec![0; self.router.len()];
        for at in leased_now.iter().chain(&below_now) {
            if let Some(tier) = active.source.get(at).and_then(|t| per_tier.get_mut(*t)) {
                *tier += 1;
            }
        }
        let sources = active
            .request
            .groups
            .iter()
            .enumerate()
            .map(|(g, group)| {
                (0..group.keys.len())
                    .map(|i| of_hit(&(g, i)).then(|| active.source.get(&(g, i)).copied()).flatten())
                    .collect()
            })
            .collect();
        let outcome = Prefetched {
            hit_chunks: n,
            lease,
            readers: grant.readers,
            leased,
            started: active.started,
            per_tier,
            sources,
            below,
        };
        self.active.remove(&id);
        self.shared.deliver(id, Ok(outcome));
        self.start_pending();
    }

    /// Returns the tier locks of keys that are not the chosen source of a needed key.
    fn unlock_all_but_sources(&self, active: &mut Active) {
        for tier in 0..active.locked.len() {
            let keep: HashSet<ObjectKey> = active
                .source
                .iter()
                .filter(|(_, t)| **t == tier)
                .map(|(at, _)| active.request.groups[at.0].keys[at.1])
                .collect();
            let (kept, returned): (Vec<ObjectKey>, Vec<ObjectKey>) =
                active.locked[tier].iter().partition(|k| keep.contains(k));
            self.unlock(tier, &returned);
            active.locked[tier] = kept;
        }
    }

    /// Aborts the reservations at `positions`.
    fn abort(&self, active: &Active, positions: &[At]) {
        let reservations = active.reservations(positions);
        if !reservations.is_empty() {
            self.l1.abort_reserved(active.request.owner, &reservations);
        }
    }

    /// Aborts every reservation except `kept`, and returns every tier lock.
    fn release_everything(&self, active: &Active, kept: &BTreeSet<At>) {
        let doomed: Vec<At> =
            active.reserved.keys().filter(|at| !kept.contains(at)).copied().collect();
        self.abort(active, &doomed);
        for (tier, keys) in active.locked.iter().enumerate() {
            self.unlock(tier, keys);
        }
    }

    /// Submits a task to `tier`. A tier that panics taking it (a bug) fails this one task, as
    /// a task it answered with nothing would (its items, and their L1 write guards, dropped):
    /// never the controller and every request in it.
    fn submit(
        &self,
        tier: usize,
        submit: impl FnOnce(&dyn tierkv_core::TierAdapter) -> TaskId,
        what: &str,
    ) -> Option<TaskId> {
        let submitted =
            catch_unwind(AssertUnwindSafe(|| self.router.submit(tier, &self.events_tx, submit)));
        submitted.unwrap_or_else(|_| {
            tracing::error!(
                tier,
                what,
                "a tier panicked taking a task; counted as answered with nothing"
            );
            self.shared.metrics.tier_panicked();
            None
        })
    }

    /// Whether `tier` has not answered a task of a request given up on for long enough to
    /// count as not answering ([`Late::slow_from`]): it is asked nothing new.
    fn unanswering(&self, tier: usize) -> bool {
        let now = self.clock.now();
        self.late.iter().any(|((t, _), late)| *t == tier && now >= late.slow_from)
    }

    /// When a task handed to a tier now, moving `bytes` (a load's; 0 for a lookup), has been
    /// out for a whole request timeout, plus those bytes' time at [`LOAD_FLOOR_BYTES_PER_S`]:
    /// a tier that has not answered it by then does not answer (see [`Late::slow_from`]).
    fn slow_at(&self, bytes: u64) -> Duration {
        let allowance = Duration::try_from_secs_f64(bytes as f64 / LOAD_FLOOR_BYTES_PER_S)
            .unwrap_or(Duration::MAX);
        after(after(self.clock.now(), self.config.request_timeout), allowance)
    }

    /// Returns tier locks. A tier that panics (a bug) keeps them, as a tier that failed would:
    /// the request and the controller go on.
    fn unlock(&self, tier: usize, keys: &[ObjectKey]) {
        let Some(adapter) = self.router.tier(tier).filter(|_| !keys.is_empty()) else { return };
        if catch_unwind(AssertUnwindSafe(|| adapter.unlock(keys))).is_err() {
            tracing::error!(tier, "a tier panicked returning locks; they stay held there");
            self.shared.metrics.tier_panicked();
        }
    }
}

/// The keys a lookup-and-lock of `keys` locked, by its completion (none for any other answer).
fn locks_taken(keys: &[ObjectKey], completion: &Completion) -> Vec<ObjectKey> {
    match completion {
        Completion::LookedUp { locked, .. } => {
            locked.iter_ones().filter_map(|i| keys.get(i).copied()).collect()
        }
        _ => Vec::new(),
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
