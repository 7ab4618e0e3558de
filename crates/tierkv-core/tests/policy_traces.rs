//! Replays the Mooncake traces against both policies as a prefix cache of KV blocks.
//!
//! Each trace line is one request whose `hash_ids` name its 512-token blocks; an id is a hash of
//! the whole prefix up to and including its block, so a block is only useful after all the blocks
//! before it. The simulated cache holds `capacity` blocks. For each request:
//! - its hits are the leading run of its blocks that are cached (a prefix hit);
//! - the hit blocks are touched, then each later block that is not cached is inserted, both in
//!   the replay's order (below); before an insert into a full cache, one block is evicted, with
//!   every block eligible. Later blocks that are still cached are neither hits nor touched: their
//!   prefix is gone, so the request recomputes them.
//!
//! The hit ratio is hit blocks over requested blocks across the whole trace, with no warm-up.
//!
//! LRU touches and inserts a request's blocks in request order, root first. This reproduces the
//! reference table below to all four decimals. So does also touching the later blocks that are
//! still cached; counting every cached block as a hit, prefix or not, or replaying leaf first,
//! lands within 0.0016 of it, so the 0.005 tolerance cannot tell those definitions apart.
//!
//! S3-FIFO replays leaf first, from a request's last block to its first. Its small FIFO evicts in insertion order,
//! so a chain then loses its tail before its root and keeps a usable prefix; its touches only
//! count uses, so their order does not matter. LRU gains almost nothing from the same order: the
//! test replays it leaf first too and requires S3-FIFO to beat both.

use std::time::Instant;

use serde::Deserialize;
use tierkv_core::policy::{EvictionPolicy, PolicyKind};

const TRACE_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/traces/mooncake/");

/// Cache sizes in blocks at which S3-FIFO must beat LRU.
const CAPACITIES: [usize; 4] = [1_000, 5_859, 10_000, 30_000];

/// The reference LRU hit ratios, by trace and then by capacity; a replay must agree within 0.005.
const LRU_REFERENCE: [(&str, [(usize, f64); 5]); 2] = [
    (
        "conversation_trace.jsonl",
        [(1_000, 0.0445), (5_859, 0.1355), (10_000, 0.2112), (30_000, 0.3257), (50_000, 0.3546)],
    ),
    (
        "synthetic_trace.jsonl",
        [(1_000, 0.0825), (5_859, 0.3094), (10_000, 0.4235), (30_000, 0.6242), (50_000, 0.6396)],
    ),
];

/// One trace line; the other fields do not matter to a block cache.
#[derive(Deserialize)]
struct Request {
    hash_ids: Vec<u64>,
}

/// The order in which a request's missing blocks enter the cache.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Order {
    RootFirst,
    LeafFirst,
}

/// One replay to run.
#[derive(Clone, Copy, Debug)]
struct Run {
    trace: usize,
    kind: PolicyKind,
    order: Order,
    capacity: usize,
}

/// Reads a trace's requests, or `None` if the file is absent.
fn load(name: &str) -> Option<Vec<Vec<u64>>> {
    let text = match std::fs::read_to_string(format!("{TRACE_DIR}{name}")) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => panic!("cannot read {name}: {e}"),
    };
    let requests = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| match serde_json::from_str::<Request>(line) {
            Ok(request) => request.hash_ids,
            Err(e) => panic!("{name}: malformed line {line:?}: {e}"),
        })
        .collect();
    Some(requests)
}

/// The prefix hit ratio of `requests` replayed against a cache of `capacity` blocks.
fn hit_ratio(kind: PolicyKind, order: Order, capacity: usize, requests: &[Vec<u64>]) -> f64 {
    let mut policy: Box<dyn EvictionPolicy<u64>> = kind.build();
    let (mut hits, mut blocks) = (0usize, 0usize);
    for request in requests {
        let run = request.iter().take_while(|block| policy.contains(block)).count();
        hits += run;
        blocks += request.len();
        let (hit, missed) = request.split_at(run);
        match order {
            Order::RootFirst => hit.iter().for_each(|block| policy.touch(block)),
            Order::LeafFirst => hit.iter().rev().for_each(|block| policy.touch(block)),
        }
        let mut insert = |block: &u64| {
            if !policy.contains(block) {
                if policy.len() >= capacity {
                    assert_eq!(policy.evict(1, &mut |_| true).len(), 1);
                }
                policy.insert(*block);
            }
        };
        match order {
            Order::RootFirst => missed.iter().for_each(&mut insert),
            Order::LeafFirst => missed.iter().rev().for_each(&mut insert),
        }
        assert!(policy.len() <= capacity);
    }
    hits as f64 / blocks as f64
}

#[test]
fn s3fifo_beats_lru_on_the_mooncake_traces() {
    let started = Instant::now();
    let mut traces = vec![];
    for (name, _) in LRU_REFERENCE {
        match load(name) {
            Some(requests) => traces.push(requests),
            None => {
                println!("skipping the trace replay: {TRACE_DIR}{name} is absent");
                return;
            }
        }
    }

    let mut runs = vec![];
    for (trace, (_, reference)) in LRU_REFERENCE.iter().enumerate() {
        for &(capacity, _) in reference {
            runs.push(Run { trace, kind: PolicyKind::Lru, order: Order::RootFirst, capacity });
            runs.push(Run { trace, kind: PolicyKind::Lru, order: Order::LeafFirst, capacity });
            runs.push(Run { trace, kind: PolicyKind::S3Fifo, order: Order::LeafFirst, capacity });
        }
    }
    // The replays are independent: spread them over the available cores.
    let workers = std::thread::available_parallelism().map_or(1, usize::from).min(runs.len());
    let ratios: Vec<f64> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|worker| {
                let (runs, traces) = (&runs, &traces);
                scope.spawn(move || {
                    runs.iter()
                        .enumerate()
                        .skip(worker)
                        .step_by(workers)
                        .map(|(i, run)| {
                            (i, hit_ratio(run.kind, run.order, run.capacity, &traces[run.trace]))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut ratios = vec![0.0; runs.len()];
        for handle in handles {
            for (i, ratio) in handle.join().unwrap() {
                ratios[i] = ratio;
            }
        }
        ratios
    });
    let ratio = |trace: usize, kind: PolicyKind, order: Order, capacity: usize| {
        let at = runs.iter().position(|run| {
            (run.trace, run.kind, run.order, run.capacity) == (trace, kind, order, capacity)
        });
        ratios[at.unwrap()]
    };

    println!("prefix hit ratio; LRU root first, and both policies leaf first");
    println!("{:<26} {:>8} {:>9} {:>9} {:>9}", "trace", "blocks", "LRU", "LRU leaf", "S3-FIFO");
    let mut failures = vec![];
    for (trace, (name, reference)) in LRU_REFERENCE.iter().enumerate() {
        for &(capacity, expected) in reference {
            let lru = ratio(trace, PolicyKind::Lru, Order::RootFirst, capacity);
            let lru_leaf = ratio(trace, PolicyKind::Lru, Order::LeafFirst, capacity);
            let s3fifo = ratio(trace, PolicyKind::S3Fifo, Order::LeafFirst, capacity);
            println!("{name:<26} {capacity:>8} {lru:>9.4} {lru_leaf:>9.4} {s3fifo:>9.4}");
            if (lru - expected).abs() > 0.005 {
                failures.push(format!("{name} at {capacity}: LRU {lru:.4}, reference {expected}"));
            }
            if CAPACITIES.contains(&capacity) && !(s3fifo > lru && s3fifo > lru_leaf) {
                failures.push(format!(
                    "{name} at {capacity}: S3-FIFO {s3fifo:.4} does not beat LRU {lru:.4} \
                     (leaf first {lru_leaf:.4})"
                ));
            }
        }
    }
    println!("replayed in {:.1?}", started.elapsed());
    assert!(failures.is_empty(), "{failures:#?}");
}
