"""What the scheduler side tells the workers each step, and the connector's settings.

Both travel between processes (the metadata with every step, pickled by vLLM), so they are plain
dataclasses with no handles in them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from tierkv.client import trusted_uids
from tierkv.vllm.link import Link

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorWorkerMetadata as _WorkerMetadataBase,
    )
except ImportError:  # an older vLLM, without the workers' channel to the scheduler
    _WorkerMetadataBase = object

#: Whether this vLLM carries what the workers tell the scheduler after a step
#: (``KVConnectorWorkerMetadata``): without it the scheduler half never hears that a worker runs
#: without the daemon, and goes on reporting the daemon's hits (each a failed load).
WORKER_METADATA = _WorkerMetadataBase is not object

#: A chunk as the daemon names it: its id and the engine blocks that hold it, in token order.
ChunkBlocks = tuple[int, list[int]]


@dataclass
class LoadOp:
    """Copy these chunks of a lookup's hit into the request's blocks (before the forward)."""

    req_id: str
    #: The lookup to read, per TP rank (one entry, read by every rank, with MLA).
    lookups: list[int]
    chunks: list[ChunkBlocks]


@dataclass
class StoreOp:
    """Store these newly computed chunks (after the forward)."""

    req_id: str
    chunks: list[ChunkBlocks]
    #: The requests whose loads (of this step or the last) filled blocks this KV was computed
    #: over, the request's own included: through vLLM's prefix cache another request's blocks
    #: can be among them. Should any of those loads have failed, the KV is not stored.
    after: list[str] = field(default_factory=list)
    #: Of ``after``, the requests whose loads it was computed over are all of this step (a
    #: load of theirs that failed in the last step does not concern it), and those whose loads
    #: it was computed over are all of earlier steps (one that failed in this step does not).
    this_step: list[str] = field(default_factory=list)
    earlier: list[str] = field(default_factory=list)


@dataclass
class TierKVMetadata(KVConnectorMetadata):
    """One step's loads and stores, and the requests preempted since the last step."""

    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    #: Blocks vLLM counts as loaded (external tokens it accepted) that no load of this step
    #: fills, per request: the scheduler half failed to plan it. The workers report them as
    #: failed, so vLLM recomputes them instead of reading them.
    unloadable: dict[str, list[int]] = field(default_factory=dict)
    #: The step schedules no tokens: vLLM runs it only for the connector (a finished request
    #: whose blocks wait on :meth:`get_finished`), over and over while they do.
    idle: bool = False
    #: ``async_loads``: loads of requests vLLM keeps waiting (``WAITING_FOR_REMOTE_KVS``) until
    #: the workers report them in ``get_finished``'s finished-recving set. Run off the step.
    async_loads: list[LoadOp] = field(default_factory=list)
    #: Blocks of such requests that no load fills, per request (every one of them listed, even
    #: with none): the workers report them failed, and the request finished loading, at once.
    async_unloadable: dict[str, list[int]] = field(default_factory=dict)
    #: Requests vLLM finished while their asynchronous load was not yet reported to it: vLLM
    #: frees their blocks on the finished-recving report, so the workers must not report them
    #: again in finished-sending.
    freed_on_recv: list[str] = field(default_factory=list)
    #: Requests whose asynchronous load went out before vLLM reset the connector's cache and
    #: was not yet reported over: the workers report every block of it failed whatever the
    #: retrieve did (it read what was computed before the reset), and vLLM recomputes them.
    stale_loads: list[str] = field(default_factory=list)


@dataclass
class TierKVWorkerMetadata(_WorkerMetadataBase):
    """What the workers tell the scheduler half after a step (vLLM aggregates every TP rank's):
    the ranks that run without the daemon, each with why (their KV memory could not be
    registered). One such rank fails every load of the engine, so the scheduler half then
    reports no hits."""

    without_daemon: dict[int, str] = field(default_factory=dict)

    def aggregate(self, other: Any) -> TierKVWorkerMetadata:
        """Any rank's word: the union of both."""
        ranks = dict(self.without_daemon)
        if isinstance(other, TierKVWorkerMetadata):
            ranks.update(other.without_daemon)
        return TierKVWorkerMetadata(ranks)


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` keys (all optional)."""

    #: The daemon's Unix socket.
    socket: str = "/tmp/tierkv.sock"
    #: Users the daemon may run as besides the engine's own and root: the client refuses a
    #: socket any other user listens on (``tierkv.errors.UntrustedDaemon``) before it sends
    #: anything, since anyone may bind a path in ``/tmp`` before the daemon does.
    daemon_uids: tuple[int, ...] = ()
    #: Deadline of every call to the daemon, in seconds.
    timeout_s: float = 5.0
    #: How long a daemon that failed a call is left alone before the next try, in seconds; 0 tries
    #: again at once after a refused connect. While it keeps missing deadlines the wait doubles,
    #: from at least ``link.MIN_BACKOFF_S`` whatever this is.
    retry_s: float = 1.0
    #: vLLM blocks in one tierkv chunk.
    chunk_blocks: int = 1
    #: The namespace's model name; chunks of different names never match. Defaults to the
    #: model, its KV dtype, dtype, block size, quantization and revision, so incompatible KV
    #: never meets.
    namespace: str = ""
    #: A lookup older than this is redone before it is used (leases expire in the daemon after
    #: ``l1.lease_ttl``, 30 s by default).
    lookup_refresh_s: float = 10.0
    #: A lookup that found no usable hit (or failed) answers a request vLLM keeps waiting for
    #: this long, in seconds, without asking the daemon again: what other engines store is seen
    #: after it. This engine's store of the chunk it missed, or a local hit that shrank, ends it
    #: at once. 0 asks again at every scheduler step.
    miss_refresh_s: float = 1.0
    #: Loads run asynchronously: vLLM keeps a request with a hit waiting until its load is
    #: over, and only then caches its blocks, so no other request ever reads a load that failed
    #: (under vLLM's async scheduling a synchronous load's failure is heard of a step late, and
    #: vLLM 0.32 cannot recover from it). It costs a hit about one scheduler step. ``None``
    #: ("auto", the default): on exactly when vLLM schedules asynchronously
    #: (:meth:`resolved`); true or false wins over that.
    async_loads: bool | None = None

    def link(self, hello: dict[str, Any], **kw: Any) -> Link:
        """A link to the daemon these settings name, opening its sessions with ``hello``;
        keywords go to :class:`~tierkv.vllm.link.Link`."""
        return Link(
            self.socket, hello, self.timeout_s, self.retry_s, daemon_uids=self.daemon_uids, **kw
        )

    def resolved(self, async_scheduling: bool | None) -> Settings:
        """These settings with ``async_loads`` decided: "auto" follows vLLM's
        ``scheduler_config.async_scheduling`` (``None``, not decided yet, is off)."""
        if self.async_loads is not None:
            return self
        return replace(self, async_loads=bool(async_scheduling))

    @staticmethod
    def from_extra(extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = {f for f in Settings.__dataclass_fields__}
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise ValueError(f"unknown tierkv connector settings {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        env_socket = os.environ.get("TIERKV_SOCKET")
        if env_socket:
            values["socket"] = env_socket
        for key in known:
            if key in extra:
                values[key] = _value(key, extra[key])
        settings = Settings(**values)
        if settings.chunk_blocks < 1:
            raise ValueError("chunk_blocks must be at least 1")
        if settings.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if settings.retry_s < 0 or settings.miss_refresh_s < 0:
            raise ValueError("retry_s and miss_refresh_s must not be negative")
        return settings


#: The flags that may also be "auto" (``None``: decided when the connector starts).
AUTO_FLAGS = ("async_loads",)


def _uids(raw: Any) -> tuple[int, ...]:
    """``daemon_uids`` from a list of user ids (or one)."""
    try:
        return tuple(sorted(trusted_uids([raw] if isinstance(raw, int) else raw)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"daemon_uids must be a list of user ids, not {raw!r}: {e}") from e


def _value(key: str, raw: Any) -> Any:
    """``raw`` as the type of the setting ``key`` (a flag from a bool, 0/1 or true/false;
    one of :data:`AUTO_FLAGS` also from "auto" or null)."""
    if key == "daemon_uids":
        return _uids(raw)
    if key in AUTO_FLAGS:
        if raw is None or (isinstance(raw, str) and raw.strip().lower() == "auto"):
            return None
        kind: type = bool
    else:
        kind = type(getattr(Settings, key))
    if kind is not bool:
        return kind(raw)
    if isinstance(raw, bool) or raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false", "1", "0"):
        return raw.strip().lower() in ("true", "1")
    also = ', or "auto"' if key in AUTO_FLAGS else ""
    raise ValueError(f"{key} must be true or false{also}, not {raw!r}")
