//! tierkv-disk: the persistent tier, the one that makes tierkv useful across daemon restarts.
//!
//! It owns the [`DiskStore`]: chunks as checksummed records appended to segments (by default of
//! one record each) in preallocated files, an in-memory index rebuilt from the segment headers
//! when the store opens, eviction of whole segments by a core policy (never a segment holding a
//! locked record), and the
//! asynchronous, batched [`tierkv_core::TierAdapter`] face on dedicated I/O threads. A record
//! that fails verification is never served: it is a miss, counted, and dropped from the index.
//!
//! The format and the crash-consistency promise of each fsync policy are in
//! `docs/disk-format.md`. It does not decide what reaches disk (the store pipeline's admission
//! policy does), and it keeps no state outside its directory.

mod config;
mod error;
mod format;
mod metrics;
mod segment;
mod store;

pub use config::{DiskStoreConfig, FILE_BYTES, FsyncPolicy, ReadMode, auto_segment_bytes};
pub use error::DiskError;
pub use format::{BLOCK, record_bytes};
pub use segment::IoMode;
pub use store::{DiskStore, Recovered, WRITABLE_RETRY, WRITES_IN_FLIGHT};
