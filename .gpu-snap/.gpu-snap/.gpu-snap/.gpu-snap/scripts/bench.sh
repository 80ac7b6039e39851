#!/usr/bin/env bash
# bench.sh - the main job: dependencies, a release build, then `kiln bench`
# on the GPU when one is present and this build can drive it (kiln bench
# --probe), else the CPU. Extra arguments go to `kiln bench` (e.g. --json,
# --workload softmax); KILN_BENCH_DEVICE=cpu|cuda forces the device.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/deps.sh

jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKILN_SANITIZE=OFF
cmake --build build -j "$jobs" --target kiln_cmd

device=cpu
if [[ -z ${KILN_BENCH_DEVICE:-} ]] && command -v nvidia-smi >/dev/null &&
	nvidia-smi -L >/dev/null 2>&1; then
	if build/kiln bench --device cuda --probe >/dev/null 2>build/bench-probe.err; then
		device=cuda
	else
		echo "bench.sh: a GPU is present but kiln cannot use it, so the CPU runs:" \
			"$(cat build/bench-probe.err)" >&2
	fi
fi
device=${KILN_BENCH_DEVICE:-$device}
exec build/kiln bench --device "$device" "$@"
