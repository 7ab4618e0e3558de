"""Where the external tokens vLLM accepted came from (``get_external_cache_hit_sources``): the
daemon's tier of each, in vLLM's ``CacheHitSource`` names, adding up to what vLLM accepted.

A lookup's reply counts its hit's chunks per tier without saying which positions each tier held,
so the scheduler half assumes each tier holds its part root first (L1, L2, disk, remote): the
split tests below set those counts on a real hit's request to check the arithmetic."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from halves import BLOCK, Halves, request
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import Request

#: 3 chunks and one token: a lookup asks for all 3 chunks.
PROMPT = list(range(3000, 3000 + 3 * BLOCK + 1))


@pytest.fixture
def halves(tmp_path: Path) -> Iterator[Halves]:
    with Halves(tmp_path / "daemon") as h:
        yield h


def _connector(halves: Halves) -> Any:
    """A ``TierKVConnector`` over the scheduler half (its constructor needs a whole engine)."""
    from tierkv.vllm.connector import TierKVConnector

    connector = TierKVConnector.__new__(TierKVConnector)
    connector._scheduler, connector._worker = halves.scheduler, None  # noqa: SLF001
    return connector


def _hit(halves: Halves, computed: int, per_tier: list[list[int]] | None = None) -> Request:
    """A request for :data:`PROMPT` with its 3-chunk hit, vLLM holding ``computed`` tokens of it;
    ``per_tier``: each rank's per-tier counts to take instead of the daemon's."""
    halves.store(request("cold", PROMPT), [0, 1, 2, 3])
    r = request("r", PROMPT)
    assert halves.matched(r, computed) == 3 * BLOCK - computed
    halves.scheduler.update_state_after_alloc(r, 3 * BLOCK - computed)
    if per_tier is not None:
        halves.scheduler.requests[r.request_id].hit_tiers = per_tier
    return r


def test_a_hit_the_daemon_holds_in_l1_is_host_memory(halves: Halves) -> None:
    r = _hit(halves, BLOCK)
    assert halves.scheduler.requests[r.request_id].hit_tiers == [[3, 0, 0, 0]]
    # vLLM's own prefix cache held the first chunk: the two after it came from the daemon.
    assert _connector(halves).get_external_cache_hit_sources(r, 2 * BLOCK) == {
        CacheHitSource.HOST: 2 * BLOCK
    }
    assert _connector(halves).get_external_cache_hit_sources(r, 0) == {}


@pytest.mark.parametrize(
    ("computed", "accepted", "per_tier", "split"),
    [
        # One chunk from each of L1, L2 and the disk: vLLM's own chunk was the L1 one.
        (BLOCK, 2 * BLOCK, [[1, 1, 1, 0]], {"host": BLOCK, "disk": BLOCK}),
        (0, 3 * BLOCK, [[1, 1, 1, 0]], {"host": 2 * BLOCK, "disk": BLOCK}),
        # vLLM took fewer tokens than the hit: the first ones.
        (0, BLOCK + 3, [[1, 0, 2, 0]], {"host": BLOCK, "disk": 3}),
        # The remote tier (another node's, through Redis) is no tier vLLM names.
        (0, 3 * BLOCK, [[1, 0, 0, 2]], {"host": BLOCK, "external_unspecified": 2 * BLOCK}),
        # Two TP ranks: each position from the slower of the ranks' tiers.
        (0, 3 * BLOCK, [[2, 1, 0, 0], [1, 0, 2, 0]], {"host": BLOCK, "disk": 2 * BLOCK}),
        # A rank's counts not known (a failed query): nothing can be said of any position.
        (0, 3 * BLOCK, [[3, 0, 0, 0], []], {"external_unspecified": 3 * BLOCK}),
    ],
)
def test_the_accepted_tokens_are_split_by_tier_root_first(
    halves: Halves,
    computed: int,
    accepted: int,
    per_tier: list[list[int]],
    split: dict[str, int],
) -> None:
    r = _hit(halves, computed, per_tier)
    sources = _connector(halves).get_external_cache_hit_sources(r, accepted)
    assert sources == {CacheHitSource(name): tokens for name, tokens in split.items()}
    assert sum(sources.values()) == accepted and all(sources.values())


def test_a_split_that_fails_is_unspecified_not_an_exception(
    halves: Halves, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = _hit(halves, 0, [[3, 0, 0, 0]])

    def broken(*_args: object) -> dict[str, int]:
        raise RuntimeError("a bug in the split")

    monkeypatch.setattr(halves.scheduler, "_hit_sources", broken)
    assert _connector(halves).get_external_cache_hit_sources(r, 3 * BLOCK) == {
        CacheHitSource.EXTERNAL_UNSPECIFIED: 3 * BLOCK
    }
