"""The client's deadlines and its close from another thread, against a socket server written
here that answers when a test says (no daemon needed)."""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from daemon import in_background

from tierkv import Client, ConnectionLost, Stored, wire
from tierkv.client import READY_EVENT_WAIT_S, STORE_BACKPRESSURE_S

#: The client's deadline in these tests.
TIMEOUT = 0.3
#: A CUDA event's IPC handle, as far as the server here cares.
EVENT = bytes(64)


class Server:
    """A Unix socket server of one connection: it welcomes the hello, then hands each request
    body to ``answer``, which returns the reply body (after as long as it likes)."""

    def __init__(self, path: Path, answer: Callable[[Any], Any]) -> None:
        self.path = str(path)
        self.answer = answer
        #: Request bodies, in the order they came.
        self.requests: list[Any] = []
        #: Set when a request (not the hello) has been read.
        self.asked = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(1)
        self.conn: socket.socket | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _read(self, conn: socket.socket, n: int) -> bytes:
        out = b""
        while len(out) < n:
            more = conn.recv(n - len(out))
            if not more:
                raise EOFError
            out += more
        return out

    def send(self, request_id: int, body: Any) -> None:
        assert self.conn is not None
        packed = msgpack.packb({"id": request_id, "body": body}, use_bin_type=True)
        self.conn.sendall(struct.pack("<I", len(packed)) + packed)

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        self.conn = conn
        try:
            while True:
                (length,) = struct.unpack("<I", self._read(conn, 4))
                request = msgpack.unpackb(self._read(conn, length), raw=False)
                if "hello" in request["body"]:
                    welcome = {"version": 6, "session": 1, "max_chunk_bytes": 4096, "readers": 1}
                    self.send(request["id"], {"welcome": welcome})
                    continue
                self.requests.append(request["body"])
                self.asked.set()
                reply = self.answer(request["body"])
                if reply is not None:
                    self.send(request["id"], reply)
        except (EOFError, OSError):
            pass  # the client is gone, or the test closed the connection

    def close(self) -> None:
        """Closes the server's end of the connection (the daemon is done with the session)."""
        with contextlib.suppress(OSError):
            self._listener.close()
        if self.conn is not None:
            self.conn.close()
        self._thread.join(timeout=5)


@contextlib.contextmanager
def serving(
    path: Path, answer: Callable[[Any], Any], timeout: float = TIMEOUT
) -> Iterator[tuple[Server, Client]]:
    """A server at ``path`` and a client connected to it with ``timeout``."""
    server = Server(path, answer)
    client = Client.connect(server.path, wire.hello(namespaces=[("m", "")]), timeout=timeout)
    try:
        yield server, client
    finally:
        client.close()
        server.close()


def stored_after(delay_s: float) -> Callable[[Any], Any]:
    """An answer that stores every chunk, ``delay_s`` after the request came."""

    def answer(_body: Any) -> Any:
        time.sleep(delay_s)
        return {"stored": {"stored": 1, "present": 0, "refused": []}}

    return answer


def test_a_store_with_a_ready_event_waits_past_the_clients_deadline(tmp_path):
    """The daemon may wait for a store's ready_event, then for room, before it answers: the
    store's deadline covers both, so a late answer is the caller's, not a lost connection."""
    with serving(tmp_path / "a.sock", stored_after(3 * TIMEOUT)) as (server, client):
        start = time.monotonic()
        stored = client.store(0, 0, [(7, [1])], ready_event=EVENT)
        elapsed = time.monotonic() - start
        assert stored == Stored(1, 0, [])
        assert elapsed >= 3 * TIMEOUT
        assert not client.closed
        assert server.requests[0]["store"]["ready_event"] == EVENT
    # What the default covers: the daemon's two waits, then the ordinary deadline.
    assert READY_EVENT_WAIT_S == 30.0 and STORE_BACKPRESSURE_S == 2.0


def test_a_stores_timeout_replaces_the_clients_deadline(tmp_path):
    with serving(tmp_path / "a.sock", stored_after(3 * TIMEOUT)) as (_, client):
        assert client.store(0, 0, [(7, [1])], timeout=10 * TIMEOUT).stored == 1
        # Without a ready_event or a timeout, the client's deadline holds.
        with pytest.raises(ConnectionLost, match="deadline"):
            client.store(0, 0, [(8, [2])])
    with serving(tmp_path / "b.sock", stored_after(3 * TIMEOUT)) as (_, client):
        # A timeout given wins over the ready_event's default.
        with pytest.raises(ConnectionLost, match="deadline"):
            client.store(0, 0, [(7, [1])], ready_event=EVENT, timeout=TIMEOUT)
        for bad in (0.0, -1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match="timeout"):
                client.store(0, 0, [(7, [1])], timeout=bad)


def test_a_close_from_another_thread_leaves_the_call_in_flight_unanswered(tmp_path):
    """A close while a retrieve waits for its reply ends the call as a missed deadline does: its
    connection, intact but for the writing side, is the caller's to watch, and it settles only
    once the daemon closes its end (it may be copying into the caller's memory until then)."""
    hold = threading.Event()

    def held(_body: Any) -> Any:
        hold.wait(10)
        return None

    # A deadline long enough that the call ends by the close.
    with serving(tmp_path / "a.sock", held, timeout=10.0) as (server, client):
        caller, raised = in_background(lambda: client.retrieve(5, 0, [(7, [1])]))
        assert server.asked.wait(5)
        start = time.monotonic()
        client.close()
        caller.join(timeout=5)
        assert time.monotonic() - start < 2.0, "the close waited for the call"
        assert len(raised) == 1 and isinstance(raised[0], ConnectionLost), raised
        assert "closed while the call was in flight" in str(raised[0])
        assert client.closed
        unanswered = client.take_unanswered()
        assert unanswered is not None, "the call's connection was not left to watch"
        # The daemon sees the client give up (the end of its stream; the server's thread is
        # held, so it is read here), and has not closed its end.
        assert server.conn is not None
        server.conn.settimeout(5)
        assert server.conn.recv(1) == b""
        assert not unanswered.settled(), "settled while the daemon still holds the connection"
        assert not unanswered.wait(0.2)
        hold.set()
        server.close()
        assert unanswered.wait(5.0)
        # A later close leaves the taken connection alone, and calls say the client is closed.
        client.close()
        with pytest.raises(ConnectionLost, match="the client is closed"):
            client.status()


def test_a_close_with_no_call_in_flight_leaves_nothing_unanswered(tmp_path):
    with serving(tmp_path / "a.sock", lambda _body: "released") as (_, client):
        client.release(5)
        client.close()
        client.close()
        assert client.take_unanswered() is None
        with pytest.raises(ConnectionLost, match="the client is closed"):
            client.release(5)


def test_an_infinite_wait_asks_for_the_daemons_longest(tmp_path):
    """``math.inf`` is the daemon's cap (60 s), not an OverflowError; what is not a number of
    seconds is a TypeError, a negative one a ValueError, and none of them sends anything."""
    outcome = {"hit_chunks": 0, "hit_tokens": 0, "readers": 1, "per_tier": [0, 0, 0, 0]}
    flushed = {"durable": 0, "not_durable": 0}

    def answer(body: Any) -> Any:
        return {"done": outcome} if "wait" in body else {"flushed": flushed}

    with serving(tmp_path / "a.sock", answer) as (server, client):
        assert client.wait(9, math.inf).hit_chunks == 0
        assert client.flush(math.inf).durable == 0
        assert client.wait(9, 1e9).hit_chunks == 0
        assert server.requests == [
            {"wait": {"lookup": 9, "timeout_ms": 60_000}},
            {"flush": {"timeout_ms": 60_000}},
            {"wait": {"lookup": 9, "timeout_ms": 60_000}},
        ]
        for bad, error in ((-1.0, ValueError), (math.nan, ValueError), ("1", TypeError)):
            with pytest.raises(error, match="timeout_s"):
                client.wait(9, bad)
            with pytest.raises(error, match="timeout_s"):
                client.flush(bad)
        assert len(server.requests) == 3
        assert not client.closed


def test_a_tcp_connect_whose_name_lookup_hangs_ends_at_its_deadline(monkeypatch):
    """A resolver that never answers costs ``connect_tcp`` its deadline, not the caller's thread
    for as long as the resolver takes: ``ConnectionLost`` caused by a ``TimeoutError``, naming the
    host and the deadline."""
    looked_up = socket.getaddrinfo
    asked = threading.Event()
    never = threading.Event()

    def hung(host: Any, *args: Any, **kw: Any) -> Any:
        if kw.get("flags", 0) & socket.AI_NUMERICHOST:
            return looked_up(host, *args, **kw)  # no resolver asked: a name fails at once
        asked.set()
        never.wait()
        raise socket.gaierror(socket.EAI_AGAIN, "the resolver gave up")

    monkeypatch.setattr(socket, "getaddrinfo", hung)
    hello = wire.hello(namespaces=[("m", "")], token="t" * 16)
    connecting, raised = in_background(
        lambda: Client.connect_tcp("tierkv.invalid", 7070, hello, timeout=TIMEOUT)
    )
    # Generous: the connect is over within its deadline, and only a hang takes this long.
    connecting.join(timeout=30)
    hung_up = connecting.is_alive()
    never.set()  # lets the lookup (and a connect that waits for it) end
    connecting.join(timeout=5)
    assert not hung_up, "connect_tcp waited for the name lookup past its deadline"
    assert asked.is_set()
    assert len(raised) == 1 and isinstance(raised[0], ConnectionLost), raised
    assert isinstance(raised[0].__cause__, TimeoutError), raised[0].__cause__
    assert "tierkv.invalid:7070" in str(raised[0]) and f"{TIMEOUT} s" in str(raised[0])
