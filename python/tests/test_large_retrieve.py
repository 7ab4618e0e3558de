"""Large retrieves: every byte lands where it was asked, and a hit held below L1 takes a bounded
amount of the daemon's memory."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import pytest
from daemon import Daemon, config

from tierkv import Client, SharedBuffer, prefix_hashes, wire

MIB = 1 << 20


def test_a_large_retrieve_lands_every_chunk_in_its_blocks(tierkv_bin, tmp_path) -> None:
    make = partial(config, l1="64MiB", slot="1MiB", l2="64MiB")
    daemon = Daemon(tierkv_bin, tmp_path, make_config=make)
    try:
        hello = wire.hello(namespaces=[("m", "")], chunk_bytes=MIB, chunk_tokens=16)
        with Client.connect(str(daemon.socket), hello) as client:
            buf = SharedBuffer(MIB, 48)
            buffer = client.register_buffer(buf)
            chunks = prefix_hashes(list(range(3, 3 + 16 * 24)), 16)  # 24 chunks: 24 MiB
            for i in range(24):
                buf.block(i)[:] = bytes([i + 1]) * MIB
            assert client.store(0, buffer, [(h, i) for i, h in enumerate(chunks)]).stored == 24
            started = client.lookup(0, chunks)
            assert started.outcome is not None and started.outcome.hit_chunks == 24
            targets = random.Random(7).sample(range(24, 48), 24)
            got = client.retrieve(started.lookup, buffer, list(zip(chunks, targets, strict=True)))
            assert got.bytes == 24 * MIB
            for i, block in enumerate(targets):
                assert bytes(buf.block(block)) == bytes([i + 1]) * MIB, f"chunk {i}"
            # Two chunks into one block (the client's own mistake) take the sequential path: the
            # later one wins, and nothing else is touched.
            again = client.lookup(0, chunks[:2])
            client.retrieve(again.lookup, buffer, [(chunks[0], 47), (chunks[1], 47)])
            assert bytes(buf.block(47)) == bytes([2]) * MIB
    finally:
        daemon.stop()


def _status_bytes(pid: int, field: str) -> int:
    """A ``kB`` figure of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_a_hit_held_below_l1_is_read_into_memory_a_window_at_a_time(tierkv_bin, tmp_path) -> None:
    # L1 of 8 chunks of 1 MiB: the 256 chunks stored pass down to L2, and a lookup holds its hit
    # there. A retrieve of all of it must not read 256 MiB into the daemon's memory at once.
    chunks_n = 256
    make = partial(config, l1="8MiB", slot="1MiB", l2="512MiB")
    daemon = Daemon(tierkv_bin, tmp_path, make_config=make)
    try:
        hello = wire.hello(namespaces=[("m", "")], chunk_bytes=MIB, chunk_tokens=16)
        with Client.connect(str(daemon.socket), hello) as client:
            buf = SharedBuffer(MIB, chunks_n)
            for i in range(chunks_n):
                buf.block(i)[:] = bytes([i % 251 + 1]) * MIB  # every page resident before it maps
            buffer = client.register_buffer(buf)
            chunks = prefix_hashes(list(range(5, 5 + 16 * chunks_n)), 16)
            stored = client.store(0, buffer, [(h, i) for i, h in enumerate(chunks)]).stored
            assert stored == chunks_n
            started = client.lookup(0, chunks)
            outcome = started.outcome or client.wait(started.lookup, 10.0)
            assert outcome.hit_chunks == chunks_n
            for i in range(chunks_n):
                buf.block(i)[:] = bytes(MIB)
            pid = daemon.proc.pid
            try:
                Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak RSS starts again here
            except OSError as e:
                pytest.skip(f"cannot reset the daemon's peak RSS (/proc/PID/clear_refs): {e}")
            before = _status_bytes(pid, "VmRSS")
            got = client.retrieve(started.lookup, buffer, [(h, i) for i, h in enumerate(chunks)])
            grown = _status_bytes(pid, "VmHWM") - before
            assert got.bytes == chunks_n * MIB
            for i in range(chunks_n):
                assert bytes(buf.block(i)) == bytes([i % 251 + 1]) * MIB, f"chunk {i}"
            # A window is 64 MiB (64 MiB more, measured); all of the hit at once was 248 MiB more
            # (8 of its chunks are in L1).
            assert grown < 128 * MIB, f"the daemon's peak grew {grown / MIB:.0f} MiB"
    finally:
        daemon.stop()
