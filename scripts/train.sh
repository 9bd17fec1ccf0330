#!/usr/bin/env bash
# The README's main command: sets up and builds if needed, then trains the default model
#   roundpipe train configs/default.yaml [key=value ...] [--resume [DIR]]
# (a small Llama from scratch on English text, on CPU workers; docs/getting-started.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${ROUNDPIPE_BUILD_DIR:-$root/build}"
"$root/scripts/build.sh"
cd "$root"
exec "$build/roundpipe/launcher/roundpipe" train configs/default.yaml "$@"
