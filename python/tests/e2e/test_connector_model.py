"""A model-based randomized test of what the connector stores after failed loads.

A small vLLM-like engine (block size 16, chunks of 2 blocks, chunked prefill, a prefix cache
that shares block ids, loads of a request's first chunks that fail at random, and vLLM's
reaction to a reported failure under the recompute policy) drives the real scheduler half
(``SchedulerSide``, over a socket that does not exist: lookups are set up directly) and the real
worker half's drop rule (``WorkerSide.start_load_kv`` and ``wait_for_save``, with the daemon
calls ``_load`` and ``_store`` replaced). Beside them the test keeps the truth: for every slot
of every block, whether it holds valid KV. A load that succeeds makes its blocks valid, one that
fails leaves them garbage; a step computing a request's tokens from position ``p`` writes valid
KV only if every slot before ``p`` of the request's blocks is valid (a block written in part
keeps the old state of the rest).

The promise checked at every store the worker sends: every slot of the chunk's blocks is valid
KV. KV computed over blocks a failed load left unwritten, stored, would be served as the right
prefix's KV to every engine. Failing, the test prints the seed and the step-by-step trace.

Blocks come from a small pool, as vLLM's ``BlockPool`` hands them out (12 to 24 blocks, or
plenty): a finished request's blocks are freed at once when ``request_finished`` says so, else
once the worker's ``get_finished`` reports it (the step after vLLM said it finished); a freed
block keeps its prefix cache hash (a hit may take it back) until it is handed out again, from
the free queue's front (blocks without a hash first, then the least recently freed), to a
request that writes it from slot 0. Invalid blocks keep their hash too (the recompute policy).
Short of blocks, vLLM preempts the last running request (its blocks freed without asking the
connector, after the step in flight that computes it under async scheduling), listing it in
``preempted_req_ids``; it resumes later with ``num_preemptions`` moved, from its prefix cache
hit and a new lookup.

Between steps (where vLLM's engine core handles its input queue) a request may be aborted
(``finish_requests``: running or waiting, mid-prefill, with a load or store in flight under async
scheduling; its blocks held for the workers if ``request_finished`` says so, else freed after the
step in flight), and vLLM may reset its prefix cache (``reset_prefix_cache`` with
``reset_running_requests``: every running request preempted outside a schedule, listed in the
next step's ``preempted_req_ids`` and resumed in it where it fits; the hashes dropped only if
no block is in use, else vLLM raises and the requests stay preempted). Half of the resets that
drop the hashes reset the connector's cache too (``reset_connector``, what vLLM's sleep and
pause do): every request the scheduler half knows then is frozen, and from then on none of them
is looked up, and no step plans a load or store for one.

Runs have one or two TP ranks. Each rank keeps its own KV and its own lookups; a rank's load
fails on its own, leaving only that rank's blocks garbage, but the attention output's all-reduce
makes every rank's later KV garbage; vLLM hears of the union of the ranks' failed blocks, and
the worker halves agree on failed loads through ``dist.all_reduce`` (a thread per rank).

Lookups go through ``get_num_new_matched_tokens`` into a made-up daemon (``SchedulerSide._hit``
replaced): per rank, the chunk ids it holds (some prompts' first chunks from the start, then every
chunk a worker stores), so this engine's stores grow later requests' hits; an open lookup is used
again or redone as the real one is, returning the old one. Misses are kept (``miss_refresh_s`` past
the run) or not. At the end every lookup made must have been returned (``release``) unless a
request the scheduler half still knows holds it, and no finished request is still known (nor
waiting on a kept miss). A request vLLM's own hit covers whole is not looked up but touched: the
scheduler half's background work (``_touch_now``) runs at once over the made-up daemon, on the
touches' own sessions (never the scheduler thread's), whose touch lookups fail at random (leasing
nothing) and whose releases find the session busy at random (tried again); each such request is
touched once per rank, from the root, deferred, never loaded through, and its lookups returned
exactly once. A load fills exactly the blocks vLLM allocated for the external tokens it accepted
(none of its own hit's). The daemon refuses a retrieve through a lookup already returned (a failed
load): that is a broken promise under either scheduling. Under async scheduling the next step's
plan (a preemption) or an abort comes before the step in flight loads, and the scheduler half holds
such a release back until that step has run. After the scheduler half's shutdown every lookup made
was returned, those it held back included.

A third of the runs use ``async_loads``, under sync or async scheduling in turn. vLLM then
answers a hit ``(n, True)``: it allocates the request's blocks for its local and external
tokens only (if they fit beside what the prefills in flight still need), caches none of the
loaded ones, and keeps it waiting (``WAITING_FOR_REMOTE_KVS``, drained first among the waiting
requests, skipped until ready, taking no token budget). Each rank's loading thread is the
worker's own (``_load_in_background``), with only the daemon's retrieve (``_load_async``)
replaced: the run draws when each retrieve is over (0 to 5 steps on, in the thread's order) and
how: ok, failed (its blocks garbage on that rank), refused because its lookup was returned
first (an abort), or given up on at its deadline (``Unavailable`` with an unanswered call that
the daemon closes a few steps later: until then it may write the blocks). The ranks' reports
(``get_transfer_results``, ``get_block_ids_with_load_errors``) go through vLLM's
``KVOutputAggregator`` (finished once every rank reported, in any steps; failed-whole with the
finished-recving report), and vLLM reacts as 0.32 does: ``_handle_failed_recving``, then
``_update_requests_with_invalid_blocks`` over the waiting loads (their computed tokens cut at
the first failed block) and over the running requests, the connector's
``update_connector_output``, then ``finished_recving`` (a request finished while waiting has
its blocks freed then, else it is marked ready) and ``finished_sending``. A ready request is
promoted when next scheduled (``_update_waiting_for_remote_kv``: its loaded blocks cached, up
to the first failed one; none left, its blocks freed and it is looked up afresh), then allocated
and scheduled as new or resumed. An abort of a waiting request (``finish_requests``) holds its
blocks until the load is reported over unless vLLM heard that already, whatever
``request_finished`` says. Checked besides: no step computes over, no store reads, and no free
gives back a block a load may still write (on any rank: a retrieve not over, or one given up on
whose call is unanswered); vLLM never hears a request finished recving that it does not wait
for, nor finished sending that it holds no blocks for (its asserts, or a double free); a
request whose load failed is offered no hit again; and the workers forget every request vLLM
freed. In every run, besides: every chunk a request finished holding as valid KV was stored (on
every rank).

What it leaves out: spec decoding, failures of the connector's own bookkeeping (the guard's
fallbacks), ``unloadable`` blocks (every accepted external token gets a load here), lookups still
prefetching (``None``), MLA, partial-block local hits, and the synchronous path's calls given up
on (every such call here answers at once, so ``get_finished`` and ``handle_preemptions`` never
wait); with ``async_loads``, a given-up retrieve still unanswered after one more deadline (the
worker then reports it anyway, saying so: the run's time never reaches it), and GPU events.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from tierkv.errors import ClientBusy, LeaseLimit
from tierkv.vllm import worker as worker_module
from tierkv.vllm.link import Unavailable
from tierkv.vllm.plan import LoadOp, Settings, StoreOp, TierKVMetadata
from tierkv.vllm.scheduler import SchedulerSide, _Touch
from tierkv.vllm.worker import WorkerSide, dist

BLOCK = 16
CHUNK_BLOCKS = 2
CHUNK = BLOCK * CHUNK_BLOCKS


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Req:
    rid: str
    #: The prompt, then the tokens the engine decodes (their KV is computed too).
    tokens: list[int]
    prompt_len: int
    arrival: int
    request: Any
    blocks: list[int] = field(default_factory=list)
    #: vLLM's ``num_computed_tokens``: advanced when a step is scheduled.
    computed: int = 0
    #: The last step that scheduled it.
    last_step: int = -1
    #: The prompt's chunk ids, as the scheduler half names them.
    chunks: list[int] = field(default_factory=list)
    #: Preempted, and not scheduled since.
    resumed: bool = False
    #: ``async_loads``: vLLM keeps it waiting for its load (``WAITING_FOR_REMOTE_KVS``).
    remote: bool = False
    #: vLLM's own hit, in tokens, when it was last asked about (loads start after it).
    local: int = 0
    #: The external tokens vLLM accepted then: a load fills exactly the blocks allocated for
    #: them, after ``local``'s.
    external: int = 0
    #: When it was last looked up, else first asked about (-1: neither), by the run's
    #: ``_tick``: what the daemon let go before then, the request must store again if it holds
    #: it.
    looked: int = -1


class Failed(AssertionError):
    pass


class _Unanswered:
    """A retrieve given up on at its deadline (``tierkv.client.Unanswered``): the daemon may go
    on copying into its blocks until the run says it closed the connection (``done``)."""

    def __init__(self) -> None:
        self.done = False

    def wait(self, timeout: float) -> bool:
        return self.done

    def close(self) -> None:
        pass


@dataclass
class _AsyncLoad:
    """One rank's asynchronous retrieve, as the run decides it when the step hands it to the
    loading thread: over (the thread's call returns or raises) at step ``due``, ``ok``,
    ``failed`` or ``given up`` (past its deadline: the daemon may still copy into the blocks
    until step ``settle``)."""

    rid: str
    rank: int
    blocks: list[int]
    lookup: int
    due: int
    outcome: str
    settle: int
    go: threading.Event = field(default_factory=threading.Event)
    unanswered: _Unanswered = field(default_factory=_Unanswered)


class _Aggregator:
    """vLLM's ``KVOutputAggregator``: a request is finished sending or receiving once every
    rank reported it (in any steps); failed blocks are the union of the ranks' as they come; a
    request failed whole is reported with its finished-recving."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.send: dict[str, int] = {}
        self.recv: dict[str, int] = {}
        self.failed: set[str] = set()

    @staticmethod
    def _count(reported: set[str], remaining: dict[str, int], ranks: int) -> set[str]:
        done = set()
        for rid in reported:
            remaining[rid] = remaining.get(rid, ranks) - 1
            if remaining[rid] == 0:
                done.add(rid)
                del remaining[rid]
        return done

    def aggregate(
        self, outputs: list[tuple[set[str], set[str], set[str], set[int]]]
    ) -> tuple[set[int], set[str], set[str], set[str]]:
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        for sent, recved, failed, errors in outputs:
            sending |= self._count(sent, self.send, self.ranks)
            recving |= self._count(recved, self.recv, self.ranks)
            invalid |= errors
            self.failed |= failed
        failed_whole = self.failed & recving
        self.failed -= failed_whole
        return invalid, sending, recving, failed_whole


class _TpGroup:
    """The TP group's CPU group, for ``dist.all_reduce`` (MAX) among the ranks' worker halves,
    each calling it from its own thread."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=10)
        self.parts: list[torch.Tensor] = []
        self.lock = threading.Lock()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        with self.lock:
            self.parts.append(tensor.clone())
        self.barrier.wait()
        tensor.copy_(torch.stack(self.parts).amax(dim=0))
        if self.barrier.wait() == 0:
            self.parts = []
        self.barrier.wait()


def _all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
    """``dist.all_reduce`` of the model's TP group (MAX, the only one the worker half uses)."""
    assert isinstance(group, _TpGroup), "an all-reduce outside the model's TP group"
    group.all_reduce(tensor)


class _Releases:
    """The scheduler half's queue for its background thread: leases to return, recorded instead
    of sent (every lookup made must come back here, or belong to a request the scheduler half
    still knows), and touches, handed to ``touch`` (the run's, on this thread)."""

    def __init__(self, queue: Any, touch: Any) -> None:
        self.queue = queue
        self.touch = touch
        self.released: set[int] = set()
        #: Lookups returned more than once.
        self.twice: list[int] = []

    def put(self, item: Any) -> None:
        if item is None:
            self.queue.put(None)  # shutdown: ends the releasing thread
            return
        if isinstance(item, _Touch):
            self.touch(item)
            return
        self.record(item[2])

    def record(self, lookup: int) -> None:
        if lookup in self.released:
            self.twice.append(lookup)
        self.released.add(lookup)


class _TouchClient:
    """A rank's session as the background thread's touches see it: the made-up daemon's lookups
    and releases (``Engine._touch_lookup``, ``Engine._touch_release``)."""

    def __init__(self, engine: Engine, rank: int) -> None:
        self.engine = engine
        self.rank = rank

    def lookup(self, namespace: int, chunks: list[int], defer: bool) -> Any:
        return self.engine._touch_lookup(self.rank, chunks, defer)  # noqa: SLF001

    def release(self, lookup: int) -> None:
        self.engine._touch_release(self.rank, lookup)  # noqa: SLF001


class Engine:
    """One engine run: the scheduler and worker halves, the truth, and the trace."""

    #: How often a load fails.
    fail = 0.4

    def __init__(
        self, seed: int, asynchronous: bool, socket: str, steps: int = 30, async_loads: bool = False
    ) -> None:
        self.seed = seed
        self.asynchronous = asynchronous
        self.async_loads = async_loads
        self.steps = steps
        self.rng = random.Random(seed)
        rng = self.rng
        #: TP ranks: each keeps its own KV, and its loads fail on their own.
        self.tp = rng.choice([1, 1, 2])
        #: How often, between steps, a request is aborted and vLLM resets its prefix cache.
        self.abort = rng.choice([0.0, 0.15])
        self.reset = rng.choice([0.0, 0.0, 0.1])
        # A miss is kept (until this engine stores the chunk it missed, or vLLM's own hit
        # shrinks), or answered afresh at every step.
        settings = Settings(
            socket=socket,
            chunk_blocks=CHUNK_BLOCKS,
            miss_refresh_s=rng.choice([0.0, 1e9]),
            async_loads=async_loads,
        )
        #: How often, between steps, the daemon lets a chunk go (its eviction policy), and how
        #: often a request's open lookup is found older than ``lookup_refresh_s``.
        self.evict = rng.choice([0.0, 0.3, 0.6])
        self.stale = rng.choice([0.0, 0.3])
        self.scheduler = SchedulerSide(
            settings, "m", 4096, BLOCK, self.tp, False, steps_in_flight=2 if asynchronous else 1
        )
        # The scheduler half's own bookkeeping runs; only the daemon's lookups are made up.
        self.scheduler._look_up = self._lookup  # type: ignore[method-assign]  # noqa: SLF001
        self.releases = _Releases(self.scheduler.releases, self._touch_prompt)
        self.scheduler.releases = self.releases  # type: ignore[assignment]
        # The background thread's touch calls (their lookups and releases) reach the made-up
        # daemon: each rank's touch link answers with its own session.
        for rank, link in enumerate(self.scheduler.touch_links):
            client = _TouchClient(self, rank)
            link.call = lambda fn, client=client: fn(client)  # type: ignore[method-assign]
        # Nothing else here reaches the scheduler's own sessions (its lookups are made up, their
        # releases recorded): a touch there would hold up the scheduler thread's lookups.
        for link in self.scheduler.links:
            link.call = self._on_scheduler_session  # type: ignore[method-assign]
        #: How often a touch's lookup fails (the daemon down, or refusing it), and how often its
        #: release finds the session busy (tried again).
        self.touch_fails = rng.choice([0.0, 0.3])
        self.touch_busy = rng.choice([0.0, 0.3])
        #: The request being asked about (``get_num_new_matched_tokens``), whose touch it is.
        self.asking: _Req | None = None
        #: Touches' lookups (never loaded), per request the ranks it touched, touches made, and
        #: touches whose lookups failed.
        self.touch_lookups: set[int] = set()
        self.touched: dict[str, list[int]] = {}
        self.touches = self.touches_failed = 0
        self.found_busy: set[int] = set()
        group = _TpGroup(self.tp) if self.tp > 1 else None
        self.workers = [
            WorkerSide(settings, "m", CHUNK, rank, self.tp, False, 1 << 16, group)  # type: ignore[arg-type]
            for rank in range(self.tp)
        ]
        for rank, worker in enumerate(self.workers):
            # The worker half's own drop rule runs; only its calls to the daemon are replaced.
            worker.link = SimpleNamespace(close=lambda: None)  # type: ignore[assignment]
            worker._load = partial(self._load, rank=rank)  # type: ignore[method-assign]  # noqa: SLF001
            worker._store = partial(self._store, rank=rank)  # type: ignore[method-assign]  # noqa: SLF001
            worker._load_async = partial(self._load_async, rank=rank)  # type: ignore[method-assign]  # noqa: SLF001
        #: The truth, per rank: whether each slot of each block holds valid KV.
        self.valid: list[dict[int, list[bool]]] = [{} for _ in range(self.tp)]
        #: The daemon, per rank: the chunk ids it holds (valid KV: every store is checked).
        self.daemon: list[set[int]] = [set() for _ in range(self.tp)]
        #: Lookups made (by the made-up daemon): each must be returned, or still be held by a
        #: request the scheduler half knows; per lookup, its rank and the chunks it leased.
        self.lookups: set[int] = set()
        self.leased: dict[int, tuple[int, list[int]]] = {}
        #: When each chunk id was last let go by the daemon (on any rank), by :meth:`_tick`
        #: (steps do not order it: under async scheduling a step is planned before the last
        #: one runs).
        self.lost: dict[int, int] = {}
        self.ticks = 0
        #: Requests freed on their finished-recving report by the step planned last (``run``).
        self.unrun: set[str] = set()
        #: Requests that computed over garbage: the connector drops their stores whole, the
        #: chunks of their own hit with the rest.
        self.over_garbage: set[str] = set()
        #: Chunks a lookup found where vLLM's own hit held them and the daemon did not.
        self.roots_missed = 0
        self.cache: dict[tuple[int, ...], int] = {}
        # vLLM's block pool: few blocks, so that finished and preempted requests' blocks are
        # handed to others, or many.
        blocks = rng.choice([12, 16, 24, 1 << 10])
        self.free = list(range(blocks))
        self.ref = dict.fromkeys(self.free, 0)
        self.hash_of: dict[int, tuple[int, ...]] = {}
        #: Requests preempted since the last step was scheduled (by it, or by a reset of the
        #: prefix cache); blocks of requests preempted or aborted while a step computing them
        #: is in flight (freed once it is reported); requests that finished since the last step
        #: was scheduled; finished requests whose blocks wait for the workers
        #: (``get_finished``).
        self.preempted: set[str] = set()
        self.deferred: list[_Req] = []
        self.finished: set[str] = set()
        self.finished_ever: set[str] = set()
        self.held: dict[str, _Req] = {}
        self.reported = -1
        self.preemptions = self.reused = self.aborted = self.resets = 0
        #: Resets of the connector's cache, and the requests the scheduler half knew then: no
        #: step planned after is to load or store for them (their chunk ids are of the epoch
        #: before), so they are left out of the checks that every chunk is stored.
        self.connector_resets = 0
        self.frozen: set[str] = set()
        #: Aborts of a request a step in flight computes; loads that failed on some ranks
        #: only; lookups whose hit includes a chunk this engine stored; kept misses answered.
        self.aborted_in_flight = self.partial = self.grown = self.kept = 0
        self.failed_on: dict[tuple[int, str], set[int]] = {}
        self.next_lookup = 1
        self.trace: list[str] = []
        self.violations: list[str] = []
        #: Lookups never returned, and the scheduler half's bookkeeping of finished requests.
        self.leaks: list[str] = []
        self.step = 0
        self.requests = self._requests()
        self.waiting = list(self.requests)
        self.running: list[_Req] = []
        #: Blocks a failed load or a forward over garbage left garbage (in part at least).
        self.spoiled: set[int] = set()
        #: Chunk ids a failure's report found spoiled in a running request's computed blocks
        #: (the step of the first such report), and the steps each chunk id was stored.
        self.damaged: dict[int, int] = {}
        self.stored_at: dict[int, list[int]] = {}
        self.loads = self.failures = self.sent = 0
        #: Synchronous loads the daemon refused, their lookup returned before they ran.
        self.refused = 0
        #: Chunks a request finished holding as valid KV that the daemon never got (request, its
        #: chunk index).
        self.never_stored: list[tuple[str, int]] = []
        #: Requests that finished holding a chunk as valid KV, and the chunk's index.
        self.finished_holding: list[tuple[_Req, int]] = []
        # ``async_loads``: how many steps the loading thread takes over a retrieve, how often one
        # is given up on at its deadline (the daemon may go on copying for a few steps more).
        self.load_steps = rng.choice([[0], [0, 1, 2], [1, 2, 3, 5]]) if async_loads else [0]
        self.give_up = rng.choice([0.0, 0.2]) if async_loads else 0.0
        #: Per rank: the retrieves handed to the loading thread, in its order; those given up on
        #: whose daemon may still copy; the blocks either may still write, with their request;
        #: the retrieves the loading thread has yet to take (by request).
        self.queued: list[list[_AsyncLoad]] = [[] for _ in range(self.tp)]
        self.unsettled: list[list[_AsyncLoad]] = [[] for _ in range(self.tp)]
        self.loading: list[dict[int, str]] = [{} for _ in range(self.tp)]
        self.plans: list[dict[str, _AsyncLoad]] = [{} for _ in range(self.tp)]
        self.plans_lock = threading.Lock()
        #: vLLM's ``finished_recving_kv_req_ids`` and ``failed_recving_kv_req_ids``; requests it
        #: finished while waiting for their load, freed on the finished-recving report.
        self.recv_done: set[str] = set()
        self.recv_failed: set[str] = set()
        self.recv_held: dict[str, _Req] = {}
        #: Requests promoted after a failed asynchronous load: never offered a hit again.
        self.load_failed: set[str] = set()
        self.aggregator = _Aggregator(self.tp)
        #: Asynchronous loads: started (per rank), failed, given up on, reported over to vLLM
        #: (and of those failed), requests finished while waiting.
        self.async_started = self.async_failed = self.given_up = 0
        self.recved = self.recv_failures = self.aborted_waiting = 0

    # -- the workload ---------------------------------------------------------------------

    def _requests(self) -> list[_Req]:
        rng = self.rng
        families = [[1000 * (f + 1) + i for i in range(160)] for f in range(2)]
        out = []
        for i in range(rng.randint(3, 8)):
            base = rng.choice(families)
            shared = rng.choice([0, 16, 24, 32, 48, 64, 80, 96, 160, 160, 160])
            length = rng.randint(40, 150)
            prompt = base[: min(shared, length)]
            prompt += [100_000 * (i + 1) + j for j in range(length - len(prompt))]
            decoded = [900_000 + 100 * i + j for j in range(rng.randint(0, 2))]
            rid = f"R{i}"
            request = SimpleNamespace(
                request_id=rid,
                prompt_token_ids=prompt,
                cache_salt=None,
                lora_request=None,
                mm_features=None,
                prompt_embeds=None,
                num_preemptions=0,
            )
            out.append(_Req(rid, prompt + decoded, len(prompt), rng.randint(0, 16), request))
        return out

    # -- the truth --------------------------------------------------------------------------

    def _slots(self, block: int, rank: int = 0) -> list[bool]:
        return self.valid[rank].setdefault(block, [False] * BLOCK)

    def _chunk_valid(self, blocks: list[int], rank: int | None = None) -> bool:
        ranks = range(self.tp) if rank is None else [rank]
        return all(all(self._slots(b, k)) for k in ranks for b in blocks)

    def _load(self, op: LoadOp, rank: int) -> None:
        """A rank's retrieve: fails at random (on that rank only), leaving its blocks garbage
        there."""
        self.loads += 1
        blocks = [b for _, held in op.chunks for b in held]
        lookup = op.lookups[rank] if len(op.lookups) > 1 else op.lookups[0]
        assert lookup in self.lookups, f"{op.req_id} loads through unknown lookup {lookup}"
        # The daemon refuses a retrieve through a lookup already returned: a failed load, which
        # vLLM recomputes for nothing. Under async scheduling the next step is planned first,
        # and its preemption (or an abort between them) must not return the lookup before this
        # step's load has run.
        refused = lookup in self.releases.released
        if refused:
            self.violations.append(
                f"step {self.step}: rank {rank} {op.req_id} loads through lookup {lookup}, "
                "already released"
            )
        self.refused += refused
        failed = self.failed_on.setdefault((self.step, op.req_id), set())
        if refused or self.rng.random() < self.fail / self.tp:
            failed.add(rank)
            self.partial += rank == self.tp - 1 and len(failed) < self.tp
            self.failures += 1
            for b in blocks:
                self.valid[rank][b] = [False] * BLOCK
            self.spoiled.update(blocks)
            self.trace.append(f"  rank {rank} load {op.req_id} {blocks} FAILED")
            raise RuntimeError("an injected load failure")
        self.partial += rank == self.tp - 1 and 0 < len(failed) < self.tp
        for b in blocks:
            self.valid[rank][b] = [True] * BLOCK
        self.trace.append(f"  rank {rank} load {op.req_id} {blocks} ok")

    def _load_async(self, op: LoadOp, rank: int) -> None:
        """A rank's asynchronous retrieve, on its loading thread: it waits until the run says it
        is over (``_AsyncLoad.go``), and returns or raises as the run decided (the truth is the
        run's to change, on its own thread)."""
        with self.plans_lock:
            plan = self.plans[rank].pop(op.req_id, None)
        if plan is None:
            raise AssertionError(f"rank {rank} loads {op.req_id}, which no step handed it")
        if not plan.go.wait(10):
            raise AssertionError(f"rank {rank}'s load of {op.req_id} was never let finish")
        if plan.outcome == "failed":
            raise RuntimeError("an injected load failure")
        if plan.outcome == "given up":
            raise Unavailable("a retrieve past its deadline", plan.unanswered)  # type: ignore[arg-type]

    def _store(self, op: StoreOp, _ready: bytes | None, rank: int) -> None:
        """A rank's store, as the daemon would receive it: checked against that rank's truth."""
        self.sent += 1
        for chunk, held in op.chunks:
            self.stored_at.setdefault(chunk, []).append(self.step)
            if any(b in self.loading[rank] for b in held):
                self.violations.append(
                    f"step {self.step}: rank {rank} {op.req_id} stored blocks {held} that a load "
                    f"may still write ({ {b: self.loading[rank].get(b) for b in held} })"
                )
            if not self._chunk_valid(held, rank):
                bad = {b: "".join("v" if s else "." for s in self._slots(b, rank)) for b in held}
                self.violations.append(
                    f"step {self.step}: rank {rank} {op.req_id} stored blocks {bad}"
                )
            self.daemon[rank].add(chunk)
        self.trace.append(
            f"  rank {rank} store sent {op.req_id} {[h for _, h in op.chunks]} after={op.after}"
        )

    # -- vLLM's block pool ------------------------------------------------------------------

    def _touch(self, blocks: list[int]) -> None:
        """A prefix cache hit: a free block is taken off the free queue."""
        for b in blocks:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1

    def _free(self, r: _Req) -> None:
        """``free_blocks``, last block first: a block nobody else holds goes back to the free
        queue, at its front without a prefix cache hash (reused first), at its end with one
        (kept for hits until evicted). Invalid blocks keep their hash (the recompute policy)."""
        first: list[int] = []
        for b in reversed(r.blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                loading = {k: self.loading[k][b] for k in range(self.tp) if b in self.loading[k]}
                if loading:
                    self.violations.append(
                        f"step {self.step}: {r.rid} freed block {b} while a load into it may "
                        f"still run (rank: request {loading})"
                    )
                if b in self.hash_of:
                    self.free.append(b)
                else:
                    first.append(b)
        self.free[:0] = first
        self.trace.append(f"  {r.rid} frees {r.blocks}")
        r.blocks = []

    def _new_blocks(self, r: _Req, tokens: int) -> list[int] | None:
        """``get_new_blocks``: from the front of the free queue, each block's hash evicted. A
        reused block still holds its last owner's KV: not this request's."""
        need = _ceil(tokens, BLOCK) - len(r.blocks)
        if need > len(self.free):
            return None
        new = self.free[:need]
        del self.free[:need]
        for b in new:
            self.reused += b in self.valid[0]
            key = self.hash_of.pop(b, None)
            if key is not None:
                del self.cache[key]
            self.ref[b] = 1
            for valid in self.valid:
                valid[b] = [False] * BLOCK
        r.blocks.extend(new)
        return new

    def _cache(self, r: _Req, tokens: int) -> None:
        """vLLM caches the full blocks of what is computed once the step is scheduled, so a
        request scheduled after it (in this step, or the next) hits them."""
        for i in range(min(tokens, len(r.tokens)) // BLOCK):
            key = tuple(r.tokens[: (i + 1) * BLOCK])
            b = r.blocks[i]
            if key not in self.cache and b not in self.hash_of:
                self.cache[key] = b
                self.hash_of[b] = key

    def _free_after_flight(self, r: _Req) -> None:
        """``_free_request_blocks``: with a step computing the request still in flight (async
        scheduling), its blocks go back once that step is reported."""
        if r.last_step > self.reported:
            self.deferred.append(_Req(r.rid, [], 0, 0, None, list(r.blocks), last_step=r.last_step))
            r.blocks = []
        else:
            self._free(r)

    def _preempt(self, r: _Req) -> None:
        """vLLM's ``_preempt_request`` (the request already off the running queue): its blocks
        freed without asking the connector (after the step in flight that computes it, under
        async scheduling), back to the front of the waiting queue, recomputed from its prefix
        cache hit when it resumes."""
        self.preempted.add(r.rid)
        r.computed = 0
        r.request.num_preemptions += 1
        r.resumed = True
        self.waiting.insert(0, r)
        self.preemptions += 1
        self.trace.append(f"  {r.rid} PREEMPTED")
        self._free_after_flight(r)

    def _finish(self, r: _Req) -> None:
        """``_free_request``: the connector is asked (``request_finished``) whether the blocks
        wait for the workers; if not, they are freed (after the step in flight)."""
        # Every chunk a request finished holding as valid KV was stored (on every rank), its
        # own hit's included: checked at the end of the run (a store of the step in flight
        # is still to come).
        if r.blocks and r.computed >= len(r.tokens):
            for c, _ in enumerate(r.chunks[: r.computed // CHUNK]):
                held = r.blocks[c * CHUNK_BLOCKS : (c + 1) * CHUNK_BLOCKS]
                if self._chunk_valid(held):
                    self.finished_holding.append((r, c))
        self.finished.add(r.rid)
        self.finished_ever.add(r.rid)
        # ``finish_requests``: a request waiting for its asynchronous load keeps its blocks
        # until the workers report the load over, unless vLLM heard that already.
        on_recv = r.remote and r.rid not in self.recv_done
        if r.remote:
            self.recv_done.discard(r.rid)
            self.recv_failed.discard(r.rid)
            self.aborted_waiting += 1
            r.remote = False
        held = self.scheduler.request_finished(r.request)
        self.trace.append(
            f"  {r.rid} finished{' (blocks held)' if held else ''}"
            f"{' (freed on its finished-recving report)' if on_recv else ''}"
        )
        if on_recv:
            self.recv_held[r.rid] = r
        if held:
            self.held[r.rid] = r
        elif not on_recv:
            self._free_after_flight(r)

    # -- what comes between steps -----------------------------------------------------------

    def _abort(self) -> None:
        """``finish_requests`` (a client went away): a running or waiting request, mid-prefill
        or not, with a load in flight or not, is finished at once."""
        candidates = [r for r in self.running + self.waiting if r.arrival <= self.step]
        if not candidates:
            return
        r = self.rng.choice(candidates)
        self.trace.append(f"  {r.rid} ABORTED")
        self.aborted_in_flight += r.last_step > self.reported
        if r in self.running:
            self.running.remove(r)
        else:
            self.waiting.remove(r)
        self.aborted += 1
        self._finish(r)

    def _reset_prefix_cache(self) -> None:
        """``reset_prefix_cache(reset_running_requests=True)``: every running request preempted,
        last first, outside a schedule (listed in the next step's ``preempted_req_ids``, and
        resumed in that step where it fits); then the prefix cache is emptied, unless a block
        is still in use (held for the workers, or by a step in flight: vLLM raises, the
        requests stay preempted)."""
        self.trace.append("  RESET of the prefix cache")
        self.resets += 1
        while self.running:
            self._preempt(self.running.pop())
        if any(self.ref.values()) or self.deferred:
            self.trace.append("  reset failed: blocks in use")
            return
        self.cache.clear()
        self.hash_of.clear()
        if self.rng.random() < 0.5:
            # vLLM resets the connector only once its own cache is reset.
            self.trace.append("  RESET of the connector's cache")
            self.connector_resets += 1
            if self.scheduler.reset_cache() is not True:
                self.violations.append(f"step {self.step}: the connector refused a reset")
            self.frozen |= set(self.scheduler.requests)

    def _tick(self) -> int:
        self.ticks += 1
        return self.ticks

    def _let_go(self) -> None:
        """The daemon's eviction: a chunk no open lookup leases goes, on one rank or all (a
        request's root that vLLM holds is no older there than the chunks after it)."""
        live = {
            (rank, c)
            for lookup, (rank, chunks) in self.leased.items()
            if lookup not in self.releases.released
            for c in chunks
        }
        held = sorted({c for chunks in self.daemon for c in chunks})
        if not held:
            return
        chunk = self.rng.choice(held)
        ranks = [self.rng.randrange(self.tp)] if self.rng.random() < 0.5 else range(self.tp)
        if any((rank, chunk) in live for rank in ranks):
            return
        for rank in ranks:
            self.daemon[rank].discard(chunk)
        self.lost[chunk] = self._tick()
        self.trace.append(f"  daemon let {chunk} go on ranks {list(ranks)}")

    def between_steps(self) -> None:
        if self.rng.random() < self.abort:
            self._abort()
        if self.rng.random() < self.reset:
            self._reset_prefix_cache()
        if self.rng.random() < self.evict:
            self._let_go()

    # -- vLLM's scheduler -------------------------------------------------------------------

    def _hit_blocks(self, r: _Req) -> list[int]:
        """vLLM's prefix cache hit: the longest run of cached full blocks, short of the last
        token."""
        hit: list[int] = []
        for i in range((len(r.tokens) - 1) // BLOCK):
            block = self.cache.get(tuple(r.tokens[: (i + 1) * BLOCK]))
            if block is None:
                break
            hit.append(block)
        return hit

    def _lookup(self, state: Any, wanted: list[int]) -> None:
        """The daemon's lookups (``SchedulerSide._look_up``), one per rank, made up over the
        chunks the daemon holds per rank: each leases its hit, the chunks from the first up to
        the first it lacks. Every lookup must ask for the prompt's chunks from the root, those
        vLLM holds included: the daemon's eviction sees them used only so."""
        rid = next(rid for rid, known in self.scheduler.requests.items() if known is state)
        r = self.requests[int(rid[1:])]
        if rid in self.frozen:
            self.violations.append(f"step {self.step}: {rid} looked up after a reset")
        if wanted != r.chunks[: len(wanted)] or len(wanted) != state.lookup_chunks:
            self.violations.append(
                f"step {self.step}: {rid} looked up {len(wanted)} chunks, not the "
                f"{state.lookup_chunks} of its prompt from the root"
            )
        r.looked = self._tick()
        links = self.scheduler.links
        state.lookups = []
        state.outcomes = []
        for rank in range(len(links)):
            hit = 0
            while hit < len(wanted) and wanted[hit] in self.daemon[rank]:
                hit += 1
            self.grown += rank == 0 and any(c in self.stored_at for c in wanted[:hit])
            self.roots_missed += rank == 0 and hit < r.local // CHUNK
            state.lookups.append(self.next_lookup)
            state.outcomes.append(hit)
            self.lookups.add(self.next_lookup)
            self.leased[self.next_lookup] = (rank, wanted[:hit])
            self.next_lookup += 1
        state.generations = [link.generation for link in links]
        state.looked_at = time.monotonic()

    def _touch_prompt(self, touch: _Touch) -> None:
        """The background thread's touch, run here at once: the scheduler half's own
        ``_touch_now``, its releases found busy tried again until it gives them up."""
        r = self.asking
        if r is None:
            self.violations.append(f"step {self.step}: a touch outside a lookup of a request")
            return
        self.touches += 1
        self.touched.setdefault(r.rid, [])
        again: list[Any] = []
        self.scheduler._touch_now(touch, again)  # noqa: SLF001
        while again:
            self.scheduler._release_one(*again.pop(0), again)  # noqa: SLF001

    def _on_scheduler_session(self, _fn: Any) -> Any:
        self.violations.append(f"step {self.step}: a call on a scheduler thread's session")
        raise Unavailable("not the touches' session")

    def _touch_lookup(self, rank: int, wanted: list[int], defer: bool) -> Any:
        """A touch's lookup on ``rank``'s session: only of a request vLLM's own hit covers whole,
        once per rank in its life, of its prompt's chunks from the root, deferred (its L1 hits
        leased, nothing prefetched). Fails at random, leasing nothing."""
        r = self.asking
        assert r is not None
        state = self.scheduler.requests[r.rid]
        if wanted != r.chunks[: state.lookup_chunks] or r.local < len(wanted) * CHUNK:
            self.violations.append(
                f"step {self.step}: {r.rid} touched {len(wanted)} chunks with vLLM's hit of "
                f"{r.local} tokens, not the {state.lookup_chunks} of its prompt vLLM holds"
            )
        if not defer:
            self.violations.append(f"step {self.step}: {r.rid}'s touch may prefetch")
        if rank in self.touched[r.rid]:
            self.violations.append(f"step {self.step}: {r.rid} touched again on rank {rank}")
        self.touched[r.rid].append(rank)
        if self.rng.random() < self.touch_fails:
            self.touches_failed += 1
            if self.rng.random() < 0.5:
                raise Unavailable("the daemon is down")
            raise LeaseLimit("this session's open lookups hold too many leases")
        lookup = self.next_lookup
        self.next_lookup += 1
        self.lookups.add(lookup)
        self.touch_lookups.add(lookup)
        self.leased[lookup] = (rank, [c for c in wanted if c in self.daemon[rank]])
        self.trace.append(f"  {r.rid} touches {len(wanted)} chunks on rank {rank}: {lookup}")
        return SimpleNamespace(lookup=lookup, outcome=None)

    def _touch_release(self, rank: int, lookup: int) -> None:
        """A release on the background thread: finds the session busy at random, once per
        lookup (nothing returned: tried again); else returns the lookup, which must be this
        rank's."""
        if lookup not in self.found_busy and self.rng.random() < self.touch_busy:
            self.found_busy.add(lookup)
            try:
                raise ClientBusy("another call holds the session")
            except ClientBusy as e:
                raise Unavailable(str(e)) from e
        if self.leased.get(lookup, (None,))[0] != rank:
            self.violations.append(f"step {self.step}: lookup {lookup} released on rank {rank}")
        self.releases.record(lookup)

    def _chunk(self) -> int:
        """The tokens a step computes of a prompt: a random count, or whole blocks (large
        token budgets rarely end a step inside a block)."""
        kind = self.rng.random()
        if kind < 0.4:
            return BLOCK * self.rng.randint(1, 3)
        if kind < 0.7:
            return self.rng.randint(1, 12)
        return self.rng.randint(1, 40)

    def _wait_for_load(self, r: _Req, hit: list[int], local: int, external: int) -> bool:
        """A hit vLLM loads asynchronously: blocks for its local and external tokens (none for
        what it computes), unless they do not fit beside what the prefills in flight still need
        (``reserved_blocks``); their hashes cached only once the load is over. It waits
        (``WAITING_FOR_REMOTE_KVS``), and takes no token budget."""
        inflight = [q for q in self.running if q.computed < len(q.tokens)] + [
            q for q in self.waiting if q is not r and (q.remote or q.blocks)
        ]
        reserved = sum(max(_ceil(len(q.tokens), BLOCK) - len(q.blocks), 0) for q in inflight)
        short = sum(self.ref[b] == 0 for b in hit)
        if _ceil(local + external, BLOCK) - len(hit) > len(self.free) - short - reserved:
            return False
        self._touch(hit)
        r.blocks = list(hit)
        r.computed = local + external
        if self._new_blocks(r, r.computed) is None:
            raise AssertionError("no free blocks for an admitted request")
        self.scheduler.update_state_after_alloc(r.request, external, list(r.blocks))
        r.remote = True
        self.trace.append(
            f"  {r.rid} WAITS for its load: hit {local} external {external} blocks {r.blocks}"
        )
        return True

    def _promote(self, r: _Req) -> None:
        """``_update_waiting_for_remote_kv``: the load is over. Failed, the blocks before the
        first failed one are cached (none left: every block freed, and the request is looked
        up afresh); else all of them."""
        failed = r.rid in self.recv_failed
        if failed:
            self.recv_failed.discard(r.rid)
            self.load_failed.add(r.rid)
            if r.computed:
                self._cache(r, r.computed)
            else:
                self._free(r)
        else:
            self._cache(r, r.computed)
        self.recv_done.discard(r.rid)
        r.remote = False
        self.trace.append(
            f"  {r.rid} promoted{' after a FAILED load' if failed else ''}: computed {r.computed}"
        )

    def schedule(self) -> tuple[TierKVMetadata, dict[str, tuple[int, int, list[int]]], set[str]]:
        rng = self.rng
        budget = rng.choice([rng.randint(16, 96), 1000])
        planned: dict[str, tuple[int, int, list[int]]] = {}
        cached: list[tuple[_Req, list[int], int, int]] = []
        new: list[tuple[_Req, int, int]] = []
        resumed: set[str] = set()
        lines = []
        preempting = False
        for r in list(self.running):
            if r not in self.running or r.computed >= len(r.tokens) or budget <= 0:
                continue
            n = 1 if r.computed >= r.prompt_len else self._chunk()
            n = min(n, len(r.tokens) - r.computed, budget)
            # Short of blocks, vLLM preempts the last running request, until it fits.
            while (added := self._new_blocks(r, r.computed + n)) is None:
                preempting = True
                self._preempt(self.running.pop())
                if r not in self.running:
                    break
            if added is None:
                continue
            self._cache(r, r.computed + n)
            cached.append((r, added, r.computed, n))
            planned[r.rid] = (r.computed, n, list(r.blocks))
            lines.append(f"{r.rid} from {r.computed} +{n} new blocks {added}")
            r.computed += n
            r.last_step = self.step
            budget -= n
        # No request is admitted in a step that preempts one (a reset's preemptions before the
        # step do not count: those requests resume in it).
        # vLLM drains the waiting requests that hold blocks first (``kv_holding_waiting``:
        # those waiting for an asynchronous load, or promoted from it).
        holding = [w for w in self.waiting if w.remote or w.computed > 0]
        order = holding + [w for w in self.waiting if w not in holding]
        for r in [w for w in order if w.arrival <= self.step and not preempting]:
            if budget <= 0:
                break
            if r.remote:
                # ``_handle_blocked_waiting_request``: skipped until vLLM heard the load is over.
                if r.rid not in self.recv_done:
                    continue
                self._promote(r)
            load_async = False
            if r.computed == 0:
                hit = self._hit_blocks(r)
                local = len(hit) * BLOCK
                r.local = local
                if r.looked < 0:
                    r.looked = self._tick()
                known = self.scheduler.requests.get(r.rid)
                if known is not None and self.rng.random() < self.stale:
                    known.looked_at = float("-inf")  # older than lookup_refresh_s: made again
                self.asking = r
                answer, load_async = self.scheduler.get_num_new_matched_tokens(r.request, local)
                self.asking = None
                self.kept += self.scheduler.requests[r.rid].miss_for is not None
                if answer and r.rid in self.load_failed:
                    # A retrieve that keeps failing would keep it waiting for ever.
                    self.violations.append(
                        f"step {self.step}: {r.rid}, whose asynchronous load failed, got a hit "
                        f"of {answer} tokens again"
                    )
                external = answer or 0
                r.external = external
            else:
                # Promoted from an asynchronous load: it holds its blocks, and is not looked up.
                hit, local, external = [], r.computed, 0
            if load_async:
                if not self._wait_for_load(r, hit, local, external):
                    break
                continue
            n = min(self._chunk(), len(r.tokens) - local - external, budget)
            # ``allocate_slots``: short of blocks, the request keeps waiting (the connector is
            # not told: its lookup stays open for the next try).
            short = sum(self.ref[b] == 0 for b in hit)
            if _ceil(local + external + n, BLOCK) - len(r.blocks or hit) > len(self.free) - short:
                break
            if r.computed == 0:
                self._touch(hit)
                r.blocks = list(hit)
                r.computed = local + external
            if self._new_blocks(r, r.computed + n) is None:
                raise AssertionError("no free blocks for an admitted request")
            self.waiting.remove(r)
            self.running.append(r)
            self._cache(r, r.computed + n)
            self.scheduler.update_state_after_alloc(
                r.request, external, list(r.blocks) if external > 0 else None
            )
            if r.resumed:
                resumed.add(r.rid)
                cached.append((r, list(r.blocks), r.computed, n))
            else:
                new.append((r, r.computed, n))
            r.resumed = False
            planned[r.rid] = (r.computed, n, list(r.blocks))
            lines.append(
                f"{r.rid} {'RESUMED' if r.rid in resumed else 'NEW'} hit {local} external "
                f"{external} from {r.computed} +{n} blocks {r.blocks}"
            )
            r.computed += n
            r.last_step = self.step
            budget -= n
        finished, self.finished = self.finished, set()
        out = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=r.rid,
                    prompt_token_ids=r.tokens[: r.prompt_len],
                    mm_features=[],
                    sampling_params=None,
                    pooling_params=None,
                    block_ids=(list(r.blocks),),
                    num_computed_tokens=computed,
                    lora_request=None,
                )
                for r, computed, _ in new
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.rid for r, *_ in cached],
                resumed_req_ids=resumed,
                new_token_ids=[[] for _ in cached],
                all_token_ids={},
                new_block_ids=[(added,) if added else None for _, added, _, _ in cached],
                num_computed_tokens=[computed for _, _, computed, _ in cached],
                num_output_tokens=[max(computed - r.prompt_len, 0) for r, _, computed, _ in cached],
            ),
            num_scheduled_tokens={rid: n for rid, (_, n, _) in planned.items()},
            total_num_scheduled_tokens=sum(n for _, n, _ in planned.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=finished,
            free_encoder_mm_hashes=[],
            preempted_req_ids=set(self.preempted),
        )
        meta = self.scheduler.build_connector_meta(out)
        assert not self.scheduler.promised, "accepted external tokens left unplanned"
        for op in meta.loads + meta.async_loads + meta.stores:
            if op.req_id in self.frozen:
                self.violations.append(
                    f"step {self.step}: a load or store of {op.req_id} after a reset"
                )
        # A load fills only blocks after vLLM's own hit: those are its prefix cache's, maybe
        # other requests' too.
        for op in meta.loads + meta.async_loads:
            if self.touch_lookups.intersection(op.lookups):
                self.violations.append(
                    f"step {self.step}: {op.req_id} loads through a touch's lookup {op.lookups}"
                )
            r = self.requests[int(op.req_id[1:])]
            blocks = [b for _, held in op.chunks for b in held]
            external = r.blocks[r.local // BLOCK : (r.local + r.external) // BLOCK]
            if blocks != external:
                self.violations.append(
                    f"step {self.step}: {op.req_id} loads into blocks {blocks}, not the blocks "
                    f"{external} vLLM allocated for its {r.external} external tokens after its "
                    f"own hit of {r.local}"
                )
        self.trace.append(f"step {self.step} plan: " + "; ".join(lines))
        if self.preempted:
            self.trace.append(f"  preempted {sorted(self.preempted)}")
        self.preempted = set()
        for op in meta.stores:
            self.trace.append(
                f"  planned store {op.req_id} {[h for _, h in op.chunks]} after={op.after}"
            )
        if meta.unloadable:
            self.trace.append(f"  unloadable {meta.unloadable}")
        return meta, planned, finished

    # -- the worker and the forward pass ---------------------------------------------------

    def execute(
        self,
        step: int,
        meta: TierKVMetadata,
        planned: dict[str, tuple[int, int, list[int]]],
        finished: set[str],
    ) -> tuple[set[int], set[str], set[str], set[str]]:
        self.step = step
        self.trace.append(f"step {step} runs")
        self._hand_over(meta)
        for worker in self.workers:
            worker.handle_preemptions(meta)
            worker.start_load_kv(meta)
        # Every layer writes the whole batch's KV before its attention reads it: a request reads
        # what another wrote in the same step. Its reads are all positions before its first, so
        # in order of first position, each reads only what is settled. With TP > 1 the
        # attention output is all-reduced: garbage on one rank's blocks makes every rank's
        # later KV garbage.
        written: dict[tuple[int, int], bool] = {}
        for rid, (start, n, blocks) in sorted(planned.items(), key=lambda item: item[1][0]):
            under = {
                b: self.loading[k][b]
                for k in range(self.tp)
                for b in blocks[: _ceil(start + n, BLOCK)]
                if b in self.loading[k]
            }
            if under:
                self.violations.append(
                    f"step {step}: {rid} computes {start}..{start + n} over blocks a load may "
                    f"still write (block: loading request) {under}"
                )
            ok = all(
                self._slots(blocks[p // BLOCK], k)[p % BLOCK]
                for k in range(self.tp)
                for p in range(start)
            )
            for p in range(start, start + n):
                where = (blocks[p // BLOCK], p % BLOCK)
                # Two writers of one slot in a step: valid only if both are.
                written[where] = written.get(where, True) and ok
                for k in range(self.tp):
                    self._slots(where[0], k)[where[1]] = written[where]
                if not ok:
                    self.spoiled.add(where[0])
            if not ok:
                self.over_garbage.add(rid)
            self.trace.append(f"  {rid} computes {start}..{start + n} {'ok' if ok else 'GARBAGE'}")
        if self.tp > 1 and meta.loads:
            # The ranks agree on the step's failed loads through an all-reduce: each its own
            # thread, as each is its own process.
            threads = [
                threading.Thread(target=worker.wait_for_save, args=(meta,))
                for worker in self.workers
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            for worker in self.workers:
                worker.wait_for_save(meta)
        # The loading threads: the retrieves over by now end (before the workers' reports).
        self._loads_over(step)
        # What the workers report (``get_transfer_results``, then the load errors), and vLLM's
        # output aggregator over them.
        outputs = []
        for worker in self.workers:
            sending = worker.get_finished(finished, idle=meta.idle)
            recving, whole = worker.take_finished_recving(idle=meta.idle)
            outputs.append((sending, recving, whole, worker.take_load_errors()))
        return self.aggregator.aggregate(outputs)

    def _hand_over(self, meta: TierKVMetadata) -> None:
        """The step's asynchronous loads, as each rank's loading thread will run them: when each
        is over, and how (drawn here, on the run's thread)."""
        for op in meta.async_loads:
            blocks = [b for _, held in op.chunks for b in held]
            for rank in range(self.tp):
                delay = self.rng.choice(self.load_steps)
                draw = self.rng.random()
                outcome = "ok"
                if draw < self.fail / self.tp:
                    outcome = "failed"
                elif draw < self.fail / self.tp + self.give_up:
                    outcome = "given up"
                settle = self.step + delay + self.rng.choice([0, 1, 2, 4])
                lookup = op.lookups[rank] if len(op.lookups) > 1 else op.lookups[0]
                plan = _AsyncLoad(
                    op.req_id, rank, blocks, lookup, self.step + delay, outcome, settle
                )
                with self.plans_lock:
                    assert op.req_id not in self.plans[rank], f"{op.req_id} loads twice at once"
                    self.plans[rank][op.req_id] = plan
                self.queued[rank].append(plan)
                for b in blocks:
                    self.loading[rank][b] = op.req_id
                self.async_started += 1
                self.trace.append(
                    f"  rank {rank} async load {op.req_id} {blocks} handed over: {outcome} at "
                    f"step {plan.due}" + (f", settled at {settle}" if outcome == "given up" else "")
                )
        for rid, blocks in meta.async_unloadable.items():
            self.trace.append(f"  async unloadable {rid} {blocks}")

    def _unload(self, plan: _AsyncLoad, valid: bool) -> None:
        """``plan``'s retrieve writes its blocks no more: with the stored KV, or garbage."""
        for b in plan.blocks:
            self.valid[plan.rank][b] = [valid] * BLOCK
            if self.loading[plan.rank].get(b) == plan.rid:
                del self.loading[plan.rank][b]
        if not valid:
            self.spoiled.update(plan.blocks)

    def _loads_over(self, step: int) -> None:
        """Each rank's loading thread ends, in its order, the retrieves due by ``step``; then the
        daemon closes the connections of those given up on that are due to settle. A retrieve
        whose lookup was returned before it ran is refused (fails)."""
        for rank, worker in enumerate(self.workers):
            queue = self.queued[rank]
            while queue and queue[0].due <= step:
                plan = queue.pop(0)
                assert plan.lookup in self.lookups, f"{plan.rid} loads unknown lookup"
                if plan.outcome == "ok" and plan.lookup in self.releases.released:
                    plan.outcome = "failed"
                    self.trace.append(f"  rank {rank} async load {plan.rid}: its lease is gone")
                if plan.outcome == "ok":
                    self.loads += 1
                    self._unload(plan, valid=True)
                elif plan.outcome == "failed":
                    self.async_failed += 1
                    self._unload(plan, valid=False)
                else:
                    self.given_up += 1
                    self.unsettled[rank].append(plan)
                self.trace.append(f"  rank {rank} async load {plan.rid} over: {plan.outcome}")
                plan.go.set()
                with worker._lock:  # noqa: SLF001
                    over = worker._lock.wait_for(  # noqa: SLF001
                        lambda rid=plan.rid, w=worker: rid not in w._loading,  # noqa: SLF001
                        timeout=10,
                    )
                if not over:
                    self.violations.append(
                        f"step {step}: rank {rank}'s loading thread never ended {plan.rid}'s load"
                    )
            for plan in [p for p in self.unsettled[rank] if p.settle <= step]:
                self.unsettled[rank].remove(plan)
                plan.unanswered.done = True
                # It may have copied anything meanwhile: reported failed, never read.
                self._unload(plan, valid=False)
                self.trace.append(f"  rank {rank} given-up load {plan.rid} settled")

    # -- vLLM's reaction to the step's output -----------------------------------------------

    def report(
        self,
        step: int,
        output: tuple[set[int], set[str], set[str], set[str]],
        planned: dict[str, tuple[int, int, list[int]]],
    ) -> None:
        """``update_from_output`` of ``step``: the loads vLLM must take as failed whole
        (``_handle_failed_recving``), vLLM's ``_update_requests_with_invalid_blocks`` over the
        requests waiting for their loads, then over its running requests (the recompute policy),
        then the connector's ``update_connector_output``, the loads the workers report over
        (``finished_recving``: a request finished while waiting is freed), the blocks of the
        requests the workers report finished (``finished_sending``), then the requests that
        finished."""
        invalid, sending, recving, whole = output
        affected: set[str] = set()
        waiting = [r for r in self.waiting if r.remote]
        for r in waiting:
            if r.rid in whole:
                r.computed = 0
                self.recv_failed.add(r.rid)
        if invalid:
            # Marked failed: promoted once the load is reported over, from the first failed
            # block on.
            hurt: set[str] = set()
            waits = self._vllm_resets(invalid, planned, hurt, waiting)
            self.recv_failed |= hurt
            for r in self.running:
                done = r.computed - (planned[r.rid][1] if r.rid in planned else 0)
                for c in range(min(done, r.prompt_len) // CHUNK):
                    held = r.blocks[c * CHUNK_BLOCKS : (c + 1) * CHUNK_BLOCKS]
                    if self.spoiled.intersection(held) and not self._chunk_valid(held):
                        self.damaged.setdefault(r.chunks[c], step)
            resets = self._vllm_resets(invalid, planned, affected, self.running)
            self.trace.append(
                f"report of step {step}: invalid {sorted(invalid)}; resets {resets}"
                + (f"; waiting {waits}" if waits else "")
            )
        if invalid or recving:
            self.scheduler.update_connector_output(invalid, recving, whole)
            self.trace.append(f"  tainted {sorted(self.scheduler.tainted)}")
        self.reported = step
        for rid in sorted(recving):
            r = next((w for w in waiting if w.rid == rid), None)
            self.recved += 1
            self.recv_failures += rid in self.recv_failed
            self.trace.append(
                f"  {rid} load reported over{' (failed whole)' if rid in whole else ''}"
            )
            if r is not None:
                self.recv_done.add(rid)
            elif rid in self.recv_held:
                # vLLM frees it, and forgets it: a later report of it fails vLLM's assert.
                self.held.pop(rid, None)
                self._free_after_flight(self.recv_held.pop(rid))
            else:
                self.violations.append(
                    f"step {step}: {rid} reported finished recving; vLLM waits for no load of it"
                )
        for rid in sorted(sending):
            if rid not in self.held:
                self.violations.append(
                    f"step {step}: {rid} reported finished sending; vLLM holds no blocks for it"
                )
                continue
            self.recv_held.pop(rid, None)
            self._free(self.held.pop(rid))
        for r in [d for d in self.deferred if d.last_step <= step]:
            self.deferred.remove(r)
            self._free(r)
        for r in list(self.running):
            if r.computed >= len(r.tokens) and r.last_step <= step and r.rid not in affected:
                self.running.remove(r)
                self._finish(r)

    def _vllm_resets(
        self,
        invalid: set[int],
        planned: dict[str, tuple[int, int, list[int]]],
        affected: set[str],
        requests: list[_Req],
    ) -> list[str]:
        resets = []
        marked: set[int] = set()
        for r in requests:
            hit = False
            marked_here = False
            before = r.computed
            done = r.computed - (planned[r.rid][1] if r.rid in planned else 0)
            for idx, block in enumerate(r.blocks[: max(_ceil(done, BLOCK), 0)]):
                if block not in invalid:
                    continue
                hit = True
                if block in marked:
                    continue
                marked.add(block)
                if marked_here:
                    continue
                marked_here = True
                r.computed = idx * BLOCK
            if hit:
                if not marked_here:
                    r.computed = done
                affected.add(r.rid)
                resets.append(f"{r.rid} {before}->{r.computed}")
        return resets

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> None:
        for r in self.requests:
            r.chunks = self.scheduler._state(r.request).chunks  # noqa: SLF001
        # The daemon holds some prompts' first chunks already (stored by other engines): on
        # every rank, or, with TP > 1, one rank short of the last.
        for r in self.requests:
            if self.rng.random() < 0.6 and len(r.chunks) > 1:
                held = r.chunks[: self.rng.randint(1, len(r.chunks) - 1)]
                for rank in range(self.tp):
                    short = rank > 0 and self.rng.random() < 0.3
                    self.daemon[rank].update(held[:-1] if short else held)
        if not self.asynchronous:
            for step in range(self.steps):
                self.step = step
                pending = self.schedule()
                self.report(step, self.execute(step, *pending), pending[1])
                self.between_steps()
            self.check_leases()
            self.check_stored()
            return
        # Async scheduling: step N + 1 is planned before the output of step N is reported.
        self.step = 0
        pending = self.schedule()
        for step in range(self.steps):
            self.step = step + 1
            following = self.schedule()
            self.report(step, self.execute(step, *pending), pending[1])
            self.between_steps()
            pending = following
        # The last step planned never runs: the workers never hear of the requests it says
        # vLLM freed on their finished-recving report.
        self.unrun = set(pending[0].freed_on_recv)
        self.check_leases()
        self.check_stored()

    def check_stored(self) -> None:
        """Every chunk a request finished holding as valid KV is in the daemon, unless the
        daemon let it go after the request's last lookup (the request could not know), or the
        request computed over garbage (its stores were dropped whole)."""
        for r, c in self.finished_holding:
            if r.rid in self.frozen:
                continue
            chunk = r.chunks[c]
            since = 0 if r.rid in self.over_garbage else r.looked
            if not self.in_daemon(chunk) and self.lost.get(chunk, -1) < since:
                self.never_stored.append((r.rid, c))

    def check_leases(self) -> None:
        """Every lookup made was returned, unless a request the scheduler half still knows holds
        it; every kept miss is a known request's; no request vLLM finished is still known."""
        states = self.scheduler.requests
        held = {lookup for state in states.values() for lookup in state.lookups or ()}
        # Releases held back until the step that loads through their lookup has run: only while
        # that step may still be in flight (a later plan sends them).
        ran = self.scheduler.planned_steps - self.scheduler.steps_in_flight
        held |= {release[2] for step, release in self.scheduler.held_back if step > ran}
        # Finished requests' lookups their asynchronous load still goes through.
        finished = self.scheduler.release_on_recv.values()
        held |= {lookup for state in finished for lookup in state.lookups or ()}
        leaked = self.lookups - self.releases.released - held
        if leaked:
            self.leaks.append(f"lookups never returned: {sorted(leaked)}")
        reused = held & self.releases.released
        if held & self.touch_lookups:
            self.leaks.append(f"touches' lookups held by requests: {held & self.touch_lookups}")
        if reused:
            self.leaks.append(f"returned lookups still held: {sorted(reused)}")
        waiting = {rid for rids in self.scheduler.waiting_on.values() for rid in rids}
        if waiting - states.keys():
            self.leaks.append(f"kept misses of finished requests: {waiting - states.keys()}")
        gone = states.keys() & {r.rid for r in self.requests if r.rid in self.finished_ever}
        if gone:
            self.leaks.append(f"finished requests still known: {sorted(gone)}")
        # The workers forget every request vLLM has freed.
        freed = self.finished_ever - self.held.keys() - self.recv_held.keys() - self.unrun
        for rank, worker in enumerate(self.workers):
            with worker._lock:  # noqa: SLF001
                kept = {
                    "planned": worker._planned,  # noqa: SLF001
                    "finishing": worker._finishing,  # noqa: SLF001
                    "freed on recv": worker._freed_on_recv,  # noqa: SLF001
                    "unanswered": set(worker._unanswered),  # noqa: SLF001
                    "loading": worker._loading,  # noqa: SLF001
                    "loaded": {item[0] for item in worker._loaded},  # noqa: SLF001
                }
            for what, rids in kept.items():
                if rids & freed:
                    self.leaks.append(
                        f"rank {rank} keeps freed requests {sorted(rids & freed)} ({what})"
                    )

    def check_returned(self) -> None:
        """After the scheduler half's shutdown, every lookup made was returned, and none twice."""
        left = self.lookups - self.releases.released
        if left:
            self.leaks.append(f"lookups not returned at shutdown: {sorted(left)}")
        if self.releases.twice:
            self.leaks.append(f"lookups returned twice: {sorted(self.releases.twice)}")

    def in_daemon(self, chunk: int) -> bool:
        return all(chunk in held for held in self.daemon)

    def stored_since(self, chunk: int) -> bool:
        """Whether ``chunk``, spoiled and then let go by the daemon, was stored since the report
        that found it spoiled."""
        return chunk in self.lost and any(
            step >= self.damaged[chunk] for step in self.stored_at.get(chunk, [])
        )

    def close(self) -> None:
        self.scheduler.shutdown()
        # The loads still under way end, so that the loading threads do too.
        for rank in range(self.tp):
            for plan in self.queued[rank] + self.unsettled[rank]:
                plan.go.set()
                plan.unanswered.done = True
            with self.plans_lock:
                for plan in self.plans[rank].values():
                    plan.go.set()
        for worker in self.workers:
            worker.shutdown()

    def mode(self) -> str:
        mode = "async scheduling" if self.asynchronous else "sync scheduling"
        return mode + (", async_loads" if self.async_loads else "")

    def recomputed(self) -> list[int]:
        """The chunks a failure's report found spoiled that some request's blocks hold as
        valid KV by the end."""
        valid = {
            chunk
            for r in self.requests
            if r.rid not in self.frozen
            for c, chunk in enumerate(r.chunks)
            if len(held := r.blocks[c * CHUNK_BLOCKS : (c + 1) * CHUNK_BLOCKS]) == CHUNK_BLOCKS
            and self._chunk_valid(held)
        }
        return [chunk for chunk in self.damaged if chunk in valid]


def run_seed(seed: int, asynchronous: bool, socket: str, async_loads: bool = False) -> Engine:
    engine = Engine(seed, asynchronous, socket, async_loads=async_loads)
    try:
        # Every call here answers at once: an idle step's wait for one would only be slept.
        with (
            mock.patch.object(dist, "all_reduce", _all_reduce),
            mock.patch.object(worker_module, "IDLE_SETTLE_WAIT_S", 0.0),
        ):
            engine.run()
    finally:
        engine.close()
    engine.check_returned()
    return engine


#: The runs' kinds: vLLM's synchronous or async scheduling, with the connector's synchronous
#: loads or its ``async_loads``.
VARIANTS = {
    "sync": (False, False),
    "async": (True, False),
    "loads-sync": (False, True),
    "loads-async": (True, True),
}


def _runs() -> list[tuple[int, str]]:
    """The seeds and variants to run: 300 seeds, each with synchronous and with async
    scheduling, and with ``async_loads`` under one of the two (in turn). ``TIERKV_MODEL_SEEDS``
    (``A-B``, both included) and ``TIERKV_MODEL_VARIANTS`` (names of :data:`VARIANTS`,
    comma-separated: every seed runs each) choose others, e.g. for a long search in the
    background."""
    seeds = os.environ.get("TIERKV_MODEL_SEEDS")
    first, last = (int(x) for x in seeds.split("-")) if seeds else (0, 299)
    names = os.environ.get("TIERKV_MODEL_VARIANTS")
    if names:
        chosen = [name.strip() for name in names.split(",")]
        unknown = [name for name in chosen if name not in VARIANTS]
        assert not unknown, f"unknown variants {unknown}; known: {sorted(VARIANTS)}"
        return [(seed, name) for seed in range(first, last + 1) for name in chosen]
    return [
        (seed, name)
        for seed in range(first, last + 1)
        for name in ("sync", "async", "loads-async" if seed % 2 else "loads-sync")
    ]


def _first(engines: list[Engine]) -> str:
    seeds = ", ".join(f"{e.seed} ({e.mode()})" for e in engines[:20])
    return f"seeds {seeds}{' ...' if len(engines) > 20 else ''}; the first"


def test_kv_computed_over_a_failed_load_is_never_stored_randomized(tmp_path: Any) -> None:
    """300 seeds of 30 steps (block reuse, preemption, aborts, prefix cache resets, TP 2 and
    kept misses included), each with synchronous and with async scheduling, and with
    ``async_loads`` (loads that take steps, fail, or are given up on, aborts while waiting);
    every lookup is returned or still held, and the workers forget every freed request. Then,
    what vLLM recomputes after a failure is stored again: every chunk a failure's report found
    spoiled that some request's blocks hold as valid KV by the end was stored, and so was every
    chunk a request finished holding as valid KV (a miss otherwise, not a wrong answer). Only
    blocks a request holds count: a freed block may be handed to another prompt. The counts are
    printed with ``-s``."""
    socket = str(tmp_path / "none.sock")
    quiet = logging.getLogger("tierkv")
    level = quiet.level
    # Every injected failure is logged; the guard's warnings would only slow the loop.
    quiet.setLevel(logging.CRITICAL)
    wrong: list[Engine] = []
    leaking: list[Engine] = []
    missed: list[tuple[Engine, list[int]]] = []
    totals = dict.fromkeys(
        (
            "loads",
            "failed",
            "refused",
            "sent",
            "spoiled",
            "recomputed",
            "stored",
            "preempted",
            "reused",
            "aborted",
            "aborted in flight",
            "resets",
            "connector resets",
            "tp2 runs",
            "partial failures",
            "grown hits",
            "kept misses",
            "let go",
            "roots missed",
            "touches",
            "touches failed",
            "async loads",
            "async failed",
            "given up",
            "recved",
            "recv failures",
            "aborted waiting",
        ),
        0,
    )
    try:
        for seed, variant in _runs():
            asynchronous, async_loads = VARIANTS[variant]
            engine = run_seed(seed, asynchronous, socket, async_loads)
            recomputed = engine.recomputed()
            # The daemon may hold it already (it was loaded again): no miss then. One it let go
            # must have been stored since the report.
            unstored = [
                c for c in recomputed if not engine.in_daemon(c) and not engine.stored_since(c)
            ]
            totals["loads"] += engine.loads
            totals["failed"] += engine.failures
            totals["refused"] += engine.refused
            totals["sent"] += engine.sent
            totals["spoiled"] += len(engine.damaged)
            totals["recomputed"] += len(recomputed)
            totals["stored"] += len(recomputed) - len(unstored)
            totals["preempted"] += engine.preemptions
            totals["reused"] += engine.reused
            totals["aborted"] += engine.aborted
            totals["aborted in flight"] += engine.aborted_in_flight
            totals["resets"] += engine.resets
            totals["connector resets"] += engine.connector_resets
            totals["tp2 runs"] += engine.tp > 1
            totals["partial failures"] += engine.partial
            totals["grown hits"] += engine.grown
            totals["kept misses"] += engine.kept
            totals["let go"] += len(engine.lost)
            totals["roots missed"] += engine.roots_missed
            totals["touches"] += engine.touches
            totals["touches failed"] += engine.touches_failed
            totals["async loads"] += engine.async_started
            totals["async failed"] += engine.async_failed
            totals["given up"] += engine.given_up
            totals["recved"] += engine.recved
            totals["recv failures"] += engine.recv_failures
            totals["aborted waiting"] += engine.aborted_waiting
            if engine.violations:
                wrong.append(engine)
            if engine.leaks:
                leaking.append(engine)
            never = [engine.requests[int(rid[1:])].chunks[c] for rid, c in engine.never_stored]
            if unstored or never:
                missed.append((engine, unstored + never))
    finally:
        quiet.setLevel(level)
    print(totals)
    # The async_loads runs must have loaded asynchronously, given retrieves up and aborted
    # requests that waited, or they checked the synchronous path again (counted over enough
    # runs: one seed may have none).
    loads_runs = sum(1 for _, variant in _runs() if VARIANTS[variant][1])
    if loads_runs >= 50:
        for what in ("async loads", "async failed", "given up", "aborted waiting"):
            assert totals[what] > 0, f"no {what} in {loads_runs} async_loads runs: {totals}"
    # Lookups must have found the daemon without chunks vLLM's own hit held, or the runs never
    # checked that those are stored again.
    if len(_runs()) >= 100:
        assert totals["roots missed"] > 0, f"no lookup missed a chunk vLLM held: {totals}"
        # Requests vLLM's own hit covered whole must have been touched, some of those touches
        # failing, or the runs never checked their leases.
        for what in ("touches", "touches failed"):
            assert totals[what] > 0, f"no {what} in {len(_runs())} runs: {totals}"
    if wrong:
        engine = wrong[0]
        raise Failed(
            f"{len(wrong)} runs broke the connector's promises; {_first(wrong)}: "
            f"{engine.violations[0]}\n" + "\n".join(engine.trace)
        )
    if leaking:
        engine = leaking[0]
        raise Failed(
            f"{len(leaking)} runs left lookups or finished requests behind; {_first(leaking)}: "
            f"{engine.leaks[0]}\n" + "\n".join(engine.trace)
        )
    if missed:
        engine, unstored = missed[0]
        raise Failed(
            f"{len(missed)} runs never stored chunks vLLM recomputed after a failure, or that a "
            "request finished holding; "
            f"{_first([e for e, _ in missed])}: chunks {unstored}\n" + "\n".join(engine.trace)
        )
