"""The exceptions of the tierkv client.

Three kinds of failure reach a caller:

* :class:`ConnectionLost`: the session is gone or unusable. The socket failed or closed, a call
  missed its deadline, or the daemon answered something that is not a reply to the request.
  The client is closed when this is raised; open a new one. A reply that breaks the protocol
  (a frame over the reply limit, not MessagePack, past the limits of ``tierkv.wire``, or no
  answer to the request) is its subclass :class:`BadReply`; a Unix socket whose listener runs as
  a user the client does not trust, refused before anything is sent, is :class:`UntrustedDaemon`.
* :class:`DaemonError`: the daemon refused the request (an ``error`` reply). A refused request
  changed nothing and the session goes on, except where ``docs/protocol.md`` says the daemon
  closes the connection (a failed hello, ``bad_frame``). There is one subclass per error code,
  so a caller can ``except BlockOutOfRange``; :func:`error_for` maps a code to its exception.
* :class:`ClientBusy`: another thread's call on the same client kept it for the whole of this
  call's deadline; this call sent nothing and the client is still open.
"""

from __future__ import annotations

import os

__all__ = [
    "BadBuffer",
    "BadFrame",
    "BadReply",
    "BadRequest",
    "BlockOutOfRange",
    "ClientBusy",
    "ConnectionLost",
    "DaemonError",
    "Forbidden",
    "Full",
    "Internal",
    "LookupPending",
    "NamespaceNotDeclared",
    "NoSession",
    "NotInHit",
    "ShareReturned",
    "LeaseLimit",
    "Stopped",
    "TierKVError",
    "TooManyConnections",
    "UnknownLookup",
    "UntrustedDaemon",
    "VersionMismatch",
    "WaitTimeout",
    "error_for",
]


class TierKVError(Exception):
    """Base of every error this package raises about the daemon or the session."""


class ConnectionLost(TierKVError):
    """The connection failed, closed, missed a deadline, or carried a reply that makes no sense.

    The client that raised it is closed and must not be used again.
    """


class BadReply(ConnectionLost):
    """What came back is no reply of this protocol: a frame longer than
    :data:`tierkv.wire.MAX_REPLY_BYTES`, a body that is not MessagePack or goes past the reply
    limits of :mod:`tierkv.wire` (nesting, lengths, values per byte), or a reply that does not
    answer the request. A buggy daemon, another program on the socket, or a corrupted stream.

    The client that raised it is closed (nothing of the frame is left to be read as the next
    call's reply) and must not be used again.
    """


class UntrustedDaemon(ConnectionLost):
    """The process listening on the Unix socket runs as a user the client does not trust: not the
    client's own (effective) user, not root, and not one of the ``daemon_uids`` it was given.
    Anyone may bind a socket at a path in a world-writable directory such as ``/tmp`` before the
    daemon does, and would then receive the session's hello and the KV memory it registers, so
    the client refused the connection before sending anything.

    ``path`` is the socket, ``uid`` the listener's user. A daemon that runs as another user on
    purpose is trusted by passing its uid in ``daemon_uids`` (the vLLM connector's
    ``daemon_uids`` setting). The client that raised it is closed.
    """

    def __init__(self, path: str, uid: int) -> None:
        super().__init__(
            f"the process listening on {path} runs as uid {uid}, which this client does not "
            f"trust (its own uid is {os.geteuid()}; root is trusted too): nothing was sent. "
            "Another user may have bound this path before the daemon. If the daemon runs as uid "
            f"{uid} on purpose, trust it with daemon_uids=[{uid}]"
        )
        self.path = path
        self.uid = uid

    def __reduce__(self) -> tuple[type[UntrustedDaemon], tuple[str, int]]:
        # Pickling (e.g. across a multiprocessing boundary) rebuilds it from the path and uid.
        return (UntrustedDaemon, (self.path, self.uid))


class ClientBusy(TierKVError):
    """Another thread's call on the same client held it until this call's deadline passed.

    Nothing was sent; the client stays open (the other call ends by its own deadline).
    """


class DaemonError(TierKVError):
    """The daemon refused a request: ``code`` is the wire's error code, ``message`` its words.

    An unknown code (from a newer daemon) is a plain ``DaemonError``; every known code has its
    own subclass.
    """

    #: The wire code of a subclass (``None`` on the base class, which carries any code).
    CODE: str | None = None

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class _CodedError(DaemonError):
    """A daemon error of one fixed code: built from the message alone."""

    CODE: str = ""

    def __init__(self, message: str) -> None:
        super().__init__(self.CODE, message)
        # So that pickling (e.g. across a multiprocessing boundary) rebuilds it from its message.
        self.args = (message,)


class BadFrame(_CodedError):
    """The frame was not MessagePack, too long, or empty; the daemon closes the connection."""

    CODE = "bad_frame"


class BadRequest(_CodedError):
    """A well-formed frame of an unknown type or with fields that do not fit; or a bad hello."""

    CODE = "bad_request"


class VersionMismatch(_CodedError):
    """The hello's protocol version is not the daemon's."""

    CODE = "version_mismatch"


class NoSession(_CodedError):
    """A request before the hello, or a second hello."""

    CODE = "no_session"


class Forbidden(_CodedError):
    """Wrong or missing TCP token, a request the role may not make, another session's lookup."""

    CODE = "forbidden"


class NamespaceNotDeclared(_CodedError):
    """A namespace index outside the hello's list."""

    CODE = "namespace_not_declared"


class BadBuffer(_CodedError):
    """A refused registration (no descriptor, unsealed, too small, bad layout) or unknown buffer."""

    CODE = "bad_buffer"


class BlockOutOfRange(_CodedError):
    """A block index outside the buffer, or a chunk naming the wrong number of blocks."""

    CODE = "block_out_of_range"


class UnknownLookup(_CodedError):
    """The lookup was never made, was released or expired, or is of another namespace."""

    CODE = "unknown_lookup"


class LookupPending(_CodedError):
    """The lookup is still prefetching (wire code ``pending``)."""

    CODE = "pending"


class NotInHit(_CodedError):
    """A retrieve named a chunk outside the lookup's hit."""

    CODE = "not_in_hit"


class ShareReturned(_CodedError):
    """This reader already returned its share of the lookup."""

    CODE = "share_returned"


class WaitTimeout(_CodedError):
    """A wait ran out (wire code ``timeout``); the lookup is still open."""

    CODE = "timeout"


class Full(_CodedError):
    """The cache cannot take the request now."""

    CODE = "full"


class Stopped(_CodedError):
    """The daemon is shutting down."""

    CODE = "stopped"


class TooManyConnections(_CodedError):
    """The daemon serves ``server.max_connections`` connections already; it closes this one."""

    CODE = "too_many_connections"


class LeaseLimit(_CodedError):
    """The session's open lookups hold ``server.max_leased_per_session`` bytes of leases:
    retrieve or release some before looking up again."""

    CODE = "lease_limit"


class Internal(_CodedError):
    """Something failed inside the daemon; the message says what."""

    CODE = "internal"


_BY_CODE: dict[str, type[_CodedError]] = {
    cls.CODE: cls
    for cls in (
        BadFrame,
        BadRequest,
        VersionMismatch,
        NoSession,
        Forbidden,
        NamespaceNotDeclared,
        BadBuffer,
        BlockOutOfRange,
        UnknownLookup,
        LookupPending,
        NotInHit,
        ShareReturned,
        WaitTimeout,
        Full,
        Stopped,
        TooManyConnections,
        LeaseLimit,
        Internal,
    )
}


def error_for(code: str, message: str) -> DaemonError:
    """The exception for an ``error`` reply: the code's subclass, or a plain ``DaemonError``."""
    cls = _BY_CODE.get(code) if isinstance(code, str) else None
    if cls is None:
        return DaemonError(str(code), str(message))
    return cls(str(message))
