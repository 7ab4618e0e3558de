//! The L2's metrics, registered once through the `metrics` facade.

use metrics::{Counter, Gauge, Unit, counter, describe_counter, describe_gauge, gauge};

const TIER: &str = "l2";

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

    fn as_str(self) -> &'static str {
        match self {
            Failure::NoSpace => "no_space",
            Failure::TooLarge => "too_large",
            Failure::Copy => "copy",
            Failure::Closed => "closed",
            Failure::Panic => "panic",
        }
    }
}

pub(crate) struct L2Metrics {
    capacity: Gauge,
    used: Gauge,
    cached: Gauge,
    free: Gauge,
    objects: Gauge,
    stores: Counter,
    loads: Counter,
    bytes_written: Counter,
    bytes_read: Counter,
    evictions: Counter,
    failures: Vec<(Failure, Counter)>,
}

impl L2Metrics {
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
        describe_gauge!("tierkv_tier_capacity_bytes", Unit::Bytes, "Bytes a tier may hold.");
        describe_gauge!("tierkv_tier_used_bytes", Unit::Bytes, "Bytes held by objects.");
        describe_gauge!("tierkv_tier_objects", Unit::Count, "Objects held by a tier.");
        describe_counter!(
            "tierkv_evictions_total",
            Unit::Count,
            "Objects evicted, by tier and reason."
        );
        describe_counter!(
            "tierkv_errors_total",
            Unit::Count,
            "Refused requests and keys, by tier and reason."
        );
        L2Metrics {
            capacity: gauge!("tierkv_tier_capacity_bytes", "tier" => TIER),
            used: gauge!("tierkv_tier_used_bytes", "tier" => TIER),
            cached: gauge!("tierkv_tier_cached_bytes", "tier" => TIER),
            free: gauge!("tierkv_tier_free_bytes", "tier" => TIER),
            objects: gauge!("tierkv_tier_objects", "tier" => TIER),
            stores: counter!("tierkv_tier_stores_total", "tier" => TIER),
            loads: counter!("tierkv_tier_loads_total", "tier" => TIER),
            bytes_written: counter!("tierkv_tier_bytes_written_total", "tier" => TIER),
            bytes_read: counter!("tierkv_tier_bytes_read_total", "tier" => TIER),
            evictions: counter!("tierkv_evictions_total", "tier" => TIER, "reason" => "capacity"),
            failures: Failure::ALL
                .into_iter()
                .map(|f| {
                    (f, counter!("tierkv_errors_total", "tier" => TIER, "reason" => f.as_str()))
                })
                .collect(),
        }
    }

    pub(crate) fn publish(&self, capacity: u64, used: u64, objects: u64) {
        self.capacity.set(capacity as f64);
        self.used.set(used as f64);
        // Every object of a lower tier is cached (evictable, but for the brief locks of a load),
        // so the gauges add up as L1's do: cached + free = capacity.
        self.cached.set(used as f64);
        self.free.set(capacity.saturating_sub(used) as f64);
        self.objects.set(objects as f64);
    }

    pub(crate) fn stored(&self, objects: u64, bytes: u64) {
        self.stores.increment(objects);
        self.bytes_written.increment(bytes);
    }

    pub(crate) fn loaded(&self, objects: u64, bytes: u64) {
        self.loads.increment(objects);
        self.bytes_read.increment(bytes);
    }

    pub(crate) fn evicted(&self, n: u64) {
        self.evictions.increment(n);
    }

    pub(crate) fn failed(&self, failure: Failure) {
        if let Some((_, c)) = self.failures.iter().find(|(f, _)| *f == failure) {
            c.increment(1);
        }
    }
}
