#!/usr/bin/env bash
# test.sh - the test suite as CI runs it: dependencies, then a plain build
# (build/) and an ASan+UBSan build (build-asan/), each with every ctest.
# Warnings are errors in both. Any failure fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/deps.sh

jobs=$(nproc 2>/dev/null || echo 2)
export CTEST_OUTPUT_ON_FAILURE=1

# Plain: the release build that scripts/bench.sh also uses, so a test run
# leaves a ready benchmark build behind.
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKILN_WERROR=ON -DKILN_SANITIZE=OFF
cmake --build build -j "$jobs"
(cd build && ctest --output-on-failure -j "$jobs")

# Sanitized: Debug keeps assertions on; -O1 keeps the numeric tests quick.
# Leak checking is on. If OpenMP's or OpenBLAS's thread pools ever show up as
# leaks at exit, tests/lsan.supp is where those libraries' own allocation
# sites get named (and only those).
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-g -O1" \
	-DKILN_WERROR=ON -DKILN_SANITIZE=ON
cmake --build build-asan -j "$jobs"
(
	cd build-asan
	export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:strict_string_checks=1
	if [[ -f ../tests/lsan.supp ]]; then
		export LSAN_OPTIONS="suppressions=$PWD/../tests/lsan.supp:print_suppressions=0"
	fi
	export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
	ctest --output-on-failure -j "$jobs"
)
echo "test.sh: all tests passed (build/ and build-asan/)"
