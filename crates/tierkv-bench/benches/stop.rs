//! A cascade's clean stop: L1 and L2 full of 2 MiB chunks are handed down to the disk tier
//! (`StorageManager::stop`, what SIGTERM does), timed and printed as a ratio of the disk's
//! sequential `O_DIRECT` write bandwidth, measured right before and right after on the same
//! filesystem with as many writes in flight as the disk tier keeps.
//!
//! `cargo bench -p tierkv-bench --bench stop` (set `TIERKV_BENCH_DIR` to measure another
//! filesystem; the default is the system temporary directory).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark setup: a failure aborts the run"
)]
#![allow(clippy::print_stdout, reason = "the table is the benchmark's output")]

use std::time::{Duration, Instant};

use tierkv_bench::{Table, direct_write_bandwidth, key};
use tierkv_core::{Layout, ObjectKey};
use tierkv_disk::{BLOCK, DiskStoreConfig, FsyncPolicy, WRITES_IN_FLIGHT, record_bytes};
use tierkv_l1::{DeviceKind, L1Config, OwnerId, Watermark};
use tierkv_l2::{HostMemory, HostStoreConfig};
use tierkv_storage::{StorageConfig, StorageManager, StorePolicy};

const CHUNK: u64 = 2 << 20;
const L1_CHUNKS: u64 = 128;
const L2_CHUNKS: u64 = 256;
const OWNER: OwnerId = OwnerId(1);

fn main() {
    let dir = std::env::var_os("TIERKV_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let chunks = L1_CHUNKS + L2_CHUNKS;
    let bytes = (chunks * CHUNK) as usize;
    let mut table = Table::new("GB/s", 1e9);
    let limit = || direct_write_bandwidth(&dir, bytes, CHUNK as usize, WRITES_IN_FLIGHT).unwrap();
    let mut limits = vec![limit()];
    let mut rates = Vec::new();
    for _ in 0..3 {
        let run = tempfile::tempdir_in(&dir).unwrap();
        let segment_bytes = BLOCK + 64 * record_bytes(CHUNK);
        let segments = (chunks * record_bytes(CHUNK)).div_ceil(segment_bytes) + 2;
        let config = StorageConfig {
            l2: Some(HostStoreConfig {
                memory: HostMemory::Plain,
                ..HostStoreConfig::new(L2_CHUNKS * CHUNK, CHUNK)
            }),
            disk: Some(DiskStoreConfig {
                segment_bytes,
                fsync: FsyncPolicy::Never,
                ..DiskStoreConfig::new(run.path(), segments * segment_bytes, CHUNK)
            }),
            store_policy: StorePolicy::Cascade,
            l2_watermark: Watermark { high: 1.0, low: 1.0 },
            stop_drain_timeout: Duration::from_secs(120),
            ..StorageConfig::new(L1Config {
                device: DeviceKind::Emulated,
                prefault: true,
                watermark: Watermark { high: 1.0, low: 1.0 },
                ..L1Config::new(L1_CHUNKS * CHUNK, CHUNK)
            })
        };
        let s = StorageManager::start(config).unwrap();
        // L1's chunks first, then as many again push L1's victims into L2, and so on until
        // both are full: nothing reaches the disk before the stop.
        let layout = Layout::bytes(CHUNK).unwrap();
        let source = vec![0x5au8; CHUNK as usize];
        for window in (0..chunks).collect::<Vec<_>>().chunks(L1_CHUNKS as usize / 8) {
            let keys: Vec<ObjectKey> = window.iter().map(|i| key(*i)).collect();
            assert!(s.reserve_write(OWNER, &keys, &layout).unwrap().iter().all(|r| r.is_ok()));
            for k in &keys {
                s.write_access(OWNER, k).unwrap().write_at(0, &source).unwrap();
            }
            assert!(s.finish_write(OWNER, &keys).unwrap().iter().all(|r| r.is_ok()));
        }
        let status = s.status();
        assert_eq!(status.l1.cached + status.tiers[0].1.objects, chunks, "{status:?}");
        let start = Instant::now();
        s.stop();
        let elapsed = start.elapsed().as_secs_f64();
        let status = s.status();
        assert_eq!(status.tiers[1].1.objects, chunks, "every chunk is on disk: {status:?}");
        rates.push(bytes as f64 / elapsed);
        drop(s);
        limits.push(limit());
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let name = format!("disk sequential write, 2 MiB requests x {WRITES_IN_FLIGHT} (median of 4)");
    table.limit(&name, median(limits));
    table.figure(
        &format!(
            "cascade stop: L1 {L1_CHUNKS} + L2 {L2_CHUNKS} chunks of 2 MiB to disk (median of 3)"
        ),
        median(rates),
        &name,
    );
    println!("{}", table.render());
    println!("filesystem: {}; fsync never; host tier: plain memory", dir.display());
}
