//! Prefetch throughput: lookups of 64-chunk prefixes of 2 MiB chunks whose hits come from L1,
//! from L2 and from disk, through the whole StorageManager. Each lookup is submitted, waited
//! for, every chunk of the hit is read out into a host buffer (what a worker does), and the
//! lookup is released; from L2 and disk every lookup moves every chunk up again (a promotion is
//! temporary and freed on release). Figures are chunks per second and GB/s, next to the limits
//! measured in the same run: single-core memcpy, and the disk's sequential `O_DIRECT` read.
//!
//! `cargo bench -p tierkv-bench --bench prefetch` (`TIERKV_BENCH_DIR` picks the filesystem).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark setup: a failure aborts the run"
)]
#![allow(clippy::print_stdout, reason = "the table is the benchmark's output")]

use std::time::{Duration, Instant};

use tierkv_bench::{Table, direct_file_bandwidth, memcpy_bandwidth};
use tierkv_core::{ChunkHash, ExtraCount, KvRank, Layout, Namespace, ObjectKey};
use tierkv_disk::{BLOCK, DiskStoreConfig, FsyncPolicy, record_bytes};
use tierkv_l1::{DeviceKind, L1Config, OwnerId, Readers};
use tierkv_l2::{HostMemory, HostStoreConfig};
use tierkv_storage::{StorageConfig, StorageManager};

const CHUNK: u64 = 2 << 20;
const PREFIX: u64 = 64;
const OWNER: OwnerId = OwnerId(1);

fn key(i: u64) -> ObjectKey {
    ObjectKey::new(Namespace::new("bench", ""), ChunkHash(u128::from(i) << 40 | 3), KvRank::Shared)
}

fn settle(s: &StorageManager, tier: usize, objects: u64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !(s.status().store_in_flight == 0 && s.status().tiers[tier].1.objects >= objects) {
        assert!(Instant::now() < deadline, "the store pipeline never settled");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs `lookups` lookups of the prefix and returns chunks per second; checks the hit and that
/// every chunk came from `tier` (0 = L1).
fn run(
    s: &StorageManager,
    keys: &[ObjectKey],
    lookups: usize,
    tier: usize,
    out: &mut [Vec<u8>],
) -> f64 {
    let layout = Layout::bytes(CHUNK).unwrap();
    let start = Instant::now();
    for _ in 0..lookups {
        let id = s.submit_prefetch(OWNER, keys.to_vec(), ExtraCount::ZERO, layout.clone()).unwrap();
        let result = s.wait(id, Duration::from_secs(60)).unwrap();
        assert_eq!(result.hit_chunks, keys.len());
        assert_eq!(
            result.per_tier[tier],
            keys.len(),
            "not every chunk came from tier {tier}: {result:?}"
        );
        for (key, buffer) in keys.iter().zip(out.iter_mut()) {
            s.read(id, 0, key).unwrap().read_at(0, buffer).unwrap();
        }
        s.release(id, Readers::All).unwrap();
    }
    (lookups * keys.len()) as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let parent = std::env::var_os("TIERKV_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(&parent).unwrap();
    let mut table = Table::new("GB/s", 1e9);
    table.limit("memcpy 2 MiB", memcpy_bandwidth(CHUNK as usize, Duration::from_secs(1)));
    let (_, read) =
        direct_file_bandwidth(dir.path(), 1 << 30, CHUNK as usize, 4).expect("O_DIRECT is needed");
    table.limit("disk sequential read, 2 MiB requests x 4", read);

    let segment_bytes = BLOCK + 64 * record_bytes(CHUNK);
    let config = StorageConfig {
        l2: Some(HostStoreConfig {
            memory: HostMemory::Plain,
            workers: 2,
            ..HostStoreConfig::new(2 * PREFIX * CHUNK, CHUNK)
        }),
        disk: Some(DiskStoreConfig {
            segment_bytes,
            fsync: FsyncPolicy::Never,
            ..DiskStoreConfig::new(dir.path().join("tier"), 4 * segment_bytes, CHUNK)
        }),
        ..StorageConfig::new(L1Config {
            device: DeviceKind::Emulated,
            ..L1Config::new(2 * PREFIX * CHUNK, CHUNK)
        })
    };
    let s = StorageManager::start(config).unwrap();
    let keys: Vec<ObjectKey> = (0..PREFIX).map(key).collect();
    let layout = Layout::bytes(CHUNK).unwrap();
    let source = vec![0x5au8; CHUNK as usize];
    assert!(s.reserve_write(OWNER, &keys, &layout).unwrap().iter().all(|r| r.is_ok()));
    for k in &keys {
        s.write_access(OWNER, k).unwrap().write_at(0, &source).unwrap();
    }
    assert!(s.finish_write(OWNER, &keys).unwrap().iter().all(|r| r.is_ok()));
    settle(&s, 0, PREFIX);
    settle(&s, 1, PREFIX);
    let mut out: Vec<Vec<u8>> = (0..PREFIX).map(|_| vec![1u8; CHUNK as usize]).collect();

    let per_chunk = |rate: f64| rate * CHUNK as f64;
    let rate = run(&s, &keys, 16, 0, &mut out);
    table.figure(
        "64-chunk prefix, hits in L1 (lease, read out, release)",
        per_chunk(rate),
        "memcpy 2 MiB",
    );
    let l1 = rate;
    s.clear_l1(false);
    let rate = run(&s, &keys, 8, 1, &mut out);
    table.figure(
        "64-chunk prefix, hits in L2 (promote, read out, release)",
        per_chunk(rate),
        "memcpy 2 MiB",
    );
    let l2 = rate;
    s.clear_tier(0);
    let rate = run(&s, &keys, 4, 2, &mut out);
    table.figure(
        "64-chunk prefix, hits on disk (promote, read out, release)",
        per_chunk(rate),
        "disk sequential read, 2 MiB requests x 4",
    );
    println!("{}", table.render());
    println!(
        "chunks per second: L1 {l1:.0}, L2 {l2:.0}, disk {rate:.0} (2 MiB chunks, emulated L1, 2 cores)"
    );
    s.stop();
}
