#!/usr/bin/env bash
# deps.sh - installs what building and testing kiln needs on Debian 12 (or
# another apt system). Idempotent: packages already present are left alone and
# apt-get update runs only when something is missing. Root, or sudo.
set -euo pipefail

# gcc brings the ASan/UBSan runtimes; libc6-dev the headers the
# CPU JIT's generated C needs; binutils nm/readelf the install test's checks;
# python3 the bench comparison (bench/compare.py) and its test; clang the
# libFuzzer targets (fuzz/), with its compiler-rt (libFuzzer, sanitizers),
# named after its version below (no OpenMP runtime: kiln has its own pool).
# libopenmpi-dev and openmpi-bin (mpirun): libkiln_dist's CPU backend and its
# tests (dist_*).
pkgs=(cmake gcc libc6-dev make pkg-config libopenblas-dev libcmocka-dev binutils python3 clang
	libopenmpi-dev openmpi-bin)

installed() {
	[[ $(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null) == installed ]]
}

if ! command -v dpkg-query >/dev/null || ! command -v apt-get >/dev/null; then
	# Not a Debian-like system: say what is missing rather than guess a
	# package manager.
	missing=()
	for tool in cmake cc make pkg-config python3; do
		command -v "$tool" >/dev/null || missing+=("$tool")
	done
	for pc in openblas cmocka; do
		pkg-config --exists "$pc" 2>/dev/null || missing+=("$pc (pkg-config)")
	done
	if ((${#missing[@]})); then
		echo "deps.sh: no apt-get here; install these yourself: ${missing[*]}" >&2
		exit 1
	fi
	exit 0
fi

# clang's runtimes are packaged per version (Debian 12: libclang-rt-14-dev):
# the version of the clang that is, or will be, installed.
clang_pkgs() {
	local v
	v=$(apt-cache depends clang 2>/dev/null | sed -n 's/.*Depends: clang-\([0-9][0-9]*\)$/\1/p' | head -n 1)
	[[ -n $v ]] || return 0
	for p in "libclang-rt-$v-dev"; do
		apt-cache show "$p" >/dev/null 2>&1 && echo "$p"
	done
	return 0
}

missing_of() {
	local p
	for p in "$@"; do
		installed "$p" || echo "$p"
	done
}

mapfile -t missing < <(missing_of "${pkgs[@]}" $(clang_pkgs))
((${#missing[@]})) || exit 0

if [[ $(id -u) -eq 0 ]]; then
	as_root=()
elif command -v sudo >/dev/null; then
	as_root=(sudo)
else
	echo "deps.sh: need root or sudo to install: ${missing[*]}" >&2
	exit 1
fi

echo "deps.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -q
"${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
# On a fresh system clang's version is known only now that the package
# lists are: its runtimes may still be missing.
mapfile -t missing < <(missing_of $(clang_pkgs))
if ((${#missing[@]})); then
	echo "deps.sh: installing ${missing[*]}"
	"${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
