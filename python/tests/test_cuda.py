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


# What the GPU path relies on when a daemon dies mid-retrieve: the worker's stream waits on an
# interprocess event that the daemon records after its copies. Run apart, in a process of its
# own, so that a wait that never returns fails the test instead of hanging it.
DEAD_RECORDER = r"""
import os, signal, subprocess, sys, time
import torch

RECORDER = '''
import sys, torch
handle = bytes.fromhex(sys.stdin.readline().strip())
event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), handle)
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):
    torch.cuda._sleep(40_000_000_000)  # about 20 s of one spinning kernel
    event.record(stream)
print("recorded", flush=True)
sys.stdin.readline()
'''

event = torch.cuda.Event(interprocess=True)
event.record(torch.cuda.current_stream())
torch.cuda.synchronize()
recorder = subprocess.Popen(
    [sys.executable, "-c", RECORDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
)
recorder.stdin.write(bytes(event.ipc_handle()).hex() + "\n")
recorder.stdin.flush()
assert recorder.stdout.readline().strip() == "recorded"
pending = not event.query()
torch.cuda.current_stream().wait_event(event)
marker = torch.ones(1, device="cuda") * 2  # a kernel behind the wait
os.kill(recorder.pid, signal.SIGKILL)
recorder.wait()
start = time.monotonic()
try:
    event.synchronize()
    torch.cuda.current_stream().synchronize()
    outcome = f"ok {float(marker.item())}"
except RuntimeError as e:
    outcome = f"error {e}"
print(f"pending={pending} waited={time.monotonic() - start:.3f} {outcome}", flush=True)
"""


@pytest.mark.skipif(not has_driver(), reason="no CUDA driver here: the GPU session runs it")
def test_an_event_recorded_by_a_killed_process_does_not_hang_its_waiters():
    import subprocess
    import sys

    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the GPU session runs it")
    try:
        done = subprocess.run(
            [sys.executable, "-c", DEAD_RECORDER], capture_output=True, text=True, timeout=45
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"waiting on a killed recorder's event hung: {e.stdout!r} {e.stderr!r}")
    print(done.stdout, done.stderr)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("pending=True"), f"the recorder's kernel ended too soon: {line}"
    assert line.endswith("ok 2.0"), f"a waiter saw an error or a stale result: {line}"
