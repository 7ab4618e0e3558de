//! The remote tier's metrics, registered once through the `metrics` facade, with the names and
//! labels the other tiers use (`tier="remote"`).

use metrics::{Counter, Gauge, Unit, counter, describe_counter, describe_gauge, gauge};

const TIER: &str = "remote";

/// Reasons counted in `tierkv_errors_total{tier="remote"}`.
const REASONS: [&str; 12] = [
    "checksum",
    "truncated",
    "bad_header",
    "wrong_key",
    "wrong_length",
    "unavailable",
    "timeout",
    "connection",
    "server",
    "oom",
    "closed",
    "too_large",
];

pub(crate) struct RemoteMetrics {
    objects: Gauge,
    used: Gauge,
    degraded: Gauge,
    stores: Counter,
    loads: Counter,
    bytes_written: Counter,
    bytes_read: Counter,
    checksum_failures: Counter,
    errors: Vec<(&'static str, Counter)>,
}

impl RemoteMetrics {
    pub(crate) fn register() -> Self {
        describe_counter!(
            "tierkv_tier_stores_total",
            Unit::Count,
            "Objects stored into a lower tier."
        );
        describe_counter!(
            "tierkv_tier_loads_total",
            Unit::Count,
            "Objects loaded from a lower tier."
        );
        describe_counter!(
            "tierkv_tier_bytes_written_total",
            Unit::Bytes,
            "Bytes stored into a lower tier."
        );
        describe_counter!(
            "tierkv_tier_bytes_read_total",
            Unit::Bytes,
            "Bytes loaded from a lower tier."
        );
        describe_gauge!("tierkv_tier_used_bytes", Unit::Bytes, "Bytes held by objects.");
        describe_gauge!("tierkv_tier_objects", Unit::Count, "Objects held by a tier.");
        describe_counter!(
            "tierkv_checksum_failures_total",
            Unit::Count,
            "Objects that failed verification: served as misses."
        );
        describe_counter!(
            "tierkv_errors_total",
            Unit::Count,
            "Refused requests and keys, by tier and reason."
        );
        describe_gauge!(
            "tierkv_remote_degraded",
            Unit::Count,
            "1 while the remote tier cannot be reached: its lookups and loads are misses."
        );
        RemoteMetrics {
            objects: gauge!("tierkv_tier_objects", "tier" => TIER),
            used: gauge!("tierkv_tier_used_bytes", "tier" => TIER),
            degraded: gauge!("tierkv_remote_degraded"),
            stores: counter!("tierkv_tier_stores_total", "tier" => TIER),
            loads: counter!("tierkv_tier_loads_total", "tier" => TIER),
            bytes_written: counter!("tierkv_tier_bytes_written_total", "tier" => TIER),
            bytes_read: counter!("tierkv_tier_bytes_read_total", "tier" => TIER),
            checksum_failures: counter!("tierkv_checksum_failures_total", "tier" => TIER),
            errors: REASONS
                .into_iter()
                .map(|r| (r, counter!("tierkv_errors_total", "tier" => TIER, "reason" => r)))
                .collect(),
        }
    }

    pub(crate) fn publish(&self, objects: u64, used: u64, degraded: bool) {
        self.objects.set(objects as f64);
        self.used.set(used as f64);
        self.degraded.set(if degraded { 1.0 } else { 0.0 });
    }

    pub(crate) fn stored(&self, objects: u64, bytes: u64) {
        self.stores.increment(objects);
        self.bytes_written.increment(bytes);
    }

    pub(crate) fn loaded(&self, objects: u64, bytes: u64) {
        self.loads.increment(objects);
        self.bytes_read.increment(bytes);
    }

    /// A value failed verification for `reason`.
    pub(crate) fn invalid(&self, reason: &'static str) {
        self.checksum_failures.increment(1);
        self.error(reason);
    }

    pub(crate) fn error(&self, reason: &str) {
        if let Some((_, c)) = self.errors.iter().find(|(r, _)| *r == reason) {
            c.increment(1);
        }
    }
}
