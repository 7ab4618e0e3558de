//! Writers waiting for room: whatever frees room in L1 wakes a writer watching for it
//! (`L1Manager::watch_room`), so a store that found L1 full is not left waiting out its deadline
//! while L1 has room again.

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

mod common;

use std::time::{Duration, Instant};

use common::*;
use tierkv_core::KeyError;
use tierkv_l1::{LeaseId, OwnerId, Readers};

/// Another client, writing.
const OTHER: OwnerId = OwnerId(2);

/// Far enough that a wait which ends before it was woken, not timed out.
const FAR: Duration = Duration::from_secs(30);

/// An L1 of two slots with no room: key 0 finished and leased (`lease`, a lookup's), key 1
/// reserved by `OTHER`, still being written.
struct Full {
    f: Fixture,
    lease: LeaseId,
}

fn full() -> Full {
    let f = l1(2);
    f.write(&keys(0..1));
    let lease = f.lease(&key(0), 0);
    let reserved = f.l1.reserve_write(
        OTHER,
        &keys(1..2),
        &layout(),
        tierkv_l1::WriteMode::Create,
        tierkv_l1::Lifetime::Cached,
    );
    assert!(reserved.unwrap()[0].is_ok());
    Full { f, lease }
}

/// A writer watches, is refused (L1 full), then `free` makes room: the watch's wait ends at
/// once, long before its deadline, and the writer's next try gets the room.
fn check_wakes(what: &str, free: impl FnOnce(&Full)) {
    let full = full();
    let mut watch = full.f.l1.watch_room();
    assert_eq!(full.f.try_reserve(&keys(9..10))[0], Err(KeyError::OutOfMemory), "{what}");
    free(&full);
    let deadline = Instant::now() + FAR;
    assert!(watch.wait_until(deadline), "{what}: the wait timed out");
    assert!(Instant::now() < deadline, "{what}: woken only at the deadline");
    assert!(full.f.try_reserve(&keys(9..10))[0].is_ok(), "{what}: no room after the wake-up");
    drop(watch);
    full.f.assert_consistent();
}

#[test]
fn a_lookup_released_wakes_a_writer_watching_for_room() {
    check_wakes("finish_read", |full| full.f.release(full.lease, 0));
    check_wakes("release_lease", |full| {
        full.f.l1.release_lease(full.lease).unwrap();
    });
}

#[test]
fn a_lease_expired_wakes_a_writer_watching_for_room() {
    check_wakes("expire_leases (the maintenance tick)", |full| {
        full.f.clock.advance(LEASE_TTL);
        assert_eq!(full.f.l1.expire_leases(), 1);
    });
    check_wakes("a call that finds the lease expired", |full| {
        full.f.clock.advance(LEASE_TTL);
        assert!(!full.f.l1.lease_live(full.lease));
    });
}

#[test]
fn a_reservation_aborted_or_finished_wakes_a_writer_watching_for_room() {
    check_wakes("abort_write", |full| {
        assert!(full.f.l1.abort_write(OTHER, &keys(1..2))[0].is_ok());
    });
    check_wakes("release_owner (a client gone)", |full| {
        assert_eq!(full.f.l1.release_owner(OTHER).aborted_writes, 1);
    });
    check_wakes("finish_write without a lease", |full| {
        assert!(full.f.l1.finish_write(OTHER, &keys(1..2))[0].is_ok());
    });
}

#[test]
fn a_chunk_deleted_wakes_a_writer_watching_for_room() {
    check_wakes("delete, forced", |full| {
        assert!(full.f.l1.delete(&keys(0..1), true)[0].is_ok());
    });
    check_wakes("clear, forced", |full| {
        assert_eq!(full.f.l1.clear(true).removed, 2);
    });
}

/// A released chunk whose bytes a reader is still copying out is not evictable; the end of the
/// copy makes it so, and wakes the writer.
#[test]
fn the_last_copy_out_of_a_released_chunk_wakes_a_writer_watching_for_room() {
    let full = full();
    let copy = full.f.l1.read_access(full.lease, 0, &key(0)).unwrap();
    full.f.l1.finish_read(full.lease, Readers::All, None).unwrap();
    let mut watch = full.f.l1.watch_room();
    assert_eq!(full.f.try_reserve(&keys(9..10))[0], Err(KeyError::OutOfMemory));
    drop(copy);
    let deadline = Instant::now() + FAR;
    assert!(watch.wait_until(deadline) && Instant::now() < deadline, "woken only at the deadline");
    assert!(full.f.try_reserve(&keys(9..10))[0].is_ok());
}

/// What frees room while no writer watches costs nothing and leaves no wake-up behind: a writer
/// that starts watching later waits for room freed after it.
#[test]
fn room_freed_before_a_writer_watches_does_not_end_its_wait() {
    let full = full();
    full.f.release(full.lease, 0);
    assert_eq!(full.f.l1.room_watchers(), 0);
    let mut watch = full.f.l1.watch_room();
    assert_eq!(full.f.l1.room_watchers(), 1);
    assert!(!watch.wait_until(Instant::now()), "a wake-up from before the watch");
    drop(watch);
    assert_eq!(full.f.l1.room_watchers(), 0);
}
