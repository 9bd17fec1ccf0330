// Training checkpoints of the launcher: out_dir/checkpoints/step-NNNNNN/ holds the master weights
// as a transformers model directory (config.json + model.safetensors, so `roundpipe export` and
// from_pretrained read them) or, for a LoRA run, the adapters as a PEFT adapter directory
// (adapter_config.json + adapter_model.safetensors; the frozen base stays in model.pretrained),
// optimizer.pt, trainer_state.pt (step, tokens, sampler, CPU RNG, GradScaler) and config.yaml (the
// resolved run configuration). See docs/launcher.md.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <optional>
#include <string>

#include "amp/grad_scaler.h"
#include "roundpipe/launcher/config.h"
#include "roundpipe/models/lora.h"
#include "roundpipe/models/model_config.h"
#include "roundpipe/round_pipe.h"

namespace roundpipe::launcher {

/// The non-tensor training state saved with each checkpoint.
struct TrainerState {
  int64_t step = 0;            ///< optimizer steps completed
  int64_t tokens = 0;          ///< tokens trained on so far
  uint64_t sampler_state = 0;  ///< TrainSampler::state()
  at::Tensor cpu_rng_state;    ///< torch's default CPU generator state
  amp::GradScalerState scaler;
  int64_t world_size = 1;      ///< data-parallel ranks of the run (resume needs the same)
  /// RoundPipe::iteration() (the layer seeds' iteration index); -1: not recorded (checkpoints
  /// written before it was).
  int64_t iteration = -1;
};

/// Everything a checkpoint writer needs. The references must outlive the call.
struct CheckpointContents {
  RoundPipe& model;
  const models::ModelConfig& model_config;
  torch::optim::Optimizer& optimizer;
  const LauncherConfig& config;
  TrainerState state;
  /// The LoRA options of a LoRA run (then only the adapters are saved); null for full training.
  const models::LoraOptions* lora = nullptr;
};

/// Writes out_dir/checkpoints/step-NNNNNN atomically (staging directory, fsync, rename; Note
/// [Atomic publish]), points `latest` at it and prunes to checkpoint.keep. Calls
/// model.synchronize() first: see Note [Checkpoints are sync points]. Returns the directory.
std::string save_checkpoint_dir(CheckpointContents contents);

/// The checkpoint directory `--resume` means: `requested` when given, else
/// <out_dir>/checkpoints/latest (resolved to its step directory). Throws c10::Error naming the
/// path when it holds no checkpoint.
std::string resolve_resume_dir(const LauncherConfig& config, const std::string& requested);

/// Loads a checkpoint into a freshly built model (before its first forward_backward): master and
/// compute weights (a tensor of another shape fails naming it; a LoRA run reads only its adapters,
/// whose rank and alpha must match `lora`), the optimizer state; returns the trainer state. A LoRA
/// checkpoint into a full run, or the reverse, fails saying which.
TrainerState load_checkpoint_dir(const std::string& dir, RoundPipe& model,
                                 const models::ModelConfig& model_config,
                                 torch::optim::Optimizer& optimizer,
                                 const models::LoraOptions* lora = nullptr);

/// True when `dir` looks like a launcher checkpoint (trainer_state.pt and config.json, or
/// adapter_config.json for LoRA, present).
bool is_checkpoint_dir(const std::string& dir);

/// True when `dir` holds a PEFT adapter (adapter_config.json): a LoRA checkpoint.
bool is_lora_checkpoint_dir(const std::string& dir);

}  // namespace roundpipe::launcher
