//! Segment files: creation, positional aligned I/O, and optional read-only mappings.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
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

/// Segment files are never opened through a symlink (`O_NOFOLLOW`), and are created `0600`
/// (`SegmentFile::secure` then sets the configured mode and group).
fn options(write: bool, create: bool, mode: IoMode) -> OpenOptions {
    let mut options = OpenOptions::new();
    options.read(true).write(write).create(create).mode(0o600);
    let direct = if mode == IoMode::Direct { libc::O_DIRECT } else { 0 };
    options.custom_flags(libc::O_NOFOLLOW | direct);
    options
}

/// Gives `file` the `mode` and, when set, the `group`.
fn secure_fd(file: &File, mode: u32, group: Option<u32>) -> io::Result<()> {
    if let Some(gid) = group {
        std::os::unix::fs::fchown(file.as_fd(), None, Some(gid))?;
    }
    file.set_permissions(std::fs::Permissions::from_mode(mode))
}

/// Gives the directory `dir` the `mode` and, when set, the `group`.
pub(crate) fn secure(dir: &Path, mode: u32, group: Option<u32>) -> io::Result<()> {
    secure_fd(&File::open(dir)?, mode, group)
}

/// The name of the lock file in a store's directory.
pub(crate) const LOCK_FILE: &str = ".tierkv.lock";

/// An exclusive `flock` on a store's directory, held while the store is open: one store (one
/// daemon) per directory. The file holds the holder's pid, so a refusal can name it.
pub(crate) struct DirLock {
    file: File,
}

impl Drop for DirLock {
    /// Unlocks before the descriptor closes: a child another thread is starting holds a copy of
    /// the descriptor until it execs, and the lock would stay while that copy is open, refusing
    /// a store reopened at once in this process.
    fn drop(&mut self) {
        // SAFETY: flock on a descriptor we own, open until after this call.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl DirLock {
    /// Locks `dir`. `Ok(None)`: the directory cannot be written and holds no lock file, so
    /// there is nothing to lock (and nothing anyone could write).
    pub(crate) fn take(dir: &Path, mode: u32) -> Result<Option<DirLock>, crate::DiskError> {
        let path = dir.join(LOCK_FILE);
        let opened = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path);
        let (file, writable) = match opened {
            Ok(file) => (file, true),
            Err(e)
                if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EROFS | libc::ENOSPC)) =>
            {
                match OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path) {
                    Ok(file) => (file, false),
                    Err(_) => return Ok(None),
                }
            }
            Err(e) => return Err(crate::DiskError::io("opening the lock file", &path)(e)),
        };
        // SAFETY: flock on a descriptor we own.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(crate::DiskError::io("locking", &path)(e));
            }
            let mut holder = String::new();
            let _ = io::Read::read_to_string(&mut &file, &mut holder);
            let holder = match holder.trim().parse::<u32>() {
                Ok(pid) => format!("pid {pid}"),
                Err(_) => "a process that wrote no pid".into(),
            };
            return Err(crate::DiskError::Locked { dir: dir.to_path_buf(), holder });
        }
        if writable {
            // Best effort: the pid only makes a refusal more helpful.
            let pid = format!("{}\n", std::process::id());
            if file.set_len(0).and_then(|()| file.write_all_at(pid.as_bytes(), 0)).is_err() {
                let _ = file.set_len(0);
            }
        }
        Ok(Some(DirLock { file }))
    }
}

impl SegmentFile {
    /// Opens an existing segment.
    pub(crate) fn open(path: PathBuf, writable: bool, mode: IoMode) -> io::Result<Self> {
        let file = options(writable, false, mode).open(&path)?;
        Ok(SegmentFile { path, file, map: OnceLock::new() })
    }

    /// Opens (creating if needed) a segment and makes sure `bytes` of disk are allocated to it,
    /// so a full disk is found here, before any record is written, and not in the middle of one.
    /// A longer file (of a larger `segment` configured before) is cut to `bytes`, so the store
    /// never holds more disk than its capacity.
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
        if file.metadata()?.len() > bytes {
            file.set_len(bytes)?;
        }
        Ok(SegmentFile { path, file, map: OnceLock::new() })
    }

    /// Gives the file the `mode` and, when set, the `group`.
    pub(crate) fn secure(&self, mode: u32, group: Option<u32>) -> io::Result<()> {
        secure_fd(&self.file, mode, group)
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
