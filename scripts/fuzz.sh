#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang, ASan + UBSan) into build-asan/ and runs each for
# [seconds] (default 60) from its seed corpus in fuzz/corpus/<target>/; prints one summary line per
# target ("fuzz <target>: ... execs, cov ..., crashes ...") and exits 1 if any target crashed.
# Inputs found are kept in build-asan/fuzz/corpus/<target>/ (the repo's corpus stays as committed);
# a crashing input lands in build-asan/fuzz/artifacts/ (docs/sanitizers.md: turn it into a
# regression test in the module's test binary, then fix the bug). Extra arguments go to libFuzzer.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-60}"
[ $# -gt 0 ] && shift
targets=(fuzz_safetensors fuzz_token_file fuzz_config fuzz_split_batch fuzz_tokenizer fuzz_chat_template)
export ROUNDPIPE_BUILD_DIR="${ROUNDPIPE_ASAN_BUILD_DIR:-$root/build-asan}"
export ROUNDPIPE_BUILD_TARGETS="${targets[*]}"
export CXX="${ROUNDPIPE_ASAN_CXX:-clang++}" CC="${ROUNDPIPE_ASAN_CC:-clang}"
"$root/scripts/build.sh" -DROUNDPIPE_SANITIZE=address,undefined -DROUNDPIPE_FUZZ=ON \
  -DROUNDPIPE_BUILD_BENCHMARKS=OFF -DROUNDPIPE_BUILD_EXAMPLES=OFF

# detect_leaks=0: see scripts/asan.sh (LibTorch's process-lifetime allocations on first use would
#   be reported as leaks of the input that happened to trigger them).
# UBSan: halt on the first report so that libFuzzer saves the input as a crash.
export ASAN_OPTIONS="detect_leaks=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export OMP_NUM_THREADS=1
out="$ROUNDPIPE_BUILD_DIR/fuzz"
mkdir -p "$out/artifacts"
failed=0
summaries=()
crash_inputs=()
for t in "${targets[@]}"; do
  mkdir -p "$out/corpus/$t"
  dict=()
  case "$t" in
    fuzz_safetensors) dict=(-dict="$root/fuzz/safetensors.dict") ;;
    fuzz_config) dict=(-dict="$root/fuzz/config.dict") ;;
    fuzz_chat_template) dict=(-dict="$root/fuzz/chat_template.dict") ;;
  esac
  log="$out/$t.log"
  set +e
  # -rss_limit_mb: LibTorch + ASan shadow memory start near 1 GiB; -timeout: one input, seconds.
  "$ROUNDPIPE_BUILD_DIR/fuzz/$t" "$out/corpus/$t" "$root/fuzz/corpus/$t" "${dict[@]}" \
    -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -max_len=4096 -print_final_stats=1 \
    -artifact_prefix="$out/artifacts/$t-" "$@" > "$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' "$log" | tail -1)
  crashes=$(grep -c 'Test unit written to' "$log" || true)  # crash, timeout or out-of-memory
  line="fuzz $t: ${seconds} s, ${execs:-?} execs, ${cov:-no coverage line}, crashes $crashes, exit $rc"
  if [ "$rc" -ne 0 ]; then
    failed=1
    tail -60 "$log"
    line="$line (FAILED: see $log)"
    # The input itself, printed last: CI's temporary build directory (and the artifact) is gone
    # by the time anyone reads the log. Replay: echo TEXT | base64 -d > crash; fuzz/<target> crash
    for a in "$out/artifacts/$t-"*; do
      if [ -f "$a" ]; then crash_inputs+=("$t $(basename "$a") base64: $(head -c 8192 "$a" | base64 -w0)"); fi
    done
  fi
  echo "$line"
  summaries+=("$line")
done
echo "fuzz summary:"
printf '  %s\n' "${summaries[@]}"
if [ "${#crash_inputs[@]}" -gt 0 ]; then printf 'crashing input: %s\n' "${crash_inputs[@]}"; fi
exit "$failed"
