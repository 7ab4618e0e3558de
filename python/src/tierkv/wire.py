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
import reprlib
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgpack

from .errors import BadReply, DaemonError, error_for

__all__ = [
    "CLEAR",
    "END_SESSION",
    "HEADER",
    "MAX_REPLY_BYTES",
    "MAX_REPLY_DEPTH",
    "MAX_REPLY_KEYS",
    "MAX_REPLY_LIST",
    "MAX_REPLY_STRING",
    "PROTOCOL_VERSION",
    "REFUSAL_REASONS",
    "REPLY_BYTES_PER_VALUE",
    "REPLY_EXTRA_VALUES",
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

# What a reply may be. A reply comes from whatever holds the socket (a buggy daemon, another
# program, a corrupted stream), so its frame is checked against these before MessagePack builds
# anything of it: a bad one is `BadReply`, never a MemoryError, a RecursionError or a hang.
# docs/protocol.md states them (under "Frames"); test_protocol_docs.py holds the two together.

#: Reply frames longer than this are refused before their body is read (a status with thousands
#: of sessions, or a store that refuses every chunk of a 16 MiB request with the daemon's short
#: messages, still fits; the Rust client, ``tierkv-client``'s ``REPLY_LIMIT``, uses the same
#: limit).
MAX_REPLY_BYTES = 64 << 20

#: How deep a reply's maps and lists nest, at most: the protocol's limit on every frame
#: (tierkv-proto's ``MAX_DEPTH``). A reply nests five deep (a status's tier reports).
MAX_REPLY_DEPTH = 32

#: The longest string or bin a reply holds: replies carry names and messages, and no bin.
MAX_REPLY_STRING = 1 << 20

#: The longest list a reply holds. The longest a daemon sends is a store's ``refused``, an entry
#: of at least 29 bytes per chunk refused: a reply of :data:`MAX_REPLY_BYTES` has at most
#: 2.3 million of them.
MAX_REPLY_LIST = 1 << 22

#: The most keys of a map in a reply (a status has 13 fields; the rest is room for the fields a
#: newer daemon adds).
MAX_REPLY_KEYS = 1024

#: A reply holds at most one value (every key, value and element, at every level) per this many
#: bytes of its frame, plus :data:`REPLY_EXTRA_VALUES`: the densest a daemon sends, a store's
#: ``refused``, takes 29 bytes for an entry's 7 values. So a reply costs the client no more memory
#: than a genuine reply of its size would, where MessagePack alone builds an empty list (some 60
#: bytes of Python objects) from each byte.
REPLY_BYTES_PER_VALUE = 4

#: The values a reply may hold beyond one per :data:`REPLY_BYTES_PER_VALUE` bytes: room for the
#: few dense ones of any reply (an id, a lookup's ``per_tier`` counts).
REPLY_EXTRA_VALUES = 64

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


# The bytes after a scalar's MessagePack type byte (0 where the type byte is all there is); a
# type byte in none of these tables (an extension type, 0xC1) is no reply's.
_U8 = struct.Struct(">B").unpack_from
_U16_AT = struct.Struct(">H").unpack_from
_U32_AT = struct.Struct(">I").unpack_from
_SCALAR_BYTES = {
    0xC0: 0,  # nil
    0xC2: 0,  # false
    0xC3: 0,  # true
    0xCA: 4,  # float 32
    0xCB: 8,  # float 64
    0xCC: 1,  # uint 8 .. int 64
    0xCD: 2,
    0xCE: 4,
    0xCF: 8,
    0xD0: 1,
    0xD1: 2,
    0xD2: 4,
    0xD3: 8,
}
# str 8/16/32 and bin 8/16/32: the bytes of the length.
_SIZED = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}
# array 16/32 and map 16/32: (bytes of the count, values per counted item).
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}
_LENGTH_READERS = {1: _U8, 2: _U16_AT, 4: _U32_AT}


def check_reply_shape(body: bytes | bytearray | memoryview) -> None:
    """Walks a reply frame's body without building anything and raises :class:`BadReply` unless
    it is exactly one MessagePack value within the reply limits: maps and lists nested at most
    :data:`MAX_REPLY_DEPTH` deep, no string or bin over :data:`MAX_REPLY_STRING` bytes, no list
    over :data:`MAX_REPLY_LIST` elements nor map over :data:`MAX_REPLY_KEYS` keys, no length
    that the bytes left could not hold, at most one value per :data:`REPLY_BYTES_PER_VALUE`
    bytes (plus :data:`REPLY_EXTRA_VALUES`), and no extension types (the protocol has none)."""
    data = body if isinstance(body, (bytes, bytearray)) else bytes(body)
    end = len(data)
    if end > MAX_REPLY_BYTES:
        raise BadReply(f"bad reply: a frame of {end} bytes, over the limit of {MAX_REPLY_BYTES}")
    budget = end // REPLY_BYTES_PER_VALUE + REPLY_EXTRA_VALUES
    # Values the walk has to read: each map or list adds its own as it starts, so the budget is
    # checked before any of them is (a frame of many values fails fast, not at its end).
    promised = 1
    pos = 0
    # The values left to read in each open map or list, outermost first (not the innermost's).
    open_counts: list[int] = []
    left = 1
    try:
        while True:
            if not left:
                if not open_counts:
                    break
                left = open_counts.pop()
                continue
            left -= 1
            b = data[pos]  # IndexError past the end: cut short
            pos += 1
            if b < 0x80 or b >= 0xE0:  # fixint
                continue
            if b < 0x90:  # fixmap
                count = 2 * (b & 0x0F)
            elif b < 0xA0:  # fixarray
                count = b & 0x0F
            elif b < 0xC0:  # fixstr
                pos += b & 0x1F
                continue
            elif (skip := _SCALAR_BYTES.get(b)) is not None:
                pos += skip
                continue
            elif (width := _SIZED.get(b)) is not None:
                (size,) = _LENGTH_READERS[width](data, pos)
                pos += width
                if size > MAX_REPLY_STRING or size > end - pos:
                    what = "bin" if b < 0xD0 else "string"
                    raise BadReply(
                        f"bad reply: a {what} of {size} bytes at byte {pos - width - 1}, "
                        f"{_over(size, MAX_REPLY_STRING, end - pos)}"
                    )
                pos += size
                continue
            elif (container := _CONTAINERS.get(b)) is not None:
                width, per_item = container
                (items,) = _LENGTH_READERS[width](data, pos)
                pos += width
                limit = MAX_REPLY_KEYS if per_item == 2 else MAX_REPLY_LIST
                if items > limit or items * per_item > end - pos:
                    what = f"map of {items} keys" if per_item == 2 else f"list of {items} items"
                    raise BadReply(
                        f"bad reply: a {what} at byte {pos - width - 1}, "
                        f"{_over(items, limit, end - pos)}"
                    )
                count = items * per_item
            else:
                what = "an extension type" if 0xC7 <= b <= 0xC9 or b >= 0xD4 else "no type"
                raise BadReply(f"bad reply: byte {pos - 1} is {b:#04x}, {what} of a reply")
            # A map or a list, `count` values long.
            if len(open_counts) >= MAX_REPLY_DEPTH:
                raise BadReply(
                    f"bad reply: maps and lists nested deeper than {MAX_REPLY_DEPTH} "
                    f"(byte {pos - 1})"
                )
            if count:
                promised += count
                if promised > budget:
                    raise BadReply(
                        f"bad reply: more than {budget} values in a frame of {end} bytes, over "
                        f"one per {REPLY_BYTES_PER_VALUE} bytes (plus {REPLY_EXTRA_VALUES})"
                    )
                open_counts.append(left)
                left = count
    except (IndexError, struct.error):
        raise BadReply(f"bad reply: the frame's {end} bytes end inside a value") from None
    if pos > end:
        raise BadReply(f"bad reply: the frame's {end} bytes end inside a value")
    if pos != end:
        raise BadReply(f"bad reply: bytes after the reply ({end - pos}); a frame holds one value")


def _over(n: int, limit: int, left: int) -> str:
    if n > limit:
        return f"over the limit of {limit}"
    return f"where {left} bytes are left in the frame"


#: The representation of a reply's values in messages: a few elements, a few levels.
_SHOW = reprlib.Repr()
_SHOW.maxlevel = 4
_SHOW.maxdict = _SHOW.maxlist = _SHOW.maxtuple = _SHOW.maxset = 6
_SHOW.maxstring = _SHOW.maxother = _SHOW.maxlong = 80


def show(value: Any) -> str:
    """``repr(value)`` cut short: a few elements and levels of it, at most some 200 characters,
    whatever its size (a bad reply's values go into error messages)."""
    text = _SHOW.repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def unpack_reply(body_bytes: bytes | bytearray | memoryview) -> tuple[int, Any]:
    """The ``(id, body)`` of a reply frame's body, the body still as MessagePack decoded it.

    Raises :class:`~tierkv.errors.BadReply` when it is not a reply at all, or goes past the
    reply limits (:func:`check_reply_shape`).
    """
    check_reply_shape(body_bytes)
    try:
        reply = msgpack.unpackb(
            body_bytes,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=MAX_REPLY_STRING,
            max_bin_len=MAX_REPLY_STRING,
            max_array_len=MAX_REPLY_LIST,
            max_map_len=MAX_REPLY_KEYS,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types for broken input
        raise BadReply(f"bad reply: not MessagePack ({type(e).__name__}: {e})") from e
    if not isinstance(reply, dict) or "id" not in reply or "body" not in reply:
        raise BadReply(f"bad reply: not an {{id, body}} map: {show(reply)}")
    reply_id = reply["id"]
    if not isinstance(reply_id, int) or isinstance(reply_id, bool) or not 0 <= reply_id <= _U64:
        raise BadReply(f"bad reply: id {show(reply_id)}")
    return reply_id, reply["body"]


def decode_reply(body_bytes: bytes | bytearray | memoryview) -> tuple[int, Reply]:
    """The ``(id, reply)`` of a reply frame's body (without the 4-byte length).

    An ``error`` reply raises its :class:`~tierkv.errors.DaemonError` subclass; a body that is
    not a reply raises :class:`~tierkv.errors.BadReply`.
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
    .ipc_handle()``); the daemon waits for it before its copies."""
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
        raise _BadReply(f"{what} is {show(value)}, not an unsigned integer")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _BadReply(f"{what} is {show(value)}, not a string")
    return value


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise _BadReply(f"{what} is {show(value)}, not a list")
    return value


def _map(value: Any, what: str, keys: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise _BadReply(f"{what} is {show(value)}, not a map")
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

_REPLIES: dict[str, Callable[[Any], Reply]] = {
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
    is not a reply raises :class:`~tierkv.errors.BadReply`.
    """
    try:
        if isinstance(body, str):
            if body in _UNIT_REPLIES:
                return _UNIT_REPLIES[body]
            raise _BadReply(f"unknown reply {show(body)}")
        if not isinstance(body, dict) or len(body) != 1:
            raise _BadReply(f"not an externally tagged reply: {show(body)}")
        ((tag, value),) = body.items()
        if tag == "error":
            error = _error(value)
        else:
            parse = _REPLIES.get(tag)
            if parse is None:
                raise _BadReply(f"unknown reply {show(tag)}")
            return parse(value)
    except _BadReply as e:
        raise BadReply(f"bad reply: {e}") from None
    raise error
