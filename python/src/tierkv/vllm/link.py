"""A session with the daemon that fails fast and comes back by itself.

Every engine-side call goes through a :class:`Link`. While the daemon is down, restarting or hung,
a call costs at most one deadline, after which the link stays down (calls then fail at once,
without touching the socket) and then tries again after ``retry_s``; after deadlines missed (or
sessions refused) in a row the wait doubles each time from at least :data:`MIN_BACKOFF_S`, up to
:data:`MAX_DOWN_S`, so a daemon hung for long costs the engine one deadline now and then, not one
per request, whatever ``retry_s`` is (0 included). A connection found closed
(the daemon restarted since the last call) is replaced at once, so the first call after a restart
is served. Each new connection bumps ``generation``, so state that belonged to an old session
(lookup ids, registered buffers) is known to be void.

A call that missed its deadline may still be carried out by a daemon that resumes. A link made
with ``watch_unanswered`` hands that call's connection to the caller on the
:class:`Unavailable` it raises (``unanswered``), so that the engine's memory the call named is
reused only once the daemon is done with it (see :class:`tierkv.client.Unanswered`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from tierkv.client import Client, Unanswered
from tierkv.errors import ClientBusy, ConnectionLost, DaemonError, UntrustedDaemon
from tierkv.vllm.throttle import Throttle

log = logging.getLogger(__name__)

#: The longest a link stays down between two tries.
MAX_DOWN_S = 30.0

#: The least wait the backoff doubles from after deadlines missed (or sessions refused) in a row,
#: whatever ``retry_s`` is: from 0 or a tiny retry, doubling would stay near 0 and a hung daemon
#: would cost a deadline per call. From 0.1 s the waits reach :data:`MAX_DOWN_S` within ten
#: deadlines missed in a row.
MIN_BACKOFF_S = 0.1


class Unavailable(Exception):
    """The daemon cannot be reached now; the caller treats it as a miss.

    ``unanswered`` is the connection of a call that missed its deadline, where the link watches
    for them: the daemon may still carry that call out.
    """

    def __init__(self, message: str, unanswered: Unanswered | None = None) -> None:
        super().__init__(message)
        self.unanswered = unanswered


def _timed_out(error: BaseException) -> bool:
    """Whether a call failed by missing its deadline (a hung daemon: retrying at once would only
    wait again), rather than on a closed connection."""
    return isinstance(error, TimeoutError) or isinstance(error.__cause__, TimeoutError)


class Link:
    """One session, reconnected on demand."""

    def __init__(
        self,
        socket_path: str,
        hello: dict[str, Any],
        timeout_s: float,
        retry_s: float,
        on_connect: Callable[[Client], None] | None = None,
        watch_unanswered: bool = False,
        daemon_uids: Iterable[int] = (),
    ) -> None:
        self._path = socket_path
        self._daemon_uids = tuple(daemon_uids)
        self._hello = hello
        self._timeout = timeout_s
        self._retry = retry_s
        self._on_connect = on_connect
        self._watch_unanswered = watch_unanswered
        self._client: Client | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._closed = False
        self.generation = 0
        self.failures = 0
        self._in_a_row = 0
        # A daemon that stays down fails a try every retry_s: one warning a minute says so.
        self._throttle = Throttle(log)

    def client(self) -> Client:
        """The live client, connecting first if allowed now; :class:`Unavailable` if not, or if
        another thread's connect keeps the link for longer than a call's deadline."""
        if not self._lock.acquire(timeout=self._timeout):
            raise Unavailable(f"another thread is still connecting to {self._path}")
        try:
            if self._closed:
                raise Unavailable("the link is closed")
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._down_until:
                raise Unavailable(f"the tierkv daemon at {self._path} is down; retrying later")
            try:
                client = Client.connect(
                    self._path, self._hello, timeout=self._timeout, daemon_uids=self._daemon_uids
                )
            except UntrustedDaemon as e:
                # Another user's socket, or a daemon run as another user on purpose: the warning
                # says which connector setting trusts it.
                said = f'{e} ("daemon_uids": [{e.uid}] in kv_connector_extra_config)'
                self._down(e, said)
                raise Unavailable(said) from e
            except (OSError, ConnectionLost, DaemonError) as e:
                self._down(e)
                raise Unavailable(str(e)) from e
            try:
                if self._on_connect is not None:
                    self._on_connect(client)
            except (OSError, ConnectionLost, DaemonError) as e:
                # A session set up halfway is not kept: closing it ends it at the daemon.
                client.close()
                self._down(e)
                raise Unavailable(str(e)) from e
            except Exception as e:
                # Not the daemon's doing (a registration the client refuses to send, say):
                # the session is ended all the same, and the error passes on as it is.
                client.close()
                self._down(e)
                raise
            self._client = client
            self.generation += 1
            log.info("tierkv: connected to %s (session %d)", self._path, client.session.session)
            return client
        finally:
            self._lock.release()

    def call(self, fn: Callable[[Client], Any]) -> Any:
        """Runs ``fn`` on the client. A connection the daemon closed (it restarted, say) is
        replaced at once and ``fn`` tried once more on the new session; a missed deadline or a
        failed retry marks the link down and raises :class:`Unavailable`. A daemon's refusal
        (``DaemonError``) passes through."""
        client = self.client()
        try:
            result = fn(client)
        except ClientBusy as e:
            # Another thread's call holds the session past this one's deadline: a miss for this
            # call; the session is that call's to keep or lose.
            raise Unavailable(str(e)) from e
        except (OSError, ConnectionLost) as e:
            unanswered = self._drop(client)
            if _timed_out(e):
                self._down(e)
                raise Unavailable(str(e), unanswered) from e
            try:
                client = self.client()
            except Unavailable as again:
                # Closed meanwhile (a shutdown ended this call from another thread): the call's
                # connection goes to the caller all the same.
                raise Unavailable(str(again), unanswered) from e
            try:
                result = fn(client)
            except ClientBusy as e:
                raise Unavailable(str(e)) from e
            except (OSError, ConnectionLost) as e:
                unanswered = self._drop(client)
                self._down(e)
                raise Unavailable(str(e), unanswered) from e
        self._in_a_row = 0
        return result

    def _drop(self, client: Client) -> Unanswered | None:
        """Forgets a failed client; its unanswered call's connection, if the link watches them."""
        with self._lock:
            if self._client is client:
                self._client = None
        unanswered = client.take_unanswered() if self._watch_unanswered else None
        client.close()
        return unanswered

    def _down(self, why: BaseException, said: str | None = None) -> None:
        """Marks the link down after ``why``; the warning says ``said`` (``why`` without it)."""
        self.failures += 1
        wait = self._retry
        if _timed_out(why) or isinstance(why, (DaemonError, UntrustedDaemon)):
            # A hung daemon costs a deadline per try, a daemon that refuses the session (a chunk
            # larger than its slot, say) will refuse it again, and a listener of an untrusted
            # user is refused again: all back off. A refused connect (the daemon is not there)
            # is free to repeat.
            self._in_a_row += 1
            base = max(self._retry, MIN_BACKOFF_S)
            wait = min(base * 2 ** min(self._in_a_row - 1, 16), max(MAX_DOWN_S, self._retry))
        self._down_until = time.monotonic() + wait
        self._throttle.warning(
            "down",
            "tierkv: daemon at %s unavailable (%s); misses until it is back",
            self._path,
            why if said is None else said,
        )

    def close(self) -> None:
        """Ends the session; later calls are :class:`Unavailable` and open none."""
        with self._lock:
            self._closed = True
            if self._client is not None:
                # Busy: another thread's call holds the client; closing it ends the session.
                with contextlib.suppress(OSError, ConnectionLost, DaemonError, ClientBusy):
                    self._client.end()
                # Once: a second close would close the connection of the call in flight that
                # the first left to that call's thread, which takes it (`_drop`) to watch.
                if not self._client.closed:
                    self._client.close()
                self._client = None
