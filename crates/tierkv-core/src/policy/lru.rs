//! Least recently used: one recency list, most recent at the front.

use std::fmt;
use std::hash::Hash;

use super::EvictionPolicy;
use super::group::{Member, Published};
use super::list::KeyedLists;

/// The only list: most recently used at the front, least recently used at the back.
const RECENCY: usize = 0;

/// Least recently used first.
///
/// The baseline policy: it keeps what was used last, which suits workloads whose reuse distance
/// is shorter than the cache. Inserting, touching and removing a key are O(1) and allocate
/// nothing once the policy has held its peak number of keys; an eviction costs O(1) per key it
/// returns or skips.
pub struct Lru<K> {
    /// Each key with the stamp of its last use (0 outside a group, where nothing reads it).
    keys: KeyedLists<K, u64, 1>,
    /// The group this policy is one shard of, if any.
    member: Option<Member>,
}

impl<K: Hash + Eq + Clone> Lru<K> {
    /// An empty policy.
    pub fn new() -> Self {
        Lru { keys: KeyedLists::new(), member: None }
    }

    /// The policy of one shard of a [`super::PolicyGroup`].
    pub(super) fn in_group(member: Member) -> Self {
        Lru { keys: KeyedLists::new(), member: Some(member) }
    }

    fn stamp(&mut self) -> u64 {
        self.member.as_mut().map_or(0, Member::tick)
    }

    /// Drops the least recently used key, if any, and returns it: [`EvictionPolicy::evict`] of
    /// one key without its `Vec`, for callers on a hot path (the adaptive policy's shadows).
    pub(super) fn evict_oldest(&mut self) -> Option<K> {
        let id = self.keys.back(RECENCY)?;
        let key = self.keys.remove_node(id).0;
        self.publish();
        Some(key)
    }

    /// Tells the group, if any, where this shard's next victim stands.
    fn publish(&self) {
        if let Some(member) = &self.member {
            let oldest = self.keys.back(RECENCY).map(|id| *self.keys.value(id));
            member.publish(Published {
                len: [self.keys.len(RECENCY), 0],
                oldest: [oldest, None],
                ..Published::default()
            });
        }
    }
}

impl<K: Hash + Eq + Clone> Default for Lru<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K> fmt::Debug for Lru<K>
where
    K: Hash + Eq + Clone,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lru").field("len", &self.keys.len(RECENCY)).finish()
    }
}

impl<K: Hash + Eq + Clone + Send> EvictionPolicy<K> for Lru<K> {
    fn insert(&mut self, key: K) {
        // A key already tracked keeps its place: being cached again is not a use.
        let stamp = self.stamp();
        let (_, added) = self.keys.push_front_if_absent(RECENCY, key, stamp);
        if added {
            self.publish();
        }
    }

    fn touch(&mut self, key: &K) {
        if let Some(id) = self.keys.find(key) {
            let stamp = self.stamp();
            *self.keys.value_mut(id) = stamp;
            self.keys.move_to_front(id, RECENCY);
            self.publish();
        }
    }

    fn remove(&mut self, key: &K) -> bool {
        let removed = self.keys.remove(key).is_some();
        self.publish();
        removed
    }

    fn len(&self) -> usize {
        self.keys.len(RECENCY)
    }

    fn contains(&self, key: &K) -> bool {
        self.keys.find(key).is_some()
    }

    fn stamp_next(&mut self, stamp: Option<u64>) {
        if let Some(member) = &mut self.member {
            member.next = stamp;
        }
    }

    fn evict(&mut self, n: usize, eligible: &mut dyn FnMut(&K) -> bool) -> Vec<K> {
        let mut victims = Vec::with_capacity(n.min(self.len()));
        // Walk from the least recently used key towards the most recent. The next node is read
        // before the current one may be removed; skipped keys are neither moved nor dropped.
        let mut next = self.keys.back(RECENCY);
        while victims.len() < n
            && let Some(id) = next
        {
            next = self.keys.newer(id);
            if eligible(self.keys.key(id)) {
                victims.push(self.keys.remove_node(id).0);
            }
        }
        self.publish();
        victims
    }
}
