//! The DiskStore: segment files, the in-memory index rebuilt at open, worker threads, and the
//! `TierAdapter` face.
//!
//! Writes append records to one active segment, one record at a time, each write finishing
//! before the next starts; so after a crash only the last record of a segment can be torn, and
//! the scan at open stops there. The writes run on one write thread (`tierkv-disk-write`) while
//! the storing I/O thread copies and checksums the next record into another buffer, so copy,
//! checksum and write overlap; a segment is sealed only with no write in flight. A load of
//! several records is split over the I/O threads, so its reads are in flight at once. Records become visible in the index only after their whole
//! store task was written (and synced, under `FsyncPolicy::Always`). Loads read a record while
//! its segment is pinned, verify header, epoch, key and payload checksum, and only then copy
//! into the caller's sink. Eviction drops a whole sealed segment that holds no locked and no
//! pinned record, and reuses its file under a new epoch.

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, unbounded};
use parking_lot::Mutex;
use tierkv_core::policy::EvictionPolicy;
use tierkv_core::{
    AlignedBuf, Bitmap, ChunkSink, ChunkSource, Completion, LoadItem, ObjectKey, StoreItem, TaskId,
    TierAdapter, TierError, TierUsage,
};

use crate::config::{DiskStoreConfig, FsyncPolicy, ReadMode};
use crate::error::DiskError;
use crate::format::{BLOCK, Header, Superblock, payload_checksum, record_bytes};
use crate::metrics::{DiskMetrics, Failure};
use crate::segment::{
    DirLock, IoMode, SegmentFile, probe, secure, segment_id, segment_path, sync_dir,
};

/// How often a read-only store tries to become writable again (`DiskStore::maintain`).
pub const WRITABLE_RETRY: Duration = Duration::from_secs(2);

/// Where a record lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Loc {
    segment: u32,
    offset: u64,
    len: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    /// No records: never created, or failed to initialise.
    Free,
    /// Being initialised for a new epoch by the writer.
    Preparing,
    /// Receiving appends.
    Active,
    /// Full or closed for appends; evictable when nothing locks or pins it.
    Sealed,
    /// Its name is taken by something the store did not create (a directory, a FIFO, a
    /// symlink, another user's file): never used.
    Unusable,
}

struct Segment {
    file: Option<Arc<SegmentFile>>,
    status: Status,
    epoch: u64,
    /// End of the last record written (appends go here).
    end: u64,
    /// Keys whose records were published into this segment (some may since be deleted).
    keys: Vec<ObjectKey>,
    live: u64,
    live_bytes: u64,
    /// Distinct keys of this segment that lookups hold locked.
    locked: u64,
    /// Loads reading from this segment now.
    pins: u64,
}

impl Segment {
    fn free() -> Self {
        Segment {
            file: None,
            status: Status::Free,
            epoch: 0,
            end: BLOCK,
            keys: Vec::new(),
            live: 0,
            live_bytes: 0,
            locked: 0,
            pins: 0,
        }
    }

    fn evictable(&self) -> bool {
        self.status == Status::Sealed && self.locked == 0 && self.pins == 0
    }
}

struct Index {
    map: HashMap<ObjectKey, Loc>,
    /// Lock count and segment of every locked key.
    locks: HashMap<ObjectKey, (u64, u32)>,
    lock_total: u64,
    segments: Vec<Segment>,
    /// Tracks exactly the sealed segments.
    policy: Box<dyn EvictionPolicy<u32>>,
}

impl Index {
    /// Drops the index entry of `key` if it still points at `loc`.
    fn drop_record(&mut self, key: &ObjectKey, loc: Loc) {
        if self.map.get(key) == Some(&loc) {
            self.map.remove(key);
            let segment = &mut self.segments[loc.segment as usize];
            segment.live -= 1;
            segment.live_bytes -= record_bytes(loc.len);
        }
    }
}

/// The writer's state: only one store task appends at a time.
struct Writer {
    active: Option<u32>,
    /// Record buffers not in flight: one is filled while the others are being written.
    spare: Vec<AlignedBuf>,
    /// The write thread, once started.
    pipe: Option<WritePipe>,
    /// Store tasks so far; numbers each write, so the write thread can skip the rest of a task
    /// after one of its writes failed.
    tasks: u64,
    /// Segments written since the last periodic sync.
    dirty: HashSet<u32>,
}

/// Record buffers per store: one being filled, one being written, one queued.
const RECORD_BUFFERS: usize = 3;

/// The write thread (`tierkv-disk-write`): writes records in the order handed to it.
struct WritePipe {
    requests: Sender<WriteRequest>,
    done: Receiver<WriteDone>,
    thread: JoinHandle<()>,
}

/// One record to write: the first `len` bytes of `buf` at `offset` of `file`.
struct WriteRequest {
    task: u64,
    file: Arc<SegmentFile>,
    buf: AlignedBuf,
    len: usize,
    offset: u64,
}

/// A written record's buffer, handed back with the outcome.
struct WriteDone {
    buf: AlignedBuf,
    result: std::io::Result<()>,
}

/// The writes of one store task not yet confirmed, oldest first, and its first failure.
#[derive(Default)]
struct InFlight {
    records: std::collections::VecDeque<(ObjectKey, Loc, Arc<SegmentFile>)>,
    failure: Option<TierError>,
}

/// The write thread's loop. Writes run strictly one after another, in order; once a write of a
/// task fails, that task's later writes are skipped (reported failed, nothing written), so no
/// record lands after one that may be torn.
fn write_records(requests: Receiver<WriteRequest>, done: Sender<WriteDone>) {
    let mut failed_task = None;
    while let Ok(WriteRequest { task, file, buf, len, offset }) = requests.recv() {
        let result = if failed_task == Some(task) {
            Err(std::io::Error::other("skipped: an earlier write of the task failed"))
        } else {
            match buf.as_slice().get(..len) {
                Some(record) => file.write_at(record, offset),
                None => Err(std::io::Error::other("a record larger than its buffer")),
            }
        };
        if result.is_err() {
            failed_task = Some(task);
        }
        if done.send(WriteDone { buf, result }).is_err() {
            return;
        }
    }
}

enum Job {
    Store(TaskId, Vec<StoreItem>),
    Lookup(TaskId, Vec<ObjectKey>),
    Load(TaskId, Vec<LoadItem>),
    /// One contiguous part of a load task split over the I/O threads: the items from `first` on.
    LoadPart {
        joint: Arc<JointLoad>,
        first: usize,
        items: Vec<LoadItem>,
    },
}

/// A load task split into parts that run on several I/O threads at once, so one large load has
/// as many reads in flight as the store has threads. Each part hands its sinks back here; the
/// part that finishes last sends the task's one completion, sinks in the order submitted.
struct JointLoad {
    task: TaskId,
    state: Mutex<JointState>,
}

struct JointState {
    sinks: Vec<Option<LoadItem>>,
    loaded: Bitmap,
    parts_left: usize,
}

impl JointLoad {
    /// Records a finished part; the task's completion once every part is in.
    fn part_done(&self, first: usize, items: Vec<LoadItem>, loaded: &Bitmap) -> Option<Completion> {
        let mut state = self.state.lock();
        for (i, item) in items.into_iter().enumerate() {
            state.loaded.set(first + i, loaded.get(i));
            if let Some(slot) = state.sinks.get_mut(first + i) {
                *slot = Some(item);
            }
        }
        state.parts_left -= 1;
        if state.parts_left > 0 {
            return None;
        }
        let sinks: Vec<LoadItem> = std::mem::take(&mut state.sinks).into_iter().flatten().collect();
        let loaded = std::mem::replace(&mut state.loaded, Bitmap::new(0));
        Some(Completion::Loaded { task: self.task, loaded, sinks })
    }
}

/// A load of fewer items than this runs on one thread: splitting it buys less than it costs.
const SPLIT_LOADS_FROM: usize = 4;

/// Whether stores are accepted, and what a read-only store needs to become writable.
struct WriteState {
    /// Why stores are refused, when the directory cannot be written.
    read_only: Option<String>,
    /// When `maintain` last tried to become writable.
    last_try: Instant,
    /// The directory's lock; `None` only while read-only (a directory that cannot be written
    /// may have no lock file to lock).
    lock: Option<DirLock>,
}

struct Shared {
    config: DiskStoreConfig,
    io: IoMode,
    state: Mutex<WriteState>,
    index: Mutex<Index>,
    writer: Mutex<Writer>,
    closed: AtomicBool,
    next_task: AtomicU64,
    epochs: AtomicU64,
    done: Sender<Completion>,
    completions: Receiver<Completion>,
    metrics: DiskMetrics,
}

/// The persistent, checksummed disk tier.
pub struct DiskStore {
    shared: Arc<Shared>,
    jobs: Mutex<Option<Sender<Job>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    flusher: Mutex<Option<(Sender<()>, JoinHandle<()>)>>,
    recovered: Recovered,
}

/// What opening the store found in its directory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Records indexed.
    pub records: u64,
    /// Payload bytes of the records indexed.
    pub bytes: u64,
    /// Entries named like segments that are not regular files of this user (directories,
    /// FIFOs, symlinks, other users' files): skipped, with a warning, and their ids unused.
    pub skipped_files: u32,
    /// How long opening took (the scan included).
    pub elapsed: Duration,
    /// Segments with a valid superblock.
    pub segments: u32,
    /// Blocks skipped between valid records of a segment: damaged headers and the payloads
    /// behind them. (A damaged header at the very end of a segment's records cannot be told
    /// from bytes of the segment's earlier life; it ends the segment and is not counted.)
    pub damaged_blocks: u64,
    /// Records skipped because their header failed verification: not indexed.
    pub damaged_records: u32,
    /// Records whose header is valid but whose payload the file does not hold whole (a write
    /// torn by a crash, or a truncated file): not indexed.
    pub torn_records: u32,
    /// Records marked deleted (by a delete or a clear before the restart): not indexed.
    pub deleted_records: u32,
}

impl DiskStore {
    /// Opens (or creates) the store in `config.dir` and rebuilds its index from the segment
    /// headers. The directory is locked (`flock` on `.tierkv.lock`, which holds the owner's
    /// pid): a second store on it, in this process or another, is refused with
    /// [`DiskError::Locked`]. A directory that cannot be written opens read-only: loads work,
    /// stores fail, and [`DiskStore::maintain`] retries becoming writable.
    pub fn open(config: DiskStoreConfig) -> Result<Self, DiskError> {
        let started = Instant::now();
        let segments = config.segments()?;
        let dir = config.dir.clone();
        if !dir.is_dir() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(config.dir_mode())
                .create(&dir)
                .map_err(DiskError::io("creating directory", &dir))?;
        }
        let lock = DirLock::take(&dir, config.file_mode())?;
        let (io, read_only) = match probe(&dir) {
            Ok(mode) if lock.is_some() => (mode, None),
            Ok(mode) => (mode, Some(format!("the lock file in {} cannot be made", dir.display()))),
            Err(e) => (
                Self::read_mode_of_existing(&dir),
                Some(format!("the directory {} is not writable: {e}", dir.display())),
            ),
        };
        if read_only.is_none()
            && let Err(e) = secure(&dir, config.dir_mode(), config.group)
        {
            tracing::warn!(
                "cannot restrict {} to mode {:o}: {e}; other local users may read the cache",
                dir.display(),
                config.dir_mode()
            );
        }
        let (index, mut recovered) = scan(&config, segments, io, read_only.is_none())?;
        recovered.elapsed = started.elapsed();
        let spare = (0..RECORD_BUFFERS)
            .map(|_| AlignedBuf::new(record_bytes(config.max_chunk_bytes) as usize))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| DiskError::Config("cannot allocate the write buffers".into()))?;
        let (done, completions) = unbounded();
        let shared = Arc::new(Shared {
            io,
            state: Mutex::new(WriteState {
                read_only: read_only.clone(),
                last_try: Instant::now(),
                lock,
            }),
            index: Mutex::new(index),
            writer: Mutex::new(Writer {
                active: None,
                spare,
                pipe: None,
                tasks: 0,
                dirty: HashSet::new(),
            }),
            closed: AtomicBool::new(false),
            next_task: AtomicU64::new(1),
            epochs: AtomicU64::new(0),
            done,
            completions,
            metrics: DiskMetrics::register(),
            config,
        });
        let store = DiskStore {
            shared: Arc::clone(&shared),
            jobs: Mutex::new(None),
            workers: Mutex::new(Vec::new()),
            flusher: Mutex::new(None),
            recovered,
        };
        // Records the scan could not index are misses like those a load finds damaged.
        store.shared.metrics.checksum_failures(
            u64::from(recovered.damaged_records) + u64::from(recovered.torn_records),
        );
        tracing::info!(
            records = recovered.records,
            bytes = recovered.bytes,
            segments = recovered.segments,
            damaged_records = recovered.damaged_records,
            torn_records = recovered.torn_records,
            skipped_files = recovered.skipped_files,
            elapsed = ?recovered.elapsed,
            "disk tier in {}: recovered {} records ({} bytes) in {:?}",
            dir.display(),
            recovered.records,
            recovered.bytes,
            recovered.elapsed,
        );
        if let Some(why) = &read_only {
            tracing::warn!(
                "the disk tier is read-only: {why}; stores to disk are refused, loads still \
                 work; retrying every {WRITABLE_RETRY:?}"
            );
        }
        store.shared.metrics.read_only(read_only.is_some());
        store.start_threads()?;
        store.publish_metrics();
        Ok(store)
    }

    /// For a read-only directory: direct I/O if an existing segment accepts it.
    fn read_mode_of_existing(dir: &Path) -> IoMode {
        let first = std::fs::read_dir(dir).ok().and_then(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                .find(|e| e.file_name().to_str().and_then(segment_id).is_some())
                .map(|e| e.path())
        });
        match first {
            Some(path) if SegmentFile::open(path.clone(), false, IoMode::Direct).is_ok() => {
                IoMode::Direct
            }
            _ => IoMode::Buffered,
        }
    }

    fn start_threads(&self) -> Result<(), DiskError> {
        let (requests, queued) = unbounded::<WriteRequest>();
        let (written, done) = unbounded::<WriteDone>();
        let thread = std::thread::Builder::new()
            .name("tierkv-disk-write".into())
            .spawn(move || write_records(queued, written))
            .map_err(DiskError::Thread)?;
        self.shared.writer.lock().pipe = Some(WritePipe { requests, done, thread });
        let (jobs, queue) = unbounded::<Job>();
        let mut workers = Vec::new();
        for n in 0..self.shared.config.io_threads {
            let (shared, queue) = (Arc::clone(&self.shared), queue.clone());
            let handle = std::thread::Builder::new()
                .name(format!("tierkv-disk-{n}"))
                .spawn(move || shared.work(&queue))
                .map_err(DiskError::Thread)?;
            workers.push(handle);
        }
        *self.jobs.lock() = Some(jobs);
        *self.workers.lock() = workers;
        if let FsyncPolicy::Periodic(every) = self.shared.config.fsync {
            let (stop, stopped) = crossbeam_channel::bounded::<()>(1);
            let shared = Arc::clone(&self.shared);
            let handle = std::thread::Builder::new()
                .name("tierkv-disk-flush".into())
                .spawn(move || {
                    while let Err(crossbeam_channel::RecvTimeoutError::Timeout) =
                        stopped.recv_timeout(every)
                    {
                        shared.sync_dirty();
                    }
                })
                .map_err(DiskError::Thread)?;
            *self.flusher.lock() = Some((stop, handle));
        }
        Ok(())
    }

    /// How file I/O is done: direct, or buffered where the filesystem refuses direct I/O.
    pub fn io_mode(&self) -> IoMode {
        self.shared.io
    }

    /// Why stores are refused, while the directory cannot be written.
    pub fn read_only(&self) -> Option<String> {
        self.shared.state.lock().read_only.clone()
    }

    /// Background upkeep, called periodically (the StorageManager's maintenance tick): a
    /// read-only store tries to become writable again, at most every [`WRITABLE_RETRY`].
    pub fn maintain(&self) {
        let due = {
            let state = self.shared.state.lock();
            state.read_only.is_some() && state.last_try.elapsed() >= WRITABLE_RETRY
        };
        if due {
            self.retry_writable();
        }
    }

    /// Tries now to become writable (when read-only): the directory must accept a probe file,
    /// its lock must be ours, and every segment file must open for writing. Returns whether
    /// the store is writable.
    pub fn retry_writable(&self) -> bool {
        self.shared.retry_writable()
    }

    /// What the scan at open found.
    pub fn recovered(&self) -> Recovered {
        self.recovered
    }

    /// Sets the disk gauges from the current state.
    pub fn publish_metrics(&self) {
        self.shared.publish();
    }

    fn submit(&self, make: impl FnOnce(TaskId) -> Job) -> TaskId {
        let task = TaskId(self.shared.next_task.fetch_add(1, Ordering::Relaxed));
        let job = make(task);
        let sender = self.jobs.lock().clone();
        match sender {
            Some(sender) if !self.shared.closed.load(Ordering::Acquire) => {
                if let Err(refused) = sender.send(job) {
                    self.shared.fail(refused.0);
                }
            }
            _ => self.shared.fail(job),
        }
        task
    }
}

/// Rebuilds the index from the segment files in the directory.
///
/// Segments are scanned in parallel, `io_threads` at a time (each header is one small read, so
/// a restart is bound by read latency, which parallel requests hide), then indexed in id order.
fn scan(
    config: &DiskStoreConfig,
    segments: u32,
    io: IoMode,
    writable: bool,
) -> Result<(Index, Recovered), DiskError> {
    let mut index = Index {
        map: HashMap::new(),
        locks: HashMap::new(),
        lock_total: 0,
        segments: (0..segments).map(|_| Segment::free()).collect(),
        policy: config.policy.build(),
    };
    let mut recovered = Recovered::default();
    let entries = std::fs::read_dir(&config.dir).map_err(DiskError::io("listing", &config.dir))?;
    // SAFETY: geteuid cannot fail and touches no memory.
    let user = unsafe { libc::geteuid() };
    let mut ids: Vec<u32> = Vec::new();
    for entry in entries.flatten() {
        let Some(id) = entry.file_name().to_str().and_then(segment_id).filter(|id| *id < segments)
        else {
            continue;
        };
        // `symlink_metadata`: a symlink is judged as itself, never by where it points.
        let ours = match std::fs::symlink_metadata(entry.path()) {
            Ok(meta) if !meta.file_type().is_file() => Err("it is not a regular file".to_string()),
            Ok(meta) if meta.uid() != user => {
                Err(format!("it belongs to user {}, not to this daemon's {user}", meta.uid()))
            }
            Ok(_) => Ok(()),
            Err(e) => Err(e.to_string()),
        };
        match ours {
            Ok(()) => ids.push(id),
            Err(why) => {
                tracing::warn!(
                    "skipping {}: named like a segment, but {why}; segment {id} stays unused \
                     until it is removed",
                    entry.path().display()
                );
                recovered.skipped_files += 1;
                index.segments[id as usize].status = Status::Unusable;
            }
        }
    }
    ids.sort_unstable();
    let mut scanned = scan_files(config, &ids, io, writable)?;
    scanned.sort_unstable_by_key(|s| s.id);
    for Scanned { id, file, found } in scanned {
        let segment = &mut index.segments[id as usize];
        segment.file = Some(Arc::new(file));
        // A segment without a valid superblock holds nothing; its file is reused as is.
        let Some((epoch, found)) = found else {
            continue;
        };
        recovered.segments += 1;
        recovered.damaged_blocks += found.damaged_blocks;
        recovered.damaged_records += found.damaged_records;
        recovered.torn_records += found.torn_records;
        recovered.deleted_records += found.deleted_records;
        segment.epoch = epoch;
        segment.end = found.end;
        segment.status = Status::Sealed;
        for (key, loc) in found.records {
            // One object per key: a second copy (written again after a delete) is redundant.
            if index.map.contains_key(&key) {
                continue;
            }
            index.map.insert(key, loc);
            let segment = &mut index.segments[id as usize];
            segment.keys.push(key);
            segment.live += 1;
            segment.live_bytes += record_bytes(loc.len);
            recovered.records += 1;
            recovered.bytes += loc.len;
        }
        index.policy.insert(id);
    }
    Ok((index, recovered))
}

/// One segment file as the scan found it.
struct Scanned {
    id: u32,
    file: SegmentFile,
    /// The epoch of its valid superblock and what it holds; `None` without a valid superblock.
    found: Option<(u64, SegmentScan)>,
}

/// Scans the segment files `ids` on up to `io_threads` threads; in no particular order.
fn scan_files(
    config: &DiskStoreConfig,
    ids: &[u32],
    io: IoMode,
    writable: bool,
) -> Result<Vec<Scanned>, DiskError> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let worker = || -> Result<Vec<Scanned>, DiskError> {
        let mut buf = AlignedBuf::new(SCAN_WINDOW as usize)
            .ok_or_else(|| DiskError::Config("cannot allocate the scan buffer".into()))?;
        let mut out = Vec::new();
        while let Some(id) = ids.get(next.fetch_add(1, Ordering::Relaxed)) {
            out.push(scan_file(config, *id, io, writable, &mut buf)?);
        }
        Ok(out)
    };
    let threads = config.io_threads.min(ids.len());
    if threads <= 1 {
        return worker();
    }
    std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(threads);
        for n in 0..threads {
            let handle = std::thread::Builder::new()
                .name(format!("tierkv-disk-scan-{n}"))
                .spawn_scoped(scope, worker)
                .map_err(DiskError::Thread)?;
            handles.push(handle);
        }
        let mut all = Vec::with_capacity(ids.len());
        for handle in handles {
            let part = handle.join().unwrap_or_else(|_| {
                Err(DiskError::io("scanning", &config.dir)(std::io::Error::other(
                    "a scan thread panicked",
                )))
            })?;
            all.extend(part);
        }
        Ok(all)
    })
}

/// Opens segment `id` and scans its current life.
fn scan_file(
    config: &DiskStoreConfig,
    id: u32,
    io: IoMode,
    writable: bool,
    buf: &mut AlignedBuf,
) -> Result<Scanned, DiskError> {
    let path = segment_path(&config.dir, id);
    let file = SegmentFile::open(path.clone(), writable, io)
        .map_err(DiskError::io("opening segment", &path))?;
    if writable && let Err(e) = file.secure(config.file_mode(), config.group) {
        tracing::warn!("cannot restrict {} to mode {:o}: {e}", path.display(), config.file_mode());
    }
    let len = file.len().map_err(DiskError::io("reading segment", &path))?;
    let superblock = match file.read_at(&mut buf.as_mut_slice()[..BLOCK as usize], 0) {
        Ok(()) => Superblock::decode(buf.as_slice()).ok(),
        Err(_) => None,
    };
    let found = superblock.filter(|sb| sb.id == id).map(|sb| {
        // Whole blocks only: a file cut short mid-block ends at its last whole block.
        let limit = len.min(config.segment_bytes) / BLOCK * BLOCK;
        (sb.epoch, scan_segment(&file, id, sb.epoch, limit, config, buf))
    });
    Ok(Scanned { id, file, found })
}

/// The most bytes the scan reads at once while it searches past a damaged header.
const SCAN_WINDOW: u64 = 1 << 20;

/// What the scan found in one segment's current life.
#[derive(Default)]
struct SegmentScan {
    records: Vec<(ObjectKey, Loc)>,
    /// Where the life's last record ends: appends would go here.
    end: u64,
    damaged_blocks: u64,
    damaged_records: u32,
    torn_records: u32,
    deleted_records: u32,
}

/// Reads the record headers of segment `id`'s life `epoch`, from block 1 to `limit` (a whole
/// number of blocks).
///
/// A block that is neither a header of this life nor zeros is either a damaged header of this
/// life or bytes of an earlier life past this life's end; the two cannot be told apart by the
/// block alone. A damaged record is at most `record_bytes(max_chunk_bytes)` long, so if it is
/// one, the next record of this life (if any) starts within that distance: the scan searches
/// exactly that window for a header of this epoch, and ends the life where it finds none (or
/// finds a header of an earlier life). The search never runs past one record's length.
fn scan_segment(
    file: &SegmentFile,
    id: u32,
    epoch: u64,
    limit: u64,
    config: &DiskStoreConfig,
    buf: &mut AlignedBuf,
) -> SegmentScan {
    let max_record = record_bytes(config.max_chunk_bytes);
    let mut found = SegmentScan::default();
    let mut at = BLOCK;
    'records: while at + BLOCK <= limit {
        let head = &mut buf.as_mut_slice()[..BLOCK as usize];
        if file.read_at(head, at).is_err() {
            break;
        }
        match Header::decode(head) {
            Ok(h) if h.epoch == epoch => {
                let size = record_bytes(h.len);
                if h.len > config.max_chunk_bytes || at + size > limit {
                    found.torn_records += 1;
                    break;
                }
                if h.deleted {
                    found.deleted_records += 1;
                } else {
                    found.records.push((h.key, Loc { segment: id, offset: at, len: h.len }));
                }
                at += size;
            }
            // A record of an earlier life of this segment: this life's records end here.
            Ok(_) => break,
            // Never written: appends are sequential, so nothing of this life follows.
            Err(_) if head.iter().all(|b| *b == 0) => break,
            Err(_) => {
                // Search the blocks after it (zeros included: payloads may be zero) for the
                // next header of this life. Headers are block-aligned and carry the segment's
                // random epoch, which no payload can guess.
                let end = (at + max_record + BLOCK).min(limit);
                let mut from = at + BLOCK;
                while from < end {
                    let piece = (end - from).min(buf.as_slice().len() as u64);
                    let bytes = &mut buf.as_mut_slice()[..piece as usize];
                    if file.read_at(bytes, from).is_err() {
                        break 'records;
                    }
                    for (n, block) in bytes.chunks_exact(BLOCK as usize).enumerate() {
                        match Header::decode(block) {
                            Ok(h) if h.epoch == epoch => {
                                let next = from + n as u64 * BLOCK;
                                found.damaged_blocks += (next - at) / BLOCK;
                                found.damaged_records += 1;
                                at = next;
                                continue 'records;
                            }
                            Ok(_) => break 'records,
                            Err(_) => {}
                        }
                    }
                    from += piece;
                }
                break;
            }
        }
    }
    found.end = at;
    found
}

impl Shared {
    fn work(&self, queue: &Receiver<Job>) {
        let mut staging = AlignedBuf::new(record_bytes(self.config.max_chunk_bytes) as usize);
        while let Ok(job) = queue.recv() {
            if self.closed.load(Ordering::Acquire) {
                self.fail(job);
                continue;
            }
            let Some(buffer) = staging.as_mut() else {
                // Without a read buffer this worker cannot load; fail rather than hang.
                self.fail(job);
                continue;
            };
            if let Some(completion) = self.run(job, buffer) {
                let _ = self.done.send(completion);
            }
            self.publish();
        }
    }

    /// Runs a job. The job's buffers stay outside the code that may panic, so a panic (a bug in
    /// this crate, or a caller's buffer whose methods panic) completes the task as a failure,
    /// counted, with every buffer handed back; pins and other state are released by guards.
    /// Returns the task's completion (`None` for a part of a split load that is not the last).
    fn run(&self, job: Job, staging: &mut AlignedBuf) -> Option<Completion> {
        Some(match job {
            Job::Store(task, sources) => {
                let result = self
                    .contained(|| self.store(&sources))
                    .unwrap_or_else(|| Err(TierError::Io("internal panic while storing".into())));
                Completion::Stored { task, result, sources }
            }
            Job::Lookup(task, keys) => {
                let locked = self
                    .contained(|| self.lookup_and_lock(&keys))
                    .unwrap_or_else(|| Bitmap::new(keys.len()));
                Completion::LookedUp { task, locked }
            }
            Job::Load(task, mut sinks) => {
                let loaded = self
                    .contained(|| self.load(&mut sinks, staging))
                    .unwrap_or_else(|| Bitmap::new(sinks.len()));
                Completion::Loaded { task, loaded, sinks }
            }
            Job::LoadPart { joint, first, mut items } => {
                let loaded = self
                    .contained(|| self.load(&mut items, staging))
                    .unwrap_or_else(|| Bitmap::new(items.len()));
                return joint.part_done(first, items, &loaded);
            }
        })
    }

    /// Runs `f`, turning a panic into `None` (counted).
    fn contained<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(value) => Some(value),
            Err(_) => {
                self.metrics.failed(Failure::Panic);
                None
            }
        }
    }

    /// Completes a job that will not run.
    fn fail(&self, job: Job) {
        self.metrics.failed(Failure::Closed);
        let completion = match job {
            Job::Store(task, sources) => {
                Completion::Stored { task, result: Err(TierError::Closed), sources }
            }
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

    // ----- stores -----

    fn store(&self, items: &[StoreItem]) -> Result<(), TierError> {
        if let Some(why) = self.state.lock().read_only.clone() {
            self.metrics.failed(Failure::ReadOnly);
            return Err(TierError::Io(format!("{why}; stores are refused, loads still work")));
        }
        if let Some(item) =
            items.iter().find(|item| item.source.len() > self.config.max_chunk_bytes)
        {
            self.metrics.failed(Failure::TooLarge);
            return Err(TierError::TooLarge {
                bytes: item.source.len(),
                limit: self.config.max_chunk_bytes,
            });
        }
        // One store task appends at a time (the writer lock), so the keys being written now are
        // exactly this task's: a key present in the index, or repeated in the batch, is skipped.
        let mut writer = self.writer.lock();
        let new: Vec<&StoreItem> = {
            let index = self.index.lock();
            let mut batch = HashSet::with_capacity(items.len());
            items
                .iter()
                .filter(|item| !index.map.contains_key(&item.key) && batch.insert(item.key))
                .collect()
        };
        let mut written: Vec<(ObjectKey, Loc)> = Vec::with_capacity(new.len());
        let mut result = self.append_all(&mut writer, &new, &mut written);
        if result.is_ok() && self.config.fsync == FsyncPolicy::Always {
            result = self.sync_segments(written.iter().map(|(_, loc)| loc.segment));
        }
        let mut index = self.index.lock();
        if result.is_ok() {
            for (key, loc) in &written {
                index.map.insert(*key, *loc);
                let segment = &mut index.segments[loc.segment as usize];
                segment.keys.push(*key);
                segment.live += 1;
                segment.live_bytes += record_bytes(loc.len);
            }
            if matches!(self.config.fsync, FsyncPolicy::Periodic(_)) {
                writer.dirty.extend(written.iter().map(|(_, loc)| loc.segment));
            }
        }
        drop(index);
        drop(writer);
        match &result {
            Ok(()) => {
                self.metrics.stored(written.len() as u64, written.iter().map(|(_, l)| l.len).sum())
            }
            Err(TierError::NoSpace(_)) => self.metrics.failed(Failure::NoSpace),
            Err(TierError::Buffer(_)) => self.metrics.failed(Failure::Copy),
            Err(_) => self.metrics.failed(Failure::Io),
        }
        result
    }

    /// Appends `items` at the end of the active segment (opening new ones as segments fill),
    /// pipelined: while the write thread writes one record, this thread copies and checksums the
    /// next into another buffer. Records are written in order, one at a time, so only the last
    /// record written can be torn; after a failed write the write thread skips the rest of the
    /// task, and every segment it touched is sealed. Returns once no write of the task is in
    /// flight; `written` gets the records that reached the file (all of them on success).
    fn append_all(
        &self,
        writer: &mut Writer,
        items: &[&StoreItem],
        written: &mut Vec<(ObjectKey, Loc)>,
    ) -> Result<(), TierError> {
        writer.tasks += 1;
        let task = writer.tasks;
        let mut flight = InFlight::default();
        for item in items {
            let size = record_bytes(item.source.len());
            // A segment is sealed (and may be evicted and reused) only with nothing in flight.
            if !self.active_has_room(writer, size) {
                self.drain(writer, &mut flight, written);
            }
            if flight.failure.is_some() {
                break;
            }
            while writer.spare.is_empty() && !flight.records.is_empty() {
                self.await_write(writer, &mut flight, written);
            }
            if flight.failure.is_some() {
                break;
            }
            if let Err(e) = self.submit_record(writer, task, item, &mut flight) {
                flight.failure = Some(e);
                break;
            }
        }
        self.drain(writer, &mut flight, written);
        flight.failure.map_or(Ok(()), Err)
    }

    /// Copies one record into a spare buffer (header, payload, checksum, zero padding) and hands
    /// it to the write thread. The segment's end moves past it only once the copy succeeded, so
    /// a source that fails leaves no hole.
    fn submit_record(
        &self,
        writer: &mut Writer,
        task: u64,
        item: &StoreItem,
        flight: &mut InFlight,
    ) -> Result<(), TierError> {
        let len = item.source.len();
        let size = record_bytes(len);
        let (segment, offset, epoch, file) = self.reserve(writer, size)?;
        let Some(mut buf) = writer.spare.pop() else {
            return Err(TierError::Io("no record buffer is free".into()));
        };
        let record = &mut buf.as_mut_slice()[..size as usize];
        let (head, payload) = record.split_at_mut(BLOCK as usize);
        let payload_bytes = &mut payload[..len as usize];
        let copied =
            catch_unwind(AssertUnwindSafe(|| copy_in(item.source.as_ref(), payload_bytes)));
        let failed = match copied {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(TierError::Buffer(e)),
            Err(_) => Some(TierError::Io(format!("the source of {:?} panicked", item.key))),
        };
        if let Some(e) = failed {
            writer.spare.push(buf);
            return Err(e);
        }
        payload[len as usize..].fill(0);
        let checksum = payload_checksum(&payload[..len as usize]);
        Header { epoch, key: item.key, len, checksum, deleted: false }.encode(head);
        let Some(requests) = writer.pipe.as_ref().map(|p| &p.requests) else {
            writer.spare.push(buf);
            return Err(TierError::Closed);
        };
        let request =
            WriteRequest { task, file: Arc::clone(&file), buf, len: size as usize, offset };
        if let Err(refused) = requests.send(request) {
            writer.spare.push(refused.0.buf);
            return Err(TierError::Io("the disk write thread is gone".into()));
        }
        self.index.lock().segments[segment as usize].end = offset + size;
        flight.records.push_back((item.key, Loc { segment, offset, len }, file));
        Ok(())
    }

    /// Waits for the oldest write in flight: its record joins `written`, or its failure is kept
    /// and its segment sealed (no record is ever appended after one the scan would stop at).
    fn await_write(
        &self,
        writer: &mut Writer,
        flight: &mut InFlight,
        written: &mut Vec<(ObjectKey, Loc)>,
    ) {
        let Some((key, loc, file)) = flight.records.pop_front() else {
            return;
        };
        let done = match writer.pipe.as_ref() {
            Some(pipe) => pipe.done.recv().ok(),
            None => None,
        };
        let failure = match done {
            Some(WriteDone { buf, result }) => {
                writer.spare.push(buf);
                match result {
                    Ok(()) => {
                        written.push((key, loc));
                        return;
                    }
                    Err(e) => io_error(&file.path, "writing", &e),
                }
            }
            None => TierError::Io("the disk write thread is gone".into()),
        };
        self.seal(writer, loc.segment);
        flight.failure.get_or_insert(failure);
    }

    /// Waits for every write in flight.
    fn drain(
        &self,
        writer: &mut Writer,
        flight: &mut InFlight,
        written: &mut Vec<(ObjectKey, Loc)>,
    ) {
        while !flight.records.is_empty() {
            self.await_write(writer, flight, written);
        }
    }

    /// Whether the active segment has room for `size` more bytes (false without one).
    fn active_has_room(&self, writer: &Writer, size: u64) -> bool {
        let Some(active) = writer.active else {
            return false;
        };
        let index = self.index.lock();
        let segment = &index.segments[active as usize];
        segment.end + size <= self.config.segment_bytes && segment.file.is_some()
    }

    /// Room for `size` bytes in the active segment: its id, the offset, its epoch and file.
    fn reserve(
        &self,
        writer: &mut Writer,
        size: u64,
    ) -> Result<(u32, u64, u64, Arc<SegmentFile>), TierError> {
        if let Some(active) = writer.active {
            let index = self.index.lock();
            let segment = &index.segments[active as usize];
            if segment.end + size <= self.config.segment_bytes
                && let Some(file) = &segment.file
            {
                return Ok((active, segment.end, segment.epoch, Arc::clone(file)));
            }
            drop(index);
            self.seal(writer, active);
        }
        let (id, file) = self.open_segment()?;
        writer.active = Some(id);
        Ok((id, BLOCK, self.index.lock().segments[id as usize].epoch, file))
    }

    /// Stops appending to `segment`; it becomes evictable.
    fn seal(&self, writer: &mut Writer, segment: u32) {
        let mut index = self.index.lock();
        let seg = &mut index.segments[segment as usize];
        if seg.status == Status::Active {
            seg.status = Status::Sealed;
            index.policy.insert(segment);
        }
        if writer.active == Some(segment) {
            writer.active = None;
        }
    }

    /// A segment initialised for a new epoch: a free one, or the policy's evictable victim. When
    /// the disk is too full to create a segment file, an existing segment is reused instead, so a
    /// capacity larger than the disk degrades into a smaller cache rather than failing.
    fn open_segment(&self) -> Result<(u32, Arc<SegmentFile>), TierError> {
        match self.open_segment_from(true) {
            Err(TierError::NoSpace(full)) => {
                self.open_segment_from(false).map_err(|_| TierError::NoSpace(full))
            }
            other => other,
        }
    }

    /// Like `open_segment`; free segments without a file are used only if `create` allows.
    fn open_segment_from(&self, create: bool) -> Result<(u32, Arc<SegmentFile>), TierError> {
        let (id, evicted, existing) = {
            let mut index = self.index.lock();
            let free = index
                .segments
                .iter()
                .position(|s| s.status == Status::Free && (create || s.file.is_some()))
                .map(|i| i as u32);
            let (id, evicted) = match free {
                Some(id) => (id, 0),
                None => {
                    let Index { segments, policy, .. } = &mut *index;
                    let victim =
                        policy.evict(1, &mut |id| segments[*id as usize].evictable()).pop();
                    let Some(id) = victim else {
                        return Err(TierError::NoSpace(format!(
                            "all {} segments of {} bytes hold locked or pinned records",
                            index.segments.len(),
                            self.config.segment_bytes
                        )));
                    };
                    let keys = std::mem::take(&mut index.segments[id as usize].keys);
                    let mut evicted = 0;
                    for key in keys {
                        if index.map.get(&key).is_some_and(|loc| loc.segment == id) {
                            index.map.remove(&key);
                            evicted += 1;
                        }
                    }
                    (id, evicted)
                }
            };
            let segment = &mut index.segments[id as usize];
            segment.status = Status::Preparing;
            segment.live = 0;
            segment.live_bytes = 0;
            segment.end = BLOCK;
            (id, evicted, segment.file.clone())
        };
        self.metrics.evicted(evicted);
        let initialised = self.initialise(id, existing);
        let mut index = self.index.lock();
        let segment = &mut index.segments[id as usize];
        match initialised {
            Ok((file, epoch)) => {
                segment.file = Some(Arc::clone(&file));
                segment.epoch = epoch;
                segment.status = Status::Active;
                Ok((id, file))
            }
            Err(e) => {
                segment.status = Status::Free;
                Err(e)
            }
        }
    }

    /// Creates (or reuses) segment `id`'s file at full size and writes a superblock with a new
    /// epoch, so every record of the previous epoch stops matching.
    fn initialise(
        &self,
        id: u32,
        existing: Option<Arc<SegmentFile>>,
    ) -> Result<(Arc<SegmentFile>, u64), TierError> {
        let path = segment_path(&self.config.dir, id);
        let bytes = self.config.segment_bytes;
        let file = match existing {
            Some(file) if file.len().is_ok_and(|len| len >= bytes) => file,
            _ => {
                let created = SegmentFile::create(path.clone(), bytes, self.io)
                    .map_err(|e| io_error(&path, "creating", &e))?;
                created
                    .secure(self.config.file_mode(), self.config.group)
                    .map_err(|e| io_error(&path, "setting the mode of", &e))?;
                if self.config.fsync != FsyncPolicy::Never {
                    sync_dir(&self.config.dir)
                        .map_err(|e| io_error(&self.config.dir, "syncing", &e))?;
                }
                Arc::new(created)
            }
        };
        let epoch = self.new_epoch(id);
        let mut block = AlignedBuf::new(BLOCK as usize)
            .ok_or_else(|| TierError::Io("cannot allocate".into()))?;
        Superblock { id, epoch, segment_bytes: bytes }.encode(block.as_mut_slice());
        file.write_at(block.as_slice(), 0)
            .map_err(|e| io_error(&path, "writing the superblock of", &e))?;
        if self.config.fsync != FsyncPolicy::Never {
            file.sync().map_err(|e| io_error(&path, "syncing", &e))?;
        }
        Ok((file, epoch))
    }

    /// An epoch no earlier life of any segment had: random per process, so a payload can never be
    /// crafted to pass for a record header of a future epoch.
    fn new_epoch(&self, id: u32) -> u64 {
        let n = self.epochs.fetch_add(1, Ordering::Relaxed);
        std::collections::hash_map::RandomState::new().hash_one((
            id,
            n,
            std::time::SystemTime::now(),
        ))
    }

    /// Sets the deleted flag in the header of each record (a pinned segment's, of the epoch it
    /// was indexed in). A mark that cannot be written leaves the record to be found again after
    /// a restart, with its key's correct bytes: the delete is then only not persistent.
    fn mark_deleted(&self, marks: &[(Arc<SegmentFile>, u64, ObjectKey, Loc)]) {
        let Some(mut block) = AlignedBuf::new(BLOCK as usize) else {
            return;
        };
        let mut written: Vec<&Arc<SegmentFile>> = Vec::new();
        for (file, epoch, key, loc) in marks {
            let head = block.as_mut_slice();
            if file.read_at(head, loc.offset).is_err() {
                continue;
            }
            let Ok(mut header) = Header::decode(head) else { continue };
            if header.epoch != *epoch || header.key != *key || header.deleted {
                continue;
            }
            header.deleted = true;
            header.encode(head);
            if file.write_at(block.as_slice(), loc.offset).is_ok()
                && !written.iter().any(|f| Arc::ptr_eq(f, file))
            {
                written.push(file);
            }
        }
        if self.config.fsync != FsyncPolicy::Never {
            for file in written {
                let _ = file.sync();
            }
        }
    }

    fn sync_segments(&self, segments: impl Iterator<Item = u32>) -> Result<(), TierError> {
        let unique: HashSet<u32> = segments.collect();
        let files: Vec<Arc<SegmentFile>> = {
            let index = self.index.lock();
            unique.iter().filter_map(|id| index.segments[*id as usize].file.clone()).collect()
        };
        for file in files {
            file.sync().map_err(|e| io_error(&file.path, "syncing", &e))?;
        }
        Ok(())
    }

    /// The periodic flusher's step: syncs the segments written since the last one.
    fn sync_dirty(&self) {
        let dirty = std::mem::take(&mut self.writer.lock().dirty);
        if self.sync_segments(dirty.into_iter()).is_err() {
            self.metrics.failed(Failure::Io);
        }
    }

    // ----- lookups and loads -----

    fn lookup_and_lock(&self, keys: &[ObjectKey]) -> Bitmap {
        let mut index = self.index.lock();
        let index = &mut *index;
        Bitmap::from_bools(keys.iter().map(|key| {
            let Some(loc) = index.map.get(key).copied() else {
                return false;
            };
            let (count, _) = index.locks.entry(*key).or_insert((0, loc.segment));
            *count += 1;
            if *count == 1 {
                index.segments[loc.segment as usize].locked += 1;
            }
            index.lock_total += 1;
            index.policy.touch(&loc.segment);
            true
        }))
    }

    fn load(&self, items: &mut [LoadItem], staging: &mut AlignedBuf) -> Bitmap {
        // Pin the segments under the lock, read outside it; the guard unpins them under it
        // again, on every path out of here, a panic included.
        let mut pins = Pins { index: &self.index, segments: Vec::with_capacity(items.len()) };
        let planned: Vec<Option<(Loc, u64, Arc<SegmentFile>)>> = {
            let mut index = self.index.lock();
            items
                .iter()
                .map(|item| {
                    let loc = *index.map.get(&item.key)?;
                    let segment = &mut index.segments[loc.segment as usize];
                    let file = segment.file.clone()?;
                    segment.pins += 1;
                    pins.segments.push(loc.segment);
                    let epoch = segment.epoch;
                    index.policy.touch(&loc.segment);
                    Some((loc, epoch, file))
                })
                .collect()
        };
        let mut loaded = Bitmap::new(items.len());
        let mut bytes = 0;
        let mut damaged = Vec::new();
        for (i, (item, plan)) in items.iter_mut().zip(&planned).enumerate() {
            let Some((loc, epoch, file)) = plan else {
                continue;
            };
            match self.read_record(file, *loc, *epoch, &item.key, item.sink.as_mut(), staging) {
                Ok(()) => {
                    loaded.set(i, true);
                    bytes += loc.len;
                }
                Err(ReadFailure::Sink) => self.metrics.failed(Failure::Copy),
                Err(ReadFailure::Damaged) => {
                    self.metrics.checksum_failed();
                    damaged.push((item.key, *loc));
                }
                Err(ReadFailure::Io) => {
                    self.metrics.failed(Failure::Io);
                    damaged.push((item.key, *loc));
                }
            }
        }
        // A record that failed verification or could not be read is never served again. (It is
        // dropped while its segment is still pinned, so `loc` cannot name a reused segment.)
        if !damaged.is_empty() {
            let mut index = self.index.lock();
            for (key, loc) in damaged {
                index.drop_record(&key, loc);
            }
        }
        drop(pins);
        self.metrics.loaded(loaded.count_ones() as u64, bytes);
        loaded
    }

    /// Reads, verifies and copies one record into `sink`.
    fn read_record(
        &self,
        file: &SegmentFile,
        loc: Loc,
        epoch: u64,
        key: &ObjectKey,
        sink: &mut dyn ChunkSink,
        staging: &mut AlignedBuf,
    ) -> Result<(), ReadFailure> {
        if sink.len() != loc.len {
            return Err(ReadFailure::Sink);
        }
        let size = record_bytes(loc.len) as usize;
        let record: &[u8] = match self.config.read_mode {
            ReadMode::Direct => {
                let buf = &mut staging.as_mut_slice()[..size];
                file.read_at(buf, loc.offset).map_err(|_| ReadFailure::Io)?;
                buf
            }
            ReadMode::Mmap => {
                let map = file.mapping().map_err(|_| ReadFailure::Io)?;
                let start = loc.offset as usize;
                map.get(start..start + size).ok_or(ReadFailure::Io)?
            }
        };
        let (head, payload) = record.split_at(BLOCK as usize);
        let header = Header::decode(head).map_err(|_| ReadFailure::Damaged)?;
        let payload = &payload[..loc.len as usize];
        if header.epoch != epoch
            || header.key != *key
            || header.len != loc.len
            || payload_checksum(payload) != header.checksum
        {
            return Err(ReadFailure::Damaged);
        }
        match catch_unwind(AssertUnwindSafe(|| copy_out(payload, sink))) {
            Ok(Ok(())) => Ok(()),
            _ => Err(ReadFailure::Sink),
        }
    }

    // ----- becoming writable -----

    fn retry_writable(&self) -> bool {
        let mut state = self.state.lock();
        if state.read_only.is_none() {
            return true;
        }
        state.last_try = Instant::now();
        match self.become_writable(&mut state) {
            Ok(()) => {
                state.read_only = None;
                self.metrics.read_only(false);
                tracing::info!(
                    "the disk tier in {} is writable again; stores to disk resume",
                    self.config.dir.display()
                );
                true
            }
            Err(why) => {
                tracing::debug!("the disk tier is still read-only: {why}");
                state.read_only = Some(why);
                false
            }
        }
    }

    fn become_writable(&self, state: &mut WriteState) -> Result<(), String> {
        let dir = &self.config.dir;
        probe(dir).map_err(|e| format!("the directory {} is not writable: {e}", dir.display()))?;
        if state.lock.is_none() {
            state.lock = DirLock::take(dir, self.config.file_mode()).map_err(|e| e.to_string())?;
            if state.lock.is_none() {
                return Err(format!("the lock file in {} cannot be made", dir.display()));
            }
        }
        if let Err(e) = secure(dir, self.config.dir_mode(), self.config.group) {
            tracing::warn!(
                "cannot restrict {} to mode {:o}: {e}",
                dir.display(),
                self.config.dir_mode()
            );
        }
        // The scan opened the segment files read-only: open them again for writing.
        let files: Vec<(u32, std::path::PathBuf)> = {
            let index = self.index.lock();
            index
                .segments
                .iter()
                .enumerate()
                .filter_map(|(id, s)| Some((id as u32, s.file.as_ref()?.path.clone())))
                .collect()
        };
        let mut reopened = Vec::with_capacity(files.len());
        for (id, path) in files {
            let file = SegmentFile::open(path.clone(), true, self.io)
                .map_err(|e| format!("cannot open {} for writing: {e}", path.display()))?;
            if let Err(e) = file.secure(self.config.file_mode(), self.config.group) {
                tracing::warn!(
                    "cannot restrict {} to mode {:o}: {e}",
                    path.display(),
                    self.config.file_mode()
                );
            }
            reopened.push((id, Arc::new(file)));
        }
        let mut index = self.index.lock();
        for (id, file) in reopened {
            index.segments[id as usize].file = Some(file);
        }
        Ok(())
    }

    fn usage(&self) -> TierUsage {
        let index = self.index.lock();
        TierUsage {
            capacity_bytes: index.segments.len() as u64 * self.config.segment_bytes,
            used_bytes: index.segments.iter().map(|s| s.live_bytes).sum(),
            objects: index.map.len() as u64,
            locks: index.lock_total,
        }
    }

    fn publish(&self) {
        let usage = self.usage();
        self.metrics.publish(usage.capacity_bytes, usage.used_bytes, usage.objects);
    }
}

/// Segments a load pinned; unpinned when dropped.
struct Pins<'a> {
    index: &'a Mutex<Index>,
    segments: Vec<u32>,
}

impl Drop for Pins<'_> {
    fn drop(&mut self) {
        if self.segments.is_empty() {
            return;
        }
        let mut index = self.index.lock();
        for segment in &self.segments {
            index.segments[*segment as usize].pins -= 1;
        }
    }
}

enum ReadFailure {
    /// The record failed verification: torn, corrupted, or not the record asked for.
    Damaged,
    /// The OS could not read it.
    Io,
    /// The caller's buffer refused the bytes.
    Sink,
}

fn io_error(path: &Path, action: &str, error: &std::io::Error) -> TierError {
    let message = format!("{action} {}: {error}", path.display());
    if error.raw_os_error() == Some(libc::ENOSPC) {
        TierError::NoSpace(message)
    } else {
        TierError::Io(message)
    }
}

/// Copies a source into a record's payload area: in place when the source is host memory.
fn copy_in(source: &dyn ChunkSource, dst: &mut [u8]) -> Result<(), tierkv_core::BufferError> {
    match source.host_bytes() {
        Some(bytes) if bytes.len() == dst.len() => {
            dst.copy_from_slice(bytes);
            Ok(())
        }
        _ => source.copy_to_host(dst),
    }
}

/// Copies a verified payload into a sink: in place when the sink is host memory.
fn copy_out(src: &[u8], sink: &mut dyn ChunkSink) -> Result<(), tierkv_core::BufferError> {
    match sink.host_bytes_mut() {
        Some(bytes) if bytes.len() == src.len() => {
            bytes.copy_from_slice(src);
            Ok(())
        }
        _ => sink.copy_from_host(src),
    }
}

impl TierAdapter for DiskStore {
    fn name(&self) -> &str {
        "disk"
    }

    fn submit_store(&self, items: Vec<StoreItem>) -> TaskId {
        self.submit(|task| Job::Store(task, items))
    }

    fn submit_lookup_and_lock(&self, keys: Vec<ObjectKey>) -> TaskId {
        self.submit(|task| Job::Lookup(task, keys))
    }

    /// A load of several records is split into contiguous parts, one per I/O thread, so its
    /// reads are in flight at once; the task still completes once, with every sink in order.
    fn submit_load(&self, items: Vec<LoadItem>) -> TaskId {
        let threads = self.shared.config.io_threads;
        if items.len() < SPLIT_LOADS_FROM || threads < 2 {
            return self.submit(|task| Job::Load(task, items));
        }
        let task = TaskId(self.shared.next_task.fetch_add(1, Ordering::Relaxed));
        let parts = threads.min(items.len());
        let per_part = items.len().div_ceil(parts);
        let total = items.len();
        let mut rest = items;
        let mut jobs = Vec::with_capacity(parts);
        let mut first = 0;
        while !rest.is_empty() {
            let tail = rest.split_off(per_part.min(rest.len()));
            let part = std::mem::replace(&mut rest, tail);
            let len = part.len();
            jobs.push((first, part));
            first += len;
        }
        let joint = Arc::new(JointLoad {
            task,
            state: Mutex::new(JointState {
                sinks: (0..total).map(|_| None).collect(),
                loaded: Bitmap::new(total),
                parts_left: jobs.len(),
            }),
        });
        let sender = self.jobs.lock().clone();
        for (first, items) in jobs {
            let job = Job::LoadPart { joint: Arc::clone(&joint), first, items };
            match &sender {
                Some(sender) if !self.shared.closed.load(Ordering::Acquire) => {
                    if let Err(refused) = sender.send(job) {
                        self.shared.fail(refused.0);
                    }
                }
                _ => self.shared.fail(job),
            }
        }
        task
    }

    fn unlock(&self, keys: &[ObjectKey]) {
        let mut index = self.shared.index.lock();
        let index = &mut *index;
        for key in keys {
            let Some((count, segment)) = index.locks.get_mut(key) else {
                continue;
            };
            *count -= 1;
            index.lock_total -= 1;
            if *count == 0 {
                let segment = *segment;
                index.locks.remove(key);
                index.segments[segment as usize].locked -= 1;
            }
        }
    }

    /// Deletes unlocked keys: drops them from the index, and marks each record deleted on disk
    /// (its header's flag), so a restart does not find it again.
    fn delete(&self, keys: &[ObjectKey]) -> usize {
        let mut marks = Vec::new();
        let mut deleted = 0;
        {
            let mut index = self.shared.index.lock();
            for key in keys {
                if index.locks.contains_key(key) {
                    continue;
                }
                // A load in progress pins the segment, not the key: dropping the key from the
                // index leaves its record readable until the load's pin is gone, and no longer.
                if let Some(loc) = index.map.get(key).copied() {
                    index.drop_record(key, loc);
                    deleted += 1;
                    let segment = &mut index.segments[loc.segment as usize];
                    if let Some(file) = segment.file.clone() {
                        // The pin keeps the segment from reuse until its mark is written, so the
                        // mark can never land on a record of the segment's next life.
                        segment.pins += 1;
                        marks.push((file, segment.epoch, *key, loc));
                    }
                }
            }
        }
        if !marks.is_empty() {
            self.shared.mark_deleted(&marks);
            let mut index = self.shared.index.lock();
            for (_, _, _, loc) in &marks {
                index.segments[loc.segment as usize].pins -= 1;
            }
        }
        deleted
    }

    /// Deletes every unlocked record, persistently like `delete`.
    fn clear(&self) -> usize {
        let keys: Vec<ObjectKey> = self.shared.index.lock().map.keys().copied().collect();
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
        drop(self.jobs.lock().take());
        let workers = std::mem::take(&mut *self.workers.lock());
        for worker in workers {
            let _ = worker.join();
        }
        // No store runs now (the workers are gone), so no write is in flight.
        let pipe = self.shared.writer.lock().pipe.take();
        if let Some(WritePipe { requests, done, thread }) = pipe {
            drop(requests);
            drop(done);
            let _ = thread.join();
        }
        if let Some((stop, flusher)) = self.flusher.lock().take() {
            drop(stop);
            let _ = flusher.join();
        }
        // Whatever the policy, a clean close leaves everything written on stable storage.
        if self.shared.state.lock().read_only.is_none() {
            let all: Vec<u32> = (0..self.shared.index.lock().segments.len() as u32).collect();
            if self.shared.sync_segments(all.into_iter()).is_err() {
                self.shared.metrics.failed(Failure::Io);
            }
        }
        self.shared.publish();
    }
}

impl Drop for DiskStore {
    fn drop(&mut self) {
        self.close();
    }
}
