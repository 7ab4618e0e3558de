"""Injects load failures into an engine's worker processes (``test_vllm_async.py``): put on
``PYTHONPATH`` with ``TIERKV_FAIL_LOADS`` naming a file. While that file exists every
asynchronous load of the connector fails, and each failure appends a line to it."""

from __future__ import annotations

import os

FLAG = os.environ.get("TIERKV_FAIL_LOADS")

if FLAG:
    from tierkv.vllm.plan import LoadOp
    from tierkv.vllm.worker import WorkerSide

    _load = WorkerSide._load_async

    def _failing(self: WorkerSide, op: LoadOp) -> None:
        if FLAG is not None and os.path.exists(FLAG):
            with open(FLAG, "a") as f:
                f.write(f"{op.req_id}\n")
            raise RuntimeError("an injected load failure")
        _load(self, op)

    WorkerSide._load_async = _failing  # type: ignore[method-assign]
