//! Remote-tier bandwidth: RemoteStore store and load of 2 MiB and 4 MiB chunks with several in
//! flight, each printed as a ratio of the raw limit measured in the same run against the same
//! server: the same `redis` crate doing plain `SET`/`GET` of values of the same size with as
//! many in flight (no header, no checksum, no copy into or out of a chunk buffer), and
//! `redis-benchmark` (the server's own C client) for reference.
//!
//! Each figure is the best of a few rounds that alternate the raw client and the RemoteStore, so
//! both see the same machine. It starts its own servers on loopback (Debian's redis-server): one standalone server, and a
//! 3-master + 3-replica cluster.
//!
//! `cargo bench -p tierkv-remote --bench remote`

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark setup: a failure aborts the run"
)]
#![allow(clippy::print_stdout, reason = "the table is the benchmark's output")]

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tierkv_bench::{Pump, Table};
use tierkv_core::{
    ChunkHash, KvRank, LoadItem, Namespace, ObjectKey, StoreItem, TierAdapter, VecChunk,
};
use tierkv_remote::{RemoteConfig, RemoteMode, RemoteStore};
use tierkv_testkit::redis::{RedisCluster, RedisStandalone};

/// Values on the wire at once (the adapter's `max_in_flight`, and the raw client's), tasks
/// submitted at once (twice as many chunks as go on the wire: the adapter's limit, not the
/// submitter's round trips, bounds it, as in the pipelines), chunks per task.
const VALUES_IN_FLIGHT: usize = 8;
const TASKS_IN_FLIGHT: usize = 8;
const PER_TASK: usize = 2;
/// Bytes moved per figure and round.
const TOTAL: u64 = 256 << 20;
/// Rounds, alternating the raw client and the RemoteStore; each figure is its best round (the
/// machine is shared: the best round is the one least disturbed).
const ROUNDS: usize = 5;

fn key(i: u64) -> ObjectKey {
    ObjectKey::new(Namespace::new("bench", ""), ChunkHash(u128::from(i) << 32 | 9), KvRank::Shared)
}

fn adapter(urls: Vec<String>, mode: RemoteMode, chunk: u64, prefix: &str) -> RemoteStore {
    RemoteStore::open(RemoteConfig {
        key_prefix: prefix.into(),
        op_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(10),
        max_in_flight: VALUES_IN_FLIGHT,
        ttl: Some(Duration::from_secs(600)),
        threads: 2,
        ..RemoteConfig::new(urls, mode, chunk)
    })
    .unwrap()
}

/// (store, load) bytes per second through the RemoteStore.
fn tierkv_figures(store: &RemoteStore, chunk: u64) -> (f64, f64) {
    let total = (TOTAL / chunk) as usize;
    let mut sources: Vec<Option<Vec<u8>>> =
        (0..total).map(|i| Some(vec![0x5a ^ i as u8; chunk as usize])).collect();
    let stored = Pump { per_task: PER_TASK, in_flight: TASKS_IN_FLIGHT }
        .run(store, total, chunk, |first| {
            let items = (first..(first + PER_TASK).min(total))
                .map(|i| StoreItem {
                    key: key(i as u64),
                    source: Box::new(VecChunk(sources[i].take().unwrap())),
                })
                .collect();
            store.submit_store(items)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let mut sinks: Vec<Option<Vec<u8>>> =
        (0..total).map(|_| Some(vec![0u8; chunk as usize])).collect();
    let loaded = Pump { per_task: PER_TASK, in_flight: TASKS_IN_FLIGHT }
        .run(store, total, chunk, |first| {
            let items = (first..(first + PER_TASK).min(total))
                .map(|i| LoadItem {
                    key: key(i as u64),
                    sink: Box::new(VecChunk(sinks[i].take().unwrap())),
                })
                .collect();
            store.submit_load(items)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    (stored, loaded)
}

enum Raw {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Raw {
    async fn query<T: redis::FromRedisValue>(&self, cmd: redis::Cmd) -> T {
        match self {
            Raw::Single(c) => cmd.query_async(&mut c.clone()).await.unwrap(),
            Raw::Cluster(c) => cmd.query_async(&mut c.clone()).await.unwrap(),
        }
    }
}

/// (SET, GET) bytes per second with the same crate, the same number in flight, plain values.
fn raw_figures(urls: &[String], mode: RemoteMode, chunk: u64, prefix: &str) -> (f64, f64) {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let raw = Arc::new(match mode {
            RemoteMode::Standalone => Raw::Single(
                redis::Client::open(urls[0].as_str())
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap(),
            ),
            RemoteMode::Cluster => Raw::Cluster(
                redis::cluster::ClusterClient::new(urls.to_vec())
                    .unwrap()
                    .get_async_connection()
                    .await
                    .unwrap(),
            ),
        });
        let total = (TOTAL / chunk) as usize;
        let values: Vec<Vec<u8>> =
            (0..total).map(|i| vec![0xa5 ^ i as u8; chunk as usize]).collect();
        let permits = Arc::new(tokio::sync::Semaphore::new(VALUES_IN_FLIGHT));
        let start = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for (i, value) in values.into_iter().enumerate() {
            let (raw, permits) = (Arc::clone(&raw), Arc::clone(&permits));
            let name = format!("{prefix}:raw:{i}");
            let permit = permits.acquire_owned().await.unwrap();
            set.spawn(async move {
                let mut cmd = redis::cmd("SET");
                cmd.arg(name).arg(value);
                raw.query::<()>(cmd).await;
                drop(permit);
            });
        }
        while set.join_next().await.is_some() {}
        let stored = TOTAL as f64 / start.elapsed().as_secs_f64();
        let start = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for i in 0..total {
            let (raw, permits) = (Arc::clone(&raw), Arc::clone(&permits));
            let name = format!("{prefix}:raw:{i}");
            let permit = permits.acquire_owned().await.unwrap();
            set.spawn(async move {
                let mut cmd = redis::cmd("GET");
                cmd.arg(name);
                let value: Vec<u8> = raw.query(cmd).await;
                drop(permit);
                value
            });
        }
        let mut got = Vec::with_capacity(total);
        while let Some(value) = set.join_next().await {
            got.push(value.unwrap());
        }
        let loaded = TOTAL as f64 / start.elapsed().as_secs_f64();
        assert!(got.iter().all(|v| v.len() == chunk as usize));
        (stored, loaded)
    })
}

/// `redis-benchmark` SET and GET of `chunk`-byte values, `VALUES_IN_FLIGHT` clients; bytes per
/// second, `None` where it cannot run.
fn redis_benchmark(port: u16, cluster: bool, chunk: u64) -> Option<(f64, f64)> {
    let n = (TOTAL / chunk).to_string();
    let mut command = Command::new("redis-benchmark");
    command.args(["-h", "127.0.0.1", "-p", &port.to_string(), "-t", "set,get", "-q", "--csv"]);
    command.args(["-d", &chunk.to_string(), "-n", &n, "-c", &VALUES_IN_FLIGHT.to_string()]);
    if cluster {
        command.arg("--cluster");
    }
    let out = command.output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rps = |test: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.starts_with(&format!("\"{test}\"")))?;
        line.split(',').nth(1)?.trim_matches('"').parse::<f64>().ok()
    };
    Some((rps("SET")? * chunk as f64, rps("GET")? * chunk as f64))
}

fn measure(table: &mut Table, label: &str, urls: Vec<String>, mode: RemoteMode, port: u16) {
    for chunk in [2u64 << 20, 4 << 20] {
        let mib = chunk >> 20;
        let prefix = format!("bench-{label}-{mib}");
        let store = adapter(urls.clone(), mode, chunk, &prefix);
        let (mut raw_set, mut raw_get, mut stored, mut loaded) = (0f64, 0f64, 0f64, 0f64);
        for _ in 0..ROUNDS {
            let (set, get) = raw_figures(&urls, mode, chunk, &prefix);
            let (st, ld) = tierkv_figures(&store, chunk);
            (raw_set, raw_get) = (raw_set.max(set), raw_get.max(get));
            (stored, loaded) = (stored.max(st), loaded.max(ld));
        }
        drop(store);
        let set_limit = format!("{label} {mib} MiB: redis crate SET");
        let get_limit = format!("{label} {mib} MiB: redis crate GET");
        table.limit(&set_limit, raw_set).limit(&get_limit, raw_get);
        table.figure(&format!("{label} {mib} MiB: RemoteStore store"), stored, &set_limit);
        table.figure(&format!("{label} {mib} MiB: RemoteStore load"), loaded, &get_limit);
        if let Some((bench_set, bench_get)) =
            redis_benchmark(port, mode == RemoteMode::Cluster, chunk)
        {
            let (set_ref, get_ref) = (
                format!("{label} {mib} MiB: redis-benchmark SET"),
                format!("{label} {mib} MiB: redis-benchmark GET"),
            );
            table.limit(&set_ref, bench_set).limit(&get_ref, bench_get);
            table.figure(&format!("{label} {mib} MiB: RemoteStore store, same"), stored, &set_ref);
            table.figure(&format!("{label} {mib} MiB: RemoteStore load, same"), loaded, &get_ref);
        }
    }
}

fn main() {
    if let Err(why) = tierkv_testkit::redis::redis_available() {
        println!("skipped: {why}");
        return;
    }
    println!(
        "remote tier: {} MiB per figure and round, best of {ROUNDS} alternating rounds, {VALUES_IN_FLIGHT} values on the wire ({TASKS_IN_FLIGHT} tasks of {PER_TASK} chunks submitted)\n",
        TOTAL >> 20
    );
    let mut table = Table::new("GB/s", 1e9);
    let server = RedisStandalone::start(&[]);
    measure(&mut table, "standalone", vec![server.url()], RemoteMode::Standalone, server.node.port);
    drop(server);
    let cluster = RedisCluster::start();
    let port = cluster.nodes[0].port;
    measure(&mut table, "cluster", cluster.urls(), RemoteMode::Cluster, port);
    print!("{}", table.render());
}
