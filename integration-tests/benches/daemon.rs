//! Round trips through the daemon over the Unix socket: lookup of 64 chunks, and retrieve of 64
//! chunks (256 KiB and 2 MiB) into a worker's shared-memory buffer, with 1, 4 and 8 client
//! processes. Prints p50/p99 and GB/s beside memcpy bandwidth measured in the same run, right
//! before and right after each round: one core's, and that of as many threads at once as the
//! round copies on (a retrieve is split over a thread per core, and several clients retrieve at
//! once). GB/s are the bytes all clients retrieved within the window in which every
//! client was timing, over that window's length.
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
use std::time::{Duration, Instant, SystemTime};

use tierkv_bench::{Table, bracketed, memcpy_bandwidth, memcpy_bandwidth_threads};
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

/// Nanoseconds since the Unix epoch: a clock every client process reads alike.
fn epoch_ns() -> u128 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

/// A client process: `rounds` of lookup then retrieve; prints each latency in ns, the epoch time
/// at which each retrieve finished, and the epoch times its timed loop began and ended.
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
    let (mut lookups, mut retrieves, mut finished) = (Vec::new(), Vec::new(), Vec::new());
    let began = epoch_ns();
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < seconds || lookups.len() < 5 {
        let t = Instant::now();
        let lookup = client.lookup(0, ids.clone()).unwrap();
        lookups.push(t.elapsed().as_nanos());
        assert_eq!(lookup.l1_hit_chunks as u64, CHUNKS, "every chunk is an L1 hit");
        let t = Instant::now();
        client.retrieve(lookup.id, id, refs()).unwrap();
        retrieves.push(t.elapsed().as_nanos());
        finished.push(epoch_ns());
    }
    let ended = epoch_ns();
    let line = |v: &[u128]| v.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(" ");
    println!("window {began} {ended}");
    println!("finished {}", line(&finished));
    println!("lookup {}", line(&lookups));
    println!("retrieve {}", line(&retrieves));
    client.end().unwrap();
}

/// One client storing fresh chunks, `per_request` a request, into a daemon whose L1 holds 1,000
/// chunks (so stores evict, as in the replay), for `seconds`: with `depth` requests in flight
/// (1: each store waits for its reply). The blocks of a request in flight are not touched again
/// until its reply is in, and requests take their blocks in turn from at least 128 MiB of
/// sources (as much as the memcpy limit rotates over), so neither stays in cache. Returns bytes
/// stored per second of wall time.
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
    // Until 2026-11-30 the sources were depth + 1 requests' blocks (3-80 MiB), partly in cache
    // while the limit copied from memory.
    let groups = (depth as u64 + 1).max((128u64 << 20).div_ceil(per_request * chunk_bytes));
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
        let kib = chunk_bytes >> 10;
        for d in [1, depth] {
            // One core's memcpy, right before and right after the figure.
            let copy = || memcpy_bandwidth(chunk_bytes as usize, Duration::from_millis(250));
            let (rate, limit) =
                bracketed(copy, || store_rate(chunk_bytes, per_request, d, seconds));
            let how = if d == 1 { "one at a time".to_string() } else { format!("{d} in flight") };
            let name = format!("memcpy, one core, around {how} (mean)");
            table.limit(&name, limit);
            table.figure(
                &format!("store {kib} KiB chunks, {per_request} a request, {how}"),
                rate,
                &name,
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
        // A large retrieve is split over a thread per core, up to 4 (session.rs), and several
        // clients retrieve at once: each round is set against memcpy on as many threads as it
        // copies on (clients x threads per retrieve; on cores shared with other work, more
        // threads take a larger share of them), one client's also against one core, each limit
        // measured right before and right after the round it bounds (the other sessions on this
        // machine move memcpy by as much as rounds differ).
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let time = Duration::from_millis(250);
        let one_core = || memcpy_bandwidth(chunk_bytes as usize, time);
        let threads = |clients: usize| clients * cores.min(4);
        let all_threads =
            |clients| memcpy_bandwidth_threads(chunk_bytes as usize, time, threads(clients));
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
        for clients in [1usize, 4, 8] {
            let before = (one_core(), all_threads(clients));
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
            let (mut lookups, mut retrieves, mut finished) = (Vec::new(), Vec::new(), Vec::new());
            let (mut window_start, mut window_end) = (0u128, u128::MAX);
            for child in children {
                let output = child.wait_with_output().unwrap();
                assert!(output.status.success());
                for line in BufReader::new(&output.stdout[..]).lines() {
                    let line = line.unwrap();
                    let mut words = line.split_whitespace();
                    let target = match words.next() {
                        Some("window") => {
                            let mut at = words.map(|w| w.parse::<u128>().unwrap());
                            window_start = window_start.max(at.next().unwrap());
                            window_end = window_end.min(at.next().unwrap());
                            continue;
                        }
                        Some("finished") => &mut finished,
                        Some("lookup") => &mut lookups,
                        Some("retrieve") => &mut retrieves,
                        _ => continue,
                    };
                    target.extend(words.map(|w| w.parse::<u128>().unwrap()));
                }
            }
            let wall = started.elapsed().as_secs_f64();
            let after = (one_core(), all_threads(clients));
            let (one_name, all_name) = (
                format!("memcpy, one core, around {clients} client(s) (mean)"),
                format!(
                    "memcpy, {} threads on {cores} cores, around {clients} client(s) (mean)",
                    threads(clients)
                ),
            );
            if clients == 1 {
                table.limit(&one_name, (before.0 + after.0) / 2.0);
            }
            table.limit(&all_name, (before.1 + after.1) / 2.0);
            lookups.sort_unstable();
            retrieves.sort_unstable();
            // Throughput over the window in which every client was timing (not diluted by process
            // start-up or by clients that finished early): the retrieves that finished in it.
            // Until 2026-11-30 it was over the time inside retrieve calls, averaged per client,
            // which left out the time a client spent looking up while others retrieved: it
            // overstated the rate of several clients.
            assert!(window_end > window_start, "the clients' timed windows do not overlap");
            let in_window = finished.iter().filter(|&&t| t > window_start && t <= window_end);
            let moved = in_window.count() as f64 * (CHUNKS * chunk_bytes) as f64;
            let busy = (window_end - window_start) as f64 / 1e9;
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
            // One client's figure against one core as well, as it was first reported; every
            // figure against memcpy on as many threads as it copies on.
            let kib = chunk_bytes >> 10;
            if clients == 1 {
                table.figure(
                    &format!("retrieve {kib} KiB chunks, 1 client, vs one core"),
                    moved / busy,
                    &one_name,
                );
            }
            table.figure(
                &format!("retrieve {kib} KiB chunks, {clients} client(s)"),
                moved / busy,
                &all_name,
            );
        }
        println!("\n{}", table.render());
        writer.end().unwrap();
        drop(daemon);
    }
    stores(seconds);
}
