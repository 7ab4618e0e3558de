//! A value that fails verification is a miss counted every time, and logged at most once a
//! while: a tenant that loads damaged keys in a loop does not fill the log. Its own test binary,
//! since it installs the process's log subscriber (the tier logs from its runtime's threads).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

use std::io::Write;

use parking_lot::Mutex;
use tierkv_remote::format::{HEADER_BYTES, redis_key};
use tierkv_remote::{RemoteConfig, RemoteMode};
use tierkv_testkit::contract::{SharedTier, keys};
use tierkv_testkit::redis::RedisStandalone;
use tierkv_testkit::require_redis;

mod common;
use common::{Seen, open_recorded, unique_prefix};

const CHUNK: u64 = 4 << 10;

/// Every line the process logged.
static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct Captured;

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOG.lock().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn values_that_fail_verification_are_all_counted_and_logged_once_a_while() {
    require_redis!();
    tracing_subscriber::fmt().with_writer(|| Captured).with_ansi(false).init();
    let server = RedisStandalone::start(&[]);
    let prefix = unique_prefix("logged");
    let (store, snapshotter) = open_recorded(RemoteConfig {
        key_prefix: prefix.clone(),
        ..RemoteConfig::new(vec![server.url()], RemoteMode::Standalone, CHUNK)
    });
    let tier = SharedTier::new(store, CHUNK);
    let all = keys(0..20);
    tier.store(&all).unwrap();
    // A byte of every payload overwritten: each value fails its checksum.
    let at = (HEADER_BYTES + 100).to_string();
    for key in &all {
        server.node.cli(&["SETRANGE", &redis_key(&prefix, key), &at, "\x01\x02\x03"]);
    }
    for _ in 0..5 {
        assert_eq!(tier.load_verified(&all).count_ones(), 0);
    }

    let failures = Seen::take(&snapshotter).get("tierkv_checksum_failures_total", "");
    assert_eq!(failures, 100.0, "every failed verification counts");
    let log = String::from_utf8_lossy(&LOG.lock()).into_owned();
    let warnings = log.matches("failed verification").count();
    assert_eq!(warnings, 1, "100 failed verifications logged {warnings} times:\n{log}");
}
