"""tierkv's vLLM KV connector.

Use it with::

    --kv-transfer-config '{"kv_connector": "TierKVConnector",
                           "kv_connector_module_path": "tierkv.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute"}'

Taking ``TierKVConnector`` from this module imports vLLM; ``import tierkv`` does not, and neither
do the parts that need only torch (``tierkv.vllm.memory``, which the GPU check uses on machines
without vLLM).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "TierKVConnector":
        from tierkv.vllm.connector import TierKVConnector

        return TierKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
