#!/usr/bin/env bash
# Builds RoundPipe C++ on a machine without network: unpacks the .deb files made by
# scripts/pack-offline-deps.sh into a private prefix (never into /), and builds against that
# machine's PyTorch (python3 -c 'import torch; print(torch.utils.cmake_prefix_path)').
# Usage: scripts/build-offline.sh [debs_dir=.debs] [python=python3]; env ROUNDPIPE_BUILD_DIR
# (default build-offline), ROUNDPIPE_JOBS, ROUNDPIPE_BUILD_TARGETS (space-separated: only those targets). Then: ctest --test-dir $ROUNDPIPE_BUILD_DIR.
# Executables get an RPATH (not RUNPATH) to the prefix, so the libraries' own dependencies (e.g.
# spdlog's libfmt) are found there too, without LD_LIBRARY_PATH.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
debs="${1:-$root/.debs}"
python="${2:-${ROUNDPIPE_PYTHON:-python3}}"
build="${ROUNDPIPE_BUILD_DIR:-$root/build-offline}"
prefix="$build/deps"
mkdir -p "$prefix"
for f in "$debs"/*.deb; do dpkg -x "$f" "$prefix"; done
libdir="$prefix/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# pkg-config (PCRE2, utf8proc): the .pc files of the prefix, their /usr paths moved under it.
export PKG_CONFIG_PATH="$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export PKG_CONFIG_SYSROOT_DIR="$prefix"
torch_prefix="$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$root" -B "$build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_PREFIX_PATH="$prefix/usr;$libdir/cmake;$torch_prefix" \
  -DCMAKE_CXX_FLAGS="-isystem $prefix/usr/include" \
  -DCMAKE_BUILD_RPATH="$libdir" \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,--disable-new-dtags" \
  -DROUNDPIPE_PYTHON="$(command -v "$python")" \
  -DGTest_DIR="$libdir/cmake/GTest" "${@:3}"
targets=()
for t in ${ROUNDPIPE_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j "${ROUNDPIPE_JOBS:-$(nproc)}" "${targets[@]}"
echo "built in $build; run: LD_LIBRARY_PATH=$libdir ctest --test-dir $build --output-on-failure"
