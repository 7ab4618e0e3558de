//! What the remote tier's test binaries share: key prefixes of their own, and the tier's
//! metrics read back from a recorder local to the test.

#![allow(dead_code, reason = "each test binary uses its own part of this module")]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tierkv_remote::{RemoteConfig, RemoteStore};

/// A key prefix no other test (or test process) uses.
pub fn unique_prefix(name: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("test-{name}-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// `open()` with a recorder of its own in place: what it opens registers its metrics there, and
/// the snapshotter reads them (this test's alone, whatever other tests run beside it).
pub fn recorded<T>(open: impl FnOnce() -> T) -> (T, Snapshotter) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    (metrics::with_local_recorder(&recorder, open), snapshotter)
}

/// A store opened on `config` with a recorder of its own ([`recorded`]).
pub fn open_recorded(config: RemoteConfig) -> (Arc<RemoteStore>, Snapshotter) {
    recorded(|| Arc::new(RemoteStore::open(config).unwrap()))
}

/// The remote tier's counters and gauges in one snapshot (a snapshot drains the counters), by
/// name and `reason` label ("" where there is none).
#[derive(Debug)]
pub struct Seen(std::collections::HashMap<(String, String), f64>);

impl Seen {
    pub fn take(snapshotter: &Snapshotter) -> Self {
        let mut seen = std::collections::HashMap::new();
        for (k, _, _, v) in snapshotter.snapshot().into_vec() {
            let key = k.key();
            let label =
                |name: &str| key.labels().find(|l| l.key() == name).map(|l| l.value().to_string());
            if label("tier").is_some_and(|t| t != "remote") {
                continue;
            }
            let value = match v {
                DebugValue::Counter(n) => n as f64,
                DebugValue::Gauge(g) => g.into_inner(),
                DebugValue::Histogram(_) => continue,
            };
            *seen
                .entry((key.name().to_string(), label("reason").unwrap_or_default()))
                .or_insert(0.0) += value;
        }
        Seen(seen)
    }

    pub fn get(&self, name: &str, reason: &str) -> f64 {
        self.0.get(&(name.to_string(), reason.to_string())).copied().unwrap_or(0.0)
    }

    /// `name` over every reason.
    #[allow(dead_code, reason = "not every test binary sums over reasons")]
    pub fn total(&self, name: &str) -> f64 {
        self.0.iter().filter(|((n, _), _)| n == name).map(|(_, v)| v).sum()
    }
}
