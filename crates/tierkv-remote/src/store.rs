//! The RemoteStore: the `TierAdapter` face over Redis, tasks run on the adapter's own tokio
//! runtime, completions sent on a crossbeam channel like every other tier's.
//!
//! The remote tier cannot lock: a lookup answers presence (`EXISTS`, one per key, all in flight
//! at once on the multiplexed connection) and a value may vanish (expiry, server eviction, a
//! failover that lost it) before the load. The load then reports that key absent and the
//! prefetch pipeline trims the hit to what arrived. The "locks" this adapter counts are a
//! ledger only, kept so the pipelines' bookkeeping (every lock returned) is checked on this tier
//! as on the others; they protect nothing.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, unbounded};
use parking_lot::Mutex;
use tierkv_core::{
    Bitmap, ChunkSource, Completion, LoadItem, LogLimit, ObjectKey, StoreItem, TaskId, TierAdapter,
    TierError, TierUsage,
};
use tokio::runtime::Runtime;
use tokio::sync::{Semaphore, watch};

use crate::config::RemoteConfig;
use crate::conn::Link;
use crate::error::{CallError, RemoteError};
use crate::format::{HEADER_BYTES, encode_header, redis_key, verify};
use crate::held::Held;
use tierkv_tier_metrics::TierMetrics;

use crate::metrics::{self, DegradedGauge};

struct Shared {
    config: RemoteConfig,
    link: Link,
    /// Values stored in flight, over every task.
    store_permits: Semaphore,
    /// Values loaded in flight, over every task: apart from the stores', since the permits are
    /// handed out in order and a load would otherwise wait behind every value of a store
    /// backlog, with no deadline.
    load_permits: Semaphore,
    done: Sender<Completion>,
    completions: Receiver<Completion>,
    metrics: TierMetrics,
    degraded_gauge: DegradedGauge,
    closed: AtomicBool,
    close_signal: watch::Sender<bool>,
    /// Lookup "locks" not yet returned: a ledger, see the module documentation.
    locks: Mutex<HashMap<ObjectKey, u64>>,
    /// Objects and bytes this node stored, did not delete, and that have not certainly expired
    /// (the cluster holds others' too).
    held: Held,
    /// Tasks spawned and not yet completed.
    running: AtomicU64,
    /// Values that failed verification: each counted, at most one a while logged.
    invalid_log: LogLimit,
    /// Store tasks not yet complete, each with the signal that it was given up on.
    abandonable: Mutex<HashMap<TaskId, watch::Sender<bool>>>,
}

/// How often a value that failed verification is logged at most (all are counted).
const INVALID_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The cross-node tier: a Redis Cluster or one Redis server.
pub struct RemoteStore {
    shared: Arc<Shared>,
    runtime: Mutex<Option<Runtime>>,
    next_task: AtomicU64,
}

impl RemoteStore {
    /// Starts the adapter's runtime. It does not wait for Redis: the first call connects, and
    /// until it can the tier is degraded and every call a miss.
    pub fn open(config: RemoteConfig) -> Result<Self, RemoteError> {
        config.validate()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads)
            .thread_name("tierkv-remote")
            .enable_all()
            .build()?;
        let (done, completions) = unbounded();
        let (close_signal, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            link: Link::new(config.clone()),
            store_permits: Semaphore::new(config.max_in_flight),
            load_permits: Semaphore::new(config.max_in_flight),
            held: Held::new(config.ttl),
            config,
            done,
            completions,
            metrics: metrics::register(),
            degraded_gauge: DegradedGauge::register(),
            closed: AtomicBool::new(false),
            close_signal,
            locks: Mutex::new(HashMap::new()),
            running: AtomicU64::new(0),
            invalid_log: LogLimit::new(INVALID_LOG_INTERVAL),
            abandonable: Mutex::new(HashMap::new()),
        });
        shared.publish();
        Ok(RemoteStore { shared, runtime: Mutex::new(Some(runtime)), next_task: AtomicU64::new(1) })
    }

    /// Why the tier is degraded (the last call could not reach Redis), if it is.
    pub fn degraded(&self) -> Option<String> {
        self.shared.link.degraded()
    }

    /// Sets the remote tier's gauges.
    pub fn publish_metrics(&self) {
        self.shared.publish();
    }

    /// Tries to reach Redis (a `PING` within the op deadline) in the background, without
    /// waiting, unless a probe is under way (one at a time: see `Link::claim_probe`): a degraded
    /// tier then notices its recovery without waiting for a lookup. The storage layer's
    /// maintenance calls it while the tier is degraded.
    pub fn probe(&self) {
        let shared = Arc::clone(&self.shared);
        if let Some(runtime) = self.runtime.lock().as_ref() {
            runtime.spawn(async move {
                if shared.link.probe_alone().await.is_some() {
                    shared.publish();
                }
            });
        }
    }

    /// The configuration the store was opened with.
    pub fn config(&self) -> &RemoteConfig {
        &self.shared.config
    }

    fn task(&self) -> TaskId {
        TaskId(self.next_task.fetch_add(1, Ordering::Relaxed))
    }

    /// Runs `work` on the runtime; when the adapter is closed (before or while it runs) the task
    /// completes with `failed` instead.
    fn spawn<W, F>(&self, work: W, failed: F)
    where
        W: Future<Output = Completion> + Send + 'static,
        F: FnOnce() -> Completion + Send + 'static,
    {
        // The runtime stays locked until the task is counted and spawned: `close` takes the
        // runtime under this lock, so it either finds the task counted (and waits for its
        // completion) or no runtime is left here (and the task fails at once). Checked apart,
        // a task could be spawned on a runtime already shut down, and never complete.
        let runtime = self.runtime.lock();
        let shared = Arc::clone(&self.shared);
        match runtime.as_ref() {
            Some(runtime) if !shared.closed.load(Ordering::Acquire) => {
                let mut closing = shared.close_signal.subscribe();
                shared.running.fetch_add(1, Ordering::AcqRel);
                runtime.spawn(async move {
                    let completion = tokio::select! {
                        biased;
                        _ = closing.wait_for(|c| *c) => None,
                        completion = work => Some(completion),
                    };
                    let completion = completion.unwrap_or_else(|| {
                        shared.metrics.failed("closed");
                        failed()
                    });
                    let _ = shared.done.send(completion);
                    shared.publish();
                    shared.running.fetch_sub(1, Ordering::AcqRel);
                });
            }
            _ => {
                shared.metrics.failed("closed");
                let _ = shared.done.send(failed());
            }
        }
    }
}

impl Shared {
    fn publish(&self) {
        let (objects, bytes) = self.held.now();
        self.metrics.publish(0, bytes, objects);
        self.degraded_gauge.set(self.link.degraded().is_some());
    }

    fn count_error(&self, e: &CallError) {
        self.metrics.failed(e.reason());
    }

    /// Stores every item, each in its own task (its copy, checksum and `SET` overlap the
    /// others'); the first failure fails the task (values already written stay: each verifies
    /// itself, so a partial task leaves nothing that could be served wrong). An item still
    /// waiting for a slot when the task is given up on (`abandoned`) is not sent. Hands the
    /// items back in their order.
    async fn store(
        self: Arc<Self>,
        items: Vec<StoreItem>,
        abandoned: watch::Receiver<bool>,
    ) -> (Result<(), TierError>, Vec<StoreItem>) {
        let limit = self.config.max_chunk_bytes;
        if let Some(item) = items.iter().find(|i| i.source.len() > limit) {
            self.metrics.failed("too_large");
            let bytes = item.source.len();
            return (Err(TierError::TooLarge { bytes, limit }), items);
        }
        let n = items.len();
        let mut set = tokio::task::JoinSet::new();
        for (i, item) in items.into_iter().enumerate() {
            let shared = Arc::clone(&self);
            let mut abandoned = abandoned.clone();
            set.spawn(async move {
                let permit = tokio::select! {
                    biased;
                    Ok(_) = abandoned.wait_for(|a| *a) => {
                        return (i, Err(StoreFailure::Tier(TierError::Abandoned)), item);
                    }
                    permit = shared.store_permits.acquire() => permit,
                };
                let Ok(_permit) = permit else {
                    return (i, Err(CallError::Closed.into()), item);
                };
                let name = redis_key(&shared.config.key_prefix, &item.key);
                let cmd =
                    match set_command(&name, &item.key, item.source.as_ref(), shared.config.ttl) {
                        Ok(cmd) => cmd,
                        Err(e) => return (i, Err(StoreFailure::Tier(e)), item),
                    };
                let result = shared.link.call::<()>(&cmd).await.map_err(StoreFailure::from);
                (i, result, item)
            });
        }
        let mut back: Vec<Option<StoreItem>> = (0..n).map(|_| None).collect();
        let (mut stored, mut bytes, mut failure, mut abandoned) = (0u64, 0u64, None, 0u64);
        // One count per failed store task and reason, not per value, as for lookups and loads:
        // a dead cluster is one event per call.
        let (mut call_failed, mut copy_failed) = (None, false);
        while let Some(joined) = set.join_next().await {
            match joined {
                Ok((i, result, item)) => {
                    match result {
                        Ok(()) => {
                            stored += 1;
                            bytes += item.source.len();
                        }
                        Err(e) => {
                            match &e {
                                StoreFailure::Call(e) => {
                                    call_failed.get_or_insert(e.reason());
                                }
                                StoreFailure::Tier(TierError::Abandoned) => abandoned += 1,
                                // The source's bytes could not be read (a failed device copy).
                                StoreFailure::Tier(_) => copy_failed = true,
                            }
                            failure.get_or_insert(e);
                        }
                    }
                    back[i] = Some(item);
                }
                Err(e) => {
                    failure.get_or_insert(StoreFailure::Call(CallError::Unavailable(format!(
                        "task failed: {e}"
                    ))));
                }
            }
        }
        let items = back.into_iter().flatten().collect();
        if let Some(reason) = call_failed {
            self.metrics.failed(reason);
        }
        if copy_failed {
            self.metrics.failed("copy");
        }
        if abandoned > 0 {
            // One count per task given up on, as for any failed task.
            self.metrics.failed("abandoned");
        }
        self.held.stored(stored, bytes);
        self.metrics.stored(stored, bytes);
        let result = match failure {
            None => Ok(()),
            Some(StoreFailure::Tier(e)) => Err(e),
            Some(StoreFailure::Call(e)) if e.reason() == "oom" => {
                Err(TierError::NoSpace(e.to_string()))
            }
            Some(StoreFailure::Call(e)) => Err(TierError::Io(format!("remote store failed: {e}"))),
        };
        (result, items)
    }

    /// Which keys exist: one `EXISTS` per key, all in flight at once. A failure is a miss.
    async fn lookup(self: Arc<Self>, keys: Vec<ObjectKey>) -> Bitmap {
        let mut set = tokio::task::JoinSet::new();
        for (i, key) in keys.iter().enumerate() {
            let shared = Arc::clone(&self);
            let name = redis_key(&self.config.key_prefix, key);
            set.spawn(async move {
                let mut cmd = redis::cmd("EXISTS");
                cmd.arg(name);
                (i, shared.link.call::<u64>(&cmd).await)
            });
        }
        let mut found = Bitmap::new(keys.len());
        let mut error = None;
        while let Some(joined) = set.join_next().await {
            match joined {
                Ok((i, Ok(n))) => {
                    found.set(i, n > 0);
                }
                Ok((_, Err(e))) => {
                    error.get_or_insert(e);
                }
                Err(_) => {}
            }
        }
        // One count per failed lookup task, not per key: a dead cluster is one event per call.
        if let Some(e) = error {
            self.count_error(&e);
        }
        let mut locks = self.locks.lock();
        for i in found.iter_ones() {
            *locks.entry(keys[i]).or_insert(0) += 1;
        }
        found
    }

    /// Loads every item, each in its own task: read at most the value's expected length and a
    /// byte (see [`load_command`]), verify it against its key, copy its payload into the sink,
    /// overlapping the others'. A value absent, unreachable or that does not verify is a miss
    /// (counted), never copied. Hands the items back in their order.
    async fn load(self: Arc<Self>, items: Vec<LoadItem>) -> (Bitmap, Vec<LoadItem>) {
        let n = items.len();
        let mut set = tokio::task::JoinSet::new();
        for (i, mut item) in items.into_iter().enumerate() {
            let shared = Arc::clone(&self);
            set.spawn(async move {
                let Ok(_permit) = shared.load_permits.acquire().await else {
                    return (i, Err(CallError::Closed), item);
                };
                let cmd = load_command(&shared.config.key_prefix, &item.key, item.sink.len());
                let value = match shared.link.call::<Option<Vec<u8>>>(&cmd).await {
                    // GETRANGE answers an absent key with an empty string.
                    Ok(Some(value)) if !value.is_empty() => value,
                    Ok(_) => return (i, Ok(false), item),
                    Err(e) => return (i, Err(e), item),
                };
                let loaded = match verify(&item.key, &value, item.sink.len()) {
                    Ok(payload) => {
                        let copied = item.sink.write_from(payload).is_ok();
                        if !copied {
                            shared.metrics.failed("copy");
                        }
                        copied
                    }
                    Err(invalid) => {
                        // At most the expected value and one byte were read: more is "longer".
                        let expected = HEADER_BYTES as u64 + item.sink.len();
                        if let Some(left_out) = shared.invalid_log.admit() {
                            tracing::warn!(
                                key = ?item.key,
                                why = invalid.reason(),
                                read = value.len(),
                                expected,
                                longer = value.len() as u64 > expected,
                                left_out,
                                "a remote value failed verification: a miss (at most one such \
                                 warning in {INVALID_LOG_INTERVAL:?}; left_out: those since the \
                                 last, all counted in tierkv_errors_total)"
                            );
                        }
                        shared.metrics.checksum_failed(1);
                        shared.metrics.failed(invalid.reason());
                        false
                    }
                };
                (i, Ok(loaded), item)
            });
        }
        let mut back: Vec<Option<LoadItem>> = (0..n).map(|_| None).collect();
        let mut loaded = Bitmap::new(n);
        let (mut bytes, mut error) = (0u64, None);
        while let Some(joined) = set.join_next().await {
            let Ok((i, result, item)) = joined else { continue };
            match result {
                Ok(true) => {
                    loaded.set(i, true);
                    bytes += item.sink.len();
                }
                Ok(false) => {}
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
            back[i] = Some(item);
        }
        // One count per failed task, not per key: a dead cluster is one event per call.
        if let Some(e) = error {
            self.count_error(&e);
        }
        self.metrics.loaded(loaded.count_ones() as u64, bytes);
        // A sink lost to a panicked task cannot be handed back: the bitmap is rebuilt over the
        // sinks that are, so that bit `i` still names `sinks[i]` (a caller reading bit `i` as
        // another key's would take an unwritten sink for a loaded one).
        let mut bits = Vec::with_capacity(n);
        let mut sinks = Vec::with_capacity(n);
        for (i, item) in back.into_iter().enumerate() {
            if let Some(item) = item {
                bits.push(loaded.get(i));
                sinks.push(item);
            }
        }
        (Bitmap::from_bools(bits), sinks)
    }
}

/// The read of a load of `key` into a sink of `len` bytes: `GETRANGE` of the header, the
/// payload and one byte more, never more. A value longer than the object it should be (a foreign
/// or damaged key, however large) costs those bytes, not its own size, and the byte past the end
/// tells it apart from the exact value (`verify` calls it `wrong_length`). One round trip, as a
/// `GET`; an absent key reads as an empty string.
fn load_command(prefix: &str, key: &ObjectKey, len: u64) -> redis::Cmd {
    let mut cmd = redis::cmd("GETRANGE");
    // The end offset is inclusive: bytes 0..=HEADER+len are HEADER+len+1 bytes.
    cmd.arg(redis_key(prefix, key)).arg(0).arg(HEADER_BYTES as u64 + len);
    cmd
}

/// Why one value of a store task failed.
enum StoreFailure {
    /// Reading the source failed.
    Tier(TierError),
    /// Redis did not take it.
    Call(CallError),
}

impl From<CallError> for StoreFailure {
    fn from(e: CallError) -> Self {
        StoreFailure::Call(e)
    }
}

/// The `SET` of a store item, its value (header and payload) written straight into the
/// command's buffer: one copy of the chunk, as a plain `SET` of the bytes makes.
fn set_command(
    name: &str,
    key: &ObjectKey,
    source: &dyn ChunkSource,
    ttl: Option<Duration>,
) -> Result<redis::Cmd, TierError> {
    use std::io::Write;

    use redis::RedisWrite;

    let mut cmd = redis::cmd("SET");
    cmd.arg(name);
    let len = source.len() as usize;
    match source.host_bytes() {
        Some(payload) if payload.len() == len => {
            let mut header = [0u8; HEADER_BYTES];
            encode_header(key, payload, &mut header);
            cmd.reserve_space_for_args([HEADER_BYTES + len]);
            let mut arg = cmd.writer_for_next_arg();
            arg.write_all(&header).map_err(|e| TierError::Io(e.to_string()))?;
            arg.write_all(payload).map_err(|e| TierError::Io(e.to_string()))?;
        }
        // A source that is not host memory (a device slot) is staged once.
        _ => {
            cmd.arg(value_of(key, source)?);
        }
    }
    if let Some(ttl) = ttl {
        cmd.arg("PX").arg(ttl.as_millis().max(1) as u64);
    }
    Ok(cmd)
}

/// The value of a store item: header and payload, read from the source in one copy.
fn value_of(key: &ObjectKey, source: &dyn ChunkSource) -> Result<Vec<u8>, TierError> {
    let len = source.len() as usize;
    let mut value = vec![0u8; HEADER_BYTES + len];
    source.read_into(&mut value[HEADER_BYTES..])?;
    let (header, payload) = value.split_at_mut(HEADER_BYTES);
    encode_header(key, payload, header);
    Ok(value)
}

impl TierAdapter for RemoteStore {
    fn name(&self) -> &str {
        "remote"
    }

    fn submit_store(&self, items: Vec<StoreItem>) -> TaskId {
        let task = self.task();
        let shared = Arc::clone(&self.shared);
        // The sources go back in the completion; a task cut short by `close` hands back those
        // it has not yet passed to its value tasks.
        let items = Arc::new(Mutex::new(Some(items)));
        let give_back = Arc::clone(&items);
        let (abandon, abandoned) = watch::channel(false);
        self.shared.abandonable.lock().insert(task, abandon);
        let work = async move {
            let sources = items.lock().take().unwrap_or_default();
            let (result, sources) = Arc::clone(&shared).store(sources, abandoned).await;
            shared.abandonable.lock().remove(&task);
            Completion::Stored { task, result, sources }
        };
        let forget = Arc::clone(&self.shared);
        let failed = move || {
            forget.abandonable.lock().remove(&task);
            Completion::Stored {
                task,
                result: Err(TierError::Closed),
                sources: give_back.lock().take().unwrap_or_default(),
            }
        };
        self.spawn(work, failed);
        task
    }

    fn submit_lookup_and_lock(&self, keys: Vec<ObjectKey>) -> TaskId {
        let task = self.task();
        let n = keys.len();
        let shared = Arc::clone(&self.shared);
        let work = async move { Completion::LookedUp { task, locked: shared.lookup(keys).await } };
        self.spawn(work, move || Completion::LookedUp { task, locked: Bitmap::new(n) });
        task
    }

    fn submit_load(&self, items: Vec<LoadItem>) -> TaskId {
        let task = self.task();
        let shared = Arc::clone(&self.shared);
        let items = Arc::new(Mutex::new(Some(items)));
        let give_back = Arc::clone(&items);
        let work = async move {
            let sinks = items.lock().take().unwrap_or_default();
            let (loaded, sinks) = shared.load(sinks).await;
            Completion::Loaded { task, loaded, sinks }
        };
        // One bit per sink handed back: none once the work has taken them (they dropped with
        // its value tasks), all of them if it never started.
        let failed = move || {
            let sinks = give_back.lock().take().unwrap_or_default();
            Completion::Loaded { task, loaded: Bitmap::new(sinks.len()), sinks }
        };
        self.spawn(work, failed);
        task
    }

    /// The task's values still waiting for a slot are not sent; those in flight end within
    /// the op deadline.
    fn abandon(&self, task: TaskId) {
        if let Some(abandon) = self.shared.abandonable.lock().get(&task) {
            let _ = abandon.send(true);
        }
    }

    fn unlock(&self, keys: &[ObjectKey]) {
        let mut locks = self.shared.locks.lock();
        for key in keys {
            if let Some(n) = locks.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    locks.remove(key);
                }
            }
        }
    }

    /// Deletes nothing, and says so (0): the remote tier is shared by every node's daemon, and
    /// a key names its bytes, whoever stored them (equal keys are equal bytes), so a key this
    /// node would delete may be one another node stored, or one it is loading or about to look
    /// up; "only what this node wrote" is no safer, since another node may have written or
    /// fetched the same key since. Values leave by their TTL or the server's eviction; an
    /// operator who wants them gone deletes them in Redis. So no caller (a `StorageManager`
    /// deleting from every tier, the store pipeline taking back a chunk deleted above) can
    /// take a chunk from another node through this tier.
    fn delete(&self, _keys: &[ObjectKey]) -> usize {
        0
    }

    /// Deletes nothing: the remote tier is shared with other nodes, which may be reading what
    /// this node would clear. Values leave by their TTL or the server's eviction (an operator
    /// who wants the tier empty flushes Redis).
    fn clear(&self) -> usize {
        0
    }

    /// What this node stored and may still be there (see `held.rs`): an upper bound.
    fn usage(&self) -> TierUsage {
        let (objects, used_bytes) = self.shared.held.now();
        TierUsage {
            capacity_bytes: 0,
            used_bytes,
            objects,
            locks: self.shared.locks.lock().values().sum(),
        }
    }

    fn completions(&self) -> Receiver<Completion> {
        self.shared.completions.clone()
    }

    /// A chunk fetched over the network stays in L1: the next lookup of it is local.
    fn keep_promoted(&self) -> bool {
        true
    }

    fn close(&self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.close_signal.send_replace(true);
        if let Some(runtime) = self.runtime.lock().take() {
            // Every task selects on the close signal and completes at once; wait for their
            // completions (briefly), then let the runtime go without blocking, which is allowed
            // on any thread, an async one included.
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            while self.shared.running.load(Ordering::Acquire) > 0
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            runtime.shutdown_background();
        }
        self.shared.publish();
    }
}

impl Drop for RemoteStore {
    fn drop(&mut self) {
        self.close();
    }
}

impl RemoteStore {
    /// How long one call may take (the op deadline).
    pub fn op_timeout(&self) -> Duration {
        self.shared.link.op_timeout()
    }
}
