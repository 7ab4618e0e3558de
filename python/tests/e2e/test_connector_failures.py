"""Whatever fails inside the connector's hooks is a miss or a recompute for vLLM: never an
exception in its step, never a block vLLM reads that nobody wrote. Each test drives both halves
over a real daemon (``halves.py``) and makes one thing fail: a prompt the hash refuses, the
connector's own bookkeeping broken, a plan the worker cannot carry out, a failed collective."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from halves import BLOCK, Halves, request, scheduler_output
from vllm.v1.request import Request

from tierkv.client import Client
from tierkv.errors import BadBuffer
from tierkv.hashing import prefix_hashes
from tierkv.vllm.plan import LoadOp, Settings, StoreOp, TierKVMetadata
from tierkv.vllm.scheduler import SchedulerSide
from tierkv.vllm.worker import WorkerSide

#: 3 chunks and one token: a lookup asks for all 3 chunks (vLLM computes the last token).
PROMPT = list(range(1000, 1000 + 3 * BLOCK + 1))


@pytest.fixture
def halves(tmp_path: Path) -> Iterator[Halves]:
    with Halves(tmp_path / "daemon") as h:
        yield h


#: :data:`PROMPT`'s first three blocks, then two blocks and a token it does not have.
EXTENDED = PROMPT[: 3 * BLOCK] + list(range(7000, 7000 + 2 * BLOCK + 1))


def _hit(halves: Halves, req_id: str, prompt: list[int] = PROMPT) -> Request:
    """A request for ``prompt`` (:data:`PROMPT`, or one that shares its first three blocks)
    after :data:`PROMPT` was stored from blocks 0-2: a hit of 48 tokens."""
    halves.store(request("cold", PROMPT), [0, 1, 2, 3])
    r = request(req_id, prompt)
    assert halves.matched(r) == 3 * BLOCK
    return r


def test_a_loaded_prefix_arrives_byte_exact(halves: Halves) -> None:
    # The control for the tests below: nothing fails, the blocks hold the stored KV.
    r = _hit(halves, "r")
    halves.scheduler.update_state_after_alloc(r, 3 * BLOCK)
    meta = halves.step([(r, [4, 5, 6, 7], 3 * BLOCK, 1)])
    assert [len(op.chunks) for op in meta.loads] == [3] and not meta.unloadable
    assert halves.worker.take_load_errors() == set()
    assert halves.holds([4, 5, 6], like=[0, 1, 2])


def test_a_step_that_schedules_nothing_is_marked_idle_for_the_workers(halves: Halves) -> None:
    # vLLM runs such steps back to back while a finished request's blocks wait on the workers;
    # the workers wait a little in them (IDLE_SETTLE_WAIT_S) rather than spin.
    assert halves.scheduler.build_connector_meta(scheduler_output([])).idle
    r = request("r", list(range(2 * BLOCK)))
    busy = scheduler_output([(r, [0, 1], 0, 2 * BLOCK)])
    assert not halves.scheduler.build_connector_meta(busy).idle


def test_a_prompt_the_hash_refuses_is_a_miss_not_an_exception(halves: Halves) -> None:
    # A token id past u32 cannot be hashed (OverflowError): no hit, and never asked again.
    r = request("big", [1 << 32, *PROMPT[1:]])
    for _ in range(3):
        assert halves.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
    assert halves.scheduler.guard.failures == 1, "hashed once, then known unhashable"
    halves.scheduler.update_state_after_alloc(r, 0)
    assert not halves.scheduler.request_finished(r)


def test_tokens_vllm_accepted_that_the_plan_cannot_load_are_reported_not_read(
    halves: Halves,
) -> None:
    # vLLM counts the 48 tokens computed once update_state_after_alloc is called; the
    # connector's state for the request is broken there (a bookkeeping bug): the step's blocks
    # 4-6 get no load, and must be reported, or vLLM would read them as they are.
    r = _hit(halves, "r")
    halves.scheduler.requests["r"].hit_chunks = None  # type: ignore[assignment]
    halves.scheduler.update_state_after_alloc(r, 3 * BLOCK)
    stored = halves.worker.stored_chunks
    meta = halves.step([(r, [4, 5, 6, 7], 3 * BLOCK, 1)])
    assert meta.loads == [] and meta.unloadable == {"r": [4, 5, 6]}
    assert halves.worker.take_load_errors() == {4, 5, 6}
    assert halves.zero([4, 5, 6, 7])
    # Nothing is stored of what r computed over those blocks: the lookup found the daemon
    # holding all three chunks, so no store of them is even planned.
    assert meta.stores == [] and halves.worker.stored_chunks == stored
    # With no call to the daemon, its blocks are vLLM's to free at once.
    assert halves.scheduler.request_finished(r) is False
    assert halves.worker.get_finished({"r"}) == set()
    halves.no_lookup_left_open()


def test_a_promised_load_the_plan_drops_without_an_error_is_reported(halves: Halves) -> None:
    # The lookup is gone by the time the step is planned (released by a slip elsewhere): the
    # old plan made no load and said nothing, so vLLM read blocks nobody wrote.
    r = _hit(halves, "r")
    halves.scheduler.update_state_after_alloc(r, 3 * BLOCK)
    halves.scheduler._release(halves.scheduler.requests["r"])  # noqa: SLF001
    meta = halves.step([(r, [4, 5, 6, 7], 3 * BLOCK, 1)])
    assert meta.loads == [] and meta.unloadable == {"r": [4, 5, 6]}
    assert halves.worker.take_load_errors() == {4, 5, 6}


def test_one_requests_broken_plan_spares_the_others_and_reports_its_blocks(
    halves: Halves,
) -> None:
    r = _hit(halves, "r")
    other = request("other", list(range(5000, 5000 + 2 * BLOCK + 1)))
    assert halves.matched(other) == 0
    halves.scheduler.update_state_after_alloc(other, 0)
    halves.scheduler.update_state_after_alloc(r, 3 * BLOCK)
    halves.scheduler.requests["r"].chunks = None  # type: ignore[assignment]
    halves.fill([8, 9], seed=2)
    before = halves.worker.stored_chunks
    meta = halves.step([(r, [4, 5, 6, 7], 3 * BLOCK, 1), (other, [8, 9, 10], 0, 2 * BLOCK + 1)])
    assert meta.unloadable == {"r": [4, 5, 6]}
    assert halves.worker.take_load_errors() == {4, 5, 6}
    assert halves.worker.stored_chunks - before == 2, "the other request stored its chunks"


def test_a_finished_request_whose_release_fails_still_keeps_its_blocks(halves: Halves) -> None:
    r = _hit(halves, "r")
    halves.scheduler.update_state_after_alloc(r, 3 * BLOCK)
    halves.step([(r, [4, 5, 6, 7], 3 * BLOCK, 1)])
    state = halves.scheduler.requests["r"]
    state.lookups = [1, 2]  # more lookups than sessions: the release raises
    assert halves.scheduler.request_finished(r) is True, "it had a load: the workers report it"
    assert halves.worker.get_finished({"r"}) == {"r"}


def test_a_load_the_worker_cannot_read_is_reported_and_the_others_load(halves: Halves) -> None:
    r = _hit(halves, "r")
    halves.scheduler.update_state_after_alloc(r, 3 * BLOCK)
    meta = halves.scheduler.build_connector_meta(
        scheduler_output([(r, [4, 5, 6, 7], 3 * BLOCK, 1)])
    )
    chunk = prefix_hashes(PROMPT, BLOCK)[0]
    # A load with no lookup for this rank (a plan that does not fit the TP size).
    meta.loads.insert(0, LoadOp("broken", [], [(chunk, [10])]))
    halves.worker.start_load_kv(meta)
    assert halves.worker.take_load_errors() == {10}
    assert halves.holds([4, 5, 6], like=[0, 1, 2]), "the other load went through"


def test_a_worker_whose_kv_cannot_be_registered_runs_without_the_daemon(halves: Halves) -> None:
    chunk = prefix_hashes(PROMPT, BLOCK)[0]
    worker = WorkerSide(halves.settings, "m", BLOCK, 0, 1, False, num_blocks=16)
    # No dimension of 16 blocks: the layout cannot be described to the daemon.
    worker.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(5, 4)})
    assert worker.link is None
    assert worker.without_daemon is not None and "LayoutError" in worker.without_daemon
    worker.start_load_kv(TierKVMetadata(loads=[LoadOp("r", [1], [(chunk, [3])])]))
    assert worker.take_load_errors() == {3}
    worker.wait_for_save(TierKVMetadata(stores=[StoreOp("s", [(chunk, [4])])]))
    assert worker.stored_chunks == 0
    worker.shutdown()


def test_a_worker_whose_registration_the_daemon_refuses_runs_without_it(
    halves: Halves, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a daemon answers memory it cannot map (a GPU's VMM memory, sleep mode's): it would
    # answer it again at every try, so the worker does not try again.
    def refused(*_args: object, **_kwargs: object) -> int:
        raise BadBuffer("cuda_ipc region 0: the driver will not open this handle")

    monkeypatch.setattr(Client, "register_kv", refused)
    worker = WorkerSide(halves.settings, "m", BLOCK, 0, 1, False, num_blocks=6)
    try:
        worker.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(6, 2, BLOCK, 8)})
        assert worker.link is None and worker.memory is None
        assert worker.without_daemon is not None and "BadBuffer" in worker.without_daemon
    finally:
        worker.shutdown()


def _connector(scheduler: SchedulerSide | None = None, worker: WorkerSide | None = None) -> Any:
    """A ``TierKVConnector`` over these halves (its constructor needs a whole engine)."""
    from tierkv.vllm.connector import TierKVConnector

    connector = TierKVConnector.__new__(TierKVConnector)
    connector._scheduler, connector._worker = scheduler, worker  # noqa: SLF001
    return connector


def test_once_a_worker_runs_without_the_daemon_the_scheduler_reports_no_hits(
    halves: Halves, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    first = _hit(halves, "first")
    halves.scheduler.update_state_after_alloc(first, 0)
    # TP ranks 1 and 2 could not register their KV (rank 0, the healthy one, says nothing).
    workers = [halves.worker]
    for rank in (1, 2):
        broken = WorkerSide(halves.settings, "m", BLOCK, rank, 3, False, num_blocks=16)
        broken.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(5, 4)})
        workers.append(broken)
    try:
        metas = [_connector(worker=w).build_connector_worker_meta() for w in workers]
        assert metas[0] is None and all(m is not None for m in metas[1:])
        # vLLM's own aggregation of the ranks' step outputs, and its call of the scheduler's.
        outputs = [
            ModelRunnerOutput.with_kv_conn_output_only(
                KVConnectorOutput(kv_connector_worker_meta=meta)
            )
            for meta in metas
        ]
        merged = KVOutputAggregator(len(workers)).aggregate(outputs)
        assert merged is not None and merged.kv_connector_output is not None
        said = merged.kv_connector_output.kv_connector_worker_meta
        assert sorted(said.without_daemon) == [1, 2]
        scheduler = _connector(scheduler=halves.scheduler)
        before = int(halves.daemon.status()["lookups"])
        with caplog.at_level(logging.WARNING, logger="tierkv.vllm.scheduler"):
            for _ in range(3):
                scheduler.update_connector_output(merged.kv_connector_output)
        warnings = [r for r in caplog.records if "run without the daemon" in r.getMessage()]
        assert len(warnings) == 1 and "LayoutError" in warnings[0].getMessage()
        # The daemon holds the prefix, but no rank could load it: no hit, and no lookup made.
        assert halves.scheduler.get_num_new_matched_tokens(request("r", PROMPT), 0) == (0, False)
        assert int(halves.daemon.status()["lookups"]) == before
    finally:
        for w in workers[1:]:
            w.shutdown()


def test_the_kv_is_registered_when_vllm_registers_it_or_at_the_first_call_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from harness import start_daemon

    daemon = start_daemon(tmp_path / "daemon")
    # retry_s 0: a daemon that refused the connection is tried again at the next call.
    settings = Settings.from_extra({"socket": str(daemon.socket), "timeout_s": 2.0, "retry_s": 0.0})
    layers = {"model.layers.0.self_attn.attn": torch.zeros(6, 2, BLOCK, 8)}
    chunk = prefix_hashes(list(range(BLOCK)), BLOCK)[0]
    worker = WorkerSide(settings, "m", BLOCK, 0, 1, False, num_blocks=6)
    late = WorkerSide(settings, "m", BLOCK, 0, 1, False, num_blocks=6)
    try:
        # At registration: the session is open before any step, its KV registered on it.
        worker.register_kv_caches(layers)
        assert worker.link is not None and worker.link.generation == 1
        assert daemon.status()["connected_workers"] == 1
        # A daemon not there yet: the engine starts all the same, and the first store after
        # the daemon came registers the KV and goes through.
        daemon.stop()
        with caplog.at_level(logging.WARNING, logger="tierkv.vllm.worker"):
            late.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(6, 2, BLOCK, 8)})
        assert late.link is not None and late.link.generation == 0
        assert "no session with the daemon yet" in caplog.text
        assert late.without_daemon is None, "a daemon not there yet is waited for"
        daemon.start()
        late.wait_for_save(TierKVMetadata(stores=[StoreOp("s", [(chunk, [1])])]))
        assert late.stored_chunks == 1 and late.link.generation == 1
    finally:
        worker.shutdown()
        late.shutdown()
        daemon.stop()


def test_kv_tensors_left_half_moved_stop_the_engine(tmp_path: Path) -> None:
    from tierkv.vllm.guard import EngineStateUnknown

    settings = Settings.from_extra({"socket": str(tmp_path / "none.sock")})
    worker = WorkerSide(settings, "m", BLOCK, 0, 1, False, num_blocks=6)
    layers = {"model.layers.0.self_attn.attn": torch.zeros(6, 2, BLOCK, 8)}
    # A view the engine reads through that the move could not reach: the engine would write
    # and read the KV through tensors that no longer share memory. No fallback repairs that.
    elsewhere = torch.zeros(6, 2, BLOCK, 8)
    with pytest.raises(EngineStateUnknown, match="not backed by the memfd"):
        worker.register_kv_caches(layers, lambda: [elsewhere])


def test_a_failed_agreement_on_loads_keeps_the_loading_requests_from_storing(
    halves: Halves,
) -> None:
    # With a TP group whose all-reduce fails, the rank cannot know whether another rank's load
    # failed: the requests that loaded this step store nothing, the others store.
    r = _hit(halves, "r")
    halves.scheduler.update_state_after_alloc(r, 3 * BLOCK)
    meta = halves.scheduler.build_connector_meta(
        scheduler_output([(r, [4, 5, 6, 7], 3 * BLOCK, 1)])
    )
    chunks = prefix_hashes(list(range(7000, 7000 + 2 * BLOCK)), BLOCK)
    meta.stores += [StoreOp("r", [(chunks[0], [7])]), StoreOp("s", [(chunks[1], [8])])]
    halves.worker.tp_group = object()  # type: ignore[assignment]
    before = halves.worker.stored_chunks
    halves.worker.start_load_kv(meta)
    halves.worker.wait_for_save(meta)
    assert halves.worker.stored_chunks - before == 1, "only the request that did not load"


def test_a_broken_record_of_unanswered_calls_holds_that_request_only(halves: Halves) -> None:
    worker = halves.worker
    chunk = prefix_hashes(PROMPT, BLOCK)[0]
    worker.wait_for_save(
        TierKVMetadata(stores=[StoreOp("a", [(chunk, [0])]), StoreOp("b", [(chunk, [1])])])
    )
    worker._unanswered["b"] = [None]  # type: ignore[list-item]  # noqa: SLF001
    assert worker.get_finished({"a", "b"}) == {"a"}, "b's blocks stay held; a is freed"
    del worker._unanswered["b"]  # noqa: SLF001
    assert worker.get_finished(set()) == {"b"}, "asked again at the next step"


def test_a_dead_daemon_costs_a_warning_per_kind_not_one_per_request(
    halves: Halves, caplog: pytest.LogCaptureFixture
) -> None:
    chunk = prefix_hashes(PROMPT, BLOCK)[0]
    halves.worker.wait_for_save(TierKVMetadata(stores=[StoreOp("a", [(chunk, [0])])]))
    halves.daemon.kill()
    caplog.set_level(logging.DEBUG, logger="tierkv")
    for i in range(30):
        r = request(f"r{i}", [i, *PROMPT])
        assert halves.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
        load = LoadOp(f"r{i}", [1], [(chunk, [i % 16])])
        halves.worker.start_load_kv(TierKVMetadata(loads=[load]))
        assert halves.worker.take_load_errors() == {i % 16}
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    # The scheduler's and the worker's links going down, a failed lookup, a failed load.
    assert len(warnings) <= 4, [r.getMessage() for r in warnings]
    assert sum("failed" in r.getMessage() for r in caplog.records) >= 60, "the rest at debug"


def test_what_was_computed_over_unloadable_blocks_is_never_stored(halves: Halves) -> None:
    # Whether or not the step's start_load_kv ran (or failed before it marked them), the
    # request whose blocks no load filled stores nothing this step; another request does.
    chunks = prefix_hashes(list(range(8000, 8000 + 2 * BLOCK)), BLOCK)
    meta = TierKVMetadata(
        stores=[StoreOp("r", [(chunks[0], [2])]), StoreOp("s", [(chunks[1], [3])])],
        unloadable={"r": [0, 1]},
    )
    halves.worker.wait_for_save(meta)
    assert halves.worker.stored_chunks == 1, "only s stored"


def test_a_request_computed_over_another_requests_failed_load_stores_none_of_it(
    halves: Halves,
) -> None:
    # vLLM's prefix cache gives b, scheduled in a's step, the blocks a's load fills. a's load
    # fails: b computed its new chunks over blocks nobody wrote. Stored, they would be served
    # under the right ids to every later request; vLLM recomputes b, and nothing of it is kept.
    a = _hit(halves, "a")
    halves.scheduler.update_state_after_alloc(a, 3 * BLOCK)
    b = request("b", PROMPT[: 3 * BLOCK] + list(range(5000, 5000 + 2 * BLOCK + 1)))
    assert halves.matched(b, 3 * BLOCK) == 0, "vLLM's own cache holds what tierkv would load"
    halves.scheduler.update_state_after_alloc(b, 0)
    meta = halves.scheduler.build_connector_meta(
        scheduler_output(
            [(a, [4, 5, 6, 7], 3 * BLOCK, 1), (b, [4, 5, 6, 10, 11, 12], 3 * BLOCK, 2 * BLOCK + 1)]
        )
    )
    assert [op.after for op in meta.stores if op.req_id == "b"] == [["a"]]
    meta.loads[0].lookups = [987_654]  # a load the daemon refuses
    before = halves.worker.stored_chunks
    halves.worker.start_load_kv(meta)
    assert halves.worker.take_load_errors() == {4, 5, 6}
    halves.worker.wait_for_save(meta)
    assert halves.worker.stored_chunks == before, "b stored what it computed over a's blocks"
    c = request("c", b.prompt_token_ids or [])
    assert halves.matched(c) == 3 * BLOCK, "only what a's earlier store holds"


def test_under_async_scheduling_the_next_steps_stores_wait_on_this_steps_failed_loads(
    halves: Halves,
) -> None:
    # vLLM plans the next step before it hears that a load failed: a's store of what it
    # computed next over the unwritten blocks is dropped too; the step after stores again.
    worker = halves.worker
    first, later, last = prefix_hashes(list(range(9000, 9000 + 3 * BLOCK)), BLOCK)
    worker.start_load_kv(TierKVMetadata(loads=[LoadOp("a", [987_654], [(first, [0])])]))
    assert worker.take_load_errors() == {0}
    worker.wait_for_save(TierKVMetadata())
    worker.wait_for_save(TierKVMetadata(stores=[StoreOp("a", [(later, [1])], after=["a"])]))
    assert worker.stored_chunks == 0, "computed over block 0 before vLLM knew"
    worker.wait_for_save(TierKVMetadata(stores=[StoreOp("a", [(last, [2])], after=[])]))
    assert worker.stored_chunks == 1


def test_a_request_that_loads_again_right_after_a_failed_load_stores_what_it_computes(
    halves: Halves,
) -> None:
    # a's load fails; before the next step vLLM resets its prefix cache, which preempts a and
    # resumes it in that step: it looks up and loads again, and that load succeeds. What it
    # computes over it depends on this step's load only: the last step's failure must not drop
    # it (the scheduler half counts it stored, so it would never be stored: a miss for good).
    scheduler, worker = halves.scheduler, halves.worker
    a = _hit(halves, "a", EXTENDED)
    scheduler.update_state_after_alloc(a, 3 * BLOCK)
    blocks = [4, 5, 6, 7, 8, 9]
    meta = scheduler.build_connector_meta(scheduler_output([(a, blocks, 3 * BLOCK, 2 * BLOCK + 1)]))
    meta.loads[0].lookups = [987_654]  # a load the daemon refuses
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    assert worker.take_load_errors() == {4, 5, 6}
    scheduler.update_connector_output({4, 5, 6})
    a.num_preemptions += 1  # reset_prefix_cache(reset_running_requests=True)
    assert halves.matched(a) == 3 * BLOCK
    scheduler.update_state_after_alloc(a, 3 * BLOCK)
    before = worker.stored_chunks
    meta = halves.step([(a, blocks, 3 * BLOCK, 2 * BLOCK + 1)], preempted=("a",))
    assert [op.req_id for op in meta.loads] == ["a"]
    assert [op.after for op in meta.stores] == [["a"]], "computed over this step's load"
    assert worker.take_load_errors() == set()
    assert worker.stored_chunks == before + 2, "dropped for the last step's failed load"


def test_a_failed_load_does_not_drop_a_store_over_the_requests_earlier_good_load(
    halves: Halves,
) -> None:
    # a loads into blocks 4-6, and that load is good. vLLM resets its prefix cache: a is
    # preempted, and its blocks go to others at once: b writes block 6 anew and stores it,
    # still counted as depending on a's load of the last step. a resumes in the same step and
    # loads again, and that load fails: it does not concern b's store.
    scheduler, worker = halves.scheduler, halves.worker
    a = _hit(halves, "a")
    scheduler.update_state_after_alloc(a, 3 * BLOCK)
    halves.step([(a, [4, 5, 6, 7], 3 * BLOCK, 1)])
    assert worker.take_load_errors() == set()
    a.num_preemptions += 1  # reset_prefix_cache(reset_running_requests=True)
    b = request("b", list(range(8000, 8000 + 2 * BLOCK + 1)))
    assert halves.matched(b) == 0
    scheduler.update_state_after_alloc(b, 0)
    assert halves.matched(a) == 3 * BLOCK
    scheduler.update_state_after_alloc(a, 3 * BLOCK)
    meta = scheduler.build_connector_meta(
        scheduler_output(
            [(a, [8, 9, 10, 11], 3 * BLOCK, 1), (b, [6, 12, 13], 0, 2 * BLOCK + 1)],
            preempted=("a",),
        )
    )
    assert [op.after for op in meta.stores if op.req_id == "b"] == [["a"]]
    meta.loads[0].lookups = [987_654]  # a load the daemon refuses
    before = worker.stored_chunks
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    assert worker.take_load_errors() == {8, 9, 10}
    assert worker.stored_chunks == before + 2, "dropped for a's failed load of this step"


def test_stores_a_failed_load_dropped_are_made_after_a_preemption_heard_of_first(
    halves: Halves,
) -> None:
    # Under async scheduling vLLM preempts a in the plan of the next step before it hears
    # that a's load failed: the stores that step dropped (of what a computed over the unwritten
    # blocks) are planned again once a resumes and recomputes them.
    scheduler, worker = halves.scheduler, halves.worker
    a = _hit(halves, "a", EXTENDED)
    scheduler.update_state_after_alloc(a, 3 * BLOCK)
    meta = scheduler.build_connector_meta(
        scheduler_output([(a, [4, 5, 6, 7, 8, 9], 3 * BLOCK, 2 * BLOCK + 1)])
    )
    meta.loads[0].lookups = [987_654]  # a load the daemon refuses
    before = worker.stored_chunks
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    assert worker.stored_chunks == before, "computed over the blocks the load left unwritten"
    preempting = scheduler.build_connector_meta(scheduler_output([], preempted=("a",)))
    a.num_preemptions += 1
    scheduler.update_connector_output(worker.take_load_errors())  # the report comes now
    worker.start_load_kv(preempting)
    worker.wait_for_save(preempting)
    assert halves.matched(a) == 3 * BLOCK
    scheduler.update_state_after_alloc(a, 3 * BLOCK)
    halves.fill([13, 14], seed=3)
    meta = halves.step([(a, [10, 11, 12, 13, 14, 15], 3 * BLOCK, 2 * BLOCK + 1)])
    assert [held for op in meta.stores for _, held in op.chunks] == [[13], [14]]
    assert worker.stored_chunks == before + 2


def test_what_vllm_recomputes_after_a_failed_load_is_stored(halves: Halves) -> None:
    # a's load of its first three chunks fails in the step that computes its next two over
    # them: those two are not stored. vLLM hears of it before it plans the next step (no async
    # scheduling) and recomputes a from block 4; what it computes then is stored, so the next
    # request with the prompt finds all five chunks.
    scheduler, worker = halves.scheduler, halves.worker
    a = _hit(halves, "a", EXTENDED)
    scheduler.update_state_after_alloc(a, 3 * BLOCK)
    blocks = [4, 5, 6, 7, 8, 9]
    meta = scheduler.build_connector_meta(scheduler_output([(a, blocks, 3 * BLOCK, 2 * BLOCK + 1)]))
    assert [op.after for op in meta.stores] == [["a"]]
    meta.loads[0].lookups = [987_654]  # a load the daemon refuses
    worker.start_load_kv(meta)
    assert worker.take_load_errors() == {4, 5, 6}
    halves.fill([7, 8], seed=2)
    before = worker.stored_chunks
    worker.wait_for_save(meta)
    assert worker.stored_chunks == before, "computed over the blocks the load left unwritten"
    scheduler.update_connector_output({4, 5, 6})  # vLLM hears of it, and recomputes a
    halves.fill(blocks[:5], seed=3)
    meta = halves.step([(a, blocks, 0, 5 * BLOCK + 1)])
    assert [[c for c, _ in op.chunks] for op in meta.stores] == [
        prefix_hashes(EXTENDED, BLOCK)[:5]
    ], "every chunk recomputed, stored"
    assert [op.after for op in meta.stores] == [[]], "planned after vLLM heard"
    assert worker.stored_chunks > before
    c = request("c", EXTENDED)
    assert halves.matched(c) == 5 * BLOCK


def test_a_store_over_blocks_a_failed_load_left_unwritten_is_dropped_however_late(
    halves: Halves,
) -> None:
    # Under the recompute policy vLLM keeps a failed load's blocks in its prefix cache until a
    # request computes into them again: a request that reads them steps later computes over
    # blocks nobody wrote, long after the load's own step; nothing of it may be stored.
    scheduler, worker = halves.scheduler, halves.worker
    a = _hit(halves, "a")
    scheduler.update_state_after_alloc(a, 3 * BLOCK)
    meta = scheduler.build_connector_meta(scheduler_output([(a, [4, 5, 6, 7], 3 * BLOCK, 1)]))
    meta.loads[0].lookups = [987_654]  # a load the daemon refuses
    worker.start_load_kv(meta)
    assert worker.take_load_errors() == {4, 5, 6}
    worker.wait_for_save(meta)
    scheduler.update_connector_output({4, 5, 6})  # vLLM hears of it
    for _ in range(3):
        worker.wait_for_save(scheduler.build_connector_meta(scheduler_output([])))
    b = request("b", PROMPT[: 3 * BLOCK] + list(range(6000, 6000 + 2 * BLOCK + 1)))
    assert halves.matched(b, 3 * BLOCK) == 0, "vLLM's own cache holds what tierkv would load"
    scheduler.update_state_after_alloc(b, 0)
    meta = scheduler.build_connector_meta(
        scheduler_output([(b, [4, 5, 6, 10, 11, 12], 3 * BLOCK, 2 * BLOCK + 1)])
    )
    assert [op.chunks for op in meta.stores if op.req_id == "b"] == [[]], "b read a's blocks"
    before = worker.stored_chunks
    worker.wait_for_save(meta)
    assert worker.stored_chunks == before
    # A request that computes into those blocks from the start writes them whole: what is then
    # computed over them is stored again.
    c = request("c", list(range(7000, 7000 + 3 * BLOCK + 1)))
    assert halves.matched(c) == 0
    scheduler.update_state_after_alloc(c, 0)
    meta = scheduler.build_connector_meta(scheduler_output([(c, [4, 5, 6, 13], 0, 3 * BLOCK + 1)]))
    assert [len(op.chunks) for op in meta.stores if op.req_id == "c"] == [3]
    worker.wait_for_save(meta)
    assert worker.stored_chunks == before + 3


@pytest.mark.parametrize("how", ["preempted", "aborted"])
def test_a_request_let_go_before_its_loading_step_runs_still_loads(
    halves: Halves, how: str
) -> None:
    # Under async scheduling vLLM plans the next step while the last one is in flight, and may
    # preempt a request there (or abort it between the two) whose synchronous load that step
    # has yet to make. Its lookup's release waits until the step has run: the daemon refuses a
    # retrieve through a lookup released first (unknown lookup), a load vLLM recomputes for
    # nothing. The releases are made here, when the test says, not on the background thread.
    scheduler, worker = halves.scheduler, halves.worker
    scheduler.steps_in_flight = 2  # async scheduling's max_concurrent_batches
    scheduler.releases.put(None)
    scheduler.releaser.join()

    def release_queued() -> None:
        while not scheduler.releases.empty():
            item = scheduler.releases.get()
            assert isinstance(item, tuple)
            scheduler._release_one(*item, 0, [])  # noqa: SLF001

    a = _hit(halves, "a")
    scheduler.update_state_after_alloc(a, 3 * BLOCK)
    in_flight = scheduler.build_connector_meta(scheduler_output([(a, [4, 5, 6, 7], 3 * BLOCK, 1)]))
    assert [op.req_id for op in in_flight.loads] == ["a"]
    if how == "aborted":
        assert scheduler.request_finished(a), "its blocks wait for the workers"
    scheduler.build_connector_meta(scheduler_output([], preempted=(how == "preempted") * ("a",)))
    assert scheduler.has_held_back_releases(), "vLLM would stop stepping with a release held back"
    release_queued()
    worker.start_load_kv(in_flight)
    worker.wait_for_save(in_flight)
    assert worker.take_load_errors() == set(), "its lookup was released before it loaded"
    assert halves.holds([4, 5, 6], like=[0, 1, 2])
    # The step that loaded has run once the plan after the next is made: the release goes out.
    scheduler.build_connector_meta(scheduler_output([]))
    assert not scheduler.has_held_back_releases()
    assert not scheduler.releases.empty(), "the release held back is never sent"
    release_queued()


def test_a_request_preempted_and_resumed_in_one_step_still_loads(halves: Halves) -> None:
    # vLLM's reset of its prefix cache (reset_running_requests) preempts every running request
    # outside a schedule and resumes them in the next step, whose output names them preempted
    # too: the resumed request's new lookup and load must survive that report.
    r = _hit(halves, "r")
    halves.scheduler.update_state_after_alloc(r, 3 * BLOCK)
    halves.step([(r, [4, 5, 6, 7], 3 * BLOCK, 1)])
    assert halves.worker.take_load_errors() == set()
    r.num_preemptions += 1  # as vLLM's _preempt_request does
    assert halves.matched(r) == 3 * BLOCK
    halves.scheduler.update_state_after_alloc(r, 3 * BLOCK)
    meta = halves.step([(r, [8, 9, 10, 11], 3 * BLOCK, 1)], preempted=("r",))
    assert [len(op.chunks) for op in meta.loads] == [3] and not meta.unloadable
    assert halves.worker.take_load_errors() == set()
    assert halves.holds([8, 9, 10], like=[0, 1, 2])
