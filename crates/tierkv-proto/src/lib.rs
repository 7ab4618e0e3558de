//! tierkv-proto: what a worker and the daemon say to each other, and how it is framed.
//!
//! A frame is a 4-byte little-endian body length followed by the body: one MessagePack value,
//! structs as maps with their field names (so a Python client with `msgpack` speaks it as
//! easily as this crate does). A client sends [`Request`]s and gets one [`Reply`] per request,
//! in order, carrying the request's `id`. `docs/protocol.md` documents every message.
//!
//! Bulk data never travels in frames: a worker registers its KV memory once as regions with a
//! layout (memfd descriptors ride on the `register_kv` frame as `SCM_RIGHTS`) and then names
//! chunks by the engine's block ids; the daemon gathers and scatters the pieces itself.

mod frame;
mod message;

pub use frame::{FrameError, HEADER_BYTES, MIN_FRAME_LIMIT, decode, encode, frame_len, read_frame};
pub use message::{
    ChunkBlocks, ChunkId, ErrorCode, Hello, KvLayout, LookupOutcome, MAX_NAMESPACES, MAX_REGIONS,
    MAX_SEGMENTS, NamespaceDecl, RefusalReason, Refused, RegionSource, Reply, ReplyBody, Request,
    RequestBody, RequestHeader, Role, Segment, SessionReport, StatusReport, TierReport,
};

/// The protocol version this build speaks; a hello with another version is refused.
///
/// Version 2 replaced `register_buffer` (one memfd of equal blocks) with `register_kv` (regions
/// and a layout, so the daemon gathers a chunk from every layer of an engine's paged KV), and a
/// chunk names its blocks as a list. Version 4 added a store's `ready_event` (a CUDA IPC event
/// the daemon's copies wait for) and a retrieve's `done_event` (one it records after them).
/// Version 5 sends a request's chunks flat: a lookup's ids as one `bin`, a store's and a
/// retrieve's chunks as `{"ids": bin, "blocks": bin}` instead of a map per chunk, which cost
/// the Python client about a microsecond a chunk to build and pack. Version 6 added a lookup's
/// `defer_prefetch`: a daemon of version 5 refuses the field (requests refuse unknown fields), so
/// a client that may send it says so in its hello, and an older daemon refuses the session at
/// once rather than every lookup of it.
pub const PROTOCOL_VERSION: u32 = 6;
