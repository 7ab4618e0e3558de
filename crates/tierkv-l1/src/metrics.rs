//! The L1's metrics, registered once through the `metrics` facade (no exporter here).

use metrics::{Counter, Gauge, Unit, counter, describe_counter, describe_gauge, gauge};
use tierkv_core::KeyError;

use crate::error::L1Error;

const TIER: &str = "l1";

/// Why objects left L1 without being deleted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictionReason {
    /// A reservation found no free slot.
    OnDemand,
    /// Occupancy crossed the high watermark.
    Watermark,
    /// The storage layer is stopping and hands what L1 holds down to the tiers that outlive it.
    Stop,
    /// Write-back copied the victim to the next tier down before its slot was freed.
    WriteBack,
}

impl EvictionReason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            EvictionReason::OnDemand => "on_demand",
            EvictionReason::Watermark => "watermark",
            EvictionReason::Stop => "stop",
            EvictionReason::WriteBack => "write_back",
        }
    }
}

/// Request-level error reasons, registered up front so every counter exists from the start:
/// every [`L1Error::reason`] but `config` (refused at construction, before the L1 counts
/// anything) and the key errors' own (counted as those).
const REQUEST_ERRORS: [&str; 10] = [
    "layout_too_large",
    "unknown_lease",
    "lease_expired",
    "lease_released",
    "no_such_reader",
    "already_released",
    "empty_release",
    "not_leased",
    "out_of_range",
    "device",
];

pub(crate) struct L1Metrics {
    capacity: Gauge,
    used: Gauge,
    pinned: Gauge,
    cached: Gauge,
    free: Gauge,
    objects: Gauge,
    leases: Gauge,
    arc_order: Gauge,
    frequency_order: Gauge,
    evicted_on_demand: Counter,
    evicted_watermark: Counter,
    evicted_stop: Counter,
    evicted_write_back: Counter,
    lease_expiries: Counter,
    writes_finished: Counter,
    read_shares: Counter,
    demoter_panics: Counter,
    key_errors: Vec<(KeyError, Counter)>,
    request_errors: Vec<(&'static str, Counter)>,
}

impl L1Metrics {
    pub(crate) fn register() -> Self {
        tierkv_tier_metrics::describe_shared();
        describe_gauge!(
            "tierkv_l1_pinned_bytes",
            Unit::Bytes,
            "Bytes of L1 held by objects being written or read, which eviction cannot free."
        );
        describe_gauge!(
            "tierkv_l1_leases_active",
            Unit::Count,
            "Read leases not yet fully released."
        );
        describe_counter!(
            "tierkv_lease_expiries_total",
            Unit::Count,
            "Read leases revoked at their deadline."
        );
        describe_counter!(
            "tierkv_l1_writes_finished_total",
            Unit::Count,
            "Objects made visible by finish_write."
        );
        describe_counter!(
            "tierkv_l1_read_shares_total",
            Unit::Count,
            "Read shares granted (one per reader per object)."
        );
        let key_errors = KeyError::ALL
            .into_iter()
            .map(|e| (e, counter!("tierkv_errors_total", "tier" => TIER, "reason" => e.as_str())))
            .collect();
        let request_errors = REQUEST_ERRORS
            .into_iter()
            .map(|r| (r, counter!("tierkv_errors_total", "tier" => TIER, "reason" => r)))
            .collect();
        L1Metrics {
            capacity: gauge!("tierkv_tier_capacity_bytes", "tier" => TIER),
            used: gauge!("tierkv_tier_used_bytes", "tier" => TIER),
            pinned: gauge!("tierkv_l1_pinned_bytes"),
            cached: gauge!("tierkv_tier_cached_bytes", "tier" => TIER),
            free: gauge!("tierkv_tier_free_bytes", "tier" => TIER),
            objects: gauge!("tierkv_tier_objects", "tier" => TIER),
            leases: gauge!("tierkv_l1_leases_active"),
            arc_order: gauge!(tierkv_tier_metrics::ARC_ORDER, "tier" => TIER),
            frequency_order: gauge!(tierkv_tier_metrics::FREQUENCY_ORDER, "tier" => TIER),
            evicted_on_demand: counter!("tierkv_evictions_total", "tier" => TIER, "reason" => "on_demand"),
            evicted_watermark: counter!("tierkv_evictions_total", "tier" => TIER, "reason" => "watermark"),
            evicted_stop: counter!("tierkv_evictions_total", "tier" => TIER, "reason" => "stop"),
            evicted_write_back: counter!("tierkv_evictions_total", "tier" => TIER, "reason" => "write_back"),
            lease_expiries: counter!("tierkv_lease_expiries_total", "tier" => TIER),
            writes_finished: counter!("tierkv_l1_writes_finished_total"),
            read_shares: counter!("tierkv_l1_read_shares_total"),
            demoter_panics: counter!("tierkv_errors_total", "tier" => TIER, "reason" => "demoter_panic"),
            key_errors,
            request_errors,
        }
    }

    /// Sets the gauges: `[arc, frequency]` are the shares of index shards whose policy evicts
    /// in ARC's order and by use counts.
    pub(crate) fn publish(&self, usage: &crate::Usage, leases: u64, [arc, frequency]: [f64; 2]) {
        self.capacity.set(usage.capacity_bytes as f64);
        // `Usage::used_bytes` is what cannot be evicted; the shared gauge counts every state.
        self.used.set(usage.used_bytes.saturating_add(usage.cached_bytes) as f64);
        self.pinned.set(usage.used_bytes as f64);
        self.cached.set(usage.cached_bytes as f64);
        self.free.set(usage.free_bytes as f64);
        self.objects.set((usage.writing + usage.leased + usage.cached) as f64);
        self.leases.set(leases as f64);
        self.arc_order.set(arc);
        self.frequency_order.set(frequency);
    }

    pub(crate) fn evicted(&self, reason: EvictionReason, n: usize) {
        match reason {
            EvictionReason::OnDemand => self.evicted_on_demand.increment(n as u64),
            EvictionReason::Watermark => self.evicted_watermark.increment(n as u64),
            EvictionReason::Stop => self.evicted_stop.increment(n as u64),
            EvictionReason::WriteBack => self.evicted_write_back.increment(n as u64),
        }
    }

    pub(crate) fn lease_expired(&self) {
        self.lease_expiries.increment(1);
    }

    pub(crate) fn writes_finished(&self, n: usize) {
        self.writes_finished.increment(n as u64);
    }

    pub(crate) fn read_shares(&self, n: u64) {
        self.read_shares.increment(n);
    }

    pub(crate) fn demoter_panicked(&self) {
        self.demoter_panics.increment(1);
    }

    pub(crate) fn key_error(&self, error: KeyError) {
        if let Some((_, c)) = self.key_errors.iter().find(|(e, _)| *e == error) {
            c.increment(1);
        }
    }

    pub(crate) fn request_error(&self, error: &L1Error) {
        if let L1Error::Key { error, .. } = error {
            return self.key_error(*error);
        }
        let reason = error.reason();
        if let Some((_, c)) = self.request_errors.iter().find(|(r, _)| *r == reason) {
            c.increment(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use tierkv_core::{ChunkHash, KvRank, Namespace, ObjectKey};

    use super::*;
    use crate::device::DeviceError;
    use crate::lease::LeaseId;

    /// One error of every kind. `kind` numbers the kinds with a match that stops compiling when
    /// one is added, and the test checks each number has its example: a new kind cannot be
    /// missed here.
    fn one_of_each() -> Vec<L1Error> {
        let key = ObjectKey::new(Namespace::new("m", ""), ChunkHash(1), KvRank::Shared);
        let lease = LeaseId(1);
        vec![
            L1Error::Config(String::new()),
            L1Error::Device(DeviceError::CudaUnavailable(String::new())),
            L1Error::LayoutTooLarge { layout_bytes: 2, slot_bytes: 1 },
            L1Error::UnknownLease(lease),
            L1Error::LeaseExpired(lease),
            L1Error::LeaseReleased(lease),
            L1Error::NoSuchReader { lease, reader: 1, readers: 1 },
            L1Error::AlreadyReleased { lease, reader: 0, key },
            L1Error::EmptyRelease(lease),
            L1Error::NotLeased { lease, key, error: KeyError::NotFound },
            L1Error::Key { key, error: KeyError::NotFound },
            L1Error::OutOfRange { offset: 0, len: 2, object: 1 },
        ]
    }

    fn kind(error: &L1Error) -> usize {
        match error {
            L1Error::Config(_) => 0,
            L1Error::Device(_) => 1,
            L1Error::LayoutTooLarge { .. } => 2,
            L1Error::UnknownLease(_) => 3,
            L1Error::LeaseExpired(_) => 4,
            L1Error::LeaseReleased(_) => 5,
            L1Error::NoSuchReader { .. } => 6,
            L1Error::AlreadyReleased { .. } => 7,
            L1Error::EmptyRelease(_) => 8,
            L1Error::NotLeased { .. } => 9,
            L1Error::Key { .. } => 10,
            L1Error::OutOfRange { .. } => 11,
        }
    }

    #[test]
    fn every_reason_an_l1_request_is_refused_for_has_a_counter() {
        let errors = one_of_each();
        let kinds: std::collections::BTreeSet<usize> = errors.iter().map(kind).collect();
        assert_eq!(kinds, (0..12).collect(), "one example of every kind");
        for error in &errors {
            let reason = error.reason();
            match error {
                // Refused at construction, before the L1 counts anything.
                L1Error::Config(_) => {}
                // Counted as the key's own refusal.
                L1Error::Key { error, .. } => assert!(KeyError::ALL.contains(error), "{reason}"),
                _ => assert!(REQUEST_ERRORS.contains(&reason), "{reason} has no counter"),
            }
        }
    }
}
