//! Lower-tier bandwidth: HostStore (L2) and DiskStore store and load of 2 MiB and 16 MiB chunks
//! with several tasks in flight, each printed as a ratio of a limit measured in the same run on
//! the same machine and filesystem: memcpy on as many threads at once as the host tier has
//! workers (they copy in parallel) for the host tier; sequential `O_DIRECT` write of a fresh file,
//! and its sequential `O_DIRECT` read with as many requests in flight as the store has I/O
//! threads, for the disk tier, each measured right before and right after the store or load it
//! bounds (the virtio disk's bandwidth drifts within a run). Disk loads are cold: the store writes with
//! `O_DIRECT` (nothing enters the page cache), and each chunk is read once per read mode.
//!
//! `cargo bench -p tierkv-bench --bench tiers` (set `TIERKV_BENCH_DIR` to measure another
//! filesystem; the default is the system temporary directory).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark setup: a failure aborts the run"
)]
#![allow(clippy::print_stdout, reason = "the table is the benchmark's output")]

use std::path::Path;
use std::time::{Duration, Instant};

use tierkv_bench::{
    Pump, Table, bracketed, direct_file_bandwidth, direct_write_bandwidth, key, memcpy_bandwidth,
    memcpy_bandwidth_threads,
};
use tierkv_core::{LoadItem, StoreItem, TierAdapter, VecChunk};
use tierkv_disk::{
    BLOCK, DiskStore, DiskStoreConfig, FsyncPolicy, ReadMode, WRITES_IN_FLIGHT, auto_segment_bytes,
    record_bytes,
};
use tierkv_l2::{HostMemory, HostStore, HostStoreConfig};

/// Tasks kept in flight, and chunks per task.
const IN_FLIGHT: usize = 4;
const PER_TASK: usize = 2;
/// The host tier's workers: with tasks in flight, each copies one task at a time, in parallel.
const HOST_WORKERS: usize = 2;

/// Buffers of `chunk` bytes, allocated and touched before any timing, as L1 slots would be.
fn buffers(total: usize, chunk: u64, fill: u8) -> Vec<Option<Vec<u8>>> {
    (0..total).map(|i| Some(vec![fill ^ i as u8; chunk as usize])).collect()
}

fn store_all(tier: &dyn TierAdapter, total: usize, chunk: u64) -> f64 {
    store_from(tier, buffers(total, chunk, 0x5a), chunk)
}

/// Stores `sources` (allocated and filled beforehand, as L1 slots would be).
fn store_from(tier: &dyn TierAdapter, mut sources: Vec<Option<Vec<u8>>>, chunk: u64) -> f64 {
    let total = sources.len();
    Pump { per_task: PER_TASK, in_flight: IN_FLIGHT }
        .run(tier, total, chunk, |first| {
            let items = (first..(first + PER_TASK).min(total))
                .map(|i| StoreItem {
                    key: key(i as u64),
                    source: Box::new(VecChunk(sources[i].take().unwrap_or_default())),
                })
                .collect();
            tier.submit_store(items)
        })
        .unwrap_or_else(|e| panic!("{e}"))
}

fn load_all(tier: &dyn TierAdapter, total: usize, chunk: u64) -> f64 {
    let mut sinks = buffers(total, chunk, 1);
    Pump { per_task: PER_TASK, in_flight: IN_FLIGHT }
        .run(tier, total, chunk, |first| {
            let items = (first..(first + PER_TASK).min(total))
                .map(|i| LoadItem {
                    key: key(i as u64),
                    sink: Box::new(VecChunk(sinks[i].take().unwrap_or_default())),
                })
                .collect();
            tier.submit_load(items)
        })
        .unwrap_or_else(|e| panic!("{e}"))
}

fn host(table: &mut Table, chunk: u64, total: usize) {
    let config = HostStoreConfig {
        memory: HostMemory::Plain,
        workers: HOST_WORKERS,
        ..HostStoreConfig::new(chunk * total as u64, chunk)
    };
    let store = HostStore::open(config).unwrap();
    // A first pass faults the arena's pages in, as a long-running daemon's arena would be.
    store_all(&store, total, chunk);
    store.delete(&(0..total as u64).map(key).collect::<Vec<_>>());
    let mib = chunk >> 20;
    // The host tier's workers copy in parallel, so the limit is memcpy on as many threads at once
    // (until 2026-11-30 one core's, which the two workers beat), measured right before and right
    // after each figure: a run of 512 MiB takes tens of milliseconds, and the other sessions on
    // this machine move memcpy by as much as the figures differ.
    let copy =
        || memcpy_bandwidth_threads(chunk as usize, Duration::from_millis(250), HOST_WORKERS);
    let (store_rate, store_limit) = bracketed(copy, || store_all(&store, total, chunk));
    let (load_rate, load_limit) = bracketed(copy, || load_all(&store, total, chunk));
    for (what, rate, limit) in [("store", store_rate, store_limit), ("load", load_rate, load_limit)]
    {
        let name = format!("memcpy {mib} MiB x {HOST_WORKERS} threads, around the {what} (mean)");
        table.limit(&name, limit);
        table.figure(&format!("HostStore {what}, {mib} MiB chunks"), rate, &name);
    }
}

/// How the disk tier's segments are sized in a run.
#[derive(Clone, Copy)]
enum Segments {
    /// One record each: the default (`disk.segment = "auto"`), a superblock written per record.
    OneRecord,
    /// 256 MiB (at least 16 records): the default until the disk freed one chunk at a time.
    Large,
}

fn disk(table: &mut Table, parent: &Path, chunk: u64, total: usize, segments: Segments) {
    let run = tempfile::tempdir_in(parent).unwrap();
    let (segment_bytes, layout) = match segments {
        Segments::OneRecord => (auto_segment_bytes(chunk), "one-record segments"),
        Segments::Large => (
            (BLOCK + 16 * record_bytes(chunk)).max(256 << 20).next_multiple_of(BLOCK),
            "256 MiB segments",
        ),
    };
    let capacity = (total as u64 * record_bytes(chunk)).div_ceil(segment_bytes) * segment_bytes
        + 2 * segment_bytes;
    let config = DiskStoreConfig {
        segment_bytes,
        io_threads: IN_FLIGHT,
        fsync: FsyncPolicy::Never,
        ..DiskStoreConfig::new(run.path(), capacity, chunk)
    };
    let mib = chunk >> 20;
    {
        let store = DiskStore::open(config.clone()).unwrap();
        // The sources are made before the clock starts (until issue 13 they were made inside
        // the timed region, which cost this figure about half its value).
        let sources = buffers(total, chunk, 0x5a);
        // The virtio disk's write bandwidth drifts within a run (the host's cache fills), so the
        // limit is measured right before and right after the store, the same volume each time,
        // one write at a time and with as many in flight as the store keeps (WRITES_IN_FLIGHT),
        // and the store is set against the better of the two means: on this disk neither
        // pattern is reliably the faster.
        let bytes = total * chunk as usize;
        let limits = || {
            [1, WRITES_IN_FLIGHT].map(|writers| {
                direct_write_bandwidth(parent, bytes, chunk as usize, writers).unwrap()
            })
        };
        let before = limits();
        let start = Instant::now();
        store_from(&store, sources, chunk);
        store.close(); // syncs everything written
        let rate = total as f64 * chunk as f64 / start.elapsed().as_secs_f64();
        let after = limits();
        let [single, several] = [0, 1].map(|i| (before[i] + after[i]) / 2.0);
        table.limit(&format!("disk sequential write, {mib} MiB requests x 1 (mean)"), single);
        table.limit(
            &format!("disk sequential write, {mib} MiB requests x {WRITES_IN_FLIGHT} (mean)"),
            several,
        );
        let limit = format!("disk sequential write, {mib} MiB requests, the better");
        table.limit(&limit, single.max(several));
        table.figure(&format!("DiskStore store + sync, {mib} MiB chunks, {layout}"), rate, &limit);
    }
    for mode in [ReadMode::Direct, ReadMode::Mmap] {
        let store = DiskStore::open(DiskStoreConfig { read_mode: mode, ..config.clone() }).unwrap();
        // Read with as many in flight as the store has I/O threads, in requests of the chunk
        // size, the volume the load reads, right before and right after the load (until
        // 2026-11-30 it was measured once at start-up, and a drift of the disk between the two
        // gave a load 1.71 of it).
        let bytes = total * chunk as usize;
        let read = || {
            direct_file_bandwidth(parent, bytes, chunk as usize, IN_FLIGHT)
                .expect("O_DIRECT is needed")
                .1
        };
        let (rate, read) = bracketed(read, || load_all(&store, total, chunk));
        let limit = format!(
            "disk sequential read, {mib} MiB requests x {IN_FLIGHT}, around {mode:?} {layout} (mean)"
        );
        table.limit(&limit, read);
        let name = format!("DiskStore cold load ({mode:?}), {mib} MiB chunks, {layout}");
        table.figure(&name, rate, &limit);
    }
}

fn main() {
    let dir = std::env::var_os("TIERKV_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let work = tempfile::tempdir_in(&dir).unwrap();
    let mut table = Table::new("GB/s", 1e9);
    for mib in [2usize, 16] {
        // One core's copy, for reference (the host tier is judged against its workers' threads).
        let time = Duration::from_secs(1);
        table.limit(&format!("memcpy {mib} MiB, one core"), memcpy_bandwidth(mib << 20, time));
    }
    // `TIERKV_BENCH_ONLY=disk` skips the host tier (for profiling the disk tier alone).
    if std::env::var("TIERKV_BENCH_ONLY").map_or(true, |only| only != "disk") {
        host(&mut table, 2 << 20, 256);
        host(&mut table, 16 << 20, 32);
    }
    for segments in [Segments::OneRecord, Segments::Large] {
        disk(&mut table, work.path(), 2 << 20, 512, segments);
        disk(&mut table, work.path(), 16 << 20, 64, segments);
    }
    println!("{}", table.render());
    println!(
        "filesystem: {}; host tier: plain memory, {HOST_WORKERS} workers; disk tier: {IN_FLIGHT} I/O threads",
        dir.display()
    );
}
