//! Chunk ids and chunk bytes that any process can recompute, so a reader can check every byte a
//! different process stored. The example worker, the integration tests and `tierkv replay` all
//! name and fill chunks this way.
//!
//! A chunk's bytes are 64-bit words `seed ^ (i * φ)`, where the seed mixes the chunk id with a tag
//! (the rank whose KV it is, or one value for KV shared by every rank). Two different chunks, or
//! one chunk's bytes at a different offset, never look alike; the fill and the check run at
//! memory speed, so they do not hide the daemon's own speed in a benchmark.

use tierkv_proto::ChunkId;

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The tag of KV that every rank shares (MLA): no rank's own tag can equal it.
pub const SHARED_TAG: u64 = u64::MAX;

/// A well-mixed 64-bit function of `x` (SplitMix64's finaliser).
pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(GOLDEN);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The id of chunk `index` of a prompt numbered `prompt`: fixed, and distinct for distinct pairs.
pub fn chunk_id(prompt: u64, index: u64) -> ChunkId {
    let hi = splitmix(prompt ^ GOLDEN);
    let lo = splitmix(hi ^ index.wrapping_mul(0xbf58_476d_1ce4_e5b9));
    ChunkId((u128::from(hi) << 64) | u128::from(lo))
}

fn seed(id: ChunkId, tag: u64) -> u64 {
    splitmix(
        (id.0 as u64) ^ splitmix((id.0 >> 64) as u64) ^ tag.wrapping_mul(0x2545_f491_4f6c_dd1d),
    )
}

fn word(seed: u64, i: usize) -> u64 {
    seed ^ (i as u64).wrapping_mul(GOLDEN)
}

/// Writes the bytes of chunk `id` (tagged `tag`) into `block`.
pub fn fill(block: &mut [u8], id: ChunkId, tag: u64) {
    let seed = seed(id, tag);
    let last = word(seed, block.len() / 8).to_le_bytes();
    let mut words = block.chunks_exact_mut(8);
    for (i, out) in words.by_ref().enumerate() {
        out.copy_from_slice(&word(seed, i).to_le_bytes());
    }
    let tail = words.into_remainder();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// Whether `block` holds exactly the bytes [`fill`] writes for `id` and `tag`.
pub fn holds(block: &[u8], id: ChunkId, tag: u64) -> bool {
    let seed = seed(id, tag);
    let mut words = block.chunks_exact(8);
    // Fold the differences instead of returning at the first one: the loop then vectorises.
    let mut diff = 0u64;
    for (i, bytes) in words.by_ref().enumerate() {
        let mut le = [0u8; 8];
        le.copy_from_slice(bytes);
        diff |= u64::from_le_bytes(le) ^ word(seed, i);
    }
    let tail = words.remainder();
    let last = word(seed, block.len() / 8).to_le_bytes();
    diff == 0 && tail == &last[..tail.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filled_block_holds_its_chunk_and_no_other() {
        for len in [0, 1, 7, 8, 13, 4096, 4100] {
            let mut block = vec![0u8; len];
            fill(&mut block, chunk_id(1, 2), 0);
            assert!(holds(&block, chunk_id(1, 2), 0), "len {len}");
            if len > 0 {
                assert!(!holds(&block, chunk_id(1, 3), 0), "another chunk, len {len}");
                assert!(!holds(&block, chunk_id(1, 2), 1), "another rank, len {len}");
                for at in [0, len / 2, len - 1] {
                    let mut bad = block.clone();
                    bad[at] ^= 0x10;
                    assert!(!holds(&bad, chunk_id(1, 2), 0), "flipped byte {at} of {len}");
                }
            }
        }
    }

    #[test]
    fn a_chunk_read_at_an_offset_is_not_the_chunk() {
        let mut block = vec![0u8; 4104];
        fill(&mut block, chunk_id(5, 5), 3);
        assert!(!holds(&block[8..], chunk_id(5, 5), 3));
    }
}
