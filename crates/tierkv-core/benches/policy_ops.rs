//! What an eviction policy costs per chunk access: each policy serves the same stream of chunk
//! keys as a bounded cache (a hit is a `touch`, a miss evicts one victim when full and
//! `insert`s), next to the least any cache must do per access, measured in the same run: one
//! `HashMap` lookup and one insert or remove. Run with
//! `cargo bench -p tierkv-core --bench policy_ops`.
//!
//! The stream mixes what the daemon sees: a hot set of shared roots, conversations that come
//! back, and one-off tails, with a working set three times the capacity.
//!
//! Two more rows: the adaptive policy as a tier below L1 runs it under the cascade, following a
//! judge's order; and that judge, told every access, as the StorageManager tells it every
//! lookup's chunks (its cost per chunk looked up; it caches nothing). Then two threads telling
//! one judge their lookups at once, doing nothing else: behind a plain mutex, and as the
//! [`SharedJudge`] the StorageManager holds, with what each lookup waited and the sampled chunks
//! the shared judge dropped for being that far behind.
//!
//! The disk's policies order segments, not keys: the same stream then goes through a log of
//! segments of four chunks (a hit is `hit`, a miss is `missed` and an append; a full segment is
//! sealed, and a whole segment is evicted when no segment is free), next to the same log
//! evicting its oldest segment with no policy.

#![allow(clippy::print_stdout, reason = "the summary table is the benchmark's output")]

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tierkv_core::policy::{
    EvictionPolicy, Judge, JudgedOrder, PolicyKind, SegmentPolicy, SharedJudge,
};

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
    run_built(kind.build::<u64>(), keys)
}

/// The adaptive policy of a tier below L1 under the cascade: it follows a judge's order (here
/// always recency) and keeps ARC's lists only.
fn run_follower(keys: &[u64]) -> (Duration, u64) {
    let mut policy = PolicyKind::Adaptive.build::<u64>();
    policy.follow(JudgedOrder::default());
    run_built(policy, keys)
}

/// The judge of the tiers below L1, told every access as the StorageManager tells it every
/// lookup's chunks (tiers of three times the capacity); no hits to count.
fn run_judge(keys: &[u64]) -> (Duration, u64) {
    let mut judge = Judge::<u64>::new(3 * CAPACITY);
    let start = Instant::now();
    for key in keys {
        judge.looked_up(key);
    }
    black_box(judge.order());
    (start.elapsed(), 0)
}

/// Chunks per lookup in the two-thread judge rows.
const LOOKUP_CHUNKS: usize = 64;

/// What two threads telling a judge their lookups at once each wait per lookup: the keys split
/// into lookups of [`LOOKUP_CHUNKS`], every other lookup to each thread, each told through
/// `tell`. Returns the wall time and every lookup's time, sorted.
fn run_two_threads(keys: &[u64], tell: &(dyn Fn(&[u64]) + Sync)) -> (Duration, Vec<Duration>) {
    let lookups: Vec<&[u64]> = keys.chunks(LOOKUP_CHUNKS).collect();
    let start = Instant::now();
    let mut times: Vec<Duration> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..2)
            .map(|t| {
                let lookups = &lookups;
                scope.spawn(move || {
                    lookups
                        .iter()
                        .skip(t)
                        .step_by(2)
                        .map(|lookup| {
                            let asked = Instant::now();
                            tell(lookup);
                            asked.elapsed()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads.into_iter().flat_map(|t| t.join().unwrap_or_default()).collect()
    });
    let wall = start.elapsed();
    times.sort_unstable();
    (wall, times)
}

/// A two-thread judge run: wall time, every lookup's time (sorted), and the sampled keys the
/// judge never heard.
type TwoThreadRun = (Duration, Vec<Duration>, u64);

/// The judge behind a mutex, as the StorageManager held it before: a lookup waits while
/// another's chunks go through it.
fn run_judge_locked(keys: &[u64]) -> TwoThreadRun {
    let judge = Mutex::new(Judge::<u64>::new(3 * CAPACITY));
    let (wall, times) = run_two_threads(keys, &|lookup| {
        let mut judge = judge.lock();
        lookup.iter().for_each(|key| judge.looked_up(key));
    });
    (wall, times, 0)
}

/// The [`SharedJudge`] the StorageManager holds: no lookup waits for another.
fn run_judge_shared(keys: &[u64]) -> TwoThreadRun {
    let judge = SharedJudge::<u64>::new(3 * CAPACITY);
    let dropped = std::sync::atomic::AtomicU64::new(0);
    let (wall, times) = run_two_threads(keys, &|lookup| {
        dropped.fetch_add(judge.looked_up(lookup), std::sync::atomic::Ordering::Relaxed);
    });
    (wall, times, dropped.into_inner())
}

fn run_built(mut policy: Box<dyn EvictionPolicy<u64>>, keys: &[u64]) -> (Duration, u64) {
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
fn run_floor(keys: &[u64]) -> (Duration, u64) {
    let mut map: HashMap<u64, u32> = HashMap::with_capacity(CAPACITY * 2);
    let mut ring = vec![0u64; CAPACITY];
    let mut at = 0usize;
    let mut hits = 0u64;
    let start = Instant::now();
    for key in keys {
        if let Some(count) = map.get_mut(key) {
            *count += 1;
            hits += 1;
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
    (start.elapsed(), hits)
}

/// Chunks per segment in the log.
const PER_SEGMENT: usize = 4;

/// A log of `CAPACITY / PER_SEGMENT` segments serving `keys`, ordered by `policy`, or with
/// `None` by age alone (the oldest sealed segment goes first): the floor for a log.
fn run_log(mut policy: Option<Box<dyn SegmentPolicy<u64, u64>>>, keys: &[u64]) -> (Duration, u64) {
    let segments = CAPACITY / PER_SEGMENT;
    // Each segment's chunks and current life; lives are numbered from 1.
    let mut chunks: Vec<Vec<u64>> =
        (0..segments).map(|_| Vec::with_capacity(PER_SEGMENT)).collect();
    let mut life = vec![0u64; segments];
    let mut segment_of: HashMap<u64, usize> = HashMap::with_capacity(segments * 2);
    let mut at: HashMap<u64, usize> = HashMap::with_capacity(CAPACITY * 2);
    let (mut lives, mut opened, mut active, mut oldest) = (0u64, 0usize, None::<usize>, 0usize);
    let mut hits = 0u64;
    let start = Instant::now();
    for key in keys {
        if let Some(segment) = at.get(key) {
            if let Some(policy) = &mut policy {
                policy.hit(&life[*segment], key);
            }
            hits += 1;
            continue;
        }
        if let Some(policy) = &mut policy {
            policy.missed(key);
        }
        let id = match active {
            Some(id) if chunks[id].len() < PER_SEGMENT => id,
            full => {
                if let (Some(id), Some(policy)) = (full, &mut policy) {
                    policy.seal(life[id]);
                }
                let id = if opened < segments {
                    opened += 1;
                    opened - 1
                } else {
                    let victim = match &mut policy {
                        Some(policy) => {
                            let chunks_of = |l: &u64| {
                                segment_of.get(l).map_or(&[][..], |s| chunks[*s].as_slice())
                            };
                            let victim = policy.evict(&mut |_| true, &chunks_of);
                            victim.and_then(|l| segment_of.get(&l).copied())
                        }
                        None => {
                            let victim = oldest;
                            oldest = (oldest + 1) % segments;
                            Some(victim)
                        }
                    };
                    let Some(victim) = victim else { continue };
                    segment_of.remove(&life[victim]);
                    for chunk in chunks[victim].drain(..) {
                        at.remove(&chunk);
                    }
                    victim
                };
                lives += 1;
                life[id] = lives;
                segment_of.insert(lives, id);
                id
            }
        };
        chunks[id].push(*key);
        at.insert(*key, id);
        active = Some(id);
        if let Some(policy) = &mut policy {
            policy.written(&life[id], key);
        }
    }
    black_box(&at);
    (start.elapsed(), hits)
}

fn main() {
    let keys = stream();
    // Best of three, so a burst of other work on the machine does not decide the figure.
    let best = |run: &dyn Fn() -> (Duration, u64)| {
        (0..3).map(|_| run()).min_by_key(|(d, _)| *d).unwrap_or_default()
    };
    // One row: time and hits of a run against its floor's time.
    let row = |name: &str, (time, hits): (Duration, u64), floor: Duration| {
        println!(
            "{:<24} {:>10.1} {:>10.4} {:>12.2}",
            name,
            time.as_nanos() as f64 / keys.len() as f64,
            hits as f64 / keys.len() as f64,
            time.as_secs_f64() / floor.as_secs_f64()
        );
    };
    let floor = best(&|| run_floor(&keys));
    println!("{ACCESSES} accesses, capacity {CAPACITY} keys");
    println!("{:<24} {:>10} {:>10} {:>12}", "policy", "ns/access", "hit ratio", "vs floor");
    row("floor (HashMap, FIFO)", floor, floor.0);
    for kind in PolicyKind::ALL {
        row(kind.as_str(), best(&|| run_policy(kind, &keys)), floor.0);
    }
    row("adaptive, following", best(&|| run_follower(&keys)), floor.0);
    row("judge (3x capacity)", best(&|| run_judge(&keys)), floor.0);
    println!();
    println!("the judge told lookups of {LOOKUP_CHUNKS} chunks from two threads at once");
    println!(
        "{:<24} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "judge", "ns/chunk", "p50 µs", "p99 µs", "max µs", "unheard"
    );
    for (name, run) in [
        ("behind a mutex", run_judge_locked as fn(&[u64]) -> TwoThreadRun),
        ("shared", run_judge_shared),
    ] {
        let (wall, times, dropped) =
            (0..3).map(|_| run(&keys)).min_by_key(|(wall, ..)| *wall).unwrap_or_default();
        let at = |q: f64| {
            times.get(((times.len() as f64 * q) as usize).min(times.len().saturating_sub(1)))
        };
        let micros = |d: Option<&Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1e6);
        println!(
            "{:<24} {:>10.1} {:>10.2} {:>10.2} {:>10.2} {:>10}",
            name,
            wall.as_nanos() as f64 / keys.len() as f64,
            micros(at(0.5)),
            micros(at(0.99)),
            micros(times.last()),
            dropped,
        );
    }
    let log_floor = best(&|| run_log(None, &keys));
    println!();
    println!("a log of segments of {PER_SEGMENT} chunks, {CAPACITY} chunks in all");
    row("floor (oldest first)", log_floor, log_floor.0);
    for kind in PolicyKind::ALL {
        row(kind.as_str(), best(&|| run_log(Some(kind.build_for_segments()), &keys)), log_floor.0);
    }
}
