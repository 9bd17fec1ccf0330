#!/usr/bin/env bash
# Sets up (if needed), configures (if needed) and builds RoundPipe C++ into build/ (or $ROUNDPIPE_BUILD_DIR).
# Extra arguments are passed to the first CMake configure, e.g. -DROUNDPIPE_SANITIZE=thread.
# ROUNDPIPE_BUILD_TARGETS (space-separated) builds only those targets.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${ROUNDPIPE_BUILD_DIR:-$root/build}"
venv="${ROUNDPIPE_VENV:-$root/.venv}"
jobs="${ROUNDPIPE_JOBS:-$(nproc)}"

"$root/scripts/setup.sh"

# ccache: share hits between clones of the repo, and accept the precompiled header.
export CCACHE_BASEDIR="$root"
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
export CCACHE_NOHASHDIR=1
# Three object sets live in the cache (build/, build-tsan/, build-asan/ with the sanitizer phases,
# ~2 GB each with debug info); the default 5 GB cap would evict one with every CI run.
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-15G}"

if [ ! -f "$build/build.ninja" ]; then
  torch_prefix="$("$venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  cmake -S "$root" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE="${ROUNDPIPE_BUILD_TYPE:-RelWithDebInfo}" \
    -DCMAKE_PREFIX_PATH="$torch_prefix" \
    -DROUNDPIPE_PYTHON="$venv/bin/python" \
    "$@"
fi
# shellcheck disable=SC2086  # word splitting of the target list is intended
cmake --build "$build" -j "$jobs" ${ROUNDPIPE_BUILD_TARGETS:+--target $ROUNDPIPE_BUILD_TARGETS}
