#!/usr/bin/env bash
# check_layers_planted.sh - proves tests/check_layers.py catches a violation:
# copies src/ to a temporary directory, plants includes that point up (backend
# -> runtime, core -> graph) and across (backend/cpu -> backend/cuda), and
# expects the check to fail naming each planted file and line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$here/../src" "$tmp/src"

# The copy as it is passes (with the known list, if given).
"$py" "$here/check_layers.py" "$tmp/src" "$@" > "$tmp/clean.txt" || {
	cat "$tmp/clean.txt"; echo "FAIL: the unmodified copy of src/ does not pass"; exit 1; }

# Plant: each line appended at the end of the file, so its line number is known.
plant() { # file include
	printf '#include "%s"\n' "$2" >> "$tmp/src/$1"
	echo "$1:$(wc -l < "$tmp/src/$1"): #include \"$2\""
}
expect=()
expect+=("$(plant backend/cpu/blas.c runtime/compiled.h)")
expect+=("$(plant core/tensor.c graph/graph.h)")
expect+=("$(plant backend/cpu/cpu.c backend/cuda/device.h)")
expect+=("$(plant graph/graph.c plan/plan.h)")

if "$py" "$here/check_layers.py" "$tmp/src" "$@" > "$tmp/out.txt"; then
	cat "$tmp/out.txt"; echo "FAIL: check_layers passed with planted violations"; exit 1
fi
cat "$tmp/out.txt"
for e in "${expect[@]}"; do
	grep -qF -- "$e" "$tmp/out.txt" || { echo "FAIL: not reported: $e"; exit 1; }
done
n=$(grep -v '^known, not yet fixed' "$tmp/out.txt" | grep -c ': #include' || true)
[[ "$n" -eq ${#expect[@]} ]] || { echo "FAIL: $n reported, ${#expect[@]} planted"; exit 1; }
echo "check_layers_planted: all ${#expect[@]} planted violations reported, nothing else"
