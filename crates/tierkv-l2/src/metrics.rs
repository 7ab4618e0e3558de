//! The L2's metrics: the lower tiers' shared set (`tierkv-tier-metrics`) with `tier="l2"`.

use tierkv_tier_metrics::{Capacity, DepartingMetrics, TierMetrics};

/// Reasons a task or key failed, each with its own counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    NoSpace,
    TooLarge,
    Copy,
    Closed,
    Panic,
}

impl Failure {
    const ALL: [Failure; 5] =
        [Failure::NoSpace, Failure::TooLarge, Failure::Copy, Failure::Closed, Failure::Panic];
}

impl From<Failure> for &'static str {
    fn from(failure: Failure) -> Self {
        match failure {
            Failure::NoSpace => "no_space",
            Failure::TooLarge => "too_large",
            Failure::Copy => "copy",
            Failure::Closed => "closed",
            Failure::Panic => "panic",
        }
    }
}

pub(crate) fn register() -> TierMetrics {
    TierMetrics::register("l2", Capacity::Bounded, &Failure::ALL.map(<&str>::from))
}

/// The metrics of L2's victims on their way to the disk, which it serves until they land.
pub(crate) fn register_departing() -> DepartingMetrics {
    DepartingMetrics::register("l2")
}
