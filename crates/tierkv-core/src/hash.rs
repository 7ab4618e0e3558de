//! Chained chunk hashing over token ids.
//!
//! `h_i = xxh3_128(h_{i-1} || n_i || tokens_i || extra_i)` where `h_{-1}` is [`root()`], `h` is
//! written as 16 little-endian bytes, `n_i` (the chunk's token count) as a little-endian `u32`,
//! every token id as a little-endian `u32`, and `extra_i` (per-chunk extra keys such as a LoRA id
//! or a multimodal item hash) as raw bytes. The token count stands before the tokens so that the
//! boundary between tokens and extra bytes is never ambiguous.
//!
//! This encoding is part of the wire contract: clients may compute hashes themselves, and stored
//! objects on disk are found again by these hashes after an upgrade. The golden vectors in the
//! tests pin it; changing it is a format change.

use xxhash_rust::xxh3::{Xxh3, xxh3_128};

use crate::key::ChunkHash;

/// Domain-separation string whose hash is the parent of the first chunk of every prefix.
const ROOT_DOMAIN: &[u8] = b"tierkv chunk hash v1";

/// The hash every chain starts from (`h_{-1}`).
pub fn root() -> ChunkHash {
    ChunkHash(xxh3_128(ROOT_DOMAIN))
}

/// Hashes one chunk given the hash of the chunk before it.
pub fn chain(parent: ChunkHash, tokens: &[u32], extra: &[u8]) -> ChunkHash {
    let mut hasher = Xxh3::new();
    hasher.update(&parent.0.to_le_bytes());
    // A chunk longer than u32::MAX tokens cannot exist in practice; saturate rather than wrap so
    // the count stays monotone.
    let count = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
    hasher.update(&count.to_le_bytes());
    // Hash in blocks of little-endian bytes to avoid one update call per token.
    let mut block = [0u8; 256];
    for group in tokens.chunks(block.len() / 4) {
        for (slot, token) in block.chunks_exact_mut(4).zip(group) {
            slot.copy_from_slice(&token.to_le_bytes());
        }
        hasher.update(&block[..group.len() * 4]);
    }
    hasher.update(extra);
    ChunkHash(hasher.digest128())
}

/// Splits token sequences into fixed-size chunks and hashes them as chains.
#[derive(Clone, Copy, Debug)]
pub struct ChunkHasher {
    chunk_tokens: usize,
}

impl ChunkHasher {
    /// A hasher for chunks of `chunk_tokens` tokens; `None` for zero.
    pub fn new(chunk_tokens: usize) -> Option<Self> {
        (chunk_tokens > 0).then_some(ChunkHasher { chunk_tokens })
    }

    /// Tokens per chunk.
    pub fn chunk_tokens(&self) -> usize {
        self.chunk_tokens
    }

    /// The chain of hashes of every full chunk of `tokens`.
    ///
    /// A trailing partial chunk is not hashed: engines store only full chunks, and a partial
    /// chunk's KV would be extended in place by the next decode step anyway.
    pub fn prefix_hashes(&self, tokens: &[u32]) -> Vec<ChunkHash> {
        self.prefix_hashes_with(tokens, |_| &[])
    }

    /// Like [`ChunkHasher::prefix_hashes`], with per-chunk extra keys (`extra(i)` for chunk `i`).
    pub fn prefix_hashes_with<'e>(
        &self,
        tokens: &[u32],
        mut extra: impl FnMut(usize) -> &'e [u8],
    ) -> Vec<ChunkHash> {
        let mut parent = root();
        tokens
            .chunks_exact(self.chunk_tokens)
            .enumerate()
            .map(|(i, chunk)| {
                parent = chain(parent, chunk, extra(i));
                parent
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh3_128_matches_the_reference_implementation() {
        // XXH3_128bits("") from the reference C implementation: if the dependency ever changed
        // its output, every stored hash would change with it.
        assert_eq!(xxh3_128(b""), 0x99aa06d3014798d86001c324468d497f);
    }

    #[test]
    fn golden_vectors_pin_the_encoding() {
        let tokens: Vec<u32> = (0..8).collect();
        let hasher = ChunkHasher::new(4).unwrap();
        let hashes = hasher.prefix_hashes(&tokens);
        let golden = [GOLDEN_ROOT, GOLDEN_CHUNK0, GOLDEN_CHUNK1];
        let actual = [root().0, hashes[0].0, hashes[1].0];
        assert_eq!(actual, golden, "the chunk hash encoding changed: this breaks stored data");
        assert_eq!(chain(root(), &[1, 2, 3], b"lora:7").0, GOLDEN_EXTRA);
    }

    // Computed independently with Python's `xxhash` package from the encoding in the module
    // docs, not by this code.
    const GOLDEN_ROOT: u128 = 0x6eab4445bfd64c891e935564cf3b12f5;
    const GOLDEN_CHUNK0: u128 = 0x4280bb5ac4329e45baa14f07a5d4b762;
    const GOLDEN_CHUNK1: u128 = 0xd8abf6f1185367c281cd16437057fbe8;
    const GOLDEN_EXTRA: u128 = 0xf786444313f2145e88187944a48e088c;

    #[test]
    fn chain_equals_one_shot_hash_of_the_documented_encoding() {
        let tokens: Vec<u32> = (0..1000).map(|t| t * 7919).collect();
        let mut bytes = root().0.to_le_bytes().to_vec();
        bytes.extend_from_slice(&1000u32.to_le_bytes());
        for t in &tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        bytes.extend_from_slice(b"x");
        assert_eq!(chain(root(), &tokens, b"x").0, xxh3_128(&bytes));
    }

    #[test]
    fn equal_hash_means_equal_prefix() {
        let hasher = ChunkHasher::new(2).unwrap();
        let a = hasher.prefix_hashes(&[1, 2, 3, 4, 5, 6]);
        let b = hasher.prefix_hashes(&[1, 2, 3, 4, 9, 9]);
        let c = hasher.prefix_hashes(&[9, 2, 3, 4, 5, 6]);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // A different first chunk changes every later hash, even where the chunk tokens agree.
        assert!(a.iter().zip(&c).all(|(x, y)| x != y));
    }

    #[test]
    fn token_count_separates_tokens_from_extra_bytes() {
        // Without the count, tokens [1] + extra [2,0,0,0] would equal tokens [1, 2].
        assert_ne!(chain(root(), &[1], &2u32.to_le_bytes()), chain(root(), &[1, 2], &[]));
    }

    #[test]
    fn partial_trailing_chunk_is_not_hashed() {
        let hasher = ChunkHasher::new(4).unwrap();
        assert_eq!(hasher.prefix_hashes(&[0; 11]).len(), 2);
        assert!(hasher.prefix_hashes(&[0; 3]).is_empty());
        assert!(ChunkHasher::new(0).is_none());
    }

    #[test]
    fn extra_keys_change_only_their_chunk_and_after() {
        let hasher = ChunkHasher::new(2).unwrap();
        let plain = hasher.prefix_hashes(&[1, 2, 3, 4]);
        let with_extra =
            hasher.prefix_hashes_with(&[1, 2, 3, 4], |i| if i == 1 { b"img" } else { &[] });
        assert_eq!(plain[0], with_extra[0]);
        assert_ne!(plain[1], with_extra[1]);
    }
}
