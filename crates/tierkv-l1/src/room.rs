//! Room for writers that wait for it: a writer that found L1 full watches ([`RoomWatch`]), and
//! whatever may free room wakes it.
//!
//! Room comes free in many places: a lease's last share returned (a lookup released, a lease
//! expired, the store pipeline done with its copies), a reservation aborted, a write finished
//! without a lease, an object deleted or evicted, the last copy out of a slot ending. Each of
//! them calls [`Room::freed`] once its own locks are let go, and that is one atomic load while
//! no writer watches: the hot paths of leasing and releasing pay nothing more for a wait that is
//! rare (L1 full of chunks nobody may evict).
//!
//! No wake-up is lost. A writer counts itself watching and reads the count of wake-ups before it
//! tries to reserve; a place that frees room changes L1 first, under the lock the writer's try
//! takes too (or on the atomic it reads), and reads the watchers after. So either the writer's
//! try comes after the change and sees the room, or the change comes after the writer counted
//! itself, and the place that freed the room sees it watching and wakes it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

/// On cache lines of its own: `watchers` is read by every release and every reservation that
/// frees room, and written only while a writer waits, so it must not share a line with what
/// they write (the free list's lock beside it in `Slots`).
#[derive(Default)]
#[repr(align(128))]
pub(crate) struct Room {
    /// Writers watching now ([`RoomWatch`]).
    watchers: AtomicUsize,
    /// Bumped, and the watchers woken, each time room may have come free while one watched.
    freed: Mutex<u64>,
    cv: Condvar,
}

impl Room {
    /// Room may have come free: wakes the writers watching, if any. Call with no lock of L1 held
    /// where the caller can (a woken writer takes L1's locks to try again).
    pub(crate) fn freed(&self) {
        if self.watchers.load(Ordering::SeqCst) == 0 {
            return;
        }
        *self.freed.lock() += 1;
        self.cv.notify_all();
    }

    /// Starts a watch: room freed from now on wakes it.
    pub(crate) fn watch(&self) -> RoomWatch<'_> {
        self.watchers.fetch_add(1, Ordering::SeqCst);
        // Orders the count before the writer's next try, which reads slots' pin words with
        // acquire loads only (see `Slots::unpin`).
        std::sync::atomic::fence(Ordering::SeqCst);
        let seen = *self.freed.lock();
        RoomWatch { room: self, seen }
    }

    /// Writers watching now.
    pub(crate) fn watchers(&self) -> usize {
        self.watchers.load(Ordering::SeqCst)
    }
}

/// A writer's watch for room in L1 ([`crate::L1Manager::watch_room`]), taken before its first
/// try: whatever frees room after it was taken ends the next [`RoomWatch::wait_until`]. Dropped,
/// it stops watching.
pub struct RoomWatch<'a> {
    room: &'a Room,
    /// The wake-ups counted when the watch was taken, or when its last wait ended.
    seen: u64,
}

impl RoomWatch<'_> {
    /// Waits until room may have come free since the watch was taken or its last wait ended
    /// (`true`: try again), or until `deadline` (`false`). A wake-up may find no room after
    /// all: another writer took it first, or what came free was not what the writer needs.
    pub fn wait_until(&mut self, deadline: Instant) -> bool {
        let mut freed = self.room.freed.lock();
        while *freed == self.seen {
            if self.room.cv.wait_until(&mut freed, deadline).timed_out() {
                return false;
            }
        }
        self.seen = *freed;
        true
    }
}

impl Drop for RoomWatch<'_> {
    fn drop(&mut self) {
        self.room.watchers.fetch_sub(1, Ordering::SeqCst);
    }
}

impl std::fmt::Debug for RoomWatch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoomWatch").field("seen", &self.seen).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn room_freed_after_a_watch_began_ends_its_next_wait_once() {
        let room = Room::default();
        let mut watch = room.watch();
        room.freed();
        assert!(watch.wait_until(Instant::now() + Duration::from_secs(30)));
        assert!(!watch.wait_until(Instant::now()), "the same wake-up counted twice");
        drop(watch);
        assert_eq!(room.watchers(), 0);
    }
}
