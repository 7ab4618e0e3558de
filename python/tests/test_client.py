"""The client against a real daemon (see daemon.py)."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import mmap
import os
import pickle
import re
import resource
import select
import shutil
import signal
import socket
import struct
import threading
import time
import tracemalloc
import urllib.request
import warnings
from pathlib import Path

import msgpack
import pytest
from daemon import (
    OTHER_UID,
    Daemon,
    admin_hello,
    config,
    free_port,
    in_background,
    other_users_dir,
    other_users_listener,
)

from tierkv import (
    BadBuffer,
    BadFrame,
    BadReply,
    BlockOutOfRange,
    Client,
    ClientBusy,
    ConnectionLost,
    CudaIpcRegion,
    Forbidden,
    KvLayout,
    LookupOutcome,
    LookupStarted,
    MemfdRegion,
    NamespaceNotDeclared,
    NotInHit,
    Retrieved,
    Segment,
    SharedBuffer,
    ShareReturned,
    Stored,
    UnknownLookup,
    UntrustedDaemon,
    VersionMismatch,
    Welcome,
    prefix_hashes,
    sealed_memfd,
    wire,
)

#: The session's chunk size in these tests (the daemon's slot is 64 KiB).
CHUNK_BYTES = 4096
#: Tokens per chunk in these tests.
CHUNK_TOKENS = 16
#: The namespace every worker here declares first.
MODEL = ("tiny-llama", "")


def worker_hello(**kw) -> dict:
    """A worker hello of this suite's shape; keywords override."""
    kw.setdefault("namespaces", [MODEL])
    kw.setdefault("chunk_bytes", CHUNK_BYTES)
    kw.setdefault("chunk_tokens", CHUNK_TOKENS)
    return wire.hello(**kw)


def connect(daemon, timeout: float = 5.0, **hello) -> Client:
    """A worker session on ``daemon`` (closed at teardown); keywords go to the hello."""
    return daemon.connect(worker_hello(**hello), timeout=timeout)


def prompt(seed: int, chunks: int) -> list[int]:
    """Token ids of ``chunks`` full chunks, distinct per seed."""
    return [(seed * 100_003 + t * 7919) % 128_000 for t in range(chunks * CHUNK_TOKENS)]


def fill(view: memoryview, value: int) -> None:
    view[:] = bytes([value]) * len(view)


def outcome_of(client: Client, started: LookupStarted) -> LookupOutcome:
    """The lookup's outcome, waiting for it if it did not complete at once."""
    return started.outcome or client.wait(started.lookup, 5.0)


@pytest.fixture
def buf():
    with SharedBuffer(CHUNK_BYTES, 8, name="tierkv-test") as b:
        yield b


def test_hello_opens_a_session(daemon):
    a = connect(daemon)
    b = connect(daemon, mla=True, rank=0, tp_size=2, world_size=2)
    assert isinstance(a.session, Welcome)
    assert a.session.version == wire.PROTOCOL_VERSION
    assert a.session.max_chunk_bytes == 64 * 1024
    assert a.session.readers == 1
    assert b.session.readers == 2, "with MLA every rank of the TP group reads"
    assert a.session.session != b.session.session
    report = a.status()
    sessions = {s["session"]: s for s in report["sessions"]}
    assert sessions[b.session.session]["tp_size"] == 2
    assert report["connected_workers"] == 2


def test_a_version_1_hello_is_refused_and_says_why(daemon):
    with pytest.raises(VersionMismatch) as caught:
        connect(daemon, version=1)
    assert caught.value.code == "version_mismatch"
    assert "register_kv" in caught.value.message
    # The daemon goes on serving others.
    assert connect(daemon).session.version == wire.PROTOCOL_VERSION


def test_store_lookup_retrieve_round_trip(daemon, buf):
    client = connect(daemon)
    buffer = client.register_buffer(buf)
    assert buffer == 0
    for i in range(buf.blocks):
        fill(buf.block(i), 0x10 + i)
    hashes = prefix_hashes(prompt(1, 3), CHUNK_TOKENS)
    stored = client.store(0, buffer, [(h, i) for i, h in enumerate(hashes)])
    assert stored == Stored(stored=3, present=0, refused=[])
    assert client.store(0, buffer, [(hashes[0], [0])]) == Stored(stored=0, present=1, refused=[])

    started = client.lookup(0, hashes + prefix_hashes(prompt(2, 1), CHUNK_TOKENS))
    assert started.l1_hit_chunks == 3
    outcome = outcome_of(client, started)
    assert outcome.hit_chunks == 3
    assert outcome.hit_tokens == 3 * CHUNK_TOKENS
    assert outcome.readers == 1
    assert outcome.per_tier[0] == 3
    assert client.query(started.lookup) == outcome

    # Retrieve into other blocks: their bytes become the stored ones.
    for i in (5, 6, 7):
        fill(buf.block(i), 0)
    got = client.retrieve(started.lookup, buffer, [(hashes[0], [7]), (hashes[2], [5])])
    assert got == Retrieved(chunks=2, bytes=2 * CHUNK_BYTES)
    assert bytes(buf.block(7)) == bytes([0x10]) * CHUNK_BYTES
    assert bytes(buf.block(5)) == bytes([0x12]) * CHUNK_BYTES
    assert bytes(buf.block(6)) == bytes(CHUNK_BYTES), "a block no chunk named is untouched"
    # The only reader returned its share: the lookup is gone.
    with pytest.raises(UnknownLookup):
        client.query(started.lookup)


def test_a_multi_segment_layout_gathers_segment_major_then_block_order(daemon):
    # Two segments ("layers") of 8 blocks of 1 KiB, 2 KiB apart, in one memfd; a chunk is two
    # blocks of each: 2 x 2 x 1 KiB = the session's 4 KiB chunk.
    block, stride, blocks, seg_bytes = 1024, 2048, 8, 16 * 1024
    client = connect(daemon)
    fd = sealed_memfd(2 * seg_bytes, "tierkv-test-layers")
    try:
        region = mmap.mmap(fd, 2 * seg_bytes)
        layout = KvLayout(
            blocks=blocks,
            block_bytes=block,
            block_stride=stride,
            blocks_per_chunk=2,
            segments=[Segment(0, 0), Segment(0, seg_bytes)],
        )
        assert layout.chunk_bytes == CHUNK_BYTES
        kv = client.register_kv([(MemfdRegion(2 * seg_bytes), fd)], layout)
    finally:
        os.close(fd)  # the daemon holds its own descriptor and mapping

    def piece(seg: int, b: int) -> slice:
        at = seg * seg_bytes + b * stride
        return slice(at, at + block)

    def value(seg: int, b: int) -> int:
        return 1 + seg * 16 + b

    for seg in range(2):
        for b in range(blocks):
            region[piece(seg, b)] = bytes([value(seg, b)]) * block
    gaps = bytes([0xEE]) * (stride - block)
    for seg in range(2):
        for b in range(blocks):
            at = seg * seg_bytes + b * stride + block
            region[at : at + stride - block] = gaps

    # A flat buffer of one-block chunks in the same session shows a chunk's object as it is.
    flat = SharedBuffer(CHUNK_BYTES, 2)
    flat_id = client.register_buffer(flat)
    (h,) = prefix_hashes(prompt(3, 1), CHUNK_TOKENS)
    assert client.store(0, kv, [(h, [5, 1])]).stored == 1

    started = client.lookup(0, [h])
    assert outcome_of(client, started).hit_chunks == 1
    client.retrieve(started.lookup, flat_id, [(h, 0)])
    gathered = bytes(flat.block(0))
    expected = b"".join(bytes([value(seg, b)]) * block for seg in (0, 1) for b in (5, 1))
    assert gathered == expected, "segment 0 blocks 5, 1, then segment 1 blocks 5, 1"

    # Scatter it back into blocks 0 and 7 of the layout: each piece lands where it belongs.
    started = client.lookup(0, [h])
    outcome_of(client, started)
    client.retrieve(started.lookup, kv, [(h, [0, 7])])
    for seg in range(2):
        assert region[piece(seg, 0)] == bytes([value(seg, 5)]) * block
        assert region[piece(seg, 7)] == bytes([value(seg, 1)]) * block
        for b in range(1, 7):
            assert region[piece(seg, b)] == bytes([value(seg, b)]) * block, "others untouched"
        for b in range(blocks):
            at = seg * seg_bytes + b * stride + block
            assert region[at : at + stride - block] == gaps, "the gaps are never written"
    flat.close()
    region.close()


def test_blocks_out_of_range_are_refused_and_change_nothing(daemon, buf):
    client = connect(daemon)
    buffer = client.register_buffer(buf)
    h0, h1 = prefix_hashes(prompt(4, 2), CHUNK_TOKENS)
    with pytest.raises(BlockOutOfRange) as caught:
        client.store(0, buffer, [(h0, 0), (h1, buf.blocks)])
    assert caught.value.code == "block_out_of_range"
    assert f"block {buf.blocks}" in caught.value.message
    with pytest.raises(BlockOutOfRange, match="names"):
        client.store(0, buffer, [(h0, [0, 1])])
    # Nothing was stored by the refused requests.
    started = client.lookup(0, [h0])
    assert outcome_of(client, started).hit_chunks == 0
    client.release(started.lookup)

    assert client.store(0, buffer, [(h0, 0)]).stored == 1
    started = client.lookup(0, [h0])
    assert outcome_of(client, started).hit_chunks == 1
    with pytest.raises(BlockOutOfRange):
        client.retrieve(started.lookup, buffer, [(h0, 1 << 40)])
    # The refused retrieve returned no share: a good one still works.
    assert client.retrieve(started.lookup, buffer, [(h0, 3)]).chunks == 1


def test_unknown_lookups_are_refused(daemon, buf):
    client = connect(daemon)
    buffer = client.register_buffer(buf)
    for call in (
        lambda: client.query(123_456),
        lambda: client.wait(123_456, 0.1),
        lambda: client.release(123_456),
        lambda: client.retrieve(123_456, buffer, [(1, 0)]),
    ):
        with pytest.raises(UnknownLookup) as caught:
            call()
        assert caught.value.code == "unknown_lookup"
    started = client.lookup(0, [1, 2])
    client.release(started.lookup)
    with pytest.raises(UnknownLookup):
        client.query(started.lookup)


def test_a_second_retrieve_by_the_same_reader_is_share_returned(daemon):
    # With MLA a lookup has one share per rank: rank 0 returning its share twice is refused,
    # while rank 1 (another session) still reads with the same lookup id.
    mla = {"mla": True, "tp_size": 2, "world_size": 2}
    rank0 = connect(daemon, rank=0, **mla)
    rank1 = connect(daemon, rank=1, **mla)
    buf0, buf1 = SharedBuffer(CHUNK_BYTES, 2), SharedBuffer(CHUNK_BYTES, 2)
    b0, b1 = rank0.register_buffer(buf0), rank1.register_buffer(buf1)
    fill(buf0.block(0), 0x5A)
    (h,) = prefix_hashes(prompt(5, 1), CHUNK_TOKENS)
    rank0.store(0, b0, [(h, 0)])

    started = rank0.lookup(0, [h])
    assert outcome_of(rank0, started).readers == 2
    assert rank0.retrieve(started.lookup, b0, [(h, 1)]).chunks == 1
    with pytest.raises(ShareReturned) as caught:
        rank0.retrieve(started.lookup, b0, [(h, 1)])
    assert caught.value.code == "share_returned"
    assert rank1.retrieve(started.lookup, b1, [(h, 0)]).bytes == CHUNK_BYTES
    assert bytes(buf1.block(0)) == bytes([0x5A]) * CHUNK_BYTES
    with pytest.raises(UnknownLookup):
        rank0.query(started.lookup)
    buf0.close()
    buf1.close()


def test_a_chunk_outside_the_hit_is_not_in_hit(daemon, buf):
    client = connect(daemon)
    buffer = client.register_buffer(buf)
    h0, h1 = prefix_hashes(prompt(6, 2), CHUNK_TOKENS)
    client.store(0, buffer, [(h0, 0)])
    started = client.lookup(0, [h0, h1])
    assert outcome_of(client, started).hit_chunks == 1
    with pytest.raises(NotInHit):
        client.retrieve(started.lookup, buffer, [(h1, 1)])
    client.release(started.lookup)


def test_an_undeclared_namespace_is_refused(daemon, buf):
    client = connect(daemon, namespaces=[MODEL, ("other-model", "tenant")])
    buffer = client.register_buffer(buf)
    with pytest.raises(NamespaceNotDeclared) as caught:
        client.lookup(2, [1])
    assert caught.value.code == "namespace_not_declared"
    with pytest.raises(NamespaceNotDeclared):
        client.store(7, buffer, [(1, 0)])
    # Namespaces do not share chunks.
    (h,) = prefix_hashes(prompt(7, 1), CHUNK_TOKENS)
    client.store(0, buffer, [(h, 0)])
    assert outcome_of(client, client.lookup(1, [h])).hit_chunks == 0


def test_a_registration_may_take_longer_than_the_clients_deadline(daemon, buf):
    # The daemon maps every resident page of a memfd before it answers: a large KV cache needs
    # a registration deadline of its own (the connector's grows with the KV's size).
    client = connect(daemon, timeout=0.3)
    daemon.pause()
    resumer = threading.Timer(0.8, daemon.resume)
    resumer.start()
    try:
        assert client.register_buffer(buf, timeout=5.0) == 0
    finally:
        resumer.join()
    assert not client.closed


def test_an_unsealed_memfd_is_bad_buffer(daemon, buf):
    client = connect(daemon)
    fd = os.memfd_create("tierkv-unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, CHUNK_BYTES * 4)
        layout = KvLayout(4, CHUNK_BYTES, CHUNK_BYTES, 1, [Segment(0, 0)])
        with pytest.raises(BadBuffer) as caught:
            client.register_kv([(MemfdRegion(CHUNK_BYTES * 4), fd)], layout)
    finally:
        os.close(fd)
    assert caught.value.code == "bad_buffer"
    assert "F_SEAL_SHRINK" in caught.value.message
    # A layout whose chunk is not the session's chunk_bytes is refused too.
    with pytest.raises(BadBuffer, match="chunk_bytes"):
        client.register_kv(
            [(MemfdRegion(buf.nbytes), buf.fd)],
            KvLayout(buf.blocks * 2, CHUNK_BYTES // 2, CHUNK_BYTES // 2, 1, [Segment(0, 0)]),
        )
    # The session goes on, and a refused registration took no buffer number.
    assert client.register_buffer(buf) == 0
    with pytest.raises(ValueError, match="descriptor"):
        client.register_kv([(MemfdRegion(buf.nbytes), None)], KvLayout(1, 1, 1, 1, []))


def test_memfds_made_here_are_allocated_and_a_sparse_one_is_bad_buffer(daemon, buf):
    # Every page allocated by the client: the daemon's reads of a hole would allocate the page,
    # charged to the daemon, so it refuses a memfd with holes.
    fd = sealed_memfd(CHUNK_BYTES * 4 + 1)
    try:
        assert os.fstat(fd).st_blocks * 512 >= CHUNK_BYTES * 4 + 1
    finally:
        os.close(fd)
    assert os.fstat(buf.fd).st_blocks * 512 >= buf.nbytes
    client = connect(daemon)
    fd = os.memfd_create("tierkv-sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, CHUNK_BYTES * 4)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        layout = KvLayout(4, CHUNK_BYTES, CHUNK_BYTES, 1, [Segment(0, 0)])
        with pytest.raises(BadBuffer, match="fallocate"):
            client.register_kv([(MemfdRegion(CHUNK_BYTES * 4), fd)], layout)
        os.posix_fallocate(fd, 0, CHUNK_BYTES * 4)
        assert client.register_kv([(MemfdRegion(CHUNK_BYTES * 4), fd)], layout) == 0
    finally:
        os.close(fd)


def test_a_cuda_ipc_region_without_a_cuda_driver_is_bad_buffer_saying_why(daemon, buf):
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver: scripts/gpu-check.sh covers CUDA IPC")
    client = connect(daemon)
    region = CudaIpcRegion(handle=bytes(64), device="0000:00:00.0", bytes=CHUNK_BYTES * 4)
    layout = KvLayout(4, CHUNK_BYTES, CHUNK_BYTES, 1, [Segment(0, 0)])
    with pytest.raises(BadBuffer) as caught:
        client.register_kv([(region, None)], layout)
    assert "cuda_ipc region 0: CUDA is unavailable" in caught.value.message
    # The session goes on, and the refused registration took no buffer number.
    assert client.register_buffer(buf) == 0


def test_a_sessions_registrations_are_unmapped_when_it_disconnects(daemon):
    """A registration lives exactly as long as its session: the daemon drops it (unmaps a memfd,
    closes a CUDA IPC handle: the same `Drop`) when the connection goes."""
    maps = f"/proc/{daemon.proc.pid}/maps"

    def mapped(name: str) -> bool:
        with open(maps) as f:
            return f"/memfd:{name} " in f.read()

    client = connect(daemon)
    with SharedBuffer(CHUNK_BYTES, 8, name="tierkv-drop-test") as shared:
        client.register_buffer(shared)
        assert mapped("tierkv-drop-test")
        client.close()
        deadline = time.monotonic() + 10
        while mapped("tierkv-drop-test") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not mapped("tierkv-drop-test"), "the registration outlived its session"


def test_a_killed_daemon_is_connection_lost_within_the_deadline(daemon):
    client = connect(daemon, timeout=2.0)
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(timeout=10)
    start = time.monotonic()
    with pytest.raises(ConnectionLost):
        client.status()
    assert time.monotonic() - start < 2.5
    assert client.closed
    with pytest.raises(ConnectionLost, match="closed"):
        client.lookup(0, [1])


def test_a_missed_deadline_is_connection_lost_and_closes_the_client(daemon):
    client = connect(daemon, timeout=0.5)
    daemon.pause()
    try:
        start = time.monotonic()
        with pytest.raises(ConnectionLost, match="deadline"):
            client.status()
        elapsed = time.monotonic() - start
    finally:
        daemon.resume()
    assert 0.4 < elapsed < 2.0
    assert client.closed, "a half-read session is never reused"
    with pytest.raises(ConnectionLost):
        client.status()
    assert connect(daemon).status()["version"]


def test_a_call_behind_another_threads_call_keeps_its_own_deadline(daemon):
    """A call waits for another thread's call on the same client only until its own deadline:
    then ``ClientBusy``, nothing sent, and the client stays open for the other call."""
    client = connect(daemon, timeout=0.5)
    daemon.pause()
    # Its deadline: 0.5 s more than the wait's 2 s.
    waiter, outcome = in_background(lambda: client.wait(12345, 2.0))
    try:
        time.sleep(0.1)
        start = time.monotonic()
        with pytest.raises(ClientBusy):
            client.status()
        elapsed = time.monotonic() - start
        assert not client.closed, "the other call still owns the session"
    finally:
        daemon.resume()
        waiter.join(timeout=10)
    assert 0.4 < elapsed < 1.5, elapsed
    assert len(outcome) == 1 and isinstance(outcome[0], UnknownLookup), outcome
    assert client.status()["version"], "the session goes on"


def test_a_call_after_another_threads_missed_deadline_says_it_timed_out(daemon):
    client = connect(daemon, timeout=0.5)
    daemon.pause()
    try:
        with pytest.raises(ConnectionLost, match="deadline"):
            client.status()
    finally:
        daemon.resume()
    # A caller (the connector's link) backs off on a timeout rather than reconnecting at once.
    with pytest.raises(ConnectionLost, match="missed its deadline") as closed:
        client.status()
    assert isinstance(closed.value.__cause__, TimeoutError)


def test_descriptors_are_checked_before_anything_is_sent(daemon, tmp_path):
    client = connect(daemon)
    region = MemfdRegion(bytes=CHUNK_BYTES)
    layout = KvLayout(
        blocks=1,
        block_bytes=CHUNK_BYTES,
        block_stride=CHUNK_BYTES,
        blocks_per_chunk=1,
        segments=[Segment(region=0, offset=0)],
    )
    closed_fd = os.open(tmp_path, os.O_RDONLY)
    os.close(closed_fd)
    for fd, error in ((True, TypeError), (-1, ValueError), (closed_fd, ValueError)):
        with pytest.raises(error):
            client.register_kv([(region, fd)], layout)
    many = [(MemfdRegion(bytes=CHUNK_BYTES), 0)] * (wire.MAX_MEMFD_REGIONS + 1)
    with pytest.raises(ValueError, match="memfd regions"):
        client.register_kv(many, layout)
    assert client.status()["version"], "nothing was sent: the session goes on"


def test_a_retrieve_past_its_deadline_is_not_carried_out_late(daemon, buf):
    """The hazard a hung daemon makes: a retrieve given up on at its deadline, carried out when
    the daemon resumes, would land in blocks the engine may have handed to another request. The
    client shuts its writing side as it gives up, and the daemon, seeing that before it copies,
    copies nothing. Its :class:`Unanswered` settles once the daemon has ended the session."""
    client = connect(daemon, timeout=0.5)
    buffer = client.register_buffer(buf)
    fill(buf.block(0), 0x5A)
    hashes = prefix_hashes(prompt(7, 1), CHUNK_TOKENS)
    client.store(0, buffer, [(hashes[0], [0])])
    started = client.lookup(0, hashes)
    assert outcome_of(client, started).hit_chunks == 1
    fill(buf.block(3), 0)
    assert client.take_unanswered() is None, "nothing is unanswered yet"
    daemon.pause()
    try:
        with pytest.raises(ConnectionLost, match="deadline"):
            client.retrieve(started.lookup, buffer, [(hashes[0], [3])])
        unanswered = client.take_unanswered()
        assert unanswered is not None
        assert client.take_unanswered() is None, "handed over once"
        assert not unanswered.settled()
        assert not unanswered.wait(0.2), "a stopped daemon is not done"
    finally:
        daemon.resume()
    assert unanswered.wait(5.0)
    assert bytes(buf.block(3)) == bytes(CHUNK_BYTES), "the retrieve given up on wrote nothing"
    assert unanswered.settled(), "settled stays settled"
    assert daemon.settled()["l1_leased_chunks"] == 0


def test_a_store_past_its_deadline_keeps_nothing_read_from_reused_blocks(daemon, buf):
    """A store given up on at its deadline, carried out when the daemon resumes, would read
    blocks the engine may have reused, and file another prompt's KV under this prefix. The
    daemon asks whether the client gave up after its copies and before the chunk becomes
    visible: it never does."""
    client = connect(daemon, timeout=0.5)
    buffer = client.register_buffer(buf)
    hashes = prefix_hashes(prompt(8, 1), CHUNK_TOKENS)
    fill(buf.block(0), 0x5A)
    daemon.pause()
    try:
        with pytest.raises(ConnectionLost, match="deadline"):
            client.store(0, buffer, [(hashes[0], [0])])
        unanswered = client.take_unanswered()
        assert unanswered is not None
        fill(buf.block(0), 0x77)  # the engine reuses the block for another prompt
    finally:
        daemon.resume()
    assert unanswered.wait(5.0)
    other = connect(daemon)
    started = other.lookup(0, hashes)
    assert outcome_of(other, started).hit_chunks == 0, "nothing of the store was kept"
    other.release(started.lookup)
    tiers = daemon.settled()["tiers"]
    assert [t["objects"] for t in tiers] == [0] * len(tiers), "no tier holds a chunk"


def test_calls_given_up_on_are_not_carried_out_and_are_counted(tierkv_bin, tmp_path, buf):
    """A lookup, a store and a retrieve given up on while the daemon was stopped: once it
    resumes, none is carried out, and its metrics count each by op."""
    port = free_port()
    daemon = Daemon(
        tierkv_bin,
        tmp_path,
        make_config=lambda s, d, e: config(s, d, e, metrics_listen=f"127.0.0.1:{port}"),
    )
    try:
        held, stored, fresh = (prefix_hashes(prompt(seed, 1), CHUNK_TOKENS) for seed in (9, 10, 11))
        setup = connect(daemon)
        setup_buffer = setup.register_buffer(buf)
        fill(buf.block(0), 0x5A)
        setup.store(0, setup_buffer, [(held[0], [0])])
        retriever, storer, looker = (connect(daemon, timeout=0.5) for _ in range(3))
        started = retriever.lookup(0, held)
        assert outcome_of(retriever, started).hit_chunks == 1
        retrieve_buffer = retriever.register_buffer(buf)
        store_buffer = storer.register_buffer(buf)
        fill(buf.block(3), 0)
        daemon.pause()
        try:
            calls = (
                lambda: retriever.retrieve(started.lookup, retrieve_buffer, [(held[0], [3])]),
                lambda: storer.store(0, store_buffer, [(stored[0], [0])]),
                lambda: looker.lookup(0, fresh),
            )
            unanswered = []
            for call, client in zip(calls, (retriever, storer, looker), strict=True):
                with pytest.raises(ConnectionLost, match="deadline"):
                    call()
                unanswered.append(client.take_unanswered())
        finally:
            daemon.resume()
        assert all(u is not None and u.wait(5.0) for u in unanswered)
        assert bytes(buf.block(3)) == bytes(CHUNK_BYTES), "the retrieve wrote nothing"
        check = connect(daemon)
        for hashes in (stored, fresh):
            looked = check.lookup(0, hashes)
            assert outcome_of(check, looked).hit_chunks == 0, "nothing was stored"
            check.release(looked.lookup)
        assert daemon.settled()["l1_leased_chunks"] == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
            text = page.read().decode()
        counted = {
            op: float(value)
            for op, value in re.findall(
                r'^tierkv_given_up_requests_total\{op="(\w+)"\} (\S+)$', text, re.MULTILINE
            )
        }
        assert counted == {"lookup": 1.0, "store": 1.0, "retrieve": 1.0}
    finally:
        daemon.stop()


def test_an_unanswered_call_to_a_killed_daemon_is_settled(daemon):
    client = connect(daemon, timeout=0.5)
    daemon.pause()
    with pytest.raises(ConnectionLost, match="deadline"):
        client.status()
    unanswered = client.take_unanswered()
    assert unanswered is not None and not unanswered.settled()
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(timeout=10)
    assert unanswered.wait(2.0), "a dead daemon carries nothing out"


def open_descriptors() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def test_a_connect_that_fails_leaves_no_connection_open(daemon):
    # A hello past its deadline, or a timeout refused: nobody gets a client to close.
    daemon.pause()
    try:
        before = open_descriptors()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ConnectionLost, match="deadline"):
                Client.connect(str(daemon.socket), worker_hello(), timeout=0.3)
            gc.collect()
        assert open_descriptors() <= before, "the connection of the failed hello stayed open"
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    finally:
        daemon.resume()
    for timeout in (0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="timeout must be a positive, finite"):
            Client.connect(str(daemon.socket), worker_hello(), timeout=timeout)
    assert open_descriptors() <= before, "the socket of a refused timeout stayed open"


def test_a_client_closed_with_an_unanswered_call_closes_its_connection(daemon):
    client = connect(daemon, timeout=0.5)
    daemon.pause()
    try:
        with pytest.raises(ConnectionLost):
            client.status()
        held = open_descriptors()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            client.close()
            gc.collect()
        assert client.take_unanswered() is None
        # The unanswered connection, and the eventfd a close wakes a call in flight with.
        assert len(held - open_descriptors()) == 2, "the unanswered connection stayed open"
        # Closed by the client, not left for the garbage collector to find unclosed.
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    finally:
        daemon.resume()
    # The daemon's end of the closed connection ends the session; nobody is left connected.
    daemon.eventually("the session ends", lambda s: s["connected_workers"] == 0)


def test_an_unanswered_connection_past_descriptor_1024_is_still_watched(daemon):
    # An engine's process may hold more than 1,024 descriptors, past what select() can watch.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE's hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fillers: list[int] = []
    try:
        while not fillers or fillers[-1] < 1100:
            fillers.append(os.open("/dev/null", os.O_RDONLY))
        client = connect(daemon, timeout=0.5)
        daemon.pause()
        try:
            with pytest.raises(ConnectionLost, match="deadline"):
                client.status()
            unanswered = client.take_unanswered()
            assert unanswered is not None
            assert not unanswered.wait(0.1)
        finally:
            daemon.resume()
        assert unanswered.wait(5.0)
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_wait_gets_a_deadline_beyond_its_own_timeout(daemon, buf):
    client = connect(daemon, timeout=0.5)
    buffer = client.register_buffer(buf)
    (h,) = prefix_hashes(prompt(8, 1), CHUNK_TOKENS)
    client.store(0, buffer, [(h, 0)])
    started = client.lookup(0, [h])
    # The daemon is stopped for longer than the client's timeout, but not longer than the wait
    # plus the timeout: the wait must still succeed.
    daemon.pause()
    resume = threading.Timer(0.8, daemon.resume)
    resume.start()
    try:
        outcome = client.wait(started.lookup, 2.0)
    finally:
        resume.join()
    assert outcome.hit_chunks == 1
    assert not client.closed


def test_status_shows_hit_tokens(daemon, buf):
    client = connect(daemon)
    buffer = client.register_buffer(buf)
    hashes = prefix_hashes(prompt(9, 4), CHUNK_TOKENS)
    client.store(0, buffer, [(h, i) for i, h in enumerate(hashes[:2])])
    started = client.lookup(0, hashes)
    assert outcome_of(client, started).hit_tokens == 2 * CHUNK_TOKENS
    report = client.status()
    assert report["hit_tokens"] == 2 * CHUNK_TOKENS
    assert report["requested_tokens"] == 4 * CHUNK_TOKENS
    assert report["lookups"] == 1
    assert report["hit_chunks"] == 2 and report["hit_ratio"] == pytest.approx(0.5)
    assert [t["name"] for t in report["tiers"]][0] == "l1"
    assert report["tiers"][0]["hit_chunks"] == 2
    assert report["open_lookups"] == 1
    mine = [s for s in report["sessions"] if s["session"] == client.session.session]
    assert mine == [
        {
            "session": client.session.session,
            "role": "worker",
            "rank": 0,
            "tp_size": 1,
            "open_lookups": 1,
            "joined_lookups": 0,
        }
    ]
    client.release(started.lookup)
    assert client.status()["open_lookups"] == 0


def test_admin_clear_empties_the_tiers(daemon, buf):
    worker = connect(daemon)
    buffer = worker.register_buffer(buf)
    hashes = prefix_hashes(prompt(10, 3), CHUNK_TOKENS)
    assert worker.store(0, buffer, [(h, i) for i, h in enumerate(hashes)]).stored == 3
    with pytest.raises(Forbidden):
        worker.clear()
    daemon.settled()

    # Anyone who can connect may ask the status; clear needs the daemon's token.
    with Client.connect(str(daemon.socket), admin_hello()) as local:
        assert local.status()["tiers"][0]["objects"] == 3
        with pytest.raises(Forbidden, match="token"):
            local.clear()
    admin = daemon.admin()
    with pytest.raises(Forbidden):
        admin.lookup(0, hashes)
    removed = admin.clear()
    assert len(removed) == len(admin.status()["tiers"])
    assert removed[0] == 3, f"L1 held the three chunks: {removed}"
    started = worker.lookup(0, hashes)
    assert outcome_of(worker, started).hit_chunks == 0


def test_calls_from_many_threads_never_interleave(daemon, buf):
    client = connect(daemon)
    buffer = client.register_buffer(buf)
    hashes = prefix_hashes(prompt(11, 2), CHUNK_TOKENS)
    client.store(0, buffer, [(h, i) for i, h in enumerate(hashes)])
    failures: list[BaseException] = []

    def work():
        try:
            for i in range(40):
                if i % 2:
                    assert isinstance(client.status(), dict)
                else:
                    started = client.lookup(0, hashes)
                    assert outcome_of(client, started).hit_chunks == 2
                    client.release(started.lookup)
        except BaseException as e:  # reported below
            failures.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert client.status()["open_lookups"] == 0


def test_end_and_the_context_manager_end_the_session(daemon):
    with Client.connect(str(daemon.socket), worker_hello()) as client:
        session = client.session.session
        assert client.status()
    assert client.closed
    client.end()  # nothing to do on a closed client
    with pytest.raises(ConnectionLost):
        client.status()
    daemon.eventually(
        "the session is gone", lambda s: all(x["session"] != session for x in s["sessions"])
    )
    other = connect(daemon)
    other.end()
    assert other.closed


def test_close_from_another_thread_ends_a_call_in_flight(daemon):
    client = connect(daemon, timeout=5.0)
    daemon.pause()
    errors: list[BaseException] = []

    def call():
        try:
            client.status()
        except BaseException as e:  # checked below
            errors.append(e)

    try:
        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.2)
        start = time.monotonic()
        client.close()
        t.join(timeout=3.0)
        assert time.monotonic() - start < 2.0
    finally:
        daemon.resume()
    assert len(errors) == 1 and isinstance(errors[0], ConnectionLost)
    assert client.closed


def test_tcp_sessions_need_the_token_and_carry_no_descriptors(tcp_daemon, buf):
    port = tcp_daemon.tcp_port
    with pytest.raises(Forbidden):
        Client.connect_tcp("127.0.0.1", port, worker_hello())
    client = Client.connect_tcp("127.0.0.1", port, worker_hello(token=tcp_daemon.token))
    try:
        assert client.session.version == wire.PROTOCOL_VERSION
        started = client.lookup(0, [1, 2])
        assert outcome_of(client, started).hit_chunks == 0
        client.release(started.lookup)
        with pytest.raises(ValueError, match="Unix socket"):
            client.register_buffer(buf)
        assert client.status()["connected_workers"] == 1
    finally:
        client.end()
    # A name is looked up (on a thread of its own, within the connect's deadline).
    admin = Client.connect_tcp("localhost", port, admin_hello(token=tcp_daemon.token))
    assert len(admin.clear()) >= 1
    admin.end()


def test_connecting_to_nothing_is_connection_lost(tmp_path):
    with pytest.raises(ConnectionLost):
        Client.connect(str(tmp_path / "nobody.sock"), worker_hello(), timeout=1.0)


def test_shared_buffer_blocks_are_bounds_checked():
    with SharedBuffer(64, 4) as b:
        assert (b.block_bytes, b.blocks, b.nbytes) == (64, 4, 256)
        b.block(3)[:] = b"\x07" * 64
        assert bytes(b.buffer()[192:]) == b"\x07" * 64
        for bad in (4, -1):
            with pytest.raises(IndexError):
                b.block(bad)
        view = b.block(0)
        fd = b.fd
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert seals & want == want
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 128)
    assert b.closed
    view[:4] = b"\x01\x02\x03\x04"  # a live view keeps its mapping after close
    assert bytes(view[:4]) == b"\x01\x02\x03\x04"
    with pytest.raises(ValueError):
        b.fd  # noqa: B018
    with pytest.raises(ValueError):
        SharedBuffer(0, 4)


def _reply_frame(reply: object) -> bytes:
    body = msgpack.packb(reply)
    return wire.HEADER.pack(len(body)) + body


@pytest.mark.parametrize(
    ("sent", "why"),
    [
        (_reply_frame({"id": 99, "body": {"cleared": {"removed": []}}}), "request 99"),
        (_reply_frame({"id": 1, "body": "bye"}), "does not answer"),
        (_reply_frame({"id": 1, "body": {"frobnicated": {}}}), "unknown reply"),
        (wire.HEADER.pack(100) + b"\x81", "inside a reply"),
        (wire.HEADER.pack(0), "0 bytes"),
        (wire.HEADER.pack(wire.MAX_REPLY_BYTES + 1), f"{wire.MAX_REPLY_BYTES + 1} bytes"),
    ],
)
def test_a_reply_that_does_not_fit_is_connection_lost(sent, why):
    # A fake daemon on the other end of a socket pair: the reply is already waiting.
    ours, theirs = socket.socketpair()
    with theirs:
        client = Client(ours, timeout=1.0, unix=True)
        theirs.sendall(sent)
        theirs.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionLost, match=why):
            client.clear()
        assert client.closed
        with pytest.raises(ConnectionLost, match="closed"):
            client.clear()
        # What the client sent was one well-formed request.
        (length,) = wire.HEADER.unpack(theirs.recv(4))
        assert msgpack.unpackb(theirs.recv(length)) == {"id": 1, "body": "clear"}


def test_a_retrieve_answered_for_other_chunks_is_connection_lost():
    # Two chunks asked for, none copied by the daemon's count: the blocks may not hold them.
    ours, theirs = socket.socketpair()
    with theirs:
        client = Client(ours, timeout=1.0, unix=True)
        theirs.sendall(_reply_frame({"id": 1, "body": {"retrieved": {"chunks": 0, "bytes": 0}}}))
        with pytest.raises(ConnectionLost, match="does not answer"):
            client.retrieve(7, 0, [(1, [0]), (2, [1])])
        assert client.closed


def test_bad_frame_closes_the_client_and_other_errors_do_not():
    ours, theirs = socket.socketpair()
    with theirs:
        client = Client(ours, timeout=1.0, unix=True)
        error = {"error": {"code": "unknown_lookup", "message": "no lookup 5"}}
        theirs.sendall(_reply_frame({"id": 1, "body": error}))
        with pytest.raises(UnknownLookup, match="no lookup 5"):
            client.query(5)
        assert not client.closed
        bad = {"error": {"code": "bad_frame", "message": "malformed"}}
        theirs.sendall(_reply_frame({"id": 0, "body": bad}))
        with pytest.raises(BadFrame):
            client.query(5)
        assert client.closed


#: ``{"id": 1, "body": `` and then the body's bytes.
_REPLY_HEAD = b"\x82\xa2id\x01\xa4body"


def _cleared_with(extra: object) -> bytes:
    """A ``clear``'s reply frame with an unknown field, which a client ignores within limits."""
    return _reply_frame({"id": 1, "body": {"cleared": {"removed": [1, 2, 3], "x": extra}}})


def _raw_frame(body: bytes) -> bytes:
    return wire.HEADER.pack(len(body)) + body


#: Frames no daemon sends, and what the client says of each.
HOSTILE = {
    "longer than the limit": (
        wire.HEADER.pack(wire.MAX_REPLY_BYTES + 1) + bytes(1 << 20),
        f"a frame of {wire.MAX_REPLY_BYTES + 1} bytes",
    ),
    "4 GiB long": (wire.HEADER.pack(2**32 - 1) + b"\x81", "a frame of 4294967295 bytes"),
    "a list of 2**31 items": (
        _raw_frame(_REPLY_HEAD + b"\xdd" + struct.pack(">I", 2**31)),
        "list of 2147483648 items",
    ),
    "a map of 2**31 keys": (
        _raw_frame(_REPLY_HEAD + b"\xdf" + struct.pack(">I", 2**31)),
        "map of 2147483648 keys",
    ),
    "nested 1,000 deep": (
        _raw_frame(_REPLY_HEAD + b"\x91" * 1000 + b"\xc0"),
        "nested deeper than 32",
    ),
    "nested 1,000,000 deep": (
        _raw_frame(_REPLY_HEAD + b"\x91" * 1_000_000 + b"\xc0"),
        "nested deeper than 32",
    ),
    "a bin of 4 GiB": (_raw_frame(_REPLY_HEAD + b"\xc6\xff\xff\xff\xff"), "bin of 4294967295"),
    "a bin of 4 MiB": (_cleared_with(bytes(4 << 20)), "bin of 4194304 bytes"),
    "a million empty lists": (_cleared_with([[[]] * 250_000] * 4), "values in a frame"),
    "cut inside a value": (
        _raw_frame(msgpack.packb({"id": 1, "body": {"cleared": {"removed": [1, 2]}}})[:-1]),
        "end inside a value",
    ),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_reply_is_bad_reply_at_once_in_bounded_memory_and_closes_the_client(
    name: str,
) -> None:
    frame, why = HOSTILE[name]
    ours, theirs = socket.socketpair()
    with theirs:
        client = Client(ours, timeout=5.0, unix=True)

        def send() -> None:
            # A frame longer than the socket's buffer: the client closes before it is all read.
            with contextlib.suppress(OSError):
                theirs.sendall(frame)

        sender = threading.Thread(target=send)
        sender.start()
        tracemalloc.start()
        try:
            started = time.monotonic()
            with pytest.raises(BadReply, match=f"bad reply: .*{why}"):
                client.clear()
            took = time.monotonic() - started
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert took < 2.0, f"{took:.1f} s"
        # The frame, read once, and little else: nothing built from what it announces.
        assert peak < min(len(frame), wire.MAX_REPLY_BYTES) + (1 << 20), f"{peak} bytes"
        assert client.closed
        with pytest.raises(ConnectionLost, match="closed"):
            client.clear()
        # The daemon's end sees one request and then the connection closed: nothing of the bad
        # frame can be read as a later call's reply.
        (length,) = wire.HEADER.unpack(theirs.recv(4))
        assert msgpack.unpackb(theirs.recv(length)) == {"id": 1, "body": "clear"}
        theirs.settimeout(5.0)
        with contextlib.suppress(ConnectionResetError):  # closed with the frame's rest unread
            assert theirs.recv(1) == b""
        sender.join(5.0)
        assert not sender.is_alive()


def test_a_frame_cut_short_is_connection_lost_within_the_deadline() -> None:
    # A daemon that stops inside a reply and keeps the connection open: the deadline ends it.
    ours, theirs = socket.socketpair()
    with theirs:
        client = Client(ours, timeout=0.3, unix=True)
        theirs.sendall(wire.HEADER.pack(100) + b"\x81")
        started = time.monotonic()
        with pytest.raises(ConnectionLost, match="deadline"):
            client.clear()
        assert time.monotonic() - started < 2.0
        assert client.closed
        with pytest.raises(ConnectionLost, match="closed"):
            client.clear()


def test_the_largest_status_a_daemon_sends_is_read_whole() -> None:
    # A status of as many sessions as the daemon serves by default (server.max_connections).
    sessions = [
        {
            "session": 2**40 + i,
            "role": "worker",
            "rank": i % 8,
            "tp_size": 8,
            "open_lookups": 3,
            "joined_lookups": 0,
        }
        for i in range(1024)
    ]
    status = {"tiers": [], "hit_tokens": 0, "sessions": sessions}
    ours, theirs = socket.socketpair()
    with theirs:
        client = Client(ours, timeout=5.0, unix=True)
        theirs.sendall(_reply_frame({"id": 1, "body": {"status": status}}))
        assert client.status()["sessions"] == sessions
        assert not client.closed


def test_a_deferred_lookup_nobody_starts_is_over_at_its_deadline(tierkv_bin, tmp_path):
    """Deferred, and never queried or waited on within ``l1.lease_ttl``: the client's timing, so
    ``unknown_lookup`` saying why (it was ``internal``, counted as the daemon's failure)."""
    daemon = Daemon(
        tierkv_bin, tmp_path, make_config=lambda s, d, e: config(s, d, e, lease_ttl="2s")
    )
    try:
        client = connect(daemon)
        # Nothing of it in L1: not complete at once, so nothing starts until it is asked.
        started = client.lookup(0, prefix_hashes(prompt(12, 2), CHUNK_TOKENS), defer_prefetch=True)
        assert started.outcome is None
        # Failed at its deadline (2 s), and kept to say why for one more lease time.
        time.sleep(2.8)
        with pytest.raises(UnknownLookup, match="not started"):
            client.query(started.lookup)
    finally:
        daemon.stop()


def test_a_socket_another_user_listens_on_is_refused_before_anything_is_sent() -> None:
    """Anyone may bind the default socket's path in /tmp before the daemon: the client must not
    send such a listener its hello, let alone the KV memory it registers."""
    with other_users_listener() as (path, listener):
        # Trusting some other user changes nothing.
        with pytest.raises(UntrustedDaemon) as refused:
            Client.connect(path, worker_hello(), daemon_uids=[1000])
        said, _ = listener.communicate(timeout=10)
    assert listener.returncode == 0
    assert said.split() == ["0"], "the client sent something to another user's listener"
    error = refused.value
    assert isinstance(error, ConnectionLost)
    assert (error.path, error.uid) == (path, OTHER_UID)
    for words in (path, f"uid {OTHER_UID}", f"daemon_uids=[{OTHER_UID}]"):
        assert words in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), again.path, again.uid, str(again)) == (
        UntrustedDaemon,
        path,
        OTHER_UID,
        str(error),
    )


def test_a_daemon_of_a_trusted_user_serves_the_session(tierkv_bin) -> None:
    """A daemon run as another user on purpose: refused until its uid is trusted, then a session
    like any other, its KV memory registered and used."""
    with other_users_dir() as where:
        # A copy that user can run wherever the checkout lies (under /root, say).
        binary = Path(shutil.copy(tierkv_bin, where / "tierkv"))
        binary.chmod(0o755)
        daemon = Daemon(binary, where, user=OTHER_UID)
        try:
            with pytest.raises(UntrustedDaemon, match=f"uid {OTHER_UID}"):
                Client.connect(str(daemon.socket), worker_hello())
            with Client.connect(
                str(daemon.socket), worker_hello(), daemon_uids=[OTHER_UID]
            ) as client:
                buf = SharedBuffer(block_bytes=CHUNK_BYTES, blocks=1)
                fill(buf.block(0), 7)
                buffer = client.register_buffer(buf)
                chunks = prefix_hashes(prompt(31, 1), CHUNK_TOKENS)
                assert client.store(0, buffer, [(chunks[0], 0)]).stored == 1
        finally:
            daemon.stop()


def test_daemon_uids_must_be_user_ids() -> None:
    for bad in ("1000", [-1], [True], [1 << 32], 1000):
        with pytest.raises((TypeError, ValueError)):
            Client.connect("/nonexistent/tierkv.sock", worker_hello(), daemon_uids=bad)


def test_a_deadline_longer_than_poll_can_wait_is_waited_for_in_parts(daemon):
    # poll takes at most 2^31-1 ms (~24.8 days); a caller who means "no deadline" by a huge
    # number must get its call, not an OverflowError that closes the client.
    client = connect(daemon, timeout=3e6)
    try:
        assert client.status() is not None
        assert not client.closed
    finally:
        client.close()


def test_a_forked_child_that_closes_an_inherited_client_leaves_the_parents_calls_alone(daemon):
    # The eventfd that wakes a call in flight survives fork. A child closing its copy of the
    # client must not signal it: never drained, it would stay readable, and every later call of
    # the parent's would spin on it.
    client = connect(daemon)
    try:
        pid = os.fork()
        if pid == 0:
            try:
                client.close()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        wake = client._wake.fd  # noqa: SLF001
        assert select.select([wake], [], [], 0)[0] == [], "the child's close woke the parent"
        assert client.status() is not None
    finally:
        client.close()
