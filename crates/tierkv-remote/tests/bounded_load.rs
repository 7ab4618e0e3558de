//! A load reads at most the value it expects: a key holding far more than a chunk (a foreign
//! value, or ours grown by a stray `SETRANGE`) is a miss counted by reason, and the process's
//! memory does not grow by that value's size. Its own test binary, with a counting allocator, so
//! the peak of live heap bytes during the load is this test's alone.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tierkv_remote::format::{HEADER_BYTES, redis_key};
use tierkv_remote::{RemoteConfig, RemoteMode};
use tierkv_testkit::contract::{SharedTier, keys};
use tierkv_testkit::redis::RedisStandalone;
use tierkv_testkit::require_redis;

mod common;
use common::{Seen, open_recorded, unique_prefix};

/// The system allocator, counting the bytes live now and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed on to the system allocator unchanged; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `alloc`'s contract, which `System.alloc` shares.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller upholds `realloc`'s contract, which `System.realloc` shares.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let grown = new_size - layout.size();
                let live = LIVE.fetch_add(grown, Ordering::Relaxed) + grown;
                PEAK.fetch_max(live, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const CHUNK: u64 = 64 << 10;
/// What the oversized keys hold: a thousand chunks.
const HUGE: u64 = 64 << 20;

#[test]
fn an_oversized_value_is_a_miss_that_reads_no_more_than_a_chunk() {
    require_redis!();
    let server = RedisStandalone::start(&[]);
    let prefix = unique_prefix("bounded");
    let (store, snapshotter) = open_recorded(RemoteConfig {
        key_prefix: prefix.clone(),
        op_timeout: Duration::from_secs(5),
        ..RemoteConfig::new(vec![server.url()], RemoteMode::Standalone, CHUNK)
    });
    let tier = SharedTier::new(store, CHUNK);
    let all = keys(0..3);
    tier.store(&all).unwrap();
    assert_eq!(tier.load_verified(&all).count_ones(), 3);

    // Key 0: our own value, grown by 64 MiB of zeros past its end (its header and payload
    // intact). Key 1: a foreign value of 64 MiB under our key. Written by redis-cli, so the
    // bytes are the server's, not this process's.
    let name = |i: usize| redis_key(&prefix, &all[i]);
    let end = HUGE.to_string();
    assert_eq!(server.node.cli(&["SETRANGE", &name(0), &end, "x"]), (HUGE + 1).to_string());
    assert_eq!(server.node.cli(&["DEL", &name(1)]), "1");
    assert_eq!(server.node.cli(&["SETRANGE", &name(1), &end, "x"]), (HUGE + 1).to_string());

    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let loaded = tier.load_verified(&all);
    let grown = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    assert_eq!(loaded.iter_ones().collect::<Vec<_>>(), [2], "only the intact value loads");
    // Three sinks and three reads of a chunk each, and some slack for the runtime; a read of
    // either whole value alone would be 64 MiB.
    assert!(
        grown < 8 << 20,
        "the load's heap grew by {grown} bytes: it read an oversized value whole"
    );

    let seen = Seen::take(&snapshotter);
    assert_eq!(seen.get("tierkv_errors_total", "wrong_length"), 1.0);
    assert_eq!(seen.get("tierkv_errors_total", "bad_header"), 1.0);

    // The value of exactly the expected length still loads: the bound is not one byte short.
    let exact = server.node.cli(&["STRLEN", &name(2)]);
    assert_eq!(exact, (HEADER_BYTES as u64 + CHUNK).to_string());
}
