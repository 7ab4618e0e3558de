#!/usr/bin/env bash
# Builds what a GPU session carries to the GPU machine (which has no Rust toolchain and no
# network): the release `tierkv` binary and the unit-test executables that hold the CUDA tests,
# stripped, in target/gpu-carry/. Prints the files and their total size (the device tool carries
# at most 64 MiB of ignored paths).
#
#   scripts/gpu-build.sh
#
# Then, on the GPU machine (carry target/gpu-carry), all of it at once: scripts/gpu-all.sh; or
# one by one:
#   scripts/gpu-check.sh --bin target/gpu-carry/tierkv
#   target/gpu-carry/tierkv_l1-tests --test-threads 1   (the CUDA tests: filter "cuda")
#   target/gpu-carry/tierkv_l2-tests memory_kind --nocapture   (pinned L2 through cudarc)
#   target/gpu-carry/tierkv_server-tests cuda --nocapture --test-threads 1
#   TIERKV_BIN=target/gpu-carry/tierkv TIERKV_SOAK_L1_DEVICE=cuda target/gpu-carry/soak-tests
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out=target/gpu-carry
rm -rf "$out"
mkdir -p "$out"
cargo build --release --locked --bin tierkv
cp target/release/tierkv "$out/tierkv"
# Copies the test executable `cargo test --release ARGS --no-run` builds to $out/NAME.
carry_tests() {
    local name=$1
    shift
    local exe
    exe=$(cargo test --release --locked "$@" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])')
    if [[ -z "$exe" ]]; then
        echo "gpu-build: no test executable for $name" >&2
        exit 1
    fi
    cp "$exe" "$out/$name"
}
for crate in tierkv-l1 tierkv-l2 tierkv-server; do
    # The lib's unit-test executable: the CUDA tests live there.
    carry_tests "${crate//-/_}-tests" -p "$crate" --lib
done
# The daemon soak, run there with L1 on the GPU (TIERKV_SOAK_L1_DEVICE=cuda).
carry_tests soak-tests -p tierkv-integration-tests --test soak
strip "$out"/*
ls -la "$out"
du -ch "$out"/* | tail -1
