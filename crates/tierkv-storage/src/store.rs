//! The store pipeline: copies finished L1 writes (and write-back victims) to the lower tiers.
//!
//! The StorageManager hands it every store's finished chunks (never a prefetch promotion) together
//! with one read share per chunk, taken by `L1Manager::finish_write_leased` in the same step that
//! made the chunk visible: from that moment until every target tier the policy names has answered,
//! the chunk is readable and cannot be evicted from L1 (it was once leased only when the pipeline
//! got to the job, and eviction could take an acknowledged chunk in between). It submits a store
//! to every target tier and returns the share once every target has answered. Failures are
//! counted, not retried: a chunk that did not reach a tier is a miss there later, nothing worse.
//! A [`StoreTicket`] tells the writer which of its chunks reached the disk tier.

use parking_lot::Condvar;
use std::collections::{HashMap, HashSet};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, select, unbounded};
use parking_lot::{Mutex, RwLock};
use tierkv_core::{
    BufferError, ChunkSource, Completion, ExtraCount, LoadItem, ObjectKey, StoreItem, TaskId,
    VecChunk,
};
use tierkv_l1::{L1Manager, LeaseId, OwnerId, ReadAccess, Readers};
use tierkv_prefetch::{Landed, Landing, TierEvent, TierRouter};

use crate::config::{RemoteAdmission, StorePolicy};
use crate::metrics::StorageMetrics;
use crate::reads::ReadCounts;

/// The owner of the store pipeline's shares.
pub(crate) const STORE_OWNER: OwnerId = OwnerId(u64::MAX - 1);

/// The tiers (fastest first, of `count`) a chunk is copied to when it is copied before anyone
/// read it (write-through, write-back): every one but a remote tier that admits chunks only
/// after reads, which receives them by [`StoreJob::AdmitRemote`] alone.
pub(crate) fn copied_unread(count: usize, remote: Option<(usize, RemoteAdmission)>) -> Vec<usize> {
    let later = match remote {
        Some((index, RemoteAdmission::AfterReads { .. })) => Some(index),
        _ => None,
    };
    (0..count).filter(|&t| Some(t) != later).collect()
}

/// Work for the store pipeline.
pub(crate) enum StoreJob {
    /// Objects made visible by `finish_write`; with the lease that pinned them when they became
    /// visible (one share each, the pipeline's to return), and the writer's ticket.
    Finished { keys: Vec<ObjectKey>, lease: Option<LeaseId>, ticket: Option<Arc<StoreTicket>> },
    /// Objects read often enough to be admitted to disk.
    Admit(Vec<ObjectKey>),
    /// Objects read often enough to be admitted to the remote tier.
    AdmitRemote(Vec<ObjectKey>),
    /// Chunks read often enough to be admitted to lower tier `to` that L1 had no room for: each
    /// (with its length in bytes) held in lower tier `from`, where their lookups read them.
    /// They are copied from there, holding no L1 room: locked in `from` under the pipeline's
    /// own lock, loaded into memory, unlocked, then stored into `to` as a demotion is
    /// ([`Fetch`]).
    AdmitBelow { from: usize, to: usize, items: Vec<(ObjectKey, u64)> },
    /// Eviction victims leased for write-back; the lease is the pipeline's to return. `clears`
    /// is what [`Clears::seen`] said before they were leased.
    WriteBack { lease: LeaseId, keys: Vec<ObjectKey>, clears: u64 },
    /// L1's chunks leased at a clean stop, for the tiers that outlive the daemon's memory: the
    /// disk, and under write-back a remote tier that takes unread chunks. The lease is the
    /// pipeline's to return; `clears` as for `WriteBack`.
    HandDown { lease: LeaseId, keys: Vec<ObjectKey>, clears: u64 },
    /// Chunks a tier above evicted under the cascade policy, with their bytes, for lower tier
    /// `tier` (fastest first): the cascade sends [`tierkv_core::Departing`] copies. The bytes
    /// are dropped once the tier answered (or the job was dropped); until then the tier whose
    /// board they left from serves them (L2 its victims, the disk L1's when there is no L2).
    Demoted { tier: usize, items: Vec<(ObjectKey, Box<dyn ChunkSource>)> },
}

impl StoreJob {
    /// Whether the job is queued holding L1 shares (its lease), rather than taking them when it
    /// starts or holding none.
    fn leased(&self) -> bool {
        matches!(
            self,
            StoreJob::WriteBack { .. }
                | StoreJob::HandDown { .. }
                | StoreJob::Finished { lease: Some(_), .. }
        )
    }
}

/// The store pipeline's jobs that hold L1 shares: copies read out of L1 (finished writes,
/// admissions) and write-back and hand-down victims, freed once written. A writer that finds
/// L1 full waits for room only while such jobs are under way (their ends free room for sure),
/// not for the pipeline's other jobs: the cascade's demotions carry copies of their bytes and
/// hold no slot. Whatever frees room meanwhile wakes it (`L1Manager::watch_room`), and so does
/// the end of each such job, after which it may stop waiting.
#[derive(Default)]
pub(crate) struct L1Holds {
    /// Jobs holding shares now, or queued with them.
    jobs: AtomicU64,
    /// Bumped whenever such a job has given its shares back.
    returned: AtomicU64,
}

impl L1Holds {
    /// A job holds shares from now on: counted before it takes them, so a writer refused room
    /// for them finds the job counted.
    fn take(&self) {
        self.jobs.fetch_add(1, Ordering::AcqRel);
    }

    /// A job gave its shares back to `l1`. It counts as returned before it stops holding, so a
    /// writer that finds no job holding also finds the return of the last one; and the writers
    /// waiting for room are woken even where the shares freed none (lookups hold the chunks
    /// too), to find no job holding and stop waiting.
    fn gave_back(&self, l1: &L1Manager) {
        self.returned.fetch_add(1, Ordering::AcqRel);
        let _ = self.jobs.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        l1.wake_room_watchers();
    }

    /// Jobs holding L1 shares now.
    pub(crate) fn holding(&self) -> u64 {
        self.jobs.load(Ordering::Acquire)
    }

    /// How many jobs have given their shares back so far.
    pub(crate) fn returned(&self) -> u64 {
        self.returned.load(Ordering::Acquire)
    }
}

/// How many times this node was cleared (`StorageManager::clear_l1`). A clear keeps in L1 the
/// chunks L1 leased to the pipeline for the tiers below (write-back and hand-down victims), and
/// the clears of those tiers miss them (not there yet); once written there they would fill the
/// cleared node again, then leave L1. So a victim leased before a clear is withdrawn by it
/// ([`LeasedVictim`]), as a cascade victim deleted on its way is: the pipeline drops it before
/// its write, or deletes it below once written (`Worker::take_back_withdrawn`). This rather
/// than a clear that waits for the victims: that wait would hold an admin's request for as
/// long as the slowest tier takes (up to `storage.store_timeout`), and the maintenance tick
/// would have to be kept from leasing more meanwhile.
#[derive(Default)]
pub(crate) struct Clears(AtomicU64);

impl Clears {
    /// The clears so far; read before leasing victims for the pipeline.
    pub(crate) fn seen(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// L1 was cleared: counted after L1's clear and before the clears of the tiers below.
    /// Counted before L1's clear, a victim the maintenance tick leased in between would carry
    /// the new count, and so land below although the clear found it and kept it.
    pub(crate) fn cleared(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}

/// A write-back or hand-down victim, read out of its L1 slot: withdrawn once the node was
/// cleared after it was leased ([`Clears`]).
struct LeasedVictim {
    access: ReadAccess,
    clears: Arc<Clears>,
    /// [`Clears::seen`] before it was leased.
    seen: u64,
}

impl ChunkSource for LeasedVictim {
    fn len(&self) -> u64 {
        ChunkSource::len(&self.access)
    }

    fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), BufferError> {
        self.access.copy_to_host(dst)
    }

    fn host_bytes(&self) -> Option<&[u8]> {
        ChunkSource::host_bytes(&self.access)
    }

    fn withdrawn(&self) -> bool {
        self.clears.seen() != self.seen
    }
}

/// What became of the chunks of one `finish_write`: how many reached the disk tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Durability {
    /// Chunks the disk tier stored (synced before its answer under `fsync = always`).
    pub durable: u32,
    /// Chunks that did not reach the disk tier: no disk tier, a store policy that does not write
    /// them to disk now, a failed copy, or a pipeline stopped before copying them.
    pub not_durable: u32,
}

/// The writer's view of one batch in the store pipeline: settled once every target answered.
#[derive(Debug, Default)]
pub struct StoreTicket {
    outcome: Mutex<Option<Durability>>,
    settled: Condvar,
}

impl StoreTicket {
    /// A ticket already settled.
    pub(crate) fn settled(outcome: Durability) -> Arc<Self> {
        Arc::new(StoreTicket { outcome: Mutex::new(Some(outcome)), settled: Condvar::new() })
    }

    fn settle(&self, outcome: Durability) {
        let mut slot = self.outcome.lock();
        if slot.is_none() {
            *slot = Some(outcome);
            self.settled.notify_all();
        }
    }

    /// What became of the chunks, if the pipeline is done with them; never waits.
    pub fn outcome(&self) -> Option<Durability> {
        *self.outcome.lock()
    }

    /// What became of the chunks, waiting at most until `deadline`; `None` if they are still
    /// being copied then.
    pub fn wait_until(&self, deadline: Instant) -> Option<Durability> {
        let mut slot = self.outcome.lock();
        while slot.is_none() {
            if self.settled.wait_until(&mut slot, deadline).timed_out() {
                break;
            }
        }
        *slot
    }
}

/// The store pipeline's queue, counting every job from the moment it is sent until its copies
/// are finished (or it is dropped), so "nothing outstanding" really means idle.
#[derive(Clone)]
pub(crate) struct StoreQueue {
    sender: Sender<StoreJob>,
    outstanding: Arc<AtomicU64>,
    /// Bumped (and waiters woken) whenever a job ends, so a stop handing L1 down can send the
    /// next batch once the pipeline caught up.
    progress: Arc<(Mutex<u64>, Condvar)>,
    /// The jobs among them that hold L1 shares: what writers held back by a full L1 wait for.
    l1_holds: Arc<L1Holds>,
    /// Bytes of demoted chunks queued or being written: their copies live in memory until then.
    demoted_bytes: Arc<AtomicU64>,
    /// The node's clears, which withdraw the victims leased before them.
    clears: Arc<Clears>,
    /// Whether the pipeline takes jobs. A send holds the read lock while it queues, and a stop
    /// closes the queue under the write lock before it drains it: every job sent is either in
    /// the channel before the drain or refused, never queued to a pipeline that stopped
    /// (L1 and L2 outlive a stop, and their demoters still send what they evict).
    open: Arc<RwLock<bool>>,
}

impl StoreQueue {
    pub(crate) fn new() -> (Self, Receiver<StoreJob>) {
        let (sender, inbox) = unbounded();
        let queue = StoreQueue {
            sender,
            outstanding: Arc::new(AtomicU64::new(0)),
            progress: Arc::new((Mutex::new(0), Condvar::new())),
            l1_holds: Arc::new(L1Holds::default()),
            demoted_bytes: Arc::new(AtomicU64::new(0)),
            clears: Arc::default(),
            open: Arc::new(RwLock::new(true)),
        };
        (queue, inbox)
    }

    /// Sends a chunk a tier evicted down to `tier`, unless the demoted bytes queued or being
    /// written would then pass `cap` (one chunk always goes): a tier below slower than the
    /// writers above it must not grow the daemon's memory without bound; nor may a pipeline
    /// that stopped. A refused chunk is dropped by the caller, a miss later like any eviction.
    /// Returns whether it was sent.
    pub(crate) fn send_demoted(
        &self,
        tier: usize,
        key: ObjectKey,
        bytes: Box<dyn ChunkSource>,
        cap: u64,
    ) -> bool {
        let len = bytes.len();
        let before = self.demoted_bytes.fetch_add(len, Ordering::AcqRel);
        if before > 0 && before.saturating_add(len) > cap {
            self.demoted_bytes.fetch_sub(len, Ordering::AcqRel);
            return false;
        }
        if self.send(StoreJob::Demoted { tier, items: vec![(key, bytes)] }).is_err() {
            self.demoted_bytes.fetch_sub(len, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// Sends an admission's copy of `items` out of lower tier `from` into `to`
    /// ([`StoreJob::AdmitBelow`]), their bytes counted with the demoted ones from now (they
    /// will be held in memory between their load and their store), unless that would pass
    /// `cap` (a job always goes when nothing else is on its way). Returns whether it was sent.
    pub(crate) fn send_admit_below(
        &self,
        from: usize,
        to: usize,
        items: Vec<(ObjectKey, u64)>,
        cap: u64,
    ) -> bool {
        let len = admitted_len(&items);
        let before = self.demoted_bytes.fetch_add(len, Ordering::AcqRel);
        if before > 0 && before.saturating_add(len) > cap {
            self.demoted_bytes.fetch_sub(len, Ordering::AcqRel);
            return false;
        }
        if self.send(StoreJob::AdmitBelow { from, to, items }).is_err() {
            // The pipeline has stopped: nothing will copy them.
            self.demoted_bytes.fetch_sub(len, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// Queues `job`, or hands it back when the pipeline has stopped (or was never started):
    /// nothing will copy it then, and what it holds is the caller's to return
    /// ([`release_unstarted`]).
    pub(crate) fn send(&self, job: StoreJob) -> Result<(), StoreJob> {
        // Counted before anything can refuse it: a refused job's shares go back, and are
        // counted back, in `release_unstarted`.
        if job.leased() {
            self.l1_holds.take();
        }
        let open = self.open.read();
        if !*open {
            return Err(job);
        }
        self.outstanding.fetch_add(1, Ordering::AcqRel);
        self.sender.send(job).map_err(|refused| {
            self.outstanding.fetch_sub(1, Ordering::AcqRel);
            refused.0
        })
    }

    /// Refuses every job from now on; returns once no send is under way.
    fn close(&self) {
        *self.open.write() = false;
    }

    /// The number of jobs that have ended so far.
    pub(crate) fn progress(&self) -> u64 {
        *self.progress.0.lock()
    }

    /// Waits until a job ends after `seen` jobs had ended, or `deadline` passes.
    pub(crate) fn wait_progress(&self, seen: u64, deadline: Instant) {
        let (count, cv) = &*self.progress;
        let mut count = count.lock();
        while *count == seen {
            if cv.wait_until(&mut count, deadline).timed_out() {
                return;
            }
        }
    }

    /// Jobs queued or being copied.
    pub(crate) fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Acquire)
    }

    /// The jobs that hold L1 shares, for writers waiting for room in L1.
    pub(crate) fn l1_holds(&self) -> &L1Holds {
        &self.l1_holds
    }

    /// The node's clears, for whoever leases victims for the pipeline and for the clear.
    pub(crate) fn clears(&self) -> &Clears {
        &self.clears
    }

    /// Bytes of demoted chunks queued or being written.
    #[cfg(test)]
    pub(crate) fn demoted_bytes(&self) -> u64 {
        self.demoted_bytes.load(Ordering::Acquire)
    }
}

struct Batch {
    /// The L1 lease the batch's sources are read under; demoted chunks bring their own bytes.
    lease: Option<LeaseId>,
    /// A write-back lease is returned whole (its objects are then freed); a copy share is returned
    /// as reader 0's.
    write_back: bool,
    waiting: usize,
    /// Keys of the batch, and how many of them the disk tier stored so far.
    keys: usize,
    durable: u32,
    ticket: Option<Arc<StoreTicket>>,
    /// Queue jobs the batch stands for (demoted chunks of several jobs go as one batch).
    jobs: usize,
    /// Bytes of the demoted chunks the batch carries.
    demoted_bytes: u64,
    /// When its copies were handed to the tiers: past `Worker::timeout`, given up.
    started: Instant,
}

/// An admission's copy out of the lower tier that holds its chunks ([`StoreJob::AdmitBelow`]):
/// first the tier's lock on them, then their load. Every lock the tier granted goes back exactly
/// once: when the load answers, when it cannot be submitted, or when the copy is given up
/// (`Worker::give_up_late`; a lock granted after that goes back when it is).
struct Fetch {
    /// The lower tier the chunks go to.
    to: usize,
    /// The chunks and their lengths: all of the job's while locking, the locked ones since.
    items: Vec<(ObjectKey, u64)>,
    /// Where their load lands, once they are locked and loading.
    landed: Option<Landed>,
    /// When the job started: past `Worker::timeout`, given up.
    started: Instant,
    /// The bytes counted with the demoted ones for it (`StoreQueue::send_admit_below`): all of
    /// the job's chunks, until it ends ([`Worker::fetch_over`]).
    reserved: u64,
}

/// The chunks of `fetch` that loaded `whole`, with their bytes, taken out of its table.
fn landed_whole(
    fetch: &Fetch,
    whole: &HashSet<ObjectKey>,
) -> Vec<(ObjectKey, Box<dyn ChunkSource>)> {
    let Some(landed) = &fetch.landed else { return Vec::new() };
    let mut landed = landed.lock();
    fetch
        .items
        .iter()
        .zip(landed.iter_mut())
        .filter(|((key, _), _)| whole.contains(key))
        .filter_map(|((key, len), bytes)| {
            let bytes = bytes.take().filter(|bytes| bytes.len() as u64 == *len)?;
            Some((*key, Box::new(VecChunk(bytes)) as Box<dyn ChunkSource>))
        })
        .collect()
}

/// The store pipeline's thread and queue.
pub(crate) struct StorePipeline {
    queue: StoreQueue,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<Worker>>>,
    /// The queue's other end, kept so that a job is never lost: whatever the thread did not
    /// take before it ended is dropped here, its shares returned.
    leftovers: Receiver<StoreJob>,
    /// Where the shares of a job refused after the stop go back.
    l1: Arc<L1Manager>,
    /// The thread's worker once it ended: what drops those jobs.
    ended: Mutex<Option<Worker>>,
}

impl StorePipeline {
    pub(crate) fn start(
        l1: Arc<L1Manager>,
        router: Arc<TierRouter>,
        policy: StorePolicy,
        (disk, remote): (Option<usize>, Option<(usize, RemoteAdmission)>),
        reads: Arc<Mutex<ReadCounts>>,
        (queue, inbox): (StoreQueue, Receiver<StoreJob>),
        (metrics, timeout): (Arc<StorageMetrics>, Duration),
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (events_tx, events) = unbounded();
        let mut worker = Worker {
            l1: Arc::clone(&l1),
            router,
            policy,
            disk,
            remote,
            reads,
            events_tx,
            batches: HashMap::new(),
            tasks: HashMap::new(),
            fetches: HashMap::new(),
            late_locks: HashMap::new(),
            next_batch: 0,
            outstanding: Arc::clone(&queue.outstanding),
            progress: Arc::clone(&queue.progress),
            l1_holds: Arc::clone(&queue.l1_holds),
            demoted_bytes: Arc::clone(&queue.demoted_bytes),
            clears: Arc::clone(&queue.clears),
            metrics,
            timeout,
            next_late_check: Instant::now(),
        };
        let halt = Arc::clone(&stop);
        let leftovers = inbox.clone();
        let thread = std::thread::Builder::new().name("tierkv-store".into()).spawn(move || {
            worker.run(&inbox, &events, &halt);
            worker
        })?;
        Ok(StorePipeline {
            queue,
            stop,
            thread: Mutex::new(Some(thread)),
            leftovers,
            l1,
            ended: Mutex::new(None),
        })
    }

    /// The queue jobs go through, for writers waiting on the pipeline's progress.
    pub(crate) fn queue(&self) -> &StoreQueue {
        &self.queue
    }

    pub(crate) fn submit(&self, job: StoreJob) {
        if let Err(job) = self.queue.send(job) {
            // Sent after the pipeline stopped: nothing will copy it.
            let queue = &self.queue;
            release_unstarted(&self.l1, &queue.demoted_bytes, &queue.l1_holds, job);
        }
    }

    /// Jobs queued or being copied.
    pub(crate) fn in_flight(&self) -> u64 {
        self.queue.outstanding()
    }

    /// Stops after the batches in flight finished (or a drain timeout passed). Idempotent.
    pub(crate) fn stop(&self) {
        self.queue.close();
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.lock().take()
            && let Ok(worker) = thread.join()
        {
            *self.ended.lock() = Some(worker);
        }
        self.drop_leftovers();
    }

    /// Drops the jobs queued that the thread, now ended, never took: their shares go back,
    /// their writers learn nothing of them reached the disk.
    fn drop_leftovers(&self) {
        let ended = self.ended.lock();
        let Some(worker) = ended.as_ref() else { return };
        while let Ok(job) = self.leftovers.try_recv() {
            worker.drop_job(job);
        }
    }
}

impl Drop for StorePipeline {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The bytes of an admission's chunks ([`StoreJob::AdmitBelow`]).
fn admitted_len(items: &[(ObjectKey, u64)]) -> u64 {
    items.iter().map(|(_, len)| len).sum()
}

/// The bytes of demoted chunks.
fn demoted_len(items: &[(ObjectKey, Box<dyn ChunkSource>)]) -> u64 {
    items.iter().map(|(_, bytes)| bytes.len()).sum()
}

/// Returns what a job that will not be started holds: its lease's shares, its demoted bytes
/// (counted on their way until now), and its writer's ticket, which learns that nothing of it
/// reached the disk.
fn release_unstarted(l1: &L1Manager, demoted_bytes: &AtomicU64, l1_holds: &L1Holds, job: StoreJob) {
    match &job {
        StoreJob::WriteBack { lease, .. }
        | StoreJob::HandDown { lease, .. }
        | StoreJob::Finished { lease: Some(lease), .. } => {
            let _ = l1.release_lease(*lease);
            l1_holds.gave_back(l1);
        }
        StoreJob::Demoted { items, .. } => {
            demoted_bytes.fetch_sub(demoted_len(items), Ordering::AcqRel);
        }
        StoreJob::AdmitBelow { items, .. } => {
            demoted_bytes.fetch_sub(admitted_len(items), Ordering::AcqRel);
        }
        _ => {}
    }
    if let StoreJob::Finished { keys, ticket: Some(ticket), .. } = &job {
        ticket.settle(Durability { durable: 0, not_durable: keys.len() as u32 });
    }
}

/// How long stopping waits for copies in flight.
const DRAIN: Duration = Duration::from_secs(10);

/// Demoted chunks the pipeline gathers into one batch at most (`start_with_followers`).
const DEMOTED_BATCH: usize = 32;

struct Worker {
    l1: Arc<L1Manager>,
    router: Arc<TierRouter>,
    policy: StorePolicy,
    disk: Option<usize>,
    /// The remote tier's index and which chunks it receives.
    remote: Option<(usize, RemoteAdmission)>,
    /// The chunks the remote tier served this node: never sent back to it.
    reads: Arc<Mutex<ReadCounts>>,
    events_tx: Sender<TierEvent>,
    batches: HashMap<u64, Batch>,
    tasks: HashMap<(usize, TaskId), u64>,
    /// Admissions copying out of a lower tier, by the task there they wait for.
    fetches: HashMap<(usize, TaskId), Fetch>,
    /// The keys of lock tasks whose admission was given up before the tier answered: the locks
    /// the answer grants go back when it comes.
    late_locks: HashMap<(usize, TaskId), Vec<ObjectKey>>,
    next_batch: u64,
    /// Jobs sent and not yet done, shared with the queue.
    outstanding: Arc<AtomicU64>,
    progress: Arc<(Mutex<u64>, Condvar)>,
    /// The jobs holding L1 shares, shared with the queue.
    l1_holds: Arc<L1Holds>,
    /// Bytes of demoted chunks queued or being written, shared with the queue.
    demoted_bytes: Arc<AtomicU64>,
    /// The node's clears, shared with the queue.
    clears: Arc<Clears>,
    metrics: Arc<StorageMetrics>,
    /// How long a batch may wait for its tiers' answers (`StorageConfig::store_timeout`).
    timeout: Duration,
    /// When the batches are next looked over for that: a few times a timeout (at most a
    /// second apart), not after every job and answer.
    next_late_check: Instant,
}

impl Worker {
    fn run(&mut self, inbox: &Receiver<StoreJob>, events: &Receiver<TierEvent>, stop: &AtomicBool) {
        let mut stopping: Option<Instant> = None;
        loop {
            if stop.load(Ordering::Acquire) && stopping.is_none() {
                stopping = Some(Instant::now());
            }
            if let Some(since) = stopping {
                // Jobs already queued are not started; batches in flight are waited for.
                while let Ok(job) = inbox.try_recv() {
                    self.drop_job(job);
                }
                let idle = self.batches.is_empty() && self.fetches.is_empty();
                if idle || since.elapsed() > DRAIN {
                    break;
                }
            }
            let step = catch_unwind(AssertUnwindSafe(|| {
                select! {
                    recv(inbox) -> job => match job {
                        Ok(job) if stopping.is_none() => self.start_with_followers(job, inbox),
                        Ok(job) => self.drop_job(job),
                        Err(_) => {}
                    },
                    recv(events) -> event => if let Ok(event) = event { self.on_event(event) },
                    default(Duration::from_millis(20)) => {},
                }
                self.give_up_late();
            }));
            if let Err(panic) = step {
                // Recover: the batches recorded so far stay correct; keep going.
                tracing::error!(why = ?panic.downcast_ref::<&str>(), "the store pipeline panicked; recovering");
                self.metrics.store_panic();
            }
        }
        // Past the drain timeout: return every share and lock still held. The tiers hand the
        // sources back (and so drop their pins) when they answer or close; a lock a tier grants
        // from now on is one its close lets go of.
        for ((tier, _), fetch) in std::mem::take(&mut self.fetches) {
            self.end_fetch(tier, &fetch);
            self.fetch_over(fetch.reserved, 0);
            self.done_with_job();
        }
        for (_, batch) in std::mem::take(&mut self.batches) {
            if let Some(lease) = batch.lease {
                let _ = self.l1.release_lease(lease);
                self.l1_holds.gave_back(&self.l1);
            }
            self.demoted_bytes.fetch_sub(batch.demoted_bytes, Ordering::AcqRel);
            for _ in 0..batch.jobs {
                self.done_with_job();
            }
            if let Some(ticket) = &batch.ticket {
                ticket.settle(Durability { durable: 0, not_durable: batch.keys as u32 });
            }
        }
    }

    /// A job that will not be started (the pipeline is stopping): its shares go back, its
    /// writer learns that nothing of it reached the disk.
    fn drop_job(&self, job: StoreJob) {
        release_unstarted(&self.l1, &self.demoted_bytes, &self.l1_holds, job);
        self.done_with_job();
    }

    /// One job is over: copied, or dropped. Its shares are back already; it counts as progress
    /// before it stops being outstanding, so a waiter that finds the pipeline idle also finds
    /// the progress of its last job (`Inner::wait_for_store_jobs`).
    fn done_with_job(&self) {
        let (count, cv) = &*self.progress;
        *count.lock() += 1;
        let _ = self
            .outstanding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        cv.notify_all();
    }

    /// The tiers a job's objects go to.
    fn targets(&self, job: &StoreJob) -> Vec<usize> {
        match job {
            StoreJob::AdmitRemote(_) => {
                return self.remote.map(|(index, _)| index).into_iter().collect();
            }
            StoreJob::AdmitBelow { to, .. } => return vec![*to],
            _ => {}
        }
        let at_write = || copied_unread(self.router.len(), self.remote);
        match (job, self.policy) {
            (StoreJob::Finished { .. }, StorePolicy::WriteThrough) => at_write(),
            (StoreJob::WriteBack { .. }, _) => at_write(),
            // Under the cascade the remote tier took what it takes at the write already.
            (StoreJob::HandDown { .. }, StorePolicy::Cascade) => self.disk.into_iter().collect(),
            (StoreJob::HandDown { .. }, _) => {
                let outlives = |t: &usize| {
                    Some(*t) == self.disk || Some(*t) == self.remote.map(|(index, _)| index)
                };
                at_write().into_iter().filter(outlives).collect()
            }
            (StoreJob::Finished { .. }, StorePolicy::DiskAdmission { .. }) => {
                at_write().into_iter().filter(|t| Some(*t) != self.disk).collect()
            }
            (StoreJob::Finished { .. }, StorePolicy::WriteBack) => Vec::new(),
            // The cascade's tiers take only what the tier above evicted; the remote tier, shared
            // by the nodes, takes finished writes at once under write-through admission.
            (StoreJob::Finished { .. }, StorePolicy::Cascade) => match self.remote {
                Some((index, RemoteAdmission::WriteThrough)) => vec![index],
                _ => Vec::new(),
            },
            (StoreJob::Admit(_), _) => self.disk.into_iter().collect(),
            (StoreJob::AdmitRemote(_) | StoreJob::AdmitBelow { .. }, _) => Vec::new(),
            (StoreJob::Demoted { tier, .. }, _) => {
                (0..self.router.len()).filter(|t| t == tier).collect()
            }
        }
    }

    /// Stores chunks another tier evicted into `tier`, from the bytes they came with; those the
    /// tier above deleted on their way ([`ChunkSource::withdrawn`]) are dropped instead.
    fn start_demoted(
        &mut self,
        tier: usize,
        items: Vec<(ObjectKey, Box<dyn ChunkSource>)>,
        jobs: usize,
    ) {
        let demoted_bytes = demoted_len(&items);
        let items: Vec<StoreItem> = items
            .into_iter()
            .filter(|(key, source)| !source.withdrawn() && !self.remote_holds(tier, key))
            .map(|(key, source)| StoreItem { key, source })
            .collect();
        let keys = items.len();
        let id = self.next_batch;
        self.next_batch += 1;
        let batch = Batch {
            lease: None,
            write_back: false,
            waiting: 0,
            keys,
            durable: 0,
            ticket: None,
            jobs,
            demoted_bytes,
            started: Instant::now(),
        };
        self.batches.insert(id, batch);
        self.submit_to(tier, id, items);
        if self.batches.get(&id).is_some_and(|b| b.waiting == 0) {
            self.finish(id);
        }
    }

    /// Starts `job`; demoted chunks for one tier queued right behind it go in the same batch
    /// (up to [`DEMOTED_BATCH`] chunks), since the cascade sends each victim as a job of its
    /// own and a tier task per chunk costs the disk tier more than the write (a task fails as a
    /// whole: a failed write then drops the batch's chunks, each a miss later). A job of another
    /// kind found behind it is started next.
    fn start_with_followers(&mut self, job: StoreJob, inbox: &Receiver<StoreJob>) {
        let StoreJob::Demoted { tier, mut items } = job else {
            self.start(job);
            return;
        };
        let mut jobs = 1;
        let mut next = None;
        while items.len() < DEMOTED_BATCH {
            match inbox.try_recv() {
                Ok(StoreJob::Demoted { tier: t, items: more }) if t == tier => {
                    items.extend(more);
                    jobs += 1;
                }
                Ok(other) => {
                    next = Some(other);
                    break;
                }
                Err(_) => break,
            }
        }
        self.start_demoted(tier, items, jobs);
        if let Some(job) = next {
            self.start(job);
        }
    }

    fn start(&mut self, job: StoreJob) {
        let job = match job {
            StoreJob::Demoted { tier, items } => {
                self.start_demoted(tier, items, 1);
                return;
            }
            StoreJob::AdmitBelow { from, to, items } => {
                self.start_fetch(from, to, items);
                return;
            }
            job => job,
        };
        let targets = self.targets(&job);
        // `clears`: what `Clears::seen` said before the victims of a write-back or a hand-down
        // were leased.
        let (lease, keys, write_back, ticket, clears) = match job {
            StoreJob::WriteBack { lease, keys, clears }
            | StoreJob::HandDown { lease, keys, clears } => (lease, keys, true, None, Some(clears)),
            StoreJob::Finished { keys, lease: Some(lease), ticket } if !targets.is_empty() => {
                (lease, keys, false, ticket, None)
            }
            job @ (StoreJob::Finished { .. } | StoreJob::Admit(_) | StoreJob::AdmitRemote(_))
                if targets.is_empty() =>
            {
                self.drop_job(job);
                return;
            }
            StoreJob::Finished { keys, lease: None, ticket: _ }
            | StoreJob::Admit(keys)
            | StoreJob::AdmitRemote(keys) => {
                // One share per key while copying; keys already gone are skipped. Counted as
                // holding before the shares are taken (`L1Holds::take`).
                self.l1_holds.take();
                let grant = self.l1.reserve_read(STORE_OWNER, &keys, ExtraCount::ZERO);
                let Some(lease) = grant.lease else {
                    self.l1_holds.gave_back(&self.l1);
                    self.done_with_job();
                    return;
                };
                let granted = keys
                    .into_iter()
                    .zip(grant.results)
                    .filter(|(_, r)| r.is_ok())
                    .map(|(k, _)| k)
                    .collect();
                (lease, granted, false, None, None)
            }
            StoreJob::Finished { lease: Some(lease), .. } => (lease, Vec::new(), false, None, None),
            StoreJob::Demoted { .. } | StoreJob::AdmitBelow { .. } => {
                self.done_with_job();
                return;
            }
        };
        let id = self.next_batch;
        self.next_batch += 1;
        let batch = Batch {
            lease: Some(lease),
            write_back,
            waiting: 0,
            keys: keys.len(),
            durable: 0,
            ticket,
            jobs: 1,
            demoted_bytes: 0,
            started: Instant::now(),
        };
        self.batches.insert(id, batch);
        for tier in targets {
            let items: Vec<StoreItem> = keys
                .iter()
                .filter(|key| !self.remote_holds(tier, key))
                .filter_map(|key| {
                    let access = self.l1.read_access(lease, 0, key).ok()?;
                    let source: Box<dyn ChunkSource> = match clears {
                        Some(seen) => {
                            let clears = Arc::clone(&self.clears);
                            Box::new(LeasedVictim { access, clears, seen })
                        }
                        None => Box::new(access),
                    };
                    // A victim a clear withdrew before its write is not written.
                    (!source.withdrawn()).then_some(StoreItem { key: *key, source })
                })
                .collect();
            self.submit_to(tier, id, items);
        }
        if self.batches.get(&id).is_some_and(|b| b.waiting == 0) {
            self.finish(id);
        }
    }

    /// Starts an admission's copy of `items` out of lower tier `from` into `to`: locks them in
    /// `from` (`on_fetched` loads what it locked). Nothing goes back to the remote tier that
    /// served it, nor to the tier the chunks are in already.
    fn start_fetch(&mut self, from: usize, to: usize, items: Vec<(ObjectKey, u64)>) {
        let reserved = admitted_len(&items);
        let items: Vec<(ObjectKey, u64)> =
            items.into_iter().filter(|(key, _)| !self.remote_holds(to, key)).collect();
        if from == to || to >= self.router.len() || items.is_empty() {
            self.demoted_bytes.fetch_sub(reserved, Ordering::AcqRel);
            self.done_with_job();
            return;
        }
        let keys: Vec<ObjectKey> = items.iter().map(|(key, _)| *key).collect();
        let fetch = Fetch { to, items, landed: None, started: Instant::now(), reserved };
        if !self.submit_fetch(from, fetch, |t| t.submit_lookup_and_lock(keys)) {
            self.demoted_bytes.fetch_sub(reserved, Ordering::AcqRel);
            self.done_with_job();
        }
    }

    /// Submits a task of `fetch` to tier `from` with `submit` and records the fetch under it;
    /// `false` when the tier took no task (it does not exist, or it panicked: counted).
    fn submit_fetch(
        &mut self,
        from: usize,
        fetch: Fetch,
        submit: impl FnOnce(&dyn tierkv_core::TierAdapter) -> TaskId,
    ) -> bool {
        let submitted =
            catch_unwind(AssertUnwindSafe(|| self.router.submit(from, &self.events_tx, submit)));
        match submitted {
            Ok(Some(task)) => {
                self.fetches.insert((from, task), fetch);
                true
            }
            Ok(None) => false,
            Err(_) => {
                tracing::error!(tier = from, "a tier panicked taking an admission's copy");
                self.metrics.store_panic();
                false
            }
        }
    }

    /// The answer of `fetch`'s task in tier `from`: once locked, its chunks are loaded; once
    /// loaded, their locks go back and what loaded whole is stored into the target tier, from
    /// memory, as a demotion.
    fn on_fetched(&mut self, from: usize, fetch: Fetch, completion: Completion) {
        match completion {
            Completion::LookedUp { locked, .. } if fetch.landed.is_none() => {
                let items: Vec<(ObjectKey, u64)> = fetch
                    .items
                    .into_iter()
                    .enumerate()
                    .filter(|(i, _)| locked.get(*i))
                    .map(|(_, item)| item)
                    .collect();
                if items.is_empty() {
                    self.fetch_over(fetch.reserved, 0);
                    self.done_with_job();
                    return;
                }
                let landed: Landed = Arc::new(Mutex::new(vec![None; items.len()]));
                let loads: Vec<LoadItem> = items
                    .iter()
                    .enumerate()
                    .map(|(i, (key, len))| LoadItem {
                        key: *key,
                        sink: Box::new(Landing::new(*len, i, Arc::clone(&landed))),
                    })
                    .collect();
                let fetch = Fetch { items, landed: Some(landed), ..fetch };
                let keys: Vec<ObjectKey> = fetch.items.iter().map(|(key, _)| *key).collect();
                let reserved = fetch.reserved;
                if !self.submit_fetch(from, fetch, |t| t.submit_load(loads)) {
                    // Not loading: the locks it took go back now.
                    self.unlock(from, &keys);
                    self.fetch_over(reserved, 0);
                    self.done_with_job();
                }
            }
            Completion::Loaded { loaded, sinks, .. } => {
                // Only whole loads count: the sinks handed back with their bits set. Dropped,
                // the sinks hand their bytes to the table.
                let whole: HashSet<ObjectKey> = sinks
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| loaded.get(*i))
                    .map(|(_, item)| item.key)
                    .collect();
                drop(sinks);
                self.end_fetch(from, &fetch);
                let items = landed_whole(&fetch, &whole);
                // What loaded stays counted, as the demoted bytes it now is (the batch counts
                // it out); what did not is counted out now.
                self.fetch_over(fetch.reserved, demoted_len(&items));
                if items.is_empty() {
                    self.done_with_job();
                    return;
                }
                self.start_demoted(fetch.to, items, 1);
            }
            // Not an answer this fetch waits for (a tier's bug): it ends.
            _ => {
                self.end_fetch(from, &fetch);
                self.fetch_over(fetch.reserved, 0);
                self.done_with_job();
            }
        }
    }

    /// An admission's copy is over: of the bytes counted for it (`reserved`), all but those of
    /// the chunks it goes on to store (`kept`, counted out by their batch) are counted out.
    fn fetch_over(&self, reserved: u64, kept: u64) {
        self.demoted_bytes.fetch_sub(reserved.saturating_sub(kept), Ordering::AcqRel);
    }

    /// `fetch`, waiting on tier `from`, ends: the locks it holds there (once loading) go back.
    /// Its job is the caller's to count done.
    fn end_fetch(&self, from: usize, fetch: &Fetch) {
        if fetch.landed.is_some() {
            let keys: Vec<ObjectKey> = fetch.items.iter().map(|(key, _)| *key).collect();
            self.unlock(from, &keys);
        }
    }

    /// Returns the pipeline's locks on `keys` in `tier`.
    fn unlock(&self, tier: usize, keys: &[ObjectKey]) {
        let Some(target) = self.router.tier(tier) else { return };
        // A tier that panics keeps the locks (its bug); the pipeline goes on.
        if catch_unwind(AssertUnwindSafe(|| target.unlock(keys))).is_err() {
            tracing::error!(tier, "a tier panicked returning an admission's locks");
            self.metrics.store_panic();
        }
    }

    /// Whether `tier` is the remote tier and it served `key` to this node: it holds those bytes
    /// already (equal keys are equal bytes), so a write-back, a hand-down or a demotion there
    /// would send them over the network for nothing.
    fn remote_holds(&self, tier: usize, key: &ObjectKey) -> bool {
        self.remote.is_some_and(|(remote, _)| remote == tier) && self.reads.lock().remote_holds(key)
    }

    /// Submits one batch's store of `items` to `tier` and records the task.
    fn submit_to(&mut self, tier: usize, id: u64, items: Vec<StoreItem>) {
        {
            if items.is_empty() {
                return;
            }
            self.metrics.store_submitted(items.len() as u64);
            // A tier that panics is one failed target, not a stuck batch.
            let submitted = catch_unwind(AssertUnwindSafe(|| {
                self.router.submit(tier, &self.events_tx, |t| t.submit_store(items))
            }));
            match submitted {
                Ok(Some(task)) => {
                    self.tasks.insert((tier, task), id);
                    if let Some(batch) = self.batches.get_mut(&id) {
                        batch.waiting += 1;
                    }
                }
                Ok(None) => {}
                Err(_) => {
                    tracing::error!(
                        tier,
                        "a tier panicked taking a store; counted as a failed copy"
                    );
                    self.metrics.store_panic();
                    self.metrics
                        .store_failed(self.router.tier(tier).map_or("unknown", |t| t.name()));
                }
            }
        }
    }

    fn on_event(&mut self, event: TierEvent) {
        let TierEvent { tier, completion } = event;
        let task = (tier, completion.task());
        if let Some(fetch) = self.fetches.remove(&task) {
            self.on_fetched(tier, fetch, completion);
            return;
        }
        if let Some(keys) = self.late_locks.remove(&task) {
            // The lock of an admission given up on: whatever it locked goes back.
            if let Completion::LookedUp { locked, .. } = completion {
                let locked: Vec<ObjectKey> = keys
                    .into_iter()
                    .enumerate()
                    .filter(|(i, _)| locked.get(*i))
                    .map(|(_, k)| k)
                    .collect();
                if !locked.is_empty() {
                    self.unlock(tier, &locked);
                }
            }
            return;
        }
        // A task of a batch given up on (`give_up_late`) is no longer known: its answer counts
        // for nothing, but what it stored that was deleted above meanwhile still goes.
        let id = self.tasks.remove(&(tier, completion.task()));
        let mut durable = 0;
        if let Completion::Stored { result, sources, .. } = completion {
            if result.is_ok() && Some(tier) == self.disk {
                durable = sources.len() as u32;
            }
            if result.is_ok() {
                self.take_back_withdrawn(tier, &sources);
            }
            // The copies are done: drop the read guards before the share is returned.
            drop(sources);
            if result.is_err() {
                self.metrics.store_failed(self.router.tier(tier).map_or("unknown", |t| t.name()));
            }
        }
        let Some(id) = id else { return };
        let done = match self.batches.get_mut(&id) {
            Some(batch) => {
                batch.durable += durable;
                batch.waiting -= 1;
                batch.waiting == 0
            }
            None => false,
        };
        if done {
            self.finish(id);
        }
    }

    /// Deletes from `tier` the demoted chunks it just stored that the tier above deleted while
    /// the write was under way (each was checked before it, in `start_demoted`), and the
    /// write-back and hand-down victims a clear withdrew meanwhile ([`Clears`]): a delete
    /// above that came after the check and before the chunk was in `tier` would otherwise not
    /// reach it. One that comes later finds the chunk in `tier` itself. A later departure of the
    /// same key that landed meanwhile goes too: a miss, never wrong bytes.
    fn take_back_withdrawn(&self, tier: usize, sources: &[StoreItem]) {
        if self.remote.is_some_and(|(remote, _)| remote == tier) {
            // The remote tier is shared by the nodes: what this node deleted (a `clear`) is
            // not deleted there, where others may have stored it and read it. Equal keys are
            // equal bytes, so keeping it serves nothing wrong.
            return;
        }
        let withdrawn: Vec<ObjectKey> =
            sources.iter().filter(|item| item.source.withdrawn()).map(|item| item.key).collect();
        if let (false, Some(target)) = (withdrawn.is_empty(), self.router.tier(tier)) {
            // A tier that panics here keeps the keys (a miss at worst, never wrong bytes: equal
            // keys are equal bytes); its batch still ends.
            if catch_unwind(AssertUnwindSafe(|| target.delete(&withdrawn))).is_err() {
                tracing::error!(tier, "a tier panicked deleting withdrawn chunks; they stay");
                self.metrics.store_panic();
            }
        }
    }

    /// Gives up on every batch whose tiers have not all answered within the timeout (a hung
    /// disk, say): it finishes as if they had, with what the disk stored so far durable and
    /// the rest not, its shares returned. Its copies' sources (and their pins on the L1 slots)
    /// go back when the tier answers at last.
    fn give_up_late(&mut self) {
        let now = Instant::now();
        if now < self.next_late_check {
            return;
        }
        self.next_late_check = now + (self.timeout / 4).min(Duration::from_secs(1));
        self.give_up_late_fetches();
        let late: Vec<u64> = self
            .batches
            .iter()
            .filter(|(_, batch)| batch.waiting > 0 && batch.started.elapsed() > self.timeout)
            .map(|(id, _)| *id)
            .collect();
        if late.is_empty() {
            return;
        }
        let given_up: Vec<(usize, TaskId)> =
            self.tasks.iter().filter(|(_, id)| late.contains(id)).map(|(task, _)| *task).collect();
        for (tier, task) in given_up {
            self.tasks.remove(&(tier, task));
            // What the tier has not started of it need not be: its sources come back sooner.
            if let Some(target) = self.router.tier(tier) {
                target.abandon(task);
            }
        }
        tracing::warn!(
            batches = late.len(),
            timeout = ?self.timeout,
            "a lower tier has not answered stores in time; their copies are given up (not durable)"
        );
        for id in late {
            self.metrics.store_timed_out();
            self.finish(id);
        }
    }

    /// Gives up on every admission whose source tier has not answered within the timeout: a
    /// loading one returns its locks now (its late load lands nowhere), a locking one when its
    /// tier answers at last ([`Worker::late_locks`]).
    fn give_up_late_fetches(&mut self) {
        let late: Vec<(usize, TaskId)> = self
            .fetches
            .iter()
            .filter(|(_, fetch)| fetch.started.elapsed() > self.timeout)
            .map(|(task, _)| *task)
            .collect();
        for task in late {
            let Some(fetch) = self.fetches.remove(&task) else { continue };
            if fetch.landed.is_none() {
                self.late_locks.insert(task, fetch.items.iter().map(|(key, _)| *key).collect());
            }
            self.end_fetch(task.0, &fetch);
            self.fetch_over(fetch.reserved, 0);
            self.metrics.store_timed_out();
            self.done_with_job();
        }
    }

    fn finish(&mut self, id: u64) {
        let Some(batch) = self.batches.remove(&id) else { return };
        let returned = match batch.lease {
            None => Ok(()),
            Some(lease) if batch.write_back => self.l1.release_lease(lease).map(|_| ()),
            Some(lease) => self.l1.finish_read(lease, Readers::One(0), None).map(|_| ()),
        };
        if returned.is_err() {
            // Only an expired lease can be refused here: its shares came back when it expired.
            self.metrics.store_lease_expired();
        }
        if batch.lease.is_some() {
            // Every batch with a lease was counted holding: queued with it, or as it took it.
            self.l1_holds.gave_back(&self.l1);
        }
        self.demoted_bytes.fetch_sub(batch.demoted_bytes, Ordering::AcqRel);
        for _ in 0..batch.jobs {
            self.done_with_job();
        }
        // Settled last: whoever waits on the ticket then finds the batch's shares back and its
        // jobs no longer in flight (`store_in_flight`), not a status a moment behind.
        if let Some(ticket) = &batch.ticket {
            let durable = batch.durable.min(batch.keys as u32);
            ticket.settle(Durability { durable, not_durable: batch.keys as u32 - durable });
        }
    }
}
