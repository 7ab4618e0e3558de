//! Round trips through the daemon over the Unix socket: lookup of 64 chunks, and retrieve of 64
//! chunks (256 KiB and 2 MiB) into a worker's shared-memory buffer, with 1, 4 and 8 client
//! processes. Prints p50/p99 and GB/s beside single-core memcpy bandwidth measured in the same
//! run.
//!
//! Then stores from one client, one request at a time against several in flight
//! (`Client::submit_store`), at 64 KiB and 2 MiB, beside memcpy.
//!
//! `cargo bench -p tierkv-integration-tests --bench daemon` (`-- --quick` for a short run;
//! `-- --stores` for the store part alone). Each client is this binary re-executed with
//! `TIERKV_BENCH_CLIENT` set.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, reason = "benchmark")]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tierkv_bench::{Table, memcpy_bandwidth, memcpy_bandwidth_threads};
use tierkv_client::proto::{ChunkBlocks, ChunkId};
use tierkv_client::{Client, SharedBuffer};
use tierkv_integration_tests::Daemon;

const CHUNKS: u64 = 64;

fn chunk(i: u64) -> ChunkId {
    ChunkId(0xbe4c_0000_0000 + u128::from(i))
}

fn refs() -> Vec<ChunkBlocks> {
    (0..CHUNKS).map(|i| ChunkBlocks::one(chunk(i), i)).collect()
}

/// A client process: `rounds` of lookup then retrieve; prints each latency in ns.
fn client(socket: &str, chunk_bytes: u64, seconds: f64) {
    let mut client =
        Client::connect_unix(socket, Client::worker_hello("bench", chunk_bytes)).unwrap();
    let mut buffer = SharedBuffer::new(chunk_bytes, CHUNKS).unwrap();
    // Fault the buffer in and run one untimed round: first-touch page faults are start-up,
    // not the data plane.
    for i in 0..CHUNKS {
        buffer.block_mut(i).unwrap().fill(0);
    }
    let id = client.register_buffer(&buffer).unwrap();
    let ids: Vec<ChunkId> = (0..CHUNKS).map(chunk).collect();
    let warm = client.lookup(0, ids.clone()).unwrap();
    client.retrieve(warm.id, id, refs()).unwrap();
    let (mut lookups, mut retrieves) = (Vec::new(), Vec::new());
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < seconds || lookups.len() < 5 {
        let t = Instant::now();
        let lookup = client.lookup(0, ids.clone()).unwrap();
        lookups.push(t.elapsed().as_nanos());
        assert_eq!(lookup.l1_hit_chunks as u64, CHUNKS, "every chunk is an L1 hit");
        let t = Instant::now();
        client.retrieve(lookup.id, id, refs()).unwrap();
        retrieves.push(t.elapsed().as_nanos());
    }
    let line = |v: &[u128]| v.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(" ");
    println!("lookup {}", line(&lookups));
    println!("retrieve {}", line(&retrieves));
    client.end().unwrap();
}

/// One client storing fresh chunks, `per_request` a request, into a daemon whose L1 holds 1,000
/// chunks (so stores evict, as in the replay), for `seconds`: with `depth` requests in flight
/// (1: each store waits for its reply). The blocks of a request in flight are not touched again
/// until its reply is in. Returns bytes stored per second of wall time.
fn store_rate(chunk_bytes: u64, per_request: u64, depth: usize, seconds: f64) -> f64 {
    let daemon = Daemon::start_with(|dir| {
        format!(
            "[server]\nsocket = \"{}\"\n[metrics]\nenabled = false\n[l1]\ndevice = \"emulated\"\ncapacity = \"{}\"\nslot = \"{}\"\nprefault = true\n[l2]\nenabled = false\n[disk]\nenabled = false\n",
            dir.join("tierkv.sock").display(),
            chunk_bytes * 1000,
            chunk_bytes
        )
    });
    let mut client =
        Client::connect_unix(&daemon.socket, Client::worker_hello("bench", chunk_bytes)).unwrap();
    let groups = depth as u64 + 1;
    let mut buffer = SharedBuffer::new(chunk_bytes, groups * per_request).unwrap();
    for i in 0..groups * per_request {
        buffer.block_mut(i).unwrap().fill(i as u8);
    }
    let id = client.register_buffer(&buffer).unwrap();
    let mut next = 0u64;
    let mut request = |r: u64| -> Vec<ChunkBlocks> {
        let group = r % groups;
        (0..per_request)
            .map(|i| {
                next += 1;
                ChunkBlocks::one(
                    ChunkId(0x5707_0000_0000_0000 + u128::from(next)),
                    group * per_request + i,
                )
            })
            .collect()
    };
    // Warm-up: fill L1 once, so the timed part evicts as a running daemon does.
    for r in 0..(1000 / per_request + 1) {
        client.store(0, id, request(r)).unwrap();
    }
    let mut in_flight = std::collections::VecDeque::new();
    let (mut stored, mut r) = (0u64, 0u64);
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < seconds {
        if in_flight.len() >= depth {
            let done = client.finish_store(in_flight.pop_front().unwrap()).unwrap();
            stored += u64::from(done.stored);
        }
        in_flight.push_back(client.submit_store(0, id, request(r)).unwrap());
        r += 1;
    }
    while let Some(pending) = in_flight.pop_front() {
        stored += u64::from(client.finish_store(pending).unwrap().stored);
    }
    let rate = (stored * chunk_bytes) as f64 / start.elapsed().as_secs_f64();
    assert_eq!(stored, r * per_request, "every chunk was stored");
    client.end().unwrap();
    rate
}

fn stores(seconds: f64) {
    println!("\nstores from one client, fresh chunks, L1 of 1,000 chunks (evicting)\n");
    for (chunk_bytes, per_request, depth) in [(64u64 << 10, 25u64, 8usize), (2 << 20, 8, 4)] {
        let mut table = Table::new("GB/s", 1e9);
        table.limit(
            "memcpy, one core",
            memcpy_bandwidth(chunk_bytes as usize, Duration::from_millis(500)),
        );
        let kib = chunk_bytes >> 10;
        for d in [1, depth] {
            let rate = store_rate(chunk_bytes, per_request, d, seconds);
            let how = if d == 1 { "one at a time".to_string() } else { format!("{d} in flight") };
            table.figure(
                &format!("store {kib} KiB chunks, {per_request} a request, {how}"),
                rate,
                "memcpy, one core",
            );
        }
        println!("{}", table.render());
    }
}

fn percentile(sorted: &[u128], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64
}

fn main() {
    if let Ok(spec) = std::env::var("TIERKV_BENCH_CLIENT") {
        let mut parts = spec.split(',');
        let socket = parts.next().unwrap().to_string();
        let bytes: u64 = parts.next().unwrap().parse().unwrap();
        let seconds: f64 = parts.next().unwrap().parse().unwrap();
        client(&socket, bytes, seconds);
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let seconds = if quick { 0.5 } else { 3.0 };
    if std::env::args().any(|a| a == "--stores") {
        stores(seconds);
        return;
    }
    let me = std::env::current_exe().unwrap();
    println!("daemon round trips over the Unix socket, {CHUNKS} chunks per request, L1 hits\n");
    let mut lines = Vec::new();
    for chunk_bytes in [256u64 << 10, 2 << 20] {
        let memcpy = memcpy_bandwidth(chunk_bytes as usize, Duration::from_millis(500));
        // A large retrieve is split over up to 4 threads (session.rs): one client can use every
        // core, so its figure is also set against all cores copying at once.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let memcpy_all =
            memcpy_bandwidth_threads(chunk_bytes as usize, Duration::from_millis(500), cores);
        let daemon = Daemon::start_with(|dir| {
            format!(
                "[server]\nsocket = \"{}\"\n[metrics]\nenabled = false\n[l1]\ndevice = \"emulated\"\ncapacity = \"{}\"\nslot = \"{}\"\n[l2]\nenabled = false\n[disk]\nenabled = false\n",
                dir.join("tierkv.sock").display(),
                chunk_bytes * CHUNKS * 2,
                chunk_bytes
            )
        });
        // Store the prefix once; every client then looks it up and retrieves it.
        let mut writer =
            Client::connect_unix(&daemon.socket, Client::worker_hello("bench", chunk_bytes))
                .unwrap();
        let mut buffer = SharedBuffer::new(chunk_bytes, CHUNKS).unwrap();
        for i in 0..CHUNKS {
            buffer.block_mut(i).unwrap().fill(i as u8);
        }
        let buffer_id = writer.register_buffer(&buffer).unwrap();
        assert_eq!(writer.store(0, buffer_id, refs()).unwrap().stored as u64, CHUNKS);
        let mut table = Table::new("GB/s", 1e9);
        table.limit("memcpy, one core", memcpy);
        table.limit(&format!("memcpy, all {cores} cores at once"), memcpy_all);
        for clients in [1usize, 4, 8] {
            let spec = format!("{},{chunk_bytes},{seconds}", daemon.socket.display());
            let started = Instant::now();
            let children: Vec<_> = (0..clients)
                .map(|_| {
                    Command::new(&me)
                        .env("TIERKV_BENCH_CLIENT", &spec)
                        .stdout(Stdio::piped())
                        .spawn()
                        .unwrap()
                })
                .collect();
            let (mut lookups, mut retrieves) = (Vec::new(), Vec::new());
            for child in children {
                let output = child.wait_with_output().unwrap();
                assert!(output.status.success());
                for line in BufReader::new(&output.stdout[..]).lines() {
                    let line = line.unwrap();
                    let mut words = line.split_whitespace();
                    let target = match words.next() {
                        Some("lookup") => &mut lookups,
                        Some("retrieve") => &mut retrieves,
                        _ => continue,
                    };
                    target.extend(words.map(|w| w.parse::<u128>().unwrap()));
                }
            }
            let wall = started.elapsed().as_secs_f64();
            lookups.sort_unstable();
            retrieves.sort_unstable();
            let moved = retrieves.len() as f64 * (CHUNKS * chunk_bytes) as f64;
            // Throughput over the time spent retrieving, summed per client: the data plane's
            // rate, not diluted by process start-up.
            let busy: f64 = retrieves.iter().map(|&n| n as f64 / 1e9).sum::<f64>() / clients as f64;
            let line = format!(
                "{:>4} KiB x{clients}: lookup p50 {:>6.0} us p99 {:>6.0} us | retrieve p50 {:>7.0} us p99 {:>7.0} us | {:.2} GB/s ({} rounds, {wall:.1} s)",
                chunk_bytes >> 10,
                percentile(&lookups, 0.5) / 1e3,
                percentile(&lookups, 0.99) / 1e3,
                percentile(&retrieves, 0.5) / 1e3,
                percentile(&retrieves, 0.99) / 1e3,
                moved / busy / 1e9,
                retrieves.len(),
            );
            println!("{line}");
            lines.push(line);
            table.figure(
                &format!("retrieve {} KiB chunks, {clients} client(s)", chunk_bytes >> 10),
                moved / busy,
                "memcpy, one core",
            );
            if clients == 1 {
                table.figure(
                    &format!("retrieve {} KiB chunks, 1 client, vs all cores", chunk_bytes >> 10),
                    moved / busy,
                    &format!("memcpy, all {cores} cores at once"),
                );
            }
        }
        println!("\n{}", table.render());
        writer.end().unwrap();
        drop(daemon);
    }
    stores(seconds);
}
