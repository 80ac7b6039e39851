#!/usr/bin/env bash
# bench.sh - the main job: dependencies, a release build, then `kiln bench`
# on the GPU when one is present (and this build can drive it), else the CPU.
# Extra arguments go to `kiln bench` (e.g. --json, --workload softmax).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/deps.sh

jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKILN_SANITIZE=OFF
cmake --build build -j "$jobs" --target kiln_cmd

# This build has no CUDA backend yet, so the CPU is the device even where a
# GPU exists; once it does, a GPU found here is used.
device=cpu
if [[ -z ${KILN_BENCH_DEVICE:-} ]] && command -v nvidia-smi >/dev/null &&
	nvidia-smi -L >/dev/null 2>&1 &&
	build/kiln bench --device cuda --workload relu_fma --iters 1 >/dev/null 2>&1; then
	device=cuda
fi
device=${KILN_BENCH_DEVICE:-$device}
exec build/kiln bench --device "$device" "$@"
