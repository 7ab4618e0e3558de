#!/usr/bin/env python3
"""The GPU check of issue 14: raw copy limits and tierkv's GPU data path, measured in one run.

Run through ``scripts/gpu-check.sh`` (which sets ``PYTHONPATH`` to this checkout's
``python/src``). Needs python3 with torch (CUDA) and msgpack; nothing is fetched.

1. Prints the device and the driver.
2. Raw limits, timed with CUDA events: pinned H2D and D2H, D2D, and the pieces of a fragmented
   chunk (8 blocks x 32 layers x K/V of Llama-3-8B's paged KV, 32 KiB each) copied one
   ``copy_`` per piece and, where the driver has it, with one ``cuMemcpyBatchAsync``.
3. Unless ``--raw-only``: starts ``tierkv serve`` with ``l1.device = "cuda"``, allocates paged
   KV tensors shaped like Llama-3-8B's (32 layers, 8 KV heads, head dim 128, 16-token blocks,
   bf16), registers them by CUDA IPC handles, stores and retrieves 2 MiB contiguous chunks and
   16 MiB fragmented chunks with every byte verified (the blocks are overwritten before each
   retrieve, so equal bytes prove the load), and times engine->L1, L1->L2 and L2->L1->engine.
   These parts run write-through (a store's flush is its L1->L2 move); one more runs the
   default store policy, the cascade, where a store into a full L1 moves L1's victims to
   pinned L2 on the writer's path, and loads the first round back from L2.

The daemon inherits the environment: ``TIERKV_NO_BATCH_COPY=1`` makes it copy one
``cuMemcpyAsync`` per piece instead of ``cuMemcpyBatchAsync``, to compare the two.

Exit status: 0 when every byte matched (the targets are printed, not enforced); 2 when there is
no CUDA device; 1 on any other failure (a byte differs, a step is unsupported, the daemon fails).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

NO_DEVICE = 2
FAILED = 1

# Llama-3-8B's paged KV in vLLM's GPU layout: per layer [2, blocks, 16, 8, 128] bf16.
LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
BLOCK_TOKENS = 16
DTYPE_BYTES = 2
PIECE_BYTES = BLOCK_TOKENS * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 32 KiB: one block of K or V
FRAG_BLOCKS = 8  # blocks per fragmented chunk
FRAG_CHUNK = FRAG_BLOCKS * LAYERS * 2 * PIECE_BYTES  # 16 MiB, 512 pieces
CONTIG_CHUNK = 2 << 20

# Issue 14's targets.
TARGET_HOST = 0.8  # device<->host moves against the raw pinned copy
TARGET_D2D = 0.7  # device-to-device against raw D2D
TARGET_FRAG = 0.8  # fragmented chunks against raw batched copies of the same pieces


#: Failures that do not stop the run (the check still exits 1 at the end).
PROBLEMS: list[str] = []


class CheckFailed(Exception):
    """A step failed: the check exits 1 with this message."""


def fail(message: str) -> None:
    raise CheckFailed(message)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def tierkv_importable() -> None:
    """Lets ``import tierkv`` work where ``xxhash`` is missing (a GPU machine has torch and
    msgpack, maybe nothing else): the check names chunks by ids of its own and hashes nothing,
    so a stand-in is enough. It answers 0 (``tierkv.hashing`` hashes its root at import), so any
    chunk hash made with it is wrong: nothing here makes one."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        import types

        stub = types.ModuleType("xxhash")
        stub.xxh3_128_intdigest = lambda *_args, **_kw: 0
        sys.modules["xxhash"] = stub


def load_torch():
    """torch with a usable CUDA device, or exit NO_DEVICE with the reason."""
    try:
        import torch
    except ImportError as e:
        print(f"gpu-check: no CUDA device: torch is not installed ({e})", file=sys.stderr)
        sys.exit(NO_DEVICE)
    if not torch.cuda.is_available():
        build = torch.version.cuda or "a CPU-only build"
        print(
            f"gpu-check: no CUDA device: torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, CUDA {build})",
            file=sys.stderr,
        )
        sys.exit(NO_DEVICE)
    return torch


# ---------------------------------------------------------------------------------------------
# The driver, through ctypes (for its version and cuMemcpyBatchAsync)
# ---------------------------------------------------------------------------------------------


def libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def driver_version(cuda) -> int | None:
    if cuda is None:
        return None
    v = ctypes.c_int(0)
    if cuda.cuDriverGetVersion(ctypes.byref(v)) != 0:
        return None
    return v.value


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1


class BatchCopy:
    """``cuMemcpyBatchAsync``, resolved from the loaded driver for its version: CUDA 12.8-12.9
    take a ``failIdx`` argument that CUDA 13 dropped."""

    def __init__(self, cuda, version: int):
        if version < 12080:
            raise RuntimeError(f"the driver ({version}) predates cuMemcpyBatchAsync (12.8)")
        get = cuda.cuGetProcAddress_v2
        get.argtypes = [
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_int),
        ]
        pfn = ctypes.c_void_p()
        status = ctypes.c_int(0)
        self.v13 = version >= 13000
        want = 13000 if self.v13 else 12080
        rc = get(b"cuMemcpyBatchAsync", ctypes.byref(pfn), want, 0, ctypes.byref(status))
        if rc != 0 or not pfn.value:
            raise RuntimeError(f"cuGetProcAddress(cuMemcpyBatchAsync, {want}) = {rc}")
        p = ctypes.POINTER
        args = [
            p(ctypes.c_uint64),
            p(ctypes.c_uint64),
            p(ctypes.c_size_t),
            ctypes.c_size_t,
            p(MemcpyAttributes),
            p(ctypes.c_size_t),
            ctypes.c_size_t,
        ]
        if not self.v13:
            args.append(p(ctypes.c_size_t))
        args.append(ctypes.c_void_p)
        self.fn = ctypes.CFUNCTYPE(ctypes.c_int, *args)(pfn.value)
        self.attrs = MemcpyAttributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        self.attr_idx = (ctypes.c_size_t * 1)(0)

    def prepare(self, dsts: list[int], srcs: list[int], size: int):
        n = len(dsts)
        return (
            (ctypes.c_uint64 * n)(*dsts),
            (ctypes.c_uint64 * n)(*srcs),
            (ctypes.c_size_t * n)(*([size] * n)),
            n,
        )

    def __call__(self, prepared, stream: int) -> None:
        d, s, sizes, n = prepared
        fail_idx = ctypes.c_size_t(0)
        extra = [] if self.v13 else [ctypes.byref(fail_idx)]
        rc = self.fn(
            d,
            s,
            sizes,
            n,
            ctypes.byref(self.attrs),
            self.attr_idx,
            1,
            *extra,
            ctypes.c_void_p(stream),
        )
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync returned CUresult {rc}")


# ---------------------------------------------------------------------------------------------
# Raw limits
# ---------------------------------------------------------------------------------------------


def timed(torch, fn, nbytes: int, repeat: int) -> float:
    """Best-of GB/s of ``fn`` (which moves ``nbytes``), timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = max(best, gbps(nbytes, start.elapsed_time(end) / 1e3))
    return best


class Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D``."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


CU_MEMORYTYPE_HOST = 1
CU_MEMORYTYPE_DEVICE = 2


def raw_limits(torch, cuda, args) -> dict[str, float]:
    """Raw copies timed on a stream of their own (``cuMemcpyBatchAsync`` refuses the legacy
    default stream): whole buffers, 2 MiB pieces, and one fragmented chunk's 32 KiB pieces
    copied piece by piece, batched, and as 2D copies (one per block, a row per layer x K/V)."""
    dev = torch.device("cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        return _raw_limits(torch, cuda, args, dev, stream)


def _raw_limits(torch, cuda, args, dev, stream) -> dict[str, float]:
    total = max(args.raw_mib << 20, args.contig_chunks * CONTIG_CHUNK)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    a = torch.empty(total, dtype=torch.uint8, device=dev)
    b = torch.empty(total, dtype=torch.uint8, device=dev)
    r = {}
    r["h2d"] = timed(torch, lambda: a.copy_(pinned, non_blocking=True), total, args.repeat)
    r["d2h"] = timed(torch, lambda: pinned.copy_(a, non_blocking=True), total, args.repeat)
    r["d2d"] = timed(torch, lambda: b.copy_(a, non_blocking=True), total, args.repeat)
    version = driver_version(cuda)
    batch = None
    try:
        if cuda is None or version is None:
            raise RuntimeError("libcuda.so.1 cannot be loaded through ctypes")
        batch = BatchCopy(cuda, version)
    except (RuntimeError, AttributeError) as e:
        print(f"  batched copies: cuMemcpyBatchAsync unavailable ({e})")

    # 2 MiB pieces, as many as the contiguous part stores in one request.
    n = args.contig_chunks
    src2 = a[: n * CONTIG_CHUNK].view(n, CONTIG_CHUNK)
    dst2 = b[: n * CONTIG_CHUNK].view(n, CONTIG_CHUNK)

    def pieces_loop():
        for i in range(n):
            dst2[i].copy_(src2[i], non_blocking=True)

    r["contig_d2d_loop"] = timed(torch, pieces_loop, n * CONTIG_CHUNK, args.repeat)
    if batch is not None:
        prepared = batch.prepare(
            [dst2[i].data_ptr() for i in range(n)],
            [src2[i].data_ptr() for i in range(n)],
            CONTIG_CHUNK,
        )
        r["contig_d2d_batch"] = timed(
            torch,
            lambda: batch(prepared, stream.cuda_stream),
            n * CONTIG_CHUNK,
            args.repeat,
        )
    r["contig_d2d"] = max(r["contig_d2d_loop"], r.get("contig_d2d_batch", 0.0))

    # Fragmented: the 512 pieces of 32 KiB of each of as many chunks as tierkv moves in one
    # request (a quarter of --chunks), each chunk taking every other block of a paged KV. One
    # chunk alone is ~60 us of copying, too short to time steadily.
    per = max(1, args.chunks // 4)
    blocks = max(64, 2 * per * FRAG_BLOCKS)
    kv = torch.empty((LAYERS, 2, blocks, PIECE_BYTES), dtype=torch.uint8, device=dev)
    kv.random_(0, 256)
    chosen = [[2 * (c * FRAG_BLOCKS + j) + 1 for j in range(FRAG_BLOCKS)] for c in range(per)]
    pieces = [
        kv[layer, plane, blk]
        for mine in chosen
        for layer in range(LAYERS)
        for plane in (0, 1)
        for blk in mine
    ]
    frag_bytes = per * FRAG_CHUNK
    want = torch.stack(pieces)
    dst_h = torch.empty((len(pieces), PIECE_BYTES), dtype=torch.uint8, pin_memory=True)
    dst_d = torch.empty((len(pieces), PIECE_BYTES), dtype=torch.uint8, device=dev)

    def loop(dst):
        def run():
            for i, p in enumerate(pieces):
                dst[i].copy_(p, non_blocking=True)

        return run

    def verified(name: str, dst) -> None:
        torch.cuda.synchronize()
        if not torch.equal(dst.to(dev), want):
            # The figure is dropped and the check fails at the end, after the rest ran.
            del r[name]
            PROBLEMS.append(f"{name}: the raw copy moved wrong bytes")
            print(f"  {PROBLEMS[-1]}: its figure is dropped")
        dst.zero_()

    for name, dst in (("frag_d2h", dst_h), ("frag_d2d", dst_d)):
        r[f"{name}_loop"] = timed(torch, loop(dst), frag_bytes, args.repeat)
        verified(f"{name}_loop", dst)
        if batch is not None:
            prepared = batch.prepare(
                [dst[i].data_ptr() for i in range(len(pieces))],
                [p.data_ptr() for p in pieces],
                PIECE_BYTES,
            )
            r[f"{name}_batch"] = timed(
                torch,
                lambda prepared=prepared: batch(prepared, stream.cuda_stream),
                frag_bytes,
                args.repeat,
            )
            verified(f"{name}_batch", dst)
        if cuda is not None:
            copy_2d = cuda.cuMemcpy2DAsync_v2
            copy_2d.argtypes = [ctypes.POINTER(Memcpy2D), ctypes.c_void_p]
            descs = []
            for j, blk in (
                (c * LAYERS * 2 * FRAG_BLOCKS + j, blk)
                for c, mine in enumerate(chosen)
                for j, blk in enumerate(mine)
            ):
                d = Memcpy2D()
                d.srcMemoryType = CU_MEMORYTYPE_DEVICE
                d.srcDevice = kv[0, 0, blk].data_ptr()
                d.srcPitch = blocks * PIECE_BYTES  # from one layer x K/V plane to the next
                if dst.is_cuda:
                    d.dstMemoryType, d.dstDevice = (
                        CU_MEMORYTYPE_DEVICE,
                        dst[j].data_ptr(),
                    )
                else:
                    d.dstMemoryType, d.dstHost = CU_MEMORYTYPE_HOST, dst[j].data_ptr()
                d.dstPitch = FRAG_BLOCKS * PIECE_BYTES
                d.WidthInBytes, d.Height = PIECE_BYTES, LAYERS * 2
                descs.append(d)

            def run_2d(descs=descs, copy_2d=copy_2d):
                for d in descs:
                    rc = copy_2d(ctypes.byref(d), stream.cuda_stream)
                    if rc != 0:
                        raise RuntimeError(f"cuMemcpy2DAsync returned CUresult {rc}")

            try:
                r[f"{name}_2d"] = timed(torch, run_2d, frag_bytes, args.repeat)
                verified(f"{name}_2d", dst)
            except RuntimeError as e:
                print(f"  2D copies: {e}")
        r[name] = max(r.get(f"{name}_{way}", 0.0) for way in ("loop", "batch", "2d"))
    return r


def best_way(r: dict[str, float], name: str) -> str:
    """Which raw way of moving the pieces gave ``r[name]``."""
    ways = {"loop": "copy_ per piece", "batch": "batched", "2d": "2D"}
    for way, what in ways.items():
        if r.get(f"{name}_{way}") == r[name]:
            return what
    return "raw"


def print_raw(r: dict[str, float]) -> None:
    print("raw limits (GB/s, best of runs, CUDA events):")
    for name, what in [
        ("h2d", "pinned host -> device"),
        ("d2h", "device -> pinned host"),
        ("d2d", "device -> device"),
        ("contig_d2d_loop", "2 MiB pieces -> device, one copy_ each"),
        ("contig_d2d_batch", "2 MiB pieces -> device, cuMemcpyBatchAsync"),
        (
            "frag_d2h_loop",
            "a request of fragmented chunks -> pinned host, one copy_ per 32 KiB piece",
        ),
        (
            "frag_d2h_batch",
            "a request of fragmented chunks -> pinned host, cuMemcpyBatchAsync",
        ),
        (
            "frag_d2h_2d",
            "a request of fragmented chunks -> pinned host, cuMemcpy2DAsync per block",
        ),
        (
            "frag_d2d_loop",
            "a request of fragmented chunks -> device, one copy_ per 32 KiB piece",
        ),
        (
            "frag_d2d_batch",
            "a request of fragmented chunks -> device, cuMemcpyBatchAsync",
        ),
        (
            "frag_d2d_2d",
            "a request of fragmented chunks -> device, cuMemcpy2DAsync per block",
        ),
    ]:
        if name in r:
            print(f"  {what:<64} {r[name]:8.2f}")


# ---------------------------------------------------------------------------------------------
# The daemon
# ---------------------------------------------------------------------------------------------


class Daemon:
    def __init__(
        self,
        binary: Path,
        workdir: Path,
        l1: str,
        l2: str,
        slot: str,
        gpu: bool,
        store_policy: str = "write_through",
    ):
        self.socket = workdir / "s"
        self.log = workdir / "daemon.log"
        self.config = workdir / "tierkv.toml"
        self.config.write_text(f"""
[server]
socket = "{self.socket}"
max_leased_per_session = "{l1}"

[metrics]
enabled = false

[l1]
device = "{"cuda" if gpu else "emulated"}"
cuda_device = 0
capacity = "{l1}"
slot = "{slot}"
lease_ttl = "60s"

[l2]
capacity = "{l2}"
memory = "{"pinned" if gpu else "plain"}"
workers = 4

[disk]
enabled = false

[storage]
# Write-through unless a part asks for the cascade: a store's flush is then its L1 -> L2 move,
# which the check times.
store_policy = "{store_policy}"
""")
        env = dict(os.environ, TIERKV_LOG=os.environ.get("TIERKV_LOG", "warn"))
        try:
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [str(binary), "serve", "--config", str(self.config)],
                    cwd=workdir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as e:
            fail(f"cannot start {binary}: {e}")
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                fail(
                    f"the daemon exited ({self.proc.returncode}) before listening:\n"
                    + self.log.read_text(errors="replace")
                )
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(str(self.socket))
                    return
                except OSError:
                    pass
            if time.monotonic() > deadline:
                self.stop()
                fail("the daemon did not listen within 60 s:\n" + self.log.read_text())
            time.sleep(0.05)

    def cpu_seconds(self) -> float | None:
        """CPU time the daemon has used so far (user + system), from /proc."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return None
        fields = stat.rsplit(")", 1)[1].split()
        # Fields 14 and 15 of stat(5), utime and stime, are the 12th and 13th after the name.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
        return ""


def pci_bus_id(torch) -> str:
    """Device 0's PCI bus id, as the daemon's ``cuDeviceGetByPCIBusId`` takes it."""
    cuda = libcuda()
    if cuda is not None:
        dev = ctypes.c_int(0)
        buf = ctypes.create_string_buffer(32)
        if (
            cuda.cuInit(0) == 0
            and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
            and cuda.cuDeviceGetPCIBusId(buf, 32, dev) == 0
        ):
            return buf.value.decode()
    p = torch.cuda.get_device_properties(0)
    try:
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except AttributeError:
        fail("cannot tell device 0's PCI bus id (no libcuda through ctypes, an old torch)")


def ipc_region(torch, tensor):
    """The CUDA IPC region holding ``tensor`` and the byte offset of the tensor in it.

    Through the driver (``tierkv.cuda.ipc_region``: ``cuMemGetAddressRange`` for the
    allocation, ``cuIpcGetMemHandle`` of its base) where ctypes can load it, else torch's
    ``_share_cuda_`` (whose handle is the bare 64 bytes in older torch, and ``version, 'c',
    64 bytes`` since torch 2.3)."""
    from tierkv.cuda import CudaIpcError, CudaUnavailable
    from tierkv.cuda import ipc_region as export
    from tierkv.wire import CudaIpcRegion

    try:
        return export(tensor.data_ptr(), 0)
    except CudaUnavailable:
        pass  # torch's own export, below
    except CudaIpcError as e:
        fail(str(e))
    device = pci_bus_id(torch)
    storage = tensor.untyped_storage()
    try:
        shared = storage._share_cuda_()
    except RuntimeError as e:
        fail(
            f"cuIpcGetMemHandle failed for the KV tensor (expandable segments or a VMM "
            f"allocation cannot be shared by IPC): {e}"
        )
    handle, size, offset = bytes(shared[1]), int(shared[2]), int(shared[3])
    if len(handle) == 66 and handle[1:2] == b"c":
        handle = handle[2:]
    elif len(handle) != 64:
        fail(f"torch returned a {len(handle)}-byte IPC handle of an unknown format")
    region = CudaIpcRegion(handle=handle, device=device, bytes=offset + size)
    return region, offset + tensor.data_ptr() - storage.data_ptr()


class Memory:
    """The worker's KV memory: device memory exported by CUDA IPC on a GPU; on CPU (the dry run,
    which tests this script without a GPU) a sealed memfd, registered as a memfd region."""

    def __init__(self, torch, gpu: bool):
        self.torch = torch
        self.gpu = gpu
        self._keep: list = []

    def alloc(self, nbytes: int):
        """A uint8 tensor of ``nbytes``, its ``(region, fd)`` and its offset in the region."""
        torch = self.torch
        if self.gpu:
            t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            region, offset = ipc_region(torch, t)
            return t, (region, None), offset
        import mmap

        from tierkv.shm import sealed_memfd
        from tierkv.wire import MemfdRegion

        fd = sealed_memfd(nbytes, "gpu-check")
        m = mmap.mmap(fd, nbytes)
        self._keep.append((fd, m))
        t = torch.frombuffer(m, dtype=torch.uint8)
        return t, (MemfdRegion(bytes=nbytes), fd), 0

    def sync(self) -> None:
        if self.gpu:
            self.torch.cuda.synchronize()


class Session:
    """A worker session on one registered buffer."""

    def __init__(self, daemon: Daemon, chunk_bytes: int, regions, layout, label: str):
        from tierkv import Client, wire
        from tierkv.errors import ConnectionLost, DaemonError

        self.client = Client.connect(
            str(daemon.socket),
            wire.hello(namespaces=[f"gpu-check-{label}"], chunk_bytes=chunk_bytes),
            timeout=120.0,
        )
        try:
            self.buffer = self.client.register_kv(regions, layout)
        except (DaemonError, ConnectionLost) as e:
            self.client.close()
            fail(f"register_kv of CUDA IPC regions ({label}) was refused: {e}")

    def store(self, chunks, ready_event: bytes | None = None, timeout: float | None = None) -> None:
        out = self.client.store(0, self.buffer, chunks, ready_event=ready_event, timeout=timeout)
        if out.refused or out.stored + out.present != len(chunks):
            fail(f"store: {out}")

    def load(self, chunks, expect_tier: int | None) -> tuple[float, float, list[int]]:
        """Looks up and retrieves ``chunks``: seconds from lookup to its outcome, seconds of the
        retrieve (its request to its reply), and the outcome's chunks per tier."""
        t0 = time.perf_counter()
        started = self.client.lookup(0, [c for c, _ in chunks])
        outcome = started.outcome or self.client.wait(started.lookup, 60.0)
        t1 = time.perf_counter()
        if outcome.hit_chunks != len(chunks):
            fail(f"lookup hit {outcome.hit_chunks} of {len(chunks)} chunks ({outcome})")
        self.client.retrieve(started.lookup, self.buffer, chunks)
        t2 = time.perf_counter()
        if expect_tier is not None and outcome.per_tier[expect_tier] != len(chunks):
            print(f"  note: chunks came from tiers {outcome.per_tier} (L1, L2, disk, remote)")
        return t1 - t0, t2 - t1, outcome.per_tier

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.end()


@contextlib.contextmanager
def running_daemon(
    args, l1: int, l2: int, slot: int, gpu: bool, store_policy: str = "write_through"
):
    """A daemon of its own for one part of the check, stopped (and its directory removed unless
    ``--keep``) when the part is over; a failure inside carries the log's tail."""
    workdir = Path(tempfile.mkdtemp(prefix="tierkv-gpu-"))
    try:
        daemon = Daemon(
            args.binary,
            workdir,
            l1=str(l1),
            l2=str(l2),
            slot=str(slot),
            gpu=gpu,
            store_policy=store_policy,
        )
    except CheckFailed:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    print(
        f"daemon: {args.binary} (L1 {l1 >> 20} MiB {'on cuda:0' if gpu else 'emulated'}, "
        f"slot {slot >> 20} MiB, {'pinned' if gpu else 'plain'} L2, {store_policy}), "
        f"log {daemon.log}"
    )
    # CPU time from here on, past the daemon's start (CUDA's initialization is most of that):
    # a daemon that spins while it waits for copies uses a core for as long as they take.
    started, cpu_before = time.monotonic(), daemon.cpu_seconds()
    try:
        yield daemon
        if daemon.proc.poll() is not None:
            fail(f"the daemon exited ({daemon.proc.returncode}) during the check")
        cpu = daemon.cpu_seconds()
        if cpu is not None and cpu_before is not None:
            wall = time.monotonic() - started
            print(f"  daemon CPU time: {cpu - cpu_before:.2f} s in {wall:.2f} s of requests")
    except CheckFailed as e:
        raise CheckFailed(f"{e}\n--- daemon log (tail) ---\n{daemon.tail()}") from None
    except Exception as e:
        raise CheckFailed(
            f"{type(e).__name__}: {e}\n--- daemon log (tail) ---\n{daemon.tail()}"
        ) from e
    finally:
        daemon.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


class Row(NamedTuple):
    """One figure of the report: GB/s against a raw limit of the same run."""

    label: str
    gb_s: float
    limit: float
    what: str
    target: float | None


def row(label: str, gb_s: float, limit: float, what: str, target: float | None) -> Row:
    return Row(label, gb_s, limit, what, target)


def summary(rounds: list[list[Row]]) -> list[str]:
    """Each row's median over the rounds, its ratio to the limit, and the rounds' range."""
    lines = []
    for same in zip(*rounds, strict=True):
        first = same[0]
        values = sorted(r.gb_s for r in same)
        median = statistics.median(values)
        aim = f"  (target {first.target})" if first.target is not None else ""
        spread = f"  [{values[0]:.0f}-{values[-1]:.0f}]" if len(values) > 1 else ""
        # A limit of 0 (every way of its raw copy failed, already reported) has no ratio.
        ratio = f"{median / first.limit:5.2f}" if first.limit > 0 else "    -"
        lines.append(f"  {first.label:<70} {median:8.2f}  {ratio} x {first.what}{aim}{spread}")
    return lines


def daemon_check(torch, args, raw: dict[str, float], gpu: bool) -> list[str]:
    """``--rounds`` rounds of both parts, each on fresh daemons; the report has each row's
    median and range over the rounds."""
    rounds = []
    for n in range(args.rounds):
        memory = Memory(torch, gpu)
        report = contiguous_check(torch, args, raw, gpu, memory)
        report += cascade_check(torch, args, raw, gpu, memory)
        report += fragmented_check(torch, args, raw, gpu, memory)
        rounds.append(report)
        # Each round's figures as it ends: a run stopped by its time limit still has them.
        print(f"round {n + 1} of {args.rounds}:", flush=True)
        for line in summary([report]):
            print(line, flush=True)
        if gpu:
            torch.cuda.empty_cache()
    return summary(rounds)


def contiguous_session(daemon: Daemon, memory: Memory, n: int, label: str):
    """``n`` blocks of one 2 MiB chunk each, as an ``(n, 2 MiB)`` tensor, and a session that
    registered them."""
    from tierkv.wire import KvLayout, Segment

    blocks, region, off = memory.alloc(n * CONTIG_CHUNK)
    layout = KvLayout(
        blocks=n,
        block_bytes=CONTIG_CHUNK,
        block_stride=CONTIG_CHUNK,
        blocks_per_chunk=1,
        segments=[Segment(0, off)],
    )
    return blocks.view(n, CONTIG_CHUNK), Session(daemon, CONTIG_CHUNK, [region], layout, label)


def contiguous_check(torch, args, raw, gpu: bool, memory: Memory) -> list[Row]:
    """2 MiB contiguous chunks, ``--contig-chunks`` to a request, in three rounds of fresh keys
    (the best round counts): store (engine -> L1), flush (-> L2), lookup, retrieve (L1 ->
    engine). A daemon with 2 MiB slots, L1 holding every round."""

    n, rounds = args.contig_chunks, 3
    l1 = rounds * n * CONTIG_CHUNK
    best = {"store": 0.0, "down": 0.0, "retrieve": 0.0, "lookup": 0.0}
    tiers: list[int] = []
    with running_daemon(args, l1, 2 * l1, CONTIG_CHUNK, gpu) as daemon:
        contig, s = contiguous_session(daemon, memory, n, "contig")
        event_session = None
        try:
            nb = n * CONTIG_CHUNK
            for r in range(rounds):
                contig.random_(0, 256)
                reference = contig.clone()
                chunks = [(0x1000 + r * n + i, [i]) for i in range(n)]
                memory.sync()  # the worker's rule: its writes are done before `store`
                t0 = time.perf_counter()
                s.store(chunks)
                t_store = time.perf_counter() - t0
                s.client.flush(120.0)
                t_down = time.perf_counter() - t0
                contig.zero_()
                memory.sync()
                t_lookup, t_retrieve, tiers = s.load(chunks, 0)
                if not torch.equal(contig, reference):
                    bad = int((contig != reference).any(dim=1).nonzero()[0])
                    fail(f"2 MiB chunks: chunk {bad} differs after store and retrieve")
                for key, t in (
                    ("store", t_store),
                    ("down", t_down),
                    ("retrieve", t_retrieve),
                    ("lookup", t_lookup + t_retrieve),
                ):
                    best[key] = max(best[key], gbps(nb, t))
            if gpu:
                # On this daemon, whose L1 slots are the chunks' size: its 2 x 64 chunks stay
                # in L1, so the retrieve with a done event takes the device path (a daemon of
                # 16 MiB slots held only 32 of them in L1 and answered through the host).
                event_session = ready_event_check(torch, daemon, memory)
        finally:
            if event_session is not None:
                event_session.close()
            s.close()
    print("  2 MiB contiguous chunks: every byte verified")
    pieces = f"raw 2 MiB D2D ({best_way(raw, 'contig_d2d')})"
    what = f"2 MiB contiguous, {n} a request:"
    return [
        row(
            f"{what} engine -> L1 (store)",
            best["store"],
            raw["contig_d2d"],
            pieces,
            TARGET_D2D,
        ),
        row(f"{what} engine -> L1 (store)", best["store"], raw["d2d"], "raw D2D", None),
        row(
            f"{what} engine -> L1 -> L2 (store + flush)",
            best["down"],
            raw["d2h"],
            "raw D2H",
            TARGET_HOST,
        ),
        row(
            f"{what} L1 -> engine (retrieve) {tiers}",
            best["retrieve"],
            raw["contig_d2d"],
            pieces,
            TARGET_D2D,
        ),
        row(f"{what} lookup + retrieve", best["lookup"], raw["contig_d2d"], pieces, None),
    ]


def cascade_check(torch, args, raw, gpu: bool, memory: Memory) -> list[Row]:
    """The daemon's default store policy, the cascade: L1 holds one round of ``--contig-chunks``
    2 MiB chunks, so each later round's store moves the round before it out of L1 into L2 on the
    writer's path (device to pinned host, under the victims' shard lock); then the first round,
    in L2, is loaded back through L1 and every byte checked."""

    n, rounds = args.contig_chunks, 3
    l1 = n * CONTIG_CHUNK
    nb = n * CONTIG_CHUNK
    t_store = 0.0
    with running_daemon(args, l1, 4 * l1, CONTIG_CHUNK, gpu, "cascade") as daemon:
        contig, s = contiguous_session(daemon, memory, n, "cascade")
        try:
            rounds_chunks = [[(0x3000 + r * n + i, [i]) for i in range(n)] for r in range(rounds)]
            first = None
            for r, chunks in enumerate(rounds_chunks):
                contig.random_(0, 256)
                if r == 0:
                    first = contig.clone()
                memory.sync()
                t0 = time.perf_counter()
                s.store(chunks)
                if r > 0:  # L1 is full from the second round on: each store evicts down
                    t_store += time.perf_counter() - t0
            contig.zero_()
            memory.sync()
            t_lookup, t_retrieve, tiers = s.load(rounds_chunks[0], 1)
            if not torch.equal(contig, first):
                bad = int((contig != first).any(dim=1).nonzero()[0])
                fail(f"cascade: chunk {bad} differs after it went down to L2 and back")
        finally:
            s.close()
    print("  cascade: every byte verified after L2")
    what = f"cascade, {n} x 2 MiB:"
    serial = 1 / (1 / raw["h2d"] + 1 / raw["contig_d2d"])
    return [
        row(
            f"{what} engine -> L1, victims -> L2 (store)",
            gbps(nb * (rounds - 1), t_store),
            raw["d2h"],
            "raw D2H",
            None,
        ),
        row(
            f"{what} L2 -> L1 (the lookup's loads) {tiers}",
            gbps(nb, t_lookup),
            raw["h2d"],
            "raw H2D",
            TARGET_HOST,
        ),
        row(
            f"{what} L2 -> L1 -> engine (lookup + retrieve)",
            gbps(nb, t_lookup + t_retrieve),
            serial,
            "raw H2D then raw D2D",
            None,
        ),
    ]


def fragmented_check(torch, args, raw, gpu: bool, memory: Memory) -> list[Row]:
    """Fragmented chunks of Llama-3-8B's paged KV (one tensor, 64 segments: layer x K/V; 8
    scattered blocks a chunk, 16 MiB): stored a quarter at a time and flushed to L2, the last
    quarter retrieved from L1, the first (evicted) through L2. Then the vLLM connector's own
    registration, on the same daemon."""
    from tierkv.wire import KvLayout, Segment

    n = args.chunks
    frag_bytes = n * FRAG_CHUNK
    # L1 holds half the chunks: the first half stored are evicted from L1 (write-through: L2
    # keeps them) and come back through L2. L2 holds everything: it keeps each chunk in a slot
    # of L1's size, so the connector's small chunks take 16 MiB slots too; 16 spare slots keep
    # its first chunk there until its lookup.
    l1 = n // 2 * FRAG_CHUNK if args.l1_mib == 0 else args.l1_mib << 20
    l2 = 2 * frag_bytes + 16 * FRAG_CHUNK
    report: list[Row] = []
    dev = torch.device("cuda" if gpu else "cpu")
    sessions: list[Session] = []
    with running_daemon(args, l1, l2, FRAG_CHUNK, gpu) as daemon:
        try:
            blocks = n * FRAG_BLOCKS * 2
            shape = (LAYERS, 2, blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
            kv, region, off = memory.alloc(LAYERS * 2 * blocks * PIECE_BYTES)
            kv = kv.view(torch.bfloat16).view(shape)
            plane = blocks * PIECE_BYTES
            layout = KvLayout(
                blocks=blocks,
                block_bytes=PIECE_BYTES,
                block_stride=PIECE_BYTES,
                blocks_per_chunk=FRAG_BLOCKS,
                segments=[Segment(0, off + i * plane) for i in range(2 * LAYERS)],
            )
            s = Session(daemon, FRAG_CHUNK, [region], layout, "frag")
            sessions.append(s)
            raw_view = kv.view(torch.int16)
            raw_view.random_(-(1 << 15), 1 << 15)
            # Chunk i takes every other block, in a scrambled order: pieces are scattered.
            chunk_blocks = [
                [(2 * (i * FRAG_BLOCKS + j) * 7) % blocks for j in range(FRAG_BLOCKS)]
                for i in range(n)
            ]
            if len({b for bl in chunk_blocks for b in bl}) != n * FRAG_BLOCKS:
                chunk_blocks = [
                    [2 * (i * FRAG_BLOCKS + j) for j in range(FRAG_BLOCKS)] for i in range(n)
                ]
            chunks = [(0x2000 + i, chunk_blocks[i]) for i in range(n)]
            used = sorted({b for bl in chunk_blocks for b in bl})
            reference = raw_view[:, :, used].clone()
            memory.sync()
            # Stored a quarter at a time, each quarter flushed down to L2 before the next: L1
            # has room for two quarters, so each store evicts only chunks L2 already holds.
            t_store = t_down = 0.0
            quarter = n // 4
            per_quarter = []
            for q in range(4):
                t0 = time.perf_counter()
                s.store(chunks[q * quarter : (q + 1) * quarter])
                t1 = time.perf_counter()
                s.client.flush(120.0)
                t2 = time.perf_counter()
                t_store += t1 - t0
                t_down += t2 - t0
                per_quarter.append(f"{(t1 - t0) * 1e3:.1f} + {(t2 - t1) * 1e3:.1f}")
            print(f"  fragmented: store + flush ms, by quarter: {', '.join(per_quarter)}")
            nb = n * FRAG_CHUNK
            pieces = f"raw D2D of the pieces ({best_way(raw, 'frag_d2d')})"
            report.append(
                row(
                    "fragmented: engine -> L1 (store)",
                    gbps(nb, t_store),
                    raw["frag_d2d"],
                    pieces,
                    TARGET_FRAG,
                )
            )
            report.append(
                row(
                    "fragmented: engine -> L1 -> L2 (store + flush)",
                    gbps(nb, t_down),
                    raw["d2h"],
                    "raw D2H",
                    TARGET_HOST,
                )
            )
            # Reload the last quarter stored, which L1 still has, then the first, which the L1
            # of two quarters has evicted: it comes back through L2.
            for label, part, tier in (
                ("L1 -> engine (retrieve)", chunks[3 * quarter :], 0),
                ("L2 -> L1 -> engine (lookup + retrieve)", chunks[:quarter], 1),
            ):
                # Every block used is overwritten first, so equal bytes prove the load.
                raw_view.index_fill_(2, torch.tensor(used, device=dev), 0)
                memory.sync()
                t_lookup, t_retrieve, tiers = s.load(part, tier)
                if args.corrupt:  # the self-test of the verification: one bit flipped
                    raw_view[0, 0, part[0][1][0]].view(-1)[0] ^= 1
                part_blocks = sorted({b for _, bl in part for b in bl})
                pos = torch.tensor([used.index(b) for b in part_blocks], device=dev)
                got = raw_view[:, :, part_blocks]
                want = reference.index_select(2, pos)
                if not torch.equal(got, want):
                    fail(f"fragmented chunks ({label}): bytes differ after retrieve")
                # ...and nothing else was written: the other blocks zeroed above stay zero.
                loaded = set(part_blocks)
                others = [b for b in used if b not in loaded]
                if others and bool(raw_view[:, :, others].any()):
                    fail(f"fragmented chunks ({label}): a retrieve wrote blocks of other chunks")
                nb = len(part) * FRAG_CHUNK
                if tier == 0:
                    report.append(
                        row(
                            f"fragmented: {label} {tiers}",
                            gbps(nb, t_retrieve),
                            raw["frag_d2d"],
                            pieces,
                            TARGET_FRAG,
                        )
                    )
                    continue
                # Through L2: the lookup loads the chunks into L1 (a host-to-device move), the
                # retrieve scatters them (device to device). Each move against its raw limit,
                # and the whole against the two raw copies one after the other.
                serial = 1 / (1 / raw["h2d"] + 1 / raw["frag_d2d"])
                report.append(
                    row(
                        f"fragmented: L2 -> L1 (the lookup's loads) {tiers}",
                        gbps(nb, t_lookup),
                        raw["h2d"],
                        "raw H2D",
                        TARGET_HOST,
                    )
                )
                report.append(
                    row(
                        f"fragmented: {label}",
                        gbps(nb, t_lookup + t_retrieve),
                        raw["h2d"],
                        "raw H2D",
                        None,
                    )
                )
                report.append(
                    row(
                        f"fragmented: {label}",
                        gbps(nb, t_lookup + t_retrieve),
                        serial,
                        "raw H2D then raw D2D",
                        TARGET_HOST,
                    )
                )
            print("  fragmented chunks: every byte verified")
            sessions.append(connector_check(torch, daemon, gpu))
        finally:
            for session in sessions:
                session.close()
    return report


#: GPU clock cycles the producer kernel spins before it writes the blocks (about 0.1 s).
SPIN_CYCLES = 200_000_000


def ready_event_check(torch, daemon: Daemon, memory: Memory) -> Session:
    """A store sent while the kernels that write its blocks still run, naming the worker's
    interprocess event recorded after them: the daemon waits for it before its copies, so the
    stored chunks hold what the kernels wrote. Then the control, the same store of fresh chunks
    without the event: the daemon copies at once, before the kernels wrote, and gets the stale
    bytes (the check says how many chunks did; their bytes prove the ordering was exercised)."""

    n = 64  # 128 MiB: copies long enough (~0.3 ms) to outlast the reply of a retrieve
    blocks, s = contiguous_session(daemon, memory, n, "event")
    event = torch.cuda.Event(interprocess=True)
    stale = {}
    for label, key, with_event in (("event", 0x4000, True), ("control", 0x5000, False)):
        blocks.zero_()
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)  # the engine's kernels, still running...
        blocks.fill_(0x5A)  # ...until they write the blocks
        event.record()
        chunks = [(key + i, [i]) for i in range(n)]
        s.store(chunks, ready_event=bytes(event.ipc_handle()) if with_event else None)
        torch.cuda.synchronize()
        blocks.zero_()
        torch.cuda.synchronize()
        s.load(chunks, 0)
        stale[label] = int((blocks != 0x5A).any(dim=1).sum())
    if stale["event"]:
        fail(
            f"ready_event: {stale['event']} of {n} chunks stored before the kernels that "
            "wrote them had finished"
        )
    # The retrieve's event: the daemon records it after the copies and replies without
    # waiting for them; a kernel that reads the blocks after waiting for it sees every byte.
    done = torch.cuda.Event(interprocess=True)
    done.record()  # the event exists before its handle is taken
    chunks = [(0x4000 + i, [i]) for i in range(n)]
    blocks.zero_()
    torch.cuda.synchronize()
    started = s.client.lookup(0, [c for c, _ in chunks])
    if (started.outcome or s.client.wait(started.lookup, 60.0)).hit_chunks != n:
        fail("done_event: the chunks stored with the ready_event are gone")
    s.client.retrieve(started.lookup, s.buffer, chunks, done_event=bytes(done.ipc_handle()))
    running = not done.query()
    torch.cuda.current_stream().wait_event(done)
    got = blocks.clone()  # the engine's kernel, after the wait on the GPU
    torch.cuda.synchronize()
    late = int((got != 0x5A).any(dim=1).sum())
    if late:
        fail(f"done_event: {late} of {n} chunks were not in place when the event fired")
    given_up_check(torch, daemon, memory)
    print(
        f"  ready_event: {n} chunks stored while their kernels ran, every byte the kernels "
        f"wrote; without the event {stale['control']} of {n} held stale bytes"
    )
    print(
        f"  done_event: {n} chunks retrieved, every byte in place once the event fired "
        f"(at the reply the copies were {'still running' if running else 'done'})"
    )
    return s


#: GPU clock cycles of a kernel that outlasts a client's deadline (about 3 s).
LONG_SPIN_CYCLES = 30 * SPIN_CYCLES


def given_up_check(torch, daemon: Daemon, memory: Memory) -> None:
    """A store whose ``ready_event`` waits behind kernels that outlast the client's deadline (a
    worker hung in a collective, say): the daemon waits for the event on its host, so once the
    client gives up (its writing side shut) the daemon ends the request, stores nothing of it,
    and closes the connection while the kernels still run, instead of leaving a copy stream
    waiting on the GPU and the session stuck in its copies."""
    from tierkv.errors import ConnectionLost

    n = 8
    blocks, s = contiguous_session(daemon, memory, n, "given-up")
    event = torch.cuda.Event(interprocess=True)
    blocks.fill_(0x3C)
    torch.cuda.synchronize()
    torch.cuda._sleep(LONG_SPIN_CYCLES)  # kernels that will not finish in time
    event.record()
    chunks = [(0x6000 + i, [i]) for i in range(n)]
    started = time.perf_counter()
    try:
        # A deadline of its own: by default a store with an event waits as long as the daemon may.
        s.store(chunks, ready_event=bytes(event.ipc_handle()), timeout=0.5)
        fail("given up: a store behind a 3 s kernel answered within a 0.5 s deadline")
    except ConnectionLost:
        pass
    unanswered = s.client.take_unanswered()
    settled = unanswered is None or unanswered.wait(2.0)
    elapsed = time.perf_counter() - started
    still_running = not event.query()
    torch.cuda.synchronize()
    if not settled:
        fail("given up: the daemon did not close the session of a store given up on within 2 s")
    if not still_running:
        print("  note: the kernel ended before the daemon let the store go; nothing proven")
    # The same namespace (the label's): it would find the chunks, had any been stored.
    _, fresh = contiguous_session(daemon, memory, n, "given-up")
    started_lookup = fresh.client.lookup(0, [c for c, _ in chunks])
    outcome = started_lookup.outcome or fresh.client.wait(started_lookup.lookup, 60.0)
    fresh.client.release(started_lookup.lookup)
    fresh.close()
    if outcome.hit_chunks:
        fail(f"given up: {outcome.hit_chunks} of {n} chunks of a store given up on were stored")
    print(
        f"  given up: a store waiting on a 3 s kernel's event let go {elapsed:.2f} s after it "
        "was sent (0.5 s deadline), nothing stored"
    )


def connector_check(torch, daemon: Daemon, gpu: bool) -> Session:
    """The vLLM connector's own registration of the engine's KV, where it is: per-layer tensors
    shaped as vLLM's FlashAttention backend allocates them, ``(2, blocks, block_tokens, kv_heads,
    head_dim)``, exported by ``tierkv.vllm.memory.export_device_kv`` on a GPU (one CUDA IPC
    region per allocation behind them) or moved into a memfd on CPU (the dry run); then chunks
    stored, the blocks zeroed, and every byte retrieved and compared."""
    from tierkv.vllm.memory import export_device_kv, move_to_memfd

    layers, blocks, per_chunk = 4, 64, 8
    shape = (2, blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
    dev = torch.device("cuda" if gpu else "cpu")
    kv = {
        f"model.layers.{i}.self_attn.attn": torch.empty(shape, dtype=torch.bfloat16, device=dev)
        for i in range(layers)
    }
    if gpu:
        exported = export_device_kv(kv, blocks, per_chunk)
        regions = [(region, None) for region in exported.regions]
        layout, chunk_bytes = exported.layout, exported.chunk_bytes()
    else:
        moved = move_to_memfd(kv, blocks, per_chunk)
        regions = [(moved.region, moved.fd)]
        layout, chunk_bytes = moved.layout, moved.chunk_bytes()
    s = Session(daemon, chunk_bytes, regions, layout, "vllm")
    for t in kv.values():
        t.view(torch.int16).random_(-(1 << 15), 1 << 15)
    # Compared as int16: random bits make bfloat16 NaNs, which never equal themselves.
    reference = {name: t.view(torch.int16).clone() for name, t in kv.items()}
    # Every other chunk's blocks backwards, so blocks of a chunk are not neighbours.
    chunks = [
        (0x3000 + c, [blocks - 1 - (c * per_chunk + j) for j in range(per_chunk)])
        for c in range(blocks // per_chunk)
    ]
    if gpu:
        torch.cuda.synchronize()
    s.store(chunks)
    for t in kv.values():
        t.zero_()
    if gpu:
        torch.cuda.synchronize()
    s.load(chunks, None)
    for name, t in kv.items():
        if not torch.equal(t.view(torch.int16), reference[name]):
            fail(f"vLLM-shaped KV ({name}): bytes differ after store and retrieve")
    where = f"{len(regions)} CUDA IPC region(s)" if gpu else "a memfd"
    print(f"  vLLM-shaped KV of {layers} layers in {where}: every byte verified")
    return s


def stopped_by_signal(signum: int, _frame: object) -> None:
    raise SystemExit(f"gpu-check: stopped by signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--bin",
        dest="binary",
        type=Path,
        default=None,
        help="the tierkv binary (default: target/release/tierkv, else target/gpu-carry/tierkv)",
    )
    ap.add_argument("--raw-only", action="store_true", help="measure the raw limits only")
    ap.add_argument(
        "--chunks",
        type=int,
        default=64,
        help="fragmented (16 MiB) chunks, a multiple of 4; half as many 2 MiB ones",
    )
    ap.add_argument(
        "--l1-mib",
        type=int,
        default=0,
        help="L1 capacity (default: half the "
        "fragmented chunks' bytes, so half come back through L2)",
    )
    ap.add_argument(
        "--contig-chunks",
        type=int,
        default=None,
        help="2 MiB chunks in one store or retrieve request (default: 128; in the dry run, "
        "--chunks)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of the daemon part, each on fresh daemons; the report has each row's "
        "median (default: 5; in the dry run, 1)",
    )
    ap.add_argument("--raw-mib", type=int, default=256, help="bytes of each raw copy")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the daemon's directory")
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="the daemon part on CPU torch, memfd regions and an emulated L1: tests this "
        "script without a GPU (its figures mean nothing)",
    )
    ap.add_argument("--corrupt", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    # `timeout` stops the check with SIGTERM: leave by an exception, so that every `finally`
    # stops its daemon (they run in sessions of their own, out of `timeout`'s reach).
    signal.signal(signal.SIGTERM, stopped_by_signal)
    if args.binary is None:
        release = Path("target/release/tierkv")
        carried = Path("target/gpu-carry/tierkv")
        args.binary = carried if carried.is_file() and not release.is_file() else release
    args.binary = args.binary.resolve()  # the daemon runs in its own directory
    if args.chunks < 4 or args.chunks % 4:
        ap.error("--chunks must be a positive multiple of 4")
    if args.contig_chunks is None:
        args.contig_chunks = args.chunks if args.cpu_dry_run else 128
    if args.contig_chunks < 1:
        ap.error("--contig-chunks must be positive")
    if args.rounds is None:
        args.rounds = 1 if args.cpu_dry_run else 5
    if args.rounds < 1:
        ap.error("--rounds must be positive")

    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").find("expandable_segments:True") >= 0:
        print(
            "gpu-check: PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True; its memory "
            "cannot be shared by CUDA IPC. Unset it.",
            file=sys.stderr,
        )
        return FAILED
    tierkv_importable()
    if args.cpu_dry_run:
        return dry_run(args)
    torch = load_torch()
    cuda = libcuda()
    version = driver_version(cuda)
    props = torch.cuda.get_device_properties(0)
    drv = f"{version // 1000}.{version % 1000 // 10}" if version else "unknown"
    print(
        f"device: {props.name} ({props.total_memory >> 30} GiB, PCI {pci_bus_id(torch)}), "
        f"driver CUDA {drv}, torch {torch.__version__} (CUDA {torch.version.cuda})"
    )
    with contextlib.suppress(Exception):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            check=False,
            capture_output=True,
            text=True,
            timeout=20,
        )
        if smi.returncode == 0:
            print(f"nvidia driver: {smi.stdout.strip()}")
    try:
        raw = raw_limits(torch, cuda, args)
        torch.cuda.empty_cache()  # the raw buffers are gone with raw_limits' frame
        print_raw(raw)
        if args.raw_only:
            return report_problems()
        if not args.binary.is_file():
            fail(
                f"no tierkv binary at {args.binary} (build it: cargo build --release --bin "
                "tierkv, and carry it along)"
            )
        report = daemon_check(torch, args, raw, gpu=True)
    except CheckFailed as e:
        print(f"gpu-check: FAILED: {e}", file=sys.stderr)
        return FAILED
    return finish(args, report)


def dry_run(args) -> int:
    try:
        import torch
    except ImportError as e:
        print(f"gpu-check: the dry run needs torch ({e})", file=sys.stderr)
        return FAILED
    print("dry run on CPU: memfd regions, emulated L1; the figures mean nothing")
    raw = dict.fromkeys(("h2d", "d2h", "d2d", "contig_d2d", "frag_d2h", "frag_d2d"), 1.0)
    try:
        if not args.binary.is_file():
            fail(f"no tierkv binary at {args.binary}")
        report = daemon_check(torch, args, raw, gpu=False)
    except CheckFailed as e:
        print(f"gpu-check: FAILED: {e}", file=sys.stderr)
        return FAILED
    return finish(args, report)


def finish(args, report: list[str]) -> int:
    print(
        f"tierkv (GB/s, wall clock around the requests; {args.contig_chunks} x 2 MiB chunks a "
        f"request, {args.chunks} x 16 MiB fragmented chunks a quarter at a time):"
    )
    for line in report:
        print(line)
    if not PROBLEMS:
        print("gpu-check: every byte verified")
    return report_problems()


def report_problems() -> int:
    for problem in PROBLEMS:
        print(f"gpu-check: FAILED: {problem}", file=sys.stderr)
    return FAILED if PROBLEMS else 0


if __name__ == "__main__":
    sys.exit(main())
