#!/usr/bin/env bash
# Everything a GPU session runs, in one call (device time is scarce), most wanted first: the GPU
# check, then the Python CUDA tests (the connector's GPU path and the IPC events) against the
# carried daemon, then the unit tests of the GPU crates (tierkv-l1, tierkv-l2, tierkv-server: all
# of them, the CUDA tests enabled by the device), from what scripts/gpu-build.sh put in
# target/gpu-carry, then the other Python tests (all but the vLLM end-to-end ones and the no-GPU
# check of gpu-check.sh), then the daemon soak (integration-tests/tests/soak.rs) with L1 on the
# GPU. Output goes to the terminal and to OUTDIR (default: $OUT, the device tool's output folder,
# else target/gpu-out): gpu-check.txt, python-tests.txt (both Python steps), unit-tests.txt,
# soak.txt, and the daemons' logs. Exit status: the first failure's. Each step has its own time
# limit (GPU_CHECK_LIMIT, default 230 s; 90 s for the Python CUDA tests, 45 s for each test
# executable, 120 s for the other Python tests, 60 s for the soak), so a step that hangs costs
# its limit, not the whole call, and no step runs past GPU_ALL_LIMIT (default 560 s) from the
# start, its 20 s of clean-up after its limit before a kill included (a step with no time left
# is skipped, and fails the call): the device tool stops a command at 600 s, and what a stopped
# command wrote still comes back (Python runs unbuffered). A first call that must leave time for a second: GPU_ALL_LIMIT=300 and gpu-check's
# --rounds 2. PYTORCH_CUDA_ALLOC_CONF defaults to expandable_segments:False: memory from
# expandable segments cannot be shared by CUDA IPC.
#
#   scripts/gpu-all.sh [OUTDIR] [gpu-check.sh arguments...]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-${OUT:-target/gpu-out}}"
shift || true
mkdir -p "$out"
carry=target/gpu-carry
status=0
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:False}"
export PYTHONUNBUFFERED=1
cuda_python=(python/tests/test_worker_cuda.py python/tests/test_cuda.py)
deadline=$((SECONDS + ${GPU_ALL_LIMIT:-560}))
# Runs "$@" as a step that would like $1 seconds: less if the call's deadline is nearer, with
# 20 s of clean-up after its limit before a kill, so it ends by the deadline; a step with no
# time left is not started (exit 124).
bounded() {
    local want=$1 left
    shift
    left=$((deadline - SECONDS - 25))
    if ((left < 1)); then
        echo "gpu-all: no time left for: $*"
        return 124
    fi
    timeout -k 20 "$((want < left ? want : left))" "$@"
}
# The Python tests named (with their pytest arguments), against the carried daemon; appended to
# python-tests.txt.
python_tests() {
    local seconds=$1
    shift
    bounded "$seconds" env PYTHONPATH="$root/python/src" TIERKV_BIN="$root/$carry/tierkv" \
        python3 -m pytest -rA -p no:cacheprovider "$@" 2>&1 |
        tee -a "$out/python-tests.txt"
    return "${PIPESTATUS[0]}"
}
{
    date -u
    nvidia-smi || true
} 2>&1 | tee "$out/device.txt"
bounded "${GPU_CHECK_LIMIT:-230}" scripts/gpu-check.sh --bin "$carry/tierkv" --keep "$@" 2>&1 | tee "$out/gpu-check.txt"
rc=${PIPESTATUS[0]}
[[ $status -eq 0 ]] && status=$rc
# One file for every daemon's log (the device tool brings back at most 8 files).
for log in /tmp/tierkv-gpu-*/daemon.log; do
    [[ -f "$log" ]] && { echo "== $log"; cat "$log"; }
done > "$out/daemons.log"
: > "$out/python-tests.txt"
python_tests 90 "${cuda_python[@]}"
rc=$?
[[ $status -eq 0 ]] && status=$rc
{
    for t in tierkv_l1-tests tierkv_l2-tests tierkv_server-tests; do
        echo "== $carry/$t"
        bounded 45 "$carry/$t" --test-threads 1
        rc=$?
        [[ $status -eq 0 ]] && status=$rc
    done
    exit $status
} 2>&1 | tee "$out/unit-tests.txt"
rc=${PIPESTATUS[0]}
[[ $status -eq 0 ]] && status=$rc
python_tests 120 python/tests --ignore=python/tests/e2e \
    --ignore=python/tests/test_gpu_check.py "${cuda_python[@]/#/--ignore=}"
rc=$?
[[ $status -eq 0 ]] && status=$rc
# The soak's Redis test skips itself where no redis-server is installed.
bounded 60 env TIERKV_BIN="$root/$carry/tierkv" TIERKV_SOAK_L1_DEVICE=cuda \
    "$carry/soak-tests" --nocapture 2>&1 | tee "$out/soak.txt"
rc=${PIPESTATUS[0]}
[[ $status -eq 0 ]] && status=$rc
echo "gpu-all: exit $status; output in $out"
exit $status
