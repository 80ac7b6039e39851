#!/usr/bin/env bash
# fuzz.sh TARGET SECONDS [libFuzzer flags...] - build kiln's libFuzzer targets
# (build-fuzz/: clang, -fsanitize=fuzzer,address,undefined) and run one of
# them for SECONDS: json, safetensors, cache, fn_call or package (fuzz/fuzz_*.c).
# It starts from fuzz/corpus/TARGET (committed), the seeds the target writes
# itself and what earlier runs kept (build-fuzz/fuzz/work-TARGET/new), and
# ends with the executions, coverage (libFuzzer's cov: edges, ft: features)
# and corpus size. A crash, leak or hang fails it; the input is kept in
# build-fuzz/fuzz/work-TARGET/artifacts/. CC picks the clang (default clang).
set -euo pipefail
cd "$(dirname "$0")/.."
if (($# < 2)); then
	echo "usage: scripts/fuzz.sh TARGET SECONDS [libFuzzer flags...]" >&2
	echo "targets: $(cd fuzz && ls fuzz_*.c | grep -Ev "fuzz_(util|graphs)" | sed 's/^fuzz_//; s/\.c$//' | tr '\n' ' ')" >&2
	exit 2
fi
target=$1 secs=$2
shift 2
if [[ ! -f fuzz/fuzz_$target.c || $target == util || $target == graphs ]]; then
	echo "fuzz.sh: no target '$target' (fuzz/fuzz_$target.c)" >&2
	exit 2
fi
[[ $secs =~ ^[0-9]+$ ]] || { echo "fuzz.sh: SECONDS must be a whole number" >&2; exit 2; }
cc=${CC:-clang}
command -v "$cc" >/dev/null || { echo "fuzz.sh: $cc not found (libFuzzer needs clang; scripts/deps.sh installs it)" >&2; exit 1; }

cmake -S . -B build-fuzz -DCMAKE_C_COMPILER="$cc" -DCMAKE_BUILD_TYPE=Debug \
	-DCMAKE_C_FLAGS_DEBUG="-g -O1" -DKILN_WERROR=ON -DKILN_FUZZ=ON -DKILN_BUILD_TESTS=OFF >/dev/null
cmake --build build-fuzz -j "$(nproc 2>/dev/null || echo 2)" --target "fuzz_$target" >/dev/null

work=build-fuzz/fuzz/work-$target
log=$work/last.log
mkdir -p "$work"
set +e
bash fuzz/run.sh "build-fuzz/fuzz/fuzz_$target" "fuzz/corpus/$target" "$work" "$secs" "$@" \
	2>&1 | tee "$log" | grep --line-buffered -E '^#[0-9]+.*(INITED|pulse|DONE)|ERROR|SUMMARY|fuzz target:|fuzz_'
rc=${PIPESTATUS[0]}
set -e
# the last status line: "#N DONE cov: C ft: F corp: U/S ..."
last=$(grep -E '^#[0-9]+.*cov: ' "$log" | tail -n 1 || true)
execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
[[ -n $execs ]] || execs=$(sed -n 's/^#\([0-9]*\).*/\1/p' <<<"$last") # -fork=N prints no stats
rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
corp=$(sed -n 's/.* corp: \([^ ]*\).*/\1/p' <<<"$last")
echo "fuzz.sh: $target ${secs}s: ${execs:-?} executions (${rate:-?}/s), cov ${cov:-?}, ft ${ft:-?}, corpus ${corp:-?} (units/bytes), $(ls "$work/artifacts" | wc -l) artifacts, exit $rc"
exit "$rc"
