#!/usr/bin/env bash
# cli_test.sh - the `kiln` command end to end: --version, --help, every bench
# workload once (JSON checked field by field), and the errors it must give.
# usage: cli_test.sh PATH_TO_KILN
set -euo pipefail

kiln=$1
work=$(mktemp -d "${TMPDIR:-/tmp}/kiln-cli.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "cli_test: $*" >&2; exit 1; }

"$kiln" --version | grep -Eqx 'kiln [0-9]+\.[0-9]+\.[0-9]+' || fail "--version"
"$kiln" --help | grep -q 'bench' || fail "--help does not list bench"
"$kiln" bench --help | grep -q -- '--workload' || fail "bench --help"
if "$kiln" frobnicate >/dev/null 2>&1; then fail "an unknown command succeeded"; fi
if "$kiln" bench --workload nope >/dev/null 2>"$work/err"; then fail "unknown workload accepted"; fi
grep -q "unknown workload 'nope'" "$work/err" || fail "unknown workload: $(cat "$work/err")"
if "$kiln" bench --iters zero >/dev/null 2>&1; then fail "--iters zero accepted"; fi

# This build has no CUDA backend: the library's own error, and a failure.
if "$kiln" bench --device cuda >"$work/out" 2>"$work/err"; then
	fail "--device cuda succeeded on a CPU-only build"
fi
grep -qi 'cuda' "$work/err" || fail "--device cuda: unclear error: $(cat "$work/err")"
[[ ! -s $work/out ]] || fail "--device cuda printed results"

"$kiln" bench --list >"$work/list"
mapfile -t names < <(awk '{print $1}' "$work/list")
(( ${#names[@]} >= 8 )) || fail "bench --list: ${#names[@]} workloads"

"$kiln" bench --json --iters 1 >"$work/json" || { cat "$work/json"; fail "bench --json failed"; }
num='-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?'
grep -Eq '^\{"workload":"memory_bandwidth","device":"cpu","mode":"copy","ms":'"$num"'.*"gbps":' \
	"$work/json" || fail "no memory_bandwidth line"
for w in "${names[@]}"; do
	prefix="{\"workload\":\"$w\",\"device\":\"cpu\",\"mode\":\"eager\","
	line=$(grep -F "$prefix" "$work/json") ||
		fail "no eager line for $w"
	for key in ms iters first_call_ms speedup checksum; do
		grep -Eq "\"$key\":${num}[,}]" <<<"$line" || fail "$w: no numeric $key in $line"
	done
	grep -Eq "\"(gbps|tflops)\":${num}[,}]" <<<"$line" || fail "$w: neither gbps nor tflops"
	grep -Eq '"iters":1[,}]' <<<"$line" || fail "$w: --iters 1 not honoured"
done
grep -Eiq 'nan|inf' "$work/json" && fail "non-finite numbers in the JSON"

# The table form of one workload.
"$kiln" bench --workload relu_fma --iters 2 >"$work/table" || fail "bench table failed"
grep -Eq '^memory bandwidth: [0-9.]+ GB/s' "$work/table" || fail "table: no bandwidth line"
grep -Eq '^relu_fma +cpu +eager +[0-9.]+ +[0-9.]+ +1\.00x +[0-9.]+ GB/s +[0-9]+% +[0-9.]+$' \
	"$work/table" || { cat "$work/table"; fail "table: bad relu_fma row"; }
echo "cli_test: ok (${#names[@]} workloads)"
