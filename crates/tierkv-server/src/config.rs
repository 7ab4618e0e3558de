//! The daemon's TOML configuration.
//!
//! Every key is optional: an empty file is the embedded default ([`DEFAULT_TOML`], which
//! documents every key; `docs/configuration.md` tables them). Unknown keys are refused, so a typo
//! cannot silently fall back to a default. Sizes are human strings ("8GiB", "1.5GiB", "10GB", see
//! [`ByteSize`]), durations humantime strings ("30s", "50ms"). Every refusal names the file, the
//! line and column, and the key, as `file:line:column: section.key: what is wrong`.
//!
//! The file maps onto the plain config structs of the tier crates. The checks those crates run
//! when a tier opens are repeated here, where the key and its line are still known; what only
//! opening can tell (is there a GPU, may memory be pinned, is the directory writable) is left to
//! the daemon.

mod raw;
mod size;

use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tierkv_disk::{BLOCK, DiskStoreConfig, record_bytes};
use tierkv_l1::{DeviceKind, L1Config, Watermark};
use tierkv_l2::HostStoreConfig;
use tierkv_prefetch::PrefetchConfig;
use tierkv_proto::MIN_FRAME_LIMIT;
use tierkv_storage::{StorageConfig, StorePolicy};
use toml::de::{DeTable, DeValue};

use raw::{Device, Raw, StoreMode};
pub use size::ByteSize;

/// The embedded default configuration, every key present and commented: what the daemon runs
/// with when given no file, and what `tierkv config default` prints as a starting point.
pub const DEFAULT_TOML: &str = include_str!("../../../config/default.toml");

/// The longest Unix socket path the kernel accepts (`sun_path` holds 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The text is not TOML.
    #[error("{origin}{}: {message}", located(*at))]
    Syntax {
        /// The file.
        origin: String,
        /// Where the parser stopped.
        at: Option<Position>,
        /// What the parser expected.
        message: String,
    },
    /// A key is unknown, its value has the wrong type or is out of range, or keys contradict
    /// each other.
    #[error("{origin}{}: {key}: {message}", located(*at))]
    Invalid {
        /// The file.
        origin: String,
        /// Where the key is written; `None` when it is not (it took its default).
        at: Option<Position>,
        /// The key, as `section.key`.
        key: String,
        /// What is wrong.
        message: String,
    },
}

/// A place in a configuration file, 1-based, as editors count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    /// The line.
    pub line: usize,
    /// The column, in characters.
    pub column: usize,
}

fn located(at: Option<Position>) -> String {
    at.map(|p| format!(":{}:{}", p.line, p.column)).unwrap_or_default()
}

/// What the daemon runs with.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// The listeners and their limits.
    pub server: ServerConfig,
    /// The Prometheus endpoint.
    pub metrics: MetricsConfig,
    /// The tiers and the pipelines between them.
    pub storage: StorageConfig,
}

/// Where and how the daemon listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    /// The Unix socket workers connect to (KV buffers' descriptors travel over it).
    pub socket: PathBuf,
    /// The TCP listener, off unless set; `token` is then set too.
    pub tcp: Option<SocketAddr>,
    /// The shared secret TCP clients present in their hello, at least 16 characters.
    pub token: Option<String>,
    /// The largest request frame accepted, at least [`MIN_FRAME_LIMIT`].
    pub max_frame_bytes: u32,
    /// Connections served at once.
    pub max_connections: usize,
    /// Bytes of leases one session's open lookups may hold; `None`: a quarter of `l1.capacity`.
    pub max_leased_per_session: Option<u64>,
}

/// Where `/metrics` is served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricsConfig {
    /// The HTTP listener; `None` when metrics are disabled.
    pub listen: Option<SocketAddr>,
}

impl DaemonConfig {
    /// The embedded default ([`DEFAULT_TOML`]).
    pub fn embedded_default() -> Result<Self, ConfigError> {
        Self::parse(DEFAULT_TOML, "config/default.toml (embedded)")
    }

    /// Reads and checks the file at `path`.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and checks `text`; `origin` (a file name) starts every error message.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let syntax = |e: toml::de::Error| ConfigError::Syntax {
            origin: origin.to_string(),
            at: e.span().map(|span| position(text, span.start)),
            message: e.message().trim_end().to_string(),
        };
        let doc = DeTable::parse(text).map_err(syntax)?;
        let file = File { origin, text, doc: doc.get_ref() };
        let raw = Raw::deserialize(toml::de::Deserializer::from(doc.clone()))
            .map_err(|e| file.refused(e))?;
        let server = server(&file, &raw.server)?;
        let storage = storage(&file, &raw)?;
        Ok(DaemonConfig {
            server,
            metrics: MetricsConfig { listen: raw.metrics.enabled.then_some(raw.metrics.listen) },
            storage,
        })
    }
}

/// The file being checked: its name, its text, and its keys with their spans.
struct File<'a> {
    origin: &'a str,
    text: &'a str,
    doc: &'a DeTable<'a>,
}

impl File<'_> {
    /// Refuses unless `ok`; see [`File::refuse`].
    fn ensure(
        &self,
        ok: bool,
        keys: &[&str],
        why: impl FnOnce() -> String,
    ) -> Result<(), ConfigError> {
        if ok { Ok(()) } else { Err(self.refuse(keys, why())) }
    }

    /// An error blaming the first of `keys` the file writes, at its line; the first key, with no
    /// position, when the file writes none of them (the value is a default).
    fn refuse(&self, keys: &[&str], message: String) -> ConfigError {
        let written = keys.iter().find_map(|&key| Some((key, self.span_of(key)?)));
        let (key, at) = match written {
            Some((key, span)) => (key, Some(position(self.text, span.start))),
            None => (keys.first().copied().unwrap_or_default(), None),
        };
        ConfigError::Invalid { origin: self.origin.to_string(), at, key: key.to_string(), message }
    }

    /// The span of `section.key` where the file writes it.
    fn span_of(&self, key: &str) -> Option<Range<usize>> {
        let (section, name) = key.split_once('.')?;
        let (_, table) = self.doc.iter().find(|(k, _)| k.get_ref() == section)?;
        let DeValue::Table(table) = table.get_ref() else { return None };
        let (key, _) = table.iter().find(|(k, _)| k.get_ref() == name)?;
        Some(key.span())
    }

    /// A deserialization error (unknown key, wrong type, malformed value), with the key it is in.
    fn refused(&self, e: toml::de::Error) -> ConfigError {
        let span = e.span();
        let key = span.as_ref().and_then(|span| key_at(self.doc, span.start));
        let at = span.map(|span| position(self.text, span.start));
        let origin = self.origin.to_string();
        let message = e.message().trim_end().to_string();
        match key {
            Some(key) => ConfigError::Invalid { origin, at, key, message },
            None => ConfigError::Syntax { origin, at, message },
        }
    }
}

/// The dotted path of the innermost key whose name or value covers byte `offset`.
fn key_at(table: &DeTable<'_>, offset: usize) -> Option<String> {
    table.iter().find_map(|(key, value)| {
        let inner = match value.get_ref() {
            DeValue::Table(table) => key_at(table, offset),
            _ => None,
        };
        let name = key.get_ref();
        inner.map(|inner| format!("{name}.{inner}")).or_else(|| {
            (key.span().contains(&offset) || value.span().contains(&offset))
                .then(|| name.to_string())
        })
    })
}

/// The line and column of byte `offset` of `text`.
fn position(text: &str, offset: usize) -> Position {
    let before = text.get(..offset).unwrap_or(text);
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    Position {
        line: before.matches('\n').count() + 1,
        column: before[line_start..].chars().count() + 1,
    }
}

fn server(file: &File<'_>, s: &raw::Server) -> Result<ServerConfig, ConfigError> {
    let socket_len = s.socket.as_os_str().len();
    file.ensure((1..=MAX_SOCKET_PATH).contains(&socket_len), &["server.socket"], || {
        format!("a Unix socket path takes 1 to {MAX_SOCKET_PATH} bytes, got {socket_len}")
    })?;
    file.ensure(s.tcp.is_none() || s.token.is_some(), &["server.tcp"], || {
        "TCP needs server.token, the shared secret every TCP client presents".into()
    })?;
    let token_len = s.token.as_deref().map_or(16, |t| t.chars().count());
    file.ensure(token_len >= 16, &["server.token"], || {
        format!("must be at least 16 characters, got {token_len}")
    })?;
    let Some(max_frame_bytes) = u32::try_from(s.max_frame.0).ok().filter(|&b| b >= MIN_FRAME_LIMIT)
    else {
        let why = format!(
            "must be at least {MIN_FRAME_LIMIT} bytes (4KiB) and below 4GiB, got {}",
            s.max_frame.0
        );
        return Err(file.refuse(&["server.max_frame"], why));
    };
    file.ensure(s.max_connections > 0, &["server.max_connections"], || "must be positive".into())?;
    file.ensure(
        s.max_leased_per_session.is_none_or(|b| b.0 > 0),
        &["server.max_leased_per_session"],
        || "must be positive".into(),
    )?;
    Ok(ServerConfig {
        socket: s.socket.clone(),
        tcp: s.tcp,
        token: s.token.clone(),
        max_frame_bytes,
        max_connections: s.max_connections,
        max_leased_per_session: s.max_leased_per_session.map(|b| b.0),
    })
}

/// Background eviction thresholds: `0 < low <= high <= 1`, as the tiers require.
fn watermark(
    file: &File<'_>,
    section: &str,
    high: f64,
    low: f64,
) -> Result<Watermark, ConfigError> {
    let (high_key, low_key) =
        (format!("{section}.watermark_high"), format!("{section}.watermark_low"));
    file.ensure(high > 0.0 && high <= 1.0, &[&high_key], || {
        format!("must be within (0, 1], got {high}")
    })?;
    file.ensure(low > 0.0 && low <= high, &[&low_key, &high_key], || {
        format!("{low_key} ({low}) must be positive and at most {high_key} ({high})")
    })?;
    Ok(Watermark { high, low })
}

/// Refuses a tier of more slots than the tiers' `u32` slot numbers count.
fn slot_count(file: &File<'_>, keys: &[&str], slots: u64) -> Result<(), ConfigError> {
    file.ensure(slots <= u64::from(u32::MAX), keys, || {
        format!("{slots} slots (capacity / slot) exceed the limit of {}", u32::MAX)
    })
}

fn l1(file: &File<'_>, s: &raw::L1) -> Result<L1Config, ConfigError> {
    let (capacity, slot) = (s.capacity.0, s.slot.0);
    file.ensure(slot > 0, &["l1.slot"], || "must be positive".into())?;
    file.ensure(capacity >= slot, &["l1.capacity", "l1.slot"], || {
        format!("l1.capacity ({capacity} bytes) cannot hold one l1.slot ({slot} bytes)")
    })?;
    slot_count(file, &["l1.capacity", "l1.slot"], capacity / slot)?;
    file.ensure(s.cuda_device == 0 || s.device == Device::Cuda, &["l1.cuda_device"], || {
        "applies only with device = \"cuda\"".into()
    })?;
    file.ensure(!s.lease_ttl.is_zero(), &["l1.lease_ttl"], || "must be positive".into())?;
    file.ensure(
        s.shards == 0 || (s.shards.is_power_of_two() && s.shards <= 1024),
        &["l1.shards"],
        || format!("must be 0 (automatic) or a power of two up to 1024, got {}", s.shards),
    )?;
    Ok(L1Config {
        capacity_bytes: capacity,
        slot_bytes: slot,
        device: match s.device {
            Device::Auto => DeviceKind::Auto,
            Device::Emulated => DeviceKind::Emulated,
            Device::Cuda => DeviceKind::Cuda { ordinal: s.cuda_device },
        },
        policy: s.policy,
        shards: s.shards,
        lease_ttl: s.lease_ttl,
        watermark: watermark(file, "l1", s.watermark_high, s.watermark_low)?,
    })
}

fn l2(file: &File<'_>, raw: &Raw) -> Result<Option<HostStoreConfig>, ConfigError> {
    let (s, slot) = (&raw.l2, raw.l1.slot.0);
    if !s.enabled {
        return Ok(None);
    }
    let capacity = s.capacity.0;
    file.ensure(capacity >= slot, &["l2.capacity", "l1.slot"], || {
        format!("l2.capacity ({capacity} bytes) cannot hold one chunk of l1.slot ({slot} bytes)")
    })?;
    slot_count(file, &["l2.capacity", "l1.slot"], capacity / slot)?;
    file.ensure((1..=256).contains(&s.workers), &["l2.workers"], || {
        format!("must be within 1..=256, got {}", s.workers)
    })?;
    Ok(Some(HostStoreConfig {
        capacity_bytes: capacity,
        chunk_bytes: slot,
        policy: s.policy,
        workers: s.workers,
        memory: s.memory,
    }))
}

fn disk(file: &File<'_>, raw: &Raw) -> Result<Option<DiskStoreConfig>, ConfigError> {
    let (s, slot) = (&raw.disk, raw.l1.slot.0);
    if !s.enabled {
        return Ok(None);
    }
    let (capacity, segment) = (s.capacity.0, s.segment.0);
    file.ensure(!s.dir.as_os_str().is_empty(), &["disk.dir"], || "must not be empty".into())?;
    file.ensure(segment > 0 && segment.is_multiple_of(BLOCK), &["disk.segment"], || {
        format!("must be a positive multiple of {BLOCK} bytes, got {segment}")
    })?;
    // A segment holds its header block and at least one record of a whole slot.
    let fits = slot <= segment.saturating_sub(2 * BLOCK) && BLOCK + record_bytes(slot) <= segment;
    file.ensure(fits, &["disk.segment", "l1.slot"], || {
        format!(
            "a disk.segment of {segment} bytes cannot hold a record of one l1.slot ({slot} bytes)"
        )
    })?;
    let segments = capacity / segment;
    file.ensure(segments >= 2, &["disk.capacity", "disk.segment"], || {
        format!(
            "disk.capacity ({capacity} bytes) must hold two disk.segment ({segment} bytes): one to write, one to evict"
        )
    })?;
    file.ensure(segments <= u64::from(u32::MAX), &["disk.capacity", "disk.segment"], || {
        format!("{segments} segments exceed the limit of {}", u32::MAX)
    })?;
    file.ensure((1..=256).contains(&s.io_threads), &["disk.io_threads"], || {
        format!("must be within 1..=256, got {}", s.io_threads)
    })?;
    Ok(Some(DiskStoreConfig {
        dir: s.dir.clone(),
        capacity_bytes: capacity,
        segment_bytes: segment,
        max_chunk_bytes: slot,
        fsync: s.fsync,
        io_threads: s.io_threads,
        read_mode: s.read_mode,
        policy: s.policy,
    }))
}

fn storage(file: &File<'_>, raw: &Raw) -> Result<StorageConfig, ConfigError> {
    let (l1, l2, disk) = (l1(file, &raw.l1)?, l2(file, raw)?, disk(file, raw)?);
    let l2_watermark = watermark(file, "l2", raw.l2.watermark_high, raw.l2.watermark_low)?;
    let s = &raw.storage;
    file.ensure(s.disk_admission_min_reads > 0, &["storage.disk_admission_min_reads"], || {
        "must be positive".into()
    })?;
    file.ensure(!s.maintenance_interval.is_zero(), &["storage.maintenance_interval"], || {
        "must be positive".into()
    })?;
    file.ensure(s.prefetch_max_in_flight > 0, &["storage.prefetch_max_in_flight"], || {
        "must be positive".into()
    })?;
    Ok(StorageConfig {
        l1,
        l2,
        disk,
        prefetch: PrefetchConfig {
            max_in_flight: s.prefetch_max_in_flight,
            drain_timeout: s.prefetch_drain_timeout,
        },
        store_policy: match s.store_policy {
            StoreMode::WriteThrough => StorePolicy::WriteThrough,
            StoreMode::WriteBack => StorePolicy::WriteBack,
            StoreMode::DiskAdmission => {
                StorePolicy::DiskAdmission { min_reads: s.disk_admission_min_reads }
            }
        },
        l2_watermark,
        maintenance_interval: s.maintenance_interval,
        store_backpressure: s.store_backpressure,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_count_lines_and_characters() {
        let text = "a\n\u{e9}t\u{e9} = 1\n";
        assert_eq!(position(text, 0), Position { line: 1, column: 1 });
        assert_eq!(position(text, 2), Position { line: 2, column: 1 });
        assert_eq!(position(text, 7), Position { line: 2, column: 4 }, "characters, not bytes");
        assert_eq!(position(text, text.len()), Position { line: 3, column: 1 });
    }
}
