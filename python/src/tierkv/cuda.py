"""CUDA IPC regions for ``register_kv``, through the CUDA driver (``libcuda``, by ctypes).

A worker whose KV is GPU memory registers each device allocation as a
:class:`~tierkv.wire.CudaIpcRegion`: :func:`ipc_region` finds the allocation that holds a device
pointer (``cuMemGetAddressRange``), exports its base (``cuIpcGetMemHandle``) and names the
device by its PCI bus id, and returns the pointer's offset in it (a segment's offset). Nothing
here imports torch: give it ``tensor.data_ptr()``. The driver must already have a context current
on this thread (any CUDA work through torch does that).

Memory from the CUDA VMM API, which PyTorch's ``expandable_segments:True`` uses, cannot be
exported this way: :class:`CudaIpcError` says so, before the daemon is asked.
"""

from __future__ import annotations

import ctypes

from .errors import TierKVError
from .wire import CudaIpcRegion

__all__ = ["CudaIpcError", "CudaUnavailable", "ipc_region", "pci_bus_id"]

_HANDLE_BYTES = 64


class CudaIpcError(TierKVError):
    """A device allocation could not be exported for the daemon."""


class CudaUnavailable(CudaIpcError):
    """No CUDA driver library in this process."""


def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaUnavailable(
            f"the CUDA driver library (libcuda.so.1) cannot be loaded: {e}"
        ) from e


def pci_bus_id(ordinal: int = 0) -> str:
    """The PCI bus id of device ``ordinal`` (as numbered under ``CUDA_VISIBLE_DEVICES``), the
    form the daemon's ``cuDeviceGetByPCIBusId`` takes (``"0000:3b:00.0"``)."""
    cuda = _driver()
    dev = ctypes.c_int(0)
    buf = ctypes.create_string_buffer(32)
    for what, rc in (
        ("cuInit", lambda: cuda.cuInit(0)),
        ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), ordinal)),
        ("cuDeviceGetPCIBusId", lambda: cuda.cuDeviceGetPCIBusId(buf, 32, dev)),
    ):
        code = rc()
        if code != 0:
            raise CudaIpcError(f"{what} failed (CUresult {code}) for device {ordinal}")
    return buf.value.decode()


def ipc_region(ptr: int, ordinal: int = 0) -> tuple[CudaIpcRegion, int]:
    """The region holding device pointer ``ptr`` on device ``ordinal``, and ``ptr``'s byte
    offset in it."""
    cuda = _driver()
    base = ctypes.c_uint64(0)
    size = ctypes.c_size_t(0)
    rc = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise CudaIpcError(
            f"cuMemGetAddressRange failed (CUresult {rc}) for {ptr:#x}: not device memory of "
            "the current context"
        )
    handle = ctypes.create_string_buffer(_HANDLE_BYTES)
    rc = cuda.cuIpcGetMemHandle(handle, ctypes.c_uint64(base.value))
    if rc != 0:
        raise CudaIpcError(
            f"cuIpcGetMemHandle failed (CUresult {rc}) for the allocation at {base.value:#x}: "
            "memory from the CUDA VMM API, such as PyTorch's expandable segments "
            "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or vLLM's sleep mode "
            "(enable_sleep_mode, whose allocator maps the KV cache that way), cannot be shared "
            "by CUDA IPC; allocate the KV cache with cudaMalloc (expandable segments and sleep "
            "mode off)"
        )
    region = CudaIpcRegion(handle=handle.raw, device=pci_bus_id(ordinal), bytes=size.value)
    return region, ptr - base.value
