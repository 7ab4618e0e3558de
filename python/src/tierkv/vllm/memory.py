"""The engine's KV memory, shared with the daemon: on CPU moved into one sealed memfd the daemon
maps, on a GPU exported by CUDA IPC where it is.

vLLM allocates its paged KV cache as ordinary host memory on CPU. To let the daemon copy between
the engine's blocks and its own tiers with no staging copy, the worker side moves every backing
storage of the KV tensors into one sealed memfd, once, before the engine has written anything,
and re-points every tensor that viewed the old storage (the tensors handed to the connector, the
attention layers' bound views, the model runner's list) at the same bytes in the memfd. From
then on the engine's blocks *are* shared memory; the daemon gathers a chunk from every layer and
scatters it back itself.

KV tensors on a GPU stay where vLLM allocated them: :func:`export_device_kv` exports each
``cudaMalloc`` allocation behind them as a CUDA IPC region (``tierkv.cuda``), which the daemon
opens once per session, and describes the blocks by region and offset. The daemon then gathers
and scatters on the device with its own streams. Memory PyTorch allocated with expandable
segments cannot be exported; the error says so before the daemon is asked.

The layout the daemon is told: one segment per layer (two where K and V are separate planes),
each an array of ``num_blocks`` equal blocks ``block_stride`` bytes apart. Layers are ordered by
their index in the model, so every worker and every process lays a chunk out the same way.
"""

from __future__ import annotations

import gc
import mmap
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from tierkv.shm import sealed_memfd
from tierkv.vllm.guard import EngineStateUnknown
from tierkv.wire import CudaIpcRegion, KvLayout, MemfdRegion, Segment

_PAGE = 4096


class LayoutError(ValueError):
    """The KV tensors are not laid out as the connector can describe to the daemon."""


@dataclass
class KvMemory:
    """The memfd that now backs the engine's KV tensors, and their layout in it."""

    fd: int
    nbytes: int
    mapping: mmap.mmap
    layout: KvLayout

    @property
    def region(self) -> MemfdRegion:
        return MemfdRegion(bytes=self.nbytes)

    def chunk_bytes(self) -> int:
        return len(self.layout.segments) * self.layout.blocks_per_chunk * self.layout.block_bytes

    def base(self) -> int:
        return _address(self.mapping)

    def contains(self, tensor: torch.Tensor) -> bool:
        start = tensor.data_ptr()
        return self.base() <= start < self.base() + self.nbytes


@dataclass
class DeviceKv:
    """KV tensors in GPU memory, exported for the daemon: one CUDA IPC region per allocation
    behind them, and the layout of the KV blocks over those regions."""

    regions: list[CudaIpcRegion]
    layout: KvLayout

    def chunk_bytes(self) -> int:
        return len(self.layout.segments) * self.layout.blocks_per_chunk * self.layout.block_bytes


def _address(mapping: mmap.mmap) -> int:
    return torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()


def _layer_order(name: str) -> tuple[int, str]:
    match = re.search(r"\.(\d+)\.", name) or re.search(r"(\d+)", name)
    return (int(match.group(1)) if match else -1, name)


def move_to_memfd(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    blocks_per_chunk: int,
    bound_views: Iterable[torch.Tensor] = (),
    interior: str | None = None,
) -> KvMemory:
    """Moves the storages behind ``kv_caches`` into one sealed memfd and re-points every tensor
    that used them; returns the memfd and the layout of the KV blocks in it. ``interior``: the
    order of a block's bytes vLLM's layout names, checked against the tensors (:func:`_layout`).

    ``bound_views`` are tensors the engine reads through (the attention layers' caches): each
    must end up inside the memfd, or the move is refused, since bytes the daemon writes where the
    engine does not read would be silently wrong KV.
    """
    tensors = _ordered(kv_caches)
    if any(t.device.type != "cpu" for t in tensors):
        raise LayoutError("KV tensors on a GPU are exported where they are (export_device_kv)")
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    offsets: dict[int, int] = {}
    total = 0
    for ptr, storage in storages.items():
        offsets[ptr] = total
        total += -(-storage.nbytes() // _PAGE) * _PAGE

    def in_memfd(ptr: int) -> tuple[int, int]:
        """Where an address of the engine's storages will lie in the memfd."""
        for start, storage in storages.items():
            if start <= ptr < start + storage.nbytes():
                return 0, offsets[start] + (ptr - start)
        raise LayoutError("a KV plane lies outside the storages of the KV tensors")

    # Described before anything moves: a layout the daemon cannot take leaves the engine's
    # tensors where they are, and no memfd behind.
    layout = _layout(tensors, num_blocks, blocks_per_chunk, in_memfd, interior)
    fd = sealed_memfd(total, "tierkv-vllm-kv")
    replacements: dict[int, torch.UntypedStorage] = {}
    try:
        mapping = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        for ptr, storage in storages.items():
            view = torch.frombuffer(
                mapping, dtype=torch.uint8, count=storage.nbytes(), offset=offsets[ptr]
            )
            view.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            replacements[ptr] = view.untyped_storage()
    except BaseException:
        os.close(fd)
        raise
    try:
        _repoint(replacements)
    except Exception as e:
        # Some of the engine's tensors may view the memfd and others still the old storage.
        raise EngineStateUnknown(f"moving the KV tensors into the memfd failed halfway: {e}") from e
    memory = KvMemory(fd=fd, nbytes=total, mapping=mapping, layout=layout)
    for view in [*tensors, *bound_views]:
        if view.numel() and not memory.contains(view):
            # The engine writes the blocks through one tensor and reads them through another.
            raise EngineStateUnknown(
                "a KV view the engine reads through is not backed by the memfd after the move; "
                "loads would land where the engine does not read"
            )
    return memory


def export_device_kv(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    blocks_per_chunk: int,
    interior: str | None = None,
) -> DeviceKv:
    """Exports the GPU allocations behind ``kv_caches`` by CUDA IPC, where they are, and
    describes the KV blocks over them (``interior`` as in :func:`move_to_memfd`). Every tensor
    must be on the same device; the CUDA context of that device must be current (any torch
    work on it makes it so)."""
    from tierkv.cuda import ipc_region

    tensors = _ordered(kv_caches)
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise LayoutError(
            f"export_device_kv takes KV tensors on one GPU; they are on {sorted(map(str, devices))}"
        )
    ordinal = next(iter(devices)).index or 0
    regions: list[CudaIpcRegion] = []
    bases: list[int] = []

    def locate(ptr: int) -> tuple[int, int]:
        for i, (base, region) in enumerate(zip(bases, regions, strict=True)):
            if base <= ptr < base + region.bytes:
                return i, ptr - base
        region, offset = ipc_region(ptr, ordinal)
        regions.append(region)
        bases.append(ptr - offset)
        return len(regions) - 1, offset

    layout = _layout(tensors, num_blocks, blocks_per_chunk, locate, interior)
    return DeviceKv(regions=regions, layout=layout)


def _ordered(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    tensors = [kv_caches[name] for name in sorted(kv_caches, key=_layer_order)]
    if not tensors:
        raise LayoutError("the engine registered no KV tensors")
    return tensors


def _repoint(replacements: Mapping[int, torch.UntypedStorage]) -> None:
    """Points every live CPU tensor that views an old storage at its replacement, keeping its
    offset, shape and strides (every tensor object, wherever the engine keeps it)."""
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
            continue
        try:
            ptr = obj.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        new = replacements.get(ptr)
        if new is not None:
            with torch.no_grad():
                obj.set_(new, obj.storage_offset(), obj.size(), obj.stride())


def _layout(
    tensors: list[torch.Tensor],
    num_blocks: int,
    blocks_per_chunk: int,
    locate: Callable[[int], tuple[int, int]],
    interior: str | None = None,
) -> KvLayout:
    """The layout of the KV blocks of ``tensors``; ``locate`` maps an address to its region and
    the offset in it.

    A block moves as one run of bytes, so the chunk's bytes are the blocks' bytes as they lie.
    With ``interior`` (vLLM's resolved layout, which the namespace names) the tensors are vLLM's
    ``[blocks, heads, tokens, content]`` views, and a block must lie in that order (``"HNC"``
    or ``"NHC"``, dimensions of size one aside): an engine whose blocks lie otherwise than its
    namespace says would store chunks another engine reads in the wrong order. Without it, a
    block must be contiguous as the tensor is shaped."""
    segments: list[Segment] = []
    seen: set[int] = set()
    shape: tuple[int, int] | None = None
    for t in tensors:
        if t.data_ptr() in seen:
            continue  # a layer that shares another layer's cache
        seen.add(t.data_ptr())
        if t.dim() >= 1 and t.shape[0] == num_blocks:
            planes = [t]
        elif interior is not None and t.dim() == 4 and t.shape[0] % num_blocks == 0:
            # vLLM split each block into kernel blocks of fewer tokens, a block's back to back
            # (it refuses to split blocks that are not): one block is those kernel blocks.
            planes = [t.unflatten(0, (num_blocks, -1))]
        elif t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            planes = [t[0], t[1]]
        else:
            raise LayoutError(
                f"a KV tensor of shape {tuple(t.shape)} has no dimension of {num_blocks} blocks "
                "first (or after a K/V dimension of 2)"
            )
        for plane in planes:
            block = plane[0]
            if interior is not None:
                _check_interior(block, interior)
            elif not block.is_contiguous():
                raise LayoutError("a block of a KV tensor is not contiguous")
            this = (block.numel() * block.element_size(), plane.stride(0) * plane.element_size())
            if shape is not None and this != shape:
                raise LayoutError(
                    f"KV tensors differ in block size or stride ({shape} and {this}); "
                    "hybrid caches are not supported yet"
                )
            shape = this
            region, offset = locate(plane.data_ptr())
            segments.append(Segment(region=region, offset=offset))
    assert shape is not None
    block_bytes, block_stride = shape
    return KvLayout(
        blocks=num_blocks,
        block_bytes=block_bytes,
        block_stride=block_stride,
        blocks_per_chunk=blocks_per_chunk,
        segments=segments,
    )


def _check_interior(block: torch.Tensor, interior: str) -> None:
    """Refuses a ``[heads, tokens, content]`` block that is not one run of bytes in the order
    ``interior`` names, or a ``[kernel blocks, heads, tokens, content]`` one (vLLM split the
    block) whose bytes do not lie as the unsplit block's would. Dimensions of size one are left
    out of the orders: they move no byte."""
    dims = "KHNC" if block.dim() == 4 else "HNC"
    if block.dim() not in (3, 4):
        raise LayoutError(
            f"a KV block of shape {tuple(block.shape)} is not [heads, tokens, content], as vLLM's "
            f"KV cache layout (block interior {interior}) says"
        )
    sized = [d for d in range(block.dim()) if block.shape[d] > 1]
    lying = sorted(sized, key=block.stride, reverse=True)
    run = 1
    for d in reversed(lying):
        if block.stride(d) != run:
            raise LayoutError("a block of a KV tensor is not one run of bytes")
        run *= block.shape[d]
    found = "".join(dims[d] for d in lying)
    said = "".join(c for c in "K" + interior if c in found)
    if found != said:
        raise LayoutError(
            f"the KV blocks lie {found} (heads H, tokens N, content C, kernel blocks K), not "
            f"{said} as vLLM's KV cache layout says; their chunks would be read in the wrong order"
        )
    split, heads = block.dim() == 4 and block.shape[0] > 1, block.shape[dims.index("H")]
    if split and heads > 1 and interior.index("H") < interior.index("N"):
        # Each kernel block holds every head's share of its own tokens, not each head its share
        # of the block's: the bytes depend on the kernel's block size, which an engine with
        # another backend may not share. Tokens first, the kernel blocks are the block's tokens
        # in order, whatever their size.
        kernel_tokens = block.shape[dims.index("N")]
        raise LayoutError(
            f"vLLM splits each {block.shape[0] * kernel_tokens}-token block into kernel blocks of "
            f"{kernel_tokens}, which heads-first ({interior}) lie otherwise than one block would; "
            f"use --block-size {kernel_tokens} or a tokens-first KV cache layout "
            "(VLLM_KV_CACHE_LAYOUT=LBNHC)"
        )
