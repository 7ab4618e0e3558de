//! The policies' touches allocate nothing once they have held their peak of keys and ghosts
//! (ARCHITECTURE.md, tierkv-core: "allocation-free in steady state"): L1 calls `insert` and
//! `touch` under a shard lock. A global allocator of this test binary counts what the calling
//! thread allocates; `evict`'s returned `Vec` is the trait's, and is not counted.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use tierkv_core::policy::{Adaptive, EvictionPolicy, Lru, S3Fifo};

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is passed to the system allocator unchanged; the count is a thread-local
// cell, which allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

/// A cache of `capacity` keys over a stream that reuses a hot set and brings new keys: each
/// access touches a held key or inserts a new one, evicting one first when full. Returns the
/// allocations made inside `insert` and `touch` over the last `measured` accesses.
fn touches_allocate(
    policy: &mut dyn EvictionPolicy<u64>,
    capacity: usize,
    warm: u64,
    measured: u64,
) -> u64 {
    let mut held = std::collections::HashSet::new();
    let mut counted = 0;
    let mut next_new = 1_000_000u64;
    // A fixed-seed xorshift: the same stream every run.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for step in 0..warm + measured {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        // Half the accesses go to a hot set of twice the capacity, half to new keys.
        let key = if state.is_multiple_of(2) {
            state % (2 * capacity as u64)
        } else {
            next_new += 1;
            next_new
        };
        // Only the policy's `insert` and `touch` are counted (the test's own set allocates).
        let measure = |call: &mut dyn FnMut()| {
            let before = allocations();
            call();
            allocations() - before
        };
        let allocated = if held.contains(&key) {
            measure(&mut || policy.touch(&key))
        } else {
            if held.len() >= capacity {
                for victim in policy.evict(1, &mut |_| true) {
                    held.remove(&victim);
                }
            }
            held.insert(key);
            measure(&mut || policy.insert(key))
        };
        if step >= warm {
            counted += allocated;
        }
    }
    counted
}

#[test]
fn the_policies_touches_allocate_nothing_in_steady_state() {
    for (name, policy) in [
        ("lru", Box::new(Lru::new()) as Box<dyn EvictionPolicy<u64>>),
        ("s3fifo", Box::new(S3Fifo::new())),
        ("adaptive", Box::new(Adaptive::new())),
    ] {
        let mut policy = policy;
        let allocated = touches_allocate(policy.as_mut(), 1_000, 400_000, 100_000);
        assert_eq!(allocated, 0, "{name}: inserts and touches allocated in steady state");
    }
}
