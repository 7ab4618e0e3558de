//! The messages. Enums are externally tagged with snake_case names (`{"lookup": {...}}`, or a
//! bare string for a request without fields, `"status"`); every struct is a map of its fields.

use std::fmt;

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Namespaces one hello may declare.
pub const MAX_NAMESPACES: usize = 64;
/// Regions one `register_kv` may carry: a CUDA IPC region per allocation behind an engine's KV
/// tensors (vLLM allocates one per layer).
pub const MAX_REGIONS: usize = 256;
/// Segments one layout may have (its pieces, segments x blocks per chunk, are bounded too).
pub const MAX_SEGMENTS: usize = 1 << 16;

/// A list of at most `MAX` elements. The decoder refuses a longer one before it builds the
/// elements past the limit: MessagePack encodes some of them (a struct as a short array of
/// defaults) in a few bytes, so a frame could otherwise decode into many times its own size.
mod bounded {
    use std::fmt;
    use std::marker::PhantomData;

    use serde::de::{self, Deserialize, Deserializer, SeqAccess, Visitor};

    pub(super) fn deserialize<'de, D, T, const MAX: usize>(
        deserializer: D,
    ) -> Result<Vec<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: Deserialize<'de>,
    {
        struct List<T, const MAX: usize>(PhantomData<T>);

        impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for List<T, MAX> {
            type Value = Vec<T>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a list of at most {MAX}")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
                let announced = seq.size_hint().unwrap_or(0);
                if announced > MAX {
                    return Err(de::Error::invalid_length(announced, &self));
                }
                let mut list = Vec::with_capacity(announced);
                while let Some(element) = seq.next_element()? {
                    if list.len() == MAX {
                        return Err(de::Error::invalid_length(MAX + 1, &self));
                    }
                    list.push(element);
                }
                Ok(list)
            }
        }

        deserializer.deserialize_seq(List::<T, MAX>(PhantomData))
    }
}

/// The 128-bit chained hash of a chunk and its whole prefix, as the engine computes it. On the
/// wire: 16 bytes (MessagePack `bin`), big-endian.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub u128);

impl ChunkId {
    /// Bytes of a chunk id on the wire.
    pub const BYTES: usize = 16;

    /// The id's wire form: big-endian.
    pub fn to_bytes(self) -> [u8; Self::BYTES] {
        self.0.to_be_bytes()
    }

    /// The id of its wire form.
    pub fn from_bytes(bytes: [u8; Self::BYTES]) -> Self {
        ChunkId(u128::from_be_bytes(bytes))
    }
}

impl Serialize for ChunkId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.to_bytes())
    }
}

impl<'de> Deserialize<'de> for ChunkId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Bytes16;
        impl<'de> Visitor<'de> for Bytes16 {
            type Value = ChunkId;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("16 bytes")
            }

            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<ChunkId, E> {
                let bytes = v.try_into().map_err(|_| E::invalid_length(v.len(), &self))?;
                Ok(ChunkId::from_bytes(bytes))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ChunkId, A::Error> {
                let mut bytes = [0u8; ChunkId::BYTES];
                for (i, b) in bytes.iter_mut().enumerate() {
                    *b = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(i, &self))?;
                }
                if seq.next_element::<de::IgnoredAny>()?.is_some() {
                    return Err(de::Error::invalid_length(17, &self));
                }
                Ok(ChunkId::from_bytes(bytes))
            }
        }
        deserializer.deserialize_bytes(Bytes16)
    }
}

/// A request and the number its reply will carry. Requests refuse fields they do not know (a
/// misspelt optional field would otherwise be silently ignored), so a client learns of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// Chosen by the client; echoed in the reply.
    pub id: u64,
    /// What is asked.
    pub body: RequestBody,
}

/// The part of a request every well-formed frame has, whatever its body: lets the daemon answer
/// a request of a type it does not know with an error that carries the right id.
#[derive(Clone, Copy, Debug, Deserialize)]
pub struct RequestHeader {
    /// The request's id.
    pub id: u64,
}

/// Which requests a session may make.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// An engine worker: registers buffers, stores, looks up, retrieves.
    #[default]
    Worker,
    /// An operator's tool (`tierkv status`): status and clear only.
    Admin,
}

/// A model and tenant whose chunks a session may touch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceDecl {
    /// The model's name (its KV bytes differ from every other model's).
    pub model: String,
    /// A tenant salt: sessions with different salts never share chunks.
    #[serde(default)]
    pub cache_salt: String,
}

/// The first request of every session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    /// The client's [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// Worker or admin.
    #[serde(default)]
    pub role: Role,
    /// This worker's tensor-parallel rank.
    #[serde(default)]
    pub rank: u16,
    /// Tensor-parallel size of the worker's group.
    #[serde(default = "one")]
    pub tp_size: u16,
    /// World size of the engine (at least `tp_size`); `None` (left out): `tp_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u16>,
    /// The KV is identical on every rank (MLA): one shared copy serves the whole TP group, and a
    /// lookup counts `tp_size` readers.
    #[serde(default)]
    pub mla: bool,
    /// The namespaces this session touches; requests name them by index into this list.
    #[serde(default, deserialize_with = "bounded::deserialize::<_, _, MAX_NAMESPACES>")]
    pub namespaces: Vec<NamespaceDecl>,
    /// Bytes of one chunk (one block of the worker's buffer).
    #[serde(default)]
    pub chunk_bytes: u64,
    /// Tokens of one chunk.
    #[serde(default = "one_u32")]
    pub chunk_tokens: u32,
    /// The shared token, required over TCP.
    #[serde(default)]
    pub token: Option<String>,
}

fn one() -> u16 {
    1
}

fn one_u32() -> u32 {
    1
}

/// A chunk and the engine blocks of a registered KV buffer it is gathered from or scattered
/// into: `blocks[j]` holds the chunk's `j`-th block of tokens in every segment of the layout.
/// A request's chunks travel together, flat (the `chunk_list` encoding below).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkBlocks {
    /// The chunk.
    pub chunk: ChunkId,
    /// Its blocks, one per block of the layout's `blocks_per_chunk`, in token order.
    pub blocks: Vec<u64>,
}

impl ChunkBlocks {
    /// A chunk held by one block (a buffer whose chunks are single blocks).
    pub fn one(chunk: ChunkId, block: u64) -> Self {
        ChunkBlocks { chunk, blocks: vec![block] }
    }
}

/// A request's chunk ids on the wire: one `bin` of 16 bytes per chunk, each big-endian, in the
/// request's order. One string instead of an array of strings: a client packs a prompt's ids
/// without a call per id, and the daemon reads them without one.
pub mod chunk_ids {
    use serde::{Deserialize, Deserializer, Serializer, de};

    use super::ChunkId;

    const ID_BYTES: usize = ChunkId::BYTES;

    /// Packs `ids` into one `bin`.
    pub fn serialize<S: Serializer>(ids: &[ChunkId], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&pack(ids.iter().copied(), ids.len()))
    }

    /// Unpacks a `bin` of whole 16-byte ids.
    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Vec<ChunkId>, D::Error> {
        let raw = serde_bytes::ByteBuf::deserialize(deserializer)?;
        unpack(&raw).map_err(de::Error::custom)
    }

    /// `count` ids, packed one after another.
    pub(super) fn pack(ids: impl Iterator<Item = ChunkId>, count: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(count * ID_BYTES);
        for id in ids {
            out.extend_from_slice(&id.to_bytes());
        }
        out
    }

    pub(super) fn unpack(raw: &[u8]) -> Result<Vec<ChunkId>, String> {
        if !raw.len().is_multiple_of(ID_BYTES) {
            return Err(format!(
                "chunk ids are {ID_BYTES} bytes each; got {} bytes of them",
                raw.len()
            ));
        }
        Ok(raw
            .chunks_exact(ID_BYTES)
            .map(|id| {
                let mut bytes = [0u8; ID_BYTES];
                bytes.copy_from_slice(id);
                ChunkId::from_bytes(bytes)
            })
            .collect())
    }
}

/// A request's chunks and their blocks on the wire, flat: `{"ids": bin, "blocks": bin}`. `ids`
/// as in [`chunk_ids`]; `blocks` the chunks' block ids in order, each a little-endian `u64`, the
/// same number for every chunk (the buffer's `blocks_per_chunk`, which the daemon checks).
pub mod chunk_list {
    use serde::ser::Error as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

    use super::{ChunkBlocks, chunk_ids};

    /// Bytes of one block id.
    const BLOCK_BYTES: usize = 8;

    #[derive(Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Flat {
        ids: serde_bytes::ByteBuf,
        blocks: serde_bytes::ByteBuf,
    }

    /// Packs `chunks`; chunks naming different numbers of blocks are an error.
    pub fn serialize<S: Serializer>(
        chunks: &[ChunkBlocks],
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        let per_chunk = chunks.first().map_or(0, |c| c.blocks.len());
        let mut blocks = Vec::with_capacity(chunks.len() * per_chunk * BLOCK_BYTES);
        for chunk in chunks {
            if chunk.blocks.len() != per_chunk {
                return Err(S::Error::custom(format!(
                    "every chunk of a request names the same number of blocks; the first \
                     names {per_chunk}, another {}",
                    chunk.blocks.len()
                )));
            }
            for block in &chunk.blocks {
                blocks.extend_from_slice(&block.to_le_bytes());
            }
        }
        let ids = chunk_ids::pack(chunks.iter().map(|c| c.chunk), chunks.len());
        Flat { ids: ids.into(), blocks: blocks.into() }.serialize(serializer)
    }

    /// Unpacks the chunks, refusing ids and blocks that do not divide evenly.
    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Vec<ChunkBlocks>, D::Error> {
        let flat = Flat::deserialize(deserializer)?;
        let ids = chunk_ids::unpack(&flat.ids).map_err(de::Error::custom)?;
        let blocks = &flat.blocks;
        if !blocks.len().is_multiple_of(BLOCK_BYTES) {
            return Err(de::Error::custom(format!(
                "block ids are {BLOCK_BYTES} bytes each; got {} bytes of them",
                blocks.len()
            )));
        }
        let count = blocks.len() / BLOCK_BYTES;
        if ids.is_empty() {
            return if count == 0 {
                Ok(Vec::new())
            } else {
                Err(de::Error::custom(format!("{count} block ids for no chunk")))
            };
        }
        if !count.is_multiple_of(ids.len()) {
            return Err(de::Error::custom(format!(
                "{count} block ids do not divide among {} chunks: every chunk names the same \
                 number of blocks",
                ids.len()
            )));
        }
        let per_chunk = count / ids.len();
        if per_chunk == 0 {
            // Chunks without blocks: the daemon refuses them against the buffer's layout.
            return Ok(ids
                .into_iter()
                .map(|chunk| ChunkBlocks { chunk, blocks: Vec::new() })
                .collect());
        }
        Ok(ids
            .into_iter()
            .zip(blocks.chunks_exact(BLOCK_BYTES * per_chunk))
            .map(|(chunk, raw)| ChunkBlocks {
                chunk,
                blocks: raw
                    .chunks_exact(BLOCK_BYTES)
                    .map(|b| {
                        let mut bytes = [0u8; BLOCK_BYTES];
                        bytes.copy_from_slice(b);
                        u64::from_le_bytes(bytes)
                    })
                    .collect(),
            })
            .collect())
    }
}

/// Where the memory of a registered region lives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum RegionSource {
    /// A memfd sealed against shrinking whose descriptor rides on the `register_kv` frame
    /// (`SCM_RIGHTS`; the memfd regions' descriptors in the order of the regions).
    Memfd {
        /// Bytes of the region; the file must be at least this long.
        bytes: u64,
    },
    /// Device memory exported with `cuIpcGetMemHandle` (the GPU data path). A daemon without
    /// it refuses the registration with `bad_buffer`.
    CudaIpc {
        /// The 64-byte `CUipcMemHandle`.
        #[serde(with = "serde_bytes")]
        handle: Vec<u8>,
        /// The device's PCI bus id (`0000:3b:00.0`), so the daemon opens it on the same GPU.
        device: String,
        /// Bytes of the allocation the handle names.
        bytes: u64,
    },
}

/// One array of equal, strided blocks inside a region: a layer's KV, or one plane of it (K or
/// V) when the engine keeps them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Segment {
    /// Index into the registration's regions.
    pub region: u32,
    /// Byte offset of block 0 in the region.
    pub offset: u64,
}

/// How an engine's KV memory is laid out: every segment holds `blocks` blocks of `block_bytes`
/// bytes, `block_stride` apart, and a chunk is `blocks_per_chunk` engine blocks taken from every
/// segment. The daemon gathers a chunk's pieces segment by segment, block by block, into one
/// object of `segments * blocks_per_chunk * block_bytes` bytes, and scatters it back the same way.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvLayout {
    /// Blocks in each segment.
    pub blocks: u64,
    /// Contiguous bytes of one block in one segment.
    pub block_bytes: u64,
    /// Bytes from the start of a block to the start of the next in the same segment.
    pub block_stride: u64,
    /// Engine blocks in one chunk.
    pub blocks_per_chunk: u32,
    /// The segments, in the order their pieces are laid out in a chunk.
    #[serde(deserialize_with = "bounded::deserialize::<_, _, MAX_SEGMENTS>")]
    pub segments: Vec<Segment>,
}

/// What a client asks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum RequestBody {
    /// Opens the session; must come first.
    Hello(Hello),
    /// Registers a KV buffer: its memory regions (memfds ride on this frame) and their layout.
    RegisterKv {
        /// The regions, 1..=256, of which at most 8 memfd regions.
        #[serde(deserialize_with = "bounded::deserialize::<_, _, MAX_REGIONS>")]
        regions: Vec<RegionSource>,
        /// How chunks lie in them; a chunk must be the session's `chunk_bytes`.
        layout: KvLayout,
    },
    /// Copies blocks into the cache as new chunks, visible once the copy is complete.
    Store {
        /// Index into the hello's namespaces.
        namespace: u32,
        /// A registered buffer.
        buffer: u32,
        /// The chunks, root first, and the blocks holding their bytes.
        #[serde(with = "chunk_list")]
        chunks: Vec<ChunkBlocks>,
        /// For a buffer in GPU memory: the 64-byte handle of a CUDA IPC event
        /// (`cuIpcGetEventHandle`) the worker recorded on the stream that wrote the blocks. The
        /// daemon waits for it before its copies, so the worker need not synchronize first.
        #[serde(default, skip_serializing_if = "Option::is_none", with = "serde_bytes")]
        ready_event: Option<Vec<u8>>,
    },
    /// Starts a prefix lookup: the hits in L1 are leased at once, the rest is prefetched.
    Lookup {
        /// Index into the hello's namespaces.
        namespace: u32,
        /// The prompt's chunk hashes, root first.
        #[serde(with = "chunk_ids")]
        chunks: Vec<ChunkId>,
        /// Prefetch nothing until the lookup's first `query` or `wait`: a request's lookups on
        /// its TP ranks' sessions are all made (every rank's L1 hits leased) before any rank's
        /// prefetch can evict another rank's hits.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        defer_prefetch: bool,
    },
    /// Asks whether a lookup is complete, without waiting.
    Query {
        /// The lookup.
        lookup: u64,
    },
    /// Waits for a lookup to complete.
    Wait {
        /// The lookup.
        lookup: u64,
        /// How long to wait at most.
        timeout_ms: u64,
    },
    /// Copies chunks of a lookup's hit into blocks, then returns this reader's share.
    Retrieve {
        /// The lookup (possibly made by another rank of the same TP group).
        lookup: u64,
        /// A registered buffer.
        buffer: u32,
        /// Chunks of the hit and the blocks to copy them into.
        #[serde(with = "chunk_list")]
        chunks: Vec<ChunkBlocks>,
        /// For a buffer in GPU memory: the 64-byte handle of a CUDA IPC event of the worker's.
        /// The daemon records it after the retrieve's copies and replies without waiting for
        /// them; the engine makes its stream wait for the event before its kernels read.
        #[serde(default, skip_serializing_if = "Option::is_none", with = "serde_bytes")]
        done_event: Option<Vec<u8>>,
    },
    /// Returns every share a lookup still holds (chunks the engine will not read).
    Release {
        /// The lookup; only the session that made it may release it.
        lookup: u64,
    },
    /// Waits until every chunk this session stored since its last flush has been through the
    /// store pipeline, and says how many of them are on the disk tier.
    Flush {
        /// How long to wait at most; chunks still on their way then stay for the next flush.
        timeout_ms: u64,
    },
    /// Ends the session: everything it holds is returned, and the connection closes.
    EndSession,
    /// How the daemon is doing.
    Status,
    /// Empties every tier of what nobody holds (admin sessions only).
    Clear,
}

/// A reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    /// The request's id (0 when the request was too broken to carry one).
    pub id: u64,
    /// The answer.
    pub body: ReplyBody,
}

/// Why a chunk of a store was not stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refused {
    /// Its position in the request.
    pub index: u32,
    /// Why, as a code a client can branch on.
    pub reason: RefusalReason,
    /// What the daemon said of it, for a person.
    pub message: String,
}

/// Why one chunk of a store was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalReason {
    /// L1 has no room: full of chunks being read, written or copied down (try again later).
    NoSpace,
    /// The chunk's slot is busy (another copy is under way); try again.
    Busy,
    /// Gathering the chunk from the worker's blocks failed.
    CopyFailed,
    /// Something else failed inside the daemon; the message says what.
    Internal,
}

/// What a lookup found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupOutcome {
    /// The hit: this many chunks from the root are available.
    pub hit_chunks: u32,
    /// The hit in tokens.
    pub hit_tokens: u64,
    /// Readers that each return a share (`1 + extra_count`).
    pub readers: u32,
    /// Chunks of the hit served by each tier, always four: `[l1, l2, disk, remote]` (0 for a tier the
    /// daemon does not have). They add up to `hit_chunks`.
    pub per_tier: Vec<u32>,
}

/// One tier in a status report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierReport {
    /// "l1", "l2", "disk", "remote".
    pub name: String,
    /// Bytes of every chunk the tier holds, in any state (cached, being written, or held), as
    /// `tierkv_tier_used_bytes` counts them.
    pub used_bytes: u64,
    /// Bytes of cached chunks that eviction may take: `used_bytes - cached_bytes` are pinned
    /// (in L1: chunks being written, leased, or still being copied from).
    pub cached_bytes: u64,
    /// Bytes the tier may use.
    pub capacity_bytes: u64,
    /// Chunks stored.
    pub objects: u64,
    /// Chunks of lookup hits this tier served.
    pub hit_chunks: u64,
    /// Why the tier refuses stores, while it does (the disk tier, when its directory cannot be
    /// written: read-only, or unwritable; a full disk is not a reason, its segments are reused;
    /// it retries and clears this when it can write again); `None` (nil) otherwise.
    #[serde(default)]
    pub read_only: Option<String>,
    /// Why the tier is degraded, while it is (the remote tier, when Redis cannot be reached:
    /// its lookups and loads are misses while it reconnects); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub degraded: Option<String>,
}

/// One connected session in a status report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionReport {
    /// The session's number.
    pub session: u64,
    /// Worker or admin.
    pub role: Role,
    /// Tensor-parallel rank and size.
    pub rank: u16,
    /// Tensor-parallel size.
    pub tp_size: u16,
    /// Lookups it made that are not yet released.
    pub open_lookups: u64,
    /// Other sessions' lookups it answers for a reader's share of (an MLA rank's, once it asked
    /// about one): each returned when it retrieves, or when it closes.
    #[serde(default)]
    pub joined_lookups: u64,
}

/// The daemon's state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The daemon's version.
    pub version: String,
    /// Seconds since it started.
    pub uptime_s: f64,
    /// Every tier, L1 first.
    pub tiers: Vec<TierReport>,
    /// L1 chunks with read shares not yet returned (0 when every reader is done).
    pub l1_leased_chunks: u64,
    /// Lookups completed.
    pub lookups: u64,
    /// Chunks asked for by lookups.
    pub requested_chunks: u64,
    /// Chunks of hits, all tiers.
    pub hit_chunks: u64,
    /// `hit_chunks / requested_chunks` (0 before the first lookup).
    pub hit_ratio: f64,
    /// Tokens asked for by lookups.
    pub requested_tokens: u64,
    /// Tokens of hits, all tiers.
    pub hit_tokens: u64,
    /// Lookups not yet released.
    pub open_lookups: u64,
    /// Store copies to the lower tiers queued or running.
    pub store_in_flight: u64,
    /// Worker sessions connected.
    pub connected_workers: u32,
    /// Every session.
    pub sessions: Vec<SessionReport>,
}

/// Why a request failed. Stable numbers a client can branch on; the message says the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The frame could not be decoded; the connection is closed after this reply.
    BadFrame,
    /// A well-formed frame of an unknown type, or with fields that do not fit.
    BadRequest,
    /// The hello's protocol version is not this daemon's.
    VersionMismatch,
    /// A request before the hello, or a second hello.
    NoSession,
    /// A wrong or missing token, or a request the session's role may not make.
    Forbidden,
    /// A namespace index the hello did not declare.
    NamespaceNotDeclared,
    /// A buffer that was not registered, or a registration that was refused.
    BadBuffer,
    /// A block index outside the registered buffer.
    BlockOutOfRange,
    /// A lookup that does not exist (never, or no longer).
    UnknownLookup,
    /// The lookup is still prefetching.
    Pending,
    /// A chunk that is not part of the lookup's hit.
    NotInHit,
    /// This reader already returned its share.
    ShareReturned,
    /// The wait timed out; the lookup stays open.
    Timeout,
    /// The cache cannot take the request now (no free or evictable space).
    Full,
    /// The daemon is shutting down.
    Stopped,
    /// The daemon serves `server.max_connections` connections already; the connection closes.
    TooManyConnections,
    /// The session's lookups hold `server.max_leased_per_session` bytes of leases already;
    /// release or retrieve some first.
    LeaseLimit,
    /// Something failed inside the daemon; the message says what.
    Internal,
}

/// What the daemon answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplyBody {
    /// The session is open.
    Welcome {
        /// The daemon's protocol version.
        version: u32,
        /// The session's number.
        session: u64,
        /// The largest chunk the daemon stores.
        max_chunk_bytes: u64,
        /// Readers of every lookup this session makes (`tp_size` with MLA, else 1).
        readers: u32,
    },
    /// The KV buffer is registered under this number.
    BufferRegistered {
        /// Its number for later requests.
        buffer: u32,
    },
    /// A store's outcome.
    Stored {
        /// Chunks copied in and now visible.
        stored: u32,
        /// Chunks that were already cached (or being written by another session).
        present: u32,
        /// Chunks refused, with why.
        refused: Vec<Refused>,
    },
    /// A lookup started.
    LookupStarted {
        /// Its number.
        lookup: u64,
        /// Chunks of the hit that L1 held: readable at once.
        l1_hit_chunks: u32,
        /// Its outcome, when it completed at once (everything came from L1).
        outcome: Option<LookupOutcome>,
    },
    /// The lookup is still prefetching.
    Pending,
    /// The lookup completed.
    Done(LookupOutcome),
    /// A retrieve's copies are complete and this reader's share is returned.
    Retrieved {
        /// Chunks copied.
        chunks: u32,
        /// Bytes copied.
        bytes: u64,
    },
    /// The lookup's shares are returned.
    Released,
    /// What a flush found.
    Flushed {
        /// Chunks the session stored since its last flush that are on the disk tier (synced
        /// under `disk.fsync = "always"`).
        durable: u32,
        /// Chunks that did not reach the disk: no disk tier, a store policy that does not write
        /// them to disk now, or a failed copy.
        not_durable: u32,
    },
    /// The session ended.
    Bye,
    /// The status.
    Status(StatusReport),
    /// What a clear removed.
    Cleared {
        /// Chunks removed from each tier, L1 first.
        removed: Vec<u64>,
    },
    /// The request failed; nothing it asked for happened.
    Error {
        /// What kind of failure.
        code: ErrorCode,
        /// What happened, for a person.
        message: String,
    },
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;
    use crate::{decode, encode};

    fn round_trip<T: Serialize + serde::de::DeserializeOwned>(value: &T) -> T {
        let mut out = Vec::new();
        encode(value, &mut out).unwrap();
        decode(&out[4..]).unwrap()
    }

    #[test]
    fn every_request_round_trips() {
        let hello = Hello {
            version: 1,
            role: Role::Worker,
            rank: 1,
            tp_size: 2,
            world_size: Some(2),
            mla: true,
            namespaces: vec![NamespaceDecl { model: "m".into(), cache_salt: "s".into() }],
            chunk_bytes: 4096,
            chunk_tokens: 16,
            token: Some("t".into()),
        };
        let chunk = ChunkId(u128::MAX - 5);
        let bodies = vec![
            RequestBody::Hello(hello),
            RequestBody::RegisterKv {
                regions: vec![
                    RegionSource::Memfd { bytes: 1 << 20 },
                    RegionSource::CudaIpc {
                        handle: vec![7; 64],
                        device: "0000:3b:00.0".into(),
                        bytes: 1 << 30,
                    },
                ],
                layout: KvLayout {
                    blocks: 8,
                    block_bytes: 512,
                    block_stride: 1024,
                    blocks_per_chunk: 2,
                    segments: vec![
                        Segment { region: 0, offset: 0 },
                        Segment { region: 1, offset: 512 },
                    ],
                },
            },
            RequestBody::Store {
                namespace: 0,
                buffer: 1,
                chunks: vec![ChunkBlocks { chunk, blocks: vec![3, 5] }],
                ready_event: None,
            },
            RequestBody::Store {
                namespace: 0,
                buffer: 1,
                chunks: vec![ChunkBlocks::one(chunk, 0)],
                ready_event: Some(vec![9; 64]),
            },
            RequestBody::Lookup {
                namespace: 0,
                chunks: vec![chunk, ChunkId(0)],
                defer_prefetch: false,
            },
            RequestBody::Lookup { namespace: 0, chunks: vec![chunk], defer_prefetch: true },
            RequestBody::Query { lookup: 9 },
            RequestBody::Wait { lookup: 9, timeout_ms: 10 },
            RequestBody::Retrieve {
                lookup: 9,
                buffer: 1,
                chunks: vec![ChunkBlocks::one(chunk, 0)],
                done_event: None,
            },
            RequestBody::Retrieve {
                lookup: 9,
                buffer: 1,
                chunks: vec![ChunkBlocks::one(chunk, 0)],
                done_event: Some(vec![3; 64]),
            },
            RequestBody::Release { lookup: 9 },
            RequestBody::EndSession,
            RequestBody::Status,
            RequestBody::Clear,
        ];
        for (id, body) in bodies.into_iter().enumerate() {
            let request = Request { id: id as u64, body };
            assert_eq!(round_trip(&request), request);
        }
    }

    #[test]
    fn replies_round_trip() {
        let outcome =
            LookupOutcome { hit_chunks: 3, hit_tokens: 48, readers: 2, per_tier: vec![1, 2] };
        let bodies = vec![
            ReplyBody::Welcome { version: 1, session: 4, max_chunk_bytes: 1 << 20, readers: 2 },
            ReplyBody::Stored {
                stored: 1,
                present: 2,
                refused: vec![Refused {
                    index: 0,
                    reason: RefusalReason::NoSpace,
                    message: "full".into(),
                }],
            },
            ReplyBody::LookupStarted {
                lookup: 1,
                l1_hit_chunks: 1,
                outcome: Some(outcome.clone()),
            },
            ReplyBody::Pending,
            ReplyBody::Done(outcome),
            ReplyBody::Error { code: ErrorCode::BlockOutOfRange, message: "no".into() },
            ReplyBody::Bye,
        ];
        for body in bodies {
            let reply = Reply { id: 1, body };
            assert_eq!(round_trip(&reply), reply);
        }
    }

    #[test]
    fn the_wire_form_is_what_docs_protocol_md_shows() {
        // A Python client builds exactly these maps; pin them.
        let mut out = Vec::new();
        encode(&Request { id: 1, body: RequestBody::Status }, &mut out).unwrap();
        let expected: &[u8] = &[
            0x82, 0xa2, b'i', b'd', 0x01, 0xa4, b'b', b'o', b'd', b'y', 0xa6, b's', b't', b'a',
            b't', b'u', b's',
        ];
        assert_eq!(&out[4..], expected);
        out.clear();
        encode(&ChunkId(1), &mut out).unwrap();
        assert_eq!(&out[4..6], &[0xc4, 16], "a chunk id is a 16-byte bin");
        assert_eq!(out[21], 1, "big-endian");
    }

    #[test]
    fn an_unknown_request_type_still_yields_its_id() {
        // {"id": 5, "body": {"frobnicate": {}}}
        let body: &[u8] = &[
            0x82, 0xa2, b'i', b'd', 0x05, 0xa4, b'b', b'o', b'd', b'y', 0x81, 0xaa, b'f', b'r',
            b'o', b'b', b'n', b'i', b'c', b'a', b't', b'e', 0x80,
        ];
        assert!(decode::<Request>(body).is_err());
        assert_eq!(decode::<RequestHeader>(body).unwrap().id, 5);
    }

    #[test]
    fn chunk_ids_of_the_wrong_length_are_refused() {
        let mut out = Vec::new();
        encode(&serde_bytes_like(&[1, 2, 3]), &mut out).unwrap();
        assert!(decode::<ChunkId>(&out[4..]).is_err());
    }

    /// A retrieve whose `chunks` are `{"ids": ids, "blocks": blocks}` as given.
    fn retrieve_frame(ids: &[u8], blocks: &[u8]) -> Vec<u8> {
        #[derive(Serialize)]
        struct Flat<'a> {
            ids: Raw<'a>,
            blocks: Raw<'a>,
        }
        #[derive(Serialize)]
        struct Body<'a> {
            lookup: u64,
            buffer: u32,
            chunks: Flat<'a>,
        }
        #[derive(Serialize)]
        #[serde(rename_all = "snake_case")]
        enum Wire<'a> {
            Retrieve(Body<'a>),
        }
        #[derive(Serialize)]
        struct Frame<'a> {
            id: u64,
            body: Wire<'a>,
        }
        let body =
            Body { lookup: 1, buffer: 0, chunks: Flat { ids: Raw(ids), blocks: Raw(blocks) } };
        let mut out = Vec::new();
        encode(&Frame { id: 3, body: Wire::Retrieve(body) }, &mut out).unwrap();
        out.split_off(4)
    }

    fn retrieved_chunks(frame: &[u8]) -> Result<Vec<ChunkBlocks>, crate::FrameError> {
        match decode::<Request>(frame)?.body {
            RequestBody::Retrieve { chunks, .. } => Ok(chunks),
            other => panic!("not a retrieve: {other:?}"),
        }
    }

    #[test]
    fn a_flat_chunk_list_splits_its_blocks_evenly_among_its_chunks() {
        let ids: Vec<u8> = (0..32).collect();
        let blocks: Vec<u8> = [1u64, 2, 3, 4].iter().flat_map(|b| b.to_le_bytes()).collect();
        let chunks = retrieved_chunks(&retrieve_frame(&ids, &blocks)).unwrap();
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[0].blocks, [1, 2]);
        assert_eq!(chunks[1].blocks, [3, 4]);
        assert_eq!(chunks[1].chunk, ChunkId(u128::from_be_bytes(ids[16..].try_into().unwrap())));
        // Chunks without blocks decode, for the daemon to refuse against the buffer's layout.
        let bare = retrieved_chunks(&retrieve_frame(&ids, &[])).unwrap();
        assert_eq!(bare.len(), 2);
        assert!(bare.iter().all(|c| c.blocks.is_empty()));
        assert!(retrieved_chunks(&retrieve_frame(&[], &[])).unwrap().is_empty());
    }

    #[test]
    fn a_flat_chunk_list_that_does_not_divide_is_refused() {
        let ids: Vec<u8> = (0..32).collect();
        let three: Vec<u8> = [1u64, 2, 3].iter().flat_map(|b| b.to_le_bytes()).collect();
        let cases: [(&[u8], &[u8], &str); 4] = [
            (&ids[..20], &three[..16], "16 bytes each"),
            (&ids, &three[..12], "8 bytes each"),
            (&ids, &three, "do not divide among 2 chunks"),
            (&[], &three[..8], "for no chunk"),
        ];
        for (ids, blocks, says) in cases {
            let error = retrieved_chunks(&retrieve_frame(ids, blocks)).unwrap_err();
            assert!(error.to_string().contains(says), "{error} should say {says:?}");
        }
    }

    #[test]
    fn chunks_naming_different_numbers_of_blocks_cannot_be_encoded() {
        let body = RequestBody::Store {
            namespace: 0,
            buffer: 0,
            chunks: vec![
                ChunkBlocks::one(ChunkId(1), 0),
                ChunkBlocks { chunk: ChunkId(2), blocks: vec![1, 2] },
            ],
            ready_event: None,
        };
        let error = encode(&Request { id: 1, body }, &mut Vec::new()).unwrap_err();
        assert!(error.to_string().contains("same number of blocks"), "{error}");
    }

    struct Raw<'a>(&'a [u8]);
    impl Serialize for Raw<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(self.0)
        }
    }
    fn serde_bytes_like(bytes: &[u8]) -> Raw<'_> {
        Raw(bytes)
    }
}
