// Shared pieces of the launcher's subcommands: the model (pretrained or preset), the RoundPipe
// options, the data sources and the evaluation loop, all built from a LauncherConfig.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "comm/process_group.h"
#include "roundpipe/launcher/chat_data.h"
#include "roundpipe/launcher/config.h"
#include "roundpipe/launcher/token_data.h"
#include "roundpipe/models/lora.h"
#include "roundpipe/models/pretrained.h"
#include "roundpipe/round_pipe.h"

namespace roundpipe::launcher {

/// Checks the data against the model (vocabulary). Throws ConfigError naming the key.
void check_supported(const LauncherConfig& config, const models::ModelConfig& model_config);

/// The HF model configuration (model.pretrained's config.json with model.config laid over it,
/// or the preset with model.config). Throws ConfigError naming model.config when it is invalid.
models::ModelConfig resolve_model_config(const LauncherConfig& config);

/// The launcher's model: the Sequential, its HF configuration and, with model.lora, the LoRA
/// options applied (those of model.lora.adapter when it is set).
struct LauncherModel {
  torch::nn::Sequential model;
  models::ModelConfig config;
  std::optional<models::LoraOptions> lora;
};

/// The LoRA options of model.lora (targets `all-linear` expanded to the seven projections), or
/// nullopt without model.lora.
std::optional<models::LoraOptions> lora_options(const LauncherConfig& config);

/// The model in model.dtype: model.pretrained's weights, or a fresh HF-style random init seeded
/// with train.seed. With model.lora: LoRA adapters on the frozen base (Note [LoRA in the
/// launcher]): model.lora.adapter's weights and options, else PEFT's init seeded with train.seed.
LauncherModel make_launcher_model(const LauncherConfig& config);

/// Refuses model.lora.targets that the model cannot adapt as PEFT would (`all-linear` on a
/// mixture of experts: docs/models.md). Throws ConfigError naming the key.
void check_lora_targets(const LauncherConfig& config, const models::ModelConfig& model_config);

/// Parameter counts of a model (shared tensors once): those that train (requires_grad) and all.
struct ParameterCounts {
  int64_t trainable = 0;
  int64_t total = 0;
};
ParameterCounts count_parameters(const torch::nn::Module& model);

/// "trainable parameters: 2,048 of 1,050,624 (0.1949%)" (PEFT's print_trainable_parameters).
std::string describe_parameter_counts(const ParameterCounts& counts);

/// The directory recorded as a LoRA adapter's base_model_name_or_path: model.pretrained made
/// absolute (so `roundpipe export --merge` and PEFT's AutoPeftModel find it from anywhere).
std::string lora_base_model_path(const LauncherConfig& config);

/// RoundPipe options of the config: devices (run.devices, else default_devices(); under a
/// multi-rank launch on one node, the GPUs are dealt out to the local ranks), master dtype (or
/// in-place masters), microbatches, recompute, seed = train.seed, and a size-based
/// (deterministic) plan; see Note [Deterministic plans]. RunConfig::preserve_rng_state is
/// `model_draws` (models::draws_in_training of the model): a model without dropout has no masks
/// to replay, and on CPU devices the seeding's lock would serialize the workers' forwards.
RoundPipeOptions round_pipe_options(const LauncherConfig& config, bool model_draws = true);
/// Whether the config's masters are its compute copies (RoundPipeOptions::in_place_masters):
/// model.master_dtype == model.dtype with run.step_mode sync.
bool in_place_masters(const LauncherConfig& config);
/// The 16-bit dtype whose gradients the optimizer reads as they are (RoundPipeOptions::
/// master_grad_dtype), if any: model.dtype when it is float16/bfloat16 with float32 masters that
/// are not the compute copies, optimizer adam/adamw (roundpipe::optim::Adam widens them in its
/// fused pass; clipping goes through optim::clip_grad_norm) and amp.scaler off (GradScaler
/// unscales gradients in their own dtype). Saves the float32 gradient buffers (4 B/param) and a
/// cast pass per step; bitwise the same training (Note [Gradients in the compute dtype]).
std::optional<c10::ScalarType> master_grad_dtype(const LauncherConfig& config);

/// The data-parallel group of a job started by `roundpipe launch` or torchrun (RANK and
/// WORLD_SIZE set, WORLD_SIZE > 1), with the config's distributed.backend and timeout; null for a
/// single process (docs/distributed.md).
std::shared_ptr<comm::ProcessGroup> make_process_group(const LauncherConfig& config);

/// One split of the configured data (data.train or data.valid) in data.format: a token stream, or
/// chat conversations (tokenized when opened). Owns what its samplers and readers read: keep it
/// alive while they are used. Not synchronized (one owner).
struct LauncherData {
  std::unique_ptr<TokenSource> tokens;  ///< tokens, bytes, synthetic
  std::unique_ptr<ChatDataset> chat;    ///< chat
  int64_t seq_len = 0;

  /// "token file 'x.bin' ..." / "chat file 'x.jsonl' (N conversations, ...)".
  std::string describe() const;
  /// Training batches of `rows` rows each (TrainSampler windows / ChatSampler conversations).
  std::unique_ptr<BatchSampler> sampler(int64_t rows, uint64_t seed) const;
  /// Evaluation batches of `rows` rows, at most `max_batches` (0: all the data).
  std::unique_ptr<BatchReader> eval_batches(int64_t rows, int64_t max_batches) const;
};

/// The data of `path` in data.format (synthetic: `seed_offset` selects the stream). Chat data is
/// rendered and tokenized with model.pretrained's chat template and tokenizer; a bad line throws
/// ConfigError naming the file and line, and a tokenizer larger than the model's vocabulary
/// throws ConfigError.
LauncherData open_data(const LauncherConfig& config, const std::string& path, uint64_t seed_offset);

/// Mean token cross-entropy (the sum of every trained label's loss / their count, in float32:
/// labels of -100 do not count) and token accuracy (the share of those labels that are the argmax
/// of their logits) over data.eval_batches(train.batch_size, eval.max_batches), with
/// RoundPipe::forward(inputs, labels) in eval mode without autograd: the LmHead returns each
/// microbatch's summed loss, chunked (the logits never exist whole). Call synchronize() first when
/// steps may be queued.
struct EvalResult {
  double loss = 0.0;
  double accuracy = 0.0;  ///< token accuracy: the share of trained labels predicted (argmax)
};
EvalResult evaluate(RoundPipe& model, const LauncherConfig& config, const LauncherData& data);

}  // namespace roundpipe::launcher
