//! A40: 8 threads x 1,000 random write / read / release / delete cycles on shared keys, with
//! evictions, lease expiries and forced deletes racing them. Every writer of a key writes the
//! same bytes, so any read that differs from them is a torn or half-written object made visible.
//! At the end every owner returns what it holds, and the accounting and audit must be exact.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test"
)]

mod common;

use std::time::Duration;

use common::*;
use tierkv_core::KeyError;
use tierkv_l1::{L1Config, L1Error, Lifetime, OwnerId, Readers, WriteMode};

const THREADS: u64 = 8;
const CYCLES: u64 = 1_000;
const KEY_SPACE: u64 = 48;

/// xorshift64*: a deterministic, dependency-free generator per thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn cycle(f: &Fixture, owner: OwnerId, rng: &mut Rng) {
    let k = key(rng.below(KEY_SPACE));
    match rng.below(100) {
        // Write, sometimes as a temporary promotion, sometimes aborted.
        0..=34 => {
            let temporary = rng.below(5) == 0;
            let lifetime = if temporary {
                Lifetime::Temporary
            } else {
                Lifetime::Cached
            };
            let reserved =
                f.l1.reserve_write(owner, &[k], &layout(), WriteMode::Create, lifetime)
                    .unwrap();
            if reserved[0].is_err() {
                return;
            }
            {
                let mut guard = f.l1.write_access(owner, &k).unwrap();
                guard.write_at(0, &payload(&k, 0)).unwrap();
            }
            if rng.below(10) == 0 {
                // A forced delete may have removed the reservation meanwhile.
                let _ = f.l1.abort_write(owner, &[k]);
            } else if temporary {
                let grant =
                    f.l1.finish_write_and_reserve_read(owner, &[k], extra(rng.below(3) as i64));
                if let Some(lease) = grant.lease {
                    read_and_release(f, lease, &[k], grant.readers, rng);
                }
            } else {
                let _ = f.l1.finish_write(owner, &[k]);
            }
        }
        // Lease a short run of keys and read it with every reader.
        35..=79 => {
            let first = rng.below(KEY_SPACE - 3);
            let run: Vec<_> = (first..first + 1 + rng.below(3)).map(key).collect();
            let grant = f.l1.reserve_read(owner, &run, extra(rng.below(3) as i64));
            if let Some(lease) = grant.lease {
                let granted: Vec<_> = run
                    .iter()
                    .zip(&grant.results)
                    .filter(|(_, r)| r.is_ok())
                    .map(|(k, _)| *k)
                    .collect();
                read_and_release(f, lease, &granted, grant.readers, rng);
            }
        }
        80..=89 => {
            let _ = f.l1.delete(&[k], rng.below(10) == 0);
        }
        90..=94 => {
            f.l1.evict_to_watermark();
        }
        95..=97 => {
            f.clock.advance(Duration::from_millis(rng.below(20)));
            f.l1.expire_leases();
        }
        _ => {
            let _ = f.l1.clear(false);
        }
    }
}

/// Every reader reads every key and returns its share; some readers try to return it twice
/// (refused), some never return it (the lease expires, or their owner's cleanup returns it).
fn read_and_release(
    f: &Fixture,
    lease: tierkv_l1::LeaseId,
    keys: &[tierkv_core::ObjectKey],
    readers: u32,
    rng: &mut Rng,
) {
    for reader in 0..readers as u8 {
        for k in keys {
            match f.l1.read_access(lease, reader, k) {
                Ok(guard) => {
                    let mut bytes = vec![0; SLOT as usize];
                    guard.read_at(0, &mut bytes).unwrap();
                    assert!(
                        bytes == payload(k, 0),
                        "a reader saw bytes nobody finished writing for {k:?}"
                    );
                }
                Err(L1Error::LeaseExpired(_)) => return,
                // A forced delete removed the object under the lease.
                Err(L1Error::Key {
                    error: KeyError::NotFound,
                    ..
                }) => {}
                Err(other) => panic!("unexpected read refusal: {other}"),
            }
        }
        match rng.below(10) {
            0 => continue, // this reader never releases
            1 => {
                let _ = f.l1.finish_read(lease, Readers::One(reader), None);
                let again = f.l1.finish_read(lease, Readers::One(reader), None);
                assert!(
                    again.is_err(),
                    "a second release by one reader was accepted"
                );
            }
            _ => match f.l1.finish_read(lease, Readers::One(reader), None) {
                Ok(_) | Err(L1Error::LeaseExpired(_)) => {}
                Err(other) => panic!("unexpected release refusal: {other}"),
            },
        }
    }
}

#[test]
fn a40_eight_threads_of_random_cycles_keep_the_accounting_exact() {
    let f = with_config(L1Config {
        lease_ttl: Duration::from_millis(50),
        ..config(32)
    });
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let f = &f;
            s.spawn(move || {
                let mut rng =
                    Rng(0x9e37_79b9_7f4a_7c15 ^ (t + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
                for _ in 0..CYCLES {
                    cycle(f, OwnerId(t), &mut rng);
                }
            });
        }
    });
    for t in 0..THREADS {
        f.l1.release_owner(OwnerId(t));
    }
    f.assert_consistent();
    let u = f.usage();
    assert_eq!((u.used_bytes, u.writing, u.leased), (0, 0, 0), "{u:?}");
    assert_eq!(f.l1.active_leases(), 0);
}
