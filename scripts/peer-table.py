#!/usr/bin/env python3
"""One table of LMCache 0.5.6 (the peer) and tierkv on the same shapes, from the JSON files of
one scripts/peer-bench run: the peer's bench.py (page cache warm, as it runs), the peer's
prefetch again with the page cache dropped before every trial (scripts/peer-cold.py), and
tierkv's `cargo bench -p tierkv-bench --bench peer`.

Usage: python3 scripts/peer-table.py PEER.json PEER_COLD.json TIERKV.json [--markdown]
"""

import json
import sys

args = [a for a in sys.argv[1:] if not a.startswith("--")]
markdown = "--markdown" in sys.argv


def load(path):
    with open(path) as f:
        return json.load(f)


peer, cold, tk = (load(p) for p in args)
lim = tk["_limits"]


def get(d, row, measure):
    v = d.get(row, {}).get(measure)
    return v if isinstance(v, (int, float)) else None


def fmt(v, unit):
    if v is None:
        return "n/a"
    if unit == "GB/s":
        return f"{v:.2f} GB/s"
    if unit == "ms":
        return f"{v:.1f} ms"
    if v >= 1e6:
        return f"{v / 1e6:.2f} M/s"
    return f"{v / 1e3:.1f} k/s"


rows = []  # (shape, peer figure, tierkv figure, ratio tierkv over peer, limit, tierkv / limit)


def add(shape, prow, pd, trow, measure, unit, limit=None, higher_better=True):
    p, t = get(pd, prow, measure), get(tk, trow, measure)
    ratio = None
    if p and t:
        ratio = t / p if higher_better else p / t
    lname, lval = limit if limit else ("", None)
    of_limit = None
    if lval:
        fig = get(tk, trow, "GBps")
        of_limit = fig / lval if fig else None
    rows.append((shape, fmt(p, unit), fmt(t, unit), ratio, lname, lval, of_limit))


for kib, name in ((256, "256 KiB"), (2048, "2 MiB"), (16384, "16 MiB")):
    mem = lim.get(f"memcpy_{kib}KiB_GBps")
    for b in (1, 16):
        add(
            f"store {name}, {b} key{'s' if b > 1 else ''} a call",
            f"store_{kib}KiB_b{b}",
            peer,
            f"store_{kib}KiB_b{b}",
            "GBps",
            "GB/s",
            (f"memcpy {name}", mem),
        )
mem2 = lim.get("memcpy_2048KiB_GBps")
add(
    "store 2 MiB, 16 keys a call, first write of fresh L1 (tierkv only)",
    "-",
    peer,
    "store_2048KiB_b16_first_write",
    "GBps",
    "GB/s",
    ("memcpy 2 MiB", mem2),
)
add(
    "  the same with l1.prefault (tierkv only)",
    "-",
    peer,
    "store_2048KiB_b16_first_write_prefault",
    "GBps",
    "GB/s",
    ("memcpy 2 MiB", mem2),
)
add(
    "L1 read lock + release, 1 key at a time",
    "l1_read_lock_unlock_single",
    peer,
    "l1_read_lock_unlock_single",
    "pairs_per_s",
    "/s",
)
add(
    "L1 read lock + release, 1,000 at a time",
    "l1_read_lock_unlock_batch1000",
    peer,
    "l1_read_lock_unlock_batch1000",
    "keys_per_s",
    "/s",
)
add(
    "L1 lock for 4 readers + 4 releases, 1 key",
    "l1_read_lock4_finish4_single",
    peer,
    "l1_read_lock4_finish4_single",
    "keys_per_s",
    "/s",
)
add(
    "lookup path (L1 hits), 1 key at a time",
    "sm_lookup_lock_finish_single",
    peer,
    "sm_lookup_lock_finish_single",
    "keys_per_s",
    "/s",
)
add(
    "lookup path (L1 hits), 1,000 at a time",
    "sm_lookup_lock_finish_batch1000",
    peer,
    "sm_lookup_lock_finish_batch1000",
    "keys_per_s",
    "/s",
)
n = next((k.rsplit("_x", 1)[1] for k in tk if k.startswith("prefetch_l2_256KiB_x")), "1000")
for kib, size in ((4, "4 KiB"), (256, "256 KiB")):
    # tierkv's L2 splits the lookup's loads over its two workers: the bound is two threads' memcpy.
    mem = lim.get("memcpy_256KiB_x2_GBps")
    add(
        f"prefetch {n} x {size} from L2 (peer: mock), 4 readers, round trip",
        f"prefetch_mock_{kib}KiB_x{n}",
        peer,
        f"prefetch_l2_{kib}KiB_x{n}",
        "ms_round_trip",
        "ms",
        ("memcpy 256 KiB x 2 threads", mem) if kib == 256 else None,
        higher_better=False,
    )
for kib, size in ((4, "4 KiB"), (256, "256 KiB")):
    disk = lim.get(f"disk_read_{kib}KiB_x4_GBps")
    for kind, src, note in (
        ("fs_odirect", peer, "O_DIRECT"),
        ("fs_native", cold, "cold"),
        ("fs", cold, "cold"),
        ("fs_native", peer, "page cache warm"),
    ):
        add(
            f"prefetch {n} x {size} from disk, cold (peer: {kind}, {note})",
            f"prefetch_{kind}_{kib}KiB_x{n}",
            src,
            f"prefetch_disk_{kib}KiB_x{n}",
            "ms_round_trip",
            "ms",
            (f"disk read {size} x4", disk),
            higher_better=False,
        )

limits = [
    ("memcpy 256 KiB (one core)", lim.get("memcpy_256KiB_GBps")),
    ("memcpy 256 KiB (2 threads at once)", lim.get("memcpy_256KiB_x2_GBps")),
    ("memcpy 2 MiB (one core)", lim.get("memcpy_2048KiB_GBps")),
    ("memcpy 16 MiB (one core)", lim.get("memcpy_16384KiB_GBps")),
    ("disk O_DIRECT read, 4 KiB x 4 in flight", lim.get("disk_read_4KiB_x4_GBps")),
    ("disk O_DIRECT read, 256 KiB x 4 in flight", lim.get("disk_read_256KiB_x4_GBps")),
    ("disk O_DIRECT sequential write, 2 MiB", lim.get("disk_write_2048KiB_GBps")),
]


def r(x):
    return f"{x:.2f}" if x is not None else ""


if markdown:
    print("| shape | LMCache 0.5.6 | tierkv | tierkv / LMCache | tierkv / limit (same run) |")
    print("|---|---:|---:|---:|---:|")
    for shape, p, t, ratio, lname, lval, of in rows:
        lim_cell = f"{r(of)} of {lname} {lval:.2f} GB/s" if of is not None else ""
        cell = f"**{r(ratio)}x**" if ratio is not None else ""
        print(f"| {shape} | {p} | {t} | {cell} | {lim_cell} |")
    print()
    print("| limit, same run | GB/s |")
    print("|---|---:|")
    for name, v in limits:
        print(f"| {name} | {v:.2f} |" if v else f"| {name} | n/a |")
else:
    print(f"{'shape':66} {'LMCache':>12} {'tierkv':>12} {'ratio':>7}  tierkv/limit")
    for shape, p, t, ratio, lname, lval, of in rows:
        lim_cell = f"{r(of)} of {lname} ({lval:.2f} GB/s)" if of is not None else ""
        cell = f"{r(ratio)}x" if ratio is not None else ""
        print(f"{shape:66} {p:>12} {t:>12} {cell:>7}  {lim_cell}")
    print()
    for name, v in limits:
        print(f"limit: {name:50} {v:.2f} GB/s" if v else f"limit: {name}: n/a")
    print(
        "ratio: tierkv over LMCache (throughput), LMCache over tierkv (times); >= 2 is the target"
    )
