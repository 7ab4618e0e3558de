//! The StorageManager: the one API the daemon calls.
//!
//! It wires L1, the lower tiers (fastest first), the prefetch pipeline, the store pipeline and a
//! maintenance thread (lease expiry, background eviction, gauges), and keeps the record of every
//! open lookup: which lease holds which key of its hit.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use parking_lot::Mutex;
use tierkv_core::policy::{Order, PolicyKind, SharedJudge};
use tierkv_core::{
    ChunkSource, Clock, Departing, KeyError, Layout, LogLimit, ObjectKey, SystemClock, TierAdapter,
    TierUsage, deadline_after,
};
use tierkv_disk::DiskStore;
use tierkv_l1::{
    Cleared, Demoter, EvictionReason, L1Context, L1Manager, L1Observer, LeaseId, Lifetime, OwnerId,
    ReadAccess, Readers, RoomWatch, SlotHandle, Usage, WriteAccess, WriteMode,
};
use tierkv_l2::HostStore;
use tierkv_prefetch::{
    GroupKind, GroupRequest, HeldBelow, PrefetchController, PrefetchError, PrefetchRequest,
    Prefetched, TierRouter, hit_chunks,
};
use tierkv_remote::RemoteStore;

use crate::config::{RemoteAdmission, StorageConfig, StorePolicy};
use crate::error::StorageError;
use crate::lookup::{Failure, HitChunk, Lookup, LookupId, LookupRequest, LookupResult, Stage};
use crate::metrics::{LookupTotals, StorageMetrics};
use crate::reads::ReadCounts;
use crate::store::{
    Durability, STORE_OWNER, StoreJob, StorePipeline, StoreQueue, StoreTicket, copied_unread,
};

/// Owners from here on belong to the storage layer's own pipelines.
pub const RESERVED_OWNERS: u64 = 1 << 63;

/// The owner of write-back leases.
const WRITEBACK_OWNER: OwnerId = OwnerId(u64::MAX - 2);

/// Each key's answer to a `finish_write`, in request order.
pub type FinishResults = Vec<Result<(), KeyError>>;

/// The tiers `start` opened itself: host, disk, remote.
type ConfiguredTiers = (Option<Arc<HostStore>>, Option<Arc<DiskStore>>, Option<Arc<RemoteStore>>);

/// How often the maintenance thread probes a degraded remote tier (a `PING` on the tier's own
/// runtime; the thread does not wait for it).
const REMOTE_PROBE: Duration = Duration::from_secs(1);

/// Reads counted per chunk for disk admission, at most; beyond this the counts start over.
const READ_COUNTS: usize = 1 << 20;

/// Chunks a stop hands down at a time under the cascade (`Inner::hand_down_to_disk`).
const STOP_BATCH: usize = 32;

/// How often a writer waiting for room in L1 asks whether its client gave up
/// ([`StorageManager::reserve_write_until`]): a client learns of it only by asking (a socket
/// poll of a fraction of a microsecond), and a store given up on keeps what it reserved until it
/// notices, at most this much longer.
const GIVE_UP_POLL: Duration = Duration::from_millis(5);

/// Waits until room may have come free in L1 since `watch` began or last waited, or until
/// `deadline` (`true`: try again, at the deadline a last time), asking `gave_up` every
/// [`GIVE_UP_POLL`]; `false` once it says the client gave up.
fn wait_for_room(watch: &mut RoomWatch<'_>, deadline: Instant, gave_up: impl Fn() -> bool) -> bool {
    loop {
        if gave_up() {
            return false;
        }
        let now = Instant::now();
        if now >= deadline || watch.wait_until(deadline.min(now + GIVE_UP_POLL)) {
            return true;
        }
    }
}

/// Tells the store pipeline of writes finished by a plain `L1Manager::finish_write` (the
/// manager's own `finish_write` hands the pipeline its jobs, already pinned, itself).
struct Forward {
    jobs: StoreQueue,
    /// Whether a lower tier takes finished writes at once ([`copies_at_write`]); when none
    /// does, the pipeline is not woken for a job it would drop.
    copies_at_write: bool,
    /// The record of chunks the remote tier served, when there is a remote tier: a chunk
    /// finished here is this node's own again, as in [`Inner::stored_here`].
    served: Option<Arc<Mutex<ReadCounts>>>,
}

impl L1Observer for Forward {
    fn writes_finished(&self, keys: &[ObjectKey]) {
        if let Some(reads) = &self.served {
            // Before the job goes out: the pipeline must not find them served by Redis.
            let mut reads = reads.lock();
            keys.iter().for_each(|key| reads.stored_here(key));
        }
        if self.copies_at_write {
            // Refused once the pipeline stopped: such a job holds nothing to return.
            let job = StoreJob::Finished { keys: keys.to_vec(), lease: None, ticket: None };
            let _ = self.jobs.send(job);
        }
    }

    fn evicted(&self, _keys: &[ObjectKey], _reason: EvictionReason) {}
}

/// The chunks of L1's slot size the host and disk stores hold together.
fn chunks_below(config: &StorageConfig, host: Option<&HostStore>, disk: Option<&DiskStore>) -> u64 {
    let slot = config.l1.slot_bytes.max(1);
    host.map_or(0, |h| h.config().capacity_bytes / h.config().chunk_bytes.max(1))
        .saturating_add(disk.map_or(0, |d| d.chunk_capacity(slot)))
}

/// The judge the host and disk stores follow, when the cascade hands chunks down to either and
/// it runs the adaptive policy: one judge of the tiers' combined size, in chunks of L1's slots,
/// fed every lookup (see [`SharedJudge`]). `None` when no tier below L1 has a choice of order.
fn judge_below(
    config: &StorageConfig,
    host: Option<&HostStore>,
    disk: Option<&DiskStore>,
) -> Option<SharedJudge<ObjectKey>> {
    let adaptive = |policy: PolicyKind| policy == PolicyKind::Adaptive;
    let host_follows = host.is_some_and(|h| adaptive(h.config().policy));
    let disk_follows = disk.is_some_and(|d| adaptive(d.policy()));
    if !host_follows && !disk_follows {
        return None;
    }
    let slot = config.l1.slot_bytes.max(1);
    let chunks = (config.l1.capacity_bytes / slot).saturating_add(chunks_below(config, host, disk));
    let judge = SharedJudge::new(usize::try_from(chunks).unwrap_or(usize::MAX));
    if let Some(host) = host.filter(|_| host_follows) {
        host.follow(judge.order());
    }
    if let Some(disk) = disk.filter(|_| disk_follows) {
        disk.follow(judge.order());
    }
    Some(judge)
}

/// Whether `policy` copies a finished write down at once to one of `tiers`: write-through to
/// any lower tier, disk admission to any but the disk; write-back copies only what L1 evicts,
/// and so does the cascade, but for the remote tier under write-through admission (shared by
/// the nodes, it is no part of the node's tiers that add up).
fn copies_at_write(
    policy: StorePolicy,
    tiers: &[Arc<dyn TierAdapter>],
    remote: RemoteAdmission,
) -> bool {
    match policy {
        StorePolicy::WriteBack => false,
        StorePolicy::Cascade => {
            remote == RemoteAdmission::WriteThrough && tiers.iter().any(|t| t.name() == "remote")
        }
        StorePolicy::WriteThrough => !tiers.is_empty(),
        StorePolicy::DiskAdmission { .. } => tiers.iter().any(|t| t.name() != "disk"),
    }
}

/// Where an L1 victim goes before L1 reuses its slot: under the cascade to the first lower tier,
/// under write-back to every tier a write-back copies to (a victim a store's reservation took
/// before the background wrote it back). Into the host store it is copied at once, on the
/// evicting thread; into any other tier it is copied out and handed to the store pipeline, and a
/// disk tier serves it from that copy until it is written ([`DiskStore::depart`]). A chunk a
/// tier cannot take is dropped there: a miss later, like any eviction. A chunk the remote tier
/// served this node is not sent back to it ([`ReadCounts::remote_holds`]).
struct DemoteFromL1 {
    /// The host store, when it takes L1's victims (it is tier 0).
    host: Option<Arc<HostStore>>,
    /// The other tiers that take them, by index, through the store pipeline.
    piped: Vec<usize>,
    /// The disk tier and its index, when it is among them.
    disk: Option<(usize, Arc<DiskStore>)>,
    /// The remote tier's index, and what it served this node.
    remote: Option<(usize, Arc<Mutex<ReadCounts>>)>,
    down: DemoteDown,
}

impl DemoteFromL1 {
    /// Demotes to the lower tiers numbered `to` (fastest first), among them the configured host
    /// store (tier 0) and disk store (with its index), if any, and the remote tier (with its
    /// index and the record of what it served); `None` when `to` is empty.
    fn to(
        to: &[usize],
        host: Option<&Arc<HostStore>>,
        disk: Option<(usize, &Arc<DiskStore>)>,
        remote: Option<(usize, &Arc<Mutex<ReadCounts>>)>,
        down: &DemoteDown,
    ) -> Option<Arc<dyn Demoter>> {
        if to.is_empty() {
            return None;
        }
        let host = host.filter(|_| to.contains(&0)).cloned();
        let piped: Vec<usize> = to.iter().copied().filter(|&t| t != 0 || host.is_none()).collect();
        let disk = disk
            .filter(|(index, _)| piped.contains(index))
            .map(|(index, disk)| (index, Arc::clone(disk)));
        let remote = remote
            .filter(|(index, _)| piped.contains(index))
            .map(|(index, reads)| (index, Arc::clone(reads)));
        Some(Arc::new(DemoteFromL1 { host, piped, disk, remote, down: down.clone() }))
    }
}

impl Demoter for DemoteFromL1 {
    fn demote(&self, key: &ObjectKey, bytes: &dyn ChunkSource) {
        // The remote tier does not get back what it served: it holds those bytes already.
        let remote_holds = match &self.remote {
            Some((index, reads)) => reads.lock().remote_holds(key).then_some(*index),
            None => None,
        };
        let piped = || self.piped.iter().copied().filter(move |&t| Some(t) != remote_holds);
        // A victim bound for the store pipeline is copied out of its slot once (a device-to-host
        // copy with L1 on a GPU), and that copy serves the host store too.
        let copy = if piped().next().is_none() {
            None
        } else {
            let mut copy: Arc<[u8]> = std::iter::repeat_n(0u8, bytes.len() as usize).collect();
            let Some(dst) = Arc::get_mut(&mut copy) else { return };
            if let Err(e) = bytes.copy_to_host(dst) {
                // The victim is gone from L1 and reaches no tier below: lost, and said so
                // (under write-back it was the only copy).
                self.down.metrics.demotion_copy_failed();
                if let Some(left_out) = self.down.copy_failures.admit() {
                    tracing::warn!(
                        ?key,
                        error = %e,
                        left_out,
                        "an L1 victim could not be copied out of its slot: lost (at most one \
                         such warning a minute; left_out: those since the last, all counted in \
                         tierkv_errors_total)"
                    );
                }
                return;
            }
            Some(copy)
        };
        if let Some(host) = &self.host {
            let stored = match &copy {
                Some(copy) => host.store_now(*key, &Departing::unserved(*key, Arc::clone(copy))),
                None => host.store_now(*key, bytes),
            };
            if let Err(e) = stored {
                tracing::debug!(?key, error = %e, "an L1 victim did not fit into L2; dropped");
            }
        }
        let Some(copy) = copy else { return };
        for tier in piped() {
            let departing = match &self.disk {
                Some((index, disk)) if *index == tier => disk.depart(*key, Arc::clone(&copy)),
                _ => Departing::unserved(*key, Arc::clone(&copy)),
            };
            self.down.send(tier, *key, Box::new(departing));
        }
    }
}

/// The cascade's steps through the store pipeline: a victim's bytes go to a lower tier as a
/// job, unless [`demoted_cap`] bytes of victims are already on their way (then it is dropped
/// and counted).
#[derive(Clone)]
struct DemoteDown {
    jobs: StoreQueue,
    cap: u64,
    metrics: Arc<StorageMetrics>,
    /// Warnings of victims that could not be copied out of L1: one a minute.
    copy_failures: Arc<LogLimit>,
}

impl DemoteDown {
    fn send(&self, tier: usize, key: ObjectKey, bytes: Box<dyn ChunkSource>) {
        if !self.jobs.send_demoted(tier, key, bytes, self.cap) {
            self.metrics.demotion_dropped();
        }
    }
}

/// Bytes of cascade victims that may be on their way to a lower tier at once (copies in
/// memory): 256 MiB, or room for a stop's batches of the largest chunks.
fn demoted_cap(slot_bytes: u64) -> u64 {
    (256u64 << 20).max((4 * STOP_BATCH as u64).saturating_mul(slot_bytes))
}

/// How full every tier is, and what is in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageStatus {
    /// L1.
    pub l1: Usage,
    /// Each lower tier, fastest first: its name and usage.
    pub tiers: Vec<(String, TierUsage)>,
    /// Lookups not yet released.
    pub open_lookups: usize,
    /// Store jobs queued or being copied (0: the store pipeline is idle).
    pub store_in_flight: u64,
    /// Lookups and their hits since the start.
    pub lookups: LookupTotals,
    /// Why the disk tier refuses stores, while its directory cannot be written (it retries).
    pub disk_read_only: Option<String>,
    /// Why the remote tier is degraded (its last call could not reach Redis: its lookups and
    /// loads are misses while it reconnects), if it is.
    pub remote_degraded: Option<String>,
    /// The order the judge of the tiers below L1 chose, when they follow one.
    pub judged_order: Option<Order>,
    /// The order the host and disk tiers evict in, each as of its last eviction.
    pub below_orders: Vec<(&'static str, Order)>,
}

struct Inner {
    l1: Arc<L1Manager>,
    /// Chooses the order of the tiers below L1 from every lookup, when the cascade hands
    /// chunks down to an adaptive policy ([`SharedJudge`]): no lookup waits on it.
    judge: Option<SharedJudge<ObjectKey>>,
    /// The clock L1's lease deadlines are measured on; tier locks held for a hit expire on it too.
    clock: Arc<dyn Clock>,
    router: Arc<TierRouter>,
    host: Option<Arc<HostStore>>,
    disk: Option<Arc<DiskStore>>,
    remote: Option<Arc<RemoteStore>>,
    /// The remote tier's place among the lower tiers (fastest first), if there is one.
    remote_tier: Option<usize>,
    /// The disk tier's place among them, if there is one: where disk admission writes.
    disk_tier: Option<usize>,
    /// When the maintenance thread last probed a degraded remote tier.
    remote_probed: Mutex<Option<Instant>>,
    prefetch: PrefetchController,
    store: StorePipeline,
    lookups: Mutex<HashMap<LookupId, Lookup>>,
    /// Lookups whose owner left while they were prefetching: their leases are returned when the
    /// prefetch finishes.
    abandoned: Mutex<Vec<Lookup>>,
    next_lookup: AtomicU64,
    /// Reads per chunk, for admission after reads, and the chunks the remote tier served (shared
    /// with the store pipeline and L1's demoter, which do not send those back to it).
    reads: Arc<Mutex<ReadCounts>>,
    config: StorageConfig,
    metrics: Arc<StorageMetrics>,
    accepting: AtomicBool,
    stop_maintenance: AtomicBool,
    /// Whether finished writes are copied down at once ([`copies_at_write`]).
    copies_at_write: bool,
    /// Whether a stop hands L1's chunks (and under the cascade L2's) down to the disk tier:
    /// under the cascade, the only tier a restart keeps holds nothing the tiers above hold, and
    /// under write-back nothing L1 has not yet written back.
    hand_down_at_stop: bool,
    /// Set by the first hand-down.
    handed_down: AtomicBool,
}

/// Where a read of a lookup's chunks finds them: each chunk's L1 lease (`None`: held below L1),
/// the lookup's locks below L1, and its number of readers.
type Covering = (Vec<Option<LeaseId>>, Option<Arc<HeldBelow>>, u32);

/// L1, the lower tiers and the pipelines between them.
pub struct StorageManager {
    inner: Arc<Inner>,
    maintenance: Mutex<Option<JoinHandle<()>>>,
}

impl StorageManager {
    /// Opens every configured tier and starts the pipelines and the maintenance thread.
    pub fn start(config: StorageConfig) -> Result<Self, StorageError> {
        Self::start_with_clock(config, Arc::new(SystemClock::new()))
    }

    /// Like [`StorageManager::start`], with the clock lease deadlines are measured on.
    pub fn start_with_clock(
        config: StorageConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StorageError> {
        let host = config.l2.clone().map(HostStore::open).transpose()?.map(Arc::new);
        let disk = config.disk.clone().map(DiskStore::open).transpose()?.map(Arc::new);
        let remote = config.remote.clone().map(RemoteStore::open).transpose()?.map(Arc::new);
        let mut tiers: Vec<Arc<dyn TierAdapter>> = Vec::new();
        if let Some(host) = &host {
            tiers.push(host.clone());
        }
        if let Some(disk) = &disk {
            tiers.push(disk.clone());
        }
        if let Some(remote) = &remote {
            tiers.push(remote.clone());
        }
        Self::assemble(config, clock, tiers, (host, disk, remote))
    }

    /// Runs over lower tiers the caller built (fastest first) instead of the configured ones: a
    /// tier named "disk" is the one disk admission writes to, one named "remote" the one
    /// `remote_admission` feeds. For tests that inject failures.
    pub fn start_with_tiers(
        config: StorageConfig,
        clock: Arc<dyn Clock>,
        tiers: Vec<Arc<dyn TierAdapter>>,
    ) -> Result<Self, StorageError> {
        if config.l2.is_some() || config.disk.is_some() || config.remote.is_some() {
            return Err(StorageError::Config(
                "either configured tiers or given tiers, not both".into(),
            ));
        }
        Self::assemble(config, clock, tiers, (None, None, None))
    }

    fn assemble(
        config: StorageConfig,
        clock: Arc<dyn Clock>,
        tiers: Vec<Arc<dyn TierAdapter>>,
        (host, disk, remote): ConfiguredTiers,
    ) -> Result<Self, StorageError> {
        let (jobs, inbox) = StoreQueue::new();
        let copies_at_write = copies_at_write(config.store_policy, &tiers, config.remote_admission);
        // Which tiers the cascade hands victims to: each but a remote tier that takes every
        // finished write already (write-through admission).
        let takes_victims = |index: usize| {
            tiers.get(index).is_some_and(|t| {
                t.name() != "remote" || config.remote_admission != RemoteAdmission::WriteThrough
            })
        };
        let names: Vec<String> = tiers.iter().map(|t| t.name().to_string()).collect();
        let metrics = Arc::new(StorageMetrics::register(&names));
        let cascade = config.store_policy == StorePolicy::Cascade && takes_victims(0);
        let down = DemoteDown {
            jobs: jobs.clone(),
            cap: demoted_cap(config.l1.slot_bytes),
            metrics: metrics.clone(),
            copy_failures: Arc::new(LogLimit::new(Duration::from_secs(60))),
        };
        let remote_index = tiers
            .iter()
            .position(|t| t.name() == "remote")
            .map(|index| (index, config.remote_admission));
        let write_back = config.store_policy == StorePolicy::WriteBack;
        let demoted_to = if cascade {
            vec![0]
        } else if write_back {
            copied_unread(tiers.len(), remote_index)
        } else {
            Vec::new()
        };
        let disk_index = tiers.iter().position(|t| t.name() == "disk");
        let reads = Arc::new(Mutex::new(ReadCounts::new(READ_COUNTS)));
        let observer = Arc::new(Forward {
            jobs: jobs.clone(),
            copies_at_write,
            served: remote_index.map(|_| Arc::clone(&reads)),
        });
        let demoter = DemoteFromL1::to(
            &demoted_to,
            host.as_ref(),
            disk_index.zip(disk.as_ref()),
            remote_index.map(|(index, _)| (index, &reads)),
            &down,
        );
        if let Some(host) = host.as_ref().filter(|_| cascade && takes_victims(1)) {
            // The host store is tier 0 (fastest first): its victims go to tier 1.
            host.set_demoter(Box::new(move |key, departing| {
                down.send(1, key, Box::new(departing))
            }));
        }
        let context = L1Context { clock: Arc::clone(&clock), observer, demoter };
        let l1 = Arc::new(L1Manager::build(config.l1.clone(), context)?);
        if cascade {
            // What L1 evicts goes down to the host and disk stores: L1's policy ages uses over
            // the tiers' turnover, as the simulation's cascade does.
            let below = chunks_below(&config, host.as_deref(), disk.as_deref());
            l1.keep_below(usize::try_from(below).unwrap_or(usize::MAX));
        }
        let judge =
            cascade.then(|| judge_below(&config, host.as_deref(), disk.as_deref())).flatten();
        let router = Arc::new(TierRouter::start(tiers)?);
        let prefetch = PrefetchController::start(l1.clone(), router.clone(), config.prefetch)?;
        let store = StorePipeline::start(
            l1.clone(),
            router.clone(),
            config.store_policy,
            (disk_index, remote_index),
            Arc::clone(&reads),
            (jobs, inbox),
            (metrics.clone(), config.store_timeout),
        )?;
        let inner = Arc::new(Inner {
            l1,
            judge,
            clock,
            router,
            host,
            disk,
            remote,
            remote_tier: remote_index.map(|(index, _)| index),
            disk_tier: disk_index,
            remote_probed: Mutex::new(None),
            prefetch,
            store,
            lookups: Mutex::new(HashMap::new()),
            abandoned: Mutex::new(Vec::new()),
            next_lookup: AtomicU64::new(first_lookup_id()),
            reads,
            config,
            metrics,
            accepting: AtomicBool::new(true),
            stop_maintenance: AtomicBool::new(false),
            copies_at_write,
            hand_down_at_stop: (cascade || write_back) && disk_index.is_some(),
            handed_down: AtomicBool::new(false),
        });
        let worker = Arc::clone(&inner);
        let maintenance =
            std::thread::Builder::new().name("tierkv-maintenance".into()).spawn(move || {
                while !worker.stop_maintenance.load(Ordering::Acquire) {
                    // Parked, not asleep: `stop` unparks it, so a stop never waits out the
                    // interval (an early wake-up only ticks early).
                    std::thread::park_timeout(worker.config.maintenance_interval);
                    if worker.stop_maintenance.load(Ordering::Acquire) {
                        break;
                    }
                    if catch_unwind(AssertUnwindSafe(|| worker.tick())).is_err() {
                        tracing::error!(
                            "the maintenance thread panicked; it carries on at its next tick"
                        );
                        worker.metrics.maintenance_panic();
                    }
                }
            })?;
        Ok(StorageManager { inner, maintenance: Mutex::new(Some(maintenance)) })
    }

    /// L1, for callers that copy into and out of its slots (the daemon's data plane).
    pub fn l1(&self) -> &Arc<L1Manager> {
        &self.inner.l1
    }

    fn check(&self, owner: OwnerId) -> Result<(), StorageError> {
        if !self.inner.accepting.load(Ordering::Acquire) {
            return Err(StorageError::Stopped);
        }
        if owner.0 >= RESERVED_OWNERS {
            return Err(StorageError::ReservedOwner(owner.0));
        }
        Ok(())
    }

    // ----- writes -----

    /// Reserves L1 slots for new chunks (invisible until finished), waiting for room up to
    /// `StorageConfig::store_backpressure` from now ([`StorageManager::reserve_write_until`]).
    pub fn reserve_write(
        &self,
        owner: OwnerId,
        keys: &[ObjectKey],
        layout: &Layout,
    ) -> Result<Vec<Result<SlotHandle, KeyError>>, StorageError> {
        self.reserve_write_until(owner, keys, layout, self.store_deadline(), || false)
    }

    /// When a store that starts now stops waiting for room in L1:
    /// `StorageConfig::store_backpressure` from now. A store that reserves in windows
    /// ([`StorageManager::store_window`]) reserves every window by this one deadline, so the
    /// whole store waits that long at most, however many windows it has.
    pub fn store_deadline(&self) -> Instant {
        deadline_after(Instant::now(), self.inner.config.store_backpressure)
    }

    /// Reserves L1 slots for new chunks (invisible until finished), waiting for room until
    /// `deadline` at most ([`StorageManager::store_deadline`]), or until `gave_up` says the
    /// client gave up on the store (asked every few milliseconds while it waits): then the keys
    /// still without room are refused (`OutOfMemory`), and the caller, which asks `gave_up`
    /// again, aborts what was reserved.
    ///
    /// Backpressure: when L1 has no room because its chunks are still being copied down by the
    /// store pipeline (they cannot be evicted before the tiers their policy names have them),
    /// the writer waits, and the keys that found no room are tried again each time room may
    /// have come free: a job of the pipeline holding L1 shares gave them back, and as well a
    /// lookup released or expired, a reservation aborted, a chunk evicted
    /// ([`L1Manager::watch_room`]). It waits only while such jobs are under way: the pipeline's
    /// other jobs (the cascade's demotions, which carry copies of their bytes) free no room in
    /// L1, and a writer that finds L1 full of chunks held otherwise (by lookups, by other
    /// writers) is refused at once, and stops waiting once the last such job is over.
    ///
    /// What the writer is refused in the end counts in `tierkv_errors_total`, once per key;
    /// the tries before it count nothing.
    pub fn reserve_write_until(
        &self,
        owner: OwnerId,
        keys: &[ObjectKey],
        layout: &Layout,
        deadline: Instant,
        gave_up: impl Fn() -> bool,
    ) -> Result<Vec<Result<SlotHandle, KeyError>>, StorageError> {
        self.check(owner)?;
        let reserved = self.reserve_waiting(owner, keys, layout, deadline, gave_up);
        self.inner.l1.count_refused(&reserved);
        Ok(reserved?)
    }

    /// [`StorageManager::reserve_write_until`], counting no refusal.
    fn reserve_waiting(
        &self,
        owner: OwnerId,
        keys: &[ObjectKey],
        layout: &Layout,
        deadline: Instant,
        gave_up: impl Fn() -> bool,
    ) -> Result<Vec<Result<SlotHandle, KeyError>>, tierkv_l1::L1Error> {
        let l1 = &self.inner.l1;
        let holds = self.inner.store.queue().l1_holds();
        let mut seen = holds.returned();
        // Taken at the first refusal, so a writer that finds room watches nothing.
        let mut room: Option<RoomWatch<'_>> = None;
        let reserve = |keys: &[ObjectKey]| {
            l1.reserve_write_uncounted(owner, keys, layout, WriteMode::Create, Lifetime::Cached)
        };
        let mut results = reserve(keys)?;
        // Reservations go root first and stop at the first key without room: retry from it.
        while let Some(first) = results.iter().position(|r| r == &Err(KeyError::OutOfMemory)) {
            // `holding` is read before `returned`: a job gives its shares back, then counts as
            // returned, then stops holding. So a job that gave its shares back after this
            // writer's last try shows here, and the writer tries once more.
            let none_held = holds.holding() == 0;
            if Instant::now() >= deadline || (none_held && holds.returned() == seen) {
                break;
            }
            match &mut room {
                // Watching from now on, it tries once more at once: for room freed between its
                // try and its watch, which wakes no wait.
                None => room = Some(l1.watch_room()),
                Some(watch) => {
                    if !wait_for_room(watch, deadline, &gave_up) {
                        break;
                    }
                }
            }
            seen = holds.returned();
            let retried = reserve(&keys[first..])?;
            for (i, result) in retried.into_iter().enumerate() {
                let slot = &mut results[first + i];
                if slot == &Err(KeyError::OutOfMemory) {
                    *slot = result;
                } else if result.is_ok() {
                    // Refused for another reason the first time and free now: the answer
                    // already given stands, so the reservation is not kept.
                    let _ = l1.abort_write(owner, std::slice::from_ref(&keys[first + i]));
                }
            }
        }
        Ok(results)
    }

    /// [`StorageManager::reserve_write`] without the wait for the store pipeline: keys L1 has
    /// no room for now are refused (`OutOfMemory`). For a caller that must not block.
    pub fn reserve_write_now(
        &self,
        owner: OwnerId,
        keys: &[ObjectKey],
        layout: &Layout,
    ) -> Result<Vec<Result<SlotHandle, KeyError>>, StorageError> {
        self.check(owner)?;
        Ok(self.inner.l1.reserve_write(owner, keys, layout, WriteMode::Create, Lifetime::Cached)?)
    }

    /// The most chunks one store should reserve at a time. Without lower tiers a store is one
    /// reservation, and what does not fit is refused. With them, a store goes in windows of
    /// [`tierkv_core::store_window`] chunks (an eighth of L1), each finished before the next is
    /// reserved: L1 hands the earlier windows down (demoted under cascade and write-back, copied
    /// and freed under write-through and disk admission) to make room for the later ones, so
    /// every chunk of a store larger than L1 reaches the tiers below.
    pub fn store_window(&self) -> usize {
        if self.inner.router.is_empty() {
            return usize::MAX;
        }
        tierkv_core::store_window(self.inner.config.l1.slot_count() as usize)
    }

    /// Whether a store made now might wait: the store pipeline has jobs that hold L1 shares, and
    /// a writer that finds L1 full of chunks still being copied waits for them
    /// (`reserve_write`).
    pub fn store_may_wait(&self) -> bool {
        self.inner.store.queue().l1_holds().holding() > 0
    }

    /// Whether a read of the lookup may load from a tier below L1 (a wait of up to the lease
    /// time to live) by the time it reads: it holds chunks of its hit there, or it is not
    /// complete yet (whatever completes it, the maintenance tick included, may leave chunks of
    /// its hit there). `false` only where no read can: a complete lookup held in L1 alone, or
    /// one that is not open. The answer cannot turn from `false` to `true`, so a caller may
    /// decide up front how it reads.
    pub fn may_read_below(&self, id: LookupId) -> bool {
        self.inner.lookups.lock().get(&id).is_some_and(|lookup| match &lookup.stage {
            Stage::Done { below, .. } => below.as_ref().is_some_and(|held| !held.is_empty()),
            Stage::Deferred { .. } | Stage::Prefetching(_) => true,
            Stage::Failed { .. } => false,
        })
    }

    /// Pins a reserved slot for copying bytes in.
    pub fn write_access(
        &self,
        owner: OwnerId,
        key: &ObjectKey,
    ) -> Result<WriteAccess, StorageError> {
        self.check(owner)?;
        Ok(self.inner.l1.write_access(owner, key)?)
    }

    /// Makes written chunks visible; the store pipeline copies them down by policy.
    ///
    /// A request's keys are a chain, root first. L1 is handed them leaf first, so its eviction
    /// order loses a chain's tail before its parents: the part that stays is still a usable
    /// prefix (the prefix-aware choice, with any policy).
    pub fn finish_write(
        &self,
        owner: OwnerId,
        keys: &[ObjectKey],
    ) -> Result<Vec<Result<(), KeyError>>, StorageError> {
        self.finish_write_tracked(owner, keys).map(|(results, _)| results)
    }

    /// Like [`StorageManager::finish_write`], and returns a ticket that tells, once the store
    /// pipeline is done with them, how many of the finished chunks reached the disk tier.
    ///
    /// Each chunk is made visible and pinned for the store pipeline in one L1 step, so it cannot
    /// be evicted from L1 before every tier its store policy names has answered.
    pub fn finish_write_tracked(
        &self,
        owner: OwnerId,
        keys: &[ObjectKey],
    ) -> Result<(FinishResults, Arc<StoreTicket>), StorageError> {
        self.check(owner)?;
        let reversed: Vec<ObjectKey> = keys.iter().rev().copied().collect();
        if !self.inner.copies_at_write {
            // L1's observer (`Forward`) records them as stored here.
            let mut results = self.inner.l1.finish_write(owner, &reversed);
            results.reverse();
            let finished = results.iter().filter(|r| r.is_ok()).count() as u32;
            let ticket = StoreTicket::settled(Durability { durable: 0, not_durable: finished });
            return Ok((results, ticket));
        }
        let grant = self.inner.l1.finish_write_leased(owner, STORE_OWNER, &reversed);
        let finished: Vec<ObjectKey> = reversed
            .iter()
            .zip(&grant.results)
            .filter(|(_, r)| r.is_ok())
            .map(|(k, _)| *k)
            .collect();
        self.inner.stored_here(finished.iter());
        let mut results: Vec<Result<(), KeyError>> =
            grant.results.into_iter().map(|r| r.map(|_| ())).collect();
        results.reverse();
        let ticket = match grant.lease {
            Some(lease) => {
                let ticket = Arc::new(StoreTicket::default());
                let job = StoreJob::Finished {
                    keys: finished,
                    lease: Some(lease),
                    ticket: Some(Arc::clone(&ticket)),
                };
                self.inner.store.submit(job);
                ticket
            }
            None => StoreTicket::settled(Durability::default()),
        };
        Ok((results, ticket))
    }

    /// Drops write reservations; nothing of them was ever visible.
    pub fn abort_write(
        &self,
        owner: OwnerId,
        keys: &[ObjectKey],
    ) -> Result<Vec<Result<(), KeyError>>, StorageError> {
        self.check(owner)?;
        Ok(self.inner.l1.abort_write(owner, keys))
    }

    // ----- lookups -----

    /// Starts a prefix lookup of one full-attention group.
    pub fn submit_prefetch(
        &self,
        owner: OwnerId,
        keys: Vec<ObjectKey>,
        extra: tierkv_core::ExtraCount,
        layout: Layout,
    ) -> Result<LookupId, StorageError> {
        self.submit_lookup(LookupRequest::prefix(owner, extra, layout, keys))
    }

    /// Starts a lookup. Every L1 hit, in every group, is leased at once (rule 4: before anything
    /// is reserved for a load, so a load's evictions can never take the request's own hits). When
    /// L1 holds the whole hit the lookup completes here; otherwise the prefetch pipeline fills
    /// the gaps from the lower tiers.
    pub fn submit_lookup(&self, request: LookupRequest) -> Result<LookupId, StorageError> {
        self.check(request.owner)?;
        if request.groups.is_empty() || request.chunk_tokens == 0 {
            return Err(StorageError::Invalid(
                "a lookup needs at least one group and positive chunk_tokens".into(),
            ));
        }
        // Leaf first within each group, so the lookup's touches leave roots most recent.
        let order: Vec<(usize, usize)> = request
            .groups
            .iter()
            .enumerate()
            .flat_map(|(g, group)| (0..group.keys.len()).rev().map(move |i| (g, i)))
            .collect();
        let flat: Vec<ObjectKey> = order.iter().map(|(g, i)| request.groups[*g].keys[*i]).collect();
        if let Some(judge) = &self.inner.judge {
            self.inner.metrics.judge_samples_dropped(judge.looked_up(&flat));
        }
        let grant = self.inner.l1.reserve_read(request.owner, &flat, request.extra);
        let mut in_l1: Vec<Vec<bool>> =
            request.groups.iter().map(|g| vec![false; g.keys.len()]).collect();
        for ((g, i), result) in order.iter().zip(&grant.results) {
            in_l1[*g][*i] = result.is_ok();
        }
        let id = LookupId(self.inner.next_lookup.fetch_add(1, Ordering::Relaxed));
        let possible = request.groups.iter().map(|g| g.keys.len()).min().unwrap_or(0);
        let from_l1 = hit_of(&request, |g, i| in_l1[g][i]);
        let mut lookup = Lookup {
            owner: request.owner,
            request,
            l1_lease: grant.lease,
            in_l1,
            stage: Stage::Failed { why: Failure::NotStarted, expires: Duration::ZERO },
            returned: 0,
        };
        if from_l1 == possible || self.inner.router.is_empty() {
            self.inner.complete(&mut lookup, None);
        } else if lookup.request.defer_prefetch {
            let expires = self.inner.clock.now().saturating_add(self.inner.config.l1.lease_ttl);
            lookup.stage = Stage::Deferred { expires };
        } else {
            // Refused: the lookup failed and returned its L1 shares; nobody will ask for it.
            self.inner.start(&mut lookup)?;
        }
        self.inner.lookups.lock().insert(id, lookup);
        Ok(id)
    }

    /// Starts the prefetch of a lookup submitted with `defer_prefetch` (a query or a wait
    /// starts it too). Nothing for a lookup already started or complete. A lookup not started
    /// within `l1.lease_ttl` of its submission has failed (its L1 shares went back).
    pub fn start_prefetch(&self, id: LookupId) -> Result<(), StorageError> {
        let mut lookups = self.inner.lookups.lock();
        let lookup = lookups.get_mut(&id).ok_or(StorageError::UnknownLookup(id))?;
        self.inner.start_deferred(lookup);
        match &lookup.stage {
            Stage::Failed { why, .. } => Err(why.error(id)),
            _ => Ok(()),
        }
    }

    /// The lookup's result if it is complete, `None` if not; unlike
    /// [`StorageManager::query`], starts nothing and asks the prefetch pipeline nothing.
    pub fn result_if_complete(&self, id: LookupId) -> Result<Option<LookupResult>, StorageError> {
        let lookups = self.inner.lookups.lock();
        match &lookups.get(&id).ok_or(StorageError::UnknownLookup(id))?.stage {
            Stage::Done { result, .. } => Ok(Some(result.clone())),
            Stage::Failed { why, .. } => Err(why.error(id)),
            Stage::Deferred { .. } | Stage::Prefetching(_) => Ok(None),
        }
    }

    /// Chunks of the lookup's hit that L1 held when it was submitted (what a worker can read at
    /// once, before the prefetch of the rest completes).
    pub fn l1_hit(&self, id: LookupId) -> Result<usize, StorageError> {
        let lookups = self.inner.lookups.lock();
        let lookup = lookups.get(&id).ok_or(StorageError::UnknownLookup(id))?;
        Ok(hit_of(&lookup.request, |g, i| lookup.in_l1[g][i]))
    }

    /// The lookup's result if it is complete, `None` while it prefetches. Starts a deferred
    /// lookup's prefetch.
    pub fn query(&self, id: LookupId) -> Result<Option<LookupResult>, StorageError> {
        let mut lookups = self.inner.lookups.lock();
        let lookup = lookups.get_mut(&id).ok_or(StorageError::UnknownLookup(id))?;
        self.inner.start_deferred(lookup);
        if let Stage::Prefetching(request) = lookup.stage {
            match self.inner.prefetch.query(request) {
                None => return Ok(None),
                Some(Ok(prefetched)) => self.inner.complete(lookup, Some(prefetched)),
                Some(Err(e)) => self.inner.fail(lookup, Failure::Prefetch(e)),
            }
        }
        match &lookup.stage {
            Stage::Done { result, .. } => Ok(Some(result.clone())),
            Stage::Failed { why, .. } => Err(why.error(id)),
            Stage::Deferred { .. } | Stage::Prefetching(_) => Ok(None),
        }
    }

    /// Waits up to `timeout` for the lookup to complete. A wait that times out leaves the lookup
    /// open: its leases belong to its owner, and a later wait, query, release or the owner's
    /// departure settles them. Starts a deferred lookup's prefetch.
    pub fn wait(&self, id: LookupId, timeout: Duration) -> Result<LookupResult, StorageError> {
        let request = {
            let mut lookups = self.inner.lookups.lock();
            let lookup = lookups.get_mut(&id).ok_or(StorageError::UnknownLookup(id))?;
            self.inner.start_deferred(lookup);
            match &lookup.stage {
                Stage::Prefetching(request) => Some(*request),
                _ => None,
            }
        };
        if let Some(request) = request {
            let started = Instant::now();
            let outcome = self.inner.prefetch.wait(request, timeout);
            let mut lookups = self.inner.lookups.lock();
            let Some(lookup) = lookups.get_mut(&id) else {
                // Abandoned while we waited (released, or its owner left). The outcome is ours
                // now and nobody else will see it: settle it, or its lease would stay taken.
                drop(lookups);
                if let Ok(prefetched) = outcome {
                    self.inner.settle_abandoned(request, &prefetched);
                }
                return Err(StorageError::UnknownLookup(id));
            };
            let mut taken_by_another = false;
            if matches!(lookup.stage, Stage::Prefetching(_)) {
                match outcome {
                    Ok(prefetched) => self.inner.complete(lookup, Some(prefetched)),
                    Err(PrefetchError::Timeout) => return Err(PrefetchError::Timeout.into()),
                    // Another waiter (another reader's session) took the outcome first: it
                    // completes the lookup as soon as it has this lock.
                    Err(PrefetchError::Invalid(_)) => taken_by_another = true,
                    Err(e) => self.inner.fail(lookup, Failure::Prefetch(e)),
                }
            }
            drop(lookups);
            if taken_by_another {
                let deadline = deadline_after(started, timeout);
                while self.prefetching(id) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        self.query(id)?.ok_or(StorageError::Prefetch(PrefetchError::Timeout))
    }

    /// Whether the lookup is open and still prefetching.
    fn prefetching(&self, id: LookupId) -> bool {
        matches!(self.inner.lookups.lock().get(&id).map(|l| &l.stage), Some(Stage::Prefetching(_)))
    }

    /// Pins `key` of a completed lookup for reading by `reader`, who must still hold its share.
    pub fn read(
        &self,
        id: LookupId,
        reader: u8,
        key: &ObjectKey,
    ) -> Result<ReadAccess, StorageError> {
        let lease = self.lease_of(id, key)?;
        Ok(self.inner.l1.read_access(lease, reader, key)?)
    }

    /// Pins or loads every chunk of `keys` (each `chunk_bytes` long) of a completed lookup for
    /// `reader`, who must still hold its share; in order, all or nothing. A chunk in L1 is
    /// pinned; a chunk L1 had no room for is read from the lower tier that holds it, under the
    /// lookup's lock there, into a buffer of its own (a failed or late read fails the request:
    /// a miss for the engine, never partial bytes).
    pub fn read_hit(
        &self,
        id: LookupId,
        reader: u8,
        keys: &[ObjectKey],
        chunk_bytes: u64,
    ) -> Result<Vec<HitChunk>, StorageError> {
        let (leases, below, result_readers) = self.covering(id, reader, keys)?;
        let mut chunks: Vec<Option<HitChunk>> = Vec::with_capacity(keys.len());
        let mut from_below = Vec::new();
        for (i, (key, lease)) in keys.iter().zip(leases).enumerate() {
            match lease {
                Some(lease) => {
                    chunks.push(Some(HitChunk::L1(self.inner.l1.read_access(lease, reader, key)?)))
                }
                None => {
                    from_below.push(i);
                    chunks.push(None);
                }
            }
        }
        if let Some(held) = below.filter(|_| !from_below.is_empty()) {
            let wanted: Vec<ObjectKey> = from_below.iter().map(|i| keys[*i]).collect();
            let loaded =
                held.read(&wanted, chunk_bytes, self.inner.config.l1.lease_ttl, result_readers)?;
            for (i, bytes) in from_below.into_iter().zip(loaded) {
                chunks[i] = Some(HitChunk::Loaded(bytes));
            }
        }
        // Every key was checked above to be in L1 or held below: none is left unread.
        keys.iter()
            .zip(chunks)
            .map(|(key, chunk)| chunk.ok_or(StorageError::NotCovered { lookup: id, key: *key }))
            .collect()
    }

    /// Checks that `reader` may read every chunk of `keys` of the completed lookup `id`, as
    /// [`StorageManager::read_hit`] does before it reads any, and pins or loads nothing: a
    /// request read in parts is checked whole first, so a chunk outside the hit refuses all of it.
    pub fn check_hit(
        &self,
        id: LookupId,
        reader: u8,
        keys: &[ObjectKey],
    ) -> Result<(), StorageError> {
        self.covering(id, reader, keys).map(|_| ())
    }

    /// What [`StorageManager::read_hit`] reads `keys` from, or why `reader` may not read them.
    fn covering(
        &self,
        id: LookupId,
        reader: u8,
        keys: &[ObjectKey],
    ) -> Result<Covering, StorageError> {
        let lookups = self.inner.lookups.lock();
        let lookup = lookups.get(&id).ok_or(StorageError::UnknownLookup(id))?;
        let not_covered = |key: &ObjectKey| StorageError::NotCovered { lookup: id, key: *key };
        let Stage::Done { result, covered, below, .. } = &lookup.stage else {
            if let Stage::Deferred { .. } | Stage::Prefetching(_) = lookup.stage {
                return Err(StorageError::Pending(id));
            }
            return Err(keys.first().map_or(StorageError::UnknownLookup(id), not_covered));
        };
        if self.inner.expired_without_l1(lookup) {
            return Err(StorageError::Expired(id));
        }
        if u32::from(reader) >= result.readers {
            return Err(StorageError::NoSuchReader { lookup: id, reader, readers: result.readers });
        }
        if lookup.returned & (1u128 << reader) != 0 {
            return Err(StorageError::ShareReturned { lookup: id, reader });
        }
        let mut leases = Vec::with_capacity(keys.len());
        for key in keys {
            let lease = covered.get(key).copied();
            if lease.is_none() && below.as_ref().is_none_or(|b| b.tier_of(key).is_none()) {
                return Err(not_covered(key));
            }
            leases.push(lease);
        }
        Ok((leases, below.clone(), result.readers))
    }

    fn lease_of(&self, id: LookupId, key: &ObjectKey) -> Result<LeaseId, StorageError> {
        let lookups = self.inner.lookups.lock();
        let lookup = lookups.get(&id).ok_or(StorageError::UnknownLookup(id))?;
        match &lookup.stage {
            Stage::Done { covered, .. } => {
                covered.get(key).copied().ok_or(StorageError::NotCovered { lookup: id, key: *key })
            }
            _ => Err(StorageError::NotCovered { lookup: id, key: *key }),
        }
    }

    /// Returns the shares of `readers` on every chunk of the lookup's hit, an empty hit included.
    /// Returns whether that ended the lookup (every reader has returned its share). One reader
    /// may return its share while the lookup still prefetches (its session ended): the share
    /// goes back when the prefetch completes, or the lookup ends at once if it was the last.
    ///
    /// The whole request is checked before anything changes: a reader the lookup does not have,
    /// a reader that already returned its share, or a lease L1 refuses (past its deadline)
    /// refuses the request, and every share stays where it was.
    pub fn release(&self, id: LookupId, readers: Readers) -> Result<bool, StorageError> {
        let mut lookups = self.inner.lookups.lock();
        let lookup = lookups.get_mut(&id).ok_or(StorageError::UnknownLookup(id))?;
        if self.inner.expired_without_l1(lookup) {
            // Forgotten now rather than at the next tick: its tier locks go back with it.
            lookups.remove(&id);
            return Err(StorageError::Expired(id));
        }
        let (covered, readers_of) = match &lookup.stage {
            Stage::Done { covered, result, .. } => (Some(covered), result.readers),
            // A reader leaving before the hit is known (its session ended): its share goes
            // back once the prefetch completes (`Inner::complete`).
            Stage::Deferred { .. } | Stage::Prefetching(_)
                if matches!(readers, Readers::One(_)) =>
            {
                (None, lookup.request.extra.readers())
            }
            Stage::Deferred { .. } | Stage::Prefetching(_) => {
                return Err(StorageError::Pending(id));
            }
            Stage::Failed { why, .. } => return Err(why.error(id)),
        };
        let all = all_readers(readers_of);
        let mask = match readers {
            Readers::One(r) if u32::from(r) < readers_of => 1u128 << r,
            Readers::All => all,
            Readers::Set(set) if set != 0 && set & !all == 0 => set,
            Readers::One(reader) => {
                return Err(StorageError::NoSuchReader { lookup: id, reader, readers: readers_of });
            }
            Readers::Set(set) => {
                let outside = set & !all;
                let reader = if outside == 0 { 0 } else { outside.trailing_zeros() as u8 };
                return Err(StorageError::NoSuchReader { lookup: id, reader, readers: readers_of });
            }
        };
        if mask & lookup.returned != 0 {
            let reader = (mask & lookup.returned).trailing_zeros() as u8;
            return Err(StorageError::ShareReturned { lookup: id, reader });
        }
        let Some(covered) = covered else {
            lookup.returned |= mask;
            if lookup.returned != all {
                return Ok(false);
            }
            // The last reader left before the hit was known: nobody will read it.
            if let Some(lookup) = lookups.remove(&id) {
                drop(lookups);
                self.inner.settle(lookup);
            }
            return Ok(true);
        };
        let mut by_lease: HashMap<LeaseId, Vec<ObjectKey>> = HashMap::new();
        for (key, lease) in covered {
            by_lease.entry(*lease).or_default().push(*key);
        }
        // Every lease first, then the shares: a refusal of any leaves all of them untouched.
        for (lease, keys) in &by_lease {
            self.inner.l1.check_finish_read(*lease, Readers::Set(mask), Some(keys))?;
        }
        for (lease, keys) in &by_lease {
            // Checked under the lookup lock a moment ago; only a deadline passing in between can
            // refuse now, and then the lease's shares have come back already.
            let _ = self.inner.l1.finish_read(*lease, Readers::Set(mask), Some(keys));
        }
        lookup.returned |= mask;
        let ended = lookup.returned == all;
        if ended {
            lookups.remove(&id);
        }
        Ok(ended)
    }

    /// Chunks whose shares the lookup holds: its hit's chunks once complete (every group's),
    /// every chunk asked for while it prefetches; `None` when the lookup is not open. Past its
    /// deadline a complete lookup holds nothing, though the maintenance tick has yet to forget
    /// it: chunks under an expired lease count for nothing, nor do those held below L1 once
    /// their time to live is over.
    pub fn held_chunks(&self, id: LookupId) -> Option<usize> {
        let lookups = self.inner.lookups.lock();
        let lookup = lookups.get(&id)?;
        Some(match &lookup.stage {
            Stage::Done { covered, below, expires, .. } => {
                // Chunks by lease (a lookup has one, or a few), counted while their lease lives:
                // one pass over the hit and one look at each lease, on every lookup a session
                // makes (its allowance is checked then).
                let mut by_lease: Vec<(LeaseId, usize)> = Vec::new();
                for lease in covered.values() {
                    match by_lease.iter_mut().find(|(held, _)| held == lease) {
                        Some((_, chunks)) => *chunks += 1,
                        None => by_lease.push((*lease, 1)),
                    }
                }
                let in_l1: usize = by_lease
                    .into_iter()
                    .filter(|(lease, _)| self.inner.l1.lease_live(*lease))
                    .map(|(_, chunks)| chunks)
                    .sum();
                let below_l1 = match below {
                    Some(below) if self.inner.clock.now() < *expires => below.len(),
                    _ => 0,
                };
                in_l1 + below_l1
            }
            Stage::Deferred { .. } | Stage::Prefetching(_) => {
                lookup.request.groups.iter().map(|g| g.keys.len()).sum()
            }
            Stage::Failed { .. } => 0,
        })
    }

    /// Whether the lookup is open (not ended, released or forgotten).
    pub fn is_open(&self, id: LookupId) -> bool {
        self.inner.lookups.lock().contains_key(&id)
    }

    /// Returns every share the lookup still holds (chunks the engine will not read) and forgets
    /// it. A lookup still prefetching has its leases returned when the prefetch finishes.
    pub fn release_all(&self, id: LookupId) -> Result<(), StorageError> {
        let lookup =
            self.inner.lookups.lock().remove(&id).ok_or(StorageError::UnknownLookup(id))?;
        self.inner.settle(lookup);
        Ok(())
    }

    /// Returns everything `owner` holds: its lookups' shares and its write reservations. Called
    /// when a client disconnects.
    pub fn release_owner(&self, owner: OwnerId) -> tierkv_l1::OwnerReleased {
        let mine: Vec<Lookup> = {
            let mut lookups = self.inner.lookups.lock();
            let ids: Vec<LookupId> =
                lookups.iter().filter(|(_, l)| l.owner == owner).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| lookups.remove(&id)).collect()
        };
        for lookup in mine {
            if matches!(lookup.stage, Stage::Prefetching(_)) {
                self.inner.abandoned.lock().push(lookup);
            }
        }
        self.inner.l1.release_owner(owner)
    }

    // ----- removal and status -----

    /// Deletes chunks that no one holds, from every tier of this node. Returns how many each
    /// tier deleted, L1 first. The remote tier, shared with other nodes, deletes nothing (0):
    /// another node may be reading any of its keys (`RemoteStore::delete`).
    pub fn delete(&self, keys: &[ObjectKey]) -> Vec<usize> {
        let l1 = self.inner.l1.delete(keys, false).iter().filter(|r| r.is_ok()).count();
        std::iter::once(l1).chain(self.inner.router.tiers().map(|t| t.delete(keys))).collect()
    }

    /// Empties L1 of everything no one holds (with `force`, of everything). A clear of the node
    /// is this, then [`StorageManager::clear_tier`] of every tier below. The chunks it keeps
    /// because L1 leased them to the store pipeline for the tiers below (write-back and
    /// hand-down victims) are withdrawn: not written below, or deleted there once written, and
    /// freed in L1 as ever, so the cleared node does not fill up again from them. A chunk the
    /// pipeline is copying down that L1 keeps (a write-through store's, a disk admission) stays
    /// where it lands: L1 keeps it too, and a clear that races a store may keep what it stores.
    pub fn clear_l1(&self, force: bool) -> Cleared {
        let cleared = self.inner.l1.clear(force);
        self.inner.store.queue().clears().cleared();
        cleared
    }

    /// Empties lower tier `tier` (fastest first) of everything not locked; `None` if there is no
    /// such tier.
    pub fn clear_tier(&self, tier: usize) -> Option<usize> {
        self.inner.router.tier(tier).map(|t| t.clear())
    }

    /// How full every tier is, and what is in flight.
    pub fn status(&self) -> StorageStatus {
        StorageStatus {
            l1: self.inner.l1.usage(),
            tiers: self.inner.router.tiers().map(|t| (t.name().to_string(), t.usage())).collect(),
            open_lookups: self.inner.lookups.lock().len(),
            store_in_flight: self.inner.store.in_flight(),
            lookups: self.inner.metrics.totals(),
            disk_read_only: self.inner.disk.as_ref().and_then(|d| d.read_only()),
            remote_degraded: self.inner.remote.as_ref().and_then(|r| r.degraded()),
            judged_order: self.inner.judge.as_ref().map(|judge| judge.order().order()),
            below_orders: [
                self.inner.host.as_ref().map(|h| ("l2", h.order())),
                self.inner.disk.as_ref().map(|d| ("disk", d.order())),
            ]
            .into_iter()
            .flatten()
            .collect(),
        }
    }

    /// Stops every thread in order: no new work, prefetches drained, under the cascade L1's and
    /// L2's chunks handed down to disk, copies drained, tiers closed (the disk tier syncs).
    /// Idempotent.
    pub fn stop(&self) {
        self.inner.accepting.store(false, Ordering::Release);
        self.inner.prefetch.stop();
        self.inner.stop_maintenance.store(true, Ordering::Release);
        if let Some(thread) = self.maintenance.lock().take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
        if self.inner.hand_down_at_stop {
            self.inner.hand_down_to_disk();
        }
        self.inner.store.stop();
        for tier in self.inner.router.tiers() {
            tier.close();
        }
        self.inner.router.stop();
    }
}

impl Drop for StorageManager {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The hit of `request` if `available(group, index)` said which chunks are there.
fn hit_of(request: &LookupRequest, available: impl Fn(usize, usize) -> bool) -> usize {
    let present: Vec<Vec<bool>> = request
        .groups
        .iter()
        .enumerate()
        .map(|(g, group)| (0..group.keys.len()).map(|i| available(g, i)).collect())
        .collect();
    let groups: Vec<(GroupKind, &[bool])> =
        request.groups.iter().zip(&present).map(|(group, p)| (group.kind, p.as_slice())).collect();
    hit_chunks(&groups, request.chunk_tokens)
}

impl Inner {
    /// A clean stop under the cascade or write-back: what L1 (and under the cascade L2) holds
    /// goes down to the disk tier, the one a restart keeps, as it would have under
    /// write-through. Once: a second stop finds the tiers closed. L1 first, the hottest tier:
    /// its chunks are leased in eviction order and handed to the store pipeline for the disk
    /// (under write-back also for a remote tier that takes unread chunks; never for L2, which
    /// closes with the daemon), each freed once written.
    /// Then, under the cascade, L2's, coldest first, through its demoter (under write-back L2
    /// holds only copies of what is on disk). A batch at a time, the next once the pipeline has
    /// caught up (L2's victims are copies in memory); what is not down at `stop_drain_timeout`
    /// is lost.
    fn hand_down_to_disk(&self) {
        if self.handed_down.swap(true, Ordering::AcqRel) {
            return;
        }
        let started = Instant::now();
        let deadline = deadline_after(started, self.config.stop_drain_timeout);
        // Copies still on their way (to a remote tier) pin their chunks: let them finish first.
        self.wait_for_store_jobs(0, deadline);
        let mut from_l1 = 0;
        while Instant::now() < deadline && self.wait_for_store_jobs(1, deadline) {
            let clears = self.store.queue().clears().seen();
            let leased = self.l1.lease_eviction_candidates(
                WRITEBACK_OWNER,
                STOP_BATCH,
                EvictionReason::Stop,
            );
            let Some(lease) = leased.lease else { break };
            from_l1 += leased.keys.len();
            self.store.submit(StoreJob::HandDown { lease, keys: leased.keys, clears });
        }
        let mut from_l2 = 0;
        let cascade = self.config.store_policy == StorePolicy::Cascade;
        if let Some(host) = self.host.as_ref().filter(|_| cascade) {
            while Instant::now() < deadline && self.wait_for_store_jobs(STOP_BATCH as u64, deadline)
            {
                let batch = host.evict(STOP_BATCH);
                if batch == 0 {
                    break;
                }
                from_l2 += batch;
            }
        }
        let complete = self.wait_for_store_jobs(0, deadline);
        tracing::info!(
            from_l1,
            from_l2,
            seconds = started.elapsed().as_secs_f64(),
            complete,
            "handed L1's and L2's chunks down to disk for the restart"
        );
    }

    /// Waits until at most `jobs` store jobs are queued or copying; false if `deadline` passed
    /// first.
    fn wait_for_store_jobs(&self, jobs: u64, deadline: Instant) -> bool {
        let queue = self.store.queue();
        loop {
            let seen = queue.progress();
            if queue.outstanding() <= jobs {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            queue.wait_progress(seen, deadline);
        }
    }

    /// Settles a lookup whose hit is known: records which lease holds each chunk of the hit and
    /// returns the shares the hit does not need.
    ///
    /// The final hit counts only chunks whose shares are still held now: an L1 lease that passed
    /// its deadline while the prefetch loaded holds nothing, so its chunks are not part of it.
    /// `per_tier` has one count per tier (L1, then each lower tier) and adds up to the hit: a
    /// chunk position counts once, for the slowest tier any group needed it from.
    fn complete(&self, lookup: &mut Lookup, prefetched: Option<Prefetched>) {
        let request = &lookup.request;
        let l1_live = lookup.l1_lease.is_some_and(|lease| self.l1.lease_live(lease));
        let from_l1 = |g: usize, i: usize| l1_live && lookup.in_l1[g][i];
        // The prefetch's lease too: claimed after its deadline, it holds nothing any more.
        let below_live = prefetched
            .as_ref()
            .and_then(|p| p.lease)
            .is_some_and(|lease| self.l1.lease_live(lease));
        let from_below = |g: usize, i: usize| {
            below_live && prefetched.as_ref().is_some_and(|p| p.leased.get(g).is_some_and(|l| l[i]))
        };
        // Chunks of the hit that stayed in their tier (L1 had no room): no lease, a tier lock.
        let held_below = |g: usize, i: usize| {
            prefetched.as_ref().is_some_and(|p| {
                p.below.is_some()
                    && !p.leased.get(g).is_some_and(|l| l[i])
                    && p.sources.get(g).is_some_and(|s| s[i].is_some())
            })
        };
        if let Some(p) = &prefetched {
            self.remember_promoted_from_remote(request, p);
        }
        let n = hit_of(request, |g, i| from_l1(g, i) || from_below(g, i) || held_below(g, i));
        let n = prefetched.as_ref().map_or(n, |p| n.min(p.hit_chunks));
        let mut covered = HashMap::with_capacity(n);
        let mut unneeded_l1 = Vec::new();
        let mut unneeded_below = Vec::new();
        let mut unneeded_held = Vec::new();
        let mut per_tier = vec![0usize; 1 + self.router.len()];
        let mut slowest: Vec<Option<usize>> = vec![None; n];
        // Chunks the remote tier served: admission after reads does not send them back to it.
        let remote_tier = self.remote_tier.map(|t| 1 + t);
        let mut from_remote = HashSet::new();
        // Chunks of the hit read straight from their tier: each one's tier (fastest first) and
        // length. Their reads count toward admission as those of the chunks leased in L1.
        let mut read_below: HashMap<ObjectKey, (usize, u64)> = HashMap::new();
        for (g, group) in request.groups.iter().enumerate() {
            let needed = group.kind.needed(n, request.chunk_tokens);
            for (i, key) in group.keys.iter().enumerate() {
                let tier = if needed.contains(&i) && from_l1(g, i) {
                    covered.extend(lookup.l1_lease.map(|lease| (*key, lease)));
                    Some(0)
                } else if needed.contains(&i) && (from_below(g, i) || held_below(g, i)) {
                    let p = prefetched.as_ref();
                    let below =
                        p.and_then(|p| p.sources.get(g)?.get(i).copied().flatten()).unwrap_or(0);
                    if from_below(g, i) {
                        covered.extend(p.and_then(|p| p.lease).map(|lease| (*key, lease)));
                    } else {
                        read_below.insert(*key, (below, group.layout.size_bytes()));
                    }
                    let tier = 1 + below;
                    if Some(tier) == remote_tier {
                        from_remote.insert(*key);
                    }
                    Some(tier)
                } else {
                    if lookup.in_l1[g][i] && l1_live {
                        unneeded_l1.push(*key);
                    }
                    if from_below(g, i) {
                        unneeded_below.push(*key);
                    }
                    if held_below(g, i) {
                        unneeded_held.push(*key);
                    }
                    None
                };
                if let (Some(tier), Some(slot)) = (tier, slowest.get_mut(i)) {
                    *slot = Some(slot.map_or(tier, |t: usize| t.max(tier)));
                }
            }
        }
        for tier in slowest {
            if let Some(count) = per_tier.get_mut(tier.unwrap_or(0)) {
                *count += 1;
            }
        }
        if let (Some(lease), false) = (lookup.l1_lease, unneeded_l1.is_empty()) {
            let _ = self.l1.finish_read(lease, Readers::All, Some(&unneeded_l1));
        }
        if let (Some(lease), false) =
            (prefetched.as_ref().and_then(|p| p.lease), unneeded_below.is_empty())
        {
            let _ = self.l1.finish_read(lease, Readers::All, Some(&unneeded_below));
        }
        let below = prefetched.and_then(|p| p.below);
        if let Some(held) = &below {
            held.release(&unneeded_held);
        }
        let below = below.filter(|held| !held.is_empty());
        let possible = request.groups.iter().map(|g| g.keys.len()).min().unwrap_or(0);
        let hits: Vec<u64> = per_tier.iter().map(|n| *n as u64).collect();
        let held = below.as_ref().map_or(0, |b| b.len() as u64);
        self.metrics.lookup(possible as u64, &hits, held, request.chunk_tokens);
        read_below.retain(|key, _| !covered.contains_key(key));
        self.count_reads(covered.keys().copied(), &read_below, &from_remote);
        let readers = request.extra.readers();
        let result = LookupResult {
            hit_chunks: n,
            hit_tokens: n as u64 * request.chunk_tokens,
            readers,
            per_tier,
        };
        if lookup.returned != 0 {
            // Readers that left while it prefetched: their shares go back now.
            let gone = Readers::Set(lookup.returned);
            let mut by_lease: HashMap<LeaseId, Vec<ObjectKey>> = HashMap::new();
            for (key, lease) in &covered {
                by_lease.entry(*lease).or_default().push(*key);
            }
            for (lease, keys) in &by_lease {
                let _ = self.l1.finish_read(*lease, gone, Some(keys));
            }
        }
        let expires = self.clock.now().saturating_add(self.config.l1.lease_ttl);
        lookup.stage = Stage::Done { result, covered, below, expires };
        // The hit is known: what the request named past it is never looked at again. A miss
        // of a long prompt, kept until its deadline, keeps nothing of it.
        for (group, in_l1) in lookup.request.groups.iter_mut().zip(&mut lookup.in_l1) {
            group.keys.truncate(n);
            group.keys.shrink_to_fit();
            in_l1.truncate(n);
            in_l1.shrink_to_fit();
        }
    }

    /// Whether a complete lookup holds nothing in L1 (its chunks only below L1, or none: a
    /// miss) and has passed its deadline. One with L1 chunks expires with its lease, which L1
    /// itself refuses. A miss expires too, so a client that never returns the shares of its
    /// misses does not grow the record without bound; and so does a failed lookup.
    fn expired_without_l1(&self, lookup: &Lookup) -> bool {
        match &lookup.stage {
            Stage::Done { covered, expires, .. } => {
                covered.is_empty() && self.clock.now() >= *expires
            }
            Stage::Failed { expires, .. } => self.clock.now() >= *expires,
            // Failed at its deadline by the tick, which returns its L1 shares.
            Stage::Deferred { .. } | Stage::Prefetching(_) => false,
        }
    }

    /// Submits the lookup's prefetch: the chunks L1 lacks, from the lower tiers. A refusal fails
    /// the lookup.
    fn start(&self, lookup: &mut Lookup) -> Result<(), StorageError> {
        let prefetch = PrefetchRequest {
            owner: lookup.owner,
            extra: lookup.request.extra,
            chunk_tokens: lookup.request.chunk_tokens,
            max_promoted: lookup.request.max_promoted,
            groups: lookup
                .request
                .groups
                .iter()
                .zip(&lookup.in_l1)
                .map(|(group, in_l1)| GroupRequest {
                    kind: group.kind,
                    layout: group.layout.clone(),
                    keys: group.keys.clone(),
                    in_l1: in_l1.clone(),
                })
                .collect(),
        };
        match self.prefetch.submit(prefetch) {
            Ok(request) => {
                lookup.stage = Stage::Prefetching(request);
                Ok(())
            }
            Err(e) => {
                self.fail(lookup, Failure::Prefetch(e.clone()));
                Err(e.into())
            }
        }
    }

    /// Starts a deferred lookup's prefetch, or fails it if its deadline passed; nothing for any
    /// other lookup. A refused start fails the lookup, which says why.
    fn start_deferred(&self, lookup: &mut Lookup) {
        if let Stage::Deferred { expires } = lookup.stage {
            if self.clock.now() >= expires {
                self.fail(lookup, Failure::NotStarted);
            } else {
                let _ = self.start(lookup);
            }
        }
    }

    /// A lookup that cannot complete: its L1 shares go back.
    fn fail(&self, lookup: &mut Lookup, why: Failure) {
        if let Some(lease) = lookup.l1_lease.take() {
            let _ = self.l1.release_lease(lease);
        }
        let expires = self.clock.now().saturating_add(self.config.l1.lease_ttl);
        lookup.stage = Stage::Failed { why, expires };
        // Kept only to say why: the keys it named are not needed for that.
        for (group, in_l1) in lookup.request.groups.iter_mut().zip(&mut lookup.in_l1) {
            group.keys = Vec::new();
            *in_l1 = Vec::new();
        }
    }

    /// Returns every share a lookup holds, now or (still prefetching) when its prefetch ends.
    fn settle(&self, mut lookup: Lookup) {
        match &lookup.stage {
            Stage::Done { covered, .. } => {
                let leases: HashSet<LeaseId> = covered.values().copied().collect();
                for lease in leases {
                    let _ = self.l1.release_lease(lease);
                }
            }
            Stage::Prefetching(_) => {
                if let Some(lease) = lookup.l1_lease.take() {
                    let _ = self.l1.release_lease(lease);
                }
                self.abandoned.lock().push(lookup);
            }
            Stage::Deferred { .. } => {
                if let Some(lease) = lookup.l1_lease.take() {
                    let _ = self.l1.release_lease(lease);
                }
            }
            Stage::Failed { .. } => {}
        }
    }

    /// Chunks this node finished writing: no longer ones the remote tier served, so they go
    /// there as this node's own (it computed them: the remote tier most likely lost its copy).
    fn stored_here<'a>(&self, finished: impl Iterator<Item = &'a ObjectKey>) {
        if self.remote_tier.is_none() {
            return;
        }
        let mut reads = self.reads.lock();
        for key in finished {
            reads.stored_here(key);
        }
    }

    /// Settles the outcome of an abandoned lookup's prefetch `request` that a waiter claimed:
    /// what it promoted out of the remote tier is remembered (the lookup's request is still in
    /// `abandoned`, which the maintenance tick clears once the outcome is claimed), and its lease
    /// returned.
    fn settle_abandoned(&self, request: tierkv_prefetch::RequestId, prefetched: &Prefetched) {
        let abandoned = self.abandoned.lock();
        let lookup = abandoned
            .iter()
            .find(|lookup| matches!(lookup.stage, Stage::Prefetching(r) if r == request));
        if let Some(lookup) = lookup {
            self.remember_promoted_from_remote(&lookup.request, prefetched);
        }
        drop(abandoned);
        if let Some(lease) = prefetched.lease {
            let _ = self.l1.release_lease(lease);
        }
    }

    /// Remembers the chunks `prefetched` promoted into L1 out of the remote tier, read or not
    /// (a hit trimmed after the prefetch, a lookup abandoned while it prefetched): L1 keeps them
    /// cached, and nothing may send them back to the tier that holds them already (a
    /// write-back, a demotion, remote admission after reads).
    fn remember_promoted_from_remote(&self, request: &LookupRequest, prefetched: &Prefetched) {
        let Some(remote) = self.remote_tier else { return };
        let mut served = Vec::new();
        for (g, group) in request.groups.iter().enumerate() {
            for (i, key) in group.keys.iter().enumerate() {
                let promoted = prefetched.leased.get(g).is_some_and(|l| l.get(i) == Some(&true));
                let source = prefetched.sources.get(g).and_then(|s| s.get(i).copied().flatten());
                if promoted && source == Some(remote) {
                    served.push(*key);
                }
            }
        }
        if served.is_empty() {
            return;
        }
        let mut reads = self.reads.lock();
        for key in served {
            reads.served_by_remote(key);
        }
    }

    /// Disk and remote admission: counts the reads of a hit's chunks, those leased in L1
    /// (`in_l1`) and those read straight from the lower tier holding them (`below`: the tier and
    /// the chunk's length), and sends chunks that reached a threshold to that tier, from L1 or
    /// from the tier that holds them; never a chunk back to the remote tier that served it.
    fn count_reads(
        &self,
        in_l1: impl Iterator<Item = ObjectKey>,
        below: &HashMap<ObjectKey, (usize, u64)>,
        from_remote: &HashSet<ObjectKey>,
    ) {
        let disk = match self.config.store_policy {
            StorePolicy::DiskAdmission { min_reads } => Some(min_reads),
            _ => None,
        };
        // The tier named "remote", configured or given (`start_with_tiers`), as the store
        // pipeline finds it.
        let remote = match (self.remote_tier, self.config.remote_admission) {
            (Some(_), RemoteAdmission::AfterReads { min_reads }) => Some(min_reads),
            _ => None,
        };
        if disk.is_none() && remote.is_none() {
            // No admission counts reads; what the remote tier served is still remembered, so
            // that nothing writes it back there.
            if !from_remote.is_empty() {
                let mut reads = self.reads.lock();
                for key in from_remote {
                    reads.served_by_remote(*key);
                }
            }
            return;
        }
        let mut reads = self.reads.lock();
        reads.bound();
        let (mut to_disk, mut to_remote) = (Vec::new(), Vec::new());
        for key in in_l1 {
            let admit = reads.read(key, from_remote.contains(&key), disk, remote);
            if admit.disk {
                to_disk.push(key);
            }
            if admit.remote {
                to_remote.push(key);
            }
        }
        // Chunks held below go from their tier to each tier they are admitted to: by (from, to).
        let mut copies: HashMap<(usize, usize), Vec<(ObjectKey, u64)>> = HashMap::new();
        for (key, &(from, len)) in below {
            let admit = reads.read(*key, from_remote.contains(key), disk, remote);
            let targets =
                [self.disk_tier.filter(|_| admit.disk), self.remote_tier.filter(|_| admit.remote)];
            for to in targets.into_iter().flatten().filter(|&to| to != from) {
                copies.entry((from, to)).or_default().push((*key, len));
            }
        }
        drop(reads);
        if !to_disk.is_empty() {
            self.store.submit(StoreJob::Admit(to_disk));
        }
        if !to_remote.is_empty() {
            self.store.submit(StoreJob::AdmitRemote(to_remote));
        }
        // Their bytes are held in memory from their load until their store, as a cascade
        // victim's are: they count with those, within half the cap (the cascade's victims,
        // which have no other copy, keep the other half), in jobs of an eighth of it.
        let cap = demoted_cap(self.config.l1.slot_bytes) / 2;
        for ((from, to), items) in copies {
            let mut job = Vec::new();
            let mut job_bytes = 0;
            for (key, len) in items {
                if !job.is_empty() && job_bytes + len > cap / 4 {
                    let items = std::mem::take(&mut job);
                    self.admit_below(from, to, items, cap);
                    job_bytes = 0;
                }
                job.push((key, len));
                job_bytes += len;
            }
            if !job.is_empty() {
                self.admit_below(from, to, job, cap);
            }
        }
    }

    /// Sends an admission's copy of `items` from lower tier `from` to `to`, unless `cap` bytes
    /// are already on their way down: then it is not sent, the chunks stay where they are, and
    /// the read that admitted them is taken back, so that their next read admits them again.
    fn admit_below(&self, from: usize, to: usize, items: Vec<(ObjectKey, u64)>, cap: u64) {
        let keys: Vec<ObjectKey> = items.iter().map(|(key, _)| *key).collect();
        if !self.store.queue().send_admit_below(from, to, items, cap) {
            tracing::debug!(
                from,
                to,
                "an admission's copy from a lower tier waits for room below {cap} bytes on their way down"
            );
            let mut reads = self.reads.lock();
            for key in &keys {
                reads.unread(key);
            }
        }
    }

    /// One round of background work.
    fn tick(&self) {
        self.l1.expire_leases();
        let watermark = self.config.l1.watermark;
        if self.config.store_policy == StorePolicy::WriteBack {
            // Write back at most one batch at a time: leased victims still count as occupied.
            let usage = self.l1.usage();
            let occupied = usage.slots - usage.free_bytes / usage.slot_bytes.max(1);
            if self.store.in_flight() == 0 && occupied as f64 > watermark.high * usage.slots as f64
            {
                let target = (watermark.low * usage.slots as f64).floor() as u64;
                // Read before the lease: a clear after it withdraws the victims (`Clears`).
                let clears = self.store.queue().clears().seen();
                let victims = self.l1.lease_eviction_candidates(
                    WRITEBACK_OWNER,
                    (occupied - target) as usize,
                    EvictionReason::WriteBack,
                );
                if let Some(lease) = victims.lease {
                    self.store.submit(StoreJob::WriteBack { lease, keys: victims.keys, clears });
                }
            }
        } else {
            self.l1.evict_to_watermark();
        }
        if let Some(host) = &self.host {
            host.evict_to_watermark(self.config.l2_watermark.high, self.config.l2_watermark.low);
            host.publish_metrics();
        }
        if let Some(disk) = &self.disk {
            disk.maintain();
            disk.publish_metrics();
        }
        if let Some(remote) = &self.remote {
            // A degraded tier is probed in the background, so it recovers (and says so) without
            // waiting for a lookup to find it healthy again.
            let mut probed = self.remote_probed.lock();
            if remote.degraded().is_some() && probed.is_none_or(|t| t.elapsed() >= REMOTE_PROBE) {
                remote.probe();
                *probed = Some(Instant::now());
            }
            drop(probed);
            remote.publish_metrics();
        }
        self.l1.publish_metrics();
        // Abandoned lookups: return their prefetched leases once the prefetch is over.
        // Complete lookups whose every lease passed its deadline hold nothing any more: forget
        // them, so a session that never releases does not grow the record without bound.
        // A lookup holding chunks only below L1, or none (a miss), expires with the same time
        // to live as leases (dropping it returns its tier locks). A prefetch that finished
        // while nobody asked completes here, so its clock starts: otherwise the tier locks of a
        // hit held below L1 would stay taken for as long as its session lives.
        // A deferred lookup nobody started by its deadline fails, returning its L1 shares.
        self.lookups.lock().retain(|_, lookup| {
            if let Stage::Deferred { expires } = lookup.stage
                && self.clock.now() >= expires
            {
                self.fail(lookup, Failure::NotStarted);
            }
            if let Stage::Prefetching(request) = lookup.stage {
                match self.prefetch.query(request) {
                    None => {}
                    Some(Ok(prefetched)) => self.complete(lookup, Some(prefetched)),
                    Some(Err(e)) => self.fail(lookup, Failure::Prefetch(e)),
                }
            }
            match &lookup.stage {
                Stage::Done { covered, .. } if !covered.is_empty() => {
                    let leases: HashSet<LeaseId> = covered.values().copied().collect();
                    leases.into_iter().any(|lease| self.l1.lease_live(lease))
                }
                _ => !self.expired_without_l1(lookup),
            }
        });
        let mut abandoned = self.abandoned.lock();
        abandoned.retain(|lookup| {
            let Stage::Prefetching(request) = lookup.stage else { return false };
            match self.prefetch.query(request) {
                // Still loading; or claimed by a waiter, who settled it.
                None => self.prefetch.is_known(request),
                Some(outcome) => {
                    if let Ok(prefetched) = outcome {
                        self.remember_promoted_from_remote(&lookup.request, &prefetched);
                        if let Some(lease) = prefetched.lease {
                            let _ = self.l1.release_lease(lease);
                        }
                    }
                    false
                }
            }
        });
    }
}

/// Where this manager's lookup ids start: a random point below 2^52, so that the ids of a
/// daemon that restarted do not meet its earlier run's. A client that kept an id across the
/// restart (its session replaced) gets `unknown_lookup` for it, where ids counted from 1 again
/// would name another client's new lookup, and its retrieve would take that lookup's share.
fn first_lookup_id() -> u64 {
    use std::hash::BuildHasher;
    let random =
        std::collections::hash_map::RandomState::new().hash_one(std::time::SystemTime::now());
    (random >> 12).max(1)
}

/// The bitmap of every reader of a lookup with `readers` readers (1..=128).
fn all_readers(readers: u32) -> u128 {
    if readers >= 128 { u128::MAX } else { (1u128 << readers) - 1 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierkv_core::{ExtraCount, Layout, VecChunk};
    use tierkv_l1::{DeviceKind, L1Config};
    use tierkv_testkit::contract::{keys, payload};

    const CHUNK: u64 = 16 << 10;
    const OWNER: OwnerId = OwnerId(3);

    /// With no tier below L1 to copy to, a finished write is no work for the store pipeline:
    /// it is not woken (a thread wake-up per store, and a store that then counts as one that
    /// may wait). Both ways of finishing are checked: the manager's and L1's own.
    #[test]
    fn finished_writes_with_no_tier_below_leave_the_store_pipeline_idle() {
        for policy in [StorePolicy::WriteThrough, StorePolicy::DiskAdmission { min_reads: 2 }] {
            let l1 = L1Config { device: DeviceKind::Emulated, ..L1Config::new(8 * CHUNK, CHUNK) };
            let storage = StorageManager::start(StorageConfig {
                store_policy: policy,
                ..StorageConfig::new(l1)
            })
            .unwrap();
            let layout = Layout::bytes(CHUNK).unwrap();
            let chunks = keys(0..4);
            let (by_manager, by_l1) = chunks.split_at(2);
            assert!(
                storage.reserve_write(OWNER, &chunks, &layout).unwrap().iter().all(|r| r.is_ok())
            );
            for k in &chunks {
                storage.write_access(OWNER, k).unwrap().write_at(0, &payload(k, CHUNK)).unwrap();
            }
            assert!(storage.finish_write(OWNER, by_manager).unwrap().iter().all(|r| r.is_ok()));
            assert!(storage.l1().finish_write(OWNER, by_l1).iter().all(|r| r.is_ok()));
            assert!(!storage.store_may_wait(), "{policy:?}: a job is outstanding");
            storage.stop();
            assert_eq!(storage.inner.store.queue().progress(), 0, "{policy:?}: jobs were sent");
        }
    }

    /// A store that finishes while the pipeline stops (or after) has its copy's share returned:
    /// nothing will copy it, and the chunk must stay evictable.
    #[test]
    fn a_store_finished_as_the_pipeline_stops_returns_its_share() {
        let below = Arc::new(tierkv_testkit::FakeTier::new("disk", 64, CHUNK));
        let l1 = L1Config { device: DeviceKind::Emulated, ..L1Config::new(8 * CHUNK, CHUNK) };
        let config =
            StorageConfig { store_policy: StorePolicy::WriteThrough, ..StorageConfig::new(l1) };
        let tiers: Vec<Arc<dyn TierAdapter>> = vec![below];
        let clock = Arc::new(tierkv_core::ManualClock::new());
        let storage = StorageManager::start_with_tiers(config, clock, tiers).unwrap();
        let layout = Layout::bytes(CHUNK).unwrap();
        let chunk = keys(0..1);
        assert!(storage.reserve_write(OWNER, &chunk, &layout).unwrap().iter().all(|r| r.is_ok()));
        let k = chunk[0];
        storage.write_access(OWNER, &k).unwrap().write_at(0, &payload(&k, CHUNK)).unwrap();
        storage.inner.store.stop();
        let (results, ticket) = storage.finish_write_tracked(OWNER, &chunk).unwrap();
        assert!(results.iter().all(|r| r.is_ok()));
        assert!(matches!(storage.l1().presence(&k), tierkv_l1::Presence::Ready { shares: 0, .. }));
        assert_eq!(storage.l1().active_leases(), 0, "the copy's lease went back");
        assert!(!storage.store_may_wait(), "the refused copy still counts as holding L1 room");
        assert_eq!(ticket.outcome().map(|d| d.not_durable), Some(1), "nothing reached the disk");
    }

    /// Writes `chunks` (their payloads) into L1 and finishes them.
    fn write(storage: &StorageManager, chunks: &[ObjectKey]) {
        let layout = Layout::bytes(CHUNK).unwrap();
        assert!(storage.reserve_write(OWNER, chunks, &layout).unwrap().iter().all(|r| r.is_ok()));
        for k in chunks {
            storage.write_access(OWNER, k).unwrap().write_at(0, &payload(k, CHUNK)).unwrap();
        }
        assert!(storage.finish_write(OWNER, chunks).unwrap().iter().all(|r| r.is_ok()));
    }

    /// A lease time to live of "forever" is a deadline that never comes, never an overflow.
    #[test]
    fn an_endless_lease_ttl_or_backpressure_wait_is_no_panic() {
        let l1 = L1Config {
            device: DeviceKind::Emulated,
            lease_ttl: Duration::MAX,
            ..L1Config::new(8 * CHUNK, CHUNK)
        };
        let config = StorageConfig { store_backpressure: Duration::MAX, ..StorageConfig::new(l1) };
        let storage = StorageManager::start(config).unwrap();
        let layout = Layout::bytes(CHUNK).unwrap();
        let stored = keys(0..8);
        write(&storage, &stored);
        let lookup = LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout.clone(), stored);
        let lookup = storage.submit_lookup(lookup).unwrap();
        assert_eq!(storage.wait(lookup, Duration::MAX).unwrap().hit_chunks, 8);
        // L1 full of leased chunks, the pipeline idle: refused at once, its deadline no panic.
        let more = keys(8..9);
        let refused = storage.reserve_write(OWNER, &more, &layout).unwrap();
        assert_eq!(refused, vec![Err(KeyError::OutOfMemory)]);
        storage.release_all(lookup).unwrap();
    }

    /// A lookup whose prefetch failed says why until its deadline, then is forgotten: a client
    /// that never releases such lookups does not grow the record (nor its allowance's count).
    #[test]
    fn a_failed_lookup_is_forgotten_after_its_deadline() {
        let below = Arc::new(tierkv_testkit::FakeTier::new("disk", 64, CHUNK));
        let l1 = L1Config { device: DeviceKind::Emulated, ..L1Config::new(8 * CHUNK, CHUNK) };
        let ttl = l1.lease_ttl;
        let tiers: Vec<Arc<dyn TierAdapter>> = vec![below.clone()];
        let clock = Arc::new(tierkv_core::ManualClock::new());
        let mut config = StorageConfig::new(l1);
        config.prefetch.request_timeout = Duration::from_millis(100);
        let storage = StorageManager::start_with_tiers(config, clock.clone(), tiers).unwrap();
        // A tier that never answers: the prefetch is given up, and the lookup fails.
        below.hold();
        let layout = Layout::bytes(CHUNK).unwrap();
        let lookup = LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout, keys(0..100));
        let id = storage.submit_lookup(lookup).unwrap();
        assert!(matches!(
            storage.wait(id, Duration::from_secs(5)),
            Err(StorageError::Prefetch(PrefetchError::NoAnswer(_)))
        ));
        assert_eq!(storage.inner.lookups.lock()[&id].request.groups[0].keys.len(), 0);
        storage.inner.tick();
        assert!(storage.is_open(id), "kept to say why until its deadline");
        clock.advance(ttl + Duration::from_secs(1));
        storage.inner.tick();
        assert!(!storage.is_open(id), "a failed lookup stayed past its deadline");
    }

    /// A complete lookup keeps only the keys of its hit: a miss of a long prompt, kept until its
    /// deadline, holds none of the keys it named.
    #[test]
    fn a_complete_lookup_keeps_only_the_keys_of_its_hit() {
        let l1 = L1Config { device: DeviceKind::Emulated, ..L1Config::new(8 * CHUNK, CHUNK) };
        let storage = StorageManager::start(StorageConfig::new(l1)).unwrap();
        let layout = Layout::bytes(CHUNK).unwrap();
        write(&storage, &keys(0..2));
        let named = |id: LookupId| {
            let lookups = storage.inner.lookups.lock();
            let lookup = &lookups[&id];
            (lookup.request.groups[0].keys.len(), lookup.in_l1[0].len())
        };
        let hit = LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout.clone(), keys(0..1000));
        let hit = storage.submit_lookup(hit).unwrap();
        assert_eq!(storage.wait(hit, Duration::from_secs(5)).unwrap().hit_chunks, 2);
        assert_eq!(named(hit), (2, 2));
        let miss = LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout, keys(5000..6000));
        let miss = storage.submit_lookup(miss).unwrap();
        assert_eq!(storage.wait(miss, Duration::from_secs(5)).unwrap().hit_chunks, 0);
        assert_eq!(named(miss), (0, 0));
        assert_eq!(storage.l1_hit(hit).unwrap(), 2, "what L1 held is still told");
        storage.release_all(hit).unwrap();
        storage.release_all(miss).unwrap();
    }

    /// A cascade with an L1 of eight chunks over one tier, a fake disk, that holds tasks when
    /// told to.
    fn cascade_over_one_tier() -> (StorageManager, Arc<tierkv_testkit::FakeTier>) {
        let below = Arc::new(tierkv_testkit::FakeTier::new("disk", 64, CHUNK));
        let l1 = L1Config { device: DeviceKind::Emulated, ..L1Config::new(8 * CHUNK, CHUNK) };
        let config = StorageConfig { store_policy: StorePolicy::Cascade, ..StorageConfig::new(l1) };
        let tiers: Vec<Arc<dyn TierAdapter>> = vec![below.clone()];
        let clock = Arc::new(tierkv_core::ManualClock::new());
        (StorageManager::start_with_tiers(config, clock, tiers).unwrap(), below)
    }

    /// A victim whose bytes cannot be copied out of its slot (a device error) reaches no tier:
    /// it is counted as lost, and nothing half-copied goes down.
    #[test]
    fn a_victim_that_cannot_be_copied_out_of_l1_is_counted_and_sent_nowhere() {
        struct Broken;
        impl ChunkSource for Broken {
            fn len(&self) -> u64 {
                CHUNK
            }
            fn copy_to_host(&self, _: &mut [u8]) -> Result<(), tierkv_core::BufferError> {
                Err(tierkv_core::BufferError::Device("the device fell off the bus".into()))
            }
        }
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let (storage, below) = metrics::with_local_recorder(&recorder, cascade_over_one_tier);
        let down = DemoteDown {
            jobs: storage.inner.store.queue().clone(),
            cap: 64 * CHUNK,
            metrics: storage.inner.metrics.clone(),
            copy_failures: Arc::new(LogLimit::new(Duration::from_secs(60))),
        };
        let demoter = DemoteFromL1::to(&[0], None, None, None, &down).unwrap();
        let chunks = keys(0..2);
        demoter.demote(&chunks[0], &Broken);
        demoter.demote(&chunks[1], &VecChunk(payload(&chunks[1], CHUNK)));
        assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)));
        assert!(!below.contains(&chunks[0]) && below.contains(&chunks[1]));
        assert_eq!(errors_counted(&snapshotter, "demotion_copy_failed"), 1);
    }

    /// Cascade victims on their way down are copies in memory: past the cap a victim is dropped
    /// (a miss later) rather than queued, and the room comes back as the tier below takes them.
    #[test]
    fn demoted_bytes_on_their_way_are_capped_and_come_back_when_written() {
        let (storage, below) = cascade_over_one_tier();
        let queue = storage.inner.store.queue();
        let down = DemoteDown {
            jobs: queue.clone(),
            cap: 2 * CHUNK,
            metrics: storage.inner.metrics.clone(),
            copy_failures: Arc::new(LogLimit::new(Duration::from_secs(60))),
        };
        let chunks = keys(0..4);
        let bytes =
            |k: &ObjectKey| -> Box<dyn ChunkSource> { Box::new(VecChunk(payload(k, CHUNK))) };
        below.hold();
        down.send(0, chunks[0], bytes(&chunks[0]));
        let deadline = Instant::now() + Duration::from_secs(10);
        while below.held_tasks() == 0 {
            assert!(Instant::now() < deadline, "the pipeline never took the victim");
            std::thread::sleep(Duration::from_millis(1));
        }
        // The first is still on its way (held by the tier): one more fits, the next does not.
        down.send(0, chunks[1], bytes(&chunks[1]));
        down.send(0, chunks[2], bytes(&chunks[2]));
        below.release_held();
        assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)));
        down.send(0, chunks[3], bytes(&chunks[3])); // room again
        assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)));
        let kept: Vec<bool> = chunks.iter().map(|k| below.contains(k)).collect();
        assert_eq!(kept, [true, true, false, true]);
    }

    /// An admission's copy out of a lower tier holds its chunks' bytes in memory between their
    /// load and their store: counted with the demoted bytes from when it is sent, within their
    /// cap, and counted out however it ends (its load failed or hung, or it stored them).
    #[test]
    fn an_admission_from_below_counts_its_bytes_on_their_way_down_until_it_ends() {
        for (case, admitted) in [("fails", false), ("hangs", false), ("lands", true)] {
            let l2 = Arc::new(tierkv_testkit::FakeTier::new("l2", 64, CHUNK));
            let disk = Arc::new(tierkv_testkit::FakeTier::new("disk", 64, CHUNK));
            let held = keys(0..4);
            for key in &held {
                l2.insert(*key, payload(key, CHUNK));
            }
            let l1 = L1Config { device: DeviceKind::Emulated, ..L1Config::new(4 * CHUNK, CHUNK) };
            let config = StorageConfig {
                store_policy: StorePolicy::DiskAdmission { min_reads: 1 },
                store_timeout: Duration::from_millis(100),
                maintenance_interval: Duration::from_millis(5),
                ..StorageConfig::new(l1)
            };
            let tiers: Vec<Arc<dyn TierAdapter>> = vec![l2.clone(), disk.clone()];
            let clock = Arc::new(tierkv_core::ManualClock::new());
            let storage = StorageManager::start_with_tiers(config, clock, tiers).unwrap();
            let queue = storage.inner.store.queue();
            match case {
                "fails" => l2.fail_loads_of(&held),
                "hangs" => l2.hold_loads(),
                _ => {}
            }
            let layout = Layout::bytes(CHUNK).unwrap();
            let lookup = LookupRequest {
                max_promoted: 0,
                ..LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout, held.clone())
            };
            let id = storage.submit_lookup(lookup).unwrap();
            assert_eq!(storage.wait(id, Duration::from_secs(10)).unwrap().per_tier, [0, 4, 0]);
            storage.release(id, Readers::All).unwrap();
            assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)));
            assert_eq!(queue.demoted_bytes(), 0, "{case}: the admission's bytes stayed counted");
            assert!(held.iter().all(|k| disk.contains(k) == admitted), "{case}");
            l2.release_held();
        }
    }

    /// Past the cap of bytes on their way down, an admission's copy is not sent, unless nothing
    /// else is on its way.
    #[test]
    fn an_admission_from_below_past_the_cap_of_bytes_on_their_way_is_not_sent() {
        let (storage, below) = cascade_over_one_tier();
        let queue = storage.inner.store.queue();
        let chunks = keys(0..3);
        below.hold();
        // A victim on its way down, held by the tier.
        let victim: Box<dyn ChunkSource> = Box::new(VecChunk(payload(&chunks[0], CHUNK)));
        assert!(queue.send_demoted(0, chunks[0], victim, 2 * CHUNK));
        let deadline = Instant::now() + Duration::from_secs(10);
        while below.held_tasks() == 0 {
            assert!(Instant::now() < deadline, "the pipeline never took the victim");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!queue.send_admit_below(0, 0, vec![(chunks[1], CHUNK)], CHUNK), "past the cap");
        assert_eq!(queue.demoted_bytes(), CHUNK, "the refused copy stayed counted");
        // Within it, it goes (to the tier the chunk is in: nothing to copy, and it ends).
        assert!(queue.send_admit_below(0, 0, vec![(chunks[2], CHUNK)], 2 * CHUNK));
        below.release_held();
        assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)));
        assert_eq!(queue.demoted_bytes(), 0);
    }

    /// `tierkv_errors_total` of `reason`, as `snapshotter` finds it (a snapshot drains it).
    fn errors_counted(snapshotter: &metrics_util::debugging::Snapshotter, reason: &str) -> u64 {
        let seen = snapshotter.snapshot().into_vec();
        tierkv_testkit::metrics::counter(&seen, "tierkv_errors_total", &[("reason", reason)])
    }

    /// L1 outlives a stop (the daemon's data plane holds it), and what it evicts then still goes
    /// to its demoter. With the store pipeline stopped nothing takes the victim: it is dropped
    /// and counted at once, not queued to nobody, where it stayed counted in flight and its
    /// bytes on their way for good.
    #[test]
    fn a_demotion_after_the_stop_is_dropped_and_counted_not_queued_to_nobody() {
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        // A tier that is not the disk: a stop hands nothing down to it, L1 stays full.
        let below = Arc::new(tierkv_testkit::FakeTier::new("l2", 64, CHUNK));
        let l1 = L1Config { device: DeviceKind::Emulated, ..L1Config::new(8 * CHUNK, CHUNK) };
        let config = StorageConfig { store_policy: StorePolicy::Cascade, ..StorageConfig::new(l1) };
        let tiers: Vec<Arc<dyn TierAdapter>> = vec![below.clone()];
        let clock = Arc::new(tierkv_core::ManualClock::new());
        let storage = metrics::with_local_recorder(&recorder, || {
            StorageManager::start_with_tiers(config, clock, tiers).unwrap()
        });
        write(&storage, &keys(0..8));
        storage.stop();
        assert_eq!(storage.l1().usage().cached, 8);
        let layout = Layout::bytes(CHUNK).unwrap();
        let more = keys(8..9);
        let reserved =
            storage.l1().reserve_write(OWNER, &more, &layout, WriteMode::Create, Lifetime::Cached);
        assert!(reserved.unwrap().iter().all(|r| r.is_ok()), "L1 made room by evicting");
        let queue = storage.inner.store.queue();
        assert_eq!(storage.status().store_in_flight, 0, "a demotion was queued to nobody");
        assert_eq!(queue.demoted_bytes(), 0, "its bytes stayed counted");
        assert_eq!(
            errors_counted(&snapshotter, "demotion_dropped"),
            1,
            "the lost victim was not counted"
        );
        assert_eq!(below.usage().objects, 0);
    }

    /// A fake remote tier: a [`tierkv_testkit::FakeTier`] named "remote" whose promotions
    /// stay cached in L1, as the remote tier's do.
    struct KeptRemote(Arc<tierkv_testkit::FakeTier>);

    impl TierAdapter for KeptRemote {
        fn name(&self) -> &str {
            self.0.name()
        }
        fn submit_store(&self, items: Vec<tierkv_core::StoreItem>) -> tierkv_core::TaskId {
            self.0.submit_store(items)
        }
        fn submit_lookup_and_lock(&self, keys: Vec<ObjectKey>) -> tierkv_core::TaskId {
            self.0.submit_lookup_and_lock(keys)
        }
        fn submit_load(&self, items: Vec<tierkv_core::LoadItem>) -> tierkv_core::TaskId {
            self.0.submit_load(items)
        }
        fn unlock(&self, keys: &[ObjectKey]) {
            self.0.unlock(keys);
        }
        fn delete(&self, keys: &[ObjectKey]) -> usize {
            self.0.delete(keys)
        }
        fn clear(&self) -> usize {
            self.0.clear()
        }
        fn usage(&self) -> TierUsage {
            self.0.usage()
        }
        fn completions(&self) -> crossbeam_channel::Receiver<tierkv_core::Completion> {
            self.0.completions()
        }
        fn close(&self) {
            self.0.close();
        }
        fn keep_promoted(&self) -> bool {
            true
        }
    }

    /// A write-through storage manager over a fake remote tier (its copies kept in L1) that
    /// holds one chunk, `served`, which no node's L1 holds yet.
    fn served_by_remote(
        admission: RemoteAdmission,
    ) -> (StorageManager, Arc<tierkv_testkit::FakeTier>, ObjectKey) {
        let remote = Arc::new(tierkv_testkit::FakeTier::new("remote", 64, CHUNK));
        let served = keys(100..101)[0];
        remote.insert(served, payload(&served, CHUNK));
        let l1 = L1Config { device: DeviceKind::Emulated, ..L1Config::new(16 * CHUNK, CHUNK) };
        let config = StorageConfig {
            store_policy: StorePolicy::WriteThrough,
            remote_admission: admission,
            ..StorageConfig::new(l1)
        };
        let tiers: Vec<Arc<dyn TierAdapter>> = vec![Arc::new(KeptRemote(remote.clone()))];
        let clock = Arc::new(tierkv_core::ManualClock::new());
        let storage = StorageManager::start_with_tiers(config, clock, tiers).unwrap();
        (storage, remote, served)
    }

    /// A lookup released while it prefetched leaves what it promoted out of
    /// the remote tier cached in L1: remembered as the remote tier's all the same, so its later
    /// reads do not admit it back there.
    #[test]
    fn a_chunk_promoted_from_the_remote_tier_by_an_abandoned_lookup_is_not_stored_back() {
        let (storage, remote, served) =
            served_by_remote(RemoteAdmission::AfterReads { min_reads: 1 });
        let layout = Layout::bytes(CHUNK).unwrap();
        remote.hold_loads();
        let lookup = LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout.clone(), vec![served]);
        let id = storage.submit_lookup(lookup).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while remote.held_tasks() == 0 {
            assert!(Instant::now() < deadline, "the load never reached the remote tier");
            std::thread::sleep(Duration::from_millis(1));
        }
        storage.release_all(id).unwrap();
        remote.release_held();
        while !storage.inner.abandoned.lock().is_empty() {
            assert!(Instant::now() < deadline, "the abandoned lookup was never settled");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            matches!(storage.l1().presence(&served), tierkv_l1::Presence::Ready { .. }),
            "the promotion stays in L1"
        );
        // Redis let it go meanwhile: a store back to it would show.
        assert_eq!(remote.delete(&[served]), 1);
        let lookup = LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout, vec![served]);
        let id = storage.submit_lookup(lookup).unwrap();
        assert_eq!(storage.wait(id, Duration::from_secs(5)).unwrap().hit_chunks, 1);
        storage.release_all(id).unwrap();
        assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)));
        assert!(!remote.contains(&served), "a chunk the remote tier served was stored back to it");
    }

    /// Remote admission after reads never sends a chunk back to the remote tier that served
    /// it. That was a bit of the chunk's read count, and the counts start over when they pass
    /// their bound: a chunk the remote tier had served (kept in L1) was then admitted back to
    /// it after its next reads, as if this node had computed it.
    #[test]
    fn a_chunk_the_remote_tier_served_is_not_stored_back_once_the_read_counts_start_over() {
        let (storage, remote, served) =
            served_by_remote(RemoteAdmission::AfterReads { min_reads: 2 });
        // Counts for four chunks: the bound is passed in a few lookups.
        *storage.inner.reads.lock() = ReadCounts::new(4);
        let layout = Layout::bytes(CHUNK).unwrap();
        let read = |chunks: &[ObjectKey]| {
            let lookup =
                LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout.clone(), chunks.to_vec());
            let id = storage.submit_lookup(lookup).unwrap();
            assert_eq!(storage.wait(id, Duration::from_secs(5)).unwrap().hit_chunks, chunks.len());
            storage.release_all(id).unwrap();
        };
        let idle = || {
            assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)))
        };
        read(&[served]);
        assert!(
            matches!(storage.l1().presence(&served), tierkv_l1::Presence::Ready { .. }),
            "a promotion from the remote tier stays in L1"
        );
        // Redis let it go meanwhile: a store back to it would show.
        assert_eq!(remote.delete(&[served]), 1);
        // A chunk this node wrote goes to the remote tier at its second read.
        let local = keys(0..1);
        write(&storage, &local);
        read(&local);
        read(&local);
        idle();
        assert!(remote.contains(&local[0]), "admission after reads admits nothing");
        // Other chunks read: the counts pass their bound and start over.
        let others = keys(1..7);
        write(&storage, &others);
        read(&others);
        read(&[served]);
        read(&[served]);
        idle();
        assert!(!remote.contains(&served), "a chunk the remote tier served was stored back to it");
    }

    /// A chunk the remote tier served that this node then computes and stores itself goes to
    /// the remote tier as its own (Redis most likely lost it), whichever way the write is
    /// finished: through the manager, or through a plain `L1Manager::finish_write`, which only
    /// the L1 observer hears of.
    #[test]
    fn a_served_chunk_this_node_stores_again_goes_to_the_remote_tier_through_plain_l1_finishes() {
        let (storage, remote, served) = served_by_remote(RemoteAdmission::WriteThrough);
        let layout = Layout::bytes(CHUNK).unwrap();
        let lookup = LookupRequest::prefix(OWNER, ExtraCount::ZERO, layout.clone(), vec![served]);
        let id = storage.submit_lookup(lookup).unwrap();
        assert_eq!(storage.wait(id, Duration::from_secs(5)).unwrap().hit_chunks, 1);
        storage.release_all(id).unwrap();
        assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)));
        // Redis lets it go, and L1 too: this node computes it again.
        assert_eq!(remote.delete(&[served]), 1);
        assert_eq!(storage.delete(&[served]).iter().sum::<usize>(), 1);
        assert!(storage.reserve_write(OWNER, &[served], &layout).unwrap()[0].is_ok());
        storage
            .write_access(OWNER, &served)
            .unwrap()
            .write_at(0, &payload(&served, CHUNK))
            .unwrap();
        assert!(storage.l1().finish_write(OWNER, &[served])[0].is_ok());
        assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)));
        assert!(remote.contains(&served), "a chunk this node stored was kept from the remote tier");
    }

    /// An L2 of one slot whose victims the test sends down `storage`'s pipeline to tier 0.
    struct L2Above {
        host: HostStore,
        departed: Arc<Mutex<Vec<tierkv_core::Departing>>>,
        down: DemoteDown,
    }

    impl L2Above {
        fn new(storage: &StorageManager) -> Self {
            let host = HostStore::open(tierkv_l2::HostStoreConfig {
                memory: tierkv_l2::HostMemory::Plain,
                workers: 1,
                ..tierkv_l2::HostStoreConfig::new(CHUNK, CHUNK)
            })
            .unwrap();
            let departed: Arc<Mutex<Vec<tierkv_core::Departing>>> = Arc::default();
            let keep = Arc::clone(&departed);
            assert!(host.set_demoter(Box::new(move |_, departing| keep.lock().push(departing))));
            let down = DemoteDown {
                jobs: storage.inner.store.queue().clone(),
                cap: 64 * CHUNK,
                metrics: storage.inner.metrics.clone(),
                copy_failures: Arc::new(LogLimit::new(Duration::from_secs(60))),
            };
            L2Above { host, departed, down }
        }

        fn store(&self, key: ObjectKey) {
            self.host.store_now(key, &VecChunk(payload(&key, CHUNK))).unwrap();
        }

        /// Sends L2's victims so far down the pipeline.
        fn send_down(&self) {
            for departing in self.departed.lock().drain(..) {
                self.down.send(0, departing.key(), Box::new(departing));
            }
        }

        /// Stores k0, then k1 (k0 leaves) and sends k0 down to `below`, which holds its tasks:
        /// returns k0 once `below` holds its write.
        fn victim_on_its_way(&self, below: &tierkv_testkit::FakeTier) -> ObjectKey {
            let [k0, k1] = keys(0..2)[..] else { unreachable!() };
            below.hold();
            self.store(k0);
            self.store(k1); // k0 leaves
            self.send_down();
            let deadline = Instant::now() + Duration::from_secs(10);
            while below.held_tasks() == 0 {
                assert!(Instant::now() < deadline, "the pipeline never took the victim");
                std::thread::sleep(Duration::from_millis(1));
            }
            k0
        }
    }

    #[test]
    fn a_chunk_withdrawn_on_its_way_to_the_remote_tier_is_not_deleted_there() {
        // L2 over the shared remote tier (no disk): L2's victim is on its way there when this
        // node clears L2. The remote tier keeps what it got; other nodes may read it.
        let remote = Arc::new(tierkv_testkit::FakeTier::new("remote", 64, CHUNK));
        let l1 = L1Config { device: DeviceKind::Emulated, ..L1Config::new(8 * CHUNK, CHUNK) };
        let config = StorageConfig {
            store_policy: StorePolicy::Cascade,
            remote_admission: RemoteAdmission::AfterReads { min_reads: 1 },
            ..StorageConfig::new(l1)
        };
        let tiers: Vec<Arc<dyn TierAdapter>> = vec![remote.clone()];
        let clock = Arc::new(tierkv_core::ManualClock::new());
        let storage = StorageManager::start_with_tiers(config, clock, tiers).unwrap();
        let l2 = L2Above::new(&storage);
        let k0 = l2.victim_on_its_way(&remote);
        assert_eq!(l2.host.clear(), 2, "the clear withdraws k0 on its way, and takes k1");
        remote.release_held();
        assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)));
        assert!(remote.contains(&k0), "this node's clear deleted a shared value");
    }

    #[test]
    fn a_tier_that_panics_taking_back_a_withdrawn_chunk_still_ends_its_batch() {
        let (storage, below) = cascade_over_one_tier();
        let l2 = L2Above::new(&storage);
        let k0 = l2.victim_on_its_way(&below);
        assert_eq!(l2.host.delete(&[k0]), 1); // withdrawn while it is written
        below.panic_on_delete();
        below.release_held();
        assert!(
            storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)),
            "the batch never ended"
        );
    }

    /// A chunk L2 deleted while it was on its way down does not stay in the tier below: the
    /// pipeline drops it if the delete came before the write, and deletes it below if the delete
    /// came while the write was under way. A victim not deleted lands as ever.
    #[test]
    fn a_victim_deleted_above_on_its_way_down_does_not_stay_below() {
        let (storage, below) = cascade_over_one_tier();
        let l2 = L2Above::new(&storage);
        let idle = || {
            assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)))
        };
        let [k0, k1, k2, k3] = keys(0..4)[..] else { unreachable!() };

        // Deleted while its write is under way: the tier below has it once the write ends, and
        // then no more.
        assert_eq!(l2.victim_on_its_way(&below), k0);
        assert_eq!(l2.host.delete(&[k0]), 1);
        below.release_held();
        idle();
        assert!(!below.contains(&k0), "a chunk deleted while it was written stayed below");
        // Deleted before the pipeline got to it: never written (the tier below, holding every
        // task, gets none). The other lands.
        l2.store(k2); // k1 leaves
        l2.store(k3); // k2 leaves
        assert_eq!(l2.host.delete(&[k2]), 1);
        let first = l2.departed.lock().remove(0);
        below.hold();
        l2.send_down();
        idle();
        assert_eq!(below.held_tasks(), 0, "a chunk deleted on its way was sent below");
        below.release_held();
        l2.down.send(0, first.key(), Box::new(first));
        idle();
        assert!(below.contains(&k1), "a victim not deleted lands below");
        assert!(!below.contains(&k2), "a chunk deleted on its way was written below");
        assert_eq!(below.usage().objects, 1);
    }

    /// A write-back over one fake tier below L1 (an L2) that holds tasks when told to; L1 of
    /// eight chunks writes back past half full, down to a quarter. The maintenance thread
    /// ticks once an hour: the tests tick.
    fn write_back_over_one_tier() -> (StorageManager, Arc<tierkv_testkit::FakeTier>) {
        let below = Arc::new(tierkv_testkit::FakeTier::new("l2", 64, CHUNK));
        let l1 = L1Config {
            device: DeviceKind::Emulated,
            watermark: tierkv_l1::Watermark { high: 0.5, low: 0.25 },
            ..L1Config::new(8 * CHUNK, CHUNK)
        };
        let config = StorageConfig {
            store_policy: StorePolicy::WriteBack,
            maintenance_interval: Duration::from_secs(3600),
            ..StorageConfig::new(l1)
        };
        let tiers: Vec<Arc<dyn TierAdapter>> = vec![below.clone()];
        let clock = Arc::new(tierkv_core::ManualClock::new());
        (StorageManager::start_with_tiers(config, clock, tiers).unwrap(), below)
    }

    /// A clear does not fill the tiers below again from the write-back victims on their way
    /// down when it came: L1's clear keeps them (leased to the pipeline), the tier's clear
    /// misses them (not there yet), and once written they are deleted there again. L1 frees
    /// them once written, as ever: the node holds none of them.
    #[test]
    fn write_back_victims_on_their_way_at_a_clear_do_not_stay_below() {
        let (storage, below) = write_back_over_one_tier();
        let chunks = keys(0..6);
        write(&storage, &chunks);
        below.hold();
        storage.inner.tick(); // leases four victims (six to two) and sends them down
        let deadline = Instant::now() + Duration::from_secs(10);
        while below.held_tasks() == 0 {
            assert!(Instant::now() < deadline, "the pipeline never took the victims");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(storage.clear_l1(false).kept, 4, "the victims on their way are kept");
        assert_eq!(storage.clear_tier(0), Some(0), "the tier has none of them yet");
        below.release_held();
        assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)));
        let stayed: Vec<&ObjectKey> = chunks.iter().filter(|k| below.contains(k)).collect();
        assert!(stayed.is_empty(), "cleared chunks filled the tier below again: {stayed:?}");
        assert_eq!(storage.l1().usage().used_bytes, 0, "L1 kept a victim once written");
    }

    /// Victims leased before a clear and sent down after it are never written below.
    #[test]
    fn write_back_victims_leased_before_a_clear_are_not_written_after_it() {
        let (storage, below) = write_back_over_one_tier();
        let chunks = keys(0..4);
        write(&storage, &chunks);
        let clears = storage.inner.store.queue().clears().seen();
        let victims =
            storage.l1().lease_eviction_candidates(WRITEBACK_OWNER, 2, EvictionReason::WriteBack);
        assert_eq!(storage.clear_l1(false).kept, 2);
        below.hold();
        let lease = victims.lease.unwrap();
        storage.inner.store.submit(StoreJob::WriteBack { lease, keys: victims.keys, clears });
        assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)));
        assert_eq!(below.held_tasks(), 0, "a victim withdrawn before its write was sent below");
        assert_eq!(storage.l1().usage().used_bytes, 0, "the victims stayed in L1");
        // Leased after the clear: written as ever.
        below.release_held();
        write(&storage, &chunks);
        let clears = storage.inner.store.queue().clears().seen();
        let victims =
            storage.l1().lease_eviction_candidates(WRITEBACK_OWNER, 2, EvictionReason::WriteBack);
        let (lease, sent) = (victims.lease.unwrap(), victims.keys.clone());
        storage.inner.store.submit(StoreJob::WriteBack { lease, keys: victims.keys, clears });
        assert!(storage.inner.wait_for_store_jobs(0, Instant::now() + Duration::from_secs(10)));
        assert!(sent.iter().all(|k| below.contains(k)), "a victim after the clear was not written");
    }
}
