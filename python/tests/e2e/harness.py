"""Real processes for the end-to-end tests and the benchmark: a tierkv daemon and vLLM engines.

Every process started here is stopped by the fixture that started it (and killed if it does not
stop in time), so a failed test leaves nothing running.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon import Daemon, engine_config, is_idle, tierkv_binary  # noqa: E402

ENGINE = Path(__file__).with_name("engine.py")
PREFIX = "@@tierkv@@ "


def start_daemon(directory: Path, make_config=engine_config) -> Daemon:
    directory.mkdir(parents=True, exist_ok=True)
    return Daemon(tierkv_binary(), directory, make_config=make_config)


class Engine:
    """A vLLM engine process (``engine.py``) and its JSON-line commands."""

    def __init__(
        self,
        model: Path,
        connector: str = "tierkv",
        socket: Path | None = None,
        blocks: int | None = 256,
        max_model_len: int = 4096,
        log: Path | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        python: str | None = None,
        speculative: dict[str, Any] | None = None,
    ) -> None:
        """``speculative``: vLLM's ``speculative_config`` (e.g. ngram speculative decoding)."""
        args = [
            python or sys.executable,
            str(ENGINE),
            "--model",
            str(model),
            "--connector",
            connector,
            "--max-model-len",
            str(max_model_len),
            *extra_args,
        ]
        if socket is not None:
            args += ["--socket", str(socket)]
        if blocks:
            args += ["--blocks", str(blocks)]
        if speculative is not None:
            args += ["--speculative", json.dumps(speculative)]
        environment = dict(os.environ)
        environment.update(
            {
                "DO_NOT_TRACK": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "LMCACHE_TRACK_USAGE": "false",
                "PYTHONUNBUFFERED": "1",
            }
        )
        environment.update(env or {})
        self.log_path = log
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environment,
            start_new_session=True,
        )
        self.answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._answer(600)  # {"ready": true}

    def _read(self) -> None:
        assert self.process.stdout is not None
        sink = self.log_path.open("a") if self.log_path else None
        for line in self.process.stdout:
            if line.startswith(PREFIX):
                self.answers.put(json.loads(line[len(PREFIX) :]))
            else:
                self.lines.append(line)
                del self.lines[:-200]
                if sink:
                    sink.write(line)
                    sink.flush()
        self.answers.put(None)

    def _answer(self, timeout_s: float) -> dict[str, Any]:
        try:
            answer = self.answers.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"the engine did not answer within {timeout_s} s:\n{''.join(self.lines[-40:])}"
            ) from None
        if answer is None:
            raise AssertionError(f"the engine exited:\n{''.join(self.lines[-60:])}")
        return answer

    def call(self, timeout_s: float = 300, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._answer(timeout_s)

    def generate(
        self, prompts: list[list[int]], max_tokens: int = 16, timeout_s: float = 300
    ) -> list[dict[str, Any]]:
        return self.call(timeout_s, op="generate", prompts=prompts, max_tokens=max_tokens)[
            "outputs"
        ]

    def counters(self) -> dict[str, float]:
        """Every counter of vLLM's metrics by name (the engine needs ``--stats``)."""
        return self.call(op="counters")["counters"]

    def reset(self, within_s: float = 10.0, **flags: bool) -> None:
        """``reset_prefix_cache``, asked again while vLLM refuses it for up to ``within_s``: a
        finished request's blocks wait for the workers' report that its calls are over, which
        under async scheduling may come a step after ``generate`` returned. ``flags``: the
        engine's ``running`` and ``connector`` (``reset_running_requests``, ``reset_connector``)."""
        deadline = time.monotonic() + within_s
        while not (answer := self.call(op="reset", **flags))["reset"]:
            assert time.monotonic() < deadline, f"reset_prefix_cache refused: {answer}"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.call(30, op="quit")
                self.process.wait(60)
            except (AssertionError, subprocess.TimeoutExpired, BrokenPipeError, OSError):
                pass
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


def speculative_engine(
    model: Path, speculative: dict[str, Any], log: Path, socket: Path | None = None
) -> Iterator[Engine]:
    """A speculative-decoding engine, stopped when the generator ends: with the connector on
    ``socket`` and vLLM's metrics (``--stats``), or with no connector where no socket is given
    (the reference: outputs computed cold)."""
    engine = (
        Engine(model, socket=socket, log=log, speculative=speculative, extra_args=("--stats",))
        if socket is not None
        else Engine(model, connector="none", log=log, speculative=speculative)
    )
    yield engine
    engine.stop()


#: vLLM's speculative-decoding counters (``Engine.counters``): draft tokens proposed, accepted.
DRAFTS, ACCEPTED = "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens"


def repeated(seed: int, length: int, period: int = 40) -> list[int]:
    """``length`` tokens repeating a random phrase of ``period`` tokens (ngram drafts find it)."""
    phrase = prompt(seed, period)
    return [phrase[i % period] for i in range(length)]


def loadable(tokens: int, chunk: int = 128) -> int:
    """The tokens a prompt of ``tokens`` can load: whole chunks, short of its last token."""
    return (tokens - 1) // chunk * chunk


def decoded_chunks_load_as_cold(
    engine: Engine,
    reference: Engine,
    daemon: Daemon,
    longer: list[int],
    stored: dict[str, Any],
    local_hit: int,
) -> None:
    """``longer`` is a prompt ``engine`` stored (``stored``: the daemon's status after) and 300
    of the tokens it generated: vLLM's own prefix cache holds its ten full chunks, three of them
    filled by decode steps. It is served ``local_hit`` tokens from there, and the chunks tierkv
    lacks are stored from vLLM's blocks; after a reset all ten load from tierkv. Its output must
    equal ``reference``'s (no connector) every time: only if those blocks held every verified
    token's KV and nothing of a rejected draft."""
    reference_out = reference.generate([longer], max_tokens=32)[0]
    first = engine.generate([longer], max_tokens=32)[0]
    assert first["cached"] == local_hit, "vLLM's own hit"
    assert first["tokens"] == reference_out["tokens"]
    grown = daemon.eventually(
        "the three chunks computed while decoding are stored",
        lambda s: is_idle(s) and s["tiers"][0]["objects"] - stored["tiers"][0]["objects"] == 3,
    )
    engine.reset()
    loaded = engine.generate([longer], max_tokens=32)[0]
    assert loaded["cached"] == loadable(len(longer)) == 1280
    assert daemon.status()["hit_tokens"] - grown["hit_tokens"] == 1280
    assert loaded["tokens"] == reference_out["tokens"]


def prompt(seed: int, length: int, prefix: list[int] | None = None) -> list[int]:
    """``length`` deterministic token ids (after ``prefix``), all valid words of the tiny model."""
    state = seed * 2654435761 % (1 << 32) or 1
    out = list(prefix or [])
    while len(out) < length:
        state = (state * 1103515245 + 12345) % (1 << 31)
        out.append(3 + state % 31000)
    return out
