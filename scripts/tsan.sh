#!/usr/bin/env bash
# Builds the tests with ThreadSanitizer into build-tsan/ and runs the concurrency tests (runtime,
# the GradScaler's cross-thread protocol, the optimizer's helper threads, the Gloo process
# group). A filter argument replaces the runtime filter.
# LibTorch itself is not instrumented: its OpenMP pool is limited to one thread here so that
# reports concern RoundPipe's own threads (see scripts/tsan.supp for the library frames ignored).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export ROUNDPIPE_BUILD_DIR="$root/build-tsan"
export ROUNDPIPE_BUILD_TARGETS="amp_tests optim_tests comm_tests runtime_tests reliability_tests"  # only what runs below
"$root/scripts/build.sh" -DROUNDPIPE_SANITIZE=thread -DROUNDPIPE_BUILD_BENCHMARKS=OFF -DROUNDPIPE_BUILD_EXAMPLES=OFF
export OMP_NUM_THREADS=1
export TSAN_OPTIONS="halt_on_error=0 second_deadlock_stack=1 suppressions=$root/scripts/tsan.supp ${TSAN_OPTIONS:-}"
log="$ROUNDPIPE_BUILD_DIR/tsan.log"
: > "$log"
rc=0
runs=0
run() {  # one test binary; its output goes to the terminal and to the log
  runs=$((runs + 1))
  set +e
  "$@" 2>&1 | tee -a "$log"
  local status=${PIPESTATUS[0]}
  set -e
  [ "$status" -eq 0 ] || rc=$status
}
run "$ROUNDPIPE_BUILD_DIR/tests/amp/amp_tests" --gtest_filter="GradScalerCrossThreadTest.*:-*_CUDA"
run "$ROUNDPIPE_BUILD_DIR/tests/optim/optim_tests" --gtest_filter="ParallelTasksTest.*:AdamKernelTest.ResultsIndependentOfThreadCount"
run "$ROUNDPIPE_BUILD_DIR/tests/roundpipe/runtime_tests" --gtest_filter="${1:-AsyncStepTest.*:RoundPipeTest.Dropout*:RoundPipeTest.Errors*:RoundPipeTest.Equivalence_Mlp*:RoundPipeTest.LayerShells*:RoundPipeTest.Tied*:RoundPipeTest.MeasuredLayerTimes*:PlanSelectorTest.*:OverlapTest.*:GradScalerEngineTest.*:StageTraceTest.*:DataParallelTest.*:DeviceWorkerTest.*:HostBlocksTest.*:DeferredHandoverTest.*:SideInputsTest.*}"
run "$ROUNDPIPE_BUILD_DIR/tests/comm/comm_tests" --gtest_filter="ProcessGroupTest.*:-*_CUDA"
ROUNDPIPE_SOAK_ITERATIONS=100 run "$ROUNDPIPE_BUILD_DIR/tests/reliability/reliability_tests" --gtest_filter="-*_CUDA"
passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\{0,1\}[,.].*/\1/p' "$log" | awk '{n += $1} END {print n + 0}')
failed=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) tests\{0,1\}, listed below.*/\1/p' "$log" | awk '{n += $1} END {print n + 0}')
warnings=$(grep -c 'WARNING: ThreadSanitizer' "$log" || true)
echo "TSan summary: ${passed:-0} tests passed, $failed failed, $warnings ThreadSanitizer warnings ($runs binaries, exit $rc)"
exit "$rc"
