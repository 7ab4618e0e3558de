"""vLLM's reset of the connector's cache (``reset_prefix_cache(reset_connector=True)``: sleep,
``pause_generation`` before a weight update, ``release_kv_cache_memory``): both halves over a
real daemon (``halves.py``). Nothing stored before the reset is loaded after it; a request the
scheduler half knew at the reset is never looked up or stored again, and a load promised before
it is reported failed, not run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from halves import BLOCK, Halves, request, scheduler_output

from tierkv.hashing import prefix_hashes
from tierkv.vllm.scheduler import _Touch

#: 3 chunks and one token: a lookup asks for all 3 chunks.
PROMPT = list(range(3000, 3000 + 3 * BLOCK + 1))
STORED = [0, 1, 2, 3]


@pytest.fixture
def halves(tmp_path: Path) -> Iterator[Halves]:
    with Halves(tmp_path / "daemon") as h:
        h.store(request("stored", PROMPT), STORED)
        yield h


def _lookups(halves: Halves) -> int:
    return int(halves.daemon.status()["lookups"])


def test_a_prompt_stored_before_a_reset_misses_after_it_then_is_stored_again_and_hits(
    halves: Halves,
) -> None:
    assert halves.scheduler.reset_cache() is True
    # A miss (``store`` asserts it), and its three chunks stored as new ones: under the old
    # ids the daemon would have reported them present, and stored none.
    halves.store(request("after", PROMPT), [4, 5, 6, 7])
    objects = halves.daemon.status()["tiers"][0]["objects"]
    assert objects == 6, "the chunks of both epochs are in the daemon"
    again = request("again", PROMPT)
    assert halves.matched(again) == 3 * BLOCK
    halves.scheduler.update_state_after_alloc(again, 3 * BLOCK)
    meta = halves.step([(again, [8, 9, 10, 11], 3 * BLOCK, 1)])
    assert [len(op.chunks) for op in meta.loads] == [3]
    assert halves.worker.take_load_errors() == set()
    # What the request after the reset computed (``fill`` writes each block its own KV), not
    # what was stored before.
    assert halves.holds([8, 9, 10], like=[4, 5, 6])
    assert not halves.holds([8, 9, 10], like=[0, 1, 2])
    assert halves.scheduler.request_finished(again)
    halves.no_lookup_left_open()


def test_a_request_known_at_the_reset_is_neither_looked_up_nor_stored_after_it(
    halves: Halves,
) -> None:
    # Looked up before the reset (a hit it is still waiting with: its lease held), and a
    # prompt the daemon lacks, asked about before the reset too.
    waiting = request("waiting", PROMPT)
    assert halves.matched(waiting) == 3 * BLOCK
    fresh = request("fresh", list(range(7000, 7000 + 3 * BLOCK + 1)))
    assert halves.matched(fresh) == 0
    # The miss's lease goes back on the background thread; the hit's is held.
    halves.daemon.eventually("only the hit is leased", lambda s: s["open_lookups"] == 1)
    halves.scheduler.reset_cache()
    halves.no_lookup_left_open()
    base = _lookups(halves)
    assert halves.matched(waiting) == 0 and halves.matched(fresh) == 0
    assert _lookups(halves) == base, "neither is looked up again"
    halves.scheduler.update_state_after_alloc(waiting, 0)
    halves.scheduler.update_state_after_alloc(fresh, 0)
    halves.fill([4, 5, 6, 7, 8, 9, 10, 11], seed=2)
    stored = halves.worker.stored_chunks
    meta = halves.step(
        [(waiting, [4, 5, 6, 7], 0, 3 * BLOCK + 1), (fresh, [8, 9, 10, 11], 0, 3 * BLOCK + 1)]
    )
    assert meta.stores == [] and meta.loads == []
    assert halves.worker.stored_chunks == stored
    assert halves.daemon.status()["tiers"][0]["objects"] == 3
    # Nothing planned for them: their blocks are vLLM's to free at once, and they are gone.
    assert halves.scheduler.request_finished(waiting) is False
    assert halves.scheduler.request_finished(fresh) is False
    assert halves.scheduler.requests == {}
    halves.no_lookup_left_open()


def test_a_load_promised_before_the_reset_is_reported_failed_not_run(halves: Halves) -> None:
    r = request("r", PROMPT)
    assert halves.matched(r) == 3 * BLOCK
    # vLLM accepted the hit (it counts those tokens computed); the reset comes before the
    # step's plan.
    halves.scheduler.update_state_after_alloc(r, 3 * BLOCK)
    halves.scheduler.reset_cache()
    meta = halves.step([(r, [4, 5, 6, 7], 3 * BLOCK, 1)])
    assert meta.loads == [] and meta.unloadable == {"r": [4, 5, 6]}
    assert halves.worker.take_load_errors() == {4, 5, 6}
    assert halves.zero([4, 5, 6]), "nothing loaded"
    assert meta.stores == []
    assert halves.scheduler.request_finished(r) is False
    halves.no_lookup_left_open()


def test_an_asynchronous_load_planned_or_sent_before_the_reset_is_reported_failed(
    tmp_path: Path,
) -> None:
    with Halves(tmp_path / "daemon", async_loads=True) as halves:
        halves.store(request("stored", PROMPT), STORED)
        scheduler, worker = halves.scheduler, halves.worker
        sent, planned = request("sent", PROMPT), request("planned", PROMPT)
        assert scheduler.get_num_new_matched_tokens(sent, 0) == (3 * BLOCK, True)
        scheduler.update_state_after_alloc(sent, 3 * BLOCK, [4, 5, 6, 7])
        meta = scheduler.build_connector_meta(scheduler_output([]))
        assert [op.req_id for op in meta.async_loads] == ["sent"]
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        # The load runs (its retrieve reads what was stored before the reset) ...
        halves.daemon.eventually("the load is over", lambda s: s["open_lookups"] == 0)
        assert scheduler.get_num_new_matched_tokens(planned, 0) == (3 * BLOCK, True)
        scheduler.update_state_after_alloc(planned, 3 * BLOCK, [8, 9, 10, 11])
        # ... and vLLM resets before it heard of that load, and before the next step's plan.
        scheduler.reset_cache()
        meta = scheduler.build_connector_meta(scheduler_output([]))
        assert meta.async_loads == []
        assert meta.async_unloadable == {"planned": [8, 9, 10]}
        assert meta.stale_loads == ["sent"]
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        finished: set[str] = set()
        errors: set[int] = set()
        deadline = time.monotonic() + 5
        while finished != {"sent", "planned"}:
            assert time.monotonic() < deadline, f"only {finished} reported over"
            finished |= worker.take_finished_recving()[0]
            errors |= worker.take_load_errors()
            time.sleep(0.01)
        assert errors == {4, 5, 6, 8, 9, 10}, "every block of both loads is recomputed"
        scheduler.update_connector_output(errors, finished)
        for r in (sent, planned):
            assert scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
            scheduler.request_finished(r)
        assert scheduler.requests == {}
        halves.no_lookup_left_open()


def test_a_touch_queued_before_the_reset_is_dropped(halves: Halves) -> None:
    scheduler = halves.scheduler
    stale = scheduler.epoch
    scheduler.reset_cache()
    halves.store(request("after", PROMPT), [4, 5, 6, 7])
    base = _lookups(halves)
    # A touch of the stored prompt (vLLM's own cache held it whole) queued before the reset,
    # run after it on the background thread: dropped. It would have leased the three chunks
    # stored before, a lookup the daemon counts.
    scheduler._touch_now(_Touch(prefix_hashes(PROMPT, BLOCK), 3, stale), [])  # noqa: SLF001
    assert _lookups(halves) == base
    # A request met after the reset is touched, under the new epoch's ids (held in L1).
    r = request("r", PROMPT)
    assert scheduler.get_num_new_matched_tokens(r, 3 * BLOCK) == (0, False)
    halves.daemon.eventually("the new request is touched", lambda s: s["lookups"] == base + 1)
