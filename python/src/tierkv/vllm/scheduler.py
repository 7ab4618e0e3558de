"""The connector's scheduler half: how many tokens tierkv holds, and which chunks move when.

Per request it keeps the prompt's chunk ids (hashed once), the open lookup (one per rank key: one
with MLA, one per TP rank otherwise) and how far the prompt has been stored. The lookup's lease is
what guarantees the hit stays readable: it is taken in ``get_num_new_matched_tokens``, consumed by
the workers' retrieves in the step that loads, and returned by ``release`` when vLLM decides not to
load, preempts the request, or finishes it (a lookup a step's synchronous load goes through only
once that step has run: under async scheduling vLLM may preempt or finish the request while the
step is still in flight). A request vLLM's own prefix cache holds whole is not looked up but
touched (:class:`_Touch`: a deferred lookup released at once, on the background thread that returns
leases, over sessions of its own), so the daemon sees its chunks used. Any failure to reach the
daemon is a miss (0 tokens): vLLM computes the prefix itself. vLLM's reset of the connector's
cache starts a new cache epoch (:meth:`SchedulerSide.reset_cache`): a fresh salt in every later
request's chunk ids, and the requests known then frozen.

Every hook runs under the connector's :class:`~tierkv.vllm.guard.Guard`, so nothing that fails
here raises into vLLM's scheduler. Once vLLM has accepted external tokens
(``update_state_after_alloc``) it counts them computed, so a failure after that point must not
just drop the load: the tokens are recorded first (``promised``), and the step's metadata either
loads every block of them or lists the rest as ``unloadable``, which the workers report as
failed loads and vLLM recomputes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from tierkv import wire
from tierkv.client import Client
from tierkv.errors import ClientBusy, DaemonError
from tierkv.hashing import ROOT, chain
from tierkv.vllm.guard import Guard, nothing
from tierkv.vllm.link import Link, Unavailable
from tierkv.vllm.plan import ChunkBlocks, LoadOp, Settings, StoreOp, TierKVMetadata

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: How long a release that found its session busy waits before it is tried again, and how many
#: times: the session, and the lease, are still there, and would otherwise be held until the
#: lease's deadline.
_RELEASE_RETRY_S = 0.2
_RELEASE_TRIES = 3

#: vLLM's name of where a hit's tokens came from (``CacheHitSource``) when it is not known.
UNSPECIFIED = "external_unspecified"

#: vLLM's names (``CacheHitSource`` values) of the daemon's tiers, in ``per_tier``'s order: L1
#: and L2 are host memory, the disk tier disk, and the remote tier (Redis, shared with other
#: nodes) unspecified, as vLLM names a remote store. The daemon does not say where its L1 is
#: (``l1.device``: the GPU when it has one), so an L1 on a GPU counts as host memory too; vLLM's
#: ``device`` is the engine's own prefix cache.
TIER_SOURCES = ("host", "host", "disk", UNSPECIFIED)


@dataclass
class _Request:
    """What the scheduler side knows of one request."""

    chunks: list[int]
    #: Chunks a lookup may ask for: the prompt minus its last token (vLLM computes at least one).
    lookup_chunks: int
    #: The open lookups (one per rank key). Each asks for the prompt's chunks from the root,
    #: those vLLM's own prefix cache holds included, though only the chunks after those are
    #: loaded: the daemon sees every chunk of the prefix used, so its eviction policy keeps the
    #: shared roots that vLLM holds (a chunk is no use without its parent), and a root it lacks
    #: is a miss that this request's store puts back.
    lookups: list[int] | None = None
    #: Each lookup's hit, in chunks from the root (``None``: still prefetching).
    outcomes: list[int | None] = field(default_factory=list)
    #: Each lookup's hit chunks per tier of the daemon (``LookupOutcome.per_tier``: L1, L2,
    #: disk, remote), once known (empty for one that failed).
    per_tier: list[list[int]] = field(default_factory=list)
    #: Those of the lookups whose hit was last reported to vLLM: where its tokens came from
    #: (:meth:`SchedulerSide.hit_sources`).
    hit_tiers: list[list[int]] = field(default_factory=list)
    #: Each link's session generation when the lookups were made (one per link).
    generations: list[int] = field(default_factory=list)
    looked_at: float = 0.0
    hit_chunks: int = 0
    #: First chunk of a load vLLM accepted and the next step must perform.
    load_from: int | None = None
    block_ids: list[int] = field(default_factory=list)
    #: Chunks from the root known to be in tierkv (a lookup's hit, usable or not) or stored by
    #: an earlier step: the stores start after them.
    stored: int = 0
    #: Whether a load or store was planned: the workers then free the blocks (``get_finished``).
    planned: bool = False
    #: A lookup that gave no usable hit is kept (its lease returned) while vLLM keeps the request
    #: waiting: the tokens vLLM had computed then (``None``: nothing kept) and when it was made.
    miss_for: int | None = None
    missed_at: float = 0.0
    #: The first chunk that lookup missed: this engine's store of it ends the kept miss.
    missing: int | None = None
    #: vLLM's count of the request's preemptions, as of the last one settled here.
    preemptions: int = 0
    #: The tokens vLLM had computed when it was last looked up: an asynchronous load starts
    #: there (the hit itself counts from the root).
    asked_at: int = 0
    #: ``async_loads``: a load was planned that vLLM has not yet heard is over; vLLM keeps the
    #: request waiting, and frees its blocks on that report should it finish first.
    loading: bool = False
    #: ``async_loads``: a load of it failed. vLLM may ask again from scratch (a load that failed
    #: at its first block leaves nothing computed): the answer is no hit, so that a lookup whose
    #: retrieve keeps failing never keeps the request waiting for ever.
    load_failed: bool = False
    #: Its chunks were touched in the daemon (:class:`_Touch`): once in the request's life, not
    #: at every step vLLM keeps it waiting.
    touched: bool = False
    #: Known when vLLM reset the connector's cache (:meth:`SchedulerSide.reset_cache`): its
    #: chunk ids are of the epoch before, so it is never looked up, touched or stored again.
    frozen: bool = False


@dataclass(frozen=True)
class _Touch:
    """A prompt vLLM's own prefix cache holds whole (every chunk a lookup could ask for), to be
    touched in the daemon: no lookup of it is made, since none could load anything, and a store
    of a chunk the daemon holds touches nothing, so the daemon's eviction would see a hot prompt
    unused and let it go, and it would miss once vLLM lets it go too. The background thread
    looks up ``chunks[:count]`` with ``defer_prefetch`` on every rank's touch session and releases
    each lookup at once: the L1 hits are leased, which touches them (leaf first, so the root
    ends newest), nothing is prefetched from below L1, and nobody waits for the answer."""

    chunks: list[int]
    count: int
    #: The cache epoch it was queued in: one queued before a reset is dropped.
    epoch: int = 0


#: A load, as the scheduler half tells them apart: its request, and the step that planned it.
Load = tuple[str, int]


@dataclass(frozen=True)
class Scheduled:
    """One request of vLLM's scheduler output, as the plan needs it."""

    req_id: str
    #: Its block ids: all of them where ``whole`` (a new or resumed request), else the new ones.
    block_ids: list[int]
    whole: bool
    #: Tokens computed before this step: vLLM's own hit and the external tokens included.
    computed: int
    #: Tokens this step computes.
    scheduled: int


@dataclass(frozen=True)
class _Writes:
    """The blocks one request's step reads and writes."""

    #: Read whole: those before the block its first token goes into.
    read: list[int]
    #: The block its first token goes into, where that is not the block's first slot: the
    #: step reads its first ``offset`` slots and writes the rest up to ``inside_to``.
    inside: int | None
    offset: int
    inside_to: int
    #: Written whole, from the first slot to the last.
    whole: list[int]
    #: The block it stops inside, written from its first slot up to ``stops_at``.
    stops: int | None
    stops_at: int
    #: Every block it writes into.
    touched: list[int]


def scheduled_requests(out: SchedulerOutput) -> list[Scheduled]:
    """Every request vLLM's step computes, new and cached alike."""
    requests = [
        Scheduled(
            new.req_id,
            list(new.block_ids[0]),
            True,
            new.num_computed_tokens,
            out.num_scheduled_tokens.get(new.req_id, 0),
        )
        for new in out.scheduled_new_reqs
    ]
    cached = out.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        new_blocks = cached.new_block_ids[i]
        requests.append(
            Scheduled(
                req_id,
                list(new_blocks[0]) if new_blocks else [],
                req_id in cached.resumed_req_ids,
                cached.num_computed_tokens[i],
                out.num_scheduled_tokens.get(req_id, 0),
            )
        )
    return requests


def chunk_ids(tokens: list[int], chunk_tokens: int, salt: bytes) -> list[int]:
    """The chained ids of every full chunk of ``tokens``; ``salt`` (tenant, LoRA) enters the
    first chunk, so it separates every later one too."""
    ids: list[int] = []
    parent = ROOT
    for i in range(len(tokens) // chunk_tokens):
        parent = chain(
            parent, tokens[i * chunk_tokens : (i + 1) * chunk_tokens], salt if i == 0 else b""
        )
        ids.append(parent)
    return ids


def epoch_salt(salt: bytes, epoch: bytes) -> bytes:
    """A request's ``salt`` (:func:`request_salt`) in the cache epoch ``epoch`` (empty before
    the first reset, so that engines that never reset share chunks): the epoch, length-prefixed,
    then the salt. No salt of one epoch can pass for another's: every epoch's starts with its own
    length-prefixed bytes, and a request salt with ``tierkv-salt``."""
    if not epoch:
        return salt
    return b"tierkv-epoch" + len(epoch).to_bytes(4, "little") + epoch + salt


def not_from_tokens_alone(request: Request) -> bool:
    """Whether the request's KV depends on more than its token ids, the cache salt and the
    LoRA adapter (which :func:`request_salt` covers)."""
    multimodal = any(
        getattr(request, name, None) for name in ("mm_features", "mm_hashes", "mm_positions")
    )
    return multimodal or getattr(request, "prompt_embeds", None) is not None


def request_salt(request: Request) -> bytes:
    """What, besides its tokens, names a request's KV: its cache salt and its LoRA adapter (by
    name and by where its weights are, so two engines serving other adapters under one name do
    not share chunks). Empty for neither. Each part is length-prefixed, so no salt can pass for
    another salt and adapter."""
    salt = getattr(request, "cache_salt", None) or ""
    lora = getattr(request, "lora_request", None)
    name = (getattr(lora, "lora_name", None) or "") if lora is not None else ""
    path = (getattr(lora, "lora_path", None) or "") if lora is not None else ""
    if not (salt or name):
        return b""
    parts = [str(part).encode() for part in (salt, name, path)]
    return b"tierkv-salt" + b"".join(len(p).to_bytes(4, "little") + p for p in parts)


class SchedulerSide:
    """Lookups, leases and the per-step load and store plan.

    ``steps_in_flight`` is how many steps vLLM runs at once (``max_concurrent_batches``: 2
    under async scheduling, else 1): it plans a step only once it has the output of the step
    that many before, so that step's loads are over then."""

    def __init__(
        self,
        settings: Settings,
        namespace: str,
        chunk_bytes: int,
        block_size: int,
        tp_size: int,
        mla: bool,
        steps_in_flight: int = 2,
    ) -> None:
        self.settings = settings
        self.steps_in_flight = steps_in_flight
        self.block_size = block_size
        self.chunk_tokens = block_size * settings.chunk_blocks
        # One session per rank key: a lookup is of one rank's KV (MLA: the shared copy).
        ranks = [0] if mla else list(range(tp_size))
        hellos = [
            wire.hello(
                rank=r,
                tp_size=tp_size,
                world_size=tp_size,
                mla=mla,
                namespaces=[(namespace, "")],
                chunk_bytes=chunk_bytes,
                chunk_tokens=self.chunk_tokens,
            )
            for r in ranks
        ]
        self.links = [settings.link(h) for h in hellos]
        #: The background thread's sessions for touches (:class:`_Touch`), one per rank key,
        #: opened on the first touch: a touch's lookup and release never hold the session a
        #: lookup of the scheduler's thread needs, nor count against its leases. Leases are per
        #: session, so the releases of the scheduler's lookups stay on ``links``.
        self.touch_links = [settings.link(h) for h in hellos]
        self.requests: dict[str, _Request] = {}
        #: Blocks that loads planned in this step or the last fill (or that KV computed over
        #: such blocks went to): the step that planned it and the loads they depend on (each a
        #: request and the step that planned its load). A store of KV computed over them waits
        #: on those loads (``StoreOp.after``).
        self.fresh: dict[int, tuple[int, frozenset[Load]]] = {}
        #: Of those, the blocks a request computed over a freshly loaded one (rather than the
        #: loaded blocks themselves), and the loads they depend on: if one of those loads is
        #: reported failed, they hold KV computed over unwritten blocks.
        self.derived: dict[int, tuple[int, frozenset[Load]]] = {}
        #: Blocks vLLM reported unwritten (a failed load's) and nobody wrote since. Under the
        #: recompute policy vLLM keeps them in its prefix cache until a request computes into
        #: them again, so KV computed over them can come any number of steps later: a store
        #: whose blocks, or the blocks before them, include one is dropped.
        self.tainted: set[int] = set()
        #: Of the tainted blocks, how many slots from the first a request has rewritten over
        #: untainted KV since (its step stopped inside the block): a step that goes on from
        #: there over untainted KV to the block's end clears it.
        self.rewritten: dict[int, int] = {}
        self.steps = 0
        #: External tokens vLLM accepted this step, per request: recorded before anything can
        #: fail, so that the step's metadata loads them or reports their blocks.
        self.promised: dict[str, int] = {}
        self.guard = Guard(log)
        #: The TP ranks whose workers run without the daemon (their KV memory could not be
        #: registered), each with why, as the workers told it (:meth:`without_daemon`): no hit
        #: is reported once there is one.
        self.workers_without_daemon: dict[int, str] = {}
        #: Requests whose preemption was settled when they were looked up again, before the
        #: step that reports it (which then leaves them alone).
        self.settled_preemptions: set[str] = set()
        #: Requests with a kept miss, by the first chunk their lookup missed.
        self.waiting_on: dict[int, set[str]] = {}
        #: ``async_loads``: the blocks vLLM allocated to a request it keeps waiting for its
        #: load, recorded before anything can fail (should planning fail, every one of them is
        #: reported failed), and the load planned for it, until the step's metadata takes them.
        self.async_promised: dict[str, list[int]] = {}
        self.async_planned: dict[str, tuple[LoadOp | None, list[int]]] = {}
        #: Requests finished while vLLM waited for their load (``TierKVMetadata.freed_on_recv``).
        self.freed_on_recv: list[str] = []
        #: Those requests, by id, until vLLM hears their load is over: the loading thread's
        #: retrieve goes through their lookups, which are returned then (the daemon refuses a
        #: retrieve through a lookup released first).
        self.release_on_recv: dict[str, _Request] = {}
        #: Steps planned (``build_connector_meta`` calls).
        self.planned_steps = 0
        #: The lookups a step's synchronous loads go through, with that step's number
        #: (``planned_steps``), while it may not have run: under async scheduling vLLM plans the
        #: next step, and may preempt or abort the loading request, before the step in flight
        #: loads, and the daemon refuses a retrieve through a lookup released first.
        self.loading_through: dict[int, int] = {}
        #: Releases of such lookups, held back until their step has run: that step's number,
        #: and the release (the lookup's link, its session generation, the lookup).
        self.held_back: list[tuple[int, tuple[Link, int, int]]] = []
        #: The cache epoch (:meth:`reset_cache`): how many resets, and the salt every request met
        #: since the last one mixes into its first chunk (empty before the first).
        self.epoch = 0
        self.epoch_salt = b""
        #: Requests whose asynchronous load went to the workers before a reset and was not yet
        #: heard over: the next step's metadata has the workers report it failed
        #: (``TierKVMetadata.stale_loads``).
        self.stale_loads: list[str] = []
        #: The background thread's work: leases to return (a lookup, on the link that made it
        #: in that session generation), touches, and ``None`` to stop.
        self.releases: queue.SimpleQueue[tuple[Link, int, int] | _Touch | None] = (
            queue.SimpleQueue()
        )
        self.releaser = threading.Thread(
            target=self._release_in_background, name="tierkv-release", daemon=True
        )
        self.releaser.start()

    # -- vLLM's scheduler calls --------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that tierkv can load; a failure is no hit. With
        ``async_loads`` a hit is loaded asynchronously: vLLM keeps the request waiting for it."""
        tokens, _ = self.guard.run(
            "a lookup (a miss)",
            lambda: self._matched(request, num_computed_tokens),
            lambda _e: self._no_hit(request, num_computed_tokens),
        )
        return tokens, bool(self.settings.async_loads and tokens)

    def update_state_after_alloc(
        self, request: Request, num_external_tokens: int, block_ids: list[int] | None = None
    ) -> None:
        """vLLM allocated the request's blocks (``block_ids``: all of them, its own hit's
        included) and accepted ``num_external_tokens`` of the hit."""
        if self.settings.async_loads and num_external_tokens > 0:
            # vLLM waits for the workers to report this request: recorded first, so that the
            # step's metadata loads it or has the workers report every block of its external
            # tokens failed. Those only: its local hit's blocks are vLLM's prefix cache, maybe
            # read by running requests, which a report of them would rewind.
            blocks = list(block_ids or [])
            state = self.requests.get(request.request_id)
            if state is not None:
                blocks = self._external_blocks(state, num_external_tokens, blocks)
            self.async_promised[request.request_id] = blocks
            self.guard.run(
                "planning an asynchronous load (vLLM recomputes its blocks)",
                lambda: self._plan_async(request, num_external_tokens, list(block_ids or [])),
                nothing,
            )
            return
        if num_external_tokens > 0:
            # From here on vLLM counts these tokens computed: recorded first, so that the step's
            # metadata loads them or reports their blocks, whatever fails below.
            self.promised[request.request_id] = num_external_tokens
        self.guard.run(
            "planning a load (vLLM recomputes its blocks)",
            lambda: self._after_alloc(request, num_external_tokens),
            nothing,
        )

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """The ``num_external_tokens`` vLLM accepted of the request's last hit, split by the
        tier of the daemon that held them (vLLM's ``CacheHitSource`` values, :data:`TIER_SOURCES`):
        only non-zero counts, adding up to ``num_external_tokens``. A failure reports them all
        unspecified."""
        return self.guard.run(
            "splitting a hit by tier (reported unspecified)",
            lambda: self._hit_sources(request, num_external_tokens),
            lambda _e: {UNSPECIFIED: num_external_tokens} if num_external_tokens > 0 else {},
        )

    def without_daemon(self, ranks: dict[int, str]) -> None:
        """The workers of these TP ranks run without the daemon for the rest of their process
        (``ranks``: each one's reason): every load of the engine would fail there, and be
        recomputed, so from now on no hit is reported. Said once, as a warning."""
        if not ranks or self.workers_without_daemon:
            return
        self.workers_without_daemon = dict(ranks)
        log.warning(
            "tierkv: the workers of TP ranks %s run without the daemon (their KV memory could "
            "not be registered: %s); no hit is reported from now on, and nothing is stored (a "
            "new engine process registers again)",
            sorted(ranks),
            "; ".join(f"rank {rank}: {why}" for rank, why in sorted(ranks.items())),
        )

    def build_connector_meta(self, out: SchedulerOutput) -> TierKVMetadata:
        """The step's loads and stores. Should planning fail, the plan made so far goes out (a
        request marked as having calls must have them in it, or its blocks would be held for a
        report that never comes), and every block of the external tokens vLLM accepted this step
        that it does not load is ``unloadable``; should even that fail, the exception reaches
        vLLM: its step would read blocks nobody wrote."""
        promised, self.promised = self.promised, {}
        self.planned_steps += 1
        self._steps_run(self.planned_steps - self.steps_in_flight)
        meta = TierKVMetadata(
            preempted=sorted(out.preempted_req_ids or ()),
            idle=getattr(out, "total_num_scheduled_tokens", 1) == 0,
        )
        self._async_meta(meta)
        meta = self.guard.run(
            "planning the step (what it leaves unloaded is recomputed)",
            lambda: self._build(meta, out, promised),
            lambda _e: self._settle(meta, scheduled_requests(out), promised),
        )
        for op in meta.loads:
            self.loading_through.update(dict.fromkeys(op.lookups, self.planned_steps))
        scheduled = scheduled_requests(out)
        return self.guard.run(
            "finding what the step's stores were computed over (its stores are dropped)",
            lambda: self._untainted(self._after_loads(meta, scheduled), scheduled),
            lambda _e: self._drop_stores(meta, scheduled),
        )

    def update_connector_output(
        self,
        invalid_block_ids: set[int],
        finished_recving: Iterable[str] = (),
        failed_recving: Iterable[str] = (),
    ) -> None:
        """Notes the asynchronous loads vLLM now knows are over (``finished_recving``).
        Remembers the blocks vLLM reports unwritten (a load's that failed), and the blocks
        computed over fresh loads before the report came, by every request that read one of the
        failed loads' blocks: vLLM recomputes the loading request, but keeps another request's
        blocks computed over them as they are (they stay in its prefix cache, never written
        again), so whatever reads them is never stored."""
        finished_recving = set(finished_recving)
        load_failed = set(failed_recving)
        if invalid_block_ids:
            # A rank may report its failed blocks a step before the last rank reports the load
            # over (vLLM waits for every rank's report, and hears of each rank's failed blocks
            # as they come): a loading request holding one failed.
            load_failed.update(
                req_id
                for req_id, state in self.requests.items()
                if state.loading and not invalid_block_ids.isdisjoint(state.block_ids)
            )
        over = finished_recving.union(failed_recving)
        for req_id in load_failed:
            state = self.requests.get(req_id)
            if state is not None and not state.load_failed:
                state.load_failed = True
                # One rank's failed blocks, the others' loads still to come: they go through
                # the same lookups, which are returned once every rank's report is in (below).
                if state.loading and req_id not in over:
                    continue
                self.guard.run(
                    "returning a failed load's leases", partial(self._release, state), nothing
                )
        for req_id in finished_recving:
            state = self.requests.get(req_id)
            if state is not None:
                state.loading = False
                if state.load_failed:
                    self.guard.run(
                        "returning a failed load's leases once every rank's load is over",
                        partial(self._release, state),
                        nothing,
                    )
        for req_id in load_failed.union(finished_recving):
            finished = self.release_on_recv.pop(req_id, None)
            if finished is not None:
                self.guard.run(
                    "returning a finished request's leases once its load is over",
                    partial(self._release, finished),
                    nothing,
                )
        if not invalid_block_ids:
            return
        spoiled = set(invalid_block_ids)
        failed = self._fresh_loads(invalid_block_ids)
        if failed:
            # From here on the failure is known: whatever depends on those loads is tainted,
            # and a store planned from now on need not wait on them (``StoreOp.after``), so
            # that what vLLM recomputes over the blocks is stored.
            for made in (self.fresh, self.derived):
                gone = [block for block, (_, loads) in made.items() if not loads.isdisjoint(failed)]
                spoiled.update(gone)
                for block in gone:
                    del made[block]
        self.tainted |= spoiled
        for block in spoiled:
            self.rewritten.pop(block, None)
        self._rewind(invalid_block_ids)

    def _rewind(self, unwritten: set[int]) -> None:
        """Plans again, from the first chunk holding an unwritten block, the stores of every
        request whose blocks include one: vLLM recomputes such a request from there, and the
        stores planned over the failed load were dropped (a store of a block still tainted when
        planned is dropped again)."""
        per = self.settings.chunk_blocks
        for state in self.requests.values():
            for c in range(state.stored):
                if not unwritten.isdisjoint(state.block_ids[c * per : (c + 1) * per]):
                    state.stored = c
                    break

    def request_finished(self, request: Request) -> bool:
        """Returns the request's leases; whether its blocks wait for the workers to report it
        (every request that had a load or store: a call given up on may still be carried out)."""
        state = self.requests.pop(request.request_id, None)
        if state is None:
            return False
        self.guard.run(
            "returning a finished request's leases",
            lambda: self._finished(request.request_id, state),
            nothing,
        )
        if state.loading:
            # vLLM holds its blocks until the workers report the load over, and frees them
            # then: the workers must not report it finished a second time.
            self.freed_on_recv.append(request.request_id)
            return False
        return state.planned

    def reset_cache(self) -> bool:
        """vLLM reset the connector's cache (``reset_prefix_cache(reset_connector=True)``: it
        sleeps, pauses to update the weights, or frees its KV memory): nothing computed before
        must be served after. The daemon is shared by every engine of the node, and holds what
        other engines computed, so nothing is cleared there: a new cache epoch starts instead.
        Every request met from now on mixes a fresh random salt into its first chunk
        (:func:`epoch_salt`), so that it never finds a chunk stored before, and no engine that
        has not reset finds what it stores. Every request known now keeps its old ids, so it is
        frozen: its lookups are returned, it is never looked up, touched or stored again, and no
        load planned for it goes out (every block vLLM was promised is reported failed instead,
        and vLLM recomputes it); an asynchronous load already at the workers is reported failed
        by them (``stale_loads``). Always True: nothing here needs the daemon."""
        self.epoch += 1
        self.epoch_salt = os.urandom(16)
        for state in self.requests.values():
            # Marked first, and nothing here can fail: a request left unfrozen would go on
            # loading and storing under ids of the epoch before.
            state.frozen = True
            state.load_from = None
        # Asynchronous loads planned but not yet in a step's metadata: every block of them
        # is listed for the workers to report failed (vLLM already waits for them).
        self.async_planned = {
            req_id: (
                None,
                [b for _, held in op.chunks for b in held] + unloadable if op else unloadable,
            )
            for req_id, (op, unloadable) in self.async_planned.items()
        }
        self.stale_loads.extend(req_id for req_id, state in self.requests.items() if state.loading)
        self.guard.run(
            "returning the leases of the requests known at a reset", self._freeze, nothing
        )
        log.info(
            "tierkv: cache reset (epoch %d): what was stored before is not loaded again", self.epoch
        )
        return True

    def _freeze(self) -> None:
        """Returns the lookups of every request known at a reset (those a step in flight loads
        through once that step has run) and forgets their kept misses. A request with an
        asynchronous load at the workers keeps its lookup until that load is heard failed (its
        stale load is reported so) or the request finishes; should its load be heard over first
        (a report of the step in flight at the reset), until it finishes, or the lease's
        deadline."""
        for req_id, state in self.requests.items():
            self._forget_miss(req_id, state)
            if not state.loading:
                self._release(state)

    def shutdown(self) -> None:
        for state in self.requests.values():
            self.guard.run("returning leases at shutdown", partial(self._release, state), nothing)
        self.requests.clear()
        for state in self.release_on_recv.values():
            self.guard.run("returning leases at shutdown", partial(self._release, state), nothing)
        self.release_on_recv.clear()
        # No step runs any more: the releases held back for one go too.
        self._steps_run(self.planned_steps)
        self.releases.put(None)
        self.releaser.join(timeout=2 * self.settings.timeout_s)
        # Each session is ended with a deadline of its own (a hung daemon never answers the
        # bye): all at once, so that a TP group's sessions cost one deadline, not one each.
        # Whatever is not over by then is left to the daemon, which returns a session's leases
        # when its connection closes (at the process's exit at the latest).
        closers = [
            threading.Thread(
                target=self.guard.run,
                args=("closing a session at shutdown", link.close, nothing),
                name="tierkv-close",
                daemon=True,
            )
            for link in self.links + self.touch_links
        ]
        for closer in closers:
            closer.start()
        deadline = time.monotonic() + 2 * self.settings.timeout_s
        for closer in closers:
            closer.join(timeout=max(deadline - time.monotonic(), 0.0))

    # -- the hooks' bodies -------------------------------------------------------------------

    def _matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.workers_without_daemon:
            # A worker runs without the daemon: it could load nothing. Nothing is looked up,
            # and a request not known yet is not either (no store would be made of it).
            return 0, False
        req_id = request.request_id
        state = self._state(request)
        preemptions = getattr(request, "num_preemptions", 0)
        if preemptions != state.preemptions:
            # Preempted since it was last planned, and resumed before the step that reports
            # the preemption (vLLM's reset of its prefix cache preempts every running request
            # outside a schedule and resumes them in the next): settled now, so that this
            # lookup is a new one and the step's report of the preemption leaves it alone.
            self._preempted(req_id)
            state.preemptions = preemptions
            self.settled_preemptions.add(req_id)
        if state.lookup_chunks == 0 or state.load_failed or state.frozen:
            return 0, False
        if num_computed_tokens >= state.lookup_chunks * self.chunk_tokens:
            # vLLM's own prefix cache holds every chunk a lookup could find: no hit can pass it,
            # and a lookup would only prefetch what vLLM never reads (a step's wait, and L1
            # slots taken from other prefixes). Its chunks are touched in the daemon instead,
            # off this thread.
            self._release(state)
            self._touch(state)
            return 0, False
        if num_computed_tokens % self.chunk_tokens:
            return 0, False
        if self._miss_holds(req_id, state, num_computed_tokens):
            return 0, False
        hit = self._hit(state)
        if hit is None:
            return None, False
        # The daemon holds the hit's chunks and, short of the last chunk asked for, not the
        # next: the request's stores start there, whatever an earlier lookup found or an earlier
        # step stored. What it lacks of vLLM's own hit (tierkv let it go) is stored from the
        # request's blocks. A hit of every chunk asked for says nothing of the prompt's last
        # chunk (a prompt that fills it ends in it, and a lookup never asks for the last
        # token): the daemon may have let it go since this request stored it, so it is stored
        # again (a store of a chunk the daemon holds costs a transfer, a chunk lost a miss).
        state.stored = hit
        hit_tokens = hit * self.chunk_tokens
        if hit_tokens <= num_computed_tokens:
            self._release(state)
            self._keep_miss(req_id, state, num_computed_tokens, hit)
            return 0, False
        state.hit_chunks = hit
        state.hit_tiers = list(state.per_tier)
        state.asked_at = num_computed_tokens
        return hit_tokens - num_computed_tokens, False

    def _hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """The tokens ``[asked_at, asked_at + num_external_tokens)`` of the request's hit (those
        vLLM accepted: the hit is a prefix from the root, and vLLM's own hit ends where the
        lookup was asked), by tier.

        The daemon gives each lookup's count of chunks per tier, not which positions each tier
        held, so the split assumes that every tier holds its part of a hit root first, in
        ``per_tier``'s order: L1 the first chunks, L2 the next, then the disk, then the remote
        tier. That is what the daemon's eviction leaves (every tier lets a chain's tail go
        before its parents, so each holds a prefix of it) as long as no tier lost a parent and
        kept its child. With TP > 1 each rank's lookup counts its own copy; a position counts
        for the slowest tier any rank needed it from, as the daemon counts one chunk over KV
        groups. What no count covers (a hit known by none, or past it) is unspecified."""
        split: dict[str, int] = {}
        if num_external_tokens <= 0:
            return split
        state = self.requests.get(request.request_id)
        if state is None:
            return {UNSPECIFIED: num_external_tokens}
        start = state.asked_at
        end = start + num_external_tokens
        # Where each tier's part ends, in chunks from the root: a position is past tier t on
        # some rank once it is past it on the rank whose first t + 1 tiers hold the fewest.
        ends: list[int] = []
        if state.hit_tiers and all(state.hit_tiers):
            ends = [
                min(sum(counts[: t + 1]) for counts in state.hit_tiers)
                for t in range(len(TIER_SOURCES))
            ]
        begin = 0
        for source, tier_end in zip(TIER_SOURCES, ends, strict=False):
            lo, hi = max(start, begin * self.chunk_tokens), min(end, tier_end * self.chunk_tokens)
            if hi > lo:
                split[source] = split.get(source, 0) + hi - lo
            begin = tier_end
        known = sum(split.values())
        if known < num_external_tokens:
            split[UNSPECIFIED] = split.get(UNSPECIFIED, 0) + num_external_tokens - known
        return split

    def _miss_holds(self, req_id: str, state: _Request, num_computed_tokens: int) -> bool:
        """Whether the request's kept miss still answers: vLLM computed no fewer tokens than when
        it was made (fewer, and the same hit could pass them), and it is younger than
        ``miss_refresh_s`` (other engines may have stored since). Otherwise it is dropped."""
        if state.miss_for is None:
            return False
        young = time.monotonic() - state.missed_at < self.settings.miss_refresh_s
        if young and num_computed_tokens >= state.miss_for:
            return True
        self._forget_miss(req_id, state)
        return False

    def _keep_miss(self, req_id: str, state: _Request, num_computed_tokens: int, hit: int) -> None:
        """Keeps a lookup's answer of no usable hit (its lease already returned), and notes the
        first chunk it missed, whose store by this engine would grow the hit."""
        self._forget_miss(req_id, state)
        if self.settings.miss_refresh_s <= 0:
            return
        state.miss_for = num_computed_tokens
        state.missed_at = time.monotonic()
        if hit < state.lookup_chunks:
            state.missing = state.chunks[hit]
            self.waiting_on.setdefault(state.missing, set()).add(req_id)

    def _forget_miss(self, req_id: str, state: _Request) -> None:
        if state.missing is not None:
            waiting = self.waiting_on.get(state.missing)
            if waiting is not None:
                waiting.discard(req_id)
                if not waiting:
                    del self.waiting_on[state.missing]
        state.miss_for = None
        state.missing = None

    def _stored(self, chunks: list[ChunkBlocks]) -> None:
        """This step stores ``chunks``: the kept misses that missed one of them are dropped, so
        their requests look up again at the next step."""
        for chunk, _ in chunks:
            for req_id in self.waiting_on.pop(chunk, ()):
                state = self.requests.get(req_id)
                if state is not None:
                    state.miss_for = None
                    state.missing = None

    def _no_hit(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """A failed lookup's answer: no hit, kept like a miss (a refusing daemon is not asked
        again each step), and the request's leases are returned."""
        self.guard.run(
            "returning a failed lookup's leases",
            lambda: self._drop_lookups(request.request_id, num_computed_tokens),
            nothing,
        )
        return 0, False

    def _drop_lookups(self, req_id: str, num_computed_tokens: int) -> None:
        state = self.requests.get(req_id)
        if state is None:
            # It failed before the request's state was made (prompt token ids that do not hash,
            # say): the request is never looked up again.
            self.requests[req_id] = _Request(chunks=[], lookup_chunks=0)
            return
        self._release(state)
        self._forget_miss(req_id, state)
        if self.settings.miss_refresh_s > 0:
            state.miss_for = num_computed_tokens
            state.missed_at = time.monotonic()

    def _finished(self, req_id: str, state: _Request) -> None:
        self._forget_miss(req_id, state)
        if state.loading:
            self.release_on_recv[req_id] = state
        else:
            self._release(state)

    def _after_alloc(self, request: Request, num_external_tokens: int) -> None:
        state = self.requests.get(request.request_id)
        if state is None:
            return
        if num_external_tokens == 0 or state.frozen:
            # Frozen (a reset came between the answer and the allocation): no load is planned,
            # and the step's metadata reports every block vLLM was promised failed.
            self._release(state)
            state.load_from = None
            return
        state.load_from = state.hit_chunks - num_external_tokens // self.chunk_tokens

    def _plan_async(self, request: Request, num_external_tokens: int, block_ids: list[int]) -> None:
        """Plans the asynchronous load of the hit's chunks vLLM accepted into ``block_ids``, as
        the synchronous path plans it; the blocks of those tokens it cannot fill are listed for
        the workers to report failed."""
        req_id = request.request_id
        state = self.requests[req_id]
        state.block_ids = list(block_ids)
        state.load_from = None
        first = state.asked_at // self.chunk_tokens
        end = first + num_external_tokens // self.chunk_tokens
        external = self._external_blocks(state, num_external_tokens, block_ids)
        per = self.settings.chunk_blocks
        chunks: list[ChunkBlocks] = []
        # Frozen (a reset came between the answer and the allocation), nothing is loaded: every
        # block of the external tokens is reported failed.
        if state.lookups is not None and end <= state.hit_chunks and not state.frozen:
            for c in range(first, end):
                held = block_ids[c * per : (c + 1) * per]
                if len(held) != per:
                    break
                chunks.append((state.chunks[c], held))
        filled = {b for _, held in chunks for b in held}
        op = LoadOp(req_id, list(state.lookups), chunks) if chunks and state.lookups else None
        # The workers' retrieves return the lease; request_finished releases what is left.
        state.stored = max(state.stored, end)
        self.async_planned[req_id] = (op, [b for b in external if b not in filled])

    def _external_blocks(
        self, state: _Request, num_external_tokens: int, block_ids: list[int]
    ) -> list[int]:
        """The blocks of ``block_ids`` (all of a request's) that hold the hit's external tokens,
        which start where the lookup was asked (vLLM's own hit ends there)."""
        return block_ids[state.asked_at // self.block_size :][
            : -(-num_external_tokens // self.block_size)
        ]

    def _async_meta(self, meta: TierKVMetadata) -> None:
        """Puts the asynchronous loads planned since the last step in ``meta``: every request
        vLLM keeps waiting gets its load, or the blocks no load fills (all of them, should its
        plan be missing), so that the workers report it whatever happens."""
        promised, self.async_promised = self.async_promised, {}
        planned, self.async_planned = self.async_planned, {}
        meta.freed_on_recv, self.freed_on_recv = self.freed_on_recv, []
        meta.stale_loads, self.stale_loads = self.stale_loads, []
        for req_id, blocks in promised.items():
            state = self.requests.get(req_id)
            if state is not None:
                # Marked before the load joins the plan: vLLM now waits for the workers.
                state.loading = True
                state.planned = True
            op, unloadable = planned.get(req_id, (None, blocks))
            if op is not None:
                meta.async_loads.append(op)
            if unloadable or op is None:
                meta.async_unloadable[req_id] = unloadable
                self.guard.throttle.warning(
                    "unloadable",
                    "tierkv: %d blocks of %s that vLLM waits for have no load; "
                    "the workers report them failed and vLLM recomputes them",
                    len(unloadable),
                    req_id,
                )

    def _build(
        self, meta: TierKVMetadata, out: SchedulerOutput, promised: dict[str, int]
    ) -> TierKVMetadata:
        settled, self.settled_preemptions = self.settled_preemptions, set()
        for req_id in meta.preempted:
            if req_id in settled:
                continue
            self.guard.run(
                "returning a preempted request's leases",
                partial(self._preempted, req_id),
                nothing,
            )
        scheduled = scheduled_requests(out)
        for request in scheduled:
            state = self.requests.get(request.req_id)
            if state is None:
                continue
            self.guard.run(
                "planning a request's loads and stores (what it leaves unloaded is recomputed)",
                partial(self._plan, meta, request, state),
                nothing,
            )
        return self._settle(meta, scheduled, promised)

    def _after_loads(self, meta: TierKVMetadata, scheduled: list[Scheduled]) -> TierKVMetadata:
        """Names, in each store of ``meta``, the loads whose blocks its KV was computed over.

        A load that fails leaves its blocks unwritten, and vLLM learns of it only after the
        step (a step later under async scheduling). Meanwhile any request whose blocks include
        them, through vLLM's prefix cache or because they are its own, computes over them, and
        so does one that reads what such a request computed: their stores must wait on that
        load. vLLM then recomputes every request concerned."""
        self.steps += 1
        step = self.steps
        self.fresh = {b: made for b, made in self.fresh.items() if made[0] >= step - 1}
        self.derived = {b: made for b, made in self.derived.items() if made[0] >= step - 1}
        for op in meta.loads:
            loader = (step, frozenset(((op.req_id, step),)))
            self.fresh.update((b, loader) for _, held in op.chunks for b in held)
        for req_id, blocks in meta.unloadable.items():
            self.fresh.update((b, (step, frozenset(((req_id, step),)))) for b in blocks)
        if not self.fresh:
            return meta
        # Every block computed this step over a fresh one (a request's own load, or another's
        # block through vLLM's prefix cache) depends on its load.
        for request in scheduled:
            computing = self._computing(request)
            if computing is None:
                continue
            reads, written, _ = computing
            loads = self._fresh_loads(reads)
            if loads:
                for block in written:
                    earlier = self.derived.get(block, (step, frozenset()))[1]
                    self.derived[block] = (step, earlier | loads)
        per = self.settings.chunk_blocks
        for store in meta.stores:
            state = self.requests.get(store.req_id)
            read = state.block_ids[: state.stored * per] if state is not None else []
            after = self._fresh_loads(read + [b for _, held in store.chunks for b in held])
            if after:
                store.after = sorted({req_id for req_id, _ in after})
                # A request may load in two steps in a row (resumed at once after vLLM reset
                # its prefix cache): a store that depends on one of its loads only does not wait
                # on the other.
                steps = {r: {s for loader, s in after if loader == r} for r in store.after}
                store.this_step = [r for r in store.after if steps[r] == {step}]
                store.earlier = [r for r in store.after if step not in steps[r]]
                # What it computed over them is as good as those loads, for whoever reads it
                # next. Only that: a chunk of blocks computed before the loads (this request's
                # prefix hit, stored by it for the first time) holds KV as good as it was,
                # and tainted should one of the loads fail, it would be for as long as vLLM
                # keeps it, and with it every chunk after it of every request sharing it.
                made = (step, after)
                for _, held in store.chunks:
                    for block in held:
                        if block in self.derived:
                            self.fresh.setdefault(block, made)
        return meta

    def _fresh_loads(self, blocks: Iterable[int]) -> frozenset[Load]:
        """The loads (of this step or the last) ``blocks`` depend on."""
        loads: frozenset[Load] = frozenset()
        for block in blocks:
            made = self.fresh.get(block)
            if made is not None:
                loads |= made[1]
        return loads

    def _computing(self, request: Scheduled) -> tuple[list[int], list[int], int] | None:
        """The blocks a scheduled request's step reads (those before its first new token; the
        one holding its last computed token may be half written, so it is read), those it
        writes into (the last one perhaps only in part), and how many of those it writes whole;
        ``None`` for a request the scheduler half does not know."""
        state = self.requests.get(request.req_id)
        if state is None:
            return None
        first = -(-request.computed // self.block_size)
        computed = request.computed + request.scheduled
        end = -(-computed // self.block_size)
        whole = max(computed // self.block_size - first, 0)
        return state.block_ids[:first], state.block_ids[first:end], whole

    def _writes(self, request: Scheduled) -> _Writes | None:
        """What a scheduled request's step reads and writes, block by block; ``None`` for a
        request the scheduler half does not know."""
        state = self.requests.get(request.req_id)
        if state is None:
            return None
        size, blocks = self.block_size, state.block_ids
        start, end = request.computed, request.computed + request.scheduled
        first, offset = divmod(start, size)
        whole_from = -(-start // size)
        stops = end // size if end % size and end // size >= whole_from else None
        return _Writes(
            read=blocks[:first],
            inside=blocks[first] if offset and first < len(blocks) else None,
            offset=offset,
            inside_to=min(end - first * size, size),
            whole=blocks[whole_from : max(end // size, whole_from)],
            stops=blocks[stops] if stops is not None and stops < len(blocks) else None,
            stops_at=end % size,
            touched=blocks[first : -(-end // size)],
        )

    def _untainted(self, meta: TierKVMetadata, scheduled: list[Scheduled]) -> TierKVMetadata:
        """Forgets the tainted blocks this step rewrites over untainted KV (a request computing
        one from its first slot to its last, in this step or over several, or a load filling
        it: one that fails is reported again), taints every block a request writes over a
        tainted one, then drops every store that reads or writes a block still tainted."""
        if not self.tainted:
            return meta
        # An asynchronous load's blocks are read by nobody until vLLM hears the load is over,
        # and it hears of a failure's blocks no later than that (tainted again then).
        for op in meta.loads + meta.async_loads:
            for _, held in op.chunks:
                self.tainted.difference_update(held)
                for block in held:
                    self.rewritten.pop(block, None)
        steps = [w for request in scheduled if (w := self._writes(request)) is not None]
        # What a request computes over a tainted block is as unwritten as that block: vLLM
        # keeps it in its prefix cache and never recomputes it (it heard of the load's blocks
        # only), and once the block before it is rewritten nothing else would keep it out of
        # tierkv. Within the step every layer writes the whole batch's KV before attention reads
        # it, so a request reads what another rewrites in the same step: the requests that
        # compute over tainted blocks are found together, until none is added (each one added
        # only taints more, so this ends).
        over: set[int] = set()
        while True:
            tainted, rewritten = self._after_step(steps, over)
            more = {
                i
                for i, w in enumerate(steps)
                if i not in over and self._reads_tainted(w, tainted, rewritten)
            }
            if not more:
                break
            over |= more
        self.tainted = tainted
        self.rewritten = {b: n for b, n in rewritten.items() if b in tainted and n > 0}
        per = self.settings.chunk_blocks
        for store in meta.stores:
            state = self.requests.get(store.req_id)
            read = state.block_ids[: state.stored * per] if state is not None else []
            written = [b for _, held in store.chunks for b in held]
            if not self.tainted.isdisjoint(read + written):
                log.debug(
                    "tierkv: not storing %s: computed over blocks never rewritten", store.req_id
                )
                self._unplan(store)
        return meta

    def _after_step(self, steps: list[_Writes], over: set[int]) -> tuple[set[int], dict[int, int]]:
        """The tainted blocks, and how far from its first slot each is rewritten, once
        ``steps`` are computed: those of ``over`` over a tainted block."""
        size = self.block_size
        tainted, rewritten = set(self.tainted), dict(self.rewritten)
        for i, w in enumerate(steps):
            if i in over:
                continue
            tainted.difference_update(w.whole)
            if w.inside in self.tainted and self.rewritten.get(w.inside, 0) >= w.offset:
                # It goes on from where an earlier step stopped rewriting the block.
                done = max(rewritten.get(w.inside, 0), w.inside_to)
                if done >= size:
                    tainted.discard(w.inside)
                rewritten[w.inside] = done
            if w.stops in self.tainted:
                # Its first slots are rewritten; the rest still holds what was there.
                rewritten[w.stops] = max(rewritten.get(w.stops, 0), w.stops_at)
        for i in over:
            w = steps[i]
            for block in w.touched:
                tainted.add(block)
                # In the block it starts inside, the slots before its first keep what they
                # held; everything else it writes is unwritten.
                kept = w.offset if block == w.inside else 0
                if block in self.tainted:
                    kept = min(kept, self.rewritten.get(block, 0))
                rewritten[block] = min(kept, rewritten.get(block, kept))
        return tainted, rewritten

    def _reads_tainted(self, w: _Writes, tainted: set[int], rewritten: dict[int, int]) -> bool:
        """Whether a step reads a tainted block, as the step leaves them (``tainted``,
        ``rewritten``): one before the block it starts inside, or that one's slots before its
        first token, not all rewritten."""
        if not tainted.isdisjoint(w.read):
            return True
        if w.inside is None or w.inside not in tainted:
            return False
        return rewritten.get(w.inside, 0) < w.offset

    def _drop_stores(self, meta: TierKVMetadata, scheduled: list[Scheduled]) -> TierKVMetadata:
        """Empties every store of ``meta`` (a miss later), keeping the requests in the plan:
        they are marked as having calls, so the workers must hear of them. With blocks tainted,
        every block the step writes into is tainted too: what it computed over them could not
        be found, and must not be stored later either."""
        for op in meta.stores:
            self._unplan(op)
        if self.tainted:
            for request in scheduled:
                state = self.requests.get(request.req_id)
                if state is None:
                    continue
                first = request.computed // self.block_size
                end = -(-(request.computed + request.scheduled) // self.block_size)
                self.tainted.update(state.block_ids[first:end])
                for block in state.block_ids[first:end]:
                    self.rewritten.pop(block, None)
        return meta

    def _unplan(self, op: StoreOp) -> None:
        """Drops the store ``op`` and plans its chunks again from the first: a later step stores
        them once the request holds them computed over written KV (rewritten, or recomputed
        after a preemption), not before (a store of a block still tainted is dropped again)."""
        state = self.requests.get(op.req_id)
        if state is not None and op.chunks:
            first = op.chunks[0][0]
            if first in state.chunks:
                state.stored = min(state.stored, state.chunks.index(first))
        op.chunks = []

    def _preempted(self, req_id: str) -> None:
        state = self.requests.get(req_id)
        if state is not None:
            # When it resumes it looks up afresh: it may have stored what it missed.
            self._forget_miss(req_id, state)
            self._release(state)
            # Its block ids are kept until it resumes (with all of them anew): under async
            # scheduling vLLM may report a load of the step in flight failed after this, and
            # the stores that step dropped must be planned again (``_rewind``).
            state.load_from = None

    def _settle(
        self, meta: TierKVMetadata, scheduled: list[Scheduled], promised: dict[str, int]
    ) -> TierKVMetadata:
        """Lists in ``meta.unloadable`` every block of the external tokens vLLM accepted this
        step (``promised``) that no load of ``meta`` fills; no load is planned for them later."""
        if not promised:
            return meta
        loading: dict[str, set[int]] = {}
        for op in meta.loads:
            loading.setdefault(op.req_id, set()).update(b for _, held in op.chunks for b in held)
        for request in scheduled:
            external = promised.get(request.req_id, 0)
            if external <= 0:
                continue
            state = self.requests.get(request.req_id)
            if state is not None:
                state.load_from = None
            held = request.block_ids if request.whole or state is None else state.block_ids
            # vLLM's computed tokens count its own hit and the external tokens.
            first = max(request.computed - external, 0) // self.block_size
            end = -(-request.computed // self.block_size)
            filled = loading.get(request.req_id, set())
            unloadable = [b for b in held[first:end] if b not in filled]
            if unloadable:
                meta.unloadable[request.req_id] = unloadable
                self.guard.throttle.warning(
                    "unloadable",
                    "tierkv: %d blocks of %s that vLLM counts as loaded have no load; "
                    "the workers report them failed and vLLM recomputes them",
                    len(unloadable),
                    request.req_id,
                )
        return meta

    # -- internals ---------------------------------------------------------------------------

    def _state(self, request: Request) -> _Request:
        state = self.requests.get(request.request_id)
        if state is None:
            tokens = list(request.prompt_token_ids or [])
            # KV that the token ids do not determine (images and other multimodal inputs behind
            # placeholder tokens, prompt embeddings) is neither looked up nor stored: two such
            # prompts with equal ids would share chunks of different KV.
            ids = (
                []
                if not_from_tokens_alone(request)
                else chunk_ids(
                    tokens, self.chunk_tokens, epoch_salt(request_salt(request), self.epoch_salt)
                )
            )
            lookup = min(max(len(tokens) - 1, 0) // self.chunk_tokens, len(ids))
            state = _Request(chunks=ids, lookup_chunks=lookup)
            self.requests[request.request_id] = state
        return state

    def _hit(self, state: _Request) -> int | None:
        """The hit in chunks from the root (the least over rank keys), ``None`` while a prefetch
        runs. The open lookups are used again unless a session changed or they are older than
        ``lookup_refresh_s``; otherwise they are returned and made again."""
        generations = [link.generation for link in self.links]
        stale = time.monotonic() - state.looked_at > self.settings.lookup_refresh_s
        if state.lookups is None or state.generations != generations or stale:
            self._release(state)
            self._look_up(state, state.chunks[: state.lookup_chunks])
        assert state.lookups is not None
        # Every rank is asked each time, not only up to the first still prefetching: the first
        # query of a deferred lookup starts its prefetch, and the ranks' prefetches overlap.
        prefetching = False
        for i, (link, lookup) in enumerate(zip(self.links, state.lookups, strict=True)):
            if state.outcomes[i] is None:
                try:
                    outcome = link.call(partial(Client.query, lookup=lookup))
                except DaemonError as e:
                    log.debug("tierkv: lookup %d failed: %s", lookup, e)
                    state.outcomes[i] = 0
                    state.per_tier[i] = []
                    continue
                if outcome is None:
                    if time.monotonic() - state.looked_at > self.settings.timeout_s:
                        state.outcomes[i] = 0  # a prefetch past the deadline is a miss
                        state.per_tier[i] = []
                        continue
                    prefetching = True
                    continue
                state.outcomes[i] = outcome.hit_chunks
                state.per_tier[i] = list(outcome.per_tier)
        if prefetching:
            return None
        # Never more than was asked for: vLLM must compute at least the prompt's last token.
        return min(min(o or 0 for o in state.outcomes), state.lookup_chunks)

    def _look_up(self, state: _Request, wanted: list[int]) -> None:
        """Makes one lookup of ``wanted`` per rank key and records them in ``state``; should one
        fail, those made are returned and it raises."""
        # Each rank keeps its own copy of the KV (without MLA): every rank's lookup leases its
        # L1 hits before any prefetches (the queries start them), or one rank's prefetch could
        # evict the hits the next rank's lookup was about to lease.
        defer = len(self.links) > 1
        # Each lookup with the generation of the session that made it (a link connects, or
        # reconnects, inside its call).
        started: list[tuple[Any, int]] = []
        try:
            for link in self.links:
                started.append((link.call(lambda c: c.lookup(0, wanted, defer)), link.generation))
        except BaseException:
            # Refused (e.g. lease_limit: the session holds its cap of leases), a rank's session
            # is down, or anything else: a miss for now, and the lookups already made on the
            # other ranks' sessions are returned, not left to their lease deadline: off the
            # scheduler's thread, since a daemon that just failed one call may be slow to
            # answer these too.
            for link, (s, generation) in zip(self.links, started, strict=False):
                self.releases.put((link, generation, s.lookup))
            raise
        state.lookups = [s.lookup for s, _ in started]
        state.outcomes = [s.outcome.hit_chunks if s.outcome else None for s, _ in started]
        state.per_tier = [list(s.outcome.per_tier) if s.outcome else [] for s, _ in started]
        state.generations = [generation for _, generation in started]
        state.looked_at = time.monotonic()

    def _plan(self, meta: TierKVMetadata, request: Scheduled, state: _Request) -> None:
        if request.whole:
            state.block_ids = list(request.block_ids)
        else:
            state.block_ids.extend(request.block_ids)
        req_id = request.req_id
        computed = request.computed + request.scheduled
        per = self.settings.chunk_blocks
        blocks = state.block_ids

        def blocks_of(c: int) -> list[int] | None:
            held = blocks[c * per : (c + 1) * per]
            return held if len(held) == per else None

        if state.load_from is not None and state.lookups is not None:
            chunks: list[ChunkBlocks] = []
            for c in range(state.load_from, state.hit_chunks):
                held = blocks_of(c)
                if held is None:
                    break
                chunks.append((state.chunks[c], held))
            if chunks:
                # Marked before the load joins the plan: a request whose blocks the workers
                # report must have been told to vLLM as waiting for that report.
                state.planned = True
                meta.loads.append(LoadOp(req_id, list(state.lookups), chunks))
            # The workers' retrieves return the lease; request_finished releases what is left.
            state.stored = max(state.stored, state.hit_chunks)
        state.load_from = None
        if state.frozen:
            # Its chunk ids are of the epoch before the reset: nothing computed since is stored
            # under them.
            return
        complete = min(computed // self.chunk_tokens, len(state.chunks))
        stores: list[ChunkBlocks] = []
        for c in range(state.stored, complete):
            held = blocks_of(c)
            if held is None:
                break
            stores.append((state.chunks[c], held))
        if stores:
            state.planned = True
            meta.stores.append(StoreOp(req_id, stores))
            state.stored += len(stores)
            self._stored(stores)

    def _touch(self, state: _Request) -> None:
        """Has the background thread touch the request's chunks in the daemon (:class:`_Touch`),
        once: this thread only queues it."""
        if state.touched:
            return
        state.touched = True
        self.releases.put(_Touch(state.chunks, state.lookup_chunks, self.epoch))

    def _release(self, state: _Request) -> None:
        """Returns the request's lookups, each on its own link's session as long as that session
        is the one that made it (a session that is gone returned its lookups itself): one rank's
        reconnect does not keep the other ranks' leases to their deadline. A lookup that a step
        not known to have run loads through is held back until it has (``loading_through``)."""
        lookups, state.lookups = state.lookups, None
        state.outcomes = []
        state.per_tier = []
        if lookups is None:
            return
        for link, generation, lookup in zip(self.links, state.generations, lookups, strict=True):
            step = self.loading_through.get(lookup)
            if step is None:
                self.releases.put((link, generation, lookup))
            else:
                self.held_back.append((step, (link, generation, lookup)))

    def has_held_back_releases(self) -> bool:
        """Whether releases wait for a step to run (``held_back``): they go out at a later
        plan, so the engine should keep planning steps (vLLM's ``has_pending_push_work``)."""
        return bool(self.held_back)

    def _steps_run(self, last: int) -> None:
        """Every step up to ``last`` (a ``planned_steps`` number) has run, its loads with it:
        the releases held back for their lookups go out."""
        self.loading_through = {
            lookup: step for lookup, step in self.loading_through.items() if step > last
        }
        held, self.held_back = self.held_back, []
        for step, release in held:
            if step <= last:
                self.releases.put(release)
            else:
                self.held_back.append((step, release))

    def _release_in_background(self) -> None:
        """Returns leases off the scheduler's loop: a release is needed only where a lookup was
        not (entirely) consumed by the workers' retrieves, and vLLM should not wait for it. One
        that found the session busy with the scheduler thread's call is tried again a little
        later (a few times), since the session, and the lease, are still there. Touches
        (:class:`_Touch`) are made here too, for the same reason, on sessions of their own."""
        again: list[tuple[Link, int, int, int]] = []
        while True:
            if again:
                try:
                    item = self.releases.get(timeout=_RELEASE_RETRY_S)
                except queue.Empty:
                    self._release_one(*again.pop(0), again)
                    continue
            else:
                item = self.releases.get()
            if item is None:
                return
            if isinstance(item, _Touch):
                self._touch_now(item, again)
            else:
                self._release_one(*item, 0, again)

    def _touch_now(self, touch: _Touch, again: list[tuple[Link, int, int, int]]) -> None:
        """Looks up the touch's chunks on every rank's touch session (``touch_links``), deferred
        (no prefetch), and releases each lookup made on the session that made it, once (a
        release that finds the session busy is tried again like any other). A lookup that
        fails leased nothing, or its session is gone with its leases: it is skipped, as a miss
        would be."""
        if touch.epoch != self.epoch:
            return  # queued before a reset: its chunks are of the epoch before
        wanted = touch.chunks[: touch.count]
        for link in self.touch_links:
            try:
                started = link.call(lambda c: c.lookup(0, wanted, True))
            except (Unavailable, DaemonError):
                continue
            except Exception as e:
                # Not the daemon's doing: once a minute at most, as the guard's warnings.
                self.guard.throttle.warning(
                    "touch", "tierkv: a touch of %d chunks failed", len(wanted), exc_info=e
                )
                continue
            # The generation read after the call: the call may have opened a new session,
            # which made the lookup (one replaced since returned its leases as it ended).
            self._release_one(link, link.generation, started.lookup, 0, again)

    def _release_one(
        self,
        link: Link,
        generation: int,
        lookup: int,
        tries: int,
        again: list[tuple[Link, int, int, int]],
    ) -> None:
        if link.generation != generation:
            return  # a lookup of a session that is gone: the daemon returned it already
        # Already consumed by the retrieves, expired, or the daemon is gone: nothing to return.
        # Nothing may end the thread but shutdown, or later leases would wait for the TTL.
        try:
            link.call(lambda c: c.release(lookup))
        except Unavailable as e:
            if isinstance(e.__cause__, ClientBusy) and tries < _RELEASE_TRIES:
                again.append((link, generation, lookup, tries + 1))
        except DaemonError:
            pass
        except Exception:
            log.warning("tierkv: release of lookup %d failed", lookup, exc_info=True)


def namespace_of(
    vllm_config: Any,
    settings: Settings,
    block_size: int | None = None,
    kv_cache_config: Any = None,
) -> str:
    """The namespace name: chunks match only between engines whose KV bytes are the same.
    ``block_size`` is the one the KV is laid out in (``cache_config``'s if not given);
    ``kv_cache_config`` may carry the KV cache layout vLLM resolved (:func:`block_interior_of`)."""
    if settings.namespace:
        return settings.namespace
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    # The same model id served quantized or not, or at another revision, has other KV bytes.
    quantization = getattr(model, "quantization", None) or "none"
    revision = getattr(model, "revision", None) or "default"
    # So has a block whose tokens come before its heads rather than after, or one an attention
    # backend packs otherwise (K and V as two head slots rather than halves of each head's).
    interior = block_interior_of(vllm_config, kv_cache_config)
    layout = f"|kv={interior}" if interior else ""
    layout += _page_of(kv_cache_config)
    return (
        f"{model.model}|{cache.cache_dtype}|{model.dtype}|block={block_size or cache.block_size}"
        f"{layout}|quant={quantization}|rev={revision}{_draft_of(vllm_config)}"
    )


def _page_of(kv_cache_config: Any) -> str:
    """The namespace's part for how a KV block is packed, from the KV cache spec (vLLM 0.32 on):
    one slot per KV head holding its K and V side by side (``heads``, FlashAttention's,
    FlashInfer's, Triton's), or the slots and their bytes an attention backend published
    (``customize_spec``: B12X keeps K and V as two slots of every head's bytes), and a KV
    quantization mode other than none. Two backends can pack a block of the same size
    otherwise, and the same bytes read the other way are wrong KV. Empty from an older vLLM.

    What the spec does not say, the namespace cannot: two backends that publish the same slots
    and arrange them otherwise inside (vLLM's ROCm backends; tierkv's GPU path is CUDA's)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    spec = getattr(groups[0], "kv_cache_spec", None) if groups else None
    if spec is None or not hasattr(spec, "num_head_slots"):
        return ""
    slots = spec.num_head_slots
    page = "heads" if slots is None else f"{slots}slots"
    content = getattr(spec, "state_content_bytes", None)
    if content is not None:
        page += f"x{content}B"
    quant = getattr(spec, "kv_quant_mode", None)
    quant_name = str(getattr(quant, "name", quant)) if quant is not None else "NONE"
    if quant_name != "NONE":
        page += f"|kvq={quant_name}"
    return f"|page={page}"


#: The orders of a block's bytes the worker can describe to the daemon: each block of a layer one
#: run of bytes, heads before tokens (``HNC``) or tokens before heads (``NHC``).
BLOCK_INTERIORS = ("HNC", "NHC")


def block_interior_of(vllm_config: Any, kv_cache_config: Any = None) -> str | None:
    """The order of the bytes inside one layer's KV block, ``"HNC"`` (heads, tokens, content) or
    ``"NHC"``, from the KV cache layout vLLM resolved at start (``KVCacheLayout``, vLLM 0.32 on:
    its name's last three letters; how layers and blocks nest outside a block changes no block's
    bytes). ``None`` from a vLLM that resolves no layout: each attention backend then shapes its
    tensors its own way, and the worker takes only blocks contiguous as shaped.

    A layout that splits a layer's block into pieces (heads outside blocks, ``LHBNC``; layers
    between heads and tokens, ``BHLNC``) is refused: the daemon moves a block as one run."""
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        name = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if name is None:
        return None
    name = str(getattr(name, "name", name))  # the enum member, or its name as vLLM records it
    # vLLM's legacy names, which it still takes where a layout is set beforehand.
    name = {"NHD": "LBNHC", "HND": "LBHNC"}.get(name, name)
    interior = name[-3:]
    if interior not in BLOCK_INTERIORS:
        raise ValueError(
            f"TierKVConnector needs each layer's KV block to be one run of bytes, and the KV "
            f"cache layout {name} splits it; use one of LBHNC, LBNHC, BLHNC or BLNHC "
            "(VLLM_KV_CACHE_LAYOUT)"
        )
    return interior


#: Speculative methods whose drafts come from the tokens alone: no draft layers, no draft KV.
_TOKENS_ONLY_DRAFTS = frozenset({"ngram", "ngram_gpu", "suffix"})


def _draft_of(vllm_config: Any) -> str:
    """The namespace's part for a speculative draft whose layers have KV in the engine's cache
    (EAGLE, MTP, a draft model): every chunk holds those layers' KV too, so an engine without
    the draft (a chunk of other bytes: the daemon refuses to load it) or with another (another
    draft's KV, silently) must not share chunks with it. Empty without one (none, ngram).
    A vLLM older than ``SpeculativeConfig.uses_draft_kv_cache`` names the draft of every method
    but those that propose from the tokens alone."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return ""
    uses_draft_kv = getattr(spec, "uses_draft_kv_cache", None)
    if uses_draft_kv is not None:
        has_draft_kv = bool(uses_draft_kv())
    else:
        has_draft_kv = spec.method not in _TOKENS_ONLY_DRAFTS
    draft = getattr(spec, "draft_model_config", None)
    if not has_draft_kv or draft is None:
        return ""
    revision = getattr(draft, "revision", None) or "default"
    return f"|draft={spec.method}:{draft.model}|draft_rev={revision}"
