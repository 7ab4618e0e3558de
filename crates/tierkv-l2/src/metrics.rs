//! The L2's metrics: the lower tiers' shared set (`tierkv-tier-metrics`) with `tier="l2"`.

use metrics::{Counter, Gauge, Unit, counter, describe_counter, describe_gauge, gauge};
use tierkv_tier_metrics::{Capacity, TierMetrics};

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

/// L2's own metrics of its victims on their way to the tier below (the cascade), which it
/// serves until they land there.
pub(crate) struct DepartingMetrics {
    /// Objects loaded from a victim's copy on its way down (counted in the tier's loads too).
    pub(crate) loads: Counter,
    /// Victims on their way down now, and their bytes (outside the tier's capacity).
    pub(crate) objects: Gauge,
    pub(crate) bytes: Gauge,
}

pub(crate) fn register_departing() -> DepartingMetrics {
    describe_counter!(
        "tierkv_l2_departing_loads_total",
        "objects L2 loaded from a victim's copy on its way to the tier below (also counted in tierkv_tier_loads_total)"
    );
    describe_gauge!(
        "tierkv_l2_departing_objects",
        "objects L2 evicted that are on their way to the tier below and still served by L2"
    );
    describe_gauge!(
        "tierkv_l2_departing_bytes",
        Unit::Bytes,
        "bytes of L2's victims on their way to the tier below, held outside L2's capacity"
    );
    DepartingMetrics {
        loads: counter!("tierkv_l2_departing_loads_total"),
        objects: gauge!("tierkv_l2_departing_objects"),
        bytes: gauge!("tierkv_l2_departing_bytes"),
    }
}
