#!/usr/bin/env bash
# Validates RoundPipe C++ on a GPU machine and measures it (issue 6), in phases:
#   build     offline build against the machine's CUDA PyTorch (scripts/build-offline.sh, .debs/
#             made beforehand by scripts/pack-offline-deps.sh on a machine with network);
#   test      every test, the *_CUDA ones included (they run when a GPU is visible);
#   sanitize  compute-sanitizer memcheck and racecheck on a small CUDA engine case (if present);
#   bench     bench/llama_bench: RoundPipe vs the plain loop on a ~1B model (tokens/s, MFU, peak
#             memory, upload GB/s vs pinned copy, upload/compute overlap, per-job timeline);
#   scale-model  under a 24 GiB cap per GPU: the largest model (blocks of --hidden 4096) that
#                trains without running out of memory;
#   scale-seq    the same cap: the longest sequence for a ~1.7B model (`scale` = both).
# Usage: scripts/gpu-validate.sh [python=/opt/torch/.venv/bin/python] [phase ...] (default: all,
# in that order). Results are appended to $OUT (the device tool's folder) or gpu-results/.
# With the device tool (at most 600 s a call, build outputs kept while the machine stays warm):
# scripts/pack-offline-deps.sh here, then one call per phase or two, carrying .debs, e.g.
#   scripts/gpu-validate.sh /opt/torch/.venv/bin/python build test
#   scripts/gpu-validate.sh /opt/torch/.venv/bin/python sanitize bench
#   scripts/gpu-validate.sh /opt/torch/.venv/bin/python scale-model
#   scripts/gpu-validate.sh /opt/torch/.venv/bin/python scale-seq
# A phase after `build` that finds no build runs the build first.
# Prebuilt: `scripts/pack-gpu-prebuilt.sh` here packs the binaries built here (same torch
# 2.11.0+cu130 as the GPU image) into .gpu-prebuilt/ (~14 MiB); carried, with
# ROUNDPIPE_BUILD_DIR=.gpu-prebuilt, no phase builds and the lease is spent on running.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${1:-/opt/torch/.venv/bin/python}"
shift || true
phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(build test sanitize bench scale)
for i in "${!phases[@]}"; do [ "${phases[$i]}" = scale ] && phases[$i]=scale-model && phases+=(scale-seq); done
out="${OUT:-$root/gpu-results}"
build="${ROUNDPIPE_BUILD_DIR:-$root/build-offline}"
mkdir -p "$out"
log() { printf '[gpu-validate] %s\n' "$*" | tee -a "$out/summary.txt"; }
for phase in "${phases[@]}"; do
  case "$phase" in
    build | test | sanitize | bench | scale-model | scale-seq) ;;
    *) log "unknown phase '$phase' (use build, test, sanitize, bench, scale-model, scale-seq, scale)"; exit 2 ;;
  esac
done
wants() { local p; for p in "${phases[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
prebuilt=0
[ -f "$build/PREBUILT" ] && prebuilt=1
if [ $prebuilt = 0 ] && { wants build || [ ! -x "$build/bench/llama_bench" ]; }; then
  start=$SECONDS
  ROUNDPIPE_BUILD_DIR="$build" "$root/scripts/build-offline.sh" "$root/.debs" "$python" > "$out/build.log" 2>&1 ||
    { log "build failed (see build.log)"; tail -30 "$out/build.log"; exit 1; }
  log "build: $((SECONDS - start)) s"
fi
export LD_LIBRARY_PATH="$build/deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ $prebuilt = 1 ]; then  # linked here against another path of the same torch: find this one's
  torch_lib="$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
  site="$(dirname "$(dirname "$torch_lib")")"
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$torch_lib:$site/nvidia/cu13/lib:/usr/local/cuda/lib64"
  log "prebuilt binaries from $build; torch libraries from $torch_lib"
fi

if wants test; then
  [ -n "${ROUNDPIPE_BUILD_TARGETS:-}" ] || [ $prebuilt = 1 ] || ctest --test-dir "$build" --output-on-failure -j 4 > "$out/ctest.log" 2>&1
  [ $prebuilt = 1 ] || log "ctest: $(grep -E 'tests passed|tests failed' "$out/ctest.log" | tail -1)"
  : > "$out/cuda_tests.log"
  for t in roundpipe/runtime_tests amp/amp_tests reliability/reliability_tests errors/errors_tests comm/comm_tests models/models_tests models/moe_tests; do
    [ -x "$build/tests/$t" ] || continue
    timeout 300 "$build/tests/$t" --gtest_filter='*_CUDA' >> "$out/cuda_tests.log" 2>&1
    log "$t *_CUDA: exit $?"
  done
  log "CUDA tests: $(grep -cE '^\[       OK \]' "$out/cuda_tests.log") passed, $(grep -cE '^\[  FAILED  \].*\(' "$out/cuda_tests.log") failed"
fi

if wants sanitize; then
  sanitizer="$(command -v compute-sanitizer || true)"
  [ -n "$sanitizer" ] || [ ! -x /usr/local/cuda/bin/compute-sanitizer ] || sanitizer=/usr/local/cuda/bin/compute-sanitizer
  wheel="$(ls "$root"/.debs/nvidia_cuda_sanitizer_api-*.whl 2>/dev/null | head -1)"
  if [ -z "$sanitizer" ] && [ -n "$wheel" ]; then  # packed by pack-offline-deps.sh
    rm -rf "$build/deps/sanitizer"
    "$python" -m zipfile -e "$wheel" "$build/deps/sanitizer"
    sanitizer="$(find "$build/deps/sanitizer" -type f -name compute-sanitizer | head -1)"
    chmod +x "$sanitizer"
  fi
  if [ -n "$sanitizer" ]; then
    for tool in memcheck racecheck; do
      timeout "${ROUNDPIPE_SANITIZER_TIMEOUT:-300}" "$sanitizer" --tool "$tool" --error-exitcode 9 "$build/tests/roundpipe/runtime_tests" \
        --gtest_filter='RoundPipeTest.Equivalence_MlpOnGpus_CUDA:CudaEngineTest.AsyncStress*' > "$out/sanitizer-$tool.log" 2>&1
      log "compute-sanitizer $tool: exit $? ($(grep -E 'ERROR SUMMARY' "$out/sanitizer-$tool.log" | tail -1))"
    done
  else
    log "compute-sanitizer not found: skipped"
  fi
fi

bench="$build/bench/llama_bench"
if wants bench; then
  LLAMA_BENCH_TIMELINE=1 "$bench" --hidden 2048 --layers 16 --heads 16 --ffn 5632 --seq 2048 --batch 8 --micro 4 \
    > "$out/llama_1b.txt" 2>&1
  log "llama ~1B: $(grep -E '^(roundpipe|plain) |pinned|/ plain' "$out/llama_1b.txt" | tr '\n' ';')"
fi

if wants scale-model; then
  # Largest model under a 24 GiB cap: hidden 4096 blocks (~200M parameters each), growing.
  # Host memory bounds it too: ~16 B/param (bf16 copy + bf16 grad handed to the optimizer uncast,
  # fp32 master, Adam m and v), so the 128 GiB GPU host trains up to ~7B parameters.
  for layers in 8 16 24 28 32; do
    if "$bench" --mode roundpipe --mem-cap-gib 24 --hidden 4096 --heads 32 --ffn 11008 --layers "$layers" \
      --seq 2048 --batch 4 --micro 4 --iters 2 > "$out/scale_layers_$layers.txt" 2>&1; then
      log "24 GiB cap, hidden 4096 x $layers blocks: trains ($(grep -E '^llama_bench:' "$out/scale_layers_$layers.txt" | head -1 | cut -d' ' -f2) params; $(grep -E '^host memory' "$out/scale_layers_$layers.txt"))"
    else
      log "24 GiB cap, hidden 4096 x $layers blocks: failed ($(tail -1 "$out/scale_layers_$layers.txt"))"
      break
    fi
  done
fi
if wants scale-seq; then
  # Longest sequence for a ~1.7B model (hidden 2048, 30 blocks + embeddings) under the cap.
  for seq in 8192 16384 32768 65536 131072; do
    if "$bench" --mode roundpipe --mem-cap-gib 24 --hidden 2048 --heads 16 --ffn 5632 --layers 30 \
      --seq "$seq" --batch 1 --micro 1 --iters 2 > "$out/scale_seq_$seq.txt" 2>&1; then
      log "24 GiB cap, ~1.7B model, seq $seq: trains ($(grep -E '^roundpipe ' "$out/scale_seq_$seq.txt"))"
    else
      log "24 GiB cap, ~1.7B model, seq $seq: failed ($(tail -1 "$out/scale_seq_$seq.txt"))"
      break
    fi
  done
fi
log "done; logs in $out"
