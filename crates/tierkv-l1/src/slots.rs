//! The slot table: fixed-size slots over one device arena, and the pin word that keeps a slot
//! from being reused while a copy into or out of it is under way.
//!
//! Every slot has one atomic state word:
//!
//! ```text
//!  bit 31   RETIRED  the entry that owned the slot is gone; free it when the last pin drops
//!  bit 30   WRITER   a write guard is copying into the slot (at most one)
//!  bits 0-29         pins: guards (readers, plus the writer) copying now
//! ```
//!
//! Pins are only taken while the caller holds the index shard lock of a live entry that owns the
//! slot, and retirement only happens under that same lock after the entry is removed. So a pin
//! can never be taken on a retired slot, and whichever of `retire` and the last `unpin` comes
//! second returns the slot to the free list: exactly once.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::device::DeviceArena;
use crate::room::Room;

const RETIRED: u32 = 1 << 31;
const WRITER: u32 = 1 << 30;
const PINS: u32 = WRITER - 1;

/// The index of a slot in the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub u32);

pub(crate) struct Slots {
    arena: Box<dyn DeviceArena>,
    slot_bytes: u64,
    states: Box<[AtomicU32]>,
    free: Mutex<Vec<SlotId>>,
    /// Slots whose entry is gone but which a copy still pins.
    retiring: AtomicU64,
    /// Writers waiting for room: a slot's last pin dropped may give them some (a retired slot
    /// freed, or a cached object evictable again).
    pub(crate) room: Room,
}

impl Slots {
    pub(crate) fn new(arena: Box<dyn DeviceArena>, slot_bytes: u64, count: u32) -> Self {
        let states = (0..count).map(|_| AtomicU32::new(0)).collect();
        // Pop from the end: hand out low slots first, which keeps small tests readable.
        let free = (0..count).rev().map(SlotId).collect();
        Slots {
            arena,
            slot_bytes,
            states,
            free: Mutex::new(free),
            retiring: AtomicU64::new(0),
            room: Room::default(),
        }
    }

    pub(crate) fn arena(&self) -> &dyn DeviceArena {
        self.arena.as_ref()
    }

    pub(crate) fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    pub(crate) fn count(&self) -> u32 {
        self.states.len() as u32
    }

    pub(crate) fn offset(&self, slot: SlotId) -> u64 {
        u64::from(slot.0) * self.slot_bytes
    }

    pub(crate) fn free_count(&self) -> u64 {
        self.free.lock().len() as u64
    }

    pub(crate) fn retiring_count(&self) -> u64 {
        self.retiring.load(Ordering::Acquire)
    }

    /// Takes a free slot, if any.
    pub(crate) fn alloc(&self) -> Option<SlotId> {
        self.free.lock().pop()
    }

    /// Takes up to `n` free slots at once, in the order `alloc` would hand them out.
    pub(crate) fn alloc_many(&self, n: usize) -> Vec<SlotId> {
        let mut free = self.free.lock();
        let keep = free.len().saturating_sub(n);
        let mut taken = free.split_off(keep);
        taken.reverse();
        taken
    }

    /// Returns a slot that was allocated but never became an entry.
    pub(crate) fn give_back(&self, slot: SlotId) {
        self.free.lock().push(slot);
    }

    /// Returns slots that were allocated but never became entries, under one lock; slots
    /// `alloc_many` handed out come back in the order it would hand them out again.
    pub(crate) fn give_back_many(&self, slots: Vec<SlotId>) {
        if !slots.is_empty() {
            self.free.lock().extend(slots.into_iter().rev());
        }
    }

    fn state(&self, slot: SlotId) -> &AtomicU32 {
        // Slot ids are only minted by `new` below `count`, so the index is in bounds.
        &self.states[slot.0 as usize]
    }

    /// Whether no copy pins the slot: it may be evicted, or re-locked for an update.
    pub(crate) fn is_idle(&self, slot: SlotId) -> bool {
        self.state(slot).load(Ordering::Acquire) & (PINS | WRITER) == 0
    }

    /// Whether a write guard is copying into the slot.
    pub(crate) fn has_writer(&self, slot: SlotId) -> bool {
        self.state(slot).load(Ordering::Acquire) & WRITER != 0
    }

    /// Pins the slot of a live `Ready` entry for a read. Call with the entry's shard locked.
    pub(crate) fn pin_read(&self, slot: SlotId) {
        self.state(slot).fetch_add(1, Ordering::AcqRel);
    }

    /// Pins the slot of a live `Writing` entry for the one writer; `false` if a writer already
    /// holds it. Call with the entry's shard locked.
    pub(crate) fn pin_write(&self, slot: SlotId) -> bool {
        self.state(slot)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |word| {
                (word & WRITER == 0).then_some(word + WRITER + 1)
            })
            .is_ok()
    }

    /// Drops a pin taken by `pin_read` (or `pin_write` with `writer`). The last pin of a retired
    /// slot frees it. Guards drop their pins outside every lock of L1, so the last pin tells the
    /// writers waiting for room (if any) here.
    pub(crate) fn unpin(&self, slot: SlotId, writer: bool) {
        let delta = if writer { WRITER + 1 } else { 1 };
        // Sequentially consistent, as the watchers' count the wake-up reads after it and a
        // writer's watch before its try (`Room`): either the writer's try sees this pin gone or
        // this sees the writer watching. (The same instruction as `AcqRel` on x86.)
        let before = self.state(slot).fetch_sub(delta, Ordering::SeqCst);
        if before & PINS == 1 {
            if before & RETIRED != 0 {
                self.release_retired(slot);
            }
            self.room.freed();
        }
    }

    /// The slot's entry is gone (call with its shard locked, after removing it). The slot is free
    /// now if nothing pins it, else when its last pin drops. Returns whether it was freed now.
    pub(crate) fn retire(&self, slot: SlotId) -> bool {
        // Count it as retiring first, so the counter never dips below zero if the last unpin
        // races with us.
        self.retiring.fetch_add(1, Ordering::AcqRel);
        let before = self.state(slot).fetch_or(RETIRED, Ordering::AcqRel);
        if before & PINS == 0 {
            self.release_retired(slot);
            true
        } else {
            false
        }
    }

    /// Like `retire`, for an idle slot the caller reuses at once instead of freeing (eviction on
    /// behalf of a reservation). Call with the shard locked and `is_idle(slot)` just checked.
    pub(crate) fn recycle(&self, slot: SlotId) {
        debug_assert!(self.is_idle(slot));
        self.state(slot).store(0, Ordering::Release);
    }

    /// Frees a retired slot. Its state, the free list and the retiring count change under the
    /// free list's lock, so a [`snapshot`](Self::snapshot) sees the slot either retiring or free,
    /// never between the two (the last unpin runs on whichever thread dropped its pin, outside
    /// any shard lock an audit holds).
    fn release_retired(&self, slot: SlotId) {
        let mut free = self.free.lock();
        self.state(slot).store(0, Ordering::Release);
        free.push(slot);
        self.retiring.fetch_sub(1, Ordering::AcqRel);
    }

    /// A copy of the free list, the set of retired-but-pinned slots and the retiring count, taken
    /// together, for audits.
    pub(crate) fn snapshot(&self) -> (Vec<SlotId>, Vec<SlotId>, u64) {
        let free = self.free.lock();
        let retiring = (0..self.count())
            .map(SlotId)
            .filter(|s| self.state(*s).load(Ordering::Acquire) & RETIRED != 0)
            .collect();
        (free.clone(), retiring, self.retiring_count())
    }
}
