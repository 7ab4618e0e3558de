//! The RemoteStore against real Redis: a 3-master + 3-replica cluster and a standalone server
//! (Debian's redis-server), on loopback. The adapter contract (C1, C2, C4-C6, C8: the remote tier
//! cannot lock or be full, so C3 and C7 do not apply), values that prove themselves, tenants
//! that never meet, and every failure a miss: a master killed, the whole cluster hung or gone, a
//! server full.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tierkv_core::{
    Bitmap, ChunkHash, Completion, KvRank, Namespace, ObjectKey, StoreItem, TierAdapter, TierError,
    VecChunk,
};
use tierkv_remote::format::{HEADER_BYTES, encode, redis_key};
use tierkv_remote::{RemoteConfig, RemoteMode, RemoteStore};
use tierkv_testkit::contract::{self, OpenTier, SharedTier, key, keys, payload};
use tierkv_testkit::redis::{RedisCluster, RedisStandalone};
use tierkv_testkit::require_redis;

mod common;
use common::{Seen, open_recorded, recorded, unique_prefix};

const CHUNK: u64 = 64 << 10;

/// One cluster for the tests that do not break it; each uses its own key prefix.
fn shared_cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(RedisCluster::start)
}

fn config(urls: Vec<String>, mode: RemoteMode, prefix: &str) -> RemoteConfig {
    RemoteConfig {
        key_prefix: prefix.to_string(),
        connect_timeout: Duration::from_millis(500),
        op_timeout: Duration::from_millis(500),
        reconnect_interval: Duration::from_millis(200),
        ttl: Some(Duration::from_secs(600)),
        ..RemoteConfig::new(urls, mode, CHUNK)
    }
}

fn open_tier(config: RemoteConfig) -> OpenTier {
    OpenTier {
        tier: Arc::new(RemoteStore::open(config).unwrap()),
        chunk_bytes: CHUNK,
        keep: Box::new(()),
    }
}

macro_rules! contract_on {
    ($module:ident, $open:expr) => {
        mod $module {
            use super::*;

            fn open(_capacity: u64) -> OpenTier {
                $open
            }

            #[test]
            fn c1_store_completes_once_and_only_once() {
                require_redis!();
                contract::c1_store_completes_once_and_only_once(&open);
            }

            #[test]
            fn c2_lookup_answers_per_key() {
                require_redis!();
                contract::c2_lookup_answers_per_key(&open);
            }

            #[test]
            fn c4_load_copies_exact_bytes_and_reports_absent_keys() {
                require_redis!();
                contract::c4_load_copies_exact_bytes_and_reports_absent_keys(&open);
            }

            #[test]
            fn c5_five_keys_in_one_task_and_unique_task_ids() {
                require_redis!();
                contract::c5_five_keys_in_one_task_and_unique_task_ids(&open);
            }

            #[test]
            fn c6_round_trip_of_1_and_100_keys() {
                require_redis!();
                contract::c6_round_trip_of_1_and_100_keys(&open);
            }

            #[test]
            fn c8_close_with_tasks_in_flight() {
                require_redis!();
                contract::c8_close_with_tasks_in_flight(&open);
            }
        }
    };
}

contract_on!(
    contract_cluster,
    open_tier(config(shared_cluster().urls(), RemoteMode::Cluster, &unique_prefix("c")))
);

fn standalone() -> &'static RedisStandalone {
    static SERVER: OnceLock<RedisStandalone> = OnceLock::new();
    SERVER.get_or_init(|| RedisStandalone::start(&[]))
}

contract_on!(
    contract_standalone,
    open_tier(config(vec![standalone().url()], RemoteMode::Standalone, &unique_prefix("s")))
);

#[test]
fn a_value_that_does_not_verify_is_a_miss_counted_never_served() {
    require_redis!();
    let cluster = shared_cluster();
    let prefix = unique_prefix("verify");
    let (open, snapshotter) =
        recorded(|| open_tier(config(cluster.urls(), RemoteMode::Cluster, &prefix)));
    let tier = SharedTier::new(open.tier, CHUNK);
    tier.store(&keys(0..4)).unwrap();
    assert_eq!(tier.load_verified(&keys(0..4)).count_ones(), 4);
    let name = |i: u64| redis_key(&prefix, &key(i));

    // A flipped payload byte, written with redis-cli: the checksum catches it.
    let at = HEADER_BYTES as u64 + 1000;
    let original = payload(&key(0), CHUNK)[1000];
    let flipped = if original == b'Z' { "Y" } else { "Z" };
    assert_eq!(
        cluster.cli(&["SETRANGE", &name(0), &at.to_string(), flipped]),
        (CHUNK + HEADER_BYTES as u64).to_string()
    );
    // A value cut short.
    let whole = encode(&key(1), &payload(&key(1), CHUNK));
    assert_eq!(cluster.cli_with_input(&["SET", &name(1)], Some(&whole[..whole.len() - 7])), "OK");
    // Another key's value, whole and valid, under this key.
    let foreign = encode(&key(3), &payload(&key(3), CHUNK));
    assert_eq!(cluster.cli_with_input(&["SET", &name(2)], Some(&foreign)), "OK");

    assert_eq!(tier.lookup(&keys(0..4)).count_ones(), 4, "the damaged values exist");
    tier.tier.unlock(&keys(0..4));
    let loaded = tier.load_verified(&keys(0..4));
    assert_eq!(
        loaded,
        Bitmap::from_bools([false, false, false, true]),
        "only the intact value loads"
    );
    let seen = Seen::take(&snapshotter);
    assert_eq!(seen.get("tierkv_errors_total", "checksum"), 1.0);
    assert_eq!(seen.get("tierkv_errors_total", "truncated"), 1.0);
    assert_eq!(seen.get("tierkv_errors_total", "wrong_key"), 1.0);
    assert_eq!(seen.get("tierkv_checksum_failures_total", ""), 3.0);
    assert_eq!(seen.get("tierkv_tier_loads_total", ""), 4.0 + 1.0);

    // Storing again heals the value.
    tier.store(&keys(0..3)).unwrap();
    assert_eq!(tier.load_verified(&keys(0..4)).count_ones(), 4);
}

/// A sink whose copy panics: a bug in the caller's buffer type.
struct PanickingSink;

impl tierkv_core::ChunkSink for PanickingSink {
    fn len(&self) -> u64 {
        CHUNK
    }

    fn copy_from_host(&mut self, _src: &[u8]) -> Result<(), tierkv_core::BufferError> {
        panic!("a sink that panics");
    }
}

#[test]
fn a_load_whose_sink_panics_still_names_each_sink_handed_back_by_its_own_bit() {
    // Keys 0 and 1 are stored, key 2 is not; key 0's sink panics as the value lands. Its sink
    // cannot come back, and the bits must follow the sinks that do: read against the keys
    // asked for, key 1's bit would say key 2 (never written) loaded.
    require_redis!();
    let prefix = unique_prefix("panic");
    let store =
        RemoteStore::open(config(vec![standalone().url()], RemoteMode::Standalone, &prefix))
            .unwrap();
    let tier = SharedTier::new(Arc::new(store), CHUNK);
    tier.store(&keys(0..2)).unwrap();
    let items = vec![
        tierkv_core::LoadItem { key: key(0), sink: Box::new(PanickingSink) },
        tierkv_core::LoadItem { key: key(1), sink: Box::new(VecChunk(vec![0; CHUNK as usize])) },
        tierkv_core::LoadItem { key: key(2), sink: Box::new(VecChunk(vec![0; CHUNK as usize])) },
    ];
    // Through the tier's router: the completion channel has one consumer, and it is the router.
    let completion = tier.call(|t| t.submit_load(items));
    let Completion::Loaded { loaded, sinks, .. } = completion else { panic!("not a load") };
    assert_eq!(loaded.len(), sinks.len(), "one bit per sink handed back");
    for (i, item) in sinks.iter().enumerate() {
        assert_eq!(loaded.get(i), item.key == key(1), "{:?}", item.key);
    }
}

/// A source whose bytes cannot be read: a device copy that failed.
struct UnreadableSource;

impl tierkv_core::ChunkSource for UnreadableSource {
    fn len(&self) -> u64 {
        CHUNK
    }

    fn copy_to_host(&self, _dst: &mut [u8]) -> Result<(), tierkv_core::BufferError> {
        Err(tierkv_core::BufferError::Device("the copy failed".into()))
    }
}

#[test]
fn a_store_whose_source_cannot_be_read_fails_counted_as_copy_and_stores_nothing_of_it() {
    require_redis!();
    let server = RedisStandalone::start(&[]);
    let prefix = unique_prefix("unreadable");
    let (open, snapshotter) =
        recorded(|| open_tier(config(vec![server.url()], RemoteMode::Standalone, &prefix)));
    let tier = SharedTier::new(open.tier, CHUNK);
    let items = vec![
        StoreItem { key: key(0), source: Box::new(VecChunk(payload(&key(0), CHUNK))) },
        StoreItem { key: key(1), source: Box::new(UnreadableSource) },
    ];
    let completion = tier.call(|t| t.submit_store(items));
    let Completion::Stored { result, .. } = completion else { panic!("not a store") };
    assert!(result.is_err(), "a store with an unreadable source succeeded");
    assert_eq!(server.node.cli(&["EXISTS", &redis_key(&prefix, &key(1))]), "0");
    let seen = Seen::take(&snapshotter);
    assert_eq!(seen.get("tierkv_errors_total", "copy"), 1.0);
    assert_eq!(tier.load_verified(&keys(0..2)), Bitmap::from_bools([true, false]));
}

/// A store task whose values all fail counts one error, as a lookup's or a load's does: a
/// server gone is one event per call, not one per value.
#[test]
fn a_store_of_many_values_to_a_server_gone_counts_one_error() {
    require_redis!();
    let mut server = RedisStandalone::start(&[]);
    let prefix = unique_prefix("gone");
    let (open, snapshotter) =
        recorded(|| open_tier(config(vec![server.url()], RemoteMode::Standalone, &prefix)));
    let tier = SharedTier::new(open.tier, CHUNK);
    tier.store(&keys(0..1)).unwrap();
    Seen::take(&snapshotter);
    server.node.kill();
    assert!(tier.store(&keys(1..17)).is_err(), "a store to a server gone succeeded");
    let seen = Seen::take(&snapshotter);
    assert_eq!(seen.total("tierkv_errors_total"), 1.0, "{seen:?}");
}

#[test]
fn two_namespaces_never_see_each_other() {
    require_redis!();
    let cluster = shared_cluster();
    let prefix = unique_prefix("tenants");
    let tier = SharedTier::new(
        open_tier(config(cluster.urls(), RemoteMode::Cluster, &prefix)).tier,
        CHUNK,
    );
    let tenant = |salt: &str, i: u64| {
        ObjectKey::new(
            Namespace::new("model", salt),
            ChunkHash(u128::from(i) << 64 | 0xab),
            KvRank::Shared,
        )
    };
    let a: Vec<ObjectKey> = (0..3).map(|i| tenant("a", i)).collect();
    let b: Vec<ObjectKey> = (0..3).map(|i| tenant("b", i)).collect();
    tier.store(&a).unwrap();
    assert_eq!(tier.lookup(&b).count_ones(), 0, "tenant b finds tenant a's chunks");
    assert_eq!(tier.load_verified(&b).count_ones(), 0);
    // Even tenant a's value copied under tenant b's Redis key is never served to b.
    let stolen = encode(&a[0], &payload(&a[0], CHUNK));
    assert_eq!(cluster.cli_with_input(&["SET", &redis_key(&prefix, &b[0])], Some(&stolen)), "OK");
    assert!(tier.lookup(&b[..1]).get(0), "the copied value is there");
    tier.tier.unlock(&b[..1]);
    assert_eq!(tier.load_verified(&b).count_ones(), 0, "another namespace's value was served");
    assert_eq!(tier.load_verified(&a).count_ones(), 3);
    // The namespace leads every Redis key: a tenant's keys are one SCAN pattern.
    assert!(redis_key(&prefix, &a[0]).starts_with(&format!("{prefix}:{:016x}:", a[0].namespace.0)));
}

/// Loads of `keys` until `until` says stop; every byte verified (SharedTier panics on wrong
/// bytes). Returns how many loads had misses and how many were whole. A degraded tier misses at
/// once, so the loads pause a little between rounds: without pauses the loop holds a core of the
/// 2-core CI machine that the Redis servers need for their failover election.
fn load_until(
    tier: &SharedTier,
    keys: &[ObjectKey],
    mut until: impl FnMut(usize) -> bool,
) -> (u64, u64) {
    let (mut partial, mut whole) = (0, 0);
    loop {
        let loaded = tier.load_verified(keys).count_ones();
        if loaded == keys.len() {
            whole += 1;
        } else {
            partial += 1;
        }
        if until(loaded) {
            return (partial, whole);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_master_killed_during_loads_misses_then_hits_after_failover() {
    require_redis!();
    let mut cluster = RedisCluster::start();
    let prefix = unique_prefix("failover");
    let store =
        Arc::new(RemoteStore::open(config(cluster.urls(), RemoteMode::Cluster, &prefix)).unwrap());
    let tier = SharedTier::new(Arc::clone(&store) as Arc<dyn TierAdapter>, CHUNK);
    let all = keys(0..48);
    tier.store(&all).unwrap();
    // Wait until the replicas have every value, so the failover loses nothing.
    cluster.wait_replicated(Duration::from_secs(20));
    assert_eq!(tier.load_verified(&all).count_ones(), all.len());
    let victim = cluster.master_of(&redis_key(&prefix, &all[0])).unwrap();
    let started = Instant::now();
    cluster.nodes[victim].kill();
    // Loads go on while the master is gone and the replica takes over.
    let (partial, whole) = load_until(&tier, &all, |loaded| {
        if started.elapsed() > Duration::from_secs(60) {
            // What a failure needs to be understood: the tier's view and the cluster's.
            let nodes = cluster
                .nodes
                .iter()
                .find(|n| n.running())
                .map(|n| n.cli(&["CLUSTER", "NODES"]))
                .unwrap_or_default();
            panic!(
                "never recovered after the failover: {loaded} of {} loaded, the tier degraded: \
                 {:?}\nCLUSTER NODES:\n{nodes}",
                all.len(),
                store.degraded()
            );
        }
        loaded == all.len() && started.elapsed() > Duration::from_millis(200)
    });
    assert!(partial > 0, "loads never missed while a master was down ({whole} whole)");
    cluster.wait_ok(Duration::from_secs(30));
    assert!(!cluster.masters().contains(&victim));
    assert_eq!(
        tier.load_verified(&all).count_ones(),
        all.len(),
        "every value survived on the replica"
    );
    // The old master comes back as a replica; nothing changes for the readers.
    cluster.nodes[victim].restart();
    cluster.wait_ok(Duration::from_secs(30));
    assert_eq!(tier.load_verified(&all).count_ones(), all.len());
}

#[test]
fn a_hung_master_costs_at_most_the_deadline_and_never_wrong_bytes() {
    require_redis!();
    let cluster = RedisCluster::start();
    let prefix = unique_prefix("slow");
    let store =
        Arc::new(RemoteStore::open(config(cluster.urls(), RemoteMode::Cluster, &prefix)).unwrap());
    let tier = SharedTier::new(store.clone(), CHUNK);
    let all = keys(0..32);
    tier.store(&all).unwrap();
    cluster.wait_replicated(Duration::from_secs(20));
    let victim = cluster.master_of(&redis_key(&prefix, &all[0])).unwrap();
    // A master that accepts connections and never answers (SIGSTOP): a slow node at its worst.
    cluster.nodes[victim].pause();
    let started = Instant::now();
    // Each load ends within the deadline (500 ms) plus scheduling slack, hung master or not.
    let (mut previous, mut slowest) = (Instant::now(), Duration::ZERO);
    let (partial, _) = load_until(&tier, &all, |loaded| {
        slowest = slowest.max(previous.elapsed());
        previous = Instant::now();
        assert!(started.elapsed() < Duration::from_secs(60), "never recovered from a hung master");
        loaded == all.len()
    });
    assert!(partial > 0, "no load missed while a master hung");
    assert!(slowest < Duration::from_secs(2), "a load took {slowest:?}");
    // Recovered after the failover, the master still hung.
    healed(&store);
    cluster.nodes[victim].resume();
    cluster.wait_ok(Duration::from_secs(30));
    assert_eq!(tier.load_verified(&all).count_ones(), all.len());
}

/// Waits (briefly) until the tier is healthy: on a cluster, the probe a successful call started
/// heals it once every master answered.
fn healed(store: &RemoteStore) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Some(why) = store.degraded() {
        assert!(Instant::now() < deadline, "still degraded: {why}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn the_whole_cluster_hung_or_gone_is_a_miss_within_the_deadline_then_recovers() {
    require_redis!();
    let mut cluster = RedisCluster::start();
    let prefix = unique_prefix("down");
    let (store, snapshotter) = open_recorded(RemoteConfig {
        // Long enough that the calls right after a failure all fall in its window.
        reconnect_interval: Duration::from_secs(1),
        ..config(cluster.urls(), RemoteMode::Cluster, &prefix)
    });
    let tier = SharedTier::new(store.clone(), CHUNK);
    let all = keys(0..16);
    tier.store(&all).unwrap();
    // A call's success on a cluster starts a probe of every master, which heals the tier.
    healed(&store);
    store.publish_metrics();
    assert_eq!(Seen::take(&snapshotter).get("tierkv_remote_degraded", ""), 0.0);

    // Hung: every node stopped (SIGSTOP). Calls end at their deadline, as misses.
    for node in &cluster.nodes {
        node.pause();
    }
    let t = Instant::now();
    assert_eq!(tier.lookup(&all).count_ones(), 0);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "a lookup of a hung cluster took {:?}",
        t.elapsed()
    );
    // Degraded, the tier answers at once until the reconnect interval has passed: a hung
    // cluster costs the deadline once per interval, not on every lookup. These calls fail as
    // `unavailable`, none reaches its deadline.
    // (A snapshot takes the counters: the next one counts from it.)
    let hung = Seen::take(&snapshotter);
    assert!(hung.get("tierkv_errors_total", "timeout") > 0.0, "the first lookup's deadline");
    assert_eq!(tier.lookup(&all).count_ones(), 0);
    assert_eq!(tier.load_verified(&all).count_ones(), 0);
    let seen = Seen::take(&snapshotter);
    let errors = |reason: &str| seen.get("tierkv_errors_total", reason);
    assert_eq!(errors("timeout"), 0.0, "a degraded tier's call waited for its deadline");
    assert!(errors("unavailable") > 0.0, "the calls were not refused as unavailable");
    let t = Instant::now();
    for _ in 0..5 {
        assert_eq!(tier.load_verified(&all).count_ones(), 0);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(t.elapsed() < Duration::from_secs(5), "calls to a hung cluster took {:?}", t.elapsed());
    assert!(matches!(tier.store(&keys(100..101)), Err(TierError::Io(_))));
    assert!(store.degraded().is_some());
    let seen = Seen::take(&snapshotter);
    assert_eq!(seen.get("tierkv_remote_degraded", ""), 1.0);
    for node in &cluster.nodes {
        node.resume();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while tier.load_verified(&all).count_ones() < all.len() {
        assert!(Instant::now() < deadline, "never recovered from the hang");
        std::thread::sleep(Duration::from_millis(100));
    }
    healed(&store);

    // Gone: every node killed. Misses, fast (no reconnect storm), then back when it returns.
    for node in &mut cluster.nodes {
        node.kill();
    }
    let t = Instant::now();
    for _ in 0..5 {
        assert_eq!(tier.load_verified(&all).count_ones(), 0);
        assert_eq!(tier.lookup(&all).count_ones(), 0);
    }
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "calls to a dead cluster took {:?}",
        t.elapsed()
    );
    assert!(store.degraded().is_some());
    for node in &mut cluster.nodes {
        node.restart();
    }
    cluster.wait_ok(Duration::from_secs(60));
    // The servers kept no data (`--save ''`): the tier is empty but works again.
    let deadline = Instant::now() + Duration::from_secs(30);
    while tier.store(&all).is_err() {
        assert!(Instant::now() < deadline, "never reconnected after the restart");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(tier.load_verified(&all).count_ones(), all.len());
    healed(&store);
    store.publish_metrics();
    assert_eq!(Seen::take(&snapshotter).get("tierkv_remote_degraded", ""), 0.0);
}

#[test]
fn a_full_server_evicts_to_misses_or_refuses_stores_never_wrong_bytes() {
    require_redis!();
    // Eviction: an LRU server of 4 MiB holds a fraction of 48 chunks of 64 KiB.
    let lru = RedisStandalone::start(&["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]);
    let tier = SharedTier::new(
        open_tier(config(vec![lru.url()], RemoteMode::Standalone, &unique_prefix("lru"))).tier,
        CHUNK,
    );
    for i in 0..48 {
        tier.store(&[key(i)]).unwrap();
    }
    let present = tier.lookup(&keys(0..48));
    tier.tier.unlock(&present.iter_ones().map(|i| key(i as u64)).collect::<Vec<_>>());
    assert!(
        present.count_ones() < 48 && present.count_ones() > 0,
        "{} present",
        present.count_ones()
    );
    // What loads was present (reads may evict more: a reply's buffer counts against maxmemory),
    // every byte verified.
    let loaded = tier.load_verified(&keys(0..48));
    assert!(loaded.count_ones() > 0);
    assert!(loaded.iter_ones().all(|i| present.get(i)), "{loaded:?} not within {present:?}");

    // Refusal: a full server without eviction refuses the store; not a broken link.
    let full = RedisStandalone::start(&["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]);
    let (store, snapshotter) =
        open_recorded(config(vec![full.url()], RemoteMode::Standalone, &unique_prefix("full")));
    let tier = SharedTier::new(store.clone(), CHUNK);
    let mut refused = None;
    for i in 0..64 {
        if let Err(e) = tier.store(&[key(i)]) {
            refused = Some((i, e));
            break;
        }
    }
    let (first_refused, error) = refused.expect("a 2 MiB server took 4 MiB");
    assert!(matches!(error, TierError::NoSpace(_)), "{error:?}");
    assert!(Seen::take(&snapshotter).get("tierkv_errors_total", "oom") > 0.0);
    assert!(store.degraded().is_none(), "a full server is not a broken link");
    assert_eq!(tier.load_verified(&keys(0..first_refused)).count_ones() as u64, first_refused);
}

#[test]
fn a_server_that_is_not_what_the_configuration_says_is_a_degraded_tier_saying_why() {
    require_redis!();
    // A standalone server configured as a cluster: every call misses, and the reason is there.
    let store = Arc::new(
        RemoteStore::open(config(
            vec![standalone().url()],
            RemoteMode::Cluster,
            &unique_prefix("mode"),
        ))
        .unwrap(),
    );
    let tier = SharedTier::new(store.clone(), CHUNK);
    assert!(tier.store(&keys(0..2)).is_err());
    assert_eq!(tier.lookup(&keys(0..2)).count_ones(), 0);
    let why = store.degraded().expect("degraded");
    assert!(why.contains("cluster"), "{why}");
}

/// The opposite mistake: a node of a cluster configured as one server. Each key of another
/// master's slots would be answered `MOVED`, so it used to serve a third of the keys and flap
/// between degraded and healthy; it is refused whole, and the reason names the setting.
#[test]
fn a_cluster_node_configured_as_one_server_is_a_degraded_tier_naming_the_mode() {
    require_redis!();
    let node = shared_cluster().urls().remove(0);
    let store = Arc::new(
        RemoteStore::open(config(vec![node], RemoteMode::Standalone, &unique_prefix("moved")))
            .unwrap(),
    );
    let tier = SharedTier::new(store.clone(), CHUNK);
    for round in 0..3 {
        assert!(tier.store(&keys(0..8)).is_err(), "round {round}: a store went through");
        assert_eq!(tier.lookup(&keys(0..8)).count_ones(), 0);
        let why = store.degraded().expect("degraded");
        assert!(why.contains("remote.mode = \"cluster\""), "{why}");
        // Past the reconnect interval it tries again, and is refused again: it never heals.
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// A load submitted behind a long backlog of stores does not wait for the backlog: loads and
/// stores have their own `max_in_flight` slots. What the server holds when the load completes
/// says how far the backlog had got.
#[test]
fn a_load_does_not_queue_behind_a_backlog_of_stores() {
    require_redis!();
    const SMALL: u64 = 1 << 10;
    const BACKLOG: u64 = 20_000;
    let server = RedisStandalone::start(&[]);
    let prefix = unique_prefix("backlog");
    let store = RemoteStore::open(RemoteConfig {
        max_in_flight: 2,
        ..config(vec![server.url()], RemoteMode::Standalone, &prefix)
    })
    .unwrap();
    let tier = SharedTier::new(Arc::new(store), SMALL);
    tier.store(&keys(0..1)).unwrap();
    let dbsize = || server.node.cli(&["DBSIZE"]).parse::<u64>().unwrap();
    let items: Vec<StoreItem> = keys(1..1 + BACKLOG)
        .into_iter()
        .map(|k| StoreItem { key: k, source: Box::new(VecChunk(payload(&k, SMALL))) })
        .collect();
    let (submitted, backlog_submitted) = crossbeam_channel::bounded(1);
    let (stored_by_then, took) = std::thread::scope(|s| {
        let backlog = s.spawn(|| {
            let started = Instant::now();
            let done = tier.call(|t| {
                let task = t.submit_store(items);
                submitted.send(()).unwrap();
                task
            });
            assert!(matches!(done, Completion::Stored { result: Ok(()), .. }));
            started.elapsed()
        });
        // The backlog is submitted, every value waiting for one of two slots.
        backlog_submitted.recv().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(tier.load_verified(&keys(0..1)).count_ones(), 1);
        let stored_by_then = dbsize() - 1;
        (stored_by_then, backlog.join().unwrap())
    });
    assert_eq!(dbsize(), 1 + BACKLOG);
    // A load queued behind the backlog completes only once every value of it is stored, so the
    // server then holds all of them. Any fewer says the load went first; half the backlog, the
    // bound this used to have, let a test thread held up under load (DBSIZE is a process of its
    // own) fail a correct store.
    assert!(
        stored_by_then < BACKLOG,
        "the load completed only after {stored_by_then} of the backlog's {BACKLOG} values were \
         stored (the backlog took {took:?})"
    );
}

/// A store task the submitter gave up on (the storage pipeline's `store_timeout`) sends none of
/// its values still waiting for a slot: a slow server no longer holds their sources (pins on L1
/// slots) until it has taken every one. The value in flight ends as it would have.
#[test]
fn a_store_given_up_on_sends_none_of_its_values_still_waiting_for_a_slot() {
    require_redis!();
    let server = RedisStandalone::start(&[]);
    let prefix = unique_prefix("abandon");
    let store = Arc::new(
        RemoteStore::open(RemoteConfig {
            max_in_flight: 1,
            op_timeout: Duration::from_secs(5),
            ..config(vec![server.url()], RemoteMode::Standalone, &prefix)
        })
        .unwrap(),
    );
    let tier = SharedTier::new(Arc::clone(&store) as Arc<dyn TierAdapter>, CHUNK);
    tier.store(&keys(0..1)).unwrap(); // connected
    let dbsize = || server.node.cli(&["DBSIZE"]).parse::<u64>().unwrap();
    // Writes wait at the server: the task's first value holds the one slot, the others queue.
    server.node.cli(&["CLIENT", "PAUSE", "1500", "WRITE"]);
    let items: Vec<StoreItem> = keys(1..5)
        .into_iter()
        .map(|k| StoreItem { key: k, source: Box::new(VecChunk(payload(&k, CHUNK))) })
        .collect();
    let (submitted, task) = crossbeam_channel::bounded(1);
    let done = std::thread::scope(|s| {
        let waiting = s.spawn(|| {
            tier.call(|t| {
                let task = t.submit_store(items);
                submitted.send(task).unwrap();
                task
            })
        });
        let task = task.recv().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        store.abandon(task);
        store.abandon(task); // twice is once
        waiting.join().unwrap()
    });
    let Completion::Stored { result, sources, .. } = done else { panic!("not a store's answer") };
    assert!(matches!(result, Err(TierError::Abandoned)), "{result:?}");
    assert_eq!(sources.len(), 4, "every source handed back");
    assert_eq!(dbsize(), 2, "the value in flight stored, none of the three waiting sent");
    // The tier stores as before, and a task already complete is ignored.
    store.abandon(tierkv_core::TaskId(1));
    tier.store(&keys(5..7)).unwrap();
    assert_eq!(dbsize(), 4);
}

#[test]
fn the_usage_shrinks_when_values_expire() {
    require_redis!();
    let prefix = unique_prefix("usage");
    let ttl = Duration::from_millis(400);
    let store = Arc::new(
        RemoteStore::open(RemoteConfig {
            ttl: Some(ttl),
            ..config(vec![standalone().url()], RemoteMode::Standalone, &prefix)
        })
        .unwrap(),
    );
    let tier = SharedTier::new(store.clone(), CHUNK);
    tier.store(&keys(0..4)).unwrap();
    let usage = || {
        let u = store.usage();
        (u.objects, u.used_bytes)
    };
    assert_eq!(usage(), (4, 4 * CHUNK));
    // Past the TTL (and the usage's granularity of a 32nd of it) the values are gone, in Redis
    // and in the usage.
    std::thread::sleep(ttl + ttl / 8);
    assert_eq!(tier.lookup(&keys(0..4)).count_ones(), 0);
    assert_eq!(usage(), (0, 0), "expired values stayed in the usage");
}

/// The remote tier is shared by every node's daemon, and a key names its bytes whoever stored
/// them: a delete through the tier (a `StorageManager` deletes from every tier it has) would
/// take another node's chunk away. It deletes nothing, on a cluster or a single server, and
/// says so.
#[test]
fn a_delete_through_the_tier_leaves_the_shared_values_alone() {
    require_redis!();
    let prefix = unique_prefix("shared-delete");
    for (urls, mode) in [
        (shared_cluster().urls(), RemoteMode::Cluster),
        (vec![standalone().url()], RemoteMode::Standalone),
    ] {
        let node_a = Arc::new(RemoteStore::open(config(urls.clone(), mode, &prefix)).unwrap());
        let node_b = Arc::new(RemoteStore::open(config(urls, mode, &prefix)).unwrap());
        let a = SharedTier::new(node_a.clone(), CHUNK);
        let b = SharedTier::new(node_b.clone(), CHUNK);
        a.store(&keys(0..6)).unwrap();
        // Node B stored k0..k2 too (the same bytes): neither node may delete them.
        b.store(&keys(0..3)).unwrap();
        let before = node_a.usage();
        assert_eq!(node_a.delete(&keys(0..6)), 0, "{mode:?}: a delete reported values deleted");
        assert_eq!(node_b.delete(&keys(0..3)), 0, "{mode:?}: a delete reported values deleted");
        assert_eq!(node_a.usage(), before, "{mode:?}: the usage changed");
        assert_eq!(
            b.load_verified(&keys(0..6)).count_ones(),
            6,
            "{mode:?}: node B lost values to node A's delete"
        );
        assert_eq!(a.load_verified(&keys(0..6)).count_ones(), 6);
    }
}

#[test]
fn a_server_that_refuses_ping_still_heals_a_degraded_tier() {
    require_redis!();
    let server = RedisStandalone::start(&[]);
    // The default user may run everything the tier's calls need, but not PING.
    assert_eq!(server.node.cli(&["ACL", "SETUSER", "default", "-ping"]), "OK");
    let prefix = unique_prefix("noping");
    let store =
        RemoteStore::open(config(vec![server.url()], RemoteMode::Standalone, &prefix)).unwrap();
    assert!(store.degraded().is_some(), "not connected yet");
    // The maintenance thread probes a degraded tier; nothing else calls it meanwhile.
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.degraded().is_some() {
        assert!(Instant::now() < deadline, "still degraded: {:?}", store.degraded());
        store.probe();
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The maintenance thread's probes and the calls' run one at a time: two at once could end in
/// either order, and the one that ended last left its view of the cluster (which masters are
/// silent) even if it was the older one. The cluster here is one "node" that takes connections
/// and never answers (as a hung server does), so a probe lasts its whole deadline, and asks it
/// over a connection of its own: the connections it took count the probes.
#[test]
fn probes_run_one_at_a_time() {
    let node = SilentNode::start();
    let store =
        RemoteStore::open(config(vec![node.url()], RemoteMode::Cluster, "one-probe")).unwrap();
    // Five probes asked for within the first one's deadline (500 ms): one runs.
    for _ in 0..5 {
        store.probe();
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(900));
    assert_eq!(node.accepted(), 1, "probes ran at once");
    // Once it ended, the next probe runs.
    store.probe();
    let deadline = Instant::now() + Duration::from_secs(5);
    while node.accepted() < 2 {
        assert!(Instant::now() < deadline, "no probe ran after the first");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A server on loopback that takes connections and never answers (as a hung Redis does), and
/// counts them; it stops when dropped.
struct SilentNode {
    addr: std::net::SocketAddr,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl SilentNode {
    fn start() -> Self {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let (accepted, stop) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let (counted, stopped) = (Arc::clone(&accepted), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut held = Vec::new();
            while !stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        held.push(stream);
                        counted.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        SilentNode { addr, accepted, stop }
    }

    fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for SilentNode {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A master that is dead and stays dead (its replica may not fail over, and the cluster serves
/// the slots it still covers): the tier is degraded, and stays so for as long as the master is
/// gone, not healthy on one probe or call and degraded on the next; healthy again once its
/// replica took over.
#[test]
fn a_dead_master_keeps_the_tier_degraded_without_flapping() {
    require_redis!();
    let mut cluster = RedisCluster::start();
    let prefix = unique_prefix("flap");
    let store =
        Arc::new(RemoteStore::open(config(cluster.urls(), RemoteMode::Cluster, &prefix)).unwrap());
    let tier = SharedTier::new(Arc::clone(&store) as Arc<dyn TierAdapter>, CHUNK);
    let all = keys(0..24);
    tier.store(&all).unwrap();
    let victim = cluster.master_of(&redis_key(&prefix, &all[0])).unwrap();
    for node in &cluster.nodes {
        assert_eq!(node.cli(&["CONFIG", "SET", "cluster-require-full-coverage", "no"]), "OK");
        assert_eq!(node.cli(&["CONFIG", "SET", "cluster-replica-no-failover", "yes"]), "OK");
    }
    // The replica must hold the victim's keys before it dies: every key loads after failover.
    cluster.wait_replicated(Duration::from_secs(20));
    cluster.nodes[victim].kill();
    // Loads and probes (the maintenance thread's, once a second while degraded) for 4 s.
    let started = Instant::now();
    let (mut degraded_seen, mut healthy_after) = (false, 0);
    while started.elapsed() < Duration::from_secs(4) {
        tier.load_verified(&all);
        store.probe();
        std::thread::sleep(Duration::from_millis(20));
        match store.degraded() {
            Some(_) => degraded_seen = true,
            None if degraded_seen => healthy_after += 1,
            None => {}
        }
    }
    assert!(degraded_seen, "a dead master never degraded the tier");
    assert_eq!(healthy_after, 0, "the tier flapped healthy {healthy_after} times, its master dead");
    // The replica may take over now: once it did, every master answers, and the tier heals.
    for node in cluster.nodes.iter().filter(|n| n.running()) {
        assert_eq!(node.cli(&["CONFIG", "SET", "cluster-replica-no-failover", "no"]), "OK");
    }
    cluster.wait_ok(Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(20);
    while store.degraded().is_some() {
        assert!(Instant::now() < deadline, "never healthy again: {:?}", store.degraded());
        tier.load_verified(&all);
        store.probe();
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(tier.load_verified(&all).count_ones(), all.len());
}

/// Lets the cluster's replicas take over from a failed master (`allowed`), or bars them, on every
/// running node; either way the slots a master still serves stay served while another's are
/// not (`cluster-require-full-coverage no`): otherwise a master in `FAIL` takes the whole
/// cluster down, and no key of any master could hit.
fn allow_failover(cluster: &RedisCluster, allowed: bool) {
    let barred = if allowed { "no" } else { "yes" };
    for node in cluster.nodes.iter().filter(|n| n.running()) {
        assert_eq!(node.cli(&["CONFIG", "SET", "cluster-require-full-coverage", "no"]), "OK");
        assert_eq!(node.cli(&["CONFIG", "SET", "cluster-replica-no-failover", barred]), "OK");
    }
}

/// `all` split into the keys `victim` serves and the others, each part non-empty (so a test of
/// one master's keys against the others' cannot pass on an empty side).
fn split_by_master(
    cluster: &RedisCluster,
    prefix: &str,
    all: &[ObjectKey],
    victim: usize,
) -> (Vec<ObjectKey>, Vec<ObjectKey>) {
    let (on_victim, others): (Vec<ObjectKey>, Vec<ObjectKey>) =
        all.iter().partition(|k| cluster.master_of(&redis_key(prefix, k)) == Some(victim));
    assert!(!on_victim.is_empty() && !others.is_empty(), "{} on the victim", on_victim.len());
    let masters: std::collections::HashSet<usize> =
        all.iter().filter_map(|k| cluster.master_of(&redis_key(prefix, k))).collect();
    assert_eq!(masters.len(), 3, "the keys do not cover every master");
    (on_victim, others)
}

/// Loads `keys` `rounds` times in a row (every byte verified), probing between rounds as the
/// maintenance thread does while the tier is degraded; how many rounds loaded every key.
fn whole_rounds(store: &RemoteStore, tier: &SharedTier, keys: &[ObjectKey], rounds: u32) -> u32 {
    (0..rounds)
        .filter(|_| {
            store.probe();
            std::thread::sleep(Duration::from_millis(20));
            let n = tier.load_verified(keys).count_ones();
            n == keys.len()
        })
        .count() as u32
}

/// One master dead and no replica taking over: the live masters' keys still hit, every byte
/// verified, while the dead one's are misses within the call deadline; the tier says degraded
/// all along. Once the replica may take over, the dead master's keys hit again (what the
/// replica holds) and the tier heals.
#[test]
fn the_live_masters_keys_hit_while_a_dead_masters_are_misses() {
    require_redis!();
    let mut cluster = RedisCluster::start();
    let prefix = unique_prefix("live");
    let store =
        Arc::new(RemoteStore::open(config(cluster.urls(), RemoteMode::Cluster, &prefix)).unwrap());
    let tier = SharedTier::new(Arc::clone(&store) as Arc<dyn TierAdapter>, CHUNK);
    let all = keys(0..36);
    tier.store(&all).unwrap();
    cluster.wait_replicated(Duration::from_secs(20));
    healed(&store);
    let victim = cluster.master_of(&redis_key(&prefix, &all[0])).unwrap();
    let (dead, live) = split_by_master(&cluster, &prefix, &all, victim);
    allow_failover(&cluster, false);
    cluster.nodes[victim].kill();

    // Loads of every key, probed between them as the maintenance thread does: only the live
    // masters' keys ever load, each load ends within the deadline (500 ms), and once the live
    // masters' keys loaded (the first loads may fall in the reconnect interval after the first
    // failure) they load every time: a call to the dead master's slots fails alone, it does not
    // take the other masters' keys down with it.
    let (mut slowest, mut rounds, mut whole) = (Duration::ZERO, 0, 0);
    let started = Instant::now();
    while whole == 0 || rounds < 15 {
        assert!(started.elapsed() < Duration::from_secs(20), "the live keys never all loaded");
        let t = Instant::now();
        let loaded = tier.load_verified(&all);
        slowest = slowest.max(t.elapsed());
        let hits: Vec<ObjectKey> = loaded.iter_ones().map(|i| all[i]).collect();
        assert!(hits.iter().all(|k| live.contains(k)), "a dead master's key loaded: {hits:?}");
        if whole > 0 || hits.len() == live.len() {
            rounds += 1;
            whole += u32::from(hits.len() == live.len());
        }
        store.probe();
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(slowest < Duration::from_secs(2), "a load took {slowest:?}");
    assert_eq!(whole, rounds, "the live masters' keys missed, a master dead");
    assert!(store.degraded().is_some(), "a dead master, and the tier is not degraded");
    assert_eq!(cluster.masters().len(), 2, "failed over: {}", cluster.cli(&["CLUSTER", "NODES"]));

    // Calls only to the live masters: every one hits, and the probes that miss the dead master
    // keep the tier degraded.
    assert_eq!(whole_rounds(&store, &tier, &live, 10), 10, "live masters' keys missed");
    assert!(store.degraded().is_some(), "the tier healed, a master dead: {:?}", store.degraded());
    // And the dead master's keys are misses, within the deadline.
    let t = Instant::now();
    assert_eq!(tier.load_verified(&dead).count_ones(), 0);
    assert!(t.elapsed() < Duration::from_secs(2), "a load took {:?}", t.elapsed());

    // The replica takes over: every value comes back (the replicas had them all), and the tier
    // heals.
    allow_failover(&cluster, true);
    cluster.wait_ok(Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(20);
    while tier.load_verified(&all).count_ones() < all.len() || store.degraded().is_some() {
        assert!(Instant::now() < deadline, "never whole again: {:?}", store.degraded());
        store.probe();
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One master hung (SIGSTOP) while the tier is degraded, its replica barred from taking over:
/// each load ends within a bound of the deadline, none of the hung master's keys loads, no byte
/// is wrong, and once the tier has settled the other masters' keys hit in most rounds: one hung
/// node does not take the whole tier's hits away. Once it answers again (SIGCONT) the tier heals
/// by itself, no restart, no failover, and every key hits.
#[test]
fn a_master_hung_then_resumed_heals_a_degraded_tier_without_a_failover() {
    require_redis!();
    let cluster = RedisCluster::start();
    let prefix = unique_prefix("resumed");
    let store =
        Arc::new(RemoteStore::open(config(cluster.urls(), RemoteMode::Cluster, &prefix)).unwrap());
    let tier = SharedTier::new(Arc::clone(&store) as Arc<dyn TierAdapter>, CHUNK);
    let all = keys(0..36);
    tier.store(&all).unwrap();
    healed(&store);
    let victim = cluster.master_of(&redis_key(&prefix, &all[0])).unwrap();
    let (hung, live) = split_by_master(&cluster, &prefix, &all, victim);
    allow_failover(&cluster, false);
    cluster.nodes[victim].pause();

    // The hung master's keys alone: the connection answers nothing for a whole deadline, a
    // link failure; the tier is degraded.
    let t = Instant::now();
    assert_eq!(tier.load_verified(&hung).count_ones(), 0);
    assert!(t.elapsed() < Duration::from_secs(3), "a load took {:?}", t.elapsed());
    assert!(store.degraded().is_some(), "a hung master's silence did not degrade the tier");

    // Every key, probed between loads, for longer than the cluster takes to mark the master
    // failed (1 s): each load ends within the deadline (500 ms) for each of the three rounds of
    // `max_in_flight` (16) calls it may take, plus slack; only the others' keys may load. Once
    // the live masters' keys loaded whole (the first rounds may fall in the reconnect interval
    // after the link failure, or wait for a new connection), they load whole in most of the 12
    // rounds that follow: the hung master's calls do not hold theirs.
    let (mut slowest, mut rounds, mut whole) = (Duration::ZERO, 0, 0);
    let started = Instant::now();
    while whole == 0 || rounds < 12 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the live masters' keys never all loaded, a master hung: {:?}",
            store.degraded()
        );
        let t = Instant::now();
        let loaded = tier.load_verified(&all);
        slowest = slowest.max(t.elapsed());
        let hits: Vec<ObjectKey> = loaded.iter_ones().map(|i| all[i]).collect();
        assert!(hits.iter().all(|k| live.contains(k)), "a hung master's key loaded: {hits:?}");
        if whole > 0 || hits.len() == live.len() {
            rounds += 1;
            whole += u32::from(hits.len() == live.len());
        }
        store.probe();
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(slowest < Duration::from_secs(3), "a load took {slowest:?}");
    assert!(whole >= 9, "the live masters' keys loaded whole in {whole} of {rounds} rounds");
    assert!(store.degraded().is_some(), "the tier healed, a master hung");

    // It answers again, still the master of its slots: the tier heals, and every key hits.
    cluster.nodes[victim].resume();
    cluster.wait_ok(Duration::from_secs(30));
    assert!(cluster.masters().contains(&victim), "failed over");
    let deadline = Instant::now() + Duration::from_secs(20);
    while tier.load_verified(&all).count_ones() < all.len() || store.degraded().is_some() {
        assert!(Instant::now() < deadline, "never whole again: {:?}", store.degraded());
        store.probe();
        std::thread::sleep(Duration::from_millis(50));
    }
}
