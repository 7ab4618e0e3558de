//! Host memory standing in for a GPU arena, so everything above L1 runs and is tested on any
//! machine.

use std::ptr::NonNull;

use memmap2::MmapMut;

use super::{DeviceArena, DeviceError, check_range};

/// An anonymous memory mapping: pages are committed only when first written, so a large
/// configured L1 costs nothing until it fills; or, prefaulted, all at once when it is mapped, so
/// no write ever pays a page fault (as with GPU memory, committed when allocated).
#[derive(Debug)]
pub struct EmulatedArena {
    map: MmapMut,
    base: NonNull<u8>,
    prefaulted: bool,
}

// SAFETY: the arena is a plain byte region. Concurrent access goes through `copy_in`/`copy_out`
// (or the base pointer) on ranges that the L1 slot protocol keeps disjoint between writers and
// readers, which is the contract those unsafe methods state.
unsafe impl Send for EmulatedArena {}
// SAFETY: as above; shared references only hand out raw access under the slot protocol.
unsafe impl Sync for EmulatedArena {}

impl EmulatedArena {
    /// Maps `bytes` of anonymous memory, committed page by page as it is first written.
    pub fn new(bytes: u64) -> Result<Self, DeviceError> {
        Self::with_prefault(bytes, false)
    }

    /// Maps `bytes` of anonymous memory; with `prefault`, every page is committed now
    /// (`MAP_POPULATE`), so the first write of a slot does not pay a page fault per 4 KiB.
    pub fn with_prefault(bytes: u64, prefault: bool) -> Result<Self, DeviceError> {
        let alloc_error =
            |reason: String| DeviceError::Alloc { backend: "emulated", bytes, reason };
        if bytes == 0 {
            return Err(alloc_error("an arena needs at least one byte".into()));
        }
        let len = usize::try_from(bytes)
            .map_err(|_| alloc_error("larger than the address space".into()))?;
        let mut options = memmap2::MmapOptions::new();
        options.len(len);
        if prefault {
            options.populate();
        }
        let mut map = options.map_anon().map_err(|e| alloc_error(e.to_string()))?;
        let base =
            NonNull::new(map.as_mut_ptr()).ok_or_else(|| alloc_error("null mapping".into()))?;
        Ok(EmulatedArena { map, base, prefaulted: prefault })
    }
}

impl DeviceArena for EmulatedArena {
    fn backend(&self) -> &'static str {
        "emulated"
    }

    fn describe(&self) -> String {
        let prefaulted = if self.prefaulted { ", prefaulted" } else { "" };
        format!("emulated (host memory), {} bytes{prefaulted}", self.map.len())
    }

    fn len(&self) -> u64 {
        self.map.len() as u64
    }

    unsafe fn copy_in(&self, offset: u64, src: &[u8]) -> Result<(), DeviceError> {
        check_range(offset, src.len() as u64, self.len())?;
        // SAFETY: the range is inside the mapping (checked above, and `offset` fits in usize
        // because it is below the mapping's length); the caller guarantees no concurrent access
        // to it; `src` cannot overlap the arena because the caller holds it as a separate borrow
        // of memory it owns.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.base.as_ptr().add(offset as usize),
                src.len(),
            );
        }
        Ok(())
    }

    unsafe fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<(), DeviceError> {
        check_range(offset, dst.len() as u64, self.len())?;
        // SAFETY: as in `copy_in`, with no concurrent writer to the range.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.as_ptr().add(offset as usize),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        Ok(())
    }

    fn host_base(&self) -> Option<NonNull<u8>> {
        Some(self.base)
    }

    fn device_base(&self) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_round_trip_and_bounds_are_checked() {
        let arena = EmulatedArena::new(8192).unwrap();
        let data: Vec<u8> = (0..100).collect();
        // SAFETY: single-threaded test, no concurrent access.
        unsafe {
            arena.copy_in(4000, &data).unwrap();
            let mut back = vec![0; 100];
            arena.copy_out(4000, &mut back).unwrap();
            assert_eq!(back, data);
            assert!(matches!(arena.copy_in(8100, &data), Err(DeviceError::OutOfBounds { .. })));
            assert!(arena.copy_out(u64::MAX, &mut back).is_err());
        }
        assert!(EmulatedArena::new(0).is_err());
    }

    /// Pages of the arena resident in memory now (`mincore`).
    fn resident_pages(arena: &EmulatedArena) -> usize {
        let page = 4096;
        let pages = arena.map.len().div_ceil(page);
        let mut vec = vec![0u8; pages];
        // SAFETY: the range is exactly the mapping, page aligned (mmap returns page-aligned
        // memory), and `vec` has one byte per page of it.
        let rc =
            unsafe { libc::mincore(arena.base.as_ptr().cast(), arena.map.len(), vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore failed");
        vec.iter().filter(|b| *b & 1 != 0).count()
    }

    #[test]
    fn a_prefaulted_arena_is_resident_before_any_write_and_a_lazy_one_is_not() {
        let bytes = 16 << 20;
        let lazy = EmulatedArena::with_prefault(bytes, false).unwrap();
        let eager = EmulatedArena::with_prefault(bytes, true).unwrap();
        let pages = (bytes / 4096) as usize;
        assert_eq!(resident_pages(&eager), pages, "{}", eager.describe());
        assert!(resident_pages(&lazy) < pages / 2, "a lazy arena was committed up front");
        assert!(eager.describe().contains("prefaulted"));
        // Prefaulted memory is ordinary zeroed memory.
        let mut back = vec![1u8; 4096];
        // SAFETY: single-threaded test, no concurrent access.
        unsafe { eager.copy_out(bytes - 4096, &mut back).unwrap() };
        assert!(back.iter().all(|b| *b == 0));
    }
}
