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
//! - [`metrics::counter`]: a counter as a test's debugging recorder saw it.
//! - [`eventually`]: waits for a condition another thread makes true, a hang being a failure.
//! - [`may_run_as`]: whether a test may start a process as another user, skipping where not.
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
pub mod metrics;
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

/// Whether a test may run `probe` (a program it will start again) as another user, `uid`: only
/// root may, and only where that user can reach and run the program (a checkout under a
/// directory only root enters cannot). Where it may not, the test skips, saying why, unless
/// `TIERKV_OTHER_USERS=1` (which `.ci/run` sets when it runs as root) makes that a failure, so
/// such tests never pass untested where they could run.
pub fn may_run_as(uid: u32, mut probe: std::process::Command) -> bool {
    use std::os::unix::process::CommandExt;

    let strict = std::env::var("TIERKV_OTHER_USERS").is_ok_and(|v| v == "1");
    let skip = |why: String| {
        assert!(!strict, "TIERKV_OTHER_USERS=1, but {why}");
        eprintln!("SKIPPED: {why}");
        false
    };
    // SAFETY: geteuid only reads the process's credentials.
    if unsafe { libc::geteuid() } != 0 {
        return skip(format!("not root, so nothing can be started as uid {uid}"));
    }
    probe.uid(uid).gid(uid).stdin(std::process::Stdio::null());
    probe.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    match probe.status() {
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            let program = probe.get_program().to_string_lossy().into_owned();
            skip(format!("uid {uid} cannot run {program}: {e}"))
        }
        Err(e) => panic!("starting {:?} as uid {uid}: {e}", probe.get_program()),
    }
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
