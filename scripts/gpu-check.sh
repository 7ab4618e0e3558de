#!/usr/bin/env bash
# The GPU check of issue 14 (scripts/gpu_check.py does the work; its docstring says what).
#
#   scripts/gpu-check.sh [--bin PATH] [--raw-only] [--chunks N] [--keep]
#
# Runs on a GPU machine with python3, torch (CUDA) and msgpack; nothing is fetched. The tierkv
# binary is built beforehand (cargo build --release --bin tierkv) and carried along; its path
# defaults to target/release/tierkv, or $TIERKV_BIN. The tierkv Python package comes from this
# checkout's python/src. Exit status: 0 every byte verified; 2 no CUDA device; 1 anything else.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
if ! command -v "$python" >/dev/null 2>&1; then
    echo "gpu-check: no $python on PATH (set PYTHON)" >&2
    exit 1
fi
args=("$@")
if [[ -n "${TIERKV_BIN:-}" ]]; then
    args=(--bin "$TIERKV_BIN" "${args[@]}")
fi
export PYTHONPATH="$root/python/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
exec "$python" "$root/scripts/gpu_check.py" "${args[@]}"
