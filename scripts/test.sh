#!/usr/bin/env bash
# The README's test command: sets up if needed, builds, and runs every test with CTest.
# Extra arguments go to ctest (e.g. -R Scheduler, -L oracle).
# With ROUNDPIPE_SANITIZERS=1 and no extra arguments, the main suite is followed by
# the sanitizer and fuzzing phases (docs/sanitizers.md), each printing its summary line:
#   scripts/tsan.sh (ThreadSanitizer, the concurrency tests), scripts/asan.sh (ASan + UBSan, the CPU
#   suite), scripts/fuzz.sh $ROUNDPIPE_FUZZ_SECONDS (libFuzzer, 60 s per target by default).
# Every phase runs even when an earlier one failed; the exit status is non-zero if any failed.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${ROUNDPIPE_BUILD_DIR:-$root/build}"

"$root/scripts/build.sh"
cd "$build"
if [ $# -gt 0 ] || [ "${ROUNDPIPE_SANITIZERS:-0}" != 1 ]; then
  exec ctest --output-on-failure -j "${ROUNDPIPE_JOBS:-$(nproc)}" "$@"
fi

status=0
results=()
phase() {  # phase <name> <command...>: runs it, records its exit status and time
  local name=$1 start rc
  shift
  echo "=== phase $name: $*"
  start=$(date +%s)
  set +e
  (unset ROUNDPIPE_BUILD_DIR ROUNDPIPE_BUILD_TARGETS; "$@")
  rc=$?
  set -e
  [ "$rc" -eq 0 ] || status=1
  results+=("phase $name: exit $rc, $(( $(date +%s) - start )) s")
  echo "=== ${results[-1]}"
}
phase tests ctest --output-on-failure -j "${ROUNDPIPE_JOBS:-$(nproc)}"
phase tsan "$root/scripts/tsan.sh"
phase asan "$root/scripts/asan.sh"
phase fuzz "$root/scripts/fuzz.sh" "${ROUNDPIPE_FUZZ_SECONDS:-60}"
echo "=== summary"
printf '%s\n' "${results[@]}"
exit "$status"
