# gpu-deps.sh - sourced by gpu-check.sh. The lent GPU machine has the CUDA
# toolkit, cmake and a compiler but cannot install packages: when OpenBLAS or
# cmocka (or pkg-config itself) is missing there, unpack the Debian packages
# carried in .gpu-deps/ (fetched here with `apt-get download`, see below) into
# the build folder and point pkg-config, the compiler and the loader at them.
#
# To refresh the carried packages on a developer machine:
#   mkdir -p .gpu-deps && cd .gpu-deps && apt-get download libopenblas0-pthread \
#     libopenblas-dev libopenblas-pthread-dev libopenblas0 libcmocka0 libcmocka-dev \
#     libgfortran5 libblas3 liblapack3 pkg-config libpkgconf3 pkgconf pkgconf-bin
gpu_deps_setup() {
	local root=$1 build=$2
	if command -v pkg-config >/dev/null 2>&1 && pkg-config --exists openblas cmocka 2>/dev/null; then
		return 0
	fi
	if ! ls "$root"/.gpu-deps/*.deb >/dev/null 2>&1; then
		echo "gpu-deps: OpenBLAS/cmocka missing and no carried packages in .gpu-deps/" >&2
		return 1
	fi
	local d=$build/deps
	mkdir -p "$d"
	local f
	for f in "$root"/.gpu-deps/*.deb; do
		dpkg-deb -x "$f" "$d" 2>/dev/null || (cd "$d" && ar p "$f" data.tar.xz | tar xJ) || return 1
	done
	local ml=$d/usr/lib/x86_64-linux-gnu
	export LD_LIBRARY_PATH=$ml/openblas-pthread:$ml${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
	# point the carried .pc files at where they were unpacked (a sysroot
	# setting would also rewrite the paths of kiln's own installed kiln.pc)
	sed -i "s|/usr/|$d/usr/|g" "$ml/openblas-pthread/pkgconfig/openblas.pc" "$ml/pkgconfig/cmocka.pc"
	export PKG_CONFIG_PATH=$ml/openblas-pthread/pkgconfig:$ml/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
	if ! command -v pkg-config >/dev/null 2>&1; then
		export PATH=$d/usr/bin:$PATH
	fi
	echo "gpu-deps: using carried OpenBLAS/cmocka from $d"
	pkg-config --cflags --libs openblas cmocka
}
