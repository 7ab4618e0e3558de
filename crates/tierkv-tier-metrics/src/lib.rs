//! The metrics every tier below L1 publishes, under one set of names with a `tier` label: what
//! it stores and loads, what it holds, what it evicts, what failed verification, and what it
//! refused and why. One definition, so that names, units and descriptions cannot drift between
//! the host, disk and remote tiers; L1 publishes the gauges of what it holds under the same
//! names and takes their descriptions from [`describe_shared`] (README.md lists them). The tiers
//! that serve chunks on their way to the disk (L2, the disk) add [`DepartingMetrics`].

use metrics::{Counter, Gauge, Unit, counter, describe_counter, describe_gauge, gauge};

/// The metric handles of one tier, registered once through the `metrics` facade.
pub struct TierMetrics {
    stores: Counter,
    loads: Counter,
    bytes_written: Counter,
    bytes_read: Counter,
    used: Gauge,
    objects: Gauge,
    checksum_failures: Counter,
    errors: Vec<(&'static str, Counter)>,
    /// For a tier that bounds and evicts its own contents.
    bounded: Option<Bounded>,
}

/// The metrics only a tier that bounds its own contents has.
struct Bounded {
    capacity: Gauge,
    cached: Gauge,
    free: Gauge,
    evictions: Counter,
    arc_order: Gauge,
    frequency_order: Gauge,
}

/// Whether a tier bounds its contents itself (and so has a capacity and evicts), or leaves that
/// to the store behind it (Redis).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capacity {
    /// The tier holds at most a configured number of bytes and evicts to stay within it.
    Bounded,
    /// The store behind the tier decides what it keeps.
    External,
}

impl TierMetrics {
    /// Registers the metrics of `tier` (the label value), with one error counter per reason in
    /// `reasons` (the values of the `reason` label of `tierkv_errors_total`).
    pub fn register(tier: &'static str, capacity: Capacity, reasons: &[&'static str]) -> Self {
        describe();
        let bounded = (capacity == Capacity::Bounded).then(|| Bounded {
            capacity: gauge!("tierkv_tier_capacity_bytes", "tier" => tier),
            cached: gauge!("tierkv_tier_cached_bytes", "tier" => tier),
            free: gauge!("tierkv_tier_free_bytes", "tier" => tier),
            evictions: counter!("tierkv_evictions_total", "tier" => tier, "reason" => "capacity"),
            arc_order: gauge!(ARC_ORDER, "tier" => tier),
            frequency_order: gauge!(FREQUENCY_ORDER, "tier" => tier),
        });
        TierMetrics {
            stores: counter!("tierkv_tier_stores_total", "tier" => tier),
            loads: counter!("tierkv_tier_loads_total", "tier" => tier),
            bytes_written: counter!("tierkv_tier_bytes_written_total", "tier" => tier),
            bytes_read: counter!("tierkv_tier_bytes_read_total", "tier" => tier),
            used: gauge!("tierkv_tier_used_bytes", "tier" => tier),
            objects: gauge!("tierkv_tier_objects", "tier" => tier),
            checksum_failures: counter!("tierkv_checksum_failures_total", "tier" => tier),
            errors: reasons
                .iter()
                .map(|r| (*r, counter!("tierkv_errors_total", "tier" => tier, "reason" => *r)))
                .collect(),
            bounded,
        }
    }

    /// Sets the usage gauges: `capacity` counts only for a bounded tier. Every object of a lower
    /// tier is cached (evictable, but for the brief locks of a load), so cached = used, and a
    /// bounded tier's gauges add up as L1's do: used + free = capacity.
    pub fn publish(&self, capacity: u64, used: u64, objects: u64) {
        self.used.set(used as f64);
        self.objects.set(objects as f64);
        if let Some(bounded) = &self.bounded {
            bounded.capacity.set(capacity as f64);
            bounded.cached.set(used as f64);
            bounded.free.set(capacity.saturating_sub(used) as f64);
        }
    }

    /// `objects` objects of `bytes` bytes in all were stored.
    pub fn stored(&self, objects: u64, bytes: u64) {
        self.stores.increment(objects);
        self.bytes_written.increment(bytes);
    }

    /// `objects` objects of `bytes` bytes in all were loaded.
    pub fn loaded(&self, objects: u64, bytes: u64) {
        self.loads.increment(objects);
        self.bytes_read.increment(bytes);
    }

    /// Sets the shares of the tier's eviction policies that evict in ARC's order and by use
    /// counts now (each 1 or 0 for a tier with one policy; nothing is published for an external
    /// tier).
    pub fn publish_orders(&self, arc: f64, frequency: f64) {
        if let Some(bounded) = &self.bounded {
            bounded.arc_order.set(arc);
            bounded.frequency_order.set(frequency);
        }
    }

    /// `n` objects were evicted for room (nothing is counted for an external tier).
    pub fn evicted(&self, n: u64) {
        if let Some(bounded) = &self.bounded {
            bounded.evictions.increment(n);
        }
    }

    /// `n` objects failed verification and were served as misses.
    pub fn checksum_failed(&self, n: u64) {
        self.checksum_failures.increment(n);
    }

    /// A request or key was refused for `reason`, one of those registered (any other is a bug,
    /// caught in debug builds).
    pub fn failed(&self, reason: impl Into<&'static str>) {
        let reason = reason.into();
        match self.errors.iter().find(|(r, _)| *r == reason) {
            Some((_, counter)) => counter.increment(1),
            None => debug_assert!(false, "the error reason {reason:?} was never registered"),
        }
    }
}

/// The metrics of a tier that serves chunks on their way to the disk under the cascade
/// (`tierkv_core::Departures`): L2 its own victims, the disk L1's when there is no L2.
pub struct DepartingMetrics {
    loads: Counter,
    objects: Gauge,
    bytes: Gauge,
}

impl DepartingMetrics {
    /// Registers the departing metrics of `tier` (the label value).
    pub fn register(tier: &'static str) -> Self {
        describe_counter!(
            "tierkv_departing_loads_total",
            Unit::Count,
            "Objects a tier loaded from copies of chunks on their way to the disk (also counted \
             in tierkv_tier_loads_total)."
        );
        describe_gauge!(
            "tierkv_departing_objects",
            Unit::Count,
            "Chunks on their way to the disk, served meanwhile by the tier from copies in memory."
        );
        describe_gauge!(
            "tierkv_departing_bytes",
            Unit::Bytes,
            "Bytes of the chunks on their way to the disk, held in memory outside any capacity."
        );
        DepartingMetrics {
            loads: counter!("tierkv_departing_loads_total", "tier" => tier),
            objects: gauge!("tierkv_departing_objects", "tier" => tier),
            bytes: gauge!("tierkv_departing_bytes", "tier" => tier),
        }
    }

    /// `objects` objects were loaded from copies on their way.
    pub fn loaded(&self, objects: u64) {
        self.loads.increment(objects);
    }

    /// Sets the gauges: `objects` chunks of `bytes` bytes in all are on their way now.
    pub fn publish(&self, objects: u64, bytes: u64) {
        self.objects.set(objects as f64);
        self.bytes.set(bytes as f64);
    }
}

/// The gauge of the share of a tier's eviction policies that evict in ARC's order.
pub const ARC_ORDER: &str = "tierkv_policy_arc_order";

/// The gauge of the share of a tier's eviction policies that evict by use counts.
pub const FREQUENCY_ORDER: &str = "tierkv_policy_frequency_order";

/// Describes the gauges and counters every tier publishes, L1 included, so that each name has
/// one description whichever tier registers it last (describing again is harmless).
pub fn describe_shared() {
    describe_gauge!(
        ARC_ORDER,
        Unit::Count,
        "Share of a tier's eviction policies evicting in ARC's order (the adaptive policy's \
         choice; L1 has one per index shard): 0 to 1."
    );
    describe_gauge!(
        FREQUENCY_ORDER,
        Unit::Count,
        "Share of a tier's eviction policies evicting by use counts remembered past eviction (the \
         adaptive policy's choice; L1 has one per index shard): 0 to 1."
    );
    describe_gauge!("tierkv_tier_capacity_bytes", Unit::Bytes, "Bytes a tier may hold.");
    describe_gauge!(
        "tierkv_tier_used_bytes",
        Unit::Bytes,
        "Bytes held by objects, in every state: used + free = capacity."
    );
    describe_gauge!(
        "tierkv_tier_cached_bytes",
        Unit::Bytes,
        "Bytes held by objects the tier may evict now (below L1: every object)."
    );
    describe_gauge!("tierkv_tier_free_bytes", Unit::Bytes, "Bytes not held by any object.");
    describe_gauge!("tierkv_tier_objects", Unit::Count, "Objects held by a tier, in every state.");
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
}

/// Describes the metrics only the tiers below L1 publish, and the shared ones.
fn describe() {
    describe_shared();
    describe_counter!("tierkv_tier_stores_total", Unit::Count, "Objects stored into a lower tier.");
    describe_counter!("tierkv_tier_loads_total", Unit::Count, "Objects loaded from a lower tier.");
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
    describe_counter!(
        "tierkv_checksum_failures_total",
        Unit::Count,
        "Objects whose header or payload failed verification: served as misses and dropped."
    );
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;

    /// One series: its name, its labels and its value.
    type Series = (String, Vec<(String, String)>, f64);

    /// Every series the calls in `record` leave.
    fn series(record: impl FnOnce()) -> Vec<Series> {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, record);
        let mut all: Vec<_> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let labels = key
                    .key()
                    .labels()
                    .map(|l| (l.key().to_string(), l.value().to_string()))
                    .collect();
                let value = match value {
                    DebugValue::Counter(n) => n as f64,
                    DebugValue::Gauge(g) => g.into_inner(),
                    DebugValue::Histogram(_) => f64::NAN,
                };
                (key.key().name().to_string(), labels, value)
            })
            .collect();
        all.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        all
    }

    fn value(all: &[Series], name: &str, reason: &str) -> f64 {
        all.iter()
            .filter(|(n, labels, _)| {
                n == name && (reason.is_empty() || labels.iter().any(|(_, v)| v == reason))
            })
            .map(|(.., v)| *v)
            .sum()
    }

    #[test]
    fn a_bounded_tier_publishes_its_usage_traffic_and_refusals_under_the_shared_names() {
        let all = series(|| {
            let m = TierMetrics::register("disk", Capacity::Bounded, &["io", "no_space"]);
            m.publish(100, 30, 3);
            m.stored(2, 20);
            m.loaded(1, 10);
            m.evicted(4);
            m.checksum_failed(1);
            m.failed("io");
            m.failed("io");
            m.publish_orders(0.0, 1.0);
        });
        let expected = [
            ("tierkv_tier_capacity_bytes", "", 100.0),
            ("tierkv_tier_used_bytes", "", 30.0),
            ("tierkv_tier_cached_bytes", "", 30.0),
            ("tierkv_tier_free_bytes", "", 70.0),
            ("tierkv_tier_objects", "", 3.0),
            ("tierkv_tier_stores_total", "", 2.0),
            ("tierkv_tier_bytes_written_total", "", 20.0),
            ("tierkv_tier_loads_total", "", 1.0),
            ("tierkv_tier_bytes_read_total", "", 10.0),
            ("tierkv_evictions_total", "capacity", 4.0),
            ("tierkv_checksum_failures_total", "", 1.0),
            ("tierkv_errors_total", "io", 2.0),
            ("tierkv_errors_total", "no_space", 0.0),
            ("tierkv_policy_arc_order", "", 0.0),
            ("tierkv_policy_frequency_order", "", 1.0),
        ];
        for (name, reason, want) in expected {
            assert_eq!(value(&all, name, reason), want, "{name} {reason}");
        }
        assert!(all.iter().all(|(_, labels, _)| labels.contains(&("tier".into(), "disk".into()))));
    }

    #[test]
    fn an_external_tier_has_no_capacity_and_no_evictions_of_its_own() {
        let all = series(|| {
            let m = TierMetrics::register("remote", Capacity::External, &["timeout"]);
            m.publish(0, 30, 3);
            m.evicted(4);
            m.publish_orders(1.0, 1.0);
        });
        let names: Vec<&str> = all.iter().map(|(n, ..)| n.as_str()).collect();
        for absent in [
            "tierkv_tier_capacity_bytes",
            "tierkv_tier_cached_bytes",
            "tierkv_tier_free_bytes",
            "tierkv_evictions_total",
            "tierkv_policy_arc_order",
            "tierkv_policy_frequency_order",
        ] {
            assert!(!names.contains(&absent), "{absent} is published: {names:?}");
        }
        assert_eq!(value(&all, "tierkv_tier_used_bytes", ""), 30.0);
    }
}
