#!/usr/bin/env bash
# The README's test command: sets up if needed, builds, and runs every test with CTest.
# Extra arguments go to ctest (e.g. -R Scheduler, -L oracle).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${ROUNDPIPE_BUILD_DIR:-$root/build}"

"$root/scripts/build.sh"
cd "$build"
ctest --output-on-failure -j "${ROUNDPIPE_JOBS:-$(nproc)}" "$@"
