//! The daemon's TOML configuration.
//!
//! Every key is optional; an empty file is the embedded default (`config/default.toml`, which
//! documents every key). Unknown keys are refused. Sizes are human strings ("8GiB", "512MiB",
//! "1.5GiB", "10GB") or plain integers of bytes; durations are "30s", "50ms". Every error names
//! the file, the line and the key.

use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use toml::Spanned;

use tierkv_core::policy::PolicyKind;
use tierkv_disk::{BLOCK, DiskStoreConfig, FsyncPolicy, ReadMode, record_bytes};
use tierkv_l1::{DeviceKind, L1Config, Watermark};
use tierkv_l2::{HostMemory, HostStoreConfig};
use tierkv_prefetch::PrefetchConfig;
use tierkv_storage::{StorageConfig, StorePolicy};

/// The embedded default configuration, every key commented.
pub const DEFAULT_TOML: &str = include_str!("../../../config/default.toml");

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The TOML is malformed, a key is unknown, or a value has the wrong type.
    #[error("{origin}: {message}")]
    Parse {
        /// The file.
        origin: String,
        /// toml's message, with the line and column.
        message: String,
    },
    /// A value is out of range, or values contradict each other.
    #[error("{origin}{}: {key}: {message}", line.map(|l| format!(":{l}")).unwrap_or_default())]
    Invalid {
        /// The file.
        origin: String,
        /// The line of the key (`None` when the key was left at its default).
        line: Option<usize>,
        /// The key, as `section.key`.
        key: String,
        /// What is wrong.
        message: String,
    },
}

/// What the daemon runs with.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// Sockets and limits.
    pub server: ServerConfig,
    /// The Prometheus endpoint.
    pub metrics: MetricsConfig,
    /// The tiers and pipelines.
    pub storage: StorageConfig,
}

/// Where and how the daemon listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    /// The Unix socket.
    pub socket: PathBuf,
    /// TCP, off unless set; requires `token`.
    pub tcp: Option<SocketAddr>,
    /// The secret TCP clients present in their hello.
    pub token: Option<String>,
    /// The largest request frame accepted.
    pub max_frame_bytes: u32,
    /// Connections served at once.
    pub max_connections: usize,
}

/// Where `/metrics` is served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricsConfig {
    /// `None` when disabled.
    pub listen: Option<SocketAddr>,
}

/// A size in bytes, written as "8GiB", "512MiB", "1.5GiB", "10GB", "4096B" or an integer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses the string form.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
        let (number, unit) = (&text[..split], text[split..].trim());
        let factor: u64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            "tib" => 1 << 40,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            _ => {
                return Err(format!(
                    "unknown size unit {unit:?} in {text:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"
                ));
            }
        };
        let bad = || format!("{text:?} is not a size such as \"8GiB\"");
        if number.is_empty() {
            return Err(bad());
        }
        if let Ok(whole) = number.parse::<u64>() {
            return whole
                .checked_mul(factor)
                .map(ByteSize)
                .ok_or_else(|| format!("{text:?} is too large"));
        }
        let value: f64 = number.parse().map_err(|_| bad())?;
        let bytes = value * factor as f64;
        if !bytes.is_finite() || bytes >= u64::MAX as f64 {
            return Err(format!("{text:?} is too large"));
        }
        if bytes.fract() != 0.0 {
            return Err(format!("{text:?} is not a whole number of bytes"));
        }
        Ok(ByteSize(bytes as u64))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SizeVisitor;
        impl Visitor<'_> for SizeVisitor {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as \"8GiB\" or a number of bytes")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v).map(ByteSize).map_err(|_| E::custom("a size cannot be negative"))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                ByteSize::parse(v).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(SizeVisitor)
    }
}

/// A duration written as "30s", "50ms", "1m".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HumanDuration(Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        humantime::parse_duration(&text).map(HumanDuration).map_err(|e| {
            de::Error::custom(format!("{text:?} is not a duration such as \"30s\": {e}"))
        })
    }
}

type Field<T> = Option<Spanned<T>>;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct RawConfig {
    server: RawServer,
    metrics: RawMetrics,
    l1: RawL1,
    l2: RawL2,
    disk: RawDisk,
    storage: RawStorage,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct RawServer {
    socket: Field<PathBuf>,
    tcp: Field<SocketAddr>,
    token: Field<String>,
    max_frame: Field<ByteSize>,
    max_connections: Field<usize>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct RawMetrics {
    enabled: Field<bool>,
    listen: Field<SocketAddr>,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum RawDevice {
    Auto,
    Emulated,
    Cuda,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum RawPolicy {
    Lru,
    S3fifo,
}

impl From<RawPolicy> for PolicyKind {
    fn from(p: RawPolicy) -> Self {
        match p {
            RawPolicy::Lru => PolicyKind::Lru,
            RawPolicy::S3fifo => PolicyKind::S3Fifo,
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct RawL1 {
    device: Field<RawDevice>,
    cuda_device: Field<usize>,
    capacity: Field<ByteSize>,
    slot: Field<ByteSize>,
    policy: Field<RawPolicy>,
    lease_ttl: Field<HumanDuration>,
    watermark_high: Field<f64>,
    watermark_low: Field<f64>,
    shards: Field<usize>,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum RawMemory {
    Auto,
    Plain,
    HugePages,
    Pinned,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct RawL2 {
    enabled: Field<bool>,
    capacity: Field<ByteSize>,
    memory: Field<RawMemory>,
    policy: Field<RawPolicy>,
    workers: Field<usize>,
    watermark_high: Field<f64>,
    watermark_low: Field<f64>,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum RawReadMode {
    Direct,
    Mmap,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct RawDisk {
    enabled: Field<bool>,
    dir: Field<PathBuf>,
    capacity: Field<ByteSize>,
    segment: Field<ByteSize>,
    fsync: Field<String>,
    io_threads: Field<usize>,
    read_mode: Field<RawReadMode>,
    policy: Field<RawPolicy>,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum RawStorePolicy {
    WriteThrough,
    WriteBack,
    DiskAdmission,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct RawStorage {
    store_policy: Field<RawStorePolicy>,
    disk_admission_min_reads: Field<u32>,
    maintenance_interval: Field<HumanDuration>,
    prefetch_max_in_flight: Field<usize>,
    prefetch_drain_timeout: Field<HumanDuration>,
}

/// Resolves fields to values and turns spans into lines for error messages.
struct Resolver<'a> {
    text: &'a str,
    origin: &'a str,
}

impl Resolver<'_> {
    fn get<T: Clone>(&self, field: &Field<T>, default: T) -> (T, Option<Range<usize>>) {
        match field {
            Some(s) => (s.get_ref().clone(), Some(s.span())),
            None => (default, None),
        }
    }

    fn line(&self, span: &Option<Range<usize>>) -> Option<usize> {
        span.as_ref().map(|s| self.text[..s.start.min(self.text.len())].matches('\n').count() + 1)
    }

    fn invalid(&self, key: &str, span: &Option<Range<usize>>, message: String) -> ConfigError {
        ConfigError::Invalid {
            origin: self.origin.to_string(),
            line: self.line(span),
            key: key.to_string(),
            message,
        }
    }

    fn check(
        &self,
        ok: bool,
        key: &str,
        span: &Option<Range<usize>>,
        message: impl FnOnce() -> String,
    ) -> Result<(), ConfigError> {
        if ok { Ok(()) } else { Err(self.invalid(key, span, message())) }
    }

    fn watermark(
        &self,
        section: &str,
        high: &Field<f64>,
        low: &Field<f64>,
    ) -> Result<Watermark, ConfigError> {
        let default = Watermark::default();
        let (high, high_at) = self.get(high, default.high);
        let (low, low_at) = self.get(low, default.low);
        self.check(
            high > 0.0 && high <= 1.0,
            &format!("{section}.watermark_high"),
            &high_at,
            || format!("must be within (0, 1], got {high}"),
        )?;
        self.check(low > 0.0 && low <= high, &format!("{section}.watermark_low"), &low_at, || {
            format!("must be within (0, watermark_high = {high}], got {low}")
        })?;
        Ok(Watermark { high, low })
    }
}

impl DaemonConfig {
    /// The embedded default.
    pub fn embedded_default() -> Result<Self, ConfigError> {
        Self::parse(DEFAULT_TOML, "the embedded default (config/default.toml)")
    }

    /// Reads and checks a file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and checks a configuration; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            origin: origin.to_string(),
            message: e.to_string().trim_end().to_string(),
        })?;
        let r = Resolver { text, origin };
        Ok(DaemonConfig {
            server: server(&r, &raw.server)?,
            metrics: metrics(&r, &raw.metrics),
            storage: storage(&r, &raw)?,
        })
    }
}

fn server(r: &Resolver<'_>, raw: &RawServer) -> Result<ServerConfig, ConfigError> {
    let (socket, _) = r.get(&raw.socket, PathBuf::from("/tmp/tierkv.sock"));
    let (tcp, tcp_at) =
        (raw.tcp.as_ref().map(|s| *s.get_ref()), raw.tcp.as_ref().map(|s| s.span()));
    let (token, token_at) =
        (raw.token.as_ref().map(|s| s.get_ref().clone()), raw.token.as_ref().map(|s| s.span()));
    r.check(tcp.is_none() || token.is_some(), "server.tcp", &tcp_at, || {
        "TCP needs server.token: a shared secret every TCP client presents".into()
    })?;
    r.check(token.as_ref().is_none_or(|t| t.len() >= 16), "server.token", &token_at, || {
        "must be at least 16 characters".into()
    })?;
    let (max_frame, frame_at) = r.get(&raw.max_frame, ByteSize(16 << 20));
    let min = u64::from(tierkv_proto::MIN_FRAME_LIMIT);
    r.check(
        max_frame.0 >= min && max_frame.0 <= u64::from(u32::MAX),
        "server.max_frame",
        &frame_at,
        || format!("must be within {min} bytes and 4GiB, got {}", max_frame.0),
    )?;
    let (max_connections, conn_at) = r.get(&raw.max_connections, 1024);
    r.check(max_connections > 0, "server.max_connections", &conn_at, || "must be positive".into())?;
    Ok(ServerConfig { socket, tcp, token, max_frame_bytes: max_frame.0 as u32, max_connections })
}

fn metrics(r: &Resolver<'_>, raw: &RawMetrics) -> MetricsConfig {
    let (enabled, _) = r.get(&raw.enabled, true);
    let default: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 9464));
    let (listen, _) = r.get(&raw.listen, default);
    MetricsConfig { listen: enabled.then_some(listen) }
}

fn policy(r: &Resolver<'_>, field: &Field<RawPolicy>) -> PolicyKind {
    r.get(field, RawPolicy::Lru).0.into()
}

fn storage(r: &Resolver<'_>, raw: &RawConfig) -> Result<StorageConfig, ConfigError> {
    // L1.
    let l1 = &raw.l1;
    let (slot, slot_at) = r.get(&l1.slot, ByteSize(2 << 20));
    r.check(slot.0 > 0, "l1.slot", &slot_at, || "must be positive".into())?;
    let (capacity, capacity_at) = r.get(&l1.capacity, ByteSize(1 << 30));
    r.check(capacity >= slot, "l1.capacity", &capacity_at, || {
        format!("{} bytes cannot hold one slot of {} bytes", capacity.0, slot.0)
    })?;
    let (device, _) = r.get(&l1.device, RawDevice::Auto);
    let (ordinal, ordinal_at) = r.get(&l1.cuda_device, 0);
    r.check(ordinal == 0 || device == RawDevice::Cuda, "l1.cuda_device", &ordinal_at, || {
        "only applies with device = \"cuda\"".into()
    })?;
    let (ttl, ttl_at) = r.get(&l1.lease_ttl, HumanDuration(Duration::from_secs(30)));
    r.check(!ttl.0.is_zero(), "l1.lease_ttl", &ttl_at, || "must be positive".into())?;
    let (shards, shards_at) = r.get(&l1.shards, 0);
    r.check(
        shards == 0 || (shards.is_power_of_two() && shards <= 1024),
        "l1.shards",
        &shards_at,
        || format!("must be 0 (automatic) or a power of two up to 1024, got {shards}"),
    )?;
    let l1_config = L1Config {
        capacity_bytes: capacity.0,
        slot_bytes: slot.0,
        device: match device {
            RawDevice::Auto => DeviceKind::Auto,
            RawDevice::Emulated => DeviceKind::Emulated,
            RawDevice::Cuda => DeviceKind::Cuda { ordinal },
        },
        policy: policy(r, &l1.policy),
        shards,
        lease_ttl: ttl.0,
        watermark: r.watermark("l1", &l1.watermark_high, &l1.watermark_low)?,
    };

    // L2.
    let l2 = &raw.l2;
    let (l2_on, _) = r.get(&l2.enabled, true);
    let (l2_capacity, l2_at) = r.get(&l2.capacity, ByteSize(4 << 30));
    let (workers, workers_at) = r.get(&l2.workers, 2);
    let l2_watermark = r.watermark("l2", &l2.watermark_high, &l2.watermark_low)?;
    let l2_config = if l2_on {
        r.check(l2_capacity >= slot, "l2.capacity", &l2_at, || {
            format!("{} bytes cannot hold one chunk of l1.slot = {} bytes", l2_capacity.0, slot.0)
        })?;
        r.check((1..=256).contains(&workers), "l2.workers", &workers_at, || {
            format!("must be within 1..=256, got {workers}")
        })?;
        Some(HostStoreConfig {
            capacity_bytes: l2_capacity.0,
            chunk_bytes: slot.0,
            policy: policy(r, &l2.policy),
            workers,
            memory: match r.get(&l2.memory, RawMemory::Auto).0 {
                RawMemory::Auto => HostMemory::Auto,
                RawMemory::Plain => HostMemory::Plain,
                RawMemory::HugePages => HostMemory::HugePages,
                RawMemory::Pinned => HostMemory::Pinned,
            },
        })
    } else {
        None
    };

    // Disk.
    let disk = &raw.disk;
    let (disk_on, _) = r.get(&disk.enabled, true);
    let disk_config = if disk_on {
        let (dir, _) = r.get(&disk.dir, PathBuf::from("tierkv-data"));
        let (segment, segment_at) = r.get(&disk.segment, ByteSize(256 << 20));
        let needed = BLOCK + record_bytes(slot.0);
        r.check(segment.0 % BLOCK == 0 && segment.0 >= needed, "disk.segment", &segment_at, || {
            format!(
                "must be a multiple of {BLOCK} bytes holding a record of one l1.slot chunk ({needed} bytes), got {}",
                segment.0
            )
        })?;
        let (disk_capacity, disk_at) = r.get(&disk.capacity, ByteSize(16 << 30));
        r.check(disk_capacity.0 / segment.0 >= 2, "disk.capacity", &disk_at, || {
            format!(
                "must hold at least two segments of {} bytes, got {}",
                segment.0, disk_capacity.0
            )
        })?;
        let (fsync, fsync_at) = r.get(&disk.fsync, "always".to_string());
        let fsync = match fsync.as_str() {
            "always" => FsyncPolicy::Always,
            "never" => FsyncPolicy::Never,
            other => match humantime::parse_duration(other) {
                Ok(every) if !every.is_zero() => FsyncPolicy::Periodic(every),
                _ => {
                    return Err(r.invalid(
                        "disk.fsync",
                        &fsync_at,
                        format!("must be \"always\", \"never\" or a positive interval such as \"1s\", got {other:?}"),
                    ));
                }
            },
        };
        let (io_threads, io_at) = r.get(&disk.io_threads, 4);
        r.check((1..=256).contains(&io_threads), "disk.io_threads", &io_at, || {
            format!("must be within 1..=256, got {io_threads}")
        })?;
        Some(DiskStoreConfig {
            dir,
            capacity_bytes: disk_capacity.0,
            segment_bytes: segment.0,
            max_chunk_bytes: slot.0,
            fsync,
            io_threads,
            read_mode: match r.get(&disk.read_mode, RawReadMode::Direct).0 {
                RawReadMode::Direct => ReadMode::Direct,
                RawReadMode::Mmap => ReadMode::Mmap,
            },
            policy: policy(r, &disk.policy),
        })
    } else {
        None
    };

    // Pipelines.
    let s = &raw.storage;
    let (min_reads, reads_at) = r.get(&s.disk_admission_min_reads, 2);
    r.check(min_reads > 0, "storage.disk_admission_min_reads", &reads_at, || {
        "must be positive".into()
    })?;
    let store_policy = match r.get(&s.store_policy, RawStorePolicy::WriteThrough).0 {
        RawStorePolicy::WriteThrough => StorePolicy::WriteThrough,
        RawStorePolicy::WriteBack => StorePolicy::WriteBack,
        RawStorePolicy::DiskAdmission => StorePolicy::DiskAdmission { min_reads },
    };
    let defaults = PrefetchConfig::default();
    let (interval, interval_at) =
        r.get(&s.maintenance_interval, HumanDuration(Duration::from_millis(50)));
    r.check(!interval.0.is_zero(), "storage.maintenance_interval", &interval_at, || {
        "must be positive".into()
    })?;
    let (in_flight, in_flight_at) = r.get(&s.prefetch_max_in_flight, defaults.max_in_flight);
    r.check(in_flight > 0, "storage.prefetch_max_in_flight", &in_flight_at, || {
        "must be positive".into()
    })?;
    let (drain, _) = r.get(&s.prefetch_drain_timeout, HumanDuration(defaults.drain_timeout));
    let mut config = StorageConfig::new(l1_config);
    config.l2 = l2_config;
    config.disk = disk_config;
    config.prefetch = PrefetchConfig { max_in_flight: in_flight, drain_timeout: drain.0 };
    config.store_policy = store_policy;
    config.l2_watermark = l2_watermark;
    config.maintenance_interval = interval.0;
    Ok(config)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn sizes_parse_in_binary_and_decimal_units() {
        let ok = |s: &str| ByteSize::parse(s).unwrap().0;
        assert_eq!(ok("8GiB"), 8 << 30);
        assert_eq!(ok("512MiB"), 512 << 20);
        assert_eq!(ok("1.5GiB"), 3 << 29);
        assert_eq!(ok("10GB"), 10_000_000_000);
        assert_eq!(ok("4096"), 4096);
        assert_eq!(ok("64 KiB"), 64 << 10);
        for bad in ["", "GiB", "8XB", "1.5B", "99999999999TiB", "-1GiB", "1.2.3MiB"] {
            assert!(ByteSize::parse(bad).is_err(), "{bad:?} must be refused");
        }
    }
}
