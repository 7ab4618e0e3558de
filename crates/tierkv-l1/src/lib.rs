//! tierkv-l1: the fastest tier, through which every read and write of tierkv passes.
//!
//! It owns the L1 entry state machine (`Writing` -> `Ready` -> gone), read leases that count
//! readers (`1 + extra_count` shares, each returned once by its own reader), write reservations
//! that stay invisible until finished, exact accounting of used / cached / free bytes, eviction
//! (on demand inside reservations, and a watermark step), and the slot arena on a device backend
//! (`Emulated` host memory, or `Cuda`).
//!
//! It does not move data between tiers (that is `tierkv-storage` and the tier crates), speak any
//! protocol, or run threads of its own: callers drive it, from as many threads as they like.

mod access;
mod config;
pub mod device;
mod error;
mod index;
mod lease;
mod manager;
mod metrics;
mod room;
mod slots;

pub use access::{ReadAccess, SlotHandle, WriteAccess};
pub use config::{L1Config, Watermark};
pub use device::{DeviceArena, DeviceError, DeviceKind};
pub use error::L1Error;
pub use lease::{LeaseId, OwnerId, Readers};
pub use manager::{
    Cleared, Demoter, EvictionLease, L1Context, L1Manager, L1Observer, Lifetime, NoObserver,
    OwnerReleased, Presence, ReadGrant, Released, Usage, WriteMode,
};
pub use metrics::EvictionReason;
pub use room::RoomWatch;
pub use slots::SlotId;
