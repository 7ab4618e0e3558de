//! Segment files: their layout, creation, positional aligned I/O, and optional read-only
//! mappings.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use memmap2::{Advice, Mmap};
use tierkv_core::AlignedBuf;

use crate::format::BLOCK;

/// The name of segment file `n`.
pub(crate) fn file_path(dir: &Path, n: u32) -> PathBuf {
    dir.join(format!("seg-{n:08}.tkv"))
}

/// The file number a name stands for, if it is a segment file.
pub(crate) fn file_number(name: &str) -> Option<u32> {
    name.strip_prefix("seg-")?.strip_suffix(".tkv")?.parse().ok()
}

/// Where each segment lies: segments of `segment_bytes` back to back, `per_file` to a file (the
/// last file holds the rest). Only the segment's size and the file's size decide it, not the
/// capacity, so a disk made larger or smaller keeps every segment where it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) segment_bytes: u64,
    pub(crate) segments: u32,
    pub(crate) per_file: u32,
}

impl Layout {
    /// How many files the segments take.
    pub(crate) fn files(&self) -> u32 {
        self.segments.div_ceil(self.per_file)
    }

    /// The file that holds segment `id`.
    pub(crate) fn file_of(&self, id: u32) -> u32 {
        id / self.per_file
    }

    /// The byte offset of segment `id` in its file.
    pub(crate) fn base(&self, id: u32) -> u64 {
        u64::from(id % self.per_file) * self.segment_bytes
    }

    /// The segments file `n` holds.
    pub(crate) fn segments_of(&self, n: u32) -> std::ops::Range<u32> {
        let first = n.saturating_mul(self.per_file).min(self.segments);
        first..first.saturating_add(self.per_file).min(self.segments)
    }

    /// The length of file `n`: its segments, whole.
    pub(crate) fn file_bytes(&self, n: u32) -> u64 {
        self.segments_of(n).len() as u64 * self.segment_bytes
    }
}

/// How the store does file I/O, decided once: at open, or, in a directory that could tell none
/// then (full, or read-only, and holding no segment file), when its first segment file is made.
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
    map: OnceLock<Mmap>,
}

#[cfg(test)]
thread_local! {
    /// The syncs this thread has asked for, for tests.
    pub(crate) static SYNCS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
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
                if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EROFS))
                    || is_no_space(&e) =>
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

    /// Opens (creating if needed) a segment file and makes sure its first `bytes` are allocated
    /// on disk, so a full disk is found here, before any record is written, and not in the
    /// middle of one. A file that was not there is removed again when its space cannot be had.
    pub(crate) fn create(path: PathBuf, bytes: u64, mode: IoMode) -> io::Result<Self> {
        let existed = path.exists();
        let file = options(true, true, mode).open(&path)?;
        if !existed && let Err(e) = no_copy_on_write(&file) {
            // Not fatal: a reused segment then needs new room on a full disk, which the store
            // finds at its first write there and turns read-only for (docs/disk-format.md).
            tracing::warn!("cannot turn copy-on-write off for {}: {e}", path.display());
        }
        let created = SegmentFile { path, file, map: OnceLock::new() };
        if let Err(e) = created.allocate(bytes) {
            if !existed {
                // Give back whatever part was allocated: a full disk should not stay fuller.
                let _ = std::fs::remove_file(&created.path);
            }
            return Err(e);
        }
        Ok(created)
    }

    /// Allocates the file's first `bytes` on disk (fallocate, which never changes bytes already
    /// there), making it at least that long. A file grows a segment at a time, as its segments
    /// are first used, so a disk smaller than the capacity still holds the segments it has room
    /// for.
    pub(crate) fn allocate(&self, bytes: u64) -> io::Result<()> {
        let len = libc::off_t::try_from(bytes)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: fallocate on a file descriptor we own, with a valid length.
        let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), 0, 0, len) };
        if rc != 0 {
            let error = io::Error::last_os_error();
            // Filesystems without fallocate: extend the file instead (space is then found at
            // write time; such a filesystem gives weaker full-disk behaviour, documented).
            if error.raw_os_error() != Some(libc::EOPNOTSUPP) {
                return Err(error);
            }
            if self.len()? < bytes {
                self.file.set_len(bytes)?;
            }
        }
        Ok(())
    }

    /// Cuts the file to `bytes` if it is longer (a file of a larger capacity before), so the
    /// store never holds more disk than its capacity. Segments within `bytes` keep their records.
    pub(crate) fn cut(&self, bytes: u64) -> io::Result<()> {
        if self.len()? > bytes {
            self.file.set_len(bytes)?;
        }
        Ok(())
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
        #[cfg(test)]
        SYNCS.with(|syncs| syncs.set(syncs.get() + 1));
        self.file.sync_data()
    }

    /// A read-only mapping of the whole file, made on first use (of the file as long as it was
    /// then: a file made longer later is read past the mapping with `read_at`). A mapping that
    /// fails (the address space or `vm.max_map_count` exhausted for a moment) is tried again at
    /// the next use, not remembered as the file's for good.
    pub(crate) fn mapping(&self) -> io::Result<&Mmap> {
        if let Some(map) = self.map.get() {
            return Ok(map);
        }
        // SAFETY: the mapping is only read; records are read only while their segment is
        // pinned, so the store never rewrites a mapped range while it is being read. A
        // truncation or I/O error by another party turns into SIGBUS, which is why this read
        // mode is not the default.
        let map = unsafe { Mmap::map(&self.file) }?;
        let _ = map.advise(Advice::Sequential);
        // Another reader may have mapped the file meanwhile: its mapping is kept, this one goes.
        Ok(self.map.get_or_init(|| map))
    }
}

/// The inode flag `chattr +C` sets (`FS_NOCOW_FL` in `linux/fs.h`; the libc crate lacks it).
const FS_NOCOW_FL: libc::c_int = 0x0080_0000;

/// Turns copy-on-write off for `file`, still empty (the flag takes effect on no other), as
/// `chattr +C` does, where the filesystem copies on write (btrfs): a segment reused is then
/// written in place, as on ext4, and needs no room for a second copy, so reusing segments makes
/// room on a full disk or over a quota there too. Records carry their own checksums, so the data
/// checksums btrfs keeps only for copied-on-write files are not missed. Filesystems without the
/// flag (ext4, XFS, tmpfs) refuse it (`ENOTTY`, `EOPNOTSUPP`, `EINVAL`): nothing to do there.
fn no_copy_on_write(file: &File) -> io::Result<()> {
    let fd = file.as_raw_fd();
    let mut flags: libc::c_int = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one int through the pointer, to a local that outlives it,
    // on a descriptor we own.
    if unsafe { libc::ioctl(fd, libc::FS_IOC_GETFLAGS, &mut flags) } != 0 {
        return unsupported_is_fine(io::Error::last_os_error());
    }
    if flags & FS_NOCOW_FL != 0 {
        return Ok(());
    }
    flags |= FS_NOCOW_FL;
    // SAFETY: FS_IOC_SETFLAGS reads one int through the pointer, on a descriptor we own.
    if unsafe { libc::ioctl(fd, libc::FS_IOC_SETFLAGS, &flags) } != 0 {
        return unsupported_is_fine(io::Error::last_os_error());
    }
    Ok(())
}

/// `Ok` where `error` only says the filesystem has no inode flags, or not that one.
fn unsupported_is_fine(error: io::Error) -> io::Result<()> {
    match error.raw_os_error() {
        Some(libc::ENOTTY | libc::EOPNOTSUPP | libc::EINVAL) => Ok(()),
        _ => Err(error),
    }
}

/// Whether `error` says there is no room to write: the filesystem is full (`ENOSPC`), or the
/// user or group the daemon runs as is over its disk quota (`EDQUOT`). The tier's own files are
/// what fill a quota, so both mean the same to the store: reuse a segment instead of growing.
pub(crate) fn is_no_space(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// Syncs a directory, so files created in it survive a crash.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Decides the I/O mode for `dir` by writing a probe file with `O_DIRECT`. Returns `Err` when the
/// directory takes no probe file: it cannot be written (`EROFS`, `EACCES`, `EPERM`), or it can
/// but has no room for the file (`is_no_space`: the kernel checks the mount and the permissions
/// before it looks for space). The probe file is removed either way.
pub(crate) fn probe(dir: &Path) -> io::Result<IoMode> {
    let path = probe_path(dir);
    let attempt = |mode: IoMode| -> io::Result<()> {
        let file = options(true, true, mode).open(&path)?;
        let block =
            AlignedBuf::new(BLOCK as usize).ok_or_else(|| io::Error::other("cannot allocate"))?;
        file.write_all_at(block.as_slice(), 0)
    };
    let probed = match attempt(IoMode::Direct) {
        Ok(()) => Ok(IoMode::Direct),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            attempt(IoMode::Buffered).map(|()| IoMode::Buffered)
        }
        Err(e) => Err(e),
    };
    // A file left behind by a write that failed (a full disk) would take yet more of the space.
    let _ = std::fs::remove_file(&path);
    probed
}

/// Whether `dir`'s filesystem has room for `bytes` more of the store's: as much free as
/// `statvfs` tells (which a filesystem without `fallocate` leaves as the only sign) and a probe
/// file allocated that long (`fallocate`: nothing is written; a quota shows here), then removed.
pub(crate) fn room(dir: &Path, bytes: u64) -> io::Result<()> {
    if available_bytes(dir)? < bytes {
        return Err(io::Error::from_raw_os_error(libc::ENOSPC));
    }
    let path = probe_path(dir);
    let allocated = SegmentFile::create(path.clone(), bytes, IoMode::Buffered).map(drop);
    let _ = std::fs::remove_file(&path);
    allocated
}

/// The probe file of `dir`, this process's.
fn probe_path(dir: &Path) -> PathBuf {
    dir.join(format!(".tierkv-probe-{}", std::process::id()))
}

/// Bytes of `dir`'s filesystem an unprivileged writer may still take (`statvfs`'s `f_bavail`).
pub(crate) fn available_bytes(dir: &Path) -> io::Result<u64> {
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `path` is a NUL-terminated string and `stat` a buffer statvfs fills on success.
    if unsafe { libc::statvfs(path.as_ptr(), stat.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it filled the buffer (which started zeroed anyway).
    let stat = unsafe { stat.assume_init() };
    let (blocks, block_bytes): (u64, u64) = (stat.f_bavail, stat.f_frsize);
    Ok(blocks.saturating_mul(block_bytes))
}

/// Bytes the segment files of `layout` in `dir` take now (those that exist).
pub(crate) fn files_bytes(dir: &Path, layout: Layout) -> u64 {
    (0..layout.files())
        .filter_map(|n| std::fs::metadata(file_path(dir, n)).ok())
        .map(|meta| meta.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let path = file_path(Path::new("/d"), 42);
        assert_eq!(path, Path::new("/d/seg-00000042.tkv"));
        assert_eq!(file_number("seg-00000042.tkv"), Some(42));
        assert_eq!(file_number("seg-x.tkv"), None);
        assert_eq!(file_number(".tierkv-probe-1"), None);
    }

    #[test]
    fn segments_lie_back_to_back_in_files_of_whole_segments() {
        let layout = Layout { segment_bytes: 3 * BLOCK, segments: 7, per_file: 3 };
        assert_eq!(layout.files(), 3);
        assert_eq!(layout.segments_of(0), 0..3);
        assert_eq!(layout.segments_of(2), 6..7);
        assert_eq!(layout.segments_of(3), 7..7);
        assert_eq!((layout.file_of(4), layout.base(4)), (1, 3 * BLOCK));
        assert_eq!((layout.file_of(6), layout.base(6)), (2, 0));
        assert_eq!(layout.file_bytes(1), 9 * BLOCK);
        assert_eq!(layout.file_bytes(2), 3 * BLOCK);
    }
}
