#!/usr/bin/env bash
# The README's main command: sets up if needed, builds, and trains the example model with
# RoundPipe (plan printed). Arguments go to the example: [iterations] [num_devices].
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${ROUNDPIPE_BUILD_DIR:-$root/build}"
"$root/scripts/build.sh"
exec "$build/examples/train_mlp" "$@"
