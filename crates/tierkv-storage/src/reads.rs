//! Read counts for admission after reads: disk admission (`StorePolicy::DiskAdmission`) and
//! remote admission (`RemoteAdmission::AfterReads`) send a chunk down once it has been read
//! often enough, and never send one back to the remote tier that served it.
//!
//! The chunks the remote tier served are also what keeps the store pipeline from writing them
//! back to it (write-back, a clean stop's hand-down, a demotion): Redis holds them already
//! ([`ReadCounts::remote_holds`]), whatever the admission. A chunk this node stores itself is
//! forgotten there ([`ReadCounts::stored_here`]): it computed the chunk, so the remote tier most
//! likely lost it, and it goes there as any chunk of this node's.
//!
//! Both records are bounded, and apart: the counts start over when they pass their bound, which
//! costs at most a few reads more before a chunk is admitted; the chunks the remote tier served
//! are kept through that, since forgetting one sends it back to the remote tier at its next
//! reads. They are kept in two generations of a bounded size: a chunk served or read again
//! moves to the newest, so only a chunk neither served nor read while a whole generation of
//! others arrived is forgotten.

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use tierkv_core::ObjectKey;

/// Where a chunk read just now goes, by the thresholds it reached with this read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Admit {
    /// Its reads reached disk admission's threshold.
    pub(crate) disk: bool,
    /// Its reads reached remote admission's threshold, and the remote tier never served it.
    pub(crate) remote: bool,
}

/// Reads counted per chunk, and the chunks the remote tier served, each for about `cap`
/// chunks at most.
pub(crate) struct ReadCounts {
    /// Reads per chunk; they start over past `cap` chunks.
    counts: HashMap<ObjectKey, u32>,
    /// Chunks the remote tier served: the newest generation, then the one before it. A
    /// generation of `cap / 2` chunks becomes the older one and the older is forgotten.
    from_remote: [HashSet<ObjectKey>; 2],
    cap: usize,
}

impl ReadCounts {
    /// Counts for at most about `cap` chunks, and as many chunks the remote tier served.
    pub(crate) fn new(cap: usize) -> Self {
        ReadCounts { counts: HashMap::new(), from_remote: [HashSet::new(), HashSet::new()], cap }
    }

    /// Keeps the counts within their bound before a lookup's reads are counted. The chunks the
    /// remote tier served are kept.
    pub(crate) fn bound(&mut self) {
        if self.counts.len() > self.cap {
            self.counts.clear();
        }
    }

    /// Counts one read of `key` (served by the remote tier if `from_remote`) and says which
    /// thresholds (`disk`, `remote`: reads to admission, if admitted after reads) it reached now.
    pub(crate) fn read(
        &mut self,
        key: ObjectKey,
        from_remote: bool,
        disk: Option<u32>,
        remote: Option<u32>,
    ) -> Admit {
        let came_from_remote = self.remember_remote(key, from_remote);
        let count = self.counts.entry(key).or_insert(0);
        *count = count.saturating_add(1);
        Admit { disk: Some(*count) == disk, remote: Some(*count) == remote && !came_from_remote }
    }

    /// Takes back one read of `key`: the admission it reached was not carried out (no room for
    /// its copy), so that its next read reaches the threshold again.
    pub(crate) fn unread(&mut self, key: &ObjectKey) {
        if let Some(count) = self.counts.get_mut(key) {
            *count = count.saturating_sub(1);
        }
    }

    /// Remembers that the remote tier served `key` (a lookup that counts no reads).
    pub(crate) fn served_by_remote(&mut self, key: ObjectKey) {
        self.remember_remote(key, true);
    }

    /// Whether the remote tier served `key` and this node has not stored it since: the remote
    /// tier holds it, as far as this node knows (it may have let it go since: a miss there
    /// later, as any value Redis evicts).
    pub(crate) fn remote_holds(&self, key: &ObjectKey) -> bool {
        self.from_remote.iter().any(|generation| generation.contains(key))
    }

    /// This node stored `key` itself: it is no longer a chunk the remote tier served.
    pub(crate) fn stored_here(&mut self, key: &ObjectKey) {
        for generation in &mut self.from_remote {
            generation.remove(key);
        }
    }

    /// Whether the remote tier served `key`, now (`served`) or before; if it did, `key` moves
    /// to the newest generation.
    fn remember_remote(&mut self, key: ObjectKey, served: bool) -> bool {
        let [newest, older] = &mut self.from_remote;
        if newest.contains(&key) {
            return true;
        }
        if !(older.remove(&key) || served) {
            return false;
        }
        if newest.len() >= (self.cap / 2).max(1) {
            *older = std::mem::take(newest);
        }
        self.from_remote[0].insert(key);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierkv_testkit::contract::keys;

    /// A read taken back (its admission found no room) leaves the count one short of the
    /// threshold, so the next read admits the chunk: the counts admit only on reaching it, and
    /// one left at it would never admit again.
    #[test]
    fn an_admission_taken_back_is_reached_again_at_the_next_read() {
        let mut reads = ReadCounts::new(16);
        let key = keys(0..1)[0];
        assert!(!reads.read(key, false, Some(2), None).disk);
        assert!(reads.read(key, false, Some(2), None).disk);
        reads.unread(&key);
        assert!(reads.read(key, false, Some(2), None).disk, "the next read does not admit it");
        assert!(!reads.read(key, false, Some(2), None).disk, "admitted twice");
    }

    /// Reads `steps` (a key's number, and whether the remote tier served it) into counts of
    /// `cap` chunks, a lookup each, and returns the numbers of those admitted to the remote tier
    /// (after two reads).
    fn check(cap: usize, steps: &[(u64, bool)], expected: &[u64]) {
        let mut reads = ReadCounts::new(cap);
        let mut admitted = Vec::new();
        for &(n, served) in steps {
            reads.bound();
            if reads.read(keys(n..n + 1)[0], served, None, Some(2)).remote {
                admitted.push(n);
            }
        }
        assert_eq!(admitted, expected, "steps {steps:?}");
    }

    #[test]
    fn a_chunk_the_remote_tier_served_is_never_admitted_back_while_remembered() {
        // Local chunk 1 is admitted at its second read; chunk 0, served by the remote tier, is
        // not, however often it is read.
        check(100, &[(0, true), (0, false), (0, false), (1, false), (1, false)], &[1]);
        // The counts start over past four chunks: chunk 0 is still known to come from remote.
        let mut steps = vec![(0, true)];
        steps.extend((1..=5).map(|n| (n, false)));
        steps.extend([(0, false), (0, false), (0, false)]);
        check(4, &steps, &[]);
    }

    #[test]
    fn the_chunks_the_remote_tier_served_are_bounded_and_the_ones_read_are_kept_longest() {
        // Generations of two: chunk 0, read again, moves to the newest each time and outlives
        // chunk 1, served with it and never read since, which is forgotten: admitted at its
        // second read.
        let steps = [(0, true), (1, true), (2, true), (0, false), (3, true), (0, false)];
        let steps = [&steps[..], &[(0, false), (1, false)]].concat();
        check(4, &steps, &[1]);
        let mut reads = ReadCounts::new(4);
        for n in 0..1000 {
            reads.read(keys(n..n + 1)[0], true, None, Some(2));
        }
        assert!(reads.from_remote.iter().map(HashSet::len).sum::<usize>() <= 4);
    }

    #[test]
    fn the_remote_tier_holds_what_it_served_until_this_node_stores_it() {
        let mut reads = ReadCounts::new(100);
        let [served, local] = [keys(0..1)[0], keys(1..2)[0]];
        reads.served_by_remote(served);
        reads.read(local, false, None, None);
        assert!(reads.remote_holds(&served));
        assert!(!reads.remote_holds(&local));
        reads.stored_here(&served);
        assert!(!reads.remote_holds(&served), "stored here: it goes to the remote tier again");
        assert!(reads.read(served, false, None, Some(1)).remote, "and is admitted as this node's");
    }
}
