//! tierkv-core: the vocabulary every tierkv crate shares.
//!
//! It owns object identity ([`ObjectKey`] and its parts), the chained chunk hash, chunk layouts,
//! the per-key result codes, the validated `extra_count`, a clock that tests can drive, the
//! eviction policies, the [`TierAdapter`] contract that lower tiers implement, the board of
//! chunks on their way to the disk that a tier serves meanwhile ([`Departures`]), and the size
//! of a store's windows when it is larger than L1 ([`store_window`]).
//!
//! Architecture invariant: this crate does no I/O (it offers page-aligned buffers for those who
//! do), spawns no threads and depends on neither
//! tokio nor cudarc. Slots, leases and devices live in `tierkv-l1`; stores and loads in the tier
//! crates.

mod adapter;
mod aligned;
mod bitmap;
mod clock;
mod departures;
mod error;
mod extra;
pub mod hash;
mod joint;
mod key;
mod layout;
mod log_limit;
pub mod policy;
mod window;

pub use adapter::{
    BufferError, ChunkSink, ChunkSource, Completion, LoadItem, StoreItem, TaskId, TierAdapter,
    TierError, TierUsage, VecChunk,
};
pub use aligned::{ALIGN, AlignedBuf};
pub use bitmap::Bitmap;
pub use clock::{Clock, ManualClock, SystemClock, deadline_after};
pub use departures::{Board, Departing, Departures};
pub use error::KeyError;
pub use extra::{ExtraCount, ExtraCountOutOfRange};
pub use joint::JointLoad;
pub use key::{ChunkHash, GroupId, KvRank, Namespace, ObjectKey};
pub use layout::{DType, Layout, LayoutError, TensorSpec};
pub use log_limit::LogLimit;
pub use window::store_window;
