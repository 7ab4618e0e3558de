//! Restart cost: how fast `DiskStore::open` rebuilds its index from the segments' superblocks
//! and record headers, scanning segments on one thread and on four, in segments of 256 records
//! and of one. Each figure is printed beside its limit, measured in the same run over the same
//! files: the `O_DIRECT` reads a scan makes (one 8 KiB read per one-record segment; a 4 KiB
//! superblock per segment and a 4 KiB header per record in larger ones), alone, with as many in
//! flight as the scan has threads.
//!
//! `cargo bench -p tierkv-disk --bench open` (set `TIERKV_BENCH_DIR` to measure another
//! filesystem; the default is the system temporary directory). Bandwidth of stores and loads is
//! in `cargo bench -p tierkv-bench --bench tiers`.

#![allow(clippy::unwrap_used, reason = "benchmark setup: a failure aborts the run")]
#![allow(clippy::print_stdout, reason = "the figures are the benchmark's output")]

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use tierkv_bench::AlignedBuf;
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
    let (files, reads) = scan_reads(dir.path(), segment_bytes, segments, per_segment);
    for threads in [1, 4, 1, 4] {
        let start = Instant::now();
        let store = DiskStore::open(config(threads)).unwrap();
        let took = start.elapsed();
        assert_eq!(store.recovered().records, RECORDS);
        drop(store);
        let rate = RECORDS as f64 / took.as_secs_f64();
        let limit = RECORDS as f64 / read_all(&files, &reads, threads).as_secs_f64();
        println!(
            "open, scan on {threads} thread(s): {:>7.1} ms, {rate:>9.0} records/s; \
             limit: the same reads alone, {threads} in flight, {limit:>9.0} records/s; ratio {:.2}",
            took.as_secs_f64() * 1e3,
            rate / limit
        );
    }
}

/// The segment files, opened with `O_DIRECT`, and the (file, offset, length) of every read a scan
/// of `segments` segments makes: the segments lie back to back in the files, in name order.
fn scan_reads(
    dir: &Path,
    segment_bytes: u64,
    segments: u64,
    per_segment: u64,
) -> (Vec<File>, Vec<(usize, u64, usize)>) {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.len() >= segment_bytes))
        .collect();
    names.sort();
    let (mut files, mut reads, mut left) = (Vec::new(), Vec::new(), segments);
    for name in &names {
        let f = files.len();
        files.push(OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(name).unwrap());
        let in_file = std::fs::metadata(name).unwrap().len() / segment_bytes;
        for s in 0..in_file.min(left) {
            let start = s * segment_bytes;
            if per_segment == 1 {
                reads.push((f, start, 2 * BLOCK as usize)); // superblock and header at once
            } else {
                reads.push((f, start, BLOCK as usize));
                let record = record_bytes(CHUNK);
                reads.extend(
                    (0..per_segment).map(|r| (f, start + BLOCK + r * record, BLOCK as usize)),
                );
            }
        }
        left -= in_file.min(left);
    }
    assert_eq!(left, 0, "found fewer segments than were written");
    (files, reads)
}

/// Makes `reads` on `threads` threads, each taking every `threads`-th read; returns the time.
fn read_all(files: &[File], reads: &[(usize, u64, usize)], threads: usize) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let mut buf = AlignedBuf::new(2 * BLOCK as usize).unwrap();
                for &(f, offset, len) in reads.iter().skip(t).step_by(threads) {
                    files[f].read_exact_at(&mut buf.as_mut_slice()[..len], offset).unwrap();
                }
            });
        }
    });
    start.elapsed()
}
