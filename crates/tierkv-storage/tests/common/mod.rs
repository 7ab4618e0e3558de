//! What the StorageManager test files share: 16 KiB chunks, one owner, and an emulated L1 of a
//! given number of slots.

#![allow(dead_code, reason = "each test binary uses a different part of the fixture")]

use std::time::Duration;

use tierkv_core::Layout;
use tierkv_l1::{DeviceKind, L1Config, OwnerId};

pub const CHUNK: u64 = 16 << 10;
pub const OWNER: OwnerId = OwnerId(3);
pub const WAIT: Duration = Duration::from_secs(20);

pub fn layout() -> Layout {
    Layout::bytes(CHUNK).unwrap()
}

/// An emulated L1 of `slots` chunks.
pub fn l1_config(slots: u64) -> L1Config {
    L1Config { device: DeviceKind::Emulated, ..L1Config::new(slots * CHUNK, CHUNK) }
}

/// What a debugging recorder's snapshot holds (taking one drains the counters).
pub type Seen = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    metrics_util::debugging::DebugValue,
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
        .map(|(.., v)| if let metrics_util::debugging::DebugValue::Counter(n) = v { *n } else { 0 })
        .sum()
}

/// `tierkv_errors_total{tier="l1",reason="out_of_memory"}` in `seen`: the keys L1 refused for
/// want of room.
pub fn l1_out_of_memory(seen: &Seen) -> u64 {
    counter(seen, "tierkv_errors_total", &[("tier", "l1"), ("reason", "out_of_memory")])
}
