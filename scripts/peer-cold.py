#!/usr/bin/env python3
"""Runs the peer's bench.py (LMCache 0.5.6) with one change: in the prefetch section, the page
cache is dropped after every trial's cleanup (outside the timed region), so LMCache's filesystem
adapters read from the disk, not from memory, as tierkv's O_DIRECT disk tier does. Needs root
(writes /proc/sys/vm/drop_caches). Arguments are bench.py's.

Usage: PEER/venv/bin/python scripts/peer-cold.py PEER_DIR [bench.py arguments]
"""

import os
import sys

peer_dir = sys.argv.pop(1)
sys.path.insert(0, peer_dir)
import bench  # noqa: E402  (the peer's module, unmodified)

_cold = False
_delete = bench.StorageManager.delete_l1_keys


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def delete_then_drop(self, *args, **kwargs):
    result = _delete(self, *args, **kwargs)
    if _cold:
        drop_page_cache()
    return result


_prefetch = bench.bench_prefetch


def cold_prefetch(args, out, kind, chunk):
    global _cold
    _cold = kind.startswith("fs")
    try:
        _prefetch(args, out, kind, chunk)
    finally:
        _cold = False


bench.StorageManager.delete_l1_keys = delete_then_drop
bench.bench_prefetch = cold_prefetch
drop_page_cache()  # fails here, before any work, without the right to drop it
bench.main()
