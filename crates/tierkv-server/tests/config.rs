//! The TOML configuration: defaults, refusals that name the file, line and key, and the
//! `tierkv config` commands.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::process::Command;
use std::time::Duration;

use tierkv_disk::FsyncPolicy;
use tierkv_l1::DeviceKind;
use tierkv_server::config::{ConfigError, DEFAULT_TOML, DaemonConfig};
use tierkv_storage::StorePolicy;

fn parse(text: &str) -> Result<DaemonConfig, ConfigError> {
    DaemonConfig::parse(text, "test.toml")
}

fn refusal(text: &str) -> String {
    match parse(text) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_embedded_default_is_the_all_defaults_config() {
    let embedded = DaemonConfig::embedded_default().unwrap();
    let empty = parse("").unwrap();
    assert_eq!(
        format!("{embedded:?}"),
        format!("{empty:?}"),
        "every key of default.toml is its default"
    );
    assert_eq!(embedded.server.socket.to_str(), Some("/tmp/tierkv.sock"));
    assert_eq!(embedded.server.tcp, None, "TCP is off by default");
    assert_eq!(embedded.metrics.listen.map(|a| a.to_string()).as_deref(), Some("127.0.0.1:9464"));
    assert_eq!(embedded.storage.l1.device, DeviceKind::Auto, "the GPU when present");
    assert_eq!(embedded.storage.l1.slot_bytes, 2 << 20);
    assert_eq!(embedded.storage.l2.as_ref().unwrap().chunk_bytes, 2 << 20);
    let disk = embedded.storage.disk.as_ref().unwrap();
    assert_eq!(disk.dir.to_str(), Some("tierkv-data"), "relative: the daemon's working directory");
    assert_eq!(disk.max_chunk_bytes, 2 << 20);
    assert_eq!(embedded.storage.store_policy, StorePolicy::WriteThrough);
    // Every section and key of the file is documented by a comment above it.
    for line in DEFAULT_TOML.lines().filter(|l| l.contains(" = ") && !l.starts_with('#')) {
        let at = DEFAULT_TOML.find(line).unwrap();
        let before = DEFAULT_TOML[..at].trim_end().lines().last().unwrap_or("");
        assert!(before.starts_with('#') || before.contains(" = "), "{line} has no comment");
    }
}

#[test]
fn values_map_onto_the_tiers() {
    let config = parse(
        r#"
[server]
tcp = "127.0.0.1:7070"
token = "0123456789abcdef"
max_frame = "1MiB"
[metrics]
enabled = false
[l1]
device = "cuda"
cuda_device = 1
capacity = "40GiB"
slot = "512KiB"
policy = "s3fifo"
lease_ttl = "2m"
[l2]
enabled = false
[disk]
capacity = "1TB"
segment = "64MiB"
fsync = "250ms"
read_mode = "mmap"
[storage]
store_policy = "disk_admission"
disk_admission_min_reads = 3
maintenance_interval = "10ms"
"#,
    )
    .unwrap();
    assert_eq!(config.server.max_frame_bytes, 1 << 20);
    assert!(config.server.tcp.is_some());
    assert_eq!(config.metrics.listen, None);
    assert_eq!(config.storage.l1.device, DeviceKind::Cuda { ordinal: 1 });
    assert_eq!(config.storage.l1.capacity_bytes, 40 << 30);
    assert_eq!(config.storage.l1.lease_ttl, Duration::from_secs(120));
    assert!(config.storage.l2.is_none(), "a disabled tier is absent");
    let disk = config.storage.disk.unwrap();
    assert_eq!((disk.capacity_bytes, disk.max_chunk_bytes), (1_000_000_000_000, 512 << 10));
    assert_eq!(disk.fsync, FsyncPolicy::Periodic(Duration::from_millis(250)));
    assert_eq!(config.storage.store_policy, StorePolicy::DiskAdmission { min_reads: 3 });
}

#[test]
fn unknown_keys_are_refused_with_file_line_and_key() {
    for section in ["server", "metrics", "l1", "l2", "disk", "storage"] {
        let text = format!("# comment\n[{section}]\nbogus_key = 1\n");
        let message = refusal(&text);
        assert!(message.contains("test.toml"), "{message}");
        assert!(message.contains("line 3"), "{message}");
        assert!(message.contains("bogus_key"), "{message}");
    }
    let message = refusal("[nonsense]\n");
    assert!(message.contains("nonsense"), "{message}");
}

#[test]
fn wrong_types_and_bad_sizes_are_refused_with_the_line() {
    let message = refusal("[l1]\n\ncapacity = true\n");
    assert!(message.contains("line 3") && message.contains("size"), "{message}");
    let message = refusal("[l1]\nslot = \"2 parsecs\"\n");
    assert!(message.contains("line 2") && message.contains("unit"), "{message}");
    let message = refusal("[l1]\nlease_ttl = \"soon\"\n");
    assert!(message.contains("line 2") && message.contains("duration"), "{message}");
    let message = refusal("[server]\nmax_connections = -1\n");
    assert!(message.contains("line 2"), "{message}");
}

#[test]
fn contradictions_are_refused_naming_the_key_and_its_line() {
    let cases = [
        ("[server]\ntcp = \"127.0.0.1:7070\"\n", "server.tcp", 2),
        ("[server]\ntcp = \"127.0.0.1:7070\"\ntoken = \"short\"\n", "server.token", 3),
        ("[server]\nmax_frame = \"1KiB\"\n", "server.max_frame", 2),
        ("[l1]\nslot = 0\n", "l1.slot", 2),
        ("[l1]\ncapacity = \"1MiB\"\nslot = \"2MiB\"\n", "l1.capacity", 2),
        ("[l1]\nwatermark_high = 0.5\nwatermark_low = 0.9\n", "l1.watermark_low", 3),
        ("[l1]\nwatermark_high = 1.5\n", "l1.watermark_high", 2),
        ("[l1]\nshards = 3\n", "l1.shards", 2),
        ("[l1]\ncuda_device = 2\n", "l1.cuda_device", 2),
        ("[l2]\ncapacity = \"1MiB\"\n", "l2.capacity", 2),
        ("[l2]\nworkers = 0\n", "l2.workers", 2),
        ("[disk]\nsegment = \"1MiB\"\n", "disk.segment", 2),
        ("[disk]\ncapacity = \"300MiB\"\n", "disk.capacity", 2),
        ("[disk]\nfsync = \"sometimes\"\n", "disk.fsync", 2),
        ("[storage]\nmaintenance_interval = \"0s\"\n", "storage.maintenance_interval", 2),
        ("[storage]\nprefetch_max_in_flight = 0\n", "storage.prefetch_max_in_flight", 2),
    ];
    for (text, key, line) in cases {
        let message = refusal(text);
        assert!(message.contains(key), "{key}: {message}");
        assert!(message.contains(&format!("test.toml:{line}:")), "{key}: {message}");
    }
}

#[test]
fn a_missing_file_is_named() {
    let err = DaemonConfig::from_file("/nonexistent/tierkv.toml".as_ref()).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/tierkv.toml"), "{err}");
}

#[test]
fn the_config_commands_check_files_and_print_the_default() {
    let tierkv = env!("CARGO_BIN_EXE_tierkv");
    let printed = Command::new(tierkv).args(["config", "default"]).output().unwrap();
    assert!(printed.status.success());
    assert_eq!(String::from_utf8(printed.stdout).unwrap(), DEFAULT_TOML);

    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(&good, DEFAULT_TOML).unwrap();
    let checked = Command::new(tierkv).args(["config", "check"]).arg(&good).output().unwrap();
    assert!(checked.status.success(), "{checked:?}");
    assert!(String::from_utf8_lossy(&checked.stdout).contains("ok"));

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[l1]\nslot = \"2MiB\"\ncapacity = \"1MiB\"\n").unwrap();
    let checked = Command::new(tierkv).args(["config", "check"]).arg(&bad).output().unwrap();
    assert!(!checked.status.success());
    let stderr = String::from_utf8_lossy(&checked.stderr);
    assert!(stderr.contains("bad.toml:3:") && stderr.contains("l1.capacity"), "{stderr}");
}
