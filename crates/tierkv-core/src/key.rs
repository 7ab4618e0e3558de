//! Object identity: which bytes a stored chunk is.

use std::fmt;

use xxhash_rust::xxh3::xxh3_64;

/// A 64-bit digest of (model name, cache salt).
///
/// Keys of different namespaces never match, so two models, or two tenants of one model that use
/// different salts, can share a daemon without ever reading each other's chunks.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Namespace(pub u64);

impl Namespace {
    /// Derives the namespace of a model and a cache salt.
    ///
    /// Both strings are length-prefixed before hashing, so `("ab", "c")` and `("a", "bc")` differ.
    pub fn new(model: &str, cache_salt: &str) -> Self {
        let mut buf = Vec::with_capacity(16 + model.len() + cache_salt.len());
        buf.extend_from_slice(&(model.len() as u64).to_le_bytes());
        buf.extend_from_slice(model.as_bytes());
        buf.extend_from_slice(&(cache_salt.len() as u64).to_le_bytes());
        buf.extend_from_slice(cache_salt.as_bytes());
        Namespace(xxh3_64(&buf))
    }
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ns:{:016x}", self.0)
    }
}

/// The chained 128-bit hash of a chunk and every chunk before it (see [`crate::hash`]).
///
/// Equal hashes mean equal prefixes, so a hit on chunk `i` implies the whole prefix up to `i` is
/// cached content of the same tokens.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkHash(pub u128);

impl fmt::Debug for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "chunk:{:032x}", self.0)
    }
}

/// Which tensor-parallel shard of the KV cache the bytes of an object are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvRank {
    /// The KV is identical on every rank (MLA): one object serves every rank.
    Shared,
    /// Shard `rank` of `world`.
    Rank {
        /// This shard's index, below `world`.
        rank: u16,
        /// The tensor-parallel size the KV was split for.
        world: u16,
    },
}

/// The KV-cache group of a hybrid model (full-attention and sliding-window layers cache apart).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupId(pub u16);

/// The identity of one stored object: one chunk of one rank of one KV group of one namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    /// Model and tenant the chunk belongs to.
    pub namespace: Namespace,
    /// Chained hash of the prefix that ends with this chunk.
    pub chunk: ChunkHash,
    /// Tensor-parallel shard, or `Shared` for MLA.
    pub rank: KvRank,
    /// KV-cache group, `GroupId(0)` for models with a single group.
    pub group: GroupId,
}

impl ObjectKey {
    /// A key of group 0, the common case of a model with one KV-cache group.
    pub fn new(namespace: Namespace, chunk: ChunkHash, rank: KvRank) -> Self {
        ObjectKey { namespace, chunk, rank, group: GroupId(0) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_separates_model_and_salt_boundaries() {
        assert_ne!(Namespace::new("ab", "c"), Namespace::new("a", "bc"));
        assert_ne!(Namespace::new("m", ""), Namespace::new("m", "tenant"));
        assert_eq!(Namespace::new("m", "s"), Namespace::new("m", "s"));
    }

    #[test]
    fn keys_differ_by_every_field() {
        let ns = Namespace::new("m", "");
        let base = ObjectKey::new(ns, ChunkHash(7), KvRank::Shared);
        let other_rank = ObjectKey { rank: KvRank::Rank { rank: 0, world: 1 }, ..base };
        let other_group = ObjectKey { group: GroupId(1), ..base };
        let other_ns = ObjectKey { namespace: Namespace::new("m", "x"), ..base };
        let other_chunk = ObjectKey { chunk: ChunkHash(8), ..base };
        for other in [other_rank, other_group, other_ns, other_chunk] {
            assert_ne!(base, other);
        }
    }
}
