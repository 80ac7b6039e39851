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

# Without a GPU (CI) --device cuda fails with the library's own error and
# prints no rows; on a GPU machine scripts/gpu-check.sh runs the CUDA bench.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
	if "$kiln" bench --device cuda >"$work/out" 2>"$work/err"; then
		fail "--device cuda succeeded on a machine without a GPU"
	fi
	grep -qi 'cuda' "$work/err" || fail "--device cuda: unclear error: $(cat "$work/err")"
	[[ ! -s $work/out ]] || fail "--device cuda printed results"
fi

"$kiln" bench --list >"$work/list"
mapfile -t names < <(awk '{print $1}' "$work/list")
(( ${#names[@]} >= 8 )) || fail "bench --list: ${#names[@]} workloads"

"$kiln" bench --json --iters 1 >"$work/json" || { cat "$work/json"; fail "bench --json failed"; }
num='-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?'
grep -Eq '^\{"workload":"memory_bandwidth","device":"cpu","mode":"copy","ms":'"$num"'.*"gbps":' \
	"$work/json" || fail "no memory_bandwidth line"
grep -F '"workload":"memory_bandwidth"' "$work/json" | grep -q '"kernels"' &&
	fail "the memory_bandwidth line counts kernels"
for w in "${names[@]}"; do
	prefix="{\"workload\":\"$w\",\"device\":\"cpu\",\"mode\":\"eager\","
	line=$(grep -F "$prefix" "$work/json") ||
		fail "no eager line for $w"
	for key in ms iters first_call_ms speedup checksum; do
		grep -Eq "\"$key\":${num}[,}]" <<<"$line" || fail "$w: no numeric $key in $line"
	done
	grep -Eq "\"(gbps|tflops)\":${num}[,}]" <<<"$line" || fail "$w: neither gbps nor tflops"
	grep -Eq '"iters":1[,}]' <<<"$line" || fail "$w: --iters 1 not honoured"
	for mode in default reduce-overhead max-autotune; do
		prefix="{\"workload\":\"$w\",\"device\":\"cpu\",\"mode\":\"$mode\","
		line=$(grep -F "$prefix" "$work/json") || fail "no $mode line for $w"
		for key in ms iters first_call_ms first_call_s speedup checksum; do
			grep -Eq "\"$key\":${num}[,}]" <<<"$line" ||
				fail "$w $mode: no numeric $key"
		done
		grep -Eq '"kernels":[1-9][0-9]*[,}]' <<<"$line" || fail "$w $mode: no kernels count"
		grep -Eq "\"(gbps|tflops)\":${num}[,}]" <<<"$line" || fail "$w $mode: no rate"
		if [[ $mode != default ]]; then
			grep -q '"as_mode":"default"' <<<"$line" ||
				fail "$w $mode: not marked as default"
		fi
	done
done
# Fusion: a pointwise chain is one kernel per call.
for w in relu_fma pointwise8; do
	grep -F "{\"workload\":\"$w\",\"device\":\"cpu\",\"mode\":\"default\"," "$work/json" |
		grep -q '"kernels":1[,}]' || fail "$w: compiled into more than one kernel"
done
grep -Eiq 'nan|inf' "$work/json" && fail "non-finite numbers in the JSON"

# The table form of one workload.
"$kiln" bench --workload relu_fma --iters 2 >"$work/table" || fail "bench table failed"
grep -Eq '^memory bandwidth: [0-9.]+ GB/s' "$work/table" || fail "table: no bandwidth line"
grep -Eq '^relu_fma +cpu +eager +[0-9.]+ +[0-9.]+ +1\.00x +[0-9.]+ GB/s +[0-9]+% +[0-9.]+ +-$' \
	"$work/table" || { cat "$work/table"; fail "table: bad relu_fma eager row"; }
grep -Eq '^relu_fma +cpu +default +[0-9.]+ +[0-9.]+ +[0-9.]+x +[0-9.]+ GB/s +[0-9]+% +[0-9.]+ +1$' \
	"$work/table" || { cat "$work/table"; fail "table: bad relu_fma default row"; }
grep -Eq '^relu_fma +cpu +reduce-overhead\* ' "$work/table" ||
	fail "table: reduce-overhead not marked as default"

# --cold: a compile into an empty cache, then a second process's first call;
# the cache directory it makes is gone afterwards.
mkdir "$work/tmp"
TMPDIR=$work/tmp "$kiln" bench --cold --json >"$work/cold" || fail "bench --cold failed"
for mode in cold_compile warm_process; do
	line=$(grep -F "{\"workload\":\"swiglu_ffn\",\"device\":\"cpu\",\"mode\":\"$mode\"," \
		"$work/cold") || { cat "$work/cold"; fail "--cold: no $mode line"; }
	for key in first_call_ms first_call_s kernels; do
		grep -Eq "\"$key\":${num}[,}]" <<<"$line" || fail "--cold $mode: no numeric $key"
	done
done
[[ -z $(ls -A "$work/tmp") ]] || fail "--cold left $(ls -A "$work/tmp") behind"
TMPDIR=$work/tmp "$kiln" bench --cold --workload relu_fma >"$work/coldt" ||
	fail "bench --cold (table) failed"
grep -Eq '^cold compile .*: +[0-9.]+ ms' "$work/coldt" || fail "--cold table: $(cat "$work/coldt")"
grep -Eq '^warm process .*: +[0-9.]+ ms' "$work/coldt" || fail "--cold table: $(cat "$work/coldt")"

# kiln explain: the example with a host sync shows two graphs and names the break
KILN_CACHE_DIR=$work/cache-explain "$kiln" explain graph_break relu_fma >"$work/explain" 2>&1 ||
	fail "kiln explain failed: $(tail -5 "$work/explain")"
grep -q "graph break: kl_item" "$work/explain" || fail "explain: no break reason"
grep -q "graph 1:" "$work/explain" || fail "explain: no second graph"
grep -q "pointwise: mul#2 add#4 relu#5" "$work/explain" || fail "explain: relu_fma not one fused kernel"
if "$kiln" explain nope >/dev/null 2>&1; then fail "explain accepted an unknown workload"; fi
echo "cli_test: ok (${#names[@]} workloads)"
