//! The DiskStore: segment files, the in-memory index rebuilt at open, worker threads, and the
//! `TierAdapter` face.
//!
//! Writes append records to one active segment, in order, at most two at a time; so after a
//! crash only the last two records of a segment can be torn (or the second-last missing), and a
//! load verifies every record before serving it. The write thread (`tierkv-disk-write`) hands
//! records to two writer threads (`tierkv-disk-w<n>`) while the storing I/O thread copies and
//! checksums the next record into another buffer, so copy, checksum and writes overlap; a full
//! segment is sealed with its writes in flight (their records are unpublished until their task
//! ends). The I/O threads (`tierkv-disk-<n>`) take lookups first, which read only the index
//! (each evicting first what the stores queued before it will evict), then loads and stores in
//! turns, one store prepared at a time ([`Queue`]): a request whose hit is on disk does not
//! wait behind the demotions queued before it, and the demotions still get their share of the
//! disk. A load of several records is split over the I/O threads, so its reads are in flight at
//! once. Records become visible in the index only after their whole store task was written
//! (and synced, under `FsyncPolicy::Always`). Loads read a record while its segment is pinned,
//! verify header, epoch, key and payload checksum, and only then copy into the caller's sink.
//! Eviction drops a whole sealed segment that holds no locked, no pinned and no unpublished
//! record (one of a store task not yet published), and reuses its file under a new epoch.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::BuildHasher;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, unbounded};
use parking_lot::Mutex;
use tierkv_core::policy::{JudgedOrder, Order, PolicyKind, SampleKey, SegmentPolicy};
use tierkv_core::{
    AlignedBuf, Bitmap, Board, ChunkSink, Completion, Departing, Departures, JointLoad, LoadItem,
    ObjectKey, StoreItem, TaskId, TierAdapter, TierError, TierUsage,
};

use crate::config::{DiskStoreConfig, FsyncPolicy, ReadMode};
use crate::error::DiskError;
use crate::format::{BLOCK, Header, Superblock, payload_checksum, record_bytes};
use tierkv_tier_metrics::{DepartingMetrics, TierMetrics};

use crate::metrics::{self, Failure, ReadOnlyGauge};
use crate::segment::{
    DirLock, IoMode, Layout, SegmentFile, available_bytes, file_number, file_path, files_bytes,
    is_no_space, probe, room, secure, sync_dir,
};

/// How often a read-only store tries to become writable again (`DiskStore::maintain`).
pub const WRITABLE_RETRY: Duration = Duration::from_secs(2);

/// Where a record lives: its segment, and its offset in the segment's file; and whether its
/// payload is known good. A record the restart scan found has had only its header checked (a
/// crash may have left the header without its payload) until a load reads it: a store of its
/// key writes a fresh record, which replaces it. (The flag sits in the padding after `segment`:
/// it costs the index nothing.)
#[derive(Clone, Copy, Debug)]
struct Loc {
    segment: u32,
    verified: bool,
    offset: u64,
    len: u64,
}

impl Loc {
    /// A record this process wrote (its payload is what it was given).
    fn written(segment: u32, offset: u64, len: u64) -> Self {
        Loc { segment, verified: true, offset, len }
    }
}

/// The same record: its place, whether verified or not.
impl PartialEq for Loc {
    fn eq(&self, other: &Self) -> bool {
        (self.segment, self.offset, self.len) == (other.segment, other.offset, other.len)
    }
}

impl Eq for Loc {}

const _: () = assert!(std::mem::size_of::<Loc>() == 24, "the flag fits in Loc's padding");

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    /// No records: never created, or failed to initialise.
    Free,
    /// Being initialised for a new epoch by the writer.
    Preparing,
    /// Receiving appends.
    Active,
    /// Full or closed for appends; evictable when nothing locks or pins it and every record
    /// written into it is published or abandoned.
    Sealed,
    /// Its name is taken by something the store did not create (a directory, a FIFO, a
    /// symlink, another user's file): never used.
    Unusable,
}

struct Segment {
    /// The file that holds it (shared with the other segments of that file).
    file: Option<Arc<SegmentFile>>,
    status: Status,
    epoch: u64,
    /// Which life this is in the order the store opened (or recovered) lives, from 1: what the
    /// policy samples by, as the simulation numbers its segments' lives.
    serial: u64,
    /// End of the last record written, from the segment's start (appends go here).
    end: u64,
    /// This life writes over space its file held before (the segment was used before, in this
    /// process or an earlier one), not over space allocated for it: on a filesystem that copies
    /// on write such a write needs new room all the same ([`Shared::notice_refused`]).
    overwrites: bool,
    /// Keys whose records were published into this segment (some may since be deleted).
    keys: Vec<ObjectKey>,
    /// Distinct keys of this segment that lookups hold locked.
    locked: u64,
    /// Loads reading from this segment now.
    pins: u64,
    /// Records handed to the write thread (counted just before) whose store task is not yet
    /// published or abandoned: until it is, the segment's space is theirs even though the index
    /// does not name them.
    unpublished: u64,
    /// Records on disk that no index entry names, each with its life's epoch, which a restart
    /// would find again: those of its earlier lives indexed when it was evicted; records of this
    /// life or an earlier one whose mark did not settle ([`Index::keep_unmarked`]: a delete's, a
    /// failed task's, a publish's loser's, a damaged record's found by a load); records a load could
    /// not read (an I/O error); a key's second copy found by a restart. A delete or a
    /// clear marks those of its keys deleted. The earlier lives' records end once the first
    /// record of a new life is written with its superblock and synced (under
    /// `FsyncPolicy::Always` by its store task's sync, or at the task's end should it publish
    /// nothing; under `Periodic` by the flusher's next sync, or by a delete or a clear of one of
    /// them before it; under `Never` once written; `superseded`); a life's own records stay. An
    /// eviction ahead of the stores ([`Index::make_room_ahead`]) leaves them there until a store
    /// reuses the segment, for good if none does; a store that fails before its first record is
    /// written leaves them too.
    stale: Vec<(u64, ObjectKey, Loc)>,
    /// Deletes and clears marking stale records now: until they are done, the life's first
    /// record is not handed to the write thread (a mark must not land on it).
    marking: u32,
    /// The life's first record is with the write thread, stale records behind it: none is
    /// marked until it is written, which ends them once a sync covers it (`unsynced`). A write
    /// that fails (or is skipped) leaves them, unmarkable until the life's writes are over: until
    /// the segment is sealed with no record unpublished ([`Shared::settle`]), or evicted again; a
    /// sync that fails, until the segment's next life (`sync_failed`).
    superseding: bool,
    /// The write of the life's first record ended without ending the stale records behind it
    /// yet: it failed (a delete or a clear then waits for the life's writes to be over,
    /// [`Segment::waits_to_end_stale`]), or no sync covered it yet (it waits no more, and syncs
    /// the file itself).
    unsuperseded: bool,
    /// The epoch of the life whose first record, written over stale records, no sync has
    /// covered yet: under `FsyncPolicy::Always` its task's sync ([`Shared::publish_records`]),
    /// or, should the task publish nothing, a sync at its end
    /// ([`Shared::end_unpublished_lives`]); under `Periodic` the flusher's next sync
    /// ([`Shared::sync_dirty`]); a delete or a clear of one of the stale keys syncs it first
    /// ([`Shared::mark_stale`]). It outlives the life's eviction: until that sync, a power loss
    /// could bring back the earlier lives' records the life's writes overwrote, so a mark that
    /// finds one overwritten is settled only after it.
    unsynced: Option<u64>,
    /// A sync meant to cover `unsynced` failed: no later one is trusted for it (after a failed
    /// sync the kernel may report the next one clean without the pages on disk), so its stale
    /// records stay unmarked until the segment's next life is written and synced.
    sync_failed: bool,
}

impl Segment {
    fn free() -> Self {
        Segment {
            file: None,
            status: Status::Free,
            epoch: 0,
            serial: 0,
            end: BLOCK,
            overwrites: false,
            keys: Vec::new(),
            locked: 0,
            pins: 0,
            unpublished: 0,
            stale: Vec::new(),
            marking: 0,
            superseding: false,
            unsuperseded: false,
            unsynced: None,
            sync_failed: false,
        }
    }

    /// Whether a delete or a clear waits before marking the stale records: the life's first
    /// record is on its way (its write ends them, `Shared::superseded`), or it was not written
    /// (its write failed, or was skipped) and the life's writes are not over yet (once they are,
    /// they can be marked: [`Segment::end_unwritten_life`]). Neither takes long.
    fn waits_to_end_stale(&self) -> bool {
        self.superseding && (!self.unsuperseded || self.unsynced != Some(self.epoch))
    }

    /// The life's first record was not written (its write failed, or was skipped behind an
    /// earlier failed write) and its writes are over: the segment is sealed (a failed write
    /// seals it) with no record unpublished, so no write of the life can land under a mark any
    /// more, and the stale records behind that record can be marked. Returns whether it ended
    /// the wait for it (`superseding`); the caller wakes the deletes and clears waiting.
    fn end_unwritten_life(&mut self) -> bool {
        let unwritten = self.superseding && self.unsuperseded && self.unsynced != Some(self.epoch);
        if unwritten && self.unpublished == 0 && self.status == Status::Sealed {
            self.superseding = false;
            self.unsuperseded = false;
            return true;
        }
        false
    }

    fn evictable(&self) -> bool {
        self.status == Status::Sealed && self.locked == 0 && self.pins == 0 && self.unpublished == 0
    }
}

/// One life of a segment, as the eviction policy tracks it: a reused segment is a new life (a new
/// epoch), never the return of the one evicted before, so a policy that remembers its victims
/// (the adaptive policy's and S3-FIFO's ghosts) does not take every reused segment for a victim
/// that came back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct SegmentLife {
    id: u32,
    epoch: u64,
    serial: u64,
}

impl SegmentLife {
    fn of(id: u32, segment: &Segment) -> Self {
        SegmentLife { id, epoch: segment.epoch, serial: segment.serial }
    }
}

impl SampleKey for SegmentLife {
    /// The life's serial: the adaptive policy's shadows then sample the same lives in the
    /// daemon as in `tierkv replay --simulate`, which numbers lives in the same order. (The
    /// epoch is random per process; sampling by it made every run's shadows differ.)
    fn sample_bits(&self) -> u64 {
        self.serial
    }
}

struct Index {
    map: HashMap<ObjectKey, Loc>,
    /// Lock count and segment of every locked key.
    locks: HashMap<ObjectKey, (u64, u32)>,
    lock_total: u64,
    segments: Vec<Segment>,
    /// Tracks exactly the sealed segments, each in its current life, told the keys published
    /// into each and looked up.
    policy: Box<dyn SegmentPolicy<SegmentLife, ObjectKey>>,
    /// Lives opened or recovered so far: the last one's serial.
    lives: u64,
    /// Bytes of the records indexed, all segments together.
    live_bytes: u64,
    /// No segment before this one is free: where the search for a free segment starts.
    free_from: usize,
    /// The segment receiving appends (the writer's, mirrored here for lookups), or being
    /// opened to receive them (`Status::Preparing`, set under the same lock): a lookup never sees
    /// a segment taken for the stores that it does not count as theirs.
    active: Option<u32>,
    /// Sizes of the records of the store task being prepared that have no room yet, in order.
    preparing: VecDeque<u64>,
    /// The segments that hold stale records (`Segment::stale`).
    stale: BTreeSet<u32>,
}

/// A segment's life whose first record is written and not yet synced (`Segment::unsynced`): the
/// segment, the life's epoch, its file.
type WrittenLife = (u32, u64, Arc<SegmentFile>);

/// A record to mark deleted ([`Shared::mark_deleted`]): its segment's file, the epoch of the life
/// it was written in, its key and place.
type Mark = (Arc<SegmentFile>, u64, ObjectKey, Loc);

impl Index {
    /// The lives among `segments` whose first record is written and not yet synced, with stale
    /// records behind it that `wanted` accepts; none whose sync failed.
    fn written_lives(
        &self,
        segments: impl Iterator<Item = u32>,
        wanted: impl Fn(&[(u64, ObjectKey, Loc)]) -> bool,
    ) -> Vec<WrittenLife> {
        segments
            .filter_map(|id| {
                let segment = &self.segments[id as usize];
                let epoch =
                    segment.unsynced.filter(|_| !segment.sync_failed && wanted(&segment.stale))?;
                Some((id, epoch, segment.file.clone()?))
            })
            .collect()
    }

    /// Keeps the records of `marks` whose mark did not settle (`settled`, from
    /// [`Shared::mark_deleted`]: its read or write failed) among their segments' stale records, in
    /// the life each was written in, so that the next delete of its key, or a clear, marks it
    /// again: neither indexed nor marked, it would come back with a restart and nothing would
    /// reach it meanwhile. Each segment must still be in (or past) that life.
    fn keep_unmarked(&mut self, marks: &[Mark], settled: &[bool]) {
        for ((_, epoch, key, loc), settled) in marks.iter().zip(settled) {
            if !settled {
                self.keep_stale(*epoch, *key, *loc);
            }
        }
    }

    /// Keeps a record that no index entry names, written in its segment's life `epoch`, among
    /// the segment's stale records (`Segment::stale`): a delete of its key, or a clear, marks it.
    fn keep_stale(&mut self, epoch: u64, key: ObjectKey, loc: Loc) {
        self.segments[loc.segment as usize].stale.push((epoch, key, loc));
        self.stale.insert(loc.segment);
    }

    /// The first record of segment `id`'s life is on disk for good: the stale records of its
    /// earlier lives end (`Segment::stale`; the life's own stay), and so does the wait for it.
    fn end_earlier_lives(&mut self, id: u32) {
        let segment = &mut self.segments[id as usize];
        let life = segment.epoch;
        segment.superseding = false;
        segment.stale.retain(|(of, _, _)| *of == life);
        if segment.stale.is_empty() {
            self.stale.remove(&id);
        }
    }

    /// The next life's serial.
    fn next_serial(&mut self) -> u64 {
        self.lives += 1;
        self.lives
    }

    /// The current life of segment `id`.
    fn life(&self, id: u32) -> SegmentLife {
        SegmentLife::of(id, &self.segments[id as usize])
    }

    /// `id` is sealed: its current life enters the policy.
    fn track_sealed(&mut self, id: u32) {
        let life = self.life(id);
        self.policy.seal(life);
    }

    /// Indexes `key`'s record at `loc`, unless the key already has one; returns whether it did.
    /// A lock the key still holds (its earlier record was found damaged and dropped while a
    /// lookup held it) moves to the new record's segment, which it must now keep from eviction.
    fn index_record(&mut self, key: ObjectKey, loc: Loc) -> bool {
        if self.map.contains_key(&key) {
            return false;
        }
        if let Some((_, locked_in)) = self.locks.get_mut(&key)
            && *locked_in != loc.segment
        {
            let earlier = std::mem::replace(locked_in, loc.segment);
            self.segments[earlier as usize].locked -= 1;
            self.segments[loc.segment as usize].locked += 1;
        }
        self.map.insert(key, loc);
        let segment = &mut self.segments[loc.segment as usize];
        segment.keys.push(key);
        self.live_bytes += record_bytes(loc.len);
        let life = self.life(loc.segment);
        self.policy.written(&life, &key);
        true
    }

    /// Drops the index entry of `key` if it still points at `loc`.
    fn drop_record(&mut self, key: &ObjectKey, loc: Loc) {
        if self.map.get(key) == Some(&loc) {
            self.map.remove(key);
            self.live_bytes -= record_bytes(loc.len);
        }
    }

    /// Locks every key of `keys` indexed here or on its way here (on `board`), and tells the
    /// policy of each hit and miss. Lookups name a chain root first; the keys are visited leaf
    /// first (as L2 touches them), so the root's segment ends up the most recent and eviction
    /// takes a chain's tail before its root. The policy hears of every key before any is locked:
    /// a panic in it (a bug) leaves no lock behind that nobody would release.
    fn lookup_and_lock(&mut self, board: &mut Board, keys: &[ObjectKey]) -> Bitmap {
        enum Found {
            Indexed(Loc),
            Departing,
            Missing,
        }
        let mut found: Vec<Found> = keys
            .iter()
            .rev()
            .map(|key| match self.map.get(key).copied() {
                Some(loc) => {
                    let life = self.life(loc.segment);
                    self.policy.hit(&life, key);
                    Found::Indexed(loc)
                }
                // On its way here: found, without a word to the policy, which hears of the chunk
                // when its record is written.
                None if board.contains(key) => Found::Departing,
                None => {
                    self.policy.missed(key);
                    Found::Missing
                }
            })
            .collect();
        found.reverse();
        let mut locked = vec![false; keys.len()];
        for ((key, found), locked) in keys.iter().zip(found).zip(&mut locked) {
            match found {
                Found::Indexed(loc) => {
                    let (count, _) = self.locks.entry(*key).or_insert((0, loc.segment));
                    *count += 1;
                    if *count == 1 {
                        self.segments[loc.segment as usize].locked += 1;
                    }
                }
                Found::Departing => {
                    board.lock(key);
                }
                Found::Missing => continue,
            }
            self.lock_total += 1;
            *locked = true;
        }
        Bitmap::from_bools(locked)
    }

    /// Evicts the policy's victim among the evictable segments: drops its records from the index
    /// (they stay stale until the segment's next life is written) and takes its life out of the
    /// policy. Returns its id and how many records it dropped, or `None` when every segment holds
    /// locked, pinned or unpublished records.
    fn evict_one(&mut self) -> Option<(u32, u64)> {
        let Index { segments, policy, .. } = self;
        let victim = policy.evict(&mut |life| segments[life.id as usize].evictable(), &|life| {
            segments[life.id as usize].keys.as_slice()
        });
        let SegmentLife { id, .. } = victim?;
        let keys = std::mem::take(&mut self.segments[id as usize].keys);
        let epoch = self.segments[id as usize].epoch;
        let mut evicted = Vec::new();
        for key in keys {
            if let Some(loc) = self.map.get(&key).copied()
                && loc.segment == id
            {
                self.drop_record(&key, loc);
                evicted.push((epoch, key, loc));
            }
        }
        let dropped = evicted.len() as u64;
        let segment = &mut self.segments[id as usize];
        // Evictable: no write of its life is in flight or to come, a failed first one included.
        // An unsynced first record stays so until a sync.
        segment.superseding = false;
        segment.unsuperseded = false;
        segment.stale.extend(evicted);
        if !segment.stale.is_empty() {
            self.stale.insert(id);
        }
        Some((id, dropped))
    }

    /// Makes the room that the records of the stores queued ahead (`queued`, one list of key and
    /// length a task, in order; after those of the task being prepared) will take, as preparing
    /// them would, one task after another: the segments they would open, free ones first, then
    /// the policy's victims, evicted now and left free for them. As a store does, each task keeps
    /// the segments of its keys present (pinned while its room is made), and a key whose record
    /// an earlier task's room evicted takes room again. So a lookup that runs ahead of queued
    /// stores finds what it would have found behind them (their victims gone) rather than a disk
    /// larger by their backlog; their own keys are found on their way here, or above. Returns
    /// the records evicted.
    fn make_room_ahead(
        &mut self,
        queued: &[Vec<(ObjectKey, u64)>],
        config: &DiskStoreConfig,
    ) -> u64 {
        // Where the records go: the active segment's room (all of it, while it is being
        // opened), then one new segment after another, free ones first.
        let active = self.active.map(|id| &self.segments[id as usize]);
        let receiving = |s: &&Segment| matches!(s.status, Status::Active | Status::Preparing);
        let mut room = Room {
            end: active.filter(receiving).map(|s| s.end),
            next_free: self.free_from,
            freed: HashSet::new(),
            evicted: 0,
            full: false,
        };
        // The task being prepared pins its own present keys' segments.
        for size in self.preparing.clone() {
            room.place(self, size, config);
        }
        for task in queued {
            if task.iter().any(|(_, len)| *len > config.max_chunk_bytes) {
                continue; // Refused whole.
            }
            let mut batch = HashSet::with_capacity(task.len());
            let mut pinned = Vec::new();
            let mut sizes = Vec::new();
            for (key, len) in task {
                match self.map.get(key).copied() {
                    Some(loc) if loc.verified => pinned.push(loc.segment),
                    _ if batch.insert(*key) => sizes.push(record_bytes(*len)),
                    _ => {}
                }
            }
            for &id in &pinned {
                self.segments[id as usize].pins += 1;
            }
            // Unpinned by the guard, so that a policy that panics placing them leaks no pin.
            let pins = PinnedAhead { index: self, segments: pinned };
            for size in sizes {
                room.place(pins.index, size, config);
            }
        }
        room.evicted
    }

    /// Segment `id` is free again (evicted ahead of the stores that will use it, or its
    /// initialisation failed): the search starts at it.
    fn free(&mut self, id: u32) {
        self.segments[id as usize].status = Status::Free;
        self.free_from = self.free_from.min(id as usize);
    }

    /// The first free segment; unless `create` allows any, one whose space its file already
    /// holds (`layout` says where it lies). Without `create` (a full disk) each file's length is
    /// asked of the OS once per call, not once per free segment.
    fn free_segment(&mut self, create: bool, layout: &Layout) -> Option<u32> {
        let from = self.free_from;
        let mut lengths: HashMap<u32, u64> = HashMap::new();
        let mut allocated = |id: usize, s: &Segment| {
            let Some(file) = &s.file else { return false };
            let n = layout.file_of(id as u32);
            let len = *lengths.entry(n).or_insert_with(|| file.len().unwrap_or(0));
            len >= layout.base(id as u32) + layout.segment_bytes
        };
        let found = self.segments[from..]
            .iter()
            .enumerate()
            .position(|(i, s)| s.status == Status::Free && (create || allocated(from + i, s)))
            .map(|i| from + i);
        if create {
            // Every segment before the one found (or all of them) is in use.
            self.free_from = found.unwrap_or(self.segments.len());
        }
        found.map(|i| i as u32)
    }
}

/// Where [`Index::make_room_ahead`] places the records of the stores queued ahead.
struct Room {
    /// The end of the segment they fill now, if any.
    end: Option<u64>,
    /// Where the search for the next free segment goes on.
    next_free: usize,
    /// Segments this call freed, already theirs: not counted free again.
    freed: HashSet<u32>,
    evicted: u64,
    /// No segment is free or evictable: the stores will fail to find room too.
    full: bool,
}

impl Room {
    /// Places a record of `size` bytes: in the segment being filled, or in the next free
    /// segment, or in the policy's victim, evicted now and left free.
    fn place(&mut self, index: &mut Index, size: u64, config: &DiskStoreConfig) {
        if let Some(at) = self.end
            && at + size <= config.segment_bytes
        {
            self.end = Some(at + size);
            return;
        }
        if self.full {
            return;
        }
        let segments = &index.segments;
        let free = (self.next_free..segments.len())
            .find(|&i| segments[i].status == Status::Free && !self.freed.contains(&(i as u32)));
        if let Some(i) = free {
            self.next_free = i + 1;
        } else if let Some((id, records)) = index.evict_one() {
            self.evicted += records;
            index.free(id);
            self.freed.insert(id);
        } else {
            self.full = true;
            return;
        }
        self.end = Some(BLOCK + size);
    }
}

/// The writer's state: only one store task prepares records at a time.
struct Writer {
    active: Option<u32>,
    /// Record buffers in hand; the others are with the write thread, and come back on `free`.
    spare: Vec<AlignedBuf>,
    /// Record buffers handed to the write thread in a record and not yet received back on
    /// `free` (as a buffer, or as lost). With `spare`, every buffer the writer can count on: a
    /// buffer lost anywhere (to a panic) is made again when fewer than `RECORD_BUFFERS` are.
    out: usize,
    /// The write thread, once started.
    pipe: Option<WritePipe>,
    /// Store tasks so far; numbers each record, so the write thread can tell tasks apart.
    tasks: u64,
}

/// Record buffers per store: one being filled while the others are written or queued (the
/// slack lets the write thread keep writing while a loaded machine delays the storing thread).
const RECORD_BUFFERS: usize = 4;

/// The longest a store waits for the write thread to hand a record buffer back. Buffers come
/// back as their writes finish (or are reported lost), so only a write that hangs (a dead
/// disk or mount) reaches it: the store then fails (a miss) instead of holding the writer, and
/// the stores queued behind it, for ever; and the stores after it fail at once until a buffer
/// comes back (`Shared::stuck`).
#[cfg(not(test))]
const BUFFER_WAIT: Duration = Duration::from_secs(10);
/// Under test, longer than any test holds writes (`WriteFaults::writes`), so that the store left
/// waiting for a buffer behind them is not failed, and the writer left stuck, on a machine loaded
/// enough to stretch the test past 10 s. The tests of the bound pass their own wait.
#[cfg(test)]
const BUFFER_WAIT: Duration = Duration::from_secs(120);

/// What the write thread hands back to the storing thread for each record buffer it took.
enum Freed {
    /// The buffer, done with.
    Buffer(AlignedBuf),
    /// The buffer was lost to a panic (a bug): the storing thread makes another when it needs
    /// one, and fails that store if it cannot (no memory), rather than waiting for it.
    Lost,
}

/// The write thread (`tierkv-disk-write`): hands records, in order, to the writer threads
/// (`tierkv-disk-w<n>`), and publishes each store task once all its records are written.
struct WritePipe {
    messages: Sender<WriteMsg>,
    /// Buffers the write thread is done with, or lost.
    free: Receiver<Freed>,
    thread: JoinHandle<()>,
}

enum WriteMsg {
    /// One record: `bytes` of `buf`, at `at` of `file`.
    Record { task: u64, file: Arc<SegmentFile>, buf: AlignedBuf, bytes: Span, loc: Loc, epoch: u64 },
    /// Every record of store task `task` has been handed over: publish them (unless one failed)
    /// and complete the caller's task with its sources.
    End { task: u64, id: TaskId, records: Vec<(ObjectKey, Loc)>, sources: Vec<StoreItem> },
    /// Store task `task` failed (`error`) before handing over all its records: what it handed
    /// over (`records`) is written and never published. The write thread marks those written
    /// deleted, forgets the task and only then completes the caller's task, with its sources: a
    /// caller that deletes a key once told of the failure must find nothing of it to come back.
    Abandon {
        task: u64,
        id: TaskId,
        records: Vec<(ObjectKey, Loc)>,
        error: TierError,
        sources: Vec<StoreItem>,
    },
}

/// What a store task handed to the write thread.
struct Queued {
    task: u64,
    records: Vec<(ObjectKey, Loc)>,
    /// Why the task failed after handing `records` over (some, not all): they are abandoned.
    failed: Option<TierError>,
}

/// Record writes in flight at once. Two let one record's hand-over and wake-up overlap the
/// write before it, so the disk never waits for the write thread between records. (The tiers
/// benchmark measures the disk's write limit with as many in flight.)
pub const WRITES_IN_FLIGHT: usize = 2;

/// What of a record buffer is written, and where in the file. A buffer keeps a block in front of
/// the record for the superblock of a segment's life: the first record of a life is written with
/// it, in one write, so a segment of one record costs one write, not two.
#[derive(Clone, Copy)]
struct Span {
    start: usize,
    len: usize,
    at: u64,
}

/// One record to write, and what its outcome is reported with.
struct Write {
    task: u64,
    file: Arc<SegmentFile>,
    buf: AlignedBuf,
    bytes: Span,
    loc: Loc,
    epoch: u64,
}

/// A finished [`Write`], its buffer handed back.
struct Written {
    task: u64,
    buf: AlignedBuf,
    loc: Loc,
    epoch: u64,
    result: Result<(), TierError>,
    /// The OS failed the write (not a skip, a panic or an injected fault): the directory may
    /// have turned unwritable ([`Shared::notice_unwritable`]).
    refused: bool,
}

impl Write {
    fn run(self) -> Written {
        let Write { task, file, buf, bytes, loc, epoch } = self;
        let mut refused = false;
        let result = match buf.as_slice().get(bytes.start..bytes.start + bytes.len) {
            // A panic (a bug) fails this write, reported as any failed write is; the buffer,
            // outside the call, still goes back, and the writer thread lives on.
            Some(record) => {
                match catch_unwind(AssertUnwindSafe(|| file.write_at(record, bytes.at))) {
                    Ok(written) => written.map_err(|e| {
                        refused = true;
                        io_error(&file.path, "writing", &e)
                    }),
                    Err(_) => Err(TierError::Io("internal panic while writing".into())),
                }
            }
            None => Err(TierError::Io("a record larger than its buffer".into())),
        };
        Written { task, buf, loc, epoch, result, refused }
    }

    /// The write as a disk failing part way leaves it (`write_all_at` can): all but its last
    /// block (the superblock of a life's first record, the header) written, then an error.
    #[cfg(test)]
    fn torn(self) -> Written {
        let Write { task, file, buf, bytes, loc, epoch } = self;
        let header = &buf.as_slice()[bytes.start..bytes.start + bytes.len - BLOCK as usize];
        file.write_at(header, bytes.at).unwrap();
        let result = Err(TierError::Io("injected: torn write".into()));
        Written { task, buf, loc, epoch, result, refused: false }
    }
}

/// The write thread's loop. It hands records to `WRITES_IN_FLIGHT` writer threads in order,
/// and publishes a store task only once every write before its end has finished (so an
/// abandoned task's segment is released, and a published record read, only after its bytes
/// are on the file). Once a write fails, every later record of the same task and of the same
/// segment life not yet handed over is skipped (nothing written) and the segment is sealed; the
/// task completes with the failure and publishes nothing. So does a task with a record after
/// the failed one in that life, written by another task before the failure was known: a restart
/// scans a life from its start and stops at the failed record, so it would not find the record,
/// and a store acknowledged durable would be lost. Records written after a failed or torn one are
/// harmless: nothing indexes a record of an unpublished task at run time, and after a restart the
/// scan indexes only records whose header matches, and a load verifies epoch, key and checksum
/// before serving one. A task that publishes nothing marks the records it wrote deleted at its
/// end ([`Shared::mark_unpublished`]), so a restart does not bring back a key deleted or cleared
/// meanwhile.
///
/// The thread runs no caller code, but a bug in this crate (or in a policy it calls) that panics
/// here costs the task whose message (or finished write) it was handling, never the thread:
/// every step runs under `InFlight::step`, that task completes as failed, counted, its sources
/// handed back, any record buffer the panic lost is reported lost (only those: the storing
/// thread makes another), and later tasks are written as before.
fn write_records(shared: Arc<Shared>, messages: Receiver<WriteMsg>, free: Sender<Freed>) {
    let (writes, queued) = unbounded::<Write>();
    let (report, written) = unbounded::<Written>();
    std::thread::scope(|scope| {
        let mut writers = 0;
        for n in 0..WRITES_IN_FLIGHT {
            let (queued, report) = (queued.clone(), report.clone());
            #[cfg(test)]
            let faults = &shared.faults;
            let spawned = std::thread::Builder::new()
                .name(format!("tierkv-disk-w{n}"))
                .spawn_scoped(scope, move || {
                    while let Ok(write) = queued.recv() {
                        #[cfg(test)]
                        faults.writes.pass();
                        if report.send(write.run()).is_err() {
                            break;
                        }
                    }
                });
            writers += usize::from(spawned.is_ok());
        }
        drop((queued, report));
        let mut state = InFlight {
            shared: &shared,
            free: &free,
            written: &written,
            in_flight: 0,
            held: 0,
            failed_tasks: HashMap::new(),
            lives: LifeFailures::default(),
        };
        // Finished writes are collected as they come, so their buffers go back to the storing
        // thread while it waits for one; the queue of results is watched only while a write
        // is in flight.
        let nothing = crossbeam_channel::never::<Written>();
        loop {
            let results = if state.in_flight > 0 { &written } else { &nothing };
            let message = crossbeam_channel::select! {
                recv(messages) -> message => message,
                recv(results) -> done => {
                    state.on_written(done);
                    continue;
                }
            };
            let Ok(message) = message else {
                break;
            };
            state.handle(message, &writes, writers);
        }
        state.step("collecting the last writes", InFlight::collect_all, |_| {});
        drop(writes);
    });
}

/// The write thread's bookkeeping of writes in flight and of failures.
struct InFlight<'a> {
    shared: &'a Shared,
    free: &'a Sender<Freed>,
    written: &'a Receiver<Written>,
    in_flight: usize,
    /// Record buffers in this thread's hands: taken in with a record or a finished write, not
    /// yet handed to a writer or back to the storing thread. None between steps; after a step
    /// that panicked, those it lost.
    held: usize,
    failed_tasks: HashMap<u64, TierError>,
    lives: LifeFailures,
}

/// Which segment lives had a write fail, and which records the tasks in flight handed over.
#[derive(Default)]
struct LifeFailures {
    /// For each segment whose current life had a write fail: the life's epoch and the lowest
    /// offset that failed. A record of another life drops it, so there is at most one entry a
    /// segment: a segment is reused only once every task that wrote its earlier life has ended
    /// (its unpublished records keep it from eviction until then, and a task ends on this
    /// thread, after its writes are reported), so no task in flight can be behind that failure
    /// any more, and no record or report of that life is to come. Epochs are random, not
    /// ordered: a life is told from another by its epoch alone, never by which is larger.
    failed: HashMap<u32, (u64, u64)>,
    /// The records each task in flight has handed over, with their lives' epochs.
    handed_over: HashMap<u64, Vec<(Loc, u64)>>,
    /// The records of each task in flight whose write was skipped, by segment and
    /// offset: a task that fails marks deleted only its other records (`Shared::mark_unpublished`).
    unwritten: HashMap<u64, HashSet<(u32, u64)>>,
}

impl LifeFailures {
    fn handed_over(&mut self, task: u64, loc: Loc, epoch: u64) {
        if self.failed.get(&loc.segment).is_some_and(|(failed, _)| *failed != epoch) {
            self.failed.remove(&loc.segment);
        }
        self.handed_over.entry(task).or_default().push((loc, epoch));
    }

    /// Notes a failed write of the record at `loc` in life `epoch`.
    fn write_failed(&mut self, loc: Loc, epoch: u64) {
        match self.failed.get_mut(&loc.segment) {
            Some((failed, lowest)) if *failed == epoch => *lowest = (*lowest).min(loc.offset),
            // The segment's next life: the earlier one's tasks have ended.
            _ => {
                self.failed.insert(loc.segment, (epoch, loc.offset));
            }
        }
    }

    /// The lowest offset that failed in `segment`'s life `epoch`, if one did.
    fn failed_at(&self, segment: u32, epoch: u64) -> Option<u64> {
        self.failed.get(&segment).filter(|(failed, _)| *failed == epoch).map(|(_, at)| *at)
    }

    /// Whether a write to `loc`'s segment in life `epoch` has failed.
    fn failed(&self, loc: Loc, epoch: u64) -> bool {
        self.failed_at(loc.segment, epoch).is_some()
    }

    /// Whether a record `task` handed over lies after a failed write in its segment's life: a
    /// restart, which scans a life from its start and stops at the failed record, would not
    /// find it.
    fn behind_a_failed_write(&self, task: u64) -> bool {
        self.handed_over.get(&task).is_some_and(|records| {
            records.iter().any(|(loc, epoch)| {
                self.failed_at(loc.segment, *epoch).is_some_and(|at| loc.offset > at)
            })
        })
    }

    /// Notes that `task`'s record at `loc` was skipped, never written.
    fn unwritten(&mut self, task: u64, loc: Loc) {
        self.unwritten.entry(task).or_default().insert((loc.segment, loc.offset));
    }

    /// Forgets a task that ended; returns which of its records were not written (`unwritten`).
    fn forget(&mut self, task: u64) -> HashSet<(u32, u64)> {
        self.handed_over.remove(&task);
        self.unwritten.remove(&task).unwrap_or_default()
    }
}

/// The records of `records` not known unwritten (`unwritten`, from [`LifeFailures::forget`]):
/// written, failed (a failed write may have left its header), or whose outcome a panic lost.
fn written_of(
    records: &[(ObjectKey, Loc)],
    unwritten: &HashSet<(u32, u64)>,
) -> Vec<(ObjectKey, Loc)> {
    records
        .iter()
        .filter(|(_, loc)| !unwritten.contains(&(loc.segment, loc.offset)))
        .copied()
        .collect()
}

impl InFlight<'_> {
    /// Runs one step of the thread under `catch_unwind`. A panic (a bug) is counted and logged,
    /// `recover` fails what the step was about, and every record buffer the step had in hand
    /// and lost is reported lost, so the storing thread never waits for one that will not come
    /// back (it makes another; this thread allocates nothing, so it cannot fail to); the thread
    /// goes on with the next message.
    fn step(&mut self, doing: &str, step: impl FnOnce(&mut Self), recover: impl FnOnce(&mut Self)) {
        if catch_unwind(AssertUnwindSafe(|| step(self))).is_ok() {
            return;
        }
        self.panicked(doing);
        recover(self);
        for _ in 0..std::mem::take(&mut self.held) {
            let _ = self.free.send(Freed::Lost);
        }
    }

    /// Handles one message of the storing threads. A panic (a bug) fails the task the message
    /// belongs to and is counted; the thread goes on with the next message.
    fn handle(&mut self, message: WriteMsg, writes: &Sender<Write>, writers: usize) {
        match message {
            WriteMsg::Record { task, file, buf, bytes, loc, epoch } => {
                self.held += 1;
                let write = Write { task, file, buf, bytes, loc, epoch };
                // Whether it was written is not known: its life is failed as after a failed
                // write (the task fails, and so does any behind it in the life), and so is the
                // write for the stale records behind it, as when collecting a write panics
                // (should it still land, its outcome then ends them as usual).
                self.step(
                    "handing over a record",
                    |s| s.record(write, writes, writers),
                    |s| {
                        let _ = s.shared.contained(|| s.shared.superseded(loc, epoch, false));
                        s.write_failed(task, loc, epoch, internal_panic());
                    },
                );
            }
            WriteMsg::Abandon { task, id, records, error, sources } => {
                // On a panic, the records' segments may stay unevictable (space lost until a
                // restart), never evictable under an unpublished record. The sources stay out
                // of the step, and the task completes (failed) whatever happens, once its
                // written records are marked.
                self.step(
                    "abandoning a task",
                    |s| {
                        s.collect_all();
                        s.failed_tasks.remove(&task);
                        let unwritten = s.lives.forget(task);
                        s.shared.mark_unpublished(&written_of(&records, &unwritten));
                        s.shared.end_unpublished_lives(&records);
                        s.shared.settle(&records);
                    },
                    |s| s.forget(task),
                );
                let result = Err(error);
                let _ = self.shared.done.send(Completion::Stored { task: id, result, sources });
                let _ = self.shared.contained(|| self.shared.publish());
            }
            WriteMsg::End { task, id, records, sources } => {
                // The sources stay out of the step: they go back whatever happens.
                let mut result = Err(internal_panic());
                self.step("ending a task", |s| result = s.end(task, &records), |s| s.forget(task));
                let _ = self.shared.done.send(Completion::Stored { task: id, result, sources });
                let _ = self.shared.contained(|| self.shared.publish());
            }
        }
    }

    /// Handles a finished write (or the writers' end); `collected` is a step of its own.
    fn on_written(&mut self, done: Result<Written, crossbeam_channel::RecvError>) {
        self.collected(done);
    }

    /// Forgets a task whose handling panicked.
    fn forget(&mut self, task: u64) {
        self.failed_tasks.remove(&task);
        let _ = self.lives.forget(task);
    }

    /// Hands one record to a writer thread, or fails it at once.
    fn record(&mut self, write: Write, writes: &Sender<Write>, writers: usize) {
        #[cfg(test)]
        WriteFaults::fire(&self.shared.faults.handing_over, "handing a record over");
        let Write { task, loc, epoch, .. } = write;
        self.lives.handed_over(task, loc, epoch);
        if self.failed_tasks.contains_key(&task) || self.lives.failed(loc, epoch) {
            // Never written: nothing of it to mark (`mark_unpublished`).
            self.lives.unwritten(task, loc);
            let e = TierError::Io("skipped: an earlier write to its segment failed".into());
            let buf = write.buf;
            self.finish(Written { task, buf, loc, epoch, result: Err(e), refused: false });
            return;
        }
        #[cfg(test)]
        if self.shared.faults.torn_write.swap(false, Ordering::SeqCst) {
            self.finish(write.torn());
            return;
        }
        if writers == 0 {
            // No writer thread could be started: write here, one at a time.
            self.finish(write.run());
            return;
        }
        while self.in_flight >= writers {
            self.collect_one();
        }
        match writes.send(write) {
            Ok(()) => {
                self.in_flight += 1;
                self.held -= 1;
                #[cfg(test)]
                WriteFaults::fire(&self.shared.faults.handed_over, "a record handed over");
            }
            Err(refused) => self.finish(refused.0.run()),
        }
    }

    /// Publishes a task every record of which was handed over (unless one failed), gives its
    /// segments back to eviction and counts it; returns its outcome.
    fn end(&mut self, task: u64, records: &[(ObjectKey, Loc)]) -> Result<(), TierError> {
        self.collect_all();
        let result = match self.failed_tasks.remove(&task) {
            Some(e) => Err(e),
            None if self.lives.behind_a_failed_write(task) => Err(TierError::Io(
                "an earlier write to its segment failed, so a restart would not find it".into(),
            )),
            None => self
                .shared
                .contained(|| self.shared.publish_records(records))
                .unwrap_or_else(|| Err(TierError::Io("internal panic while publishing".into()))),
        };
        let unwritten = self.lives.forget(task);
        if result.is_err() {
            let written = written_of(records, &unwritten);
            let _ = self.shared.contained(|| self.shared.mark_unpublished(&written));
            let _ = self.shared.contained(|| self.shared.end_unpublished_lives(records));
        }
        if self.shared.contained(|| self.shared.settle(records)).is_none() {
            // The records' segments may stay unevictable (space lost until a restart), never
            // evictable under an unpublished record.
            tracing::error!(task, "the disk write thread panicked settling a task's records");
        }
        self.shared.count_store(&result, records);
        result
    }

    /// Counts and logs a panic of the write thread's own.
    fn panicked(&self, doing: &str) {
        self.shared.metrics.failed(Failure::Panic);
        tracing::error!(
            "the disk write thread panicked {doing}; that task fails, the thread goes on"
        );
    }

    /// Notes a failed write of `task`'s record at `loc` in life `epoch`: the life is sealed and
    /// the task fails.
    fn write_failed(&mut self, task: u64, loc: Loc, epoch: u64, e: TierError) {
        self.lives.write_failed(loc, epoch);
        if self.shared.contained(|| self.shared.seal_failed(loc.segment, epoch)).is_none() {
            // Unsealed, the segment may still take appends; the failed life's records after this
            // one are skipped all the same (`LifeFailures::failed`).
            tracing::error!(segment = loc.segment, "the disk write thread panicked sealing");
        }
        self.failed_tasks.entry(task).or_insert(e);
    }

    /// Hands a write's buffer back and records its outcome.
    fn finish(&mut self, written: Written) {
        let Written { task, buf, loc, epoch, result, refused } = written;
        // First, so that a panic recording the outcome costs no buffer. The store thread may be
        // gone (closing): the buffer is then simply freed.
        let _ = self.free.send(Freed::Buffer(buf));
        self.held -= 1;
        match result {
            Ok(()) => self.shared.superseded(loc, epoch, true),
            Err(e) => {
                // A write that failed may have left its header on disk (`write_all_at` can fail
                // part way): it is marked like a written one.
                self.shared.superseded(loc, epoch, false);
                // Before the task completes: the stores after it find the store read-only.
                if refused {
                    self.shared.notice_refused(&e, loc, epoch);
                }
                self.write_failed(task, loc, epoch, e);
            }
        }
    }

    /// Waits for one write in flight to finish.
    fn collect_one(&mut self) {
        self.collected(self.written.recv());
    }

    /// Counts one write as finished, as a step of its own: the write may be another task's
    /// than the one whose message is being handled (with several I/O threads, a task's records
    /// can arrive while an earlier task's writes are in flight, its end not yet sent; a record
    /// waiting for a writer, or an end or abandon waiting for every write, collects them). A
    /// panic here fails the write's own task, whose outcome it lost, and replaces only its
    /// buffer; the step it was collected in goes on with what it has in hand.
    fn collected(&mut self, done: Result<Written, crossbeam_channel::RecvError>) {
        match done {
            Ok(written) => {
                self.in_flight -= 1;
                let (task, loc, epoch) = (written.task, written.loc, written.epoch);
                // The enclosing step's buffers are not this step's to replace.
                let outer = std::mem::take(&mut self.held);
                self.step(
                    "collecting a write",
                    |s| {
                        s.held += 1;
                        #[cfg(test)]
                        WriteFaults::fire(&s.shared.faults.collecting, "collecting a write");
                        s.finish(written);
                    },
                    |s| {
                        // Its outcome lost, the write counts as failed for the stale records
                        // behind it too: were it the first of a life, a delete or a clear of
                        // those would otherwise wait for it (`BUFFER_WAIT`) until the segment is
                        // evicted again.
                        let _ = s.shared.contained(|| s.shared.superseded(loc, epoch, false));
                        s.write_failed(task, loc, epoch, internal_panic());
                    },
                );
                self.held += outer;
            }
            // Every writer is gone (none is while its queue is open): nothing is in flight.
            Err(_) => self.in_flight = 0,
        }
    }

    /// Waits until no write is in flight.
    fn collect_all(&mut self) {
        while self.in_flight > 0 {
            self.collect_one();
        }
    }
}

/// Why a task whose handling panicked on the write thread failed.
fn internal_panic() -> TierError {
    TierError::Io("internal panic on the disk write thread".into())
}

enum Job {
    /// A store task, with each source's length, asked once when it was submitted (`None` if
    /// asking panicked): lookups count the room its records will take while it waits, and a
    /// source that answered differently later would find its record's room wrong.
    Store(TaskId, Vec<StoreItem>, Option<Vec<u64>>),
    /// A lookup, with the records submitted for storing before it (set when it is queued).
    Lookup(TaskId, Vec<ObjectKey>, u64),
    Load(TaskId, Vec<LoadItem>),
    /// One contiguous part of a load task split over the I/O threads: the items from `first` on.
    LoadPart {
        joint: Arc<JointLoad>,
        first: usize,
        items: Vec<LoadItem>,
    },
}

/// A load of fewer items than this runs on one thread: splitting it buys less than it costs.
const SPLIT_LOADS_FROM: usize = 4;

/// How many chunks loads may read ahead of the stores while stores wait: a load task starts
/// only while the chunks of the load tasks started since stores began waiting exceed the
/// chunks of the stores prepared meanwhile by less than this. So while both wait, loads and
/// stores take turns at about one chunk for one, and neither waits for more than the other's
/// turn: a load for the stores that make up its lead (a few writes), a demotion for a
/// request's loads, never for a queue of them.
const READ_AHEAD: u64 = 8;

/// How long the store being prepared may wait for a record buffer before loads stop taking turns
/// with it. A healthy disk hands a buffer back within a write (milliseconds; a sync at most);
/// a store that waits longer is behind a write that hangs, up to `BUFFER_WAIT`, and loads then
/// start as if no store waited until that buffer comes or the store fails. A store that waits
/// for the marks of its segment's stale records (`Shared::supersede`) is held the same way.
const TURN_WAIT: Duration = Duration::from_secs(1);

/// The store being prepared has waited for a record buffer longer than [`TURN_WAIT`]: loads do
/// not take turns with it until this is dropped.
struct Stalled<'a>(&'a Queue);

impl<'a> Stalled<'a> {
    fn new(queue: &'a Queue) -> Self {
        queue.state.lock().stalled = true;
        queue.ready.notify_all();
        Stalled(queue)
    }
}

impl Drop for Stalled<'_> {
    fn drop(&mut self) {
        self.0.state.lock().stalled = false;
    }
}

/// The store task being prepared: when it is over, none of its records waits for room.
struct Preparing<'a>(&'a Mutex<Index>);

impl Drop for Preparing<'_> {
    fn drop(&mut self) {
        self.0.lock().preparing.clear();
    }
}

/// A store taken from the [`Queue`]: its turn ends when this is dropped.
struct StoreTurn<'a>(&'a Queue, u64);

impl Drop for StoreTurn<'_> {
    fn drop(&mut self) {
        self.0.stored(self.1);
    }
}

/// How many records queued for storing before it a lookup may run ahead of. It evicts what
/// they will evict first ([`Index::make_room_ahead`]), so it finds what it would find behind
/// them but for their own keys, found on their way here (or above) until they are written: a
/// store that lags adds that much room, so the lag is bounded, well within a disk's capacity
/// (and the daemon's replay still counts what its simulation does). 128 is the daemon's cap on
/// demoted bytes in 2 MiB chunks (`tierkv-storage`, `demoted_cap`): a lookup does not wait
/// behind the demotions of chunks that large.
const LOOKUP_AHEAD: u64 = 128;

/// The I/O threads' queue. Lookups go first: they read only the index. Loads (a task whole, all
/// its parts at once) and stores take turns by [`READ_AHEAD`]. One store is prepared at a time
/// (they share the writer anyway), so a store waiting for a record buffer, as long as a write
/// takes, holds one thread, never all of them.
struct Queue {
    state: Mutex<QueueState>,
    ready: parking_lot::Condvar,
}

#[derive(Default)]
struct QueueState {
    lookups: VecDeque<Job>,
    /// Load tasks not yet started: their chunks, and their jobs (one, or the parts of a split).
    loads: VecDeque<(u64, Vec<Job>)>,
    /// Parts of load tasks started: taken before anything but a lookup.
    started: VecDeque<Job>,
    /// Store tasks, each with the records submitted for storing before it.
    stores: VecDeque<(u64, Job)>,
    /// Whether a store is being prepared.
    storing: bool,
    /// The key and length of each record of the store taken, until it counts them itself
    /// (`Index::preparing`).
    taking: Option<Vec<(ObjectKey, u64)>>,
    /// Chunks of the load tasks started since stores began waiting, less those of the stores
    /// prepared since: what loads read ahead of the stores.
    ahead: u64,
    /// The store being prepared waits for a record buffer past [`TURN_WAIT`] ([`Stalled`]).
    stalled: bool,
    /// Records submitted for storing so far, and those taken to be prepared.
    stored_in: u64,
    stored_out: u64,
    closed: bool,
}

/// The key and length of each record of a store task.
fn records_of(items: &[StoreItem], lens: &[u64]) -> Vec<(ObjectKey, u64)> {
    items.iter().map(|item| item.key).zip(lens.iter().copied()).collect()
}

impl QueueState {
    /// The key and length of every record of the store taken, if it does not count them yet,
    /// and of the stores queued among the first `before` records submitted for storing: a list
    /// a task, in order.
    fn records_before(&self, before: u64) -> Vec<Vec<(ObjectKey, u64)>> {
        let queued = self.stores.iter().filter_map(|(first, job)| match job {
            Job::Store(_, items, Some(lens)) if *first < before => Some(records_of(items, lens)),
            _ => None,
        });
        self.taking.iter().cloned().chain(queued).collect()
    }

    /// The next job the rules let start now, if any. Once closed, any job left (to be failed).
    fn take(&mut self) -> Option<Job> {
        // A lookup runs ahead of at most `LOOKUP_AHEAD` records queued for storing before it.
        let within = |job: &Job| match job {
            Job::Lookup(_, _, behind) => behind.saturating_sub(self.stored_out) <= LOOKUP_AHEAD,
            _ => true,
        };
        if self.lookups.front().is_some_and(|l| self.closed || within(l)) {
            return self.lookups.pop_front();
        }
        if let Some(job) = self.started.pop_front() {
            return Some(job);
        }
        let stores_wait = self.storing || !self.stores.is_empty();
        if !stores_wait {
            self.ahead = 0;
        }
        // A store stalled behind a write that hangs takes no turn: loads do not wait for it.
        let turns = stores_wait && !self.stalled;
        if (self.closed || !turns || self.ahead < READ_AHEAD)
            && let Some((chunks, jobs)) = self.loads.pop_front()
        {
            if turns {
                self.ahead += chunks;
            }
            self.started.extend(jobs);
            return self.started.pop_front();
        }
        if (self.closed || !self.storing)
            && let Some((_, job)) = self.stores.pop_front()
        {
            self.storing = true;
            if let Job::Store(_, items, lens) = &job {
                self.stored_out += items.len() as u64;
                self.taking = lens.as_ref().map(|lens| records_of(items, lens));
            }
            return Some(job);
        }
        None
    }

    /// A store of `chunks` chunks taken is prepared (or failed).
    fn stored(&mut self, chunks: u64) {
        self.storing = false;
        self.taking = None;
        self.ahead = self.ahead.saturating_sub(chunks);
    }
}

impl Queue {
    fn new() -> Self {
        Queue { state: Mutex::new(QueueState::default()), ready: parking_lot::Condvar::new() }
    }

    /// Queues jobs, or hands them back when the store is closed.
    fn push(&self, to: impl FnOnce(&mut QueueState) -> Result<(), Vec<Job>>) -> Vec<Job> {
        let mut state = self.state.lock();
        let refused = to(&mut state).err().unwrap_or_default();
        drop(state);
        self.ready.notify_one();
        refused
    }

    fn push_lookup(&self, mut job: Job) -> Vec<Job> {
        self.push(|state| {
            if state.closed {
                return Err(vec![job]);
            }
            if let Job::Lookup(_, _, behind) = &mut job {
                *behind = state.stored_in;
            }
            state.lookups.push_back(job);
            Ok(())
        })
    }

    /// Queues a store task of `records` records.
    fn push_store(&self, records: u64, job: Job) -> Vec<Job> {
        self.push(|state| {
            if state.closed {
                return Err(vec![job]);
            }
            state.stores.push_back((state.stored_in, job));
            state.stored_in += records;
            Ok(())
        })
    }

    /// Queues a load task of `chunks` chunks: one job, or the parts it was split into.
    fn push_load(&self, chunks: u64, jobs: Vec<Job>) -> Vec<Job> {
        let parts = jobs.len();
        let refused = self.push(|state| {
            if state.closed {
                return Err(jobs);
            }
            state.loads.push_back((chunks, jobs));
            Ok(())
        });
        if parts > 1 {
            self.ready.notify_all();
        }
        refused
    }

    /// The next job to run, waiting for one; `None` once the store is closed and nothing is
    /// left. A store taken must be handed back to [`Queue::stored`] once prepared.
    fn next(&self) -> Option<Job> {
        let mut state = self.state.lock();
        loop {
            if let Some(job) = state.take() {
                // Another may start too: a started load's other parts, or a lookup now within
                // its bound.
                if !state.started.is_empty() || !state.lookups.is_empty() {
                    self.ready.notify_one();
                }
                return Some(job);
            }
            if state.closed {
                return None;
            }
            self.ready.wait(&mut state);
        }
    }

    /// A store of `chunks` chunks taken by [`Queue::next`] is prepared (or failed): the next
    /// may start, and loads may read as much further ahead.
    fn stored(&self, chunks: u64) {
        self.state.lock().stored(chunks);
        self.ready.notify_all();
    }

    /// Refuses further jobs; those queued are handed out to be failed.
    fn close(&self) {
        self.state.lock().closed = true;
        self.ready.notify_all();
    }
}

/// Why a read-only store refuses stores.
struct ReadOnly {
    /// What [`DiskStore::read_only`] says.
    why: String,
    /// For want of room (a reused segment found none to be written over, and no retry has
    /// found room for a segment since): stores are refused with `NoSpace`, as the write that
    /// turned the store read-only failed, and not with `Io`, which a directory that cannot be
    /// written answers. One cause, one answer, for the store that found it and those after.
    full: bool,
}

impl ReadOnly {
    /// Read-only because the directory cannot be written.
    fn unwritable(why: String) -> Self {
        ReadOnly { why, full: false }
    }

    /// What a store is answered while the store is read-only for this.
    fn refusal(&self) -> TierError {
        let message = format!("{}; stores are refused, loads still work", self.why);
        if self.full { TierError::NoSpace(message) } else { TierError::Io(message) }
    }
}

/// Whether stores are accepted, and what a read-only store needs to become writable.
struct WriteState {
    /// Why stores are refused, while they are.
    read_only: Option<ReadOnly>,
    /// Read-only because a reused segment found no room to be written over
    /// ([`Shared::notice_refused`]): a writable directory is not enough to write again, the
    /// filesystem must have room for a segment.
    needs_room: bool,
    /// Turns to read-only so far, those that found the store read-only already included: a
    /// retry that saw a turn while it ran without this lock stays read-only.
    turns: u64,
    /// When `maintain` last tried to become writable.
    last_try: Instant,
    /// The directory's lock; `None` only while read-only (a directory that cannot be written
    /// may have no lock file to lock).
    lock: Option<DirLock>,
}

struct Shared {
    config: DiskStoreConfig,
    layout: Layout,
    /// How file I/O is done, once decided ([`Shared::decided_io`]).
    io: OnceLock<IoMode>,
    state: Mutex<WriteState>,
    /// Held by the retry of a read-only store to become writable ([`Shared::retry_writable`]),
    /// one at a time, so that its probe, reopens and syncs need not hold `state`, which lookups
    /// and stores read. Taken before `state` and `index`, never while holding either.
    retrying: Mutex<()>,
    index: Mutex<Index>,
    /// Signalled (with `index`) when a delete or a clear is done marking stale records.
    marked: parking_lot::Condvar,
    /// A store waited for a record buffer until its bound and none has come back since: the
    /// write thread is stuck (behind a write that hangs). Later stores then take a buffer only if
    /// one is back, and fail at once otherwise, rather than each waiting out the bound in turn;
    /// and lookups make no room ahead of them. Written under the writer lock, read by lookups
    /// without it.
    stuck: AtomicBool,
    writer: Mutex<Writer>,
    /// Segments written since the last periodic sync (its own lock: the write thread adds to
    /// it while a store may hold the writer lock waiting for a buffer).
    dirty: Mutex<HashSet<u32>>,
    closed: AtomicBool,
    /// Lookups, loads and stores for the I/O threads.
    queue: Queue,
    next_task: AtomicU64,
    epochs: AtomicU64,
    done: Sender<Completion>,
    completions: Receiver<Completion>,
    metrics: TierMetrics,
    read_only_gauge: ReadOnlyGauge,
    /// Chunks handed to this store for writing and not yet answered ([`DiskStore::depart`]):
    /// found, locked and loaded from their copies until then. Locked after `index`.
    departures: Departures,
    departing_metrics: DepartingMetrics,
    /// Panics the tests inject on the write thread.
    #[cfg(test)]
    faults: WriteFaults,
}

/// Faults the tests inject (panics on the write thread, each armed for one shot; held threads;
/// failing syncs), and the syncs they count.
#[cfg(test)]
#[derive(Default)]
struct WriteFaults {
    /// While a finished write is collected, its buffer in hand.
    collecting: AtomicBool,
    /// Once a record has gone to a writer thread, its buffer with it.
    handed_over: AtomicBool,
    /// Before a record goes to a writer thread (it is not written).
    handing_over: AtomicBool,
    /// While a segment whose write failed is sealed (`Shared::seal_failed`).
    sealing_failed: AtomicBool,
    /// While set (not a single shot), no record buffer can be allocated.
    no_memory: AtomicBool,
    /// While held, the writer threads start no write: they wait, as behind a disk that hangs.
    writes: Gate,
    /// While held, a segment being opened waits before its initialisation (its file and epoch).
    opening: Gate,
    /// While held, a store becoming writable waits before it syncs the files its scan found.
    found_syncs: Gate,
    /// While held, a store waits once a record has gone to the write thread.
    sent: Gate,
    /// While held, a delete or a clear waits before writing its marks of stale records.
    marks: Gate,
    /// Once a delete or a clear has counted itself in `Segment::marking`.
    marking: AtomicBool,
    /// While set (not a single shot), the syncs of lives' first records
    /// (`Shared::end_written_lives`) fail.
    failing_syncs: AtomicBool,
    /// The syncs of lives' first records made (`Shared::end_written_lives`).
    life_syncs: AtomicU64,
    /// While set (not a single shot), every mark of a record deleted fails, as one whose read
    /// failed (`Shared::mark_deleted`).
    failing_marks: AtomicBool,
    /// The marks of records deleted tried (`Shared::mark_deleted`).
    marks_tried: AtomicU64,
    /// While set (not a single shot), the syncs of the marks of records deleted fail
    /// (`Shared::mark_deleted`).
    failing_mark_syncs: AtomicBool,
    /// Once armed (a single shot), the next record handed over is written torn: its header
    /// only, then a failure (`Write::torn`).
    torn_write: AtomicBool,
    /// While set (not a single shot), every read of a record by a load fails, as one the OS
    /// refused (`Shared::read_record`).
    failing_reads: AtomicBool,
}

#[cfg(test)]
impl WriteFaults {
    fn fire(armed: &AtomicBool, what: &str) {
        if armed.swap(false, Ordering::SeqCst) {
            panic!("injected panic: {what}");
        }
    }

    /// Holds every write not yet started until the guard is dropped.
    fn hold_writes(&self) -> Held<'_> {
        self.writes.hold()
    }
}

/// A point the tests can hold threads at (not a single shot): while held, every thread that
/// reaches it waits.
#[cfg(test)]
#[derive(Default)]
struct Gate {
    held: Mutex<bool>,
    released: parking_lot::Condvar,
    /// Threads waiting at it now.
    waiting: AtomicU64,
}

#[cfg(test)]
impl Gate {
    /// Holds the threads that reach it until the guard is dropped (a test that fails meanwhile
    /// releases them as it unwinds, so closing the store does not hang).
    fn hold(&self) -> Held<'_> {
        *self.held.lock() = true;
        Held(self)
    }

    /// Waits while the gate is held.
    fn pass(&self) {
        let mut held = self.held.lock();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        while *held {
            self.released.wait(&mut held);
        }
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }

    /// Waits until `n` threads wait at the gate.
    fn wait_for(&self, n: u64) {
        while self.waiting.load(Ordering::SeqCst) < n {
            std::thread::yield_now();
        }
    }
}

/// A [`Gate`] held: released when dropped.
#[cfg(test)]
struct Held<'a>(&'a Gate);

#[cfg(test)]
impl Drop for Held<'_> {
    fn drop(&mut self) {
        *self.0.held.lock() = false;
        self.0.released.notify_all();
    }
}

/// The persistent, checksummed disk tier.
pub struct DiskStore {
    shared: Arc<Shared>,
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
    /// Segment files of this user numbered at or past the configured segments (the capacity
    /// shrank, or the segment grew): removed, so the directory holds no more than the capacity.
    /// Kept when the directory is read-only.
    pub removed_files: u32,
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
    /// stores fail, and [`DiskStore::maintain`] retries becoming writable. A full one (or one
    /// over its quota) opens writable: stores reuse its segments, as when the store fills the
    /// disk while running.
    pub fn open(config: DiskStoreConfig) -> Result<Self, DiskError> {
        let started = Instant::now();
        let layout = config.layout()?;
        let dir = config.dir.clone();
        if !dir.is_dir() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(config.dir_mode())
                .create(&dir)
                .map_err(DiskError::io("creating directory", &dir))?;
        }
        let lock = DirLock::take(&dir, config.file_mode())?;
        let probed = probe(&dir);
        let read_only = unwritable(&dir, &probed, lock.is_some());
        // A directory that takes no probe file (full, or read-only) tells no mode: its segment
        // files do, and where it holds none, the first one made (`Shared::decided_io`).
        let io = match probed {
            Ok(mode) => Some(mode),
            Err(_) => Self::read_mode_of_existing(&dir),
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
        // Without a mode there is no segment file to open.
        let scan_io = io.unwrap_or(IoMode::Buffered);
        let (index, mut recovered) = scan(&config, layout, scan_io, read_only.is_none())?;
        if let Some(warning) = read_only.is_none().then(|| space_warning(&dir, layout)).flatten() {
            tracing::warn!("{warning}");
        }
        recovered.elapsed = started.elapsed();
        let spare = (0..RECORD_BUFFERS)
            .map(|_| AlignedBuf::new((BLOCK + record_bytes(config.max_chunk_bytes)) as usize))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| DiskError::Config("cannot allocate the write buffers".into()))?;
        let (done, completions) = unbounded();
        let shared = Arc::new(Shared {
            layout,
            io: io.map(OnceLock::from).unwrap_or_default(),
            state: Mutex::new(WriteState {
                read_only: read_only.clone().map(ReadOnly::unwritable),
                needs_room: false,
                turns: 0,
                last_try: Instant::now(),
                lock,
            }),
            retrying: Mutex::new(()),
            index: Mutex::new(index),
            marked: parking_lot::Condvar::new(),
            stuck: AtomicBool::new(false),
            writer: Mutex::new(Writer { active: None, spare, out: 0, pipe: None, tasks: 0 }),
            dirty: Mutex::new(HashSet::new()),
            closed: AtomicBool::new(false),
            queue: Queue::new(),
            next_task: AtomicU64::new(1),
            epochs: AtomicU64::new(0),
            done,
            completions,
            metrics: metrics::register(),
            read_only_gauge: ReadOnlyGauge::register(),
            departures: Departures::new(),
            departing_metrics: DepartingMetrics::register("disk"),
            config,
            #[cfg(test)]
            faults: WriteFaults::default(),
        });
        let store = DiskStore {
            shared: Arc::clone(&shared),
            workers: Mutex::new(Vec::new()),
            flusher: Mutex::new(None),
            recovered,
        };
        // Records the scan could not index are misses like those a load finds damaged.
        store.shared.metrics.checksum_failed(
            u64::from(recovered.damaged_records) + u64::from(recovered.torn_records),
        );
        tracing::info!(
            records = recovered.records,
            bytes = recovered.bytes,
            segments = recovered.segments,
            damaged_records = recovered.damaged_records,
            torn_records = recovered.torn_records,
            skipped_files = recovered.skipped_files,
            removed_files = recovered.removed_files,
            elapsed = ?recovered.elapsed,
            "disk tier in {}: recovered {} records ({} bytes) in {:?}",
            dir.display(),
            recovered.records,
            recovered.bytes,
            recovered.elapsed,
        );
        if let Some(why) = &read_only {
            warn_read_only(why);
        }
        store.shared.read_only_gauge.set(read_only.is_some());
        store.start_threads()?;
        store.publish_metrics();
        Ok(store)
    }

    /// For a directory that takes no probe file: direct I/O if an existing segment accepts it;
    /// `None` where there is none to ask.
    fn read_mode_of_existing(dir: &Path) -> Option<IoMode> {
        let first = std::fs::read_dir(dir).ok().and_then(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                .find(|e| e.file_name().to_str().and_then(file_number).is_some())
                .map(|e| e.path())
        })?;
        Some(match SegmentFile::open(first, false, IoMode::Direct) {
            Ok(_) => IoMode::Direct,
            Err(_) => IoMode::Buffered,
        })
    }

    fn start_threads(&self) -> Result<(), DiskError> {
        let (messages, queued) = unbounded::<WriteMsg>();
        let (freed, free) = unbounded::<Freed>();
        let shared = Arc::clone(&self.shared);
        let thread = std::thread::Builder::new()
            .name("tierkv-disk-write".into())
            .spawn(move || write_records(shared, queued, freed))
            .map_err(DiskError::Thread)?;
        self.shared.writer.lock().pipe = Some(WritePipe { messages, free, thread });
        let mut workers = Vec::new();
        for n in 0..self.shared.config.io_threads {
            let shared = Arc::clone(&self.shared);
            let spawned = std::thread::Builder::new()
                .name(format!("tierkv-disk-{n}"))
                .spawn(move || shared.work());
            match spawned {
                Ok(handle) => workers.push(handle),
                Err(e) => {
                    // The threads started stop once the store is closed (dropped).
                    *self.workers.lock() = workers;
                    return Err(DiskError::Thread(e));
                }
            }
        }
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
    /// `None` until it is decided: a directory that took no probe file at open (full, or
    /// read-only) and held no segment file decides it when its first segment file is made.
    pub fn io_mode(&self) -> Option<IoMode> {
        self.shared.io.get().copied()
    }

    /// Why stores are refused, while the directory cannot be written.
    pub fn read_only(&self) -> Option<String> {
        self.shared.state.lock().read_only.as_ref().map(|r| r.why.clone())
    }

    /// Background upkeep, called periodically (the StorageManager's maintenance tick): a
    /// read-only store tries to become writable again, at most every [`WRITABLE_RETRY`].
    pub fn maintain(&self) {
        let due = {
            let state = self.shared.state.lock();
            state.read_only.is_some() && state.last_try.elapsed() >= WRITABLE_RETRY
        };
        // A retry still under way (behind slow syncs) is not waited for: the tick has other work.
        if due && let Some(retrying) = self.shared.retrying.try_lock() {
            self.shared.retry_writable(retrying);
        }
    }

    /// Tries now to become writable (when read-only): the directory must accept a probe file
    /// (or refuse it only for want of space: a full disk is writable), its lock must be ours,
    /// and every segment file must open for writing. Returns whether
    /// the store is writable.
    pub fn retry_writable(&self) -> bool {
        self.shared.retry_writable(self.shared.retrying.lock())
    }

    /// What the scan at open found.
    pub fn recovered(&self) -> Recovered {
        self.recovered
    }

    /// The order the segments are evicted in (the adaptive policy's as of its last eviction).
    pub fn order(&self) -> Order {
        self.shared.index.lock().policy.order()
    }

    /// The eviction policy over the segments.
    pub fn policy(&self) -> PolicyKind {
        self.shared.config.policy
    }

    /// How many chunks of `chunk_bytes` the store holds when full.
    pub fn chunk_capacity(&self, chunk_bytes: u64) -> u64 {
        let segments = self.shared.index.lock().segments.len() as u64;
        let per_segment = self.shared.layout.segment_bytes.saturating_sub(BLOCK)
            / record_bytes(chunk_bytes).max(1);
        segments.saturating_mul(per_segment)
    }

    /// Orders the segments by the order `order` names from now on, instead of one the policy
    /// judges from the disk's own traffic ([`SegmentPolicy::follow`]; only the adaptive policy
    /// has a choice).
    pub fn follow(&self, order: JudgedOrder) {
        self.shared.index.lock().policy.follow(order);
    }

    /// Puts a chunk on its way to this store, with a copy of its bytes: until the returned chunk
    /// is dropped (give it to [`TierAdapter::submit_store`] and drop it with the answer), lookups
    /// find, lock and load it here from that copy, as if it were written. How the cascade hands
    /// L1's victims straight to the disk (no L2) without a window in which they are in neither
    /// tier.
    pub fn depart(&self, key: ObjectKey, bytes: Arc<[u8]>) -> Departing {
        self.shared.departures.depart(key, bytes)
    }

    /// Sets the disk gauges from the current state.
    pub fn publish_metrics(&self) {
        self.shared.publish();
    }

    /// `delete` but for the stale records: returns how many keys went, and the keys it did not
    /// skip as locked.
    fn delete_indexed(&self, keys: &[ObjectKey]) -> (usize, HashSet<ObjectKey>) {
        let mut marks = Vec::new();
        let mut unlocked = HashSet::new();
        let mut deleted = 0;
        {
            let mut index = self.shared.index.lock();
            let mut board = self.shared.departures.lock();
            for key in keys {
                // Locked where the lookup found it, the index or the board (a copy on its way
                // here that has landed since): a locked key is not deleted, in either place.
                if index.locks.contains_key(key) || board.is_locked(key) {
                    continue;
                }
                unlocked.insert(*key);
                // A key counts once, whether its record, its copy on its way here or both went.
                let mut gone = board.delete(key);
                // A load in progress pins the segment, not the key: dropping the key from the
                // index leaves its record readable until the load's pin is gone, and no longer.
                if let Some(loc) = index.map.get(key).copied() {
                    index.drop_record(key, loc);
                    gone = true;
                    let segment = &mut index.segments[loc.segment as usize];
                    if let Some(file) = segment.file.clone() {
                        // The pin keeps the segment from reuse until its mark is written, so the
                        // mark can never land on a record of the segment's next life.
                        segment.pins += 1;
                        marks.push((file, segment.epoch, *key, loc));
                    }
                }
                deleted += usize::from(gone);
            }
        }
        self.shared.mark_deleted_and_unpin(&marks);
        (deleted, unlocked)
    }

    fn next_task(&self) -> TaskId {
        TaskId(self.shared.next_task.fetch_add(1, Ordering::Relaxed))
    }

    /// Completes jobs the queue refused (the store is closed) as failed.
    fn refused(&self, jobs: Vec<Job>) {
        for job in jobs {
            self.shared.fail(job);
        }
    }
}

/// Rebuilds the index from the segment files in the directory.
///
/// The files are opened one after another; their segments are then scanned in parallel,
/// `io_threads` at a time (each header is one small read, so a restart is bound by read latency,
/// which parallel requests hide), and indexed in id order. A file longer than its layout's length
/// is cut after the scan, when writable.
fn scan(
    config: &DiskStoreConfig,
    layout: Layout,
    io: IoMode,
    writable: bool,
) -> Result<(Index, Recovered), DiskError> {
    let mut index = Index {
        map: HashMap::new(),
        locks: HashMap::new(),
        lock_total: 0,
        segments: (0..layout.segments).map(|_| Segment::free()).collect(),
        policy: config.policy.build_for_segments(),
        lives: 0,
        live_bytes: 0,
        free_from: 0,
        active: None,
        preparing: VecDeque::new(),
        stale: BTreeSet::new(),
    };
    let mut recovered = Recovered::default();
    let entries = std::fs::read_dir(&config.dir).map_err(DiskError::io("listing", &config.dir))?;
    // SAFETY: geteuid cannot fail and touches no memory.
    let user = unsafe { libc::geteuid() };
    let mut numbers: Vec<u32> = Vec::new();
    for entry in entries.flatten() {
        let Some(n) = entry.file_name().to_str().and_then(file_number) else {
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
        if n >= layout.files() {
            // Past the configured files: a file of ours is an earlier layout's, and what it
            // holds no longer fits the capacity. Anything else is left alone, as below.
            if ours.is_ok() && writable {
                match std::fs::remove_file(entry.path()) {
                    Ok(()) => recovered.removed_files += 1,
                    Err(e) => tracing::warn!("cannot remove {}: {e}", entry.path().display()),
                }
            }
            continue;
        }
        match ours {
            Ok(()) => numbers.push(n),
            Err(why) => {
                let held = layout.segments_of(n);
                tracing::warn!(
                    "skipping {}: named like a segment file, but {why}; segments {}..{} stay \
                     unused until it is removed",
                    entry.path().display(),
                    held.start,
                    held.end
                );
                recovered.skipped_files += 1;
                for id in held {
                    index.segments[id as usize].status = Status::Unusable;
                }
            }
        }
    }
    if recovered.removed_files > 0 {
        tracing::info!(
            "removed {} segment files numbered past the {} files configured in {}",
            recovered.removed_files,
            layout.files(),
            config.dir.display()
        );
    }
    numbers.sort_unstable();
    let mut files = Vec::with_capacity(numbers.len());
    for n in numbers {
        let file = open_file(config, n, io, writable)?;
        for id in layout.segments_of(n) {
            index.segments[id as usize].file = Some(Arc::clone(&file));
        }
        files.push((n, file));
    }
    let mut scanned = scan_files(config, layout, &files)?;
    scanned.sort_unstable_by_key(|s| s.id);
    if writable {
        // After the scan, which must see a torn file as it was left.
        for (n, file) in &files {
            cut_file(file, layout.file_bytes(*n));
        }
        sync_found(config, files.iter().map(|(_, file)| file.as_ref()));
    }
    for Scanned { id, found } in scanned {
        // A segment without a valid superblock holds nothing; its space is reused as is.
        let Some((epoch, found)) = found else {
            continue;
        };
        recovered.segments += 1;
        recovered.damaged_blocks += found.damaged_blocks;
        recovered.damaged_records += found.damaged_records;
        recovered.torn_records += found.torn_records;
        recovered.deleted_records += found.deleted_records;
        let serial = index.next_serial();
        let segment = &mut index.segments[id as usize];
        segment.epoch = epoch;
        segment.end = found.end;
        segment.serial = serial;
        segment.status = Status::Sealed;
        for (key, loc) in found.records {
            // One object per key: a second copy (a chunk stored again after its first record
            // was evicted, still on disk) is redundant. It stays on disk, so it is kept as a
            // stale record (`Segment::stale`): a delete or a clear of its key marks it too, or
            // the next restart would find it.
            if index.index_record(key, loc) {
                recovered.records += 1;
                recovered.bytes += loc.len;
            } else {
                index.segments[id as usize].stale.push((epoch, key, loc));
                index.stale.insert(id);
            }
        }
        index.track_sealed(id);
    }
    Ok((index, recovered))
}

/// Syncs the segment files whose records the scan found, unless `fsync` is `never`, before a
/// store can count on them: they may still be only in the page cache (a process killed between
/// a write and its sync). Done at open when writable, else when the store becomes writable. A
/// file that cannot be synced is still served (its records verify on every load); only the
/// promise for what it holds is weaker, which the log says.
fn sync_found<'a>(config: &DiskStoreConfig, files: impl Iterator<Item = &'a SegmentFile>) {
    if config.fsync == FsyncPolicy::Never {
        return;
    }
    for file in files {
        if let Err(e) = file.sync() {
            tracing::warn!(
                "cannot sync {}: {e}; records found in it may not survive a power loss",
                file.path.display()
            );
        }
    }
}

/// Opens segment file `n`; when writable, gives it the configured mode.
fn open_file(
    config: &DiskStoreConfig,
    n: u32,
    io: IoMode,
    writable: bool,
) -> Result<Arc<SegmentFile>, DiskError> {
    let path = file_path(&config.dir, n);
    let file =
        SegmentFile::open(path.clone(), writable, io).map_err(DiskError::io("opening", &path))?;
    if writable && let Err(e) = file.secure(config.file_mode(), config.group) {
        tracing::warn!("cannot restrict {} to mode {:o}: {e}", path.display(), config.file_mode());
    }
    Ok(Arc::new(file))
}

/// Cuts a segment file longer than its layout's `bytes` (of a larger capacity before); the
/// segments within keep their records. A short file stays short: it grows a segment at a time.
fn cut_file(file: &SegmentFile, bytes: u64) {
    if let Err(e) = file.cut(bytes) {
        tracing::warn!("cannot cut {} to {bytes} bytes: {e}", file.path.display());
    }
}

/// One segment as the scan found it.
struct Scanned {
    id: u32,
    /// The epoch of its valid superblock and what it holds; `None` without a valid superblock.
    found: Option<(u64, SegmentScan)>,
}

/// Scans every segment of the opened `files` on up to `io_threads` threads; in no particular
/// order.
fn scan_files(
    config: &DiskStoreConfig,
    layout: Layout,
    files: &[(u32, Arc<SegmentFile>)],
) -> Result<Vec<Scanned>, DiskError> {
    let mut segments = Vec::new();
    for (n, file) in files {
        let len = file.len().map_err(DiskError::io("reading", &file.path))?;
        segments.extend(layout.segments_of(*n).map(|id| (id, file.as_ref(), len)));
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let worker = || -> Result<Vec<Scanned>, DiskError> {
        let mut buf = AlignedBuf::new(SCAN_WINDOW as usize)
            .ok_or_else(|| DiskError::Config("cannot allocate the scan buffer".into()))?;
        let mut out = Vec::new();
        while let Some((id, file, len)) = segments.get(next.fetch_add(1, Ordering::Relaxed)) {
            let found = scan_superblock(config, layout, *id, file, *len, &mut buf);
            out.push(Scanned { id: *id, found });
        }
        Ok(out)
    };
    let threads = config.io_threads.min(segments.len());
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
        let mut all = Vec::with_capacity(segments.len());
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

/// Reads segment `id`'s superblock from `file` (`len` bytes long) and scans its current life.
///
/// The superblock and the block after it, the first record's header, come in one read, so a
/// segment of one record (the default) costs one read to restart.
fn scan_superblock(
    config: &DiskStoreConfig,
    layout: Layout,
    id: u32,
    file: &SegmentFile,
    len: u64,
    buf: &mut AlignedBuf,
) -> Option<(u64, SegmentScan)> {
    let base = layout.base(id);
    // Whole blocks only: a file cut short mid-block ends at its last whole block.
    let limit = len.min(base + layout.segment_bytes) / BLOCK * BLOCK;
    let first = limit.saturating_sub(base).min(2 * BLOCK);
    if first < BLOCK {
        return None;
    }
    let bytes = buf.as_mut_slice();
    file.read_at(&mut bytes[..first as usize], base).ok()?;
    // A superblock of another segment or of another segment size is an earlier layout's (its
    // segment lay elsewhere), or bytes of an earlier layout's payload, which a client chose:
    // the segment holds nothing.
    let superblock = Superblock::decode(bytes)
        .ok()
        .filter(|sb| sb.id == id && sb.segment_bytes == layout.segment_bytes)?;
    // `scan_segment` finds the first header where it reads its blocks.
    bytes.copy_within(BLOCK as usize..first as usize, 0);
    Some((superblock.epoch, scan_segment(file, id, base, superblock.epoch, limit, config, buf)))
}

/// The most bytes the scan reads at once while it searches past a damaged header.
const SCAN_WINDOW: u64 = 1 << 20;

/// What the scan found in one segment's current life.
#[derive(Default)]
struct SegmentScan {
    records: Vec<(ObjectKey, Loc)>,
    /// Where the life's last record ends, from the segment's start: appends would go here.
    end: u64,
    damaged_blocks: u64,
    damaged_records: u32,
    torn_records: u32,
    deleted_records: u32,
}

/// Reads the record headers of segment `id`'s life `epoch`, from its block 1 (the segment
/// starts at `base` of the file) to `limit` (a file offset of whole blocks). `buf` starts with
/// block 1 already read, where the segment has one.
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
    base: u64,
    epoch: u64,
    limit: u64,
    config: &DiskStoreConfig,
    buf: &mut AlignedBuf,
) -> SegmentScan {
    let max_record = record_bytes(config.max_chunk_bytes);
    let mut found = SegmentScan::default();
    let mut at = base + BLOCK;
    // Whether `buf` holds the block at `at` already: block 1 only.
    let mut held = true;
    'records: while at + BLOCK <= limit {
        let head = &mut buf.as_mut_slice()[..BLOCK as usize];
        if !std::mem::take(&mut held) && file.read_at(head, at).is_err() {
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
                    // Its header checked, its payload not yet.
                    let loc = Loc { segment: id, verified: false, offset: at, len: h.len };
                    found.records.push((h.key, loc));
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
    found.end = at - base;
    found
}

impl Shared {
    /// An I/O thread's loop (`tierkv-disk-<n>`).
    fn work(&self) {
        let mut staging = AlignedBuf::new(record_bytes(self.config.max_chunk_bytes) as usize);
        while let Some(job) = self.queue.next() {
            // A store's turn ends when this job does, however it ends.
            let _turn = match &job {
                Job::Store(_, items, _) => Some(StoreTurn(&self.queue, items.len() as u64)),
                _ => None,
            };
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
            Job::Store(task, sources, lens) => {
                let queued = lens
                    .and_then(|lens| self.contained(|| self.store(&sources, &lens)))
                    .unwrap_or_else(|| Err(TierError::Io("internal panic while storing".into())));
                // Records handed over are written whatever happens; only a task whose every
                // record was handed over is published, by the write thread, which completes it.
                // A task that failed after handing some over is completed by the write thread
                // too, once it has marked those written deleted: a delete of their keys after
                // the failure is reported finds nothing to mark, and a restart must find nothing
                // either. (Records of a failed task are written but never indexed.)
                let Queued { task: number, records, failed } = match queued {
                    Ok(queued) => queued,
                    Err(e) => return Some(Completion::Stored { task, result: Err(e), sources }),
                };
                let message = match failed {
                    None => WriteMsg::End { task: number, id: task, records, sources },
                    Some(error) => {
                        WriteMsg::Abandon { task: number, id: task, records, error, sources }
                    }
                };
                let sent = match self.writer.lock().pipe.as_ref() {
                    Some(pipe) => pipe.messages.send(message).map_err(|refused| refused.0),
                    None => Err(message),
                };
                match sent {
                    Ok(()) => return None,
                    Err(unsent) => {
                        let gone = || TierError::Io("the disk write thread is gone".into());
                        let (records, result, sources) = match unsent {
                            WriteMsg::End { records, sources, .. } => {
                                self.metrics.failed(Failure::Io);
                                (records, Err(gone()), sources)
                            }
                            // Counted when it failed.
                            WriteMsg::Abandon { records, error, sources, .. } => {
                                (records, Err(error), sources)
                            }
                            WriteMsg::Record { .. } => (Vec::new(), Err(gone()), Vec::new()),
                        };
                        // Never published: their segments may go.
                        self.settle(&records);
                        Completion::Stored { task, result, sources }
                    }
                }
            }
            Job::Lookup(task, keys, behind) => {
                self.contained(|| self.make_room_ahead(behind));
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
            Job::Store(task, sources, _) => {
                Completion::Stored { task, result: Err(TierError::Closed), sources }
            }
            Job::Lookup(task, keys, _) => {
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

    /// Copies and checksums the task's new records into record buffers and hands them to the
    /// write thread, which writes them in order and then publishes the task. Returns as soon
    /// as the last record is handed over, so the next task's copies overlap these writes.
    fn store(&self, items: &[StoreItem], lens: &[u64]) -> Result<Queued, TierError> {
        let refused = |failure: Failure, e: TierError| {
            self.metrics.failed(failure);
            Err(e)
        };
        if let Some(e) = self.refusal() {
            return refused(Failure::ReadOnly, e);
        }
        if let Some(&bytes) = lens.iter().find(|&&len| len > self.config.max_chunk_bytes) {
            let e = TierError::TooLarge { bytes, limit: self.config.max_chunk_bytes };
            return refused(Failure::TooLarge, e);
        }
        // One store task prepares records at a time (the writer lock). A key present in the
        // index (unless only the restart scan vouches for its record), or repeated in the batch,
        // is skipped; one still in flight from an earlier task is written again, and publishing
        // keeps the first.
        let mut writer = self.writer.lock();
        // The segments of the task's keys already here stay while it makes room for the others
        // (pinned until it is over): evicting one would drop a key this task reports stored.
        let mut present = Pins { index: &self.index, segments: Vec::new() };
        // Until it returns, lookups count the room of its records still to be given room.
        let _preparing = Preparing(&self.index);
        let new: Vec<(&StoreItem, u64)> = {
            // The queue, then the index, as a lookup making room locks them.
            let mut queue = self.queue.state.lock();
            let mut index = self.index.lock();
            queue.taking = None;
            let mut batch = HashSet::with_capacity(items.len());
            let new: Vec<(&StoreItem, u64)> = items
                .iter()
                .zip(lens.iter().copied())
                .filter(|(item, _)| match index.map.get(&item.key).copied() {
                    Some(loc) if loc.verified => {
                        index.segments[loc.segment as usize].pins += 1;
                        present.segments.push(loc.segment);
                        false
                    }
                    _ => batch.insert(item.key),
                })
                .collect();
            index.preparing = new.iter().map(|(_, len)| record_bytes(*len)).collect();
            new
        };
        writer.tasks += 1;
        let task = writer.tasks;
        let mut records = Vec::with_capacity(new.len());
        for (item, len) in new {
            // A panic here (a bug) still abandons what was handed over, so no segment keeps an
            // unpublished count nobody will release.
            let submitted = catch_unwind(AssertUnwindSafe(|| {
                self.submit_record(&mut writer, task, item, len, &mut records)
            }))
            .unwrap_or_else(|_| Err(TierError::Io("internal panic while storing".into())));
            if let Err(e) = submitted {
                let failure = match &e {
                    TierError::NoSpace(_) => Failure::NoSpace,
                    TierError::Buffer(_) => Failure::Copy,
                    _ => Failure::Io,
                };
                if records.is_empty() {
                    return refused(failure, e);
                }
                // Those handed over are abandoned, by the write thread (`Shared::run`).
                self.metrics.failed(failure);
                return Ok(Queued { task, records, failed: Some(e) });
            }
        }
        Ok(Queued { task, records, failed: None })
    }

    /// Copies one record into a free buffer (header, payload, checksum, zero padding; the first
    /// record of a segment's life with its superblock in front) and hands it to the write
    /// thread. The segment's end moves past the record only once its copy succeeded, so a source
    /// that fails leaves no hole (and the next record, the life's first again, brings the
    /// superblock).
    fn submit_record(
        &self,
        writer: &mut Writer,
        task: u64,
        item: &StoreItem,
        len: u64,
        records: &mut Vec<(ObjectKey, Loc)>,
    ) -> Result<(), TierError> {
        let size = record_bytes(len);
        // A full segment is sealed with its writes still in flight: their records are
        // unpublished until the task ends, which keeps it from eviction until then.
        // The buffer first: a store that fails for want of one (a stuck write thread) has taken
        // no room, evicted nothing.
        let mut buf = self.free_buffer(writer)?;
        let (segment, offset, epoch, file) = match self.reserve(writer, size) {
            Ok(reserved) => reserved,
            Err(e) => {
                writer.spare.push(buf);
                return Err(e);
            }
        };
        let (superblock, record) = buf.as_mut_slice().split_at_mut(BLOCK as usize);
        let first = offset == BLOCK;
        if first {
            Superblock { id: segment, epoch, segment_bytes: self.layout.segment_bytes }
                .encode(superblock);
        }
        let (head, payload) = record[..size as usize].split_at_mut(BLOCK as usize);
        let payload_bytes = &mut payload[..len as usize];
        let copied = catch_unwind(AssertUnwindSafe(|| item.source.read_into(payload_bytes)));
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
        let loc = Loc::written(segment, self.layout.base(segment) + offset, len);
        let bytes = if first {
            Span { start: 0, len: (BLOCK + size) as usize, at: loc.offset - BLOCK }
        } else {
            Span { start: BLOCK as usize, len: size as usize, at: loc.offset }
        };
        let superseding = match first.then(|| self.supersede(segment)) {
            Some(Ok(superseding)) => superseding,
            Some(Err(e)) => {
                writer.spare.push(buf);
                return Err(e);
            }
            None => false,
        };
        let message = WriteMsg::Record { task, file, buf, bytes, loc, epoch };
        // Counted before it is sent: the write thread may fail it at once, and a life whose
        // first record failed ends (its stale records markable) only once none of its records is
        // unpublished (`Segment::end_unwritten_life`), this one included.
        self.index.lock().segments[segment as usize].unpublished += 1;
        if let Err(e) = self.send(writer, message) {
            let mut index = self.index.lock();
            let reserved = &mut index.segments[segment as usize];
            reserved.unpublished -= 1;
            if superseding {
                // Nothing was handed over: its stale records are still to be marked.
                reserved.superseding = false;
            }
            reserved.end_unwritten_life();
            drop(index);
            self.marked.notify_all();
            return Err(e);
        }
        #[cfg(test)]
        self.faults.sent.pass();
        let mut index = self.index.lock();
        let reserved = &mut index.segments[segment as usize];
        reserved.end = offset + size;
        index.preparing.pop_front();
        drop(index);
        records.push((item.key, loc));
        Ok(())
    }

    /// The first record of `segment`'s life is about to be handed to the write thread: keeps
    /// its stale records from being marked from now until it is written (`superseded`), and
    /// waits until the deletes and clears marking them now are done. A mark that hangs (a dead
    /// disk) holds the store at most `BUFFER_WAIT`, as a write would, loads not taking turns with
    /// it past `TURN_WAIT`; the store then fails, nothing handed over. Returns whether the
    /// segment has stale records.
    fn supersede(&self, segment: u32) -> Result<bool, TierError> {
        let started = Instant::now();
        let (turn_over, deadline) = (started + TURN_WAIT, started + BUFFER_WAIT);
        let mut stalled = None;
        let id = segment as usize;
        let mut index = self.index.lock();
        let segment = &mut index.segments[id];
        segment.superseding = !segment.stale.is_empty();
        segment.unsuperseded = false;
        while index.segments[id].marking > 0 {
            let until = if stalled.is_none() { turn_over.min(deadline) } else { deadline };
            if !self.marked.wait_until(&mut index, until).timed_out() {
                continue;
            }
            if until == deadline {
                index.segments[id].superseding = false;
                drop(index);
                self.marked.notify_all();
                return Err(TierError::Io(
                    "marking the stale records of the segment to reuse hangs".into(),
                ));
            }
            stalled =
                Some(parking_lot::MutexGuard::unlocked(&mut index, || Stalled::new(&self.queue)));
        }
        Ok(index.segments[id].superseding)
    }

    /// Whether the record at `loc` is its segment's first, the one written with the superblock
    /// of the segment's life.
    fn is_first(&self, loc: Loc) -> bool {
        loc.offset == self.layout.base(loc.segment) + BLOCK
    }

    /// The write of the record at `loc` in life `epoch` ended (`written` or failed). If it was
    /// the life's first, its superblock ends the stale records behind it once it is on disk for
    /// good: under [`FsyncPolicy::Always`] when its task's sync covers it
    /// ([`Shared::publish_records`], or [`Shared::end_unpublished_lives`] for a task that
    /// publishes nothing), under `Periodic` at the flusher's next sync ([`Shared::sync_dirty`]),
    /// under `Never` now. Written, the deletes and clears waiting for it go on now, and a delete
    /// or a clear of one of its stale keys syncs the file itself before returning
    /// ([`Shared::mark_stale`]), so it is not undone by a power loss either. No sync of its own
    /// here: one on the write thread for every segment reused cost the stream of stores a fifth
    /// of its speed under `Always`, and made `Periodic` sync nearly every record. If the write
    /// failed they stay, and deletes and clears wait, until the life's writes are over
    /// ([`Segment::end_unwritten_life`]).
    fn superseded(&self, loc: Loc, epoch: u64, written: bool) {
        if !self.is_first(loc) {
            return;
        }
        let mut index = self.index.lock();
        let segment = &mut index.segments[loc.segment as usize];
        if !segment.superseding || segment.epoch != epoch {
            return;
        }
        if !written || self.config.fsync != FsyncPolicy::Never {
            segment.unsuperseded = true;
            if written {
                segment.unsynced = Some(epoch);
                segment.sync_failed = false;
            }
            drop(index);
            self.marked.notify_all();
            return;
        }
        drop(index);
        self.end_stale(loc.segment, epoch, true);
    }

    /// A sync of `segment`'s file that covered the first record of its life `epoch` ended. If
    /// it succeeded (`durable`), and none failed for that life before, the life is synced and, if
    /// the segment is still in it, the stale records behind the record end; if it failed, the
    /// life is left unsynced for good (`Segment::sync_failed`) and they stay, unmarkable until
    /// the segment's next life. Wakes the deletes and clears waiting for it.
    fn end_stale(&self, segment: u32, epoch: u64, durable: bool) {
        let mut index = self.index.lock();
        let reused = &mut index.segments[segment as usize];
        let ours = reused.unsynced == Some(epoch);
        let durable = durable && !(ours && reused.sync_failed);
        if ours {
            if durable {
                reused.unsynced = None;
            } else {
                reused.sync_failed = true;
            }
        }
        if reused.superseding && reused.epoch == epoch {
            if durable {
                index.end_earlier_lives(segment);
            } else {
                reused.unsuperseded = true;
            }
        }
        drop(index);
        self.marked.notify_all();
    }

    /// Marks deleted on disk `records`, written though their task publishes nothing (it failed, or
    /// was abandoned, after them). Never indexed, they would be indexed by a restart, and a delete
    /// or a clear of their keys meanwhile, which found nothing to mark, would be undone. Called
    /// before the task's records are settled, so each segment is still in the life they were
    /// written in. The write thread passes only the records not known unwritten: one whose write
    /// was skipped holds nothing of that life and key, and reading its header would cost a read
    /// each, in turn, before the task completes and the stores behind it go on (a write that
    /// failed may have left its header: it is marked). A record whose
    /// mark did not settle stays stale, for the next delete or clear of its key
    /// ([`Index::keep_unmarked`]).
    fn mark_unpublished(&self, records: &[(ObjectKey, Loc)]) {
        let marks: Vec<_> = {
            let index = self.index.lock();
            records
                .iter()
                .filter_map(|(key, loc)| {
                    let segment = &index.segments[loc.segment as usize];
                    Some((segment.file.clone()?, segment.epoch, *key, *loc))
                })
                .collect()
        };
        if marks.is_empty() {
            return;
        }
        let settled = self.mark_deleted(&marks);
        self.index.lock().keep_unmarked(&marks, &settled);
    }

    /// Under [`FsyncPolicy::Always`], ends the stale records behind the first records of
    /// `records` that were written though their task publishes nothing (it failed, or was
    /// abandoned, after them): their files are synced, as the task's sync would have, so a
    /// power loss cannot bring back what a delete meanwhile skipped. Called before the task's
    /// records are settled, so each segment is still in the life they began.
    fn end_unpublished_lives(&self, records: &[(ObjectKey, Loc)]) {
        if self.config.fsync != FsyncPolicy::Always {
            return;
        }
        let lives = {
            let index = self.index.lock();
            let firsts =
                records.iter().filter(|(_, loc)| self.is_first(*loc)).map(|(_, loc)| loc.segment);
            index.written_lives(firsts, |_| true)
        };
        self.end_written_lives(lives);
    }

    /// Syncs the file of each of `lives` ([`Index::written_lives`]), each file once, and ends
    /// the stale records behind each life's first record if its file synced. Returns the files
    /// that synced, by number.
    fn end_written_lives(&self, lives: Vec<WrittenLife>) -> HashSet<u32> {
        let mut synced: HashMap<u32, bool> = HashMap::new();
        for (segment, epoch, file) in lives {
            let durable = *synced.entry(self.layout.file_of(segment)).or_insert_with(|| {
                #[cfg(test)]
                {
                    self.faults.life_syncs.fetch_add(1, Ordering::SeqCst);
                    if self.faults.failing_syncs.load(Ordering::SeqCst) {
                        self.metrics.failed(Failure::Io);
                        return false;
                    }
                }
                let durable = file.sync().is_ok();
                if !durable {
                    self.metrics.failed(Failure::Io);
                }
                durable
            });
            self.end_stale(segment, epoch, durable);
        }
        synced.into_iter().filter_map(|(file, synced)| synced.then_some(file)).collect()
    }

    /// Hands a message to the write thread.
    fn send(&self, writer: &mut Writer, message: WriteMsg) -> Result<(), TierError> {
        let gone = || TierError::Io("the disk write thread is gone".into());
        let Some(pipe) = writer.pipe.as_ref() else {
            return Err(TierError::Closed);
        };
        let record = matches!(message, WriteMsg::Record { .. });
        match pipe.messages.send(message) {
            Ok(()) => {
                // Its buffer is the write thread's until it comes back on `free`.
                writer.out += usize::from(record);
                Ok(())
            }
            Err(refused) => {
                match refused.0 {
                    WriteMsg::Record { buf, .. } => writer.spare.push(buf),
                    // Nobody will publish these records now: their segments may go.
                    WriteMsg::Abandon { records, .. } | WriteMsg::End { records, .. } => {
                        self.settle(&records);
                    }
                }
                Err(gone())
            }
        }
    }

    /// A record buffer: one in hand, one made for a buffer lost, or the next the write thread
    /// is done with, waited for at most `BUFFER_WAIT`.
    fn free_buffer(&self, writer: &mut Writer) -> Result<AlignedBuf, TierError> {
        self.free_buffer_within(writer, BUFFER_WAIT)
    }

    /// `free_buffer`, waiting at most `wait`. It never waits for a buffer that cannot come: one
    /// the write thread lost is reported (`Freed::Lost`), and one lost here (a panic while a
    /// record was copied) is simply missing from `spare` and `out`; either is made again while
    /// fewer than `RECORD_BUFFERS` are counted. A buffer that cannot be made fails the store (a
    /// miss) when none is left to wait for, as does a wait past `wait`; after which, until a
    /// buffer is had again, it does not wait at all (`Shared::stuck`).
    fn free_buffer_within(
        &self,
        writer: &mut Writer,
        wait: Duration,
    ) -> Result<AlignedBuf, TierError> {
        let got = self.take_buffer_within(writer, wait);
        if got.is_ok() {
            self.stuck.store(false, Ordering::Release);
        }
        got
    }

    fn take_buffer_within(
        &self,
        writer: &mut Writer,
        wait: Duration,
    ) -> Result<AlignedBuf, TierError> {
        let started = Instant::now();
        let deadline = started + wait;
        let turn_over = deadline.min(started + TURN_WAIT);
        // Loads stop taking turns with this store once it waited past `TURN_WAIT`.
        let mut stalled = None;
        loop {
            if let Some(buf) = writer.spare.pop() {
                return Ok(buf);
            }
            if writer.out < RECORD_BUFFERS {
                if let Some(buf) = self.record_buffer() {
                    return Ok(buf);
                }
                if writer.out == 0 {
                    return Err(TierError::Io("no memory for a record buffer".into()));
                }
            }
            let pipe = writer.pipe.as_ref().ok_or(TierError::Closed)?;
            let stuck = self.stuck.load(Ordering::Acquire);
            let freed = if stuck {
                pipe.free.try_recv().map_err(|e| match e {
                    crossbeam_channel::TryRecvError::Empty => {
                        crossbeam_channel::RecvTimeoutError::Timeout
                    }
                    crossbeam_channel::TryRecvError::Disconnected => {
                        crossbeam_channel::RecvTimeoutError::Disconnected
                    }
                })
            } else {
                match pipe.free.recv_deadline(turn_over) {
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) if turn_over < deadline => {
                        stalled.get_or_insert_with(|| Stalled::new(&self.queue));
                        pipe.free.recv_deadline(deadline)
                    }
                    freed => freed,
                }
            };
            match freed {
                Ok(freed) => {
                    writer.out = writer.out.saturating_sub(1);
                    if let Freed::Buffer(buf) = freed {
                        return Ok(buf);
                    }
                }
                Err(crossbeam_channel::RecvTimeoutError::Timeout) if stuck => {
                    return Err(TierError::Io(
                        "the disk write thread is stuck: no record buffer has come back since \
                         a store waited its bound for one"
                            .into(),
                    ));
                }
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    self.stuck.store(true, Ordering::Release);
                    return Err(TierError::Io(format!(
                        "no record buffer came back from the disk write thread in {wait:?}"
                    )));
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                    return Err(TierError::Io("the disk write thread is gone".into()));
                }
            }
        }
    }

    /// A new record buffer, if memory can be had.
    fn record_buffer(&self) -> Option<AlignedBuf> {
        #[cfg(test)]
        if self.faults.no_memory.load(Ordering::SeqCst) {
            return None;
        }
        AlignedBuf::new((BLOCK + record_bytes(self.config.max_chunk_bytes)) as usize)
    }

    /// Makes a written task's records visible (the write thread, after its last write). Under
    /// `FsyncPolicy::Always` they are synced first. A key another task published meanwhile
    /// keeps that record, unless it is one the restart scan found and nothing has read since:
    /// the new one replaces it. The record that loses is marked deleted on disk, so that a
    /// restart finds only the one indexed (a key deleted or cleared since stays gone).
    fn publish_records(&self, records: &[(ObjectKey, Loc)]) -> Result<(), TierError> {
        if self.config.fsync == FsyncPolicy::Always
            && let Err(e) = self.sync_segments(records.iter().map(|(_, loc)| loc.segment))
        {
            // The lives these records began are not trusted to a later sync
            // (`Shared::end_unpublished_lives` comes next).
            let mut index = self.index.lock();
            for (_, loc) in records {
                let segment = &mut index.segments[loc.segment as usize];
                if segment.unsynced == Some(segment.epoch) {
                    segment.sync_failed = true;
                }
            }
            return Err(e);
        }
        let mut index = self.index.lock();
        if self.config.fsync == FsyncPolicy::Always {
            // Synced, the superblocks of the lives these records began end the stale records
            // behind them for good (`superseded`): every write of the task succeeded, unless a
            // delete's sync of the life failed before. A life another task began is that task's
            // to end, at its own sync.
            for (_, loc) in records {
                if !self.is_first(*loc) {
                    continue;
                }
                let segment = &mut index.segments[loc.segment as usize];
                if segment.superseding && !segment.sync_failed {
                    segment.unsynced = None;
                    index.end_earlier_lives(loc.segment);
                }
            }
        }
        let mut losers = Vec::new();
        for (key, loc) in records {
            if let Some(old) = index.map.get(key).copied()
                && !old.verified
            {
                index.drop_record(key, old);
                losers.push((*key, old));
            }
            if !index.index_record(*key, *loc) {
                losers.push((*key, *loc));
            }
        }
        let marks: Vec<_> = losers
            .into_iter()
            .filter_map(|(key, loc)| {
                let segment = &mut index.segments[loc.segment as usize];
                let file = segment.file.clone()?;
                // Pinned until its mark is written, as a delete's is.
                segment.pins += 1;
                Some((file, segment.epoch, key, loc))
            })
            .collect();
        drop(index);
        self.mark_deleted_and_unpin(&marks);
        if matches!(self.config.fsync, FsyncPolicy::Periodic(_)) {
            self.dirty.lock().extend(records.iter().map(|(_, loc)| loc.segment));
        }
        Ok(())
    }

    /// Gives a store task's segments back to eviction once its records are published or
    /// abandoned. A segment sealed with none unpublished left has no write of its life in flight
    /// or to come: the stale records behind a first record of that life that was not written
    /// for good (its write failed, or was skipped behind an earlier failed write) can be marked
    /// from now on, a mark racing no write.
    fn settle(&self, records: &[(ObjectKey, Loc)]) {
        let mut index = self.index.lock();
        for (_, loc) in records {
            let segment = &mut index.segments[loc.segment as usize];
            segment.unpublished = segment.unpublished.saturating_sub(1);
            segment.end_unwritten_life();
        }
        drop(index);
        self.marked.notify_all();
    }

    /// Counts a store task's outcome.
    fn count_store(&self, result: &Result<(), TierError>, records: &[(ObjectKey, Loc)]) {
        match result {
            Ok(()) => {
                self.metrics.stored(records.len() as u64, records.iter().map(|(_, l)| l.len).sum())
            }
            Err(TierError::NoSpace(_)) => self.metrics.failed(Failure::NoSpace),
            Err(_) => self.metrics.failed(Failure::Io),
        }
    }

    /// Seals a segment whose write failed, if it is still in the life it was written in: no
    /// record is ever appended after one the scan would stop at. The writer notices at its next
    /// reservation and opens another.
    fn seal_failed(&self, segment: u32, epoch: u64) {
        #[cfg(test)]
        WriteFaults::fire(&self.faults.sealing_failed, "sealing a segment whose write failed");
        let mut index = self.index.lock();
        let seg = &mut index.segments[segment as usize];
        if seg.status == Status::Active && seg.epoch == epoch {
            seg.status = Status::Sealed;
            let ended = seg.end_unwritten_life();
            index.track_sealed(segment);
            if ended {
                drop(index);
                self.marked.notify_all();
            }
        }
    }

    /// Room for `size` bytes in the active segment: its id, the offset from its start, its epoch
    /// and file.
    fn reserve(
        &self,
        writer: &mut Writer,
        size: u64,
    ) -> Result<(u32, u64, u64, Arc<SegmentFile>), TierError> {
        if let Some(active) = writer.active {
            let index = self.index.lock();
            let segment = &index.segments[active as usize];
            if segment.status == Status::Active
                && segment.end + size <= self.config.segment_bytes
                && let Some(file) = &segment.file
            {
                return Ok((active, segment.end, segment.epoch, Arc::clone(file)));
            }
            drop(index);
            self.seal(writer, active);
        }
        let (id, file) = self.open_segment()?;
        writer.active = Some(id);
        let index = self.index.lock();
        Ok((id, BLOCK, index.segments[id as usize].epoch, file))
    }

    /// Stops appending to `segment`; it becomes evictable. A life whose first record was not
    /// written and whose writes are over ends here too ([`Segment::end_unwritten_life`]), as in
    /// `seal_failed`, should that have panicked.
    fn seal(&self, writer: &mut Writer, segment: u32) {
        let mut index = self.index.lock();
        let seg = &mut index.segments[segment as usize];
        let mut ended = false;
        if seg.status == Status::Active {
            seg.status = Status::Sealed;
            ended = seg.end_unwritten_life();
            index.track_sealed(segment);
        }
        if writer.active == Some(segment) {
            writer.active = None;
            index.active = None;
        }
        if ended {
            drop(index);
            self.marked.notify_all();
        }
    }

    /// A segment initialised for a new epoch: a free one, or the policy's evictable victim. When
    /// the disk is too full to create a segment file, an existing segment is reused instead, so a
    /// capacity larger than the disk degrades into a smaller cache rather than failing.
    /// A store that turned read-only meanwhile (another task's write failed) opens none: that
    /// would evict the policy's victim first.
    fn open_segment(&self) -> Result<(u32, Arc<SegmentFile>), TierError> {
        if let Some(e) = self.refusal() {
            return Err(e);
        }
        let opened = match self.open_segment_from(true) {
            Err(TierError::NoSpace(full)) => {
                self.open_segment_from(false).map_err(|_| TierError::NoSpace(full))
            }
            other => other,
        };
        if let Err(e) = &opened {
            self.notice_unwritable(e);
        }
        opened
    }

    /// Like `open_segment`; free segments whose space is not yet allocated are used only if
    /// `create` allows.
    fn open_segment_from(&self, create: bool) -> Result<(u32, Arc<SegmentFile>), TierError> {
        let (id, evicted, existing) = {
            let mut index = self.index.lock();
            let (id, evicted) = match index.free_segment(create, &self.layout) {
                Some(id) => (id, 0),
                None => index.evict_one().ok_or_else(|| {
                    TierError::NoSpace(format!(
                        "all {} segments of {} bytes hold locked, pinned or unpublished records",
                        index.segments.len(),
                        self.config.segment_bytes
                    ))
                })?,
            };
            // The stores' segment from now on, as lookups count their room.
            index.active = Some(id);
            let segment = &mut index.segments[id as usize];
            segment.status = Status::Preparing;
            segment.end = BLOCK;
            (id, evicted, segment.file.clone())
        };
        self.metrics.evicted(evicted);
        let initialised = self.initialise(id, existing);
        let mut index = self.index.lock();
        let serial = if initialised.is_ok() { index.next_serial() } else { 0 };
        match initialised {
            Ok((file, epoch, overwrites)) => {
                // A file just created holds the other segments of its file too.
                for other in self.layout.segments_of(self.layout.file_of(id)) {
                    let segment = &mut index.segments[other as usize];
                    if segment.file.is_none() {
                        segment.file = Some(Arc::clone(&file));
                    }
                }
                let segment = &mut index.segments[id as usize];
                segment.epoch = epoch;
                segment.serial = serial;
                segment.overwrites = overwrites;
                segment.status = Status::Active;
                Ok((id, file))
            }
            Err(e) => {
                index.free(id);
                index.active = None;
                Err(e)
            }
        }
    }

    /// Gives segment `id` a new epoch, first creating its file, or allocating it as far as the
    /// segment's end, where it is missing or short. The superblock carrying the epoch is
    /// written with the life's first record (`submit_record`), in the same write: until it lands,
    /// a crash leaves the segment's previous life, whose records are still their keys' bytes. It
    /// is not synced on its own: under `FsyncPolicy::Always` the sync that publishes the record
    /// covers it. Returns the file, the epoch, and whether the life writes over space the file
    /// held before ([`Segment::overwrites`]).
    fn initialise(
        &self,
        id: u32,
        existing: Option<Arc<SegmentFile>>,
    ) -> Result<(Arc<SegmentFile>, u64, bool), TierError> {
        #[cfg(test)]
        self.faults.opening.pass();
        let n = self.layout.file_of(id);
        // The file as far as this segment's end: files grow a segment at a time.
        let bytes = self.layout.base(id) + self.layout.segment_bytes;
        let (file, overwrites) = match existing {
            Some(file) if file.len().is_ok_and(|len| len >= bytes) => (file, true),
            Some(file) => {
                file.allocate(bytes).map_err(|e| io_error(&file.path, "allocating", &e))?;
                (file, false)
            }
            None => {
                let path = file_path(&self.config.dir, n);
                let io =
                    self.decided_io().map_err(|e| io_error(&self.config.dir, "probing", &e))?;
                let created = SegmentFile::create(path.clone(), bytes, io)
                    .map_err(|e| io_error(&path, "creating", &e))?;
                created
                    .secure(self.config.file_mode(), self.config.group)
                    .map_err(|e| io_error(&path, "setting the mode of", &e))?;
                if self.config.fsync != FsyncPolicy::Never {
                    sync_dir(&self.config.dir)
                        .map_err(|e| io_error(&self.config.dir, "syncing", &e))?;
                }
                (Arc::new(created), false)
            }
        };
        Ok((file, self.new_epoch(id), overwrites))
    }

    /// The I/O mode of the segment files, decided now if it is not yet. A directory that took no
    /// probe file at open (full, or read-only) and held no segment file had nothing to tell it:
    /// its first segment file is made in the mode a probe file finds then, as at an open with
    /// room, not in buffered I/O for the rest of the process.
    fn decided_io(&self) -> std::io::Result<IoMode> {
        if let Some(mode) = self.io.get() {
            return Ok(*mode);
        }
        let probed = probe(&self.config.dir)?;
        Ok(*self.io.get_or_init(|| probed))
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

    /// Sets the deleted flag in the header of each record (of a segment kept from reuse
    /// meanwhile, in the epoch it was written in). A mark that cannot be written leaves the record
    /// to be found again after a restart, with its key's correct bytes: the caller keeps it stale
    /// ([`Index::keep_unmarked`]), so that the next delete of its key, or a clear, tries again.
    /// Returns, for each, whether it is settled: marked (now or before) and synced, unless
    /// `fsync` is `never`, or not that record any more (a later life's); not if reading, writing
    /// or syncing it failed (a power loss could undo a mark whose sync failed).
    fn mark_deleted(&self, marks: &[Mark]) -> Vec<bool> {
        let mut settled = vec![false; marks.len()];
        let Some(mut block) = AlignedBuf::new(BLOCK as usize) else {
            return settled;
        };
        let mut written: Vec<&Arc<SegmentFile>> = Vec::new();
        // Which marks were written (each then to be synced with its file).
        let mut wrote = vec![false; marks.len()];
        for (((file, epoch, key, loc), settled), wrote) in
            marks.iter().zip(&mut settled).zip(&mut wrote)
        {
            #[cfg(test)]
            {
                self.faults.marks_tried.fetch_add(1, Ordering::SeqCst);
                if self.faults.failing_marks.load(Ordering::SeqCst) {
                    continue;
                }
            }
            let head = block.as_mut_slice();
            if file.read_at(head, loc.offset).is_err() {
                continue;
            }
            let Ok(mut header) = Header::decode(head) else {
                *settled = true;
                continue;
            };
            if header.epoch != *epoch || header.key != *key {
                *settled = true;
                continue;
            }
            // Marked before, maybe by a mark whose sync failed: written again all the same, since
            // a failed writeback leaves the page clean in the cache, and a sync alone would then
            // write nothing.
            header.deleted = true;
            header.encode(head);
            let marked = file.write_at(block.as_slice(), loc.offset).is_ok();
            if marked {
                *settled = true;
                *wrote = true;
                if !written.iter().any(|f| Arc::ptr_eq(f, file)) {
                    written.push(file);
                }
            }
        }
        if self.config.fsync != FsyncPolicy::Never {
            for file in written {
                #[cfg(test)]
                let synced = if self.faults.failing_mark_syncs.load(Ordering::SeqCst) {
                    Err(std::io::Error::other("injected: a failing sync"))
                } else {
                    file.sync()
                };
                #[cfg(not(test))]
                let synced = file.sync();
                if synced.is_err() {
                    for ((marked, _, _, _), (settled, wrote)) in
                        marks.iter().zip(settled.iter_mut().zip(&wrote))
                    {
                        if *wrote && Arc::ptr_eq(marked, file) {
                            *settled = false;
                        }
                    }
                }
            }
        }
        settled
    }

    /// Marks deleted the stale records (`Segment::stale`) of `keys`, or all of them. Those behind
    /// a first record on its way to disk are not marked (the mark could land on it) but waited
    /// for, at most `BUFFER_WAIT`: once that record is written it ends them, for good once its
    /// file is synced (`superseded`), which is done here if no sync did it yet (so too for a life
    /// evicted before any sync: `Segment::unsynced`); a delete that returned before would be
    /// undone by a kill, or by a power loss, that leaves them under the old superblock. So are
    /// those behind a first record that was not written, until the writes of its life are over
    /// (`settle`), when they can be marked. Those still behind it then (its write hangs, or the
    /// sync failed) are left. Each
    /// segment marked is kept meanwhile from having its next life's first record handed over
    /// (`Segment::marking`); it stays free or active as it was, counted as before by stores and
    /// lookups. A record whose mark failed stays stale, to be marked again by the next delete or
    /// clear.
    fn mark_stale(&self, keys: Option<&HashSet<ObjectKey>>) {
        let wanted = |stale: &[(u64, ObjectKey, Loc)]| {
            stale.iter().any(|(_, key, _)| keys.is_none_or(|keys| keys.contains(key)))
        };
        let deadline = Instant::now() + BUFFER_WAIT;
        let (ids, marks) = {
            let mut index = self.index.lock();
            // The segments holding stale records of `keys` now: a record evicted after this call
            // began was stored after it.
            let targets: Vec<u32> = index
                .stale
                .iter()
                .copied()
                .filter(|&id| wanted(&index.segments[id as usize].stale))
                .collect();
            loop {
                while targets.iter().any(|&id| {
                    let segment = &index.segments[id as usize];
                    segment.waits_to_end_stale() && wanted(&segment.stale)
                }) {
                    if self.marked.wait_until(&mut index, deadline).timed_out() {
                        break;
                    }
                }
                // Each life is synced once (`end_stale` forgets it, synced or not).
                let written = index.written_lives(targets.iter().copied(), wanted);
                if written.is_empty() {
                    break;
                }
                // Unlocked, another first record may set off over stale records of these keys:
                // waited for again above, and synced, up to the deadline.
                parking_lot::MutexGuard::unlocked(&mut index, || self.end_written_lives(written));
                if Instant::now() >= deadline {
                    break;
                }
            }
            let index = &mut *index;
            let mut ids = Vec::new();
            let mut marks = Vec::new();
            for &id in &index.stale {
                let segment = &mut index.segments[id as usize];
                let Some(file) = segment.file.clone() else { continue };
                // A mark that finds its record overwritten by a life no sync covered (one written
                // since the syncs above) would be settled while a power loss could bring the
                // record back: left for the next delete or clear. The life's own records are
                // behind no first record: they are marked.
                let behind = segment.superseding || segment.unsynced.is_some();
                let life = segment.epoch;
                let before = marks.len();
                marks.extend(
                    segment
                        .stale
                        .iter()
                        .filter(|(epoch, key, _)| {
                            (!behind || *epoch == life)
                                && keys.is_none_or(|keys| keys.contains(key))
                        })
                        .map(|&(epoch, key, loc)| (Arc::clone(&file), epoch, key, loc)),
                );
                if marks.len() > before {
                    segment.marking += 1;
                    ids.push(id);
                }
            }
            (ids, marks)
        };
        if ids.is_empty() {
            return;
        }
        let mut marking = Marking { shared: self, ids, settled: HashSet::new() };
        #[cfg(test)]
        {
            WriteFaults::fire(&self.faults.marking, "marking stale records");
            self.faults.marks.pass();
        }
        let settled = self.mark_deleted(&marks);
        marking.settled = marks
            .iter()
            .zip(settled)
            .filter(|(_, settled)| *settled)
            .map(|((_, epoch, _, loc), _)| (*epoch, loc.offset))
            .collect();
    }

    /// Marks the records of `marks` deleted, each in a segment pinned for it, then unpins them;
    /// those whose mark did not settle stay stale, for the next delete or clear of their keys
    /// ([`Index::keep_unmarked`]).
    fn mark_deleted_and_unpin(&self, marks: &[Mark]) {
        if marks.is_empty() {
            return;
        }
        let settled = self.mark_deleted(marks);
        let mut index = self.index.lock();
        index.keep_unmarked(marks, &settled);
        for (_, _, _, loc) in marks {
            index.segments[loc.segment as usize].pins -= 1;
        }
    }

    /// Syncs the files of `segments`, each file once.
    fn sync_segments(&self, segments: impl Iterator<Item = u32>) -> Result<(), TierError> {
        let mut unique: HashMap<u32, u32> = HashMap::new();
        for id in segments {
            unique.entry(self.layout.file_of(id)).or_insert(id);
        }
        let files: Vec<Arc<SegmentFile>> = {
            let index = self.index.lock();
            unique.values().filter_map(|id| index.segments[*id as usize].file.clone()).collect()
        };
        // Every file is synced, whatever failed before it: one bad file leaves the others'
        // records no less durable. The first failure is the answer.
        let mut synced = Ok(());
        for file in files {
            if let (Err(e), Ok(())) = (file.sync(), &synced) {
                synced = Err(io_error(&file.path, "syncing", &e));
            }
        }
        synced
    }

    /// The periodic flusher's step: syncs the segments written since the last one, and those
    /// whose life's first record is written and not yet synced, which ends the stale records
    /// behind it (taken before the sync, so it covers their writes).
    fn sync_dirty(&self) {
        // Taken first: a segment published into during the lives' syncs waits for the next step
        // rather than be taken for synced.
        let dirty = std::mem::take(&mut *self.dirty.lock());
        let lives = {
            let index = self.index.lock();
            index.written_lives(index.stale.iter().copied(), |_| true)
        };
        let synced = self.end_written_lives(lives);
        let dirty = dirty.into_iter().filter(|&id| !synced.contains(&self.layout.file_of(id)));
        if self.sync_segments(dirty).is_err() {
            self.metrics.failed(Failure::Io);
        }
    }

    // ----- lookups and loads -----

    /// Evicts now what the stores queued ahead of a lookup will evict ([`Index::make_room_ahead`]),
    /// unless stores are refused (read-only).
    fn make_room_ahead(&self, behind: u64) {
        // Stores fail at once while read-only, or while the write thread is stuck (before they
        // take any room: `submit_record` takes its buffer first).
        if self.stuck.load(Ordering::Acquire) || self.state.lock().read_only.is_some() {
            return;
        }
        // The queue, then the index: the store taken hands its records over from one to the
        // other under both, so they are counted once.
        let queue = self.queue.state.lock();
        let queued = queue.records_before(behind);
        let evicted = self.index.lock().make_room_ahead(&queued, &self.config);
        drop(queue);
        self.metrics.evicted(evicted);
    }

    /// Locks every indexed key and tells the policy of each hit and miss.
    fn lookup_and_lock(&self, keys: &[ObjectKey]) -> Bitmap {
        let mut index = self.index.lock();
        let mut board = self.departures.lock();
        index.lookup_and_lock(&mut board, keys)
    }

    fn load(&self, items: &mut [LoadItem], staging: &mut AlignedBuf) -> Bitmap {
        // Pin the segments under the lock, read outside it; the guard unpins them under it
        // again, on every path out of here, a panic included.
        let mut pins = Pins { index: &self.index, segments: Vec::with_capacity(items.len()) };
        let planned: Vec<Option<Planned>> = {
            let mut index = self.index.lock();
            let board = self.departures.lock();
            items
                .iter()
                .map(|item| {
                    let Some(loc) = index.map.get(&item.key).copied() else {
                        // On its way here: copied from its own bytes, which the plan shares.
                        return board.bytes(&item.key, item.sink.len()).map(Planned::Departing);
                    };
                    let unverified = !loc.verified;
                    let segment = &mut index.segments[loc.segment as usize];
                    let file = segment.file.clone()?;
                    segment.pins += 1;
                    pins.segments.push(loc.segment);
                    // No touch: the lookup that locked the key was the use.
                    Some(Planned::Record { loc, epoch: segment.epoch, file, unverified })
                })
                .collect()
        };
        let mut loaded = Bitmap::new(items.len());
        let mut bytes = 0;
        let mut departing = 0;
        let mut damaged = Vec::new();
        let mut marks = Vec::new();
        let mut unreadable = Vec::new();
        let mut verified = Vec::new();
        for (i, (item, plan)) in items.iter_mut().zip(&planned).enumerate() {
            let (loc, epoch, file, unverified) = match plan {
                None => continue,
                Some(Planned::Departing(copy)) => {
                    if item.sink.write_from(copy).is_ok() {
                        loaded.set(i, true);
                        bytes += copy.len() as u64;
                        departing += 1;
                    } else {
                        self.metrics.failed(Failure::Copy);
                    }
                    continue;
                }
                Some(Planned::Record { loc, epoch, file, unverified }) => {
                    (loc, epoch, file, unverified)
                }
            };
            match self.read_record(file, *loc, *epoch, &item.key, item.sink.as_mut(), staging) {
                Ok(()) => {
                    loaded.set(i, true);
                    bytes += loc.len;
                    if *unverified {
                        verified.push((item.key, *loc));
                    }
                }
                Err(ReadFailure::Sink) => self.metrics.failed(Failure::Copy),
                Err(ReadFailure::Damaged) => {
                    damaged.push((item.key, *loc));
                    marks.push((Arc::clone(file), *epoch, item.key, *loc));
                }
                Err(ReadFailure::Io) => {
                    self.metrics.failed(Failure::Io);
                    damaged.push((item.key, *loc));
                    unreadable.push((*epoch, item.key, *loc));
                }
            }
        }
        // A record that failed verification or could not be read is never served again. (It is
        // dropped while its segment is still pinned, so `loc` cannot name a reused segment.) One
        // that failed verification is marked deleted on disk too: a restart would find it again,
        // and take it for the key's record instead of a good copy stored later; kept stale if
        // its mark does not settle. One that could not be read (the error may pass) stays on
        // disk as it was, kept stale: a delete of its key or a clear marks it, or a restart
        // would bring a deleted key back. A record no longer indexed where it was read (deleted
        // or replaced meanwhile) is a plain miss: the mark of its delete may have been written
        // under the read (a torn header, not damage), and the delete saw to the record.
        if !damaged.is_empty() || !verified.is_empty() {
            let mut index = self.index.lock();
            marks.retain(|(_, _, key, loc)| index.map.get(key) == Some(loc));
            unreadable.retain(|(_, key, loc)| index.map.get(key) == Some(loc));
            self.metrics.checksum_failed(marks.len() as u64);
            for (key, loc) in damaged {
                index.drop_record(&key, loc);
            }
            for (epoch, key, loc) in unreadable {
                index.keep_stale(epoch, key, loc);
            }
            for (key, loc) in verified {
                if let Some(indexed) = index.map.get_mut(&key).filter(|indexed| **indexed == loc) {
                    indexed.verified = true;
                }
            }
        }
        if !marks.is_empty() {
            let settled = self.mark_deleted(&marks);
            self.index.lock().keep_unmarked(&marks, &settled);
        }
        drop(pins);
        self.metrics.loaded(loaded.count_ones() as u64, bytes);
        self.departing_metrics.loaded(departing);
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
        #[cfg(test)]
        if self.faults.failing_reads.load(Ordering::SeqCst) {
            return Err(ReadFailure::Io);
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
                match map.get(start..start + size) {
                    Some(record) => record,
                    // Past the mapping: the file was made longer after it was mapped.
                    None => {
                        let buf = &mut staging.as_mut_slice()[..size];
                        file.read_at(buf, loc.offset).map_err(|_| ReadFailure::Io)?;
                        buf
                    }
                }
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
        match catch_unwind(AssertUnwindSafe(|| sink.write_from(payload))) {
            Ok(Ok(())) => Ok(()),
            _ => Err(ReadFailure::Sink),
        }
    }

    // ----- becoming read-only, and writable again -----

    /// The error a store answers while stores are refused (read-only), if they are.
    fn refusal(&self) -> Option<TierError> {
        self.state.lock().read_only.as_ref().map(ReadOnly::refusal)
    }

    /// A write, an allocation or a creation in the directory failed with `failure`. Unless the
    /// disk is full or the quota reached (`NoSpace`: segments are reused instead) or the store is
    /// read-only already, the directory is probed; if it takes no probe file (a filesystem
    /// remounted read-only, by an admin or by ext4's `errors=remount-ro`; a directory made
    /// unwritable), the store turns read-only as at open, so the stores after it are refused
    /// before they evict anything (a store opening a segment evicts the policy's victim before it
    /// can find the write refused: the tier would lose a readable segment to every store).
    /// `maintain` then tries to become writable again.
    fn notice_unwritable(&self, failure: &TierError) {
        if !matches!(failure, TierError::Io(_)) || self.state.lock().read_only.is_some() {
            return;
        }
        let dir = &self.config.dir;
        match probe(dir) {
            Ok(_) => {}
            Err(e) if is_no_space(&e) => {}
            Err(e) => self.enter_read_only(not_writable(dir, &e)),
        }
    }

    /// The OS refused the write of a record at `loc`, of life `epoch`, with `failure`. Refused
    /// for want of room in a life that writes over space its file held before
    /// ([`Segment::overwrites`]: a segment reused), the filesystem copies on write (btrfs, for a
    /// segment file whose copy-on-write could not be turned off, or was made before that was
    /// done) and is full or over its quota: reusing a segment makes no room there, and every
    /// store would evict a readable segment for a write that fails. So the store turns read-only
    /// (loads go on, the stores after this one are refused before they evict anything), and its
    /// retry waits for room for a segment (`needs_room`), not just a writable directory: a store
    /// let through before would lose one more segment every retry. Anything else:
    /// `notice_unwritable`.
    fn notice_refused(&self, failure: &TierError, loc: Loc, epoch: u64) {
        let TierError::NoSpace(message) = failure else {
            return self.notice_unwritable(failure);
        };
        let overwrote = {
            let index = self.index.lock();
            let segment = &index.segments[loc.segment as usize];
            segment.epoch == epoch && segment.overwrites
        };
        if overwrote {
            let why = format!(
                "the filesystem of {} is full or over its quota and copies on write: a reused \
                 segment needs new room, so reusing segments makes none ({message})",
                self.config.dir.display()
            );
            self.enter_read_only_as(why, true);
        }
    }

    /// Refuses stores from now on, for `why`, until `retry_writable` succeeds.
    fn enter_read_only(&self, why: String) {
        self.enter_read_only_as(why, false);
    }

    /// `enter_read_only`, for want of room (`needs_room`: stores are refused with `NoSpace`,
    /// and the retry needs room for a segment). A store read-only already takes the newer
    /// reason, and keeps needing room once it does, so that a write failing while a retry runs
    /// (without the state lock) is not forgotten by it.
    fn enter_read_only_as(&self, why: String, needs_room: bool) {
        let mut state = self.state.lock();
        state.turns += 1;
        state.needs_room |= needs_room;
        if state.read_only.is_none() {
            warn_read_only(&why);
            self.read_only_gauge.set(true);
        }
        state.read_only = Some(ReadOnly { why, full: needs_room });
        state.last_try = Instant::now();
    }

    /// Tries to become writable, the only retry under way (`retrying` held). The state lock is
    /// held only to read and set the state, never across the probe, the reopens and the syncs of
    /// [`Shared::become_writable`]: lookups read it (`make_room_ahead`) and would wait behind the
    /// disk. That opens no window: until the state says writable, here, after those syncs, every
    /// store is refused (`refusal`); nothing else makes a read-only store writable, and a turn
    /// to read-only meanwhile (a write in flight that failed) keeps it read-only, with that
    /// turn's reason, until the next retry.
    fn retry_writable(&self, _retrying: parking_lot::MutexGuard<'_, ()>) -> bool {
        let turns = {
            let mut state = self.state.lock();
            if state.read_only.is_none() {
                return true;
            }
            state.last_try = Instant::now();
            state.turns
        };
        let became = self.become_writable();
        let mut state = self.state.lock();
        if state.turns != turns {
            return false;
        }
        match became {
            Ok(()) => {
                state.read_only = None;
                state.needs_room = false;
                self.read_only_gauge.set(false);
                tracing::info!(
                    "the disk tier in {} is writable again; stores to disk resume",
                    self.config.dir.display()
                );
                true
            }
            Err(still) => {
                tracing::debug!("the disk tier is still read-only: {}", still.why);
                state.read_only = Some(still);
                false
            }
        }
    }

    /// Makes the directory writable for the store again, or says why it stays read-only.
    fn become_writable(&self) -> Result<(), ReadOnly> {
        let dir = &self.config.dir;
        let probed = probe(dir);
        // Only a retry sets the lock, and this is the only one under way.
        let mut locked = self.state.lock().lock.is_some();
        if !locked && probed.as_ref().err().is_none_or(is_no_space) {
            let lock = DirLock::take(dir, self.config.file_mode())
                .map_err(|e| ReadOnly::unwritable(e.to_string()))?;
            locked = lock.is_some();
            self.state.lock().lock = lock;
        }
        if let Some(why) = unwritable(dir, &probed, locked) {
            return Err(ReadOnly::unwritable(why));
        }
        // Read-only for want of room to write a reused segment over: that room, or nothing.
        if self.state.lock().needs_room
            && let Err(e) = room(dir, self.layout.segment_bytes)
        {
            let why = format!(
                "the filesystem of {} has no room for a segment of {} bytes ({e}), which a reused \
                 segment needs where the filesystem copies on write",
                dir.display(),
                self.layout.segment_bytes
            );
            return Err(ReadOnly { why, full: true });
        }
        if let Err(e) = secure(dir, self.config.dir_mode(), self.config.group) {
            tracing::warn!(
                "cannot restrict {} to mode {:o}: {e}",
                dir.display(),
                self.config.dir_mode()
            );
        }
        // The scan opened the segment files read-only: open them again for writing.
        let files: Vec<u32> = {
            let index = self.index.lock();
            (0..self.layout.files())
                .filter(|n| {
                    let first = self.layout.segments_of(*n).start;
                    index.segments[first as usize].file.is_some()
                })
                .collect()
        };
        // Files the scan opened, or the store made, in the mode decided then.
        let io = self.io.get().copied().unwrap_or(IoMode::Buffered);
        let mut reopened = Vec::with_capacity(files.len());
        for n in files {
            let file = open_file(&self.config, n, io, true).map_err(|e| {
                let path = file_path(&self.config.dir, n);
                ReadOnly::unwritable(format!("cannot open {} for writing: {e}", path.display()))
            })?;
            cut_file(&file, self.layout.file_bytes(n));
            reopened.push((n, file));
        }
        // A store opened read-only did not sync what its scan found: a store that skips a key
        // found there counts it durable.
        #[cfg(test)]
        self.faults.found_syncs.pass();
        sync_found(&self.config, reopened.iter().map(|(_, file)| file.as_ref()));
        let mut index = self.index.lock();
        for (n, file) in reopened {
            for id in self.layout.segments_of(n) {
                index.segments[id as usize].file = Some(Arc::clone(&file));
            }
        }
        Ok(())
    }

    fn usage(&self) -> TierUsage {
        let index = self.index.lock();
        TierUsage {
            capacity_bytes: index.segments.len() as u64 * self.layout.segment_bytes,
            used_bytes: index.live_bytes,
            objects: index.map.len() as u64,
            locks: index.lock_total,
        }
    }

    fn publish(&self) {
        let usage = self.usage();
        self.metrics.publish(usage.capacity_bytes, usage.used_bytes, usage.objects);
        let order = self.index.lock().policy.order();
        let share = |o| if order == o { 1.0 } else { 0.0 };
        self.metrics.publish_orders(share(Order::Arc), share(Order::Frequency));
        let (objects, bytes) = self.departures.lock().departing();
        self.departing_metrics.publish(objects, bytes);
    }
}

/// Where a load reads a chunk from.
enum Planned {
    /// Its record, in a segment pinned for the load (of this epoch, through this file), and
    /// whether only the restart scan has checked it so far.
    Record { loc: Loc, epoch: u64, file: Arc<SegmentFile>, unverified: bool },
    /// Its copy on its way here.
    Departing(Arc<[u8]>),
}

/// Segments [`Index::make_room_ahead`] pinned for a queued task, in the index it holds locked;
/// unpinned when dropped.
struct PinnedAhead<'a> {
    index: &'a mut Index,
    segments: Vec<u32>,
}

impl Drop for PinnedAhead<'_> {
    fn drop(&mut self) {
        for &id in &self.segments {
            self.index.segments[id as usize].pins -= 1;
        }
    }
}

/// The segments whose stale records a delete or a clear is marking (`Segment::marking`): when
/// dropped, the records whose marks are `settled` leave `Segment::stale`, and the segments may
/// take their next life's first record again (a mark that panicked too: it leaves them stale).
struct Marking<'a> {
    shared: &'a Shared,
    ids: Vec<u32>,
    settled: HashSet<(u64, u64)>,
}

impl Drop for Marking<'_> {
    fn drop(&mut self) {
        let mut index = self.shared.index.lock();
        for &id in &self.ids {
            let segment = &mut index.segments[id as usize];
            let settled = &self.settled;
            segment.stale.retain(|(epoch, _, loc)| !settled.contains(&(*epoch, loc.offset)));
            segment.marking -= 1;
            if segment.stale.is_empty() {
                index.stale.remove(&id);
            }
        }
        drop(index);
        self.shared.marked.notify_all();
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

/// A warning when the filesystem cannot hold the capacity: the segment files grow a segment at
/// a time, so past the free space each new segment's writes fail (`NoSpace`, a store refused)
/// and the store keeps reusing the segments it has, a smaller tier than configured.
fn space_warning(dir: &Path, layout: Layout) -> Option<String> {
    let capacity = u64::from(layout.segments).saturating_mul(layout.segment_bytes);
    let held = files_bytes(dir, layout);
    match available_bytes(dir) {
        Ok(available) if held.saturating_add(available) < capacity => Some(format!(
            "disk.capacity ({capacity} bytes) is more than {} can hold: its segment files take \
             {held} bytes and {available} bytes are free; the tier will stop growing there \
             (lower disk.capacity, or free space)",
            dir.display()
        )),
        Ok(_) => None,
        Err(e) => Some(format!("cannot read the free space of {}: {e}", dir.display())),
    }
}

/// Why a directory that takes no probe file is read-only.
fn not_writable(dir: &Path, error: &std::io::Error) -> String {
    format!("the directory {} is not writable: {error}", dir.display())
}

/// Why the store must be read-only in `dir`, given what its probe found (`probed`) and whether it
/// holds the directory's lock; `None` when it may write. A probe refused for want of space
/// (`is_no_space`: the filesystem is full, or the quota reached) passed what the probe guards
/// against, a filesystem remounted read-only or a directory made unwritable (the kernel refuses
/// those before it looks for space): such a directory is writable, and the store reuses its
/// segments there as it does when it fills the disk while running. Read-only would refuse every
/// store for as long as the disk stays full, even one the tier's own segments filled.
fn unwritable(dir: &Path, probed: &std::io::Result<IoMode>, locked: bool) -> Option<String> {
    match probed {
        Err(e) if !is_no_space(e) => Some(not_writable(dir, e)),
        _ if locked => None,
        Ok(_) => Some(format!("the lock file in {} cannot be made", dir.display())),
        Err(e) => Some(format!("the lock file in {} cannot be made: {e}", dir.display())),
    }
}

/// Logs that the store is read-only, and why.
fn warn_read_only(why: &str) {
    tracing::warn!(
        "the disk tier is read-only: {why}; stores to disk are refused, loads still work; \
         retrying every {WRITABLE_RETRY:?}"
    );
}

fn io_error(path: &Path, action: &str, error: &std::io::Error) -> TierError {
    let message = format!("{action} {}: {error}", path.display());
    if is_no_space(error) { TierError::NoSpace(message) } else { TierError::Io(message) }
}

impl TierAdapter for DiskStore {
    fn name(&self) -> &str {
        "disk"
    }

    /// Queued behind the stores before it, never ahead of a lookup, and taking turns with loads.
    fn submit_store(&self, items: Vec<StoreItem>) -> TaskId {
        let task = self.next_task();
        let records = items.len() as u64;
        let lens = catch_unwind(AssertUnwindSafe(|| {
            items.iter().map(|item| item.source.len()).collect::<Vec<u64>>()
        }));
        if lens.is_err() {
            self.shared.metrics.failed(Failure::Panic);
        }
        self.refused(self.shared.queue.push_store(records, Job::Store(task, items, lens.ok())));
        task
    }

    /// Queued ahead of every load and store.
    fn submit_lookup_and_lock(&self, keys: Vec<ObjectKey>) -> TaskId {
        let task = self.next_task();
        self.refused(self.shared.queue.push_lookup(Job::Lookup(task, keys, 0)));
        task
    }

    /// A load of several records is split into contiguous parts, one per I/O thread, so its
    /// reads are in flight at once; the task still completes once, with every sink in order.
    fn submit_load(&self, items: Vec<LoadItem>) -> TaskId {
        let threads = self.shared.config.io_threads;
        let task = self.next_task();
        let chunks = items.len() as u64;
        let jobs = if items.len() < SPLIT_LOADS_FROM || threads < 2 {
            vec![Job::Load(task, items)]
        } else {
            let parts = threads.min(items.len());
            let (joint, parts) = JointLoad::split(task, items, parts);
            let part = |(first, items)| Job::LoadPart { joint: Arc::clone(&joint), first, items };
            parts.into_iter().map(part).collect()
        };
        self.refused(self.shared.queue.push_load(chunks, jobs));
        task
    }

    fn unlock(&self, keys: &[ObjectKey]) {
        let mut index = self.shared.index.lock();
        let index = &mut *index;
        let mut board = self.shared.departures.lock();
        for key in keys {
            let Some((count, segment)) = index.locks.get_mut(key) else {
                // A lock taken on the chunk's copy on its way here.
                if board.unlock(key) {
                    index.lock_total -= 1;
                }
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
    /// (its header's flag), so a restart does not find it again; so are their records evicted
    /// but still on disk (`Segment::stale`). A key on its way here is withdrawn (its writer
    /// deletes the record it finishes: `ChunkSource::withdrawn`).
    fn delete(&self, keys: &[ObjectKey]) -> usize {
        let (deleted, unlocked) = self.delete_indexed(keys);
        if !unlocked.is_empty() && !self.shared.index.lock().stale.is_empty() {
            self.shared.mark_stale(Some(&unlocked));
        }
        deleted
    }

    /// Deletes every unlocked record, persistently like `delete`, and withdraws every chunk on
    /// its way here; every stale record is marked deleted too.
    fn clear(&self) -> usize {
        let keys: Vec<ObjectKey> = {
            let index = self.shared.index.lock();
            let board = self.shared.departures.lock();
            index.map.keys().chain(board.keys()).copied().collect()
        };
        let (deleted, _) = self.delete_indexed(&keys);
        self.shared.mark_stale(None);
        deleted
    }

    fn usage(&self) -> TierUsage {
        self.shared.usage()
    }

    fn completions(&self) -> Receiver<Completion> {
        self.shared.completions.clone()
    }

    fn close(&self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.queue.close();
        let workers = std::mem::take(&mut *self.workers.lock());
        for worker in workers {
            let _ = worker.join();
        }
        // No store task is being prepared now (the workers are gone): the write thread writes
        // what it was handed, completes those tasks, and stops.
        let pipe = self.shared.writer.lock().pipe.take();
        if let Some(WritePipe { messages, free, thread }) = pipe {
            drop(messages);
            drop(free);
            let _ = thread.join();
        }
        if let Some((stop, flusher)) = self.flusher.lock().take() {
            drop(stop);
            let _ = flusher.join();
        }
        // Whatever the policy, a clean close leaves everything written on stable storage; also
        // when the store turned read-only while running, after writing (a sync needs no write
        // permission). Only a failure of a writable store's sync is one to count.
        let writable = self.shared.state.lock().read_only.is_none();
        let all: Vec<u32> = (0..self.shared.index.lock().segments.len() as u32).collect();
        if self.shared.sync_segments(all.into_iter()).is_err() && writable {
            self.shared.metrics.failed(Failure::Io);
        }
        self.shared.publish();
    }
}

impl Drop for DiskStore {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    mod model;

    fn at(segment: u32, offset: u64) -> Loc {
        Loc::written(segment, offset, 1)
    }

    /// A segment policy with a bug: its second hit panics.
    struct PanicsOnSecondHit {
        hits: usize,
    }

    impl SegmentPolicy<SegmentLife, ObjectKey> for PanicsOnSecondHit {
        fn written(&mut self, _: &SegmentLife, _: &ObjectKey) {}
        fn seal(&mut self, _: SegmentLife) {}
        fn missed(&mut self, _: &ObjectKey) {}
        fn hit(&mut self, _: &SegmentLife, _: &ObjectKey) {
            self.hits += 1;
            assert!(self.hits < 2, "a policy bug");
        }
        fn len(&self) -> usize {
            0
        }
        fn contains(&self, _: &SegmentLife) -> bool {
            false
        }
        fn evict<'c>(
            &mut self,
            _: &mut dyn FnMut(&SegmentLife) -> bool,
            _: &dyn Fn(&SegmentLife) -> &'c [ObjectKey],
        ) -> Option<SegmentLife>
        where
            ObjectKey: 'c,
        {
            None
        }
    }

    #[test]
    fn a_capacity_past_the_free_space_is_warned_of_and_one_within_it_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let segment_bytes = 1 << 20;
        let free = available_bytes(dir.path()).unwrap();
        let layout = |segments: u64| Layout {
            segment_bytes,
            segments: u32::try_from(segments).unwrap(),
            per_file: 4,
        };
        assert_eq!(space_warning(dir.path(), layout(2)), None);
        let past = free / segment_bytes + 2;
        let warning = space_warning(dir.path(), layout(past)).unwrap();
        assert!(warning.contains("disk.capacity"), "{warning}");
        // The room the store has already is its files' bytes, counted beside the free space.
        std::fs::write(file_path(dir.path(), 0), vec![0u8; 3 << 20]).unwrap();
        let held = files_bytes(dir.path(), layout(past));
        assert_eq!(held, 3 << 20);
    }

    #[test]
    fn a_policy_that_panics_during_a_lookup_leaves_no_lock_behind() {
        let mut index = Index {
            map: HashMap::new(),
            locks: HashMap::new(),
            lock_total: 0,
            segments: (0..3).map(|_| Segment::free()).collect(),
            policy: Box::new(PanicsOnSecondHit { hits: 0 }),
            lives: 0,
            live_bytes: 0,
            free_from: 0,
            active: None,
            preparing: VecDeque::new(),
            stale: BTreeSet::new(),
        };
        let keys = tierkv_testkit::contract::keys(0..3);
        // Keys 0 and 1 have records, key 2 is on its way here; the lookup visits 2, 1, then 0,
        // whose hit (the policy's second) panics.
        index.map.insert(keys[0], at(0, 0));
        index.map.insert(keys[1], at(1, 0));
        let departures = Departures::new();
        let departing = departures.depart(keys[2], Arc::from(vec![0u8; 1]));
        let mut board = departures.lock();
        let panicked = catch_unwind(AssertUnwindSafe(|| index.lookup_and_lock(&mut board, &keys)));
        assert!(panicked.is_err(), "the policy's second hit panics");
        assert!(index.locks.is_empty(), "locked: {:?}", index.locks);
        assert_eq!(index.lock_total, 0);
        assert!(index.segments.iter().all(|s| s.locked == 0));
        assert!(!board.unlock(&keys[2]), "the board holds no lock on the departing key");
        drop(board);
        drop(departing);
    }

    #[test]
    fn a_store_that_becomes_writable_syncs_its_files_unless_told_never_to() {
        use crate::segment::SYNCS;
        use tierkv_testkit::contract::keys;

        for fsync in [FsyncPolicy::Never, FsyncPolicy::Always] {
            let dir = tempfile::tempdir().unwrap();
            let config =
                DiskStoreConfig { fsync, ..DiskStoreConfig::new(dir.path(), 1 << 22, 4096) };
            let store = Arc::new(DiskStore::open(config).unwrap());
            harness(&store).store(&keys(0..3)).unwrap();
            // As a store opened read-only is: its scan did not sync what it found.
            store.shared.enter_read_only("read-only for the test".into());
            let before = SYNCS.with(|s| s.get());
            assert!(store.retry_writable());
            let synced = SYNCS.with(|s| s.get()) - before;
            if fsync == FsyncPolicy::Never {
                assert_eq!(synced, 0, "told never to sync");
            } else {
                assert!(synced >= 1, "the files reopened are synced before a store counts on them");
            }
        }
    }

    #[test]
    fn lookups_do_not_wait_for_the_syncs_of_a_store_becoming_writable() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let mut h = harness(&store);
        h.store(&keys(0..2)).unwrap();
        store.shared.enter_read_only("read-only for the test".into());
        // The retry's syncs held, as behind a slow disk.
        let syncs = store.shared.faults.found_syncs.hold();
        let retrying = std::thread::spawn({
            let store = Arc::clone(&store);
            move || store.retry_writable()
        });
        store.shared.faults.found_syncs.wait_for(1);
        // On a thread of its own, so that a lookup that waits for the syncs fails the test
        // rather than hangs it (the syncs go on only once this thread lets them).
        let (answer, answered) = std::sync::mpsc::channel();
        std::thread::spawn({
            let store = Arc::clone(&store);
            move || {
                let mut h = harness(&store);
                let _ = answer.send((h.present(&keys(0..2)).count_ones(), h.store(&keys(2..3))));
            }
        });
        let (present, stored) =
            answered.recv_timeout(Duration::from_secs(10)).expect("a lookup waited for the syncs");
        assert_eq!(present, 2);
        assert!(store.read_only().is_some());
        // Stores are still refused: the records found are not synced yet.
        assert!(stored.is_err(), "a store before the syncs of its retry");
        // A second retry (the maintenance tick) neither waits nor gets ahead of the first.
        store.shared.state.lock().last_try -= WRITABLE_RETRY;
        store.maintain();
        assert!(store.read_only().is_some());
        drop(syncs);
        assert!(retrying.join().unwrap());
        assert_eq!(store.read_only(), None);
        h.store(&keys(2..3)).unwrap();
    }

    #[test]
    fn a_turn_to_read_only_while_a_retry_runs_keeps_the_store_read_only_and_needing_room() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        harness(&store).store(&keys(0..2)).unwrap();
        store.shared.enter_read_only("read-only for the test".into());
        // A reused segment of a copy-on-write filesystem found no room, the store read-only
        // already: it needs room from now on, not just a writable directory.
        store.shared.enter_read_only_as("no room to write a reused segment over".into(), true);
        assert!(store.shared.state.lock().needs_room);
        assert_eq!(store.read_only().as_deref(), Some("no room to write a reused segment over"));
        store.shared.state.lock().needs_room = false;
        // The same turn while a retry runs, between its probe and its "writable".
        let syncs = store.shared.faults.found_syncs.hold();
        let retrying = std::thread::spawn({
            let store = Arc::clone(&store);
            move || store.retry_writable()
        });
        store.shared.faults.found_syncs.wait_for(1);
        store.shared.enter_read_only_as("no room to write a reused segment over".into(), true);
        drop(syncs);
        assert!(!retrying.join().unwrap(), "the retry forgot a turn made while it ran");
        assert!(store.read_only().is_some());
        assert!(store.shared.state.lock().needs_room);
    }

    #[test]
    fn stores_refused_for_want_of_room_say_no_space_and_those_refused_as_unwritable_io() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let mut h = harness(&store);
        // A reused segment of a copy-on-write filesystem found no room: its store failed with
        // `NoSpace`, and so do the stores refused after it.
        store.shared.enter_read_only_as("no room to write a reused segment over".into(), true);
        match h.store(&keys(0..1)) {
            Err(TierError::NoSpace(why)) => assert!(why.contains("reused segment"), "{why}"),
            other => panic!("a store refused for want of room answered {other:?}"),
        }
        // The directory turned unwritable since: that is the reason now, answered as at open.
        store.shared.enter_read_only("not writable".into());
        match h.store(&keys(0..1)) {
            Err(TierError::Io(why)) => assert!(why.contains("not writable"), "{why}"),
            other => panic!("a store refused as unwritable answered {other:?}"),
        }
    }

    #[test]
    fn a_clean_close_syncs_what_was_written_before_a_read_only_turn() {
        use crate::segment::SYNCS;
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let config = DiskStoreConfig {
            fsync: FsyncPolicy::Never,
            ..DiskStoreConfig::new(dir.path(), 1 << 22, 4096)
        };
        let store = Arc::new(DiskStore::open(config).unwrap());
        harness(&store).store(&keys(0..3)).unwrap();
        // Turned read-only while running, after it wrote (a filesystem remounted read-only).
        store.shared.enter_read_only("read-only for the test".into());
        let before = SYNCS.with(|s| s.get());
        store.close();
        assert!(SYNCS.with(|s| s.get()) > before, "what was written is synced at a clean close");
    }

    #[test]
    fn a_restart_syncs_what_its_scan_found_unless_told_never_to() {
        use crate::segment::SYNCS;
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let config =
            |fsync| DiskStoreConfig { fsync, ..DiskStoreConfig::new(dir.path(), 1 << 22, 4096) };
        // Opens the directory; the syncs this thread asked for while opening it.
        let open = |fsync| {
            let before = SYNCS.with(|s| s.get());
            let store = Arc::new(DiskStore::open(config(fsync)).unwrap());
            (store, SYNCS.with(|s| s.get()) - before)
        };
        // Records written and never synced, as a process killed before its sync leaves them.
        let (store, _) = open(FsyncPolicy::Never);
        harness(&store).store(&keys(0..3)).unwrap();
        drop(store);
        let (store, synced) = open(FsyncPolicy::Never);
        assert_eq!(synced, 0, "told never to sync");
        drop(store);
        let (store, synced) = open(FsyncPolicy::Always);
        assert_eq!(store.recovered().records, 3);
        assert!(synced >= 1, "the scanned file is synced before a store can count on it");
    }

    /// A segment policy with a bug: the first record written after it took over panics (on
    /// the write thread, which publishes records). Otherwise it is the policy it wraps.
    struct PanicsOnFirstWrite {
        inner: Box<dyn SegmentPolicy<SegmentLife, ObjectKey>>,
        panicked: bool,
    }

    impl SegmentPolicy<SegmentLife, ObjectKey> for PanicsOnFirstWrite {
        fn written(&mut self, segment: &SegmentLife, key: &ObjectKey) {
            if !std::mem::replace(&mut self.panicked, true) {
                panic!("a policy bug");
            }
            self.inner.written(segment, key);
        }
        fn seal(&mut self, segment: SegmentLife) {
            self.inner.seal(segment);
        }
        fn missed(&mut self, key: &ObjectKey) {
            self.inner.missed(key);
        }
        fn hit(&mut self, segment: &SegmentLife, key: &ObjectKey) {
            self.inner.hit(segment, key);
        }
        fn len(&self) -> usize {
            self.inner.len()
        }
        fn contains(&self, segment: &SegmentLife) -> bool {
            self.inner.contains(segment)
        }
        fn evict<'c>(
            &mut self,
            eligible: &mut dyn FnMut(&SegmentLife) -> bool,
            chunks: &dyn Fn(&SegmentLife) -> &'c [ObjectKey],
        ) -> Option<SegmentLife>
        where
            ObjectKey: 'c,
        {
            self.inner.evict(eligible, chunks)
        }
    }

    #[test]
    fn a_panic_on_the_write_thread_fails_its_task_and_the_thread_serves_the_next() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        {
            let mut index = store.shared.index.lock();
            let inner = std::mem::replace(&mut index.policy, PolicyKind::Lru.build_for_segments());
            index.policy = Box::new(PanicsOnFirstWrite { inner, panicked: false });
        }
        let completions = store.completions();
        let mut h = harness(&store);
        // The first store's publish panics on the write thread: the task still completes, as a
        // failure, with its sources back.
        let task = h.submit_store(&keys(0..2));
        let done = completions
            .recv_timeout(Duration::from_secs(10))
            .expect("the store whose publish panicked never completed");
        failed_with_its_sources(done, task, 2, "publish panicked");
        // The write thread lives on: the next store is written, published and served.
        h.store(&keys(2..4)).unwrap();
        h.assert_loads(&keys(2..4));
    }

    /// `done` completes store `task` of `sources` chunks as failed (`why`), its sources back.
    fn failed_with_its_sources(done: Completion, task: TaskId, sources: usize, why: &str) {
        match done {
            Completion::Stored { task: t, result, sources: back } => {
                assert_eq!(t, task);
                assert!(result.is_err(), "a store whose {why} reported {result:?}");
                assert_eq!(back.len(), sources, "the sources come back");
            }
            _ => panic!("not a store completion"),
        }
    }

    /// The record buffers `store` has once it took in all the write thread handed back: in
    /// hand, and reported lost. (None may be with the write thread then.)
    fn record_buffers(store: &DiskStore) -> (usize, usize) {
        let mut writer = store.shared.writer.lock();
        let freed: Vec<Freed> =
            writer.pipe.as_ref().map_or(Vec::new(), |pipe| pipe.free.try_iter().collect());
        let mut lost = 0;
        for freed in freed {
            writer.out -= 1;
            match freed {
                Freed::Buffer(buf) => writer.spare.push(buf),
                Freed::Lost => lost += 1,
            }
        }
        assert_eq!(writer.out, 0, "buffers still with the write thread");
        (writer.spare.len(), lost)
    }

    /// Arms the write thread's `fault` for one panic during a store: the task completes as
    /// failed with its sources, the thread serves the next store, and the store ends with as
    /// many record buffers as it began with, counting those reported lost (`lost` of them:
    /// none lost silently, none reported for one that came back).
    fn a_write_thread_panic_is_contained(fault: fn(&WriteFaults) -> &AtomicBool, lost: usize) {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let completions = store.completions();
        let mut h = harness(&store);
        fault(&store.shared.faults).store(true, Ordering::SeqCst);
        let task = h.submit_store(&keys(0..2));
        let done = completions
            .recv_timeout(Duration::from_secs(10))
            .expect("the store whose write thread panicked never completed");
        assert!(!fault(&store.shared.faults).load(Ordering::SeqCst), "the fault fired");
        failed_with_its_sources(done, task, 2, "write thread panicked");
        h.store(&keys(2..4)).expect("the write thread serves the next store");
        h.assert_loads(&keys(2..4));
        assert_eq!(record_buffers(&store), (RECORD_BUFFERS - lost, lost), "(in hand, lost)");
    }

    #[test]
    fn a_panic_collecting_a_finished_write_fails_its_task_and_loses_no_buffer() {
        a_write_thread_panic_is_contained(|faults| &faults.collecting, 1);
    }

    #[test]
    fn a_panic_after_a_record_is_handed_over_makes_no_extra_buffer() {
        a_write_thread_panic_is_contained(|faults| &faults.handed_over, 0);
    }

    #[test]
    fn a_task_behind_another_tasks_failed_write_in_the_same_life_is_failed_too() {
        // Task 1's record at 8 KiB and task 2's at 12 KiB of segment 3, life 7, both in flight;
        // task 1's write fails. A restart would stop at 8 KiB: task 2's record is lost to it.
        let mut lives = LifeFailures::default();
        lives.handed_over(1, at(3, 8192), 7);
        lives.handed_over(2, at(3, 12288), 7);
        // Task 3 wrote before the failed record in that life, task 4 in another life of the
        // segment, task 5 in another segment: a restart finds all three.
        lives.handed_over(3, at(3, 4096), 7);
        lives.handed_over(4, at(3, 12288), 8);
        lives.handed_over(5, at(4, 12288), 7);
        lives.write_failed(at(3, 8192), 7);
        assert!(lives.failed(at(3, 16384), 7), "later records of the life are skipped");
        assert!(!lives.failed(at(3, 16384), 8));
        assert!(lives.behind_a_failed_write(2));
        for task in [3, 4, 5] {
            assert!(!lives.behind_a_failed_write(task), "task {task}");
        }
        // A later failure lower in the life moves the mark down.
        lives.write_failed(at(3, 4096), 7);
        assert!(lives.behind_a_failed_write(1));
        assert!(!lives.behind_a_failed_write(3), "the failed record is its own task's failure");
        lives.forget(2);
        assert!(!lives.behind_a_failed_write(2), "a task that ended is forgotten");
    }

    #[test]
    fn a_failed_life_is_forgotten_once_its_segment_is_written_again() {
        let mut lives = LifeFailures::default();
        // Every write fails, life after life, in two segments: the failures held stay at one
        // a segment, not one a life.
        for epoch in 1..1_000u64 {
            for segment in [3, 4] {
                lives.handed_over(epoch, at(segment, 4096), epoch);
                lives.write_failed(at(segment, 4096), epoch);
                assert!(lives.failed(at(segment, 8192), epoch), "the rest of the life is skipped");
                lives.forget(epoch);
            }
            assert_eq!(lives.failed.len(), 2);
        }
        // The next life of segment 3 starts clean.
        lives.handed_over(5_000, at(3, 0), 1_000);
        assert!(!lives.failed(at(3, 4096), 1_000));
        assert!(!lives.failed(at(3, 4096), 999), "the earlier life is forgotten");
        assert!(!lives.behind_a_failed_write(5_000));
    }

    #[test]
    fn a_life_with_a_smaller_epoch_than_the_last_still_has_its_failures_seen() {
        // Epochs are random: the segment's next life may well draw a smaller one. Its failure
        // must still skip the records behind it and fail the tasks that wrote them.
        let mut lives = LifeFailures::default();
        lives.handed_over(1, at(3, 4096), 1_000);
        lives.write_failed(at(3, 4096), 1_000);
        lives.forget(1);
        lives.handed_over(2, at(3, 4096), 5);
        lives.handed_over(3, at(3, 8192), 5);
        assert!(!lives.failed(at(3, 8192), 5), "the new life starts clean");
        lives.write_failed(at(3, 4096), 5);
        assert!(lives.failed(at(3, 12288), 5), "later records of the life are skipped");
        assert!(
            lives.behind_a_failed_write(3),
            "a record behind the failed one is lost to a restart"
        );
    }

    #[test]
    fn a_panic_collecting_another_tasks_write_fails_that_task_not_the_one_being_handled() {
        // With several I/O threads, task 2's records can reach the write thread while task 1's
        // writes are in flight (task 1's end is sent after its store let go of the writer): task
        // 2's record then waits for a writer by collecting task 1's write. A panic collecting it
        // must fail task 1, whose write's outcome is unknown, and leave task 2 alone.
        let dir = tempfile::tempdir().unwrap();
        let store = DiskStore::open(DiskStoreConfig::new(dir.path(), 1 << 22, 4096)).unwrap();
        let file = Arc::new(
            SegmentFile::create(dir.path().join("records"), 1 << 20, IoMode::Buffered).unwrap(),
        );
        let (free, freed) = unbounded();
        let (writes, queued) = unbounded::<Write>();
        let (report, written) = unbounded::<Written>();
        let mut state = InFlight {
            shared: &store.shared,
            free: &free,
            written: &written,
            in_flight: 0,
            held: 0,
            failed_tasks: HashMap::new(),
            lives: LifeFailures::default(),
        };
        let record = |task: u64, offset: u64| WriteMsg::Record {
            task,
            file: Arc::clone(&file),
            buf: AlignedBuf::new(2 * BLOCK as usize).unwrap(),
            bytes: Span { start: BLOCK as usize, len: BLOCK as usize, at: offset },
            loc: at(0, offset),
            epoch: 7,
        };
        // One writer thread (played by the test), busy with task 1's record, which finishes.
        state.handle(record(1, BLOCK), &writes, 1);
        let write = queued.try_recv().expect("task 1's record went to the writer");
        report.send(write.run()).unwrap();
        // Task 2's record collects task 1's write to get a writer, and that collection panics.
        store.shared.faults.collecting.store(true, Ordering::SeqCst);
        state.handle(record(2, 2 * BLOCK), &writes, 1);
        assert!(!store.shared.faults.collecting.load(Ordering::SeqCst), "the fault fired");
        assert!(state.failed_tasks.contains_key(&1), "task 1's write's outcome is unknown");
        assert!(!state.failed_tasks.contains_key(&2), "task 2 failed for task 1's write");
        assert_eq!(queued.try_iter().map(|w| w.task).collect::<Vec<_>>(), [2], "written next");
        let freed: Vec<Freed> = freed.try_iter().collect();
        assert!(matches!(freed[..], [Freed::Lost]), "task 1's buffer, lost, is reported; no other");
    }

    #[test]
    fn a_store_never_waits_for_ever_for_record_buffers_the_write_thread_lost() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let completions = store.completions();
        let mut h = harness(&store);
        let faults = &store.shared.faults;
        let stored_within = |what: &str, wait: Duration| match completions.recv_timeout(wait) {
            Ok(Completion::Stored { result, .. }) => result,
            Ok(_) => panic!("not a store completion"),
            Err(_) => panic!("{what} did not complete within {wait:?}"),
        };
        let stored = |what: &str| stored_within(what, Duration::from_secs(10));
        // Every record buffer is lost to a panic on the write thread while no memory can be
        // had to replace it.
        faults.no_memory.store(true, Ordering::SeqCst);
        for n in 0..RECORD_BUFFERS as u64 {
            faults.collecting.store(true, Ordering::SeqCst);
            h.submit_store(&keys(n..n + 1));
            assert!(stored("a store whose write thread panicked").is_err());
        }
        // The next store has no buffer and none will come back: it fails (a miss), at once,
        // not after waiting out the bound for a buffer that cannot come.
        h.submit_store(&keys(10..11));
        let lost = stored_within("a store with every record buffer lost", BUFFER_WAIT / 2);
        assert!(lost.is_err());
        // With memory to be had again, the buffers lost are made again as stores need them.
        faults.no_memory.store(false, Ordering::SeqCst);
        let more = 20..20 + 2 * RECORD_BUFFERS as u64;
        h.store(&keys(more.clone())).expect("the buffers lost are made again");
        h.assert_loads(&keys(more));
        assert_eq!(record_buffers(&store), (RECORD_BUFFERS, 0), "as many as before, no more");
    }

    #[test]
    fn a_store_waits_for_a_record_buffer_no_longer_than_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let store = DiskStore::open(DiskStoreConfig::new(dir.path(), 1 << 22, 4096)).unwrap();
        let mut writer = store.shared.writer.lock();
        // Every buffer is with the write thread, as behind a write that hangs: none comes back.
        let spare = std::mem::take(&mut writer.spare);
        writer.out = RECORD_BUFFERS;
        let waited = store.shared.free_buffer_within(&mut writer, Duration::from_millis(20));
        assert!(matches!(waited, Err(TierError::Io(_))), "{:?}", waited.map(|_| ()));
        writer.out = 0;
        writer.spare = spare;
    }

    /// How long the tests below wait for a completion before they call the task hung.
    const DEADLINE: Duration = Duration::from_secs(60);

    /// A store of 4 KiB chunks in 4 MiB.
    fn small_store(dir: &Path) -> Arc<DiskStore> {
        Arc::new(DiskStore::open(DiskStoreConfig::new(dir, 1 << 22, 4096)).unwrap())
    }

    /// A harness over `store`, of 4 KiB chunks.
    fn harness(store: &Arc<DiskStore>) -> tierkv_testkit::contract::Harness {
        use tierkv_testkit::contract::{Harness, OpenTier};
        Harness::new(OpenTier { tier: store.clone(), chunk_bytes: 4096, keep: Box::new(()) })
    }

    /// A store of one 4 KiB chunk in one-record segments, evicting least recently used first.
    fn lru_store(dir: &Path, segments: u64) -> Arc<DiskStore> {
        lru_store_syncing(dir, segments, FsyncPolicy::Always)
    }

    fn lru_store_syncing(dir: &Path, segments: u64, fsync: FsyncPolicy) -> Arc<DiskStore> {
        let config = DiskStoreConfig::new(dir, 0, 4096);
        let capacity_bytes = segments * config.segment_bytes;
        let config = DiskStoreConfig { capacity_bytes, policy: PolicyKind::Lru, fsync, ..config };
        Arc::new(DiskStore::open(config).unwrap())
    }

    #[test]
    fn the_queue_serves_lookups_first_and_lets_loads_and_stores_take_turns() {
        let store = |n: u64| {
            let items = (0..n)
                .map(|i| StoreItem {
                    key: tierkv_testkit::contract::key(i),
                    source: Box::new(tierkv_core::VecChunk(vec![0; 8])),
                })
                .collect();
            Job::Store(TaskId(0), items, Some(vec![8; n as usize]))
        };
        let load = |task: u64| Job::Load(TaskId(task), Vec::new());
        let lookup = |task: u64| Job::Lookup(TaskId(task), Vec::new(), 0);
        let queue = Queue::new();
        let taken = || queue.state.lock().take();
        let what = |job: Option<Job>| match job {
            Some(Job::Lookup(task, ..)) => format!("lookup {}", task.0),
            Some(Job::Load(task, _)) => format!("load {}", task.0),
            Some(Job::Store(_, items, _)) => format!("store of {}", items.len()),
            Some(Job::LoadPart { .. }) => "part".into(),
            None => "wait".into(),
        };
        assert!(queue.push_store(1, store(1)).is_empty());
        assert!(queue.push_store(2, store(2)).is_empty());
        assert!(queue.push_load(READ_AHEAD, vec![load(1)]).is_empty());
        assert!(queue.push_load(READ_AHEAD, vec![load(2)]).is_empty());
        assert!(queue.push_lookup(lookup(3)).is_empty());
        // The lookup first, then a load (stores wait: it reads as far ahead of them as loads
        // may), then a store; the second load waits for a store's turn, the second store for
        // the first to be prepared.
        assert_eq!(what(taken()), "lookup 3");
        assert_eq!(what(taken()), "load 1");
        assert_eq!(what(taken()), "store of 1");
        assert_eq!(what(taken()), "wait");
        queue.stored(1);
        assert_eq!(what(taken()), "load 2");
        assert_eq!(what(taken()), "store of 2");
        assert_eq!(what(taken()), "wait");
        queue.stored(2);
        // With no store waiting, loads need no turn.
        for task in 4..7 {
            assert!(queue.push_load(READ_AHEAD, vec![load(task)]).is_empty());
            assert_eq!(what(taken()), format!("load {task}"));
        }
        // A lookup waits while more than `LOOKUP_AHEAD` records queued before it are not taken.
        for _ in 0..=LOOKUP_AHEAD {
            assert!(queue.push_store(1, store(1)).is_empty());
        }
        assert!(queue.push_lookup(lookup(7)).is_empty());
        assert!(queue.push_store(1, store(1)).is_empty());
        assert_eq!(what(taken()), "store of 1");
        assert_eq!(what(taken()), "lookup 7", "within its bound once one is taken");
        // Closed: everything left is handed out (to be failed), turns or not.
        assert!(queue.push_load(1, vec![load(8)]).is_empty());
        queue.close();
        let mut left = 0;
        while taken().is_some() {
            left += 1;
        }
        assert_eq!(left, LOOKUP_AHEAD + 2, "every store and the load");
        assert_eq!(queue.push_lookup(lookup(9)).len(), 1, "refused once closed");
    }

    /// Releases the writes held, and checks that each of the `stores` stores held behind them
    /// (keys 100 on) is written and answered.
    fn release_held_stores(
        held: Held<'_>,
        completions: &Receiver<Completion>,
        h: &mut tierkv_testkit::contract::Harness,
        stores: u64,
    ) {
        use tierkv_testkit::contract::keys;

        drop(held);
        for _ in 0..stores {
            match completions.recv_timeout(DEADLINE).expect("a store never completed") {
                Completion::Stored { result, .. } => result.expect("a held store failed"),
                _ => panic!("not a store completion"),
            }
        }
        h.assert_loads(&keys(100..100 + stores));
    }

    /// Asserts that a load brought every chunk, each with its payload.
    fn assert_loaded_whole(loaded: &Bitmap, sinks: &mut [LoadItem]) {
        assert_eq!(loaded.count_ones(), sinks.len(), "not every chunk loaded");
        for item in sinks {
            let bytes = item.sink.host_bytes_mut().map(|b| b.to_vec());
            let payload = tierkv_testkit::contract::payload(&item.key, 4096);
            assert_eq!(bytes, Some(payload), "{:?}", item.key);
        }
    }

    #[test]
    fn lookups_and_loads_are_answered_while_the_stores_before_them_wait_for_writes() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let completions = store.completions();
        let mut h = harness(&store);
        h.store(&keys(0..8)).unwrap();
        let held = store.shared.faults.hold_writes();
        // Stores whose writes cannot finish: the first take every record buffer, the next waits
        // for one (until `BUFFER_WAIT`), and more than the I/O threads queue behind it. On one
        // queue with the lookups and loads, they would hold every I/O thread.
        let stores = RECORD_BUFFERS as u64 + 2 * store.shared.config.io_threads as u64;
        for i in 0..stores {
            h.submit_store(&keys(100 + i..101 + i));
        }
        // Submitted behind them, a lookup and a load (split over the I/O threads) are answered
        // while every write is held, before any store: nothing of a store completes or is
        // published before its writes.
        let next = || {
            let done = completions.recv_timeout(DEADLINE).expect("nothing completed");
            assert!(!matches!(done, Completion::Stored { .. }), "a store completed first");
            done
        };
        let task = store.submit_lookup_and_lock(keys(0..8));
        match next() {
            Completion::LookedUp { task: t, locked } => {
                assert_eq!((t, locked.count_ones()), (task, 8), "the chunks on disk are found");
            }
            _ => panic!("not a lookup completion"),
        }
        let task = h.submit_load(&keys(0..8));
        match next() {
            Completion::Loaded { task: t, loaded, mut sinks } => {
                assert_eq!(t, task);
                assert_loaded_whole(&loaded, &mut sinks);
            }
            _ => panic!("not a load completion"),
        }
        let task = store.submit_lookup_and_lock(keys(100..100 + stores));
        match next() {
            Completion::LookedUp { task: t, locked } => {
                assert_eq!((t, locked.count_ones()), (task, 0), "published before its writes");
            }
            _ => panic!("not a lookup completion"),
        }
        store.unlock(&keys(0..8));
        release_held_stores(held, &completions, &mut h, stores);
    }

    /// Fills an `lru_store` of 16 segments with keys 0 to 15, oldest first, holds every write and
    /// submits eight stores of a new chunk each (100 to 107): the first four take the record
    /// buffers, the fifth waits for one, three wait in the queue. Each evicts the oldest chunk
    /// left when it is prepared: eight in all, three of them not yet. Returns the writes held
    /// and the stores' tasks.
    fn three_stores_queued<'a>(
        store: &'a DiskStore,
        h: &mut tierkv_testkit::contract::Harness,
    ) -> (Held<'a>, Vec<TaskId>) {
        use tierkv_testkit::contract::keys;

        for n in 0..16 {
            h.store(&keys(n..n + 1)).unwrap();
        }
        let held = store.shared.faults.hold_writes();
        let tasks: Vec<TaskId> = (100..108).map(|n| h.submit_store(&keys(n..n + 1))).collect();
        while store.shared.queue.state.lock().stores.len() > 3 {
            std::thread::yield_now();
        }
        (held, tasks)
    }

    /// Closes `store` with the stores of `three_stores_queued` still queued, which then fail;
    /// the writes held are released once it no longer takes jobs, so the store waiting for a
    /// buffer is written.
    fn close_before_the_queued_stores_run(
        store: &Arc<DiskStore>,
        h: tierkv_testkit::contract::Harness,
        held: Held<'_>,
    ) {
        let closing = std::thread::spawn({
            let store = Arc::clone(store);
            move || store.close()
        });
        while !store.shared.queue.state.lock().closed {
            std::thread::yield_now();
        }
        drop(held);
        closing.join().unwrap();
        drop(h);
    }

    #[test]
    fn a_lookup_ahead_of_queued_stores_finds_what_it_would_find_behind_them() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        let (held, tasks) = three_stores_queued(&store, &mut h);
        // A lookup ahead of the three finds what it would have found behind them.
        let found = h.present(&keys(0..16));
        assert_eq!(found.iter_ones().collect::<Vec<_>>(), (8..16).collect::<Vec<_>>());
        drop(held);
        for task in tasks {
            match h.wait(task) {
                Completion::Stored { result, .. } => result.expect("a held store failed"),
                _ => panic!("not a store completion"),
            }
        }
        // The stores took the room made for them, and evicted nothing more.
        let found = h.present(&keys(0..16));
        assert_eq!(found.iter_ones().collect::<Vec<_>>(), (8..16).collect::<Vec<_>>());
        assert_eq!(h.present(&keys(100..108)).count_ones(), 8);
    }

    #[test]
    fn a_lookup_while_a_segment_is_opened_counts_its_store_once() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        for n in 0..16 {
            h.store(&keys(n..n + 1)).unwrap();
        }
        // A store evicts the oldest chunk for its segment and is held while it opens it: the
        // segment it takes is neither free nor yet receiving appends.
        let opening = store.shared.faults.opening.hold();
        let task = h.submit_store(&keys(100..101));
        store.shared.faults.opening.wait_for(1);
        // A lookup then finds all but the chunk evicted for it: it evicts nothing more.
        let found = h.present(&keys(0..16));
        assert_eq!(found.iter_ones().collect::<Vec<_>>(), (1..16).collect::<Vec<_>>());
        drop(opening);
        match h.wait(task) {
            Completion::Stored { result, .. } => result.expect("the held store failed"),
            _ => panic!("not a store completion"),
        }
        assert_eq!(h.present(&keys(0..16)).count_ones(), 15);
        assert_eq!(h.present(&keys(100..101)).count_ones(), 1);
    }

    #[test]
    fn a_clear_marks_the_records_of_segments_evicted_ahead_of_stores_deleted() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        // A lookup evicts 5, 6 and 7 ahead of the three stores queued, whose segments stay
        // free, their records on disk, as the store closes before they run.
        let (held, _) = three_stores_queued(&store, &mut h);
        assert_eq!(h.present(&keys(0..16)).count_ones(), 8);
        // The clear waits for the first records held, which end the records evicted for them
        // (0 to 4), and marks those evicted ahead.
        let clearing = std::thread::spawn({
            let store = Arc::clone(&store);
            move || store.clear()
        });
        std::thread::sleep(Duration::from_millis(200));
        close_before_the_queued_stores_run(&store, h, held);
        clearing.join().unwrap();
        drop(store);
        // Nothing cleared comes back with a restart: not the records evicted ahead either.
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(0..16)).count_ones(), 0);
        assert_eq!(h.present(&keys(100..105)).count_ones(), 5, "stored after the clear");
    }

    #[test]
    fn stores_behind_a_stuck_write_thread_fail_at_once_until_a_buffer_comes_back() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let mut h = harness(&store);
        // Every buffer is with the write thread, as behind a write that hangs, and a store has
        // waited its bound for one.
        let spare = take_every_buffer(&store);
        // The stores after it fail at once, each, not after waiting out `BUFFER_WAIT` in turn.
        let tasks: Vec<TaskId> = (0..3).map(|n| h.submit_store(&keys(n..n + 1))).collect();
        let started = Instant::now();
        for task in tasks {
            match h.wait(task) {
                Completion::Stored { result: Err(TierError::Io(why)), .. } => {
                    assert!(why.contains("stuck"), "{why}");
                }
                _ => panic!("not a failed store"),
            }
        }
        assert!(started.elapsed() < BUFFER_WAIT, "they waited: {:?}", started.elapsed());
        // A buffer back, stores are written again, and wait for buffers again.
        give_back_buffers(&store, spare);
        h.store(&keys(10..20)).expect("stored once buffers are back");
        h.assert_loads(&keys(10..20));
        assert!(!store.shared.stuck.load(Ordering::SeqCst));
    }

    #[test]
    fn a_delete_marks_the_records_of_segments_evicted_ahead_of_stores_deleted() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        // A lookup evicts 5, 6 and 7 ahead of the three stores queued, whose segments stay
        // free, their records on disk, as the store closes before they run.
        let (held, _) = three_stores_queued(&store, &mut h);
        assert_eq!(h.present(&keys(0..16)).count_ones(), 8);
        // Not indexed, so not counted; still marked deleted on disk.
        assert_eq!(store.delete(&keys(5..7)), 0);
        close_before_the_queued_stores_run(&store, h, held);
        drop(store);
        // The keys deleted do not come back with a restart; the one evicted ahead and not
        // deleted does (its key's bytes), as do the chunks never evicted.
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(5..7)).count_ones(), 0, "deleted, back after a restart");
        assert_eq!(h.present(&keys(7..16)).count_ones(), 9);
        h.assert_loads(&keys(7..8));
    }

    /// Submits two loads of `READ_AHEAD` chunks each, from key `from`, and checks that both
    /// complete whole, before any store.
    fn two_loads_complete_before_the_store(
        h: &tierkv_testkit::contract::Harness,
        completions: &Receiver<Completion>,
        from: u64,
    ) {
        use tierkv_testkit::contract::keys;

        let first = h.submit_load(&keys(from..from + READ_AHEAD));
        let second = h.submit_load(&keys(from + READ_AHEAD..from + 2 * READ_AHEAD));
        for _ in 0..2 {
            match completions.recv_timeout(DEADLINE).expect("nothing completed") {
                Completion::Loaded { task, loaded, mut sinks } => {
                    assert!(task == first || task == second);
                    assert_loaded_whole(&loaded, &mut sinks);
                }
                Completion::Stored { .. } => panic!("a store completed before the loads"),
                _ => panic!("not a load completion"),
            }
        }
    }

    /// A 4 KiB chunk that cannot be read (a device error).
    struct Unreadable;

    impl tierkv_core::ChunkSource for Unreadable {
        fn len(&self) -> u64 {
            4096
        }
        fn copy_to_host(&self, _: &mut [u8]) -> Result<(), tierkv_core::BufferError> {
            Err(tierkv_core::BufferError::Device("the device fell off the bus".into()))
        }
    }

    #[test]
    fn a_task_that_publishes_nothing_still_ends_the_stale_records_behind_its_first_record() {
        use tierkv_testkit::contract::{key, payload};

        let dir = tempfile::tempdir().unwrap();
        let (store, mut h) = with_a_stale_record_in_the_active_segment(dir.path(), 16);
        let active = store.shared.index.lock().active.unwrap();
        // The task's first record begins the active segment's next life and is written; its
        // second cannot be read, so the task publishes nothing.
        let good = tierkv_core::VecChunk(payload(&key(200), 4096));
        let task = store.submit_store(vec![
            StoreItem { key: key(200), source: Box::new(good) },
            StoreItem { key: key(201), source: Box::new(Unreadable) },
        ]);
        match h.wait(task) {
            Completion::Stored { result, .. } => assert!(result.is_err()),
            _ => panic!("not a store completion"),
        }
        // The write thread completes the task once it has abandoned it.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let index = store.shared.index.lock();
            let segment = &index.segments[active as usize];
            if segment.stale.is_empty() && !segment.superseding {
                break;
            }
            drop(index);
            assert!(Instant::now() < deadline, "left stale, and no delete can mark them");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A store of `segments` segments full, one chunk each (keys from 0), and then a store that
    /// evicts the oldest chunk for its segment, opens it and fails: its source cannot be read (a
    /// device error), so nothing is written. Key 0's record is left stale in the active segment.
    fn with_a_stale_record_in_the_active_segment(
        dir: &Path,
        segments: u64,
    ) -> (Arc<DiskStore>, tierkv_testkit::contract::Harness) {
        with_a_stale_record_in_the_active_segment_syncing(dir, segments, FsyncPolicy::Always)
    }

    /// [`with_a_stale_record_in_the_active_segment`] under another fsync policy.
    fn with_a_stale_record_in_the_active_segment_syncing(
        dir: &Path,
        segments: u64,
        fsync: FsyncPolicy,
    ) -> (Arc<DiskStore>, tierkv_testkit::contract::Harness) {
        use tierkv_testkit::contract::keys;

        let store = lru_store_syncing(dir, segments, fsync);
        let mut h = harness(&store);
        for n in 0..segments {
            h.store(&keys(n..n + 1)).unwrap();
        }
        let key = tierkv_testkit::contract::key(100);
        let task = store.submit_store(vec![StoreItem { key, source: Box::new(Unreadable) }]);
        match h.wait(task) {
            Completion::Stored { result, .. } => assert!(result.is_err()),
            _ => panic!("not a store completion"),
        }
        assert_eq!(h.present(&keys(0..segments)).count_ones(), segments as usize - 1);
        (store, h)
    }

    #[test]
    fn a_clear_marks_the_records_of_a_segment_whose_store_failed_before_writing_them_deleted() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let (store, h) = with_a_stale_record_in_the_active_segment(dir.path(), 16);
        store.clear();
        drop((h, store));
        // The chunk evicted comes back with a restart no more than those cleared.
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(0..16)).count_ones(), 0);
    }

    #[test]
    fn a_store_that_fails_after_handing_records_over_completes_once_they_are_marked() {
        use tierkv_testkit::contract::{key, payload};

        let dir = tempfile::tempdir().unwrap();
        let killed = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let completions = store.completions();
        // Key 0's record is handed over and its write held; the next source cannot be read, so
        // the task fails with key 0's record on its way.
        let held = store.shared.faults.hold_writes();
        let good = tierkv_core::VecChunk(payload(&key(0), 4096));
        let task = store.submit_store(vec![
            StoreItem { key: key(0), source: Box::new(good) },
            StoreItem { key: key(1), source: Box::new(Unreadable) },
        ]);
        store.shared.faults.writes.wait_for(1);
        // Told of the failure now, a caller could delete key 0 (nothing indexed to mark), the
        // write land and a kill follow before the record is marked: key 0 back.
        assert!(
            completions.recv_timeout(Duration::from_millis(300)).is_err(),
            "the store completed before the record it wrote was marked"
        );
        drop(held);
        let done = completions.recv_timeout(DEADLINE).expect("the store never completed");
        failed_with_its_sources(done, task, 2, "source could not be read");
        assert_eq!(store.delete(&[key(0)]), 0, "nothing indexed");
        copy_segment_files(dir.path(), killed.path());
        drop(store);
        let store = small_store(killed.path());
        let mut h = harness(&store);
        assert_eq!(h.present(&[key(0)]).count_ones(), 0, "deleted, back after a kill");
    }

    /// Runs `f` with every mark of a record deleted failing (`WriteFaults::failing_marks`).
    fn with_marks_failing<T>(store: &DiskStore, f: impl FnOnce() -> T) -> T {
        store.shared.faults.failing_marks.store(true, Ordering::SeqCst);
        let out = f();
        store.shared.faults.failing_marks.store(false, Ordering::SeqCst);
        out
    }

    /// Stores keys 0 and 1, makes a load of key 0 fail with `fail` (a miss, the record left on
    /// disk), clears the store, and checks that no key comes back with a restart.
    fn a_key_whose_load_failed_stays_cleared(
        fail: impl FnOnce(&Arc<DiskStore>, &mut tierkv_testkit::contract::Harness, Loc),
    ) {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let mut h = harness(&store);
        h.store(&keys(0..2)).unwrap();
        let loc = store.shared.index.lock().map[&keys(0..1)[0]];
        fail(&store, &mut h, loc);
        assert_eq!(h.present(&keys(0..2)).count_ones(), 1, "the failed record left the index");
        store.clear();
        drop((h, store));
        let store = small_store(dir.path());
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(0..2)).count_ones(), 0, "cleared, back after a restart");
    }

    #[test]
    fn a_record_whose_read_failed_is_marked_by_a_later_clear() {
        a_key_whose_load_failed_stays_cleared(|store, h, _| {
            store.shared.faults.failing_reads.store(true, Ordering::SeqCst);
            let loaded = h.load(&tierkv_testkit::contract::keys(0..1)).0;
            store.shared.faults.failing_reads.store(false, Ordering::SeqCst);
            assert_eq!(loaded.count_ones(), 0, "a read that fails is a miss");
        });
    }

    #[test]
    fn a_damaged_record_whose_mark_failed_is_marked_by_a_later_clear() {
        use std::os::unix::fs::FileExt;

        a_key_whose_load_failed_stays_cleared(|store, h, loc| {
            let path =
                file_path(&store.shared.config.dir, store.shared.layout.file_of(loc.segment));
            let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            file.write_all_at(&[0x5a], loc.offset + BLOCK).unwrap();
            file.sync_all().unwrap();
            let loaded =
                with_marks_failing(store, || h.load(&tierkv_testkit::contract::keys(0..1)).0);
            assert_eq!(loaded.count_ones(), 0, "a damaged record is a miss");
        });
    }

    #[test]
    fn a_mark_whose_sync_failed_is_written_again_by_the_next_clear() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let mut h = harness(&store);
        h.store(&keys(0..2)).unwrap();
        let faults = &store.shared.faults;
        faults.failing_mark_syncs.store(true, Ordering::SeqCst);
        assert_eq!(store.delete(&keys(0..1)), 1);
        faults.failing_mark_syncs.store(false, Ordering::SeqCst);
        let tried = faults.marks_tried.load(Ordering::SeqCst);
        store.clear();
        // Key 1's record, indexed, and key 0's, whose mark a power loss could still undo.
        assert_eq!(faults.marks_tried.load(Ordering::SeqCst) - tried, 2);
        assert!(store.shared.index.lock().stale.is_empty(), "both marks settled");
    }

    #[test]
    fn a_failed_tasks_record_whose_mark_failed_is_marked_by_a_later_delete() {
        use tierkv_testkit::contract::{key, payload};

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let mut h = harness(&store);
        // Key 0's record is written; the task fails on the next source, and the mark of key 0's
        // record (`mark_unpublished`) fails.
        let good = tierkv_core::VecChunk(payload(&key(0), 4096));
        let task = with_marks_failing(&store, || {
            let task = store.submit_store(vec![
                StoreItem { key: key(0), source: Box::new(good) },
                StoreItem { key: key(1), source: Box::new(Unreadable) },
            ]);
            h.wait(task)
        });
        match task {
            Completion::Stored { result, .. } => assert!(result.is_err()),
            _ => panic!("not a store completion"),
        }
        assert_eq!(store.delete(&[key(0)]), 0, "nothing indexed");
        drop((h, store));
        let store = small_store(dir.path());
        let mut h = harness(&store);
        assert_eq!(h.present(&[key(0)]).count_ones(), 0, "deleted, back after a restart");
    }

    #[test]
    fn a_replaced_record_whose_mark_failed_is_marked_by_a_later_delete() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let mut h = harness(&store);
        h.store(&keys(0..1)).unwrap();
        drop((h, store));
        // After a restart key 0's record is vouched for by the scan only: a store of the key
        // replaces it, and the mark of the record replaced fails.
        let store = small_store(dir.path());
        let mut h = harness(&store);
        with_marks_failing(&store, || h.store(&keys(0..1))).unwrap();
        assert_eq!(store.delete(&keys(0..1)), 1);
        drop((h, store));
        let store = small_store(dir.path());
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(0..1)).count_ones(), 0, "deleted, back after a restart");
    }

    #[test]
    fn a_record_whose_delete_mark_failed_is_marked_by_the_next_clear() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let mut h = harness(&store);
        h.store(&keys(0..2)).unwrap();
        assert_eq!(with_marks_failing(&store, || store.delete(&keys(0..1))), 1);
        store.clear();
        drop((h, store));
        let store = small_store(dir.path());
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(0..2)).count_ones(), 0, "deleted, back after a restart");
    }

    #[test]
    fn a_lifes_own_unmarked_record_stays_stale_when_its_first_record_ends_the_earlier_ones() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let (store, h, _) = with_a_first_record_not_yet_synced_over_a_stale_one(dir.path());
        // Key 200's record begins its segment's life over key 0's stale record. Its delete's mark
        // fails, and the sync of its life (the delete's own, then the flusher's) ends the
        // earlier life's records: not key 200's, of this life.
        assert_eq!(with_marks_failing(&store, || store.delete(&keys(200..201))), 1);
        store.shared.sync_dirty();
        store.delete(&keys(200..201));
        drop((h, store));
        let store = lru_store_syncing(dir.path(), 16, RARE_SYNCS);
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(200..201)).count_ones(), 0, "deleted, back after a restart");
    }

    #[test]
    fn a_record_whose_write_failed_part_way_is_marked_deleted() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let mut h = harness(&store);
        // The disk fails writing key 0's record after its header landed: the task fails, and
        // the header must not let a restart find the key.
        store.shared.faults.torn_write.store(true, Ordering::SeqCst);
        assert!(h.store(&keys(0..1)).is_err());
        assert!(!store.shared.faults.torn_write.load(Ordering::SeqCst), "the fault fired");
        drop((h, store));
        let store = small_store(dir.path());
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(0..1)).count_ones(), 0, "a torn record of a failed store found");
    }

    #[test]
    fn a_failed_task_marks_only_the_records_it_wrote() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let mut h = harness(&store);
        // The write thread panics once key 0's record has gone to a writer: the task fails, and
        // its later records are skipped, never written. Only key 0's record needs a mark.
        store.shared.faults.handed_over.store(true, Ordering::SeqCst);
        let tried = store.shared.faults.marks_tried.load(Ordering::SeqCst);
        assert!(h.store(&keys(0..3)).is_err());
        assert!(!store.shared.faults.handed_over.load(Ordering::SeqCst), "the fault fired");
        assert_eq!(store.shared.faults.marks_tried.load(Ordering::SeqCst) - tried, 1);
        drop((h, store));
        let store = small_store(dir.path());
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(0..3)).count_ones(), 0, "a failed store's record found");
    }

    /// Holds back the stores queued on `store` from the I/O threads while `f` runs (as if one
    /// were being prepared), then lets them go.
    fn with_stores_held<T>(store: &DiskStore, f: impl FnOnce() -> T) -> T {
        store.shared.queue.state.lock().storing = true;
        let out = f();
        store.shared.queue.stored(0);
        out
    }

    #[test]
    fn a_lookup_makes_no_room_ahead_of_stores_that_will_fail_at_once() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        for n in 0..16 {
            h.store(&keys(n..n + 1)).unwrap();
        }
        let spare = take_every_buffer(&store);
        let tasks = with_stores_held(&store, || {
            let tasks: Vec<TaskId> = (100..103).map(|n| h.submit_store(&keys(n..n + 1))).collect();
            // The write thread is stuck: the stores will fail at once, taking no room, so a
            // lookup ahead of them evicts nothing for them.
            assert_eq!(h.present(&keys(0..16)).count_ones(), 16);
            tasks
        });
        for task in tasks {
            match h.wait(task) {
                Completion::Stored { result: Err(TierError::Io(why)), .. } => {
                    assert!(why.contains("stuck"), "{why}");
                }
                _ => panic!("not a failed store"),
            }
        }
        assert_eq!(h.present(&keys(0..16)).count_ones(), 16, "nor did they");
        give_back_buffers(&store, spare);
        h.store(&keys(100..101)).unwrap();
        assert_eq!(h.present(&keys(0..16)).count_ones(), 15);
    }

    #[test]
    fn a_lookup_ahead_of_a_store_keeps_the_segments_of_its_keys_present() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        for n in 0..16 {
            h.store(&keys(n..n + 1)).unwrap();
        }
        // A store of the oldest chunk, present, and a new one: it keeps the oldest and evicts
        // the next for the new one. A lookup ahead of it finds the same.
        let behind = (0..1).chain(2..16).collect::<Vec<_>>();
        let task = with_stores_held(&store, || {
            let mut both = keys(0..1);
            both.extend(keys(100..101));
            let task = h.submit_store(&both);
            let found = h.present(&keys(0..16));
            assert_eq!(found.iter_ones().collect::<Vec<_>>(), behind);
            task
        });
        match h.wait(task) {
            Completion::Stored { result, .. } => result.expect("the store failed"),
            _ => panic!("not a store completion"),
        }
        let found = h.present(&keys(0..16));
        assert_eq!(found.iter_ones().collect::<Vec<_>>(), behind);
        assert_eq!(h.present(&keys(100..101)).count_ones(), 1);
    }

    /// Takes every record buffer from the writer and leaves it stuck, as behind a write that
    /// hangs; returns the buffers.
    fn take_every_buffer(store: &DiskStore) -> Vec<AlignedBuf> {
        let mut writer = store.shared.writer.lock();
        let mut spare = std::mem::take(&mut writer.spare);
        loop {
            writer.out = RECORD_BUFFERS;
            match store.shared.free_buffer_within(&mut writer, Duration::from_millis(20)) {
                Ok(buf) => spare.push(buf),
                Err(_) => break spare,
            }
        }
    }

    /// Gives the writer back the buffers `take_every_buffer` took.
    fn give_back_buffers(store: &DiskStore, spare: Vec<AlignedBuf>) {
        let mut writer = store.shared.writer.lock();
        writer.out = 0;
        writer.spare = spare;
    }

    #[test]
    fn loads_past_their_turn_do_not_wait_for_a_store_stalled_behind_a_write() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let completions = store.completions();
        let mut h = harness(&store);
        h.store(&keys(0..16)).unwrap();
        // The first stores take every record buffer; the next waits for one, as behind a write
        // that hangs, until `BUFFER_WAIT`.
        let held = store.shared.faults.hold_writes();
        let stores = RECORD_BUFFERS as u64 + 1;
        for i in 0..stores {
            h.submit_store(&keys(100 + i..101 + i));
        }
        while !{
            let queue = store.shared.queue.state.lock();
            queue.stores.is_empty() && queue.storing
        } {
            std::thread::yield_now();
        }
        // The second load is past the loads' turn, and waits for the store only until it has
        // waited `TURN_WAIT`, not until its wait runs out.
        two_loads_complete_before_the_store(&h, &completions, 0);
        release_held_stores(held, &completions, &mut h, stores);
    }

    /// Copies the segment files of `from` into `to`: what a kill -9 now leaves on disk.
    fn copy_segment_files(from: &Path, to: &Path) {
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name();
            if name.to_str().unwrap().starts_with("seg") {
                std::fs::copy(entry.path(), to.join(name)).unwrap();
            }
        }
    }

    #[test]
    fn a_delete_of_a_stale_record_waits_for_the_first_record_on_its_way_that_ends_it() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let killed = tempfile::tempdir().unwrap();
        let (store, mut h) = with_a_stale_record_in_the_active_segment(dir.path(), 16);
        // The next store reuses the active segment: its first record, which ends key 0's stale
        // record, is handed over and held.
        let held = store.shared.faults.hold_writes();
        let task = h.submit_store(&keys(200..201));
        store.shared.faults.writes.wait_for(1);
        // The delete cannot mark the record (the mark could land on the first record); it must
        // not return before the first record is on disk either, or a kill then undoes it.
        let deleting = std::thread::spawn({
            let store = Arc::clone(&store);
            let (from, to) = (dir.path().to_owned(), killed.path().to_owned());
            move || {
                store.delete(&keys(0..1));
                copy_segment_files(&from, &to);
            }
        });
        std::thread::sleep(Duration::from_millis(200));
        drop(held);
        deleting.join().unwrap();
        match h.wait(task) {
            Completion::Stored { result, .. } => result.unwrap(),
            _ => panic!("not a store completion"),
        }
        drop((h, store));
        let store = lru_store(killed.path(), 16);
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(0..1)).count_ones(), 0, "deleted, back after a kill");
    }

    #[test]
    fn the_first_record_of_a_segments_next_life_ends_its_stale_records() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let (store, mut h) = with_a_stale_record_in_the_active_segment(dir.path(), 16);
        let active = store.shared.index.lock().active.unwrap();
        assert_eq!(store.shared.index.lock().segments[active as usize].stale.len(), 1);
        h.store(&keys(200..201)).unwrap();
        let index = store.shared.index.lock();
        assert!(index.segments[active as usize].stale.is_empty());
        assert!(!index.segments[active as usize].superseding);
        assert!(index.stale.is_empty());
    }

    /// Periodic syncs far apart: none runs during a test.
    const RARE_SYNCS: FsyncPolicy = FsyncPolicy::Periodic(Duration::from_secs(3600));

    /// [`with_a_stale_record_in_the_active_segment`] under rare periodic syncs, then a store of
    /// key 200 that reuses the active segment: the first record of its next life is written,
    /// not synced, key 0's stale record behind it. Returns the store, its harness and the
    /// segment.
    fn with_a_first_record_not_yet_synced_over_a_stale_one(
        dir: &Path,
    ) -> (Arc<DiskStore>, tierkv_testkit::contract::Harness, u32) {
        let (store, mut h) = with_a_stale_record_in_the_active_segment_syncing(dir, 16, RARE_SYNCS);
        let active = store.shared.index.lock().active.unwrap();
        // Written with no sync of its own (one a record would make `periodic` sync nearly every
        // store).
        h.store(&tierkv_testkit::contract::keys(200..201)).unwrap();
        {
            let index = store.shared.index.lock();
            let segment = &index.segments[active as usize];
            assert!(!segment.stale.is_empty() && segment.superseding);
            assert_eq!(segment.unsynced, Some(segment.epoch));
        }
        (store, h, active)
    }

    #[test]
    fn under_periodic_syncs_a_reused_segment_waits_for_the_flusher_to_end_its_stale_records() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _h, active) = with_a_first_record_not_yet_synced_over_a_stale_one(dir.path());
        // The flusher's sync ends the stale records behind the first record.
        store.shared.sync_dirty();
        let index = store.shared.index.lock();
        assert!(index.segments[active as usize].stale.is_empty());
        assert!(!index.segments[active as usize].superseding);
        assert!(index.stale.is_empty());
    }

    #[test]
    fn a_delete_of_a_stale_record_behind_a_first_record_not_yet_synced_syncs_it() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let (store, h, active) = with_a_first_record_not_yet_synced_over_a_stale_one(dir.path());
        // Key 0's record cannot be marked (the segment's next life began over it), and a power
        // loss before the next periodic sync would bring it back: the delete syncs the file.
        let syncs = life_syncs(&store);
        store.delete(&keys(0..1));
        assert_eq!(life_syncs(&store), syncs + 1);
        let index = store.shared.index.lock();
        let segment = &index.segments[active as usize];
        assert_eq!(segment.unsynced, None, "left to a power loss");
        assert!(segment.stale.is_empty());
        assert!(!segment.superseding);
        drop(index);
        drop(h);
    }

    #[test]
    fn a_delete_syncs_a_first_record_over_its_key_even_once_its_life_was_evicted() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let (store, h, active) = with_an_unsynced_life_evicted_over_a_stale_record(dir.path());
        // A mark of key 0 finds key 200's record over it: that settles it only once key 200's
        // life is on disk for good, so the delete syncs it first.
        let syncs = life_syncs(&store);
        store.delete(&keys(0..1));
        assert_eq!(life_syncs(&store), syncs + 1);
        let index = store.shared.index.lock();
        let segment = &index.segments[active as usize];
        assert_eq!(segment.unsynced, None, "settled while a power loss could bring it back");
        assert!(segment.stale.iter().all(|(_, key, _)| *key != keys(0..1)[0]));
        drop(index);
        drop(h);
    }

    /// [`with_a_first_record_not_yet_synced_over_a_stale_one`], then a store that seals the
    /// segment, and its life evicted before any sync (ahead of stores, as a lookup does): key
    /// 200's record joins key 0's among the stale ones, and the life stays unsynced.
    fn with_an_unsynced_life_evicted_over_a_stale_record(
        dir: &Path,
    ) -> (Arc<DiskStore>, tierkv_testkit::contract::Harness, u32) {
        let (store, mut h, active) = with_a_first_record_not_yet_synced_over_a_stale_one(dir);
        h.store(&tierkv_testkit::contract::keys(201..202)).unwrap();
        {
            let mut index = store.shared.index.lock();
            while !index.segments[active as usize].keys.is_empty() {
                index.evict_one().unwrap();
            }
            let segment = &index.segments[active as usize];
            assert!(!segment.superseding);
            assert_eq!(segment.stale.len(), 2);
            assert!(segment.unsynced.is_some());
        }
        (store, h, active)
    }

    fn life_syncs(store: &DiskStore) -> u64 {
        store.shared.faults.life_syncs.load(Ordering::SeqCst)
    }

    #[test]
    fn after_a_failed_sync_of_a_life_no_mark_is_settled_against_it_and_no_sync_trusted() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let (store, h, active) = with_an_unsynced_life_evicted_over_a_stale_record(dir.path());
        let key0 = keys(0..1)[0];
        let unmarked = |store: &DiskStore| {
            let index = store.shared.index.lock();
            let segment = &index.segments[active as usize];
            segment.unsynced.is_some() && segment.stale.iter().any(|(_, key, _)| *key == key0)
        };
        store.shared.faults.failing_syncs.store(true, Ordering::SeqCst);
        store.delete(&keys(0..1));
        assert!(unmarked(&store), "settled against a life whose sync failed");
        // A later sync could report clean without the pages on disk: none is tried for it.
        store.shared.faults.failing_syncs.store(false, Ordering::SeqCst);
        store.shared.sync_dirty();
        assert!(unmarked(&store), "the flusher trusted a sync after a failed one");
        let syncs = life_syncs(&store);
        store.delete(&keys(0..1));
        assert_eq!(life_syncs(&store), syncs, "the delete tried the sync again");
        assert!(unmarked(&store));
        drop(h);
    }

    #[test]
    fn a_store_waits_for_the_marks_of_its_segments_stale_records_without_holding_loads() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let (store, h) = with_a_stale_record_in_the_active_segment(dir.path(), 24);
        let completions = store.completions();
        // A delete marks key 0's stale record, held as behind a disk that hangs.
        let marks = store.shared.faults.marks.hold();
        let deleting = std::thread::spawn({
            let store = Arc::clone(&store);
            move || store.delete(&keys(0..1))
        });
        store.shared.faults.marks.wait_for(1);
        // The next store reuses the active segment: its first record waits for the mark.
        let task = h.submit_store(&keys(200..201));
        while !store.shared.queue.state.lock().storing {
            assert!(completions.try_recv().is_err(), "a first record written under a mark");
            std::thread::yield_now();
        }
        // The second load is past the loads' turn, and waits for the store only until it has
        // waited `TURN_WAIT`; the store writes nothing while the mark is held.
        two_loads_complete_before_the_store(&h, &completions, 1);
        assert!(
            completions.recv_timeout(Duration::from_millis(200)).is_err(),
            "a first record written under a mark"
        );
        drop(marks);
        deleting.join().unwrap();
        match completions.recv_timeout(DEADLINE).expect("the store never completed") {
            Completion::Stored { task: done, result, .. } => {
                assert_eq!(done, task);
                result.expect("the store failed");
            }
            _ => panic!("not a store completion"),
        }
        drop((h, store));
        let store = lru_store(dir.path(), 24);
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(0..1)).count_ones(), 0, "deleted, back after a restart");
        assert_eq!(h.present(&keys(200..201)).count_ones(), 1);
    }

    #[test]
    fn a_panic_collecting_the_first_write_of_a_life_leaves_no_delete_waiting_for_it() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let (store, mut h) = with_a_stale_record_in_the_active_segment(dir.path(), 16);
        let active = store.shared.index.lock().active.unwrap();
        // The next store's first record, which would end key 0's stale record, is written, and
        // the write thread panics collecting it: its outcome is lost, and the task fails.
        store.shared.faults.collecting.store(true, Ordering::SeqCst);
        assert!(h.store(&keys(200..201)).is_err());
        assert!(!store.shared.faults.collecting.load(Ordering::SeqCst), "the fault fired");
        // A delete or a clear of key 0 must not wait for that write any more (up to
        // `BUFFER_WAIT` each, until the segment is evicted again).
        let index = store.shared.index.lock();
        let segment = &index.segments[active as usize];
        assert!(
            !segment.waits_to_end_stale(),
            "a delete of its stale records waits for a write that is over"
        );
    }

    #[test]
    fn a_panic_handing_over_the_first_record_of_a_life_leaves_no_delete_waiting_for_it() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let (store, mut h) = with_a_stale_record_in_the_active_segment(dir.path(), 16);
        let active = store.shared.index.lock().active.unwrap();
        // The next store's first record, which would end key 0's stale record, is never
        // written: the write thread panics handing it over, and the task fails.
        store.shared.faults.handing_over.store(true, Ordering::SeqCst);
        assert!(h.store(&keys(200..201)).is_err());
        assert!(!store.shared.faults.handing_over.load(Ordering::SeqCst), "the fault fired");
        // The life's writes are over: a delete of key 0 marks it, and waits for nothing.
        let waits = store.shared.index.lock().segments[active as usize].waits_to_end_stale();
        assert!(!waits, "a delete of its stale records waits for a write that never comes");
        store.delete(&keys(0..1));
        drop((h, store));
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(0..1)).count_ones(), 0, "deleted, back after a restart");
    }

    #[test]
    fn a_segment_whose_failed_seal_panicked_ends_its_unwritten_life_when_sealed_later() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let (store, mut h) = with_a_stale_record_in_the_active_segment(dir.path(), 16);
        let active = store.shared.index.lock().active.unwrap();
        // The first record of the active segment's next life is lost to a panic collecting it,
        // and sealing the segment for it panics too: it stays active.
        store.shared.faults.collecting.store(true, Ordering::SeqCst);
        store.shared.faults.sealing_failed.store(true, Ordering::SeqCst);
        assert!(h.store(&keys(200..201)).is_err());
        assert!(!store.shared.faults.sealing_failed.load(Ordering::SeqCst), "the fault fired");
        assert_eq!(store.shared.index.lock().segments[active as usize].status, Status::Active);
        // The next store finds it full and seals it: its life's writes are over.
        h.store(&keys(201..202)).unwrap();
        let index = store.shared.index.lock();
        let segment = &index.segments[active as usize];
        assert_eq!(segment.status, Status::Sealed);
        assert!(
            !segment.waits_to_end_stale(),
            "a delete of its stale records waits for a write that never comes"
        );
    }

    #[test]
    fn a_record_is_unpublished_from_the_moment_the_write_thread_has_it() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = small_store(dir.path());
        let h = harness(&store);
        // The write thread may write (or fail) the record before the store goes on: a life
        // whose first record failed must not count as over (`end_unwritten_life`) meanwhile.
        let sent = store.shared.faults.sent.hold();
        let task = h.submit_store(&keys(0..1));
        store.shared.faults.sent.wait_for(1);
        let unpublished: u64 =
            store.shared.index.lock().segments.iter().map(|segment| segment.unpublished).sum();
        drop(sent);
        assert_eq!(unpublished, 1, "a record with the write thread not counted unpublished");
        match store.completions().recv_timeout(DEADLINE).expect("the store never completed") {
            Completion::Stored { task: done, result, .. } => {
                assert_eq!(done, task);
                result.unwrap();
            }
            _ => panic!("not a store completion"),
        }
    }

    #[test]
    fn a_delete_reaches_the_stale_records_behind_a_first_record_never_written() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        for n in 0..16 {
            h.store(&keys(n..n + 1)).unwrap();
        }
        // A task of two records, each the first of a new life of the segment evicted for it
        // (key 0's, then key 1's). The write thread panics once the first is handed over: the
        // task fails, and its second record is skipped, never written, key 1's record left
        // stale behind it under the segment's old superblock.
        store.shared.faults.handed_over.store(true, Ordering::SeqCst);
        assert!(h.store(&keys(200..202)).is_err());
        assert!(!store.shared.faults.handed_over.load(Ordering::SeqCst), "the fault fired");
        // The task is over, and nothing more of that life will be written: a delete of key 1
        // reaches its record.
        assert_eq!(store.delete(&keys(1..2)), 0, "not indexed, so not counted");
        drop((h, store));
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(1..2)).count_ones(), 0, "deleted, back after a restart");
    }

    #[test]
    fn a_delete_waits_for_the_writes_of_a_life_whose_first_record_was_never_written() {
        use tierkv_testkit::contract::{key, keys};

        let dir = tempfile::tempdir().unwrap();
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        for n in 0..16 {
            h.store(&keys(n..n + 1)).unwrap();
        }
        // As above, but the first record's write is held: its task cannot end, and the second
        // record, skipped, leaves key 1's record stale behind it while the life's writes are
        // not over.
        let held = store.shared.faults.hold_writes();
        store.shared.faults.handed_over.store(true, Ordering::SeqCst);
        let task = h.submit_store(&keys(200..202));
        let skipped = |index: &Index| {
            index.stale.iter().any(|&id| {
                let segment = &index.segments[id as usize];
                segment.stale.iter().any(|(_, k, _)| *k == key(1))
                    && segment.superseding
                    && segment.unsuperseded
            })
        };
        while !skipped(&store.shared.index.lock()) {
            std::thread::yield_now();
        }
        // A delete of key 1 now must not return without reaching its record.
        let deleting = std::thread::spawn({
            let store = Arc::clone(&store);
            move || store.delete(&keys(1..2))
        });
        std::thread::sleep(Duration::from_millis(200));
        drop(held);
        deleting.join().unwrap();
        match h.wait(task) {
            Completion::Stored { result, .. } => assert!(result.is_err()),
            _ => panic!("not a store completion"),
        }
        drop((h, store));
        let store = lru_store(dir.path(), 16);
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(1..2)).count_ones(), 0, "deleted, back after a restart");
    }

    #[test]
    fn a_second_copy_of_a_key_found_by_a_restart_is_deleted_with_it() {
        use tierkv_testkit::contract::{key, keys};

        let dir = tempfile::tempdir().unwrap();
        let open = |dir: &Path| {
            let segment_bytes = BLOCK + 2 * record_bytes(4096);
            let config = DiskStoreConfig {
                segment_bytes,
                policy: PolicyKind::Lru,
                ..DiskStoreConfig::new(dir, 8 * segment_bytes, 4096)
            };
            Arc::new(DiskStore::open(config).unwrap())
        };
        let store = open(dir.path());
        let mut h = harness(&store);
        // Keys 0 and 1 fill a segment; key 2 begins the next, which has room for one more.
        h.store(&keys(0..2)).unwrap();
        h.store(&keys(2..3)).unwrap();
        // Key 0's segment evicted ahead of the stores (as a lookup does) and not reused: its
        // record stays on disk. Stored again, key 0 lands in the room left beside key 2.
        {
            let mut index = store.shared.index.lock();
            while index.map.contains_key(&key(0)) {
                index.evict_one().unwrap();
            }
        }
        h.store(&keys(0..1)).unwrap();
        drop((h, store));
        // The restart finds both copies; a delete of the key must reach both.
        let store = open(dir.path());
        store.delete(&keys(0..1));
        drop(store);
        let store = open(dir.path());
        let mut h = harness(&store);
        assert_eq!(h.present(&keys(0..1)).count_ones(), 0, "deleted, its second copy back");
        assert_eq!(h.present(&keys(2..3)).count_ones(), 1);
    }

    #[test]
    fn a_delete_waits_for_a_life_whose_first_record_failed_until_its_segment_is_sealed() {
        // The first record's write failed (`superseded`) and the write thread has yet to seal
        // the segment (`seal_failed`): a delete must wait, or it would leave the stale records
        // unmarked for good, the life ending after it.
        let mut segment = Segment::free();
        segment.status = Status::Active;
        segment.epoch = 7;
        segment.stale.push((3, tierkv_testkit::contract::key(0), Loc::written(0, BLOCK, 4096)));
        segment.superseding = true;
        segment.unsuperseded = true;
        segment.unpublished = 2;
        assert!(segment.waits_to_end_stale());
        assert!(!segment.end_unwritten_life());
        segment.status = Status::Sealed;
        assert!(segment.waits_to_end_stale(), "records of the life still unpublished");
        segment.unpublished = 0;
        assert!(segment.end_unwritten_life());
        assert!(!segment.waits_to_end_stale() && !segment.superseding);
        // A first record written, not yet synced, is no such life: its sync ends them.
        let mut written = Segment::free();
        written.status = Status::Sealed;
        written.epoch = 7;
        written.superseding = true;
        written.unsuperseded = true;
        written.unsynced = Some(7);
        assert!(!written.waits_to_end_stale());
        assert!(!written.end_unwritten_life());
    }

    #[test]
    fn a_delete_that_panics_marking_stale_records_leaves_their_segment_reusable() {
        use tierkv_testkit::contract::keys;

        let dir = tempfile::tempdir().unwrap();
        let (store, mut h) = with_a_stale_record_in_the_active_segment(dir.path(), 16);
        store.shared.faults.marking.store(true, Ordering::SeqCst);
        let deleted = catch_unwind(AssertUnwindSafe(|| store.delete(&keys(0..1))));
        assert!(deleted.is_err(), "the injected panic did not fire");
        // The next store reuses the active segment: no mark is left in progress to wait for.
        let active = store.shared.index.lock().active.unwrap();
        assert_eq!(store.shared.index.lock().segments[active as usize].marking, 0);
        h.store(&keys(200..201)).unwrap();
    }
}
