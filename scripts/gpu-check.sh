#!/usr/bin/env bash
# gpu-check.sh - on a machine with an NVIDIA GPU: build kiln with the CUDA
# backend (Release), run test_cuda then the whole ctest suite, then in the same
# run `kiln bench --device cuda --json` (every workload and mode, and --cold),
# the PyTorch peer (bench/peer_torch.py) and, where JAX is importable, the JAX
# peer (bench/peer_jax.py), and end with one table of kiln vs PyTorch
# (bench/compare.py): per workload the best mode of each, the ratio, and the
# targets of ANCHORS.md / issue 4 met or missed.
# Logs and the raw JSON lines (kiln_bench_cuda.jsonl, kiln_cold_cuda.jsonl,
# peer_torch.jsonl, peer_jax.jsonl) go to $OUT when it is set (else
# build/gpu-check/); each stage writes its own log as it runs, so a run cut
# short still leaves what it did.
#
# After the tests, the sanitizer stage: the CUDA tests again under NVIDIA's
# compute-sanitizer (memcheck over test_cuda, the eager and compiled kernels
# of test_cuda_gen and test_attention's CUDA cases; racecheck over the kernels
# that use shared memory: attention, and the row reductions of softmax and
# the norms), each a stage of the table (exit 99: the tool
# found errors, which fails the run), skipped with a message where
# compute-sanitizer is not found. It runs before the benchmarks and takes up
# to 275 s of the budget: GPU_CHECK_SKIP=sanitize gives them that time back.
#
# Environment: GPU_CHECK_QUICK=1 (peers at small sizes), GPU_CHECK_SKIP=
# bench,cold,gpt,peer,jax,sanitize (stages to leave out; gpt: examples/train_gpt
# at GPT-2 small's shape, --json, beside the torch peer's train_gpt rows), GPU_CHECK_JOBS (default 16),
# GPU_CHECK_BUDGET (seconds for the whole run, default 460), GPU_CHECK_CMAKE_ARGS
# (more cmake options, e.g. -DKILN_WERROR=OFF), CUDA_HOME (toolkit),
# GPU_CHECK_PROBES=1 (also build and run each bench/probes/*.cu with nvcc,
# where nvcc is found: stand-alone experiments, reported only),
# GPU_CHECK_TESTS (a ctest -R regex: a targeted run tests only those; the
# default runs the whole suite), GPU_CHECK_WORKLOADS (a comma list: kiln bench
# and the peers run only those workloads, the copy ceiling always; e.g.
# train_decoder,adamw,attention_bwd,attention_bwd_causal for issue 21; --cold
# always times swiglu_ffn and train_decoder), GPU_CHECK_AFTER (a command run last, in this
# script's environment: the toolkit's libraries found, the build in build/;
# its output goes to after.log).
# Exit status: nonzero when configuring, building or a test fails; the
# benchmarks only report.
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
# The whole run stays inside GPU_CHECK_BUDGET seconds (default 460): each stage
# gets its own cap or what is left, whichever is less; a stage with under 20 s
# left is skipped (exit 124 in the table).
deadline=$((SECONDS + ${GPU_CHECK_BUDGET:-460}))
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
# the CUDA op tables are NVRTC-bound (a compile per op signature): spread them.
# The benchmarks need about 300 s (none when bench, peer and jax are all
# skipped; the training rows' torch.compile runs are the long part): the
# suite gets what is left beyond that (at least 120 s, at most 300 s). The sanitizer stage gets up to 275 s of its own out of the rest.
san_reserve=275
[[ $skip == *,sanitize,* ]] && san_reserve=0
bench_reserve=300
[[ $skip == *,bench,* && $skip == *,peer,* && $skip == *,jax,* ]] && bench_reserve=0
ctest_cap=$((deadline - SECONDS - bench_reserve - san_reserve))
((ctest_cap > 300)) && ctest_cap=300
((ctest_cap < 120)) && ctest_cap=120
ctest_sel=()
[[ -n ${GPU_CHECK_TESTS:-} ]] && ctest_sel=(-R "$GPU_CHECK_TESTS")
stage ctest "$ctest_cap" ctest --test-dir "$build" --output-on-failure -j 14 "${ctest_sel[@]}" ||
	status=1
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|\*\*\*" "$logs/ctest.log" | head -40

# ---- compute-sanitizer over the CUDA tests ---------------------------------------------
# Each run reuses its ctest entry's disk cache (the NVRTC builds are done),
# so the time goes to the checked kernels. API errors are not counted: the
# tests provoke some on purpose (test_gpu_oom's failed cuMemAlloc).
find_sanitizer() {
	local c d
	c=$(command -v compute-sanitizer 2>/dev/null) && { echo "$c"; return; }
	for d in "${CUDA_HOME:-}" "${cuda_inc%/include}" /usr/local/cuda; do
		[[ -n $d && -x $d/bin/compute-sanitizer ]] && { echo "$d/bin/compute-sanitizer"; return; }
	done
	while read -r d; do # the pip wheel: nvidia/cuda_sanitizer_api/compute-sanitizer/
		c=${d%/*}/compute-sanitizer/compute-sanitizer
		[[ -n $d && -x $c ]] && { echo "$c"; return; }
	done <<<"$nv_dirs"
}
san_stage() { # san_stage TOOL NAME SECONDS CACHE-NAME [VAR=VALUE...] -- TEST-BINARY
	local tool=$1 name=$2 secs=$3 cache=$4 rc errs
	shift 4
	local envs=()
	while [[ $1 != -- ]]; do envs+=("$1"); shift; done
	shift
	stage "$name" "$secs" env KILN_CACHE_DIR="$build/tests/$cache" "${envs[@]}" \
		"$sanitizer" --tool "$tool" --error-exitcode 99 --report-api-errors no "$@"
	rc=$?
	errs=$(grep -E "(ERROR|RACECHECK) SUMMARY: [0-9]+" "$logs/$name.log" | tail -n 1 |
		sed -E 's/.*(ERROR|RACECHECK) SUMMARY: //')
	say "$name: compute-sanitizer $tool: ${errs:-no summary (cut short?)}, exit $rc"
	((rc == 99)) && status=1
	return 0
}
if [[ $skip == *,sanitize,* ]]; then
	say "sanitize: skipped (GPU_CHECK_SKIP)"
elif ! sanitizer=$(find_sanitizer) || [[ -z $sanitizer ]]; then
	say "sanitize: SKIPPED, compute-sanitizer not found (PATH, \$CUDA_HOME/bin, the toolkit, the nvidia wheels)"
else
	say "sanitize: $sanitizer ($("$sanitizer" --version 2>/dev/null | grep -Eo 'Version [0-9.]+' | head -1))"
	t=$build/tests
	san_stage memcheck san_memcheck_cuda 60 cache-test_cuda -- "$t/test_cuda"
	san_stage memcheck san_memcheck_gen 45 cache-test_cuda_gen_gpu_eager \
		KILN_TEST_FILTER=test_gpu_eager -- "$t/test_cuda_gen"
	# the attention kernels on a few shapes (the whole table takes minutes
	# under the sanitizer; the ptxas-log check is not a kernel run)
	san_stage memcheck san_memcheck_attn 45 cache-test_attention KILN_TEST_FILTER=test_cuda_sdpa \
		KILN_SDPA_FEW=1 -- "$t/test_attention"
	san_stage racecheck san_racecheck_attn 45 cache-test_attention KILN_TEST_FILTER=test_cuda_sdpa \
		KILN_SDPA_FEW=1 -- "$t/test_attention"
	# (KILN_TEST_FILTER is one cmocka pattern: a run per table)
	san_stage racecheck san_racecheck_softmax 40 cache-test_ops_cuda \
		KILN_TEST_DEVICE=cuda KILN_TEST_FILTER=test_softmax -- "$t/test_ops"
	san_stage racecheck san_racecheck_norms 40 cache-test_ops_cuda \
		KILN_TEST_DEVICE=cuda KILN_TEST_FILTER=test_norms -- "$t/test_ops"
fi

# ---- benchmarks: reported, never fatal ---------------------------------------------------
# Each writes JSON lines to its .jsonl (flushed row by row, so a stage cut
# short still leaves its rows) and its messages to its .log.
jsonl_stage() { # jsonl_stage NAME SECONDS CMD...: stdout to NAME.jsonl
	local name=$1 secs=$2
	shift 2
	# shellcheck disable=SC2016 # $0 and $@ are the inner shell's
	stage "$name" "$secs" bash -c '"$@" >"$0"' "$logs/$name.jsonl" "$@"
}
kiln_args=()
peer_args=()
if [[ -n ${GPU_CHECK_WORKLOADS:-} ]]; then
	kiln_args+=(--workload "$GPU_CHECK_WORKLOADS")
	peer_args+=(--workload "memory_bandwidth,$GPU_CHECK_WORKLOADS")
fi
if [[ $skip != *,bench,* ]]; then
	jsonl_stage kiln_bench_cuda 240 "$build/kiln" bench --device cuda --json "${kiln_args[@]}" ||
		say "kiln bench --device cuda did not complete: see kiln_bench_cuda.log"
fi
# two workloads (the FeedForward, the training step), each a cold compile
# (NVRTC) and a warm process
if [[ $skip != *,cold,* ]]; then
	jsonl_stage kiln_cold_cuda 90 "$build/kiln" bench --device cuda --cold --json ||
		say "kiln bench --device cuda --cold did not complete: see kiln_cold_cuda.log"
fi
# the byte-level GPT at GPT-2 small's shape (12 layers, d 768, 12 heads,
# seq 1024, batch 8, bf16): tokens/s, one JSON line (its progress in the log)
if [[ $skip != *,gpt,* ]]; then
	gpt_shape=(--layers 12 --d-model 768 --heads 12 --seq 1024 --batch 8)
	[[ ${GPU_CHECK_QUICK:-0} == 1 ]] && gpt_shape=(--layers 2 --d-model 64 --heads 4 --seq 64 --batch 4)
	jsonl_stage kiln_gpt_cuda 120 "$build/train_gpt" "$root/tests/data/tiny.txt" "${gpt_shape[@]}" --dtype bf16 \
		--device cuda --steps 30 --warmup 5 --json ||
		say "train_gpt did not complete: see kiln_gpt_cuda.log"
fi
[[ ${GPU_CHECK_QUICK:-0} == 1 ]] && peer_args+=(--quick)
# torch: the training rows compile the DecoderLayer's step three ways
# (torch.compile's default, and with the optimizer's step compiled): 360 s
if [[ $skip != *,peer,* ]]; then
	jsonl_stage peer_torch 360 python3 "$root/bench/peer_torch.py" "${peer_args[@]}" ||
		say "peer_torch did not complete: see peer_torch.log"
	grep -h "skipped" "$logs/peer_torch.log" 2>/dev/null | head -1 | sed 's/^/[gpu-check] /'
fi
if [[ $skip != *,jax,* ]]; then
	jsonl_stage peer_jax 120 python3 "$root/bench/peer_jax.py" "${peer_args[@]}" ||
		say "peer_jax did not complete: see peer_jax.log"
fi

# ---- probes (GPU_CHECK_PROBES=1): stand-alone experiments under bench/probes, reported only -----
if [[ ${GPU_CHECK_PROBES:-0} == 1 ]]; then
	nvcc_bin=$(command -v nvcc || true)
	[[ -z $nvcc_bin && -x ${cuda_inc%/include}/bin/nvcc ]] && nvcc_bin=${cuda_inc%/include}/bin/nvcc
	if [[ -z $nvcc_bin ]]; then
		say "probes: no nvcc on this machine, skipped"
	else
		for src in "$root"/bench/probes/*.cu; do
			p=$(basename "$src" .cu)
			# shellcheck disable=SC2016 # $0, $1 and $2 are the inner shell's
			stage "$p" 60 bash -c '"$0" -O3 -arch=sm_90a -std=c++17 -o "$1" "$2" && "$1"' \
				"$nvcc_bin" "$build/$p" "$src" || say "$p did not complete: see $p.log"
			cat "$logs/$p.log"
		done
	fi
fi

# ---- the short table ----------------------------------------------------------------------
{
	echo
	echo "stage          exit   seconds"
	while IFS=$'\t' read -r n rc t; do
		printf '%-16s %-6s %s\n' "$n" "$rc" "$t"
	done <"$logs/stages.tsv"
	grep -E "tests passed" "$logs/ctest.log" 2>/dev/null | tail -1
	grep -E "\(Failed\)|\(Timeout\)" "$logs/ctest.log" 2>/dev/null | head -12
	echo
	jsonl=()
	for f in kiln_bench_cuda kiln_cold_cuda kiln_gpt_cuda peer_torch peer_jax; do
		[[ -s $logs/$f.jsonl ]] && jsonl+=("$logs/$f.jsonl")
	done
	if ((${#jsonl[@]})); then
		python3 "$root/bench/compare.py" --device cuda "${jsonl[@]}" 2>&1 |
			tee "$logs/compare.txt"
	else
		echo "no benchmark rows to compare"
	fi
} | tee -a "$logs/summary.txt"
if [[ -n ${GPU_CHECK_AFTER:-} ]]; then
	stage after $((deadline - SECONDS)) bash -c "$GPU_CHECK_AFTER"
	tail -40 "$logs/after.log"
fi
say "done: status $status in $SECONDS s"
exit $status
