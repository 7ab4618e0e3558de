//! The contract every tier below L1 implements.
//!
//! Adapters are asynchronous and batched: a `submit_*` call queues work and returns a [`TaskId`]
//! at once; the outcome arrives later as a [`Completion`] on the adapter's channel, which the
//! controllers `select!` on together with their own queues. Buffers are owned: a store or load
//! takes the buffers and hands them back inside its completion, so no borrow is held across the
//! wait (what direct I/O and DMA engines need).

use crossbeam_channel::Receiver;

use crate::bitmap::Bitmap;
use crate::key::ObjectKey;

/// Identifies one submitted task of one adapter; unique for the adapter's lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskId(pub u64);

/// A copy into or out of a chunk buffer failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BufferError {
    /// The host slice and the buffer differ in length.
    #[error("buffer holds {buffer} bytes, the copy moves {copy}")]
    LengthMismatch {
        /// Bytes the buffer holds.
        buffer: u64,
        /// Bytes the copy tried to move.
        copy: u64,
    },
    /// The device refused the copy.
    #[error("device copy failed: {0}")]
    Device(String),
}

/// A chunk an adapter reads from while storing it (an L1 slot, usually on a GPU).
pub trait ChunkSource: Send {
    /// Bytes in the chunk.
    fn len(&self) -> u64;

    /// Whether the chunk holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies the whole chunk into `dst`, whose length must equal [`ChunkSource::len`].
    fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), BufferError>;

    /// The chunk's bytes, when they live in host memory and can be read in place.
    fn host_bytes(&self) -> Option<&[u8]> {
        None
    }

    /// Copies the whole chunk into `dst`: straight from its host bytes when it has them, else
    /// through [`ChunkSource::copy_to_host`].
    fn read_into(&self, dst: &mut [u8]) -> Result<(), BufferError> {
        match self.host_bytes() {
            Some(bytes) if bytes.len() == dst.len() => {
                dst.copy_from_slice(bytes);
                Ok(())
            }
            _ => self.copy_to_host(dst),
        }
    }

    /// Whether the chunk was withdrawn while it was on its way down: deleted by the tier it was
    /// evicted from (a demoted chunk), or cleared from the node (a write-back or hand-down
    /// victim of L1 when a `clear` ran). The tier below must then not keep it (it drops it before
    /// the write, or deletes it once written). A chunk stored from its source stays.
    fn withdrawn(&self) -> bool {
        false
    }
}

/// A chunk an adapter writes into while loading it (an L1 slot reserved for the load).
pub trait ChunkSink: Send {
    /// Bytes in the chunk.
    fn len(&self) -> u64;

    /// Whether the chunk holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fills the whole chunk from `src`, whose length must equal [`ChunkSink::len`].
    fn copy_from_host(&mut self, src: &[u8]) -> Result<(), BufferError>;

    /// The chunk's bytes, when they live in host memory and can be written in place (a read
    /// from disk can then land in them without a staging copy).
    fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        None
    }

    /// Fills the whole chunk from `src`: straight into its host bytes when it has them, else
    /// through [`ChunkSink::copy_from_host`].
    fn write_from(&mut self, src: &[u8]) -> Result<(), BufferError> {
        match self.host_bytes_mut() {
            Some(bytes) if bytes.len() == src.len() => {
                bytes.copy_from_slice(src);
                Ok(())
            }
            _ => self.copy_from_host(src),
        }
    }
}

/// A chunk in an owned host `Vec`: the buffer tests, staging copies and host-only callers use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VecChunk(pub Vec<u8>);

impl ChunkSource for VecChunk {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }

    fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), BufferError> {
        if dst.len() != self.0.len() {
            return Err(BufferError::LengthMismatch {
                buffer: self.0.len() as u64,
                copy: dst.len() as u64,
            });
        }
        dst.copy_from_slice(&self.0);
        Ok(())
    }

    fn host_bytes(&self) -> Option<&[u8]> {
        Some(&self.0)
    }
}

impl ChunkSink for VecChunk {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }

    fn copy_from_host(&mut self, src: &[u8]) -> Result<(), BufferError> {
        if src.len() != self.0.len() {
            return Err(BufferError::LengthMismatch {
                buffer: self.0.len() as u64,
                copy: src.len() as u64,
            });
        }
        self.0.copy_from_slice(src);
        Ok(())
    }

    fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        Some(&mut self.0)
    }
}

/// One key to store and the buffer its bytes come from.
pub struct StoreItem {
    /// The object's identity.
    pub key: ObjectKey,
    /// Where the bytes are read from.
    pub source: Box<dyn ChunkSource>,
}

/// One key to load and the buffer its bytes go to.
pub struct LoadItem {
    /// The object's identity.
    pub key: ObjectKey,
    /// Where the bytes are written to.
    pub sink: Box<dyn ChunkSink>,
}

/// Why a whole task failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    /// The adapter was closed before the task finished.
    #[error("tier is closed")]
    Closed,
    /// The submitter gave up on the task ([`TierAdapter::abandon`]) before it finished.
    #[error("the task was given up on")]
    Abandoned,
    /// The tier is full and nothing can be evicted.
    #[error("tier is full: {0}")]
    NoSpace(String),
    /// A chunk larger than the tier stores.
    #[error("a chunk of {bytes} bytes exceeds this tier's limit of {limit} bytes")]
    TooLarge {
        /// Bytes of the chunk.
        bytes: u64,
        /// The largest chunk the tier stores.
        limit: u64,
    },
    /// The operating system reported an error.
    #[error("I/O error: {0}")]
    Io(String),
    /// A buffer copy failed.
    #[error(transparent)]
    Buffer(#[from] BufferError),
}

/// The outcome of one task.
pub enum Completion {
    /// A store task finished: every key stored, or the task failed as a whole.
    Stored {
        /// The task.
        task: TaskId,
        /// Success, or why nothing of the task can be relied upon.
        result: Result<(), TierError>,
        /// The source buffers, handed back.
        sources: Vec<StoreItem>,
    },
    /// A lookup-and-lock task finished.
    LookedUp {
        /// The task.
        task: TaskId,
        /// Bit `i`: key `i` is present and locked against this tier's eviction until unlocked.
        locked: Bitmap,
    },
    /// A load task finished.
    Loaded {
        /// The task.
        task: TaskId,
        /// Bit `i`: `sinks[i]`'s key was copied whole into it. One bit per sink handed back.
        loaded: Bitmap,
        /// The sink buffers, handed back in the order they came (a sink lost to a panic is
        /// missing, and so is its bit).
        sinks: Vec<LoadItem>,
    },
}

impl Completion {
    /// The task this completion belongs to.
    pub fn task(&self) -> TaskId {
        match self {
            Completion::Stored { task, .. }
            | Completion::LookedUp { task, .. }
            | Completion::Loaded { task, .. } => *task,
        }
    }
}

/// How full a tier is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierUsage {
    /// Bytes the tier may hold.
    pub capacity_bytes: u64,
    /// Bytes held by stored objects.
    pub used_bytes: u64,
    /// Objects stored.
    pub objects: u64,
    /// Locks held by lookups and not yet returned (one per key per lookup): zero when every
    /// pipeline is idle, which the pipeline tests check.
    pub locks: u64,
}

/// A tier below L1: host memory, disk, later a remote store.
pub trait TierAdapter: Send + Sync {
    /// A short name for logs and metric labels ("l2", "disk").
    fn name(&self) -> &str;

    /// Queues a store of every item; one completion answers for the whole task.
    fn submit_store(&self, items: Vec<StoreItem>) -> TaskId;

    /// Queues a lookup that also locks every present key against this tier's eviction. It is
    /// the use a tier's eviction policy counts for each key found.
    fn submit_lookup_and_lock(&self, keys: Vec<ObjectKey>) -> TaskId;

    /// Queues a load of every item; absent keys are reported, the others still load. A load
    /// reads what a lookup locked and is part of that use: the policy does not count it again.
    fn submit_load(&self, items: Vec<LoadItem>) -> TaskId;

    /// Returns one lock per key taken by a lookup; keys never locked are ignored.
    ///
    /// A key locked by two lookups needs two unlocks. Storing a key that is already present
    /// succeeds without rewriting it: equal keys mean equal bytes.
    fn unlock(&self, keys: &[ObjectKey]);

    /// Deletes the keys that are not locked; returns how many were deleted.
    fn delete(&self, keys: &[ObjectKey]) -> usize;

    /// Deletes every object that is not locked; returns how many were deleted.
    fn clear(&self) -> usize;

    /// Current usage.
    fn usage(&self) -> TierUsage;

    /// The channel completions arrive on. It has one consumer: the controller that submits.
    fn completions(&self) -> Receiver<Completion>;

    /// Stops accepting work; tasks still queued complete as failures, none hangs.
    fn close(&self);

    /// The submitter has given up on store task `task` (it took longer than the submitter
    /// waits): what of it has not started need not be, so its sources go back sooner. The task
    /// still completes, once, as it would have or as [`TierError::Abandoned`]; a task already
    /// complete, or unknown, is ignored. The default ignores every task: its copies run on.
    fn abandon(&self, task: TaskId) {
        let _ = task;
    }

    /// Whether a chunk promoted from this tier into L1 stays cached there (until evicted) rather
    /// than being freed with its last reader: true for a tier whose loads are costly and shared
    /// (the remote tier), false (the default) for the local tiers, which keep their own copy.
    fn keep_promoted(&self) -> bool {
        false
    }
}
