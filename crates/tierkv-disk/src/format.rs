//! The on-disk format, version 1: segment superblocks and record headers. `docs/disk-format.md`
//! describes it byte by byte; this module is the one place that encodes and decodes it.
//!
//! A segment file is a superblock block followed by records. A record is one header block and
//! its payload, padded to whole blocks. Every header carries the epoch of its segment's
//! superblock: when a segment is reused the epoch changes, so records from before the reuse no
//! longer match and end the scan. Header and superblock carry their own checksum, so a torn or
//! garbage block is recognised as such.

use tierkv_core::{ChunkHash, GroupId, KvRank, Namespace, ObjectKey};
use xxhash_rust::xxh3::xxh3_64;

/// The unit of alignment and of every header: direct I/O needs buffers, lengths and offsets
/// aligned to the device's logical block, and 4 KiB is the largest in common use.
pub const BLOCK: u64 = 4096;

/// The format version this code writes and reads.
pub const VERSION: u32 = 1;

const SEGMENT_MAGIC: &[u8; 8] = b"TKVSEG01";
const RECORD_MAGIC: &[u8; 8] = b"TKVREC01";

/// Bytes of a superblock that its checksum covers.
const SUPER_BODY: usize = 32;
/// Bytes of a record header that its checksum covers.
const HEADER_BODY: usize = 72;

/// What a segment's first block says about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// The segment's number: which file holds it, and where in the file, follow from it.
    pub id: u32,
    /// Changes every time the segment is reused; records must carry the same epoch.
    pub epoch: u64,
    /// The segment's size when it was initialised.
    pub segment_bytes: u64,
}

/// What a record header says about its record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The epoch of the segment the record was written into.
    pub epoch: u64,
    /// The object's full key.
    pub key: ObjectKey,
    /// Payload bytes (before padding).
    pub len: u64,
    /// xxh3-64 of the payload.
    pub checksum: u64,
    /// Deleted (flag bit 0): the record is skipped when the index is rebuilt.
    pub deleted: bool,
}

/// Flag bit 0 of a record header: the record was deleted after it was written.
const FLAG_DELETED: u32 = 1;

/// Why a block is not a valid superblock or header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Invalid {
    /// Not our magic: an unwritten or foreign block.
    Magic,
    /// A version this code does not read.
    Version(u32),
    /// The checksum does not match: torn or corrupted.
    Checksum,
    /// The block is shorter than its fields.
    Short,
}

/// The bytes a record with a `len`-byte payload occupies: one header block and whole payload
/// blocks.
pub fn record_bytes(len: u64) -> u64 {
    // Saturating: a length from a configuration file is not bounded yet when it is asked about.
    BLOCK.saturating_add(len.div_ceil(BLOCK).saturating_mul(BLOCK))
}

fn put(buf: &mut [u8], at: usize, bytes: &[u8]) {
    buf[at..at + bytes.len()].copy_from_slice(bytes);
}

fn u16_at(buf: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([buf[at], buf[at + 1]])
}

fn u32_at(buf: &[u8], at: usize) -> u32 {
    let mut b = [0; 4];
    b.copy_from_slice(&buf[at..at + 4]);
    u32::from_le_bytes(b)
}

fn u64_at(buf: &[u8], at: usize) -> u64 {
    let mut b = [0; 8];
    b.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(b)
}

fn u128_at(buf: &[u8], at: usize) -> u128 {
    let mut b = [0; 16];
    b.copy_from_slice(&buf[at..at + 16]);
    u128::from_le_bytes(b)
}

impl Superblock {
    /// Writes the superblock into the first bytes of `block` (at least [`BLOCK`] long), zeroing
    /// the rest of the block.
    pub fn encode(&self, block: &mut [u8]) {
        block[..BLOCK as usize].fill(0);
        put(block, 0, SEGMENT_MAGIC);
        put(block, 8, &VERSION.to_le_bytes());
        put(block, 12, &self.id.to_le_bytes());
        put(block, 16, &self.epoch.to_le_bytes());
        put(block, 24, &self.segment_bytes.to_le_bytes());
        let sum = xxh3_64(&block[..SUPER_BODY]);
        put(block, SUPER_BODY, &sum.to_le_bytes());
    }

    /// Reads a superblock, checking magic, version and checksum.
    pub fn decode(block: &[u8]) -> Result<Self, Invalid> {
        if block.len() < SUPER_BODY + 8 {
            return Err(Invalid::Short);
        }
        if &block[..8] != SEGMENT_MAGIC {
            return Err(Invalid::Magic);
        }
        let version = u32_at(block, 8);
        if version != VERSION {
            return Err(Invalid::Version(version));
        }
        if xxh3_64(&block[..SUPER_BODY]) != u64_at(block, SUPER_BODY) {
            return Err(Invalid::Checksum);
        }
        Ok(Superblock {
            id: u32_at(block, 12),
            epoch: u64_at(block, 16),
            segment_bytes: u64_at(block, 24),
        })
    }
}

impl Header {
    /// Writes the header into the first bytes of `block` (at least [`BLOCK`] long), zeroing the
    /// rest of the block.
    pub fn encode(&self, block: &mut [u8]) {
        block[..BLOCK as usize].fill(0);
        put(block, 0, RECORD_MAGIC);
        put(block, 8, &VERSION.to_le_bytes());
        put(block, 12, &(if self.deleted { FLAG_DELETED } else { 0 }).to_le_bytes());
        put(block, 16, &self.epoch.to_le_bytes());
        put(block, 24, &self.key.namespace.0.to_le_bytes());
        put(block, 32, &self.key.chunk.0.to_le_bytes());
        let (kind, rank, world) = match self.key.rank {
            KvRank::Shared => (0u8, 0u16, 0u16),
            KvRank::Rank { rank, world } => (1, rank, world),
        };
        block[48] = kind;
        put(block, 50, &rank.to_le_bytes());
        put(block, 52, &world.to_le_bytes());
        put(block, 54, &self.key.group.0.to_le_bytes());
        put(block, 56, &self.len.to_le_bytes());
        put(block, 64, &self.checksum.to_le_bytes());
        let sum = xxh3_64(&block[..HEADER_BODY]);
        put(block, HEADER_BODY, &sum.to_le_bytes());
    }

    /// Reads a header, checking magic, version and checksum (not the epoch: the caller knows
    /// which epoch it expects).
    pub fn decode(block: &[u8]) -> Result<Self, Invalid> {
        if block.len() < HEADER_BODY + 8 {
            return Err(Invalid::Short);
        }
        if &block[..8] != RECORD_MAGIC {
            return Err(Invalid::Magic);
        }
        let version = u32_at(block, 8);
        if version != VERSION {
            return Err(Invalid::Version(version));
        }
        if xxh3_64(&block[..HEADER_BODY]) != u64_at(block, HEADER_BODY) {
            return Err(Invalid::Checksum);
        }
        let flags = u32_at(block, 12);
        if flags & !FLAG_DELETED != 0 {
            // A checksummed header with flags this version does not know was written by a newer
            // version: it cannot be read safely.
            return Err(Invalid::Version(version));
        }
        let rank = match block[48] {
            0 => KvRank::Shared,
            1 => KvRank::Rank { rank: u16_at(block, 50), world: u16_at(block, 52) },
            // A checksummed header with an unknown rank kind was written by a newer version.
            _ => return Err(Invalid::Version(version)),
        };
        let key = ObjectKey {
            namespace: Namespace(u64_at(block, 24)),
            chunk: ChunkHash(u128_at(block, 32)),
            rank,
            group: GroupId(u16_at(block, 54)),
        };
        Ok(Header {
            epoch: u64_at(block, 16),
            key,
            len: u64_at(block, 56),
            checksum: u64_at(block, 64),
            deleted: flags & FLAG_DELETED != 0,
        })
    }
}

/// The checksum every payload is stored and verified with.
pub fn payload_checksum(payload: &[u8]) -> u64 {
    xxh3_64(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> ObjectKey {
        ObjectKey {
            namespace: Namespace(0x1122_3344_5566_7788),
            chunk: ChunkHash(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10),
            rank: KvRank::Rank { rank: 3, world: 8 },
            group: GroupId(2),
        }
    }

    #[test]
    fn headers_and_superblocks_round_trip() {
        let mut block = vec![0xAA; BLOCK as usize];
        let header = Header { epoch: 42, key: key(), len: 2 << 20, checksum: 7, deleted: false };
        header.encode(&mut block);
        assert_eq!(Header::decode(&block), Ok(header));
        let shared = Header { key: ObjectKey { rank: KvRank::Shared, ..key() }, ..header };
        shared.encode(&mut block);
        assert_eq!(Header::decode(&block), Ok(shared));
        let deleted = Header { deleted: true, ..header };
        deleted.encode(&mut block);
        assert_eq!(u32_at(&block, 12), 1, "the deleted flag is bit 0 of the flags");
        assert_eq!(Header::decode(&block), Ok(deleted));
        // A flag this version does not know (with a valid checksum) is a newer writer's record.
        put(&mut block, 12, &2u32.to_le_bytes());
        let sum = xxh3_64(&block[..HEADER_BODY]);
        put(&mut block, HEADER_BODY, &sum.to_le_bytes());
        assert_eq!(Header::decode(&block), Err(Invalid::Version(VERSION)));
        let sb = Superblock { id: 9, epoch: 0xdead_beef, segment_bytes: 256 << 20 };
        sb.encode(&mut block);
        assert_eq!(Superblock::decode(&block), Ok(sb));
        assert!(block[SUPER_BODY + 8..].iter().all(|b| *b == 0), "the rest of the block is zeroed");
    }

    #[test]
    fn damage_is_recognised() {
        let mut block = vec![0; BLOCK as usize];
        assert_eq!(Header::decode(&block), Err(Invalid::Magic), "an unwritten block");
        Header { epoch: 1, key: key(), len: 10, checksum: 3, deleted: false }.encode(&mut block);
        for at in [12, 20, 40, 49, 60, 70] {
            let mut torn = block.clone();
            torn[at] ^= 0x01;
            assert_eq!(Header::decode(&torn), Err(Invalid::Checksum), "flip at {at}");
        }
        let mut newer = block.clone();
        newer[8] = 2;
        assert_eq!(Header::decode(&newer), Err(Invalid::Version(2)));
        assert_eq!(Header::decode(&block[..40]), Err(Invalid::Short));
        let mut sb = vec![0; BLOCK as usize];
        Superblock { id: 1, epoch: 2, segment_bytes: 3 }.encode(&mut sb);
        sb[20] ^= 0x80;
        assert_eq!(Superblock::decode(&sb), Err(Invalid::Checksum));
    }

    #[test]
    fn record_sizes_are_whole_blocks() {
        assert_eq!(record_bytes(0), BLOCK);
        assert_eq!(record_bytes(1), 2 * BLOCK);
        assert_eq!(record_bytes(BLOCK), 2 * BLOCK);
        assert_eq!(record_bytes(2 << 20), BLOCK + (2 << 20));
    }

    /// The layout is a format: these bytes must never change within version 1.
    #[test]
    fn golden_header_bytes() {
        let mut block = vec![0; BLOCK as usize];
        Header { epoch: 1, key: key(), len: 5, checksum: 6, deleted: false }.encode(&mut block);
        assert_eq!(&block[..8], b"TKVREC01");
        assert_eq!(&block[8..12], &[1, 0, 0, 0]);
        assert_eq!(&block[16..24], &[1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&block[24..32], &[0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]);
        assert_eq!(block[32], 0x10, "the chunk hash is little-endian");
        assert_eq!(&block[48..56], &[1, 0, 3, 0, 8, 0, 2, 0]);
        assert_eq!(&block[56..64], &[5, 0, 0, 0, 0, 0, 0, 0]);
    }
}
