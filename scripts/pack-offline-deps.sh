#!/usr/bin/env bash
# Packs the project's Debian build dependencies as .deb files into a folder (default .debs/), for a
# machine without network that has CUDA PyTorch (e.g. a GPU cluster node): copy the repo with this
# folder there and run scripts/build-offline.sh. Needs apt-get (no root needed for download).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/.debs}"
mkdir -p "$out"
# Headers-only or static -dev packages plus the shared libraries they link against.
packages=(
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
  libboost1.74-dev libboost-dev
  libgtest-dev libgmock-dev googletest
  libbenchmark-dev libbenchmark1debian
  libyaml-cpp-dev libyaml-cpp0.7
  libcli11-dev nlohmann-json3-dev
  libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2   # models::Tokenizer (pkg-config finds them)
  libgloo-dev   # headers only (c10d ProcessGroupGloo.hpp); torch carries the library
)
cd "$out"
apt-get download "${packages[@]}"
# NVIDIA's compute-sanitizer for CUDA 13.0 (PyPI wheel, ~14 MiB), for GPU images without it;
# scripts/gpu-validate.sh unpacks it when `compute-sanitizer` is not installed there.
pip=("$root/.venv/bin/python" -m pip)
[ -x "$root/.venv/bin/python" ] || pip=(python3 -m pip)
"${pip[@]}" download -q --no-deps --only-binary=:all: -d "$out" "nvidia-cuda-sanitizer-api==13.0.85" ||
  echo "pack-offline-deps: could not download nvidia-cuda-sanitizer-api (optional; the sanitize phase needs it where CUDA has no compute-sanitizer)" >&2
du -sh "$out"
ls -1 "$out"
