#!/usr/bin/env bash
# deps.sh - installs what building and testing kiln needs on Debian 12 (or
# another apt system). Idempotent: packages already present are left alone and
# apt-get update runs only when something is missing. Root, or sudo.
set -euo pipefail

# gcc brings libgomp and the ASan/UBSan runtimes; libc6-dev the headers the
# CPU JIT's generated C needs; binutils nm/readelf the install test's checks;
# python3 the bench comparison (bench/compare.py) and its test.
pkgs=(cmake gcc libc6-dev make pkg-config libopenblas-dev libcmocka-dev binutils python3)

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

missing=()
for p in "${pkgs[@]}"; do
	installed "$p" || missing+=("$p")
done
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
