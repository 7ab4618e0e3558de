//! Errors of the StorageManager.

use tierkv_core::ObjectKey;
use tierkv_disk::DiskError;
use tierkv_l1::L1Error;
use tierkv_l2::L2Error;
use tierkv_prefetch::{BelowError, PrefetchError};
use tierkv_remote::RemoteError;

use crate::lookup::LookupId;

/// Why a storage request was refused. A refused request changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The configuration cannot describe a store.
    #[error("invalid storage configuration: {0}")]
    Config(String),
    /// L1 refused.
    #[error(transparent)]
    L1(#[from] L1Error),
    /// The host tier could not be opened.
    #[error(transparent)]
    L2(#[from] L2Error),
    /// The disk tier could not be opened.
    #[error(transparent)]
    Disk(#[from] DiskError),
    /// The remote tier could not be opened.
    #[error(transparent)]
    Remote(#[from] RemoteError),
    /// The prefetch pipeline refused or failed.
    #[error(transparent)]
    Prefetch(#[from] PrefetchError),
    /// A chunk of the hit held in its lower tier could not be read from there.
    #[error("a chunk held below L1: {0}")]
    Below(#[from] BelowError),
    /// A thread could not be started.
    #[error("cannot start a storage thread: {0}")]
    Thread(#[from] std::io::Error),
    /// No lookup with this id is known (never made, or released and forgotten).
    #[error("unknown lookup {0}")]
    UnknownLookup(LookupId),
    /// The lookup holds no share of this key: not a hit, or not needed for the hit.
    #[error("lookup {lookup} holds no share of {key:?}")]
    NotCovered {
        /// The lookup.
        lookup: LookupId,
        /// The key.
        key: ObjectKey,
    },
    /// The lookup is still prefetching: its hit is not known yet.
    #[error("lookup {0} is still prefetching: wait for it (or query it) first")]
    Pending(LookupId),
    /// The lookup passed its deadline (`l1.lease_ttl` after it completed) holding chunks only in
    /// the lower tiers: its tier locks went back, and it is over.
    #[error("lookup {0} passed its deadline; its chunks held below L1 were let go")]
    Expired(LookupId),
    /// The lookup was deferred (`defer_prefetch`) and nobody started it (a query, a wait or
    /// `start_prefetch`) within `l1.lease_ttl`: its shares went back, and it is over.
    #[error(
        "lookup {0} was deferred and not started (query, wait or start) within l1.lease_ttl; \
         its shares went back"
    )]
    NotStarted(LookupId),
    /// The reader has already returned its share of the lookup.
    #[error("reader {reader} already returned its share of lookup {lookup}")]
    ShareReturned {
        /// The lookup.
        lookup: LookupId,
        /// The reader.
        reader: u8,
    },
    /// The lookup has no such reader.
    #[error("lookup {lookup} has {readers} readers; reader {reader} is not one of them")]
    NoSuchReader {
        /// The lookup.
        lookup: LookupId,
        /// The lowest reader named that the lookup does not have.
        reader: u8,
        /// Readers of the lookup.
        readers: u32,
    },
    /// Owners from `1 << 63` on belong to the storage layer's own pipelines.
    #[error("owner {0} is reserved for the storage layer's pipelines")]
    ReservedOwner(u64),
    /// The lookup request is malformed.
    #[error("invalid lookup: {0}")]
    Invalid(String),
    /// The manager is stopping or stopped.
    #[error("the storage manager is stopped")]
    Stopped,
}
