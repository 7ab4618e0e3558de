//! DiskStore configuration: plain data, validated when the store opens.

use std::path::PathBuf;
use std::time::Duration;

use tierkv_core::policy::PolicyKind;

use crate::error::DiskError;
use crate::format::{BLOCK, record_bytes};
use crate::segment::Layout;

/// When written records are forced to stable storage. `docs/disk-format.md` states what each
/// promises after a crash.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// Never: the OS writes back when it likes. Fastest; a crash may lose recent records.
    Never,
    /// A background thread syncs written segments at this interval.
    Periodic(Duration),
    /// Every store task is synced before it completes: a success is durable.
    #[default]
    Always,
}

/// How loads read records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReadMode {
    /// `pread` with `O_DIRECT` into aligned buffers (buffered `pread` where the filesystem
    /// refuses `O_DIRECT`): I/O errors come back as errors.
    #[default]
    Direct,
    /// Copy out of a read-only mapping of each segment. An I/O error under a mapping is a
    /// `SIGBUS`, not an error; see `docs/disk-format.md` for why `Direct` is the default.
    Mmap,
}

/// How a DiskStore is built.
#[derive(Clone, Debug, PartialEq)]
pub struct DiskStoreConfig {
    /// The directory of the segment files; created if missing.
    pub dir: PathBuf,
    /// Bytes of disk the store may use, rounded down to whole segments.
    pub capacity_bytes: u64,
    /// Bytes per segment (a multiple of 4 KiB); eviction frees a whole segment.
    pub segment_bytes: u64,
    /// The most bytes of one segment file: it holds as many whole segments as fit, at least
    /// one. Only this and `segment_bytes` decide where a segment lies, so a capacity changed
    /// later keeps the records of the segments it keeps.
    pub file_bytes: u64,
    /// The largest payload stored; larger chunks are refused.
    pub max_chunk_bytes: u64,
    /// When records are synced.
    pub fsync: FsyncPolicy,
    /// Worker threads: how many tasks run at once. Loads run in parallel; writes are appended
    /// one at a time.
    pub io_threads: usize,
    /// How loads read.
    pub read_mode: ReadMode,
    /// Which policy picks the segment to evict.
    pub policy: PolicyKind,
    /// The group that may read the cache: the directory is `0750` and its files `0640`, owned
    /// by this group. `None`: `0700` and `0600`, the daemon's user only. Cached KV is the
    /// content of prompts, so nobody else reads it by default.
    pub group: Option<u32>,
}

/// The segment [`DiskStoreConfig::new`] makes: a header block and one record of the largest
/// chunk, so the disk frees one chunk at a time and its policy orders chunks, not groups of them
/// (`docs/performance.md`, "The disk frees one chunk at a time").
pub fn auto_segment_bytes(max_chunk_bytes: u64) -> u64 {
    BLOCK.saturating_add(record_bytes(max_chunk_bytes))
}

/// The most bytes [`DiskStoreConfig::new`] puts in one segment file: whole segments, as many as
/// fit (at least one). Segments share files so that a disk of small segments is not as many open
/// files: a terabyte is 250 of them.
pub const FILE_BYTES: u64 = 4 << 30;

impl DiskStoreConfig {
    /// A store in `dir` of `capacity_bytes` in segments of [`auto_segment_bytes`] (one record
    /// each) in files of up to [`FILE_BYTES`], for chunks up to `max_chunk_bytes`; `Always`
    /// fsync, four I/O threads, direct reads, adaptive segment eviction.
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64, max_chunk_bytes: u64) -> Self {
        DiskStoreConfig {
            dir: dir.into(),
            capacity_bytes,
            segment_bytes: auto_segment_bytes(max_chunk_bytes),
            file_bytes: FILE_BYTES,
            max_chunk_bytes,
            fsync: FsyncPolicy::default(),
            io_threads: 4,
            read_mode: ReadMode::default(),
            policy: PolicyKind::default(),
            group: None,
        }
    }

    /// The mode of the directory: `0700`, or `0750` with a group.
    pub fn dir_mode(&self) -> u32 {
        if self.group.is_some() { 0o750 } else { 0o700 }
    }

    /// The mode of the files in the directory: `0600`, or `0640` with a group.
    pub fn file_mode(&self) -> u32 {
        if self.group.is_some() { 0o640 } else { 0o600 }
    }

    /// The segment files the store keeps open (0 for a configuration it refuses).
    pub fn files(&self) -> u64 {
        self.layout().map_or(0, |layout| u64::from(layout.files()))
    }

    /// Validates the configuration; returns where the segments lie.
    pub(crate) fn layout(&self) -> Result<Layout, DiskError> {
        let bad = |why: String| Err(DiskError::Config(why));
        if self.segment_bytes == 0 || !self.segment_bytes.is_multiple_of(BLOCK) {
            return bad(format!(
                "segment_bytes must be a positive multiple of {BLOCK}, got {}",
                self.segment_bytes
            ));
        }
        if self.max_chunk_bytes == 0 {
            return bad("max_chunk_bytes must be positive".into());
        }
        if BLOCK + record_bytes(self.max_chunk_bytes) > self.segment_bytes {
            return bad(format!(
                "a segment of {} bytes cannot hold a record of a {}-byte chunk (it needs {})",
                self.segment_bytes,
                self.max_chunk_bytes,
                BLOCK + record_bytes(self.max_chunk_bytes)
            ));
        }
        let segments = self.capacity_bytes / self.segment_bytes;
        if segments < 2 {
            return bad(format!(
                "capacity_bytes ({}) must hold at least two segments of {} bytes: one to write, one to evict",
                self.capacity_bytes, self.segment_bytes
            ));
        }
        if self.io_threads == 0 || self.io_threads > 256 {
            return bad(format!("io_threads must be within 1..=256, got {}", self.io_threads));
        }
        if let FsyncPolicy::Periodic(every) = self.fsync
            && every.is_zero()
        {
            return bad("a periodic fsync interval must be positive".into());
        }
        let Ok(segments) = u32::try_from(segments) else {
            return bad(format!("{segments} segments exceed the limit of {}", u32::MAX));
        };
        let per_file = (self.file_bytes / self.segment_bytes).clamp(1, u64::from(u32::MAX)) as u32;
        Ok(Layout { segment_bytes: self.segment_bytes, segments, per_file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_problem() {
        let ok = DiskStoreConfig {
            segment_bytes: 1 << 20,
            ..DiskStoreConfig::new("/tmp/x", 8 << 20, 64 << 10)
        };
        let layout = ok.layout().unwrap();
        assert_eq!((layout.segments, layout.per_file, layout.files()), (8, 4096, 1));
        let small_files = DiskStoreConfig { file_bytes: 3 << 20, ..ok.clone() };
        assert_eq!(small_files.layout().unwrap().files(), 3);
        assert_eq!(small_files.files(), 3);
        let tiny_files = DiskStoreConfig { file_bytes: 1, ..ok.clone() };
        assert_eq!(tiny_files.layout().unwrap().per_file, 1);
        let err = |c: DiskStoreConfig| c.layout().unwrap_err().to_string();
        assert!(
            err(DiskStoreConfig { segment_bytes: 1000, ..ok.clone() }).contains("multiple of 4096")
        );
        assert!(
            err(DiskStoreConfig { max_chunk_bytes: 1 << 20, ..ok.clone() }).contains("cannot hold")
        );
        assert!(
            err(DiskStoreConfig { capacity_bytes: 1 << 20, ..ok.clone() }).contains("two segments")
        );
        assert!(err(DiskStoreConfig { io_threads: 0, ..ok.clone() }).contains("io_threads"));
        assert!(
            err(DiskStoreConfig { fsync: FsyncPolicy::Periodic(Duration::ZERO), ..ok })
                .contains("periodic")
        );
    }
}
