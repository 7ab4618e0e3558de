//! Page-aligned heap buffers, as direct I/O needs them (the disk tier, benchmarks).

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

/// Alignment for direct I/O: the page size of every platform tierkv runs on.
pub const ALIGN: usize = 4096;

/// A zeroed heap buffer whose address and length are multiples of [`ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is uniquely owned heap memory; it is shared only through `&self`/`&mut self`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only read.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of `len` bytes rounded up to a multiple of [`ALIGN`]; `None` if it cannot be
    /// allocated.
    pub fn new(len: usize) -> Option<Self> {
        let len = len.max(1).checked_next_multiple_of(ALIGN)?;
        let layout = Layout::from_size_align(len, ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(AlignedBuf { ptr, len })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` owns `len` initialised (zeroed) bytes for the buffer's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout (which was valid then).
        unsafe { dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.len, ALIGN)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_rounded_up() {
        let mut buf = AlignedBuf::new(5000).unwrap();
        assert_eq!(buf.as_slice().len(), 8192);
        assert_eq!(buf.as_slice().as_ptr() as usize % ALIGN, 0);
        buf.as_mut_slice()[8191] = 7;
        assert_eq!(buf.as_slice()[8191], 7);
    }
}
