#!/usr/bin/env bash
# install_test.sh - installs the build into a temporary prefix, then builds
# examples/eager.c against the installed copy only, three ways (CMake package,
# shared and static; pkg-config), runs each and checks what it prints.
# usage: install_test.sh BUILD_DIR SOURCE_DIR CC CMAKE LIBDIR [SANITIZE_FLAGS]
set -euo pipefail

build=$1 src=$2 cc=$3 cmake=$4 libdir=$5 san=${6:-}
work=$(mktemp -d "${TMPDIR:-/tmp}/kiln-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix

fail() { echo "install_test: $*" >&2; exit 1; }

"$cmake" --install "$build" --prefix "$prefix" >"$work/install.log" ||
	{ cat "$work/install.log"; fail "cmake --install failed"; }

for f in include/kiln.h bin/kiln "$libdir/libkiln.a" "$libdir/libkiln.so" \
	"$libdir/pkgconfig/kiln.pc" "$libdir/cmake/kiln/kilnConfig.cmake" \
	"$libdir/cmake/kiln/kilnConfigVersion.cmake"; do
	[[ -e $prefix/$f ]] || fail "not installed: $f"
done

# The shared library exports the public kl_ names and nothing else.
if command -v nm >/dev/null; then
	syms=$(nm -D --defined-only "$prefix/$libdir/libkiln.so" |
		awk '$2 ~ /^[TDBRVW]$/ {print $3}')
	grep -qx kl_ctx_new <<<"$syms" || fail "libkiln.so does not export kl_ctx_new"
	bad=$(grep -v '^kl_[^_]' <<<"$syms" || true)
	[[ -z $bad ]] || fail "libkiln.so exports non-public symbols: $(tr '\n' ' ' <<<"$bad")"
fi

"$prefix/bin/kiln" --version | grep -q '^kiln [0-9]' || fail "installed kiln --version"

# Nothing may reach back into the build or source tree: build from a copy.
mkdir "$work/examples"
cp "$src/examples/CMakeLists.txt" "$src/examples/eager.c" "$src/examples/decoder_stack.c" "$src/examples/generate.c" \
	"$src/examples/export_decoder.c" "$src/examples/package_server.c" \
	"$work/examples/"

check_output() { # name file
	grep -qx 'relu(a\*b + c) =' "$2" || fail "$1: no result printed"
	(($(grep -Ec '^( +-?[0-9]+\.[0-9]{6}){4}$' "$2") == 4)) ||
		{ cat "$2"; fail "$1: not 4x4 values"; }
	grep -qx 'eager: ok' "$2" || { cat "$2"; fail "$1: wrong result"; }
}

# 1. find_package(kiln): kiln::kiln and kiln::kiln_static.
"$cmake" -S "$work/examples" -B "$work/build-ex" -DCMAKE_PREFIX_PATH="$prefix" \
	-DCMAKE_C_COMPILER="$cc" -DCMAKE_C_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="$san" \
	-DCMAKE_BUILD_TYPE=Release >"$work/cfg.log" 2>&1 ||
	{ cat "$work/cfg.log"; fail "configuring examples/ against the install failed"; }
"$cmake" --build "$work/build-ex" >"$work/build.log" 2>&1 ||
	{ cat "$work/build.log"; fail "building examples/ against the install failed"; }
grep -q "$prefix" "$work/build-ex/CMakeCache.txt" || fail "examples/ did not use the install"
"$work/build-ex/eager" >"$work/out-cmake" ||
	{ cat "$work/out-cmake"; fail "eager (kiln::kiln) failed"; }
check_output "eager (kiln::kiln)" "$work/out-cmake"
"$work/build-ex/eager_static" >"$work/out-static" ||
	{ cat "$work/out-static"; fail "eager_static (kiln::kiln_static) failed"; }
check_output "eager_static (kiln::kiln_static)" "$work/out-static"

# 2. pkg-config, shared: cc eager.c $(pkg-config --cflags --libs kiln).
export PKG_CONFIG_PATH="$prefix/$libdir/pkgconfig"
pkg-config --exact-version=0.1.0 kiln || fail "pkg-config does not find kiln 0.1.0"
# shellcheck disable=SC2046,SC2086
"$cc" $san -o "$work/eager-pc" "$work/examples/eager.c" $(pkg-config --cflags --libs kiln) ||
	fail "cc with pkg-config --cflags --libs kiln failed"
LD_LIBRARY_PATH="$prefix/$libdir" "$work/eager-pc" >"$work/out-pc" ||
	{ cat "$work/out-pc"; fail "eager (pkg-config) failed"; }
check_output "eager (pkg-config)" "$work/out-pc"

# 3. pkg-config, static archive: Libs.private must be enough to link libkiln.a.
# shellcheck disable=SC2046,SC2086
"$cc" $san -o "$work/eager-pc-static" "$work/examples/eager.c" $(pkg-config --cflags kiln) \
	"$prefix/$libdir/libkiln.a" $(pkg-config --static --libs-only-other --libs-only-L kiln) \
	$(pkg-config --static --libs-only-l kiln | sed 's/\(^\| \)-lkiln\( \|$\)/ /') ||
	fail "static link with pkg-config --static --libs kiln failed"
"$work/eager-pc-static" >"$work/out-pc-static" ||
	{ cat "$work/out-pc-static"; fail "eager (pkg-config, static) failed"; }
check_output "eager (pkg-config, static)" "$work/out-pc-static"

# The static builds must not need libkiln.so at run time.
if command -v readelf >/dev/null; then
	for b in build-ex/eager_static eager-pc-static; do
		if readelf -d "$work/$b" | grep -q 'NEEDED.*libkiln'; then
			fail "$b links libkiln.so"
		fi
	done
	readelf -d "$work/build-ex/eager" | grep -q 'NEEDED.*libkiln\.so' ||
		fail "build-ex/eager does not link libkiln.so"
fi

# Same seeds, same library: every build prints the same numbers.
for o in out-static out-pc out-pc-static; do
	cmp -s "$work/out-cmake" "$work/$o" || fail "$o differs from out-cmake"
done
echo "install_test: ok"
cat "$work/out-cmake"
