//! The prefetch pipeline's metrics, registered once through the `metrics` facade.

use metrics::{Counter, Gauge, Unit, counter, describe_counter, describe_gauge, gauge};

use crate::PrefetchError;

pub(crate) struct PrefetchMetrics {
    queue_depth: Gauge,
    in_flight: Gauge,
    requests: Counter,
    loaded_chunks: Counter,
    failed: Counter,
    panics: Counter,
    tier_panics: Counter,
    late: Counter,
}

impl PrefetchMetrics {
    pub(crate) fn register() -> Self {
        describe_gauge!(
            "tierkv_prefetch_queue_depth",
            Unit::Count,
            "Prefetch requests waiting to start."
        );
        describe_gauge!(
            "tierkv_prefetch_in_flight",
            Unit::Count,
            "Prefetch requests being worked on."
        );
        describe_counter!(
            "tierkv_prefetch_requests_total",
            Unit::Count,
            "Prefetch requests started."
        );
        describe_counter!(
            "tierkv_prefetch_loaded_chunks_total",
            Unit::Count,
            "Chunks promoted from a lower tier into an L1 lease."
        );
        describe_counter!(
            "tierkv_errors_total",
            Unit::Count,
            "Refused requests and keys, by tier and reason."
        );
        PrefetchMetrics {
            queue_depth: gauge!("tierkv_prefetch_queue_depth"),
            in_flight: gauge!("tierkv_prefetch_in_flight"),
            requests: counter!("tierkv_prefetch_requests_total"),
            loaded_chunks: counter!("tierkv_prefetch_loaded_chunks_total"),
            failed: counter!("tierkv_errors_total", "tier" => "prefetch", "reason" => "prefetch_failed"),
            panics: counter!("tierkv_errors_total", "tier" => "prefetch", "reason" => "prefetch_panic"),
            tier_panics: counter!("tierkv_errors_total", "tier" => "prefetch", "reason" => "tier_panic"),
            late: counter!("tierkv_errors_total", "tier" => "prefetch", "reason" => "late_completion"),
        }
    }

    pub(crate) fn queues(&self, pending: usize, active: usize) {
        self.queue_depth.set(pending as f64);
        self.in_flight.set(active as f64);
    }

    pub(crate) fn started(&self) {
        self.requests.increment(1);
    }

    pub(crate) fn finished(&self, loaded: u64) {
        self.loaded_chunks.increment(loaded);
    }

    /// Counts a request that ended in an error other than the controller's stop.
    pub(crate) fn ended<T>(&self, outcome: &Result<T, PrefetchError>) {
        if matches!(outcome, Err(e) if *e != PrefetchError::Stopped) {
            self.failed.increment(1);
        }
    }

    pub(crate) fn panicked(&self) {
        self.panics.increment(1);
    }

    /// A lower tier panicked in a call from the controller.
    pub(crate) fn tier_panicked(&self) {
        self.tier_panics.increment(1);
    }

    pub(crate) fn late_completion(&self) {
        self.late.increment(1);
    }
}
