"""Shared buffers: their memory goes back when they are closed, or dropped unclosed."""

from __future__ import annotations

import gc
import os

from tierkv import SharedBuffer


def memfd_open(fd: int, name: str) -> bool:
    """Whether ``fd`` is still (not a reuse of its number) the memfd called ``name``."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name} ")
    except FileNotFoundError:
        return False


def test_a_dropped_buffer_closes_its_memfd_when_collected():
    buf = SharedBuffer(4096, 4, name="tierkv-dropped")
    fd = buf.fd
    view = buf.block(1)
    view[:4] = b"kept"
    del buf
    gc.collect()
    assert not memfd_open(fd, "tierkv-dropped"), "the memfd outlived its dropped buffer"
    # A view still alive keeps the mapping, not the descriptor.
    assert bytes(view[:4]) == b"kept"
    view.release()


def test_a_closed_buffer_closes_its_memfd_once():
    buf = SharedBuffer(4096, 2, name="tierkv-closed")
    fd = buf.fd
    buf.close()
    assert not memfd_open(fd, "tierkv-closed")
    # Its number reused by another descriptor, which neither a second close nor the collection
    # of the buffer may close.
    other = os.open("/dev/null", os.O_RDONLY)
    try:
        assert other == fd, "the lowest free number is the memfd's: the check below needs it"
        buf.close()
        del buf
        gc.collect()
        os.fstat(other)
    finally:
        os.close(other)
