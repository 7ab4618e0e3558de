//! Chunks on their way to a tier below, served meanwhile by the tier that holds their board.
//!
//! Under the cascade a chunk evicted above the disk travels to it as a copy in memory, through
//! the store pipeline's queue and the disk's write. Until the disk has it, a lookup would find
//! it in neither tier, miss, and the engine would compute and store it again. So the chunk
//! leaves as a [`Departing`] copy registered on a [`Departures`] board, and the tier that owns
//! the board finds, locks and loads it from that copy: L2 its own victims, the disk the victims
//! L1 hands it straight when there is no L2. Dropping the `Departing` (the tier below answered
//! its store, or the chunk was given up) lands it: the key stops being served from the board once
//! none of its departures is on its way and no lookup holds a lock on it. A delete withdraws a
//! key's departures ([`ChunkSource::withdrawn`]): the tier below must not keep them.
//!
//! The board has a lock of its own. A tier that also holds its index lock takes the index lock
//! first, so that a lookup finds each victim in one of the two.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use foldhash::fast::RandomState;
use parking_lot::{Mutex, MutexGuard};

use crate::adapter::{BufferError, ChunkSource};
use crate::key::ObjectKey;

/// The chunks on their way down that one tier serves.
#[derive(Default)]
pub struct Departures {
    board: Arc<Mutex<Board>>,
}

/// The keys on their way, under the board's lock.
#[derive(Default)]
pub struct Board {
    leaving: HashMap<ObjectKey, Leaving, RandomState>,
}

/// A key on its way down, as the board serves it: from its newest copy.
struct Leaving {
    bytes: Arc<[u8]>,
    /// Locks taken by lookups and not yet returned.
    locks: u64,
    /// Departures of the key not yet landed (a key can leave again before the last one landed:
    /// the same key, the same bytes).
    in_flight: u32,
    /// Set when the key is deleted from the board: every departure of this entry is then
    /// withdrawn. Its identity names the entry, so a departure never settles a later entry of
    /// its key.
    withdrawn: Arc<AtomicBool>,
}

/// A chunk on its way to the tier below, with a copy of its bytes. Until it is dropped, the
/// board's tier finds, locks and loads the chunk as if it had not left; so the holder drops it
/// once the tier below has it, or has given up on it.
pub struct Departing {
    key: ObjectKey,
    bytes: Arc<[u8]>,
    withdrawn: Arc<AtomicBool>,
    board: Weak<Mutex<Board>>,
}

impl Departures {
    /// An empty board.
    pub fn new() -> Self {
        Self::default()
    }

    /// The board, locked. Take a tier's own index lock, if any, before this one.
    pub fn lock(&self) -> MutexGuard<'_, Board> {
        self.board.lock()
    }

    /// Puts `key` on its way down with `bytes`, served from the board until the returned
    /// chunk is dropped.
    pub fn depart(&self, key: ObjectKey, bytes: Arc<[u8]>) -> Departing {
        let withdrawn = self.board.lock().depart(key, Arc::clone(&bytes));
        Departing { key, bytes, withdrawn, board: Arc::downgrade(&self.board) }
    }
}

impl Board {
    /// Registers one more departure of `key` with `bytes`; returns its entry's withdrawal flag.
    fn depart(&mut self, key: ObjectKey, bytes: Arc<[u8]>) -> Arc<AtomicBool> {
        let entry = self.leaving.entry(key).or_insert_with(|| Leaving {
            bytes: Arc::clone(&bytes),
            locks: 0,
            in_flight: 0,
            withdrawn: Arc::default(),
        });
        // Leaving again before it landed: the same key, the same bytes; its locks stay.
        entry.bytes = bytes;
        entry.in_flight += 1;
        Arc::clone(&entry.withdrawn)
    }

    /// Whether `key` is on its way (or landed and still locked).
    pub fn contains(&self, key: &ObjectKey) -> bool {
        self.leaving.contains_key(key)
    }

    /// Whether a lookup holds `key` here.
    pub fn is_locked(&self, key: &ObjectKey) -> bool {
        self.leaving.get(key).is_some_and(|entry| entry.locks > 0)
    }

    /// Takes a lock on `key` if it is here; returns whether it was.
    pub fn lock(&mut self, key: &ObjectKey) -> bool {
        let Some(entry) = self.leaving.get_mut(key) else { return false };
        entry.locks += 1;
        true
    }

    /// Returns a lock on `key`, if one is held here; returns whether one was.
    pub fn unlock(&mut self, key: &ObjectKey) -> bool {
        let Some(entry) = self.leaving.get_mut(key).filter(|l| l.locks > 0) else { return false };
        entry.locks -= 1;
        if entry.locks == 0 && entry.in_flight == 0 {
            self.leaving.remove(key);
        }
        true
    }

    /// The bytes of `key`, if it is here with `len` bytes: shared, for a copy outside the lock.
    pub fn bytes(&self, key: &ObjectKey, len: u64) -> Option<Arc<[u8]>> {
        let entry = self.leaving.get(key)?;
        (entry.bytes.len() as u64 == len).then(|| Arc::clone(&entry.bytes))
    }

    /// Takes `key` off the board unless a lookup holds it, withdrawing its departures; returns
    /// whether it was taken.
    pub fn delete(&mut self, key: &ObjectKey) -> bool {
        match self.leaving.get(key) {
            Some(entry) if entry.locks == 0 => entry.withdrawn.store(true, Ordering::Release),
            _ => return false,
        }
        self.leaving.remove(key);
        true
    }

    /// Every key here.
    pub fn keys(&self) -> impl Iterator<Item = &ObjectKey> {
        self.leaving.keys()
    }

    /// Keys on their way now (a departure not yet landed), and their bytes.
    pub fn departing(&self) -> (u64, u64) {
        let on_their_way = self.leaving.values().filter(|l| l.in_flight > 0);
        on_their_way.fold((0, 0), |(n, b), l| (n + 1, b + l.bytes.len() as u64))
    }

    /// A departure of `key` is over. `withdrawn` names the entry it left with: one deleted
    /// meanwhile (and perhaps departed again since) is not this departure's to settle.
    fn landed(&mut self, key: &ObjectKey, withdrawn: &Arc<AtomicBool>) {
        let Some(entry) = self.leaving.get_mut(key) else { return };
        if !Arc::ptr_eq(&entry.withdrawn, withdrawn) {
            return;
        }
        entry.in_flight -= 1;
        if entry.in_flight == 0 && entry.locks == 0 {
            self.leaving.remove(key);
        }
    }
}

impl Departing {
    /// A chunk on its way down that no tier serves meanwhile (on its way to a remote tier, which
    /// the node's tiers do not stand in for): never withdrawn.
    pub fn unserved(key: ObjectKey, bytes: Arc<[u8]>) -> Self {
        Departing { key, bytes, withdrawn: Arc::default(), board: Weak::new() }
    }

    /// The chunk's key.
    pub fn key(&self) -> ObjectKey {
        self.key
    }
}

impl ChunkSource for Departing {
    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), BufferError> {
        if dst.len() != self.bytes.len() {
            return Err(BufferError::LengthMismatch {
                buffer: self.bytes.len() as u64,
                copy: dst.len() as u64,
            });
        }
        dst.copy_from_slice(&self.bytes);
        Ok(())
    }

    fn host_bytes(&self) -> Option<&[u8]> {
        Some(&self.bytes)
    }

    fn withdrawn(&self) -> bool {
        self.withdrawn.load(Ordering::Acquire)
    }
}

impl Drop for Departing {
    fn drop(&mut self) {
        if let Some(board) = self.board.upgrade() {
            board.lock().landed(&self.key, &self.withdrawn);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{ChunkHash, KvRank, Namespace};

    fn key(n: u128) -> ObjectKey {
        ObjectKey::new(Namespace::new("departures", ""), ChunkHash(n), KvRank::Shared)
    }

    #[test]
    fn a_key_is_served_until_its_last_departure_lands_and_its_last_lock_returns() {
        let departures = Departures::new();
        let first = departures.depart(key(1), Arc::from(vec![1u8; 4]));
        let second = departures.depart(key(1), Arc::from(vec![1u8; 4]));
        assert!(departures.lock().lock(&key(1)));
        drop(second);
        assert!(departures.lock().contains(&key(1)), "the first is still on its way");
        drop(first);
        assert_eq!(departures.lock().bytes(&key(1), 4).as_deref(), Some(&[1u8; 4][..]));
        assert_eq!(departures.lock().bytes(&key(1), 5), None, "another length is not this chunk");
        assert!(departures.lock().unlock(&key(1)));
        assert!(!departures.lock().contains(&key(1)));
        assert!(!departures.lock().unlock(&key(1)), "no lock left to return");
    }

    #[test]
    fn a_delete_withdraws_the_departures_it_took_and_spares_a_locked_key() {
        let departures = Departures::new();
        let first = departures.depart(key(1), Arc::from(vec![1u8; 4]));
        assert!(departures.lock().lock(&key(1)));
        assert!(!departures.lock().delete(&key(1)), "locked");
        assert!(departures.lock().unlock(&key(1)));
        assert!(departures.lock().delete(&key(1)));
        assert!(first.withdrawn());
        // Departing again after the delete: a new entry, which the withdrawn one cannot settle.
        let again = departures.depart(key(1), Arc::from(vec![1u8; 4]));
        assert_eq!(departures.lock().departing(), (1, 4));
        drop(first);
        assert!(departures.lock().contains(&key(1)) && !again.withdrawn());
        drop(again);
        assert_eq!(departures.lock().departing(), (0, 0));
    }
}
