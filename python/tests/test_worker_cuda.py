"""The connector's worker half with the engine's KV on a GPU, against a daemon with L1 on the
same GPU: the CUDA IPC regions, the store's ready event, the asynchronous retrieve's done event,
and the hold on a request's blocks while a call given up on may still land in them. They need a
CUDA device (the GPU session runs them through ``scripts/gpu-all.sh``) and skip, saying so, where
there is none."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from daemon import Daemon, cuda_config, tierkv_binary

torch = pytest.importorskip("torch", reason="torch is not installed: no KV on a GPU to test")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here: the GPU session runs these", allow_module_level=True)

from tierkv import wire  # noqa: E402
from tierkv.hashing import prefix_hashes  # noqa: E402
from tierkv.vllm.plan import LoadOp, Settings, StoreOp, TierKVMetadata  # noqa: E402
from tierkv.vllm.worker import WorkerSide  # noqa: E402

BLOCKS = 6
BLOCK_TOKENS = 16
CHUNK_TOKENS = 2 * BLOCK_TOKENS
# vLLM's FlashAttention layout per layer before 0.32: (K/V, blocks, block tokens, KV heads, head
# dim).
SHAPE = (2, BLOCKS, BLOCK_TOKENS, 8, 128)


def vllm_032_layer() -> torch.Tensor:
    """A layer as vLLM 0.32 views it on a GPU by default (``LBNHC``): ``[blocks, heads, tokens,
    K|V]``, each block lying tokens first."""
    lying = torch.zeros((BLOCKS, BLOCK_TOKENS, 8, 2 * 128), dtype=torch.bfloat16, device="cuda")
    return lying.permute(0, 2, 1, 3)


class GpuWorker:
    """A worker whose KV (four bf16 layers on GPU 0) is registered with a CUDA daemon, and one
    chunk stored from blocks 0-1: written by a kernel the store's copies must wait for."""

    def __init__(self, directory: Path, timeout_s: float = 5.0, vllm_032: bool = False) -> None:
        """``vllm_032``: the layers as vLLM 0.32 views them (:func:`vllm_032_layer`), blocks
        first, registered as lying tokens first; else the layout before it, K/V first."""
        directory.mkdir(parents=True, exist_ok=True)
        self.vllm_032 = vllm_032
        self.daemon = Daemon(tierkv_binary(), directory, make_config=cuda_config)
        settings = Settings.from_extra(
            {"socket": str(self.daemon.socket), "timeout_s": timeout_s, "chunk_blocks": 2}
        )
        self.layers = {
            f"model.layers.{i}.self_attn.attn": vllm_032_layer()
            if vllm_032
            else torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")
            for i in range(4)
        }
        interior = "NHC" if vllm_032 else None
        self.worker = WorkerSide(
            settings, "m", CHUNK_TOKENS, 0, 1, False, num_blocks=BLOCKS, interior=interior
        )
        self.worker.register_kv_caches(self.layers)
        self.chunk = prefix_hashes(list(range(CHUNK_TOKENS)), CHUNK_TOKENS)[0]
        # Written on the engine's stream, not synchronized: only the ready event (the worker's
        # wait for it, and the daemon's check of it) orders the daemon's copies after these
        # kernels. A long kernel first, so that they are late.
        torch.cuda._sleep(50_000_000)
        for t in self.layers.values():
            self.blocks(t, 0, 2).view(torch.int16).random_(-(1 << 15), 1 << 15)
        self.worker.wait_for_save(TierKVMetadata(stores=[StoreOp("a", [(self.chunk, [0, 1])])]))
        assert self.worker.stored_chunks == 1
        # Compared as int16: random bits make bfloat16 NaNs, which never equal themselves.
        self.stored = [self.blocks(t, 0, 2).view(torch.int16).clone() for t in self.layers.values()]

    def blocks(self, layer: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """Blocks ``first`` to ``end`` of a layer (every plane's)."""
        return layer[first:end] if self.vllm_032 else layer[:, first:end]

    def lookup(self) -> int:
        """The scheduler half's lookup of the chunk, on its own session: its lookup id."""
        assert self.worker.memory is not None
        scheduler = self.daemon.connect(
            wire.hello(
                namespaces=[("m", "")],
                chunk_bytes=self.worker.memory.chunk_bytes(),
                chunk_tokens=CHUNK_TOKENS,
            )
        )
        started = scheduler.lookup(0, [self.chunk])
        assert (started.outcome or scheduler.wait(started.lookup, 5.0)).hit_chunks == 1
        return started.lookup

    def queue_kernels_on_4_5(self) -> None:
        """The last step's kernels, still queued on the engine's stream (as under vLLM's async
        scheduling): a long one, then one that writes blocks 4-5 for the request that held
        them before. A load into them must wait for both."""
        torch.cuda._sleep(50_000_000)
        for t in self.layers.values():
            self.blocks(t, 4, 6).zero_()

    def load_into_4_5(self, lookup: int) -> None:
        self.worker.start_load_kv(
            TierKVMetadata(loads=[LoadOp("b", [lookup], [(self.chunk, [4, 5])])])
        )

    def landed(self) -> bool:
        """Whether blocks 4-5 hold the stored chunk (compared on the current stream)."""
        return all(
            torch.equal(self.blocks(t, 4, 6).view(torch.int16), s)
            for t, s in zip(self.layers.values(), self.stored, strict=True)
        )

    def untouched(self) -> bool:
        return all(
            bool((self.blocks(t, 4, 6).view(torch.int16) == 0).all()) for t in self.layers.values()
        )

    def close(self) -> None:
        self.worker.shutdown()
        self.daemon.stop()


@pytest.mark.parametrize("vllm_032", [False, True], ids=["kv-first", "vllm-0.32-LBNHC"])
def test_cuda_worker_stores_after_the_engines_kernels_and_loads_before_its_next(
    tmp_path: Path, vllm_032: bool
) -> None:
    gpu = GpuWorker(tmp_path / "daemon", vllm_032=vllm_032)
    try:
        assert all(bool(s.any()) for s in gpu.stored), "the chunk holds the kernel's bytes"
        lookup = gpu.lookup()
        gpu.load_into_4_5(lookup)
        assert gpu.worker.take_load_errors() == set()
        # No event: the retrieve's reply comes after its copies, so the comparison (a kernel
        # launched after it) runs after them.
        assert gpu.landed(), "the engine's stream read the blocks before the copies landed"
        assert gpu.worker.get_finished({"a", "b"}) == {"a", "b"}
    finally:
        gpu.close()


def test_cuda_a_load_lands_after_the_engines_earlier_kernels_on_its_blocks(
    tmp_path: Path,
) -> None:
    gpu = GpuWorker(tmp_path / "daemon")
    try:
        lookup = gpu.lookup()
        # The load must land after the last step's kernels, not under them.
        gpu.queue_kernels_on_4_5()
        gpu.load_into_4_5(lookup)
        assert gpu.worker.take_load_errors() == set()
        assert gpu.landed(), "a kernel queued before the load overwrote the loaded blocks"
    finally:
        gpu.close()


def test_cuda_a_load_given_up_on_holds_the_blocks_and_copies_nothing_late(
    tmp_path: Path,
) -> None:
    gpu = GpuWorker(tmp_path / "daemon", timeout_s=0.5)
    try:
        lookup = gpu.lookup()
        gpu.daemon.pause()
        gpu.load_into_4_5(lookup)
        assert gpu.worker.take_load_errors() == {4, 5}, "vLLM recomputes the blocks"
        assert gpu.worker.get_finished({"b"}) == set(), "the daemon may still copy into them"
        assert gpu.untouched()
        gpu.daemon.resume()
        deadline = time.monotonic() + 10
        while not (finished := gpu.worker.get_finished(set())):
            assert time.monotonic() < deadline, "the daemon's session never ended"
            time.sleep(0.02)
        assert finished == {"b"}
        # The daemon saw that the worker had given up before it enqueued a copy.
        assert gpu.untouched()
    finally:
        gpu.close()


def test_cuda_a_load_given_up_on_settles_when_the_daemon_is_killed(tmp_path: Path) -> None:
    gpu = GpuWorker(tmp_path / "daemon", timeout_s=0.5)
    try:
        lookup = gpu.lookup()
        gpu.daemon.pause()
        gpu.load_into_4_5(lookup)
        assert gpu.worker.take_load_errors() == {4, 5}
        gpu.daemon.kill()
        result: list[set[str]] = []
        waiter = threading.Thread(
            target=lambda: result.append(gpu.worker.get_finished({"b"})), daemon=True
        )
        waiter.start()
        waiter.join(30.0)
        assert result == [{"b"}], "a dead daemon's calls must settle, never hang the engine"
        assert gpu.untouched(), "the daemon died before it ran the retrieve"
    finally:
        gpu.close()


def test_cuda_an_asynchronous_load_lands_after_the_engines_earlier_kernels_on_its_blocks(
    tmp_path: Path,
) -> None:
    """``async_loads``: the loading thread waits for the engine's stream (an event recorded on
    the step's thread) before the retrieve, which goes over the thread's own session (the KV's
    CUDA IPC regions registered a second time), and reports the load only once the daemon's
    record of the done event completed."""
    gpu = GpuWorker(tmp_path / "daemon")
    try:
        lookup = gpu.lookup()
        gpu.queue_kernels_on_4_5()
        gpu.worker.start_load_kv(
            TierKVMetadata(async_loads=[LoadOp("b", [lookup], [(gpu.chunk, [4, 5])])])
        )
        deadline = time.monotonic() + 10
        while not (finished := gpu.worker.take_finished_recving()[0]):
            assert time.monotonic() < deadline, "the load was never reported over"
            time.sleep(0.01)
        assert finished == {"b"}
        assert gpu.worker.take_load_errors() == set(), "the load failed"
        assert gpu.landed(), "a kernel queued before the load overwrote the loaded blocks"
        assert gpu.worker.get_finished({"a", "b"}) == {"a", "b"}
    finally:
        gpu.close()
