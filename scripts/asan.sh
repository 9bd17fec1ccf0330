#!/usr/bin/env bash
# Builds the CPU test suite with AddressSanitizer + UndefinedBehaviorSanitizer (clang) into
# build-asan/ and runs it with CTest; prints one summary line ("ASan+UBSan: ..."). Extra arguments
# go to ctest (e.g. -R launcher). The same build dir holds the libFuzzer targets (scripts/fuzz.sh):
# every library is compiled once, with -fsanitize=address,undefined,fuzzer-no-link.
# Not run here (docs/sanitizers.md): module_graph(_self_test), style_* and launcher_prepare_data (Python
# only, no RoundPipe code) and install_consumer (a packaging check that rebuilds a consumer project).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export ROUNDPIPE_BUILD_DIR="${ROUNDPIPE_ASAN_BUILD_DIR:-$root/build-asan}"
# Every target (no list that could drift from what CTest registers: a test binary missing from a
# hand-written list showed up as "Not Run" failures); benchmarks and examples are off below.
unset ROUNDPIPE_BUILD_TARGETS
# clang: the libFuzzer targets share these objects (gcc has no libFuzzer). Read at first configure.
export CXX="${ROUNDPIPE_ASAN_CXX:-clang++}" CC="${ROUNDPIPE_ASAN_CC:-clang}"
start=$(date +%s)
"$root/scripts/build.sh" -DROUNDPIPE_SANITIZE=address,undefined -DROUNDPIPE_FUZZ=ON \
  -DROUNDPIPE_BUILD_BENCHMARKS=OFF -DROUNDPIPE_BUILD_EXAMPLES=OFF
built=$(date +%s)

# detect_leaks=0: LibTorch (not instrumented) keeps process-lifetime allocations (operator and
#   dispatcher registries, thread pools) that LeakSanitizer reports at exit from frames we cannot
#   fix; RoundPipe's own ownership is RAII and use-after-free / overflows are still caught.
# abort_on_error=0, halt_on_error=1: the first report ends the test process with a failure.
# UBSan: every report is an error (halt_on_error) with its stack.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # LibTorch's kernels are not what is under test
cd "$ROUNDPIPE_BUILD_DIR"
log="$ROUNDPIPE_BUILD_DIR/asan-ctest.log"
set +e
ctest --output-on-failure -j "${ROUNDPIPE_JOBS:-$(nproc)}" \
  -E '^(module_graph|module_graph_self_test|style_format|style_naming|style_self_test|install_consumer|launcher_prepare_data)$' "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
reports=$(grep -c -E '^(==[0-9]+==ERROR: AddressSanitizer|.*runtime error: )' "$log" || true)
result=$(grep -E 'tests passed, [0-9]+ tests failed out of [0-9]+' "$log" | tail -1)
echo "ASan+UBSan summary: ${result:-no CTest result} (sanitizer reports: $reports; build $((built - start)) s, tests $(( $(date +%s) - built )) s)"
exit "$rc"
