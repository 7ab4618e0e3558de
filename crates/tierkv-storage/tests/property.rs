//! Random interleavings of everything a worker and an operator do, on the real tiers: writes
//! (some never finished), lookups with random extra_count (some hits larger than L1's room, held
//! in their tier), reads, reader releases (some doubled,
//! some never made and left to their deadline), deletes, clears and background evictions, under
//! every store policy. Every byte read is checked against what was written. At quiescence (the
//! clock moved past every deadline, the pipelines idle): no share is left, no tier holds a lock,
//! L1's used bytes are exactly the unfinished writes, and L1's own audit passes.

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use tierkv_core::{ExtraCount, Layout, ManualClock, ObjectKey};
use tierkv_disk::{BLOCK, DiskStoreConfig, record_bytes};
use tierkv_l1::{DeviceKind, L1Config, OwnerId, Readers, Watermark};
use tierkv_l2::{HostMemory, HostStoreConfig};
use tierkv_storage::{
    HitChunk, LookupId, StorageConfig, StorageError, StorageManager, StorePolicy,
};
use tierkv_testkit::contract::{key, payload};

const CHUNK: u64 = 4 << 10;
const KEYS: u64 = 12;
const TTL: Duration = Duration::from_secs(5);
const WAIT: Duration = Duration::from_secs(20);

#[derive(Clone, Debug)]
enum Op {
    Write {
        first: u64,
        len: u64,
        finish: bool,
        owner: u8,
    },
    Lookup {
        first: u64,
        len: u64,
        extra: u8,
        owner: u8,
    },
    Read {
        pick: usize,
        reader: u8,
    },
    Release {
        pick: usize,
        readers: u8,
        twice: bool,
    },
    ReleaseAll {
        pick: usize,
    },
    Delete {
        first: u64,
        len: u64,
    },
    ClearL1,
    Settle,
    /// The clock moves past every lease deadline taken so far.
    Expire,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KEYS, 1u64..5, prop::bool::weighted(0.9), 0u8..2)
            .prop_map(|(first, len, finish, owner)| Op::Write { first, len, finish, owner }),
        4 => (0..KEYS, 1u64..6, 0u8..3, 0u8..2).prop_map(|(first, len, extra, owner)| Op::Lookup { first, len, extra, owner }),
        3 => (0usize..16, 0u8..4).prop_map(|(pick, reader)| Op::Read { pick, reader }),
        4 => (0usize..16, 0u8..8, prop::bool::weighted(0.2)).prop_map(|(pick, readers, twice)| Op::Release { pick, readers, twice }),
        1 => (0usize..16).prop_map(|pick| Op::ReleaseAll { pick }),
        1 => (0..KEYS, 1u64..4).prop_map(|(first, len)| Op::Delete { first, len }),
        1 => Just(Op::ClearL1),
        1 => Just(Op::Settle),
        1 => Just(Op::Expire),
    ]
}

fn policy() -> impl Strategy<Value = StorePolicy> {
    prop_oneof![
        Just(StorePolicy::WriteThrough),
        Just(StorePolicy::DiskAdmission { min_reads: 2 }),
        Just(StorePolicy::WriteBack),
        Just(StorePolicy::Cascade),
    ]
}

fn chain(first: u64, len: u64) -> Vec<ObjectKey> {
    (first..(first + len).min(KEYS)).map(key).collect()
}

fn owner(o: u8) -> OwnerId {
    OwnerId(u64::from(o) + 1)
}

fn eventually(what: &str, mut done: impl FnMut() -> bool) -> Result<(), TestCaseError> {
    let deadline = Instant::now() + WAIT;
    while !done() {
        if Instant::now() > deadline {
            return Err(TestCaseError::fail(format!("never: {what}")));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

fn run(policy: StorePolicy, l1_chunks: u64, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let segment_bytes = BLOCK + 4 * record_bytes(CHUNK);
    let config = StorageConfig {
        l1: L1Config {
            device: DeviceKind::Emulated,
            lease_ttl: TTL,
            watermark: Watermark { high: 0.9, low: 0.6 },
            ..L1Config::new(l1_chunks * CHUNK, CHUNK)
        },
        l2: Some(HostStoreConfig {
            memory: HostMemory::Plain,
            ..HostStoreConfig::new(8 * CHUNK, CHUNK)
        }),
        disk: Some(DiskStoreConfig {
            segment_bytes,
            io_threads: 2,
            ..DiskStoreConfig::new(dir.path(), 4 * segment_bytes, CHUNK)
        }),
        store_policy: policy,
        maintenance_interval: Duration::from_millis(2),
        ..StorageConfig::new(L1Config::new(CHUNK, CHUNK))
    };
    let clock = Arc::new(ManualClock::new());
    let s = StorageManager::start_with_clock(config, clock.clone()).unwrap();
    let layout = Layout::bytes(CHUNK).unwrap();
    let mut lookups: Vec<(LookupId, Vec<ObjectKey>, usize)> = Vec::new();
    // The reference model of every lookup's readers (H16 #10, #12): (readers, returned). A
    // release is accepted iff it names readers the lookup has that have not returned their
    // share, empty hits included; a refused one changes nothing; the last reader ends it.
    // With the hit's size and the clock epoch the lookup was made in: all of a lookup's leases
    // are taken at one instant of the manual clock, so they expire together, and after that
    // a release of a lookup that holds chunks is refused (and changes nothing).
    let mut ledger: std::collections::HashMap<LookupId, (u32, u128, usize, u32)> =
        std::collections::HashMap::new();
    let mut epoch = 0u32;
    let mut unfinished: Vec<(OwnerId, ObjectKey)> = Vec::new();
    for op in ops {
        match op {
            Op::Write { first, len, finish, owner: o } => {
                let keys = chain(first, len);
                let reserved = s.reserve_write(owner(o), &keys, &layout).unwrap();
                let mine: Vec<ObjectKey> = keys
                    .iter()
                    .zip(&reserved)
                    .filter(|(_, r)| r.is_ok())
                    .map(|(k, _)| *k)
                    .collect();
                for k in &mine {
                    s.write_access(owner(o), k).unwrap().write_at(0, &payload(k, CHUNK)).unwrap();
                }
                if finish {
                    prop_assert!(
                        s.finish_write(owner(o), &mine).unwrap().iter().all(|r| r.is_ok())
                    );
                } else {
                    unfinished.extend(mine.iter().map(|k| (owner(o), *k)));
                }
            }
            Op::Lookup { first, len, extra, owner: o } => {
                let keys = chain(first, len);
                let id = s
                    .submit_prefetch(
                        owner(o),
                        keys.clone(),
                        ExtraCount::new(i64::from(extra)).unwrap(),
                        layout.clone(),
                    )
                    .unwrap();
                let result = s
                    .wait(id, WAIT)
                    .map_err(|e| TestCaseError::fail(format!("lookup failed: {e}")))?;
                prop_assert!(result.hit_chunks <= keys.len());
                prop_assert_eq!(result.per_tier.iter().sum::<usize>(), result.hit_chunks);
                ledger.insert(id, (result.readers, 0, result.hit_chunks, epoch));
                lookups.push((id, keys, result.hit_chunks));
            }
            Op::Read { pick, reader } => {
                let Some((id, keys, hit)) = lookups.get(pick % (lookups.len() + 1)) else {
                    continue;
                };
                // A chunk of the hit is pinned in L1 or, where L1 had no room, read from the tier
                // holding it: either way its bytes are its own. A reader the ledger says still
                // holds its share of a lookup of this epoch must be let read.
                let live = ledger.get(id).is_some_and(|(n, returned, _, made)| {
                    u32::from(reader) < *n && returned & (1u128 << reader) == 0 && *made == epoch
                });
                for k in &keys[..*hit] {
                    let read = s.read_hit(*id, reader, std::slice::from_ref(k), CHUNK);
                    prop_assert!(
                        read.is_ok() || !live,
                        "{:?}: a live reader was refused its hit: {:?}",
                        k,
                        read.as_ref().err()
                    );
                    let Ok(mut chunks) = read else {
                        continue;
                    };
                    let bytes = match chunks.pop() {
                        Some(HitChunk::L1(guard)) => {
                            let mut bytes = vec![0; CHUNK as usize];
                            guard.read_at(0, &mut bytes).unwrap();
                            bytes
                        }
                        Some(HitChunk::Loaded(bytes)) => bytes.to_vec(),
                        None => continue,
                    };
                    prop_assert!(bytes == payload(k, CHUNK), "{k:?} read other bytes");
                }
            }
            Op::Release { pick, readers, twice } => {
                let Some((id, ..)) = lookups.get(pick % (lookups.len() + 1)) else { continue };
                let mask = u128::from(readers).max(1);
                let readers = Readers::Set(mask);
                for _ in 0..if twice { 2 } else { 1 } {
                    let expected = match ledger.get(id) {
                        None => Err("unknown"),
                        Some((n, ..)) if mask >> n != 0 => Err("no such reader"),
                        Some((_, returned, ..)) if mask & returned != 0 => Err("share returned"),
                        // Past its deadline a lookup expires, a miss included (it would
                        // otherwise be kept until every reader returned a share of nothing).
                        Some((.., made)) if *made < epoch => Err("expired"),
                        Some(_) => Ok(()),
                    };
                    let got = s.release(*id, readers);
                    if expected == Err("expired") {
                        // Refused; the maintenance tick may also have forgotten it meanwhile.
                        prop_assert!(got.is_err(), "a release of expired leases was accepted");
                        continue;
                    }
                    prop_assert_eq!(got.is_ok(), expected.is_ok(), "{:?}: {:?}", expected, got);
                    if let (Ok(ended), Some((n, returned, ..))) = (got, ledger.get_mut(id)) {
                        *returned |= mask;
                        let all = if *n >= 128 { u128::MAX } else { (1u128 << *n) - 1 };
                        prop_assert_eq!(ended, *returned == all);
                        if ended {
                            ledger.remove(id);
                        }
                    }
                }
            }
            Op::ReleaseAll { pick } => {
                let len = lookups.len();
                if len > 0 {
                    let (id, ..) = lookups.remove(pick % len);
                    let _ = s.release_all(id);
                    ledger.remove(&id);
                }
            }
            Op::Delete { first, len } => drop(s.delete(&chain(first, len))),
            Op::ClearL1 => drop(s.clear_l1(false)),
            Op::Settle => {
                eventually("the store pipeline idles", || s.status().store_in_flight == 0)?
            }
            Op::Expire => {
                clock.advance(TTL * 2);
                epoch += 1;
            }
        }
    }
    // Quiescence: let the pipelines finish, then move past every deadline.
    eventually("the store pipeline idles", || s.status().store_in_flight == 0)?;
    clock.advance(TTL * 2);
    eventually("every share came back", || s.l1().usage().leased == 0)?;
    eventually("the store pipeline idles", || s.status().store_in_flight == 0)?;
    // Tier locks of hits held below L1 go back when the maintenance thread forgets their
    // expired lookups, a tick after the L1 shares.
    eventually("every tier lock came back", || {
        s.status().tiers.iter().all(|(_, usage)| usage.locks == 0)
    })?;
    let status = s.status();
    for (name, usage) in &status.tiers {
        prop_assert_eq!(usage.locks, 0, "tier {} holds locks", name);
    }
    // Under write-back the maintenance thread may still be leasing victims over the high
    // watermark and copying them down: wait for L1 to settle.
    let settled = unfinished.len() as u64 * CHUNK;
    let _ = eventually("L1 settles", || {
        s.status().store_in_flight == 0 && s.l1().usage().used_bytes == settled
    });
    let usage = s.l1().usage();
    prop_assert_eq!(usage.writing, unfinished.len() as u64, "{:?}", usage);
    prop_assert_eq!(
        usage.used_bytes,
        unfinished.len() as u64 * CHUNK,
        "used bytes are the unfinished writes: {:?}",
        usage
    );
    // The audit reads shard by shard: a write-back lease being taken meanwhile (its shares
    // counted, its record not yet filed) looks torn for a moment. A real fault stays.
    let deadline = Instant::now() + WAIT;
    while let Err(fault) = s.l1().audit() {
        if Instant::now() > deadline {
            return Err(TestCaseError::fail(fault));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    // Unfinished writes belong to their owners, whose departure returns them.
    for o in 0..2 {
        s.release_owner(owner(o));
    }
    // (Write-back may lease victims again meanwhile; its copies return them.)
    let _ = eventually("L1 empties", || {
        s.status().store_in_flight == 0 && s.l1().usage().used_bytes == 0
    });
    prop_assert_eq!(s.l1().usage().used_bytes, 0);
    let unknown = s.release(LookupId(u64::MAX), Readers::All);
    prop_assert!(matches!(unknown, Err(StorageError::UnknownLookup(_))));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn interleavings_end_with_no_share_no_lock_and_exact_usage(policy in policy(), l1_chunks in prop_oneof![Just(4u64), Just(10u64)], ops in prop::collection::vec(op(), 1..40)) {
        run(policy, l1_chunks, ops)?;
    }
}
