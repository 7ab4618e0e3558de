"""How often the scheduler half asks the daemon. vLLM calls get_num_new_matched_tokens at every
scheduler step while a request waits; a lookup that found no usable hit is kept for it until
the hit could have grown, and the daemon's own count of lookups says how many were made."""

from __future__ import annotations

import time
from pathlib import Path

from halves import BLOCK, Halves, request
from vllm.v1.request import Request

from tierkv.hashing import prefix_hashes
from tierkv.vllm.plan import StoreOp, TierKVMetadata

#: 3 chunks and one token: a lookup asks for all 3 chunks.
PROMPT = list(range(2000, 2000 + 3 * BLOCK + 1))


def _lookups(halves: Halves) -> int:
    return int(halves.daemon.status()["lookups"])


def _steps(halves: Halves, r: Request, computed: int, steps: int) -> set[int | None]:
    """vLLM's scheduler asking about a waiting request at ``steps`` steps (the first ones
    answered ``None`` while the lookup is pending); its other answers."""
    answers = {halves.matched(r, computed)}
    answers |= {
        halves.scheduler.get_num_new_matched_tokens(r, computed)[0] for _ in range(steps - 1)
    }
    return answers


def test_a_waiting_request_asks_again_once_this_engine_stored_what_it_missed(
    tmp_path: Path,
) -> None:
    # A long refresh: only this engine's store can explain a second lookup.
    with Halves(tmp_path / "daemon", miss_refresh_s=60.0) as halves:
        waiting = request("waiting", PROMPT)
        base = _lookups(halves)
        assert _steps(halves, waiting, 0, 20) == {0}
        assert _lookups(halves) - base == 1, "one lookup for twenty steps"
        halves.no_lookup_left_open()
        # Another request of this engine computes the same prefix and stores it (one lookup
        # of its own): at the next step the waiting request asks again and loads all of it.
        halves.store(request("other", PROMPT), [0, 1, 2, 3])
        assert halves.matched(waiting) == 3 * BLOCK
        assert _lookups(halves) - base == 3
        # Waiting with a usable hit, it keeps that lookup (and its lease) as before.
        assert _steps(halves, waiting, 0, 5) == {3 * BLOCK}
        assert _lookups(halves) - base == 3 and halves.open_lookups() == 1
        halves.scheduler.update_state_after_alloc(waiting, 0)
        assert not halves.scheduler.request_finished(waiting)
        halves.no_lookup_left_open()
        assert halves.scheduler.waiting_on == {}


def test_a_kept_miss_is_asked_again_after_its_interval_or_when_the_local_hit_shrinks(
    tmp_path: Path,
) -> None:
    with Halves(tmp_path / "daemon", miss_refresh_s=0.5) as halves:
        waiting = request("waiting", PROMPT)
        first = prefix_hashes(PROMPT, BLOCK)[0]
        # The daemon holds the first chunk (stored by another engine: this scheduler half does
        # not know). vLLM's own cache holds two chunks, so that hit is no use.
        halves.fill([0], seed=3)
        halves.worker.wait_for_save(TierKVMetadata(stores=[StoreOp("elsewhere", [(first, [0])])]))
        base = _lookups(halves)
        assert _steps(halves, waiting, 2 * BLOCK, 10) == {0}
        assert _lookups(halves) - base == 1
        # vLLM evicted its own blocks: the same hit now passes what it holds. Asked at once.
        assert halves.matched(waiting, 0) == BLOCK
        assert _lookups(halves) - base == 2
        halves.scheduler.update_state_after_alloc(waiting, 0)
        halves.no_lookup_left_open()
        # Kept again for a while; other engines' stores are seen once the interval has passed.
        assert _steps(halves, waiting, 2 * BLOCK, 10) == {0}
        assert _lookups(halves) - base == 3
        time.sleep(0.6)
        assert _steps(halves, waiting, 2 * BLOCK, 10) == {0}
        assert _lookups(halves) - base == 4
        assert not halves.scheduler.request_finished(waiting)
        halves.no_lookup_left_open()


def test_a_refresh_of_zero_asks_at_every_step(tmp_path: Path) -> None:
    with Halves(tmp_path / "daemon", miss_refresh_s=0.0) as halves:
        waiting = request("waiting", PROMPT)
        base = _lookups(halves)
        # Each answer is a lookup of its own (asked again while it is pending).
        assert {halves.matched(waiting) for _ in range(5)} == {0}
        assert _lookups(halves) - base == 5
        halves.no_lookup_left_open()
