//! The value format, version 1, and the Redis key of an object: the one place that encodes and
//! decodes them (`docs/remote.md` describes them byte by byte).
//!
//! A value is a 64-byte header followed by the payload. The header carries the object's full key,
//! so a value copied under another key (by mistake, by a bug, by another tenant) is recognised,
//! and an xxh3-64 checksum of the payload, so a value damaged in flight or in memory is too.

use tierkv_core::{ChunkHash, GroupId, KvRank, Namespace, ObjectKey};
use xxhash_rust::xxh3::xxh3_64;

/// The format version this code writes and reads.
pub const VERSION: u16 = 1;

/// Bytes of the header that precedes every payload.
pub const HEADER_BYTES: usize = 64;

const MAGIC: &[u8; 4] = b"TKVR";

/// Why a value is not the object it was fetched for. Each is a miss, never served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Invalid {
    /// Shorter than its header, or than the payload its header announces.
    Truncated,
    /// Not our magic, or a version this code does not read.
    Header,
    /// A valid value of another key.
    WrongKey,
    /// The payload length differs from the buffer it is loaded into.
    Length,
    /// The payload does not match its checksum.
    Checksum,
}

impl Invalid {
    /// The `reason` label of the error counter.
    pub fn reason(self) -> &'static str {
        match self {
            Invalid::Truncated => "truncated",
            Invalid::Header => "bad_header",
            Invalid::WrongKey => "wrong_key",
            Invalid::Length => "wrong_length",
            Invalid::Checksum => "checksum",
        }
    }
}

/// The Redis key of `key` under `prefix`: every field of the object key in hex, the namespace
/// first. Keys carry no hash tag, so a cluster spreads one prefix over all its masters.
pub fn redis_key(prefix: &str, key: &ObjectKey) -> String {
    let (kind, rank, world) = rank_fields(key.rank);
    format!(
        "{prefix}:{:016x}:{:032x}:{kind}{rank}.{world}:{}",
        key.namespace.0, key.chunk.0, key.group.0
    )
}

fn rank_fields(rank: KvRank) -> (char, u16, u16) {
    match rank {
        KvRank::Shared => ('s', 0, 0),
        KvRank::Rank { rank, world } => ('r', rank, world),
    }
}

/// Writes the header of `key` with `payload` into `out[..HEADER_BYTES]`.
pub fn encode_header(key: &ObjectKey, payload: &[u8], out: &mut [u8]) {
    let (kind, rank, world) = rank_fields(key.rank);
    let h = &mut out[..HEADER_BYTES];
    h.fill(0);
    h[0..4].copy_from_slice(MAGIC);
    h[4..6].copy_from_slice(&VERSION.to_le_bytes());
    h[6..8].copy_from_slice(&(HEADER_BYTES as u16).to_le_bytes());
    h[8..16].copy_from_slice(&key.namespace.0.to_le_bytes());
    h[16..32].copy_from_slice(&key.chunk.0.to_le_bytes());
    h[32] = u8::from(kind == 'r');
    h[34..36].copy_from_slice(&rank.to_le_bytes());
    h[36..38].copy_from_slice(&world.to_le_bytes());
    h[38..40].copy_from_slice(&key.group.0.to_le_bytes());
    h[40..48].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    h[48..56].copy_from_slice(&xxh3_64(payload).to_le_bytes());
    // 56..64: reserved, zero.
}

/// The whole value of `key` holding `payload`: header, then payload.
pub fn encode(key: &ObjectKey, payload: &[u8]) -> Vec<u8> {
    let mut value = vec![0; HEADER_BYTES + payload.len()];
    encode_header(key, payload, &mut value);
    value[HEADER_BYTES..].copy_from_slice(payload);
    value
}

fn le<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut out = [0; N];
    out.copy_from_slice(&bytes[at..at + N]);
    out
}

fn decode_key(h: &[u8]) -> ObjectKey {
    let rank = match h[32] {
        0 => KvRank::Shared,
        _ => KvRank::Rank {
            rank: u16::from_le_bytes(le(h, 34)),
            world: u16::from_le_bytes(le(h, 36)),
        },
    };
    ObjectKey {
        namespace: Namespace(u64::from_le_bytes(le(h, 8))),
        chunk: ChunkHash(u128::from_le_bytes(le(h, 16))),
        rank,
        group: GroupId(u16::from_le_bytes(le(h, 38))),
    }
}

/// Checks that `value` is exactly `key`'s object of `expected_len` payload bytes; returns the
/// payload.
pub fn verify<'a>(
    key: &ObjectKey,
    value: &'a [u8],
    expected_len: u64,
) -> Result<&'a [u8], Invalid> {
    if value.len() < HEADER_BYTES {
        return Err(if value.len() >= 4 && &value[..4] != MAGIC {
            Invalid::Header
        } else {
            Invalid::Truncated
        });
    }
    let (h, payload) = value.split_at(HEADER_BYTES);
    if &h[0..4] != MAGIC
        || u16::from_le_bytes(le(h, 4)) != VERSION
        || usize::from(u16::from_le_bytes(le(h, 6))) != HEADER_BYTES
    {
        return Err(Invalid::Header);
    }
    if decode_key(h) != *key {
        return Err(Invalid::WrongKey);
    }
    // The announced length first: a load reads at most the expected length and a byte more,
    // so a whole value of a larger chunk arrives cut short, and is not a truncated one.
    let len = u64::from_le_bytes(le(h, 40));
    if len != expected_len {
        return Err(Invalid::Length);
    }
    if (payload.len() as u64) < len {
        return Err(Invalid::Truncated);
    }
    if payload.len() as u64 != len {
        return Err(Invalid::Length);
    }
    if xxh3_64(payload) != u64::from_le_bytes(le(h, 48)) {
        return Err(Invalid::Checksum);
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

    use super::*;

    fn key(i: u128) -> ObjectKey {
        ObjectKey::new(Namespace::new("m", "t"), ChunkHash(i), KvRank::Rank { rank: 1, world: 4 })
    }

    #[test]
    fn a_value_verifies_as_its_own_key_only() {
        let payload: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let value = encode(&key(7), &payload);
        assert_eq!(verify(&key(7), &value, 1000).unwrap(), &payload[..]);
        assert_eq!(verify(&key(8), &value, 1000), Err(Invalid::WrongKey));
        let other_ns = ObjectKey { namespace: Namespace::new("m", "u"), ..key(7) };
        assert_eq!(verify(&other_ns, &value, 1000), Err(Invalid::WrongKey));
        let shared = ObjectKey { rank: KvRank::Shared, ..key(7) };
        assert_eq!(verify(&shared, &value, 1000), Err(Invalid::WrongKey));
        assert_eq!(verify(&key(7), &value, 999), Err(Invalid::Length));
    }

    /// A load reads the expected length and one byte more: a whole value of a larger chunk
    /// (another build's, a stray copy) arrives cut at that, and is a wrong length, not damage.
    #[test]
    fn a_larger_chunks_value_read_as_far_as_a_load_reads_is_a_wrong_length() {
        let value = encode(&key(7), &[3u8; 2000]);
        assert_eq!(verify(&key(7), &value[..HEADER_BYTES + 1001], 1000), Err(Invalid::Length));
        assert_eq!(verify(&key(7), &value[..HEADER_BYTES + 500], 1000), Err(Invalid::Length));
        let own = encode(&key(7), &[3u8; 1000]);
        assert_eq!(verify(&key(7), &own[..HEADER_BYTES + 999], 1000), Err(Invalid::Truncated));
    }

    #[test]
    fn every_damage_is_recognised() {
        let payload = vec![5u8; 4096];
        let value = encode(&key(1), &payload);
        for at in [0, 5, 9, 40, 50, HEADER_BYTES, HEADER_BYTES + 4095] {
            let mut bad = value.clone();
            bad[at] ^= 0x10;
            assert!(verify(&key(1), &bad, 4096).is_err(), "a flip at byte {at} verified");
        }
        let mut flipped = value.clone();
        flipped[HEADER_BYTES + 100] ^= 1;
        assert_eq!(verify(&key(1), &flipped, 4096), Err(Invalid::Checksum));
        assert_eq!(verify(&key(1), &value[..value.len() - 1], 4096), Err(Invalid::Truncated));
        assert_eq!(verify(&key(1), &value[..10], 4096), Err(Invalid::Truncated));
        assert_eq!(verify(&key(1), b"hello world", 4096), Err(Invalid::Header));
        let mut longer = value.clone();
        longer.push(0);
        assert_eq!(verify(&key(1), &longer, 4096), Err(Invalid::Length));
    }

    #[test]
    fn redis_keys_differ_by_every_field_and_lead_with_the_namespace() {
        let a = redis_key("tierkv", &key(1));
        assert!(a.starts_with(&format!("tierkv:{:016x}:", Namespace::new("m", "t").0)), "{a}");
        let variants = [
            key(2),
            ObjectKey { rank: KvRank::Shared, ..key(1) },
            ObjectKey { group: GroupId(1), ..key(1) },
            ObjectKey { namespace: Namespace::new("m", ""), ..key(1) },
        ];
        for v in variants {
            assert_ne!(redis_key("tierkv", &v), a);
        }
        assert_ne!(redis_key("other", &key(1)), a);
    }
}
