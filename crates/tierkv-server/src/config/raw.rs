//! The file as written: one struct per section, each key defaulted, unknown keys refused.
//!
//! Only the form of each value is checked here (a size, a duration, a known name); the ranges
//! and the agreements between keys are checked in the parent module, which knows their lines.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer};
use tierkv_core::policy::PolicyKind;
use tierkv_disk::{FsyncPolicy, ReadMode};
use tierkv_l1::Watermark;
use tierkv_l2::HostMemory;
use tierkv_prefetch::PrefetchConfig;

use super::ByteSize;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub(super) struct Raw {
    pub server: Server,
    pub metrics: Metrics,
    pub l1: L1,
    pub l2: L2,
    pub disk: Disk,
    pub remote: Remote,
    pub storage: Storage,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct Server {
    pub socket: PathBuf,
    #[serde(deserialize_with = "some_address")]
    pub tcp: Option<SocketAddr>,
    pub token: Option<String>,
    pub max_frame: ByteSize,
    pub max_connections: usize,
    pub socket_group: Option<String>,
    pub max_leased_per_session: Option<ByteSize>,
    #[serde(deserialize_with = "duration")]
    pub hello_timeout: Duration,
}

impl Default for Server {
    fn default() -> Self {
        Server {
            socket: PathBuf::from("/tmp/tierkv.sock"),
            tcp: None,
            token: None,
            max_frame: ByteSize(16 << 20),
            max_connections: 1024,
            socket_group: None,
            max_leased_per_session: None,
            hello_timeout: Duration::from_secs(10),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct Metrics {
    pub enabled: bool,
    #[serde(deserialize_with = "address")]
    pub listen: SocketAddr,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics { enabled: true, listen: SocketAddr::from(([127, 0, 0, 1], 9464)) }
    }
}

/// `l1.device`; the ordinal of `cuda` is a key of its own.
#[derive(Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(super) enum Device {
    #[default]
    Auto,
    Emulated,
    Cuda,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct L1 {
    pub device: Device,
    pub cuda_device: usize,
    pub capacity: ByteSize,
    pub slot: ByteSize,
    #[serde(with = "PolicyName")]
    pub policy: PolicyKind,
    #[serde(deserialize_with = "duration")]
    pub lease_ttl: Duration,
    pub watermark_high: f64,
    pub watermark_low: f64,
    pub shards: usize,
    pub prefault: bool,
}

impl Default for L1 {
    fn default() -> Self {
        L1 {
            device: Device::Auto,
            cuda_device: 0,
            capacity: ByteSize(1 << 30),
            slot: ByteSize(2 << 20),
            policy: PolicyKind::default(),
            lease_ttl: Duration::from_secs(30),
            watermark_high: Watermark::default().high,
            watermark_low: Watermark::default().low,
            shards: 0,
            prefault: false,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct L2 {
    pub enabled: bool,
    pub capacity: ByteSize,
    #[serde(with = "MemoryName")]
    pub memory: HostMemory,
    #[serde(with = "PolicyName")]
    pub policy: PolicyKind,
    pub workers: usize,
    pub watermark_high: f64,
    pub watermark_low: f64,
    pub prefault: bool,
}

impl Default for L2 {
    fn default() -> Self {
        L2 {
            enabled: true,
            capacity: ByteSize(4 << 30),
            memory: HostMemory::Auto,
            policy: PolicyKind::default(),
            workers: 2,
            watermark_high: Watermark::default().high,
            watermark_low: Watermark::default().low,
            prefault: false,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct Disk {
    pub enabled: bool,
    pub dir: PathBuf,
    pub capacity: ByteSize,
    #[serde(deserialize_with = "segment_size")]
    pub segment: SegmentSize,
    #[serde(deserialize_with = "fsync")]
    pub fsync: FsyncPolicy,
    pub io_threads: usize,
    #[serde(with = "ReadModeName")]
    pub read_mode: ReadMode,
    #[serde(with = "PolicyName")]
    pub policy: PolicyKind,
    pub group: Option<String>,
}

impl Default for Disk {
    fn default() -> Self {
        Disk {
            enabled: true,
            dir: PathBuf::from("tierkv-data"),
            capacity: ByteSize(16 << 30),
            segment: SegmentSize::Auto,
            fsync: FsyncPolicy::Always,
            io_threads: 4,
            read_mode: ReadMode::Direct,
            policy: PolicyKind::default(),
            group: None,
        }
    }
}

/// `remote.mode`.
#[derive(Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(super) enum RemoteModeName {
    #[default]
    Cluster,
    Standalone,
}

/// `remote.admission`; the reads of `after_reads` are a key of their own.
#[derive(Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(super) enum RemoteAdmissionName {
    #[default]
    WriteThrough,
    AfterReads,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct Remote {
    pub enabled: bool,
    pub urls: Vec<String>,
    pub mode: RemoteModeName,
    pub key_prefix: String,
    #[serde(deserialize_with = "duration")]
    pub connect_timeout: Duration,
    #[serde(deserialize_with = "duration")]
    pub op_timeout: Duration,
    pub max_in_flight: usize,
    /// "0s": no expiry. Not bounded by a day: a value's life in the cluster may be long (the
    /// remote tier's own check bounds it at ten years).
    #[serde(deserialize_with = "any_duration")]
    pub ttl: Duration,
    pub admission: RemoteAdmissionName,
    pub admission_min_reads: u32,
    #[serde(deserialize_with = "duration")]
    pub reconnect_interval: Duration,
    pub threads: usize,
}

impl Default for Remote {
    fn default() -> Self {
        let d = tierkv_remote::RemoteConfig::new(
            vec!["redis://127.0.0.1:6379".into()],
            tierkv_remote::RemoteMode::Cluster,
            1,
        );
        Remote {
            enabled: false,
            urls: d.urls,
            mode: RemoteModeName::Cluster,
            key_prefix: d.key_prefix,
            connect_timeout: d.connect_timeout,
            op_timeout: d.op_timeout,
            max_in_flight: d.max_in_flight,
            ttl: d.ttl.unwrap_or_default(),
            admission: RemoteAdmissionName::WriteThrough,
            admission_min_reads: 1,
            reconnect_interval: d.reconnect_interval,
            threads: d.threads,
        }
    }
}

/// `storage.store_policy`; the reads of `disk_admission` are a key of their own.
#[derive(Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(super) enum StoreMode {
    WriteThrough,
    WriteBack,
    DiskAdmission,
    #[default]
    Cascade,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct Storage {
    pub store_policy: StoreMode,
    pub disk_admission_min_reads: u32,
    #[serde(deserialize_with = "duration")]
    pub maintenance_interval: Duration,
    #[serde(deserialize_with = "duration")]
    pub store_backpressure: Duration,
    pub prefetch_max_in_flight: usize,
    #[serde(deserialize_with = "duration")]
    pub prefetch_drain_timeout: Duration,
    #[serde(deserialize_with = "duration")]
    pub prefetch_timeout: Duration,
    #[serde(deserialize_with = "duration")]
    pub stop_drain_timeout: Duration,
    #[serde(deserialize_with = "duration")]
    pub store_timeout: Duration,
}

impl Default for Storage {
    fn default() -> Self {
        let prefetch = PrefetchConfig::default();
        Storage {
            store_policy: StoreMode::Cascade,
            disk_admission_min_reads: 2,
            maintenance_interval: Duration::from_millis(50),
            store_backpressure: Duration::from_secs(2),
            prefetch_max_in_flight: prefetch.max_in_flight,
            prefetch_drain_timeout: prefetch.drain_timeout,
            prefetch_timeout: prefetch.request_timeout,
            stop_drain_timeout: Duration::from_secs(20),
            store_timeout: Duration::from_secs(60),
        }
    }
}

// The tier crates' enums carry no serde; these mirror them (the compiler checks that every
// variant is listed) under the names the file uses.

#[derive(Deserialize)]
#[serde(remote = "PolicyKind", rename_all = "lowercase")]
enum PolicyName {
    Lru,
    S3Fifo,
    Adaptive,
}

#[derive(Deserialize)]
#[serde(remote = "HostMemory", rename_all = "snake_case")]
enum MemoryName {
    Auto,
    Plain,
    HugePages,
    Pinned,
}

#[derive(Deserialize)]
#[serde(remote = "ReadMode", rename_all = "lowercase")]
enum ReadModeName {
    Direct,
    Mmap,
}

/// The longest duration a setting takes: longer ones are mistakes (a timeout of a year would
/// hang a stop, one near `u64::MAX` seconds would overflow the clock it is added to).
const LONGEST: Duration = Duration::from_secs(24 * 60 * 60);

/// An IP address and a port, such as "127.0.0.1:9464" or "[::1]:9464". A host name is refused,
/// not resolved: what a listener binds is then what the file says, whatever the resolver answers.
fn address<'de, D: Deserializer<'de>>(deserializer: D) -> Result<SocketAddr, D::Error> {
    let text = String::deserialize(deserializer)?;
    text.parse().map_err(|_| {
        de::Error::custom(format!(
            "{text:?} is not an IP address and port such as \"127.0.0.1:9464\" or \"[::1]:9464\" \
             (a host name such as localhost is not resolved)"
        ))
    })
}

/// [`address`], for a key that is off unless written.
fn some_address<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<SocketAddr>, D::Error> {
    address(deserializer).map(Some)
}

/// A duration such as "30s", "50ms" or "1m", at most a day.
fn duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(deserializer)?;
    let parsed = humantime::parse_duration(&text).map_err(|e| {
        de::Error::custom(format!("{text:?} is not a duration such as \"30s\": {e}"))
    })?;
    at_most_a_day(&text, parsed)
}

/// A duration such as "7d" or "1h", of any length: for a setting whose own check bounds it.
fn any_duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(deserializer)?;
    humantime::parse_duration(&text)
        .map_err(|e| de::Error::custom(format!("{text:?} is not a duration such as \"1h\": {e}")))
}

fn at_most_a_day<E: de::Error>(text: &str, parsed: Duration) -> Result<Duration, E> {
    if parsed > LONGEST {
        return Err(E::custom(format!("{text:?} is longer than a day, the most a setting takes")));
    }
    Ok(parsed)
}

/// "always", "never", or the interval of periodic syncs such as "1s".
/// `disk.segment`: a size, or `"auto"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SegmentSize {
    /// One record of a slot ([`tierkv_disk::auto_segment_bytes`]): the disk frees one chunk at a
    /// time.
    Auto,
    Bytes(ByteSize),
}

fn segment_size<'de, D: Deserializer<'de>>(deserializer: D) -> Result<SegmentSize, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Given {
        Name(String),
        Size(ByteSize),
    }
    match Given::deserialize(deserializer)? {
        Given::Name(text) if text == "auto" => Ok(SegmentSize::Auto),
        Given::Name(text) => text.parse().map(SegmentSize::Bytes).map_err(|e| {
            de::Error::custom(format!("{text:?} is neither \"auto\" nor a size: {e}"))
        }),
        Given::Size(size) => Ok(SegmentSize::Bytes(size)),
    }
}

fn fsync<'de, D: Deserializer<'de>>(deserializer: D) -> Result<FsyncPolicy, D::Error> {
    let text = String::deserialize(deserializer)?;
    match text.as_str() {
        "always" => Ok(FsyncPolicy::Always),
        "never" => Ok(FsyncPolicy::Never),
        other => match humantime::parse_duration(other) {
            Ok(every) if !every.is_zero() => at_most_a_day(other, every).map(FsyncPolicy::Periodic),
            _ => Err(de::Error::custom(format!(
                "{other:?} is neither \"always\", \"never\" nor a positive interval such as \"1s\""
            ))),
        },
    }
}
