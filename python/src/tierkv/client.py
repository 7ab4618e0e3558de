"""A blocking session with the tierkv daemon.

A :class:`Client` connects over the daemon's Unix socket (or TCP, where enabled), says hello,
and then makes one request at a time: the daemon answers in order. Every call has a deadline
(the client's ``timeout``; a ``wait`` adds its own timeout on top): a call that misses it, or
whose connection fails, raises :class:`~tierkv.errors.ConnectionLost` and closes the client, so
a half-read reply can never be taken for the next call's. A refused request raises its
:class:`~tierkv.errors.DaemonError` subclass and leaves the session usable.

A call that misses its deadline leaves a request a hung daemon may resume. The client shuts the
connection's writing side at once, and the daemon checks for that before a lookup starts, before
a retrieve's copies begin (and after every MiB of them) and after a store's copies end: a
request given up on then copies nothing into the caller's memory and keeps nothing read from it.
Only a daemon that stops *during* a retrieve's copies can still finish the MiB under way. So the
client keeps the connection as an :class:`Unanswered` (:meth:`Client.take_unanswered`), which
says when the daemon is done with it, and the caller reuses that memory only then.

One lock per client keeps calls from several threads from interleaving their frames. A
:meth:`Client.close` from another thread ends a call in flight the way a missed deadline does,
leaving its connection as an :class:`Unanswered`: the daemon may still be carrying it out.

On the Unix socket the client checks, right after connecting and before it sends anything, who
listens there (``SO_PEERCRED``): the daemon must run as the client's own user, as root, or as a
user named in ``daemon_uids``. A socket in ``/tmp`` (the default) can be bound by any local user
before the daemon starts; the session's KV memory must never reach such a listener, so anything
else is refused with :class:`~tierkv.errors.UntrustedDaemon`.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from . import wire
from .errors import (
    BadFrame,
    BadReply,
    ClientBusy,
    ConnectionLost,
    DaemonError,
    TierKVError,
    UntrustedDaemon,
)
from .shm import SharedBuffer
from .wire import (
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

__all__ = [
    "DEFAULT_TIMEOUT",
    "READY_EVENT_WAIT_S",
    "STORE_BACKPRESSURE_S",
    "Client",
    "Unanswered",
    "trusted_uids",
]

#: Seconds a call may take by default.
DEFAULT_TIMEOUT = 5.0

#: The longest wait the daemon grants, whatever a client asks (its ``MAX_WAIT``).
_MAX_DAEMON_WAIT_S = 60.0

#: The longest the daemon waits for a store's ``ready_event`` (its ``READY_EVENT_WAIT``).
READY_EVENT_WAIT_S = 30.0

#: The daemon's default ``storage.store_backpressure``: the longest a store waits for room in L1,
#: counted once its ``ready_event`` has completed.
STORE_BACKPRESSURE_S = 2.0


def _fileno(fd: Any) -> int:
    """The descriptor to send for ``fd`` (an ``int`` or anything with ``fileno()``), refused
    before anything is sent where it is not an open descriptor: the kernel would refuse the
    whole ``sendmsg``, and the session with it."""
    if isinstance(fd, bool) or not (isinstance(fd, int) or hasattr(fd, "fileno")):
        raise TypeError(f"a descriptor is an int or has fileno(), got {fd!r}")
    number = fd if isinstance(fd, int) else fd.fileno()
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise ValueError(f"{fd!r} is not a file descriptor")
    try:
        os.fstat(number)
    except OSError as e:
        raise ValueError(f"descriptor {number} is not open: {e}") from e
    return number


#: ``struct ucred`` of ``SO_PEERCRED``: pid, uid, gid.
_UCRED = struct.Struct("=iII")


def trusted_uids(uids: Iterable[int]) -> frozenset[int]:
    """``uids`` checked as the ``daemon_uids`` of :meth:`Client.connect`: user ids (ints from
    0); ``TypeError`` or ``ValueError`` if they are not."""
    if isinstance(uids, (str, bytes)) or not isinstance(uids, Iterable):
        raise TypeError(f"daemon_uids is a collection of user ids, got {uids!r}")
    checked = frozenset(uids)
    for uid in checked:
        if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid < 1 << 32:
            raise ValueError(f"daemon_uids holds user ids (ints from 0), got {uid!r}")
    return checked


def _check_peer(sock: socket.socket, path: str | bytes, trusted: frozenset[int]) -> None:
    """Raises :class:`UntrustedDaemon` unless the process listening at the other end of the
    connected Unix socket ``sock`` runs as this process's effective user, root, or a user in
    ``trusted``. The kernel records the listener's credentials when it called ``listen``."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError as e:
        raise ConnectionLost(f"cannot tell who listens on {path!r} (SO_PEERCRED): {e}") from e
    _, uid, _ = _UCRED.unpack(raw)
    if uid not in trusted and uid not in (0, os.geteuid()):
        raise UntrustedDaemon(os.fsdecode(path), uid)


#: What ``socket.getaddrinfo`` gives for each address: family, type, protocol, canonical name
#: and the address to connect to.
_AddrInfo = tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[Any, ...]]


def _addresses(host: str, port: int, deadline: float, timeout: float) -> Sequence[_AddrInfo]:
    """The TCP addresses of ``host``, looked up by ``deadline`` (a ``time.monotonic()``).

    ``getaddrinfo`` takes no timeout, and a resolver that does not answer holds its caller for
    as long as it retries (seconds to minutes): a name is looked up on a daemon thread, which is
    left to finish by itself past the deadline (its answer then goes unused). ``timeout`` is what
    the error says the deadline was."""
    with contextlib.suppress(socket.gaierror):
        # A numeric address needs no resolver; a name fails here at once.
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    answer: list[Sequence[_AddrInfo] | Exception] = []
    answered = threading.Event()

    def look_up() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except Exception as e:  # noqa: BLE001 (raised on the caller's thread, below)
            answer.append(e)
        finally:
            answered.set()

    threading.Thread(target=look_up, name="tierkv-resolve", daemon=True).start()
    if not answered.wait(max(deadline - time.monotonic(), 0.0)):
        raise ConnectionLost(
            f"cannot connect to {host}:{port}: looking up {host!r} took longer than the "
            f"{timeout} s deadline"
        ) from TimeoutError("the name lookup missed the deadline")
    (found,) = answer
    if isinstance(found, OSError):
        raise ConnectionLost(f"cannot connect to {host}:{port}: {found}") from found
    if isinstance(found, Exception):
        raise found
    return found


def _connect_tcp(
    host: str, port: int, addresses: Sequence[_AddrInfo], deadline: float
) -> socket.socket:
    """A socket connected to the first of ``addresses`` that takes the connection before
    ``deadline`` (as ``socket.create_connection`` tries them, but within one deadline for all)."""
    failure: OSError = OSError(f"no address for {host!r}")
    for family, kind, proto, _, address in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            failure = TimeoutError("the connect missed the deadline")
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(address)
        except OSError as e:
            sock.close()
            failure = e
            continue
        return sock
    raise ConnectionLost(f"cannot connect to {host}:{port}: {failure}") from failure


def _check_timeout(timeout: float) -> None:
    if isinstance(timeout, bool) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout}")


def _wait_ms(timeout_s: float) -> int:
    """A wait's ``timeout_s`` as the daemon's milliseconds. Infinity asks for the longest wait the
    daemon grants (:data:`_MAX_DAEMON_WAIT_S`), as any ask past it gets."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise TypeError(f"timeout_s is a number of seconds, got {timeout_s!r}")
    if not timeout_s >= 0:
        raise ValueError(f"timeout_s must be non-negative, got {timeout_s}")
    return math.ceil(min(timeout_s, _MAX_DAEMON_WAIT_S) * 1000)


class _Closed(Exception):
    """:meth:`Client.close` was called while this thread's call was in flight."""


class Unanswered:
    """A connection given up on while a request sent on it had no answer: the daemon may still
    be carrying that request out, copying into or out of memory the caller registered.

    The connection's writing side is shut, which the daemon sees: a store given up on keeps
    nothing, a retrieve whose copies had not begun makes none. The daemon then reads to the
    stream's end (a reply is read here and dropped), ends the session and closes the connection.
    It closes a session's connection only after the session's last request has returned, and a
    dead daemon's connections close too: once the daemon's end is closed (:meth:`settled`), it
    will not touch the caller's memory for this session again.
    """

    def __init__(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        sock.setblocking(False)
        self._sock: socket.socket | None = sock

    def settled(self) -> bool:
        """Whether the daemon has closed its end; never blocks."""
        sock = self._sock
        if sock is None:
            return True
        try:
            while sock.recv(1 << 16):
                pass  # a late reply: nobody waits for it any more
        except BlockingIOError:
            return False
        except OSError:
            pass  # reset: the daemon is gone
        self.close()
        return True

    def wait(self, timeout: float) -> bool:
        """Blocks until :meth:`settled` or ``timeout`` seconds have passed; whether settled."""
        deadline = time.monotonic() + timeout
        while not self.settled():
            sock = self._sock
            left = deadline - time.monotonic()
            if left <= 0 or sock is None:
                return sock is None
            # poll, not select: an engine's process may hold descriptors past select's 1024.
            waiting = select.poll()
            waiting.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
            waiting.poll(math.ceil(left * 1000))
        return True

    def close(self) -> None:
        """Stops watching (closing the descriptor); the answer is then never known."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class Client:
    """A session with the daemon. Build one with :meth:`connect` or :meth:`connect_tcp`."""

    def __init__(self, sock: socket.socket, *, timeout: float, unix: bool) -> None:
        """Wraps a connected socket; use :meth:`connect` or :meth:`connect_tcp` instead."""
        _check_timeout(timeout)
        self._sock: socket.socket | None = sock
        self._timeout = float(timeout)
        self._unix = unix
        self._lock = threading.Lock()
        self._wake = _Wake(self)
        self._next_id = 1
        self._session: Welcome | None = None
        self._unanswered: Unanswered | None = None
        #: Whether the client closed because a call missed its deadline: a call that then
        #: finds it closed says so, and a caller backs off instead of reconnecting at once.
        self._timed_out = False

    # -- opening --------------------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        path: str | bytes,
        hello_body: dict[str, Any],
        timeout: float = DEFAULT_TIMEOUT,
        daemon_uids: Iterable[int] = (),
    ) -> Client:
        """Connects to the daemon's Unix socket at ``path`` and opens a session with
        ``hello_body`` (from :func:`tierkv.wire.hello`).

        Before anything is sent, the process listening there must run as this process's user,
        as root, or as one of ``daemon_uids`` (a daemon run as a service user of its own);
        :class:`~tierkv.errors.UntrustedDaemon` otherwise."""
        trusted = trusted_uids(daemon_uids)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls._open(sock, path, hello_body, timeout, unix=True, trusted=trusted)

    @classmethod
    def connect_tcp(
        cls,
        host: str,
        port: int,
        hello_body: dict[str, Any],
        timeout: float = DEFAULT_TIMEOUT,
    ) -> Client:
        """Connects over TCP (the hello must carry the daemon's token). No file descriptor can
        travel over TCP, so such a session cannot register memfd regions.

        Looking ``host`` up and connecting to its addresses take ``timeout`` at most together
        (then the hello has a deadline of its own, as every call): a resolver that does not
        answer in time is :class:`~tierkv.errors.ConnectionLost`, caused by a ``TimeoutError``,
        as a connect that does not get through is. A numeric address is not looked up."""
        _check_timeout(timeout)
        deadline = time.monotonic() + timeout
        sock = _connect_tcp(host, port, _addresses(host, port, deadline, timeout), deadline)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls._open(sock, None, hello_body, timeout, unix=False)

    @classmethod
    def _open(
        cls,
        sock: socket.socket,
        path: str | bytes | None,
        hello_body: dict[str, Any],
        timeout: float,
        *,
        unix: bool,
        trusted: frozenset[int] = frozenset(),
    ) -> Client:
        if not (isinstance(hello_body, dict) and set(hello_body) == {"hello"}):
            sock.close()
            raise TypeError("hello_body must be what tierkv.wire.hello() returns")
        try:
            _check_timeout(timeout)
        except (TypeError, ValueError):
            sock.close()
            raise
        if path is not None:
            try:
                sock.settimeout(timeout)
                sock.connect(path)
            except OSError as e:
                sock.close()
                raise ConnectionLost(f"cannot connect to {path!r}: {e}") from e
            try:
                _check_peer(sock, path, trusted)
            except ConnectionLost:
                sock.close()
                raise
        client = cls(sock, timeout=timeout, unix=unix)
        try:
            reply = client._call(hello_body)
        except (DaemonError, ConnectionLost):
            # The daemon closes the connection after a failed hello. A hello that missed its
            # deadline touched none of the caller's memory: its connection is closed, not kept
            # to watch, since nobody gets this client to take it from.
            client.close()
            raise
        if not isinstance(reply, Welcome):
            client.close()
            raise BadReply(f"bad reply to hello: {wire.show(reply)}")
        client._session = reply
        return client

    # -- state ----------------------------------------------------------------------------------

    @property
    def session(self) -> Welcome:
        """The daemon's welcome: protocol version, session number, largest chunk, readers."""
        assert self._session is not None
        return self._session

    @property
    def timeout(self) -> float:
        """Seconds each call may take."""
        return self._timeout

    @property
    def closed(self) -> bool:
        """Whether the connection is closed (by :meth:`close`, :meth:`end` or a failure)."""
        return self._sock is None

    # -- the calls ------------------------------------------------------------------------------

    def register_kv(
        self,
        regions: Sequence[tuple[MemfdRegion | CudaIpcRegion, Any]],
        layout: KvLayout,
        timeout: float | None = None,
    ) -> int:
        """Registers KV memory: ``(region, fd)`` pairs, the descriptor (an ``int`` or anything
        with ``fileno()``) for each memfd region and ``None`` for a CUDA IPC one, and the
        layout over them. Returns the buffer's number. ``timeout`` replaces the client's
        deadline for this call: the daemon maps every resident page of a memfd before it
        answers, about a second per 10-20 GiB."""
        if timeout is not None:
            _check_timeout(timeout)
        fds = []
        for i, (region, fd) in enumerate(regions):
            if isinstance(region, MemfdRegion) and fd is None:
                raise ValueError(f"region {i} is a memfd region and needs its descriptor")
            if not isinstance(region, MemfdRegion) and fd is not None:
                raise ValueError(f"region {i} is not a memfd region; it takes no descriptor")
            if fd is not None:
                fds.append(_fileno(fd))
        if fds and not self._unix:
            raise ValueError("file descriptors travel only over the Unix socket")
        body = wire.register_kv([r for r, _ in regions], layout)
        return self._expect(BufferRegistered, body, fds=fds, timeout=timeout).buffer

    def register_buffer(self, buf: SharedBuffer, timeout: float | None = None) -> int:
        """Registers a :class:`~tierkv.shm.SharedBuffer` whose every block is one chunk (its
        ``block_bytes`` must be the session's ``chunk_bytes``). Returns the buffer's number;
        ``timeout`` as in :meth:`register_kv`."""
        layout = KvLayout(
            blocks=buf.blocks,
            block_bytes=buf.block_bytes,
            block_stride=buf.block_bytes,
            blocks_per_chunk=1,
            segments=[Segment(region=0, offset=0)],
        )
        return self.register_kv([(MemfdRegion(bytes=buf.nbytes), buf.fd)], layout, timeout)

    def store(
        self,
        namespace: int,
        buffer: int,
        chunks: Iterable[tuple[int, Sequence[int] | int]],
        ready_event: bytes | None = None,
        timeout: float | None = None,
    ) -> Stored:
        """Stores chunks, root first, from blocks of a registered buffer: ``(chunk_id,
        [block, ...])`` with one block per ``blocks_per_chunk`` of its layout. For a buffer in
        GPU memory, ``ready_event`` is the IPC handle of a CUDA event recorded after the blocks
        were written: the daemon waits for it before its copies (at most
        :data:`READY_EVENT_WAIT_S`; the store is refused with ``WaitTimeout`` past that), so the
        caller need not synchronize.

        ``timeout`` replaces the client's deadline for this call. With a ``ready_event`` it is by
        default long enough for the daemon's answer: the client's deadline, plus the event's wait
        and then the wait for room (:data:`STORE_BACKPRESSURE_S`, the daemon's default)."""
        if timeout is not None:
            _check_timeout(timeout)
        elif ready_event is not None:
            timeout = self._timeout + READY_EVENT_WAIT_S + STORE_BACKPRESSURE_S
        body = wire.store(namespace, buffer, chunks, ready_event)
        return self._expect(Stored, body, timeout=timeout)

    def lookup(
        self, namespace: int, chunks: Iterable[int], defer_prefetch: bool = False
    ) -> LookupStarted:
        """Starts a prefix lookup of chunk ids, root first. The L1 hits are leased at once;
        with ``defer_prefetch`` the rest is prefetched from the lookup's first :meth:`query`
        or :meth:`wait` on, so that the lookups of one request's TP ranks can all lease their
        hits before any rank's prefetch makes room in L1."""
        return self._expect(LookupStarted, wire.lookup(namespace, chunks, defer_prefetch))

    def query(self, lookup: int) -> LookupOutcome | None:
        """The lookup's outcome if it is complete, else ``None``; never waits."""
        reply = self._call(wire.query(lookup))
        if isinstance(reply, Pending):
            return None
        if isinstance(reply, Done):
            return reply.outcome
        raise self._unexpected(reply)

    def wait(self, lookup: int, timeout_s: float) -> LookupOutcome:
        """Waits up to ``timeout_s`` (the daemon grants at most 60 s) for the lookup to
        complete; :class:`~tierkv.errors.WaitTimeout` if it does not (the lookup stays open).
        ``math.inf`` asks for the daemon's longest wait."""
        timeout_ms = _wait_ms(timeout_s)
        deadline = self._timeout + timeout_ms / 1000
        return self._expect(Done, wire.wait(lookup, timeout_ms), timeout=deadline).outcome

    def retrieve(
        self,
        lookup: int,
        buffer: int,
        chunks: Iterable[tuple[int, Sequence[int] | int]],
        done_event: bytes | None = None,
    ) -> Retrieved:
        """Copies chunks of the lookup's hit into blocks of a registered buffer, then returns
        this reader's share of the lookup. For a buffer in GPU memory, ``done_event`` is the IPC
        handle of a CUDA event the daemon records after the copies: the reply then comes
        before they are done, and the caller's stream must wait for the event before reading.
        A reply that counts other chunks than were asked for is :class:`ConnectionLost`: the
        blocks may not hold what was asked for."""
        chunks = list(chunks)
        retrieved: Retrieved = self._expect(
            Retrieved, wire.retrieve(lookup, buffer, chunks, done_event)
        )
        if retrieved.chunks != len(chunks):
            raise self._unexpected(retrieved)
        return retrieved

    def release(self, lookup: int) -> None:
        """Returns every share the lookup still holds (for chunks the engine will not read)."""
        self._expect(Released, wire.release(lookup))

    def flush(self, timeout_s: float = 30.0) -> Flushed:
        """Waits up to ``timeout_s`` (the daemon grants at most 60 s) until every chunk this
        session stored since its last flush is through the store pipeline: ``durable`` of them
        are on the disk tier (they survive a daemon crash), ``not_durable`` are not.
        :class:`~tierkv.errors.WaitTimeout` if some are still on their way (flush again).
        ``math.inf`` asks for the daemon's longest wait."""
        timeout_ms = _wait_ms(timeout_s)
        deadline = self._timeout + timeout_ms / 1000
        return self._expect(Flushed, wire.flush(timeout_ms), timeout=deadline)

    def status(self) -> dict[str, Any]:
        """The daemon's status report, keys as on the wire (``tiers``, ``hit_tokens``, ...)."""
        return self._expect(dict, wire.STATUS)

    def clear(self) -> list[int]:
        """Empties every tier of what nobody holds (admin sessions); chunks removed per tier,
        L1 first."""
        return self._expect(Cleared, wire.CLEAR).removed

    def end(self) -> None:
        """Ends the session (the daemon returns everything it holds) and closes the client.
        Does nothing on a closed client."""
        if self.closed:
            return
        try:
            self._expect(Bye, wire.END_SESSION)
        finally:
            self.close()

    def close(self) -> None:
        """Closes the connection; the daemon then returns everything the session held.

        Idempotent, and safe from another thread. A call in flight then ends as one that missed
        its deadline does (:class:`~tierkv.errors.ConnectionLost`, saying the client was closed):
        its request may still be carried out, so its connection is left to
        :meth:`take_unanswered`, not shut down. An :class:`Unanswered` left from before this
        close and never taken is closed.
        """
        earlier = self._unanswered
        # Wakes a call in flight in another thread, which then lets go of the lock.
        self._wake.signal()
        with self._lock:
            self._close_locked()
            self._wake.close()
            unanswered = None
            if earlier is not None and self._unanswered is earlier:
                unanswered, self._unanswered = earlier, None
        if unanswered is not None:
            unanswered.close()

    def take_unanswered(self) -> Unanswered | None:
        """The connection of a call that missed its deadline or was in flight when the client was
        closed (the daemon may still carry its request out), handed to the caller to watch;
        ``None`` if the client closed otherwise. Taken once."""
        with self._lock:
            unanswered, self._unanswered = self._unanswered, None
        return unanswered

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            try:
                self.end()
            except TierKVError:
                self.close()
        else:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        session = self._session.session if self._session else None
        return f"Client(session={session}, {state})"

    # -- the machinery --------------------------------------------------------------------------

    def _expect(self, kind: type, body: Any, **kw: Any) -> Any:
        reply = self._call(body, **kw)
        if not isinstance(reply, kind):
            raise self._unexpected(reply)
        return reply

    def _unexpected(self, reply: Any) -> BadReply:
        self.close()
        return BadReply(f"bad reply: {wire.show(reply)} does not answer the request")

    def _close_locked(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _call(self, body: Any, *, fds: Sequence[int] = (), timeout: float | None = None) -> Any:
        """Sends one request and reads its reply within the deadline, which covers the wait for
        another thread's call on this client too; returns the parsed reply or raises
        (``ConnectionLost`` closes the client, ``ClientBusy`` sent nothing)."""
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        if not self._lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise ClientBusy(
                "another call on this client kept it past this call's deadline; nothing was sent"
            )
        try:
            sock = self._sock
            if sock is None or self._wake.signalled:
                if self._timed_out:
                    raise ConnectionLost(
                        "the client is closed: a call missed its deadline"
                    ) from TimeoutError("a call missed its deadline")
                raise ConnectionLost("the client is closed")
            request_id = self._next_id
            self._next_id += 1
            frame = wire.encode_frame(request_id, body)
            try:
                if sock.gettimeout() != 0.0:
                    sock.setblocking(False)  # every wait is a poll beside the wake-up's
                self._send(sock, frame, fds, deadline)
                reply_id, reply_body = wire.unpack_reply(self._read_frame(sock, deadline))
                if reply_id not in (request_id, 0):
                    raise BadReply(
                        f"bad reply: an answer to request {reply_id} while waiting for {request_id}"
                    )
                return wire.parse_reply_body(reply_body)
            except BadFrame:
                self._close_locked()  # the daemon closes the connection after it
                raise
            except DaemonError:
                raise
            except ConnectionLost:
                self._close_locked()
                raise
            except _Closed:
                # As a missed deadline: the request may still be carried out.
                self._sock = None
                self._unanswered = Unanswered(sock)
                raise ConnectionLost(
                    "the client was closed while the call was in flight; the daemon may still "
                    "carry it out (take_unanswered)"
                ) from None
            except OSError as e:
                if isinstance(e, TimeoutError):
                    # The request may still be carried out: keep the connection to learn when.
                    self._sock = None
                    self._timed_out = True
                    self._unanswered = Unanswered(sock)
                    raise ConnectionLost("the daemon did not answer within the deadline") from e
                self._close_locked()
                raise ConnectionLost(f"connection to the daemon failed: {e}") from e
            except BaseException:
                # Interrupted (KeyboardInterrupt, ...) with a reply maybe half-read: never reuse.
                self._close_locked()
                raise
        finally:
            self._lock.release()

    def _ready(self, sock: socket.socket, events: int, deadline: float) -> None:
        """Waits until ``sock`` may be ready for ``events``: ``TimeoutError`` past the deadline,
        ``_Closed`` once :meth:`close` is called (the socket is left as it is)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        # poll, not select: an engine's process may hold descriptors past select's 1024.
        waiting = select.poll()
        waiting.register(sock, events)
        waiting.register(self._wake.fd, select.POLLIN)
        # At most poll's limit at a time (~24.8 days); the caller waits again if it is not over.
        ready = waiting.poll(min(math.ceil(left * 1000), _POLL_MAX_MS))
        if self._wake.signalled:
            raise _Closed
        if not ready and deadline <= time.monotonic():
            raise TimeoutError("deadline passed")

    def _send(self, sock: socket.socket, frame: bytes, fds: Sequence[int], deadline: float) -> None:
        view = memoryview(frame)
        while view:
            self._ready(sock, select.POLLOUT, deadline)
            try:
                if fds:
                    sent = socket.send_fds(sock, [view], list(fds))
                    fds = ()  # the descriptors went with the first byte sent
                else:
                    sent = sock.send(view)
            except BlockingIOError:
                continue
            view = view[sent:]

    def _read_exactly(self, sock: socket.socket, n: int, deadline: float) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            self._ready(sock, select.POLLIN, deadline)
            try:
                k = sock.recv_into(view[got:])
            except BlockingIOError:
                continue
            if k == 0:
                raise ConnectionLost(
                    "the daemon closed the connection"
                    + (" inside a reply" if got or n != wire.HEADER.size else "")
                )
            got += k
        return buf

    def _read_frame(self, sock: socket.socket, deadline: float) -> bytearray:
        (length,) = wire.HEADER.unpack(self._read_exactly(sock, wire.HEADER.size, deadline))
        # Refused before a byte of the body is read (or a buffer made for it); the caller closes
        # the connection, so the rest of that frame is never taken for another reply.
        if length == 0 or length > wire.MAX_REPLY_BYTES:
            raise BadReply(
                f"bad reply: a frame of {length} bytes (a reply is 1 to "
                f"{wire.MAX_REPLY_BYTES} bytes)"
            )
        return self._read_exactly(sock, length, deadline)


#: The longest wait ``poll`` takes, in milliseconds (a C int).
_POLL_MAX_MS = 2**31 - 1


class _Wake:
    """The eventfd :meth:`Client.close` signals to end a call in flight in another thread. The
    call polls it beside the socket, so the socket is never shut down under the call: the call
    hands it, intact, to an :class:`Unanswered`. Closed with the client, or when the client is
    collected unclosed."""

    def __init__(self, owner: Client) -> None:
        self._fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        # Kept apart from the client's lock, which a call holds while it waits: a signal never
        # waits for the call, and never writes to a descriptor closed (and maybe reused) since.
        self._lock = threading.Lock()
        self.signalled = False
        # A forked child shares the eventfd: its close of an inherited client must not wake the
        # parent's calls (the eventfd, never drained, would stay readable for good).
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(owner, os.close, self._fd)

    @property
    def fd(self) -> int:
        return self._fd

    def signal(self) -> None:
        with self._lock:
            self.signalled = True
            if self._finalizer.alive and os.getpid() == self._pid:
                os.eventfd_write(self._fd, 1)

    def close(self) -> None:
        """Closes the eventfd; only with no call in flight (under the client's lock)."""
        with self._lock:
            self._finalizer()
