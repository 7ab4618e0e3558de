//! What an eviction policy costs per chunk access: each policy serves the same stream of chunk
//! keys as a bounded cache (a hit is a `touch`, a miss evicts one victim when full and
//! `insert`s), next to the least any cache must do per access, measured in the same run: one
//! `HashMap` lookup and one insert or remove. Run with
//! `cargo bench -p tierkv-core --bench policy_ops`.
//!
//! The stream mixes what the daemon sees: a hot set of shared roots, conversations that come
//! back, and one-off tails, with a working set three times the capacity.

#![allow(clippy::print_stdout, reason = "the summary table is the benchmark's output")]

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use tierkv_core::policy::PolicyKind;

const CAPACITY: usize = 10_000;
const ACCESSES: usize = 4_000_000;

/// A deterministic stream of chunk keys (xorshift; no dependency).
fn stream() -> Vec<u64> {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut fresh = 1_000_000u64;
    (0..ACCESSES)
        .map(|_| {
            let r = next();
            match r % 10 {
                // Shared roots: 500 keys used all the time.
                0..=2 => (r >> 8) % 500,
                // Conversations that come back: 30,000 keys.
                3..=6 => 1_000 + (r >> 8) % 30_000,
                // One-off tails.
                _ => {
                    fresh += 1;
                    fresh
                }
            }
        })
        .map(|k| k.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect()
}

fn run_policy(kind: PolicyKind, keys: &[u64]) -> (Duration, u64) {
    let mut policy = kind.build::<u64>();
    let mut hits = 0u64;
    let start = Instant::now();
    for key in keys {
        if policy.contains(key) {
            policy.touch(key);
            hits += 1;
        } else {
            if policy.len() >= CAPACITY {
                black_box(policy.evict(1, &mut |_| true));
            }
            policy.insert(*key);
        }
    }
    (start.elapsed(), hits)
}

/// The floor: a map of present keys with FIFO replacement, one lookup and at most one insert and
/// one remove per access, no ordering work.
fn run_floor(keys: &[u64]) -> Duration {
    let mut map: HashMap<u64, u32> = HashMap::with_capacity(CAPACITY * 2);
    let mut ring = vec![0u64; CAPACITY];
    let mut at = 0usize;
    let start = Instant::now();
    for key in keys {
        if let Some(count) = map.get_mut(key) {
            *count += 1;
        } else {
            if map.len() >= CAPACITY {
                map.remove(&ring[at]);
            }
            ring[at] = *key;
            at = (at + 1) % CAPACITY;
            map.insert(*key, 0);
        }
    }
    black_box(&map);
    start.elapsed()
}

fn main() {
    let keys = stream();
    let per_access = |d: Duration| d.as_nanos() as f64 / keys.len() as f64;
    // Best of three, so a burst of other work on the machine does not decide the figure.
    let floor = (0..3).map(|_| run_floor(&keys)).min().unwrap_or_default();
    println!("{ACCESSES} accesses, capacity {CAPACITY} keys");
    println!("{:<24} {:>10} {:>10} {:>12}", "policy", "ns/access", "hit ratio", "vs floor");
    println!(
        "{:<24} {:>10.1} {:>10} {:>12}",
        "floor (HashMap, FIFO)",
        per_access(floor),
        "",
        "1.00"
    );
    for kind in PolicyKind::ALL {
        let runs: Vec<(Duration, u64)> = (0..3).map(|_| run_policy(kind, &keys)).collect();
        let (time, hits) = runs.iter().min_by_key(|(d, _)| *d).copied().unwrap_or_default();
        println!(
            "{:<24} {:>10.1} {:>10.4} {:>12.2}",
            kind.as_str(),
            per_access(time),
            hits as f64 / keys.len() as f64,
            time.as_secs_f64() / floor.as_secs_f64()
        );
    }
}
