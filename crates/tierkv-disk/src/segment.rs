//! Segment files: creation, positional aligned I/O, and optional read-only mappings.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use memmap2::{Advice, Mmap};
use tierkv_core::AlignedBuf;

use crate::format::BLOCK;

/// The file name of segment `id`.
pub(crate) fn segment_path(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("seg-{id:08}.tkv"))
}

/// The segment id a file name stands for, if it is a segment file.
pub(crate) fn segment_id(name: &str) -> Option<u32> {
    name.strip_prefix("seg-")?.strip_suffix(".tkv")?.parse().ok()
}

/// How the store does file I/O, decided once at open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// `O_DIRECT`: the page cache is bypassed.
    Direct,
    /// Ordinary buffered I/O, where the filesystem refuses `O_DIRECT` (tmpfs, some overlays).
    Buffered,
}

/// One open segment file.
pub(crate) struct SegmentFile {
    pub(crate) path: PathBuf,
    file: File,
    map: OnceLock<io::Result<Mmap>>,
}

fn options(write: bool, create: bool, mode: IoMode) -> OpenOptions {
    let mut options = OpenOptions::new();
    options.read(true).write(write).create(create);
    if mode == IoMode::Direct {
        options.custom_flags(libc::O_DIRECT);
    }
    options
}

impl SegmentFile {
    /// Opens an existing segment.
    pub(crate) fn open(path: PathBuf, writable: bool, mode: IoMode) -> io::Result<Self> {
        let file = options(writable, false, mode).open(&path)?;
        Ok(SegmentFile { path, file, map: OnceLock::new() })
    }

    /// Opens (creating if needed) a segment and makes sure `bytes` of disk are allocated to it,
    /// so a full disk is found here, before any record is written, and not in the middle of one.
    pub(crate) fn create(path: PathBuf, bytes: u64, mode: IoMode) -> io::Result<Self> {
        let file = options(true, true, mode).open(&path)?;
        let len = libc::off_t::try_from(bytes)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: fallocate on a file descriptor we own, with a valid length.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
        if rc != 0 {
            let error = io::Error::last_os_error();
            // Filesystems without fallocate: extend the file instead (space is then found at
            // write time; such a filesystem gives weaker full-disk behaviour, documented).
            if error.raw_os_error() != Some(libc::EOPNOTSUPP) {
                // Give back whatever part was allocated: a full disk should not stay fuller.
                drop(file);
                let _ = std::fs::remove_file(&path);
                return Err(error);
            }
            file.set_len(bytes)?;
        }
        Ok(SegmentFile { path, file, map: OnceLock::new() })
    }

    /// Writes all of `buf` at `offset` (both block-aligned for direct I/O).
    pub(crate) fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }

    /// Reads exactly `buf.len()` bytes at `offset`; a short file is `UnexpectedEof`.
    pub(crate) fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    /// The file's current length.
    pub(crate) fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    /// Forces written data to stable storage.
    pub(crate) fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// A read-only mapping of the whole file, made on first use.
    pub(crate) fn mapping(&self) -> io::Result<&Mmap> {
        let map = self.map.get_or_init(|| {
            // SAFETY: the mapping is only read; records are read only while their segment is
            // pinned, so the store never rewrites a mapped range while it is being read. A
            // truncation or I/O error by another party turns into SIGBUS, which is why this read
            // mode is not the default.
            let map = unsafe { Mmap::map(&self.file) }?;
            let _ = map.advise(Advice::Sequential);
            Ok(map)
        });
        map.as_ref().map_err(|e| io::Error::new(e.kind(), e.to_string()))
    }
}

/// Syncs a directory, so files created in it survive a crash.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Decides the I/O mode for `dir` by writing a probe file with `O_DIRECT`. Returns `Err` when the
/// directory cannot be written at all.
pub(crate) fn probe(dir: &Path) -> io::Result<IoMode> {
    let path = dir.join(format!(".tierkv-probe-{}", std::process::id()));
    let attempt = |mode: IoMode| -> io::Result<()> {
        let file = options(true, true, mode).open(&path)?;
        let block =
            AlignedBuf::new(BLOCK as usize).ok_or_else(|| io::Error::other("cannot allocate"))?;
        file.write_all_at(block.as_slice(), 0)
    };
    let mode = match attempt(IoMode::Direct) {
        Ok(()) => IoMode::Direct,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            attempt(IoMode::Buffered)?;
            IoMode::Buffered
        }
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
    };
    let _ = std::fs::remove_file(&path);
    Ok(mode)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let path = segment_path(Path::new("/d"), 42);
        assert_eq!(path, Path::new("/d/seg-00000042.tkv"));
        assert_eq!(segment_id("seg-00000042.tkv"), Some(42));
        assert_eq!(segment_id("seg-x.tkv"), None);
        assert_eq!(segment_id(".tierkv-probe-1"), None);
    }
}
