//! Guards that copy into and out of one slot.
//!
//! A guard pins its slot for as long as it lives: the slot cannot be reused, re-locked for an
//! update, or made visible (for a write) until the guard is dropped. Guards own an `Arc` of the
//! slot table, so they can travel to I/O threads inside adapter tasks and come back.

use std::sync::Arc;

use tierkv_core::{BufferError, ChunkSink, ChunkSource};

use crate::error::L1Error;
use crate::slots::{SlotId, Slots};

/// Where a reserved or leased object lives in the arena. Plain data: copying or dropping a
/// handle changes no count (only leases and guards hold anything).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotHandle {
    /// The slot.
    pub slot: SlotId,
    /// Byte offset of the slot in the arena (a device address offset on CUDA).
    pub offset: u64,
    /// Bytes of the object.
    pub len: u64,
    /// Which life of the key the object is: a later reservation of the same key, after this
    /// one was aborted, has another.
    pub generation: u64,
}

/// The pinned slot shared by both guards.
struct Pinned {
    slots: Arc<Slots>,
    slot: SlotId,
    offset: u64,
    len: u64,
    generation: u64,
    writer: bool,
}

impl Pinned {
    fn range(&self, offset: u64, len: usize) -> Result<u64, L1Error> {
        let len = len as u64;
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.offset + offset),
            _ => Err(L1Error::OutOfRange { offset, len, object: self.len }),
        }
    }

    fn host_bytes(&self) -> Option<*mut u8> {
        let base = self.slots.arena().host_base()?;
        // SAFETY: `offset + len` lies inside the arena: the slot table was sized from it.
        Some(unsafe { base.as_ptr().add(self.offset as usize) })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.slots.unpin(self.slot, self.writer);
    }
}

/// Exclusive write access to the slot of a `Writing` entry.
pub struct WriteAccess(Pinned);

/// Shared read access to the slot of a leased entry.
pub struct ReadAccess(Pinned);

impl WriteAccess {
    pub(crate) fn new(slots: Arc<Slots>, slot: SlotId, generation: u64, len: u64) -> Self {
        let offset = slots.offset(slot);
        WriteAccess(Pinned { slots, slot, offset, len, generation, writer: true })
    }

    /// Where the object lives.
    pub fn handle(&self) -> SlotHandle {
        let Pinned { slot, offset, len, generation, .. } = self.0;
        SlotHandle { slot, offset, len, generation }
    }

    /// Copies `src` into the object at `offset`.
    pub fn write_at(&mut self, offset: u64, src: &[u8]) -> Result<(), L1Error> {
        let at = self.0.range(offset, src.len())?;
        // SAFETY: this guard is the slot's only writer (WRITER bit) and no reader can pin a
        // `Writing` slot; the range lies inside the object.
        unsafe { self.0.slots.arena().copy_in(at, src) }?;
        Ok(())
    }

    /// The object's bytes in place, when the arena is host memory.
    pub fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        let ptr = self.0.host_bytes()?;
        // SAFETY: exclusive access as in `write_at`; the borrow of `self` keeps the pin alive.
        Some(unsafe { std::slice::from_raw_parts_mut(ptr, self.0.len as usize) })
    }

    /// The object's device address, when the arena is GPU memory.
    pub fn device_address(&self) -> Option<u64> {
        Some(self.0.slots.arena().device_base()? + self.0.offset)
    }
}

impl ReadAccess {
    pub(crate) fn new(slots: Arc<Slots>, slot: SlotId, generation: u64, len: u64) -> Self {
        let offset = slots.offset(slot);
        ReadAccess(Pinned { slots, slot, offset, len, generation, writer: false })
    }

    /// Where the object lives.
    pub fn handle(&self) -> SlotHandle {
        let Pinned { slot, offset, len, generation, .. } = self.0;
        SlotHandle { slot, offset, len, generation }
    }

    /// Copies the object's bytes at `offset` into `dst`.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), L1Error> {
        let at = self.0.range(offset, dst.len())?;
        // SAFETY: the slot belongs to a `Ready` entry, which nobody writes while it is pinned.
        unsafe { self.0.slots.arena().copy_out(at, dst) }?;
        Ok(())
    }

    /// The object's bytes in place, when the arena is host memory.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        let ptr = self.0.host_bytes()?;
        // SAFETY: no writer while pinned, as in `read_at`.
        Some(unsafe { std::slice::from_raw_parts(ptr, self.0.len as usize) })
    }

    /// The object's device address, when the arena is GPU memory.
    pub fn device_address(&self) -> Option<u64> {
        Some(self.0.slots.arena().device_base()? + self.0.offset)
    }
}

fn whole(len: u64, copy: usize) -> Result<(), BufferError> {
    if copy as u64 == len {
        Ok(())
    } else {
        Err(BufferError::LengthMismatch { buffer: len, copy: copy as u64 })
    }
}

impl ChunkSource for ReadAccess {
    fn len(&self) -> u64 {
        self.0.len
    }

    fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), BufferError> {
        whole(self.0.len, dst.len())?;
        self.read_at(0, dst).map_err(|e| BufferError::Device(e.to_string()))
    }

    fn host_bytes(&self) -> Option<&[u8]> {
        ReadAccess::host_bytes(self)
    }
}

impl ChunkSink for WriteAccess {
    fn len(&self) -> u64 {
        self.0.len
    }

    fn copy_from_host(&mut self, src: &[u8]) -> Result<(), BufferError> {
        whole(self.0.len, src.len())?;
        self.write_at(0, src).map_err(|e| BufferError::Device(e.to_string()))
    }

    fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        WriteAccess::host_bytes_mut(self)
    }
}

/// An eviction victim's slot, read by a [`crate::Demoter`] while the victim's shard is locked:
/// the slot is idle (no guard pins it) and cannot be pinned until the lock is released, so
/// nothing writes it while the view exists.
pub(crate) struct SlotView<'a> {
    pub(crate) slots: &'a Slots,
    pub(crate) slot: SlotId,
    pub(crate) len: u64,
}

impl ChunkSource for SlotView<'_> {
    fn len(&self) -> u64 {
        self.len
    }

    fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), BufferError> {
        whole(self.len, dst.len())?;
        // SAFETY: the slot is idle and unpinnable while the view exists (see the type).
        unsafe { self.slots.arena().copy_out(self.slots.offset(self.slot), dst) }
            .map_err(|e| BufferError::Device(e.to_string()))
    }

    fn host_bytes(&self) -> Option<&[u8]> {
        let base = self.slots.arena().host_base()?;
        // SAFETY: the slot lies inside the arena, and nothing writes it while the view exists.
        Some(unsafe {
            std::slice::from_raw_parts(
                base.as_ptr().add(self.slots.offset(self.slot) as usize),
                self.len as usize,
            )
        })
    }
}
