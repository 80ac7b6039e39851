#!/usr/bin/env bash
# test.sh - the test suite as CI runs it: dependencies, then a plain build
# (build/) and an ASan+UBSan build (build-asan/), each with every ctest, then
# the libFuzzer targets (build-fuzz/, clang), each fuzzed briefly over its
# corpus. Warnings are errors in all three. Any failure fails the script.
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
# Leak checking is on. If OpenBLAS's thread pool ever shows up as
# leaks at exit, tests/lsan.supp is where that library's own allocation
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

# Fuzz: every target of fuzz/ for KILN_FUZZ_TEST_SECONDS (5) over its corpus
# (scripts/fuzz.sh runs one for longer). It needs clang with libFuzzer: CI
# must have it (deps.sh installs it), so there its absence fails the run;
# elsewhere this stage is skipped with a message.
fuzz_probe=$(mktemp -d)
if command -v clang >/dev/null &&
	echo 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { return 0; }' |
	clang -fsanitize=fuzzer,address,undefined -x c - -o "$fuzz_probe/probe" 2>/dev/null; then
	rm -rf "$fuzz_probe"
	cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug \
		-DCMAKE_C_FLAGS_DEBUG="-g -O1" -DKILN_WERROR=ON -DKILN_FUZZ=ON -DKILN_BUILD_TESTS=OFF
	cmake --build build-fuzz -j "$jobs" --target kiln_fuzz
	(cd build-fuzz && ctest --output-on-failure -j "$jobs")
	echo "test.sh: all tests passed (build/, build-asan/ and build-fuzz/)"
else
	rm -rf "$fuzz_probe"
	if [[ ${CI:-} == true ]]; then
		echo "test.sh: clang with libFuzzer (-fsanitize=fuzzer) is missing: the fuzz" \
			"targets cannot run, and CI must run them (scripts/deps.sh installs clang)" >&2
		exit 1
	fi
	echo "test.sh: clang with libFuzzer not found: SKIPPED the fuzz targets (build-fuzz/)"
	echo "test.sh: all tests passed (build/ and build-asan/; fuzz targets skipped)"
fi
