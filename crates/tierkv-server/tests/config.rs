//! The TOML configuration: defaults, the mapping onto the tiers, refusals that name the file,
//! line and key, and the `tierkv config` commands.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tierkv_core::policy::PolicyKind;
use tierkv_disk::{DiskStoreConfig, FsyncPolicy, ReadMode};
use tierkv_l1::{DeviceKind, L1Config, Watermark};
use tierkv_l2::{HostMemory, HostStoreConfig};
use tierkv_prefetch::PrefetchConfig;
use tierkv_server::config::{ConfigError, DEFAULT_TOML, DaemonConfig, ServerConfig};
use tierkv_storage::StorePolicy;

const SECTIONS: [&str; 7] = ["server", "metrics", "l1", "l2", "disk", "remote", "storage"];

fn parse(text: &str) -> Result<DaemonConfig, ConfigError> {
    DaemonConfig::parse(text, "test.toml")
}

fn refusal(text: &str) -> String {
    match parse(text) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e.to_string(),
    }
}

/// Asserts that `text` is refused as `test.toml:<line>:<column>: <key>: ...`.
fn assert_refused(text: &str, key: &str, line: usize) -> String {
    let message = refusal(text);
    assert!(message.starts_with(&format!("test.toml:{line}:")), "{key}, line {line}: {message}");
    assert!(message.contains(&format!(": {key}: ")), "{key}, line {line}: {message}");
    message
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
    assert_eq!(embedded.server, empty.server);
    assert_eq!(embedded.metrics, empty.metrics);

    let server = &embedded.server;
    assert_eq!(server.socket, Path::new("/tmp/tierkv.sock"));
    assert_eq!((server.tcp, server.token.as_deref()), (None, None), "TCP is off by default");
    assert_eq!(server.max_frame_bytes, 16 << 20);
    assert_eq!(server.max_connections, 1024);
    assert_eq!(embedded.metrics.listen, Some("127.0.0.1:9464".parse().unwrap()));

    // The defaults are the tier crates' own: the constructors' and `Default`s.
    let storage = &embedded.storage;
    assert_eq!(storage.l1, L1Config::new(1 << 30, 2 << 20));
    assert_eq!(storage.l2, Some(HostStoreConfig::new(4 << 30, 2 << 20)));
    let disk = DiskStoreConfig::new("tierkv-data", 16 << 30, 2 << 20);
    assert_eq!(storage.disk, Some(disk), "a relative dir: the daemon's working directory");
    assert_eq!(storage.prefetch, PrefetchConfig::default());
    assert_eq!(storage.l2_watermark, Watermark::default());
    assert_eq!(storage.store_policy, StorePolicy::Cascade);
    assert_eq!(storage.maintenance_interval, Duration::from_millis(50));
    assert_eq!(storage.stop_drain_timeout, Duration::from_secs(20));
    assert_eq!(storage.store_timeout, Duration::from_secs(60));
}

/// The key a line of `default.toml` sets, commented out or not.
fn key_of(line: &str) -> Option<&str> {
    let (key, _) = line.trim_start_matches("# ").split_once(" = ")?;
    (!key.is_empty()
        && key.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
    .then_some(key)
}

#[test]
fn every_key_of_the_default_file_is_commented() {
    let lines: Vec<&str> = DEFAULT_TOML.lines().collect();
    for (i, line) in lines.iter().enumerate().filter(|(_, l)| key_of(l).is_some()) {
        // The comment above a key explains it (and the keys right below it, such as a pair).
        let above = lines[..i].iter().rev().find(|l| key_of(l).is_none());
        assert!(above.is_some_and(|l| l.starts_with('#')), "{line} has no comment above it");
    }
    // The keys commented out because they are off by default are real keys.
    let uncommented = DEFAULT_TOML.replace("# tcp = ", "tcp = ").replace("# token = ", "token = ");
    let on = DaemonConfig::parse(&uncommented, "default.toml").unwrap();
    assert!(on.server.tcp.is_some() && on.server.token.is_some());
}

/// The keys the parser accepts in `section`, read from its refusal of an unknown one.
fn known_keys(section: &str) -> BTreeSet<String> {
    let message = refusal(&format!("[{section}]\nno_such_key = 1\n"));
    let (_, expected) = message.split_once("expected").expect("serde lists the keys it knows");
    expected.split('`').skip(1).step_by(2).map(|k| format!("{section}.{k}")).collect()
}

/// The keys `default.toml` shows, commented-out ones included.
fn keys_in_default_toml() -> BTreeSet<String> {
    let mut section = "";
    let mut keys = BTreeSet::new();
    for line in DEFAULT_TOML.lines() {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name;
        } else if let Some(key) = key_of(line) {
            keys.insert(format!("{section}.{key}"));
        }
    }
    keys
}

#[test]
fn every_key_is_in_the_default_file_and_the_documentation() {
    let known: BTreeSet<String> = SECTIONS.iter().flat_map(|s| known_keys(s)).collect();
    assert!(known.len() > 30 && known.contains("server.max_connections"), "{known:?}");
    assert_eq!(keys_in_default_toml(), known, "config/default.toml shows every key");

    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/configuration.md");
    let docs = std::fs::read_to_string(docs).unwrap();
    for key in &known {
        let (section, name) = key.split_once('.').unwrap();
        let heading = format!("\n## `[{section}]`\n");
        let (_, table) = docs.split_once(&heading).expect("a heading per section");
        let table = table.split("\n## ").next().unwrap();
        assert!(table.contains(&format!("\n| `{name}` | ")), "docs/configuration.md lacks {key}");
    }
    // The example parses.
    let (_, example) = docs.split_once("```toml\n").expect("an example");
    let (example, _) = example.split_once("```").unwrap();
    let gpu = DaemonConfig::parse(example, "docs/configuration.md").unwrap();
    assert_eq!(gpu.storage.l1.device, DeviceKind::Cuda { ordinal: 0 });
    assert_eq!(gpu.storage.disk.unwrap().capacity_bytes, 2 << 40);
}

#[test]
fn values_map_onto_the_tiers() {
    let config = parse(
        r#"
[server]
socket = "run/tierkv.sock"
tcp = "0.0.0.0:7070"
token = "0123456789abcdef"
max_frame = "1MiB"
max_connections = 16
[metrics]
listen = "0.0.0.0:9100"
[l1]
device = "cuda"
cuda_device = 1
capacity = "40GiB"
slot = "512KiB"
policy = "s3fifo"
lease_ttl = "2m"
watermark_high = 0.8
watermark_low = 0.7
shards = 16
prefault = true
[l2]
capacity = "256GiB"
memory = "huge_pages"
policy = "s3fifo"
workers = 8
watermark_high = 1
watermark_low = 0.5
prefault = true
[disk]
dir = "/var/lib/tierkv"
capacity = "1TB"
segment = "64MiB"
fsync = "250ms"
io_threads = 16
read_mode = "mmap"
policy = "s3fifo"
[storage]
store_policy = "disk_admission"
disk_admission_min_reads = 3
maintenance_interval = "10ms"
prefetch_max_in_flight = 32
prefetch_drain_timeout = "1m 30s"
prefetch_timeout = "45s"
store_timeout = "2m"
"#,
    )
    .unwrap();
    let server = &config.server;
    assert_eq!(server.socket, Path::new("run/tierkv.sock"));
    assert_eq!(server.tcp, Some("0.0.0.0:7070".parse().unwrap()));
    assert_eq!(server.token.as_deref(), Some("0123456789abcdef"));
    assert_eq!(server.max_frame_bytes, 1 << 20);
    assert_eq!(server.max_connections, 16);
    assert_eq!(config.metrics.listen, Some("0.0.0.0:9100".parse().unwrap()));

    let storage = &config.storage;
    let l1 = L1Config {
        device: DeviceKind::Cuda { ordinal: 1 },
        policy: PolicyKind::S3Fifo,
        shards: 16,
        lease_ttl: Duration::from_secs(120),
        watermark: Watermark { high: 0.8, low: 0.7 },
        prefault: true,
        ..L1Config::new(40 << 30, 512 << 10)
    };
    assert_eq!(storage.l1, l1);
    let l2 = HostStoreConfig {
        memory: HostMemory::HugePages,
        policy: PolicyKind::S3Fifo,
        workers: 8,
        prefault: true,
        ..HostStoreConfig::new(256 << 30, 512 << 10)
    };
    assert_eq!(storage.l2, Some(l2), "chunks are one L1 slot");
    assert_eq!(storage.l2_watermark, Watermark { high: 1.0, low: 0.5 });
    let disk = DiskStoreConfig {
        segment_bytes: 64 << 20,
        fsync: FsyncPolicy::Periodic(Duration::from_millis(250)),
        io_threads: 16,
        read_mode: ReadMode::Mmap,
        policy: PolicyKind::S3Fifo,
        ..DiskStoreConfig::new("/var/lib/tierkv", 1_000_000_000_000, 512 << 10)
    };
    assert_eq!(storage.disk, Some(disk));
    assert_eq!(storage.store_policy, StorePolicy::DiskAdmission { min_reads: 3 });
    assert_eq!(storage.maintenance_interval, Duration::from_millis(10));
    assert_eq!(storage.store_timeout, Duration::from_secs(120));
    let prefetch = PrefetchConfig {
        max_in_flight: 32,
        drain_timeout: Duration::from_secs(90),
        request_timeout: Duration::from_secs(45),
    };
    assert_eq!(storage.prefetch, prefetch);
}

#[test]
fn the_remaining_names_map_too() {
    let config = parse(
        "[metrics]\nenabled = false\n[l1]\ndevice = \"emulated\"\n[l2]\nmemory = \"pinned\"\n\
         [disk]\nfsync = \"never\"\n[storage]\nstore_policy = \"write_back\"\n",
    )
    .unwrap();
    assert_eq!(config.metrics.listen, None, "metrics disabled");
    assert_eq!(config.storage.l1.device, DeviceKind::Emulated);
    assert_eq!(config.storage.l2.unwrap().memory, HostMemory::Pinned);
    assert_eq!(config.storage.disk.unwrap().fsync, FsyncPolicy::Never);
    assert_eq!(config.storage.store_policy, StorePolicy::WriteBack);
    let plain = parse("[l2]\nmemory = \"plain\"\n[disk]\nfsync = \"always\"\n").unwrap();
    assert_eq!(plain.storage.l2.unwrap().memory, HostMemory::Plain);
}

#[test]
fn sizes_and_durations_parse() {
    let l1 = |value: &str| parse(&format!("[l1]\nslot = 4096\ncapacity = {value}\n"));
    for (value, bytes) in [
        ("\"8GiB\"", 8u64 << 30),
        ("\"512MiB\"", 512 << 20),
        ("\"64KiB\"", 64 << 10),
        ("\"1.5GiB\"", 3 << 29),
        ("\"10GB\"", 10_000_000_000),
        ("\"2TiB\"", 2 << 40),
        ("\"12288B\"", 12288),
        ("\"12288\"", 12288),
        ("12288", 12288),
    ] {
        assert_eq!(l1(value).unwrap().storage.l1.capacity_bytes, bytes, "{value}");
    }
    for (value, why) in [
        ("-4096", "negative"),
        ("\"-1GiB\"", "negative"),
        ("\"\"", "not a size"),
        ("\"8 parsecs\"", "unit"),
        ("\"1.5B\"", "whole number of bytes"),
        ("\"99999999TiB\"", "exceeds"),
        ("1.5", "a size such as"),
    ] {
        let message = assert_refused(&format!("[l1]\ncapacity = {value}\n"), "l1.capacity", 2);
        assert!(message.contains(why), "{value}: {message}");
    }

    let ttl = |value: &str| parse(&format!("[l1]\nlease_ttl = \"{value}\"\n"));
    for (value, duration) in [
        ("30s", Duration::from_secs(30)),
        ("50ms", Duration::from_millis(50)),
        ("1m", Duration::from_secs(60)),
        ("1h 30m", Duration::from_secs(5400)),
    ] {
        assert_eq!(ttl(value).unwrap().storage.l1.lease_ttl, duration, "{value}");
    }
    let message = assert_refused("[l1]\nlease_ttl = \"soon\"\n", "l1.lease_ttl", 2);
    assert!(message.contains("duration"), "{message}");
    assert_refused("[l1]\nlease_ttl = 30\n", "l1.lease_ttl", 2);
    // Longer than a day: a mistake that would hang a stop or overflow a clock, refused.
    assert_eq!(ttl("24h").unwrap().storage.l1.lease_ttl, Duration::from_secs(86_400));
    for (toml, key) in [
        ("[storage]\nmaintenance_interval = \"1y\"\n", "storage.maintenance_interval"),
        (
            "[storage]\nstore_backpressure = \"18446744073709551615s\"\n",
            "storage.store_backpressure",
        ),
        ("[l1]\nlease_ttl = \"25h\"\n", "l1.lease_ttl"),
        ("[disk]\nfsync = \"2days\"\n", "disk.fsync"),
    ] {
        let message = assert_refused(toml, key, 2);
        assert!(message.contains("longer than a day"), "{toml}: {message}");
    }
}

#[test]
fn unknown_keys_are_refused_with_file_line_and_key() {
    for section in SECTIONS {
        let message = assert_refused(
            &format!("# comment\n[{section}]\n\nbogus_key = 1\n"),
            &format!("{section}.bogus_key"),
            4,
        );
        assert!(message.contains("unknown field `bogus_key`"), "{message}");
    }
    let message = assert_refused("[server]\n[nonsense]\nkey = 1\n", "nonsense", 2);
    assert!(message.contains("unknown field `nonsense`"), "{message}");
    assert_refused("l1.bogus = 1\n", "l1.bogus", 1);
    assert_refused("[l1]\ncapacity = \"1GiB\"\n[l1.nested]\n", "l1.nested", 3);
}

#[test]
fn wrong_types_and_names_are_refused_with_the_line() {
    let cases = [
        ("[l1]\n\ncapacity = true\n", "l1.capacity", 3, "a size"),
        ("[server]\nmax_connections = -1\n", "server.max_connections", 2, "-1"),
        ("[server]\nmax_connections = \"many\"\n", "server.max_connections", 2, "string"),
        ("[server]\ntcp = \"localhost\"\n", "server.tcp", 2, "IP address and port"),
        ("[metrics]\nenabled = \"yes\"\n", "metrics.enabled", 2, "bool"),
        ("[l1]\ndevice = \"tpu\"\n", "l1.device", 2, "`cuda`"),
        ("[l1]\npolicy = \"lfu\"\n", "l1.policy", 2, "`s3fifo`"),
        ("[l1]\nwatermark_high = \"high\"\n", "l1.watermark_high", 2, "f64"),
        ("[l2]\nmemory = \"hugepages\"\n", "l2.memory", 2, "`huge_pages`"),
        ("[disk]\nread_mode = \"fast\"\n", "disk.read_mode", 2, "`mmap`"),
        ("[disk]\nfsync = \"sometimes\"\n", "disk.fsync", 2, "always"),
        ("[disk]\nfsync = \"0s\"\n", "disk.fsync", 2, "positive"),
        ("[storage]\nstore_policy = \"write_around\"\n", "storage.store_policy", 2, "write_back"),
        ("server = 3\n", "server", 1, "struct"),
    ];
    for (text, key, line, hint) in cases {
        let message = assert_refused(text, key, line);
        assert!(message.contains(hint), "{key}: {hint:?} not in {message}");
    }
    // Not TOML at all: the parser's position, no key.
    let message = refusal("[l1\ncapacity = 1\n");
    assert!(message.starts_with("test.toml:1:"), "{message}");
}

#[test]
fn contradictions_and_ranges_are_refused_naming_the_key_and_its_line() {
    let cases = [
        ("[server]\ntcp = \"127.0.0.1:7070\"\n", "server.tcp", 2),
        ("[server]\ntcp = \"127.0.0.1:7070\"\ntoken = \"short\"\n", "server.token", 3),
        ("[server]\nsocket = \"\"\n", "server.socket", 2),
        (&format!("[server]\nsocket = \"/{}\"\n", "s".repeat(120)), "server.socket", 2),
        ("[server]\nmax_frame = \"1KiB\"\n", "server.max_frame", 2),
        ("[server]\nmax_frame = \"4GiB\"\n", "server.max_frame", 2),
        ("[server]\nmax_connections = 0\n", "server.max_connections", 2),
        ("[l1]\nslot = 0\n", "l1.slot", 2),
        ("[l1]\ncapacity = \"1MiB\"\nslot = \"2MiB\"\n", "l1.capacity", 2),
        ("[l1]\ncapacity = \"16TiB\"\nslot = \"4KiB\"\n", "l1.capacity", 2),
        ("[l1]\nwatermark_high = 0.5\nwatermark_low = 0.9\n", "l1.watermark_low", 3),
        ("[l1]\nwatermark_high = 1.5\n", "l1.watermark_high", 2),
        ("[l1]\nwatermark_low = 0\n", "l1.watermark_low", 2),
        ("[l1]\nwatermark_low = nan\n", "l1.watermark_low", 2),
        ("[l1]\nshards = 3\n", "l1.shards", 2),
        ("[l1]\nshards = 2048\n", "l1.shards", 2),
        ("[l1]\ncuda_device = 2\n", "l1.cuda_device", 2),
        ("[l1]\nlease_ttl = \"0s\"\n", "l1.lease_ttl", 2),
        ("[l2]\ncapacity = \"1MiB\"\n", "l2.capacity", 2),
        ("[l2]\nworkers = 0\n", "l2.workers", 2),
        ("[l2]\nworkers = 257\n", "l2.workers", 2),
        ("[l2]\nwatermark_low = 0.99\n", "l2.watermark_low", 2),
        ("[disk]\ndir = \"\"\n", "disk.dir", 2),
        ("[disk]\nsegment = \"1MiB\"\n", "disk.segment", 2),
        ("[disk]\nsegment = \"1000MB\"\n", "disk.segment", 2),
        ("[disk]\ncapacity = \"3MiB\"\n", "disk.capacity", 2),
        ("[disk]\ncapacity = \"300MiB\"\nsegment = \"256MiB\"\n", "disk.capacity", 2),
        ("[disk]\nio_threads = 0\n", "disk.io_threads", 2),
        ("[storage]\ndisk_admission_min_reads = 0\n", "storage.disk_admission_min_reads", 2),
        ("[storage]\nmaintenance_interval = \"0s\"\n", "storage.maintenance_interval", 2),
        ("[storage]\nprefetch_max_in_flight = 0\n", "storage.prefetch_max_in_flight", 2),
        ("[storage]\nprefetch_timeout = \"0s\"\n", "storage.prefetch_timeout", 2),
        ("[storage]\nstore_timeout = \"0s\"\n", "storage.store_timeout", 2),
    ];
    for (text, key, line) in cases {
        assert_refused(text, key, line);
    }
}

#[test]
fn a_contradiction_with_a_default_blames_the_key_written() {
    // l1.capacity keeps its default (1GiB); the slot written is what no longer fits.
    let message = assert_refused("[l1]\n\nslot = \"2GiB\"\n", "l1.slot", 3);
    assert!(message.contains("l1.capacity") && message.contains("2147483648"), "{message}");
    assert_refused("[l1]\nwatermark_high = 0.5\n", "l1.watermark_high", 2);
    // The default l2.capacity (4GiB) cannot hold the slot written.
    let message = assert_refused("[l1]\ncapacity = \"8GiB\"\nslot = \"8GiB\"\n", "l1.slot", 3);
    assert!(message.contains("l2.capacity"), "{message}");
}

#[test]
fn an_auto_disk_segment_is_one_record_of_a_slot_and_segments_share_files() {
    let record = (2 << 20) + 4096;
    // The defaults: 16GiB of 2MiB slots make 8,160 segments of one record and a header block,
    // in four files.
    let disk = parse("").unwrap().storage.disk.unwrap();
    assert_eq!(disk.segment_bytes, 4096 + record);
    assert_eq!(disk.capacity_bytes / disk.segment_bytes, 8_160);
    assert_eq!(disk.files(), 4);
    assert_eq!(disk.file_bytes, tierkv_disk::FILE_BYTES);
    // A bigger slot, a bigger segment: still one record.
    let large = parse("[l1]\nslot = \"512MiB\"\n").unwrap().storage.disk.unwrap();
    assert_eq!(large.segment_bytes, 4096 + (512 << 20) + 4096);
    // A size written is kept as written.
    let given = parse("[disk]\nsegment = \"64MiB\"\n").unwrap().storage.disk.unwrap();
    assert_eq!(given.segment_bytes, 64 << 20);
    assert_refused("[disk]\nsegment = \"automatic\"\n", "disk.segment", 2);
    // A slot within a block of the largest size is refused, not an overflow in sizing segments.
    assert_refused("[l1]\nslot = \"18446744073709551615\"\n", "l1.slot", 2);
    // Slots of a few bytes would make billions of them: at least a page.
    let message = assert_refused("[l1]\nslot = \"1B\"\ncapacity = \"4GiB\"\n", "l1.slot", 2);
    assert!(message.contains("at least 4096"), "{message}");
    assert!(parse("[l1]\nslot = \"4KiB\"\n").is_ok());
}

#[test]
fn disabled_tiers_are_none_and_skip_their_checks() {
    let config = parse(
        "[l1]\nslot = \"1GiB\"\n[l2]\nenabled = false\ncapacity = \"1MiB\"\n\
         [disk]\nenabled = false\nsegment = \"1MiB\"\n",
    )
    .unwrap();
    assert!(config.storage.l2.is_none() && config.storage.disk.is_none());
    assert_eq!(config.storage.l1.slot_bytes, 1 << 30);
}

#[test]
fn the_remote_section_maps_onto_the_remote_tier_and_its_checks_name_the_key() {
    let defaults = parse("").unwrap();
    assert!(defaults.storage.remote.is_none(), "the remote tier is off by default");
    let config = parse(
        "[l1]\nslot = \"4MiB\"\n[remote]\nenabled = true\n\
         urls = [\"redis://10.0.0.1:7000\"]\nmode = \"standalone\"\n\
         op_timeout = \"250ms\"\nttl = \"0s\"\nadmission = \"after_reads\"\nadmission_min_reads = 3\n",
    )
    .unwrap();
    let remote = config.storage.remote.unwrap();
    assert_eq!(remote.urls, ["redis://10.0.0.1:7000"]);
    assert_eq!(remote.mode, tierkv_remote::RemoteMode::Standalone);
    assert_eq!(remote.op_timeout, std::time::Duration::from_millis(250));
    assert_eq!(remote.ttl, None, "0s: no expiry");
    assert_eq!(remote.max_chunk_bytes, 4 << 20, "chunks are L1 slots");
    assert_eq!(
        config.storage.remote_admission,
        tierkv_storage::RemoteAdmission::AfterReads { min_reads: 3 }
    );
    assert_refused("[remote]\nenabled = true\nurls = [\"http://x\"]\n", "remote.urls", 3);
    // One server is one URL: more are likely a cluster's nodes under the wrong mode.
    let message = assert_refused(
        "[remote]\nenabled = true\nmode = \"standalone\"\n\
         urls = [\"redis://10.0.0.1:7000\", \"redis://10.0.0.2:7000\"]\n",
        "remote.urls",
        4,
    );
    assert!(message.contains("mode = \"cluster\""), "{message}");
    assert_refused("[remote]\nenabled = true\nmax_in_flight = 0\n", "remote.max_in_flight", 3);
    // Each duration blamed by its own name and line, not the first named in the message.
    assert_refused("[remote]\nenabled = true\nop_timeout = \"0s\"\n", "remote.op_timeout", 3);
    assert_refused(
        "[remote]\nenabled = true\nconnect_timeout = \"1s\"\nreconnect_interval = \"0s\"\n",
        "remote.reconnect_interval",
        4,
    );
    assert_refused("[remote]\nenabled = true\nkey_prefix = \"t{a}\"\n", "remote.key_prefix", 3);
    assert_refused("[remote]\nadmission_min_reads = 0\n", "remote.admission_min_reads", 2);
    // A value's life in the cluster is not a timeout: a week is taken, up to ten years.
    let week = parse("[remote]\nenabled = true\nttl = \"7days\"\n").unwrap();
    assert_eq!(week.storage.remote.unwrap().ttl, Some(std::time::Duration::from_secs(604_800)));
    let message = assert_refused("[remote]\nenabled = true\nttl = \"20years\"\n", "remote.ttl", 3);
    assert!(message.contains("ten years"), "{message}");
}

#[test]
fn a_relative_disk_dir_stays_relative() {
    let config = parse("[disk]\ndir = \"cache/kv\"\n").unwrap();
    assert_eq!(config.storage.disk.unwrap().dir, Path::new("cache/kv"), "the daemon resolves it");
}

#[test]
fn files_are_named_in_errors() {
    let err = DaemonConfig::from_file("/nonexistent/tierkv.toml".as_ref()).unwrap_err();
    assert!(matches!(err, ConfigError::Read { .. }));
    assert!(err.to_string().contains("/nonexistent/tierkv.toml"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node.toml");
    std::fs::write(&path, "[server]\nmax_connections = 8\n").unwrap();
    assert_eq!(DaemonConfig::from_file(&path).unwrap().server.max_connections, 8);
    std::fs::write(&path, "[server]\n  max_connections = 0\n").unwrap();
    let err = DaemonConfig::from_file(&path).unwrap_err().to_string();
    assert!(err.starts_with(&format!("{}:2:3: server.max_connections: ", path.display())), "{err}");
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

#[test]
fn h16_6_groups_are_names_or_numbers_and_unknown_ones_are_refused() {
    let config = parse("[server]\nsocket_group = \"0\"\n[disk]\ngroup = \"root\"\n").unwrap();
    assert_eq!(config.server.socket_group, Some(0));
    assert_eq!(config.storage.disk.unwrap().group, Some(0), "root is group 0 by name");
    let defaults = parse("").unwrap();
    assert_eq!(defaults.server.socket_group, None, "the socket is private by default");
    assert_eq!(defaults.storage.disk.unwrap().group, None, "the cache is private by default");
    let message = assert_refused("[disk]\ngroup = \"no-such-group-h16\"\n", "disk.group", 2);
    assert!(message.contains("no group named"), "{message}");
    assert_refused("\n[server]\nsocket_group = \"no-such-group-h16\"\n", "server.socket_group", 3);
}

#[test]
fn h16_ops_config_check_reports_every_error_in_a_file() {
    let text = "\
[server]
max_connections = 0
bogus = 1
[l1]
slot = \"a lot\"
capacity = \"1KiB\"
lease_ttl = \"0s\"
[l2]
workers = 0
typo = true
[disk]
io_threads = 999
[storage]
maintenance_interval = \"soon\"
";
    let err = parse(text).unwrap_err();
    let all: Vec<String> = err.all().iter().map(|e| e.to_string()).collect();
    let expected = [
        (2, "server.max_connections"),
        (3, "server.bogus"),
        (5, "l1.slot"),
        (7, "l1.lease_ttl"),
        (9, "l2.workers"),
        (10, "l2.typo"),
        (12, "disk.io_threads"),
        (14, "storage.maintenance_interval"),
    ];
    for (line, key) in expected {
        assert!(
            all.iter().any(|e| e.starts_with(&format!("test.toml:{line}:")) && e.contains(key)),
            "{key} (line {line}) missing from:\n{err}"
        );
    }
    // In the file's order, and nothing about l1.capacity: l1.slot could not be read, so
    // comparing the capacity with the default slot would blame a value the file does not hold.
    assert_eq!(all.len(), expected.len(), "{err}");
    let lines: Vec<usize> = err.all().iter().filter_map(|e| e.position()).map(|p| p.line).collect();
    assert!(lines.is_sorted(), "{lines:?}");

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, text).unwrap();
    let tierkv = env!("CARGO_BIN_EXE_tierkv");
    let checked = Command::new(tierkv).args(["config", "check"]).arg(&bad).output().unwrap();
    assert!(!checked.status.success());
    let stderr = String::from_utf8_lossy(&checked.stderr);
    for (line, key) in expected {
        assert!(stderr.contains(&format!("bad.toml:{line}:")) && stderr.contains(key), "{stderr}");
    }
    assert!(stderr.contains("8 errors"), "{stderr}");
}

#[test]
fn the_maintenance_tick_is_no_longer_than_the_lease_deadline_it_enforces() {
    let message = assert_refused(
        "[l1]\nlease_ttl = \"1s\"\n[storage]\nmaintenance_interval = \"1h\"\n",
        "storage.maintenance_interval",
        4,
    );
    assert!(message.contains("l1.lease_ttl"), "{message}");
    parse("[l1]\nlease_ttl = \"1s\"\n[storage]\nmaintenance_interval = \"1s\"\n").unwrap();
}

#[test]
fn server_tcp_and_metrics_listen_on_one_address_are_refused_naming_both_keys() {
    let both = |tcp: &str, metrics: &str| {
        format!(
            "[server]\ntcp = \"{tcp}\"\ntoken = \"a-token-of-sixteen-or-more\"\n[metrics]\n{metrics}\n"
        )
    };
    // The same address, or one the other's wildcard covers: one of the two would fail to bind.
    for (tcp, listen) in [
        ("127.0.0.1:9464", "listen = \"127.0.0.1:9464\""),
        ("127.0.0.1:9464", ""),
        ("0.0.0.0:7070", "listen = \"127.0.0.1:7070\""),
        ("127.0.0.1:7070", "listen = \"[::]:7070\""),
        ("[::1]:7070", "listen = \"[::]:7070\""),
    ] {
        let message = assert_refused(&both(tcp, listen), "server.tcp", 2);
        assert!(message.contains("metrics.listen"), "{tcp} {listen}: {message}");
    }
    // Other ports, other addresses, port 0 (the system picks two), or no metrics endpoint.
    for (tcp, listen) in [
        ("127.0.0.1:7070", "listen = \"127.0.0.1:9464\""),
        ("127.0.0.2:9464", "listen = \"127.0.0.1:9464\""),
        ("[::1]:9464", "listen = \"0.0.0.0:9464\""),
        ("127.0.0.1:0", "listen = \"127.0.0.1:0\""),
        ("127.0.0.1:9464", "enabled = false"),
    ] {
        parse(&both(tcp, listen)).unwrap_or_else(|e| panic!("{tcp} {listen}: {e}"));
    }
}

#[test]
fn the_admin_commands_read_the_server_section_alone() {
    let text = "[server]\nsocket = \"/run/tierkv.sock\"\ntoken = \"a-token-of-sixteen-or-more\"\n\
                [l1]\ncapacity = \"1KiB\"\nbogus = 1\n[nonsense]\n";
    assert!(parse(text).is_err(), "the daemon refuses it");
    let server = ServerConfig::parse(text, "test.toml").unwrap();
    assert_eq!(server, parse(&text[..text.find("[l1]").unwrap()]).unwrap().server);
    let err = ServerConfig::parse("[server]\nmax_connections = 0\n", "test.toml").unwrap_err();
    assert!(err.to_string().starts_with("test.toml:2:1: server.max_connections: "), "{err}");
    assert_eq!(
        ServerConfig::embedded_default().unwrap(),
        DaemonConfig::embedded_default().unwrap().server
    );
}

#[test]
fn listeners_take_an_ip_address_and_port_and_no_host_name() {
    let token = "token = \"a-token-of-sixteen-or-more\"";
    for (text, key, line) in [
        ("[metrics]\nlisten = \"localhost:9464\"\n".to_string(), "metrics.listen", 2),
        (format!("[server]\n{token}\ntcp = \"localhost:7070\"\n"), "server.tcp", 3),
        ("[metrics]\nlisten = \"127.0.0.1\"\n".to_string(), "metrics.listen", 2),
    ] {
        let message = assert_refused(&text, key, line);
        assert!(message.contains("is not an IP address and port such as"), "{message}");
    }
    let config = parse(&format!("[server]\n{token}\ntcp = \"[::1]:7070\"\n")).unwrap();
    assert_eq!(config.server.tcp, Some("[::1]:7070".parse().unwrap()));
}
