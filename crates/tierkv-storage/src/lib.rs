//! tierkv-storage: the one API the daemon calls.
//!
//! It owns the [`StorageManager`], which wires L1, the host, disk and remote tiers, the prefetch
//! pipeline (lower-tier hits promoted into L1 leases), the store pipeline (finished writes, and
//! write-back victims, copied down by a [`StorePolicy`]) and a maintenance thread (lease expiry,
//! background eviction of L1 and L2, gauges). It keeps the record of every open lookup: which
//! lease holds which chunk of its hit, so a reader can read and release exactly its share.
//!
//! It does not speak any protocol, parse configuration files or export metrics: the daemon in
//! `tierkv-server` does, and hands it plain config structs.

mod config;
mod error;
mod lookup;
mod manager;
mod metrics;
mod reads;
mod store;

pub use config::{RemoteAdmission, StorageConfig, StorePolicy};
pub use error::StorageError;
pub use lookup::{HitChunk, LookupGroup, LookupId, LookupRequest, LookupResult};
pub use manager::{RESERVED_OWNERS, StorageManager, StorageStatus};
pub use metrics::LookupTotals;
pub use store::{Durability, StoreTicket};
pub use tierkv_prefetch::GroupKind;
