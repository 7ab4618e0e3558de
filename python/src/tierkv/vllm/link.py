"""A session with the daemon that fails fast and comes back by itself.

Every engine-side call goes through a :class:`Link`. While the daemon is down, restarting or
hung, a call costs at most one deadline, after which the link stays down for ``retry_s`` (calls
then fail at once, without touching the socket) and then tries again. Each new connection bumps
``generation``, so state that belonged to an old session (lookup ids, registered buffers) is
known to be void.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tierkv.client import Client
from tierkv.errors import ConnectionLost, DaemonError

log = logging.getLogger(__name__)


class Unavailable(Exception):
    """The daemon cannot be reached now; the caller treats it as a miss."""


class Link:
    """One session, reconnected on demand."""

    def __init__(
        self,
        socket_path: str,
        hello: dict[str, Any],
        timeout_s: float,
        retry_s: float,
        on_connect: Callable[[Client], None] | None = None,
    ) -> None:
        self._path = socket_path
        self._hello = hello
        self._timeout = timeout_s
        self._retry = retry_s
        self._on_connect = on_connect
        self._client: Client | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.generation = 0
        self.failures = 0

    def client(self) -> Client:
        """The live client, connecting first if allowed now; :class:`Unavailable` if not."""
        with self._lock:
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._down_until:
                raise Unavailable(f"the tierkv daemon at {self._path} is down; retrying later")
            try:
                client = Client.connect(self._path, self._hello, timeout=self._timeout)
                if self._on_connect is not None:
                    self._on_connect(client)
            except (OSError, ConnectionLost, DaemonError) as e:
                self._down(e)
                raise Unavailable(str(e)) from e
            self._client = client
            self.generation += 1
            log.info("tierkv: connected to %s (session %d)", self._path, client.session.session)
            return client

    def call(self, fn: Callable[[Client], Any]) -> Any:
        """Runs ``fn`` on the client. A lost connection marks the link down and raises
        :class:`Unavailable`; a daemon's refusal (``DaemonError``) passes through."""
        client = self.client()
        try:
            return fn(client)
        except (OSError, ConnectionLost) as e:
            with self._lock:
                if self._client is client:
                    self._client = None
                    client.close()
                self._down(e)
            raise Unavailable(str(e)) from e

    def _down(self, why: BaseException) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + self._retry
        log.warning("tierkv: daemon unavailable (%s); misses until it is back", why)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                with contextlib.suppress(OSError, ConnectionLost, DaemonError):
                    self._client.end()
                self._client.close()
                self._client = None
