"""The chunk hash against ``tierkv_core::hash`` (the "hashes" section of wire_vectors.json)."""

from __future__ import annotations

import json
import struct
import time
from array import array
from pathlib import Path

import pytest
import xxhash

from tierkv import hashing
from tierkv.hashing import ROOT, chain, prefix_hashes

HASHES = json.loads((Path(__file__).parent / "wire_vectors.json").read_text())["hashes"]


def hx(values):
    return [f"{v:032x}" for v in values]


def test_every_hash_vector_is_checked():
    assert set(HASHES) == {
        "root",
        "tokens_0_to_7_chunk_4",
        "tokens_t_times_7919_mod_32000_300_chunk_128",
        "extra_lora7_tokens_1_2_3",
    }


def test_root_matches():
    assert f"{ROOT:032x}" == HASHES["root"]
    assert xxhash.xxh3_128_intdigest(b"tierkv chunk hash v1") == ROOT


def test_short_chain_matches():
    assert hx(prefix_hashes(list(range(8)), 4)) == HASHES["tokens_0_to_7_chunk_4"]


def test_long_chain_with_a_partial_tail_matches():
    tokens = [t * 7919 % 32000 for t in range(300)]
    got = prefix_hashes(tokens, 128)
    assert len(got) == 2, "the 44 trailing tokens are not a chunk"
    assert hx(got) == HASHES["tokens_t_times_7919_mod_32000_300_chunk_128"]


def test_extra_bytes_match():
    assert f"{chain(ROOT, [1, 2, 3], b'lora:7'):032x}" == HASHES["extra_lora7_tokens_1_2_3"]
    # The same through prefix_hashes, as a list and as a function of the chunk index.
    assert prefix_hashes([1, 2, 3], 3, [b"lora:7"]) == [chain(ROOT, [1, 2, 3], b"lora:7")]
    assert prefix_hashes([1, 2, 3], 3, lambda i: b"lora:7") == [chain(ROOT, [1, 2, 3], b"lora:7")]


def test_chain_is_the_documented_encoding():
    tokens = [t * 7919 for t in range(1000)]
    data = ROOT.to_bytes(16, "little") + struct.pack("<I", 1000)
    data += b"".join(struct.pack("<I", t) for t in tokens) + b"x"
    assert chain(ROOT, tokens, b"x") == xxhash.xxh3_128_intdigest(data)


def test_prefix_hashes_chain_each_chunk_on_its_parent():
    tokens = list(range(40))
    hashes = prefix_hashes(tokens, 8)
    parent = ROOT
    for i, h in enumerate(hashes):
        parent = chain(parent, tokens[i * 8 : (i + 1) * 8])
        assert h == parent
    # Inputs of any sequence type hash alike.
    assert prefix_hashes(tuple(tokens), 8) == hashes
    assert prefix_hashes(array("I", tokens), 8) == hashes


def test_equal_hash_means_equal_prefix():
    a = prefix_hashes([1, 2, 3, 4, 5, 6], 2)
    b = prefix_hashes([1, 2, 3, 4, 9, 9], 2)
    c = prefix_hashes([9, 2, 3, 4, 5, 6], 2)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c, strict=True))


def test_extra_keys_change_only_their_chunk_and_after():
    plain = prefix_hashes([1, 2, 3, 4, 5, 6], 2)
    extra = prefix_hashes([1, 2, 3, 4, 5, 6], 2, [b"", b"img"])
    assert plain[0] == extra[0]
    assert plain[1] != extra[1] and plain[2] != extra[2]


def test_extra_keys_must_be_bytes():
    # bytes(n) is n zero bytes: an int key 0 would hash as no key at all, 3 as three zeros.
    with pytest.raises(TypeError, match="bytes-like"):
        chain(ROOT, [1], 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes-like"):
        prefix_hashes([1, 2], 1, [3])  # type: ignore[list-item]
    # One key meant for every chunk, given as bytes, would be read an int per chunk.
    with pytest.raises(TypeError, match="per-chunk"):
        prefix_hashes([1, 2], 1, b"lora")
    assert prefix_hashes([1, 2], 1, [bytearray(b"k")]) == prefix_hashes([1, 2], 1, [b"k"])


def test_edges():
    assert prefix_hashes([0] * 3, 4) == []
    assert len(prefix_hashes([0] * 11, 4)) == 2
    # The token count keeps tokens apart from extra bytes.
    assert chain(ROOT, [1], struct.pack("<I", 2)) != chain(ROOT, [1, 2])
    with pytest.raises(ValueError):
        prefix_hashes([1, 2], 0)
    for not_a_count in (2.0, "2", True, None):
        with pytest.raises(TypeError, match="chunk_tokens must be an integer"):
            prefix_hashes([1, 2], not_a_count)
    with pytest.raises(OverflowError):
        prefix_hashes([-1], 1)
    with pytest.raises(OverflowError):
        prefix_hashes([1 << 32], 1)
    with pytest.raises(ValueError):
        chain(-1, [1])


def test_token_bytes_are_little_endian():
    assert hashing.token_bytes([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"


def test_an_8000_token_prompt_hashes_quickly():
    tokens = [t * 7919 % 128000 for t in range(8000)]
    start = time.perf_counter()
    for _ in range(20):
        hashes = prefix_hashes(tokens, 16)
    per_prompt = (time.perf_counter() - start) / 20
    assert len(hashes) == 500
    # About 0.3 ms here; the bound only catches a per-token Python loop sneaking back in.
    assert per_prompt < 0.05, f"{per_prompt * 1e3:.1f} ms per 8,000-token prompt"
