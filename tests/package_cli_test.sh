#!/usr/bin/env bash
# package_cli_test.sh - `kiln export`, `kiln package`, `kiln inspect` and
# `kiln run` end to end: bench workloads exported with dynamic dims, packaged
# and checked (eager = compiled = package), a package run where no compiler
# can be found, its output read back, and bad packages refused with a reason.
# usage: package_cli_test.sh PATH_TO_KILN
set -euo pipefail

kiln=$1
work=$(mktemp -d "${TMPDIR:-/tmp}/kiln-pkg.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "package_cli_test: $*" >&2; exit 1; }
mkdir -m 700 "$work/cache"
export KILN_CACHE_DIR=$work/cache

"$kiln" --help | grep -q 'package' || fail "--help does not list package"
"$kiln" export mlp24 --dynamic 0:0:batch:1:64 > "$work/prog.txt"
grep -q 'dim batch in \[1, 64\]' "$work/prog.txt" || fail "export: $(head -5 "$work/prog.txt")"
grep -q 'input  input0 .*\[batch, 256\]' "$work/prog.txt" || fail "export: no dynamic input"

# eager = compiled = package, on the example inputs
"$kiln" package decoder_layer --dynamic 0:0:batch:1:16 --dynamic 0:1:seq:1:512 \
	-o "$work/dec.klp" --save-inputs "$work/x.safetensors" --check > "$work/check.txt"
grep -q 'package vs eager' "$work/check.txt" || fail "package --check: $(cat "$work/check.txt")"
"$kiln" package attention --dynamic 0:2:seq:2:512 --dynamic 1:2:seq:2:512 \
	--dynamic 2:2:seq:2:512 -o "$work/att.klp" --check > /dev/null || fail "attention"
"$kiln" package mlp24 --dynamic 0:0:batch:1:64 -o "$work/mlp.klp" \
	--save-inputs "$work/mlp_in.safetensors" --check > /dev/null ||
	fail "mlp24"

"$kiln" inspect "$work/dec.klp" > "$work/inspect.txt"
for want in 'target cpu-x86_64\|target cpu-aarch64' 'batch in \[1, 16\]' 'seq in \[1, 512\]' \
	'attn.in_proj_weight' 'generated kernels' 'kernels [0-9]* B'; do
	grep -q "$want" "$work/inspect.txt" || fail "inspect lacks '$want'"
done

# run with no compiler anywhere (PATH and CC point nowhere)
PATH=/nonexistent CC=/nonexistent/cc "$kiln" run "$work/dec.klp" --input "$work/x.safetensors" \
	--output "$work/y.safetensors" 2> "$work/run.txt" || fail "run: $(cat "$work/run.txt")"
[ -s "$work/y.safetensors" ] || fail "run wrote no output"

# bad packages and bad runs: a reason, exit status 1, never a crash
head -c 1000 "$work/dec.klp" > "$work/trunc.klp"
if "$kiln" inspect "$work/trunc.klp" 2> "$work/err"; then fail "truncated package loaded"; fi
grep -q 'truncated' "$work/err" || fail "truncated: $(cat "$work/err")"
cp "$work/dec.klp" "$work/flip.klp"
printf '\x55' | dd of="$work/flip.klp" bs=1 seek=3000000 conv=notrunc status=none
if "$kiln" inspect "$work/flip.klp" 2> "$work/err"; then fail "bit-flipped package loaded"; fi
grep -q "checksum" "$work/err" || fail "flipped: $(cat "$work/err")"
if "$kiln" inspect "$work/x.safetensors" 2> "$work/err"; then fail "foreign file loaded"; fi
grep -q 'not a kiln package' "$work/err" || fail "foreign: $(cat "$work/err")"
if "$kiln" run "$work/dec.klp" --input "$work/mlp_in.safetensors" \
	--output "$work/z.safetensors" 2> "$work/err"; then fail "run with the wrong inputs succeeded"; fi
grep -q "kl_package_run: input 'input0' is f32 \[8,256\]; the package takes f32 of rank 3" \
	"$work/err" || fail "wrong input: $(cat "$work/err")"

# a CUDA package built here (NVRTC, no GPU): inspected, refused by a CPU run
# with the reason; skipped where no CUDA package can be built (no NVRTC)
if "$kiln" package decoder_layer --device cuda --dynamic 0:0:batch:1:16 \
	--dynamic 0:1:seq:1:512 -o "$work/dec_cuda.klp" 2> "$work/err"; then
	"$kiln" inspect "$work/dec_cuda.klp" > "$work/inspect_cuda.txt"
	for want in 'target cuda-sm_90' 'module 0  plan   cubin sm_90' 'fixed  cubin sm_90' \
		'PTX [0-9]* B (newer GPUs' 'seq in \[1, 512\]'; do
		grep -q "$want" "$work/inspect_cuda.txt" || fail "inspect (cuda) lacks '$want'"
	done
	if "$kiln" run "$work/dec_cuda.klp" --input "$work/x.safetensors" \
		--output "$work/z.safetensors" 2> "$work/err"; then fail "a CUDA package ran on the CPU"; fi
	grep -q 'a CUDA package (sm_90) needs a CUDA context' "$work/err" ||
		fail "cuda on cpu: $(cat "$work/err")"
else
	grep -q 'NVRTC\|without the CUDA backend' "$work/err" || fail "package --device cuda: $(cat "$work/err")"
	echo "package_cli_test: no CUDA package can be built here, skipped: $(cat "$work/err")"
fi
echo "package_cli_test: ok"
