#!/usr/bin/env bash
# One device-tool call's worth of GPU checks (a lease is 15 minutes of device time a session,
# machine start included), on binaries built here and packed by scripts/pack-gpu-prebuilt.sh:
#   scripts/build.sh && scripts/pack-gpu-prebuilt.sh
#   device run (carry .gpu-prebuilt, timeout_s ~540): bash scripts/gpu-session.sh
# Runs, each under its own timeout, in order of value: every *_CUDA test; compute-sanitizer
# memcheck and racecheck on a small engine case; llama_bench at 0.95B (batch 8 and 32) and 3.5B
# (batch 16) against the plain loop. Logs go to /tmp/gpu-session and, tarred after every step, to
# $OUT/gpu-session.tgz (the device tool returns at most 8 files); a summary goes to stdout.
# Figures and what they mean: docs/benchmarks.md, "Measured on an H200".
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
P="${ROUNDPIPE_PREBUILT:-.gpu-prebuilt}"
[ -f "$P/PREBUILT" ] || { echo "gpu-session: no $P/PREBUILT: run scripts/pack-gpu-prebuilt.sh here first and carry $P"; exit 2; }
G=/tmp/gpu-session
mkdir -p "$G"
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/gpu-session.tgz" -C /tmp gpu-session; }
python="${ROUNDPIPE_PYTHON:-python3}"
site="$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
export LD_LIBRARY_PATH="$P/deps/usr/lib/x86_64-linux-gnu:$site/torch/lib:$site/nvidia/cu13/lib:/usr/local/cuda/lib64"
start=$SECONDS
say() { echo "[gpu-session +$((SECONDS - start)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2

for t in roundpipe/runtime_tests amp/amp_tests reliability/reliability_tests errors/errors_tests comm/comm_tests models/models_tests; do
  log="$G/$(basename "$t").log"
  timeout 150 "$P/tests/$t" --gtest_filter='*_CUDA' > "$log" 2>&1
  say "$t *_CUDA: exit $?, $(grep -cE '^\[       OK \]' "$log") ok; $(grep -E '^\[  (FAILED|SKIPPED) +\] [A-Za-z]' "$log" | sort -u | tr '\n' ' ')"
done
pack
sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
for tool in memcheck racecheck; do
  timeout 120 "$sanitizer" --tool "$tool" --error-exitcode 9 "$P/tests/roundpipe/runtime_tests" \
    --gtest_filter='RoundPipeTest.Equivalence_MlpOnGpus_CUDA:CudaEngineTest.Equivalence*' > "$G/$tool.log" 2>&1
  say "compute-sanitizer $tool: exit $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$G/$tool.log" | tail -1))"
done
pack

bench() {  # name timeout args...
  local name="$1" limit="$2"
  shift 2
  LLAMA_BENCH_TIMELINE=1 timeout "$limit" "$P/bench/llama_bench" "$@" > "$G/$name.txt" 2>&1
  say "llama_bench $name: exit $?"
  grep -E '^(llama_bench|pinned|host memory|roundpipe|plain|  fused)' "$G/$name.txt" | grep -v '^\[20'
  pack
}
small="--hidden 2048 --layers 16 --heads 16 --ffn 5632 --seq 2048"
bench 1b_b8 70 $small --batch 8 --micro 4 --iters 6
bench 1b_b32 90 $small --batch 32 --micro 8 --plain-micro 4 --iters 4
bench 3b5_b16 160 --hidden 4096 --layers 16 --heads 32 --ffn 11008 --seq 2048 --batch 16 --micro 8 --plain-micro 4 --iters 3
say "done"
