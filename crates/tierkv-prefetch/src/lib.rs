//! tierkv-prefetch: the pipeline that promotes chunks from the lower tiers into L1 leases.
//!
//! It owns the [`PrefetchController`] (a thread with a submission queue, a FIFO of pending
//! requests and a bounded number in flight), the hit computation across KV-cache groups
//! ([`hit_chunks`]), and the [`TierRouter`], which hands each tier's completions to whichever
//! pipeline submitted the task.
//!
//! It does not lease L1 hits (the caller does that first: rule 4), decide what to store (the
//! store pipeline in `tierkv-storage`), or speak to clients.

mod below;
mod controller;
mod hit;
mod metrics;
mod router;

pub use below::{BelowError, HeldBelow, Landed, Landing};
pub use controller::{
    GroupRequest, LOAD_FLOOR_BYTES_PER_S, PrefetchConfig, PrefetchController, PrefetchError,
    PrefetchRequest, Prefetched, RequestId,
};
pub use hit::{GroupKind, hit_chunks};
pub use router::{TierEvent, TierRouter};
