//! tierkv-bench: what every tierkv benchmark measures against.
//!
//! A figure means little alone: "12 GB/s" may be excellent or poor depending on the machine. So
//! each benchmark measures the physical limit it is bounded by in the same run, on the same
//! machine and filesystem, and prints its figure as a ratio of that limit:
//!
//! - [`memcpy_bandwidth`]: single-core host copy bandwidth, over buffers larger than the last
//!   level cache (the bound of every host-memory copy path); [`memcpy_bandwidth_threads`], the
//!   same on several cores at once (the bound of a path that copies on that many threads);
//! - [`direct_read_bandwidth`]: sequential read bandwidth of a freshly written file read with
//!   `O_DIRECT`, so the page cache cannot flatter it (the bound of disk loads); [`bracketed`]
//!   measures a limit that drifts within a run right before and right after the work it bounds.
//!
//! [`Table`] prints the figures and their ratios in one format across benchmarks, and [`Pump`]
//! keeps a tier busy the same way in every tier bandwidth benchmark.

mod limits;
mod pump;
mod table;

pub use limits::{
    bracketed, direct_file_bandwidth, direct_read_bandwidth, direct_write_bandwidth,
    memcpy_bandwidth, memcpy_bandwidth_threads,
};
pub use pump::Pump;
pub use table::Table;
pub use tierkv_core::AlignedBuf;

use tierkv_core::{ChunkHash, KvRank, Namespace, ObjectKey};

/// The key of a benchmark's chunk `i`: one namespace, a distinct hash per `i`.
pub fn key(i: u64) -> ObjectKey {
    ObjectKey::new(Namespace::new("bench", ""), ChunkHash(u128::from(i) << 32 | 7), KvRank::Shared)
}
