#!/usr/bin/env bash
# run.sh BIN CORPUS WORK SECONDS [libFuzzer flags...] - one fuzz target for
# SECONDS over its committed corpus (CORPUS, read only), the seeds it writes
# itself as it starts (WORK/seeds, remade each run: they follow the build's
# formats) and
# what earlier runs found (WORK/new, where new inputs go). A crash, leak or
# hang is kept in WORK/artifacts/ and fails the run. ctest and scripts/fuzz.sh
# both run targets through here.
set -euo pipefail
if (($# < 4)); then
	echo "usage: run.sh BIN CORPUS WORK SECONDS [libFuzzer flags...]" >&2
	exit 2
fi
bin=$1 corpus=$2 work=$3 secs=$4
shift 4
rm -rf "$work/seeds"
mkdir -p "$work/new" "$work/artifacts" "$work/seeds"
dirs=("$work/new" "$work/seeds")
[[ -d $corpus ]] && dirs+=("$corpus")
# allocator_may_return_null: an impossible allocation fails as it would
# without ASan (kiln must answer KL_ENOMEM); one that succeeds beyond
# -malloc_limit_mb (= -rss_limit_mb) is still reported by libFuzzer.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:strict_string_checks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export KILN_FUZZ_SEEDS=$work/seeds
# the targets' scratch files (fuzz_util.h), removed here even after a crash
base=/dev/shm
[[ -d $base && -w $base ]] || base=${TMPDIR:-/tmp}
KILN_FUZZ_SCRATCH=$(mktemp -d "$base/kiln-fuzz-run.XXXXXX")
export KILN_FUZZ_SCRATCH
trap 'rm -rf "$KILN_FUZZ_SCRATCH"' EXIT
"$bin" -max_total_time="$secs" -timeout=30 -rss_limit_mb=2560 -print_final_stats=1 \
	-artifact_prefix="$work/artifacts/" "$@" "${dirs[@]}"
