"""A real tierkv daemon process for the Python tests and the vLLM benchmark.

The binary is ``$TIERKV_BIN``, else this repository's ``target/debug/tierkv``, brought up to date
with ``cargo build --bin tierkv`` first (so a plain ``pytest python/tests`` works and never runs
a stale daemon). A :class:`Daemon` runs ``tierkv serve`` on a config of its own
in its own directory; :meth:`Daemon.stop` sends SIGTERM and waits, killing it after 10 s.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tierkv import Client, wire

REPO_ROOT = Path(__file__).resolve().parents[2]
START_DEADLINE_S = 30.0
STOP_DEADLINE_S = 10.0
# sun_path holds 108 bytes with its terminating NUL.
MAX_SOCKET_PATH = 100
#: The token of every test daemon: TCP sessions and ``clear`` need it (at least 16 characters).
TCP_TOKEN = "python-client-test-token"


#: The other user of the peer-credential tests: ``nobody``.
OTHER_UID = 65534

#: A listener of :data:`OTHER_UID`: started as root (the interpreter may lie where only root
#: reads), it drops to that user before it binds ``argv[1]``, says ``listening``, takes one
#: connection, reads it to its end and says how many bytes came.
_OTHER_USERS_LISTENER = f"""
import os, socket, sys
os.setgroups([])
os.setgid({OTHER_UID})
os.setuid({OTHER_UID})
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
    s.bind(sys.argv[1])
    s.listen(1)
    print("listening", flush=True)
    s.settimeout(30)
    conn, _ = s.accept()
    conn.settimeout(30)
    received = 0
    while chunk := conn.recv(1 << 16):
        received += len(chunk)
    print(received, flush=True)
"""


@contextlib.contextmanager
def other_users_dir() -> Iterator[Path]:
    """A directory of :data:`OTHER_UID`'s own (pytest's ``tmp_path`` lies under one only root
    may enter), removed afterwards. Only root may give one, and start that user's processes: a
    test run by anyone else skips, saying so, unless ``TIERKV_OTHER_USERS=1`` (which ``.ci/run``
    sets as root) makes that a failure."""
    if os.geteuid() != 0:
        why = f"not root, so nothing can be started as uid {OTHER_UID}"
        if os.environ.get("TIERKV_OTHER_USERS") == "1":
            pytest.fail(f"TIERKV_OTHER_USERS=1, but {why}")
        pytest.skip(why)
    path = Path(tempfile.mkdtemp(prefix="tierkv-peer-"))
    try:
        os.chown(path, OTHER_UID, OTHER_UID)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def other_users_listener() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A socket :data:`OTHER_UID` listens on, and the listener: it takes one connection and,
    once that closes, says on its stdout how many bytes it received (``communicate``)."""
    with other_users_dir() as where:
        path = str(where / "tierkv.sock")
        listener = subprocess.Popen(
            [sys.executable, "-c", _OTHER_USERS_LISTENER, path], stdout=subprocess.PIPE, text=True
        )
        try:
            assert listener.stdout is not None
            assert listener.stdout.readline().strip() == "listening"
            yield path, listener
        finally:
            listener.kill()
            listener.wait()


def small_config(socket_path: Path, disk: Path, extra: str = "") -> str:
    """``small_config`` of the integration tests, metrics disabled: 64 KiB chunks."""
    return config(socket_path, disk, extra=extra)


def config(
    socket_path: Path,
    disk: Path,
    extra: str = "",
    l1: str = "4MiB",
    slot: str = "64KiB",
    l2: str = "8MiB",
    disk_capacity: str = "32MiB",
    segment: str = "4MiB",
    fsync: str = "always",
    device: str = "emulated",
    l2_memory: str = "plain",
    metrics_listen: str | None = None,
    l1_extra: str = "",
    lease_ttl: str = "30s",
) -> str:
    """A daemon config: an L1 (emulated by default; ``l1_extra`` adds lines to its section), L2
    (in plain memory by default), a disk tier, and a metrics endpoint only where
    ``metrics_listen`` names one."""
    metrics = (
        f'enabled = true\nlisten = "{metrics_listen}"' if metrics_listen else "enabled = false"
    )
    return f"""
[server]
socket = "{socket_path}"
{extra}

[metrics]
{metrics}

[l1]
device = "{device}"
capacity = "{l1}"
slot = "{slot}"
lease_ttl = "{lease_ttl}"
{l1_extra}

[l2]
capacity = "{l2}"
memory = "{l2_memory}"

[disk]
dir = "{disk}"
capacity = "{disk_capacity}"
segment = "{segment}"
fsync = "{fsync}"
"""


def engine_config(socket_path: Path, disk: Path, extra: str = "", **kw: str) -> str:
    """Room for an engine's 1-2 MiB chunks: 2 MiB slots, an L1 of 256 of them (the tests count
    chunks in L1, so none may be evicted), 512 MiB of L2; keywords go to :func:`config`."""
    return config(
        socket_path,
        disk,
        extra,
        **{
            "l1": "512MiB",
            "slot": "2MiB",
            "l2": "512MiB",
            "disk_capacity": "1GiB",
            "segment": "64MiB",
            "fsync": "never",
            **kw,
        },
    )


def cuda_config(socket_path: Path, disk: Path, extra: str = "") -> str:
    """:func:`engine_config` with L1 on GPU 0 and L2 in pinned host memory: the GPU tests."""
    return engine_config(socket_path, disk, extra, device="cuda", l2_memory="pinned")


def in_background(call: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    """Runs ``call`` on a thread of its own, started; what it raised, if anything, lands in the
    list (a test checks it after joining the thread)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001 (what it raised is the test's to check)
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, raised


def is_idle(status: dict) -> bool:
    """Whether a status report shows no lookup open, no L1 share held and no store copy in
    flight: every lease and write reservation returned."""
    return (
        status["open_lookups"] == 0
        and status["l1_leased_chunks"] == 0
        and status["store_in_flight"] == 0
    )


def free_port() -> int:
    """A TCP port on loopback nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(port: int, series: str) -> float:
    """The value of one Prometheus ``series`` (its name and labels, as the endpoint writes them:
    ``'tierkv_data_bytes_total{direction="store"}'``) at ``127.0.0.1:port``; 0 before its first
    count."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        text = page.read().decode()
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def admin_hello(**kw) -> dict:
    return wire.hello(role="admin", **kw)


def tierkv_binary() -> Path:
    """The daemon's binary: ``$TIERKV_BIN``, else this checkout's debug build, brought up to date
    with ``cargo build --bin tierkv`` (a no-op when it is), so no test runs a stale daemon.
    ``RuntimeError`` if it cannot be had."""
    from_env = os.environ.get("TIERKV_BIN")
    if from_env:
        path = Path(from_env)
        if not path.is_file():
            raise RuntimeError(f"TIERKV_BIN={from_env} is not a file")
        return path
    path = REPO_ROOT / "target" / "debug" / "tierkv"
    cargo = shutil.which("cargo")
    if cargo is None:
        if path.is_file():
            return path
        raise RuntimeError(f"{path} is missing and there is no cargo to build it")
    build = subprocess.run([cargo, "build", "--quiet", "--bin", "tierkv"], cwd=REPO_ROOT)
    if build.returncode != 0 or not path.is_file():
        raise RuntimeError(f"cargo build --bin tierkv failed (exit {build.returncode})")
    return path


class Daemon:
    """A running ``tierkv serve`` and the clients the test opened on it."""

    def __init__(
        self,
        binary: Path,
        workdir: Path,
        extra_config: str = "",
        tcp_port=None,
        make_config=small_config,
        user: int | None = None,
    ):
        """Starts ``binary`` on ``make_config(socket, disk_dir, extra_config)``, as ``user``
        (a uid; ``workdir`` must then be that user's) where one is given."""
        self.binary = binary
        self.user = user
        self.dir = workdir
        # Every test daemon has a token: admin sessions need it to clear (over TCP, for all).
        self.token = TCP_TOKEN
        if "token =" not in extra_config:
            extra_config = f'{extra_config}\ntoken = "{TCP_TOKEN}"'.strip()
        sock = workdir / "tierkv.sock"
        self._sock_dir = None
        if len(os.fsencode(sock)) > MAX_SOCKET_PATH:
            # A deep temporary directory: only the socket moves to a short path.
            self._sock_dir = tempfile.mkdtemp(prefix="tierkv-")
            sock = Path(self._sock_dir) / "s"
        self.socket = sock
        self.tcp_port = tcp_port
        self.config = workdir / "tierkv.toml"
        self.config.write_text(make_config(sock, workdir / "disk", extra_config))
        self.log = workdir / "daemon.log"
        self.clients: list[Client] = []
        self.start()

    def start(self) -> None:
        """(Re)starts the process on the same config and waits until it serves."""
        env = dict(os.environ, TIERKV_LOG="warn")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), "serve", "--config", str(self.config)],
                cwd=self.dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                user=self.user,
                group=self.user,
            )
        try:
            self._wait_until_serving()
        except BaseException:
            self.stop()
            raise

    def terminate(self) -> None:
        """SIGTERM and wait, killing it after ``STOP_DEADLINE_S``: the clean stop a restart
        follows (:meth:`stop` without removing the socket's directory)."""
        for client in self.clients:
            client.close()
        self.clients.clear()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)  # in case a test left it stopped
                self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """``kill -9``: nothing is flushed or closed cleanly (the socket file stays)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _wait_until_serving(self) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the daemon exited ({self.proc.returncode}) before listening:\n"
                    + self.log.read_text(errors="replace")
                )
            if self._accepts():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"nothing listens on {self.socket} after {START_DEADLINE_S} s:\n"
                    + self.log.read_text(errors="replace")
                )
            time.sleep(0.02)

    def _accepts(self) -> bool:
        targets = [(socket.AF_UNIX, str(self.socket))]
        if self.tcp_port is not None:
            targets.append((socket.AF_INET, ("127.0.0.1", self.tcp_port)))
        for family, address in targets:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                try:
                    probe.connect(address)
                except OSError:
                    return False
        return True

    def connect(self, hello: dict, timeout: float = 5.0) -> Client:
        """A client on the Unix socket, closed at teardown."""
        client = Client.connect(str(self.socket), hello, timeout=timeout)
        self.clients.append(client)
        return client

    def admin(self) -> Client:
        """An admin session with the daemon's token: it may clear."""
        return self.connect(admin_hello(token=self.token))

    def status(self) -> dict:
        """An admin session's status report."""
        with Client.connect(str(self.socket), admin_hello()) as admin:
            return admin.status()

    def eventually(self, what: str, ok, timeout: float = 10.0) -> dict:
        """Polls the status until ``ok(report)`` holds (the store pipeline is asynchronous)."""
        deadline = time.monotonic() + timeout
        while True:
            report = self.status()
            if ok(report):
                return report
            assert time.monotonic() < deadline, f"{what}: never true; last status {report}"
            time.sleep(0.02)

    def settled(self) -> dict:
        """Waits until no store copy is in flight and no L1 share is held."""
        return self.eventually(
            "the store pipeline settles",
            lambda s: s["store_in_flight"] == 0 and s["l1_leased_chunks"] == 0,
        )

    def pause(self) -> None:
        """SIGSTOP, and wait until every thread of the daemon is stopped (delivery is
        asynchronous: a thread on another CPU could otherwise still answer one request)."""
        self.proc.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.proc.pid}/task")
        deadline = time.monotonic() + 5.0
        while True:
            states = []
            for task in tasks.iterdir():
                with contextlib.suppress(OSError):
                    stat = (task / "stat").read_text()
                    states.append(stat[stat.rindex(")") + 2])
            if states and all(state in "tT" for state in states):
                return
            assert time.monotonic() < deadline, f"the daemon did not stop: {states}"
            time.sleep(0.005)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.terminate()
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
