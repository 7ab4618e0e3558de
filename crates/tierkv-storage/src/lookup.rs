//! Lookups: what a worker asks for, and what the manager remembers of it until it is released.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use foldhash::HashMap;
use tierkv_core::{ExtraCount, Layout, ObjectKey};
use tierkv_l1::{LeaseId, OwnerId, ReadAccess};
use tierkv_prefetch::{GroupKind, HeldBelow, PrefetchError, RequestId};

use crate::StorageError;

/// Identifies a lookup; never reused within one manager.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LookupId(pub u64);

impl fmt::Display for LookupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// One KV-cache group of a lookup.
#[derive(Clone, Debug)]
pub struct LookupGroup {
    /// How the group attends (which chunks a hit needs).
    pub kind: GroupKind,
    /// The layout of the group's chunks.
    pub layout: Layout,
    /// The group's chunk keys, root first.
    pub keys: Vec<ObjectKey>,
}

/// What a worker asks for.
#[derive(Clone, Debug)]
pub struct LookupRequest {
    /// The client the leases belong to.
    pub owner: OwnerId,
    /// Readers beyond the first (TP ranks that read a shared object).
    pub extra: ExtraCount,
    /// Tokens per chunk, for sliding windows and token counts.
    pub chunk_tokens: u64,
    /// The groups; one full-attention group for an ordinary model.
    pub groups: Vec<LookupGroup>,
    /// Chunks of the hit held below L1 that the lookup may load into L1 slots; the rest stay in
    /// their tier and are read from there. `usize::MAX`: as many as L1 has room for.
    pub max_promoted: usize,
    /// Lease the L1 hits now and load nothing until the lookup is first queried, waited on or
    /// started ([`crate::StorageManager::start_prefetch`]). The lookups of one request's ranks
    /// (each rank its own copy of the KV) are all made first and started after: one rank's
    /// loads then evict nothing another rank's lookup leases.
    pub defer_prefetch: bool,
}

impl LookupRequest {
    /// A lookup of one full-attention group: the ordinary prefix lookup.
    pub fn prefix(owner: OwnerId, extra: ExtraCount, layout: Layout, keys: Vec<ObjectKey>) -> Self {
        LookupRequest {
            owner,
            extra,
            chunk_tokens: 1,
            groups: vec![LookupGroup { kind: GroupKind::FullAttention, layout, keys }],
            max_promoted: usize::MAX,
            defer_prefetch: false,
        }
    }
}

/// What a lookup found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LookupResult {
    /// The hit, in chunks: every group has what it needs before it.
    pub hit_chunks: usize,
    /// The hit, in tokens.
    pub hit_tokens: u64,
    /// Readers that must each return their share (`1 + extra_count`).
    pub readers: u32,
    /// Chunks of the hit served from L1, then from each lower tier (fastest first).
    pub per_tier: Vec<usize>,
}

/// A chunk of a lookup's hit, ready for one reader.
pub enum HitChunk {
    /// In L1, pinned for the read.
    L1(ReadAccess),
    /// Read from the lower tier that holds it (L1 had no room for it): the chunk's bytes, shared
    /// with the hit's other readers.
    Loaded(Arc<Vec<u8>>),
}

impl HitChunk {
    /// Bytes in the chunk.
    pub fn len(&self) -> u64 {
        match self {
            HitChunk::L1(access) => access.handle().len,
            HitChunk::Loaded(bytes) => bytes.len() as u64,
        }
    }

    /// Whether the chunk holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a lookup failed.
pub(crate) enum Failure {
    /// Deferred, and not started (by a query, a wait or `start_prefetch`) within
    /// `l1.lease_ttl`: the client's timing, not the tiers'.
    NotStarted,
    /// Its prefetch failed.
    Prefetch(PrefetchError),
}

impl Failure {
    /// The error a request about lookup `id` gets.
    pub(crate) fn error(&self, id: LookupId) -> StorageError {
        match self {
            Failure::NotStarted => StorageError::NotStarted(id),
            Failure::Prefetch(error) => StorageError::Prefetch(error.clone()),
        }
    }
}

/// Where a lookup stands.
pub(crate) enum Stage {
    /// Its L1 hits leased, its prefetch not started (`defer_prefetch`): started by the first
    /// query or wait, or failed if none comes by `expires` (clock time).
    Deferred { expires: Duration },
    /// Waiting for the prefetch pipeline.
    Prefetching(RequestId),
    /// Complete: which lease holds each key of the hit in L1; the chunks of the hit that L1 had
    /// no room for, held in their lower tier; and when those tier locks expire (clock time), as
    /// L1 leases do.
    Done {
        result: LookupResult,
        covered: HashMap<ObjectKey, LeaseId>,
        below: Option<Arc<HeldBelow>>,
        expires: Duration,
    },
    /// The prefetch failed, or never started; the L1 shares were returned. Kept, to tell why,
    /// until `expires`.
    Failed { why: Failure, expires: Duration },
}

pub(crate) struct Lookup {
    pub(crate) owner: OwnerId,
    pub(crate) request: LookupRequest,
    /// The lease of every L1 hit, in every group, taken before anything was reserved.
    pub(crate) l1_lease: Option<LeaseId>,
    pub(crate) in_l1: Vec<Vec<bool>>,
    pub(crate) stage: Stage,
    /// Readers that returned their share (bit `r`: reader `r`), whatever the hit held: the
    /// lookup's own ledger, so every reader of every lookup, an empty one included, returns
    /// exactly one share, and the lookup ends when the last reader has.
    pub(crate) returned: u128,
}
