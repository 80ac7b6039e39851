#!/usr/bin/env bash
# cpu_vs_ort.sh - kiln against ONNX Runtime on the CPU, interleaved: for
# each of ROUNDS rounds and each workload, `kiln bench --device cpu --json
# --workload W` and then `bench/peer_ort.py --workload W`, so that the two
# sides of a row are timed seconds apart. On a shared machine, whose speed
# drifts by 20-50% from minute to minute (seen on the 2-core boxes), two
# whole runs one after the other compare the drift as much as the code.
# bench/compare.py then takes, for each side, the lowest median over the
# rounds and modes.
#
#   bench/cpu_vs_ort.sh [ROUNDS] [WORKLOAD,...]    (defaults: 3, every row ORT has)
#
# Needs a built build/kiln and `pip install onnxruntime onnx numpy`. The raw
# JSON lines go to $OUT (default build/cpu-vs-ort/): kiln.jsonl, ort.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
out=${OUT:-build/cpu-vs-ort}
mkdir -p "$out"
[[ -x build/kiln ]] || { echo "cpu_vs_ort.sh: build/kiln is missing (cmake --build build)" >&2; exit 2; }
python3 -c 'import onnxruntime, onnx' 2>/dev/null ||
	{ echo "cpu_vs_ort.sh: needs onnxruntime and onnx (pip install onnxruntime onnx numpy)" >&2; exit 2; }
if [[ -n ${2:-} ]]; then
	IFS=, read -r -a wl <<<"$2"
else
	mapfile -t wl < <(python3 bench/peer_ort.py --list | awk '{print $1}' | sort -u)
fi
: >"$out/kiln.jsonl"
: >"$out/ort.jsonl"
for ((r = 1; r <= rounds; r++)); do
	for w in "${wl[@]}"; do
		build/kiln bench --device cpu --json --workload "$w" >>"$out/kiln.jsonl"
		python3 bench/peer_ort.py --workload "$w" >>"$out/ort.jsonl"
	done
	echo "cpu_vs_ort.sh: round $r of $rounds done" >&2
done
python3 bench/compare.py --device cpu "$out/kiln.jsonl" "$out/ort.jsonl"
