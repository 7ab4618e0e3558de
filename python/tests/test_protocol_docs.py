"""docs/protocol.md, point by point, against a real daemon (issue 16).

A client written from the docs alone tripped over each of these; every test quotes what the
docs promise and checks the daemon keeps it. Frames are built by hand (msgpack and a socket),
as the docs show, so the package's own client cannot paper over a difference.
"""

from __future__ import annotations

import re
import socket
import struct

import msgpack
import pytest
from daemon import REPO_ROOT, TCP_TOKEN, Daemon

from tierkv import SharedBuffer, prefix_hashes, wire

CHUNK_BYTES = 4096
TOKENS = 16


class Raw:
    """A bare session: the `call` of docs/protocol.md."""

    def __init__(self, path) -> None:
        self.s = socket.socket(socket.AF_UNIX)
        self.s.settimeout(10)
        self.s.connect(str(path))

    def send(self, body: bytes) -> None:
        self.s.sendall(struct.pack("<I", len(body)) + body)

    def reply(self):
        header = self.s.recv(4, socket.MSG_WAITALL)
        if len(header) < 4:
            return None
        (n,) = struct.unpack("<I", header)
        return msgpack.unpackb(self.s.recv(n, socket.MSG_WAITALL))

    def call(self, i: int, body):
        self.send(msgpack.packb({"id": i, "body": body}))
        return self.reply()

    def hello(self, **fields):
        hello = {
            "version": wire.PROTOCOL_VERSION,
            "namespaces": [{"model": "m"}],
            "chunk_bytes": CHUNK_BYTES,
        }
        hello.update(fields)
        return self.call(1, {"hello": hello})


def error_code(reply) -> str:
    return reply["body"]["error"]["code"]


@pytest.fixture
def raw(daemon):
    sessions = []

    def open_():
        r = Raw(daemon.socket)
        sessions.append(r)
        return r

    yield open_
    for r in sessions:
        r.s.close()


def test_every_version_the_docs_name_as_the_daemons_is_the_current_one():
    # Each bump of the version must update every place that states it (two once stayed at 3).
    text = (REPO_ROOT / "docs" / "protocol.md").read_text()
    stated = re.findall(
        r"protocol \(version (\d+)\)|daemon's protocol version \((\d+)\)|daemon's \((\d+)\)", text
    )
    versions = {int(next(v for v in groups if v)) for groups in stated}
    assert len(stated) >= 3
    assert versions == {wire.PROTOCOL_VERSION}


def _rust_const(path: str, name: str) -> int:
    """A Rust integer constant as the source writes it (``64 << 20``, ``32``)."""
    source = (REPO_ROOT / path).read_text()
    found = re.search(rf"const {name}: \w+ = ([0-9_ <]+);", source)
    assert found, f"no const {name} in {path}"
    value, *shift = (int(part.replace("_", "")) for part in found[1].split("<<"))
    return value << shift[0] if shift else value


def test_the_reply_limits_are_the_documented_ones_and_the_rust_ones() -> None:
    # "a reply frame is at most 64 MiB, its values nest at most 32 deep, no string or bin is
    # longer than 1 MiB, no list has more than 4,194,304 items nor a map more than 1,024 keys,
    # and a frame of `n` bytes holds at most `n / 4 + 64` values"
    text = " ".join((REPO_ROOT / "docs" / "protocol.md").read_text().split())
    limits = re.search(
        r"a reply frame is at most (\d+) MiB, its values nest at most (\d+) deep, no string or "
        r"bin is longer than (\d+) MiB, no list has more than ([\d,]+) items nor a map more "
        r"than ([\d,]+) keys, and a frame of `n` bytes holds at most `n / (\d+) \+ (\d+)` values",
        text,
    )
    assert limits, "docs/protocol.md no longer states the reply limits"
    mib, depth, string_mib, items, keys, per_value, extra = (
        int(g.replace(",", "")) for g in limits.groups()
    )
    assert mib << 20 == wire.MAX_REPLY_BYTES
    assert depth == wire.MAX_REPLY_DEPTH
    assert string_mib << 20 == wire.MAX_REPLY_STRING
    assert items == wire.MAX_REPLY_LIST
    assert keys == wire.MAX_REPLY_KEYS
    assert (per_value, extra) == (wire.REPLY_BYTES_PER_VALUE, wire.REPLY_EXTRA_VALUES)
    # "Values nest at most 32 deep (`bad_frame`)": the one depth, for requests and replies.
    assert "Values nest at most 32 deep" in text
    assert _rust_const("crates/tierkv-proto/src/frame.rs", "MAX_DEPTH") == wire.MAX_REPLY_DEPTH
    assert _rust_const("crates/tierkv-client/src/lib.rs", "REPLY_LIMIT") == wire.MAX_REPLY_BYTES


def test_world_size_has_a_default_even_with_tp_size_above_one(raw):
    # "| `world_size` | u16 | `tp_size` | at least `tp_size` |"
    reply = raw().hello(tp_size=4, rank=3)
    assert "welcome" in reply["body"], reply


def test_a_second_hello_is_no_session_and_closes_the_connection(raw):
    # "A second `hello` on an open session gets `no_session` too, and the connection closes."
    r = raw()
    assert "welcome" in r.hello()["body"]
    assert error_code(r.hello()) == "no_session"
    assert r.reply() is None, "the connection is closed"


def test_unknown_fields_are_refused_with_bad_request_and_the_session_goes_on(raw):
    # "a field the request does not have ... is refused with `bad_request`"
    r = raw()
    r.hello()
    reply = r.call(7, {"query": {"lookup": 1, "lokup": 2}})
    assert reply["id"] == 7 and error_code(reply) == "bad_request"
    assert "status" in r.call(8, "status")["body"], "the session goes on"


def test_chunks_travel_flat_and_what_does_not_divide_is_bad_request(raw):
    # "ChunkIds = bin # 16 bytes per chunk" ... "Ids that are not whole 16-byte runs, block ids
    # that are not whole 8-byte runs or do not divide evenly among the chunks make the request
    # `bad_request`."
    r = raw()
    r.hello()
    ids = prefix_hashes(list(range(2 * TOKENS)), TOKENS)
    flat = b"".join(c.to_bytes(16, "big") for c in ids)
    started = r.call(2, {"lookup": {"namespace": 0, "chunks": flat}})["body"]["lookup_started"]
    assert started["l1_hit_chunks"] == 0
    for i, chunks in enumerate(
        [
            {"ids": flat[:20], "blocks": b""},
            {"ids": flat, "blocks": bytes(12)},
            {"ids": flat, "blocks": bytes(24)},
            {"ids": b"", "blocks": bytes(8)},
        ]
    ):
        body = {"retrieve": {"lookup": started["lookup"], "buffer": 0, "chunks": chunks}}
        reply = r.call(3 + i, body)
        assert reply["id"] == 3 + i and error_code(reply) == "bad_request", reply
    assert "status" in r.call(9, "status")["body"], "the session goes on"


def test_trailing_bytes_make_a_bad_frame(raw):
    # "A body is exactly one value: bytes after it make the frame `bad_frame`."
    r = raw()
    r.hello()
    r.send(msgpack.packb({"id": 2, "body": "status"}) + b"\xc0")
    assert error_code(r.reply()) == "bad_frame"
    assert r.reply() is None, "the connection closes after bad_frame"


def test_per_tier_is_always_l1_l2_disk_and_release_after_the_last_reader_is_released(daemon):
    # "`per_tier` ... always four counts, in that order ... adding up to `hit_chunks`"
    # "the owner's `release` gets `released` (nothing is left to return, and it is not an error)"
    hello = wire.hello(namespaces=["m"], chunk_bytes=CHUNK_BYTES, chunk_tokens=TOKENS)
    client = daemon.connect(hello)
    with SharedBuffer(CHUNK_BYTES, 4, name="tierkv-doc") as buf:
        assert client.register_buffer(buf) == 0
        hashes = prefix_hashes(list(range(4 * TOKENS)), TOKENS)
        assert client.store(0, 0, [(h, i) for i, h in enumerate(hashes)]).stored == 4
        started = client.lookup(0, hashes)
        assert started.outcome is not None
        assert started.outcome.per_tier == [4, 0, 0, 0]
        miss = client.lookup(0, prefix_hashes(list(range(1000, 1000 + TOKENS)), TOKENS))
        outcome = miss.outcome or client.wait(miss.lookup, 5.0)
        assert outcome.per_tier == [0, 0, 0, 0]
        client.retrieve(started.lookup, 0, [(h, i) for i, h in enumerate(hashes)])
        client.release(started.lookup)
        # The empty lookup's single reader returns its (empty) share by a retrieve of nothing.
        client.retrieve(miss.lookup, 0, [])
        client.release(miss.lookup)


@pytest.mark.parametrize(("policy", "durable"), [("write_through", 3), ("cascade", 0)])
def test_flush_says_which_stored_chunks_are_durable(tierkv_bin, tmp_path, policy, durable):
    # "`durable` chunks are on the disk tier" ... "Under the cascade [...] a chunk reaches the
    # disk only when L2 lets it go, or at a clean stop: `flush` counts it `not_durable`"
    extra = f'token = "{TCP_TOKEN}"\n[storage]\nstore_policy = "{policy}"'
    daemon = Daemon(tierkv_bin, tmp_path, extra)
    try:
        hello = wire.hello(namespaces=["m"], chunk_bytes=CHUNK_BYTES, chunk_tokens=TOKENS)
        client = daemon.connect(hello)
        with SharedBuffer(CHUNK_BYTES, 4, name="tierkv-doc") as buf:
            client.register_buffer(buf)
            hashes = prefix_hashes(list(range(500, 500 + 3 * TOKENS)), TOKENS)
            assert client.store(0, 0, [(h, i) for i, h in enumerate(hashes)]).stored == 3
            flushed = client.flush(10.0)
            assert (flushed.durable, flushed.not_durable) == (durable, 3 - durable)
            # Nothing stored since: the next flush has nothing to wait for.
            assert client.flush(1.0) == wire.Flushed(durable=0, not_durable=0)
    finally:
        daemon.stop()


def test_refusal_reasons_are_codes():
    # "each with a `reason` code: `no_space`, `busy`, `copy_failed`, `internal`"
    assert wire.REFUSAL_REASONS == ("no_space", "busy", "copy_failed", "internal")


def test_too_many_connections_has_its_own_code(tierkv_bin, tmp_path):
    # "A connection past `server.max_connections` gets `too_many_connections` (id 0)"
    d = Daemon(tierkv_bin, tmp_path, extra_config="max_connections = 1")
    try:
        first = None
        for _ in range(1000):
            # The start-up probe's connection may still hold the one slot for a moment.
            first = Raw(d.socket)
            try:
                if "welcome" in first.hello()["body"]:
                    break
            except OSError:
                pass
            first.s.close()
        second = Raw(d.socket)
        reply = second.reply()
        assert reply["id"] == 0 and error_code(reply) == "too_many_connections"
        first.s.close()
        second.s.close()
    finally:
        d.stop()


def test_lease_limit_is_refused_with_its_code(tierkv_bin, tmp_path):
    # "A lookup made while the session's open lookups hold `server.max_leased_per_session`
    # bytes of leases ... is refused with `lease_limit`."
    d = Daemon(tierkv_bin, tmp_path, extra_config='max_leased_per_session = "8KiB"')
    try:
        hello = wire.hello(namespaces=["m"], chunk_bytes=CHUNK_BYTES, chunk_tokens=TOKENS)
        client = d.connect(hello)
        with SharedBuffer(CHUNK_BYTES, 4, name="tierkv-doc") as buf:
            client.register_buffer(buf)
            hashes = prefix_hashes(list(range(2 * TOKENS)), TOKENS)
            client.store(0, 0, [(h, i) for i, h in enumerate(hashes)])
            client.lookup(0, hashes)
            with pytest.raises(wire.DaemonError) as caught:
                client.lookup(0, hashes)
            assert caught.value.code == "lease_limit"
    finally:
        d.stop()
