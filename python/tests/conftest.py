"""Fixtures of the client tests: a real tierkv daemon per test (see ``daemon.py``)."""

from __future__ import annotations

import pytest
from daemon import TCP_TOKEN, Daemon, free_port, tierkv_binary


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


@pytest.fixture
def tcp_daemon(tierkv_bin, tmp_path):
    """A daemon that also listens on TCP (with a token)."""
    port = free_port()
    extra = f'tcp = "127.0.0.1:{port}"\ntoken = "{TCP_TOKEN}"'
    d = Daemon(tierkv_bin, tmp_path, extra, tcp_port=port)
    try:
        yield d
    finally:
        d.stop()
