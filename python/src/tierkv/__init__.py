"""tierkv: the Python client of the tierkv KV-cache offload daemon.

The daemon keeps LLM inference KV caches in tiers (device or host memory, a second memory tier,
disk) on one node; engine workers talk to it over a Unix socket. This package is the pure-Python
side of that protocol (version 6, ``docs/protocol.md``):

* :class:`Client`: a blocking session (hello, ``register_kv``, store, lookup, query, wait,
  retrieve, release, status, clear), every call under a deadline.
* :mod:`tierkv.wire`: frames and the request/reply messages, byte for byte as the Rust types
  encode them.
* :class:`SharedBuffer` and :func:`sealed_memfd`: KV memory the daemon can map.
* :func:`prefix_hashes` and :func:`chain`: the chained chunk hash that names chunks.
* :mod:`tierkv.errors`: :class:`ConnectionLost` (:class:`BadReply` for a reply that breaks the
  protocol, :class:`UntrustedDaemon` for a socket another user listens on), and one
  :class:`DaemonError` subclass per error code.

Example::

    import tierkv
    from tierkv import wire

    hello = wire.hello(namespaces=[("llama-3-8b", "")], chunk_bytes=1 << 16, chunk_tokens=16)
    with tierkv.Client.connect("/tmp/tierkv.sock", hello) as client:
        buf = tierkv.SharedBuffer(block_bytes=1 << 16, blocks=64)
        buffer = client.register_buffer(buf)
        chunks = tierkv.prefix_hashes(prompt_token_ids, 16)
        client.store(0, buffer, [(h, i) for i, h in enumerate(chunks)])
        started = client.lookup(0, chunks)
"""

from . import errors, hashing, wire
from .client import DEFAULT_TIMEOUT, Client
from .errors import (
    BadBuffer,
    BadFrame,
    BadReply,
    BadRequest,
    BlockOutOfRange,
    ClientBusy,
    ConnectionLost,
    DaemonError,
    Forbidden,
    Full,
    Internal,
    LeaseLimit,
    LookupPending,
    NamespaceNotDeclared,
    NoSession,
    NotInHit,
    ShareReturned,
    Stopped,
    TierKVError,
    TooManyConnections,
    UnknownLookup,
    UntrustedDaemon,
    VersionMismatch,
    WaitTimeout,
    error_for,
)
from .hashing import ROOT, chain, prefix_hashes
from .shm import SharedBuffer, sealed_memfd
from .wire import (
    PROTOCOL_VERSION,
    BufferRegistered,
    Bye,
    Cleared,
    CudaIpcRegion,
    Done,
    Flushed,
    KvLayout,
    LookupOutcome,
    LookupStarted,
    MemfdRegion,
    Pending,
    Released,
    Retrieved,
    Segment,
    Stored,
    Welcome,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT",
    "PROTOCOL_VERSION",
    "ROOT",
    "BadBuffer",
    "BadFrame",
    "BadReply",
    "BadRequest",
    "BlockOutOfRange",
    "ClientBusy",
    "BufferRegistered",
    "Bye",
    "Cleared",
    "Client",
    "ConnectionLost",
    "CudaIpcRegion",
    "DaemonError",
    "Done",
    "Flushed",
    "Forbidden",
    "Full",
    "Internal",
    "KvLayout",
    "LeaseLimit",
    "LookupOutcome",
    "LookupPending",
    "LookupStarted",
    "MemfdRegion",
    "NamespaceNotDeclared",
    "NoSession",
    "NotInHit",
    "Pending",
    "Released",
    "Retrieved",
    "Segment",
    "ShareReturned",
    "SharedBuffer",
    "Stopped",
    "Stored",
    "TierKVError",
    "TooManyConnections",
    "UnknownLookup",
    "UntrustedDaemon",
    "VersionMismatch",
    "WaitTimeout",
    "Welcome",
    "chain",
    "error_for",
    "errors",
    "hashing",
    "prefix_hashes",
    "sealed_memfd",
    "wire",
]
