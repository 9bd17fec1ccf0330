#!/usr/bin/env bash
# Packs the CUDA-capable binaries built here (build/, against the venv's torch 2.11.0+cu130, the
# same build the GPU image holds) into a small folder (default .gpu-prebuilt/, ~10 MiB stripped)
# that the device tool can carry, so that a GPU machine's short lease is spent on running, not on
# compiling. Layout: the build tree's relative paths (tests/roundpipe/runtime_tests, bench/...)
# plus deps/usr/lib/x86_64-linux-gnu/ holding the Debian shared libraries they need (spdlog, fmt,
# yaml-cpp, PCRE2, utf8proc). On the machine: ROUNDPIPE_BUILD_DIR=.gpu-prebuilt
# scripts/gpu-validate.sh python3 test sanitize bench (the script finds torch's libraries).
# Usage: scripts/pack-gpu-prebuilt.sh [build=build] [out=.gpu-prebuilt]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
out="${2:-$root/.gpu-prebuilt}"
binaries=(tests/roundpipe/runtime_tests tests/amp/amp_tests tests/reliability/reliability_tests
  tests/errors/errors_tests tests/comm/comm_tests tests/models/models_tests
  bench/llama_bench bench/moe_bench bench/longseq_bench bench/allreduce_bench)
rm -rf "$out"
libdir="$out/deps/usr/lib/x86_64-linux-gnu"
mkdir -p "$libdir"
for b in "${binaries[@]}"; do
  [ -x "$build/$b" ] || { echo "pack-gpu-prebuilt: $build/$b is missing: build it first (scripts/build.sh)" >&2; exit 1; }
  mkdir -p "$out/$(dirname "$b")"
  strip -o "$out/$b" "$build/$b"
  # The Debian libraries (not glibc's, not the compiler runtime's, not torch's or CUDA's).
  ldd "$build/$b" | awk '$3 ~ /^\/(usr\/)?lib\/x86_64-linux-gnu\// {print $3}' |
    { grep -vE '/lib(c|m|dl|rt|pthread|util|gcc_s|stdc\+\+)\.so' || true; } | while read -r lib; do
    cp -L -n "$lib" "$libdir/"
  done
done
touch "$out/PREBUILT"
du -sh "$out"
