//! The storage layer's metrics: lookups and hits per tier, the store pipeline, background work.

use metrics::{Counter, Unit, counter, describe_counter};
use parking_lot::Mutex;

/// Lookup totals since the manager started, kept beside the counters so a status request can
/// report hit ratios without reading the metrics exporter back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LookupTotals {
    /// Lookups completed.
    pub lookups: u64,
    /// Chunks asked for (the denominator of the hit ratio).
    pub requested_chunks: u64,
    /// Tokens asked for.
    pub requested_tokens: u64,
    /// Chunks of hits, by the tier that served them: L1, then the lower tiers fastest first.
    pub hit_chunks: Vec<u64>,
    /// Tokens of hits, by tier as `hit_chunks`.
    pub hit_tokens: Vec<u64>,
}

/// The tiers a hit can come from, as metric labels: L1, then the lower tiers by name.
pub(crate) struct StorageMetrics {
    lookups: Counter,
    requested_chunks: Counter,
    requested_tokens: Counter,
    hit_chunks: Vec<(String, Counter)>,
    hit_tokens: Vec<(String, Counter)>,
    held_below: Counter,
    store_chunks: Counter,
    store_failures: Vec<(String, Counter)>,
    store_panics: Counter,
    demotions_dropped: Counter,
    demotion_copies_failed: Counter,
    store_timeouts: Counter,
    store_expired: Counter,
    maintenance_panics: Counter,
    judge_samples_dropped: Counter,
    totals: Mutex<LookupTotals>,
}

impl StorageMetrics {
    /// Registers the metrics; `tiers` are the lower tiers' names, fastest first.
    pub(crate) fn register(tiers: &[String]) -> Self {
        describe_counter!("tierkv_lookups_total", Unit::Count, "Lookups completed.");
        describe_counter!(
            "tierkv_lookup_requested_chunks_total",
            Unit::Count,
            "Chunks asked for by lookups (the denominator of the hit rate)."
        );
        describe_counter!(
            "tierkv_lookup_requested_tokens_total",
            Unit::Count,
            "Tokens asked for by lookups."
        );
        describe_counter!(
            "tierkv_lookup_hit_chunks_total",
            Unit::Count,
            "Chunks of lookup hits, by the tier that served them."
        );
        describe_counter!(
            "tierkv_lookup_hit_tokens_total",
            Unit::Count,
            "Tokens of lookup hits, by the tier that served them."
        );
        describe_counter!(
            "tierkv_lookup_held_below_l1_chunks_total",
            Unit::Count,
            "Chunks of lookup hits L1 had no room for, read from their lower tier by each reader \
             (a steady rate says L1 is small for the hits)."
        );
        describe_counter!(
            "tierkv_store_chunks_total",
            Unit::Count,
            "Chunks submitted by the store pipeline to a lower tier."
        );
        describe_counter!(
            "tierkv_judge_samples_dropped_total",
            Unit::Count,
            "Sampled lookup chunks the judge of the tiers below L1 never heard because it was \
             thousands behind (a steady rate says the judge is a bottleneck; it then judges on a \
             thinner sample)."
        );
        let all: Vec<String> =
            std::iter::once("l1".to_string()).chain(tiers.iter().cloned()).collect();
        let per_tier = |name: &'static str| -> Vec<(String, Counter)> {
            all.iter().map(|t| (t.clone(), counter!(name, "tier" => t.clone()))).collect()
        };
        StorageMetrics {
            lookups: counter!("tierkv_lookups_total"),
            requested_chunks: counter!("tierkv_lookup_requested_chunks_total"),
            requested_tokens: counter!("tierkv_lookup_requested_tokens_total"),
            hit_chunks: per_tier("tierkv_lookup_hit_chunks_total"),
            hit_tokens: per_tier("tierkv_lookup_hit_tokens_total"),
            held_below: counter!("tierkv_lookup_held_below_l1_chunks_total"),
            store_chunks: counter!("tierkv_store_chunks_total"),
            store_failures: tiers
                .iter()
                .map(|t| (t.clone(), counter!("tierkv_errors_total", "tier" => t.clone(), "reason" => "store_failed")))
                .collect(),
            store_panics: counter!("tierkv_errors_total", "tier" => "storage", "reason" => "store_panic"),
            demotions_dropped: counter!("tierkv_errors_total", "tier" => "storage", "reason" => "demotion_dropped"),
            demotion_copies_failed: counter!("tierkv_errors_total", "tier" => "l1", "reason" => "demotion_copy_failed"),
            store_timeouts: counter!("tierkv_errors_total", "tier" => "storage", "reason" => "store_timeout"),
            store_expired: counter!("tierkv_errors_total", "tier" => "l1", "reason" => "store_lease_expired"),
            maintenance_panics: counter!("tierkv_errors_total", "tier" => "storage", "reason" => "maintenance_panic"),
            judge_samples_dropped: counter!("tierkv_judge_samples_dropped_total"),
            totals: Mutex::new(LookupTotals {
                hit_chunks: vec![0; all.len()],
                hit_tokens: vec![0; all.len()],
                ..LookupTotals::default()
            }),
        }
    }

    /// A lookup completed: `hits[t]` chunks came from tier `t` (0 = L1), `held_below` of them
    /// stay in their tier for want of L1 room.
    pub(crate) fn lookup(&self, requested: u64, hits: &[u64], held_below: u64, chunk_tokens: u64) {
        self.lookups.increment(1);
        self.held_below.increment(held_below);
        self.requested_chunks.increment(requested);
        self.requested_tokens.increment(requested * chunk_tokens);
        for ((_, chunks), ((_, tokens), n)) in
            self.hit_chunks.iter().zip(self.hit_tokens.iter().zip(hits))
        {
            chunks.increment(*n);
            tokens.increment(n * chunk_tokens);
        }
        let mut totals = self.totals.lock();
        totals.lookups += 1;
        totals.requested_chunks += requested;
        totals.requested_tokens += requested * chunk_tokens;
        for (t, n) in hits.iter().enumerate().take(totals.hit_chunks.len()) {
            totals.hit_chunks[t] += n;
            totals.hit_tokens[t] += n * chunk_tokens;
        }
    }

    /// The lookup totals so far.
    pub(crate) fn totals(&self) -> LookupTotals {
        self.totals.lock().clone()
    }

    pub(crate) fn store_submitted(&self, chunks: u64) {
        self.store_chunks.increment(chunks);
    }

    pub(crate) fn store_failed(&self, tier: &str) {
        if let Some((_, c)) = self.store_failures.iter().find(|(t, _)| t == tier) {
            c.increment(1);
        }
    }

    pub(crate) fn store_panic(&self) {
        self.store_panics.increment(1);
    }

    /// A cascade victim dropped instead of demoted: too many demoted bytes were on their way.
    pub(crate) fn demotion_dropped(&self) {
        self.demotions_dropped.increment(1);
    }

    /// A cascade victim lost: its bytes could not be copied out of its L1 slot.
    pub(crate) fn demotion_copy_failed(&self) {
        self.demotion_copies_failed.increment(1);
    }

    /// A store batch given up on: a lower tier did not answer within `store_timeout`.
    pub(crate) fn store_timed_out(&self) {
        self.store_timeouts.increment(1);
    }

    pub(crate) fn store_lease_expired(&self) {
        self.store_expired.increment(1);
    }

    pub(crate) fn maintenance_panic(&self) {
        self.maintenance_panics.increment(1);
    }

    /// `n` sampled chunks of a lookup that the judge of the tiers below will never hear.
    pub(crate) fn judge_samples_dropped(&self, n: u64) {
        // Nearly always none: no write to the shared counter on every lookup then.
        if n > 0 {
            self.judge_samples_dropped.increment(n);
        }
    }
}
