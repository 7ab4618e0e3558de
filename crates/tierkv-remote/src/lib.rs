//! tierkv-remote: the cross-node tier, on Redis Cluster (or Valkey, or one Redis server).
//!
//! It owns the [`RemoteStore`], a [`tierkv_core::TierAdapter`] whose objects live in a store
//! several nodes share, so a prefix one node computed is a hit on the others. Values prove
//! themselves: each carries a header with the full object key, the payload length and an xxh3
//! checksum, checked on every load; a value that does not verify is a miss, counted, never
//! served. Redis keys carry the namespace hash, and the header repeats it, so one tenant's
//! lookups never find, and its loads never serve, another tenant's chunks.
//!
//! The tier cannot lock and cannot be relied upon: every call has a deadline (`op_timeout`), a
//! failure of any kind is a miss (or a failed store), and the connection is reopened in the
//! background. The tier turns degraded (every call a miss at once for `reconnect_interval`) only
//! when the link fails: a refused or broken connection, or a connection silent for a whole
//! deadline. A call past its deadline on a connection that answered other calls meanwhile was
//! queued behind them (one connection carries every value in flight), so it fails alone, counted
//! as `busy`, and the tier stays healthy. The
//! adapter runs its calls on its own small tokio runtime; the rest of tierkv sees the same
//! crossbeam completions as from every other tier.
//!
//! It does not decide which chunks go to the remote tier (the store pipeline in
//! `tierkv-storage` does, by its store policy), and it never deletes what other nodes stored
//! (`clear` deletes nothing; values leave by TTL or the server's eviction).

mod config;
mod conn;
mod error;
pub mod format;
mod held;
mod metrics;
mod store;

pub use config::{RemoteConfig, RemoteMode};
pub use error::RemoteError;
pub use store::RemoteStore;
