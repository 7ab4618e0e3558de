//! The disk tier's metrics: the lower tiers' shared set (`tierkv-tier-metrics`) with
//! `tier="disk"`, and whether the tier is read-only.

use metrics::{Gauge, Unit, describe_gauge, gauge};
use tierkv_tier_metrics::{Capacity, TierMetrics};

/// Reasons a task or key failed, each with its own counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    NoSpace,
    TooLarge,
    ReadOnly,
    Io,
    Copy,
    Closed,
    Panic,
}

impl Failure {
    const ALL: [Failure; 7] = [
        Failure::NoSpace,
        Failure::TooLarge,
        Failure::ReadOnly,
        Failure::Io,
        Failure::Copy,
        Failure::Closed,
        Failure::Panic,
    ];
}

impl From<Failure> for &'static str {
    fn from(failure: Failure) -> Self {
        match failure {
            Failure::NoSpace => "no_space",
            Failure::TooLarge => "too_large",
            Failure::ReadOnly => "read_only",
            Failure::Io => "io",
            Failure::Copy => "copy",
            Failure::Closed => "closed",
            Failure::Panic => "panic",
        }
    }
}

pub(crate) fn register() -> TierMetrics {
    TierMetrics::register("disk", Capacity::Bounded, &Failure::ALL.map(<&str>::from))
}

/// `tierkv_disk_read_only`.
pub(crate) struct ReadOnlyGauge(Gauge);

impl ReadOnlyGauge {
    pub(crate) fn register() -> Self {
        describe_gauge!(
            "tierkv_disk_read_only",
            Unit::Count,
            "1 while the disk tier refuses stores because its directory cannot be written."
        );
        ReadOnlyGauge(gauge!("tierkv_disk_read_only"))
    }

    pub(crate) fn set(&self, read_only: bool) {
        self.0.set(if read_only { 1.0 } else { 0.0 });
    }
}
