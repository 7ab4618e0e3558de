//! A write reservation that has to evict, raced by another writer between its eviction and its
//! inserts. The race is staged, not hoped for: the demoter L1 hands every victim to (under the
//! victim's shard lock, in the middle of the reservation) stops the reservation at its first
//! victim until the test has run the other writer's steps, in shards the paused one does not
//! hold. L1 must then neither evict a chunk it does not use (a miss later, and under the cascade
//! a demotion for nothing) nor refuse a key for want of a slot while one is free.

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use parking_lot::Mutex;
use tierkv_core::policy::shard_of;
use tierkv_core::{ChunkSource, KeyError, ObjectKey};
use tierkv_l1::{Demoter, L1Config, Lifetime, OwnerId, Presence, SlotHandle, WriteMode};

const SHARDS: usize = 4;
const OTHER: OwnerId = OwnerId(2);

/// Once armed, pauses the next demotion until the test resumes it.
struct PauseAtNextDemotion {
    armed: AtomicBool,
    reached: Mutex<mpsc::Sender<ObjectKey>>,
    resume: Mutex<mpsc::Receiver<()>>,
}

impl PauseAtNextDemotion {
    /// A disarmed pause, the receiver of the keys it pauses at and the sender that resumes it.
    fn new() -> (Arc<Self>, mpsc::Receiver<ObjectKey>, mpsc::Sender<()>) {
        let (reached_tx, reached) = mpsc::channel();
        let (resume, resume_rx) = mpsc::channel();
        let pause = Arc::new(PauseAtNextDemotion {
            armed: AtomicBool::new(false),
            reached: Mutex::new(reached_tx),
            resume: Mutex::new(resume_rx),
        });
        (pause, reached, resume)
    }
}

impl Demoter for PauseAtNextDemotion {
    fn demote(&self, key: &ObjectKey, _bytes: &dyn ChunkSource) {
        if self.armed.swap(false, Ordering::SeqCst) {
            self.reached.lock().send(*key).unwrap();
            // A bound, so that a reservation the test cannot resume fails instead of hanging.
            self.resume.lock().recv_timeout(Duration::from_secs(10)).unwrap();
        }
    }
}

type Answers = Vec<Result<SlotHandle, KeyError>>;

/// What the staged race left.
struct Race {
    f: Fixture,
    /// The paused reservation's answers.
    batch: Answers,
    /// The other writer's answer for the batch's first key.
    other: Result<SlotHandle, KeyError>,
    /// The chunks evicted.
    evicted: Vec<ObjectKey>,
}

/// `n` keys whose shard is (`inside`) or is not the victims' shard, skipping `skip`.
fn keys_where(inside: bool, n: usize, skip: u64) -> Vec<ObjectKey> {
    let victims_shard = shard_of(&key(0), SHARDS);
    (skip..).map(key).filter(|k| (shard_of(k, SHARDS) == victims_shard) == inside).take(n).collect()
}

/// An L1 of `victims + 1` slots in 4 shards: `victims` cached chunks, all in one shard, and one
/// reservation of `OTHER` (not evictable). `OWNER` reserves `batch` (keys outside the victims'
/// shard), which must evict; paused at its first victim, `OTHER` aborts its reservation (a slot
/// comes free) and reserves the batch's first key. Then the batch goes on.
fn race(victims: usize, batch: usize) -> Race {
    let (pause, reached, resume) = PauseAtNextDemotion::new();
    let config = L1Config { shards: SHARDS, ..config(victims as u64 + 1) };
    let f = with_demoter(config, Some(pause.clone()));
    let cached = keys_where(true, victims, 0);
    for k in &cached {
        f.write(std::slice::from_ref(k));
    }
    let outside = keys_where(false, batch + 1, 1_000);
    let (held, batch) = (outside[0], outside[1..].to_vec());
    let reserve = |owner, keys: &[ObjectKey]| {
        f.l1.reserve_write(owner, keys, &layout(), WriteMode::Create, Lifetime::Cached).unwrap()
    };
    assert!(reserve(OTHER, &[held])[0].is_ok());
    assert_eq!(f.usage().free_bytes, 0);
    pause.armed.store(true, Ordering::SeqCst);

    let (answers, other) = std::thread::scope(|s| {
        let paused = s.spawn(|| reserve(OWNER, &batch));
        let victim = reached.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(victim, cached[0], "the oldest chunk goes first");
        // The other writer's steps touch only shards outside the victims' one, which the paused
        // reservation holds.
        assert_eq!(f.l1.abort_write(OTHER, &[held]), [Ok(())]);
        // The other writer waits for the claim on the key (until the batch inserts it or gives
        // it up): it answers once the batch has gone on.
        let other = s.spawn(|| reserve(OTHER, &batch[..1]).remove(0));
        std::thread::sleep(Duration::from_millis(50));
        resume.send(()).unwrap();
        (paused.join().unwrap(), other.join().unwrap())
    });
    let evicted = f.recorder.evicted.lock().iter().map(|(k, _)| *k).collect();
    Race { f, batch: answers, other, evicted }
}

impl Race {
    /// Whatever the outcome, one writer holds the contested key, every slot taken is owned,
    /// free or retiring, and once both writers let go nothing stays held.
    fn check_consistent(&self) {
        assert!(
            self.batch[0].is_ok() != self.other.is_ok(),
            "exactly one writer gets the contested key: {:?} and {:?}",
            self.batch[0],
            self.other
        );
        self.f.assert_consistent();
        self.f.l1.release_owner(OWNER);
        self.f.l1.release_owner(OTHER);
        self.f.assert_consistent();
        let usage = self.f.usage();
        assert_eq!((usage.used_bytes, usage.writing), (0, 0), "{usage:?}");
    }

    /// Every chunk evicted gave its slot to a key of the paused reservation (the other writer
    /// evicts nothing: a slot comes free for it).
    fn assert_no_victim_wasted(&self) {
        let reserved = self.batch.iter().filter(|r| r.is_ok()).count();
        assert!(
            self.evicted.len() <= reserved,
            "evicted {:?} for {reserved} reservations: answers {:?}, {} bytes free",
            self.evicted,
            self.batch,
            self.f.usage().free_bytes
        );
    }
}

#[test]
fn a_batch_evicts_no_chunk_for_a_key_another_writer_reserves_meanwhile() {
    let race = race(2, 2);
    race.assert_no_victim_wasted();
    race.check_consistent();
}

#[test]
fn a_single_key_reservation_evicts_no_chunk_for_a_key_another_writer_reserves_meanwhile() {
    let race = race(1, 1);
    race.assert_no_victim_wasted();
    race.check_consistent();
}

#[test]
fn a_batch_refuses_no_key_for_want_of_a_slot_while_one_is_free() {
    // Two chunks to evict for three keys: the third key's slot is the one that comes free.
    let race = race(2, 3);
    let free = race.f.usage().free_bytes;
    assert!(
        !race.batch.contains(&Err(KeyError::OutOfMemory)) || free == 0,
        "refused for want of a slot with {free} bytes free: {:?}",
        race.batch
    );
    race.assert_no_victim_wasted();
    race.check_consistent();
}

#[test]
fn a_writer_of_a_key_a_reservation_claims_and_then_gives_up_is_not_told_it_is_in_flight() {
    // An L1 of 2 slots: one cached chunk, one reservation of `OTHER`. `OWNER` reserves two
    // keys, claims both, and is paused at its one victim; `OTHER` then writes the second key.
    // Nothing more is evictable, so `OWNER` gives that key up (`OutOfMemory`): `OTHER` must not
    // have been told `WriteInFlight` (a store counts that as present: a chunk nobody stores).
    let (pause, reached, resume) = PauseAtNextDemotion::new();
    let f = with_demoter(L1Config { shards: SHARDS, ..config(2) }, Some(pause.clone()));
    f.write(&keys_where(true, 1, 0));
    let outside = keys_where(false, 3, 1_000);
    let (held, batch) = (outside[0], outside[1..].to_vec());
    let reserve = |owner, keys: &[ObjectKey]| {
        f.l1.reserve_write(owner, keys, &layout(), WriteMode::Create, Lifetime::Cached).unwrap()
    };
    assert!(reserve(OTHER, &[held])[0].is_ok());
    pause.armed.store(true, Ordering::SeqCst);
    let (answers, other) = std::thread::scope(|s| {
        let paused = s.spawn(|| reserve(OWNER, &batch));
        reached.recv_timeout(Duration::from_secs(10)).unwrap();
        let (tx, rx) = mpsc::channel();
        let (reserve, second) = (&reserve, &batch[1..]);
        s.spawn(move || tx.send(reserve(OTHER, second).remove(0)).unwrap());
        // Answered at once (the claim refused) or, waiting for the claim, after the resume.
        let early = rx.recv_timeout(Duration::from_millis(200)).ok();
        resume.send(()).unwrap();
        let answers = paused.join().unwrap();
        (answers, early.unwrap_or_else(|| rx.recv_timeout(Duration::from_secs(10)).unwrap()))
    });
    assert!(answers[0].is_ok(), "{answers:?}");
    assert_eq!(answers[1], Err(KeyError::OutOfMemory), "no slot for the second key");
    assert_eq!(f.l1.presence(&batch[1]), Presence::Absent, "nobody writes it");
    assert_eq!(other, Err(KeyError::OutOfMemory), "the other writer is told the truth");
    f.assert_consistent();
    f.l1.release_owner(OWNER);
    f.l1.release_owner(OTHER);
    f.assert_consistent();
}

/// Once armed, panics at the next demotion, as a faulty demoter might.
#[derive(Default)]
struct PanicAtNextDemotion {
    armed: AtomicBool,
}

impl Demoter for PanicAtNextDemotion {
    fn demote(&self, _key: &ObjectKey, _bytes: &dyn ChunkSource) {
        if self.armed.swap(false, Ordering::SeqCst) {
            panic!("the demoter fails");
        }
    }
}

#[test]
fn a_demoter_that_panics_costs_its_victim_never_the_slot() {
    // A faulty demoter panics on a victim: the victim is gone (a miss later), but its slot is
    // not. The reservation that evicted it gets it, no claim stays behind, L1 adds up.
    for shards in [1, SHARDS] {
        for n in [1, 2] {
            let case = format!("{shards} shards, {n} keys");
            let demoter = Arc::new(PanicAtNextDemotion::default());
            let config = L1Config { shards, ..config(n as u64 + 1) };
            let f = with_demoter(config, Some(demoter.clone()));
            let cached = keys_where(true, n, 0);
            for k in &cached {
                f.write(&[*k]);
            }
            let outside = keys_where(false, n + 1, 1_000);
            let (held, batch) = (outside[0], &outside[1..]);
            let reserve = |owner, keys: &[ObjectKey]| {
                f.l1.reserve_write(owner, keys, &layout(), WriteMode::Create, Lifetime::Cached)
                    .unwrap()
            };
            assert!(reserve(OTHER, &[held])[0].is_ok());
            demoter.armed.store(true, Ordering::SeqCst);
            let answers =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| reserve(OWNER, batch)))
                    .unwrap_or_else(|_| panic!("{case}: the demoter's panic reached the writer"));
            assert!(answers.iter().all(Result::is_ok), "{case}: {answers:?}");
            assert!(!demoter.armed.load(Ordering::SeqCst), "{case}: the demoter was called");
            assert_eq!(f.l1.demoter_panics(), 1, "{case}: the panic is counted");
            f.assert_consistent();
            let usage = f.usage();
            assert_eq!((usage.writing, usage.free_bytes), (n as u64 + 1, 0), "{case}: {usage:?}");
            // No key stays claimed: once the writers let go, every key can be written again.
            f.l1.release_owner(OWNER);
            f.l1.release_owner(OTHER);
            for k in batch.iter().chain(&cached) {
                assert!(reserve(OTHER, &[*k])[0].is_ok(), "{case}: {k:?} is refused");
                f.l1.release_owner(OTHER);
            }
            f.assert_consistent();
        }
    }
}
