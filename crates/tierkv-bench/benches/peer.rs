//! tierkv's side of the LMCache comparison: the shapes of LMCache 0.5.6's storage benchmark
//! (`../shared/peers/lmcache/bench.py`), run through tierkv's own APIs, with the limits they are
//! bounded by measured in the same run. `scripts/peer-bench` runs the peer's benchmark and this
//! one back to back and prints both in one table.
//!
//! - store: `reserve_write` -> copy -> `finish_write` on the StorageManager, L1 only, 256 KiB /
//!   2 MiB / 16 MiB chunks, 1 and 16 keys a call, one warm-up pass first (as the peer does).
//! - locks: L1 `reserve_read` + `finish_read` of tiny (64 B) objects one key at a time and 1,000
//!   at a time; one key leased for 4 readers and released by each; the StorageManager lookup
//!   path (submit, result, release) one key at a time and 1,000 at a time.
//! - prefetch: 1,000 keys resident only in the lower tier (L2 in host memory, or disk read with
//!   `O_DIRECT`, so every trial is cold), one lookup with 4 readers (`extra_count` 3), every chunk
//!   pinned for reading once, then 4 releases; median of the trials after a warm-up.
//!
//! `cargo bench -p tierkv-bench --bench peer -- [--json PATH] [--store-mib N] [--l1-gib N]
//! [--lock-keys N] [--sm-single-keys N] [--prefetch-keys N] [--prefetch-trials N] [--only LIST]`
//! (`--only` takes `store,locks,prefetch`; `TIERKV_BENCH_DIR` picks the disk's filesystem).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark setup: a failure aborts the run"
)]
#![allow(clippy::print_stdout, reason = "the table is the benchmark's output")]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use tierkv_bench::{direct_file_bandwidth, memcpy_bandwidth, memcpy_bandwidth_threads};
use tierkv_core::{ChunkHash, ExtraCount, KvRank, Layout, Namespace, ObjectKey};
use tierkv_disk::{BLOCK, DiskStoreConfig, FsyncPolicy, ReadMode, record_bytes};
use tierkv_l1::{
    DeviceKind, L1Config, L1Context, L1Manager, Lifetime, OwnerId, Readers, WriteMode,
};
use tierkv_l2::{HostMemory, HostStoreConfig};
use tierkv_storage::{StorageConfig, StorageManager, StorePolicy};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const OWNER: OwnerId = OwnerId(1);
/// The L2's workers in the prefetch rows: a lookup's loads are split over them, copying at once.
const L2_WORKERS: usize = 2;

/// Figures by row name (the peer's names), then by measure.
type Out = BTreeMap<String, BTreeMap<String, f64>>;

struct Args {
    json: Option<String>,
    store_mib: u64,
    l1_gib: u64,
    lock_keys: usize,
    sm_single_keys: usize,
    prefetch_keys: usize,
    prefetch_trials: usize,
    only: Vec<String>,
}

impl Args {
    fn parse() -> Self {
        let mut args = Args {
            json: None,
            store_mib: 2048,
            l1_gib: 4,
            lock_keys: 20_000,
            sm_single_keys: 5_000,
            prefetch_keys: 1_000,
            prefetch_trials: 5,
            only: Vec::new(),
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            let mut value = || it.next().expect("a flag without its value");
            let number = |v: String| v.parse::<u64>().expect("a number");
            match flag.as_str() {
                "--json" => args.json = Some(value()),
                "--store-mib" => args.store_mib = number(value()),
                "--l1-gib" => args.l1_gib = number(value()),
                "--lock-keys" => args.lock_keys = number(value()) as usize,
                "--sm-single-keys" => args.sm_single_keys = number(value()) as usize,
                "--prefetch-keys" => args.prefetch_keys = number(value()) as usize,
                "--prefetch-trials" => args.prefetch_trials = number(value()) as usize,
                "--only" => {
                    args.only =
                        value().split(',').filter(|s| !s.is_empty()).map(String::from).collect()
                }
                // cargo passes `--bench`; anything else unknown is ignored the same way.
                _ => {}
            }
        }
        args
    }

    fn runs(&self, section: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|s| s == section)
    }
}

/// Never-used keys, distinct across the whole run.
struct Keys(u64);

impl Keys {
    fn fresh(&mut self, n: usize) -> Vec<ObjectKey> {
        let first = self.0;
        self.0 += n as u64;
        (first..self.0)
            .map(|i| {
                ObjectKey::new(
                    Namespace::new("bench", ""),
                    ChunkHash(
                        u128::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835),
                    ),
                    KvRank::Shared,
                )
            })
            .collect()
    }
}

fn row(out: &mut Out, name: &str, figures: &[(&str, f64)]) {
    out.insert(name.to_string(), figures.iter().map(|(k, v)| (k.to_string(), *v)).collect());
}

fn emulated(capacity: u64, slot: u64) -> L1Config {
    L1Config { device: DeviceKind::Emulated, ..L1Config::new(capacity, slot) }
}

/// Writes `keys` through the StorageManager, `batch` keys a call, copying `src` into each.
fn store_keys(s: &StorageManager, keys: &[ObjectKey], batch: usize, layout: &Layout, src: &[u8]) {
    for ks in keys.chunks(batch) {
        let reserved = s.reserve_write(OWNER, ks, layout).unwrap();
        assert!(reserved.iter().all(|r| r.is_ok()), "reserve_write refused a key");
        for k in ks {
            s.write_access(OWNER, k).unwrap().write_at(0, src).unwrap();
        }
        assert!(s.finish_write(OWNER, ks).unwrap().iter().all(|r| r.is_ok()));
    }
}

fn bench_store(args: &Args, keys: &mut Keys, out: &mut Out) {
    for chunk in [256 * KIB, 2 * MIB, 16 * MIB] {
        let s =
            StorageManager::start(StorageConfig::new(emulated(args.l1_gib * GIB, chunk))).unwrap();
        let layout = Layout::bytes(chunk).unwrap();
        let src: Vec<u8> = (0..chunk).map(|i| (i * 31 % 251) as u8).collect();
        for batch in [1usize, 16] {
            let mut n = (args.store_mib * MIB / chunk) as usize;
            n -= n % batch;
            // Warm-up pass: first-touches every L1 page the timed pass reuses (as the peer does).
            let warm = keys.fresh(n);
            store_keys(&s, &warm, batch, &layout, &src);
            s.delete(&warm);
            let timed = keys.fresh(n);
            let start = Instant::now();
            store_keys(&s, &timed, batch, &layout, &src);
            let secs = start.elapsed().as_secs_f64();
            s.delete(&timed);
            row(
                out,
                &format!("store_{}KiB_b{batch}", chunk / KIB),
                &[("GBps", n as f64 * chunk as f64 / secs / 1e9), ("ops_per_s", n as f64 / secs)],
            );
        }
        s.stop();
    }
}

/// The first write of fresh L1 memory, 2 MiB chunks 16 a call, without and with `prefault`
/// (each on a new StorageManager; alternated, best of three each).
fn bench_first_write(args: &Args, keys: &mut Keys, out: &mut Out) {
    let chunk = 2 * MIB;
    let layout = Layout::bytes(chunk).unwrap();
    let src: Vec<u8> = (0..chunk).map(|i| (i * 31 % 251) as u8).collect();
    let n = ((args.store_mib * MIB / chunk) as usize / 16) * 16;
    let mut best = [0f64; 2];
    for _ in 0..3 {
        for (i, prefault) in [false, true].into_iter().enumerate() {
            let config = L1Config { prefault, ..emulated(args.l1_gib * GIB, chunk) };
            let s = StorageManager::start(StorageConfig::new(config)).unwrap();
            let ks = keys.fresh(n);
            let start = Instant::now();
            store_keys(&s, &ks, 16, &layout, &src);
            let rate = n as f64 * chunk as f64 / start.elapsed().as_secs_f64() / 1e9;
            best[i] = best[i].max(rate);
            s.stop();
        }
    }
    row(out, "store_2048KiB_b16_first_write", &[("GBps", best[0])]);
    row(out, "store_2048KiB_b16_first_write_prefault", &[("GBps", best[1])]);
}

fn bench_locks(args: &Args, keys: &mut Keys, out: &mut Out) {
    let n = args.lock_keys;
    let tiny = Layout::bytes(64).unwrap();
    // L1 level: 256 MiB of 4 KiB slots, as the peer's tiny objects are 4 KiB aligned.
    let l1 = L1Manager::build(emulated(256 * MIB, 4 * KIB), L1Context::default()).unwrap();
    let ks = keys.fresh(n);
    for batch in ks.chunks(1000) {
        let r = l1.reserve_write(OWNER, batch, &tiny, WriteMode::Create, Lifetime::Cached).unwrap();
        assert!(r.iter().all(|r| r.is_ok()));
        assert!(l1.finish_write(OWNER, batch).iter().all(|r| r.is_ok()));
    }
    let start = Instant::now();
    for k in &ks {
        let grant = l1.reserve_read(OWNER, std::slice::from_ref(k), ExtraCount::ZERO);
        l1.finish_read(grant.lease.unwrap(), Readers::All, None).unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    row(out, "l1_read_lock_unlock_single", &[("pairs_per_s", n as f64 / secs)]);
    let start = Instant::now();
    for batch in ks.chunks(1000) {
        let grant = l1.reserve_read(OWNER, batch, ExtraCount::ZERO);
        l1.finish_read(grant.lease.unwrap(), Readers::All, None).unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    row(out, "l1_read_lock_unlock_batch1000", &[("keys_per_s", n as f64 / secs)]);
    let four = ExtraCount::new(3).unwrap();
    let start = Instant::now();
    for k in &ks {
        let lease = l1.reserve_read(OWNER, std::slice::from_ref(k), four).lease.unwrap();
        for r in 0..4 {
            l1.finish_read(lease, Readers::One(r), None).unwrap();
        }
    }
    let secs = start.elapsed().as_secs_f64();
    row(out, "l1_read_lock4_finish4_single", &[("keys_per_s", n as f64 / secs)]);
    assert_eq!(l1.usage().leased, 0);
    drop(l1);

    // StorageManager level: the lookup path on L1 hits (submit, result, release).
    let s = StorageManager::start(StorageConfig::new(emulated(256 * MIB, 4 * KIB))).unwrap();
    let ks = keys.fresh(n);
    store_keys(&s, &ks, 1000, &tiny, &[7u8; 64]);
    let m = n.min(args.sm_single_keys);
    let lookup = |batch: &[ObjectKey]| {
        let id = s.submit_prefetch(OWNER, batch.to_vec(), ExtraCount::ZERO, tiny.clone()).unwrap();
        let result = match s.query(id).unwrap() {
            Some(result) => result,
            None => s.wait(id, Duration::from_secs(5)).unwrap(),
        };
        assert_eq!(result.hit_chunks, batch.len());
        s.release(id, Readers::All).unwrap();
    };
    let start = Instant::now();
    for k in &ks[..m] {
        lookup(std::slice::from_ref(k));
    }
    let secs = start.elapsed().as_secs_f64();
    row(out, "sm_lookup_lock_finish_single", &[("keys_per_s", m as f64 / secs)]);
    let start = Instant::now();
    for batch in ks.chunks(1000) {
        lookup(batch);
    }
    let secs = start.elapsed().as_secs_f64();
    row(out, "sm_lookup_lock_finish_batch1000", &[("keys_per_s", n as f64 / secs)]);
    s.stop();
}

/// The lower tier a prefetch comes from.
#[derive(Clone, Copy)]
enum Lower {
    Host,
    Disk,
}

fn bench_prefetch(args: &Args, keys: &mut Keys, out: &mut Out, lower: Lower, chunk: u64) {
    let n = args.prefetch_keys;
    let parent = std::env::var_os("TIERKV_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(&parent).unwrap();
    let l1 = emulated(GIB.max(4 * n as u64 * chunk), chunk);
    let config = match lower {
        Lower::Host => StorageConfig {
            l2: Some(HostStoreConfig {
                memory: HostMemory::Plain,
                workers: L2_WORKERS,
                ..HostStoreConfig::new(2 * n as u64 * chunk, chunk)
            }),
            store_policy: StorePolicy::WriteThrough,
            ..StorageConfig::new(l1)
        },
        Lower::Disk => {
            let segment_bytes = (BLOCK + 256 * record_bytes(chunk)).next_multiple_of(BLOCK);
            let segments = (n as u64 * record_bytes(chunk)).div_ceil(segment_bytes) + 2;
            StorageConfig {
                disk: Some(DiskStoreConfig {
                    segment_bytes,
                    fsync: FsyncPolicy::Never,
                    read_mode: ReadMode::Direct,
                    ..DiskStoreConfig::new(dir.path().join("tier"), segments * segment_bytes, chunk)
                }),
                store_policy: StorePolicy::WriteThrough,
                ..StorageConfig::new(l1)
            }
        }
    };
    let s = StorageManager::start(config).unwrap();
    let layout = Layout::bytes(chunk).unwrap();
    let ks = keys.fresh(n);
    let src: Vec<u8> = (0..chunk).map(|i| (i * 17 % 253) as u8).collect();
    store_keys(&s, &ks, 100, &layout, &src);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !(s.status().store_in_flight == 0 && s.status().tiers[0].1.objects >= n as u64) {
        assert!(Instant::now() < deadline, "the store pipeline never settled");
        std::thread::sleep(Duration::from_millis(2));
    }
    s.clear_l1(false);
    assert_eq!(s.status().l1.cached + s.status().l1.leased, 0, "L1 still holds chunks");
    let four = ExtraCount::new(3).unwrap();
    let (mut totals, mut to_result) = (Vec::new(), Vec::new());
    for trial in 0..=args.prefetch_trials {
        let start = Instant::now();
        let id = s.submit_prefetch(OWNER, ks.clone(), four, layout.clone()).unwrap();
        let result = s.wait(id, Duration::from_secs(60)).unwrap();
        let ready = start.elapsed();
        assert_eq!(result.per_tier.get(1), Some(&n), "not every chunk came from below: {result:?}");
        for k in &ks {
            drop(s.read(id, 0, k).unwrap());
        }
        for r in 0..4 {
            s.release(id, Readers::One(r)).unwrap();
        }
        let total = start.elapsed();
        if trial > 0 {
            totals.push(total.as_secs_f64());
            to_result.push(ready.as_secs_f64());
        }
        // Promotions are temporary: they leave L1 with their last share.
        let l1 = s.status().l1;
        assert_eq!(l1.cached + l1.leased + l1.writing, 0, "trial {trial} left chunks in L1");
    }
    let med = median(&mut totals);
    let kind = match lower {
        Lower::Host => "l2",
        Lower::Disk => "disk",
    };
    row(
        out,
        &format!("prefetch_{kind}_{}KiB_x{n}", chunk / KIB),
        &[
            ("ms_round_trip", med * 1e3),
            ("ms_to_result", median(&mut to_result) * 1e3),
            ("keys_per_s", n as f64 / med),
            ("GBps", n as f64 * chunk as f64 / med / 1e9),
        ],
    );
    s.stop();
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn limits(out: &mut Out) {
    let parent = std::env::var_os("TIERKV_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(&parent).unwrap();
    let mut limits = BTreeMap::new();
    for chunk in [256 * KIB, 2 * MIB, 16 * MIB] {
        limits.insert(
            format!("memcpy_{}KiB_GBps", chunk / KIB),
            memcpy_bandwidth(chunk as usize, Duration::from_secs(1)) / 1e9,
        );
    }
    // The L2 prefetch splits its loads over the L2's workers, copying on that many threads: its
    // limit is memcpy on as many threads at once (until 2026-11-30 one core's).
    limits.insert(
        format!("memcpy_256KiB_x{L2_WORKERS}_GBps"),
        memcpy_bandwidth_threads(256 * KIB as usize, Duration::from_secs(1), L2_WORKERS) / 1e9,
    );
    let (write, _) = direct_file_bandwidth(dir.path(), 512 << 20, 2 << 20, 1).unwrap();
    limits.insert("disk_write_2048KiB_GBps".into(), write / 1e9);
    for chunk in [4 * KIB, 256 * KIB] {
        let bytes = if chunk < 64 * KIB { 64 << 20 } else { 512 << 20 };
        let (_, read) = direct_file_bandwidth(dir.path(), bytes, chunk as usize, 4).unwrap();
        limits.insert(format!("disk_read_{}KiB_x4_GBps", chunk / KIB), read / 1e9);
    }
    out.insert("_limits".into(), limits);
}

fn json(out: &Out) -> String {
    let mut s = String::from("{\n");
    for (i, (name, figures)) in out.iter().enumerate() {
        let body: Vec<String> = figures.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
        let comma = if i + 1 < out.len() { "," } else { "" };
        let _ = writeln!(s, " \"{name}\": {{{}}}{comma}", body.join(", "));
    }
    s.push('}');
    s
}

fn main() {
    let args = Args::parse();
    let mut out = Out::new();
    let mut keys = Keys(1);
    let wall = Instant::now();
    limits(&mut out);
    if args.runs("store") {
        bench_store(&args, &mut keys, &mut out);
        bench_first_write(&args, &mut keys, &mut out);
    }
    if args.runs("locks") {
        bench_locks(&args, &mut keys, &mut out);
    }
    if args.runs("prefetch") {
        for lower in [Lower::Host, Lower::Disk] {
            for chunk in [4 * KIB, 256 * KIB] {
                bench_prefetch(&args, &mut keys, &mut out, lower, chunk);
            }
        }
    }
    row(&mut out, "_meta", &[("wall_s", wall.elapsed().as_secs_f64())]);
    for (name, figures) in &out {
        let line: Vec<String> = figures.iter().map(|(k, v)| format!("{k}={v:.3}")).collect();
        println!("{name:40} {}", line.join("  "));
    }
    if let Some(path) = &args.json {
        std::fs::write(path, json(&out)).expect("cannot write the JSON output");
    }
}
