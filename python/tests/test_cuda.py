"""``tierkv.cuda`` without a CUDA driver: a clear error, never a crash. (With one, the GPU check,
``scripts/gpu-check.sh``, exports real KV tensors through it.)"""

from __future__ import annotations

import ctypes

import pytest

from tierkv.cuda import CudaIpcError, CudaUnavailable, ipc_region, pci_bus_id
from tierkv.errors import TierKVError


def has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(has_driver(), reason="a CUDA driver is present: the GPU check covers it")
def test_without_a_driver_exporting_says_so():
    for call in (lambda: ipc_region(0x7F0000000000), lambda: pci_bus_id(0)):
        with pytest.raises(CudaUnavailable, match="libcuda.so.1") as caught:
            call()
        assert isinstance(caught.value, CudaIpcError)
        assert isinstance(caught.value, TierKVError)
