//! Load latency under stores: how long a request whose hit is on disk waits for its chunks (the
//! engine's time to first token), alone and while a steady stream of stores runs, as the
//! cascade writes L1's and L2's victims to disk all the time.
//!
//! `cargo bench -p tierkv-disk --bench loads` (set `TIERKV_BENCH_DIR` to measure another
//! filesystem; the default is the system temporary directory; `TIERKV_BENCH_FSYNC` to `never` or
//! an interval such as `1s` or `500ms` for the periodic sync, `always` by default).
//!
//! The store is the daemon's default (`DiskStoreConfig::new`: fsync always, four I/O threads,
//! direct reads, one-record segments) for 2 MiB chunks. Each sample is a lookup-and-lock of 8
//! chunks on disk, then their load, each timed from submission to completion. The limit, in the
//! same run and under the same conditions, sample for sample: a raw `O_DIRECT` read of 8 records
//! of the store's own files, four threads of two records each (as the load is split), with
//! nothing but the read in between. The stream keeps 128 store tasks of one 2 MiB chunk in
//! flight: 256 MiB, what the daemon lets be on its way to a lower tier at once
//! (`tierkv-storage`, `demoted_cap`), one chunk a task as the cascade sends its victims.
//!
//! Each ratio is a latency over its limit's at the same percentile: 1.00 is as fast as the raw
//! read, more is slower. The stream's own rate is printed too, against the disk's sequential
//! `O_DIRECT` write (2 MiB requests, `WRITES_IN_FLIGHT` at once, into a preallocated file)
//! measured right before the stream starts and right after it stops: alone (over 3 s before the
//! samples under it), the store path's own figure; and while the samples run, which shows how
//! much the disk slows writes while it reads.
//!
//! Every read is cold for the machine: loads read with `O_DIRECT` (the default), so the page
//! cache never serves them, and each sample reads its own 8 chunks, raw reads and loads distinct
//! halves of the chunks, so the two see the same (virtual) disk.

#![allow(clippy::unwrap_used, reason = "benchmark setup: a failure aborts the run")]
#![allow(clippy::print_stdout, reason = "the figures are the benchmark's output")]

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, unbounded};
use tierkv_core::{
    AlignedBuf, Bitmap, BufferError, ChunkHash, ChunkSource, Completion, KvRank, LoadItem,
    Namespace, ObjectKey, StoreItem, TaskId, TierAdapter, VecChunk,
};
use tierkv_disk::{
    BLOCK, DiskStore, DiskStoreConfig, FILE_BYTES, FsyncPolicy, WRITES_IN_FLIGHT,
    auto_segment_bytes, record_bytes,
};

const CHUNK: u64 = 2 << 20;
/// Chunks a request loads.
const PER_LOAD: usize = 8;
/// Samples per phase; each reads its own chunks twice over (raw, then through the store).
const SAMPLES: usize = 32;
/// Store tasks the stream keeps in flight: 256 MiB of 2 MiB chunks.
const STREAM_IN_FLIGHT: usize = 128;
/// Chunks of room the stream cycles through (it evicts its own; the loaded chunks are locked).
const STREAM_ROOM: u64 = 256;
/// How long the stream runs before the samples under it start.
const WARM_UP: Duration = Duration::from_millis(500);
/// How long the stream's own rate is measured, before the samples under it.
const STREAM_ALONE: Duration = Duration::from_secs(3);
/// Bytes the write limit writes each time it is measured.
const LIMIT_BYTES: usize = 512 << 20;
const WAIT: Duration = Duration::from_secs(120);

fn key(i: u64) -> ObjectKey {
    ObjectKey::new(Namespace::new("bench", ""), ChunkHash(u128::from(i) << 32 | 11), KvRank::Shared)
}

/// The byte chunk `i` is filled with.
fn fill(i: u64) -> u8 {
    (i % 251) as u8 + 1
}

/// A store's source: shared bytes, never copied before the store's own copy.
struct Shared(Arc<[u8]>);

impl ChunkSource for Shared {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }

    fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), BufferError> {
        dst.copy_from_slice(&self.0);
        Ok(())
    }

    fn host_bytes(&self) -> Option<&[u8]> {
        Some(&self.0)
    }
}

/// The completions of the store, by kind.
struct Routes {
    stored: Receiver<bool>,
    looked_up: Receiver<(TaskId, Bitmap)>,
    loaded: Receiver<(TaskId, Bitmap, Vec<LoadItem>)>,
}

fn route(completions: Receiver<Completion>) -> Routes {
    let (stored_tx, stored) = unbounded();
    let (looked_up_tx, looked_up) = unbounded();
    let (loaded_tx, loaded) = unbounded();
    std::thread::spawn(move || {
        for completion in completions {
            match completion {
                Completion::Stored { result, .. } => {
                    let _ = stored_tx.send(result.is_ok());
                }
                Completion::LookedUp { task, locked } => {
                    let _ = looked_up_tx.send((task, locked));
                }
                Completion::Loaded { task, loaded, sinks } => {
                    let _ = loaded_tx.send((task, loaded, sinks));
                }
            }
        }
    });
    Routes { stored, looked_up, loaded }
}

/// What the stream did while it ran.
#[derive(Default)]
struct Streamed {
    stored: AtomicU64,
    failed: AtomicU64,
}

/// Keeps `STREAM_IN_FLIGHT` store tasks of one fresh chunk each in flight until `stop`, then
/// waits for the last answers.
fn stream(store: &DiskStore, stored: &Receiver<bool>, stop: &AtomicBool, out: &Streamed) {
    let bytes: Arc<[u8]> = Arc::from(vec![0x5a; CHUNK as usize]);
    let mut next = 1u64 << 24;
    let mut in_flight = 0;
    while !stop.load(Ordering::Acquire) {
        while in_flight < STREAM_IN_FLIGHT {
            let source = Box::new(Shared(Arc::clone(&bytes)));
            store.submit_store(vec![StoreItem { key: key(next), source }]);
            next += 1;
            in_flight += 1;
        }
        if let Ok(ok) = stored.recv_timeout(Duration::from_millis(50)) {
            in_flight -= 1;
            let counter = if ok { &out.stored } else { &out.failed };
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }
    for _ in 0..in_flight {
        stored.recv_timeout(WAIT).unwrap();
    }
}

/// The raw limit: chunks `first..first + PER_LOAD` read straight from the store's file with
/// `O_DIRECT`, split over four threads as the store splits the load; checks it read them.
fn raw_read(file: &File, segment_bytes: u64, first: u64, bufs: &mut [AlignedBuf]) -> Duration {
    let per_thread = PER_LOAD / bufs.len();
    let start = Instant::now();
    std::thread::scope(|s| {
        for (t, buf) in bufs.iter_mut().enumerate() {
            s.spawn(move || {
                for n in 0..per_thread {
                    let chunk = first + (t * per_thread + n) as u64;
                    // One record a segment, segments in the order they were stored.
                    let at = chunk * segment_bytes + BLOCK;
                    file.read_exact_at(buf.as_mut_slice(), at).unwrap();
                    let payload = &buf.as_slice()[BLOCK as usize..];
                    assert_eq!(payload[0], fill(chunk), "not chunk {chunk}'s record");
                    assert_eq!(payload[CHUNK as usize - 1], fill(chunk));
                }
            });
        }
    });
    start.elapsed()
}

/// Latencies of one phase, in seconds.
#[derive(Default)]
struct Phase {
    raw: Vec<f64>,
    lookup: Vec<f64>,
    load: Vec<f64>,
}

/// p50 and p99 (nearest rank) of `samples`, in ms.
fn percentiles(samples: &[f64]) -> (f64, f64) {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank =
        |p: f64| sorted[((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
    (rank(0.50) * 1e3, rank(0.99) * 1e3)
}

/// The store's fsync policy, from `TIERKV_BENCH_FSYNC` (`always` when unset).
fn fsync_policy() -> FsyncPolicy {
    let named = std::env::var("TIERKV_BENCH_FSYNC").unwrap_or_else(|_| "always".into());
    let interval = if let Some(ms) = named.strip_suffix("ms") {
        ms.parse().ok().map(Duration::from_millis)
    } else {
        named.strip_suffix('s').and_then(|s| s.parse().ok()).map(Duration::from_secs)
    };
    match (named.as_str(), interval) {
        ("always", _) => FsyncPolicy::Always,
        ("never", _) => FsyncPolicy::Never,
        (_, Some(interval)) => FsyncPolicy::Periodic(interval),
        _ => panic!("TIERKV_BENCH_FSYNC: always, never or an interval (1s, 500ms), not {named}"),
    }
}

fn main() {
    let parent = std::env::var_os("TIERKV_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(&parent).unwrap();
    let segment_bytes = auto_segment_bytes(CHUNK);
    let on_disk = (2 * SAMPLES * PER_LOAD) as u64;
    let capacity = (on_disk + STREAM_ROOM) * segment_bytes;
    assert!(capacity <= FILE_BYTES, "the raw reads assume one segment file");
    let fsync = fsync_policy();
    let store = DiskStore::open(DiskStoreConfig {
        fsync,
        ..DiskStoreConfig::new(dir.path(), capacity, CHUNK)
    })
    .unwrap();
    let routes = route(store.completions());

    // The chunks loaded, stored one task at a time into a fresh directory: chunk `i` is in
    // segment `i`. Locked, so the stream never evicts them.
    for first in (0..on_disk).step_by(PER_LOAD) {
        let items = (first..first + PER_LOAD as u64)
            .map(|i| StoreItem {
                key: key(i),
                source: Box::new(VecChunk(vec![fill(i); CHUNK as usize])),
            })
            .collect();
        store.submit_store(items);
        assert!(routes.stored.recv_timeout(WAIT).unwrap(), "a setup store failed");
    }
    let all: Vec<ObjectKey> = (0..on_disk).map(key).collect();
    let task = store.submit_lookup_and_lock(all.clone());
    let (t, locked) = routes.looked_up.recv_timeout(WAIT).unwrap();
    assert!(t == task && locked.count_ones() == all.len(), "the chunks loaded are on disk");

    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dir.path().join("seg-00000000.tkv"))
        .unwrap();
    let mut bufs: Vec<AlignedBuf> =
        (0..4).map(|_| AlignedBuf::new(record_bytes(CHUNK) as usize).unwrap()).collect();
    let mut sinks: Vec<Option<Box<dyn tierkv_core::ChunkSink>>> =
        (0..PER_LOAD).map(|_| Some(Box::new(VecChunk(vec![0; CHUNK as usize])) as _)).collect();

    let mut sample = |phase: &mut Phase, n: usize| {
        // Raw reads take the first half of the chunks, loads the second.
        let raw_first = (n * PER_LOAD) as u64;
        let load_first = raw_first + (SAMPLES * PER_LOAD) as u64;
        phase.raw.push(raw_read(&file, segment_bytes, raw_first, &mut bufs).as_secs_f64());
        let keys: Vec<ObjectKey> = (load_first..load_first + PER_LOAD as u64).map(key).collect();
        let start = Instant::now();
        let task = store.submit_lookup_and_lock(keys.clone());
        let (t, locked) = routes.looked_up.recv_timeout(WAIT).unwrap();
        phase.lookup.push(start.elapsed().as_secs_f64());
        assert!(t == task && locked.count_ones() == PER_LOAD, "a lookup missed");
        let items = keys
            .iter()
            .zip(sinks.iter_mut())
            .map(|(key, sink)| LoadItem { key: *key, sink: sink.take().unwrap() })
            .collect();
        let start = Instant::now();
        let task = store.submit_load(items);
        let (t, loaded, items) = routes.loaded.recv_timeout(WAIT).unwrap();
        phase.load.push(start.elapsed().as_secs_f64());
        assert!(t == task && loaded.count_ones() == PER_LOAD, "a load missed");
        for ((item, sink), i) in items.into_iter().zip(sinks.iter_mut()).zip(load_first..) {
            let mut item = item;
            assert_eq!(item.sink.host_bytes_mut().unwrap()[0], fill(i), "chunk {i} loaded wrong");
            *sink = Some(item.sink);
        }
        store.unlock(&keys);
    };

    let mut alone = Phase::default();
    for n in 0..SAMPLES {
        sample(&mut alone, n);
    }

    let stop = AtomicBool::new(false);
    let streamed = Streamed::default();
    let mut under = Phase::default();
    let stored_since = |since: (Instant, u64)| {
        let stored = streamed.stored.load(Ordering::Relaxed) - since.1;
        (stored * CHUNK) as f64 / since.0.elapsed().as_secs_f64()
    };
    let now = || (Instant::now(), streamed.stored.load(Ordering::Relaxed));
    let write_limit = || {
        tierkv_bench::direct_write_bandwidth(&parent, LIMIT_BYTES, CHUNK as usize, WRITES_IN_FLIGHT)
            .unwrap()
    };
    let write_before = write_limit();
    let (stream_alone, stream_sampled) = std::thread::scope(|s| {
        let stream_thread = s.spawn(|| stream(&store, &routes.stored, &stop, &streamed));
        std::thread::sleep(WARM_UP);
        let start = now();
        std::thread::sleep(STREAM_ALONE);
        let alone = stored_since(start);
        let start = now();
        for n in 0..SAMPLES {
            sample(&mut under, n);
        }
        let sampled = stored_since(start);
        stop.store(true, Ordering::Release);
        stream_thread.join().unwrap();
        (alone, sampled)
    });
    let write_after = write_limit();
    let write = (write_before + write_after) / 2.0;

    println!(
        "{SAMPLES} samples a phase of {PER_LOAD} x {} MiB chunks on disk, {} (fsync {fsync:?}, 4 \
         I/O threads, O_DIRECT)",
        CHUNK >> 20,
        parent.display()
    );
    println!(
        "{:<34} {:>9} {:>9} {:>10} {:>10}",
        "figure", "p50 ms", "p99 ms", "ratio p50", "ratio p99"
    );
    let print = |name: &str, samples: &[f64], limit: Option<&[f64]>| {
        let (p50, p99) = percentiles(samples);
        let (r50, r99) = match limit {
            Some(limit) => {
                let (l50, l99) = percentiles(limit);
                (format!("{:.2}", p50 / l50), format!("{:.2}", p99 / l99))
            }
            None => (String::new(), String::new()),
        };
        println!("{name:<34} {p50:>9.1} {p99:>9.1} {r50:>10} {r99:>10}");
    };
    print("limit: raw read, alone", &alone.raw, None);
    print("lookup, alone", &alone.lookup, None);
    print("load, alone", &alone.load, Some(&alone.raw));
    print("limit: raw read, under stores", &under.raw, None);
    print("lookup, under stores", &under.lookup, None);
    print("load, under stores", &under.load, Some(&under.raw));
    print("load, under stores / raw alone", &under.load, Some(&alone.raw));
    println!("{:<34} {:>9} {:>9} {:>10}", "stream of stores", "GB/s", "", "ratio");
    println!(
        "{:<34} {:>9.2} {:>9} {:>10}",
        format!("limit: disk write, 2 MiB x {WRITES_IN_FLIGHT}"),
        write / 1e9,
        format!("({:.2}/{:.2})", write_before / 1e9, write_after / 1e9),
        ""
    );
    for (name, rate) in [("stream alone", stream_alone), ("stream while sampled", stream_sampled)] {
        println!("{name:<34} {:>9.2} {:>9} {:>10.2}", rate / 1e9, "", rate / write);
    }
    println!("stores failed: {}", streamed.failed.load(Ordering::Relaxed));
    store.close();
}
