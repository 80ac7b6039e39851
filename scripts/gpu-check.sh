#!/usr/bin/env bash
# gpu-check.sh - on a machine with an NVIDIA GPU: build kiln with the CUDA
# backend (Release), run test_cuda then the whole ctest suite, then
# `kiln bench --device cuda --json` and the PyTorch peer (bench/peer_torch.py).
# Logs go to $OUT when it is set (else build/gpu-check/); each stage writes its
# own log as it runs, so a run cut short still leaves what it did.
#
# Environment: GPU_CHECK_QUICK=1 (peer at small sizes), GPU_CHECK_SKIP=bench,peer
# (stages to leave out), GPU_CHECK_JOBS (default 16), GPU_CHECK_CMAKE_ARGS (more
# cmake options, e.g. -DKILN_WERROR=OFF), CUDA_HOME (toolkit).
# Exit status: nonzero when configuring, building or a test fails; the two
# benchmarks only report (kiln bench may not support CUDA yet).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
build=$root/build
logs=${OUT:-$build/gpu-check}
mkdir -p "$logs"
jobs=${GPU_CHECK_JOBS:-16}
skip=",${GPU_CHECK_SKIP:-},"
status=0

say() { echo "[gpu-check] $*" | tee -a "$logs/summary.txt"; }
# The whole run stays inside GPU_CHECK_BUDGET seconds (default 520): each stage
# gets its own cap or what is left, whichever is less; a stage with under 20 s
# left is skipped (exit 124 in the table).
deadline=$((SECONDS + ${GPU_CHECK_BUDGET:-520}))
: >"$logs/stages.tsv"
stage() { # stage NAME SECONDS CMD...: run with a time limit, log to NAME.log
	local name=$1 secs=$2
	shift 2
	local t0=$SECONDS rc left=$((deadline - SECONDS))
	((secs > left)) && secs=$left
	if ((secs < 20)); then
		say "$name: skipped, the time budget is spent"
		printf '%s\t%s\t%s\n' "$name" "skipped" 0 >>"$logs/stages.tsv"
		return 124
	fi
	timeout --kill-after=10 "$secs" "$@" >"$logs/$name.log" 2>&1
	rc=$?
	say "$name: exit $rc after $((SECONDS - t0)) s (log: $name.log)"
	printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$logs/stages.tsv"
	return $rc
}

: >"$logs/summary.txt"
say "kiln gpu-check in $root, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
{ nvidia-smi || echo "nvidia-smi failed"; } >"$logs/nvidia-smi.txt" 2>&1
say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"

# ---- the toolkit: headers for the build, libraries for dlopen ----------------------
cuda_inc=""
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-13.0 /usr; do
	if [[ -n $d && -f $d/include/cuda.h && -f $d/include/nvrtc.h && -f $d/include/cublasLt.h ]]; then
		cuda_inc=$d/include
		break
	fi
done
# PyTorch's CUDA wheels: site-packages/nvidia/<component>/{include,lib} (12.x)
# or nvidia/cu13/{include,lib} (13.x). Their headers are merged into one
# directory of links; their libraries are named to kiln's loader.
nv_dirs=$(python3 - 2>/dev/null <<'EOF'
import os
try:
    import nvidia
    for p in nvidia.__path__:
        for d, subdirs, files in os.walk(p):
            if os.path.basename(d) in ("include", "lib", "lib64"):
                print(d)
except Exception:
    pass
EOF
)
if [[ -z $cuda_inc && -n $nv_dirs ]]; then
	merged=$build/cuda-include
	mkdir -p "$merged"
	while read -r d; do
		[[ $d == */include ]] || continue
		for f in "$d"/*; do
			[[ -e $merged/$(basename "$f") ]] || ln -s "$f" "$merged/"
		done
	done <<<"$nv_dirs"
	if [[ -f $merged/cuda.h && -f $merged/nvrtc.h && -f $merged/cublasLt.h ]]; then
		cuda_inc=$merged
	fi
fi
if [[ -z $cuda_inc ]]; then
	say "no CUDA headers found (cuda.h, nvrtc.h, cublasLt.h): set CUDA_HOME"
	exit 1
fi
say "CUDA headers: $cuda_inc"
find_lib() { # find_lib SONAME-PREFIX: a path from the wheels when ldconfig lacks it
	ldconfig -p 2>/dev/null | grep -q "$1" && return 0
	while read -r d; do
		[[ $d == */lib || $d == */lib64 ]] || continue
		local f
		f=$(find "$d" -maxdepth 1 -name "$1*" 2>/dev/null | sort | tail -1)
		[[ -n $f ]] && echo "$f" && return 0
	done <<<"$nv_dirs"
	[[ -n ${CUDA_HOME:-} ]] && find "$CUDA_HOME/lib64" -maxdepth 1 -name "$1*" 2>/dev/null |
		sort | tail -1
	return 0
}
add_lib() { # add_lib VAR SONAME-PREFIX
	local p dir
	p=$(find_lib "$2")
	[[ -n $p ]] || return 0
	dir=$(dirname "$p")
	export "$1=$p"
	export LD_LIBRARY_PATH=$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}
add_lib KILN_LIBNVRTC libnvrtc.so
add_lib KILN_LIBCUBLASLT libcublasLt.so
say "NVRTC: ${KILN_LIBNVRTC:-from the loader path}; cuBLASLt: ${KILN_LIBCUBLASLT:-from the loader path}"

# ---- build and test -------------------------------------------------------------------
# shellcheck source=scripts/gpu-deps.sh
. "$root/scripts/gpu-deps.sh"
gpu_deps_setup "$root" "$build" >"$logs/deps.log" 2>&1 || { say "deps: $(tail -1 "$logs/deps.log")"; exit 1; }
say "deps: $(head -1 "$logs/deps.log")"
read -r -a extra <<<"${GPU_CHECK_CMAKE_ARGS:-}"
if ! stage configure 300 cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release \
	-DKILN_CUDA=ON -DKILN_CUDA_INCLUDE_DIR="$cuda_inc" "${extra[@]}"; then
	tail -30 "$logs/configure.log"
	exit 1
fi
if ! stage build 240 cmake --build "$build" -j "$jobs"; then
	grep -E "error|Error" "$logs/build.log" | head -40
	exit 1
fi
# test_cuda alone first: the GPU tests of the CUDA layer, with what they print
stage test_cuda 60 "$build/tests/test_cuda" || status=1
tail -25 "$logs/test_cuda.log"
# the CUDA op tables are NVRTC-bound (a compile per op signature): spread them
stage ctest 300 ctest --test-dir "$build" --output-on-failure -j 14 || status=1
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|\*\*\*" "$logs/ctest.log" | head -40

# ---- benchmarks: reported, never fatal ---------------------------------------------------
if [[ $skip != *,bench,* ]]; then
	if stage kiln_bench 120 "$build/kiln" bench --device cuda --json; then
		cp "$logs/kiln_bench.log" "$logs/kiln_bench_cuda.jsonl"
	else
		say "kiln bench --device cuda did not complete (unsupported yet, or failed): see kiln_bench.log"
	fi
fi
if [[ $skip != *,peer,* ]]; then
	peer_args=()
	[[ ${GPU_CHECK_QUICK:-0} == 1 ]] && peer_args+=(--quick)
	left=$((deadline - SECONDS))
	((left > 120)) && left=120
	((left < 20)) && left=20
	if timeout --kill-after=10 "$left" python3 "$root/bench/peer_torch.py" "${peer_args[@]}" \
		>"$logs/peer_torch.jsonl" 2>"$logs/peer_torch.err"; then
		say "peer_torch: $(wc -l <"$logs/peer_torch.jsonl") rows in peer_torch.jsonl"
	else
		say "peer_torch did not complete (exit $?): see peer_torch.err"
	fi
fi
# ---- the short table ----------------------------------------------------------------------
{
	echo
	echo "stage          exit   seconds"
	while IFS=$'\t' read -r n rc t; do
		printf '%-14s %-6s %s\n' "$n" "$rc" "$t"
	done <"$logs/stages.tsv"
	grep -E "tests passed" "$logs/ctest.log" 2>/dev/null | tail -1
	grep -E "\(Failed\)|\(Timeout\)" "$logs/ctest.log" 2>/dev/null | head -12
	if [[ -s $logs/kiln_bench_cuda.jsonl ]]; then
		echo
		echo "kiln bench (cuda): workload mode ms"
		sed -nE 's/.*"workload": ?"([^"]*)".*"mode": ?"([^"]*)".*"ms": ?([-0-9.eE+]*).*/\1 \2 \3/p' \
			"$logs/kiln_bench_cuda.jsonl" | head -40 | awk '{printf "  %-22s %-26s %s\n", $1, $2, $3}'
	fi
	if [[ -s $logs/peer_torch.jsonl ]]; then
		echo
		echo "torch peer: workload mode ms"
		sed -nE 's/.*"workload": ?"([^"]*)".*"mode": ?"([^"]*)".*"ms": ?([-0-9.eE+]*).*/\1 \2 \3/p' \
			"$logs/peer_torch.jsonl" | head -40 | awk '{printf "  %-22s %-26s %s\n", $1, $2, $3}'
	fi
} | tee -a "$logs/summary.txt"
say "done: status $status in $SECONDS s"
exit $status
