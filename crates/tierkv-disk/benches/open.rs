//! Restart cost: how fast `DiskStore::open` rebuilds its index from the segments' superblocks
//! and record headers, scanning segments on one thread and on four, in segments of 256 records
//! and of one.
//!
//! `cargo bench -p tierkv-disk --bench open` (set `TIERKV_BENCH_DIR` to measure another
//! filesystem; the default is the system temporary directory). Bandwidth of stores and loads is
//! in `cargo bench -p tierkv-bench --bench tiers`.

#![allow(clippy::unwrap_used, reason = "benchmark setup: a failure aborts the run")]
#![allow(clippy::print_stdout, reason = "the figures are the benchmark's output")]

use std::time::{Duration, Instant};

use tierkv_core::{
    ChunkHash, Completion, KvRank, Namespace, ObjectKey, StoreItem, TierAdapter, VecChunk,
};
use tierkv_disk::{BLOCK, DiskStore, DiskStoreConfig, FsyncPolicy, record_bytes};

const CHUNK: u64 = 16 << 10;
const RECORDS: u64 = 16 << 10;
const PER_TASK: u64 = 64;

fn key(i: u64) -> ObjectKey {
    ObjectKey::new(Namespace::new("bench", ""), ChunkHash(u128::from(i) << 32 | 9), KvRank::Shared)
}

fn main() {
    let parent = std::env::var_os("TIERKV_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    // Segments of 256 records, and of one (the default, `disk.segment = "auto"`).
    for per_segment in [256, 1] {
        layout(&parent, per_segment);
    }
}

/// Writes `RECORDS` records into segments of `per_segment` records, then times reopening.
fn layout(parent: &std::path::Path, per_segment: u64) {
    let dir = tempfile::tempdir_in(parent).unwrap();
    let segment_bytes = BLOCK + per_segment * record_bytes(CHUNK);
    let segments = RECORDS.div_ceil(per_segment);
    let config = |io_threads| DiskStoreConfig {
        segment_bytes,
        fsync: FsyncPolicy::Never,
        io_threads,
        ..DiskStoreConfig::new(dir.path(), (segments + 2) * segment_bytes, CHUNK)
    };
    {
        let store = DiskStore::open(config(2)).unwrap();
        let completions = store.completions();
        for first in (0..RECORDS).step_by(PER_TASK as usize) {
            let items = (first..first + PER_TASK)
                .map(|i| StoreItem {
                    key: key(i),
                    source: Box::new(VecChunk(vec![i as u8; CHUNK as usize])),
                })
                .collect();
            store.submit_store(items);
        }
        for _ in (0..RECORDS).step_by(PER_TASK as usize) {
            match completions.recv_timeout(Duration::from_secs(60)).unwrap() {
                Completion::Stored { result, .. } => result.unwrap(),
                _ => panic!("not a store completion"),
            }
        }
    } // closing syncs
    println!(
        "{RECORDS} records of {} KiB in {segments} segments of {per_segment}, {}",
        CHUNK >> 10,
        parent.display()
    );
    for threads in [1, 4, 1, 4] {
        let start = Instant::now();
        let store = DiskStore::open(config(threads)).unwrap();
        let took = start.elapsed();
        assert_eq!(store.recovered().records, RECORDS);
        println!(
            "open, scan on {threads} thread(s): {:>7.1} ms, {:>9.0} records/s",
            took.as_secs_f64() * 1e3,
            RECORDS as f64 / took.as_secs_f64()
        );
    }
}
