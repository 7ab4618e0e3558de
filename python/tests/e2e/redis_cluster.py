"""A real Redis Cluster on loopback for the end-to-end tests: three masters from Debian's
``redis-server``, created with ``redis-cli --cluster create``, on free ports in a directory of
the test's.

The servers are started with ``PR_SET_PDEATHSIG``, so they die with the test process even when
it dies without running its finalizers; :meth:`RedisCluster.stop` kills them otherwise. The
settings are those of ``crates/tierkv-testkit``'s cluster: no persistence, a node timeout of 1 s.
Where ``redis-server`` or ``redis-cli`` is missing, :func:`require_redis` skips the test, saying
why, except under ``TIERKV_REDIS=1`` (CI, as ``.ci/run`` sets it), where it fails: CI can never
pass by skipping the remote tier's tests.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

PR_SET_PDEATHSIG = 1
START_DEADLINE_S = 30.0


def require_redis() -> None:
    """Skips the calling test where Redis is not installed (fails instead under
    ``TIERKV_REDIS=1``)."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if not missing:
        return
    why = (
        f"{' and '.join(missing)} not found: install Debian's redis-server and redis-tools "
        "(`apt-get install -y redis-server redis-tools`) to run the remote tier's tests"
    )
    if os.environ.get("TIERKV_REDIS") == "1":
        pytest.fail(f"TIERKV_REDIS=1 but {why}", pytrace=False)
    pytest.skip(why)


def _free_port(taken: set[int]) -> int:
    """A free loopback port below 55000 whose cluster bus port (``port + 10000``) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port in taken or port >= 55000:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def cli(port: int, *args: str) -> str:
    """``redis-cli -p port args...``; its standard output, stripped (empty when it failed)."""
    done = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=10,
    )
    return done.stdout.strip() if done.returncode == 0 else ""


class RedisCluster:
    """``masters`` cluster-enabled ``redis-server`` processes, one cluster, no replicas."""

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.processes: list[subprocess.Popen] = []
        self.ports: list[int] = []
        try:
            for i in range(masters):
                port = _free_port(set(self.ports))
                node = directory / f"node{i}"
                node.mkdir(parents=True, exist_ok=True)
                self.ports.append(port)
                self.processes.append(self._spawn(port, node))
            for port, node in zip(self.ports, self.processes, strict=True):
                self._wait_ping(port, node, directory)
            addresses = [f"127.0.0.1:{p}" for p in self.ports]
            created = subprocess.run(
                ["redis-cli", "--cluster", "create", *addresses]
                + ["--cluster-replicas", "0", "--cluster-yes"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert created.returncode == 0, f"redis-cli --cluster create failed:\n{created.stdout}"
            self._wait_ok()
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _spawn(port: int, node: Path) -> subprocess.Popen:
        return subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node)]
            + ["--save", "", "--appendonly", "no", "--daemonize", "no"]
            + ["--logfile", str(node / "redis.log")]
            + ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            + ["--cluster-node-timeout", "1000"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )

    @staticmethod
    def _wait_ping(port: int, process: subprocess.Popen, directory: Path) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while cli(port, "PING") != "PONG":
            if process.poll() is not None or time.monotonic() > deadline:
                logs = "".join(p.read_text(errors="replace") for p in directory.glob("*/redis.log"))
                raise AssertionError(f"redis-server on port {port} never answered:\n{logs}")
            time.sleep(0.02)

    def _wait_ok(self) -> None:
        """Until every node says ``cluster_state:ok``."""
        deadline = time.monotonic() + START_DEADLINE_S
        while not all("cluster_state:ok" in cli(p, "CLUSTER", "INFO") for p in self.ports):
            assert time.monotonic() < deadline, "the cluster never reached cluster_state:ok"
            time.sleep(0.05)

    def urls(self) -> list[str]:
        """A seed URL per node."""
        return [f"redis://127.0.0.1:{p}" for p in self.ports]

    def values(self) -> int:
        """How many keys the masters hold together (``DBSIZE`` of each)."""
        return sum(int(cli(p, "DBSIZE") or 0) for p in self.ports)

    def pause(self) -> None:
        """SIGSTOP to every node, and wait until each is stopped: a hung cluster, which accepts
        connections and answers nothing."""
        for process in self.processes:
            process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        for process in self.processes:
            stat = Path(f"/proc/{process.pid}/stat")
            while stat.read_text().rsplit(")", 1)[1].split()[0] not in "tT":
                assert time.monotonic() < deadline, f"redis-server {process.pid} did not stop"
                time.sleep(0.005)

    def stop(self) -> None:
        """Kills every node (SIGKILL: no goodbye to the cluster) and waits for it."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()  # a stopped process dies of SIGKILL too
            process.wait(30)
