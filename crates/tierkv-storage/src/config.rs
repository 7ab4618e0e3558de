//! StorageManager configuration: which tiers exist, how they are fed, and how often the
//! background work runs.

use std::time::Duration;

use tierkv_disk::DiskStoreConfig;
use tierkv_l1::{L1Config, Watermark};
use tierkv_l2::HostStoreConfig;
use tierkv_prefetch::PrefetchConfig;
use tierkv_remote::RemoteConfig;

/// How finished writes reach the lower tiers. `ARCHITECTURE.md` records which is the default
/// and the trace replay that chose it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StorePolicy {
    /// Every finished write is copied to every lower tier at once.
    WriteThrough,
    /// Every finished write is copied to the host tier at once; a chunk reaches disk only once it
    /// has been read `min_reads` times (sparing the SSD the chunks nobody reuses).
    DiskAdmission {
        /// Reads (lookup hits) a chunk needs before it is written to disk.
        min_reads: u32,
    },
    /// Nothing is copied at write time; a chunk is copied to every lower tier when it leaves L1:
    /// written back in the background above L1's watermark, or demoted when a reservation
    /// evicts it first. A clean stop writes L1 back to disk, so a restart keeps it.
    WriteBack,
    /// Each tier holds what the one above it evicted: a chunk is written to L1 only, L1's
    /// victims (every eviction, on demand or in the background) go to the first lower tier,
    /// that tier's victims to the next. Hits stay in the tier that has them (a promotion into
    /// L1 is only for the read). The tiers hold different chunks, so their capacities add up.
    /// A clean stop hands L1's and L2's chunks down to disk, so a restart keeps them.
    #[default]
    Cascade,
}

/// Which chunks the remote tier (shared by the nodes) receives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RemoteAdmission {
    /// Every finished write goes to the remote tier at once (under write-back, when L1 writes it
    /// back): another node can hit a prefix as soon as one node computed it.
    #[default]
    WriteThrough,
    /// A chunk reaches the remote tier once it has been read `min_reads` times on this node (1:
    /// "seen twice", written then read), sparing the network the chunks nobody reuses.
    AfterReads {
        /// Reads (lookup hits) a chunk needs before it is written to the remote tier.
        min_reads: u32,
    },
}

/// How a StorageManager is built.
#[derive(Clone, Debug)]
pub struct StorageConfig {
    /// The L1 tier.
    pub l1: L1Config,
    /// The host-memory tier, if any.
    pub l2: Option<HostStoreConfig>,
    /// The disk tier, if any.
    pub disk: Option<DiskStoreConfig>,
    /// The cross-node tier, if any: after the disk tier.
    pub remote: Option<RemoteConfig>,
    /// Which chunks the remote tier receives.
    pub remote_admission: RemoteAdmission,
    /// The prefetch pipeline.
    pub prefetch: PrefetchConfig,
    /// How finished writes reach the lower tiers.
    pub store_policy: StorePolicy,
    /// Background eviction thresholds of the host tier.
    pub l2_watermark: Watermark,
    /// How often the background work (lease expiry, watermark eviction, gauges) runs.
    pub maintenance_interval: Duration,
    /// How long a store waits for room when L1 is full of chunks the store pipeline is still
    /// copying down (they cannot be evicted before their tiers have them); past it, the chunks
    /// without room are refused. One wait for a whole store, all its windows together
    /// (`StorageManager::store_deadline`); short enough (2 s) to answer within a client's
    /// deadline (the vLLM connector's `timeout_s`, 5 s).
    pub store_backpressure: Duration,
    /// Under the cascade, how long a stop may spend handing what L1 and L2 hold down to the disk
    /// tier, the one a restart keeps; what is not down by then is lost with the process.
    pub stop_drain_timeout: Duration,
    /// How long the store pipeline waits for a lower tier to answer a store (a hung disk, say)
    /// before it gives the copy up: its L1 shares go back, its writers learn that it is not
    /// durable, and a late answer changes nothing.
    pub store_timeout: Duration,
}

impl StorageConfig {
    /// An L1 of `l1` alone, with default pipelines.
    pub fn new(l1: L1Config) -> Self {
        StorageConfig {
            l1,
            l2: None,
            disk: None,
            remote: None,
            remote_admission: RemoteAdmission::default(),
            prefetch: PrefetchConfig::default(),
            store_policy: StorePolicy::default(),
            l2_watermark: Watermark::default(),
            maintenance_interval: Duration::from_millis(50),
            store_backpressure: Duration::from_secs(2),
            stop_drain_timeout: Duration::from_secs(20),
            store_timeout: Duration::from_secs(60),
        }
    }
}
