//! Doubly linked lists of keys that share one slab and one hash index.
//!
//! Both policies order keys in FIFO or recency lists and must find a key's place in O(1). A
//! `KeyedLists<K, T, N>` holds `N` lists over a single slab of nodes, with one hash map from key
//! to node. A key is in at most one of the lists, so moving it from one list to another (LRU's
//! move to front, S3-FIFO's promotion to the main queue or demotion to the ghost queue) relinks a
//! node without touching the map or allocating.
//!
//! Each list runs from its front (newest) to its back (oldest). Nodes are addressed by `u32`
//! indices into a `Vec`; freed nodes are chained into a free list and reused, so once the slab
//! and the map have grown to the peak number of keys, no operation allocates.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::Hash;

use foldhash::fast::RandomState;

/// The index that stands for "no node", at either end of a list and of the free list.
const NIL: u32 = u32::MAX;

/// A handle to a node, valid until that node is removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NodeId(u32);

/// A key with its value, the list it is on and its neighbours on that list.
struct Node<K, T> {
    key: K,
    value: T,
    /// The list this node is on, an index into `KeyedLists::lists`.
    list: u8,
    /// The neighbour towards the front of the list, or `NIL` at the front.
    newer: u32,
    /// The neighbour towards the back of the list, or `NIL` at the back.
    older: u32,
}

/// One entry of the slab.
enum Slot<K, T> {
    Used(Node<K, T>),
    /// A freed entry, holding the index of the next freed entry (or `NIL`).
    Free(u32),
}

/// Both ends and the length of one list.
#[derive(Clone, Copy)]
struct Ends {
    front: u32,
    back: u32,
    len: usize,
}

impl Ends {
    const EMPTY: Ends = Ends { front: NIL, back: NIL, len: 0 };
}

/// `N` doubly linked lists of distinct keys over one slab, indexed by key.
///
/// Invariants, maintained by every method and relied upon by the slab accesses:
/// - `index` maps exactly the keys of the `Used` slots, each to its own slot;
/// - every index stored in `Ends`, `Node::newer` and `Node::older` is either `NIL` or names a
///   `Used` slot on the same list, and every index on the free list names a `Free` slot;
/// - `Node::list` is below `N`.
pub(crate) struct KeyedLists<K, T, const N: usize> {
    slots: Vec<Slot<K, T>>,
    /// The first freed slot, or `NIL` when there is none.
    free: u32,
    index: HashMap<K, u32, RandomState>,
    lists: [Ends; N],
}

impl<K, T, const N: usize> KeyedLists<K, T, N>
where
    K: Hash + Eq + Clone,
{
    /// Empty lists.
    pub(crate) fn new() -> Self {
        const { assert!(N >= 1 && N <= u8::MAX as usize, "list numbers must fit in a u8") };
        KeyedLists {
            slots: Vec::new(),
            free: NIL,
            index: HashMap::with_hasher(RandomState::default()),
            lists: [Ends::EMPTY; N],
        }
    }

    /// The number of keys on `list`.
    pub(crate) fn len(&self, list: usize) -> usize {
        self.lists[list].len
    }

    /// The node holding `key`, on whichever list.
    pub(crate) fn find(&self, key: &K) -> Option<NodeId> {
        self.index.get(key).map(|&i| NodeId(i))
    }

    /// Puts `key` at the front of `list` unless it is already on some list.
    ///
    /// Returns the key's node and whether it was added; an existing node is left untouched, so
    /// a caller can decide what a repeated insert means with a single hash lookup.
    pub(crate) fn push_front_if_absent(&mut self, list: usize, key: K, value: T) -> (NodeId, bool) {
        let vacant = match self.index.entry(key) {
            Entry::Occupied(entry) => return (NodeId(*entry.get()), false),
            Entry::Vacant(vacant) => vacant,
        };
        let node = Node {
            key: vacant.key().clone(),
            value,
            // `link_front` sets the list and the links.
            list: 0,
            newer: NIL,
            older: NIL,
        };
        let i = if self.free == NIL {
            // NIL must stay free to mean "no node", so the slab holds at most NIL slots.
            assert!(self.slots.len() < NIL as usize, "more than u32::MAX - 1 keys tracked");
            self.slots.push(Slot::Used(node));
            (self.slots.len() - 1) as u32
        } else {
            let i = self.free;
            let Slot::Free(next_free) = self.slots[i as usize] else {
                unreachable!("the free list names only free slots");
            };
            self.free = next_free;
            self.slots[i as usize] = Slot::Used(node);
            i
        };
        vacant.insert(i);
        self.link_front(i, list);
        (NodeId(i), true)
    }

    /// Removes `key` from whichever list holds it and returns its value.
    pub(crate) fn remove(&mut self, key: &K) -> Option<T> {
        let i = self.index.remove(key)?;
        self.unlink(i);
        Some(self.release(i).1)
    }

    /// Removes `key` from whichever list holds it; returns that list, whether the key was its
    /// oldest, and the key's value.
    pub(crate) fn remove_from_list(&mut self, key: &K) -> Option<(usize, bool, T)> {
        let i = self.index.remove(key)?;
        let list = usize::from(self.node(i).list);
        let was_back = self.lists[list].back == i;
        self.unlink(i);
        Some((list, was_back, self.release(i).1))
    }

    /// Removes the node `id`, whose handle then goes stale, and returns its key and value.
    pub(crate) fn remove_node(&mut self, id: NodeId) -> (K, T) {
        self.unlink(id.0);
        let (key, value) = self.release(id.0);
        self.index.remove(&key);
        (key, value)
    }

    /// Removes the oldest key of `list`, if any, and returns its key and value.
    pub(crate) fn pop_back(&mut self, list: usize) -> Option<(K, T)> {
        let back = self.back(list)?;
        Some(self.remove_node(back))
    }

    /// Moves the node `id` to the front of `list`, which may be the list it is on.
    pub(crate) fn move_to_front(&mut self, id: NodeId, list: usize) {
        self.unlink(id.0);
        self.link_front(id.0, list);
    }

    /// The oldest node of `list`.
    pub(crate) fn back(&self, list: usize) -> Option<NodeId> {
        some(self.lists[list].back)
    }

    /// The neighbour of `id` towards the front of its list: the next node of a walk from the
    /// back (oldest) to the front (newest).
    pub(crate) fn newer(&self, id: NodeId) -> Option<NodeId> {
        some(self.node(id.0).newer)
    }

    /// The list the node `id` is on.
    pub(crate) fn list_of(&self, id: NodeId) -> usize {
        usize::from(self.node(id.0).list)
    }

    /// The key of the node `id`.
    pub(crate) fn key(&self, id: NodeId) -> &K {
        &self.node(id.0).key
    }

    /// The value of the node `id`.
    pub(crate) fn value(&self, id: NodeId) -> &T {
        &self.node(id.0).value
    }

    /// The value of the node `id`, for updating in place.
    pub(crate) fn value_mut(&mut self, id: NodeId) -> &mut T {
        &mut self.node_mut(id.0).value
    }

    /// The node in slot `i`, which the invariants say is used.
    fn node(&self, i: u32) -> &Node<K, T> {
        match &self.slots[i as usize] {
            Slot::Used(node) => node,
            Slot::Free(_) => unreachable!("node indices name only used slots"),
        }
    }

    /// The node in slot `i`, which the invariants say is used, for updating in place.
    fn node_mut(&mut self, i: u32) -> &mut Node<K, T> {
        match &mut self.slots[i as usize] {
            Slot::Used(node) => node,
            Slot::Free(_) => unreachable!("node indices name only used slots"),
        }
    }

    /// Links the unlinked node `i` in at the front of `list`.
    fn link_front(&mut self, i: u32, list: usize) {
        let old_front = self.lists[list].front;
        let node = self.node_mut(i);
        // Indexing `lists` just checked that `list < N`, and `N` fits in a u8 (see `new`).
        node.list = list as u8;
        node.newer = NIL;
        node.older = old_front;
        if old_front == NIL {
            self.lists[list].back = i;
        } else {
            self.node_mut(old_front).newer = i;
        }
        let ends = &mut self.lists[list];
        ends.front = i;
        ends.len += 1;
    }

    /// Takes the node `i` off its list, joining its neighbours; the node's own links go stale.
    fn unlink(&mut self, i: u32) {
        let Node { list, newer, older, .. } = *self.node(i);
        let list = usize::from(list);
        if newer == NIL {
            self.lists[list].front = older;
        } else {
            self.node_mut(newer).older = older;
        }
        if older == NIL {
            self.lists[list].back = newer;
        } else {
            self.node_mut(older).newer = newer;
        }
        self.lists[list].len -= 1;
    }

    /// Frees the unlinked slot `i` and returns what it held.
    fn release(&mut self, i: u32) -> (K, T) {
        match std::mem::replace(&mut self.slots[i as usize], Slot::Free(self.free)) {
            Slot::Used(node) => {
                self.free = i;
                (node.key, node.value)
            }
            Slot::Free(_) => unreachable!("node indices name only used slots"),
        }
    }
}

/// `NIL` as `None`, any other index as its node.
fn some(i: u32) -> Option<NodeId> {
    (i != NIL).then_some(NodeId(i))
}

#[cfg(test)]
mod tests {
    use super::KeyedLists;

    #[test]
    fn keyed_lists_reuse_freed_nodes() {
        let mut lists: KeyedLists<u32, (), 2> = KeyedLists::new();
        for key in 0..4 {
            lists.push_front_if_absent(0, key, ());
        }
        assert!(!lists.push_front_if_absent(1, 2, ()).1, "a key is on one list at most");
        assert_eq!(lists.remove(&1), Some(()));
        assert_eq!(lists.pop_back(0), Some((0, ())));
        let three = lists.find(&3).unwrap();
        lists.move_to_front(three, 1);
        assert_eq!((lists.len(0), lists.len(1)), (1, 1));
        // Two freed nodes are reused before the slab grows.
        lists.push_front_if_absent(0, 10, ());
        lists.push_front_if_absent(0, 11, ());
        assert_eq!(lists.slots.len(), 4);
        let mut order = vec![];
        let mut next = lists.back(0);
        while let Some(id) = next {
            order.push(*lists.key(id));
            next = lists.newer(id);
        }
        assert_eq!(order, vec![2, 10, 11]);
    }
}
