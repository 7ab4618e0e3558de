"""tierkv's vLLM KV connector.

Use it with::

    --kv-transfer-config '{"kv_connector": "TierKVConnector",
                           "kv_connector_module_path": "tierkv.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute"}'

Importing this module imports vLLM; ``import tierkv`` alone does not.
"""

from tierkv.vllm.connector import TierKVConnector

__all__ = ["TierKVConnector"]
