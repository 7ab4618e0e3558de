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

use std::cell::RefCell;
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use tierkv_disk::{BLOCK, DiskStoreConfig, FILE_BYTES, auto_segment_bytes, record_bytes};
use tierkv_l1::{DeviceKind, L1Config, Watermark};
use tierkv_l2::HostStoreConfig;
use tierkv_prefetch::PrefetchConfig;
use tierkv_proto::MIN_FRAME_LIMIT;
use tierkv_remote::{RemoteConfig, RemoteMode};
use tierkv_storage::{RemoteAdmission, StorageConfig, StorePolicy};
use toml::de::{DeTable, DeValue};

use raw::{Device, Raw, RemoteAdmissionName, RemoteModeName, SegmentSize, StoreMode};
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
    /// Several errors, in the file's order: every unknown key, every value that cannot be
    /// read, every value out of range (`tierkv config check` lists them all).
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n"))]
    Many(Vec<ConfigError>),
}

impl ConfigError {
    /// Where the error is, when the file writes it.
    pub fn position(&self) -> Option<Position> {
        match self {
            ConfigError::Syntax { at, .. } | ConfigError::Invalid { at, .. } => *at,
            ConfigError::Read { .. } | ConfigError::Many(_) => None,
        }
    }

    /// The errors this one stands for: itself, or each of `Many`.
    pub fn all(&self) -> Vec<&ConfigError> {
        match self {
            ConfigError::Many(errors) => errors.iter().collect(),
            other => vec![other],
        }
    }

    /// One error, or `Many` sorted by line (errors without a line last).
    fn from_all(mut errors: Vec<ConfigError>) -> ConfigError {
        errors.sort_by_key(|e| e.position().map_or((usize::MAX, 0), |p| (p.line, p.column)));
        if errors.len() == 1 { errors.remove(0) } else { ConfigError::Many(errors) }
    }
}

/// A check that later checks cannot do without (a divisor that is zero): its error is already
/// recorded, and the section stops there.
struct Stop;

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
    /// Connections served at once (the daemon lowers it at start to what its descriptor limit
    /// allows).
    pub max_connections: usize,
    /// The group that may connect to the socket: the socket is `0660` and owned by this group;
    /// `None`: `0600`, the daemon's user only.
    pub socket_group: Option<u32>,
    /// Bytes of leases one session's open lookups may hold; `None`: a quarter of `l1.capacity`.
    pub max_leased_per_session: Option<u64>,
    /// How long a connection may take to say hello; it is closed past that.
    pub hello_timeout: Duration,
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
        Self::parse(DEFAULT_TOML, EMBEDDED)
    }

    /// Reads and checks the file at `path`, as [`DaemonConfig::parse`] does.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        Self::parse(&read_text(path)?, &path.display().to_string())
    }

    /// Parses and checks `text` as the daemon reads it: every section, and whether the user of
    /// this process may give its files the groups `server.socket_group` and `disk.group` name
    /// (the daemon must, to hand its socket and disk files to them; checked for anyone else, the
    /// verdict is about the wrong user). `origin` (a file name) starts every error message.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        read(text, origin, Reader::Daemon, |file, raw| {
            let server = server(file, &raw.server);
            let storage = storage(file, raw);
            let metrics = metrics(file, raw);
            Ok(DaemonConfig { server: server?, metrics: metrics?, storage: storage? })
        })
    }
}

impl ServerConfig {
    /// The `[server]` section of the embedded default ([`DEFAULT_TOML`]).
    pub fn embedded_default() -> Result<Self, ConfigError> {
        Self::parse(DEFAULT_TOML, EMBEDDED)
    }

    /// Reads the `[server]` section of the file at `path`, as [`ServerConfig::parse`] does.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        Self::parse(&read_text(path)?, &path.display().to_string())
    }

    /// Parses and checks the `[server]` section of `text` alone, as a command that talks to the
    /// daemon reads it (as an admin reader): `tierkv status` needs the socket, `tierkv clear` the
    /// token too. The other sections are not read, so an operator's command is not refused over
    /// a tier's setting, nor over the daemon's user's groups.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        read(text, origin, Reader::Admin, |file, raw| server(file, &raw.server))
    }
}

/// How errors in [`DEFAULT_TOML`] name it.
const EMBEDDED: &str = "config/default.toml (embedded)";

/// The text of the file at `path`.
fn read_text(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path)
        .map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })
}

/// Who reads a configuration, which decides what is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reader {
    /// `tierkv serve` and `tierkv config check`: every section, and whether this process's user
    /// may give its files the groups `server.socket_group` and `disk.group` name (the daemon
    /// must, to hand its socket and disk files to them). Run as another user than the daemon's,
    /// that check is about the wrong user.
    Daemon,
    /// A command that talks to a running daemon: the `[server]` section only, and no check of
    /// who runs it (its user is not the daemon's).
    Admin,
}

/// Parses `text` for `reader` and makes the configuration with `make`, which records every
/// error in the [`File`]; one error or [`ConfigError::Many`] when any was recorded.
fn read<T>(
    text: &str,
    origin: &str,
    reader: Reader,
    make: impl FnOnce(&File<'_>, &Raw) -> Result<T, Stop>,
) -> Result<T, ConfigError> {
    let syntax = |e: toml::de::Error| ConfigError::Syntax {
        origin: origin.to_string(),
        at: e.span().map(|span| position(text, span.start)),
        message: e.message().trim_end().to_string(),
    };
    let mut doc = DeTable::parse(text).map_err(syntax)?;
    if reader == Reader::Admin {
        let others: Vec<String> = doc.get_ref().keys().map(|k| k.get_ref().to_string()).collect();
        for section in others.iter().filter(|s| *s != "server") {
            remove_key(doc.get_mut(), section);
        }
    }
    let file = File {
        origin,
        text,
        doc: doc.get_ref(),
        reader,
        errors: RefCell::new(Vec::new()),
        unreadable: RefCell::new(Vec::new()),
    };
    // serde stops at the first unknown key or unreadable value: note it, drop the key (it
    // takes its default) and read again, until the rest reads.
    let mut readable = doc.clone();
    let raw = loop {
        match Raw::deserialize(toml::de::Deserializer::from(readable.clone())) {
            Ok(raw) => break raw,
            Err(e) => {
                let error = file.refused(e);
                let key = match &error {
                    ConfigError::Invalid { key, .. } => Some(key.clone()),
                    _ => None,
                };
                file.errors.borrow_mut().push(error);
                match key {
                    Some(key) if remove_key(readable.get_mut(), &key) => {
                        file.unreadable.borrow_mut().push(key);
                    }
                    _ => return Err(ConfigError::from_all(file.errors.take())),
                }
            }
        }
    };
    let made = make(&file, &raw);
    let errors = file.errors.take();
    match made {
        Ok(config) if errors.is_empty() => Ok(config),
        _ => Err(ConfigError::from_all(errors)),
    }
}

/// Removes the key at the dotted `path` from `table`; whether it was there.
fn remove_key(table: &mut DeTable<'_>, path: &str) -> bool {
    match path.split_once('.') {
        None => {
            let key = table.keys().find(|key| key.get_ref() == path).cloned();
            key.is_some_and(|key| table.remove(&key).is_some())
        }
        Some((first, rest)) => table.iter_mut().any(|(key, value)| {
            if key.get_ref() != first {
                return false;
            }
            match value.get_mut() {
                DeValue::Table(inner) => remove_key(inner, rest),
                _ => false,
            }
        }),
    }
}

/// The file being checked: its name, its text, its keys with their spans, and every error
/// found so far.
struct File<'a> {
    origin: &'a str,
    text: &'a str,
    doc: &'a DeTable<'a>,
    /// Who reads it.
    reader: Reader,
    errors: RefCell<Vec<ConfigError>>,
    /// Keys whose values could not be read: they took their defaults, and checks that involve
    /// them are skipped (their verdict would be about a value the file does not hold).
    unreadable: RefCell<Vec<String>>,
}

impl File<'_> {
    /// Records an error unless `ok` (see [`File::refuse`]); checking goes on.
    fn ensure(&self, ok: bool, keys: &[&str], why: impl FnOnce() -> String) -> Result<(), Stop> {
        if !ok && !self.involves_unreadable(keys) {
            self.errors.borrow_mut().push(self.refuse(keys, why()));
        }
        Ok(())
    }

    /// Like [`File::ensure`], but the section stops at a failure: later checks depend on it.
    fn require(&self, ok: bool, keys: &[&str], why: impl FnOnce() -> String) -> Result<(), Stop> {
        if ok {
            return Ok(());
        }
        self.ensure(false, keys, why)?;
        Err(Stop)
    }

    fn involves_unreadable(&self, keys: &[&str]) -> bool {
        let unreadable = self.unreadable.borrow();
        keys.iter().any(|key| unreadable.iter().any(|u| u == key))
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

fn server(file: &File<'_>, s: &raw::Server) -> Result<ServerConfig, Stop> {
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
    let max_frame_bytes = u32::try_from(s.max_frame.0).ok().filter(|&b| b >= MIN_FRAME_LIMIT);
    file.ensure(max_frame_bytes.is_some(), &["server.max_frame"], || {
        format!(
            "must be at least {MIN_FRAME_LIMIT} bytes (4KiB) and below 4GiB, got {}",
            s.max_frame.0
        )
    })?;
    let max_frame_bytes = max_frame_bytes.unwrap_or(MIN_FRAME_LIMIT);
    file.ensure(s.max_connections > 0, &["server.max_connections"], || "must be positive".into())?;
    file.ensure(!s.hello_timeout.is_zero(), &["server.hello_timeout"], || {
        "must be positive".into()
    })?;
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
        socket_group: group(file, "server.socket_group", s.socket_group.as_deref())?,
        max_leased_per_session: s.max_leased_per_session.map(|b| b.0),
        hello_timeout: s.hello_timeout,
    })
}

/// The metrics endpoint; refused on an address `server.tcp` takes too, where one of the two
/// listeners would fail to bind when the daemon starts.
fn metrics(file: &File<'_>, raw: &Raw) -> Result<MetricsConfig, Stop> {
    let listen = raw.metrics.enabled.then_some(raw.metrics.listen);
    if let (Some(tcp), Some(listen)) = (raw.server.tcp, listen) {
        file.ensure(!overlap(tcp, listen), &["server.tcp", "metrics.listen"], || {
            format!(
                "server.tcp ({tcp}) and metrics.listen ({listen}) take the same port on the \
                 same address: give each a port of its own"
            )
        })?;
    }
    Ok(MetricsConfig { listen })
}

/// Whether TCP listeners on `a` and `b` cannot both bind: the same port (not 0, which the
/// system picks) on the same address, or on an address the other's wildcard covers (`0.0.0.0`
/// covers IPv4; `::` IPv6 and, dual-stack as Linux has it by default, IPv4 too).
fn overlap(a: SocketAddr, b: SocketAddr) -> bool {
    let covers =
        |wide: IpAddr, other: IpAddr| wide.is_unspecified() && (wide.is_ipv6() || other.is_ipv4());
    a.port() != 0
        && a.port() == b.port()
        && (a.ip() == b.ip() || covers(a.ip(), b.ip()) || covers(b.ip(), a.ip()))
}

/// Background eviction thresholds: `0 < low <= high <= 1`, as the tiers require.
fn watermark(file: &File<'_>, section: &str, high: f64, low: f64) -> Result<Watermark, Stop> {
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
fn slot_count(file: &File<'_>, keys: &[&str], slots: u64) -> Result<(), Stop> {
    file.ensure(slots <= u64::from(u32::MAX), keys, || {
        format!("{slots} slots (capacity / slot) exceed the limit of {}", u32::MAX)
    })
}

/// The smallest `l1.slot`: a page. Chunks may still be smaller (a worker's `chunk_bytes` is at
/// most a slot).
const MIN_SLOT_BYTES: u64 = 4096;

fn l1(file: &File<'_>, s: &raw::L1) -> Result<L1Config, Stop> {
    let (capacity, slot) = (s.capacity.0, s.slot.0);
    file.require(slot > 0, &["l1.slot"], || "must be positive".into())?;
    // Each slot of every tier costs index and bookkeeping memory of its own: slots of a few
    // bytes would make a tier of ordinary capacity billions of them (tens of GB of state).
    file.require(slot >= MIN_SLOT_BYTES, &["l1.slot"], || {
        format!("must be at least {MIN_SLOT_BYTES} bytes (4KiB), got {slot}")
    })?;
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
        prefault: s.prefault,
    })
}

fn l2(file: &File<'_>, raw: &Raw) -> Result<Option<HostStoreConfig>, Stop> {
    let (s, slot) = (&raw.l2, raw.l1.slot.0);
    if !s.enabled || slot == 0 {
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
        prefault: s.prefault,
    }))
}

fn disk(file: &File<'_>, raw: &Raw) -> Result<Option<DiskStoreConfig>, Stop> {
    let (s, slot) = (&raw.disk, raw.l1.slot.0);
    if !s.enabled || slot == 0 {
        return Ok(None);
    }
    let capacity = s.capacity.0;
    let segment = match s.segment {
        SegmentSize::Auto => auto_segment_bytes(slot),
        SegmentSize::Bytes(size) => size.0,
    };
    file.ensure(!s.dir.as_os_str().is_empty(), &["disk.dir"], || "must not be empty".into())?;
    file.require(segment > 0 && segment.is_multiple_of(BLOCK), &["disk.segment"], || {
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
        file_bytes: FILE_BYTES,
        max_chunk_bytes: slot,
        fsync: s.fsync,
        io_threads: s.io_threads,
        read_mode: s.read_mode,
        policy: s.policy,
        group: group(file, "disk.group", s.group.as_deref())?,
    }))
}

/// A group given by name or number, as its id; refused when the system knows no such group, or,
/// read as the daemon's ([`Reader::Daemon`]), when this process may not give its files that
/// group (it is not root and not a member): the daemon would fail to hand its socket or its disk
/// files to the group.
fn group(file: &File<'_>, key: &str, name: Option<&str>) -> Result<Option<u32>, Stop> {
    let Some(name) = name else { return Ok(None) };
    let gid = name.parse::<u32>().ok().or_else(|| group_id(name));
    file.ensure(gid.is_some(), &[key], || format!("no group named {name:?} on this system"))?;
    let Some(gid) = gid else { return Ok(None) };
    if file.reader == Reader::Daemon {
        let who = Credentials::of_process();
        file.ensure(may_give_group(gid, &who), &[key], || {
            format!(
                "this user (uid {}) is not a member of group {name:?}, so it cannot give its \
                 files that group: add the daemon's user to the group, or run it as root (the \
                 check is for the user who reads the file: run `tierkv config check` as the \
                 daemon's user)",
                who.euid
            )
        })?;
    }
    Ok(Some(gid))
}

/// Who a process is, as far as giving files a group goes.
struct Credentials {
    euid: u32,
    egid: u32,
    groups: Vec<u32>,
}

impl Credentials {
    fn of_process() -> Self {
        // SAFETY: plain calls without pointers, and getgroups writes at most `n` ids into a
        // buffer of `n` (a count that changed in between is an error, taken as no groups).
        unsafe {
            let n = libc::getgroups(0, std::ptr::null_mut()).max(0);
            let mut groups = vec![0 as libc::gid_t; n as usize];
            let got = libc::getgroups(n, groups.as_mut_ptr());
            groups.truncate(usize::try_from(got).unwrap_or(0));
            Credentials { euid: libc::geteuid(), egid: libc::getegid(), groups }
        }
    }
}

/// Whether a process of `who` may chown its files to `gid`: root may, others only to a group
/// of theirs.
fn may_give_group(gid: u32, who: &Credentials) -> bool {
    who.euid == 0 || who.egid == gid || who.groups.contains(&gid)
}

/// The id of the group `name`, from the system's group database.
fn group_id(name: &str) -> Option<u32> {
    let name = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0 as libc::c_char; 16 << 10];
    // SAFETY: `group` is plain data that getgrnam_r fills in; `buf` outlives the call and its
    // length is passed; `found` is set to null or to `&group`.
    unsafe {
        let mut group: libc::group = std::mem::zeroed();
        let mut found: *mut libc::group = std::ptr::null_mut();
        let rc =
            libc::getgrnam_r(name.as_ptr(), &mut group, buf.as_mut_ptr(), buf.len(), &mut found);
        (rc == 0 && !found.is_null()).then_some(group.gr_gid)
    }
}

fn remote(file: &File<'_>, raw: &Raw) -> Result<Option<RemoteConfig>, Stop> {
    let (s, slot) = (&raw.remote, raw.l1.slot.0);
    file.ensure(s.admission_min_reads > 0, &["remote.admission_min_reads"], || {
        "must be positive".into()
    })?;
    if !s.enabled || slot == 0 {
        return Ok(None);
    }
    let config = RemoteConfig {
        urls: s.urls.clone(),
        mode: match s.mode {
            RemoteModeName::Cluster => RemoteMode::Cluster,
            RemoteModeName::Standalone => RemoteMode::Standalone,
        },
        key_prefix: s.key_prefix.clone(),
        connect_timeout: s.connect_timeout,
        op_timeout: s.op_timeout,
        max_in_flight: s.max_in_flight,
        ttl: (!s.ttl.is_zero()).then_some(s.ttl),
        max_chunk_bytes: slot,
        reconnect_interval: s.reconnect_interval,
        threads: s.threads,
    };
    // The adapter's own checks, blamed on the key they are about.
    if let Err(e) = config.validate() {
        let message = e.to_string();
        let key = match &e {
            tierkv_remote::RemoteError::Config { key: "max_chunk_bytes", .. } => "l1.slot".into(),
            tierkv_remote::RemoteError::Config { key, .. } => format!("remote.{key}"),
            _ => "remote.urls".to_string(),
        };
        file.ensure(false, &[&key], || message)?;
        return Ok(None);
    }
    Ok(Some(config))
}

fn storage(file: &File<'_>, raw: &Raw) -> Result<StorageConfig, Stop> {
    // Each tier is checked whatever the others' verdict.
    let (l1, l2, disk) = (l1(file, &raw.l1), l2(file, raw), disk(file, raw));
    let remote = remote(file, raw);
    let l2_watermark = watermark(file, "l2", raw.l2.watermark_high, raw.l2.watermark_low)?;
    let s = &raw.storage;
    file.ensure(s.disk_admission_min_reads > 0, &["storage.disk_admission_min_reads"], || {
        "must be positive".into()
    })?;
    file.ensure(!s.maintenance_interval.is_zero(), &["storage.maintenance_interval"], || {
        "must be positive".into()
    })?;
    // The tick is what revokes leases past their deadline: a longer one lets them pin L1 that
    // long (stores refused for room) and `l1.lease_ttl` would not hold.
    file.ensure(
        s.maintenance_interval <= raw.l1.lease_ttl,
        &["storage.maintenance_interval"],
        || format!("must be at most l1.lease_ttl ({:?}), which it enforces", raw.l1.lease_ttl),
    )?;
    file.ensure(s.prefetch_max_in_flight > 0, &["storage.prefetch_max_in_flight"], || {
        "must be positive".into()
    })?;
    file.ensure(!s.prefetch_timeout.is_zero(), &["storage.prefetch_timeout"], || {
        "must be positive".into()
    })?;
    file.ensure(!s.store_timeout.is_zero(), &["storage.store_timeout"], || {
        "must be positive".into()
    })?;
    Ok(StorageConfig {
        l1: l1?,
        l2: l2?,
        disk: disk?,
        remote: remote?,
        remote_admission: match raw.remote.admission {
            RemoteAdmissionName::WriteThrough => RemoteAdmission::WriteThrough,
            RemoteAdmissionName::AfterReads => {
                RemoteAdmission::AfterReads { min_reads: raw.remote.admission_min_reads }
            }
        },
        prefetch: PrefetchConfig {
            max_in_flight: s.prefetch_max_in_flight,
            drain_timeout: s.prefetch_drain_timeout,
            request_timeout: s.prefetch_timeout,
        },
        store_policy: match s.store_policy {
            StoreMode::WriteThrough => StorePolicy::WriteThrough,
            StoreMode::WriteBack => StorePolicy::WriteBack,
            StoreMode::Cascade => StorePolicy::Cascade,
            StoreMode::DiskAdmission => {
                StorePolicy::DiskAdmission { min_reads: s.disk_admission_min_reads }
            }
        },
        l2_watermark,
        maintenance_interval: s.maintenance_interval,
        store_backpressure: s.store_backpressure,
        stop_drain_timeout: s.stop_drain_timeout,
        store_timeout: s.store_timeout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A user who may not give its files a group would run with its disk tier storing nothing
    /// (every segment file refused) and its socket unusable: `disk.group` and
    /// `server.socket_group` must be groups of its own, unless it is root.
    #[test]
    fn a_group_is_taken_only_if_the_user_may_give_it() {
        let user = |euid, egid, groups: &[u32]| Credentials { euid, egid, groups: groups.to_vec() };
        assert!(may_give_group(4, &user(0, 0, &[])), "root gives any group");
        assert!(may_give_group(4, &user(1000, 4, &[])), "its own primary group");
        assert!(may_give_group(4, &user(1000, 1000, &[27, 4])), "a supplementary group");
        assert!(!may_give_group(4, &user(1000, 1000, &[27])), "not a member");
        assert!(!may_give_group(4, &user(65534, 65534, &[])), "nobody");
    }

    #[test]
    fn positions_count_lines_and_characters() {
        let text = "a\n\u{e9}t\u{e9} = 1\n";
        assert_eq!(position(text, 0), Position { line: 1, column: 1 });
        assert_eq!(position(text, 2), Position { line: 2, column: 1 });
        assert_eq!(position(text, 7), Position { line: 2, column: 4 }, "characters, not bytes");
        assert_eq!(position(text, text.len()), Position { line: 3, column: 1 });
    }
}
