// The launcher's run configuration: a typed LauncherConfig loaded from a YAML file plus dotted
// `key=value` command-line overrides, validated as a whole at load (every error names the key path
// and the value). The schema (keys, types, defaults, checks, docs) lives in one table in
// config_schema.cpp; docs/config-reference.md is generated from it.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/logging.h"
#include "roundpipe/launcher/lr_schedule.h"
#include "roundpipe/models/architecture.h"
#include "roundpipe/models/chat_tokens.h"
#include "roundpipe/run_config.h"

namespace roundpipe::launcher {

/// A configuration error: the message names the key path (e.g. "optimizer.lr") and the value, and
/// says how to fix it. The executable prints it and exits with code 2.
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class DataFormat { kTokens, kBytes, kSynthetic, kChat };
enum class OptimizerName { kAdamW, kAdam, kSgd, kLion, kAdafactor };
/// distributed.backend: kAuto is NCCL with CUDA devices, Gloo otherwise.
enum class DistributedBackend { kAuto, kGloo, kNccl };
/// How Adam(W) stores its moments: float32, or block-wise 8-bit (optim::AdamStateDtype::kInt8).
enum class OptimizerStateDtype { kFloat32, kInt8 };

// The sections of LauncherConfig, one per top-level YAML key. Scalar fields are value-initialised
// ({}: zero, false, the enum's first value) so that a section made on its own holds no
// indeterminate value; the defaults a user gets live only in the schema table (LauncherConfig()).

/// model.lora: present (non-null) enables LoRA fine-tuning of model.pretrained.
/// PEFT's names: rank = r, alpha = lora_alpha, dropout = lora_dropout, targets = target_modules,
/// target_parameters = target_parameters.
struct LoraSection {
  int64_t rank{};
  double alpha{};
  double dropout{};
  std::vector<std::string> targets;  ///< module names, e.g. q_proj, v_proj; or all-linear
  /// PEFT's target_parameters: MoE expert weights (gate_up_proj, down_proj); empty = none
  std::vector<std::string> target_parameters;
  std::string adapter;  ///< PEFT adapter directory to start from; "" = fresh adapters
};

struct ModelSection {
  std::string pretrained;                      ///< directory with config.json + weights; "" = none
  std::optional<models::Architecture> preset;  ///< nullopt: none (model.pretrained instead)
  std::string config_json;                     ///< model.config as a JSON object text ("{}" when unset)
  c10::ScalarType dtype{};                     ///< compute dtype: Float | BFloat16 | Half
  c10::ScalarType master_dtype{};              ///< optimizer master weights: Float
  std::optional<LoraSection> lora;
};

struct DataSection {
  std::string train;  ///< token/byte/chat file; unused (may be "") for synthetic
  std::string valid;  ///< "" = no evaluation data
  DataFormat format{};
  int64_t seq_len{};
  std::optional<int64_t> vocab_size;  ///< synthetic only
  models::ChatTrainOn train_on{};     ///< chat only: which tokens the loss trains on
  bool packing{};                     ///< chat only: whole conversations packed into rows (chat_data.h)
};

struct OptimizerSection {
  OptimizerName name{};
  double lr{};
  std::array<double, 2> betas;
  double eps{};
  double weight_decay{};
  double momentum{};                  ///< sgd only
  OptimizerStateDtype state_dtype{};  ///< adam / adamw only
  bool kahan_sum{};                   ///< adam / adamw with model.master_dtype bfloat16 only
};

struct ScheduleSection {
  int64_t warmup_steps{};
  LrDecay decay{};
  double min_lr{};
};

struct TrainSection {
  int64_t steps{};
  int64_t batch_size{};
  int64_t grad_accum{};
  double clip_grad_norm{};  ///< 0 = no clipping
  uint64_t seed{};
};

struct RunSection {
  /// nullopt = "auto" (all GPUs, else one CPU worker); else one worker per entry (CPU may repeat).
  std::optional<std::vector<c10::Device>> devices;
  std::optional<int64_t> num_microbatch;  ///< nullopt = RoundPipe's default
  RecomputeGrain recompute{};
  StepMode step_mode{};
  int64_t loss_chunk_mib{};  ///< LmHead's loss chunk (models::LinearCrossEntropyOptions::chunk_bytes)
  /// Device memory the memory model plans for (GiB); nullopt = the smallest CUDA device's memory,
  /// or none on CPU devices (plan reports, train does not check).
  std::optional<double> device_memory_gib;
};

struct AmpSection {
  bool scaler{};
  double init_scale{};
  int64_t growth_interval{};
};

struct CheckpointSection {
  int64_t every{};  ///< steps between checkpoints; 0 = only at the end
  int64_t keep{};
};

struct EvalSection {
  int64_t every{};        ///< steps between evaluations; 0 = never (but at the end with data.valid)
  int64_t max_batches{};  ///< 0 = the whole validation set
  bool at_start{};        ///< also before the first step (not on resume)
};

struct DistributedSection {
  DistributedBackend backend{};
  double timeout_s{};
};

struct LogSection {
  int64_t every{};
  LogLevel level{};  ///< of the launcher and RoundPipe (base/logging.h)
};

/// The whole configuration. Default-constructed, every field holds the schema's default (the
/// defaults live only in the schema table). Plain data: copy freely; not synchronized.
struct LauncherConfig {
  LauncherConfig();

  std::string out_dir;
  ModelSection model;
  DataSection data;
  OptimizerSection optimizer;
  ScheduleSection schedule;
  TrainSection train;
  RunSection run;
  AmpSection amp;
  CheckpointSection checkpoint;
  EvalSection eval;
  DistributedSection distributed;
  LogSection log;
};

/// Loads `path` (YAML), applies `overrides` ("optimizer.lr=1e-3", "optimizer.betas=[0.9,0.99]",
/// "model.config.hidden_size=256"; each value is parsed as YAML, later overrides win) and
/// validates the result. Relative paths in the file are kept as written (relative to the working
/// directory). Throws ConfigError naming "<file>:<line>:<column>" where known, the key path and the
/// value.
LauncherConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});

/// load_config from YAML text; `source` names it in messages. An empty text is an empty map (all
/// defaults; then validation asks for the required keys).
LauncherConfig parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides = {},
                            const std::string& source = "<config>");

/// The resolved configuration as YAML: every key, in schema order, with its value. Loading the
/// output gives an equal configuration.
std::string to_yaml(const LauncherConfig& config);

/// The schema as Markdown (docs/config-reference.md is this output, committed).
std::string config_reference_markdown();

/// The model's HF config as JSON text: `<pretrained>/config.json` (when pretrained is set) with the
/// keys of model.config laid over it, else model.config. Throws ConfigError when config.json
/// cannot be read or parsed.
std::string resolved_model_config_json(const LauncherConfig& config);

/// The vocabulary of the configured data: 256 for bytes, data.vocab_size or the model's
/// vocab_size for synthetic, nullopt for token files (not recorded in the file).
std::optional<int64_t> data_vocab_size(const LauncherConfig& config);

/// Lower-case names used in the YAML ("tokens", "adamw", "stage", "async", "float32", ...).
const char* data_format_name(DataFormat format);
const char* train_on_name(models::ChatTrainOn train_on);
const char* optimizer_name(OptimizerName name);
const char* state_dtype_name(OptimizerStateDtype dtype);
const char* recompute_name(RecomputeGrain grain);
const char* step_mode_name(StepMode mode);
// dtypes: models::dtype_name (the YAML's dtype names are Hugging Face's).

}  // namespace roundpipe::launcher
