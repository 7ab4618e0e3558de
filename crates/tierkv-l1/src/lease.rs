//! Read leases: the ledger of who holds which share of which key.
//!
//! A lease is taken for a batch of keys and `1 + extra_count` readers. For every key it keeps a
//! bitmap of the readers that still hold their share (readers are numbered `0..=extra_count`, so
//! 128 readers fit one `u128`). A release names its readers; returning a share clears that
//! reader's bit, so a second release by the same reader finds the bit clear and is refused
//! instead of taking another reader's share. The entry's share counter in the index is only
//! ever changed together with these bits, which is how "count readers, not handles" holds.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use foldhash::fast::RandomState;
use parking_lot::{Mutex, MutexGuard};
use tierkv_core::ObjectKey;

use crate::error::L1Error;

/// Identifies a read lease; never reused within one manager.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Who made a reservation or took a lease: a client connection, or an internal pipeline.
/// Everything an owner holds can be returned at once when it goes away.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerId(pub u64);

/// Which readers of a lease a release speaks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readers {
    /// One reader, numbered from 0 to `extra_count`.
    One(u8),
    /// Every reader of the lease.
    All,
    /// A set of readers: bit `r` stands for reader `r`.
    Set(u128),
}

impl Readers {
    /// The reader bitmap this selection stands for in a lease of `readers` readers.
    pub(crate) fn mask(self, lease: LeaseId, readers: u32) -> Result<u128, L1Error> {
        let all = all_readers(readers);
        let mask = match self {
            Readers::One(r) if u32::from(r) < readers => 1u128 << r,
            Readers::All => all,
            Readers::Set(set) if set != 0 && set & !all == 0 => set,
            Readers::One(reader) => {
                return Err(L1Error::NoSuchReader { lease, reader, readers });
            }
            // The lowest reader outside the lease names the problem; an empty set names reader 0
            // (an empty release would be a silent no-op, which the rules forbid).
            Readers::Set(set) => {
                let outside = set & !all;
                let reader = if outside == 0 { 0 } else { outside.trailing_zeros() as u8 };
                return Err(L1Error::NoSuchReader { lease, reader, readers });
            }
        };
        Ok(mask)
    }
}

/// The bitmap of every reader of a lease with `readers` readers (1..=128).
pub(crate) fn all_readers(readers: u32) -> u128 {
    if readers >= 128 { u128::MAX } else { (1u128 << readers) - 1 }
}

/// One key's shares within a lease.
pub(crate) struct KeyShares {
    /// The entry version the shares were taken on; a force-deleted and re-created key has
    /// another, so stale shares never touch the new entry.
    pub(crate) generation: u64,
    /// Readers still holding their share.
    pub(crate) outstanding: u128,
    /// Set while a release request is being validated (finds duplicates in the request).
    pub(crate) marked: bool,
}

pub(crate) struct LeaseRecord {
    pub(crate) owner: OwnerId,
    pub(crate) readers: u32,
    pub(crate) deadline: Duration,
    pub(crate) keys: HashMap<ObjectKey, KeyShares, RandomState>,
}

impl LeaseRecord {
    pub(crate) fn new(owner: OwnerId, readers: u32, deadline: Duration, capacity: usize) -> Self {
        LeaseRecord {
            owner,
            readers,
            deadline,
            keys: HashMap::with_capacity_and_hasher(capacity, RandomState::default()),
        }
    }
}

/// What became of a lease that is no longer live, so a late caller is told why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tomb {
    Released,
    Revoked,
}

pub(crate) struct LeaseShard {
    pub(crate) live: HashMap<u64, LeaseRecord, RandomState>,
    tombs: HashMap<u64, Tomb, RandomState>,
    tomb_order: VecDeque<u64>,
}

/// Ended leases remembered per shard, to tell a late release "expired" or "released" rather
/// than "unknown". Older ones are forgotten; a release that late is reported as unknown.
const TOMBS_PER_SHARD: usize = 4096;

impl LeaseShard {
    /// Records how a lease ended.
    fn bury(&mut self, id: LeaseId, tomb: Tomb) {
        if self.tomb_order.len() == TOMBS_PER_SHARD
            && let Some(old) = self.tomb_order.pop_front()
        {
            self.tombs.remove(&old);
        }
        self.tombs.insert(id.0, tomb);
        self.tomb_order.push_back(id.0);
    }

    pub(crate) fn bury_released(&mut self, id: LeaseId) {
        self.bury(id, Tomb::Released);
    }

    pub(crate) fn bury_revoked(&mut self, id: LeaseId) {
        self.bury(id, Tomb::Revoked);
    }

    /// The error for a lease that is not live.
    pub(crate) fn gone(&self, id: LeaseId) -> L1Error {
        match self.tombs.get(&id.0) {
            Some(Tomb::Released) => L1Error::LeaseReleased(id),
            Some(Tomb::Revoked) => L1Error::LeaseExpired(id),
            None => L1Error::UnknownLease(id),
        }
    }
}

/// Live leases, sharded by id, plus recently ended ones.
pub(crate) struct LeaseTable {
    shards: Box<[Mutex<LeaseShard>]>,
    next_id: AtomicU64,
}

pub(crate) const LEASE_SHARDS: usize = 16;

impl LeaseTable {
    pub(crate) fn new() -> Self {
        let shards = (0..LEASE_SHARDS)
            .map(|_| {
                Mutex::new(LeaseShard {
                    live: HashMap::default(),
                    tombs: HashMap::default(),
                    tomb_order: VecDeque::new(),
                })
            })
            .collect();
        LeaseTable { shards, next_id: AtomicU64::new(1) }
    }

    pub(crate) fn shard(&self, id: LeaseId) -> MutexGuard<'_, LeaseShard> {
        self.shards[(id.0 % LEASE_SHARDS as u64) as usize].lock()
    }

    pub(crate) fn shards(&self) -> impl Iterator<Item = &Mutex<LeaseShard>> {
        self.shards.iter()
    }

    /// A new lease id with its shard locked. The caller takes the lease's shares in the index
    /// while it holds the lock and records them with [`LeaseTable::open`] before it lets go, so
    /// an audit (which locks every lease shard, then every index shard) never sees shares the
    /// ledger does not hold.
    pub(crate) fn mint(&self) -> (LeaseId, MutexGuard<'_, LeaseShard>) {
        let id = LeaseId(self.next_id.fetch_add(1, Ordering::Relaxed));
        (id, self.shard(id))
    }

    /// Records the lease `id` minted with `shard` ([`LeaseTable::mint`]) with its shares, and
    /// returns it; `None` for a lease that got no key. Such an id is handed back unless another
    /// was minted since, so ids stay consecutive where leases do not race (a gap is harmless:
    /// an unused id was never told to anyone).
    pub(crate) fn open(
        &self,
        mut shard: MutexGuard<'_, LeaseShard>,
        id: LeaseId,
        record: LeaseRecord,
    ) -> Option<LeaseId> {
        if record.keys.is_empty() {
            let _ =
                self.next_id.compare_exchange(id.0 + 1, id.0, Ordering::Relaxed, Ordering::Relaxed);
            return None;
        }
        shard.live.insert(id.0, record);
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_masks_are_checked_against_the_lease() {
        let lease = LeaseId(1);
        assert_eq!(Readers::One(0).mask(lease, 1).unwrap(), 1);
        assert_eq!(Readers::All.mask(lease, 3).unwrap(), 0b111);
        assert_eq!(Readers::All.mask(lease, 128).unwrap(), u128::MAX);
        assert_eq!(Readers::Set(0b110).mask(lease, 3).unwrap(), 0b110);
        let no_reader =
            |r: Readers, n| matches!(r.mask(lease, n), Err(L1Error::NoSuchReader { .. }));
        assert!(no_reader(Readers::One(1), 1));
        assert!(no_reader(Readers::Set(0b1000), 3));
        assert!(no_reader(Readers::Set(0), 3));
    }

    #[test]
    fn tombs_are_bounded_and_tell_why() {
        let table = LeaseTable::new();
        let mut shard = table.shard(LeaseId(0));
        shard.bury_released(LeaseId(0));
        shard.bury_revoked(LeaseId(16));
        assert_eq!(shard.gone(LeaseId(0)), L1Error::LeaseReleased(LeaseId(0)));
        assert_eq!(shard.gone(LeaseId(16)), L1Error::LeaseExpired(LeaseId(16)));
        assert_eq!(shard.gone(LeaseId(32)), L1Error::UnknownLease(LeaseId(32)));
        for i in 0..TOMBS_PER_SHARD as u64 {
            shard.bury_released(LeaseId(1000 + i));
        }
        assert_eq!(shard.gone(LeaseId(0)), L1Error::UnknownLease(LeaseId(0)));
        assert_eq!(shard.tombs.len(), TOMBS_PER_SHARD);
    }
}
