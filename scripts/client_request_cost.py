#!/usr/bin/env python3
"""What one request costs through the Python client, apart from its copies.

Starts ``tierkv serve`` (emulated L1, 4 KiB chunks, so the copies take next to nothing), stores
``N`` chunks, then times, over 300 rounds (medians): a store of the ``N`` chunks, a lookup of
them (with its wait when it did not complete at once), a retrieve of them, and the client's
encoding of that retrieve alone. The limit in the same run is the round trip of a one-chunk
retrieve: what a request costs before it carries anything.

    PYTHONPATH=python/src python3 scripts/client_request_cost.py target/release/tierkv [N ...]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tierkv import Client, SharedBuffer, wire

CHUNK = 4096
ROUNDS = 300

CONFIG = """
[server]
socket = "{socket}"
[metrics]
enabled = false
[l1]
device = "emulated"
capacity = "64MiB"
slot = "4KiB"
[l2]
capacity = "8MiB"
memory = "plain"
[disk]
dir = "{disk}"
capacity = "32MiB"
segment = "4MiB"
fsync = "never"
"""


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def measure(client: Client, buffer: int, n: int, first_id: int) -> dict[str, float]:
    """Median microseconds of each step for requests of ``n`` chunks."""
    ids = [first_id + i for i in range(n)]
    chunks = [(chunk, i) for i, chunk in enumerate(ids)]
    times: dict[str, list[float]] = {
        "store": [],
        "lookup": [],
        "retrieve": [],
        "encode": [],
    }
    for _ in range(ROUNDS):
        start = time.perf_counter()
        client.store(0, buffer, chunks)
        stored = time.perf_counter()
        started = client.lookup(0, ids)
        if started.outcome is None:
            client.wait(started.lookup, 5.0)
        looked = time.perf_counter()
        client.retrieve(started.lookup, buffer, chunks)
        retrieved = time.perf_counter()
        wire.encode_frame(1, wire.retrieve(started.lookup, buffer, chunks))
        encoded = time.perf_counter()
        times["store"].append(stored - start)
        times["lookup"].append(looked - stored)
        times["retrieve"].append(retrieved - looked)
        times["encode"].append(encoded - retrieved)
    return {step: median_us(samples) for step, samples in times.items()}


def main() -> int:
    binary = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("target/release/tierkv")
    counts = [int(a) for a in sys.argv[2:]] or [16, 128, 512]
    with tempfile.TemporaryDirectory(prefix="tierkv-cost-") as work:
        socket_path, config = Path(work) / "s", Path(work) / "t.toml"
        config.write_text(CONFIG.format(socket=socket_path, disk=Path(work) / "disk"))
        daemon = subprocess.Popen(
            [str(binary), "serve", "--config", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while not socket_path.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            hello = wire.hello(namespaces=[("m", "")], chunk_bytes=CHUNK, chunk_tokens=16)
            with Client.connect(str(socket_path), hello) as client:
                shared = SharedBuffer(CHUNK, max(counts))
                buffer = client.register_buffer(shared)
                floor = measure(client, buffer, 1, 1)["retrieve"]
                print(f"limit: a one-chunk retrieve's round trip, {floor:.0f} us")
                print(
                    f"{'chunks':>6} {'store':>8} {'lookup':>8} {'retrieve':>9} "
                    f"{'encode':>8} {'retrieve / limit':>17}  (us, medians of {ROUNDS})"
                )
                for i, n in enumerate(counts):
                    m = measure(client, buffer, n, 1_000_000 * (i + 1))
                    print(
                        f"{n:>6} {m['store']:>8.0f} {m['lookup']:>8.0f} {m['retrieve']:>9.0f} "
                        f"{m['encode']:>8.0f} {m['retrieve'] / floor:>17.2f}"
                    )
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
