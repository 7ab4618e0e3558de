//! tierkv-l2: the host-memory tier behind L1.
//!
//! It owns the [`HostStore`]: chunks in one host arena (pinned through CUDA when a device is
//! usable, so device copies run at DMA speed; huge or plain pages otherwise), its own eviction
//! by a core policy that never evicts a key a lookup has locked, and the asynchronous, batched
//! [`tierkv_core::TierAdapter`] face: tasks run on worker threads, completions arrive on a
//! crossbeam channel.
//!
//! It does not decide what to store or when (that is the store pipeline in `tierkv-storage`),
//! and it keeps nothing across restarts (that is `tierkv-disk`).

mod arena;
mod config;
mod error;
mod metrics;
mod store;

pub use arena::MemoryKind;
pub use config::{HostMemory, HostStoreConfig};
pub use error::L2Error;
pub use store::{Demote, HostStore};
