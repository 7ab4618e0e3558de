"""Fixtures of the client tests: a real tierkv daemon per test (see ``daemon.py``)."""

from __future__ import annotations

import socket

import pytest
from daemon import TCP_TOKEN, Daemon, tierkv_binary


@pytest.fixture(scope="session")
def tierkv_bin():
    """The daemon's binary, built if it is missing."""
    try:
        return tierkv_binary()
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture
def daemon(tierkv_bin, tmp_path):
    """A fresh daemon for one test."""
    d = Daemon(tierkv_bin, tmp_path)
    try:
        yield d
    finally:
        d.stop()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tcp_daemon(tierkv_bin, tmp_path):
    """A daemon that also listens on TCP (with a token)."""
    port = _free_port()
    extra = f'tcp = "127.0.0.1:{port}"\ntoken = "{TCP_TOKEN}"'
    d = Daemon(tierkv_bin, tmp_path, extra, tcp_port=port)
    try:
        yield d
    finally:
        d.stop()
