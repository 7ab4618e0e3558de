//! A worker's registered KV buffer, mapped into the daemon.
//!
//! The worker keeps writing its buffer while the daemon copies from it, so the daemon never
//! forms references into it: blocks are raw ranges, copied with `ptr::copy_nonoverlapping`. A
//! buffer is accepted only when the memfd is sealed against shrinking; otherwise the worker could
//! truncate the file under the daemon's mapping and the next copy would be a `SIGBUS`.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};

use memmap2::{MmapOptions, MmapRaw};

/// Why a registration was refused.
#[derive(Debug, thiserror::Error)]
pub enum BufferError {
    /// The frame carried no descriptor.
    #[error(
        "register_buffer needs the buffer's file descriptor attached (SCM_RIGHTS over the Unix socket)"
    )]
    NoDescriptor,
    /// Shape problems.
    #[error("{0}")]
    Shape(String),
    /// The memfd is not sealed against shrinking.
    #[error(
        "the buffer's memfd must be sealed with F_SEAL_SHRINK (so it cannot be truncated under the daemon's mapping)"
    )]
    NotSealed,
    /// fstat, fcntl or mmap failed.
    #[error("cannot map the buffer: {0}")]
    Io(#[from] std::io::Error),
}

/// A mapped buffer of equal blocks.
pub struct RegisteredBuffer {
    map: MmapRaw,
    block_bytes: u64,
    blocks: u64,
}

impl RegisteredBuffer {
    /// Checks and maps a worker's buffer.
    pub fn map(fd: OwnedFd, block_bytes: u64, blocks: u64) -> Result<Self, BufferError> {
        let len = block_bytes
            .checked_mul(blocks)
            .filter(|&n| n > 0)
            .ok_or_else(|| BufferError::Shape(format!("{blocks} blocks of {block_bytes} bytes")))?;
        // SAFETY: fcntl on a descriptor we own.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(BufferError::NotSealed);
        }
        let file = File::from(fd);
        let size = file.metadata()?.len();
        if size < len {
            return Err(BufferError::Shape(format!(
                "{blocks} blocks of {block_bytes} bytes need {len} bytes; the buffer has {size}"
            )));
        }
        let len = usize::try_from(len)
            .map_err(|_| BufferError::Shape(format!("{len} bytes do not fit the address space")))?;
        let map = MmapOptions::new().len(len).map_raw(&file)?;
        Ok(RegisteredBuffer { map, block_bytes, blocks })
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Whether `index` names a block of this buffer.
    pub fn contains(&self, index: u64) -> bool {
        index < self.blocks
    }

    /// Copies `len` bytes of block `index` into `dst`.
    pub fn read_block(&self, index: u64, dst: &mut [u8]) -> Result<(), BufferError> {
        let at = self.offset(index, dst.len())?;
        // SAFETY: `at..at + len` lies inside the mapping (checked), which stays mapped while
        // `self` lives and cannot shrink (sealed). The worker may write it concurrently; the
        // copy then holds whatever bytes were there, which is the worker's own business.
        unsafe {
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(at), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// Copies `src` into block `index`.
    pub fn write_block(&self, index: u64, src: &[u8]) -> Result<(), BufferError> {
        let at = self.offset(index, src.len())?;
        // SAFETY: as in `read_block`; the destination is shared memory nobody in this process
        // holds a reference to.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.map.as_mut_ptr().add(at), src.len())
        };
        Ok(())
    }

    fn offset(&self, index: u64, len: usize) -> Result<usize, BufferError> {
        if index >= self.blocks || len as u64 > self.block_bytes {
            return Err(BufferError::Shape(format!(
                "block {index} ({len} bytes) is outside a buffer of {} blocks of {} bytes",
                self.blocks, self.block_bytes
            )));
        }
        // In range of the mapping, so it fits usize.
        Ok((index * self.block_bytes) as usize)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;
    use tierkv_client::{SharedBuffer, memfd};

    fn owned(buffer: &SharedBuffer) -> OwnedFd {
        buffer.fd().try_clone_to_owned().unwrap()
    }

    #[test]
    fn blocks_round_trip_and_out_of_range_is_refused() {
        let mut shared = SharedBuffer::new(64, 4).unwrap();
        shared.block_mut(2).unwrap().fill(7);
        let mapped = RegisteredBuffer::map(owned(&shared), 64, 4).unwrap();
        let mut got = [0u8; 64];
        mapped.read_block(2, &mut got).unwrap();
        assert_eq!(got, [7u8; 64]);
        mapped.write_block(3, &[9u8; 64]).unwrap();
        assert_eq!(shared.block(3).unwrap(), &[9u8; 64]);
        assert!(mapped.read_block(4, &mut got).is_err());
        assert!(mapped.write_block(0, &[0u8; 65]).is_err());
    }

    #[test]
    fn unsealed_short_and_overflowing_buffers_are_refused() {
        let unsealed = memfd(c"t", libc::MFD_CLOEXEC).unwrap();
        unsealed.set_len(4096).unwrap();
        let err = RegisteredBuffer::map(OwnedFd::from(unsealed), 64, 4).err().unwrap();
        assert!(matches!(err, BufferError::NotSealed), "{err}");
        let shared = SharedBuffer::new(64, 4).unwrap();
        let err = RegisteredBuffer::map(owned(&shared), 64, 5).err().unwrap();
        assert!(err.to_string().contains("has 256"), "{err}");
        let err = RegisteredBuffer::map(owned(&shared), u64::MAX, 2).err().unwrap();
        assert!(matches!(err, BufferError::Shape(_)), "{err}");
    }
}
