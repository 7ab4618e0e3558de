//! What an operator sees: `tierkv status`, TCP with its token, and the metrics as a real
//! Prometheus scrapes them (`promtool check metrics` on the daemon's output, a query of the hit
//! ratio through Prometheus's API).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tierkv_client::Client;
use tierkv_client::proto::{ErrorCode, Hello};
use tierkv_integration_tests::{Daemon, artifact, free_port, http_get, small_config};

fn which(tool: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| std::path::Path::new(dir).join(tool))
        .find(|p| p.is_file())
}

#[test]
fn status_and_clear_give_up_on_a_socket_that_never_answers() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("silent.sock");
    // Takes connections into its backlog and never answers: a stopped or stuck daemon.
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    for args in [&["status", "--timeout", "1"][..], &["clear", "--timeout", "1"]] {
        let mut child = Command::new(artifact("bin", "tierkv"))
            .args(args)
            .arg("--socket")
            .arg(&socket)
            .env("TIERKV_TOKEN", "a-token-for-the-silent-socket")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Far past the timeout: a command that hangs is killed and fails the test.
        let deadline = Instant::now() + Duration::from_secs(30);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                child.kill().unwrap();
                child.wait().unwrap();
                panic!("tierkv {args:?} still waits on a socket that never answers");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let output = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        let expected = format!("no daemon answered on {} within 1 s", socket.display());
        assert!(stderr.contains(&expected), "{args:?}: {stderr}");
    }
}

#[test]
fn tierkv_status_reports_tiers_hits_and_workers() {
    let daemon = Daemon::start();
    let mut worker = daemon.worker(&["--chunk-bytes", "65536"]);
    worker.run("store 1 4");
    let id = worker.run("lookup 1 8")["lookup"].as_u64().unwrap();
    worker.run(&format!("wait {id}"));
    worker.run(&format!("release {id}"));

    let out = Command::new(artifact("bin", "tierkv"))
        .args(["status", "--config"])
        .arg(&daemon.config)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("1 worker(s) connected"), "{text}");
    assert!(text.contains("4 of 8 chunks hit (50.0%)"), "{text}");
    for tier in ["l1", "l2", "disk"] {
        assert!(text.lines().any(|l| l.starts_with(tier)), "{tier} missing:\n{text}");
    }
    let json = Command::new(artifact("bin", "tierkv"))
        .args(["status", "--json", "--socket"])
        .arg(&daemon.socket)
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(report["hit_ratio"], 0.5);
    assert_eq!(report["connected_workers"], 1);

    let nobody = Command::new(artifact("bin", "tierkv"))
        .args(["status", "--socket", "/nonexistent/tierkv.sock"])
        .output()
        .unwrap();
    assert!(!nobody.status.success());
    assert!(String::from_utf8_lossy(&nobody.stderr).contains("no daemon answers"));
    worker.exit();
}

#[test]
fn tcp_needs_the_token_and_cannot_register_buffers() {
    let port = free_port();
    let token = "a-very-long-shared-secret";
    let daemon = Daemon::start_with(|dir| {
        small_config(dir, None, "").replace(
            "[server]\n",
            &format!("[server]\ntcp = \"127.0.0.1:{port}\"\ntoken = \"{token}\"\n"),
        )
    });
    let hello = |token: Option<&str>| Hello {
        token: token.map(String::from),
        ..Client::worker_hello("model", 65536)
    };
    for wrong in [None, Some("guess"), Some("a-very-long-shared-secreT")] {
        let err = Client::connect_tcp(("127.0.0.1", port), hello(wrong)).err().unwrap();
        assert_eq!(err.code(), Some(ErrorCode::Forbidden), "{wrong:?}: {err}");
    }
    let mut client = Client::connect_tcp(("127.0.0.1", port), hello(Some(token))).unwrap();
    let lookup = client.lookup(0, vec![tierkv_client::proto::ChunkId(5)]).unwrap();
    client.release(lookup.id).unwrap();
    let buffer = tierkv_client::SharedBuffer::new(65536, 1).unwrap();
    assert!(client.register_buffer(&buffer).is_err(), "descriptors do not cross TCP");
    // Nor GPU memory, which needs no descriptor: a TCP session never registers a buffer.
    let region = tierkv_client::proto::RegionSource::CudaIpc {
        handle: vec![0; 64],
        device: "0000:00:00.0".into(),
        bytes: 65536,
    };
    let layout = tierkv_client::proto::KvLayout {
        blocks: 1,
        block_bytes: 65536,
        block_stride: 65536,
        blocks_per_chunk: 1,
        segments: vec![tierkv_client::proto::Segment { region: 0, offset: 0 }],
    };
    let err = client.register_kv(&[(region, None)], layout).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadBuffer), "{err}");
    assert!(err.to_string().contains("over the Unix socket only"), "{err}");
    assert_eq!(daemon.status().connected_workers, 1);
    // Over the Unix socket no token is needed.
    Client::connect_unix(&daemon.socket, hello(None)).unwrap().end().unwrap();
}

#[test]
fn prometheus_scrapes_the_daemon_and_computes_the_hit_ratio() {
    let (Some(prometheus), Some(promtool)) = (which("prometheus"), which("promtool")) else {
        eprintln!(
            "SKIPPED: prometheus and promtool are not installed (.ci/run installs Debian's prometheus package)"
        );
        return;
    };
    let metrics_port = free_port();
    let daemon = Daemon::start_with(|dir| small_config(dir, Some(metrics_port), ""));
    let mut worker = daemon.worker(&["--chunk-bytes", "65536"]);
    worker.run("store 2 6");
    let id = worker.run("lookup 2 8")["lookup"].as_u64().unwrap();
    worker.run(&format!("wait {id}"));
    worker.run(&format!("release {id}"));

    // The exposition passes promtool's checks.
    let (code, body) = http_get(metrics_port, "/metrics").unwrap();
    assert_eq!(code, 200);
    let mut check = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    check.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
    let checked = check.wait_with_output().unwrap();
    assert!(
        checked.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    // Every metric the Grafana dashboard charts is one the daemon exports.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let dashboard =
        std::fs::read_to_string(root.join("docker/grafana/dashboards/tierkv.json")).unwrap();
    let charted: std::collections::BTreeSet<&str> = dashboard
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("tierkv_"))
        .collect();
    assert!(charted.len() > 10, "{charted:?}");
    for name in charted {
        assert!(
            body.contains(&format!("\n{name}")),
            "the dashboard charts {name}, which /metrics lacks"
        );
    }
    // Every label the dashboard groups by is one the series carry (or Prometheus adds): a
    // label no series has makes a panel of one unnamed line.
    for clause in dashboard.split("by (").skip(1) {
        let labels = clause.split(')').next().unwrap_or_default();
        for label in labels.split(',').map(str::trim) {
            assert!(
                ["instance", "job"].contains(&label) || body.contains(&format!("{label}=\"")),
                "the dashboard groups by {label}, which no series of /metrics carries"
            );
        }
    }
    // The README's metric table is what /metrics exports, no more and no less.
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let documented = documented_metrics(&readme);
    let exported: std::collections::BTreeSet<String> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    assert!(documented.len() > 20, "{documented:?}");
    let undocumented: Vec<_> = exported.difference(&documented).collect();
    let missing: Vec<_> = documented.difference(&exported).collect();
    assert!(
        undocumented.is_empty() && missing.is_empty(),
        "README's metric table and /metrics differ: exported but not documented {undocumented:?}, \
         documented but not exported {missing:?}"
    );
    for help in [
        "# HELP tierkv_lookup_hit_chunks_total",
        "# HELP tierkv_request_seconds",
        "# TYPE tierkv_request_seconds histogram",
    ] {
        assert!(body.contains(help), "missing {help:?}");
    }

    // A real Prometheus scrapes it, and answers the hit ratio: 6 of 8 chunks.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: tierkv\n    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n"
        ),
    )
    .unwrap();
    let web_port = free_port();
    let mut server = Command::new(&prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{web_port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let query = "/api/v1/query?query=sum(tierkv_lookup_hit_chunks_total)/sum(tierkv_lookup_requested_chunks_total)";
    let deadline = Instant::now() + Duration::from_secs(60);
    let ratio = loop {
        if let Ok((200, body)) = http_get(web_port, query) {
            let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
            if let Some(value) = answer["data"]["result"][0]["value"][1].as_str() {
                break value.parse::<f64>().unwrap();
            }
        }
        if Instant::now() > deadline {
            let _ = server.kill();
            panic!("Prometheus never answered the hit ratio");
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    let _ = server.kill();
    let _ = server.wait();
    assert_eq!(ratio, 0.75, "6 of 8 chunks hit, as Prometheus computes it");
    worker.exit();
}

/// The metric names in the first column of README's table under "## Metrics"; a row may name
/// several (`a_chunks_total`, `..._tokens_total` stands for `a_tokens_total`).
fn documented_metrics(readme: &str) -> std::collections::BTreeSet<String> {
    let section = readme.split("## Metrics").nth(1).unwrap_or_default();
    let section = section.split("\n## ").next().unwrap_or_default();
    let mut names = std::collections::BTreeSet::new();
    for row in section.lines().filter(|l| l.starts_with("| `")) {
        let first = row.split('|').nth(1).unwrap_or_default();
        let mut previous = String::new();
        for name in first.split('`').skip(1).step_by(2) {
            let name = match name.strip_prefix("..._") {
                Some(tail) => {
                    let parts: Vec<&str> = previous.split('_').collect();
                    let keep = parts.len().saturating_sub(tail.split('_').count());
                    format!("{}_{tail}", parts[..keep].join("_"))
                }
                None => name.to_string(),
            };
            previous.clone_from(&name);
            names.insert(name);
        }
    }
    names
}

#[test]
fn the_docker_prometheus_config_passes_promtool() {
    let Some(promtool) = which("promtool") else {
        eprintln!(
            "SKIPPED: promtool is not installed (.ci/run installs Debian's prometheus package)"
        );
        return;
    };
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let config = root.join("docker/prometheus/prometheus.yml");
    let out = Command::new(&promtool).args(["check", "config"]).arg(&config).output().unwrap();
    let rules = root.join("docker/prometheus/rules.yml");
    let checked = Command::new(&promtool).args(["check", "rules"]).arg(&rules).output().unwrap();
    assert!(checked.status.success(), "promtool check rules: {checked:?}");
    // The alerting and recording rules' unit tests: each alert fires on made-up series that
    // should fire it and stays silent on ones that should not.
    let tests = root.join("docker/prometheus/rules.test.yml");
    let tested = Command::new(&promtool).args(["test", "rules"]).arg(&tests).output().unwrap();
    assert!(tested.status.success(), "promtool test rules: {tested:?}");
    assert!(
        out.status.success(),
        "promtool check config {}: {}{}",
        config.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn h16_ops_idle_scrapers_neither_keep_descriptors_nor_block_the_next_scrape() {
    // The metrics endpoint may face a network: connections that never send a request hold at
    // most a few descriptors, and only for the scrape timeout; a scrape after them is served.
    use std::io::Read;
    let port = free_port();
    let daemon = Daemon::start_with(|dir| small_config(dir, Some(port), ""));
    assert_eq!(http_get(port, "/metrics").unwrap().0, 200);
    let before = tierkv_integration_tests::open_fds(daemon.pid());
    let idle: Vec<std::net::TcpStream> =
        (0..40).map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let held = tierkv_integration_tests::open_fds(daemon.pid()).saturating_sub(before);
    assert!(held <= 10, "40 idle scrapers hold {held} of the daemon's descriptors");
    let started = Instant::now();
    for mut stream in idle {
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut byte = [0u8; 1];
        assert_eq!(stream.read(&mut byte).unwrap_or(0), 0, "an idle scraper was answered");
    }
    assert!(started.elapsed() < Duration::from_secs(10), "closed after {:?}", started.elapsed());
    let (code, body) = http_get(port, "/metrics").unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("tierkv_tier_capacity_bytes"), "{body:.200}");
    assert_eq!(http_get(port, "/other").unwrap().0, 404);
}
