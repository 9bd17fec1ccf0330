#!/usr/bin/env bash
# Peak host RSS per parameter of `roundpipe train` against the memory model's prediction
# (docs/benchmarks.md, "Memory model"): a random 125M-parameter Llama preset on CPU devices,
# 3 steps, final checkpoint written; peak RSS (GNU time's %M) minus the same command on a tiny
# model, divided by the parameters. Each row also prints `roundpipe plan`'s predicted B/param.
#   bench/host_peak.sh [path/to/roundpipe]     (default build/roundpipe/launcher/roundpipe)
set -euo pipefail
cli="${1:-build/roundpipe/launcher/roundpipe}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
model='{vocab_size: 32000, hidden_size: 768, intermediate_size: 2048, num_hidden_layers: 12, num_attention_heads: 12, num_key_value_heads: 4, max_position_embeddings: 256}'
tiny='{vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 256}'
cat > "$work/run.yaml" <<YAML
out_dir: $work/run
model: {preset: llama, dtype: float32}
data: {format: synthetic, seq_len: 32}
optimizer: {name: adamw, lr: 1.0e-4}
train: {steps: 3, batch_size: 2, seed: 1}
run: {devices: 1, num_microbatch: 2, step_mode: sync}
eval: {every: 0, max_batches: 1}
YAML
peak_kib() {  # peak RSS of `roundpipe train` with the given overrides, in KiB
  rm -rf "$work/run"
  /usr/bin/time -f %M -o "$work/rss" "$cli" train "$work/run.yaml" "$@" > /dev/null 2> "$work/err" || { cat "$work/err"; exit 1; }
  cat "$work/rss"
}
r0=$(peak_kib "model.config=$tiny")
params=$("$cli" plan "$work/run.yaml" "model.config=$model" | sed -n 's/.* x \([0-9]*\) parameters.*/\1/p' | head -1)
echo "R0 = $r0 KiB, $params parameters"
while read -r name overrides; do
  # shellcheck disable=SC2086  # the overrides are words
  predicted=$("$cli" plan "$work/run.yaml" "model.config=$model" $overrides | sed -n 's/^estimated host memory: .* = \([0-9.]*\) B\/param.*/\1/p')
  # shellcheck disable=SC2086
  peak=$(peak_kib "model.config=$model" $overrides)
  awk -v n="$name" -v p="$predicted" -v k="$peak" -v r="$r0" -v N="$params" \
    'BEGIN { m = (k - r) * 1024 / N; printf "%-32s predicted %5.1f  measured %5.1f B/param  ratio %.2f\n", n, p, m, p / m }'
done <<'ROWS'
fp32-sync
fp32-async run.step_mode=async
bf16-async model.dtype=bfloat16 run.step_mode=async
fp32-int8-sync optimizer.state_dtype=int8
fp32-sync-2-devices run.devices=2 run.num_microbatch=3
ROWS
