//! tierkv-proto: what a worker and the daemon say to each other, and how it is framed.
//!
//! A frame is a 4-byte little-endian body length followed by the body: one MessagePack value,
//! structs as maps with their field names (so a Python client with `msgpack` speaks it as
//! easily as this crate does). A client sends [`Request`]s and gets one [`Reply`] per request,
//! in order, carrying the request's `id`. `docs/protocol.md` documents every message.
//!
//! Bulk data never travels in frames: a worker registers a shared-memory KV buffer once (the
//! file descriptor rides on the `register_buffer` frame as `SCM_RIGHTS`) and then names blocks
//! of it by index.

mod frame;
mod message;

pub use frame::{FrameError, HEADER_BYTES, MIN_FRAME_LIMIT, decode, encode, frame_len, read_frame};
pub use message::{
    BlockRef, ChunkId, ErrorCode, Hello, LookupOutcome, NamespaceDecl, Refused, Reply, ReplyBody,
    Request, RequestBody, RequestHeader, Role, SessionReport, StatusReport, TierReport,
};

/// The protocol version this build speaks; a hello with another version is refused.
pub const PROTOCOL_VERSION: u32 = 1;
