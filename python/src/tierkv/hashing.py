"""The chained chunk hash, exactly as ``crates/tierkv-core/src/hash.rs`` computes it.

``h_i = xxh3_128(h_{i-1} || n_i || tokens_i || extra_i)``, where ``h_{-1}`` is :data:`ROOT`,
``h`` is written as 16 little-endian bytes, ``n_i`` (the chunk's token count) as a little-endian
u32, every token id as a little-endian u32, and ``extra_i`` (per-chunk extra keys such as a LoRA
id or a multimodal item hash) as raw bytes. Equal hashes mean equal prefixes. The encoding is part
of the wire contract: the daemon finds stored chunks, also on disk after an upgrade, by these
hashes.
"""

from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Callable, Sequence
from struct import Struct

from xxhash import xxh3_128_intdigest

__all__ = ["ROOT", "ROOT_DOMAIN", "chain", "prefix_hashes", "token_bytes"]

#: The domain-separation string whose hash is the parent of every chain's first chunk.
ROOT_DOMAIN = b"tierkv chunk hash v1"

#: The hash every chain starts from (``h_{-1}``).
ROOT: int = xxh3_128_intdigest(ROOT_DOMAIN)

_U32 = Struct("<I")
_U32_MAX = (1 << 32) - 1
_LITTLE = sys.byteorder == "little"
# array's 'I' is a C unsigned int: 4 bytes on every platform CPython supports, but check.
_TYPECODE = next(code for code in ("I", "L") if array(code).itemsize == 4)

Extra = Sequence[bytes] | Callable[[int], bytes] | None


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as consecutive little-endian u32 (``OverflowError`` outside ``0..2**32``)."""
    if isinstance(tokens, array) and tokens.typecode == _TYPECODE:
        packed = array(_TYPECODE, tokens) if not _LITTLE else tokens
    else:
        packed = array(_TYPECODE, tokens)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def _parent_bytes(parent: int) -> bytes:
    if not 0 <= parent < 1 << 128:
        raise ValueError(f"a chunk hash is a 128-bit unsigned integer, got {parent}")
    return parent.to_bytes(16, "little")


def _extra_bytes(extra: object) -> bytes:
    """A chunk's extra key bytes; an ``int`` is refused, since ``bytes(n)`` is ``n`` zero bytes
    (a LoRA id 0 would hash as no extra at all)."""
    if isinstance(extra, (bytes, bytearray, memoryview)):
        return bytes(extra)
    raise TypeError(f"extra key bytes must be bytes-like, got {type(extra).__name__}")


def chain(parent: int, tokens: Sequence[int], extra: bytes = b"") -> int:
    """The hash of one chunk of ``tokens`` given its parent's hash (:data:`ROOT` for the first)."""
    count = min(len(tokens), _U32_MAX)
    return xxh3_128_intdigest(
        b"".join(
            (_parent_bytes(parent), _U32.pack(count), token_bytes(tokens), _extra_bytes(extra))
        )
    )


def prefix_hashes(tokens: Sequence[int], chunk_tokens: int, extra: Extra = None) -> list[int]:
    """The chained hashes of every full chunk of ``chunk_tokens`` tokens, root first.

    A trailing partial chunk is not hashed. ``extra`` gives chunk ``i`` its extra key bytes:
    a sequence (chunks past its end get none) or a function of ``i``.
    """
    if isinstance(chunk_tokens, bool) or not hasattr(chunk_tokens, "__index__"):
        raise TypeError(f"chunk_tokens must be an integer, got {chunk_tokens!r}")
    chunk_tokens = operator.index(chunk_tokens)
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    chunks = len(tokens) // chunk_tokens
    if chunks == 0:
        return []
    full = chunks * chunk_tokens
    data = token_bytes(tokens if full == len(tokens) else tokens[:full])
    step = chunk_tokens * 4
    count = _U32.pack(min(chunk_tokens, _U32_MAX))
    if extra is None:
        extra_of: Callable[[int], bytes] = lambda _i: b""  # noqa: E731
    elif isinstance(extra, (bytes, bytearray, memoryview, str)):
        # A sequence of ints, chunk by chunk: surely meant as one key for every chunk.
        raise TypeError("extra is a sequence of per-chunk bytes or a function of the chunk index")
    elif callable(extra):
        extra_of = extra
    else:
        extras = extra
        extra_of = lambda i: extras[i] if i < len(extras) else b""  # noqa: E731
    out = []
    parent = ROOT
    view = memoryview(data)
    for i in range(chunks):
        piece = view[i * step : (i + 1) * step]
        parent = xxh3_128_intdigest(
            b"".join((parent.to_bytes(16, "little"), count, piece, _extra_bytes(extra_of(i))))
        )
        out.append(parent)
    return out
