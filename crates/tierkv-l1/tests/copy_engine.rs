//! The GPU data path's ordering rules, on the emulated copy engine (issue 14): copies complete
//! later and out of the caller's thread, as on a CUDA stream, so each rule is tested in CI.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use proptest::prelude::*;
use tierkv_core::{ChunkHash, ExtraCount};
use tierkv_core::{KeyError, KvRank, Layout, Namespace, ObjectKey};
use tierkv_l1::device::{At, CopyEngine, CopyError, EmulatedCopyEngine, Event, Piece};
use tierkv_l1::{L1Config, L1Context, L1Manager, Lifetime, OwnerId, WriteMode};

const SECOND: Duration = Duration::from_secs(5);

fn piece(src: &[u8], dst: &mut [u8]) -> Piece {
    assert_eq!(src.len(), dst.len());
    Piece::contiguous(
        At::Host(src.as_ptr() as u64),
        At::Host(dst.as_mut_ptr() as u64),
        src.len() as u64,
    )
}

/// Memory a test shares with a stream thread: the Vec never moves while the test holds it.
fn buffer(len: usize, fill: u8) -> Arc<Mutex<Vec<u8>>> {
    Arc::new(Mutex::new(vec![fill; len]))
}

fn raw(buffer: &Arc<Mutex<Vec<u8>>>) -> (u64, usize) {
    let mut b = buffer.lock();
    (b.as_mut_ptr() as u64, b.len())
}

#[test]
fn a_copy_returns_at_once_and_completes_on_the_stream_thread_before_its_event() {
    let engine = EmulatedCopyEngine::new();
    let stream = engine.stream().unwrap();
    let src = vec![7u8; 1 << 20];
    let mut dst = vec![0u8; 1 << 20];
    let gate = Event::new();
    stream.wait(&gate).unwrap();
    // SAFETY: both buffers outlive the event recorded below, which the test waits for.
    unsafe { stream.copy(vec![piece(&src, &mut dst)]) }.unwrap();
    let done = stream.record().unwrap();
    assert_eq!(done.result(), None, "nothing ran: the stream waits for the gate");
    let caller = std::thread::current().id();
    let (tx, rx) = std::sync::mpsc::channel();
    let dst_addr = dst.as_ptr() as usize;
    done.on_complete(move |result| {
        // SAFETY: the copy has completed (this is its event) and the test reads dst only later.
        let landed = unsafe { std::slice::from_raw_parts(dst_addr as *const u8, 1 << 20) };
        let all = landed.iter().all(|&b| b == 7);
        tx.send((result.clone(), std::thread::current().id(), all)).unwrap();
    });
    gate.fire(Ok(()));
    let (result, thread, all) = rx.recv_timeout(SECOND).unwrap();
    assert_eq!(result, Ok(()));
    assert_ne!(thread, caller, "completion runs on the stream's thread, not the caller's");
    assert!(all, "the event fired only after the last byte landed");
    assert!(dst.iter().all(|&b| b == 7));
}

#[test]
fn a_store_never_reads_before_the_producers_event() {
    // The producer (an engine kernel) writes the block, then fires its event; a store enqueued
    // before that must copy the final bytes, never the old ones.
    let engine = EmulatedCopyEngine::new();
    let stream = engine.stream().unwrap();
    let block = buffer(4096, 1);
    let slot = buffer(4096, 0);
    let produced = Event::new();
    stream.wait(&produced).unwrap();
    let ((src, len), (dst, _)) = (raw(&block), raw(&slot));
    // SAFETY: the buffers live until the end of the test, after the event below fired; the
    // producer writes the block only before firing `produced`, which the copy waits for.
    unsafe { stream.copy(vec![Piece::contiguous(At::Device(src), At::Device(dst), len as u64)]) }
        .unwrap();
    let stored = stream.record().unwrap();
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(stored.result(), None);
    block.lock().fill(9); // the kernel's output
    produced.fire(Ok(()));
    stored.wait(SECOND).unwrap();
    assert!(slot.lock().iter().all(|&b| b == 9), "the copy saw the producer's bytes");
}

#[test]
fn streams_run_in_order_and_a_failed_producer_skips_what_waited_on_it() {
    let engine = EmulatedCopyEngine::new();
    let stream = engine.stream().unwrap();
    let (a, b) = (vec![1u8; 64], vec![2u8; 64]);
    let mut dst = vec![0u8; 64];
    // SAFETY: buffers outlive the waits below.
    unsafe {
        stream.copy(vec![piece(&a, &mut dst)]).unwrap();
        stream.copy(vec![piece(&b, &mut dst)]).unwrap();
    }
    stream.record().unwrap().wait(SECOND).unwrap();
    assert_eq!(dst, vec![2u8; 64], "the later copy landed last");

    let failed = Event::new();
    failed.fire(Err(CopyError::Failed("the engine's kernel failed".into())));
    stream.wait(&failed).unwrap();
    // SAFETY: as above.
    unsafe { stream.copy(vec![piece(&a, &mut dst)]).unwrap() };
    let result = stream.record().unwrap().wait(SECOND);
    assert!(matches!(result, Err(CopyError::Upstream(_))), "{result:?}");
    assert_eq!(dst, vec![2u8; 64], "work after a failed event did not run");
    // The stream goes on after reporting it.
    // SAFETY: as above.
    unsafe { stream.copy(vec![piece(&a, &mut dst)]).unwrap() };
    stream.record().unwrap().wait(SECOND).unwrap();
    assert_eq!(dst, vec![1u8; 64]);
}

#[test]
fn a_producer_event_fired_with_a_timeout_is_an_upstream_failure_not_one_still_to_come() {
    let engine = EmulatedCopyEngine::new();
    let stream = engine.stream().unwrap();
    let producer = Event::new();
    stream.wait(&producer).unwrap();
    producer.fire(Err(CopyError::Timeout));
    assert!(matches!(producer.wait(SECOND), Err(CopyError::Upstream(_))));
    // Before, the stream took the fired timeout for a wait still running and spun on it, and
    // nothing recorded after it ever fired.
    let result = stream.record().unwrap().wait(SECOND);
    assert!(matches!(result, Err(CopyError::Upstream(_))), "{result:?}");
    stream.sync().unwrap();
}

#[test]
fn a_failed_copy_is_a_miss_never_a_visible_half_chunk() {
    // A chunk of 4 pieces whose third fails: the store's callback aborts the write, and no
    // reader ever sees the key, neither during the copy nor after.
    const CHUNK: u64 = 4096;
    let l1 =
        Arc::new(L1Manager::build(L1Config::new(16 * CHUNK, CHUNK), L1Context::default()).unwrap());
    let sources: Vec<Vec<u8>> = (0..4u8).map(|i| vec![i + 1; (CHUNK / 4) as usize]).collect();
    let third = sources[2].as_ptr() as u64;
    let engine =
        EmulatedCopyEngine::with_faults(Arc::new(move |p: &Piece| p.src == At::Host(third)));
    let stream = engine.stream().unwrap();
    let owner = OwnerId(1);
    let key = ObjectKey::new(Namespace::new("m", ""), ChunkHash(7), KvRank::Shared);
    let layout = Layout::bytes(CHUNK).unwrap();
    l1.reserve_write(owner, &[key], &layout, WriteMode::Create, Lifetime::Cached).unwrap()[0]
        .unwrap();
    // The guard pins the slot until the copy into it has completed, so nothing (a forced
    // delete, a disconnect) can free the slot under the copy, and the write cannot be finished
    // before its bytes are in.
    let mut access = l1.write_access(owner, &key).unwrap();
    let slot = access.host_bytes_mut().unwrap().as_mut_ptr() as u64;
    let pieces = sources
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let dst = At::Device(slot + i as u64 * CHUNK / 4);
            Piece::contiguous(At::Host(s.as_ptr() as u64), dst, CHUNK / 4)
        })
        .collect();
    // The engine's kernels: the copy waits for them, so the checks below run during it.
    let producer = Event::new();
    stream.wait(&producer).unwrap();
    // SAFETY: the sources outlive the event; `access` pins the slot (a `Writing` reservation of
    // `owner`) until the callback drops it, after the copy.
    unsafe { stream.copy(pieces) }.unwrap();
    let copied = stream.record().unwrap();
    let visible_during = l1.reserve_read(owner, &[key], ExtraCount::ZERO).results[0];
    assert_eq!(visible_during.err(), Some(KeyError::NotReadable));
    assert_eq!(l1.finish_write(owner, &[key]), vec![Err(KeyError::Busy)], "the guard lives on");
    producer.fire(Ok(()));
    let finished = Arc::new(AtomicBool::new(false));
    let (l1_cb, done) = (Arc::clone(&l1), Arc::clone(&finished));
    copied.on_complete(move |result| {
        // The copy is over: the guard goes first, since `finish_write` refuses (`Busy`) a slot
        // a writer pins.
        drop(access);
        if result.is_ok() {
            l1_cb.finish_write(owner, &[key]);
        } else {
            l1_cb.abort_write(owner, &[key]);
        }
        done.store(true, Ordering::Release);
    });
    assert!(copied.wait(SECOND).is_err());
    while !finished.load(Ordering::Acquire) {
        std::thread::yield_now();
    }
    let after = l1.reserve_read(owner, &[key], ExtraCount::ZERO).results[0];
    assert_eq!(after.err(), Some(KeyError::NotFound), "the half-copied chunk never became visible");
    l1.audit().unwrap();
}

#[test]
fn a_strided_piece_moves_each_row_from_its_pitch_to_its_pitch() {
    // A chunk's block across 4 evenly spaced layers (rows of 64 bytes, 256 apart in the engine's
    // KV) gathered into a slot where they lie packed, then scattered into a second KV: one piece
    // each way, as the daemon sends a block of a registration's run of segments.
    let (rows, width, pitch) = (4u64, 64u64, 256u64);
    let kv: Vec<u8> = (0..rows * pitch).map(|i| (i % 251) as u8).collect();
    let mut slot = vec![0u8; (rows * width) as usize];
    let mut again = vec![0u8; (rows * pitch) as usize];
    let stream = EmulatedCopyEngine::new().stream().unwrap();
    let gather = Piece {
        src: At::Host(kv.as_ptr() as u64),
        src_pitch: pitch,
        dst: At::Device(slot.as_mut_ptr() as u64),
        dst_pitch: width,
        width,
        rows,
    };
    let scatter = Piece {
        src: gather.dst,
        src_pitch: width,
        dst: At::Host(again.as_mut_ptr() as u64),
        dst_pitch: pitch,
        width,
        rows,
    };
    // SAFETY: the buffers outlive the sync; the stream runs the two in order.
    unsafe { stream.copy(vec![gather]) }.unwrap();
    // SAFETY: as above.
    unsafe { stream.copy(vec![scatter]) }.unwrap();
    stream.sync().unwrap();
    for r in 0..rows as usize {
        let row = &kv[r * pitch as usize..][..width as usize];
        assert_eq!(&slot[r * width as usize..][..width as usize], row, "row {r} of the slot");
        assert_eq!(&again[r * pitch as usize..][..width as usize], row, "row {r} scattered");
        let gap = &again[r * pitch as usize + width as usize..(r + 1) * pitch as usize];
        assert!(gap.iter().all(|&b| b == 0), "row {r}: bytes between rows were written");
    }
}

#[test]
fn a_failure_belongs_to_the_record_after_its_work_not_to_one_still_in_flight() {
    // The contract both engines keep (the CUDA one tags each failure with its interval between
    // marks): a record still waiting when later work fails fires clean, and the record after
    // that work carries the failure.
    let engine = EmulatedCopyEngine::new();
    let stream = engine.stream().unwrap();
    let gate = Event::new();
    stream.wait(&gate).unwrap();
    let before = stream.record().unwrap();
    let failed = Event::new();
    failed.fire(Err(CopyError::Failed("the producer failed".into())));
    stream.wait(&failed).unwrap();
    let after = stream.record().unwrap();
    assert!(before.result().is_none(), "held by the gate");
    gate.fire(Ok(()));
    assert_eq!(before.wait(SECOND), Ok(()));
    assert!(matches!(after.wait(SECOND), Err(CopyError::Upstream(_))));
    assert_eq!(stream.record().unwrap().wait(SECOND), Ok(()), "reported once");
}

#[test]
fn a_sync_reports_a_failure_once_and_leaves_the_stream_clean() {
    let src = vec![1u8; 64];
    let bad = src.as_ptr() as u64;
    let engine = EmulatedCopyEngine::with_faults(Arc::new(move |p: &Piece| p.src == At::Host(bad)));
    let stream = engine.stream().unwrap();
    let mut dst = vec![0u8; 64];
    // SAFETY: the buffers outlive the syncs.
    unsafe { stream.copy(vec![piece(&src, &mut dst)]) }.unwrap();
    assert!(matches!(stream.sync(), Err(CopyError::Failed(_))));
    assert_eq!(dst, vec![0u8; 64], "the failed piece was not copied");
    let good = vec![2u8; 64];
    // SAFETY: as above.
    unsafe { stream.copy(vec![piece(&good, &mut dst)]) }.unwrap();
    assert_eq!(stream.sync(), Ok(()), "the earlier failure was reported once, not again");
    assert_eq!(dst, good);
}

#[test]
fn dropping_a_stream_with_work_in_flight_neither_hangs_nor_runs_it() {
    let engine = EmulatedCopyEngine::new();
    let stream = engine.stream().unwrap();
    let never = Event::new();
    stream.wait(&never).unwrap();
    let src = vec![3u8; 64];
    let mut dst = vec![0u8; 64];
    // SAFETY: the stream is dropped (its thread joined) before the buffers.
    unsafe { stream.copy(vec![piece(&src, &mut dst)]) }.unwrap();
    let pending = stream.record().unwrap();
    drop(stream);
    assert_eq!(pending.result(), Some(Err(CopyError::Stopped)));
    assert_eq!(dst, vec![0u8; 64], "nothing ran after the stop");
}

#[test]
fn a_stream_dropped_by_its_own_callback_stops_its_later_work_and_its_thread() {
    // The stream's last owner is dropped inside a callback on the stream's own thread: the
    // work queued after it is skipped and fires Stopped, as for any drop, with no panic.
    let engine = EmulatedCopyEngine::new();
    let stream: Arc<Mutex<Option<Box<dyn tierkv_l1::device::CopyStream>>>> =
        Arc::new(Mutex::new(Some(engine.stream().unwrap())));
    let gate = Event::new();
    let (first, later) = {
        let held = stream.lock();
        let s = held.as_ref().unwrap();
        s.wait(&gate).unwrap();
        (s.record().unwrap(), s.record().unwrap())
    };
    let owner = Arc::clone(&stream);
    first.on_complete(move |_| drop(owner.lock().take()));
    let callback_ran = Arc::new(AtomicBool::new(false));
    let ran = Arc::clone(&callback_ran);
    later.on_complete(move |_| ran.store(true, Ordering::Release));
    gate.fire(Ok(()));
    assert_eq!(first.wait(Duration::from_secs(10)), Ok(()));
    assert_eq!(later.wait(Duration::from_secs(10)), Err(CopyError::Stopped));
    // Its callbacks run after its waiters wake.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !callback_ran.load(Ordering::Acquire) {
        assert!(std::time::Instant::now() < deadline, "the later event's callback never ran");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(stream.lock().is_none());
}

#[test]
fn an_endless_wait_on_an_event_is_no_overflow() {
    let event = Event::new();
    let firing = event.clone();
    let fire = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(10));
        firing.fire(Ok(()));
    });
    assert_eq!(event.wait(Duration::MAX), Ok(()));
    fire.join().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Random copies over two streams, each stream ordered, the second waiting on the first's
    /// events: the final memory equals a sequential reference that applies the same ops in the
    /// order the events force.
    #[test]
    fn two_streams_joined_by_events_match_a_sequential_model(
        ops in proptest::collection::vec((0usize..2, 0usize..4, 0usize..4, any::<bool>()), 1..40)
    ) {
        const CELL: usize = 256;
        let engine = EmulatedCopyEngine::new();
        let streams = [engine.stream().unwrap(), engine.stream().unwrap()];
        // Four cells of memory; sources are distinct constant patterns.
        let mut memory = vec![0u8; 4 * CELL];
        let patterns: Vec<Vec<u8>> = (0..4u8).map(|i| vec![i * 40 + 1; CELL]).collect();
        let mut model = memory.clone();
        let base = memory.as_mut_ptr() as u64;
        for (stream, from, to, join) in ops {
            // Everything so far must land before this op: each op waits on all previous work,
            // so the order is total and the model is sequential.
            if join {
                let other = streams[1 - stream].record().unwrap();
                streams[stream].wait(&other).unwrap();
            } else {
                let own = streams[1 - stream].record().unwrap();
                own.wait(SECOND).unwrap();
            }
            let src = patterns[from].as_ptr() as u64;
            // SAFETY: `memory` and `patterns` outlive the final waits below.
            unsafe {
                streams[stream]
                    .copy(vec![Piece::contiguous(
                        At::Host(src),
                        At::Host(base + (to * CELL) as u64),
                        CELL as u64,
                    )])
                    .unwrap();
            }
            model[to * CELL..(to + 1) * CELL].copy_from_slice(&patterns[from]);
        }
        for s in &streams {
            s.record().unwrap().wait(SECOND).unwrap();
        }
        prop_assert_eq!(memory, model);
    }
}
