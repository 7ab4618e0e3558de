//! Eviction policies: which cached objects to drop first.
//!
//! One trait, one file per policy. A policy only orders keys; it knows nothing of slots, bytes or
//! leases. Its caller decides which keys may go right now (not leased, not being written, not
//! locked) and passes that decision in as an eligibility filter, so the policy never proposes a
//! key its caller cannot evict.

mod adaptive;
#[cfg(test)]
mod adaptive_tests;
mod frequency;
mod group;
mod list;
mod lru;
mod s3fifo;
mod segments;
#[cfg(test)]
mod segments_tests;
mod shared_judge;
#[cfg(test)]
mod tests;

use std::hash::Hash;

pub use adaptive::{Adaptive, Judge, JudgedOrder};
pub use group::{Joined, PolicyGroup, auto_shards, shard_of};
pub use lru::Lru;
pub use s3fifo::S3Fifo;
pub use segments::{SegmentArc, SegmentPolicy};
pub use shared_judge::SharedJudge;

/// Orders tracked keys for eviction.
///
/// Implementations are single-threaded; callers wrap them in the lock that guards the index the
/// keys live in, so the eligibility filter sees a consistent state.
pub trait EvictionPolicy<K>: Send {
    /// Starts tracking `key` as newly cached. A key already tracked is left exactly as it is.
    fn insert(&mut self, key: K);

    /// Records a use of `key`. Unknown keys are ignored.
    fn touch(&mut self, key: &K);

    /// Stops tracking `key` because its owner deleted it (not an eviction). Returns whether it was
    /// tracked; unknown keys are ignored.
    fn remove(&mut self, key: &K) -> bool;

    /// The number of tracked keys.
    fn len(&self) -> usize;

    /// Whether no key is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `key` is tracked.
    fn contains(&self, key: &K) -> bool;

    /// The order evictions follow now: the adaptive policy's choice at its last eviction;
    /// always [`Order::Recency`] for LRU and S3-FIFO.
    fn order(&self) -> Order {
        Order::Recency
    }

    /// For one shard of a [`PolicyGroup`]: stamps the next use of a key (an insert or a touch)
    /// with `stamp` instead of the group clock's next tick, until cleared with `None`. A batch's
    /// keys, visited shard by shard, then keep the batch's order across the shards
    /// ([`PolicyGroup::reserve_stamps`]). A policy outside a group has no stamps to set.
    fn stamp_next(&mut self, _stamp: Option<u64>) {}

    /// Evicts in the order `order` names for a tier below L1 from now on (recency, or ARC's
    /// order for any other choice), instead of an order the policy judges itself: a lower
    /// tier sees only what the tiers above let through, and follows a [`Judge`] that sees every
    /// lookup. Policies with one order ignore it.
    fn follow(&mut self, _order: JudgedOrder) {}

    /// Tells an L1 policy that the tiers below it keep `chunks` more of what it evicts (the
    /// cascade): the adaptive policy's frequency order then ages a use over the evictions of
    /// L1's and those tiers' keys together, the turnover of one cache of all the tiers' size,
    /// rather than over L1's alone. Policies without a frequency order ignore it.
    fn keep_below(&mut self, _chunks: usize) {}

    /// Chooses up to `n` victims among the keys for which `eligible` returns true, stops
    /// tracking them and returns them, first victim first.
    ///
    /// Ineligible keys are skipped, not dropped: they stay tracked. The caller must evict every
    /// returned key.
    fn evict(&mut self, n: usize, eligible: &mut dyn FnMut(&K) -> bool) -> Vec<K>;
}

/// The order an adaptive policy evicts in ([`EvictionPolicy::order`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Order {
    /// Least recently used first (and every policy that is not adaptive).
    Recency,
    /// ARC's choice between keys used once and keys used again.
    Arc,
    /// The lowest priority by decayed use counts (LRFU) remembered past eviction.
    Frequency,
}

impl Order {
    /// Every order, for metrics that report each.
    pub const ALL: [Order; 3] = [Order::Recency, Order::Arc, Order::Frequency];

    /// The name used in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Order::Recency => "recency",
            Order::Arc => "arc",
            Order::Frequency => "frequency",
        }
    }
}

/// What a policy may read of a key besides its identity: bits that are the same for the same
/// chunk everywhere (in every process, run and simulation), so that a policy that samples keys
/// samples the same ones in the daemon and in `tierkv replay --simulate`.
pub trait SampleKey {
    /// Bits of the key that do not depend on the process: for a chunk, its chained hash.
    fn sample_bits(&self) -> u64;

    /// A 64-bit fingerprint of the whole key, by which the adaptive policy's history of uses
    /// tells apart keys with the same [`sample_bits`](Self::sample_bits): distinct for distinct
    /// keys but by chance (for a chunk, its rank, group and namespace too, which the sample bits
    /// leave out).
    fn identity_bits(&self) -> u64 {
        self.sample_bits()
    }
}

impl SampleKey for u64 {
    fn sample_bits(&self) -> u64 {
        *self
    }
}

impl SampleKey for u32 {
    fn sample_bits(&self) -> u64 {
        u64::from(*self)
    }
}

impl SampleKey for crate::ObjectKey {
    fn sample_bits(&self) -> u64 {
        // A trace chunk `k` is the daemon chunk `k`: its low half is `k`, so the simulation,
        // which knows only `k`, samples the same chunks.
        let hash = self.chunk.0;
        (hash as u64) ^ ((hash >> 64) as u64)
    }

    fn identity_bits(&self) -> u64 {
        let (rank, world) = match self.rank {
            crate::KvRank::Shared => (u16::MAX, 0),
            crate::KvRank::Rank { rank, world } => (rank, world),
        };
        let mut bytes = [0u8; 30];
        bytes[..8].copy_from_slice(&self.namespace.0.to_le_bytes());
        bytes[8..24].copy_from_slice(&self.chunk.0.to_le_bytes());
        bytes[24..26].copy_from_slice(&rank.to_le_bytes());
        bytes[26..28].copy_from_slice(&world.to_le_bytes());
        bytes[28..30].copy_from_slice(&self.group.0.to_le_bytes());
        xxhash_rust::xxh3::xxh3_64(&bytes)
    }
}

/// Which eviction policy to build.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// Least recently used first.
    Lru,
    /// S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO filters out objects used once,
    /// a main FIFO with reinsertion keeps the rest; a ghost FIFO remembers recent evictions.
    S3Fifo,
    /// ARC's lists evicted in ARC's or in recency order, whichever sampled shadow caches show
    /// hits more on the workload at hand ([`Adaptive`]).
    #[default]
    Adaptive,
}

impl PolicyKind {
    /// Every kind, for tests that run against each policy.
    pub const ALL: [PolicyKind; 3] = [PolicyKind::Lru, PolicyKind::S3Fifo, PolicyKind::Adaptive];

    /// A new, empty policy of this kind.
    pub fn build<K>(self) -> Box<dyn EvictionPolicy<K>>
    where
        K: Hash + Eq + Clone + Send + SampleKey + 'static,
    {
        match self {
            PolicyKind::Lru => Box::new(Lru::new()),
            PolicyKind::S3Fifo => Box::new(S3Fifo::new()),
            PolicyKind::Adaptive => Box::new(Adaptive::new()),
        }
    }

    /// A new, empty policy of this kind over `shards` joined shards, as a sharded L1 holds its
    /// keys ([`Joined`]); one shard is the policy alone.
    pub fn build_sharded<K>(self, shards: usize) -> Box<dyn EvictionPolicy<K>>
    where
        K: Hash + Eq + Clone + Send + SampleKey + 'static,
    {
        if shards <= 1 { self.build() } else { Box::new(Joined::new(self, shards)) }
    }

    /// The name used in configuration files and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::S3Fifo => "s3fifo",
            PolicyKind::Adaptive => "adaptive",
        }
    }
}

/// A fraction outside `[0, 1]` (or NaN) given to [`evict_fraction`].
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
#[error("eviction ratio must be within [0, 1], got {0}")]
pub struct InvalidRatio(pub f64);

/// Evicts the fraction `ratio` of the tracked keys, counting only eligible ones as victims.
///
/// `ratio` 0 evicts nothing and 1 evicts every eligible key. Ratios outside `[0, 1]`, and NaN,
/// are rejected rather than clamped: a caller that computes a bad ratio has a bug worth seeing.
pub fn evict_fraction<K>(
    policy: &mut dyn EvictionPolicy<K>,
    ratio: f64,
    eligible: &mut dyn FnMut(&K) -> bool,
) -> Result<Vec<K>, InvalidRatio> {
    if !(0.0..=1.0).contains(&ratio) {
        return Err(InvalidRatio(ratio));
    }
    // The product of a ratio in [0, 1] and a length is a non-negative finite float no larger
    // than the length, so the conversion cannot overflow.
    let n = (ratio * policy.len() as f64).ceil() as usize;
    Ok(policy.evict(n, eligible))
}
