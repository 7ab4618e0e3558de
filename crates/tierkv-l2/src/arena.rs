//! The host memory chunks live in.

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{CudaContext, result};
use memmap2::{Advice, MmapMut, MmapOptions};

use crate::config::HostMemory;
use crate::error::L2Error;

/// The memory actually obtained for the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Ordinary anonymous pages.
    Plain,
    /// Anonymous pages with transparent huge pages requested (`MADV_HUGEPAGE`).
    TransparentHugePages,
    /// Explicit huge pages from the kernel's reserved pool (`MAP_HUGETLB`).
    HugeTlb,
    /// Page-locked memory registered with CUDA (`cuMemHostAlloc`).
    Pinned,
}

impl MemoryKind {
    /// A short name for logs and status.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryKind::Plain => "plain",
            MemoryKind::TransparentHugePages => "transparent-huge-pages",
            MemoryKind::HugeTlb => "hugetlb",
            MemoryKind::Pinned => "pinned",
        }
    }
}

enum Backing {
    /// Owned so the mapping lives as long as the arena; reached through `Arena::base`.
    Mapped(#[expect(dead_code, reason = "held for its lifetime, not read")] MmapMut),
    Pinned(Arc<CudaContext>),
}

/// One contiguous allocation, carved into fixed-size slots by the store.
pub(crate) struct Arena {
    backing: Backing,
    base: NonNull<u8>,
    len: usize,
    kind: MemoryKind,
}

// SAFETY: the arena is a plain byte region. The store hands out raw access to disjoint slots
// only: a slot is written by the one task that reserved it and read only while pinned and
// finished, never both at once.
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

impl Arena {
    /// An arena of `bytes` in `memory`; with `prefault`, every page is committed before it
    /// returns.
    pub(crate) fn new(bytes: u64, memory: HostMemory, prefault: bool) -> Result<Self, L2Error> {
        let arena = Self::allocate(bytes, memory)?;
        if prefault && arena.kind != MemoryKind::Pinned {
            arena.commit();
        }
        Ok(arena)
    }

    fn allocate(bytes: u64, memory: HostMemory) -> Result<Self, L2Error> {
        let len = usize::try_from(bytes).map_err(|_| L2Error::Memory {
            kind: "host",
            bytes,
            reason: "larger than the address space".into(),
        })?;
        match memory {
            HostMemory::Plain => Self::mapped(len, false),
            HostMemory::HugePages => Self::huge(len),
            HostMemory::Pinned => Self::pinned(len),
            HostMemory::Auto => match tierkv_l1::device::cuda_available() {
                Ok(()) => Self::pinned(len).or_else(|_| Self::mapped(len, false)),
                Err(_) => Self::mapped(len, false),
            },
        }
    }

    fn from_map(mut map: MmapMut, kind: MemoryKind) -> Result<Self, L2Error> {
        let len = map.len();
        let base = NonNull::new(map.as_mut_ptr()).ok_or_else(|| L2Error::Memory {
            kind: "mapped",
            bytes: len as u64,
            reason: "null mapping".into(),
        })?;
        Ok(Arena { backing: Backing::Mapped(map), base, len, kind })
    }

    fn mapped(len: usize, transparent_huge: bool) -> Result<Self, L2Error> {
        let map = MmapMut::map_anon(len).map_err(|e| L2Error::Memory {
            kind: "mapped",
            bytes: len as u64,
            reason: e.to_string(),
        })?;
        let kind = if transparent_huge && map.advise(Advice::HugePage).is_ok() {
            MemoryKind::TransparentHugePages
        } else {
            MemoryKind::Plain
        };
        Self::from_map(map, kind)
    }

    fn huge(len: usize) -> Result<Self, L2Error> {
        match MmapOptions::new().len(len).huge(None).map_anon() {
            Ok(map) => Self::from_map(map, MemoryKind::HugeTlb),
            // No reserved huge pages (the usual case): ask for transparent ones instead.
            Err(_) => Self::mapped(len, true),
        }
    }

    fn pinned(len: usize) -> Result<Self, L2Error> {
        let error = |reason: String| L2Error::Memory { kind: "pinned", bytes: len as u64, reason };
        tierkv_l1::device::cuda_available().map_err(|e| error(e.to_string()))?;
        let context = CudaContext::new(0).map_err(|e| error(e.to_string()))?;
        context.bind_to_thread().map_err(|e| error(e.to_string()))?;
        // CU_MEMHOSTALLOC_PORTABLE: pinned for every context, not only the one current here.
        const PORTABLE: u32 = 1;
        // SAFETY: a context is current on this thread; the pointer is owned by the arena and
        // freed once, in `Drop`.
        let ptr =
            unsafe { result::malloc_host(len, PORTABLE) }.map_err(|e| error(e.to_string()))?;
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| error("null allocation".into()))?;
        Ok(Arena { backing: Backing::Pinned(context), base, len, kind: MemoryKind::Pinned })
    }

    pub(crate) fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// Writes a zero into every page of the fresh (all-zero) arena, after any huge-page advice,
    /// so the kernel commits them now and in the page size it chose.
    fn commit(&self) {
        const PAGE: usize = 4096;
        for offset in (0..self.len).step_by(PAGE) {
            // SAFETY: the offset lies inside the arena, which nobody else can reach yet; the
            // memory is fresh and all zero, so the write changes no byte.
            unsafe { self.base.as_ptr().add(offset).write_volatile(0) };
        }
    }

    /// The bytes `offset..offset + len`, to read.
    ///
    /// # Safety
    /// The range must lie inside the arena and no one may write it while the slice lives.
    pub(crate) unsafe fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        debug_assert!(offset + len <= self.len);
        // SAFETY: the caller guarantees the range is inside the arena and not written meanwhile.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(offset), len) }
    }

    /// The bytes `offset..offset + len`, to write.
    ///
    /// # Safety
    /// The range must lie inside the arena and nobody else may access it while the slice lives.
    #[expect(
        clippy::mut_from_ref,
        reason = "exclusive access to the range is the caller's contract"
    )]
    pub(crate) unsafe fn bytes_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        debug_assert!(offset + len <= self.len);
        // SAFETY: the caller guarantees the range is inside the arena and exclusively theirs.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(offset), len) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if let Backing::Pinned(context) = &self.backing
            && context.bind_to_thread().is_ok()
        {
            // SAFETY: `base` came from `malloc_host` in `pinned` and is freed only here. A failure
            // leaves the memory to the driver's teardown; a destructor has nobody to tell.
            let _ = unsafe { result::free_host(self.base.as_ptr().cast()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_memory_kind_opens_or_falls_back_and_says_which() {
        let plain = Arena::new(1 << 20, HostMemory::Plain, false).unwrap();
        assert_eq!(plain.kind(), MemoryKind::Plain);
        let huge = Arena::new(4 << 20, HostMemory::HugePages, false).unwrap();
        assert_ne!(huge.kind(), MemoryKind::Pinned);
        let auto = Arena::new(1 << 20, HostMemory::Auto, false).unwrap();
        match tierkv_l1::device::cuda_available() {
            Ok(()) => assert_eq!(auto.kind(), MemoryKind::Pinned),
            Err(_) => {
                assert_eq!(auto.kind(), MemoryKind::Plain);
                assert!(matches!(
                    Arena::new(1 << 20, HostMemory::Pinned, false),
                    Err(L2Error::Memory { .. })
                ));
            }
        }
        // SAFETY: single-threaded test, range inside the arena.
        unsafe {
            huge.bytes_mut(4096, 3).copy_from_slice(&[1, 2, 3]);
            assert_eq!(huge.bytes(4096, 3), &[1, 2, 3]);
        }
    }

    /// Pages of the arena resident in memory now (`mincore`).
    fn resident_pages(arena: &Arena) -> usize {
        let page = 4096;
        let mut vec = vec![0u8; arena.len.div_ceil(page)];
        // SAFETY: the range is exactly the arena's mapping, page aligned (mmap returns
        // page-aligned memory), and `vec` has one byte per page of it.
        let rc = unsafe { libc::mincore(arena.base.as_ptr().cast(), arena.len, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore failed");
        vec.iter().filter(|b| *b & 1 != 0).count()
    }

    #[test]
    fn a_prefaulted_arena_is_resident_before_any_write_and_a_lazy_one_is_not() {
        let bytes: usize = 16 << 20;
        for memory in [HostMemory::Plain, HostMemory::HugePages] {
            let lazy = Arena::new(bytes as u64, memory, false).unwrap();
            let eager = Arena::new(bytes as u64, memory, true).unwrap();
            assert_eq!(resident_pages(&eager), bytes / 4096, "{:?}", eager.kind());
            assert!(
                resident_pages(&lazy) < bytes / 4096 / 2,
                "{:?} committed up front",
                lazy.kind()
            );
            // SAFETY: single-threaded test, range inside the arena.
            assert!(unsafe { eager.bytes(0, bytes) }.iter().all(|b| *b == 0));
        }
    }
}
