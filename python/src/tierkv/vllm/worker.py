"""The connector's worker half: the engine's KV memory registered once, loads before the
forward pass, stores after it.

Both run synchronously inside vLLM's step, so no block is read or written by the daemon while
vLLM could reuse it: a load has finished before the forward pass reads its blocks, and a store
has finished before the step ends and the scheduler may free the request's blocks. KV on a GPU is
exported by CUDA IPC (``export_device_kv``); the daemon's copies of a retrieve are complete when
its reply arrives, and before a store the worker waits for the engine's stream, whose kernels
may still be writing the blocks. A load that
fails for any reason reports its blocks through ``get_block_ids_with_load_errors``, and vLLM
recomputes them (``kv_load_failure_policy="recompute"``); a failed store is only a future miss.
Every hook runs under the connector's :class:`~tierkv.vllm.guard.Guard`: whatever fails in it, a
load's blocks are reported (so are the blocks the scheduler half could not plan a load for,
``TierKVMetadata.unloadable``), a store is dropped, and vLLM's step goes on. A worker whose KV
memory could not be registered (it could not be exported, or the daemon refused it) runs without
the daemon for the rest of the process: every load fails, no store is made, and every step's
output says so to the scheduler half (``without_daemon``, in vLLM's worker metadata), which
then reports no hits. One whose daemon is merely not there yet at start is not: it connects, and
registers, at its first load or store.

What the forward pass computed over a failed load's blocks is wrong too, and must not be stored:
every later token's KV depends on the earlier ones. With TP > 1 one rank's failed load reaches
every rank through the attention output's all-reduce, so before a step's stores the ranks agree
on which of the step's loads failed anywhere (a MAX all-reduce of one flag per load over the TP
group's CPU group, only in steps that load: every rank holds the same plan, so all of them take
part or none), and no rank stores what such a request computed in that step.

A call that misses its deadline is the exception: a hung daemon may resume it. It copies nothing
into blocks and keeps nothing read from them once the client has given up (the client shuts the
connection's writing side, and the daemon checks before a retrieve's copies and after a store's),
but a daemon stopped in the middle of a retrieve's copies can finish the one under way, into blocks
vLLM may have handed to another request: wrong KV served. So the scheduler half delays the free of
every request that had a load or a store (``request_finished`` returns ``True``), and this half
reports such a request in ``finished_sending`` only once every call it gave up on for it is
settled: the daemon closed that connection, which it does only after the call returned, or died
(:class:`tierkv.client.Unanswered`). Usually that is in the step that says the request finished.
A preempted request's blocks are freed without asking the connector, so ``handle_preemptions``
waits for its unanswered calls, up to one more deadline, before the step reuses them.

With ``async_loads`` the loads of requests vLLM keeps waiting for them
(``TierKVMetadata.async_loads``) run on a thread of their own, one after the other, off the
step, over a session of their own (opened on the first load, with the KV memory registered on
it too), so that a long retrieve never holds the step's stores behind it. vLLM reads none of
their blocks until this half reports the request in ``get_finished``'s finished-recving set,
which it does once the load is over, ok or failed, with a failed load's blocks in
``get_block_ids_with_load_errors`` in the same step. A load that cannot even start is
reported at once. Every TP rank reports each request: vLLM waits for all of them and hears of
the union of their failed blocks, so a failure on any rank is a failure. One that went out
before vLLM reset the connector's cache (``TierKVMetadata.stale_loads``) read what was computed
before the reset: every block of it is reported failed, whatever its retrieve did.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from tierkv import wire
from tierkv.client import READY_EVENT_WAIT_S, Client, Unanswered
from tierkv.errors import DaemonError
from tierkv.vllm.guard import Guard, nothing
from tierkv.vllm.link import Link, Unavailable
from tierkv.vllm.memory import DeviceKv, KvMemory, export_device_kv, move_to_memfd
from tierkv.vllm.plan import LoadOp, Settings, StoreOp, TierKVMetadata

log = logging.getLogger(__name__)

#: How long a step that schedules nothing waits for the calls a finished request's blocks wait
#: on (vLLM runs such steps back to back): a stopped daemon then costs the engine 20 idle steps a
#: second, not a spinning core per process.
IDLE_SETTLE_WAIT_S = 0.05

#: The least rate at which the daemon is assumed to map a resident memfd at registration (it
#: maps every page then, so that copies do not fault them in): the registration's deadline grows
#: by a second per GiB of KV beyond the ordinary one (about 18 GB/s was measured on a 2-core
#: machine). With the ordinary deadline alone, a KV cache of ~90 GiB or more could never
#: register: every try would miss it and be retried.
REGISTER_BYTES_PER_S = 1 << 30


#: How often a wait for an interprocess CUDA event polls it (it is polled, not synchronized on,
#: so that the wait has a deadline).
EVENT_POLL_S = 0.001


def _completes(event: torch.cuda.Event, deadline: float) -> bool:
    """Whether ``event`` completes before ``deadline`` (a ``time.monotonic()`` value); it is
    queried at least once, however near the deadline. The polls start 20 µs apart and double
    to :data:`EVENT_POLL_S`: a step's kernels that end a moment after the first query cost
    the step that moment, not a whole millisecond."""
    pause = 20e-6
    while not event.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, EVENT_POLL_S)
    return True


class WorkerSide:
    """One TP rank's session, its registered KV memory, and the step's copies."""

    def __init__(
        self,
        settings: Settings,
        namespace: str,
        chunk_tokens: int,
        rank: int,
        tp_size: int,
        mla: bool,
        num_blocks: int,
        tp_group: dist.ProcessGroup | None = None,
        interior: str | None = None,
    ) -> None:
        self.settings = settings
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.rank = rank
        self.tp_size = tp_size
        self.mla = mla
        self.num_blocks = num_blocks
        # The order of a KV block's bytes vLLM's layout names (``block_interior_of``), which the
        # namespace carries: the KV tensors are checked to lie that way.
        self.interior = interior
        # The TP group's CPU (gloo) group, through which the ranks agree on failed loads.
        self.tp_group = tp_group
        self.memory: KvMemory | DeviceKv | None = None
        self.link: Link | None = None
        #: Why this worker runs without the daemon (its KV memory could not be registered), or
        #: ``None``: told to the scheduler half after every step (``TierKVWorkerMetadata``).
        self.without_daemon: str | None = None
        # The daemon's last refusal of the registration: the link reports it as unavailable,
        # and the session opened at start tells it apart.
        self._refused: DaemonError | None = None
        self.buffer = 0
        # The loading thread's own session (``async_loads``), opened on its first load, so that
        # the step's stores never wait behind a long retrieve; its own number for the KV
        # buffer it registers, and the hello both sessions share.
        self._async_link: Link | None = None
        # Shutting down: the loading thread opens no session any more.
        self._closing = False
        self._async_buffer = 0
        self._hello: dict[str, Any] | None = None
        self.load_errors: set[int] = set()
        # Requests whose load failed in this step: their stores in the same step are skipped.
        self._failed_loads: set[str] = set()
        #: The requests whose loads failed in the last step (on any rank).
        self._failed_before: set[str] = set()
        self.loaded_chunks = 0
        self.stored_chunks = 0
        # The interprocess CUDA event a store's copies wait for (made on first use).
        self._ready: torch.cuda.Event | None = None
        # Requests that had a load or store here: the scheduler half delays freeing their blocks
        # until this half reports them finished.
        self._planned: set[str] = set()
        # Calls given up on at their deadline that the daemon may still carry out, per request.
        self._unanswered: dict[str, list[Unanswered]] = {}
        # Finished requests whose blocks wait for their unanswered calls.
        self._finishing: set[str] = set()
        # ``async_loads``: the loads waiting for or on the loading thread, by request; the
        # requests whose load is over (with the blocks it failed to fill, and whether vLLM
        # must take the whole request as failed: no block of it is known); the requests
        # vLLM frees on that report (``TierKVMetadata.freed_on_recv``).
        self._lock = threading.Condition()
        self._loading: set[str] = set()
        # Each with when it may be reported at the latest while a call given up on for it is
        # still unanswered.
        self._loaded: list[tuple[str, list[int], bool, float]] = []
        self._freed_on_recv: set[str] = set()
        # The blocks of each load handed to the loading thread and not yet reported over, and
        # those of them that went out before vLLM reset the connector's cache
        # (``TierKVMetadata.stale_loads``): every block of one is reported failed.
        self._async_blocks: dict[str, list[int]] = {}
        self._stale: set[str] = set()
        self._loads: queue.SimpleQueue[tuple[LoadOp, torch.cuda.Event | None, float] | None] = (
            queue.SimpleQueue()
        )
        self._loader: threading.Thread | None = None
        # The interprocess event the daemon records after an asynchronous retrieve's copies.
        self._async_done: torch.cuda.Event | None = None
        self.guard = Guard(log)

    # -- vLLM's worker calls -----------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        bound_views: Callable[[], Iterable[torch.Tensor]] = tuple,
    ) -> None:
        """Shares the engine's KV memory with the daemon. ``bound_views`` gives the tensors the
        engine reads through (the attention layers' caches). If this fails the worker runs
        without the daemon (every load a failure, no store), unless the engine's KV tensors may
        have been left half moved (:class:`~tierkv.vllm.guard.EngineStateUnknown` passes on)."""
        self.guard.run(
            "registering the KV caches (the connector runs without the daemon)",
            lambda: self._register_kv_caches(kv_caches, list(bound_views())),
            self._unregistered,
        )

    def _unregistered(self, error: Exception) -> None:
        self.memory = None
        self.link = None
        self.without_daemon = f"{type(error).__name__}: {error}"

    def _register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], bound_views: list[torch.Tensor]
    ) -> None:
        if any(t.device.type == "cuda" for t in kv_caches.values()):
            self.memory = export_device_kv(
                kv_caches, self.num_blocks, self.settings.chunk_blocks, self.interior
            )
        else:
            self.memory = move_to_memfd(
                kv_caches, self.num_blocks, self.settings.chunk_blocks, bound_views, self.interior
            )
        hello = wire.hello(
            rank=self.rank,
            tp_size=self.tp_size,
            world_size=self.tp_size,
            mla=self.mla,
            namespaces=[(self.namespace, "")],
            chunk_bytes=self.memory.chunk_bytes(),
            chunk_tokens=self.chunk_tokens,
        )
        self._hello = hello
        self.link = self._link(self._register)
        # The session and the registration now, not in the first step that loads or stores,
        # which would pay for them (a second a GiB of KV, on a memfd), and so that a daemon that
        # refuses the registration says so at start: it would refuse it again (memory it cannot
        # open, a layout it does not take), so the worker runs without it. One not there yet
        # is tried again then.
        try:
            self.link.client()
        except Unavailable as e:
            if self._refused is not None and e.__cause__ is self._refused:
                raise self._refused from None
            log.warning(
                "tierkv: no session with the daemon yet (%s); it is tried again at the first "
                "load or store",
                e,
            )
        where = (
            f"{len(self.memory.regions)} CUDA IPC regions"
            if isinstance(self.memory, DeviceKv)
            else f"a {self.memory.nbytes}-byte memfd"
        )
        log.info(
            "tierkv: KV of %d segments in %s, %d-byte chunks",
            len(self.memory.layout.segments),
            where,
            self.memory.chunk_bytes(),
        )

    def _link(self, on_connect: Callable[[Client], None]) -> Link:
        """A session of this worker (its hello), which registers the KV memory on connecting."""
        assert self._hello is not None
        return self.settings.link(self._hello, on_connect=on_connect, watch_unanswered=True)

    def _register(self, client: Client) -> None:
        try:
            self.buffer = self._register_kv(client)
        except DaemonError as e:
            self._refused = e
            raise

    def _register_async(self, client: Client) -> None:
        self._async_buffer = self._register_kv(client)

    def _register_kv(self, client: Client) -> int:
        """Registers the KV memory on a new session (a buffer is the session's own); its
        number there."""
        memory = self.memory
        assert memory is not None
        if isinstance(memory, DeviceKv):
            regions = [(region, None) for region in memory.regions]
            return client.register_kv(regions, memory.layout)
        timeout = self.settings.timeout_s + memory.nbytes / REGISTER_BYTES_PER_S
        return client.register_kv([(memory.region, memory.fd)], memory.layout, timeout=timeout)

    def _loading_link(self) -> Link:
        """The loading thread's session, made on its first load (``async_loads`` only). Its
        retrieves read the scheduler half's lookups as the step's session does: a lookup is
        valid on every session of its namespace and rank (docs/protocol.md)."""
        with self._lock:
            if self._closing:
                raise Unavailable("the worker is shutting down")
            if self._async_link is None:
                self._async_link = self._link(self._register_async)
            return self._async_link

    def start_load_kv(self, meta: TierKVMetadata) -> None:
        """Loads the step's planned chunks into their blocks. Whatever fails, the blocks it may
        have left unwritten are reported and the request stores nothing this step. Starts the
        step's asynchronous loads; one that cannot start is reported over and failed."""
        self._note(meta)
        self.guard.run(
            "the step's loads (vLLM recomputes their blocks)",
            lambda: self._load_all(meta),
            lambda _e: self._loads_failed(meta, meta.loads),
        )
        if meta.async_loads or meta.async_unloadable:
            started: set[str] = set()
            self.guard.run(
                "starting the step's asynchronous loads (vLLM recomputes their blocks)",
                lambda: self._start_async(meta, started),
                lambda _e: self._async_not_started(meta, started),
            )

    def _start_async(self, meta: TierKVMetadata, started: set[str]) -> None:
        loading = {op.req_id for op in meta.async_loads}
        for req_id, blocks in meta.async_unloadable.items():
            if req_id in loading:
                # Reported now: vLLM must hear of them no later than of the load's end. Not
                # started yet: should what follows fail, the load is reported over, failed.
                self.load_errors.update(blocks)
            else:
                self._async_over(req_id, blocks, whole=not blocks)
                started.add(req_id)
        if not meta.async_loads:
            return
        ready = self._async_events()
        if self._loader is None or not self._loader.is_alive():
            loader = threading.Thread(target=self._load_in_background, name="tierkv-load")
            loader.daemon = True
            loader.start()
            self._loader = loader
        # Each load's deadline counts from now: one queued behind slow loads that is not
        # started by then fails without a retrieve.
        deadline = time.monotonic() + self.settings.timeout_s
        for op in meta.async_loads:
            with self._lock:
                self._loading.add(op.req_id)
                self._async_blocks[op.req_id] = [b for _, held in op.chunks for b in held]
            self._loads.put((op, ready, deadline))
            started.add(op.req_id)

    def _async_events(self) -> torch.cuda.Event | None:
        """On a GPU, on the step's thread (the engine's device and stream): an event recorded
        on the engine's stream, which the loading thread waits for before the daemon writes the
        blocks (kernels still queued from an earlier step may read them for the request that
        held them before), and the interprocess event the daemon records after an asynchronous
        retrieve's copies, made once. Made here, not on the loading thread, whose current
        device is not the engine's. ``None`` on CPU."""
        if not isinstance(self.memory, DeviceKv):
            return None
        if self._async_done is None:
            done = torch.cuda.Event(interprocess=True)
            # Recorded once here so that the event exists before its handle is taken.
            done.record(torch.cuda.current_stream())
            self._async_done = done
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        return ready

    def _async_not_started(self, meta: TierKVMetadata, started: set[str]) -> None:
        """Reports every asynchronous load of ``meta`` not yet handed to the loading thread as
        over and failed: vLLM would otherwise wait for it for ever."""
        for op in meta.async_loads:
            if op.req_id not in started:
                blocks = [b for _, held in op.chunks for b in held]
                self._async_over(op.req_id, blocks + meta.async_unloadable.get(op.req_id, []))
                started.add(op.req_id)
        for req_id, blocks in meta.async_unloadable.items():
            if req_id not in started:
                self._async_over(req_id, blocks, whole=not blocks)

    def _async_over(self, req_id: str, failed: list[int], whole: bool = False) -> None:
        with self._lock:
            self._loading.discard(req_id)
            latest = time.monotonic() + self.settings.timeout_s
            self._loaded.append((req_id, failed, whole, latest))
            self._lock.notify_all()

    def _load_in_background(self) -> None:
        """The loading thread: each load in turn; nothing but shutdown ends it. Every load it
        takes is reported over, whatever raises (else vLLM would wait for it for ever)."""
        while True:
            item = self._loads.get()
            if item is None:
                return
            op, ready, deadline = item
            failed = [b for _, held in op.chunks for b in held]
            try:
                # By the deadline counted from the step that queued it: a load not started
                # in time, or whose engine stream never gets there, fails with nothing sent
                # (the blocks are vLLM's to recompute).
                if time.monotonic() >= deadline:
                    raise Unavailable("queued behind other loads past its deadline")
                if ready is not None and not _completes(ready, deadline):
                    raise Unavailable("the engine's stream did not reach the load in time")
                self._load_async(op)
                failed = []
            except Exception as e:
                with contextlib.suppress(Exception):
                    self.guard.throttle.warning(
                        "async load",
                        "tierkv: an asynchronous load failed (vLLM recomputes its blocks): %s",
                        e,
                    )
                    with self._lock:
                        self._watch(op.req_id, e)
            finally:
                self._async_over(op.req_id, failed)

    def _load_async(self, op: LoadOp) -> None:
        if self.link is None:
            raise Unavailable("the KV caches were never registered")
        lookup = op.lookups[0] if self.mla or len(op.lookups) == 1 else op.lookups[self.rank]
        event = self._async_done
        done = bytes(event.ipc_handle()) if event is not None else None
        # On the loading thread's own session: the step's stores must not wait behind it.
        link = self._loading_link()
        link.call(lambda c: c.retrieve(lookup, self._async_buffer, op.chunks, done_event=done))
        if event is not None:
            # The reply comes before the copies are done: over once the daemon's record of
            # the event completes.
            deadline = time.monotonic() + self.settings.timeout_s
            try:
                landed = _completes(event, deadline)
            except Exception:
                self._unsettled(op.req_id)
                raise
            if not landed:
                self._unsettled(op.req_id)
                raise Unavailable("the daemon's copies of a retrieve did not complete in time")
        with self._lock:
            self.loaded_chunks += len(op.chunks)

    def _unsettled(self, req_id: str) -> None:
        """A retrieve's copies may still land (the done event did not complete in time, or
        querying it failed, and nobody knows): the request is unsettled until the event
        completes (``_settled``), as after a call given up on, so that vLLM does not reuse its
        blocks under them."""
        with self._lock:
            self._unanswered.setdefault(req_id, [])

    def take_finished_recving(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """The requests whose asynchronous load is over since the last call, and of those the
        ones vLLM must take as failed whole; their failed blocks join the load errors (taken
        right after, in the same step). In an idle step with loads under way it waits up to
        :data:`IDLE_SETTLE_WAIT_S` for one to end, and, with loads held for a call given up on
        (below), up to as long for those calls, so that a stopped daemon does not have the engine
        spin (vLLM runs idle steps back to back while a request waits for this report).

        A request with a call given up on (a retrieve past its deadline: the daemon may still be
        copying into its blocks) is reported only once that call is over: vLLM frees the blocks
        on this report if it finished the request meanwhile, and the workers may not know yet
        (its ``freed_on_recv`` comes a step later). One it finished waits for as long as that
        takes (its blocks are held, nobody waits on it); any other at most one more deadline,
        as a preempted request does (``handle_preemptions``), so no request waits for ever on a
        daemon that stopped."""
        with self._lock:
            if idle and self._loading and not self._loaded:
                self._lock.wait(IDLE_SETTLE_WAIT_S)
            loaded, self._loaded = self._loaded, []
        finished: set[str] = set()
        whole: set[str] = set()
        held: list[tuple[str, list[int], bool, float]] = []
        now = time.monotonic()
        deadline = now + (IDLE_SETTLE_WAIT_S if idle else 0.0)
        for req_id, blocks, failed_whole, latest in loaded:
            freed = req_id in self._freed_on_recv
            if (freed or now < latest) and not self.guard.run(
                "checking whether a load's calls given up on are over (asked again next step)",
                partial(self._settled_by, req_id, deadline),
                lambda _e: False,
            ):
                held.append((req_id, blocks, failed_whole, latest))
                continue
            if not freed and req_id in self._unanswered:
                log.error(
                    "tierkv: the daemon has not finished a retrieve given up on for %s; if it "
                    "resumes, it may still copy into blocks vLLM frees should the request end",
                    req_id,
                )
            self._freed_on_recv.discard(req_id)
            self.load_errors.update(blocks)
            with self._lock:
                loaded_into = self._async_blocks.pop(req_id, [])
            if req_id in self._stale:
                # It read what was stored before the reset: vLLM recomputes every block of it.
                self._stale.discard(req_id)
                self.load_errors.update(loaded_into)
            finished.add(req_id)
            if failed_whole:
                whole.add(req_id)
        if held:
            with self._lock:
                self._loaded.extend(held)
        return finished, whole

    def _load_all(self, meta: TierKVMetadata) -> None:
        # Blocks vLLM counts as loaded that the scheduler half could not plan a load for.
        self._loads_failed(meta, [])
        if meta.loads and isinstance(self.memory, DeviceKv):
            # The daemon writes the loaded blocks on its own streams, ordered after nothing of
            # the engine's: kernels still queued from an earlier step (vLLM's async scheduling
            # runs the next step's plan while the last one computes) may still read these
            # blocks for the request that held them before. Without async scheduling the
            # stream is idle here and this costs nothing. (A retrieve carries no ready event
            # in protocol 6; one would let the daemon wait on the GPU instead.)
            torch.cuda.current_stream().synchronize()
        for op in meta.loads:
            self.guard.run(
                "a load (vLLM recomputes its blocks)",
                partial(self._load, op),
                partial(self._load_failed, op),
            )

    def _load(self, op: LoadOp) -> None:
        if self.link is None:
            raise Unavailable("the KV caches were never registered")
        lookup = op.lookups[0] if self.mla or len(op.lookups) == 1 else op.lookups[self.rank]
        # No done event: the reply comes once the daemon's copies are over, on a GPU as in host
        # memory. The engine's stream is never made to wait for an event only the daemon
        # records, which a daemon that died between its reply and its copies never would. (On
        # an H100 the reply came after the copies even with the event: the driver takes as long
        # to enqueue copies into IPC-opened memory as to run them.)
        self.link.call(lambda c: c.retrieve(lookup, self.buffer, op.chunks))
        self.loaded_chunks += len(op.chunks)

    def _load_failed(self, op: LoadOp, error: Exception) -> None:
        # The daemon may still carry out a call given up on: the request's blocks wait for it.
        self._watch(op.req_id, error)
        self._loads_failed(TierKVMetadata(), [op])

    def _loads_failed(self, meta: TierKVMetadata, loads: list[LoadOp]) -> None:
        """Reports the blocks of ``loads`` and of ``meta.unloadable`` to vLLM, and keeps their
        requests from storing what they compute this step."""
        for op in loads:
            self.load_errors.update(b for _, held in op.chunks for b in held)
            self._failed_loads.add(op.req_id)
        for req_id, blocks in meta.unloadable.items():
            self.load_errors.update(blocks)
            self._failed_loads.add(req_id)

    def wait_for_save(self, meta: TierKVMetadata) -> None:
        """Stores the step's completed chunks; a store that fails is dropped (a future miss)."""
        self._note(meta)
        # First, whatever happened before: with a TP group every rank must take part.
        failed = self.guard.run(
            "agreeing on the step's failed loads (its loading requests store nothing)",
            lambda: self._failed_anywhere(meta),
            lambda _e: self._take_failed_loads() | {op.req_id for op in meta.loads},
        )
        # What a request computed over blocks no load filled is never stored, whatever
        # happened to start_load_kv.
        failed |= meta.unloadable.keys()
        # A store may have been computed over the last step's loads too: under async
        # scheduling vLLM plans a step before it hears how the last one's loads went, and the
        # scheduler names them in the store's ``after``. One planned after vLLM heard (what it
        # recomputes over the blocks) does not name them, and goes.
        before, self._failed_before = self._failed_before, set(failed)
        self.guard.run(
            "the step's stores (dropped)",
            lambda: self._store_all(meta, failed, before),
            nothing,
        )

    def _store_all(self, meta: TierKVMetadata, failed: set[str], before: set[str]) -> None:
        if self.link is None:
            return
        ready = None
        if meta.stores and isinstance(self.memory, DeviceKv):
            # The daemon waits, before its copies, for the engine's kernels that wrote the
            # blocks: an event recorded on the engine's stream, shared by CUDA IPC. It is waited
            # for here first, as long as the daemon would (the step waits for the stores'
            # replies anyway): sent unfinished, a store's call would need the daemon's whole
            # event wait on top of its deadline, and a hung daemon would cost every step that
            # tries it that much, not the deadline.
            ready = self._ready_event()
            assert self._ready is not None
            if not _completes(self._ready, time.monotonic() + READY_EVENT_WAIT_S):
                log.warning(
                    "tierkv: the step's kernels did not finish within %.0f s; its stores are "
                    "dropped",
                    READY_EVENT_WAIT_S,
                )
                return
        for op in meta.stores:
            # A request's failed load of the last step does not concern a store computed over
            # its loads of this step only (``StoreOp.this_step``), nor its failed load of this
            # step one computed over its earlier loads only (``StoreOp.earlier``).
            spoiled = failed.difference(op.earlier) | before.difference(op.this_step)
            if op.req_id in failed or not spoiled.isdisjoint(op.after):
                # Computed over blocks whose load failed (here or on another rank; its own
                # load, or another request's whose blocks it shares): stored, it would be
                # served under the right ids. vLLM recomputes them; here they are only
                # missed later.
                log.debug("tierkv: not storing %s: a load it was computed over failed", op.req_id)
                continue
            if not op.chunks:
                continue
            self.guard.run(
                "a store (dropped)",
                partial(self._store, op, ready),
                partial(self._watch, op.req_id),
            )

    def _store(self, op: StoreOp, ready: bytes | None) -> None:
        assert self.link is not None
        # The deadline of any call: the blocks' event is complete (above), so the daemon's wait
        # for it is over at once.
        timeout = self.settings.timeout_s
        stored = self.link.call(
            lambda c: c.store(0, self.buffer, op.chunks, ready_event=ready, timeout=timeout)
        )
        self.stored_chunks += stored.stored

    def _note(self, meta: TierKVMetadata) -> None:
        """Remembers the requests the step plans calls for, before anything can fail: the
        scheduler half holds their blocks until :meth:`get_finished` reports them."""
        self._planned.update(op.req_id for op in meta.loads)
        self._planned.update(op.req_id for op in meta.stores)
        self._planned.update(op.req_id for op in meta.async_loads)
        self._planned.update(meta.async_unloadable)
        # vLLM frees these on the finished-recving report: never reported finished-sending. One
        # this rank reported already (in a step planned before vLLM finished the request) is
        # not waited for any more, and is forgotten at once.
        with self._lock:
            loaded = {item[0] for item in self._loaded}
            self._freed_on_recv.update(
                req_id
                for req_id in meta.freed_on_recv
                if req_id in self._loading or req_id in loaded
            )
            self._stale.update(r for r in meta.stale_loads if r in self._async_blocks)
        self._planned.difference_update(meta.freed_on_recv)
        self._finishing.difference_update(meta.freed_on_recv)

    def _take_failed_loads(self) -> set[str]:
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def _failed_anywhere(self, meta: TierKVMetadata) -> set[str]:
        """The requests whose load of this step failed on this rank or, with a TP group, on any
        rank. Every rank calls this with the same plan, so the all-reduce is taken by all ranks
        or by none, whatever happened here (even with no session)."""
        failed = self._take_failed_loads()
        if self.tp_group is None or not meta.loads:
            return failed
        flags = torch.tensor([op.req_id in failed for op in meta.loads], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.tp_group)
        anywhere = {op.req_id for op, flag in zip(meta.loads, flags.tolist(), strict=True) if flag}
        if anywhere - failed:
            log.warning(
                "tierkv: not storing what %d requests computed this step: "
                "their loads failed on another rank",
                len(anywhere - failed),
            )
        # Requests that had no load but blocks vLLM counts as loaded (``meta.unloadable``) are
        # the same on every rank.
        return anywhere | failed

    def get_finished(self, finished_req_ids: set[str], idle: bool = False) -> set[str]:
        """Of the requests that had a load or store here, those vLLM has said finished (now or
        before) whose unanswered calls are all settled: their blocks may be freed now. One whose
        check fails is asked about again at the next call. In a step that schedules nothing
        (``idle``: vLLM runs such steps back to back while a finished request waits here), the
        check waits up to :data:`IDLE_SETTLE_WAIT_S` for those calls, so that a stopped daemon
        does not have the engine spin."""
        self._finishing |= finished_req_ids & self._planned
        self._planned -= finished_req_ids
        deadline = time.monotonic() + (IDLE_SETTLE_WAIT_S if idle else 0.0)
        done = {
            req_id
            for req_id in list(self._finishing)
            if self.guard.run(
                "checking whether a finished request's calls are over (asked again next step)",
                partial(self._settled_by, req_id, deadline),
                lambda _e: False,
            )
        }
        self._finishing -= done
        return done

    def handle_preemptions(self, meta: TierKVMetadata) -> None:
        """Before a step reuses preempted requests' blocks: waits for the calls given up on for
        them, up to one deadline for them all, since vLLM freed those blocks without asking."""
        deadline = time.monotonic() + self.settings.timeout_s
        for req_id in meta.preempted:
            settled = self.guard.run(
                "waiting for a preempted request's calls",
                partial(self._settled_by, req_id, deadline),
                lambda _e: False,
            )
            if settled:
                continue
            log.error(
                "tierkv: the daemon has not finished a call given up on for preempted request %s; "
                "if it resumes, it may still copy into blocks vLLM reuses now",
                req_id,
            )

    def _watch(self, req_id: str, error: Exception) -> None:
        unanswered = error.unanswered if isinstance(error, Unavailable) else None
        if unanswered is not None:
            self._unanswered.setdefault(req_id, []).append(unanswered)

    def _settled_by(self, req_id: str, deadline: float) -> bool:
        """:meth:`_settled`, waiting until ``deadline`` (a ``time.monotonic()``) at most."""
        return self._settled(req_id, wait_s=max(deadline - time.monotonic(), 0.0))

    def _settled(self, req_id: str, wait_s: float = 0.0) -> bool:
        """Whether every call given up on for ``req_id`` is over (waiting up to ``wait_s``)."""
        pending = self._unanswered.get(req_id)
        if pending is None:
            return True
        deadline = time.monotonic() + wait_s
        pending[:] = [u for u in pending if not u.wait(max(deadline - time.monotonic(), 0.0))]
        if pending:
            return False
        # On the GPU the daemon's copies of an asynchronous retrieve end with its record of the
        # loading thread's done event; its connection closes once they are enqueued, so they
        # must land too (a synchronous retrieve's are over before its reply). They get a wait of
        # their own, as long as the caller's (calls answered at the end of it must not leave
        # the copies none), and the event is polled: one whose recorder died may never
        # complete, and the engine must not wait on it for ever (the request then stays
        # unsettled, its blocks held, and is asked about again).
        landed = max(deadline, time.monotonic() + wait_s)
        if self._async_done is not None and not _completes(self._async_done, landed):
            return False
        del self._unanswered[req_id]
        log.info("tierkv: the calls given up on for %s are over; its blocks may be reused", req_id)
        return True

    def _ready_event(self) -> bytes:
        """Records the worker's interprocess event on the current stream; its IPC handle."""
        if self._ready is None:
            self._ready = torch.cuda.Event(interprocess=True)
        self._ready.record(torch.cuda.current_stream())
        return bytes(self._ready.ipc_handle())

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def shutdown(self) -> None:
        self.guard.run("shutting down", self._shutdown, nothing)

    def _shutdown(self) -> None:
        with self._lock:
            self._closing = True
        try:
            if self._loader is not None:
                self._loads.put(None)
                self._loader.join(timeout=2 * self.settings.timeout_s)
            # Under the lock: a loading thread the join gave up on may still record calls.
            with self._lock:
                pending = [u for calls in self._unanswered.values() for u in calls]
                self._unanswered.clear()
            for unanswered in pending:
                unanswered.close()
        finally:
            # The step's session first: a loading thread the join above gave up on may still
            # hold its own session's lock (registering the KV memory on a new connection).
            if self.link is not None:
                self.link.close()
            with self._lock:
                loading_link = self._async_link
            if loading_link is not None:
                loading_link.close()
