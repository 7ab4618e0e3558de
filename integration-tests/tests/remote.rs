//! Two `tierkv` daemons (two nodes) sharing a real Redis Cluster (3 masters + 3 replicas) as
//! their remote tier: what a worker of node A stores, a worker of node B hits, served by the
//! remote tier, every byte verified; with the cluster gone node B misses, keeps serving its own
//! chunks, and `status` says the remote tier is degraded until the cluster returns.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

use std::time::Duration;

use serde_json::json;
use tierkv_integration_tests::{Daemon, remote_section, small_config};
use tierkv_testkit::redis::RedisCluster;
use tierkv_testkit::require_redis;

fn node(cluster: &RedisCluster, prefix: &str) -> Daemon {
    let remote = remote_section(&cluster.urls(), prefix);
    Daemon::start_with(|dir| small_config(dir, None, &remote))
}

#[test]
fn two_daemons_share_prefixes_through_the_remote_tier_and_status_says_when_it_is_gone() {
    require_redis!();
    let mut cluster = RedisCluster::start();
    let prefix = format!("it-{}", std::process::id());
    let (a, b) = (node(&cluster, &prefix), node(&cluster, &prefix));
    let plain = ["--chunk-bytes", "65536"];

    let mut worker_a = a.worker(&plain);
    worker_a.run("store 5 24");
    let status = a.eventually("node A wrote every chunk to the remote tier", |s| {
        s.tiers[3].objects >= 24 && s.store_in_flight == 0
    });
    assert_eq!(status.tiers[3].name, "remote");

    let mut worker_b = b.worker(&plain);
    let id = worker_b.run("lookup 5 24")["lookup"].as_u64().unwrap();
    let done = worker_b.run(&format!("wait {id}"));
    assert_eq!(done["hit"], 24);
    assert_eq!(done["per_tier"], json!([0, 0, 0, 24]), "node B's hit came from the remote tier");
    assert_eq!(worker_b.run(&format!("retrieve {id} 5 24"))["verified"], 24);
    let status = b.status();
    assert_eq!((status.tiers[3].hit_chunks, status.tiers[3].degraded.as_deref()), (24, None));

    for node in &mut cluster.nodes {
        node.kill();
    }
    // Node B misses what only the cluster had, and keeps serving what it stored itself.
    worker_a.run("store 6 4");
    let id = worker_b.run("lookup 6 4")["lookup"].as_u64().unwrap();
    assert_eq!(worker_b.run(&format!("wait {id}"))["hit"], 0);
    worker_b.run(&format!("release {id}"));
    worker_b.run("store 7 4");
    let id = worker_b.run("lookup 7 4")["lookup"].as_u64().unwrap();
    let done = worker_b.run(&format!("wait {id}"));
    assert_eq!((done["hit"].clone(), done["per_tier"].clone()), (json!(4), json!([4, 0, 0, 0])));
    assert_eq!(worker_b.run(&format!("retrieve {id} 7 4"))["verified"], 4);
    let status =
        b.eventually("status says the remote tier is degraded", |s| s.tiers[3].degraded.is_some());
    eprintln!("degraded: {:?}", status.tiers[3].degraded);

    for node in &mut cluster.nodes {
        node.restart();
    }
    cluster.wait_ok(Duration::from_secs(60));
    b.eventually("the remote tier recovers by itself", |s| s.tiers[3].degraded.is_none());
    a.eventually("the remote tier recovers by itself", |s| s.tiers[3].degraded.is_none());
    worker_a.run("store 8 4");
    a.eventually("node A wrote the new chunks", |s| s.store_in_flight == 0);
    let id = worker_b.run("lookup 8 4")["lookup"].as_u64().unwrap();
    assert_eq!(worker_b.run(&format!("wait {id}"))["per_tier"], json!([0, 0, 0, 4]));
    worker_a.exit();
    worker_b.exit();
}

#[test]
fn a_second_sigterm_ends_a_clean_stop_stuck_behind_a_silent_remote_tier() {
    // Under write-back a clean stop writes L1 down to the disk and to the remote tier, whose
    // server here stops answering (SIGSTOP) with a 30 s deadline per call: the stop waits. A
    // second SIGTERM ends the process at once (what was not down is lost, as after SIGKILL).
    require_redis!();
    let server = tierkv_testkit::redis::RedisStandalone::start(&[]);
    let remote = format!(
        "\n[remote]\nenabled = true\nmode = \"standalone\"\nurls = [\"{}\"]\n\
         key_prefix = \"stuck\"\nop_timeout = \"30s\"\nconnect_timeout = \"500ms\"\n\
         reconnect_interval = \"200ms\"\n\n[storage]\nstore_policy = \"write_back\"\n",
        server.url()
    );
    let mut daemon = Daemon::start_with(|dir| small_config(dir, None, &remote));
    let mut worker = daemon.worker(&["--chunk-bytes", "65536"]);
    worker.run("store 1 8");
    worker.exit();
    // Connected first: a tier not reached yet fails its calls at once, and the stop is quick.
    daemon.eventually("the remote tier is reached", |s| s.tiers[3].degraded.is_none());
    server.node.pause();
    // SAFETY: kill(2) on the daemon, our child.
    unsafe { libc::kill(daemon.pid() as libc::pid_t, libc::SIGTERM) };
    std::thread::sleep(Duration::from_secs(1));
    assert!(daemon.alive(), "the clean stop waits on the silent remote tier");
    let started = std::time::Instant::now();
    let status = daemon.stop(); // the second SIGTERM
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert_eq!(status.code(), Some(1), "{status}");
    server.node.resume();
}
