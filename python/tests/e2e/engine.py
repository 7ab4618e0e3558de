"""A real vLLM engine driven by JSON lines on stdin, for the end-to-end tests and the benchmark.

Each command is one JSON object per line; each answer is one line on stdout prefixed with
``@@tierkv@@`` (vLLM logs to stdout too). Commands:

- ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": 16}`` -> per prompt the greedy
  output tokens, ``num_cached_tokens`` (vLLM's local hit plus what a connector loaded) and the
  wall time of the whole call;
- ``{"op": "ttft", "prompt": [ids...]}`` -> the wall time of ``generate(max_tokens=1)``;
- ``{"op": "reset"}`` -> ``reset_prefix_cache()``: only a connector can supply KV afterwards;
  ``"running": true`` and ``"connector": true`` pass ``reset_running_requests`` and
  ``reset_connector`` (the connector's cache reset too, as vLLM's sleep and pause do); vLLM's
  refusal, raised or returned, is ``{"reset": false}`` (with the ``error`` raised);
- ``{"op": "abort", "prompts": [...], "steps": k}`` -> adds the requests, runs k engine steps,
  aborts every one that is unfinished, and steps until the engine is idle;
- ``{"op": "preemptions"}`` -> vLLM's count of preempted requests (needs ``--stats``);
- ``{"op": "counters"}`` -> every counter of vLLM's metrics by name, e.g. speculative decoding's
  ``vllm:spec_decode_num_draft_tokens`` and ``vllm:spec_decode_num_accepted_tokens`` (needs
  ``--stats``);
- ``{"op": "quit"}``.

Usage: python engine.py --model DIR [--connector tierkv|lmcache-mp|none] [--socket PATH]
       [--blocks N] [--max-model-len N] [--tp N] [--extra JSON] [--speculative JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

PREFIX = "@@tierkv@@ "


def transfer_config(
    kind: str, socket: str | None, more: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    if kind == "none":
        return None
    if kind == "tierkv":
        extra: dict[str, Any] = {"timeout_s": 5.0, "retry_s": 1.0, **(more or {})}
        if socket:
            extra["socket"] = socket
        return {
            "kv_connector": "TierKVConnector",
            "kv_connector_module_path": "tierkv.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    if kind == "lmcache-mp":
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": json.loads(os.environ.get("LMCACHE_MP_EXTRA", "{}")),
        }
    raise SystemExit(f"unknown connector {kind}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--connector", default="tierkv")
    parser.add_argument("--socket", default=None)
    parser.add_argument("--blocks", type=int, default=None, help="KV blocks (vLLM's override)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="torch.compile (slow start)")
    parser.add_argument("--stats", action="store_true", help="keep vLLM's metrics (preemptions)")
    parser.add_argument(
        "--extra", default="{}", help="JSON: more tierkv kv_connector_extra_config settings"
    )
    parser.add_argument(
        "--speculative",
        default=None,
        help="JSON: vLLM's speculative_config, e.g. "
        '{"method": "ngram", "num_speculative_tokens": 3}',
    )
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    options: dict[str, Any] = dict(
        model=args.model,
        dtype="float32",
        max_model_len=args.max_model_len,
        enable_prefix_caching=True,
        enforce_eager=not args.compile,
        seed=0,
        gpu_memory_utilization=0.1,
        tensor_parallel_size=args.tp,
        disable_log_stats=not args.stats,
    )
    if args.blocks:
        options["num_gpu_blocks_override"] = args.blocks
    if args.speculative:
        options["speculative_config"] = json.loads(args.speculative)
    kv = transfer_config(args.connector, args.socket, json.loads(args.extra))
    if kv is not None:
        from vllm.config import KVTransferConfig

        options["kv_transfer_config"] = KVTransferConfig(**kv)
    llm = LLM(**options)
    engine = llm.llm_engine

    def answer(value: dict[str, Any]) -> None:
        sys.stdout.write(PREFIX + json.dumps(value) + "\n")
        sys.stdout.flush()

    answer({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "generate":
            params = SamplingParams(
                temperature=0.0, max_tokens=command.get("max_tokens", 16), ignore_eos=True
            )
            prompts = [TokensPrompt(prompt_token_ids=p) for p in command["prompts"]]
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - started
            answer(
                {
                    "outputs": [
                        {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0}
                        for o in outputs
                    ],
                    "seconds": elapsed,
                }
            )
        elif op == "ttft":
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            started = time.perf_counter()
            out = llm.generate(
                [TokensPrompt(prompt_token_ids=command["prompt"])], params, use_tqdm=False
            )
            elapsed = time.perf_counter() - started
            answer({"seconds": elapsed, "cached": out[0].num_cached_tokens or 0})
        elif op == "reset":
            try:
                done = llm.reset_prefix_cache(
                    reset_running_requests=command.get("running", False),
                    reset_connector=command.get("connector", False),
                )
            except RuntimeError as e:
                answer({"reset": False, "error": str(e)})
            else:
                answer({"reset": bool(done)})
        elif op == "abort":
            params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
            ids = []
            for i, prompt in enumerate(command["prompts"]):
                rid = f"abort-{time.monotonic_ns()}-{i}"
                engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
                ids.append(rid)
            finished: set[str] = set()
            for _ in range(command.get("steps", 1)):
                for out in engine.step():
                    if out.finished:
                        finished.add(out.request_id)
            engine.abort_request([r for r in ids if r not in finished])
            while engine.has_unfinished_requests():
                engine.step()
            answer({"aborted": len(ids) - len(finished)})
        elif op == "preemptions":
            total = sum(
                getattr(m, "value", 0)
                for m in llm.get_metrics()
                if m.name == "vllm:num_preemptions"
            )
            answer({"preemptions": total})
        elif op == "counters":
            from vllm.v1.metrics.reader import Counter

            counters: dict[str, float] = {}
            for m in llm.get_metrics():
                if isinstance(m, Counter):
                    counters[m.name] = counters.get(m.name, 0) + m.value
            answer({"counters": counters})
        elif op == "quit":
            answer({"bye": True})
            break
        else:
            answer({"error": f"unknown op {op}"})


if __name__ == "__main__":
    main()
