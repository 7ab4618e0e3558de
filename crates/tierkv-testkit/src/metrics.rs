//! Counters as a test's debugging recorder saw them.

use metrics_util::debugging::DebugValue;

/// What a debugging recorder's snapshot holds (taking one drains the counters).
pub type Seen = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

/// The sum of counter `name` over the series in `seen` that carry every one of `labels`
/// (`(key, value)` pairs).
pub fn counter(seen: &Seen, name: &str, labels: &[(&str, &str)]) -> u64 {
    seen.iter()
        .filter(|(k, ..)| k.key().name() == name)
        .filter(|(k, ..)| {
            labels.iter().all(|(key, value)| {
                k.key().labels().any(|l| l.key() == *key && l.value() == *value)
            })
        })
        .map(|(.., v)| if let DebugValue::Counter(n) = v { *n } else { 0 })
        .sum()
}
