//! tierkv-testkit: what the tier and pipeline tests share.
//!
//! - [`FakeTier`]: an in-memory [`TierAdapter`] whose failures and timing a test controls (loads
//!   that fail for chosen keys, tasks held in flight until released or closed). The pipeline
//!   tests use it only where a scenario needs an injected failure; everything else runs on the
//!   real tiers.
//! - [`contract`]: the adapter contract (CONFORMANCE C1-C8) written once, and
//!   [`tier_contract_tests!`] to run it against an implementation.
//! - [`redis`]: a real Redis Cluster (3 masters, 3 replicas) or standalone server on loopback
//!   ports, for the remote tier's tests.
//! - [`eventually`]: waits for a condition another thread makes true, a hang being a failure.
//! - [`cannot_mount`]: what a test that needs mounts (a tmpfs, an ext4 image on a loop device)
//!   does where it cannot have them.
//!
//! Test code only: nothing outside `[dev-dependencies]` may depend on this crate.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test support: a failure is a failed test"
)]

pub mod contract;
mod fake;
pub mod redis;

pub use fake::FakeTier;

#[doc(hidden)]
pub use tierkv_core::TierAdapter;

/// A test that needs mounts (root's tmpfs, an ext4 image on a loop device, `filefrag`) cannot
/// have them here, for `why`: it skips, saying so, unless `TIERKV_MOUNTS=1` (which `.ci/run`
/// sets where a probe mount works) makes that a failure, so such tests never pass untested
/// where they could run.
pub fn cannot_mount(why: &str) {
    if std::env::var("TIERKV_MOUNTS").is_ok_and(|v| v == "1") {
        panic!("TIERKV_MOUNTS=1, but {why}");
    }
    eprintln!("SKIPPED: {why}");
}

/// How long [`eventually`] waits: far past anything a healthy test waits for, so reaching it
/// means a hang.
pub const EVENTUALLY: std::time::Duration = std::time::Duration::from_secs(20);

/// Polls `done` until it holds; panics, naming `what`, if it has not after [`EVENTUALLY`].
pub fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + EVENTUALLY;
    while !done() {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
