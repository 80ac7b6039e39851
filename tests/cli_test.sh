#!/usr/bin/env bash
# cli_test.sh - the `kiln` command end to end: --version, --help, every bench
# workload once in every mode (JSON checked field by field), bench --cold, and
# the errors it must give.
# usage: cli_test.sh PATH_TO_KILN
set -euo pipefail

kiln=$1
work=$(mktemp -d "${TMPDIR:-/tmp}/kiln-cli.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "cli_test: $*" >&2; exit 1; }
# A private kernel cache: the compiled modes really compile, and the user's
# cache is left alone.
mkdir -m 700 "$work/cache"
export KILN_CACHE_DIR=$work/cache

"$kiln" --version | grep -Eqx 'kiln [0-9]+\.[0-9]+\.[0-9]+' || fail "--version"
"$kiln" --help | grep -q 'bench' || fail "--help does not list bench"
"$kiln" bench --help | grep -q -- '--workload' || fail "bench --help"
if "$kiln" frobnicate >/dev/null 2>&1; then fail "an unknown command succeeded"; fi
if "$kiln" bench --workload nope >/dev/null 2>"$work/err"; then fail "unknown workload accepted"; fi
grep -q "unknown workload 'nope'" "$work/err" || fail "unknown workload: $(cat "$work/err")"
if "$kiln" bench --iters zero >/dev/null 2>&1; then fail "--iters zero accepted"; fi

# Without a GPU (CI) --device cuda fails with the library's own reason (no
# driver, no device, or a build without the CUDA backend), exit status 1, and
# prints no rows; on a GPU machine scripts/gpu-check.sh runs the CUDA bench.
no_cuda='no CUDA driver found|no CUDA device found|without the CUDA backend'
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
	for args in "" "--json" "--probe" "--cold"; do
		rc=0
		# shellcheck disable=SC2086
		"$kiln" bench --device cuda $args >"$work/out" 2>"$work/err" || rc=$?
		(( rc == 1 )) || fail "--device cuda $args: exit $rc without a GPU (want 1)"
		grep -Eq "^kiln bench: .*($no_cuda)" "$work/err" ||
			fail "--device cuda $args: unclear error: $(cat "$work/err")"
		[[ ! -s $work/out ]] || fail "--device cuda $args printed results: $(cat "$work/out")"
	done
fi
"$kiln" bench --probe | grep -qx 'kiln bench: cpu works' || fail "--probe on the CPU"
# The CUDA table lists without a device: ANCHORS.md's problems in f16/bf16.
"$kiln" bench --list --device cuda >"$work/list_cuda"
for row in 'relu_fma .*4096x4096 f16' 'relu_fma .*8192x8192 f16' 'pointwise8 .*4096x4096 f16' \
	'softmax .*16384x4096 bf16' 'layer_norm .*16384x4096 bf16' 'rms_norm .*16384x4096 bf16' \
	'rms_norm_prims .*16384x4096 bf16' 'swiglu_ffn .*4x1024x2048, hidden 8192, bf16' \
	'mlp24 .*24 x \(linear 256.*batch 8, f16' \
	'attention .*batch 4, 16 heads, seq 1024, head dim 128, bf16' \
	'attention_causal .*causal, batch 4, 16 heads, seq 1024, head dim 128, bf16' \
	"decoder_layer .*the seed's DecoderLayer, x 4x1024x2048, 16 heads, ffn 8192, bf16" \
	'decoder_token .*one token, x 1x1x2048, 16 heads, ffn 8192, bf16'; do
	grep -Eq "^$row" "$work/list_cuda" || fail "bench --list --device cuda: no '$row'"
done
if "$kiln" bench --warmup -1 >/dev/null 2>&1; then fail "--warmup -1 accepted"; fi
if "$kiln" bench --workload gemm >/dev/null 2>"$work/err"; then fail "a CUDA-only workload ran on the CPU"; fi
grep -q "unknown workload 'gemm' on cpu" "$work/err" || fail "gemm on cpu: $(cat "$work/err")"

"$kiln" bench --list >"$work/list"
mapfile -t names < <(awk '{print $1}' "$work/list")
(( ${#names[@]} >= 9 )) || fail "bench --list: ${#names[@]} workloads"

"$kiln" bench --json --iters 1 >"$work/json" || { cat "$work/json"; fail "bench --json failed"; }
num='-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?'
str='"[^"]*"'
# The keys every row has (bench/compare.py and the peers read them), null
# where a figure does not apply.
while read -r line; do
	for key in workload device shape mode; do
		grep -Eq "\"$key\":$str[,}]" <<<"$line" || fail "no string $key in $line"
	done
	for key in dtype; do
		grep -Eq "\"$key\":($str|null)[,}]" <<<"$line" || fail "no $key in $line"
	done
	for key in median_us bytes bw_tbs; do
		grep -Eq "\"$key\":${num}[,}]" <<<"$line" || fail "no numeric $key in $line"
	done
	for key in first_call_s kernels flops peak_bytes; do
		grep -Eq "\"$key\":(${num}|null)[,}]" <<<"$line" || fail "no $key in $line"
	done
done <"$work/json"
grep -Eq '^\{"workload":"memory_bandwidth","device":"cpu","dtype":null,"shape":"256 MiB memcpy","mode":"copy","median_us":'"$num"'.*"gbps":' \
	"$work/json" || fail "no memory_bandwidth line"
grep -F '"workload":"memory_bandwidth"' "$work/json" | grep -q '"kernels":null' ||
	fail "the memory_bandwidth line counts kernels"
for w in "${names[@]}"; do
	prefix="{\"workload\":\"$w\",\"device\":\"cpu\",\"dtype\":\"f32\",\"shape\":"
	line=$(grep -F "$prefix" "$work/json" | grep -F '"mode":"eager"') ||
		fail "no eager line for $w"
	for key in ms iters first_call_ms speedup checksum peak_bytes flops; do
		grep -Eq "\"$key\":${num}[,}]" <<<"$line" || fail "$w: no numeric $key in $line"
	done
	grep -Eq '"kernels":null' <<<"$line" || fail "$w eager: kernels not null"
	grep -Eq "\"(gbps|tflops)\":${num}[,}]" <<<"$line" || fail "$w: neither gbps nor tflops"
	grep -Eq '"iters":1[,}]' <<<"$line" || fail "$w: --iters 1 not honoured"
	# median_us is ms in microseconds
	awk -v l="$line" 'BEGIN {
		match(l, /"median_us":[^,]*/); us = substr(l, RSTART + 12, RLENGTH - 12) + 0
		match(l, /"ms":[^,]*/); ms = substr(l, RSTART + 5, RLENGTH - 5) + 0
		exit !(us > 0 && (us - 1000 * ms) ^ 2 < (1e-4 * us) ^ 2) }' ||
		fail "$w: median_us does not match ms: $line"
	# the optimizer alone runs eagerly only (inside a compiled function its
	# step is the same fused update, deferred; nothing after it may read the
	# parameters it writes)
	[[ $w == adamw ]] && continue
	for mode in default reduce-overhead max-autotune; do
		line=$(grep -F "$prefix" "$work/json" | grep -F "\"mode\":\"$mode\"") ||
			fail "no $mode line for $w"
		for key in ms iters first_call_ms first_call_s speedup checksum peak_bytes; do
			grep -Eq "\"$key\":${num}[,}]" <<<"$line" ||
				fail "$w $mode: no numeric $key"
		done
		grep -Eq '"kernels":[1-9][0-9]*[,}]' <<<"$line" || fail "$w $mode: no kernels count"
		grep -Eq "\"(gbps|tflops)\":${num}[,}]" <<<"$line" || fail "$w $mode: no rate"
		grep -Eq '"peak_bytes":[1-9][0-9]*[,}]' <<<"$line" || fail "$w $mode: no peak memory"
		if [[ $mode != default ]]; then
			grep -q '"as_mode":"default"' <<<"$line" ||
				fail "$w $mode: not marked as default"
		fi
	done
done
# issue 22: the CPU's f16/bf16 rows (--list: a description ending in the
# dtype), eager and default, at the shape of their workload's f32 row
mapfile -t halves < <(awk '$NF == "f16" || $NF == "bf16" {print $1 " " $NF}' "$work/list")
(( ${#halves[@]} >= 8 )) || fail "bench --list: ${#halves[@]} f16/bf16 rows"
for h in "${halves[@]}"; do
	read -r w dt <<<"$h"
	f32=$(grep -F "{\"workload\":\"$w\",\"device\":\"cpu\",\"dtype\":\"f32\"," "$work/json" |
		grep -F '"mode":"eager"' | head -1 | grep -Eo '"shape":"[^"]*"') || fail "$w: no f32 row"
	for mode in eager default; do
		line=$(grep -F "{\"workload\":\"$w\",\"device\":\"cpu\",\"dtype\":\"$dt\",$f32," \
			"$work/json" | grep -F "\"mode\":\"$mode\"") || fail "$w $dt: no $mode line at $f32"
		for key in ms iters speedup checksum peak_bytes; do
			grep -Eq "\"$key\":${num}[,}]" <<<"$line" || fail "$w $dt $mode: no numeric $key"
		done
	done
done
# issue 21: the training rows. The step compiled whole (forward, loss,
# backward, AdamW) and the forward alone compiled with kl_backward and the
# optimizer after it; the optimizer alone against the copy bandwidth.
line=$(grep -F '{"workload":"train_decoder","device":"cpu"' "$work/json" |
	grep -F '"mode":"compiled-forward"') || fail "train_decoder: no compiled-forward line"
for key in ms first_call_s speedup checksum tflops; do
	grep -Eq "\"$key\":${num}[,}]" <<<"$line" || fail "train_decoder compiled-forward: no $key"
done
grep -Eq '"kernels":[1-9][0-9]*[,}]' <<<"$line" || fail "train_decoder compiled-forward: kernels"
grep -Eq '"peak_bytes":[1-9][0-9]*[,}]' <<<"$line" || fail "train_decoder compiled-forward: peak"
grep -F '{"workload":"adamw","device":"cpu"' "$work/json" | grep -F '"mode":"eager"' |
	grep -Eq "\"gbps\":${num},\"copy_gbps\":${num},\"bw_frac\":${num}" ||
	fail "adamw: no bandwidth against the copy's"
for w in attention_bwd attention_bwd_causal; do
	grep -F "{\"workload\":\"$w\",\"device\":\"cpu\"" "$work/json" |
		grep -F '"mode":"default"' | grep -Eq "\"tflops\":${num}[,}]" || fail "$w: no default row"
done
# issue 23: the dynamic plan beside the static one, same shape
grep -F '{"workload":"gpt2_block","device":"cpu"' "$work/json" | grep -F '"mode":"dynamic"' |
	grep -Eq '"kernels":[1-9][0-9]*[,}]' || fail "gpt2_block: no dynamic line"
# Fusion: a pointwise chain is one kernel per call.
for w in relu_fma pointwise8; do
	grep -F "{\"workload\":\"$w\",\"device\":\"cpu\"," "$work/json" |
		grep -F '"mode":"default"' | grep -q '"kernels":1[,}]' ||
		fail "$w: compiled into more than one kernel"
done
# Peak memory holds at least the inputs and the output: relu_fma's three
# 4096x4096 f32 inputs and its output are 256 MiB.
grep -F '{"workload":"relu_fma","device":"cpu"' "$work/json" | grep -F '"mode":"default"' |
	grep -Eq '"peak_bytes":(2[6-9][0-9]|[3-9][0-9][0-9])[0-9]{6}[,}]' ||
	fail "relu_fma default: peak memory below 256 MiB"
grep -Eiq 'nan|inf' "$work/json" && fail "non-finite numbers in the JSON"

# The table form of one workload.
"$kiln" bench --workload relu_fma --iters 2 >"$work/table" || fail "bench table failed"
grep -Eq '^memory bandwidth: [0-9.]+ GB/s' "$work/table" || fail "table: no bandwidth line"
row='^relu_fma +cpu +f32 +4096x4096 +'
# the last column, host us, is CUDA's: "-" on the CPU
grep -Eq "${row}eager +[0-9.]+ (us|ms) +[0-9.]+ +1\\.00x +[0-9.]+ GB/s +[0-9]+% +[0-9.]+ +- +[0-9.]+ +-$" \
	"$work/table" || { cat "$work/table"; fail "table: bad relu_fma eager row"; }
grep -Eq "${row}default +[0-9.]+ (us|ms) +[0-9.]+ +[0-9.]+x +[0-9.]+ GB/s +[0-9]+% +[0-9.]+ +1 +[0-9.]+ +-$" \
	"$work/table" || { cat "$work/table"; fail "table: bad relu_fma default row"; }
grep -Eq "${row}reduce-overhead\\* " "$work/table" ||
	fail "table: reduce-overhead not marked as default"

# --serve: one workload held ready, timed a batch per line read (what
# bench/pair_ort.py drives); a bad line, mode or workload count is an error.
printf '3\n1\nq\n' | "$kiln" bench --serve default --workload softmax >"$work/serve" ||
	fail "bench --serve failed"
grep -Eq "^ready softmax 4096x4096 f32 default ${num}$" "$work/serve" ||
	{ cat "$work/serve"; fail "--serve: no ready line"; }
grep -Eq "^3 ${num} ${num}$" "$work/serve" && grep -Eq "^1 ${num} ${num}$" "$work/serve" ||
	{ cat "$work/serve"; fail "--serve: no batch lines"; }
rc=0
printf '2\nlots\n5\n' | "$kiln" bench --serve eager --workload relu_fma >"$work/serve" 2>"$work/err" ||
	rc=$?
((rc == 2)) && grep -q "not 'lots'" "$work/err" && ! grep -q '^5 ' "$work/serve" ||
	fail "--serve: a bad request: exit $rc, $(cat "$work/err")"
if "$kiln" bench --serve fast --workload relu_fma </dev/null >/dev/null 2>"$work/err"; then
	fail "--serve with an unknown mode accepted"
fi
grep -q "not 'fast'" "$work/err" || fail "--serve fast: $(cat "$work/err")"
if "$kiln" bench --serve default </dev/null >/dev/null 2>"$work/err"; then
	fail "--serve without a workload accepted"
fi
grep -q "name it with --workload" "$work/err" || fail "--serve alone: $(cat "$work/err")"
# --shape: the workload's row of that shape; an unknown one is an error
printf '1\nq\n' | "$kiln" bench --serve eager --workload gpt2_block --shape 2x33x768,h12 \
	>"$work/serve" || fail "bench --serve --shape failed"
grep -Eq "^ready gpt2_block 2x33x768,h12 f32 eager ${num}$" "$work/serve" ||
	{ cat "$work/serve"; fail "--serve --shape: not the 2x33 row"; }
rc=0
"$kiln" bench --serve eager --workload gpt2_block --shape 2x34x768 </dev/null >/dev/null \
	2>"$work/err" || rc=$?
((rc == 2)) && grep -q "no row of shape '2x34x768'" "$work/err" ||
	fail "--shape of no row: exit $rc, $(cat "$work/err")"
rc=0
"$kiln" bench --shape 2x33x768,h12 </dev/null >/dev/null 2>"$work/err" || rc=$?
((rc == 2)) && grep -q "only with --serve" "$work/err" ||
	fail "--shape without --serve: exit $rc, $(cat "$work/err")"

# --cold: a compile into an empty cache, then a second process's first call;
# the cache directory it makes is gone afterwards.
mkdir "$work/tmp"
TMPDIR=$work/tmp "$kiln" bench --cold --json >"$work/cold" || fail "bench --cold failed"
for mode in cold_compile warm_process; do
	line=$(grep -F '{"workload":"swiglu_ffn","device":"cpu",' "$work/cold" |
		grep -F "\"mode\":\"$mode\",") || { cat "$work/cold"; fail "--cold: no $mode line"; }
	for key in first_call_ms first_call_s ctx_ms process_ms kernels peak_bytes; do
		grep -Eq "\"$key\":${num}[,}]" <<<"$line" || fail "--cold $mode: no numeric $key"
	done
	grep -Fq '"dtype":"f32","shape":"4x128x512->1408"' <<<"$line" ||
		fail "--cold $mode: no dtype and shape: $line"
	# and the training step's (issue 21), in processes and a cache of its own
	grep -F '{"workload":"train_decoder","device":"cpu",' "$work/cold" |
		grep -F "\"mode\":\"$mode\"," | grep -Eq "\"first_call_s\":${num}," ||
		fail "--cold: no train_decoder $mode line"
done
[[ -z $(ls -A "$work/tmp") ]] || fail "--cold left $(ls -A "$work/tmp") behind"
# The table, with KILN_LOGS=startup: each process says what its first call's
# variant cost (a build in the first, the disk cache in the second), and the
# table gives each context's creation on a line of its own.
TMPDIR=$work/tmp KILN_LOGS=startup "$kiln" bench --cold --workload relu_fma >"$work/coldt" \
	2>"$work/coldlog" || fail "bench --cold (table) failed: $(cat "$work/coldlog")"
grep -Eq '^cold compile .*: +[0-9.]+ ms' "$work/coldt" || fail "--cold table: $(cat "$work/coldt")"
grep -Eq '^warm process .*: +[0-9.]+ ms' "$work/coldt" || fail "--cold table: $(cat "$work/coldt")"
(( $(grep -Ec '^  its context creation \(kl_ctx_new\), before: +[0-9.]+ ms' "$work/coldt") == 2 )) ||
	fail "--cold table: no context creation lines: $(cat "$work/coldt")"
grep -Eq '^\[kiln:startup\] variant [0-9a-f]{16}: cache lookup [0-9.]+ ms, lowering [0-9.]+ ms, build \(cc, dlopen\) [0-9.]+ ms$' \
	"$work/coldlog" || fail "--cold: no startup log of the build: $(cat "$work/coldlog")"
grep -Eq '^\[kiln:startup\] variant [0-9a-f]{16}: plan and binary from the disk cache [0-9.]+ ms$' \
	"$work/coldlog" || fail "--cold: no startup log of the cache hit: $(cat "$work/coldlog")"

# kiln explain: the example with a host sync shows two graphs and names the break
KILN_CACHE_DIR=$work/cache-explain "$kiln" explain graph_break relu_fma >"$work/explain" 2>&1 ||
	fail "kiln explain failed: $(tail -5 "$work/explain")"
grep -q "graph break: kl_item" "$work/explain" || fail "explain: no break reason"
grep -q "graph 1:" "$work/explain" || fail "explain: no second graph"
grep -q "pointwise: mul#2 add#4 relu#5" "$work/explain" || fail "explain: relu_fma not one fused kernel"
if "$kiln" explain nope >/dev/null 2>&1; then fail "explain accepted an unknown workload"; fi
echo "cli_test: ok (${#names[@]} workloads)"
