#!/usr/bin/env bash
# The README's test command: sets up if needed, builds, and runs every test with CTest.
# Extra arguments go to ctest (e.g. -R Scheduler, -L oracle).
# With ROUNDPIPE_SANITIZERS=1 and no extra arguments, the main suite is followed by
# the sanitizer and fuzzing phases (docs/sanitizers.md), each printing its summary line:
#   scripts/tsan.sh (ThreadSanitizer, the concurrency tests), scripts/asan.sh (ASan + UBSan, the CPU
#   suite), scripts/fuzz.sh $ROUNDPIPE_FUZZ_SECONDS (libFuzzer, 60 s per target by default).
# Every phase runs even when an earlier one failed; the exit status is non-zero if any failed.
# ROUNDPIPE_TIME_BUDGET_S (seconds from this script's start; .ci/run sets it below CI's limit): a
# sanitizer phase that would, at its usual cost on a 2-core machine with a cold build, end past the
# budget is skipped with a line saying so, rather than the whole run being killed at the limit.
# The main suite always runs.
set -euo pipefail
started=$(date +%s)

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${ROUNDPIPE_BUILD_DIR:-$root/build}"

"$root/scripts/build.sh"
cd "$build"
if [ $# -gt 0 ] || [ "${ROUNDPIPE_SANITIZERS:-0}" != 1 ]; then
  exec ctest --output-on-failure -j "${ROUNDPIPE_JOBS:-$(nproc)}" "$@"
fi

status=0
results=()
phase() {  # phase <name> <usual seconds> <command...>: runs it, records its exit status and time
  local name=$1 usual=$2 start rc spent
  shift 2
  spent=$(( $(date +%s) - started ))
  if [ "${ROUNDPIPE_TIME_BUDGET_S:-0}" -gt 0 ] && [ $(( spent + usual )) -gt "$ROUNDPIPE_TIME_BUDGET_S" ]; then
    results+=("phase $name: SKIPPED: $spent s spent, it usually takes ~$usual s, the budget is ${ROUNDPIPE_TIME_BUDGET_S} s (ROUNDPIPE_TIME_BUDGET_S); run it alone: $*")
    echo "=== ${results[-1]}"
    return
  fi
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
# Usual costs: docs/sanitizers.md, "Budget" (fresh clone, cold build, 2 cores).
phase tests 0 ctest --output-on-failure -j "${ROUNDPIPE_JOBS:-$(nproc)}"
phase tsan 1500 "$root/scripts/tsan.sh"
phase asan 2400 "$root/scripts/asan.sh"
phase fuzz 400 "$root/scripts/fuzz.sh" "${ROUNDPIPE_FUZZ_SECONDS:-60}"
echo "=== summary"
printf '%s\n' "${results[@]}"
exit "$status"
