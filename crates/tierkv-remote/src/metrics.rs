//! The remote tier's metrics: the lower tiers' shared set (`tierkv-tier-metrics`) with
//! `tier="remote"`, and whether the tier is degraded.

use metrics::{Gauge, Unit, describe_gauge, gauge};
use tierkv_tier_metrics::{Capacity, TierMetrics};

/// Reasons counted in `tierkv_errors_total{tier="remote"}`.
const REASONS: [&str; 15] = [
    "checksum",
    "truncated",
    "bad_header",
    "wrong_key",
    "wrong_length",
    "unavailable",
    "timeout",
    "busy",
    "connection",
    "server",
    "oom",
    "closed",
    "too_large",
    "copy",
    "abandoned",
];

/// Redis decides what it keeps: no capacity, no evictions of the tier's own.
pub(crate) fn register() -> TierMetrics {
    TierMetrics::register("remote", Capacity::External, &REASONS)
}

/// `tierkv_remote_degraded`.
pub(crate) struct DegradedGauge(Gauge);

impl DegradedGauge {
    pub(crate) fn register() -> Self {
        describe_gauge!(
            "tierkv_remote_degraded",
            Unit::Count,
            "1 while the remote tier cannot be reached: its lookups and loads are misses."
        );
        DegradedGauge(gauge!("tierkv_remote_degraded"))
    }

    pub(crate) fn set(&self, degraded: bool) {
        self.0.set(if degraded { 1.0 } else { 0.0 });
    }
}
