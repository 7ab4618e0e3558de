//! CONFORMANCE F: the daemon as a black box, through real worker processes over the socket.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::process::{Command, Stdio};
use std::time::Duration;

use tierkv_integration_tests::{Daemon, artifact, http_get, terminate, wait_for_socket};
use tierkv_proto::StatusReport;

fn mla(rank: u16, tp: u16) -> Vec<String> {
    ["--mla", "--tp", &tp.to_string(), "--rank", &rank.to_string(), "--chunk-bytes", "65536"]
        .map(String::from)
        .to_vec()
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn f1_serve_without_config_answers_status_serves_metrics_and_stops_on_sigterm() {
    let cwd = tempfile::tempdir().unwrap();
    // The embedded default: socket /tmp/tierkv.sock, metrics on 127.0.0.1:9464, disk in
    // ./tierkv-data. Refuse to run over a daemon someone left running.
    let socket = std::path::Path::new("/tmp/tierkv.sock");
    if std::os::unix::net::UnixStream::connect(socket).is_ok() {
        panic!("a daemon already serves on {}; stop it to run this test", socket.display());
    }
    let mut child = Command::new(artifact("bin", "tierkv"))
        .arg("serve")
        .env("TIERKV_LOG", "warn")
        .current_dir(cwd.path())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_socket(socket, Some(&mut child));

    let mut admin =
        tierkv_client::Client::connect_unix(socket, tierkv_client::Client::admin_hello()).unwrap();
    let status = admin.status().unwrap();
    let names: Vec<&str> = status.tiers.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["l1", "l2", "disk"], "the default runs every tier");
    assert!(status.tiers.iter().all(|t| t.capacity_bytes > 0));
    admin.end().unwrap();

    let (code, body) = http_get(9464, "/metrics").unwrap();
    assert_eq!(code, 200);
    for name in ["tierkv_tier_capacity_bytes", "tierkv_requests_total", "tierkv_connected_workers"]
    {
        assert!(body.contains(name), "/metrics lacks {name}:\n{body}");
    }
    // Each tier says which order its adaptive policy evicts in: a share of 0 to 1 of its
    // policies in ARC's order and in the frequency order; both 0 (recency) as a fresh policy
    // starts. The disk's policy orders segments by recency or ARC only.
    for tier in ["l1", "l2", "disk"] {
        for order in ["arc", "frequency"] {
            let series = format!("tierkv_policy_{order}_order{{tier=\"{tier}\"}} ");
            let share = body
                .lines()
                .find_map(|line| line.strip_prefix(series.as_str()))
                .and_then(|value| value.trim().parse::<f64>().ok());
            assert_eq!(share, Some(0.0), "{series}in:\n{body}");
        }
    }
    assert!(cwd.path().join("tierkv-data").is_dir(), "the disk tier lives in ./tierkv-data");

    let exit = terminate(&mut child);
    assert!(exit.success(), "SIGTERM must end the daemon with 0, got {exit}");
    assert!(!socket.exists(), "the socket file is removed on exit");
}

#[test]
fn f2_mla_tp_group_stores_one_copy_and_each_rank_reads_its_share_once() {
    let daemon = Daemon::start();
    let (r0, r1) = (mla(0, 2), mla(1, 2));
    let mut rank0 = daemon.worker(&args(&r0));
    let mut rank1 = daemon.worker(&args(&r1));

    let first = rank0.run("store 1 8");
    let second = rank1.run("store 1 8");
    assert_eq!((first["stored"].as_u64(), second["stored"].as_u64()), (Some(8), Some(0)));
    assert_eq!(second["present"], 8, "the second rank's store finds the shared copy");
    assert_eq!(daemon.status().tiers[0].objects, 8, "one copy in L1, not one per rank");

    let lookup = rank0.run("lookup 1 8");
    assert_eq!((lookup["l1"].as_u64(), lookup["hit"].as_u64()), (Some(8), Some(8)));
    let id = lookup["lookup"].as_u64().unwrap();
    assert_eq!(daemon.status().l1_leased_chunks, 8);

    assert_eq!(rank0.run(&format!("retrieve {id} 1 8"))["verified"], 8);
    assert_eq!(daemon.status().l1_leased_chunks, 8, "rank 1 still holds its share");
    assert_eq!(rank1.run(&format!("retrieve {id} 1 8"))["verified"], 8);
    let after = daemon.settled();
    assert_eq!(after.open_lookups, 0, "no shares left");

    let again = rank1.try_run(&format!("retrieve {id} 1 8"));
    assert_eq!(again["ok"], false, "a reader returns its share once: {again}");
    rank0.exit();
    rank1.exit();
}

#[test]
fn f3_a_worker_that_disconnects_while_holding_shares_gives_them_back() {
    let daemon = Daemon::start();
    let plain = ["--chunk-bytes", "65536"];
    let mut writer = daemon.worker(&plain);
    writer.run("store 7 16");
    let baseline = daemon.settled();

    let mut holder = daemon.worker(&plain);
    let lookup = holder.run("lookup 7 16");
    assert_eq!(lookup["hit"], 16);
    let held = daemon.status();
    assert_eq!(held.l1_leased_chunks, 16);
    let pinned = |s: &StatusReport| s.tiers[0].used_bytes - s.tiers[0].cached_bytes;
    assert_eq!(held.tiers[0].used_bytes, baseline.tiers[0].used_bytes, "the same chunks held");
    assert!(pinned(&held) > pinned(&baseline), "leased bytes are pinned");

    holder.kill();
    let back = daemon.eventually("shares returned after the disconnect", |s| {
        s.l1_leased_chunks == 0 && s.open_lookups == 0 && s.connected_workers == 1
    });
    assert_eq!(pinned(&back), pinned(&baseline), "pinned bytes back to baseline");

    // A reader of another session's MLA lookup that dies after joining it returns its share.
    let (r0, r1) = (mla(0, 2), mla(1, 2));
    let mut rank0 = daemon.worker(&args(&r0));
    let mut rank1 = daemon.worker(&args(&r1));
    rank0.run("store 8 4");
    let id = rank0.run("lookup 8 4")["lookup"].as_u64().unwrap();
    rank1.run(&format!("wait {id}"));
    rank0.run(&format!("retrieve {id} 8 4"));
    let out = daemon.eventually("only rank 1's share is out", |s| s.store_in_flight == 0);
    assert_eq!(out.l1_leased_chunks, 4, "rank 1's share is still out");
    rank1.kill();
    daemon.eventually("the dead reader's share returned", |s| {
        s.l1_leased_chunks == 0 && s.open_lookups == 0
    });
    writer.exit();
    rank0.exit();
}

#[test]
fn f5_a_restarted_daemon_finds_its_disk_chunks_again() {
    let mut daemon = Daemon::start();
    let plain = ["--chunk-bytes", "65536"];
    let mut worker = daemon.worker(&plain);
    worker.run("store 5 24");
    // Under the cascade (the default store policy) the chunks stay in L1, which has room for
    // them; the clean stop hands them down to disk.
    let settled = daemon.eventually("the store pipeline is idle", |s| s.store_in_flight == 0);
    assert_eq!((settled.tiers[0].objects, settled.tiers[2].objects), (24, 0));
    worker.exit();
    let exit = daemon.stop();
    assert!(exit.success(), "clean stop: {exit}");

    daemon.restart();
    let status = daemon.status();
    assert_eq!(
        (status.tiers[0].objects, status.tiers[1].objects),
        (0, 0),
        "memory tiers start empty"
    );
    assert_eq!(status.tiers[2].objects, 24, "the disk tier reopened its chunks");
    let mut worker = daemon.worker(&plain);
    let id = worker.run("lookup 5 24")["lookup"].as_u64().unwrap();
    let done = worker.run(&format!("wait {id}"));
    assert_eq!(done["hit"], 24);
    assert_eq!(done["per_tier"], serde_json::json!([0, 0, 24, 0]), "every hit came from disk");
    assert_eq!(worker.run(&format!("retrieve {id} 5 24"))["verified"], 24);
    // A lookup id kept from before the restart names nothing now: were ids counted from 1 on
    // every start, the first run's id would name this run's first lookup, and a client
    // retrying its retrieve on a new session would take that lookup's share.
    let held = worker.run("lookup 5 4")["lookup"].as_u64().unwrap();
    worker.run(&format!("wait {held}"));
    worker.exit();
    assert!(daemon.stop().success());
    daemon.restart();
    let mut worker = daemon.worker(&plain);
    let mut fresh = Vec::new();
    for _ in 0..2 {
        let id = worker.run("lookup 5 4")["lookup"].as_u64().unwrap();
        assert_eq!(worker.run(&format!("wait {id}"))["hit"], 4);
        fresh.push(id);
    }
    assert!(!fresh.contains(&held), "a restarted daemon gave out an id of its earlier run");
    let stale = worker.try_run(&format!("retrieve {held} 5 4"));
    assert!(stale.to_string().contains("UnknownLookup"), "{stale}");
    for id in fresh {
        assert_eq!(worker.run(&format!("retrieve {id} 5 4"))["verified"], 4);
    }
    worker.exit();
    assert!(daemon.stop().success());
}

#[test]
fn a_signal_during_start_up_stops_the_daemon_cleanly_once_it_has_started() {
    // Start-up may take seconds (here: 4 GiB of L1 committed page by page); a SIGTERM then must
    // end in the clean stop and exit 0 that README promises, not in death by the signal.
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("tierkv.sock");
    let config = dir.path().join("tierkv.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nsocket = \"{}\"\n[metrics]\nenabled = false\n\
             [l1]\ndevice = \"emulated\"\ncapacity = \"4GiB\"\nprefault = true\n\
             [l2]\nenabled = false\n[disk]\nenabled = false\n",
            socket.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(artifact("bin", "tierkv"))
        .args(["serve", "--config"])
        .arg(&config)
        .env("TIERKV_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(150));
    assert!(!socket.exists(), "start-up was over before the signal: the test proves nothing");
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) }, 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let exit = loop {
        if let Some(exit) = child.try_wait().unwrap() {
            break exit;
        }
        assert!(std::time::Instant::now() < deadline, "the daemon never stopped");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "a signal during start-up must end in a clean stop, got {exit}");
    assert!(!socket.exists(), "the socket file is removed on exit");
}

#[test]
fn a_tier_that_cannot_open_names_the_keys_to_check() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("tierkv.sock");
    let not_a_dir = dir.path().join("a-file");
    std::fs::write(&not_a_dir, b"").unwrap();
    // Each passes the configuration's checks and fails only as the tier opens: an arena past
    // any address space, and a disk directory that is a file.
    let cases = [
        ("[l1]\ncapacity = \"4000TiB\"\nslot = \"1GiB\"\n[l2]\nenabled = false\n", "l1.capacity"),
        (
            "[l1]\ncapacity = \"1GiB\"\nslot = \"1GiB\"\n[l2]\ncapacity = \"4000TiB\"\n",
            "l2.memory and l2.capacity",
        ),
        (&format!("[disk]\nenabled = true\ndir = \"{}\"\n", not_a_dir.display()), "disk.dir"),
    ];
    for (tiers, keys) in cases {
        let config = dir.path().join("tierkv.toml");
        let disk_off = if tiers.contains("[disk]") { "" } else { "[disk]\nenabled = false\n" };
        std::fs::write(
            &config,
            format!(
                "[server]\nsocket = \"{}\"\n[metrics]\nenabled = false\n{tiers}{disk_off}",
                socket.display()
            ),
        )
        .unwrap();
        let out = Command::new(artifact("bin", "tierkv"))
            .args(["serve", "--config"])
            .arg(&config)
            .env("TIERKV_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{tiers}: the daemon started");
        assert!(
            stderr.contains("cannot open the storage tiers")
                && stderr.contains(&format!("(check {keys}")),
            "{tiers}: the refusal names no key: {stderr}"
        );
        assert!(!socket.exists(), "{tiers}: a refused start binds nothing");
    }
}

#[test]
fn a_deferred_lookup_prefetches_nothing_before_its_first_wait() {
    let mut daemon = Daemon::start();
    let plain = ["--chunk-bytes", "65536"];
    let mut worker = daemon.worker(&plain);
    worker.run("store 6 4");
    worker.exit();
    // Restarted: the chunks are on disk only.
    assert!(daemon.stop().success());
    daemon.restart();
    let mut worker = daemon.worker(&plain);
    let started = worker.run("lookup-deferred 6 4");
    assert_eq!((started["l1"].as_u64(), started["hit"].as_u64()), (Some(0), None));
    let id = started["lookup"].as_u64().unwrap();
    // Time for a prefetch to have loaded something, had one started.
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(daemon.status().tiers[0].objects, 0, "nothing was loaded before the wait");
    let done = worker.run(&format!("wait {id}"));
    assert_eq!(done["per_tier"], serde_json::json!([0, 0, 4, 0]));
    assert_eq!(worker.run(&format!("retrieve {id} 6 4"))["verified"], 4);
    worker.exit();
    assert!(daemon.stop().success());
}

#[test]
fn tp4_mla_round_trip_stores_one_copy_for_four_readers_and_leaves_no_shares() {
    let daemon = Daemon::start();
    let ranks: Vec<Vec<String>> = (0..4).map(|r| mla(r, 4)).collect();
    let mut workers: Vec<_> = ranks.iter().map(|a| daemon.worker(&args(a))).collect();
    for w in &mut workers {
        w.run("store 3 12");
    }
    assert_eq!(daemon.status().tiers[0].objects, 12, "one shared copy for the TP group");
    let id = workers[0].run("lookup 3 12")["lookup"].as_u64().unwrap();
    assert_eq!(workers[2].run(&format!("wait {id}"))["readers"], 4);
    for w in &mut workers {
        assert_eq!(w.run(&format!("retrieve {id} 3 12"))["verified"], 12);
    }
    assert_eq!(daemon.settled().open_lookups, 0);
    for w in workers {
        w.exit();
    }
}

#[test]
fn tp2_without_mla_keeps_one_copy_per_rank() {
    let daemon = Daemon::start();
    let a0 = ["--tp", "2", "--rank", "0", "--chunk-bytes", "65536"];
    let a1 = ["--tp", "2", "--rank", "1", "--chunk-bytes", "65536"];
    let mut rank0 = daemon.worker(&a0);
    let mut rank1 = daemon.worker(&a1);
    assert_eq!(rank0.run("store 4 10")["stored"], 10);
    assert_eq!(rank1.run("store 4 10")["stored"], 10, "rank 1's KV is other bytes: its own copy");
    assert_eq!(daemon.status().tiers[0].objects, 20);
    for (w, _) in [(&mut rank0, 0), (&mut rank1, 1)] {
        let lookup = w.run("lookup 4 10");
        assert_eq!(lookup["hit"], 10);
        let id = lookup["lookup"].as_u64().unwrap();
        // The worker verifies its own rank's bytes came back, not the other rank's.
        assert_eq!(w.run(&format!("retrieve {id} 4 10"))["verified"], 10);
    }
    assert_eq!(daemon.settled().open_lookups, 0);
    rank0.exit();
    rank1.exit();
}

#[test]
fn sigterm_with_sessions_open_still_exits_zero() {
    let mut daemon = Daemon::start();
    let mut worker = daemon.worker(&["--chunk-bytes", "65536"]);
    worker.run("store 9 4");
    worker.run("lookup 9 4");
    let exit = daemon.stop();
    assert!(exit.success(), "{exit}");
    std::thread::sleep(Duration::from_millis(10));
    assert!(!daemon.socket.exists());
}
