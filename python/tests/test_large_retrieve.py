"""A retrieve large enough to be split over threads scatters every byte where it was asked."""

from __future__ import annotations

import random
from functools import partial

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
