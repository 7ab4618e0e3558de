//! A worker's KV buffer in shared memory: a sealed memfd, mapped here and, once registered, in
//! the daemon.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use memmap2::MmapMut;

/// A buffer of `blocks` blocks of `block_bytes` each, in a memfd sealed against shrinking (so
/// the daemon's mapping of it can never fault) and growing.
pub struct SharedBuffer {
    file: File,
    map: MmapMut,
    block_bytes: u64,
    blocks: u64,
}

impl SharedBuffer {
    /// Creates the memfd, sizes it, seals it and maps it.
    pub fn new(block_bytes: u64, blocks: u64) -> io::Result<Self> {
        let len = block_bytes
            .checked_mul(blocks)
            .filter(|&n| n > 0 && usize::try_from(n).is_ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "buffer size overflows"))?;
        let file = memfd(c"tierkv-kv-buffer", libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)?;
        file.set_len(len)?;
        // Its pages allocated now, as an engine's KV is: the daemon refuses a memfd with holes
        // (its reads of one would allocate the page, charged to the daemon).
        // A signal interrupts a long allocation (EINTR): it is asked for again, as Python's
        // posix_fallocate does.
        loop {
            // SAFETY: fallocate on a descriptor we own, within its length.
            if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) } == 0 {
                break;
            }
            let error = io::Error::last_os_error();
            if error.kind() != io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
        // SAFETY: plain fcntl on a descriptor we own.
        let sealed = unsafe {
            libc::fcntl(
                file.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            )
        };
        if sealed != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the memfd is ours and sealed against shrinking, so the mapping stays backed.
        let map = unsafe { MmapMut::map_mut(&file)? };
        Ok(SharedBuffer { file, map, block_bytes, blocks })
    }

    /// Wraps a memfd made elsewhere (for tests that need a buffer the daemon must refuse, such
    /// as an unsealed one). It is mapped but not checked.
    pub fn from_file(file: File, block_bytes: u64, blocks: u64) -> io::Result<Self> {
        let len = file.metadata()?.len();
        if block_bytes.checked_mul(blocks).is_none_or(|n| n == 0 || n > len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{blocks} blocks of {block_bytes} bytes do not fit a file of {len} bytes"),
            ));
        }
        // SAFETY: the caller hands us the file; a shrink under the mapping would fault only here.
        let map = unsafe { MmapMut::map_mut(&file)? };
        Ok(SharedBuffer { file, map, block_bytes, blocks })
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Blocks in the buffer.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// The descriptor sent to the daemon.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Block `index`, or `None` past the end.
    pub fn block(&self, index: u64) -> Option<&[u8]> {
        let range = self.range(index)?;
        self.map.get(range)
    }

    /// Block `index` for writing, or `None` past the end.
    pub fn block_mut(&mut self, index: u64) -> Option<&mut [u8]> {
        let range = self.range(index)?;
        self.map.get_mut(range)
    }

    fn range(&self, index: u64) -> Option<std::ops::Range<usize>> {
        if index >= self.blocks {
            return None;
        }
        let start = usize::try_from(index.checked_mul(self.block_bytes)?).ok()?;
        Some(start..start.checked_add(usize::try_from(self.block_bytes).ok()?)?)
    }
}

/// Creates an anonymous memory file.
pub fn memfd(name: &std::ffi::CStr, flags: libc::c_uint) -> io::Result<File> {
    // SAFETY: `name` is NUL-terminated; the returned descriptor is checked and then owned.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn a_buffer_from_a_file_holds_its_blocks_and_no_block_wraps_around() {
        let file = memfd(c"small", libc::MFD_CLOEXEC).unwrap();
        file.set_len(8192).unwrap();
        // More blocks than the file holds, or a product that overflows: refused.
        let refused =
            |blocks: u64| SharedBuffer::from_file(file.try_clone().unwrap(), 4096, blocks);
        assert!(refused(3).is_err());
        assert!(refused((1 << 52) + 1).is_err());
        assert!(refused(0).is_err());
        let buffer = SharedBuffer::from_file(file, 4096, 2).unwrap();
        assert_eq!(buffer.block(1).map(<[u8]>::len), Some(4096));
        assert!(buffer.block(2).is_none());
        assert!(buffer.block(1 << 52).is_none());
    }
}
