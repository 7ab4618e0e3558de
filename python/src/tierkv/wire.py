"""The tierkv wire protocol (version 6): frames, request bodies and replies.

A frame is a 4-byte little-endian body length followed by one MessagePack value. A request is
``{"id": u64, "body": RequestBody}``; the daemon answers each with ``{"id", "body": ReplyBody}``
in order. Structs are maps keyed by field name in the order the Rust types declare them
(``crates/tierkv-proto/src/message.rs`` is the source of truth), enums are externally tagged in
snake_case (``{"lookup": {...}}``, or a bare string such as ``"status"`` for a variant without
fields), and ``None`` is nil. A chunk id is a Python ``int`` below ``2**128`` that travels as
16 big-endian bytes. A request's chunks travel flat: a lookup's ids as one ``bin`` of 16 bytes
per chunk, a store's and a retrieve's as ``{"ids": bin, "blocks": bin}``, the blocks
little-endian ``u64``, the same number for every chunk.

The request constructors (:func:`hello`, :func:`register_kv`, :func:`store`, ...) return the
msgpack-ready body, with its integers checked against their wire widths, so that a mistake is a
``ValueError`` here rather than a ``bad_request`` from the daemon. :func:`encode_frame` frames a
body; :func:`decode_reply` turns a reply frame's body into ``(id, reply)``, where the reply is
one of the frozen dataclasses below (a status is a plain ``dict``) and an ``error`` reply raises
its :class:`~tierkv.errors.DaemonError` subclass.
"""

from __future__ import annotations

import operator
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgpack

from .errors import ConnectionLost, DaemonError, error_for

__all__ = [
    "CLEAR",
    "END_SESSION",
    "HEADER",
    "MAX_REPLY_BYTES",
    "PROTOCOL_VERSION",
    "REFUSAL_REASONS",
    "STATUS",
    "Bye",
    "BufferRegistered",
    "Cleared",
    "CudaIpcRegion",
    "Done",
    "Flushed",
    "KvLayout",
    "LookupOutcome",
    "LookupStarted",
    "MemfdRegion",
    "Pending",
    "Released",
    "Reply",
    "Retrieved",
    "Segment",
    "Stored",
    "Welcome",
    "decode_chunk_id",
    "decode_reply",
    "encode_chunk_id",
    "encode_frame",
    "flush",
    "hello",
    "lookup",
    "parse_reply_body",
    "query",
    "register_kv",
    "release",
    "retrieve",
    "store",
    "unpack_reply",
    "wait",
]

#: The protocol version this package speaks; the daemon refuses a hello with another.
PROTOCOL_VERSION = 6

#: Regions one ``register_kv`` may name (the daemon's limit, tierkv-proto's ``MAX_REGIONS``).
MAX_REGIONS = 256

#: Memfd regions one ``register_kv`` may name: their descriptors ride on one ``sendmsg``.
MAX_MEMFD_REGIONS = 8

#: The frame header: the body's length, a little-endian u32.
HEADER = struct.Struct("<I")

#: Reply frames longer than this are refused as broken (a status with thousands of sessions
#: still fits; the Rust client uses the same limit).
MAX_REPLY_BYTES = 64 << 20

#: Request bodies without fields: the bare variant name.
END_SESSION = "end_session"
STATUS = "status"
CLEAR = "clear"

_U16 = (1 << 16) - 1
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_U128 = (1 << 128) - 1

ROLES = ("worker", "admin")


def _uint(value: Any, limit: int, what: str) -> int:
    """``value`` as a plain ``int`` within ``0..=limit`` (numpy integers are converted)."""
    # The common case first, on every block id of every request: a plain int (`type` is `bool`
    # for a bool, so a bool still takes the checks below).
    if type(value) is int and 0 <= value <= limit:
        return value
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, not a bool")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}") from None
    if not 0 <= n <= limit:
        raise ValueError(f"{what} must be within 0..={limit}, got {n}")
    return n


def encode_chunk_id(chunk: int) -> bytes:
    """A chunk id as it travels: 16 bytes, big-endian."""
    if type(chunk) is int and 0 <= chunk <= _U128:
        return chunk.to_bytes(16, "big")
    return _uint(chunk, _U128, "a chunk id").to_bytes(16, "big")


def _pack_chunk_ids(chunks: Iterable[int]) -> bytes:
    """Chunk ids as a request carries them: 16 big-endian bytes each, in one string."""
    ids = chunks if isinstance(chunks, list) else list(chunks)
    # The common case in C-level loops: plain ints in range (a bool is refused below, a negative
    # or too large id raises OverflowError, anything else AttributeError or TypeError).
    try:
        if bool not in map(type, ids):
            return b"".join([c.to_bytes(16, "big") for c in ids])
    except (AttributeError, OverflowError, TypeError):
        pass
    # Numpy integers, or the precise error of the id that is wrong.
    return b"".join([encode_chunk_id(c) for c in ids])


#: Block ids as they travel: little-endian u64.
if array("Q").itemsize != 8:  # pragma: no cover - every platform CPython supports
    raise ImportError("tierkv needs an 8-byte array('Q')")
_BIG_ENDIAN = sys.byteorder == "big"


def _pack_block_ids(blocks: list[Any]) -> bytes:
    """Block ids as a request carries them: little-endian u64 each, in one string."""
    packed: array[int] | None = None
    try:
        if bool not in map(type, blocks):
            packed = array("Q", blocks)
    except (OverflowError, TypeError):
        pass
    if packed is None:
        # Numpy integers, or the precise error of the block id that is wrong.
        packed = array("Q", [_uint(b, _U64, "a block id") for b in blocks])
    if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI machine
        packed.byteswap()
    return packed.tobytes()


def decode_chunk_id(raw: bytes) -> int:
    """The chunk id of 16 big-endian bytes."""
    if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) != 16:
        raise ValueError(f"a chunk id is 16 bytes, got {raw!r}")
    return int.from_bytes(raw, "big")


# ---------------------------------------------------------------------------------------------
# Frames
# ---------------------------------------------------------------------------------------------


def encode_frame(request_id: int, body: Any) -> bytes:
    """One request frame: the 4-byte little-endian length, then ``{"id", "body"}`` packed."""
    packed = msgpack.packb(
        {"id": _uint(request_id, _U64, "a request id"), "body": body}, use_bin_type=True
    )
    return HEADER.pack(len(packed)) + packed


def unpack_reply(body_bytes: bytes | bytearray | memoryview) -> tuple[int, Any]:
    """The ``(id, body)`` of a reply frame's body, the body still as MessagePack decoded it.

    Raises :class:`ConnectionLost` when it is not a reply at all.
    """
    try:
        reply = msgpack.unpackb(body_bytes, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for broken input
        raise ConnectionLost(f"bad reply: not MessagePack ({e})") from e
    if not isinstance(reply, dict) or "id" not in reply or "body" not in reply:
        raise ConnectionLost(f"bad reply: not an {{id, body}} map: {reply!r:.200}")
    reply_id = reply["id"]
    if not isinstance(reply_id, int) or isinstance(reply_id, bool) or not 0 <= reply_id <= _U64:
        raise ConnectionLost(f"bad reply: id {reply_id!r:.50}")
    return reply_id, reply["body"]


def decode_reply(body_bytes: bytes | bytearray | memoryview) -> tuple[int, Reply]:
    """The ``(id, reply)`` of a reply frame's body (without the 4-byte length).

    An ``error`` reply raises its :class:`~tierkv.errors.DaemonError` subclass; a body that is
    not a reply raises :class:`~tierkv.errors.ConnectionLost`.
    """
    reply_id, body = unpack_reply(body_bytes)
    return reply_id, parse_reply_body(body)


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


def hello(
    *,
    version: int = PROTOCOL_VERSION,
    role: str = "worker",
    rank: int = 0,
    tp_size: int = 1,
    world_size: int | None = None,
    mla: bool = False,
    namespaces: Iterable[tuple[str, str] | str] = (),
    chunk_bytes: int = 0,
    chunk_tokens: int = 1,
    token: str | None = None,
) -> dict[str, Any]:
    """The ``hello`` that opens a session.

    ``namespaces`` lists ``(model, cache_salt)`` pairs (a bare string is a model with an empty
    salt); later requests name them by index. A worker declares 1..=64 and a ``chunk_bytes`` of
    1..=the daemon's L1 slot; an admin (``role="admin"``) needs neither. ``token`` is required
    over TCP. ``world_size`` left out (``None``) is ``tp_size``.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    decls = []
    for ns in namespaces:
        if isinstance(ns, str):
            model, salt = ns, ""
        else:
            model, salt = ns
        if not isinstance(model, str) or not isinstance(salt, str):
            raise TypeError(f"a namespace is (model: str, cache_salt: str), got {ns!r}")
        decls.append({"model": model, "cache_salt": salt})
    if token is not None and not isinstance(token, str):
        raise TypeError("token must be a str or None")
    fields: dict[str, Any] = {
        "version": _uint(version, _U32, "version"),
        "role": role,
        "rank": _uint(rank, _U16, "rank"),
        "tp_size": _uint(tp_size, _U16, "tp_size"),
    }
    if world_size is not None:
        fields["world_size"] = _uint(world_size, _U16, "world_size")
    fields.update(
        {
            "mla": bool(mla),
            "namespaces": decls,
            "chunk_bytes": _uint(chunk_bytes, _U64, "chunk_bytes"),
            "chunk_tokens": _uint(chunk_tokens, _U32, "chunk_tokens"),
            "token": token,
        }
    )
    return {"hello": fields}


@dataclass(frozen=True)
class MemfdRegion:
    """A region backed by a memfd sealed against shrinking; its descriptor rides on the frame."""

    bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {"memfd": {"bytes": _uint(self.bytes, _U64, "region bytes")}}


@dataclass(frozen=True)
class CudaIpcRegion:
    """Device memory exported with ``cuIpcGetMemHandle``: the 64-byte handle, the device's PCI
    bus id (``"0000:3b:00.0"``) and the allocation's size. No descriptor travels with it."""

    handle: bytes
    device: str
    bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.handle, (bytes, bytearray, memoryview)) or len(self.handle) != 64:
            raise ValueError("a CUDA IPC handle is 64 bytes")
        if not isinstance(self.device, str):
            raise TypeError("device must be a PCI bus id string")

    def to_wire(self) -> dict[str, Any]:
        return {
            "cuda_ipc": {
                "handle": bytes(self.handle),
                "device": self.device,
                "bytes": _uint(self.bytes, _U64, "region bytes"),
            }
        }


Region: TypeAlias = MemfdRegion | CudaIpcRegion


@dataclass(frozen=True)
class Segment:
    """One array of equal strided blocks: ``region`` indexes the registration's regions, and
    ``offset`` is the byte offset of block 0 in it."""

    region: int
    offset: int

    def to_wire(self) -> dict[str, int]:
        return {
            "region": _uint(self.region, _U32, "segment region"),
            "offset": _uint(self.offset, _U64, "segment offset"),
        }


@dataclass(frozen=True)
class KvLayout:
    """How KV memory is laid out: every segment holds ``blocks`` blocks of ``block_bytes``,
    ``block_stride`` apart, and a chunk is ``blocks_per_chunk`` blocks taken from every segment.

    A chunk's bytes are its pieces segment-major, then block by block in the order a request
    names them, so ``len(segments) * blocks_per_chunk * block_bytes`` must equal the session's
    ``chunk_bytes``.
    """

    blocks: int
    block_bytes: int
    block_stride: int
    blocks_per_chunk: int
    segments: Sequence[Segment] = field(default_factory=list)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk of this layout."""
        return len(self.segments) * self.blocks_per_chunk * self.block_bytes

    def to_wire(self) -> dict[str, Any]:
        segments = [s if isinstance(s, Segment) else Segment(*s) for s in self.segments]
        return {
            "blocks": _uint(self.blocks, _U64, "blocks"),
            "block_bytes": _uint(self.block_bytes, _U64, "block_bytes"),
            "block_stride": _uint(self.block_stride, _U64, "block_stride"),
            "blocks_per_chunk": _uint(self.blocks_per_chunk, _U32, "blocks_per_chunk"),
            "segments": [s.to_wire() for s in segments],
        }


def register_kv(regions: Sequence[Region], layout: KvLayout) -> dict[str, Any]:
    """``register_kv``: the regions (memfd descriptors ride on the same ``sendmsg``, in region
    order) and the layout over them: 1 to :data:`MAX_REGIONS` regions, at most
    :data:`MAX_MEMFD_REGIONS` of them memfds."""
    wire_regions = []
    for r in regions:
        if not isinstance(r, (MemfdRegion, CudaIpcRegion)):
            raise TypeError(f"a region is a MemfdRegion or a CudaIpcRegion, got {r!r}")
        wire_regions.append(r.to_wire())
    if not 1 <= len(wire_regions) <= MAX_REGIONS:
        raise ValueError(f"a registration has 1 to {MAX_REGIONS} regions, got {len(wire_regions)}")
    memfds = sum(isinstance(r, MemfdRegion) for r in regions)
    if memfds > MAX_MEMFD_REGIONS:
        raise ValueError(
            f"a registration has at most {MAX_MEMFD_REGIONS} memfd regions (their descriptors "
            f"ride on one sendmsg), got {memfds}"
        )
    if not isinstance(layout, KvLayout):
        raise TypeError(f"layout must be a KvLayout, got {type(layout).__name__}")
    return {"register_kv": {"regions": wire_regions, "layout": layout.to_wire()}}


ChunkBlocks: TypeAlias = tuple[int, "Sequence[int] | int"]


def _chunk_blocks(chunks: Iterable[ChunkBlocks]) -> dict[str, bytes]:
    """A store's or retrieve's chunks, flat: ``{"ids": bin, "blocks": bin}``."""
    ids: list[Any] = []
    blocks: list[Any] = []
    add_id = ids.append
    add_block = blocks.append
    add_blocks = blocks.extend
    per_chunk = -1
    for chunk, chunk_blocks in chunks:
        add_id(chunk)
        if type(chunk_blocks) is int or not hasattr(chunk_blocks, "__iter__"):
            add_block(chunk_blocks)
            count = 1
        else:
            before = len(blocks)
            add_blocks(chunk_blocks)
            count = len(blocks) - before
        if count != per_chunk:
            if per_chunk >= 0:
                raise ValueError(
                    "every chunk of a request names the same number of blocks (the buffer's "
                    f"blocks_per_chunk): chunk 0 names {per_chunk}, chunk {len(ids) - 1} {count}"
                )
            per_chunk = count
    return {"ids": _pack_chunk_ids(ids), "blocks": _pack_block_ids(blocks)}


def store(
    namespace: int,
    buffer: int,
    chunks: Iterable[ChunkBlocks],
    ready_event: bytes | None = None,
) -> dict[str, Any]:
    """``store``: ``chunks`` are ``(chunk_id, [block, ...])``, root first, one block per
    ``blocks_per_chunk`` of the buffer's layout (a bare ``int`` is a one-block list).

    ``ready_event``, for a buffer in GPU memory: the 64-byte IPC handle of a CUDA event the
    worker recorded on the stream that wrote the blocks (``torch.cuda.Event(interprocess=True)
    .ipc_handle()``); the daemon's copies wait for it on the device."""
    body: dict[str, Any] = {
        "namespace": _uint(namespace, _U32, "namespace"),
        "buffer": _uint(buffer, _U32, "buffer"),
        "chunks": _chunk_blocks(chunks),
    }
    if ready_event is not None:
        body["ready_event"] = _event_handle(ready_event)
    return {"store": body}


def _event_handle(handle: Any) -> bytes:
    if not isinstance(handle, (bytes, bytearray, memoryview)) or len(handle) != 64:
        raise ValueError("a CUDA IPC event handle is 64 bytes")
    return bytes(handle)


def lookup(namespace: int, chunks: Iterable[int], defer_prefetch: bool = False) -> dict[str, Any]:
    """``lookup``: the prompt's chunk ids, root first; with ``defer_prefetch``, nothing is
    prefetched until the lookup's first ``query`` or ``wait``."""
    body: dict[str, Any] = {
        "namespace": _uint(namespace, _U32, "namespace"),
        "chunks": _pack_chunk_ids(chunks),
    }
    if not isinstance(defer_prefetch, bool):
        raise TypeError(f"defer_prefetch must be a bool, got {defer_prefetch!r}")
    if defer_prefetch:
        body["defer_prefetch"] = True
    return {"lookup": body}


def query(lookup: int) -> dict[str, Any]:
    """``query``: whether the lookup is complete, without waiting."""
    return {"query": {"lookup": _uint(lookup, _U64, "lookup")}}


def wait(lookup: int, timeout_ms: int) -> dict[str, Any]:
    """``wait``: until the lookup completes, at most ``timeout_ms`` (the daemon caps it at 60 s)."""
    return {
        "wait": {
            "lookup": _uint(lookup, _U64, "lookup"),
            "timeout_ms": _uint(timeout_ms, _U64, "timeout_ms"),
        }
    }


def retrieve(
    lookup: int,
    buffer: int,
    chunks: Iterable[ChunkBlocks],
    done_event: bytes | None = None,
) -> dict[str, Any]:
    """``retrieve``: copy chunks of the lookup's hit into blocks, then return this reader's
    share. ``chunks`` as in :func:`store`.

    ``done_event``, for a buffer in GPU memory: the 64-byte IPC handle of a CUDA event of the
    worker's (``torch.cuda.Event(interprocess=True)``). The daemon records it after the copies
    and replies without waiting for them; the worker's stream waits for the event before its
    kernels read the blocks."""
    body: dict[str, Any] = {
        "lookup": _uint(lookup, _U64, "lookup"),
        "buffer": _uint(buffer, _U32, "buffer"),
        "chunks": _chunk_blocks(chunks),
    }
    if done_event is not None:
        body["done_event"] = _event_handle(done_event)
    return {"retrieve": body}


def release(lookup: int) -> dict[str, Any]:
    """``release``: return every share the lookup still holds."""
    return {"release": {"lookup": _uint(lookup, _U64, "lookup")}}


def flush(timeout_ms: int) -> dict[str, Any]:
    """``flush``: wait (at most ``timeout_ms``) until this session's stores since its last flush
    are through the store pipeline, and learn how many chunks are on the disk tier."""
    return {"flush": {"timeout_ms": _uint(timeout_ms, _U64, "timeout_ms")}}


# ---------------------------------------------------------------------------------------------
# Replies
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Welcome:
    """The session is open."""

    version: int
    session: int
    max_chunk_bytes: int
    readers: int


@dataclass(frozen=True)
class BufferRegistered:
    """A registration's buffer number."""

    buffer: int


#: The codes of ``refused[].reason`` in a store's reply.
REFUSAL_REASONS = ("no_space", "busy", "copy_failed", "internal")


@dataclass(frozen=True)
class Stored:
    """A store's outcome: chunks copied in, chunks already there, and ``(index, reason,
    message)`` of the chunks refused (``reason`` one of :data:`REFUSAL_REASONS`)."""

    stored: int
    present: int
    refused: list[tuple[int, str, str]]


@dataclass(frozen=True)
class LookupOutcome:
    """What a lookup found: the first ``hit_chunks`` chunks are available; ``per_tier`` says how
    many each tier served, L1 first."""

    hit_chunks: int
    hit_tokens: int
    readers: int
    per_tier: list[int]


@dataclass(frozen=True)
class LookupStarted:
    """A lookup started; ``outcome`` is there when it completed at once."""

    lookup: int
    l1_hit_chunks: int
    outcome: LookupOutcome | None


@dataclass(frozen=True)
class Pending:
    """The lookup is still prefetching."""


@dataclass(frozen=True)
class Done:
    """The lookup completed."""

    outcome: LookupOutcome


@dataclass(frozen=True)
class Retrieved:
    """A retrieve's copies are complete and this reader's share is returned."""

    chunks: int
    bytes: int


@dataclass(frozen=True)
class Released:
    """The lookup's shares are returned."""


@dataclass(frozen=True)
class Flushed:
    """What a flush found: chunks stored since the last flush that are on the disk tier, and
    those that are not (no disk tier, a policy that does not write them there now, a failure)."""

    durable: int
    not_durable: int


@dataclass(frozen=True)
class Bye:
    """The session ended."""


@dataclass(frozen=True)
class Cleared:
    """Chunks a clear removed from each tier, L1 first."""

    removed: list[int]


#: Any parsed reply; a status is its report as a plain dict.
Reply: TypeAlias = (
    Welcome
    | BufferRegistered
    | Stored
    | LookupStarted
    | Pending
    | Done
    | Retrieved
    | Released
    | Flushed
    | Bye
    | dict
    | Cleared
)


class _BadReply(Exception):
    pass


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _BadReply(f"{what} is {value!r:.50}, not an unsigned integer")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _BadReply(f"{what} is {value!r:.50}, not a string")
    return value


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise _BadReply(f"{what} is {value!r:.50}, not a list")
    return value


def _map(value: Any, what: str, keys: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise _BadReply(f"{what} is {value!r:.50}, not a map")
    missing = [k for k in keys if k not in value]
    if missing:
        raise _BadReply(f"{what} lacks {', '.join(missing)}")
    return value


def _outcome(value: Any) -> LookupOutcome:
    m = _map(value, "outcome", ("hit_chunks", "hit_tokens", "readers", "per_tier"))
    return LookupOutcome(
        hit_chunks=_int(m["hit_chunks"], "hit_chunks"),
        hit_tokens=_int(m["hit_tokens"], "hit_tokens"),
        readers=_int(m["readers"], "readers"),
        per_tier=[_int(n, "per_tier") for n in _list(m["per_tier"], "per_tier")],
    )


def _welcome(v: Any) -> Welcome:
    m = _map(v, "welcome", ("version", "session", "max_chunk_bytes", "readers"))
    return Welcome(*(_int(m[k], k) for k in ("version", "session", "max_chunk_bytes", "readers")))


def _stored(v: Any) -> Stored:
    m = _map(v, "stored", ("stored", "present", "refused"))
    refused = []
    for r in _list(m["refused"], "refused"):
        r = _map(r, "refused", ("index", "reason", "message"))
        refused.append(
            (_int(r["index"], "index"), _str(r["reason"], "reason"), _str(r["message"], "message"))
        )
    return Stored(_int(m["stored"], "stored"), _int(m["present"], "present"), refused)


def _lookup_started(v: Any) -> LookupStarted:
    m = _map(v, "lookup_started", ("lookup", "l1_hit_chunks"))
    outcome = m.get("outcome")
    return LookupStarted(
        lookup=_int(m["lookup"], "lookup"),
        l1_hit_chunks=_int(m["l1_hit_chunks"], "l1_hit_chunks"),
        outcome=None if outcome is None else _outcome(outcome),
    )


def _retrieved(v: Any) -> Retrieved:
    m = _map(v, "retrieved", ("chunks", "bytes"))
    return Retrieved(_int(m["chunks"], "chunks"), _int(m["bytes"], "bytes"))


def _status(v: Any) -> dict:
    return _map(v, "status", ("tiers", "hit_tokens", "sessions"))


def _cleared(v: Any) -> Cleared:
    m = _map(v, "cleared", ("removed",))
    return Cleared([_int(n, "removed") for n in _list(m["removed"], "removed")])


def _buffer_registered(v: Any) -> BufferRegistered:
    return BufferRegistered(_int(_map(v, "buffer_registered", ("buffer",))["buffer"], "buffer"))


_UNIT_REPLIES: dict[str, Reply] = {"pending": Pending(), "released": Released(), "bye": Bye()}

_REPLIES = {
    "welcome": _welcome,
    "buffer_registered": _buffer_registered,
    "stored": _stored,
    "lookup_started": _lookup_started,
    "done": lambda v: Done(_outcome(v)),
    "retrieved": _retrieved,
    "status": _status,
    "cleared": _cleared,
    "flushed": lambda v: Flushed(
        *(
            _int(_map(v, "flushed", ("durable", "not_durable"))[k], k)
            for k in ("durable", "not_durable")
        )
    ),
}


def _error(v: Any) -> DaemonError:
    m = _map(v, "error", ("code", "message"))
    return error_for(_str(m["code"], "code"), _str(m["message"], "message"))


def parse_reply_body(body: Any) -> Reply:
    """A decoded reply body as its dataclass (a status as a ``dict``).

    An ``error`` reply raises its :class:`~tierkv.errors.DaemonError` subclass; anything that
    is not a reply raises :class:`~tierkv.errors.ConnectionLost`.
    """
    try:
        if isinstance(body, str):
            if body in _UNIT_REPLIES:
                return _UNIT_REPLIES[body]
            raise _BadReply(f"unknown reply {body!r:.50}")
        if not isinstance(body, dict) or len(body) != 1:
            raise _BadReply(f"not an externally tagged reply: {body!r:.200}")
        ((tag, value),) = body.items()
        if tag == "error":
            error = _error(value)
        else:
            parse = _REPLIES.get(tag)
            if parse is None:
                raise _BadReply(f"unknown reply {tag!r:.50}")
            return parse(value)
    except _BadReply as e:
        raise ConnectionLost(f"bad reply: {e}") from None
    raise error
