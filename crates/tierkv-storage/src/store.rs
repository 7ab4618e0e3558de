//! The store pipeline: copies finished L1 writes (and write-back victims) to the lower tiers.
//!
//! L1 tells it of every `finish_write` (never of a prefetch promotion). For each batch it takes one
//! read share per key, so the objects stay readable and unevictable while they are copied, submits
//! a store to every target tier the policy names, and returns the share once every target has
//! answered. Failures are counted, not retried: a chunk that did not reach a tier is a miss there
//! later, nothing worse.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, select, unbounded};
use parking_lot::Mutex;
use tierkv_core::{ChunkSource, Completion, ExtraCount, ObjectKey, StoreItem, TaskId};
use tierkv_l1::{L1Manager, LeaseId, OwnerId, Readers};
use tierkv_prefetch::{TierEvent, TierRouter};

use crate::config::StorePolicy;
use crate::metrics::StorageMetrics;

/// The owner of the store pipeline's shares.
pub(crate) const STORE_OWNER: OwnerId = OwnerId(u64::MAX - 1);

/// Work for the store pipeline.
pub(crate) enum StoreJob {
    /// Objects made visible by `finish_write`.
    Finished(Vec<ObjectKey>),
    /// Objects read often enough to be admitted to disk.
    Admit(Vec<ObjectKey>),
    /// Eviction victims leased for write-back; the lease is the pipeline's to return.
    WriteBack { lease: LeaseId, keys: Vec<ObjectKey> },
}

/// The store pipeline's queue, counting every job from the moment it is sent until its copies
/// are finished (or it is dropped), so "nothing outstanding" really means idle.
#[derive(Clone)]
pub(crate) struct StoreQueue {
    sender: Sender<StoreJob>,
    outstanding: Arc<AtomicU64>,
}

impl StoreQueue {
    pub(crate) fn new() -> (Self, Receiver<StoreJob>) {
        let (sender, inbox) = unbounded();
        (StoreQueue { sender, outstanding: Arc::new(AtomicU64::new(0)) }, inbox)
    }

    pub(crate) fn send(&self, job: StoreJob) {
        self.outstanding.fetch_add(1, Ordering::AcqRel);
        if self.sender.send(job).is_err() {
            self.outstanding.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Jobs queued or being copied.
    pub(crate) fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Acquire)
    }
}

struct Batch {
    lease: LeaseId,
    /// A write-back lease is returned whole (its objects are then freed); a copy share is returned
    /// as reader 0's.
    write_back: bool,
    waiting: usize,
}

/// The store pipeline's thread and queue.
pub(crate) struct StorePipeline {
    queue: StoreQueue,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl StorePipeline {
    pub(crate) fn start(
        l1: Arc<L1Manager>,
        router: Arc<TierRouter>,
        policy: StorePolicy,
        disk: Option<usize>,
        (queue, inbox): (StoreQueue, Receiver<StoreJob>),
        metrics: Arc<StorageMetrics>,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (events_tx, events) = unbounded();
        let mut worker = Worker {
            l1,
            router,
            policy,
            disk,
            events_tx,
            batches: HashMap::new(),
            tasks: HashMap::new(),
            next_batch: 0,
            outstanding: Arc::clone(&queue.outstanding),
            metrics,
        };
        let halt = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("tierkv-store".into())
            .spawn(move || worker.run(&inbox, &events, &halt))?;
        Ok(StorePipeline { queue, stop, thread: Mutex::new(Some(thread)) })
    }

    pub(crate) fn submit(&self, job: StoreJob) {
        self.queue.send(job);
    }

    /// Jobs queued or being copied.
    pub(crate) fn in_flight(&self) -> u64 {
        self.queue.outstanding()
    }

    /// Stops after the batches in flight finished (or a drain timeout passed). Idempotent.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.lock().take() {
            let _ = thread.join();
        }
    }
}

impl Drop for StorePipeline {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How long stopping waits for copies in flight.
const DRAIN: Duration = Duration::from_secs(10);

struct Worker {
    l1: Arc<L1Manager>,
    router: Arc<TierRouter>,
    policy: StorePolicy,
    disk: Option<usize>,
    events_tx: Sender<TierEvent>,
    batches: HashMap<u64, Batch>,
    tasks: HashMap<(usize, TaskId), u64>,
    next_batch: u64,
    /// Jobs sent and not yet done, shared with the queue.
    outstanding: Arc<AtomicU64>,
    metrics: Arc<StorageMetrics>,
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
                    if let StoreJob::WriteBack { lease, .. } = job {
                        let _ = self.l1.release_lease(lease);
                    }
                    self.done_with_job();
                }
                if self.batches.is_empty() || since.elapsed() > DRAIN {
                    break;
                }
            }
            let step = catch_unwind(AssertUnwindSafe(|| {
                select! {
                    recv(inbox) -> job => match job {
                        Ok(job) if stopping.is_none() => self.start(job),
                        Ok(job) => {
                            if let StoreJob::WriteBack { lease, .. } = job {
                                let _ = self.l1.release_lease(lease);
                            }
                            self.done_with_job();
                        }
                        Err(_) => {}
                    },
                    recv(events) -> event => if let Ok(event) = event { self.on_event(event) },
                    default(Duration::from_millis(20)) => {},
                }
            }));
            if let Err(panic) = step {
                // Recover: the batches recorded so far stay correct; keep going.
                tracing::error!(why = ?panic.downcast_ref::<&str>(), "the store pipeline panicked; recovering");
                self.metrics.store_panic();
            }
        }
        // Past the drain timeout: return every share still held. The tiers hand the sources back
        // (and so drop their pins) when they answer or close.
        for (_, batch) in std::mem::take(&mut self.batches) {
            let _ = self.l1.release_lease(batch.lease);
            self.done_with_job();
        }
    }

    /// One job is over: copied, or dropped.
    fn done_with_job(&self) {
        let _ = self
            .outstanding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// The tiers a job's objects go to.
    fn targets(&self, job: &StoreJob) -> Vec<usize> {
        let all: Vec<usize> = (0..self.router.len()).collect();
        match (job, self.policy) {
            (StoreJob::Finished(_), StorePolicy::WriteThrough)
            | (StoreJob::WriteBack { .. }, _) => all,
            (StoreJob::Finished(_), StorePolicy::DiskAdmission { .. }) => {
                all.into_iter().filter(|t| Some(*t) != self.disk).collect()
            }
            (StoreJob::Finished(_), StorePolicy::WriteBack) => Vec::new(),
            (StoreJob::Admit(_), _) => self.disk.into_iter().collect(),
        }
    }

    fn start(&mut self, job: StoreJob) {
        let targets = self.targets(&job);
        let (lease, keys, write_back) = match job {
            StoreJob::WriteBack { lease, keys } => (lease, keys, true),
            StoreJob::Finished(keys) | StoreJob::Admit(keys) => {
                if targets.is_empty() {
                    self.done_with_job();
                    return;
                }
                // One share per key while copying; keys already gone are skipped.
                let grant = self.l1.reserve_read(STORE_OWNER, &keys, ExtraCount::ZERO);
                let Some(lease) = grant.lease else {
                    self.done_with_job();
                    return;
                };
                let granted = keys
                    .into_iter()
                    .zip(grant.results)
                    .filter(|(_, r)| r.is_ok())
                    .map(|(k, _)| k)
                    .collect();
                (lease, granted, false)
            }
        };
        let id = self.next_batch;
        self.next_batch += 1;
        self.batches.insert(id, Batch { lease, write_back, waiting: 0 });
        for tier in targets {
            let items: Vec<StoreItem> = keys
                .iter()
                .filter_map(|key| {
                    let source = self.l1.read_access(lease, 0, key).ok()?;
                    Some(StoreItem { key: *key, source: Box::new(source) as Box<dyn ChunkSource> })
                })
                .collect();
            if items.is_empty() {
                continue;
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
        if self.batches.get(&id).is_some_and(|b| b.waiting == 0) {
            self.finish(id);
        }
    }

    fn on_event(&mut self, event: TierEvent) {
        let TierEvent { tier, completion } = event;
        let Some(id) = self.tasks.remove(&(tier, completion.task())) else { return };
        if let Completion::Stored { result, sources, .. } = completion {
            // The copies are done: drop the read guards before the share is returned.
            drop(sources);
            if result.is_err() {
                self.metrics.store_failed(self.router.tier(tier).map_or("unknown", |t| t.name()));
            }
        }
        let done = match self.batches.get_mut(&id) {
            Some(batch) => {
                batch.waiting -= 1;
                batch.waiting == 0
            }
            None => false,
        };
        if done {
            self.finish(id);
        }
    }

    fn finish(&mut self, id: u64) {
        let Some(batch) = self.batches.remove(&id) else { return };
        self.done_with_job();
        let returned = if batch.write_back {
            self.l1.release_lease(batch.lease).map(|_| ())
        } else {
            self.l1.finish_read(batch.lease, Readers::One(0), None).map(|_| ())
        };
        if returned.is_err() {
            // Only an expired lease can be refused here: its shares came back when it expired.
            self.metrics.store_lease_expired();
        }
    }
}
