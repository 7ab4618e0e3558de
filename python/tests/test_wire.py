"""The Python encoding against the Rust types' bytes (``wire_vectors.json``).

The JSON is written by ``crates/tierkv-proto/tests/wire_vectors.rs``; the values below are the
ones that file encodes. Every request must be built here byte for byte, and every reply must
decode to the values the Rust side put in.
"""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import msgpack
import pytest

from tierkv import errors, wire
from tierkv.wire import (
    BufferRegistered,
    Bye,
    Cleared,
    CudaIpcRegion,
    Done,
    KvLayout,
    LookupOutcome,
    LookupStarted,
    MemfdRegion,
    Pending,
    Released,
    Retrieved,
    Segment,
    Stored,
    Welcome,
)

VECTORS = json.loads((Path(__file__).parent / "wire_vectors.json").read_text())

CHUNK = 0x0102_0304_0506_0708_090A_0B0C_0D0E_0F10
U128_MAX = (1 << 128) - 1


def _hello(**changes):
    """The worker hello of wire_vectors.rs's ``hello()``; keywords change it."""
    fields = {
        "version": wire.PROTOCOL_VERSION,
        "role": "worker",
        "rank": 1,
        "tp_size": 2,
        "world_size": 2,
        "mla": False,
        "namespaces": [("tiny-llama", "t1")],
        "chunk_bytes": 1 << 20,
        "chunk_tokens": 128,
        "token": None,
    }
    return wire.hello(**(fields | changes))


#: A lookup id past 32 bits, as the daemon's are (counted from a random point below 2**52).
LARGE_LOOKUP = (1 << 52) - 3

# Each request of wire_vectors.rs, built with the Python constructors.
REQUESTS = {
    "hello": _hello,
    "hello_mla": lambda: _hello(mla=True, world_size=None),
    "hello_admin_token": lambda: wire.hello(
        version=wire.PROTOCOL_VERSION,
        role="admin",
        rank=0,
        tp_size=1,
        mla=False,
        namespaces=[],
        chunk_bytes=0,
        chunk_tokens=1,
        token="secret",
    ),
    "register_kv": lambda: wire.register_kv(
        [MemfdRegion(bytes=4 << 20)],
        KvLayout(
            blocks=16,
            block_bytes=65536,
            block_stride=65536,
            blocks_per_chunk=2,
            segments=[Segment(region=0, offset=0), Segment(region=0, offset=1 << 20)],
        ),
    ),
    "register_kv_cuda_ipc": lambda: wire.register_kv(
        [CudaIpcRegion(handle=bytes(range(64)), device="0000:3b:00.0", bytes=1 << 30)],
        KvLayout(
            blocks=1024,
            block_bytes=32768,
            block_stride=32768,
            blocks_per_chunk=1,
            segments=[Segment(region=0, offset=0)],
        ),
    ),
    "store": lambda: wire.store(0, 0, [(CHUNK, [3, 4]), (7, [9, 300])]),
    "store_ready_event": lambda: wire.store(0, 0, [(CHUNK, [3])], ready_event=bytes(range(64))),
    "lookup": lambda: wire.lookup(1, [CHUNK, U128_MAX]),
    "lookup_deferred": lambda: wire.lookup(1, [CHUNK], defer_prefetch=True),
    "store_no_chunks": lambda: wire.store(0, 0, []),
    "store_chunks_of_no_blocks": lambda: wire.store(0, 0, [(CHUNK, []), (7, ())]),
    "lookup_no_chunks": lambda: wire.lookup(1, []),
    "query": lambda: wire.query(17),
    "query_large_id": lambda: wire.query(LARGE_LOOKUP),
    "wait": lambda: wire.wait(17, 2500),
    "wait_large_id": lambda: wire.wait(LARGE_LOOKUP, 60000),
    "retrieve": lambda: wire.retrieve(17, 0, [(CHUNK, [70000, 1])]),
    "retrieve_done_event": lambda: wire.retrieve(
        17, 0, [(CHUNK, [1])], done_event=bytes(range(63, -1, -1))
    ),
    "retrieve_large_id": lambda: wire.retrieve(LARGE_LOOKUP, 63, [(CHUNK, [(1 << 32) + 5])]),
    "retrieve_no_chunks": lambda: wire.retrieve(17, 0, []),
    "release": lambda: wire.release(17),
    "release_large_id": lambda: wire.release(LARGE_LOOKUP),
    "flush": lambda: wire.flush(30000),
    "end_session": lambda: wire.END_SESSION,
    "status": lambda: wire.STATUS,
    "clear": lambda: wire.CLEAR,
}

# Always four tiers, [l1, l2, disk, remote], as the daemon sends them.
OUTCOME = LookupOutcome(hit_chunks=3, hit_tokens=384, readers=2, per_tier=[1, 1, 1, 0])

STATUS_REPORT = {
    "version": "0.1.0",
    "uptime_s": 1.5,
    "tiers": [
        {
            "name": "l1",
            "used_bytes": 1,
            "cached_bytes": 2,
            "capacity_bytes": 3,
            "objects": 4,
            "hit_chunks": 5,
            "read_only": None,
        }
    ],
    "l1_leased_chunks": 6,
    "lookups": 7,
    "requested_chunks": 8,
    "hit_chunks": 4,
    "hit_ratio": 0.5,
    "requested_tokens": 1024,
    "hit_tokens": 512,
    "open_lookups": 1,
    "store_in_flight": 0,
    "connected_workers": 1,
    "sessions": [
        {
            "session": 5,
            "role": "worker",
            "rank": 0,
            "tp_size": 1,
            "open_lookups": 1,
            "joined_lookups": 0,
        }
    ],
}

# Each non-error reply of wire_vectors.rs, as the Python side parses it.
REPLIES = {
    "welcome": Welcome(
        version=wire.PROTOCOL_VERSION, session=5, max_chunk_bytes=1 << 21, readers=1
    ),
    "buffer_registered": BufferRegistered(buffer=3),
    "stored": Stored(stored=2, present=1, refused=[(3, "no_space", "out of memory")]),
    "lookup_started_done": LookupStarted(lookup=9, l1_hit_chunks=3, outcome=OUTCOME),
    "lookup_started_pending": LookupStarted(lookup=10, l1_hit_chunks=0, outcome=None),
    "lookup_started_large_id": LookupStarted(lookup=LARGE_LOOKUP, l1_hit_chunks=0, outcome=None),
    "pending": Pending(),
    "done": Done(OUTCOME),
    "retrieved": Retrieved(chunks=2, bytes=2 << 20),
    "released": Released(),
    "flushed": wire.Flushed(durable=5, not_durable=1),
    "bye": Bye(),
    "cleared": Cleared(removed=[4, 0, 2]),
    "status": STATUS_REPORT,
}

# Every error code of the Rust enum, with its exception class and the variant name the vector's
# message carries (`format!("{code:?} happened")`).
ERRORS = {
    "bad_frame": (errors.BadFrame, "BadFrame"),
    "bad_request": (errors.BadRequest, "BadRequest"),
    "version_mismatch": (errors.VersionMismatch, "VersionMismatch"),
    "no_session": (errors.NoSession, "NoSession"),
    "forbidden": (errors.Forbidden, "Forbidden"),
    "namespace_not_declared": (errors.NamespaceNotDeclared, "NamespaceNotDeclared"),
    "bad_buffer": (errors.BadBuffer, "BadBuffer"),
    "block_out_of_range": (errors.BlockOutOfRange, "BlockOutOfRange"),
    "unknown_lookup": (errors.UnknownLookup, "UnknownLookup"),
    "pending": (errors.LookupPending, "Pending"),
    "not_in_hit": (errors.NotInHit, "NotInHit"),
    "share_returned": (errors.ShareReturned, "ShareReturned"),
    "timeout": (errors.WaitTimeout, "Timeout"),
    "full": (errors.Full, "Full"),
    "stopped": (errors.Stopped, "Stopped"),
    "too_many_connections": (errors.TooManyConnections, "TooManyConnections"),
    "lease_limit": (errors.LeaseLimit, "LeaseLimit"),
    "internal": (errors.Internal, "Internal"),
}


def test_protocol_version_is_the_rust_one():
    assert VECTORS["protocol_version"] == wire.PROTOCOL_VERSION == 6
    assert _hello()["hello"]["version"] == wire.PROTOCOL_VERSION
    assert wire.hello()["hello"]["version"] == wire.PROTOCOL_VERSION


def test_every_request_of_the_vectors_is_covered_here():
    assert set(VECTORS["requests"]) == set(REQUESTS), (
        "wire_vectors.json and the Python constructors cover different requests"
    )


@pytest.mark.parametrize("name", sorted(VECTORS["requests"]))
def test_request_bytes_match_the_rust_encoding(name):
    if name not in REQUESTS:
        pytest.fail(f"wire_vectors.json has a request {name!r} the Python side does not build")
    vector = VECTORS["requests"][name]
    frame = wire.encode_frame(vector["id"], REQUESTS[name]())
    (length,) = struct.unpack("<I", frame[:4])
    assert length == len(frame) - 4
    assert frame[4:].hex() == vector["hex"]


def test_every_reply_of_the_vectors_is_covered_here():
    expected = set(REPLIES) | {f"error_{code}" for code in ERRORS}
    assert set(VECTORS["replies"]) == expected


@pytest.mark.parametrize(
    "name", sorted(n for n in VECTORS["replies"] if not n.startswith("error_"))
)
def test_reply_decodes_to_the_rust_values(name):
    if name not in REPLIES:
        pytest.fail(f"wire_vectors.json has a reply {name!r} the Python side does not check")
    reply_id, reply = wire.decode_reply(bytes.fromhex(VECTORS["replies"][name]))
    assert reply_id == 42
    assert type(reply) is type(REPLIES[name])
    assert reply == REPLIES[name]


@pytest.mark.parametrize("name", sorted(n for n in VECTORS["replies"] if n.startswith("error_")))
def test_error_reply_raises_its_exception(name):
    code = name.removeprefix("error_")
    if code not in ERRORS:
        pytest.fail(f"wire_vectors.json has an error code {code!r} the Python side does not map")
    cls, variant = ERRORS[code]
    with pytest.raises(cls) as caught:
        wire.decode_reply(bytes.fromhex(VECTORS["replies"][name]))
    err = caught.value
    assert type(err) is cls
    assert isinstance(err, errors.DaemonError)
    assert isinstance(err, errors.TierKVError)
    assert err.code == code == cls.CODE
    assert err.message == f"{variant} happened"
    assert code in str(err) and err.message in str(err)


def test_error_for_maps_every_code_and_survives_unknown_ones():
    for code, (cls, _) in ERRORS.items():
        err = errors.error_for(code, "m")
        assert type(err) is cls and err.code == code and err.message == "m"
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is cls and again.code == code and again.message == "m"
    unknown = errors.error_for("frobnicated", "a newer daemon")
    assert type(unknown) is errors.DaemonError
    assert (unknown.code, unknown.message) == ("frobnicated", "a newer daemon")
    body = msgpack.packb({"id": 3, "body": {"error": {"code": "frobnicated", "message": "x"}}})
    with pytest.raises(errors.DaemonError) as caught:
        wire.decode_reply(body)
    assert type(caught.value) is errors.DaemonError and caught.value.code == "frobnicated"


def test_distinct_names_for_codes_that_clash_with_builtins_or_replies():
    assert errors.LookupPending.CODE == "pending" and errors.WaitTimeout.CODE == "timeout"
    assert not issubclass(errors.WaitTimeout, TimeoutError)
    assert issubclass(errors.ConnectionLost, errors.TierKVError)
    assert not issubclass(errors.ConnectionLost, errors.DaemonError)


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # never used in MessagePack
        msgpack.packb([1, 2]),
        msgpack.packb({"id": 1}),
        msgpack.packb({"id": -1, "body": "bye"}),
        msgpack.packb({"id": 1, "body": "frobnicate"}),
        msgpack.packb({"id": 1, "body": {"frobnicate": {}}}),
        msgpack.packb({"id": 1, "body": {"welcome": {"version": 2}}}),
        msgpack.packb({"id": 1, "body": {"retrieved": {"chunks": "two", "bytes": 1}}}),
        msgpack.packb({"id": 1, "body": {"stored": {"stored": 1, "present": 0, "refused": 3}}}),
        msgpack.packb({"id": 1, "body": {"bye": None, "released": None}}),
        msgpack.packb({"id": 1, "body": "bye"}) + b"\x00",
    ],
)
def test_a_body_that_is_no_reply_is_connection_lost(body):
    with pytest.raises(errors.ConnectionLost, match="bad reply"):
        wire.decode_reply(body)


def test_unknown_fields_are_ignored_like_serde_does():
    body = msgpack.packb(
        {"id": 7, "body": {"retrieved": {"chunks": 1, "bytes": 64, "later": True}}, "x": 1}
    )
    assert wire.decode_reply(body) == (7, Retrieved(chunks=1, bytes=64))


def test_chunk_ids_are_16_bytes_big_endian():
    assert wire.encode_chunk_id(1) == bytes(15) + b"\x01"
    assert wire.encode_chunk_id(U128_MAX) == b"\xff" * 16
    assert wire.decode_chunk_id(wire.encode_chunk_id(CHUNK)) == CHUNK
    for bad in (-1, 1 << 128):
        with pytest.raises(ValueError):
            wire.encode_chunk_id(bad)
    with pytest.raises(ValueError):
        wire.decode_chunk_id(b"\x01\x02\x03")


def test_constructors_refuse_values_the_wire_cannot_carry():
    with pytest.raises(ValueError, match="namespace"):
        wire.lookup(-1, [1])
    with pytest.raises(ValueError, match="buffer"):
        wire.store(0, 1 << 32, [(1, [0])])
    with pytest.raises(ValueError, match="block id"):
        wire.retrieve(1, 0, [(1, [-3])])
    # The plain-int fast paths keep every check: bare or listed, past the top, or a bool.
    with pytest.raises(ValueError, match="block id"):
        wire.retrieve(1, 0, [(1, 1 << 64)])
    with pytest.raises(ValueError, match="block id"):
        wire.store(0, 0, [(1, [0, -1])])
    with pytest.raises(TypeError, match="block id"):
        wire.store(0, 0, [(1, True)])
    with pytest.raises(TypeError, match="block id"):
        wire.store(0, 0, [(1, [0, False])])
    with pytest.raises(TypeError, match="chunk id"):
        wire.lookup(0, [True])
    with pytest.raises(ValueError, match="rank"):
        wire.hello(rank=1 << 16)
    with pytest.raises(ValueError, match="role"):
        wire.hello(role="root")
    with pytest.raises(TypeError):
        wire.query(1.5)
    with pytest.raises(ValueError, match="64 bytes"):
        CudaIpcRegion(handle=b"short", device="0000:3b:00.0", bytes=1)
    # A CUDA IPC event handle is 64 bytes of a bytes-like object, on a store or a retrieve.
    with pytest.raises(ValueError, match="event handle is 64 bytes"):
        wire.store(0, 0, [(1, [0])], ready_event=bytes(63))
    with pytest.raises(ValueError, match="event handle is 64 bytes"):
        wire.retrieve(1, 0, [(1, [0])], done_event="x" * 64)


def test_chunks_travel_flat_and_name_the_same_number_of_blocks_each():
    class Index:
        def __init__(self, n: int) -> None:
            self.n = n

        def __index__(self) -> int:
            return self.n

    body = wire.retrieve(1, 0, [(CHUNK, [3, 1 << 63]), (Index(7), (Index(2), 0))])["retrieve"]
    ids, blocks = body["chunks"]["ids"], body["chunks"]["blocks"]
    assert ids == wire.encode_chunk_id(CHUNK) + wire.encode_chunk_id(7)
    assert [int.from_bytes(blocks[i : i + 8], "little") for i in range(0, 32, 8)] == [
        3,
        1 << 63,
        2,
        0,
    ]
    assert wire.store(0, 0, []) == {
        "store": {"namespace": 0, "buffer": 0, "chunks": {"ids": b"", "blocks": b""}}
    }
    assert wire.lookup(0, iter([1, Index(2)]))["lookup"]["chunks"] == b"".join(
        wire.encode_chunk_id(c) for c in (1, 2)
    )
    with pytest.raises(ValueError, match="chunk 0 names 2, chunk 2 1"):
        wire.store(0, 0, [(1, [0, 1]), (2, [2, 3]), (3, 4)])
    with pytest.raises(ValueError, match="chunk id"):
        wire.retrieve(1, 0, [(1 << 128, [0])])
    with pytest.raises(TypeError, match="chunk id"):
        wire.retrieve(1, 0, [(1.0, [0])])


def test_constructors_take_integer_like_values_and_bare_blocks():
    class Index:
        def __index__(self):
            return 5

    assert wire.store(0, 0, [(CHUNK, 5)]) == wire.store(0, 0, [(CHUNK, [5])])
    assert wire.query(Index()) == {"query": {"lookup": 5}}
    assert wire.hello(namespaces=["m"])["hello"]["namespaces"] == [{"model": "m", "cache_salt": ""}]
    layout = KvLayout(
        blocks=4, block_bytes=8, block_stride=16, blocks_per_chunk=2, segments=[(0, 0), (0, 64)]
    )
    assert layout.chunk_bytes == 32
    assert layout.to_wire()["segments"] == [{"region": 0, "offset": 0}, {"region": 0, "offset": 64}]
    assert list(layout.to_wire()) == [
        "blocks",
        "block_bytes",
        "block_stride",
        "blocks_per_chunk",
        "segments",
    ]


def test_reply_dataclasses_are_frozen():
    welcome = REPLIES["welcome"]
    with pytest.raises(AttributeError):
        welcome.session = 6  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# The reply limits: what a reply may be, checked before MessagePack builds it
# ---------------------------------------------------------------------------------------------

#: ``{"id": 1, "body": `` and then the body's bytes.
_REPLY_HEAD = b"\x82\xa2id\x01\xa4body"


def _cleared_with(extra: object) -> bytes:
    """A ``cleared`` reply with an unknown field (ignored when it fits the limits)."""
    return msgpack.packb({"id": 1, "body": {"cleared": {"removed": [1, 2, 3], "x": extra}}})


def _nested(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (_REPLY_HEAD + b"\xdd" + struct.pack(">I", 2**31), "list of 2147483648 items"),
        (_REPLY_HEAD + b"\xdf" + struct.pack(">I", 2**31), "map of 2147483648 keys"),
        (
            _REPLY_HEAD + b"\xdc\xff\xff" + b"\xc0" * 100,
            "list of 65535 items .* 100 bytes are left",
        ),
        (_REPLY_HEAD + b"\xc6\xff\xff\xff\xff", "bin of 4294967295 bytes"),
        (_REPLY_HEAD + b"\xdb\x00\x10\x00\x00" + b"a" * 10, "string of 1048576 bytes"),
        (_cleared_with(bytes(wire.MAX_REPLY_STRING + 1)), "bin of 1048577 bytes"),
        (_cleared_with("é" * (wire.MAX_REPLY_STRING // 2 + 1)), "string of 1048578 bytes"),
        (_REPLY_HEAD + b"\x91" * 1000 + b"\xc0", "nested deeper than 32"),
        (_REPLY_HEAD + b"\x91" * 100_000 + b"\xc0", "nested deeper than 32"),
        # The reply's own three levels and 30 more: one past the protocol's 32.
        (_cleared_with(_nested(30)), "nested deeper than 32"),
        # A frame of a million empty lists: MessagePack alone builds some 60 bytes of Python
        # objects from each byte.
        (_cleared_with([[]] * (1 << 20)), "values in a frame of"),
        (_cleared_with([1000] * (1 << 20)), "values in a frame of"),
        (msgpack.packb({"id": 1, "body": {"cleared": {"removed": [1, 2, 3]}}})[:-1], "end inside"),
        (_REPLY_HEAD + b"\xcb\x00\x00", "end inside"),
        (_REPLY_HEAD + b"\xd4\x01\x00", "extension type"),
        (_REPLY_HEAD + b"\xc1", "no type"),
    ],
)
def test_a_reply_past_the_limits_is_bad_reply_before_it_is_built(body: bytes, why: str) -> None:
    with pytest.raises(errors.BadReply, match=f"bad reply: .*{why}"):
        wire.decode_reply(body)
    with pytest.raises(errors.BadReply, match=why):
        wire.check_reply_shape(body)


def test_bad_reply_is_connection_lost() -> None:
    # A caller that handles a lost connection handles a broken reply the same way.
    assert issubclass(errors.BadReply, errors.ConnectionLost)
    assert errors.BadReply in (getattr(errors, name) for name in errors.__all__)


def test_replies_at_the_limits_decode() -> None:
    assert wire.decode_reply(_cleared_with(_nested(29))) == (1, Cleared(removed=[1, 2, 3]))
    assert wire.decode_reply(_cleared_with(bytes(wire.MAX_REPLY_STRING))) == (
        1,
        Cleared(removed=[1, 2, 3]),
    )
    keys = {f"field_{i:04}": 0 for i in range(wire.MAX_REPLY_KEYS - 1)}
    body = msgpack.packb({"id": 1, "body": {"cleared": {"removed": [], **keys}}})
    assert wire.decode_reply(body) == (1, Cleared(removed=[]))


def _refused(chunks: int, reason: str, message: str) -> bytes:
    refused = [{"index": i, "reason": reason, "message": message} for i in range(chunks)]
    reply = {"id": 1, "body": {"stored": {"stored": 0, "present": 0, "refused": refused}}}
    return msgpack.packb(reply)


def test_the_largest_replies_a_daemon_sends_decode() -> None:
    # A store of as many one-block chunks as the daemon's default 16 MiB request frame holds
    # (16 bytes of id and 8 of block each), every one refused with the daemon's own message.
    chunks = (16 << 20) // 24
    body = _refused(chunks, "no_space", "out of memory")
    assert len(body) <= wire.MAX_REPLY_BYTES
    reply_id, stored = wire.decode_reply(body)
    assert isinstance(stored, Stored) and len(stored.refused) == chunks
    assert stored.refused[-1] == (chunks - 1, "no_space", "out of memory")
    # The densest reply there is: refusals with the shortest reason and no message. One
    # refusal is 7 values in 29 bytes or more, within the budget of a value per 4 bytes.
    densest = _refused(100_000, "busy", "")
    assert len(densest) >= 29 * 100_000
    assert len(wire.decode_reply(densest)[1].refused) == 100_000
    # A status of as many sessions as the daemon serves by default (server.max_connections).
    sessions = [
        {
            "session": 2**40 + i,
            "role": "worker",
            "rank": i % 8,
            "tp_size": 8,
            "open_lookups": 0,
            "joined_lookups": 0,
        }
        for i in range(1024)
    ]
    reply = msgpack.unpackb(bytes.fromhex(VECTORS["replies"]["status"]))
    reply["body"]["status"]["sessions"] = sessions
    assert wire.decode_reply(msgpack.packb(reply))[1]["sessions"] == sessions


def test_a_bad_replys_message_is_short_whatever_its_size() -> None:
    big = msgpack.packb({"id": 1, "body": [list(range(1000))] * 100})
    with pytest.raises(errors.BadReply) as caught:
        wire.decode_reply(big)
    assert len(str(caught.value)) < 300
