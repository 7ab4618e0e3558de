"""Shared KV memory: sealed memfds the daemon maps.

The daemon maps a registered region only when its memfd is sealed against shrinking
(``F_SEAL_SHRINK``): an unsealed file could be truncated under the daemon's mapping, and its
next copy would fault; and only when every page of it is allocated (no holes), since the
daemon's reads of a hole would allocate the page, charged to the daemon. :func:`sealed_memfd`
makes such a file (allocated, sealed against growing too, and then against further sealing);
:class:`SharedBuffer` maps one as equal blocks, the simplest KV buffer (one chunk per block, see
:meth:`tierkv.client.Client.register_buffer`).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import operator
import os
import weakref

__all__ = ["SEALS", "SharedBuffer", "sealed_memfd"]

#: The seals every region made here carries.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memfd(nbytes: int, name: str = "tierkv") -> int:
    """A new memfd of ``nbytes`` bytes (zeroed), its pages allocated, close-on-exec, sealed
    against shrinking, growing and further sealing. Returns the descriptor; the caller owns it
    (``os.close``).

    The pages are allocated here, charged to the caller: the daemon refuses a memfd with holes,
    since its reads of a hole would allocate the page, charged to the daemon."""
    nbytes = operator.index(nbytes)
    if nbytes <= 0:
        raise ValueError(f"a memfd region needs a positive size, got {nbytes}")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SharedBuffer:
    """``blocks`` blocks of ``block_bytes`` bytes in a sealed memfd, mapped here.

    Register it with :meth:`tierkv.client.Client.register_buffer`; the daemon then copies chunks
    between its blocks and the cache. :meth:`block` gives a writable view of one block. Close it
    (:meth:`close`, or ``with``); one dropped unclosed closes its descriptor when collected.
    """

    def __init__(self, block_bytes: int, blocks: int, name: str = "tierkv") -> None:
        block_bytes = operator.index(block_bytes)
        blocks = operator.index(blocks)
        if block_bytes <= 0 or blocks <= 0:
            raise ValueError(f"a buffer needs positive sizes, got {blocks} x {block_bytes}")
        self._block_bytes = block_bytes
        self._blocks = blocks
        self._fd = sealed_memfd(block_bytes * blocks, name)
        try:
            self._map: mmap.mmap | None = mmap.mmap(self._fd, block_bytes * blocks)
        except BaseException:
            os.close(self._fd)
            raise
        self._view: memoryview | None = memoryview(self._map)
        # A buffer dropped unclosed gives its memory back when it is collected: the descriptor
        # closes here, and the mapping with the last view of it.
        self._finalizer = weakref.finalize(self, os.close, self._fd)

    @property
    def fd(self) -> int:
        """The memfd's descriptor (owned by the buffer; sent to the daemon on registration)."""
        if self._fd < 0:
            raise ValueError("the buffer is closed")
        return self._fd

    def fileno(self) -> int:
        """The descriptor, so the buffer can stand where a file-like object is expected."""
        return self.fd

    @property
    def block_bytes(self) -> int:
        """Bytes per block."""
        return self._block_bytes

    @property
    def blocks(self) -> int:
        """Blocks in the buffer."""
        return self._blocks

    @property
    def nbytes(self) -> int:
        """Bytes of the whole buffer."""
        return self._block_bytes * self._blocks

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._view is None

    def buffer(self) -> memoryview:
        """A writable view of the whole buffer."""
        if self._view is None:
            raise ValueError("the buffer is closed")
        return self._view[:]

    def block(self, index: int) -> memoryview:
        """A writable view of block ``index`` (``IndexError`` outside ``0..blocks``)."""
        index = operator.index(index)
        if not 0 <= index < self._blocks:
            raise IndexError(f"block {index} is outside a buffer of {self._blocks} blocks")
        if self._view is None:
            raise ValueError("the buffer is closed")
        start = index * self._block_bytes
        return self._view[start : start + self._block_bytes]

    def close(self) -> None:
        """Closes the descriptor and unmaps the buffer. Idempotent.

        The daemon keeps its own mapping of a registered buffer until the session ends. Views
        handed out by :meth:`block` that are still alive keep this process's mapping until they
        are released; it is unmapped when the last of them goes.
        """
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._map is not None:
            # With views alive, the mapping goes with the last of them.
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self._fd >= 0:
            self._finalizer()  # closes the descriptor, once
            self._fd = -1

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self._fd}"
        return f"SharedBuffer({self._blocks} x {self._block_bytes} bytes, {state})"
