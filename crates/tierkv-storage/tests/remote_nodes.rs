//! Two nodes (two StorageManagers, each with its own L1 and L2) sharing one real Redis Cluster
//! (3 masters + 3 replicas) as their remote tier: what one node stores, the other's lookups hit,
//! promoted through the prefetch pipeline; a remote tier that goes away is a miss and the node
//! keeps serving from its local tiers.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tierkv_core::{ExtraCount, Layout, ObjectKey};
use tierkv_l1::{DeviceKind, L1Config, OwnerId, Readers, Watermark};
use tierkv_l2::{HostMemory, HostStoreConfig};
use tierkv_remote::{RemoteConfig, RemoteMode};
use tierkv_storage::{
    HitChunk, LookupId, LookupResult, RemoteAdmission, StorageConfig, StorageManager, StorePolicy,
};
use tierkv_testkit::contract::{key, keys, payload};
use tierkv_testkit::redis::RedisCluster;
use tierkv_testkit::require_redis;

const CHUNK: u64 = 64 << 10;
const OWNER: OwnerId = OwnerId(5);
const WAIT: Duration = Duration::from_secs(20);

fn shared_cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(RedisCluster::start)
}

fn unique_prefix(name: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("nodes-{name}-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

fn layout() -> Layout {
    Layout::bytes(CHUNK).unwrap()
}

/// A node: L1 of 32 chunks, L2 of 64, the remote tier on `urls` under `prefix`.
fn node(urls: Vec<String>, prefix: &str, admission: RemoteAdmission) -> StorageManager {
    let config = StorageConfig {
        l2: Some(HostStoreConfig {
            memory: HostMemory::Plain,
            ..HostStoreConfig::new(64 * CHUNK, CHUNK)
        }),
        remote: Some(RemoteConfig {
            key_prefix: prefix.to_string(),
            op_timeout: Duration::from_millis(500),
            connect_timeout: Duration::from_millis(500),
            reconnect_interval: Duration::from_millis(200),
            ..RemoteConfig::new(urls, RemoteMode::Cluster, CHUNK)
        }),
        remote_admission: admission,
        maintenance_interval: Duration::from_millis(10),
        store_policy: StorePolicy::WriteThrough,
        ..StorageConfig::new(L1Config {
            device: DeviceKind::Emulated,
            ..L1Config::new(32 * CHUNK, CHUNK)
        })
    };
    StorageManager::start(config).unwrap()
}

/// Writes `keys` and waits until the store pipeline has copied them everywhere.
fn write(s: &StorageManager, keys: &[ObjectKey]) {
    let reserved = s.reserve_write(OWNER, keys, &layout()).unwrap();
    assert!(reserved.iter().all(|r| r.is_ok()), "{reserved:?}");
    for k in keys {
        s.write_access(OWNER, k).unwrap().write_at(0, &payload(k, CHUNK)).unwrap();
    }
    let (results, ticket) = s.finish_write_tracked(OWNER, keys).unwrap();
    assert!(results.iter().all(|r| r.is_ok()));
    assert!(ticket.wait_until(Instant::now() + WAIT).is_some(), "the store pipeline never settled");
}

/// Looks up `keys`, checks every byte of the hit, releases it. The hit is read as a retrieve
/// reads it, from L1 or from the tier holding a chunk L1 had no room for (a write-back tick may
/// have leased L1's chunks as the lookup promoted its hit: not an L1 read's to assume).
fn lookup(s: &StorageManager, keys: Vec<ObjectKey>) -> LookupResult {
    let id: LookupId = s.submit_prefetch(OWNER, keys.clone(), ExtraCount::ZERO, layout()).unwrap();
    let result = s.wait(id, WAIT).unwrap();
    let hit = &keys[..result.hit_chunks];
    for (k, chunk) in hit.iter().zip(s.read_hit(id, 0, hit, CHUNK).unwrap()) {
        let bytes = match chunk {
            HitChunk::L1(access) => {
                let mut bytes = vec![0; CHUNK as usize];
                access.read_at(0, &mut bytes).unwrap();
                bytes
            }
            HitChunk::Loaded(bytes) => bytes.to_vec(),
        };
        assert!(bytes == payload(k, CHUNK), "{k:?} was served with wrong bytes");
    }
    s.release(id, Readers::One(0)).unwrap();
    result
}

/// Per-tier hits by name: L1, L2, remote.
fn by_tier(s: &StorageManager, result: &LookupResult) -> Vec<(String, usize)> {
    let names = std::iter::once("l1".to_string()).chain(s.status().tiers.into_iter().map(|t| t.0));
    names.zip(result.per_tier.iter().copied()).collect()
}

#[test]
fn node_b_hits_what_node_a_stored_through_the_remote_tier() {
    require_redis!();
    let urls = shared_cluster().urls();
    let prefix = unique_prefix("share");
    let a = node(urls.clone(), &prefix, RemoteAdmission::WriteThrough);
    let b = node(urls, &prefix, RemoteAdmission::WriteThrough);
    write(&a, &keys(0..8));
    assert_eq!(a.status().tiers[1].0, "remote");
    assert_eq!(a.status().tiers[1].1.objects, 8, "node A stored every chunk remotely");

    let result = lookup(&b, keys(0..8));
    assert_eq!(result.hit_chunks, 8);
    assert_eq!(
        by_tier(&b, &result),
        vec![("l1".into(), 0), ("l2".into(), 0), ("remote".into(), 8)],
        "node B's hit came from the remote tier"
    );
    let totals = b.status().lookups;
    assert_eq!(totals.hit_chunks, vec![0, 0, 8]);
    // A chunk promoted from the remote tier stays cached in L1 (it is not stored to L2 again,
    // E11): the next lookup on node B is local.
    let again = lookup(&b, keys(0..8));
    assert_eq!(again.per_tier, vec![8, 0, 0]);
    assert_eq!(b.status().tiers[0].1.objects, 0, "a promotion is not stored to L2");

    // A partial prefix: A has k10..k13 and k15; B hits the leading run only.
    write(&a, &[key(10), key(11), key(12), key(13), key(15)]);
    let result = lookup(&b, keys(10..16));
    assert_eq!(result.hit_chunks, 4);
    assert_eq!(result.per_tier, vec![0, 0, 4]);
    // Healthy: on a cluster, once a probe reached every master (a successful call starts one).
    let deadline = Instant::now() + WAIT;
    while b.status().remote_degraded.is_some() {
        assert!(Instant::now() < deadline, "{:?}", b.status().remote_degraded);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(b.status().tiers[1].1.locks, 0, "every lookup lock returned");
}

#[test]
fn after_reads_admission_sends_a_chunk_remote_only_once_it_was_read() {
    require_redis!();
    let urls = shared_cluster().urls();
    let prefix = unique_prefix("admission");
    let a = node(urls.clone(), &prefix, RemoteAdmission::AfterReads { min_reads: 1 });
    let b = node(urls, &prefix, RemoteAdmission::WriteThrough);
    write(&a, &keys(0..4));
    assert_eq!(lookup(&b, keys(0..4)).hit_chunks, 0, "written once, not yet read: not remote");
    // Node A reads k0, k1: they reach the remote tier.
    assert_eq!(lookup(&a, keys(0..2)).per_tier, vec![2, 0, 0]);
    let deadline = Instant::now() + WAIT;
    while a.status().tiers[1].1.objects < 2 || a.status().store_in_flight > 0 {
        assert!(Instant::now() < deadline, "the admitted chunks never reached the remote tier");
        std::thread::sleep(Duration::from_millis(5));
    }
    let result = lookup(&b, keys(0..4));
    assert_eq!((result.hit_chunks, result.per_tier), (2, vec![0, 0, 2]));
}

#[test]
fn a_dead_remote_tier_is_a_miss_the_node_serves_locally_and_recovers() {
    require_redis!();
    let mut cluster = RedisCluster::start();
    let prefix = unique_prefix("dead");
    let a = node(cluster.urls(), &prefix, RemoteAdmission::WriteThrough);
    let b = node(cluster.urls(), &prefix, RemoteAdmission::WriteThrough);
    write(&a, &keys(0..4));
    write(&b, &keys(40..44));
    assert_eq!(lookup(&b, keys(0..4)).per_tier, vec![0, 0, 4]);

    for node in &mut cluster.nodes {
        node.kill();
    }
    // Node A keeps writing and serving from its own tiers; node B misses what it does not hold.
    let t = Instant::now();
    write(&a, &keys(20..24));
    assert_eq!(lookup(&a, keys(20..24)).hit_chunks, 4);
    assert_eq!(lookup(&b, keys(20..24)).hit_chunks, 0);
    assert_eq!(lookup(&b, keys(0..4)).per_tier, vec![4, 0, 0], "B kept what it fetched");
    assert_eq!(lookup(&b, keys(40..44)).per_tier, vec![4, 0, 0], "B's own chunks still serve");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "a dead remote tier slowed the node: {:?}",
        t.elapsed()
    );
    let degraded = |s: &StorageManager| s.status().remote_degraded;
    assert!(degraded(&a).is_some() && degraded(&b).is_some());

    for node in &mut cluster.nodes {
        node.restart();
    }
    cluster.wait_ok(Duration::from_secs(60));
    // The maintenance probe notices the recovery without any lookup.
    let deadline = Instant::now() + Duration::from_secs(30);
    while degraded(&a).is_some() || degraded(&b).is_some() {
        assert!(Instant::now() < deadline, "the remote tier never recovered: {:?}", degraded(&a));
        std::thread::sleep(Duration::from_millis(50));
    }
    write(&a, &keys(30..34));
    assert_eq!(lookup(&b, keys(30..34)).per_tier, vec![0, 0, 4]);
}

#[test]
fn a_chunk_the_remote_tier_served_is_never_admitted_back_to_it() {
    require_redis!();
    let urls = shared_cluster().urls();
    let prefix = unique_prefix("no-echo");
    let a = node(urls.clone(), &prefix, RemoteAdmission::WriteThrough);
    let c = node(urls, &prefix, RemoteAdmission::AfterReads { min_reads: 2 });
    write(&a, &keys(0..3));
    let deadline = Instant::now() + WAIT;
    while a.status().store_in_flight > 0 {
        assert!(Instant::now() < deadline, "node A's stores never finished");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Node C gets the chunks from Redis, then reads them again (from its own L1): read twice,
    // but they came from the remote tier, so C does not send them back.
    assert_eq!(lookup(&c, keys(0..3)).per_tier, vec![0, 0, 3]);
    assert_eq!(lookup(&c, keys(0..3)).per_tier, vec![3, 0, 0]);
    assert_eq!(lookup(&c, keys(0..3)).hit_chunks, 3);
    std::thread::sleep(Duration::from_millis(100));
    let status = c.status();
    assert_eq!(status.store_in_flight, 0);
    assert_eq!(status.tiers[1].1.objects, 0, "node C stored nothing remote: {status:?}");
    // Its own chunks, read twice, still go.
    write(&c, &keys(10..12));
    lookup(&c, keys(10..12));
    lookup(&c, keys(10..12));
    let deadline = Instant::now() + WAIT;
    while c.status().tiers[1].1.objects < 2 {
        assert!(Instant::now() < deadline, "node C's own chunks never reached the remote tier");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A chunk node B got from the remote tier is not written back to it under write-back: Redis
/// holds it already (every byte of it: the key names the bytes), so a second `SET` is network
/// and cluster work for nothing. Node B's own chunks still go there when L1 lets them go, and the
/// promoted ones still go to its L2.
#[test]
fn write_back_never_sends_the_remote_tier_what_it_served() {
    require_redis!();
    let urls = shared_cluster().urls();
    let prefix = unique_prefix("write-back");
    let a = node(urls.clone(), &prefix, RemoteAdmission::WriteThrough);
    // Node B: write-back, L1 of 8 chunks written back past half full, down to a quarter.
    let b = StorageManager::start(StorageConfig {
        l2: Some(HostStoreConfig {
            memory: HostMemory::Plain,
            ..HostStoreConfig::new(64 * CHUNK, CHUNK)
        }),
        remote: Some(RemoteConfig {
            key_prefix: prefix.clone(),
            op_timeout: Duration::from_millis(500),
            connect_timeout: Duration::from_millis(500),
            reconnect_interval: Duration::from_millis(200),
            ..RemoteConfig::new(urls, RemoteMode::Cluster, CHUNK)
        }),
        remote_admission: RemoteAdmission::WriteThrough,
        maintenance_interval: Duration::from_millis(10),
        store_policy: StorePolicy::WriteBack,
        ..StorageConfig::new(L1Config {
            device: DeviceKind::Emulated,
            watermark: Watermark { high: 0.5, low: 0.25 },
            ..L1Config::new(8 * CHUNK, CHUNK)
        })
    })
    .unwrap();
    let remote_writes = |s: &StorageManager| s.status().tiers[1].1.objects;
    write(&a, &keys(0..8));
    assert_eq!(remote_writes(&a), 8);

    // B's own four chunks, then A's eight from Redis: the lookup's reservation evicts B's own
    // (to L2 at once, to Redis through the store pipeline), and the maintenance thread writes
    // back six of the eight promoted ones once L1 is past its high watermark.
    write(&b, &keys(100..104));
    assert_eq!(remote_writes(&b), 0, "write-back: nothing goes down before L1 lets it go");
    assert_eq!(lookup(&b, keys(0..8)).per_tier, vec![0, 0, 8]);
    let deadline = Instant::now() + WAIT;
    loop {
        let status = b.status();
        let l1 = status.l1;
        if status.store_in_flight == 0 && l1.slots - l1.free_bytes / l1.slot_bytes <= 4 {
            break;
        }
        assert!(Instant::now() < deadline, "L1 was never written back: {status:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(b.status().store_in_flight, 0);
    assert_eq!(
        remote_writes(&b),
        4,
        "node B wrote to Redis chunks it had fetched from there (only its own 4 should go)"
    );
    assert!(
        b.status().tiers[0].1.objects >= 4 + 6,
        "the written-back chunks reached L2: {:?}",
        b.status().tiers[0]
    );
    // Eight more from Redis: their reservation evicts the promoted chunks still in L1 on
    // demand (L1's demoter, not the maintenance thread), and those do not go back either.
    write(&a, &keys(8..16));
    assert_eq!(lookup(&b, keys(8..16)).per_tier, vec![0, 0, 8]);
    let deadline = Instant::now() + WAIT;
    while b.status().store_in_flight > 0 {
        assert!(Instant::now() < deadline, "node B's store pipeline never went idle");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(remote_writes(&b), 4, "an eviction on demand sent Redis what it served");
    // Both kinds still hit, from L1 or L2.
    for chunks in [keys(0..8), keys(8..16)] {
        let result = lookup(&b, chunks);
        assert_eq!((result.hit_chunks, result.per_tier[2]), (8, 0));
    }
    assert_eq!(lookup(&b, keys(100..104)).hit_chunks, 4);
}

/// A node that deletes chunks deletes them from its own tiers only: the remote tier is shared,
/// and another node may be reading what this one no longer wants.
#[test]
fn a_delete_on_one_node_leaves_the_remote_tier_to_the_others() {
    require_redis!();
    let urls = shared_cluster().urls();
    let prefix = unique_prefix("delete");
    let a = node(urls.clone(), &prefix, RemoteAdmission::WriteThrough);
    let b = node(urls, &prefix, RemoteAdmission::WriteThrough);
    write(&a, &keys(0..4));
    // L1, L2 and the remote tier, in that order: node A's own copies go, Redis keeps its.
    assert_eq!(a.delete(&keys(0..4)), vec![4, 4, 0]);
    assert_eq!(a.status().tiers[1].1.objects, 4, "node A still counts what it stored");
    assert_eq!(lookup(&b, keys(0..4)).per_tier, vec![0, 0, 4], "node B lost node A's chunks");
    assert_eq!(lookup(&a, keys(0..4)).per_tier, vec![0, 0, 4], "node A gets them back from Redis");
}
